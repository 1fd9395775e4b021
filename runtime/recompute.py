"""Recompute regions: a piece of a transformer block run under activation checkpointing.

The compiler (passes/recompute.py) cuts a region out of the per-rank program into its own
GraphModule (``body``) and names, per node, whether backward keeps its output or recomputes it.
``Recompute`` runs the body under ``torch.utils.checkpoint`` (non-reentrant): autograd keeps only
the region's inputs, and the first time backward needs a tensor saved inside the region, the body
runs again to produce it (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

Selective recompute (Korthikanti et al. 2022, sec. 5) keeps the outputs of the matmul nodes: a
selective-checkpoint policy (``create_selective_checkpoint_contexts``) stores the result of the
matmul kernels (mm/addmm/bmm) issued while a kept node runs, and hands them back when the body
is recomputed, so norms, rotary embeddings, activations and attention are recomputed from them.

What the compiler guarantees (so the runtime needs no special cases):
- no op drawing from torch's generator is inside a region, so the RNG state need not be saved
  and restored -- which the simulator's threads, sharing one generator, could not do safely; usc's
  counter-based draws (every dropout mask) may be: a draw recomputed from its key, which enters the
  region as an input, gives the forward's numbers;
- ZeRO-3's gathers are outside: gathered parameters enter as region inputs, are saved through the
  executor's saved-tensor hooks (dropped, re-gathered in backward) like any saved parameter;
- collectives inside a region are re-issued when backward recomputes it (recompute=full), in the
  same program order on every rank; selective regions contain none that communicate in forward.
  Non-reentrant checkpointing stops a recomputation once the tensors backward needs exist (early
  stop); every rank runs the same program, so every rank stops at the same node and the re-issued
  collectives still pair up. A collective after the region's last saving op is therefore not
  re-issued (``passes.recompute.reissued_in_backward`` names those that are; the report counts them).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .op_classes import MATMUL_KERNELS  # the kernels whose outputs a kept matmul node stores



_kept_observer: contextvars.ContextVar[Callable[[torch.Tensor], None] | None] = \
    contextvars.ContextVar("usc_kept_observer", default=None)


@contextlib.contextmanager
def observe_kept(fn: Callable[[torch.Tensor], None]):
    """Call ``fn`` on every tensor a selective policy keeps (they bypass saved-tensor hooks, so
    the executor's activation measurement learns of them here)."""
    token = _kept_observer.set(fn)
    try:
        yield
    finally:
        _kept_observer.reset(token)


class _Current(threading.local):
    node: str | None = None


class _NodeTracking(fx.Interpreter):
    """Runs the body node by node, recording which node is running (for the policy)."""

    def __init__(self, body: fx.GraphModule, current: _Current) -> None:
        super().__init__(body)
        self.current = current

    def run_node(self, n: fx.Node):
        self.current.node = n.name
        try:
            return super().run_node(n)
        finally:
            self.current.node = None


class Recompute(nn.Module):
    """One recompute region: ``body`` runs under non-reentrant checkpointing.

    kept: names of body nodes whose matmul outputs are stored (selective); empty means the whole
    region is recomputed from its inputs (full). ``label`` is the block it came from.
    """

    def __init__(self, body: fx.GraphModule, *, kept: tuple[str, ...] = (), label: str = "") -> None:
        super().__init__()
        self.body = body
        self.kept = tuple(kept)
        self.label = label
        self._current = _Current()

    def forward(self, *args):
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, so nothing to recompute
            return self.body(*args)
        context = self._selective_contexts if self.kept else _no_contexts
        # preserve_rng_state=False: no region draws from torch's generator (module docstring)
        return checkpoint(self._run, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context)

    def _run(self, *args):
        if not self.kept:
            return self.body(*args)
        return _NodeTracking(self.body, self._current).run(*args)

    def _selective_contexts(self):
        return create_selective_checkpoint_contexts(self._policy)

    def _policy(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in MATMUL_KERNELS and self._current.node in self.kept:
            observer = _kept_observer.get()
            if observer is not None and isinstance(ctx.op_output, torch.Tensor):
                observer(ctx.op_output)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_current"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._current = _Current()

    def extra_repr(self) -> str:
        mode = f"selective, kept={list(self.kept)}" if self.kept else "full"
        return f"{self.label!r}, {mode}"


def _no_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()
