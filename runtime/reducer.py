"""Bucketed gradient all-reduce for data parallelism, overlapped with the backward pass.

The scheme of PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", sec. 3.2): parameters are packed into buckets of about `bucket_bytes` in
REVERSE order of the list, since gradients arrive roughly in reverse order of use; the moment the
last gradient of a bucket is accumulated (a post-accumulate-grad hook, which fires once per leaf
after all uses are summed, so tied weights are handled) the bucket is flattened and an async
all-reduce is launched while backward goes on. `finish()` waits, writes the sums back into
`param.grad`, and resets for the next step.

A parameter may need its gradient summed over several mesh axes (e.g. dp and cp). The first axis
is reduced from the hook; the following ones are issued by finish() in launch order. That keeps
the order of collectives on every group identical on all ranks without the hook having to block
(NCCL requires the same order on every rank of a group; a completion-driven order would not be).

Limitation: every rank of a group must produce gradients for the same parameters in a step (a
bucket launched in backward on one rank and in finish() on another would reorder the
collectives). Parameters without a gradient on ALL ranks are fine: they count as zeros.

Example::

    reducer = GradReducer([(n, p, ("dp",)) for n, p in model.named_parameters()], mesh,
                          bucket_bytes=25 * 2**20)
    loss.backward()       # buckets are launched during this call
    reducer.finish()      # now every p.grad holds the sum over dp
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .comm import Work
from .timeline import SpanToken, Timeline

if TYPE_CHECKING:
    from .mesh import Mesh

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb


@dataclass(eq=False)
class _Bucket:
    """Parameters reduced together: same axes, dtype and device; contiguous in one flat buffer."""

    index: int
    axes: tuple[str, ...]
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)  # id(param) of gradients arrived this step
    flat: torch.Tensor | None = None
    buffer: torch.Tensor | None = None  # the flat gradients, reused every step (all-reduce in place)
    work: Work | None = None
    stage: int = 0  # number of axes launched so far
    span: SpanToken | None = None
    shard: str | None = None  # ZeRO: this axis is reduce-scattered; the bucket keeps one slice
    shard_grad: torch.Tensor | None = None  # after finish(): this rank's slice of the summed gradient
    deferred: bool = False  # launched by finish() only: its gradients are final only then (``deferred``)
    # ZeRO-2 (scatter_each): the shard axis is reduce-scattered in every microbatch's backward, even
    # under no_sync; the slices sent this step (output, Work, span) and their sum so far
    eager: bool = False
    sent: list = field(default_factory=list)
    partial: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.params)

    @property
    def launched(self) -> bool:
        return self.flat is not None

    def names(self) -> list[str]:
        return [name for name, _ in self.params]


def pad_to_multiple(flat: torch.Tensor, n: int) -> torch.Tensor:
    """Zero-pad a flat buffer so it splits into n equal slices (ZeRO's partitioning)."""
    extra = (-flat.numel()) % n
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat


def _is_view_of(t: torch.Tensor, piece: torch.Tensor) -> bool:
    """``t`` occupies exactly ``piece``'s elements (a gradient attached as a bucket view)."""
    return (t.untyped_storage()._cdata == piece.untyped_storage()._cdata  # _cdata: fake tensors too
            and t.storage_offset() == piece.storage_offset() and t.numel() == piece.numel() and t.is_contiguous())


def _grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def joint(axes: tuple[str, ...], comms) -> tuple[str, ...]:
    """Two axes the mesh also offers as one group ('dp' and 'ep' -> 'dp+ep') are reduced at once."""
    for name in comms:
        if "+" in name and all(a in axes for a in name.split("+")):
            first = min(axes.index(a) for a in name.split("+"))
            rest = [a for a in axes if a not in name.split("+")]
            axes = tuple(rest[:first]) + (name,) + tuple(rest[first:])
    return axes


def _build_buckets(
    params: Sequence[tuple[str, nn.Parameter, Sequence[str]]], mesh: Mesh, bucket_bytes: int,
    group_of: Callable[[str], int] | None = None, deferred: Collection[str] = (),
) -> list[_Bucket]:
    """Pack in reverse list order; one open bucket per (axes, dtype, device, optimizer group,
    deferred or not), closed when full (a ZeRO slice of a bucket is one optimizer parameter: one
    group; a deferred parameter's bucket is launched by finish only, so it holds no other).

    Axes of size 1 are dropped; parameters left with no axis (or no grad) need no reduction.
    """
    buckets: list[_Bucket] = []
    open_by_key: dict[tuple, _Bucket] = {}
    seen: set[int] = set()
    for name, param, axes in reversed(list(params)):
        reduce_axes = joint(tuple(a for a in axes if mesh.size(a) > 1), mesh.comms)
        if id(param) in seen or not param.requires_grad or not reduce_axes:
            continue
        seen.add(id(param))
        key = (reduce_axes, param.dtype, param.device, group_of(name) if group_of is not None else 0,
               name in deferred)
        if key not in open_by_key:
            open_by_key[key] = _Bucket(len(buckets), reduce_axes, deferred=name in deferred)
            buckets.append(open_by_key[key])
        bucket = open_by_key[key]
        bucket.params.append((name, param))
        if bucket.nbytes >= bucket_bytes:
            del open_by_key[key]
    return buckets


class GradReducer:
    """Sums gradients over mesh axes in buckets launched during backward (see module doc).

    `params`: (name, parameter, axes) with the mesh axes over which that gradient is summed.
    """

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter, Sequence[str]]],
        mesh: Mesh,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeline: Timeline | None = None,
        scatter_axis: str | None = None,
        scatter_each: bool = False,
        wire_dtype: torch.dtype | None = None,
        group_of: Callable[[str], int] | None = None,
        deferred: Collection[str] = (),
    ):
        """scatter_axis (ZeRO): buckets reduced over this axis are reduce-scattered over it first
        (padded to a multiple of its size); each rank keeps only its slice in `bucket.shard_grad`
        and the parameters' full gradients are dropped.
        scatter_each (ZeRO-2): those buckets are reduce-scattered in every microbatch's backward
        (no_sync does not hold them back) and the slices summed, so no full gradient outlives its
        bucket's send; the other axes are reduced once, on the summed slice, by finish(). A bucket
        whose gradients are all there is sent from the hook; one that is not (a parameter this
        microbatch left without a gradient, two of this rank's stages sharing the bucket) keeps
        accumulating and is sent with what it has at its next full arrival or by finish(): every
        gradient is in exactly one send, so the sum is the same.
        deferred: names of parameters whose gradient is final only when the step ends (a pipeline's
        weights summed over pp first); they are packed in buckets of their own, launched by finish().
        """
        self.mesh = mesh
        self.timeline = timeline
        self.wire_dtype = wire_dtype  # reduce_dtype=bf16: sums travel in bf16, halving the bytes
        self.buckets = _build_buckets(params, mesh, bucket_bytes, group_of, deferred)
        if scatter_axis is not None and mesh.size(scatter_axis) > 1:
            for bucket in self.buckets:
                if scatter_axis in bucket.axes:
                    bucket.shard = scatter_axis
                    bucket.eager = scatter_each
                    bucket.axes = (scatter_axis,) + tuple(a for a in bucket.axes if a != scatter_axis)
        self._bucket_of = {id(p): b for b in self.buckets for _, p in b.params}
        self._launch_order: list[_Bucket] = []
        self._sync = True
        self.launched_during_backward = 0  # buckets launched from hooks in the current step
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for b in self.buckets
            for _, p in b.params
        ]

    @property
    def scatters_each(self) -> bool:
        """Some bucket is reduce-scattered in every microbatch (ZeRO-2)."""
        return any(b.eager for b in self.buckets)

    def __repr__(self) -> str:
        sizes = [len(b.params) for b in self.buckets]
        return f"GradReducer({len(self.buckets)} buckets, params per bucket {sizes})"

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches but the last); nothing is launched but
        ZeRO-2's reduce-scatters (scatter_each), which run in every microbatch."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish(self) -> int:
        """Launch what backward did not, wait for all, write sums into param.grad, reset.

        Returns how many buckets had been launched during backward (the overlap achieved).
        """
        for bucket in self.buckets:
            if bucket.eager:  # overlapped: everything it got was sent from backward's hooks
                if bucket.partial is None and not bucket.sent or any(p.grad is not None for _, p in bucket.params):
                    self._send_slice(bucket)
                else:
                    self.launched_during_backward += 1
            elif not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:  # in index order, the same on every rank
            if bucket.eager:
                self._settle(bucket)
                # the other axes' sums travel in the wire dtype too (_write_back converts back)
                summed = bucket.partial if self.wire_dtype is None else bucket.partial.to(self.wire_dtype)
                bucket.flat, bucket.partial, bucket.stage = summed, None, 1
                if self._advance(bucket):
                    self._launch_order.append(bucket)
        self._complete_all()
        overlapped = self.launched_during_backward
        self._reset()
        return overlapped

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------------------ internals
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.eager:
            bucket.ready.add(id(param))
            if len(bucket.ready) == len(bucket.params) and not bucket.deferred:
                self._send_slice(bucket)
            return
        if not self._sync:
            return
        if bucket.launched or id(param) in bucket.ready:
            name = next(n for n, p in bucket.params if p is param)
            raise RuntimeError(
                f"GradReducer: {name!r} received a second gradient in the same step; call "
                f"reducer.finish() after each backward, or run earlier micro-batches under "
                f"reducer.no_sync()"
            )
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and not bucket.deferred:
            self._launch(bucket)
            self.launched_during_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        """Flatten the bucket's gradients (missing ones as zeros) and reduce over its first axis."""
        if bucket.shard is None:
            bucket.flat = self._fill_buffer(bucket)
            if self.wire_dtype is not None and bucket.flat.dtype != self.wire_dtype:
                bucket.flat = bucket.flat.to(self.wire_dtype)
        else:
            bucket.flat = self._take_for_scatter(bucket)
        if self.timeline is not None:
            bucket.span = self.timeline.begin(f"grad-bucket{bucket.index}{list(bucket.axes)}", "comm")
        self._launch_next_axis(bucket)
        self._launch_order.append(bucket)

    def slices(self) -> list[torch.Tensor]:
        """The gradient slices the reducer holds: ZeRO's reduced slices, and between ZeRO-2's
        microbatches the slices summed so far and those still in flight."""
        return [t for b in self.buckets for t in (b.shard_grad, b.partial, *(sent[0] for sent in b.sent))
                if t is not None]

    def settle(self) -> None:
        """ZeRO-2, after a microbatch's backward: wait for its reduce-scatters and sum their slices,
        so between microbatches a rank holds one summed slice per bucket (on a GPU the wait orders
        the compute stream after the sends; the host does not block)."""
        for bucket in self.buckets:
            if bucket.eager:
                self._settle(bucket)

    def _send_slice(self, bucket: _Bucket) -> None:
        """ZeRO-2: reduce-scatter the gradients the bucket's parameters hold now (missing ones as
        zeros) and drop them; the slice is summed into ``bucket.partial`` by ``_settle``. The
        bucket's earlier send (an earlier microbatch's, long done) is summed first, so a bucket holds
        one slice in flight and their sum, not one slice per microbatch."""
        self._settle(bucket)
        flat = self._take_for_scatter(bucket)
        span = None if self.timeline is None else self.timeline.begin(
            f"grad-bucket{bucket.index}[{bucket.shard}]", "comm")
        out, work = self.mesh.comm(bucket.shard).reduce_scatter(flat, 0, async_op=True)
        bucket.sent.append((out, work, span))
        bucket.ready.clear()

    def _take_for_scatter(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's gradients (missing ones as zeros) in one flat tensor of the wire dtype, padded
        to a multiple of the shard axis; the parameters' own gradients are dropped (ZeRO keeps only
        this rank's slice of the sum)."""
        flat = torch.cat([_grad_or_zeros(p).reshape(-1) for _, p in bucket.params])
        if self.wire_dtype is not None and flat.dtype != self.wire_dtype:
            flat = flat.to(self.wire_dtype)
        for _, p in bucket.params:
            p.grad = None
        return pad_to_multiple(flat, self.mesh.size(bucket.shard))

    def _settle(self, bucket: _Bucket) -> None:
        """Wait for the bucket's sent slices and sum them (in the parameters' dtype)."""
        dtype = bucket.params[0][1].dtype
        for out, work, span in bucket.sent:
            work.wait()
            out = out.to(dtype)
            bucket.partial = out if bucket.partial is None else bucket.partial.add_(out)
            if span is not None and self.timeline is not None:
                self.timeline.end(span)
        bucket.sent = []

    def _fill_buffer(self, bucket: _Bucket) -> torch.Tensor:
        """The gradients copied into the bucket's own flat buffer, allocated once and reused: a
        fresh buffer every step costs page faults on CPU (a new mmap of the whole bucket) and
        allocator churn on GPU; DDP keeps its buckets for the same reason (Li et al. 2020, 3.2.3)."""
        if bucket.buffer is None:
            first = bucket.params[0][1]
            numel = sum(p.numel() for _, p in bucket.params)
            bucket.buffer = torch.empty(numel, dtype=self.wire_dtype or first.dtype, device=first.device)
        offset = 0
        for _, param in bucket.params:
            piece = bucket.buffer[offset: offset + param.numel()]
            if param.grad is None:
                piece.zero_()
            elif not _is_view_of(param.grad, piece):
                piece.copy_(param.grad.reshape(-1))
            offset += param.numel()
        return bucket.buffer

    def attach_grad_views(self) -> None:
        """Zero each bucket's buffer and make the parameters' ``.grad`` views of it (DDP's
        gradient_as_bucket_view): backward then accumulates straight into the bucket, so neither
        the copy into the bucket before the all-reduce nor the copy back after it happens.
        Call after the optimizer dropped the gradients (buckets whose sums travel in another
        dtype, or that ZeRO reduce-scatters, keep their own gradients)."""
        for bucket in self.buckets:
            if bucket.buffer is None or bucket.shard is not None or bucket.buffer.dtype != bucket.params[0][1].dtype:
                continue
            bucket.buffer.zero_()
            offset = 0
            for _, param in bucket.params:
                param.grad = bucket.buffer[offset: offset + param.numel()].view_as(param)
                offset += param.numel()

    def _launch_next_axis(self, bucket: _Bucket) -> None:
        axis = bucket.axes[bucket.stage]
        comm = self.mesh.comm(axis)
        if axis == bucket.shard:
            bucket.flat, bucket.work = comm.reduce_scatter(bucket.flat, 0, async_op=True)
        else:
            # bucket.flat is the reducer's own buffer (or a reduce-scatter's fresh output): sum in place
            bucket.flat, bucket.work = comm.all_reduce(bucket.flat, "sum", async_op=True, inplace=True)
        bucket.stage += 1

    def _complete_all(self) -> None:
        """Wait for each bucket in launch order; issue its next axis or write it back."""
        pending = list(self._launch_order)
        while pending:
            still_running = []
            for bucket in pending:
                bucket.work.wait()
                if self._advance(bucket):
                    still_running.append(bucket)
            pending = still_running

    def _advance(self, bucket: _Bucket) -> bool:
        """A bucket whose last send is done: reduce it over its next axis (True), or, with every
        axis summed, write the sum back (False)."""
        if bucket.stage < len(bucket.axes):
            self._launch_next_axis(bucket)
            return True
        self._write_back(bucket)
        return False

    def _write_back(self, bucket: _Bucket) -> None:
        if self.wire_dtype is not None:
            bucket.flat = bucket.flat.to(bucket.params[0][1].dtype)
        if bucket.shard is not None:
            bucket.shard_grad = bucket.flat
            if bucket.span is not None and self.timeline is not None:
                self.timeline.end(bucket.span)
            return
        offset = 0
        for _, param in bucket.params:
            reduced = bucket.flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            if param.grad is None:
                param.grad = reduced.clone()
            elif not _is_view_of(param.grad, reduced):
                param.grad.copy_(reduced)
        if bucket.span is not None and self.timeline is not None:
            self.timeline.end(bucket.span)

    def reset(self) -> None:
        """After a failed step: forget launched reductions and arrived gradients (waits for nothing;
        the simulator's groups are reset apart, a real group's pending work is dropped with it)."""
        self._sync = True
        for bucket in self.buckets:
            bucket.shard_grad = None
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.sent, bucket.partial = [], None
            bucket.flat, bucket.work, bucket.stage, bucket.span = None, None, 0, None
        self._launch_order = []
        self.launched_during_backward = 0
