"""Checker, dry-run simulator, metrics and text picture of pipeline schedules.

``check_schedule`` validates a schedule (compute-only or lowered) before it runs and returns its
metrics; ``simulate`` is the dry run both the deadlock check and the metrics use; ``render_timeline``
is the picture ``usc-lint --schedule`` prints.

Dependencies, as events an action needs and events it produces (``_REQUIRES`` / ``_PRODUCES``):
F of (s, m) needs F of (s-1, m); B or I of (s, m) needs F of (s, m) and the input gradient of
(s+1, m) (a B or I there); W of (s, m) needs I of (s, m). In a lowered schedule a dependency on
another rank's compute is replaced by the recv on this rank, and a recv needs its matching send.
Dependencies on this rank's own events are checked by program order; those on other ranks by the
dry run, in which each rank runs its list in order, a recv blocks until its send was issued and
sends never block (buffered) -- a schedule deadlocks when no rank can make progress.

Timing model (``UNIT_COSTS``, in units of one stage's forward): F=1, B=2, I=1, W=1, sends and recvs
0; each action starts when its rank is free and its dependencies have finished.

Example::

    >>> from usc.passes.pipeline_schedule import build_schedule
    >>> m = check_schedule(build_schedule("gpipe", pp=4, v=1, mb=8))
    >>> m.makespan, round(m.bubble_fraction, 4), m.bubble_ratio, m.peak_in_flight
    (33.0, 0.2727, 0.375, (8, 8, 8, 8))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .pipeline_schedule import Action, Comm, CommOp, Compute, ComputeOp, Schedule

F, B, I, W = ComputeOp.FORWARD, ComputeOp.BACKWARD, ComputeOp.INPUT_GRAD, ComputeOp.WEIGHT_GRAD
UNIT_COSTS: Mapping[ComputeOp, float] = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


class ScheduleError(ValueError):
    """A schedule violates a dependency, misses or repeats work, leaves a transfer unmatched, or deadlocks."""


class Done(NamedTuple):
    """Compute event: ``kind`` "F" (forward output), "dX" (input gradient, by B or I), "I" (I ran)."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        if self.kind == "dX":
            return f"{self.stage}B{self.mb} or {self.stage}I{self.mb}"
        return f"{self.stage}{self.kind}{self.mb}"


Event = Done | Comm


def _backward_needs(act: Compute, last: int) -> list[Done]:
    """B or I of (s, m): the forward of (s, m), and the gradient coming back from (s+1, m)."""
    upstream = [Done("dX", act.stage + 1, act.mb)] if act.stage < last else []
    return [Done("F", act.stage, act.mb), *upstream]


# What each compute op needs, as events on any stage (translated to recvs when lowered).
_REQUIRES: dict[ComputeOp, Callable[[Compute, int], list[Done]]] = {
    F: lambda a, last: [Done("F", a.stage - 1, a.mb)] if a.stage > 0 else [],
    B: _backward_needs,
    I: _backward_needs,
    W: lambda a, last: [Done("I", a.stage, a.mb)],
}
_PRODUCES: dict[ComputeOp, Callable[[Compute], list[Done]]] = {
    F: lambda a: [Done("F", a.stage, a.mb)],
    B: lambda a: [Done("dX", a.stage, a.mb)],
    I: lambda a: [Done("dX", a.stage, a.mb), Done("I", a.stage, a.mb)],
    W: lambda a: [],
}
# A send needs the data it sends: the forward output or the input gradient of its own stage.
_SEND_NEEDS = {CommOp.SEND_F: "F", CommOp.SEND_B: "dX"}
# Which send carries a compute event to the neighbouring rank: forward outputs up, input gradients down.
_SENT_BY = {"F": CommOp.SEND_F, "dX": CommOp.SEND_B}


def _as_recv(schedule: Schedule, stage: int, event: Done) -> Event:
    """In a lowered schedule, a compute event of another rank arrives through a recv on this stage."""
    if not schedule.is_lowered or schedule.rank_of(event.stage) == schedule.rank_of(stage):
        return event
    return Comm(event.stage, _SENT_BY[event.kind], event.mb, stage).matching()


def requires(schedule: Schedule, act: Action) -> list[Event]:
    """The events ``act`` waits for."""
    if isinstance(act, Compute):
        return [_as_recv(schedule, act.stage, e) for e in _REQUIRES[act.op](act, schedule.stages - 1)]
    if act.is_send:
        return [Done(_SEND_NEEDS[act.op], act.stage, act.mb)]
    return [act.matching()]


def produces(act: Action) -> list[Event]:
    """The events ``act`` makes available (a send: itself issued; a recv: itself completed)."""
    return _PRODUCES[act.op](act) if isinstance(act, Compute) else [act]


def _event_rank(schedule: Schedule, event: Event) -> int:
    return schedule.rank_of(event.stage)


def _where(rank: int, pos: int, act: Action) -> str:
    return f"rank {rank}, position {pos}: {act}"


# ---------------------------------------------------------------------------------------------
# Static checks: placement, coverage, per-rank order, matched transfers.


def _check_placement(schedule: Schedule) -> None:
    for rank, acts in schedule.actions.items():
        for pos, act in enumerate(acts):
            if act.stage >= schedule.stages:
                raise ScheduleError(
                    f"{_where(rank, pos, act)} names stage {act.stage}, but pp*v = {schedule.stages}"
                )
            if schedule.rank_of(act.stage) != rank:
                raise ScheduleError(
                    f"{_where(rank, pos, act)} is stage {act.stage}, which lives on rank "
                    f"{schedule.rank_of(act.stage)} (stage = chunk * pp + rank)"
                )
            if act.mb >= schedule.mb:
                raise ScheduleError(
                    f"{_where(rank, pos, act)} names microbatch {act.mb}, but mb = {schedule.mb}"
                )


def _check_no_duplicates(schedule: Schedule) -> None:
    for rank, acts in schedule.actions.items():
        first: dict[Action, int] = {}
        for pos, act in enumerate(acts):
            if act in first:
                raise ScheduleError(
                    f"{_where(rank, pos, act)} runs a second time (first at position {first[act]})"
                )
            first[act] = pos


def _backward_problem(ops: Counter) -> str | None:
    if ops[B] and (ops[I] or ops[W]):
        return "mixes a full backward B with split I/W"
    if not ops[B] and not (ops[I] and ops[W]):
        return "has no backward (B, or I and W)"
    return None


def _check_coverage(schedule: Schedule) -> None:
    """Every (stage, microbatch) runs one forward and one backward (B, or I and W)."""
    done: dict[tuple[int, int], Counter] = {}
    for acts in schedule.actions.values():
        for act in acts:
            if isinstance(act, Compute):
                done.setdefault((act.stage, act.mb), Counter())[act.op] += 1
    for stage in range(schedule.stages):
        for mb in range(schedule.mb):
            ops = done.get((stage, mb), Counter())
            where = f"stage {stage} (rank {schedule.rank_of(stage)}), microbatch {mb}"
            if not ops[F]:
                raise ScheduleError(f"{where} has no forward {stage}F{mb}")
            if problem := _backward_problem(ops):
                raise ScheduleError(f"{where} {problem}")


def _check_program_order(schedule: Schedule) -> None:
    """Dependencies on this rank's own events must come earlier in its list."""
    for rank, acts in schedule.actions.items():
        seen: set[Event] = set()
        for pos, act in enumerate(acts):
            for need in requires(schedule, act):
                if _event_rank(schedule, need) == rank and need not in seen:
                    later = _position_of(acts, need, pos)
                    when = (
                        f"it comes later, at position {later}"
                        if later is not None
                        else f"rank {rank} never does it"
                    )
                    raise ScheduleError(f"{_where(rank, pos, act)} needs {need} first, but {when}")
            seen.update(produces(act))


def _position_of(acts: tuple[Action, ...], event: Event, after: int) -> int | None:
    return next((p for p in range(after, len(acts)) if event in produces(acts[p])), None)


def _check_transfers_matched(schedule: Schedule) -> None:
    comms = {a for acts in schedule.actions.values() for a in acts if isinstance(a, Comm)}
    for rank, acts in schedule.actions.items():
        for pos, act in enumerate(acts):
            if isinstance(act, Comm) and act.matching() not in comms:
                kind, other = ("send", "recv") if act.is_send else ("recv", "send")
                raise ScheduleError(
                    f"rank {rank}, position {pos}: {kind} {act} has no matching {other} {act.matching()} "
                    f"on rank {schedule.rank_of(act.peer)}"
                )


# ---------------------------------------------------------------------------------------------
# Dry run.


@dataclass(frozen=True)
class Slot:
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Timeline:
    """When each action of each rank runs under the timing model; ``slots[rank]`` is in program order."""

    schedule: Schedule
    slots: tuple[tuple[Slot, ...], ...]

    @property
    def makespan(self) -> float:
        return max((s.end for row in self.slots for s in row), default=0.0)


def _cost(act: Action, costs: Mapping[ComputeOp, float]) -> float:
    return costs[act.op] if isinstance(act, Compute) else 0.0


def simulate(schedule: Schedule, *, costs: Mapping[ComputeOp, float] = UNIT_COSTS) -> Timeline:
    """Run every rank's list in order; an action starts once its rank is free and its events are
    done. Raises ScheduleError naming each stuck rank, its action and what it waits for."""
    finish: dict[Event, float] = {}
    slots: list[list[Slot]] = [[] for _ in range(schedule.pp)]
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in schedule.actions.items():
            row = slots[rank]
            while len(row) < len(acts) and all(e in finish for e in requires(schedule, acts[len(row)])):
                act = acts[len(row)]
                start = max([row[-1].end if row else 0.0, *(finish[e] for e in requires(schedule, act))])
                row.append(Slot(start, start + _cost(act, costs), act))
                finish.update({e: start + _cost(act, costs) for e in produces(act)})
                progressed = True
    if any(len(row) < len(acts) for row, acts in zip(slots, schedule.actions.values(), strict=True)):
        raise ScheduleError(_deadlock_message(schedule, slots, finish))
    return Timeline(schedule, tuple(map(tuple, slots)))


def _deadlock_message(schedule: Schedule, slots: list[list[Slot]], finish: dict[Event, float]) -> str:
    stuck = []
    for rank, acts in schedule.actions.items():
        pos = len(slots[rank])
        if pos < len(acts):
            waits = [e for e in requires(schedule, acts[pos]) if e not in finish]
            waits_on = ", ".join(f"{e} (rank {_event_rank(schedule, e)})" for e in waits)
            stuck.append(f"{_where(rank, pos, acts[pos])} waits for {waits_on}")
    return "deadlock: no rank can make progress; " + "; ".join(stuck)


# ---------------------------------------------------------------------------------------------
# Metrics.


@dataclass(frozen=True)
class ScheduleMetrics:
    """Measured under the timing model.

    makespan: time from the first action to the last, over all ranks.
    idle_fraction[r]: rank r's idle time / makespan.
    bubble_fraction: mean of idle_fraction over ranks -- (p-1)/(m+p-1) for GPipe and 1F1B.
    bubble_ratio: total idle / total compute, the bubble relative to the ideal (bubble-free) time --
      the form of Narayanan et al.: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for interleaved.
    peak_in_flight[r]: most (stage, microbatch) forwards on rank r whose backward (B or I) has not
      run yet -- activations held, in units of one chunk's activations for one microbatch.
    """

    makespan: float
    bubble_fraction: float
    bubble_ratio: float
    idle_fraction: tuple[float, ...]
    peak_in_flight: tuple[int, ...]


def peak_in_flight(acts: tuple[Action, ...]) -> int:
    """Most forwards done whose B or I has not, walking one rank's list in order."""
    live = peak = 0
    for act in acts:
        if isinstance(act, Compute) and act.op in (F, B, I):
            live += 1 if act.op is F else -1
            peak = max(peak, live)
    return peak


def timeline_metrics(timeline: Timeline) -> ScheduleMetrics:
    makespan = timeline.makespan
    busy = [sum(s.end - s.start for s in row) for row in timeline.slots]
    idle = [makespan - b for b in busy]
    return ScheduleMetrics(
        makespan=makespan,
        bubble_fraction=sum(idle) / (makespan * len(idle)),
        bubble_ratio=sum(idle) / sum(busy),
        idle_fraction=tuple(i / makespan for i in idle),
        peak_in_flight=tuple(peak_in_flight(acts) for acts in timeline.schedule.actions.values()),
    )


def check_schedule(schedule: Schedule, *, costs: Mapping[ComputeOp, float] = UNIT_COSTS) -> ScheduleMetrics:
    """Validate ``schedule`` (compute-only or lowered) and return its metrics.

    Raises ScheduleError, naming rank, position and action, when an action sits on the wrong rank,
    work is missing or repeated, a dependency on the same rank comes later, a send or recv has no
    partner, or the dry run deadlocks.
    """
    _check_placement(schedule)
    _check_no_duplicates(schedule)
    _check_coverage(schedule)
    _check_transfers_matched(schedule)
    _check_program_order(schedule)
    return timeline_metrics(simulate(schedule, costs=costs))


# ---------------------------------------------------------------------------------------------
# Picture.


def _label(act: Compute, v: int) -> str:
    return f"{act.op.value}{act.mb}" if v == 1 else str(act)


def render_timeline(schedule: Schedule, *, costs: Mapping[ComputeOp, float] = UNIT_COSTS) -> str:
    """One row per rank, one cell per unit of time: the running action (``F0``, ``B3``; with v > 1
    the full form ``4F0`` so the chunk shows) or ``..`` when idle. Sends and recvs take no time and
    are not drawn.

    >>> from usc.passes.pipeline_schedule import build_schedule
    >>> print(render_timeline(build_schedule("gpipe", pp=2, v=1, mb=2)))
    rank 0 | F0 F1 .. .. .. B0 B0 B1 B1
    rank 1 | .. F0 F1 B0 B0 B1 B1 .. ..
    """
    if any(c != int(c) for c in costs.values()):
        raise ValueError(f"render_timeline draws unit cells and needs integer costs, got {dict(costs)}")
    timeline = simulate(schedule, costs=costs)
    cells = [["" for _ in range(int(timeline.makespan))] for _ in timeline.slots]
    for rank, row in enumerate(timeline.slots):
        for slot in row:
            for t in range(int(slot.start), int(slot.end)):
                cells[rank][t] = _label(slot.action, schedule.v)
    width = max([2, *(len(c) for row in cells for c in row)])
    rank_width = len(str(schedule.pp - 1))
    return "\n".join(
        f"rank {rank:>{rank_width}} | " + " ".join(c.ljust(width) if c else "." * width for c in row).rstrip()
        for rank, row in enumerate(cells)
    )
