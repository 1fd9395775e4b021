"""Memory counted from outside usc: what a training step really keeps alive for backward, and the
peak a piece of work (a checkpoint save) allocates.

usc's own numbers (the lint's ``activation_bytes``, the cost model's estimate) come from its
executor's saved-tensor hooks or from the cost model's profile; a test that compares them with
each other proves nothing. This counter shares nothing with them: a ``TorchDispatchMode`` on the
rank's thread sees every ATen op of one step, holds each storage an op reads or makes by weak
reference (so it keeps nothing alive) and sums the bytes of those still alive -- the allocator's
view of activation memory, whatever mechanism (autograd's saved tensors, activation
checkpointing's held inputs, a selective policy's cache) holds them.

- ``held_after_forward``: bytes of the storages forward touched (model state and the batch
  excluded) still alive when backward begins;
- ``peak_in_backward``: the most bytes alive at once during backward of those plus the tensors
  backward recomputes (activation checkpointing). An op runs for recomputation when autograd's
  engine is running (a graph task is active) with grad mode on: the engine runs backward formulas
  with grad mode off, and checkpointing recomputes under ``enable_grad``.

``PeakAllocations`` counts what torch ops allocate inside it (a view of an existing tensor allocates
nothing), alive at once: its ``peak``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FORWARD, BACKWARD, DONE = "forward", "backward", "done"


@dataclass(frozen=True)
class ActivationCount:
    held_after_forward: int
    peak_in_backward: int


class _LiveStorages:
    """A running total of the bytes of the storages recorded and still alive."""

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref] = {}
        self.total = 0
        self._lock = threading.Lock()  # a storage may die on another thread (a simulated peer's)

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata  # an address: reused once a storage dies, so a dead entry is replaced
        old = self.refs.get(key)
        if old is not None and old() is not None:
            return
        nbytes = storage.nbytes()
        with self._lock:
            self.total += nbytes
        self.refs[key] = weakref.ref(storage, lambda _, n=nbytes: self._forget(n))

    def _forget(self, nbytes: int) -> None:
        with self._lock:
            self.total -= nbytes


class _StepWatch(TorchDispatchMode):
    """Records the storages of forward's ops, then of backward's recomputation, and the peak."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded
        self.live = _LiveStorages()
        self.phase = FORWARD
        self.held_after_forward = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and self.phase == FORWARD:
            self.phase, self.held_after_forward = BACKWARD, self.live.total
        elif not in_backward and self.phase == BACKWARD:
            self.phase = DONE  # the optimizer step and the gradient sums are not activations
        out = func(*args, **(kwargs or {}))
        if self.phase == FORWARD or (self.phase == BACKWARD and torch.is_grad_enabled()):
            self._record((args, kwargs, out))
        if self.phase == BACKWARD:
            self.peak = max(self.peak, self.live.total)
        return out

    def _record(self, values) -> None:
        for value in tree_flatten(values)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                storage = value.untyped_storage()
                if storage._cdata not in self.excluded:
                    self.live.add(storage)


class _ComputeSpans:
    """Stands in for an executor's timeline: knows whether the rank's thread is inside one of the
    step's forward or backward computations (``forward``/``backward``; a pipeline's ``F3``, ``B3``,
    ``I3``, ``W3``) -- not the loss sums, gradient reductions or optimizer step around them."""

    def __init__(self) -> None:
        self.depth = 0
        self.input_pass = False  # inside a zero-bubble input-gradient pass (``I3``)
        self.after_input_pass = lambda: None

    @contextlib.contextmanager
    def span(self, name: str, category: str, **_):
        compute = name in ("forward", "backward") or (name[:1] in "FBIW" and name[1:].isdigit())
        self.depth += compute
        if compute:  # a span inside one (a send) leaves it as it is
            self.input_pass = name[:1] == "I"
        try:
            yield
        finally:
            self.depth -= compute
            if compute and name[:1] == "I":
                self.input_pass = False
                self.after_input_pass()


class _WholeStepWatch(TorchDispatchMode):
    """Records the storages the step's forwards (and backward's recomputation) touch, any schedule,
    and the most of them alive at once. A zero-bubble input-gradient pass (``I``) also keeps what it
    makes for the weight pass (the output gradients it records): its outputs are recorded, and the
    peak is read when it ends -- its own working set is backward's, as a plain backward's is not
    counted. The parameters' gradients the weight pass accumulates (``.grad.add_``, run with grad
    mode on) are state, not activations."""

    def __init__(self, excluded: set[int], spans: _ComputeSpans, params=()) -> None:
        super().__init__()
        self.excluded, self.spans, self.params = excluded, spans, list(params)
        self.live = _LiveStorages()
        self.peak = 0
        spans.after_input_pass = self._read_peak

    def _read_peak(self) -> None:
        self.peak = max(self.peak, self.live.total)

    def _into_a_gradient(self, func, args) -> bool:
        if not func._schema.is_mutable or not args or not isinstance(args[0], torch.Tensor):
            return False
        target = args[0].untyped_storage()._cdata
        return any(p.grad is not None and p.grad.untyped_storage()._cdata == target for p in self.params)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.spans.depth and torch.is_grad_enabled():  # backward formulas run with grad mode off
            if self._into_a_gradient(func, args):
                return out
            for value in tree_flatten((args, kwargs, out))[0]:
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    storage = value.untyped_storage()
                    if storage._cdata not in self.excluded:
                        self.live.add(storage)
            self.peak = max(self.peak, self.live.total)
        elif self.spans.input_pass:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor) and value.device.type != "meta" \
                        and value.untyped_storage()._cdata not in self.excluded:
                    self.live.add(value.untyped_storage())
        return out


class PeakAllocations(TorchDispatchMode):
    """Bytes of the storages torch ops allocate inside the mode, alive at once (``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = _LiveStorages()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata not in inputs:
                self.live.add(value.untyped_storage())
        self.peak = max(self.peak, self.live.total)
        return out


def count_step_activations(rank, batch: tuple) -> ActivationCount:
    """Run one training step of an executor rank (``usc.simulate(...).ranks[i]``, on that rank's
    thread) under the counter; the step is real (the optimizer steps)."""
    excluded = {t.untyped_storage()._cdata for t in [*rank.state.values(), *batch] if isinstance(t, torch.Tensor)}
    watch = _StepWatch(excluded)
    with watch:
        rank.step(batch)
    return ActivationCount(watch.held_after_forward, max(watch.peak, watch.held_after_forward))


def count_step_peak(rank, batch: tuple) -> int:
    """The most activation bytes one training step of an executor rank holds at once, whatever its
    schedule (a pipeline's microbatches in flight included): the storages its forwards and
    backward's recomputations touch -- model state, gradients and the batch excluded -- alive at
    once, counted inside the step's forward and backward computations (the executor's spans), not
    the gradient sums and optimizer step after them. The step is real (the optimizer steps)."""
    state = [*rank.state.values(), *batch, *(p.grad for p in rank.params if p.grad is not None)]
    excluded = {t.untyped_storage()._cdata for t in state if isinstance(t, torch.Tensor)}
    spans, timeline = _ComputeSpans(), rank.timeline
    watch = _WholeStepWatch(excluded, spans, rank.params)
    rank.timeline = spans
    try:
        with watch:
            rank.step(batch)
    finally:
        rank.timeline = timeline
    return watch.peak


def count_peaks(sim, batch: tuple, *, timeout: float = 120) -> list[int]:
    """Per rank of a simulated mesh: ``count_step_peak`` of one training step."""
    from usc.runtime.mesh import run_in_threads

    return run_in_threads(sim.meshes, lambda mesh: count_step_peak(sim.ranks[mesh.rank], batch), timeout=timeout)


def count_activations(sim, batch: tuple, *, timeout: float = 120) -> list[ActivationCount]:
    """Per rank of a simulated mesh: one training step counted (see the module docstring)."""
    from usc.runtime.mesh import run_in_threads

    return run_in_threads(sim.meshes, lambda mesh: count_step_activations(sim.ranks[mesh.rank], batch),
                          timeout=timeout)


__all__ = ["ActivationCount", "PeakAllocations", "count_activations", "count_peaks", "count_step_activations",
           "count_step_peak"]
