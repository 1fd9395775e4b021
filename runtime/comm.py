"""Collectives over ONE group of ranks along one mesh axis, on real process groups or in memory.

`Comm` is the interface the rest of the runtime talks to; it owns what every backend shares:
argument checks, per-kind call and byte counters (`comm.stats`), timeline spans, and turning any
backend failure into a CollectiveError that names the rank, collective, axis and group.

- `ProcessGroupComm` runs torch.distributed on a ProcessGroup (gloo on CPU, NCCL on CUDA).
- `ThreadComm` is the in-process simulator's backend: every rank of the mesh is a thread of one
  process and the ranks of a group meet in a shared `ThreadGroup`. Each rank computes its result
  from all ranks' inputs in rank order, so all ranks get bitwise identical sums.

All methods take local tensors and return new ones; inputs are never modified (except by
`all_reduce(..., inplace=True)`, which sums into a buffer the caller owns). `peer` and `rank`
are indices inside the group; `group_ranks` maps them to global ranks.

Example (a group of one, which is what a size-1 mesh axis gets)::

    comm = solo_comm("tp", global_rank=0, timeout=30.0)
    assert torch.equal(comm.all_reduce(torch.ones(2)), torch.ones(2))
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from .errors import CollectiveContext, CollectiveError, CollectiveTimeout
from .timeline import SpanToken, Timeline

ReduceOp = Literal["sum", "max"]
_TORCH_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

# torch 2.9 renamed the tensor-in/tensor-out collectives; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Per-kind call counts and payload bytes issued by one rank on one group.

    Bytes are the size of the local tensor this rank hands to the collective (for recv: the
    tensor received); the wire traffic of a ring algorithm is a known multiple of it. Groups of
    size one move nothing and count 0 bytes.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class Work:
    """A launched collective: `wait()` blocks until the result tensor is valid.

    wait() is idempotent; a failure is re-raised on every later wait().
    """

    def __init__(self, wait_fn: Callable[[], None] | None = None, poll_fn: Callable[[], bool] | None = None):
        self._wait_fn = wait_fn
        self._poll_fn = poll_fn
        self._done = wait_fn is None
        self._error: BaseException | None = None

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
        if self._done:
            return
        try:
            self._wait_fn()
        except BaseException as exc:
            self._error = exc
            raise
        self._done = True

    def is_completed(self) -> bool:
        """True once wait() would return at once (the transfer is done, or was waited for)."""
        return self._done or (self._poll_fn is not None and self._poll_fn())


def _all_of(works: Sequence[Work]) -> Work:
    """One Work that waits for all of `works`."""
    def wait() -> None:
        for work in works:
            work.wait()

    return Work(wait, lambda: all(work.is_completed() for work in works))


def _normalize_dim(t: torch.Tensor, dim: int, kind: str) -> int:
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise ValueError(f"{kind}: dim {dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# What a backend raises when a transfer fails: torch.distributed's DistError family and gloo/NCCL
# failures are RuntimeErrors, a dead peer's socket an OSError. Anything else raised inside a launch
# (ValueError, TypeError, NotImplementedError, ...) is a local bug and propagates as itself.
TRANSFER_FAILURES = (RuntimeError, OSError)
LOCAL_BUGS = (NotImplementedError,)  # RuntimeError subclasses that no transfer raises
# How gloo words a timeout in a RuntimeError: "Timed out waiting 5000ms for recv operation to
# complete", "Operation timed out!". A message that merely mentions a timeout setting is not one.
TIMED_OUT = re.compile(r"\btimed out\b", re.IGNORECASE)


def _is_transfer_failure(exc: BaseException) -> bool:
    return isinstance(exc, TRANSFER_FAILURES) and not isinstance(exc, LOCAL_BUGS)


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or (isinstance(exc, RuntimeError) and bool(TIMED_OUT.search(str(exc))))


class Comm(ABC):
    """Collectives over one group along one mesh axis (see the module docstring)."""

    def __init__(self, *, axis: str, rank: int, group_ranks: Sequence[int], timeout: float):
        self.axis = axis
        self.rank = rank
        self.group_ranks = tuple(group_ranks)
        self.size = len(self.group_ranks)
        self.timeout = float(timeout)
        self.stats = CommStats()
        self.timeline: Timeline | None = None  # None: no recording overhead

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axis={self.axis!r}, rank={self.rank}, group_ranks={self.group_ranks})"

    @property
    def global_rank(self) -> int:
        return self.group_ranks[self.rank]

    # ----------------------------------------------------------------- public collectives
    def all_reduce(self, t: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False, *,
                   inplace: bool = False) -> Any:
        """Elementwise sum (or max) over the group; every rank gets the same tensor.

        inplace=True (the one exception to "inputs are never modified"): the caller hands over a
        contiguous buffer it owns and gets the sum back in that same tensor, saving the copy of
        the input (the gradient buckets reuse one buffer every step, as DDP's do)."""
        if op not in _TORCH_REDUCE_OPS:
            raise ValueError(f"all_reduce: op must be one of {sorted(_TORCH_REDUCE_OPS)}, got {op!r}")
        if inplace and not t.is_contiguous():
            raise ValueError("all_reduce(inplace=True) needs a contiguous tensor")
        launch = self._all_reduce_into if inplace else self._all_reduce
        return self._run("all-reduce", t, async_op, lambda: launch(t, op, async_op))

    def all_gather(self, t: torch.Tensor, dim: int, async_op: bool = False) -> Any:
        """Concatenate every rank's tensor along `dim`, in group-rank order."""
        dim = _normalize_dim(t, dim, "all_gather")
        return self._run("all-gather", t, async_op, lambda: self._all_gather(t, dim, async_op))

    def reduce_scatter(self, t: torch.Tensor, dim: int, async_op: bool = False) -> Any:
        """Sum over the group, then keep this rank's chunk along `dim` (size divisible by group)."""
        dim = _normalize_dim(t, dim, "reduce_scatter")
        self._check_divisible(t, dim, "reduce_scatter")
        return self._run("reduce-scatter", t, async_op, lambda: self._reduce_scatter(t, dim, async_op))

    def all_to_all(self, t: torch.Tensor, split_dim: int, cat_dim: int) -> torch.Tensor:
        """Split along split_dim into `size` even chunks, send chunk j to rank j, concat received
        chunks along cat_dim in rank order (the Ulysses / expert-parallel exchange)."""
        split_dim = _normalize_dim(t, split_dim, "all_to_all")
        cat_dim = _normalize_dim(t, cat_dim, "all_to_all")
        self._check_divisible(t, split_dim, "all_to_all")
        return self._run("all-to-all", t, False, lambda: self._all_to_all(t, split_dim, cat_dim))

    def all_to_all_single(
        self, t: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]
    ) -> torch.Tensor:
        """Uneven exchange along dim 0: rows in_splits[j] go to rank j; out_splits[i] come from i."""
        self._check_splits(t, list(out_splits), list(in_splits))
        return self._run(
            "all-to-all", t, False, lambda: self._all_to_all_single(t, list(out_splits), list(in_splits))
        )

    def send(self, t: torch.Tensor, peer: int, async_op: bool = False, tag: int = 0) -> Work | None:
        """Send to the group member `peer`; matched by a recv(like, this rank, tag) there (messages
        with one tag between one pair match in order; NCCL ignores tags and matches in post order). With async_op the call returns at once with
        a Work (keep `t` alive until it is waited for): a pipeline must not block on a send whose
        receiver is itself still sending."""
        self._check_peer(peer)
        self._check_tag(tag)
        result = self._run("send/recv", t, async_op, lambda: self._send(t, peer, tag))
        return result[1] if async_op else None

    def recv(self, like: torch.Tensor, peer: int, tag: int = 0) -> torch.Tensor:
        """Receive a tensor shaped and typed like `like` from the group member `peer`, sent with `tag`."""
        self._check_peer(peer)
        self._check_tag(tag)
        return self._run("send/recv", like, False, lambda: self._recv(like, peer, tag))

    def send_recv(self, t: torch.Tensor, to_peer: int, from_peer: int, async_op: bool = False) -> Any:
        """Send t to `to_peer` and receive a tensor like t from `from_peer`, both at once (one ring
        step). With async_op the transfer runs while the caller computes: (tensor, Work)."""
        self._check_peer(to_peer)
        self._check_peer(from_peer)
        return self._run("send/recv", t, async_op, lambda: self._send_recv(t, to_peer, from_peer))

    def _send_recv(self, t: torch.Tensor, to_peer: int, from_peer: int) -> tuple[torch.Tensor, Work]:
        """Both halves posted as one batch before either is waited for, so a ring of them cannot
        deadlock (on NCCL: one group call)."""
        (buf,), received, sent = self._batch_p2p([(t, to_peer)], [(t, from_peer)])

        def wait() -> None:
            sent.wait()
            received.wait()

        return buf, Work(wait)

    def batch_p2p(self, sends: Sequence[tuple[torch.Tensor, int]],
                  recvs: Sequence[tuple[torch.Tensor, int]]) -> tuple[list[torch.Tensor], Work]:
        """Post sends (tensor, peer) and receives (like, peer) as one batch, then wait for the
        receives; returns (received tensors, Work of the sends: keep their tensors alive and wait
        before the step ends).

        No tags: messages between one pair of ranks match in post order, and both peers post in
        an order they derive from the same schedule. One batch is one NCCL group call, so a
        rank's sends never block its own receives (unbatched NCCL send/recv would)."""
        for _, peer in [*sends, *recvs]:
            self._check_peer(peer)
        nbytes = sum(_nbytes(t) for t, _ in sends) + sum(_nbytes(t) for t, _ in recvs)
        out = self._run("send/recv", None, False, lambda: self._batch_wait_receives(list(sends), list(recvs)),
                        nbytes=nbytes)
        received, sent = out
        return received, self._traced("send/recv", sent, None)

    def _batch_wait_receives(self, sends: list, recvs: list) -> tuple[tuple[list, Work], Work]:
        received, recv_work, send_work = self._batch_p2p(sends, recvs)
        return (received, send_work), recv_work

    def _batch_p2p(self, sends: list, recvs: list) -> tuple[list[torch.Tensor], Work, Work]:
        """(received buffers, Work of the receives, Work of the sends); backends that have a
        batched call override this (ProcessGroupComm: batch_isend_irecv)."""
        sent = [self._send(t, peer, 0)[1] for t, peer in sends]
        later = [self._recv_later(like, peer) for like, peer in recvs]
        return [buf for buf, _ in later], _all_of([w for _, w in later]), _all_of(sent)

    def _recv_later(self, like: torch.Tensor, peer: int) -> tuple[torch.Tensor, Work]:
        return self._recv(like, peer, 0)

    def barrier(self) -> None:
        """Block until every member of the group has reached the barrier."""
        self._run("barrier", None, False, self._barrier)

    def abort(self, reason: str) -> None:
        """Wake every rank blocked on this group with a CollectiveError (simulator only)."""

    # ------------------------------------------------------------------ backend interface
    # Each returns (result, Work); result is valid after Work.wait().
    @abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: str, async_op: bool) -> tuple[torch.Tensor, Work]: ...

    def _all_reduce_into(self, t: torch.Tensor, op: str, async_op: bool) -> tuple[torch.Tensor, Work]:
        """The sum written into t itself; backends that can reduce in place override this."""
        out, work = self._all_reduce(t, op, async_op)

        def wait() -> None:
            work.wait()
            t.copy_(out)

        return t, Work(wait, work.is_completed)

    @abstractmethod
    def _all_gather(self, t: torch.Tensor, dim: int, async_op: bool) -> tuple[torch.Tensor, Work]: ...

    @abstractmethod
    def _reduce_scatter(self, t: torch.Tensor, dim: int, async_op: bool) -> tuple[torch.Tensor, Work]: ...

    @abstractmethod
    def _all_to_all(self, t: torch.Tensor, split_dim: int, cat_dim: int) -> tuple[torch.Tensor, Work]: ...

    @abstractmethod
    def _all_to_all_single(
        self, t: torch.Tensor, out_splits: list, in_splits: list
    ) -> tuple[torch.Tensor, Work]: ...

    @abstractmethod
    def _send(self, t: torch.Tensor, peer: int, tag: int) -> tuple[None, Work]: ...

    @abstractmethod
    def _recv(self, like: torch.Tensor, peer: int, tag: int) -> tuple[torch.Tensor, Work]: ...

    @abstractmethod
    def _barrier(self) -> tuple[None, Work]: ...

    # ---------------------------------------------------------------------- shared plumbing
    def context(self, kind: str) -> CollectiveContext:
        return CollectiveContext(self.global_rank, kind, self.axis, self.group_ranks, self.timeout)

    def _run(self, kind: str, t: torch.Tensor | None, async_op: bool, launch: Callable, *,
             nbytes: int | None = None) -> Any:
        """Count, trace, launch and (unless async) wait; transfer failures become CollectiveErrors."""
        self.stats.record(kind, (_nbytes(t) if nbytes is None else nbytes) if self.size > 1 else 0)
        token = self._begin_span(kind, async_op)
        try:
            out, work = self._guard(kind, launch)
        except BaseException:
            self._end_span(token)
            raise
        work = self._traced(kind, work, token)
        if async_op:
            return out, work
        work.wait()
        return out.contiguous() if isinstance(out, torch.Tensor) else out

    def _guard(self, kind: str, fn: Callable) -> Any:
        try:
            return fn()
        except CollectiveError:
            raise
        except Exception as exc:
            if not _is_transfer_failure(exc):
                raise
            error = CollectiveTimeout if _is_timeout(exc) else CollectiveError
            raise error(self.context(kind), f"{type(exc).__name__}: {exc}") from exc

    def _traced(self, kind: str, work: Work, token: SpanToken | None) -> Work:
        """A Work whose wait() also wraps errors and closes the span (end = when waited for)."""

        def wait() -> None:
            try:
                self._guard(kind, work.wait)
            finally:
                self._end_span(token)

        return Work(wait, work.is_completed)

    def _begin_span(self, kind: str, async_op: bool = True) -> SpanToken | None:
        """Async work is "comm" (compute may run under it); a blocking call is "comm-sync": the
        caller waits through it, so no compute span around it counts as overlapping it."""
        if self.timeline is None or self.size == 1:
            return None
        category = "comm" if async_op else "comm-sync"
        return self.timeline.begin(f"{kind}[{self.axis}]", category, rank=self.global_rank)

    def _end_span(self, token: SpanToken | None) -> None:
        if token is not None and self.timeline is not None:
            self.timeline.end(token)

    def _check_divisible(self, t: torch.Tensor, dim: int, kind: str) -> None:
        if t.shape[dim] % self.size:
            raise ValueError(
                f"{kind} over mesh axis {self.axis!r}: dim {dim} of shape {tuple(t.shape)} is not "
                f"divisible by the group size {self.size}; pad it or choose a divisible mesh"
            )

    def _check_splits(self, t: torch.Tensor, out_splits: list, in_splits: list) -> None:
        if len(out_splits) != self.size or len(in_splits) != self.size:
            raise ValueError(
                f"all_to_all_single: need {self.size} out and in splits, got {out_splits}, {in_splits}"
            )
        if t.dim() == 0 or sum(in_splits) != t.shape[0]:
            raise ValueError(
                f"all_to_all_single: in_splits {in_splits} do not add up to dim 0 of {tuple(t.shape)}"
            )

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < 2**31:
            raise ValueError(f"a message tag must be an int in [0, 2**31), got {tag!r}")

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"peer {peer} is not in the group along {self.axis!r} (size {self.size})")


# The longest a CPU wait blocks before it looks at the clock and lets Python run a signal handler:
# Ctrl-C (which Python handles only between bytecodes, never inside one C++ `work.wait(timeout)`)
# ends the wait within this. A collective that completes wakes its waiter at once (its future's
# callback sets the event waited on), whatever the slice.
WAIT_SLICE_SECONDS = 0.01


def wait_in_slices(work: Any, timeout: float) -> None:
    """Wait for a torch Work, woken the moment it completes (its future's callback), raising
    TimeoutError past `timeout`; a signal handler runs at least every WAIT_SLICE_SECONDS. A Work
    without a future is waited for beside (``_wait_beside``)."""
    if not _tracks_completion(work):
        _wait_beside(work, timeout)
        return
    if not work.is_completed():
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        deadline = time.monotonic() + timeout
        while not done.wait(WAIT_SLICE_SECONDS):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no completion within {timeout:g}s")
    work.wait()  # completed: returns at once, or raises the transfer's error


def _tracks_completion(work: Any) -> bool:
    """Whether is_completed() ever turns true: a Work without a future (gloo's reduce-scatter, built
    from other collectives) reports False even after it finished."""
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


def _wait_beside(work: Any, timeout: float) -> None:
    """A Work that cannot be polled (gloo's send, recv and reduce-scatter) is waited for by a helper
    thread, its one blocking C++ wait, while this thread waits on an Event in slices: a signal reaches
    the caller at once (the helper, a daemon, is left to the dying process)."""
    done, outcome = threading.Event(), {}

    def wait() -> None:
        try:
            outcome["completed"] = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=wait, name="usc-wait", daemon=True).start()
    while not done.wait(WAIT_SLICE_SECONDS * 10):
        pass
    if "error" in outcome:
        raise outcome["error"]
    if not outcome["completed"]:
        raise TimeoutError(f"no completion within {timeout:g}s")


# =============================================================================== torch.distributed
class ProcessGroupComm(Comm):
    """torch.distributed collectives on one ProcessGroup (gloo on CPU, NCCL on CUDA).

    CPU (gloo): sync calls wait with `timeout` (a dead peer shows up as a connection error at
    once). CUDA: async calls run on a side 'comm' stream so they overlap the compute stream (the
    pattern of torch DDP / Megatron): the comm stream first waits for the current stream (the
    inputs are ready), and Work.wait() makes the current stream wait for the comm stream; the
    tensors crossing streams are record_stream()'d so the caching allocator does not reuse them
    early. NCCL timeouts are enforced by the group's watchdog (the group's timeout), because a CPU
    wait with a timeout would serialise the host with the GPU.
    """

    def __init__(self, group: dist.ProcessGroup, axis: str, timeout: float):
        super().__init__(
            axis=axis,
            rank=dist.get_rank(group),
            group_ranks=dist.get_process_group_ranks(group),
            timeout=timeout,
        )
        self.group = group
        self._streams: dict[int, Any] = {}

    def _all_reduce(self, t, op, async_op):
        def issue():
            out = t.clone(memory_format=torch.contiguous_format)
            return out, dist.all_reduce(out, op=_TORCH_REDUCE_OPS[op], group=self.group, async_op=True)

        return self._launch([t], issue, async_op)

    def _all_reduce_into(self, t, op, async_op):
        def issue():
            return t, dist.all_reduce(t, op=_TORCH_REDUCE_OPS[op], group=self.group, async_op=True)

        return self._launch([t], issue, async_op)

    def _all_gather(self, t, dim, async_op):
        def issue():
            inp = t.movedim(dim, 0).contiguous()
            buf = inp.new_empty((self.size * inp.shape[0], *inp.shape[1:]))
            work = _all_gather_single(buf, inp, group=self.group, async_op=True)
            return buf.movedim(0, dim), work

        return self._launch([t], issue, async_op)

    def _reduce_scatter(self, t, dim, async_op):
        def issue():
            inp = t.movedim(dim, 0).contiguous()
            buf = inp.new_empty((inp.shape[0] // self.size, *inp.shape[1:]))
            work = _reduce_scatter_single(buf, inp, group=self.group, async_op=True)
            return buf.movedim(0, dim), work

        return self._launch([t], issue, async_op)

    def _all_to_all(self, t, split_dim, cat_dim):
        stacked = torch.stack(t.chunk(self.size, split_dim)).contiguous()
        received = torch.empty_like(stacked)
        self._wait_torch(dist.all_to_all_single(received, stacked, group=self.group, async_op=True), t)
        return torch.cat(received.unbind(0), dim=cat_dim), Work()

    def _all_to_all_single(self, t, out_splits, in_splits):
        def issue():
            buf = t.new_empty((sum(out_splits), *t.shape[1:]))
            inp = t.contiguous()
            return buf, dist.all_to_all_single(
                buf, inp, out_splits, in_splits, group=self.group, async_op=True
            )

        return self._launch([t], issue, False)

    # Point-to-point: every send and receive goes through batch_isend_irecv (NCCL's group call;
    # an unbatched NCCL send blocks its stream until the peer receives). NCCL ignores tags and
    # matches in post order; the runtime's own transfers pass no tags.
    def _send(self, t, peer, tag):
        _, _, sent = self._batch_p2p([(t, peer)], [], tag)
        return None, sent

    def _recv(self, like, peer, tag):
        (buf,), received, _ = self._batch_p2p([], [(like, peer)], tag)
        return buf, received

    def _batch_p2p(self, sends, recvs, tag=0):
        bufs = [torch.empty_like(like, memory_format=torch.contiguous_format) for like, _ in recvs]
        outgoing = [t.contiguous() for t, _ in sends]  # held by the Work until it is waited for
        ops = [dist.P2POp(dist.isend, t, group=self.group, tag=tag, group_peer=peer)
               for t, (_, peer) in zip(outgoing, sends)]
        ops += [dist.P2POp(dist.irecv, buf, group=self.group, tag=tag, group_peer=peer)
                for buf, (_, peer) in zip(bufs, recvs)]
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) != len(ops):  # NCCL coalesces the batch into one Work: sends and receives together
            both = self._works(works, (outgoing + bufs)[:1])
            return bufs, both, both
        return bufs, self._works(works[len(sends):], bufs[:1]), self._works(works[:len(sends)], outgoing[:1])

    def _works(self, works: list, like: list) -> Work:
        return Work(lambda: [self._wait_torch(w, like[0] if like else None) for w in works],
                    lambda: all(w.is_completed() for w in works))

    def _barrier(self):
        work = dist.barrier(group=self.group, async_op=True)
        return None, Work(lambda: self._wait_torch(work, None), work.is_completed)

    # ----------------------------------------------------------------------------- helpers
    def _launch(
        self, inputs: list[torch.Tensor], issue: Callable, async_op: bool
    ) -> tuple[torch.Tensor, Work]:
        if async_op and inputs[0].is_cuda:
            return self._launch_on_comm_stream(inputs, issue)
        out, work = issue()
        return out, Work(lambda: self._wait_torch(work, out), work.is_completed)

    def _wait_torch(self, work: Any, like: torch.Tensor | None) -> None:
        if like is not None and like.is_cuda:
            work.wait()  # stream-ordered; the NCCL watchdog enforces the group timeout
            return
        wait_in_slices(work, self.timeout)

    def _comm_stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def _launch_on_comm_stream(
        self, inputs: list[torch.Tensor], issue: Callable
    ) -> tuple[torch.Tensor, Work]:
        """Issue on the side stream after the current stream's pending work (see class doc)."""
        device = inputs[0].device
        producer = torch.cuda.current_stream(device)
        comm_stream = self._comm_stream(device)
        inputs_ready = torch.cuda.Event()
        inputs_ready.record(producer)
        comm_stream.wait_event(inputs_ready)
        with torch.cuda.stream(comm_stream):
            out, work = issue()  # out is allocated on the comm stream
        for t in inputs:
            t.record_stream(comm_stream)  # freed on the producer while the comm stream reads it

        def wait() -> None:
            with torch.cuda.stream(comm_stream):
                work.wait()  # NCCL: the comm stream waits for the collective's own stream
            done = torch.cuda.Event()
            done.record(comm_stream)
            consumer = torch.cuda.current_stream(device)
            consumer.wait_event(done)
            out.record_stream(consumer)

        return out, Work(wait, work.is_completed)


# ========================================================================== in-process simulator
@dataclass
class _Slot:
    """The meeting point of one collective call (the n-th call on the group)."""

    kinds: dict[int, str] = field(default_factory=dict)
    payloads: dict[int, Any] = field(default_factory=dict)
    readers: int = 0


class ThreadGroup:
    """Rendezvous shared by the threads that simulate the ranks of one group.

    Calls are matched by their sequence number on the group (every rank counts its own calls),
    so consecutive collectives cannot mix; point-to-point messages are matched by
    (source, destination, tag, n-th message with that tag between them).
    """

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._mail: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._abort_reason: str | None = None

    def abort(self, reason: str) -> None:
        """Make every pending and future call on this group fail with `reason`."""
        with self._cond:
            self._abort_reason = self._abort_reason or reason
            self._cond.notify_all()

    def reset(self) -> None:
        """A fresh start after every rank of the group has left a failed run: no abort, no call or
        message of that run kept (each ThreadComm restarts its own counts)."""
        with self._cond:
            self._abort_reason = None
            self._slots.clear()
            self._mail.clear()

    def exchange(self, rank: int, seq: int, kind: str, payload: Any, timeout: float) -> list[Any]:
        """Deposit this rank's payload for call `seq`; return all ranks' payloads in rank order."""
        with self._cond:
            self._raise_if_aborted()
            slot = self._slots.setdefault(seq, _Slot())
            slot.kinds[rank], slot.payloads[rank] = kind, payload
            self._cond.notify_all()
            arrived = self._cond.wait_for(lambda: len(slot.kinds) == self.size or self._abort_reason, timeout)
            self._raise_if_aborted()
            if not arrived:
                self._timeout(
                    f"call #{seq} ({kind})", sorted(set(range(self.size)) - set(slot.kinds)), timeout
                )
            return self._read(slot, seq)

    def post(self, src: int, dst: int, tag: int, n: int, tensor: torch.Tensor) -> None:
        """Buffered send: the message waits in the mailbox until dst receives it."""
        with self._cond:
            self._raise_if_aborted()
            self._mail[(src, dst, tag, n)] = tensor
            self._cond.notify_all()

    def take(self, src: int, dst: int, tag: int, n: int, timeout: float) -> torch.Tensor:
        """Receive message n with `tag` from src to dst, waiting up to `timeout` seconds."""
        key = (src, dst, tag, n)
        with self._cond:
            arrived = self._cond.wait_for(lambda: key in self._mail or self._abort_reason, timeout)
            self._raise_if_aborted()
            if not arrived:
                self._timeout(f"message #{n} from group rank {src} (tag {tag})", [src], timeout)
            return self._mail.pop(key)

    def _read(self, slot: _Slot, seq: int) -> list[Any]:
        if len(set(slot.kinds.values())) > 1:
            calls = ", ".join(f"rank {self.ranks[r]} called {k}" for r, k in sorted(slot.kinds.items()))
            raise RuntimeError(f"ranks took different code paths at call #{seq} on this group: {calls}")
        slot.readers += 1
        if slot.readers == self.size:
            del self._slots[seq]
        return [slot.payloads[r] for r in range(self.size)]

    def _timeout(self, what: str, missing: list[int], timeout: float) -> None:
        names = [self.ranks[r] for r in missing]
        detail = f"rank(s) {names} never arrived at {what} within {timeout:g}s"
        self._abort_reason = self._abort_reason or f"group aborted: {detail}"
        self._cond.notify_all()
        raise TimeoutError(detail)

    def _raise_if_aborted(self) -> None:
        if self._abort_reason is not None:
            raise RuntimeError(self._abort_reason)


def _snapshot(t: torch.Tensor, size: int) -> torch.Tensor:
    """What a rank deposits: a private copy, since the caller may modify t once we return."""
    return t.detach().clone() if size > 1 else t.detach()


def _check_same_shapes(values: list[torch.Tensor], kind: str) -> None:
    shapes = [tuple(v.shape) for v in values]
    if len(set(shapes)) > 1:
        raise RuntimeError(f"ranks passed different shapes to {kind}: {shapes} (in group-rank order)")


def _reduce_in_rank_order(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """Sum (or max) in rank order 0..n-1 so every rank computes bitwise the same tensor."""
    acc = values[0].clone()
    for v in values[1:]:
        acc = acc.add_(v) if op == "sum" else torch.maximum(acc, v, out=acc)
    return acc


class ThreadComm(Comm):
    """In-memory collectives for ranks that are threads of one process (see ThreadGroup)."""

    def __init__(self, group: ThreadGroup, rank: int, *, axis: str, timeout: float):
        super().__init__(axis=axis, rank=rank, group_ranks=group.ranks, timeout=timeout)
        self.group = group
        self._calls = 0
        self._sent: Counter = Counter()
        self._received: Counter = Counter()

    def abort(self, reason: str) -> None:
        self.group.abort(reason)

    def reset(self) -> None:
        """Forget a failed run (see ThreadGroup.reset); every rank of the group resets together."""
        self.group.reset()
        self._calls = 0
        self._sent.clear()
        self._received.clear()

    def _exchange(self, kind: str, payload: Any) -> list[Any]:
        seq, self._calls = self._calls, self._calls + 1
        return self.group.exchange(self.rank, seq, kind, payload, self.timeout)

    def _all_reduce(self, t, op, async_op):
        values = self._exchange(f"all-reduce({op})", _snapshot(t, self.size))
        _check_same_shapes(values, "all-reduce")
        return _reduce_in_rank_order(values, op), Work()

    def _all_gather(self, t, dim, async_op):
        return torch.cat(self._exchange("all-gather", _snapshot(t, self.size)), dim=dim), Work()

    def _reduce_scatter(self, t, dim, async_op):
        values = self._exchange("reduce-scatter", _snapshot(t, self.size))
        _check_same_shapes(values, "reduce-scatter")
        mine = [v.chunk(self.size, dim)[self.rank] for v in values]
        return _reduce_in_rank_order(mine, "sum").contiguous(), Work()

    def _all_to_all(self, t, split_dim, cat_dim):
        values = self._exchange("all-to-all", _snapshot(t, self.size))
        return torch.cat([v.chunk(self.size, split_dim)[self.rank] for v in values], dim=cat_dim), Work()

    def _all_to_all_single(self, t, out_splits, in_splits):
        values = self._exchange("all-to-all", (_snapshot(t, self.size), in_splits))
        pieces = [v.split(splits)[self.rank] for v, splits in values]
        got = [p.shape[0] for p in pieces]
        if got != out_splits:
            raise RuntimeError(f"all_to_all_single: out_splits {out_splits} but the peers send {got} rows")
        return torch.cat(pieces), Work()

    def _send(self, t, peer, tag):
        n, self._sent[peer, tag] = self._sent[peer, tag], self._sent[peer, tag] + 1
        self.group.post(self.rank, peer, tag, n, t.detach().clone())
        return None, Work()

    def _recv(self, like, peer, tag):
        n, self._received[peer, tag] = self._received[peer, tag], self._received[peer, tag] + 1
        got = self.group.take(peer, self.rank, tag, n, self.timeout)
        if got.shape != like.shape or got.dtype != like.dtype:
            raise RuntimeError(
                f"recv expected {tuple(like.shape)} {like.dtype}, got {tuple(got.shape)} {got.dtype}"
            )
        return got, Work()

    def _recv_later(self, like, peer):
        """Sends are buffered here, so the matching take can wait until the caller waits."""
        buf = torch.empty_like(like, memory_format=torch.contiguous_format)
        n, self._received[peer, 0] = self._received[peer, 0], self._received[peer, 0] + 1  # in post order

        def take() -> None:
            got = self.group.take(peer, self.rank, 0, n, self.timeout)
            if got.shape != like.shape or got.dtype != like.dtype:
                raise RuntimeError(
                    f"recv expected {tuple(like.shape)} {like.dtype}, got {tuple(got.shape)} {got.dtype}")
            buf.copy_(got)

        return buf, Work(take)

    def _barrier(self):
        self._exchange("barrier", None)
        return None, Work()


def solo_comm(axis: str, global_rank: int, timeout: float) -> ThreadComm:
    """The trivial comm of a size-1 (or absent) mesh axis: every collective is the identity."""
    return ThreadComm(ThreadGroup((global_rank,)), 0, axis=axis, timeout=timeout)


class ShapeComm(Comm):
    """Collectives that give results of the right shape, dtype and device without any peer: rank
    `rank` of a group of `size` that is alone. With fake tensors, this lets one rank's program run for its
    shapes and memory alone (usc.lint's activation estimate) on a mesh of any size."""

    def __init__(self, axis: str, size: int, timeout: float = 1.0, rank: int = 0,
                 device: torch.device | None = None):
        super().__init__(axis=axis, rank=rank, group_ranks=tuple(range(size)), timeout=timeout)
        self.device = device  # set: refuse tensors elsewhere, as NCCL refuses host tensors

    def _run(self, kind, t, async_op, launch, **options):
        self._check_device(kind, t)
        return super()._run(kind, t, async_op, launch, **options)

    def batch_p2p(self, sends, recvs):
        for t, _ in [*sends, *recvs]:
            self._check_device("send/recv", t)
        return super().batch_p2p(sends, recvs)

    def _check_device(self, kind: str, t: torch.Tensor | None) -> None:
        if self.device is not None and isinstance(t, torch.Tensor) and t.device != self.device:
            raise CollectiveError(self.context(kind), f"a {t.device} tensor {list(t.shape)} handed to a "
                                  f"collective of a program on {self.device}")

    def _all_reduce(self, t, op, async_op):
        return t.clone(), Work()

    def _all_gather(self, t, dim, async_op):
        return torch.cat([t] * self.size, dim=dim), Work()

    def _reduce_scatter(self, t, dim, async_op):
        return t.chunk(self.size, dim)[0].clone(), Work()

    def _all_to_all(self, t, split_dim, cat_dim):
        return torch.cat([t.chunk(self.size, split_dim)[0]] * self.size, dim=cat_dim), Work()

    def _all_to_all_single(self, t, out_splits, in_splits):
        return t.new_empty((sum(out_splits), *t.shape[1:])), Work()

    def _send(self, t, peer, tag):
        return None, Work()

    def _recv(self, like, peer, tag):
        return torch.empty_like(like), Work()

    def _barrier(self):
        return None, Work()
