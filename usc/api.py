"""The public face: ``usc.compile``, ``usc.simulate``, ``usc.lint``. It strings the stages together
(dsl -> compiler -> passes -> runtime) and holds no logic of its own beyond that."""

from __future__ import annotations

import os

import torch
from torch import nn

from usc.compiler.errors import CompileError
from usc.compiler.report import Report
from usc.dsl import Plan, PlanError, parse_plan
from usc.runtime import checkpoint
from usc.runtime.executor import RankExecutor
from usc.runtime.mesh import Mesh, run_in_threads, simulated_meshes
from usc.runtime.moe import summarize
from usc.runtime.timeline import Timeline

from .build import OptimizerFactory, _as_plan, _Compiled, _full_state, _WithLoss, as_batch


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
        return self._executor

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

    def step(self, *batch, trace: str | None = None) -> float:
        """One optimizer step on the global batch; returns the global mean loss."""
        self._ensure_built(batch)
        rank = self._rank()
        timeline = Timeline(rank.mesh.rank) if trace else None
        rank.set_timeline(timeline)
        try:
            return rank.step(batch)
        finally:
            rank.set_timeline(None)
            if timeline is not None:
                self._report.exposed_comm_seconds = timeline.exposed_comm_seconds()
                path = trace if rank.mesh.world_size == 1 else _rank_path(trace, rank.mesh.rank)
                timeline.to_chrome_trace(path)

    def __call__(self, *batch) -> float:
        """The global mean loss on ``batch`` without updating anything."""
        self._ensure_built(batch)
        return self._rank().evaluate(batch)

    def activation_bytes(self, *batch) -> int:
        """Measured bytes of activations this rank saves for backward in one forward."""
        self._ensure_built(batch)
        return self._rank().activation_bytes(batch)

    def save(self, path: str | os.PathLike) -> None:
        """Write model and optimizer state with torch.distributed.checkpoint (every rank calls it;
        rank 0 writes). The checkpoint is plan-independent: load it under any plan."""
        rank = self._rank()
        tensors, meta = rank.checkpoint_state()
        if rank.mesh.rank == 0:
            checkpoint.write(path, tensors, {**meta, "plan": str(self.plan)})
        _barrier()

    def load(self, path: str | os.PathLike) -> None:
        """Read a checkpoint saved under any plan; this rank takes its shards."""
        if self._program is None:
            raise RuntimeError("compile with example_inputs= (or call step() once) before load()")
        tensors, meta = checkpoint.read_all(path)
        self._rank().load_checkpoint_state(tensors, meta)

    def moe_stats(self) -> dict:
        """This rank's view of each MoE layer over the last step (loads of its own experts, the
        all-to-all bytes it sent); ``usc.simulate(...).moe_stats()`` combines every rank's."""
        return summarize([self._rank().moe_stats()])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors under the model's own state_dict names (a collective call)."""
        full = self._rank().full_state_dict()
        return {k: full[k] for k in self._user_model.state_dict() if k in full}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank_path(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Simulated(_Compiled):
    """Every rank of the mesh in this process (one thread per rank, in-memory collectives)."""

    def __init__(self, model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None,
                 optimizer: OptimizerFactory | None = None) -> None:
        if example_inputs is None:
            raise TypeError("usc.simulate needs example_inputs=(...) (the global batch)")
        super().__init__(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer)
        self._ensure_built(())
        self.meshes = simulated_meshes(tuple(self.plan.mesh_axes), tuple(self.plan.mesh_shape), timeout=self.timeout)
        state = _full_state(self.model, self._traced)
        self.ranks = [self._make_executor(mesh, state, optimizer) for mesh in self.meshes]

    def _run(self, fn) -> list:
        return run_in_threads(self.meshes, lambda mesh: fn(self.ranks[mesh.rank]), timeout=self.timeout)

    def step(self, *batch, trace: str | None = None) -> float:
        timeline = Timeline(0) if trace else None
        for rank in self.ranks:
            rank.set_timeline(timeline)
        try:
            return self._run(lambda rank: rank.step(batch))[0]
        finally:
            for rank in self.ranks:
                rank.set_timeline(None)
            if timeline is not None:
                self._report.exposed_comm_seconds = max(
                    timeline.exposed_comm_seconds(rank=r) for r in range(len(self.ranks)))
                timeline.to_chrome_trace(trace)

    def __call__(self, *batch) -> float:
        return self._run(lambda rank: rank.evaluate(batch))[0]

    def memory_bytes(self) -> list[dict[str, int]]:
        """Measured bytes held per rank in parameters, gradients and optimizer state."""
        return [rank.memory_bytes() for rank in self.ranks]

    def activation_bytes(self, *batch) -> list[int]:
        """Measured bytes of activations saved for backward by one forward, per rank."""
        return self._run(lambda rank: rank.activation_bytes(batch))

    def save(self, path: str | os.PathLike) -> None:
        """Write model and optimizer state with torch.distributed.checkpoint; loads under any plan."""
        tensors, meta = self._run(lambda rank: rank.checkpoint_state())[0]
        checkpoint.write(path, tensors, {**meta, "plan": str(self.plan)})

    def load(self, path: str | os.PathLike) -> None:
        """Read a checkpoint saved under any plan; every rank takes its shards."""
        tensors, meta = checkpoint.read_all(path)
        for rank in self.ranks:
            rank.load_checkpoint_state(tensors, meta)

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
            optimizer: OptimizerFactory | None = None) -> Compiled:
    """Compile ``model`` for the mesh in ``plan`` and return this torchrun process's program.

    >>> import usc, torch
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> step = usc.compile(TinyLlama(), "dp=1", example_inputs=batch)
    >>> isinstance(step.step(*batch), float)
    True
    """
    return Compiled(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer)


def simulate(model: nn.Module, plan: str | Plan, *, example_inputs, loss_fn=None,
             optimizer: OptimizerFactory | None = None) -> Simulated:
    """Compile ``model`` and run every rank of the mesh in this process.

    >>> import usc
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> sim = usc.simulate(TinyLlama(), "dp=2 tp=2", example_inputs=batch)
    >>> isinstance(sim.step(*batch), float)
    True
    """
    return Simulated(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer)


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


__all__ = ["compile", "simulate", "lint", "plan", "parse_plan", "Compiled", "Simulated", "Report", "PlanError",
           "CompileError", "Plan"]
