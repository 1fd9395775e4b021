"""ZeRO stage 3 (Rajbhandari et al. 2020): parameters live as 1/dp slices and are gathered per
layer just before use, then dropped; autograd's saved copies are re-gathered in backward.

Graph nodes (inserted by passes/zero3.py, bound to a rank like the collectives):
- ``ZeroFetch(axis, group)``: launches async all-gathers of one layer's parameter slices and
  returns the in-flight buffers. The pass places the fetch of layer i+1 before layer i's first
  use, so the transfer overlaps layer i's compute (prefetch).
- ``ZeroGather(axis, group, shapes)``: waits for a fetch and hands out the full parameters (views
  of the gathered buffers). Backward: the full gradients are reduce-scattered into the slices.

Freeing: the executor runs forward under ``saved_tensors_hooks(registry.pack, registry.unpack)``;
a tensor autograd saves that lives in a gathered buffer is replaced by a small token and gathered
again when backward needs it. So between forward uses only the current and the prefetched
layer are whole on a rank; ``registry.peak_live_groups`` records it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from .collectives import CollectiveNode
from .reducer import pad_to_multiple


@dataclass
class Zero3Registry:
    """Per rank: which storages are gathered parameters, and how many layers are whole at once."""

    live: dict[str, int] = field(default_factory=dict)  # group -> live gathered buffers
    peak_live_groups: int = 0
    sources: dict[int, tuple] = field(default_factory=dict)  # storage ptr -> (comm, shard, group)

    def gathered(self, group: str, buf: torch.Tensor, comm, shard: torch.Tensor) -> None:
        self.live[group] = self.live.get(group, 0) + 1
        self.peak_live_groups = max(self.peak_live_groups, sum(1 for n in self.live.values() if n))
        ptr = buf.untyped_storage()._cdata  # unique per storage, fake tensors included
        self.sources[ptr] = (comm, shard, group)
        weakref.finalize(buf.untyped_storage(), self._freed, group, ptr)

    def _freed(self, group: str, ptr: int) -> None:
        self.live[group] -= 1
        self.sources.pop(ptr, None)

    def pack(self, t: torch.Tensor):
        source = self.sources.get(t.untyped_storage()._cdata) if isinstance(t, torch.Tensor) else None
        if source is None:
            return t
        return _Regather(source[0], source[1], tuple(t.shape), tuple(t.stride()), t.storage_offset())

    @staticmethod
    def unpack(packed):
        return packed.load() if isinstance(packed, _Regather) else packed


@dataclass
class _Regather:
    """A saved gathered parameter, dropped after forward; gathered again when backward unpacks it."""

    comm: object
    shard: torch.Tensor
    size: tuple
    stride: tuple
    offset: int

    def load(self) -> torch.Tensor:
        full = self.comm.all_gather(self.shard.detach(), 0)
        return full.as_strided(self.size, self.stride, self.offset)


class _Fetch:
    def __init__(self, pending: list[tuple[torch.Tensor, object]]) -> None:
        self.pending = pending


class ZeroFetch(CollectiveNode):
    """Start the all-gathers of one layer group's slices (async); ZeroGather waits for them."""

    kind = "all-gather"

    def __init__(self, axis: str, group: str, numel: int = 0) -> None:
        super().__init__(axis)
        self.group, self.numel = group, numel

    registry: Zero3Registry | None = None

    def forward(self, *shards: torch.Tensor) -> _Fetch:
        pending = [self.comm.all_gather(s.detach(), 0, async_op=True) for s in shards]
        if self.registry is not None:  # the buffers exist from now on, even while in flight
            for (buf, _), shard in zip(pending, shards):
                self.registry.gathered(self.group, buf, self.comm, shard)
        return _Fetch(pending)

    def global_fn(self, *shards):
        return None

    def forward_collective(self) -> str:
        return "all-gather"

    def traffic(self, local_shape, dtype, n) -> list[tuple]:
        """Filled in by the pass: the group's gathered bytes (the slices times n)."""
        return [("forward", "all-gather", (self.numel,), self.numel * _itemsize(dtype), 1)] if n > 1 else []

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, group={self.group!r}"


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fetch: _Fetch, node: "ZeroGather", *shards: torch.Tensor):
        ctx.node, ctx.numels = node, [math.prod(s) for s in node.shapes]
        outs = []
        for (buf, work), shard, shape, n in zip(fetch.pending, shards, node.shapes, ctx.numels):
            work.wait()
            outs.append(buf[:n].view(shape))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        """One reduce-scatter for the whole layer group, as FSDP2 does (a collective per parameter
        costs a fixed latency each): every padded gradient is viewed [size, slice] and the views are
        concatenated along dim 1, so rank r's chunk of the flat buffer is its slice of each gradient
        in turn; the same elementwise sums as one reduce-scatter per parameter."""
        comm = ctx.node.comm
        present = [i for i, grad in enumerate(grads) if grad is not None]
        if not present:
            return (None, None, *grads)
        rows = [pad_to_multiple(grads[i].reshape(-1), comm.size).view(comm.size, -1) for i in present]
        mine = comm.reduce_scatter(torch.cat(rows, dim=1).reshape(-1), 0)
        shard_grads: list[torch.Tensor | None] = [None] * len(grads)
        for i, piece in zip(present, mine.split([r.shape[1] for r in rows])):
            shard_grads[i] = piece
        return (None, None, *shard_grads)


class ZeroGather(CollectiveNode):
    """The full parameters of one layer group from a ZeroFetch; backward reduce-scatters grads."""

    kind = "reduce-scatter"

    def __init__(self, axis: str, group: str, shapes: list[tuple[int, ...]]) -> None:
        super().__init__(axis)
        self.group, self.shapes = group, [tuple(s) for s in shapes]
        self.registry: Zero3Registry | None = None

    def forward(self, fetch: _Fetch, *shards: torch.Tensor):
        return _GatherFn.apply(fetch, self, *shards)

    def global_fn(self, fetch, *shards):
        return tuple(torch.empty(s, device="meta") for s in self.shapes)

    def backward_collective(self) -> str:
        return "reduce-scatter"

    def traffic(self, local_shape, dtype, n) -> list[tuple]:
        """Backward: the gradients reduce-scattered, and the saved parameters gathered again."""
        numel = sum(math.prod(s) for s in self.shapes)
        if n == 1:
            return []
        return [("backward", "reduce-scatter", (numel,), numel * _itemsize(dtype), 1),
                ("backward", "all-gather", (numel,), numel * _itemsize(dtype), 1)]

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, group={self.group!r}, params={len(self.shapes)}"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shard_of(local: torch.Tensor, comm) -> torch.Tensor:
    """This rank's 1/dp slice of a (padded, flattened) local parameter."""
    flat = pad_to_multiple(local.detach().reshape(-1), comm.size)
    size = flat.numel() // comm.size
    return flat[comm.rank * size: (comm.rank + 1) * size].clone()


def unshard(shard: torch.Tensor, shape, comm) -> torch.Tensor:
    """The local (dp-whole) parameter from every rank's slice (a collective)."""
    return comm.all_gather(shard.detach(), 0)[: math.prod(shape)].view(shape)
