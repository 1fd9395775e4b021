"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020) over the data-parallel axis.

The gradient reducer's buckets are the partition: each bucket's parameters are laid out
contiguously in one flat buffer (the parameters become views into it), padded to a multiple of
dp, and rank r owns slice r of every bucket. The optimizer the user's factory builds sees one
"master" parameter per bucket — a view of this rank's slice, so it costs no extra memory — plus
the parameters that are not reduced over dp. An element-wise optimizer (Adam, AdamW, SGD with
momentum) on the slices equals the full update exactly.

Both stages reduce-scatter the gradients over dp (the reducer's scatter_axis: each rank receives
only the sum of its own slice, half an all-reduce's bytes), each rank steps its slice, then the
updated slices are all-gathered into every rank's parameters: together the bytes of plain data
parallelism's all-reduce. Under dtype=bf16 the slices travel in bfloat16 (``gather_dtype``), as
Megatron's distributed optimizer and nanotron gather their bf16 working weights: half the bytes.
A rank's own slice keeps its float32 values (the master); the other slices hold the bf16 values
the forward casts to anyway, so every forward computes what a float32 gather would give. What
reads the weights whole reads them exact: a save and ``full_state_dict`` first gather the float32
slices (``exact()``), and the replica guard compares the copies in bf16, the values they share.

The two stages differ in what a rank holds while microbatches accumulate:
Stage 1: full gradients accumulate locally; one reduce-scatter per bucket, in the last
microbatch's backward.
Stage 2: every microbatch's gradients are reduce-scattered in its own backward and the slices
accumulate; a full gradient lives only until its bucket is sent.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .reducer import GradReducer, pad_to_multiple
from .training import NamedParameters



def gathered_in(weights, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype ZeRO-1/2 gather the updated slices in: the compute dtype where it is narrower than
    every weight dtype (bf16 under float32 or float64 weights: the forward casts them to it anyway),
    else None -- the weights' own. The report lists the gather by the same rule."""
    narrower = compute_dtype is not None and all(
        w.is_floating_point and w.itemsize > compute_dtype.itemsize for w in weights)
    return compute_dtype if narrower else None

class ZeroOptimizer:
    """Wraps the user's optimizer so it only holds state for this rank's slices."""

    def __init__(self, reducer: GradReducer, axis: str, factory: Callable[[Iterable], torch.optim.Optimizer],
                 other_params: list[nn.Parameter], build: Callable | None = None,
                 gather_dtype: torch.dtype | None = None) -> None:
        """Stages 1 and 2 differ only in the reducer (``scatter_each``); this wrapper is the same.
        ``gather_dtype``: the compute dtype the updated slices travel in (None: their own)."""
        self.reducer, self.axis = reducer, axis
        self.comm = reducer.mesh.comm(axis)
        self.buckets = [b for b in reducer.buckets if axis in b.axes]
        self.flats: list[torch.Tensor] = []
        self.masters: list[nn.Parameter] = []
        for bucket in self.buckets:
            flat, master = self._partition(bucket)
            self.flats.append(flat)
            self.masters.append(master)
        sharded = {id(p) for b in self.buckets for _, p in b.params}
        rest = [p for p in other_params if id(p) not in sharded]
        named = dict(zip(map(id, other_params), other_params.names)) if isinstance(other_params, NamedParameters) \
            else {}
        names = [tuple(named.get(id(p), (n,))[0] for n, p in b.params) for b in self.buckets] + \
            [named.get(id(p), ()) for p in rest]
        # build: the executor's (a rank with nothing to train still gets an optimizer)
        self.inner = (build or (lambda f, p: f(p)))(factory, NamedParameters(self.masters + rest, names))
        self.gather_dtype = gathered_in([f.dtype for f in self.flats], gather_dtype)
        self.rounded = False  # other ranks' slices hold gather_dtype values (exact() restores them)
        self._sliced = sharded

    def _partition(self, bucket) -> tuple[torch.Tensor, nn.Parameter]:
        """One flat buffer per bucket; parameters become views into it; the master is my slice."""
        flat = pad_to_multiple(torch.cat([p.detach().reshape(-1) for _, p in bucket.params]), self.comm.size)
        offset = 0
        for _, param in bucket.params:
            param.data = flat[offset: offset + param.numel()].view_as(param)
            offset += param.numel()
        size = flat.numel() // self.comm.size
        master = nn.Parameter(flat[self.comm.rank * size: (self.comm.rank + 1) * size])
        return flat, master

    @property
    def param_groups(self):
        return self.inner.param_groups

    def _slice_grads(self) -> None:
        """The reducer reduce-scattered each bucket over dp: its slice is this master's gradient."""
        for bucket, master in zip(self.buckets, self.masters):
            master.grad = bucket.shard_grad
            bucket.shard_grad = None

    def step(self) -> None:
        self._slice_grads()
        self.inner.step()
        self._gather(self.gather_dtype)

    def exact(self) -> None:
        """Every slice back to its owner's float32 values (a float32 gather; a no-op unless the
        last step gathered in the compute dtype). Every rank of the dp group calls it."""
        if self.rounded:
            self._gather(None)

    def _gather(self, dtype: torch.dtype | None) -> None:
        rank, n = self.comm.rank, self.comm.size
        for flat, master in zip(self.flats, self.masters):
            mine = master.detach()
            gathered = self.comm.all_gather(mine if dtype is None else mine.to(dtype), 0)
            rows, got = flat.view(n, -1), gathered.view(n, -1)
            rows[:rank].copy_(got[:rank])  # my own slice keeps its exact values
            rows[rank + 1:].copy_(got[rank + 1:])
        self.rounded = dtype is not None

    def agreed_dtype(self, param: torch.Tensor) -> torch.dtype | None:
        """The dtype in which ``param``'s dp copies agree, where they do not agree exactly (after a
        compute-dtype gather: each rank's own slice keeps its float32 values); None: exactly."""
        return self.gather_dtype if self.rounded and id(param) in self._sliced else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for state in self.inner.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def optimizer_state_examples(optimizer, state_specs) -> dict[str, torch.Tensor]:
    """The state the user's optimizer keeps per parameter (key -> an example value), from one step
    of a fresh copy on a one-element probe of the model's trainable dtype. A rank with nothing to
    train (a frozen pipeline stage) learns the keys its peers hold this way, to join their
    checkpoint collectives."""
    inner = getattr(optimizer, "inner", optimizer)
    dtype = next((s.dtype for s in state_specs if s.kind == "param" and s.trainable), torch.float32)
    probe = nn.Parameter(torch.zeros(1, dtype=dtype))
    fresh = type(inner)([probe], **inner.defaults)
    probe.grad = torch.zeros_like(probe)
    fresh.step()
    return dict(fresh.state[probe])
