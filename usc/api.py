"""The public face: ``usc.compile``, ``usc.simulate``, ``usc.lint``. It strings the stages together
(dsl -> compiler -> passes -> runtime) and holds no logic of its own beyond that."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable

import torch
from torch import nn

from usc.compiler.errors import CompileError
from usc.compiler.hardware import BUILTIN_PROFILES, hardware_profile
from usc.compiler.report import Report
from usc.dsl import Plan, PlanError, parse_plan
from usc.passes.cost_profile import model_forward_flops
from usc.runtime import checkpoint, checkpoint_state
from usc.runtime.agreement import agree, fingerprint
from usc.runtime.checkpoint import CheckpointError
from usc.runtime.checkpoint_state import LoadResult
from usc.runtime.executor import RankExecutor
from usc.runtime.mesh import Mesh, run_in_threads, simulated_meshes
from usc.runtime.moe import summarize
from usc.runtime.timeline import Timeline
from usc.runtime.training import EvalMode
from usc.training import StepMetrics

from usc.runtime.materialize import InitFn, has_meta_tensors

from .build import OptimizerFactory, SchedulerFactory, _as_plan, _Compiled, _full_state
from .eval_form import check as check_eval_form
from .handover import note_given, refuse_model_changes
from .model_call import trainable
from .version import __version__


class StepContextError(RuntimeError):
    """A step or evaluation called inside a torch context that would change what it computes
    (``torch.no_grad()`` around a training step, ``torch.autocast`` around any)."""


def _refuse_ambient_modes(call: str, *, trains: bool) -> None:
    """The program runs the plan's precision and its own gradient mode; the caller's context must
    not change them. Simulated ranks run on threads, where torch's grad and autocast modes do not
    follow, so the same call did different things in one process and under torchrun."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            dtype = str(torch.get_autocast_dtype(device)).replace("torch.", "")
            raise StepContextError(
                f"{call} was called inside torch.autocast('{device}', dtype=torch.{dtype}): usc runs the plan's "
                "precision, and autocast around it would cast the program's own ops (a float32 plan's step "
                "under it took no update: the loss stayed where it was)\n"
                "  fix: put the precision in the plan -- dtype=bf16 computes in bfloat16 with float32 master "
                "weights, as autocast's recipe does -- and call it outside autocast (autocast inside the model's "
                "forward is traced and kept)")
    if trains and not torch.is_grad_enabled():
        raise StepContextError(
            f"{call} was called with gradients off (inside torch.no_grad() or torch.inference_mode()): a "
            "training step computes gradients and updates the weights\n"
            "  fix: call step(...) outside that block; to evaluate, step.eval_step(*batch) or step(*batch) "
            "take no gradients and update nothing")


class _TrainingLoop:
    """What Compiled and Simulated share of the loop a user writes: train()/eval(), the scheduler
    stepped after each step, the step's metrics and the checkpoint's metadata."""

    def _evaluation(self, call: str, batch: tuple, *, in_eval_mode: bool) -> tuple:
        """What every evaluation checks first (the caller's context, the model changed since compile,
        and in eval mode the model's evaluation form); returns the flat batch, the program built."""
        _refuse_ambient_modes(call, trains=False)
        refuse_model_changes(self._user_model_alive(), None, call, self._watcher)
        batch = self.flat_batch(batch)
        self._ensure_built(batch)
        if in_eval_mode:
            check_eval_form(self, batch, call)
        return batch

    _mode_source = None  # the user's model (a weak reference): its train()/eval() is this program's mode too
    _training = True

    @property
    def training(self) -> bool:
        """The mode steps and calls run in: the model's own ``training`` while the model you compiled
        is alive (``model.eval()`` turns dropout off in ``step(...)`` as in ``model(...)``), else the
        last ``train()`` / ``eval()`` of this object."""
        model = self._user_model_alive()
        return self._training if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        self._training = bool(mode)

    _watcher = None  # usc/handover.py's watch of the model, once this program holds its state

    def _user_model_alive(self) -> "nn.Module | None":
        return self._mode_source() if self._mode_source is not None else None

    def train(self, mode: bool = True):
        """As ``nn.Module.train``: steps and calls run with dropout as traced, and the model you
        compiled is set to the same mode (one flag, as for a module). Returns self."""
        self.training = bool(mode)
        model = self._user_model_alive()
        if model is not None:
            model.train(mode)
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

    def _measure(self, ranks: list, schedulers: list, run: Callable[[], float], batch: tuple,
                 shards: int = 1) -> float:
        """Run one step, step the schedulers after it (torch's order: optimizer, then scheduler) and
        record ``self.metrics``."""
        lr = float(ranks[0].torch_optimizer.param_groups[0]["lr"])
        cuda = ranks[0].mesh.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(ranks[0].mesh.device)
        start = time.perf_counter()
        value = run()
        self.steps_taken += 1
        self._moved()
        for scheduler in schedulers:
            scheduler.step()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(ranks[0].mesh.device) if cuda else \
            max(sum(rank.peak_state_bytes.values()) for rank in ranks)
        labels = batch[-1] if batch and isinstance(batch[-1], torch.Tensor) else None
        self.metrics = StepMetrics(step=ranks[0].steps_done, loss=value, grad_norm=ranks[0].grad_norm, lr=lr,
                                   tokens=labels.numel() * shards if labels is not None else 0, seconds=seconds,
                                   peak_bytes=int(peak), flops=self._step_flops(),
                                   peak_flops=self._peak_flops(ranks[0].mesh.device))
        return value

    _flops: float | None = None

    def _step_flops(self) -> float:
        """The model's FLOPs of one step (StepMetrics.mfu): 3 x a forward of every microbatch."""
        if self._flops is None:
            self._flops = 3 * model_forward_flops(self._traced.gm) * int(self.plan.get("mb"))
        return self._flops

    def _peak_flops(self, device: torch.device) -> float:
        """The mesh's peak: the hardware profile at the plan's dtype, per device, times the devices."""
        hw = self._hardware or _profile_of_device(device) or self.plan.get("hardware")
        return hardware_profile(hw).peak_flops(self.plan.get("dtype")) * self.plan.world_size

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




class Compiled(_TrainingLoop, _Compiled):
    """The program for *this* torchrun process (one rank of the mesh).

    >>> step = usc.compile(model, "dp=2 tp=2", example_inputs=(tokens, labels))   # doctest: +SKIP
    >>> loss = step.step(tokens, labels)   # every rank passes the same global batch
    """

    _executor: RankExecutor | None = None
    device: str | torch.device | None = None  # None: cuda:LOCAL_RANK under torchrun with CUDA, else the CPU

    _fingerprint = None  # what this rank was built from, until the ranks agreed on it

    def _rank(self, *, loading: str | os.PathLike | None = None) -> RankExecutor:
        """This rank's executor, made on first use from its share of the model (a meta-built model:
        materialised here, or left uninitialised when a checkpoint fills it: ``init='path'``, or
        ``loading``); the user's model is released once the rank holds its state."""
        if self._executor is None:
            mesh = self._mesh()
            if mesh.world_size > 1:  # from the model as built (a meta model: its structure only)
                self._fingerprint = fingerprint(plan=str(self.plan), state=_full_state(self.model, self._traced),
                                                inputs=self._program.inputs, versions=f"usc {__version__}",
                                                program=self._program.listing())
            fills = [p for p in (self.init_checkpoint, loading) if p is not None]
            executor = self._make_executor(mesh, self._state_source(mesh.device, empty=bool(fills)), self._optimizer)
            schedulers = self._schedulers_for([executor])
            for path in fills:  # strict: every tensor filled; a failure leaves no half-made rank behind
                self._load_rank(executor, schedulers, path, strict=True)
            self._executor, self._schedulers = executor, schedulers
            self._release_model()
        return self._executor

    def _agreed_rank(self) -> RankExecutor:
        """This rank, once every rank of the mesh was found built alike (runtime/agreement.py): the
        first collective call of the run compares them, and every rank raises RanksDisagree if not."""
        rank = self._rank()
        if self._fingerprint is not None:
            agree(rank.mesh, self._fingerprint)
            self._fingerprint = None
        return rank

    def _load_rank(self, executor, schedulers: list, path, *, strict: bool) -> LoadResult:
        reader = checkpoint.Reader(path)
        result = executor.load_from(reader, strict=strict)
        self._load_schedulers(reader, schedulers)
        return result

    def _can_make_rank(self) -> bool:
        """Whether this process runs a rank of the plan (not a plan-only compile of a larger mesh)."""
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        return self._program is not None and (self.plan.world_size == launched == 1 or
                                              ("RANK" in os.environ and self.plan.world_size == launched))

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This rank's torch optimizer, the one that steps (ZeRO-1/2: over this rank's slices)."""
        return self._rank().torch_optimizer

    @property
    def lr_scheduler(self):
        """The scheduler ``lr_scheduler=`` built (None without one); stepped after every step."""
        self._rank()
        return self._schedulers[0] if self._schedulers else None

    def _data_shards(self) -> int:
        from usc.runtime.training import data_shard

        return data_shard(self.program.inputs[0], self.program.mesh, self._rank().mesh.coord)[1]

    def _mesh(self) -> Mesh:
        axes, shape, world = tuple(self.plan.mesh_axes), tuple(self.plan.mesh_shape), self.plan.world_size
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and "RANK" not in os.environ:
            raise RuntimeError(
                f"plan '{self.plan}' needs {world} processes but this is a single process; launch with "
                f"`torchrun --nproc-per-node {world} your_script.py` (more nodes: --nnodes), or use "
                f"usc.simulate(...) to run every rank in this process")
        if world == 1 and launched == 1:
            return simulated_meshes(axes, shape, timeout=self.timeout, device=self.device or "cpu")[0]
        return Mesh.from_environment(axes, shape, timeout=self.timeout, device=self.device)

    def step(self, *batch, max_grad_norm: float | None = None, local: bool = False, trace: str | None = None) -> float:
        """One optimizer step on the global batch; returns the global mean loss.

        local=True: ``batch`` is this rank's data shard only (``usc.data``: a DistributedSampler over
        the dp x ep ranks); the loss is still the global token mean over every shard.

        max_grad_norm: clip the gradient to this global L2 norm first (``clip_grad_norm_`` over the
        whole model, exact on every plan; ``float('inf')`` measures the norm without clipping).
        ``self.metrics`` then holds the step's loss, grad_norm, lr, tokens, time and peak bytes."""
        _refuse_ambient_modes("step.step(...)", trains=True)
        refuse_model_changes(self._user_model_alive(), self._frozen, "step.step(...)", self._watcher)
        if local and self._program is None:
            raise RuntimeError("step(..., local=True) needs example_inputs= at compile: the global batch's shape")
        batch = self.flat_batch(batch)
        self._ensure_built(batch)
        rank = self._agreed_rank()
        timeline = Timeline(rank.mesh.rank) if trace else None
        rank.set_timeline(timeline)
        rank.max_grad_norm, rank.local_batch = max_grad_norm, local
        shards = self._data_shards() if local else 1
        try:
            with self._mode():
                value = self._measure([rank], self._schedulers, lambda: rank.step(batch), batch, shards)
            self.wait_checkpoint()  # a background save written while this step computed
            return value
        except BaseException:
            rank.rollback()  # a failed step changes nothing (a collective that failed stays failed)
            raise
        finally:
            rank.set_timeline(None)
            rank.local_batch = False  # evaluation takes the global batch
            if timeline is not None:
                self._report.exposed_comm_seconds = timeline.exposed_comm_seconds()
                path = trace if rank.mesh.world_size == 1 else _rank_path(trace, rank.mesh.rank)
                timeline.to_chrome_trace(path)

    def __call__(self, *batch) -> float:
        """The global mean loss on ``batch`` without updating anything (no gradients), in the
        current mode: after ``eval()`` dropout is off, as in ``model.eval(); model(x)``."""
        batch = self._evaluation("step(...)", batch, in_eval_mode=not self.training)
        with self._mode():
            return self._agreed_rank().evaluate(batch)

    def eval_step(self, *batch) -> float:
        """The global mean loss on ``batch`` in evaluation mode (dropout off, no gradients), whatever
        the current mode."""
        batch = self._evaluation("step.eval_step(...)", batch, in_eval_mode=True)
        with self._mode(evaluating=True):
            return self._agreed_rank().evaluate(batch)

    def activation_bytes(self, *batch) -> int:
        """Measured bytes of activations this rank saves for backward in one forward."""
        batch = self.flat_batch(batch)
        self._ensure_built(batch)
        return self._rank().activation_bytes(batch)

    _pending_save = None

    def save(self, path: str | os.PathLike, *, background: bool = False) -> None:
        """Write model, optimizer and scheduler state as a sharded checkpoint (every rank calls it):
        each rank writes only the pieces it holds; rank 0 commits once all have written. Loads under
        any plan (runtime/checkpoint.py has the format and its guarantees).

        background=True: this rank's pieces are copied and written by a thread while training goes
        on; the commit happens at the end of the next step (or ``wait_checkpoint``, ``save``, ``load``)."""
        self.wait_checkpoint()
        rank = self._agreed_rank()
        meta = self._checkpoint_meta(rank, self._schedulers)
        if not background:
            checkpoint_state.save(rank, path, meta)
            return
        self._pending_save = checkpoint_state.start_save(rank, path, meta, background=True)

    def wait_checkpoint(self) -> None:
        """Commit a background save (a collective: every rank calls it at the same point)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.finish()

    def load(self, path: str | os.PathLike, *, strict: bool = True) -> LoadResult:
        """Read a checkpoint saved under any plan; this rank reads only the pieces overlapping its
        own. strict=False loads what matches and returns what did not (missing / unexpected)."""
        if self._program is None:
            raise RuntimeError("compile with example_inputs= (or call step() once) before load()")
        self.wait_checkpoint()
        if self._executor is None and strict:  # a meta-built model is not initialised only to be overwritten
            self._rank(loading=path)
            self._agreed_rank()
            self.loads_done += 1
            self._moved()
            return LoadResult()
        result = self._load_rank(self._agreed_rank(), self._schedulers, path, strict=strict)
        self.loads_done += 1
        self._moved()
        return result

    def moe_stats(self) -> dict:
        """This rank's view of each MoE layer over the last step (loads of its own experts, the
        all-to-all bytes it sent); ``usc.simulate(...).moe_stats()`` combines every rank's."""
        return summarize([self._rank().moe_stats()])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors under the model's own state_dict names (a collective call)."""
        full = self._agreed_rank().full_state_dict()
        out = {k: full[k] for k in self._model_state_names() if k in full}
        note_given(self, out)  # loaded back into the model, these make it level with the program
        return out


def _profile_of_device(device) -> str | None:
    """The built-in hardware profile a CUDA device is ("NVIDIA H100 80GB HBM3" -> "h100"), if any."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((known for known in BUILTIN_PROFILES if known in name), None)


def _save_rank(rank, path, meta: dict) -> CheckpointError | None:
    return _finish(None, lambda: checkpoint_state.save(rank, path, meta))


def _finish(pending, save=None) -> CheckpointError | None:
    """A simulated rank's save outcome, returned: every rank agreed on it, and raising it inside
    the rank threads would tear the simulated groups down."""
    try:
        (save or pending.finish)()
    except CheckpointError as err:
        return err
    return None


def _raise_first(failures: list) -> None:
    first = next((e for e in failures if e is not None), None)
    if first is not None:
        raise first


def _rank_path(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Simulated(_TrainingLoop, _Compiled):
    """Every rank of the mesh in this process (one thread per rank, in-memory collectives)."""

    def __init__(self, model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None,
                 optimizer: OptimizerFactory | None = None, device: str | torch.device = "cpu",
                 lr_scheduler: SchedulerFactory | None = None, hardware=None,
                 init: InitFn | str | os.PathLike | None = None, init_seed: int | None = None) -> None:
        if example_inputs is None:
            raise TypeError("usc.simulate needs example_inputs=(...) (the global batch)")
        super().__init__(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                         lr_scheduler=lr_scheduler, hardware=hardware, init=init, init_seed=init_seed)
        self._ensure_built(())
        self.device = device  # every simulated rank computes there (one GPU holds the whole mesh)
        self.meshes = simulated_meshes(tuple(self.plan.mesh_axes), tuple(self.plan.mesh_shape), timeout=self.timeout,
                                       device=device)
        state = self._state_source(torch.device(device))  # one source: a meta module is made once per rank
        self.ranks = [self._make_executor(mesh, state, optimizer) for mesh in self.meshes]
        self.lr_schedulers = self._schedulers_for(self.ranks)  # one per rank, stepped together
        if self.init_checkpoint is not None:
            self.load(self.init_checkpoint)
        self._release_model()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every rank's torch optimizer (change a setting on all of them, or use lr_scheduler=)."""
        return [rank.torch_optimizer for rank in self.ranks]

    def _run(self, fn) -> list:
        try:
            return run_in_threads(self.meshes, lambda mesh: fn(self.ranks[mesh.rank]), timeout=self.timeout)
        except BaseException:
            for rank in self.ranks:  # a failed call changes nothing: the next one starts clean
                rank.rollback()
            raise

    def step(self, *batch, max_grad_norm: float | None = None, local: bool = False, trace: str | None = None) -> float:
        """As ``Compiled.step``, every rank in this process.

        local=True: ``batch`` is one batch per data shard, in shard order (``usc.data.shard``), each
        what that shard's ranks pass to ``Compiled.step(..., local=True)``; every rank is fed its own::

            shards = [usc.data.local_slice(sim, *b, coord=c) for c in usc.data.shard_coords(sim)]
            sim.step(*shards, local=True)
        """
        _refuse_ambient_modes("sim.step(...)", trains=True)
        refuse_model_changes(self._user_model_alive(), self._frozen, "sim.step(...)", self._watcher)
        timeline = Timeline(0) if trace else None
        for rank in self.ranks:
            rank.set_timeline(timeline)
            rank.max_grad_norm, rank.local_batch = max_grad_norm, local
        try:
            shards = self._local_shards(batch) if local else [self.flat_batch(batch)]
            feed = (lambda rank: shards[self._shard_of(rank)]) if local else (lambda rank: shards[0])
            run = lambda: self._run(lambda rank: self._in_mode(rank.step, feed(rank)))[0]  # noqa: E731
            value = self._measure(self.ranks, self.lr_schedulers, run, shards[0], len(shards))
            self.wait_checkpoint()
            return value
        finally:
            for rank in self.ranks:
                rank.set_timeline(None)
                rank.local_batch = False  # evaluation takes the global batch
            if timeline is not None:
                self._report.exposed_comm_seconds = max(
                    timeline.exposed_comm_seconds(rank=r) for r in range(len(self.ranks)))
                timeline.to_chrome_trace(trace)

    def _shard_of(self, rank) -> int:
        from usc.runtime.training import data_shard

        return data_shard(self.program.inputs[0], self.program.mesh, rank.mesh.coord)[0]

    def _local_shards(self, shards: tuple) -> list[tuple]:
        """Each data shard's flat batch (step(..., local=True)): one per dp x ep shard."""
        count = self._data_shards()
        if len(shards) != count:
            raise ValueError(f"step(..., local=True) on the simulator takes one batch per data shard: plan "
                             f"'{self.plan}' has {count} (dp x ep), got {len(shards)}; build them with "
                             "usc.data.local_slice(sim, *batch, coord=c) for c in usc.data.shard_coords(sim)")
        return [self.flat_batch((shard,)) for shard in shards]

    def _data_shards(self) -> int:
        from usc.runtime.training import data_shard

        return data_shard(self.program.inputs[0], self.program.mesh, self.meshes[0].coord)[1]

    def _in_mode(self, fn, batch: tuple, *, evaluating: bool = False):
        with self._mode(evaluating=evaluating):  # mode stacks are per thread: each rank enters its own
            return fn(batch)

    def __call__(self, *batch) -> float:
        batch = self._evaluation("sim(...)", batch, in_eval_mode=not self.training)
        return self._run(lambda rank: self._in_mode(rank.evaluate, batch))[0]

    def eval_step(self, *batch) -> float:
        batch = self._evaluation("sim.eval_step(...)", batch, in_eval_mode=True)
        return self._run(lambda rank: self._in_mode(rank.evaluate, batch, evaluating=True))[0]

    def memory_bytes(self) -> list[dict[str, int]]:
        """Measured bytes held per rank in parameters, gradients and optimizer state."""
        return [rank.memory_bytes() for rank in self.ranks]

    def activation_bytes(self, *batch) -> list[int]:
        """Measured bytes of activations saved for backward by one forward, per rank."""
        batch = self.flat_batch(batch)
        return self._run(lambda rank: rank.activation_bytes(batch))

    _pending_saves = None

    def save(self, path: str | os.PathLike, *, background: bool = False) -> None:
        """As ``Compiled.save``: every rank writes its own pieces."""
        self.wait_checkpoint()
        meta = self._checkpoint_meta(self.ranks[0], self.lr_schedulers)
        if not background:
            _raise_first(self._run(lambda rank: _save_rank(rank, path, meta)))
            return
        self._pending_saves = self._run(lambda rank: checkpoint_state.start_save(rank, path, meta, background=True))

    def wait_checkpoint(self) -> None:
        pending, self._pending_saves = self._pending_saves, None
        if pending is not None:
            _raise_first(self._run(lambda rank: _finish(pending[rank.mesh.rank])))

    def load(self, path: str | os.PathLike, *, strict: bool = True) -> LoadResult:
        """As ``Compiled.load``: every rank reads the pieces overlapping its own."""
        self.wait_checkpoint()
        reader = checkpoint.Reader(path)
        results = [rank.load_from(reader, strict=strict) for rank in self.ranks]
        self._load_schedulers(reader, self.lr_schedulers)
        self.loads_done += 1
        self._moved()
        return results[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = self._run(lambda rank: rank.full_state_dict())[0]
        out = {k: full[k] for k in self._model_state_names() if k in full}
        note_given(self, out)
        return out

    def moe_stats(self) -> dict:
        """Per MoE layer (module path): tokens per expert and per rank (the load), their imbalance
        (max / mean) and the all-to-all bytes each rank sent, over the last step."""
        return summarize([rank.moe_stats() for rank in self.ranks])

    def rank_state(self, rank: int) -> dict[str, torch.Tensor]:
        """The local shards held by one rank (for tests and inspection)."""
        return self.ranks[rank].local_state()


def compile(model: nn.Module, plan: str | Plan, *, example_inputs=None, loss_fn=None,
            optimizer: OptimizerFactory | None = None, device: str | torch.device | None = None,
            lr_scheduler: SchedulerFactory | None = None, hardware=None,
            init: InitFn | str | os.PathLike | None = None, init_seed: int | None = None) -> Compiled:
    """Compile ``model`` for the mesh in ``plan`` and return this torchrun process's program.

    ``hardware`` ("h100", "a100", a profile file or a HardwareProfile): the machine ``plan=auto``
    plans for and ``step.metrics.mfu`` is measured against (default: the CUDA device's profile when
    it is a built-in one, else the plan's ``hardware``, h100).

    A model built on the ``meta`` device is made real rank by rank, each rank only its share
    (runtime/materialize.py): ``init=fn`` calls ``fn(module)`` on each module (as ``model.apply`` does),
    ``init="path"`` loads a checkpoint, and without ``init=`` the model's own initialisers run
    (``reset_parameters``, Hugging Face's ``_init_weights``), each module under torch's generator
    seeded from ``(init_seed, module path)`` (default seed: ``torch.initial_seed()``), so every plan
    starts from the same values.

    >>> import usc, torch
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> step = usc.compile(TinyLlama(), "dp=1", example_inputs=batch)
    >>> isinstance(step.step(*batch), float)
    True
    """
    compiled = Compiled(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                        lr_scheduler=lr_scheduler, hardware=hardware, init=init, init_seed=init_seed)
    compiled.device = device
    # this rank takes its share now and lets go of the model -- except a meta-built model without init=,
    # whose first use decides: load(path) fills it from a checkpoint, step() runs its own initialisers
    if compiled._can_make_rank() and (init is not None or not has_meta_tensors(model)):
        compiled._rank()
    return compiled


def simulate(model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None,
             optimizer: OptimizerFactory | None = None, device: str | torch.device = "cpu",
             lr_scheduler: SchedulerFactory | None = None, hardware=None,
             init: InitFn | str | os.PathLike | None = None, init_seed: int | None = None) -> Simulated:
    """Compile ``model`` and run every rank of the mesh in this process (``hardware``, ``init``,
    ``init_seed``: as for ``usc.compile``; ``init`` applies to a model built on the meta device).

    >>> import usc
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> sim = usc.simulate(TinyLlama(), "dp=2 tp=2", example_inputs=batch)
    >>> isinstance(sim.step(*batch), float)
    True
    """
    return Simulated(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer, device=device,
                     lr_scheduler=lr_scheduler, hardware=hardware, init=init, init_seed=init_seed)


def lint(model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None, hardware=None, optimizer=None) -> Report:
    """Compile without running anything and return the report (what ``usc-lint`` prints), with the
    lint findings in ``report.findings`` (codes USC1xx errors, USC2xx warnings, USC3xx notes).

    Works for meshes of any size and for models on the ``meta`` device (no weights allocated). A plan
    that does not compile raises its PlanError / CompileError. ``hardware`` ("h100", "a100", a profile
    file or a HardwareProfile) adds the cost model's time breakdown (``report.cost``): compute, exposed
    communication and bubble per step, tokens/s, MFU; memory is checked against it (default h100).
    ``optimizer``: the factory ``compile`` will get; one that groups parameters by name
    (``usc.training.param_groups``) keeps each group in gradient buckets of its own, listed so.
    """
    from .linting import first_error, lint_plan

    result = lint_plan(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, hardware=hardware or "h100",
                       optimizer=optimizer)
    if result.report is None:
        if not result.exceptions:  # refused by a lint check before compiling: the compiler's own words
            _Compiled(model, result.plan, example_inputs=example_inputs, loss_fn=loss_fn, traced=result.traced,
                      optimizer=optimizer)
        raise first_error(result)
    result.compiled._attach_cost(result.compiled.flat_batch((example_inputs,)), hardware)
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

    model = trainable(model, loss_fn)
    batch = model.flatten(example_inputs)
    return choose(model, _as_plan(spec) if not isinstance(spec, str) else spec, batch, hardware=hardware, keep=keep)


__all__ = ["compile", "simulate", "lint", "plan", "parse_plan", "Compiled", "Simulated", "Report", "PlanError",
           "CompileError", "Plan"]
