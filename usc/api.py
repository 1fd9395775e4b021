"""The public face: ``usc.compile``, ``usc.simulate``, ``usc.lint``. It strings the stages together
(dsl -> compiler -> passes -> runtime) and holds no logic of its own beyond that."""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from typing import Callable, Iterable

import torch
from torch import nn

from usc.compiler.errors import CompileError, TraceError
from usc.compiler.moe import MoEPatternError, find_blocks
from usc.compiler.report import Report, build_report
from usc.compiler.trace import is_meta_model, trace
from usc.dsl import Plan, PlanError, check_rules_match, parse_plan
from usc.passes import parallelize
from usc.runtime import checkpoint, checkpoint_state
from usc.runtime.checkpoint import CheckpointError
from usc.runtime.checkpoint_state import LoadResult
from usc.passes.pipeline_schedule import build_schedule
from usc.passes.pipeline_schedule_check import check_schedule
from usc.runtime.executor import PipelineExecutor, RankExecutor, estimate_activation_bytes
from usc.runtime.mesh import Mesh, run_in_threads, simulated_meshes
from usc.runtime.moe import summarize
from usc.runtime.timeline import Timeline
from usc.runtime.training import EvalMode
from usc.training import StepMetrics
from usc.planning import estimate_plan

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], "torch.optim.lr_scheduler.LRScheduler"]


class _WithLoss(nn.Module):
    """model + loss_fn as one module whose forward returns the loss; module names stay the model's.

    The batch is ``(*model_inputs, target)`` and the loss is ``loss_fn(model(*model_inputs), target)``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in model.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        self._wrapped = (model,)
        self._loss_fn = loss_fn

    def forward(self, *batch):
        *inputs, target = batch
        return self._loss_fn(self._wrapped[0](*inputs), target)


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
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def _full_state(model: nn.Module, traced) -> dict[str, torch.Tensor]:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    state.update(traced.constants)
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
                 lr_scheduler: SchedulerFactory | None = None) -> None:
        self.plan = _as_plan(plan)
        self.training = model.training  # torch's default: a module starts in training mode
        self._scheduler_factory = lr_scheduler
        self.metrics: StepMetrics | None = None  # the last step's measurements
        self.model = _WithLoss(model, loss_fn) if loss_fn is not None else model
        if self.plan.auto:
            self.plan = _resolve_auto(self.model, self.plan, example_inputs, hardware)
        self._loss_source = _source_of(loss_fn) if loss_fn is not None else ""
        self._user_model = model
        self._optimizer = optimizer
        self._program = None
        self._report: Report | None = None
        if example_inputs is not None:
            self._build(as_batch(example_inputs), traced=traced)

    def trace(self, batch: tuple, *, stamp: bool = False):
        """The traced model for one global microbatch of ``batch`` (plans with the same mb share it).

        stamp: trace repeated identical layers once and stamp them (compiler/stamp.py); falls back
        to the full trace when the model does not repeat linearly (and for mixture-of-experts blocks)."""
        microbatch, moe_blocks = self._microbatch(batch), self._moe_blocks()
        if stamp and not moe_blocks:
            from usc.compiler.stamp import trace_stamped

            return trace_stamped(self.model, microbatch, wrapper_source=self._loss_source)
        return trace(self.model, microbatch, wrapper_source=self._loss_source, moe_blocks=moe_blocks)

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
        traced = traced if traced is not None else self.trace(batch)
        check_rules_match(self.plan, list(traced.module_types))
        self._traced = traced
        self._program = parallelize(traced, self.plan)
        self._report = build_report(self._program, model=type(self._user_model).__name__, plan=str(self.plan),
                                    bucket_bytes=self.bucket_bytes, compile_seconds=time.perf_counter() - start,
                                    zero_stage=int(self.plan.get("zero")), microbatches=int(self.plan.get("mb")),
                                    recompute_mode=self.plan.get("recompute"))
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
        """The model's mixture-of-experts blocks (rules with the action ``expert`` mark more)."""
        rules = {path: rule for path, _ in self.model.named_modules() for rule in self.plan.rules
                 if rule.matches(path) and any(a.name == "expert" for a in rule.actions)}
        try:
            return find_blocks(self.model, frozenset(rules))
        except MoEPatternError as err:
            if err.path in rules:
                raise self.plan.error_at(rules[err.path], f"rule 'expert' on {err}",
                                         hint="see README, 'Mixture of experts', for the patterns usc knows") from None
            raise TraceError(f"usc could not reproduce the mixture-of-experts block {err}") from None

    def _microbatch(self, batch: tuple) -> tuple:
        """The program is compiled for one global microbatch (mb=M splits the batch's dim 0)."""
        mb = int(self.plan.get("mb"))
        if mb == 1:
            return batch
        first = next((v for v in batch if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if first is None or first.shape[0] % mb:
            size = None if first is None else first.shape[0]
            raise self.plan.error_at("mb", f"mb={mb} microbatches do not divide the global batch of {size}",
                                     hint=f"use a batch that is a multiple of {mb}")
        return tuple(v.chunk(mb, 0)[0] if isinstance(v, torch.Tensor) else v for v in batch)

    def _make_executor(self, mesh, state, optimizer):
        """A plain rank, or a pipeline stage rank following the plan's schedule."""
        options = self._executor_options()
        pp = self.plan.size("pp")
        if pp == 1:
            return RankExecutor(self._program, mesh, state, optimizer=optimizer, **options)
        schedule = build_schedule(self.plan.get("schedule"), pp, int(self.plan.get("v")), options["microbatches"])
        check_schedule(schedule)
        return PipelineExecutor(self._program, mesh, state, optimizer=optimizer, schedule=schedule, **options)

    def _executor_options(self) -> dict:
        return {"bucket_bytes": self.bucket_bytes, "zero": int(self.plan.get("zero")),
                "microbatches": int(self.plan.get("mb")),
                "compute_dtype": torch.bfloat16 if self.plan.get("dtype") == "bf16" else None,
                "reduce_dtype": torch.bfloat16 if self.plan.get("reduce_dtype") == "bf16" else None}

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

    # ------------------------------------------------------------------ the training loop's face
    def train(self, mode: bool = True):
        """As ``nn.Module.train``: steps and calls run with dropout as traced. Returns self."""
        self.training = bool(mode)
        return self

    def eval(self):
        """As ``nn.Module.eval``: dropout off in ``step(...)`` calls and evaluation. Returns self."""
        return self.train(False)

    def _mode(self, *, evaluating: bool = False):
        return EvalMode() if evaluating or not self.training else contextlib.nullcontext()

    def _schedulers_for(self, ranks: list) -> list:
        if self._scheduler_factory is None:
            return []
        return [self._scheduler_factory(rank.torch_optimizer) for rank in ranks]

    def _measure(self, ranks: list, schedulers: list, run: Callable[[], float], batch: tuple) -> float:
        """Run one step, step the schedulers after it (torch's order: optimizer, then scheduler) and
        record ``self.metrics``."""
        lr = float(ranks[0].torch_optimizer.param_groups[0]["lr"])
        cuda = ranks[0].mesh.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(ranks[0].mesh.device)
        start = time.perf_counter()
        value = run()
        for scheduler in schedulers:
            scheduler.step()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(ranks[0].mesh.device) if cuda else \
            max(sum(rank.peak_state_bytes.values()) for rank in ranks)
        labels = batch[-1] if batch and isinstance(batch[-1], torch.Tensor) else None
        self.metrics = StepMetrics(step=ranks[0].steps_done, loss=value, grad_norm=ranks[0].grad_norm, lr=lr,
                                   tokens=labels.numel() if labels is not None else 0, seconds=seconds,
                                   peak_bytes=int(peak))
        return value

    def _checkpoint_meta(self, rank, schedulers: list) -> dict:
        meta = {**rank.checkpoint_meta(), "plan": str(self.plan)}
        if schedulers:
            meta["lr_scheduler"] = schedulers[0].state_dict()
        return meta

    @staticmethod
    def _load_schedulers(reader, schedulers: list) -> None:
        saved = reader.meta.get("lr_scheduler")
        if saved is not None:
            for scheduler in schedulers:
                scheduler.load_state_dict(saved)

    def _ensure_built(self, batch: tuple) -> None:
        if self._program is None:
            self._build(batch)
        if is_meta_model(self.model):
            raise RuntimeError("the model's weights are on the meta device: it can be compiled and linted, but "
                               "stepping needs real weights (build the model on 'cpu' or 'cuda')")


class Compiled(_Compiled):
    """The program for *this* torchrun process (one rank of the mesh).

    >>> step = usc.compile(model, "dp=2 tp=2", example_inputs=(tokens, labels))   # doctest: +SKIP
    >>> loss = step.step(tokens, labels)   # every rank passes the same global batch
    """

    _executor: RankExecutor | None = None

    def _rank(self) -> RankExecutor:
        if self._executor is None:
            mesh = self._mesh()
            self._executor = self._make_executor(mesh, _full_state(self.model, self._traced), self._optimizer)
            self._schedulers = self._schedulers_for([self._executor])
        return self._executor

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This rank's torch optimizer, the one that steps (ZeRO-1/2: over this rank's slices)."""
        return self._rank().torch_optimizer

    @property
    def lr_scheduler(self):
        """The scheduler ``lr_scheduler=`` built (None without one); stepped after every step."""
        self._rank()
        return self._schedulers[0] if self._schedulers else None

    def _mesh(self) -> Mesh:
        axes, shape, world = tuple(self.plan.mesh_axes), tuple(self.plan.mesh_shape), self.plan.world_size
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and "RANK" not in os.environ:
            raise RuntimeError(
                f"plan '{self.plan}' needs {world} processes but this is a single process; launch with "
                f"`torchrun --nproc-per-node {world} your_script.py` (more nodes: --nnodes), or use "
                f"usc.simulate(...) to run every rank in this process")
        if world == 1 and launched == 1:
            return simulated_meshes(axes, shape, timeout=self.timeout)[0]
        return Mesh.from_environment(axes, shape, timeout=self.timeout)

    def step(self, *batch, max_grad_norm: float | None = None, trace: str | None = None) -> float:
        """One optimizer step on the global batch; returns the global mean loss.

        max_grad_norm: clip the gradient to this global L2 norm first (``clip_grad_norm_`` over the
        whole model, exact on every plan; ``float('inf')`` measures the norm without clipping).
        ``self.metrics`` then holds the step's loss, grad_norm, lr, tokens, time and peak bytes."""
        self._ensure_built(batch)
        rank = self._rank()
        timeline = Timeline(rank.mesh.rank) if trace else None
        rank.set_timeline(timeline)
        rank.max_grad_norm = max_grad_norm
        try:
            with self._mode():
                return self._measure([rank], self._schedulers, lambda: rank.step(batch), batch)
        finally:
            rank.set_timeline(None)
            if timeline is not None:
                self._report.exposed_comm_seconds = timeline.exposed_comm_seconds()
                path = trace if rank.mesh.world_size == 1 else _rank_path(trace, rank.mesh.rank)
                timeline.to_chrome_trace(path)

    def __call__(self, *batch) -> float:
        """The global mean loss on ``batch`` without updating anything (no gradients), in the
        current mode: after ``eval()`` dropout is off, as in ``model.eval(); model(x)``."""
        self._ensure_built(batch)
        with self._mode():
            return self._rank().evaluate(batch)

    def eval_step(self, *batch) -> float:
        """The global mean loss on ``batch`` in evaluation mode (dropout off, no gradients), whatever
        the current mode."""
        self._ensure_built(batch)
        with self._mode(evaluating=True):
            return self._rank().evaluate(batch)

    def activation_bytes(self, *batch) -> int:
        """Measured bytes of activations this rank saves for backward in one forward."""
        self._ensure_built(batch)
        return self._rank().activation_bytes(batch)

    def save(self, path: str | os.PathLike) -> None:
        """Write model, optimizer and scheduler state as a sharded checkpoint (every rank calls it):
        each rank writes only the pieces it holds; rank 0 commits once all have written. Loads under
        any plan (runtime/checkpoint.py has the format and its guarantees)."""
        rank = self._rank()
        checkpoint_state.save(rank, path, self._checkpoint_meta(rank, self._schedulers))

    def load(self, path: str | os.PathLike, *, strict: bool = True) -> LoadResult:
        """Read a checkpoint saved under any plan; this rank reads only the pieces overlapping its
        own. strict=False loads what matches and returns what did not (missing / unexpected)."""
        if self._program is None:
            raise RuntimeError("compile with example_inputs= (or call step() once) before load()")
        reader = checkpoint.Reader(path)
        result = self._rank().load_from(reader, strict=strict)
        self._load_schedulers(reader, self._schedulers)
        return result

    def moe_stats(self) -> dict:
        """This rank's view of each MoE layer over the last step (loads of its own experts, the
        all-to-all bytes it sent); ``usc.simulate(...).moe_stats()`` combines every rank's."""
        return summarize([self._rank().moe_stats()])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors under the model's own state_dict names (a collective call)."""
        full = self._rank().full_state_dict()
        return {k: full[k] for k in self._user_model.state_dict() if k in full}


def _save_rank(rank, path, meta: dict) -> CheckpointError | None:
    try:
        checkpoint_state.save(rank, path, meta)
    except CheckpointError as err:
        return err
    return None


def _rank_path(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Simulated(_Compiled):
    """Every rank of the mesh in this process (one thread per rank, in-memory collectives)."""

    def __init__(self, model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None,
                 optimizer: OptimizerFactory | None = None, lr_scheduler: SchedulerFactory | None = None) -> None:
        if example_inputs is None:
            raise TypeError("usc.simulate needs example_inputs=(...) (the global batch)")
        super().__init__(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                         lr_scheduler=lr_scheduler)
        self._ensure_built(())
        self.meshes = simulated_meshes(tuple(self.plan.mesh_axes), tuple(self.plan.mesh_shape), timeout=self.timeout)
        state = _full_state(self.model, self._traced)
        self.ranks = [self._make_executor(mesh, state, optimizer) for mesh in self.meshes]
        self.lr_schedulers = self._schedulers_for(self.ranks)  # one per rank, stepped together

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every rank's torch optimizer (change a setting on all of them, or use lr_scheduler=)."""
        return [rank.torch_optimizer for rank in self.ranks]

    def _run(self, fn) -> list:
        return run_in_threads(self.meshes, lambda mesh: fn(self.ranks[mesh.rank]), timeout=self.timeout)

    def step(self, *batch, max_grad_norm: float | None = None, trace: str | None = None) -> float:
        """As ``Compiled.step``, every rank in this process."""
        timeline = Timeline(0) if trace else None
        for rank in self.ranks:
            rank.set_timeline(timeline)
            rank.max_grad_norm = max_grad_norm
        try:
            run = lambda: self._run(lambda rank: self._in_mode(rank.step, batch))[0]  # noqa: E731
            return self._measure(self.ranks, self.lr_schedulers, run, batch)
        finally:
            for rank in self.ranks:
                rank.set_timeline(None)
            if timeline is not None:
                self._report.exposed_comm_seconds = max(
                    timeline.exposed_comm_seconds(rank=r) for r in range(len(self.ranks)))
                timeline.to_chrome_trace(trace)

    def _in_mode(self, fn, batch: tuple, *, evaluating: bool = False):
        with self._mode(evaluating=evaluating):  # mode stacks are per thread: each rank enters its own
            return fn(batch)

    def __call__(self, *batch) -> float:
        return self._run(lambda rank: self._in_mode(rank.evaluate, batch))[0]

    def eval_step(self, *batch) -> float:
        return self._run(lambda rank: self._in_mode(rank.evaluate, batch, evaluating=True))[0]

    def memory_bytes(self) -> list[dict[str, int]]:
        """Measured bytes held per rank in parameters, gradients and optimizer state."""
        return [rank.memory_bytes() for rank in self.ranks]

    def activation_bytes(self, *batch) -> list[int]:
        """Measured bytes of activations saved for backward by one forward, per rank."""
        return self._run(lambda rank: rank.activation_bytes(batch))

    def save(self, path: str | os.PathLike) -> None:
        """As ``Compiled.save``: every rank writes its own pieces."""
        meta = self._checkpoint_meta(self.ranks[0], self.lr_schedulers)
        failures = [e for e in self._run(lambda rank: _save_rank(rank, path, meta)) if e is not None]
        if failures:  # every rank agreed on it; raised here so no rank's groups are torn down
            raise failures[0]

    def load(self, path: str | os.PathLike, *, strict: bool = True) -> LoadResult:
        """As ``Compiled.load``: every rank reads the pieces overlapping its own."""
        reader = checkpoint.Reader(path)
        results = [rank.load_from(reader, strict=strict) for rank in self.ranks]
        self._load_schedulers(reader, self.lr_schedulers)
        return results[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = self._run(lambda rank: rank.full_state_dict())[0]
        return {k: full[k] for k in self._user_model.state_dict() if k in full}

    def moe_stats(self) -> dict:
        """Per MoE layer (module path): tokens per expert and per rank (the load), their imbalance
        (max / mean) and the all-to-all bytes each rank sent, over the last step."""
        return summarize([rank.moe_stats() for rank in self.ranks])

    def rank_state(self, rank: int) -> dict[str, torch.Tensor]:
        """The local shards held by one rank (for tests and inspection)."""
        return self.ranks[rank].local_state()


def compile(model: nn.Module, plan: str | Plan, *, example_inputs=None, loss_fn=None,
            optimizer: OptimizerFactory | None = None, lr_scheduler: SchedulerFactory | None = None) -> Compiled:
    """Compile ``model`` for the mesh in ``plan`` and return this torchrun process's program.

    >>> import usc, torch
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> step = usc.compile(TinyLlama(), "dp=1", example_inputs=batch)
    >>> isinstance(step.step(*batch), float)
    True
    """
    return Compiled(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                    lr_scheduler=lr_scheduler)


def simulate(model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None,
             optimizer: OptimizerFactory | None = None, lr_scheduler: SchedulerFactory | None = None) -> Simulated:
    """Compile ``model`` and run every rank of the mesh in this process.

    >>> import usc
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> sim = usc.simulate(TinyLlama(), "dp=2 tp=2", example_inputs=batch)
    >>> isinstance(sim.step(*batch), float)
    True
    """
    return Simulated(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                     lr_scheduler=lr_scheduler)


def lint(model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None, hardware=None) -> Report:
    """Compile without running anything and return the report (what ``usc-lint`` prints), with the
    lint findings in ``report.findings`` (codes USC1xx errors, USC2xx warnings, USC3xx notes).

    Works for meshes of any size and for models on the ``meta`` device (no weights allocated). A plan
    that does not compile raises its PlanError / CompileError. ``hardware`` ("h100", "a100", a profile
    file or a HardwareProfile) adds the cost model's time breakdown (``report.cost``): compute, exposed
    communication and bubble per step, tokens/s, MFU; memory is checked against it (default h100).
    """
    from .linting import first_error, lint_plan

    result = lint_plan(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, hardware=hardware or "h100")
    if result.report is None:
        if not result.exceptions:  # refused by a lint check before compiling: the compiler's own words
            _Compiled(model, result.plan, example_inputs=example_inputs, loss_fn=loss_fn, traced=result.traced)
        raise first_error(result)
    result.compiled._attach_cost(as_batch(example_inputs), hardware)
    return result.report


def plan(model: nn.Module, spec: str | Plan, *, example_inputs, loss_fn=None, hardware=None, keep: int = 5) -> Plan:
    """Choose a plan for a cluster: ``spec`` names the target, the result is a ``usc.Plan``.

    ``spec`` is plan text: ``gpus=N`` (required unless axes are written), ``gpus_per_node``, ``seq`` and
    ``global_batch`` (sequences per step; default: the example's shape), and any axes or options to
    keep as written (``tp=8``, ``zero=1``, ``dtype=bf16``). Every dp/tp/pp/cp/ep/zero/mb/recompute/
    schedule combination that usc.compile runs is checked for divisibility and memory and ranked by
    the cost model's step time on ``hardware``; ``plan.search`` holds the runners-up and why each
    lost (``print(plan.search)``). The example inputs only give shapes: a model on the meta device works.

    >>> import usc, torch
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> chosen = usc.plan(TinyLlama(), "gpus=4 dtype=bf16", example_inputs=token_batch(128, 8, 32))
    >>> chosen.world_size
    4
    """
    from usc.planning import choose

    model = _WithLoss(model, loss_fn) if loss_fn is not None else model
    batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return choose(model, _as_plan(spec) if not isinstance(spec, str) else spec, batch, hardware=hardware, keep=keep)


def _resolve_auto(model: nn.Module, written: Plan, example_inputs, hardware=None) -> Plan:
    """``auto`` in compile/lint/simulate: the planner chooses, for the example batch as the global batch."""
    from usc.planning import choose

    if example_inputs is None:
        raise written.error_at("auto", "auto needs example_inputs= to plan for (the global batch)",
                               hint="pass example_inputs=(tokens, labels) to compile")
    batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return choose(model, written, batch, hardware=hardware)


__all__ = ["compile", "simulate", "lint", "plan", "parse_plan", "Compiled", "Simulated", "Report", "PlanError",
           "CompileError", "Plan"]
