"""A timeline of compute and communication spans per rank, and how much comm was exposed.

Overlap is the whole point of the reducer and of async collectives, so it must be measurable:
`exposed_comm_seconds()` is the communication time during which no compute ran on the same rank
(interval arithmetic on the recorded spans), and `to_chrome_trace()` writes a file that
chrome://tracing or https://ui.perfetto.dev shows as one process row per rank.

Async collectives are recorded with `begin()` at launch and `end()` at completion; the comm layer
ends a ProcessGroupComm span when `Work.wait()` returns (not from a future callback), so the span
is an upper bound on the transfer and never ends before the caller could use the result.

Example::

    tl = Timeline(rank=0)
    with tl.span("matmul", "compute"):
        y = x @ w
    token = tl.begin("all-reduce", "comm")
    ...
    tl.end(token)
    print(tl.exposed_comm_seconds())
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("compute", "comm", "comm-sync")


@dataclass(frozen=True)
class Span:
    """One recorded interval; times are time.perf_counter() seconds."""

    name: str
    category: str
    start: float
    end: float
    rank: int
    tid: int


@dataclass(frozen=True)
class SpanToken:
    """What begin() hands out and end() takes back."""

    name: str
    category: str
    start: float
    rank: int
    tid: int


class Timeline:
    """Thread-safe span recorder; one may be shared by all simulated ranks (spans carry rank)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    @property
    def spans(self) -> list[Span]:
        """A copy of the spans recorded so far, in completion order."""
        with self._lock:
            return list(self._spans)

    def begin(self, name: str, category: str, *, rank: int | None = None) -> SpanToken:
        """Open a span now; close it with end(token) (possibly from another thread)."""
        if category not in CATEGORIES:
            raise ValueError(f"span category must be one of {CATEGORIES}, got {category!r}")
        owner = self.rank if rank is None else rank
        return SpanToken(name, category, time.perf_counter(), owner, threading.get_ident())

    def end(self, token: SpanToken) -> Span:
        """Close a span opened by begin() and record it."""
        span = Span(token.name, token.category, token.start, time.perf_counter(), token.rank, token.tid)
        with self._lock:
            self._spans.append(span)
        return span

    @contextmanager
    def span(self, name: str, category: str, *, rank: int | None = None) -> Iterator[None]:
        """Record the body of the with-block as one span."""
        token = self.begin(name, category, rank=rank)
        try:
            yield
        finally:
            self.end(token)

    def exposed_comm_seconds(self, rank: int | None = None) -> float:
        """Comm time not overlapped by compute on the same rank, summed over ranks (or one rank)."""
        spans = self.spans
        ranks = {s.rank for s in spans} if rank is None else {rank}
        return sum(_exposed_on_rank([s for s in spans if s.rank == r]) for r in ranks)

    def to_chrome_trace(self, path: str | Path) -> None:
        """Write the Chrome trace-event JSON (complete events, pid = rank, times in us)."""
        spans = self.spans
        origin = min((s.start for s in spans), default=0.0)
        events = [_chrome_event(s, origin) for s in spans]
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _chrome_event(span: Span, origin: float) -> dict:
    """One 'X' (complete) event of the trace-event format."""
    return {
        "name": span.name,
        "cat": span.category,
        "ph": "X",
        "ts": (span.start - origin) * 1e6,
        "dur": (span.end - span.start) * 1e6,
        "pid": span.rank,
        "tid": span.tid,
    }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals into disjoint sorted ones."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two disjoint sorted interval lists (two pointers)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """a minus b, both sorted disjoint interval lists."""
    out = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def _exposed_on_rank(spans: list[Span]) -> float:
    """|union(comm) - union(compute)|: concurrent comm spans count once, overlapped parts not at all.

    A blocking ("comm-sync") call is never overlapped: the compute span around it (a whole
    forward, say) is idle while it runs, so those intervals are removed from compute first."""
    comm = _union([(s.start, s.end) for s in spans if s.category in ("comm", "comm-sync")])
    blocking = _union([(s.start, s.end) for s in spans if s.category == "comm-sync"])
    compute = _subtract(_union([(s.start, s.end) for s in spans if s.category == "compute"]), blocking)
    return sum(end - start for start, end in comm) - _overlap(comm, compute)
