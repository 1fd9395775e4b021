"""ZeRO stage 3 (Rajbhandari et al. 2020): parameters live as 1/dp slices and are gathered per
layer just before use, then dropped; autograd's saved copies are re-gathered in backward.

Graph nodes (inserted by passes/zero3.py, bound to a rank like the collectives):
- ``ZeroFetch(axis, group)``: launches one async all-gather of a layer's parameter slices laid
  end to end, and returns the in-flight buffer. The pass places the fetch of layer i+1 before
  layer i's first use, so the transfer overlaps layer i's compute (prefetch).
- ``ZeroGather(axis, group, shapes)``: waits for a fetch, copies the gathered rows into one buffer
  where each parameter is contiguous, and hands out the full parameters as views of it. Backward:
  the layer's gradients are reduce-scattered into the slices in one collective.

Freeing: the executor runs forward under ``saved_tensors_hooks(registry.pack, registry.unpack)``;
a tensor autograd saves that lives in a gathered buffer is replaced by a small token, and backward
gathers the layer again once, on the first unpack. So between forward uses only the current and
the prefetched layer are whole on a rank; ``registry.peak_live_groups`` records it. A step costs
three collectives per layer (gather, re-gather, reduce-scatter), whatever its parameter count.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from .collectives import CollectiveNode
from .reducer import pad_to_multiple
from .sizes import shape_bytes


@dataclass
class Zero3Registry:
    """Per rank: which storages hold gathered parameters, and how many layers are whole at once.

    A layer group's parameters are gathered into one buffer (``GroupBuffer``), so a tensor autograd
    saves from it is packed as a small ``_Regather`` token, and backward gathers the whole group
    again once, on the first unpack; later unpacks of the same group reuse that buffer until the
    group's gradients have been reduce-scattered (``release``)."""

    live: dict[str, int] = field(default_factory=dict)  # group -> live gathered buffers
    peak_live_groups: int = 0
    sources: dict[int, "GroupSource"] = field(default_factory=dict)  # storage ptr -> its group's slices
    regathered: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> buffer gathered for backward

    def track(self, group: str, buf: torch.Tensor, source: "GroupSource | None" = None) -> None:
        """Count ``buf`` as a whole copy of ``group`` while it lives; with ``source``, tensors saved
        from it are dropped after forward and gathered again in backward."""
        self.live[group] = self.live.get(group, 0) + 1
        self.peak_live_groups = max(self.peak_live_groups, sum(1 for n in self.live.values() if n))
        ptr = buf.untyped_storage()._cdata  # unique per storage, fake tensors included
        if source is not None:
            self.sources[ptr] = source
        weakref.finalize(buf.untyped_storage(), self._freed, group, ptr)

    def _freed(self, group: str, ptr: int) -> None:
        self.live[group] -= 1
        self.sources.pop(ptr, None)

    def pack(self, t: torch.Tensor):
        source = self.sources.get(t.untyped_storage()._cdata) if isinstance(t, torch.Tensor) else None
        if source is None:
            return t
        return _Regather(self, source, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    @staticmethod
    def unpack(packed):
        return packed.load() if isinstance(packed, _Regather) else packed

    def gather_again(self, source: "GroupSource") -> torch.Tensor:
        """The group's gathered buffer for backward: one all-gather, shared by every saved tensor."""
        buf = self.regathered.get(source.group)
        if buf is None:
            buf = source.gather()
            self.regathered[source.group] = buf
            self.track(source.group, buf)
        return buf

    def release(self, group: str) -> None:
        """The group's backward is done: drop its re-gathered buffer."""
        self.regathered.pop(group, None)

    def reset(self) -> None:
        """After a failed step: forget the buffers gathered for a backward that never finished."""
        self.regathered.clear()


@dataclass(frozen=True)
class GroupSource:
    """What gathering one layer group needs: the group, its communicator, its slices, its shapes."""

    group: str
    comm: object
    shards: tuple
    shapes: tuple

    def gather(self) -> torch.Tensor:
        gathered = self.comm.all_gather(flat_slices(self.shards), 0)
        return copy_out(gathered, self.shards, self.shapes, self.comm.size)


def flat_slices(shards) -> torch.Tensor:
    """This rank's slices of one group, end to end: what one all-gather sends."""
    dtypes = {s.dtype for s in shards}
    if len(dtypes) != 1:
        raise TypeError(f"ZeRO-3 gathers one layer's parameters in one buffer, but they have dtypes "
                        f"{sorted(map(str, dtypes))}; give the layer's parameters one dtype")
    return torch.cat([s.detach().reshape(-1) for s in shards])


def copy_out(gathered: torch.Tensor, shards, shapes, n: int) -> torch.Tensor:
    """Rearrange an all-gather of ``flat_slices`` into one buffer holding each full (padded)
    parameter contiguously: the gathered rows are ranks, and parameter i is column block i of every
    row, in rank order. Returns the buffer; parameter i starts at sum of the padded sizes before it."""
    rows = gathered.view(n, -1)
    sizes = [s.numel() for s in shards]
    out = gathered.new_empty(n * sum(sizes))
    start = column = 0
    for size in sizes:
        out[start: start + n * size].view(n, size).copy_(rows[:, column: column + size])
        start, column = start + n * size, column + size
    return out


def views(buf: torch.Tensor, shards, shapes, n: int) -> list[torch.Tensor]:
    """The full parameters as views of a ``copy_out`` buffer."""
    outs, start = [], 0
    for shard, shape in zip(shards, shapes):
        outs.append(buf[start: start + math.prod(shape)].view(shape))
        start += n * shard.numel()
    return outs


@dataclass
class _Regather:
    """A saved gathered parameter, dropped after forward; its group is gathered again (once) when
    backward unpacks it."""

    registry: Zero3Registry
    source: GroupSource
    size: tuple
    stride: tuple
    offset: int

    def load(self) -> torch.Tensor:
        return self.registry.gather_again(self.source).as_strided(self.size, self.stride, self.offset)


class _Fetch:
    def __init__(self, gathered: torch.Tensor, work, shards: tuple) -> None:
        self.gathered, self.work, self.shards = gathered, work, shards


class ZeroFetch(CollectiveNode):
    """Start the all-gather of one layer group's slices, as one flat buffer (async); ZeroGather
    waits for it. One collective per layer, not per parameter: each costs a fixed latency."""

    kind = "all-gather"

    def __init__(self, axis: str, group: str, shapes: list[tuple[int, ...]] = (),
                 wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(axis)
        self.group, self.shapes = group, [tuple(s) for s in shapes]
        # the executor hands the graph its state in the plan's compute dtype (bf16 plans: bfloat16),
        # so the slices travel in it; None: the parameters' own dtype
        self.wire_dtype = wire_dtype

    registry: Zero3Registry | None = None

    def forward(self, *shards: torch.Tensor) -> _Fetch:
        gathered, work = self.comm.all_gather(flat_slices(shards), 0, async_op=True)
        if self.registry is not None:  # the buffer exists from now on, even while in flight
            self.registry.track(self.group, gathered)
        return _Fetch(gathered, work, shards)

    def global_fn(self, *shards):
        return None

    def forward_collective(self) -> str:
        return "all-gather"

    def traffic(self, local_shape, dtype, n) -> list[tuple]:
        """The payload one rank hands the all-gather: its slices of the layer's parameters."""
        if n == 1:
            return []
        numel, dtype = slice_numel(self.shapes, n), self.wire_dtype or dtype
        return [("forward", "all-gather", (numel,), shape_bytes((numel,), dtype), 1)]

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, group={self.group!r}"


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fetch: _Fetch, node: "ZeroGather", *shards: torch.Tensor):
        ctx.node = node
        fetch.work.wait()
        n = node.comm.size
        buf = copy_out(fetch.gathered, shards, node.shapes, n)
        if node.registry is not None:
            node.registry.track(node.group, buf, GroupSource(node.group, node.comm, shards, node.shapes))
        return tuple(views(buf, shards, node.shapes, n))

    @staticmethod
    def backward(ctx, *grads):
        """One reduce-scatter for the whole layer group, as FSDP2 does (a collective per parameter
        costs a fixed latency each): every padded gradient is viewed [size, slice] and the views are
        concatenated along dim 1, so rank r's chunk of the flat buffer is its slice of each gradient
        in turn; the same elementwise sums as one reduce-scatter per parameter."""
        node = ctx.node
        comm = node.comm
        if node.registry is not None:
            node.registry.release(node.group)
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

    def __init__(self, axis: str, group: str, shapes: list[tuple[int, ...]], regather: bool = True,
                 wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(axis)
        self.group, self.shapes = group, [tuple(s) for s in shapes]
        self.regather = regather  # some op saves one of these parameters: backward gathers the layer again
        self.wire_dtype = wire_dtype  # as ZeroFetch's: gradients of the compute-dtype copies too
        self.registry: Zero3Registry | None = None

    def forward(self, fetch: _Fetch, *shards: torch.Tensor):
        return _GatherFn.apply(fetch, self, *shards)

    def global_fn(self, fetch, *shards):
        return tuple(torch.empty(s, device="meta") for s in self.shapes)

    def backward_collective(self) -> str:
        return "reduce-scatter"

    def traffic(self, local_shape, dtype, n) -> list[tuple]:
        """Backward: the gradients reduce-scattered, and the parameters gathered again when some op
        saved one (an embedding table is not: its gradient needs only the indices)."""
        if n == 1:
            return []
        padded, mine = slice_numel(self.shapes, n) * n, slice_numel(self.shapes, n)
        dtype = self.wire_dtype or dtype
        scatter = [("backward", "reduce-scatter", (padded,), shape_bytes((padded,), dtype), 1)]
        return scatter + ([("backward", "all-gather", (mine,), shape_bytes((mine,), dtype), 1)] if self.regather else [])

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, group={self.group!r}, params={len(self.shapes)}"


def slice_numel(shapes, n: int) -> int:
    """Elements of one rank's slices of these parameters (each padded to a multiple of n)."""
    return sum(-(-math.prod(shape) // n) for shape in shapes)


def shard_of(local: torch.Tensor, comm) -> torch.Tensor:
    """This rank's 1/dp slice of a (padded, flattened) local parameter."""
    flat = pad_to_multiple(local.detach().reshape(-1), comm.size)
    size = flat.numel() // comm.size
    return flat[comm.rank * size: (comm.rank + 1) * size].clone()


def unshard(shard: torch.Tensor, shape, comm) -> torch.Tensor:
    """The local (dp-whole) parameter from every rank's slice (a collective)."""
    return comm.all_gather(shard.detach(), 0)[: math.prod(shape)].view(shape)
