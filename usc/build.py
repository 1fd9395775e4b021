"""The build logic behind the public face: the plan resolved (``auto`` planned), the model wrapped with
its loss, traced for one microbatch, parallelized, and the report; what ``usc.compile``/``usc.simulate``
(usc/api.py) and ``usc-lint`` (usc/linting.py) share. It runs nothing."""

from __future__ import annotations

import functools
import inspect
import os
import time
import weakref
from collections.abc import Mapping
from typing import Callable, Iterable

import torch
from torch import nn

from usc.compiler.report import Report, build_report
from usc.compiler.trace import lifted_constants, trace
from usc.dsl import Plan, check_rules_match, parse_plan
from usc.passes import parallelize
from usc.passes.pipeline_schedule import build_schedule, refuse_unimplemented
from usc.passes.pipeline_schedule_check import check_schedule
from usc.runtime.executor import PipelineExecutor, RankExecutor, estimate_activation_bytes
from usc.runtime.materialize import InitFn, MetaState, has_meta_tensors
from usc.runtime.training import bucket_groups
from usc.planning import estimate_plan, moe_blocks

from .handover import frozen_names, refuse_if_behind, watch
from .model_call import BatchError, BatchLayout, trainable, with_checkpointed_layers


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], "torch.optim.lr_scheduler.LRScheduler"]


def _samples(batch: tuple) -> int | None:
    return next((v.shape[0] for v in batch if isinstance(v, torch.Tensor) and v.dim() > 0), None)


def _source_of(fn) -> str:
    """'file:line' where a loss function is defined (torch's own functions give '')."""
    try:
        path = inspect.getsourcefile(fn)
        line = inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return ""
    return f"{os.path.basename(path)}:{line}" if path and "torch" not in path.split(os.sep) else ""


def _as_plan(plan: str | Plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, os.PathLike) or (isinstance(plan, str) and plan.endswith(".usc") and os.path.exists(plan)):
        from usc.dsl import load_plan
        return load_plan(plan)
    return parse_plan(plan)


def as_batch(example_inputs) -> tuple:
    """The flat tuple of a batch as the user holds it (tuple, mapping or one tensor; usc/model_call.py)."""
    return BatchLayout.of(example_inputs).flatten(example_inputs)


def user_batch(args: tuple):
    """``step(tokens, labels)``, ``step((tokens, labels))``, ``step(batch_dict)``: the batch itself."""
    return args[0] if len(args) == 1 and isinstance(args[0], (Mapping, tuple, list)) else args


def _full_state(model: nn.Module, traced) -> dict[str, torch.Tensor]:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    # the trace's constants are the model's own tensors, but a trace reused for an equal model (the
    # tests' trace memo) holds the first model's: the model's own buffer of that name is the one
    state.update((name, value) for name, value in traced.constants.items() if name not in state)
    return state


def stamped_activation_bytes(stamped: tuple, plan: Plan, options: dict) -> int:
    """Activations of N identical layers from the 2- and 3-layer programs: the bytes a layer saves for
    backward do not depend on its index, so a(N) = a(2) + (N - 2) * (a(3) - a(2))."""
    two, three, layers = stamped
    a2, a3 = (estimate_activation_bytes(parallelize(t, plan), **options) for t in (two, three))
    return a2 + (layers - 2) * (a3 - a2)


class _Compiled:
    """What compile and simulate share: the plan, the traced program and its report."""

    def __init__(self, model: nn.Module, plan: str | Plan, *, example_inputs=None, loss_fn=None,
                 optimizer: OptimizerFactory | None = None, hardware=None, traced=None,
                 lr_scheduler: SchedulerFactory | None = None, init: InitFn | str | os.PathLike | None = None,
                 init_seed: int | None = None) -> None:
        if type(self) is not _Compiled:  # a program that trains starts from the model's values (lint's reads none)
            refuse_if_behind(model, "was compiled again")
        self._init, self._init_seed = _checked_init(model, init, init_seed)
        self.plan = with_checkpointed_layers(_as_plan(plan), model)
        self.training = model.training  # torch's default: a module starts in training mode
        self._mode_source = weakref.ref(model)  # its train()/eval() later sets the mode (usc/api.py)
        self._frozen = frozen_names(model)  # what it trains: a step refuses a model frozen otherwise since
        self._scheduler_factory = lr_scheduler
        self.metrics = None  # the last step's StepMetrics (usc/api.py)
        self.model = trainable(model, loss_fn)
        if example_inputs is not None:
            example_inputs = self.model.flatten(example_inputs)
        if self.plan.auto:
            self.plan = _resolve_auto(self.model, self.plan, example_inputs, hardware)
        self._loss_source = _source_of(loss_fn) if loss_fn is not None else ""
        self._loss_fn = loss_fn  # what a step checks for names set since the trace (usc/handover.py)
        self._user_model = model
        self._hardware = hardware  # what auto plans for and StepMetrics.mfu is measured against
        self._optimizer = optimizer
        self._program = None
        self._report: Report | None = None
        if example_inputs is not None:
            self._build(example_inputs, traced=traced)

    def trace(self, batch: tuple, *, stamp: bool = False):
        """The traced model for one global microbatch of ``batch`` (plans with the same mb share it).

        stamp: trace repeated identical layers once and stamp them (compiler/stamp.py); falls back
        to the full trace when the model does not repeat linearly (and for mixture-of-experts blocks)."""
        microbatch, moe_blocks = self._microbatch(batch), self._moe_blocks()
        if stamp and not moe_blocks:
            from usc.compiler.stamp import trace_stamped

            traced = trace_stamped(self.model, microbatch, wrapper_source=self._loss_source)
        else:
            traced = trace(self.model, microbatch, wrapper_source=self._loss_source, moe_blocks=moe_blocks)
        samples = _samples(microbatch)
        if int(self.plan.get("mb")) > 1 and samples is not None:
            # the model on one sample more, traced only if the microbatch analysis asks (a loss scaled
            # by a constant that may be the batch size): two samples when a microbatch holds one
            def on(rows: int):  # the model traced on the batch's first rows, once, when asked
                rows_of = tuple(v[:rows] if isinstance(v, torch.Tensor) and v.dim() else v for v in batch)
                return functools.cache(lambda: trace(self.model, rows_of, wrapper_source=self._loss_source,
                                                     moe_blocks=moe_blocks))

            probe = on(samples + 1)
            if samples == 1:
                traced.batch_probe = probe()
            traced.resized_probe = lambda: (probe().gm, samples + 1, lifted_constants(probe()))
            traced.doubled_probe = probe if samples == 1 else on(2 * samples)
        return traced

    def _attach_cost(self, batch: tuple, hardware) -> None:
        """The cost model's time breakdown for this plan (and the planner's reasons, if it chose)."""
        report = self.report
        report.plan_search = self.plan.search
        if self.plan.search is not None and self.plan.search.best is not None:
            report.cost = self.plan.search.best.estimate  # planned with `hardware` when given
        elif hardware is not None:
            report.cost = estimate_plan(self.model, self.plan, batch, hardware)

    def _build(self, batch: tuple, *, traced=None) -> None:
        start = time.perf_counter()
        refuse_unimplemented(self.plan)  # before tracing: nothing else about the model matters
        traced = traced if traced is not None else self.trace(batch)
        check_rules_match(self.plan, list(traced.module_types))
        self._traced = traced
        self._program = parallelize(traced, self.plan)
        self._report = build_report(self._program, model=type(self._user_model).__name__, plan=str(self.plan),
                                    bucket_bytes=self.bucket_bytes, compile_seconds=time.perf_counter() - start,
                                    zero_stage=int(self.plan.get("zero")), microbatches=int(self.plan.get("mb")),
                                    recompute_mode=self.plan.get("recompute"),
                                    compute_dtype=self._executor_options()["compute_dtype"],
                                    reduce_dtype=self._executor_options()["reduce_dtype"],
                                    group_of=bucket_groups(self._optimizer, self._program.state))
        program, options = self._program, self._executor_options()
        options.pop("microbatches")
        options.pop("reduce_dtype")
        if self.plan.size("pp") == 1:  # a pipeline rank holds one stage: not estimated yet
            self._report.activation_estimate = (lambda: self._activations(traced, self.plan, options)) \
                if traced.stamped else (lambda: estimate_activation_bytes(program, **options))
            self._report.activation_estimate_by_recompute = lambda: self._activation_by_recompute(traced, options)

    @staticmethod
    def _activations(traced, plan: Plan, options: dict) -> int:
        """Activation bytes of ``plan``'s rank 0 (from the 2- and 3-layer programs when stamped)."""
        if traced.stamped:
            return stamped_activation_bytes(traced.stamped, plan, options)
        return estimate_activation_bytes(parallelize(traced, plan), **options)

    def _activation_by_recompute(self, traced, options: dict) -> dict[str, int]:
        """The activation estimate of this plan under each recompute mode (rules kept)."""
        out = {}
        for mode in ("none", "selective", "full"):
            if mode == self.plan.get("recompute"):
                out[mode] = self._report.activation_bytes
            else:
                out[mode] = self._activations(traced, self.plan.with_options(recompute=mode), options)
        return out

    def _moe_blocks(self) -> list:
        return moe_blocks(self.model, self.plan)

    def _microbatch(self, batch: tuple) -> tuple:
        """The program is compiled for one global microbatch (mb=M splits the batch's dim 0)."""
        mb = int(self.plan.get("mb"))
        if mb == 1:
            return batch
        first = next((v for v in batch if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if first is None:  # the batch, not the plan: nothing in it has a dim to split
            raise BatchError(
                f"mb={mb} splits dim 0 of the batch's tensors, but the batch holds none with a batch dim (it holds "
                f"{', '.join(type(v).__name__ for v in batch) or 'nothing'}): pass the batch's tensors, [batch, ...] "
                "each, in example_inputs and every step")
        if first.shape[0] % mb:
            raise self.plan.error_at("mb", f"mb={mb} microbatches do not divide the global batch of {first.shape[0]}",
                                     hint=f"use a batch that is a multiple of {mb}")
        return tuple(v.chunk(mb, 0)[0] if isinstance(v, torch.Tensor) and v.dim() else v for v in batch)

    def _make_executor(self, mesh, state, optimizer):
        """A plain rank, or a pipeline stage rank following the plan's schedule."""
        options = self._executor_options()
        pp = self.plan.size("pp")
        if pp == 1:
            rank = RankExecutor(self._program, mesh, state, optimizer=optimizer, **options)
        else:
            schedule = build_schedule(self.plan.get("schedule"), pp, int(self.plan.get("v")), options["microbatches"])
            check_schedule(schedule)
            rank = PipelineExecutor(self._program, mesh, state, optimizer=optimizer, schedule=schedule, **options)
        rank.input_names = self._input_names()
        return rank

    def _input_names(self) -> dict[str, str]:
        """Each program input as the user names it in errors: 'input_ids' (a mapping's key) or batch[i]."""
        layout = self.model.layout
        names = layout.input_names() if layout is not None else ()
        return {spec.placeholder: names[i] if i < len(names) else f"batch[{i}]"
                for i, spec in enumerate(self._program.inputs)}

    def _executor_options(self) -> dict:
        return {"bucket_bytes": self.bucket_bytes, "zero": int(self.plan.get("zero")),
                "microbatches": int(self.plan.get("mb")),
                "compute_dtype": torch.bfloat16 if self.plan.get("dtype") == "bf16" else None,
                "reduce_dtype": torch.bfloat16 if self.plan.get("reduce_dtype") == "bf16" else None,
                "replica_check": int(self.plan.get("replica_check"))}

    @property
    def bucket_bytes(self) -> int:
        return int(float(self.plan.get("bucket_mb")) * 2**20)

    @property
    def timeout(self) -> float:
        return float(self.plan.get("timeout"))

    @property
    def report(self) -> Report:
        if self._report is None:
            raise RuntimeError("nothing is compiled yet: pass example_inputs= to compile, or call step() once")
        return self._report

    @property
    def program(self):
        return self._program

    def flat_batch(self, args: tuple) -> tuple:
        """The program's flat inputs for a step's arguments (see ``user_batch``)."""
        return self.model.flatten(user_batch(args))

    def _ensure_built(self, batch: tuple) -> None:
        if self._program is None:
            self._build(batch)

    # ------------------------------------------------------------------ the user's model -> rank state
    @property
    def init_checkpoint(self) -> str | None:
        """The checkpoint ``init=`` names (loaded once the rank holds its state), or None."""
        return os.fspath(self._init) if isinstance(self._init, (str, os.PathLike)) else None

    def _state_source(self, device, *, empty: bool = False):
        """Full tensors by state name for the executors to cut their shares from: the model's own, or
        (a meta-built model) made real module by module on ``device`` when a rank reads them
        (runtime/materialize.py). ``empty``: no initialisation (a checkpoint load fills every tensor)."""
        if self._user_model is None:
            raise RuntimeError("the model was released once the ranks held their state; compile it again")
        state = _full_state(self.model, self._traced)
        if not has_meta_tensors(self._user_model):
            return state
        init = "empty" if empty or self.init_checkpoint else self._init
        return MetaState(self._user_model, state, device=device, seed=self._init_seed, init=init)

    def _release_model(self) -> None:
        """Forget the user's model once every rank holds its own copy of its state: the compiled
        object keeps the batch layout and the state names, not the module or its tensors."""
        if self._user_model is None:
            return
        self._state_names = tuple(self._user_model.state_dict())
        # calling or saving it once trained past raises ModelOutOfDate
        watch(self._user_model, self)
        self.model = _Released(self.model)
        self._user_model = None
        for traced in (self._traced, self._traced.batch_probe, *self._traced.stamped[:2]):
            if traced is not None:
                traced.constants = {}  # the model's own constant tensors: each rank holds its copy

    steps_taken = 0  # optimizer steps this program took
    loads_done = 0  # checkpoints it loaded after its state was made

    def _moved(self) -> None:
        """The state moved past the model handed in (a step, a checkpoint load): from here its own
        tensors refuse use of their values until it is level again (usc/handover.py)."""
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.guard()

    @property
    def state_version(self) -> int:
        """Changes whenever the program's state moves away from what it was made from (a step, a
        load): the user's model is behind it until the trained values are loaded into it."""
        return self.steps_taken + self.loads_done

    def _model_state_names(self) -> tuple[str, ...]:
        return self._state_names if self._user_model is None else tuple(self._user_model.state_dict())


class _Released:
    """What is left of the traced wrapper once the model is released: the batch layout (the first
    batch seen fixes it) and the train/eval flag."""

    def __init__(self, model) -> None:
        self.layout, self.training, self._name = model.layout, model.training, type(model).__name__

    def flatten(self, batch) -> tuple:
        if self.layout is None:
            self.layout = BatchLayout.of(batch)
        return self.layout.flatten(batch)

    def named_modules(self):
        raise RuntimeError(f"{self._name} was released once the ranks held their state; compile it again")


def _checked_init(model: nn.Module, init, seed: int | None) -> tuple:
    """(init, seed): ``init`` is for models built on the meta device; the seed defaults to torch's."""
    if init is not None and not has_meta_tensors(model):
        what = "load(path) after compile" if isinstance(init, (str, os.PathLike)) else "init the model before compile"
        raise TypeError(f"init= initialises models built on the meta device, but {type(model).__name__} holds no meta "
                        f"tensors: {what}")
    if init is not None and not callable(init) and not isinstance(init, (str, os.PathLike)):
        raise TypeError(f"init= takes a function init(module) or a checkpoint path, not {type(init).__name__}")
    return init, torch.initial_seed() if seed is None else int(seed)



def _resolve_auto(model: nn.Module, written: Plan, example_inputs, hardware=None) -> Plan:
    """``auto`` in compile/lint/simulate: the planner chooses, for the example batch as the global batch."""
    from usc.planning import choose

    if example_inputs is None:
        raise written.error_at("auto", "auto needs example_inputs= to plan for (the global batch)",
                               hint="pass example_inputs=(tokens, labels) to compile")
    batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return choose(model, written, batch, hardware=hardware)
