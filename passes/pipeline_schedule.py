"""Pipeline schedules as data: actions that print and parse back, generators, and the lowering to p2p.

A schedule says, for every pipeline rank, the ordered list of actions it runs. It is built by a
generator (compute only), lowered to one with explicit sends and recvs by ``lower_communication``,
validated and measured by ``usc.passes.pipeline_schedule_check`` (checker, dry-run simulator,
metrics, text picture). Follows torch.distributed.pipelining's ``schedules.py`` (actions such as
``1F0``), with the peer named on communication actions.

Stages. The model is cut into ``pp * v`` stages; stage ``s`` lives on rank ``s % pp`` as its
chunk ``s // pp`` (Megatron's looping assignment: ``stage = chunk * pp + rank``). Forward data
flows from stage ``s`` to ``s + 1``, gradients from ``s + 1`` to ``s``.

Grammar of one action (no spaces inside)::

    action  := STAGE OP MB                  compute:  2F0   1B3   0I2   0W2
             | STAGE COMM MB DIR PEER       comm:     0SF3>1   1RF3<0   1SB3>0   0RB3<1
    OP      := F   forward
             | B   full backward (input and weight gradients)
             | I   input-gradient backward (zero-bubble's "B", on the critical path)
             | W   weight-gradient backward (deferrable, needs the I of the same stage and mb)
    COMM    := SF  send forward activation     (DIR '>', PEER = STAGE + 1)
             | RF  recv forward activation     (DIR '<', PEER = STAGE - 1)
             | SB  send backward gradient      (DIR '>', PEER = STAGE - 1)
             | RB  recv backward gradient      (DIR '<', PEER = STAGE + 1)

``0SF3>1`` reads "stage 0 sends the forward activation of microbatch 3 to stage 1"; its matching
recv is ``1RF3<0``. A schedule's text form is a header ``NAME pp=P v=V mb=M`` and one line
``RANK: ACTION ACTION ...`` per rank::

    1f1b pp=2 v=1 mb=3
    0: 0F0 0F1 0B0 0F2 0B1 0B2
    1: 1F0 1B0 1F1 1B1 1F2 1B2

Example::

    >>> s = build_schedule("1f1b", pp=2, v=1, mb=3)
    >>> parse_schedule(str(s)) == s
    True
    >>> str(lower_communication(s).actions[0][:3])
    '(0F0, 0SF0>1, 0F1)'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property


class ComputeOp(Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    INPUT_GRAD = "I"  # zero-bubble's B (Qi et al. 2024): gradient w.r.t. the stage input only
    WEIGHT_GRAD = "W"  # zero-bubble's W: gradient w.r.t. the weights, needs the same stage's I


class CommOp(Enum):
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"


# Where the peer of each communication sits, relative to the acting stage.
PEER_OFFSET = {CommOp.SEND_F: +1, CommOp.RECV_F: -1, CommOp.SEND_B: -1, CommOp.RECV_B: +1}
# The other half of each transfer: a send on stage s is received by its peer.
MATCHING_OP = {
    CommOp.SEND_F: CommOp.RECV_F,
    CommOp.RECV_F: CommOp.SEND_F,
    CommOp.SEND_B: CommOp.RECV_B,
    CommOp.RECV_B: CommOp.SEND_B,
}
SENDS = (CommOp.SEND_F, CommOp.SEND_B)


def _require_index(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Compute:
    """Forward, backward, input-grad or weight-grad of microbatch ``mb`` on stage ``stage``."""

    stage: int
    op: ComputeOp
    mb: int

    def __post_init__(self) -> None:
        _require_index("stage", self.stage)
        _require_index("mb", self.mb)
        if not isinstance(self.op, ComputeOp):
            raise TypeError(f"Compute.op must be a ComputeOp, got {self.op!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    __repr__ = __str__


@dataclass(frozen=True)
class Comm:
    """A send or recv of microbatch ``mb``'s activation (F) or gradient (B) between adjacent stages."""

    stage: int
    op: CommOp
    mb: int
    peer: int

    def __post_init__(self) -> None:
        _require_index("stage", self.stage)
        _require_index("mb", self.mb)
        if not isinstance(self.op, CommOp):
            raise TypeError(f"Comm.op must be a CommOp, got {self.op!r}")
        if self.peer != self.stage + PEER_OFFSET[self.op]:
            raise ValueError(
                f"{self.op.value} on stage {self.stage} talks to stage {self.stage + PEER_OFFSET[self.op]}, "
                f"got peer={self.peer!r} (forward data flows s -> s+1, gradients s+1 -> s)"
            )

    @property
    def is_send(self) -> bool:
        return self.op in SENDS

    def matching(self) -> Comm:
        """The other half of this transfer, on the peer stage."""
        return Comm(self.peer, MATCHING_OP[self.op], self.mb, self.stage)

    def __str__(self) -> str:
        arrow = ">" if self.is_send else "<"
        return f"{self.stage}{self.op.value}{self.mb}{arrow}{self.peer}"

    __repr__ = __str__


Action = Compute | Comm

_ACTION_RE = re.compile(r"(\d+)(SF|RF|SB|RB|F|B|I|W)(\d+)(?:([<>])(\d+))?")
_OPS_BY_TEXT: dict[str, ComputeOp | CommOp] = {op.value: op for op in (*ComputeOp, *CommOp)}


def parse_action(text: str) -> Action:
    """Read one action in the grammar of the module docstring: ``parse_action("1B3")``."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a pipeline action: {text!r} (expected e.g. 2F0, 1B3, 0W2, 0SF3>1, 1RF3<0)")
    stage, op_text, mb, arrow, peer = match.groups()
    op = _OPS_BY_TEXT[op_text]
    if isinstance(op, ComputeOp):
        if arrow is not None:
            raise ValueError(f"{text!r}: compute action {op_text} takes no peer")
        return Compute(int(stage), op, int(mb))
    want = ">" if op in SENDS else "<"
    if arrow != want:
        raise ValueError(
            f"{text!r}: {op_text} needs a peer written {want}STAGE, e.g. {stage}{op_text}{mb}{want}..."
        )
    return Comm(int(stage), op, int(mb), int(peer))


_NAME_RE = re.compile(r"[A-Za-z0-9_.+-]+")


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of a pipeline with ``pp`` ranks, ``v`` chunks per rank, ``mb`` microbatches.

    ``str`` gives the text form (header line, then ``RANK: actions``), read back by ``parse_schedule``.
    Only the shape is validated here; ``check_schedule`` validates the content.
    """

    name: str
    pp: int
    v: int
    mb: int
    actions: Mapping[int, tuple[Action, ...]] = field(hash=False)

    def __post_init__(self) -> None:
        for key in ("pp", "v", "mb"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Schedule {key} must be an int >= 1, got {value!r}")
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"Schedule name must be one word of [A-Za-z0-9_.+-], got {self.name!r}")
        if set(self.actions) != set(range(self.pp)):
            raise ValueError(
                f"Schedule needs one action list per rank 0..{self.pp - 1}, got ranks {sorted(self.actions)}"
            )
        frozen = {rank: tuple(self.actions[rank]) for rank in range(self.pp)}
        for rank, acts in frozen.items():
            for pos, act in enumerate(acts):
                if not isinstance(act, Compute | Comm):
                    raise TypeError(f"rank {rank}, position {pos}: {act!r} is not an action")
        object.__setattr__(self, "actions", frozen)

    @property
    def stages(self) -> int:
        return self.pp * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    @cached_property
    def is_lowered(self) -> bool:
        """True once any send or recv is present: cross-rank data then moves only through them."""
        return any(isinstance(a, Comm) for acts in self.actions.values() for a in acts)

    def __str__(self) -> str:
        header = f"{self.name} pp={self.pp} v={self.v} mb={self.mb}"
        rows = [f"{rank}: {' '.join(map(str, acts))}".rstrip() for rank, acts in self.actions.items()]
        return "\n".join([header, *rows])


_HEADER_RE = re.compile(r"(\S+)\s+pp=(\d+)\s+v=(\d+)\s+mb=(\d+)")
_ROW_RE = re.compile(r"(\d+):(.*)")


def parse_schedule(text: str) -> Schedule:
    """Read the text form of ``Schedule.__str__``; blank lines and ``#`` comments are ignored."""
    lines = [(n, line.split("#")[0].strip()) for n, line in enumerate(text.splitlines(), start=1)]
    lines = [(n, line) for n, line in lines if line]
    if not lines:
        raise ValueError("empty schedule text: expected a header 'NAME pp=P v=V mb=M'")
    n, header = lines[0]
    match = _HEADER_RE.fullmatch(header)
    if match is None:
        raise ValueError(f"line {n}: expected a header 'NAME pp=P v=V mb=M', got {header!r}")
    name, pp, v, mb = match.group(1), *map(int, match.groups()[1:])
    actions: dict[int, tuple[Action, ...]] = {}
    for n, line in lines[1:]:
        row = _ROW_RE.fullmatch(line)
        if row is None:
            raise ValueError(f"line {n}: expected 'RANK: ACTION ...', got {line!r}")
        rank = int(row.group(1))
        if rank in actions:
            raise ValueError(f"line {n}: rank {rank} listed twice")
        try:
            actions[rank] = tuple(parse_action(word) for word in row.group(2).split())
        except ValueError as err:
            raise ValueError(f"line {n}: {err}") from None
    return Schedule(name, pp, v, mb, actions)


# ---------------------------------------------------------------------------------------------
# Generators: compute-only action lists per rank.


def _require_sizes(pp: int, v: int, mb: int) -> None:
    for key, value in (("pp", pp), ("v", v), ("mb", mb)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline schedule needs {key} >= 1, got {key}={value!r}")


def _ops(stage: int, op: ComputeOp, mb: int) -> list[Compute]:
    return [Compute(stage, op, m) for m in range(mb)]


def _warmup_steady_cooldown(
    forwards: Sequence[Action], backwards: Sequence[Action], warmup: int
) -> list[Action]:
    """``warmup`` forwards, then alternate one forward and one backward, then the remaining backwards."""
    steady = [a for pair in zip(forwards[warmup:], backwards, strict=False) for a in pair]
    return [*forwards[:warmup], *steady, *backwards[len(forwards) - warmup :]]


def gpipe(pp: int, mb: int) -> Schedule:
    """GPipe / all-forward-all-backward (Huang et al. 2019): every forward, then every backward."""
    _require_sizes(pp, 1, mb)
    actions = {r: (*_ops(r, ComputeOp.FORWARD, mb), *_ops(r, ComputeOp.BACKWARD, mb)) for r in range(pp)}
    return Schedule("gpipe", pp, 1, mb, actions)


def one_f_one_b(pp: int, mb: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r warms up with min(pp-r-1, mb) forwards,
    then alternates one forward and one backward, then drains the backwards."""
    _require_sizes(pp, 1, mb)
    actions = {
        r: _warmup_steady_cooldown(
            _ops(r, ComputeOp.FORWARD, mb), _ops(r, ComputeOp.BACKWARD, mb), min(pp - r - 1, mb)
        )
        for r in range(pp)
    }
    return Schedule("1f1b", pp, 1, mb, actions)


def _virtual_action(pp: int, v: int, rank: int, k: int, op: ComputeOp) -> Compute:
    """The k-th forward (or backward) of a rank in Megatron's interleaved order: microbatches go in
    groups of pp through chunk 0, 1, ..., v-1 (backward: v-1, ..., 0)."""
    group, within = divmod(k, pp * v)
    chunk = within // pp
    if op is not ComputeOp.FORWARD:
        chunk = v - 1 - chunk
    return Compute(chunk * pp + rank, op, group * pp + within % pp)


def interleaved(pp: int, v: int, mb: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, sec. 2.2) with ``v`` chunks per rank.

    Rank r warms up with 2*(pp-r-1) + (v-1)*pp virtual forwards (as Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``), then runs 1F1B over chunk-microbatches.
    """
    _require_sizes(pp, v, mb)
    if mb % pp:
        raise ValueError(
            f"schedule=interleaved sends microbatches through the chunks in groups of pp, so mb must be a "
            f"multiple of pp: got mb={mb}, pp={pp}; use mb={(mb // pp + 1) * pp} or schedule=1f1b"
        )
    total = mb * v
    actions = {}
    for r in range(pp):
        forwards = [_virtual_action(pp, v, r, k, ComputeOp.FORWARD) for k in range(total)]
        backwards = [_virtual_action(pp, v, r, k, ComputeOp.BACKWARD) for k in range(total)]
        warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)
        actions[r] = _warmup_steady_cooldown(forwards, backwards, warmup)
    return Schedule("interleaved", pp, v, mb, actions)


def zero_bubble_h1(pp: int, mb: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 3.1): 1F1B with each backward
    split into I (input grad, on the critical path) and W (weight grad, deferred into the bubble).

    Forwards and I's keep 1F1B's order, so the peak in flight (F done, I not) is 1F1B's. Rank r runs
    its first r steady steps without W (as torch.distributed.pipelining's ``_get_1f1b_rank_ops`` with
    ``num_1f1b_microbatches=rank``), then one W per step, one per cool-down step, and the r W's still
    owed at the end, where 1F1B's cool-down bubble was. With unit F=I=W the bubble is p-1 slots per
    rank, against 3(p-1) for 1F1B, and every rank holds at most p microbatches whose W has not run.
    """
    _require_sizes(pp, 1, mb)
    return Schedule("zb", pp, 1, mb, {r: _zero_bubble_h1_rank(pp, mb, r) for r in range(pp)})


def _zero_bubble_h1_rank(pp: int, mb: int, rank: int) -> list[Action]:
    forward, input_grad, weight_grad = ComputeOp.FORWARD, ComputeOp.INPUT_GRAD, ComputeOp.WEIGHT_GRAD
    warmup = min(pp - rank - 1, mb)
    acts: list[Action] = _ops(rank, forward, warmup)
    weights_done = 0
    for i in range(mb):
        cooldown = warmup + i >= mb
        acts += [] if cooldown else [Compute(rank, forward, warmup + i)]
        acts.append(Compute(rank, input_grad, i))
        if cooldown or i >= rank:
            acts.append(Compute(rank, weight_grad, weights_done))
            weights_done += 1
    return acts + [Compute(rank, weight_grad, m) for m in range(weights_done, mb)]


def _one_chunk(generator: Callable[[int, int], Schedule]) -> Callable[[int, int, int], Schedule]:
    def build(pp: int, v: int, mb: int) -> Schedule:
        if v != 1:
            raise ValueError(
                f"schedule={generator.__name__} runs one stage per rank (v=1), got v={v}; "
                "use schedule=interleaved for virtual chunks"
            )
        return generator(pp, mb)

    return build


# Names the plan language accepts that have no generator yet -> what to write instead. Callers that
# hold a plan refuse them with a PlanError at the `schedule=` value (refuse_unimplemented).
NOT_IMPLEMENTED = {"dualpipe": "use schedule=zb for a low-bubble schedule"}


def _not_implemented(pp: int, v: int, mb: int) -> Schedule:
    raise NotImplementedError(f"schedule=dualpipe is not implemented; {NOT_IMPLEMENTED['dualpipe']}")


def refuse_unimplemented(plan) -> None:
    """A PlanError pointing at ``schedule=NAME`` when NAME has no generator (see NOT_IMPLEMENTED)."""
    name = plan.get("schedule")
    if name in NOT_IMPLEMENTED:
        raise plan.error_at("schedule", f"schedule={name} is not implemented", hint=NOT_IMPLEMENTED[name])


# Plan name -> generator (pp, v, mb). Names are the plan language's `schedule=` values.
SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": _one_chunk(gpipe),
    "1f1b": _one_chunk(one_f_one_b),
    "interleaved": interleaved,
    "zb": _one_chunk(zero_bubble_h1),
    "dualpipe": _not_implemented,
}


def build_schedule(name: str, pp: int, v: int, mb: int) -> Schedule:
    """The compute-only schedule for a plan's ``schedule=NAME pp=P v=V mb=M``.

    >>> str(build_schedule("gpipe", pp=2, v=1, mb=2))
    'gpipe pp=2 v=1 mb=2\\n0: 0F0 0F1 0B0 0B1\\n1: 1F0 1F1 1B0 1B1'
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](pp, v, mb)


# ---------------------------------------------------------------------------------------------
# Lowering: insert the p2p transfers next to the compute that produces or consumes them.


def _recvs_before(schedule: Schedule, act: Compute) -> list[Comm]:
    s, last = act.stage, schedule.stages - 1
    if act.op is ComputeOp.FORWARD and s > 0 and schedule.rank_of(s - 1) != schedule.rank_of(s):
        return [Comm(s, CommOp.RECV_F, act.mb, s - 1)]
    grads_in = act.op in (ComputeOp.BACKWARD, ComputeOp.INPUT_GRAD)
    if grads_in and s < last and schedule.rank_of(s + 1) != schedule.rank_of(s):
        return [Comm(s, CommOp.RECV_B, act.mb, s + 1)]
    return []


def _sends_after(schedule: Schedule, act: Compute) -> list[Comm]:
    s, last = act.stage, schedule.stages - 1
    if act.op is ComputeOp.FORWARD and s < last and schedule.rank_of(s + 1) != schedule.rank_of(s):
        return [Comm(s, CommOp.SEND_F, act.mb, s + 1)]
    grads_out = act.op in (ComputeOp.BACKWARD, ComputeOp.INPUT_GRAD)
    if grads_out and s > 0 and schedule.rank_of(s - 1) != schedule.rank_of(s):
        return [Comm(s, CommOp.SEND_B, act.mb, s - 1)]
    return []


def lower_communication(schedule: Schedule) -> Schedule:
    """Insert a recv just before each compute that needs another rank's data and a send just after
    each compute whose result another rank needs. Sends are buffered (non-blocking), so the lowered
    schedule deadlocks exactly when the compute-only one does. Stages on the same rank (pp=1) pass
    data in memory and get no transfer.

    Requires: a compute-only schedule. Establishes: every cross-rank dependency is a recv on the
    consumer's rank matched by a send on the producer's.
    """
    if schedule.is_lowered:
        raise ValueError(
            f"schedule {schedule.name!r} already has sends/recvs; lower the compute-only schedule"
        )
    actions = {rank: tuple(_lowered(schedule, acts)) for rank, acts in schedule.actions.items()}
    return Schedule(schedule.name, schedule.pp, schedule.v, schedule.mb, actions)


def _lowered(schedule: Schedule, acts: Iterable[Action]) -> Iterable[Action]:
    for act in acts:
        yield from _recvs_before(schedule, act)
        yield act
        yield from _sends_after(schedule, act)
