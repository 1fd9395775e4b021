"""Whole-mesh order check: every process group sees the same collectives in the same order, and
every pipeline send has its receive -- checked on the programs, before anything runs.

Collectives match by position: NCCL and gloo pair the k-th call of each member of a group. A rank
whose program issues one call more, one less, or another shape hangs (or mixes tensors) at run
time, often thousands of steps later. The check walks what each rank of the mesh will run (its
``RankProgram``: the whole graph, or its pipeline stage and its schedule actions), derives the
ordered calls per mesh axis -- forward collectives in graph order per microbatch, backward ones in
reverse order, then the pipeline's loss sum, the gradient buckets and the returned loss's sum, the
order the executor issues them in -- and compares the members of every group. Ranks that run the
same program object need no comparison (their calls are equal by construction), so a 1024-rank
mesh costs one walk per distinct program.

Pipeline transfers are derived the way ``runtime/pipeline.py`` posts them (stage inputs received
from lower stages in stage order, outputs sent to consumers in stage order; gradients back in the
same order) and matched per ordered pair of ranks.

    >>> # problems = check_mesh_order(rank_programs(program, schedule), program)   # [] when consistent
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx

from usc.compiler.ir import META, MeshSpec
from usc.compiler.pass_runner import pipeline_stages
from usc.compiler.report import CollectiveRecord, gradient_buckets, loss_value_records, part_collectives
from usc.runtime.mesh import axis_groups, coord_of_rank
from usc.runtime.pipeline import messages_from, stage_specs


@dataclass(frozen=True)
class Call:
    """One communication call as a rank issues it; ``key`` is what its peers must match."""

    kind: str
    axis: str
    shape: tuple[int, ...]
    dtype: str
    where: str

    @property
    def key(self) -> tuple:
        return (self.kind, self.axis, self.shape, self.dtype)

    def __str__(self) -> str:
        return f"{self.kind} {list(self.shape)} {self.dtype} at {self.where}"


@dataclass(frozen=True)
class Transfer:
    """One pipeline send or recv: from stage ``src`` to stage ``dst``."""

    src: int
    dst: int
    shape: tuple[int, ...]
    dtype: str
    what: str

    @property
    def key(self) -> tuple:
        return (self.shape, self.dtype)

    def __str__(self) -> str:
        return f"{self.what} {list(self.shape)} {self.dtype}"


@dataclass(frozen=True, eq=False)
class RankProgram:
    """What one rank runs: ``gm`` (the whole program), or under pp its schedule actions over the
    stage programs in ``stages`` (stage index -> GraphModule; interleaved schedules give a rank
    several). ``stage`` is the rank's pp coordinate. Ranks at the same pp coordinate share one object."""

    gm: fx.GraphModule
    stage: int = 0
    actions: tuple = ()
    stages: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OrderProblem:
    kind: str  # "collective" | "p2p"
    ranks: tuple[int, int]
    message: str

    def __str__(self) -> str:
        return self.message


def rank_programs(program, schedule=None) -> list[RankProgram]:
    """One RankProgram per rank of the mesh, in rank order."""
    mesh = program.mesh
    stages = pipeline_stages(program.gm)
    if not stages:
        shared = RankProgram(program.gm)
        return [shared] * mesh.world_size
    pp, size = mesh.axes.index("pp"), mesh.size("pp")
    per_rank = [RankProgram(stages[k], k, tuple(schedule.actions[k]),
                            {s: gm for s, gm in enumerate(stages) if s % size == k}) for k in range(size)]
    return [per_rank[coord_of_rank(r, mesh.shape)[pp]] for r in range(mesh.world_size)]


# ------------------------------------------------------------------------------ collectives
def _calls(records: list[CollectiveRecord], phase: str) -> list[Call]:
    return [Call(r.kind, r.axis, tuple(r.shape), r.dtype, f"{r.module} ({r.node}, {phase})")
            for r in records for _ in range(r.calls_per_step)]


def _pipeline_tail(program) -> list[Call]:
    """After the schedule: the last stage's loss sum over pp, then the gradients of weights used by
    two stages (tied embedding / lm head) summed over pp (runtime/pipeline.py, step)."""
    specs = _specs(program)
    users: dict[str, set[int]] = {}
    for spec in specs:
        for source in spec.sources:
            if source[0] == "input":
                users.setdefault(source[1], set()).add(spec.index)
    shared = sorted(name for name, stages in users.items() if len(stages) > 1)
    state = {s.placeholder: s for s in program.state if s.kind == "param" and s.trainable}
    out = [Call("all-reduce", "pp", (2,), "float64", "pipeline loss sum (step)")]
    for name in shared:
        if name in state:
            s = state[name]
            out.append(Call("all-reduce", "pp", s.layout.local_shape(s.global_shape, program.mesh),
                            str(s.dtype).replace("torch.", ""), f"{s.name} (shared by stages)"))
    return out


def step_calls(rp: RankProgram, program, *, microbatches: int, bucket_bytes: int, zero_stage: int) -> list[Call]:
    """The calls of one step of ``rp``, in the order the executor issues them."""
    def directions(gm):
        records = [r for r in part_collectives(gm, program.mesh) if r.kind != "send/recv" or r.axis != "pp"]
        return ([r for r in records if r.direction == "forward"],
                [r for r in reversed(records) if r.direction == "backward"])

    out: list[Call] = []
    if rp.actions:
        walked = {s: directions(gm) for s, gm in rp.stages.items()}
        for act in rp.actions:
            op = getattr(getattr(act, "op", None), "value", None)
            if op == "F":
                out += _calls(walked[act.stage][0], f"stage {act.stage} forward, microbatch {act.mb}")
            elif op in ("B", "I"):  # W (zero-bubble's weight gradients) communicates nothing of its own
                out += _calls(walked[act.stage][1], f"stage {act.stage} backward, microbatch {act.mb}")
        out += _pipeline_tail(program)
    else:
        forward, backward = directions(rp.gm)
        for m in range(microbatches):
            out += _calls(forward, f"forward, microbatch {m}") + _calls(backward, f"backward, microbatch {m}")
    out += _calls(gradient_buckets(program, bucket_bytes, zero_stage), "gradient buckets")
    out += _calls(loss_value_records(program), "returned loss")
    return out


def _by_axis(calls: list[Call]) -> dict[str, list[Call]]:
    out: dict[str, list[Call]] = {}
    for c in calls:
        out.setdefault(c.axis, []).append(c)
    return out


def _first_difference(a: list, b: list) -> int | None:
    """The first position where two ranks' calls differ: by what they are (the module and node that
    issue them, not only shape and dtype -- an SPMD program issues the same call on every rank)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _describe(rank: int, calls: list, i: int) -> str:
    return f"rank {rank} issues {calls[i]}" if i < len(calls) else f"rank {rank} issues nothing (it has {len(calls)} calls)"


def _collective_problem(axis: str, group: tuple, a: int, b: int, ca: list[Call], cb: list[Call]) -> OrderProblem | None:
    i = _first_difference(ca, cb)
    if i is None:
        return None
    silent = i < min(len(ca), len(cb)) and ca[i].key == cb[i].key
    effect = " (same shape and dtype: it would not hang but pair different tensors)" if silent else ""
    return OrderProblem("collective", (a, b), f"ranks {a} and {b} of {axis} group {group} differ at their call "
                                              f"#{i + 1} on {axis}: {_describe(a, ca, i)}; {_describe(b, cb, i)}"
                                              f"{effect}")


def check_collective_order(programs: Sequence[RankProgram], program, **step) -> list[OrderProblem]:
    mesh: MeshSpec = program.mesh
    walked: dict[int, dict[str, list[Call]]] = {}

    def calls_of(rank: int) -> dict[str, list[Call]]:
        rp = programs[rank]
        if id(rp) not in walked:
            walked[id(rp)] = _by_axis(step_calls(rp, program, **step))
        return walked[id(rp)]

    problems = []
    for index, axis in enumerate(mesh.axes):
        if mesh.shape[index] == 1:
            continue
        for group in axis_groups(mesh.shape, index):
            first = group[0]
            for other in group[1:]:
                if programs[other] is programs[first]:
                    continue
                found = _collective_problem(axis, group, first, other, calls_of(first).get(axis, []),
                                            calls_of(other).get(axis, []))
                if found:
                    problems.append(found)
                    break
    return problems


# ---------------------------------------------------------------------------- pipeline transfers
def _specs(program):
    return stage_specs(program.gm, lambda n: n.meta[META].layout.local_shape(tuple(n.meta["val"].shape),
                                                                                program.mesh))


def _consumers(spec) -> list[int]:
    return sorted({c for users in spec.consumers.values() for c in users})


def _grad(dtype: torch.dtype, needs: bool) -> bool:
    return needs and dtype.is_floating_point


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def stage_transfers(specs, actions, pp: int) -> tuple[list[Transfer], list[Transfer]]:
    """(sends, recvs) of one pp rank over its actions, as runtime/pipeline.py posts them: F receives
    the stage's inputs from lower stages and sends its outputs on; B or I receives its outputs'
    gradients and sends its inputs' gradients back. Transfers between two stages of one rank stay
    local and are not listed."""
    sends, recvs = [], []

    def move(producer, consumer, i, mb, backward):
        shape, dtype, needs = specs[producer].outputs[i]
        if backward and not _grad(dtype, needs):
            return
        src, dst = (consumer, producer) if backward else (producer, consumer)
        if src % pp == dst % pp:
            return
        what = f"{'gradient of ' if backward else ''}output {i} of stage {producer}, microbatch {mb}"
        t = Transfer(src, dst, shape, _dtype(dtype), what)
        (sends if src in mine else recvs).append(t)

    for act in actions:
        op = getattr(getattr(act, "op", None), "value", None)
        stage, mine = act.stage, {act.stage}
        if op == "F":
            for producer in range(stage):
                for i in messages_from(specs, producer, stage):
                    move(producer, stage, i, act.mb, False)
            for consumer in _consumers(specs[stage]):
                for i in messages_from(specs, stage, consumer):
                    move(stage, consumer, i, act.mb, False)
        elif op in ("B", "I"):
            for consumer in _consumers(specs[stage]) if stage < len(specs) - 1 else ():
                for i in messages_from(specs, stage, consumer):
                    move(stage, consumer, i, act.mb, True)
            for producer in range(stage):
                for i in messages_from(specs, producer, stage):
                    move(producer, stage, i, act.mb, True)
    return sends, recvs


def _pair_problem(ranks: tuple[int, int], sent: list[Transfer], received: list[Transfer]) -> OrderProblem | None:
    """Messages carry tags (kind, direction, microbatch): each send needs the receive of the same
    message, with the same shape and dtype, whatever the order they are posted in."""
    a, b = ranks
    missing = [t for t in sent if t not in received]
    extra = [t for t in received if t not in sent]
    if not missing and not extra:
        return None
    if missing:
        what = f"rank {a} sends {missing[0]} to rank {b}, which never receives it"
    else:
        what = f"rank {b} waits for {extra[0]} from rank {a}, which never sends it"
    more = len(missing) + len(extra) - 1
    return OrderProblem("p2p", ranks, f"pipeline transfer from rank {a} to rank {b} is unmatched: {what}"
                                      + (f" ({more} more)" if more else ""))


def check_transfers(programs: Sequence[RankProgram], program) -> list[OrderProblem]:
    mesh: MeshSpec = program.mesh
    if "pp" not in mesh.axes or mesh.size("pp") == 1:
        return []
    specs, pp = _specs(program), mesh.size("pp")
    problems, checked = [], set()
    for group in axis_groups(mesh.shape, mesh.axes.index("pp")):
        signature = tuple(id(programs[r]) for r in group)
        if signature in checked:  # the same programs as a group already checked
            continue
        checked.add(signature)
        moves = {r: stage_transfers(specs, programs[r].actions, pp) for r in group}
        for a in group:
            for b in group:
                if a == b:
                    continue
                sa, sb = programs[a].stage, programs[b].stage
                sent = [t for t in moves[a][0] if t.dst % pp == sb]
                received = [t for t in moves[b][1] if t.src % pp == sa]
                found = _pair_problem((a, b), sent, received)
                if found:
                    problems.append(found)
    return problems


def check_mesh_order(programs: Sequence[RankProgram], program, *, microbatches: int = 1,
                     bucket_bytes: int = 25 * 2**20, zero_stage: int = 0) -> list[OrderProblem]:
    """Every mismatch between the programs of the mesh's ranks (empty when they agree)."""
    step = {"microbatches": microbatches, "bucket_bytes": bucket_bytes, "zero_stage": zero_stage}
    return check_collective_order(programs, program, **step) + check_transfers(programs, program)
