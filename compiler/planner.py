"""The planner: enumerate plans for a cluster, drop those that cannot run, rank the rest by step time.

Follows the Ultra-Scale Playbook's order (fit memory first, then reach the batch, then maximise
throughput): every combination of dp/tp/pp/cp/ep sizes whose product is the GPU count, ZeRO stage,
microbatches, recompute and pipeline schedule is checked for divisibility (the model's tp-split dims,
the sequence for cp and sp, the batch for dp x mb, layers for pp), for support (a callback, so plan
items the compiler refuses today are never proposed and newly built ones become eligible), and for
memory against the device's capacity; the rest are ranked by the cost model's step time. All of it
runs on one :class:`ModelProfile` -- nothing is traced per plan.

    >>> from usc.compiler.planner import PlanTarget
    >>> PlanTarget(gpus=64, seq=4096, global_batch=256).gpus
    64
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from .cost_model import (TIME_TERMS, Estimate, ModelProfile, PlanPoint, crosses_node, estimate, peak_memory,
                         step_floor, gradient_floor)
from .cost_types import written_sizes
from .hardware import HardwareProfile

# Fraction of HBM a plan may fill: the CUDA context, NCCL buffers and allocator fragmentation take
# the rest (PyTorch's caching allocator typically loses 5-10% to fragmentation).
MEMORY_HEADROOM = 0.9
# Microbatch counts tried beyond the minimum (powers of two, as practitioners choose them).
MAX_MICROBATCHES = 64
RECOMPUTE_ORDER = ("none", "selective", "full")  # lightest first: the search tries them in this order
# Plans whose predicted steps are within this fraction of the fastest are a tie, well inside the cost
# model's error (docs/cost_model.md): the simplest of them is chosen (``simplicity``).
TIE = 0.005
# A plan whose estimate rests on more unchecked terms (UNCHECKED_TERMS) than one within this fraction of
# its predicted step does not lead: so small a margin is inside what the model misses on the terms
# measurements did check (docs/cost_model.md: within 5 MFU points, a tenth of a step), and a term
# nothing checked would decide the ranking.
UNCHECKED_MARGIN = 0.05


def simplicity(p: PlanPoint) -> tuple:
    """How much a plan asks of a user's run, least first: kinds of parallelism beside dp, then
    pipeline stages, tp, cp and ep sizes, microbatches, recompute, the ZeRO stage."""
    return (sum(n > 1 for n in (p.tp, p.pp, p.cp, p.ep)), p.pp * p.v, p.tp, p.cp, p.ep, p.mb,
            RECOMPUTE_ORDER.index(p.recompute), p.zero)


# Interleaved schedules are tried with this many virtual stages per rank (Narayanan et al. 2021 use 2-4).
INTERLEAVED_V = (2,)
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb")


# The families a user weighs against each other; the explanation shows the best plan of each. A plan
# belongs to the first family whose test it passes.
FAMILIES = (
    ("+ep", lambda p: p.ep > 1),
    ("+cp", lambda p: p.cp > 1),
    ("dp+tp+pp", lambda p: p.tp > 1 and p.pp > 1),
    ("dp+pp", lambda p: p.pp > 1),
    ("dp+tp", lambda p: p.tp > 1),
    ("dp+ZeRO", lambda p: True),
)
# Terms of the step time that no measurement has checked (docs/cost_model.md, "What is measured
# where"): a plan that relies on one is flagged, with the best plan that relies on none beside it.
# Checked: one-node tp/sp/pp and the host's per-microbatch launch time (the playbook's sweep,
# fitted), dp, tp, pp and their mixes across 2-32 nodes (the same sweep: docs/cost_model.md),
# FSDP over 8-16 nodes (torchtitan, MaxText). At 64 nodes the sweep's rows come within 5 MFU points
# only at MFU that low (its pipelined rows with its cluster's transfer time fitted on them), and
# the plans the search chooses there ran at most half their prediction (docs/cost_model.md, "The
# planner's choices"), so collective bandwidth is checked to 32 nodes where the profile measured it
# by node count, and to 16 where it did not.
UNCHECKED_TERMS = (
    (lambda p, n: p.cp > 1, "the cp ring's overlap with attention"),
    (lambda p, n: p.pp > 1 and p.schedule != "1f1b", "the bubble of schedule={schedule}"),
    (lambda p, n: p.world > n * p.gpus_per_node, "collective bandwidth beyond {nodes} nodes"),
)
CHECKED_NODES = (16, 32)  # (without, with) a busbw-by-nodes table in the profile


def family(point: PlanPoint) -> str:
    return next(name for name, test in FAMILIES if test(point))


def unchecked_terms(point: PlanPoint, measured_nodes: int = 0) -> list[str]:
    """The step-time terms this plan's estimate rests on that no measurement has checked;
    ``measured_nodes``: the most nodes the profile's bandwidth tables cover (0: none)."""
    nodes = min(measured_nodes, CHECKED_NODES[1]) if measured_nodes else CHECKED_NODES[0]
    return [text.format(schedule=point.schedule, nodes=nodes) for test, text in UNCHECKED_TERMS
            if test(point, nodes)]


@dataclass(frozen=True)
class PlanTarget:
    """What to plan for: the cluster and the training shape (global_batch in sequences)."""

    gpus: int
    seq: int
    global_batch: int
    gpus_per_node: int = 8
    dtype: str = "bf16"
    fixed: tuple[tuple[str, object], ...] = ()  # axes/options the user wrote: kept as written
    assumption: str = ""  # what the planner assumed that the user did not write (printed with the choice)


@dataclass(frozen=True)
class Candidate:
    plan: PlanPoint
    estimate: Estimate

    @property
    def step(self) -> float:
        return self.estimate.time["step"]


@dataclass
class PlanSearch:
    """The planner's answer: the best plan, the runners-up and why each lost, what was dropped."""

    target: PlanTarget
    hardware: str
    best: Candidate | None
    alternatives: list[Candidate]
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> how many plans
    rejected_examples: dict[str, str] = field(default_factory=dict)  # reason -> one plan and why
    evaluated: int = 0
    skipped_shapes: int = 0  # mesh shapes whose step floor was over every plan the answer could show
    skipped_zero_stages: int = 0  # ZeRO stages of the shapes walked whose floor was over them too
    seconds: float = 0.0
    families: dict = field(default_factory=dict)  # family -> its best Candidate, or why none fits
    best_checked: Candidate | None = None  # the best plan whose estimate rests on no unchecked term
    measured_nodes: int = 0  # the most nodes the profile's bandwidth tables cover (unchecked_terms)

    def why_lost(self, other: Candidate) -> str:
        return why_slower(other, self.best, self.measured_nodes)

    @property
    def unchecked_terms(self) -> list[str]:
        """The step-time terms the chosen plan's estimate rests on that no measurement has checked."""
        return unchecked_terms(self.best.plan, self.measured_nodes)

    def __str__(self) -> str:
        from .report_cost import render_search
        return render_search(self)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def mesh_shapes(profile: ModelProfile, target: PlanTarget) -> Iterator[tuple[dict, str | None]]:
    """(axis sizes, None) for every factorisation of the GPUs, or (sizes, reason) when one is impossible."""
    fixed = dict(target.fixed)
    layers = max(1, profile.layers)
    eps = divisors(target.gpus) if profile.experts or fixed.get("ep", 1) > 1 else [1]
    for tp in divisors(target.gpus):
        for pp in divisors(target.gpus // tp):
            for cp in divisors(target.gpus // (tp * pp)):
                for ep in (e for e in eps if (target.gpus // (tp * pp * cp)) % e == 0):
                    dp = target.gpus // (tp * pp * cp * ep)
                    sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
                    written = written_sizes(sizes)
                    if any(axis in fixed and fixed[axis] != n for axis, n in written.items()):
                        continue
                    yield sizes, _shape_problem(profile, target, sizes, layers)


def _shape_problem(profile: ModelProfile, target: PlanTarget, s: dict, layers: int) -> str | None:
    """Why a mesh shape cannot run this model and batch (None when it can)."""
    rules = [
        (s["tp"] > 1 and (not profile.tp_divides or profile.tp_divides % s["tp"]),
         f"tp={s['tp']} does not divide the model's split dims (heads, kv heads, hidden, vocab)"),
        (s["tp"] > target.gpus_per_node, f"tp={s['tp']} would cross nodes (playbook: keep tp within a node)"),
        (s["cp"] > 1 and (not profile.cp_possible or target.seq % s["cp"]),
         f"cp={s['cp']} does not divide the sequence {target.seq} (or attention cannot be split)"),
        (s["pp"] > layers, f"pp={s['pp']} exceeds the {layers} layers"),
        (target.global_batch % s["dp"], f"dp={s['dp']} does not divide the global batch {target.global_batch}"),
        (s["ep"] > 1 and (not profile.experts or profile.experts % s["ep"]),
         f"ep={s['ep']} needs experts divisible by it (the model has {profile.experts})"),
    ]
    return next((reason for bad, reason in rules if bad), None)


def base_point(target: PlanTarget, sizes: dict, sp_possible: bool) -> PlanPoint:
    """The plan of a mesh shape before options: sp whenever tp>1 allows it (it only saves memory,
    Korthikanti et al. 2022) and the model's sp compiles, zig-zag cp when the sequence splits into
    2*cp chunks (balanced causal work)."""
    sp = sp_possible and sizes["tp"] > 1 and (target.seq // sizes["cp"]) % sizes["tp"] == 0
    cp_mode = "zigzag" if sizes["cp"] > 1 and target.seq % (2 * sizes["cp"]) == 0 else "ring"
    return PlanPoint(target.global_batch, target.seq, **sizes, sp=sp, cp_mode=cp_mode, dtype=target.dtype,
                     gpus_per_node=target.gpus_per_node)


def _matches_fixed(point: PlanPoint, fixed: dict) -> bool:
    written = written_sizes({axis: getattr(point, axis) for axis in ("dp", "tp", "pp", "cp", "ep")})
    return all(written.get(name, getattr(point, name, None)) == value
               for name, value in fixed.items() if hasattr(point, name) and name != "recompute")


def _schedules(pp: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    return [(s, 1) for s in SCHEDULES if s != "interleaved"] + [("interleaved", v) for v in INTERLEAVED_V]


def _microbatches(per_replica: int, pp: int, fixed: int | None = None) -> list[int]:
    """The microbatch counts to try for a replica's ``per_replica`` sequences: every count that
    divides them (a batch of 6 runs as 1, 2, 3 or 6), up to MAX_MICROBATCHES and at least ``pp``
    where one is; ``fixed``: the count the spec writes, alone (none where it does not divide)."""
    if fixed is not None:
        return [fixed] if per_replica % fixed == 0 else []
    options = [m for m in divisors(per_replica) if m <= MAX_MICROBATCHES]
    return [m for m in options if m >= pp] or options[-1:]


def search(profile: ModelProfile, target: PlanTarget, hw: HardwareProfile, *,
           supported: Callable[[PlanPoint], str | None] = lambda p: None, keep: int = 5,
           skip: bool = True) -> PlanSearch:
    """Rank every plan that fits; ``supported(point)`` returns why the compiler refuses it, or None.
    ``skip``: leave out the mesh shapes whose step floor (``cost_model.step_floor``) is over every plan
    the answer could still show (``_Shown``) -- the answer is the same (tests hold it to ``skip=False``);
    the shapes with the lowest floors are walked first, so the bar is low early."""
    start = time.perf_counter()
    result = PlanSearch(target, hw.name, None, [], measured_nodes=hw.measured_nodes)
    search_state = _Search(profile, target, hw, result, supported)
    shapes = list(mesh_shapes(profile, target))
    bases = {i: search_state.base(sizes) for i, (sizes, problem) in enumerate(shapes) if not problem}
    floors = {i: search_state.floor(shapes[i][0], base) if skip else 0.0 for i, base in bases.items()}
    found: dict[int, tuple[list[Candidate], PlanSearch]] = {}
    shown = _Shown(keep + 1, hw.measured_nodes)
    for i in sorted(bases, key=floors.__getitem__):
        bar = shown.bar(bases[i])
        zeros = None  # every ZeRO stage
        if skip and floors[i] <= bar:
            # the step's end (gradient sums, the optimizer) per ZeRO stage, only for a shape under the
            # bar without it: the stages whose floor is over it are left out
            ends = search_state.gradient_floor(shapes[i][0], bases[i])
            zeros = tuple(zero for zero, end in ends.items() if floors[i] + end <= bar)
        if floors[i] > bar or zeros == ():
            result.skipped_shapes += 1
            continue
        result.skipped_zero_stages += len(_zero_stages(shapes[i][0])) - len(zeros) if zeros is not None else 0
        found[i] = search_state.walk(shapes[i][0], bases[i], zeros)
        shown.add(found[i][0])
    # the plans and rejections in the enumeration's order (a tie of steps keeps it, each reason's
    # example is its first), whatever order the walk took
    fits: list[Candidate] = []
    for i, (sizes, problem) in enumerate(shapes):
        if problem:
            _reject(result, problem, _shape_text(sizes))
        elif i in found:
            fits += found[i][0]
            _merge_rejections(result, found[i][1])
    fits.sort(key=lambda c: c.step)
    if fits:
        chosen = _lead(fits, hw.measured_nodes)
        fits.remove(chosen)
        fits.insert(0, chosen)
    result.best = fits[0] if fits else None
    result.alternatives = _distinct(fits, keep + 1)[1:]
    result.families = _best_of_families(fits, search_state.closest_misses)
    result.best_checked = next((c for c in fits if not unchecked_terms(c.plan, hw.measured_nodes)), None)
    result.seconds = time.perf_counter() - start
    return result


def _lead(fits: list[Candidate], measured_nodes: int) -> Candidate:
    """The plan to choose among ``fits`` (fastest first): of the plans within UNCHECKED_MARGIN of the
    fastest, the fastest resting on the fewest unchecked terms; then, within a tie of it, the simplest
    resting on no more (the cost model cannot tell them apart)."""
    near = [c for c in fits if c.step <= fits[0].step * (1 + UNCHECKED_MARGIN) * (1 + TIE)]
    terms = {id(c): len(unchecked_terms(c.plan, measured_nodes)) for c in near}
    least = min(terms[id(c)] for c in near if c.step <= fits[0].step * (1 + UNCHECKED_MARGIN))
    lead = next(c for c in near if terms[id(c)] == least)
    return min((c for c in near if c.step <= lead.step * (1 + TIE) and terms[id(c)] <= least),
               key=lambda c: simplicity(c.plan))


class _Shown:
    """The steps a mesh shape's plans must beat to change the search's answer: a place among the
    fastest ``places`` mesh shapes (the choice's and the runners-up), the best of their family, a
    place among the plans the choice is taken from (within ``UNCHECKED_MARGIN`` and a tie of the
    fastest: ``_lead``), or the best plan resting on no unchecked term (where the shape can hold
    one). ``bar(point)`` is the highest of them for ``point``'s shape: a shape whose every plan is
    slower changes nothing the search returns."""

    def __init__(self, places: int, measured_nodes: int) -> None:
        self.places, self.measured_nodes = places, measured_nodes
        self.shape_bests: list[float] = []  # each walked shape's fastest plan, fastest first
        self.family_best: dict[str, float] = {}
        self.checked_best = math.inf

    def add(self, candidates: list[Candidate]) -> None:
        if not candidates:
            return
        bisect.insort(self.shape_bests, min(c.step for c in candidates))
        for c in candidates:
            name = family(c.plan)
            self.family_best[name] = min(self.family_best.get(name, math.inf), c.step)
            if not unchecked_terms(c.plan, self.measured_nodes):
                self.checked_best = min(self.checked_best, c.step)

    def bar(self, point: PlanPoint) -> float:
        if len(self.shape_bests) < self.places:
            return math.inf
        # a 1F1B plan of a shape without cp can rest on no unchecked term
        may_be_checked = point.cp == 1 and not unchecked_terms(point.with_(schedule="1f1b"), self.measured_nodes)
        return max(self.shape_bests[self.places - 1], self.shape_bests[0] * (1 + UNCHECKED_MARGIN) * (1 + TIE),
                   self.family_best.get(family(point), math.inf), self.checked_best if may_be_checked else 0.0)


class _Search:
    """Walks the options of one mesh shape, pruning what cannot win (see ``shape``)."""

    def __init__(self, profile, target, hw, result, supported) -> None:
        self.profile, self.target, self.hw, self.result = profile, target, hw, result
        self.supported, self.cache = supported, {}
        self.closest_misses: dict[str, str] = {}  # family -> its plan that came closest to fitting
        self.least_memory: dict[str, float] = {}
        self.capacity = hw.hbm_bytes * MEMORY_HEADROOM
        self.fixed = dict(target.fixed)

    def base(self, sizes: dict) -> PlanPoint:
        """The shape's plan before its options, fused where compile runs fusion."""
        base = base_point(self.target, sizes, self.profile.sp_possible)
        if "fuse" not in self.fixed and not self.refusal(replace(base, fuse=True)):
            base = replace(base, fuse=True)  # fusion only saves memory traffic: use it once compile runs it
        return base

    def floor(self, sizes: dict, base: PlanPoint) -> float:
        """The step no plan ``shape(sizes, base)`` walks can beat (``cost_model.step_floor``)."""
        counts = _microbatches(self.target.global_batch // sizes["dp"], sizes["pp"], self.fixed.get("mb"))
        if not counts:
            return 0.0  # walked, to say why nothing runs (``shape``)
        return step_floor(self.profile, base, self.hw, counts, _schedules(sizes["pp"]))

    def gradient_floor(self, sizes: dict, base: PlanPoint) -> dict[int, float]:
        """Per ZeRO stage, what every plan ``shape(sizes, base)`` walks at it adds at the step's end
        beyond ``floor`` (``cost_model.gradient_floor``)."""
        counts = _microbatches(self.target.global_batch // sizes["dp"], sizes["pp"], self.fixed.get("mb"))
        if not counts:
            return {zero: 0.0 for zero in _zero_stages(sizes)}
        return gradient_floor(self.profile, base, self.hw, counts, _zero_stages(sizes))

    def walk(self, sizes: dict, base: PlanPoint, zeros: tuple[int, ...] | None = None
             ) -> tuple[list[Candidate], PlanSearch]:
        """``shape(sizes, base, zeros)``, and what it rejected and estimated, kept apart
        (``_merge_rejections``)."""
        kept, self.result = self.result, PlanSearch(self.target, self.hw.name, None, [])
        try:
            return self.shape(sizes, base, zeros), self.result
        finally:
            self.result = kept

    def shape(self, sizes: dict, base: PlanPoint, zeros: tuple[int, ...] | None = None) -> list[Candidate]:
        """For each ZeRO stage (of ``zeros``; None: every one) and schedule from ``base``
        (``base(sizes)``), microbatch counts in increasing order: more microbatches save activation
        memory and shrink the bubble but make each matmul smaller, so the walk stops once a plan fits
        without recompute (pp=1) or once the step time stops improving (pp>1)."""
        per_replica = self.target.global_batch // sizes["dp"]
        found = []
        counts = _microbatches(per_replica, sizes["pp"], self.fixed.get("mb"))
        if not counts:
            mb = self.fixed["mb"]
            _reject(self.result, f"mb={mb} does not divide the sequences each dp replica takes",
                    lambda: f"{base.with_(mb=mb).text()}: {per_replica} sequences a replica")
            return found
        for zero in (_zero_stages(sizes) if zeros is None else zeros):
            for schedule, v in _schedules(sizes["pp"]):
                previous = None
                for mb in counts:
                    point = base.with_(zero=zero, schedule=schedule, v=v, mb=mb)
                    if not _matches_fixed(point, self.fixed):
                        continue
                    candidate, refused = self.first_that_fits(point)
                    if refused:
                        break
                    if candidate is None:
                        continue
                    found.append(candidate)
                    if previous is not None and candidate.step >= previous.step \
                            and not self.lighter_recompute_fits(candidate.plan, counts[-1]):
                        break
                    if sizes["pp"] == 1 and candidate.plan.recompute == "none":
                        break
                    if previous is None or candidate.step < previous.step:
                        previous = candidate  # the best so far: a lighter recompute must beat it
        return found

    def first_that_fits(self, point: PlanPoint) -> tuple[Candidate | None, bool]:
        """(the point with the least recompute that fits, whether the compiler refuses the point)."""
        choices = (self.fixed["recompute"],) if "recompute" in self.fixed else RECOMPUTE_ORDER
        refused_all = True
        for recompute in choices:
            candidate = point.with_(recompute=recompute)
            reason = self.refusal(candidate)
            if reason:
                _reject(self.result, f"not supported yet: {reason}", candidate.text)
                continue
            refused_all = False
            # cheap: the time model runs only on plans that fit. A plan over the capacity whose stage
            # already holds more than its family's closest miss changes nothing further: stop there
            known = self.least_memory.get(family(candidate), float("inf"))
            memory = peak_memory(self.profile, candidate, stop_above=max(self.capacity, known))
            self.result.evaluated += 1
            if sum(memory.values()) <= self.capacity:
                # the whole peak (no stage over the stop): the estimate's own memory
                return Candidate(candidate, estimate(self.profile, candidate, self.hw, memory=memory)), False
            largest = max(memory, key=memory.get)
            self.note_miss(candidate, sum(memory.values()))
            total = sum(memory.values())
            _reject(self.result, "does not fit in memory",
                    lambda: f"{candidate.text()}: {total / 2**30:.1f} GiB per rank (largest: {largest})")
        return None, refused_all

    def lighter_recompute_fits(self, plan: PlanPoint, most: int) -> bool:
        """Whether a lighter recompute than ``plan``'s fits with the most microbatches: more of them
        may still pay off where one more did not (full recompute at 1 and 2, selective at 4)."""
        if "recompute" in self.fixed:
            return False
        for lighter in RECOMPUTE_ORDER[:RECOMPUTE_ORDER.index(plan.recompute)]:
            point = plan.with_(mb=most, recompute=lighter)
            if not self.refusal(point) and \
                    sum(peak_memory(self.profile, point, stop_above=self.capacity).values()) <= self.capacity:
                return True
        return False

    def note_miss(self, point: PlanPoint, total: float) -> None:
        name = family(point)
        if total < self.least_memory.get(name, float("inf")):
            self.least_memory[name] = total
            self.closest_misses[name] = (f"none fits; closest {point.text()}: {total / 2**30:.1f} GiB per rank "
                                         f"of {self.capacity / 2**30:.1f}")

    def refusal(self, point: PlanPoint) -> str | None:
        key = _support_key(point)
        if key not in self.cache:
            self.cache[key] = self.supported(point)
        return self.cache[key]


def _zero_stages(sizes: dict) -> tuple[int, ...]:
    """The ZeRO stages a mesh shape's walk tries: all four where there is dp to shard over, else 0."""
    return (0, 1, 2, 3) if sizes["dp"] > 1 else (0,)


def _support_key(p: PlanPoint) -> tuple:
    """What the compiler's support checks read of a plan, and their messages show (passes/plan_checks.py):
    plans equal in it are refused alike, in the same words -- an interleaved schedule's microbatches
    against pp, split's cut count against pp*v and ep against dp included."""
    interleaved = p.pp > 1 and p.schedule == "interleaved"
    return (p.dp > 1, p.tp > 1, p.pp > 1, p.cp > 1, p.ep > 1, p.zero, p.mb > 1, p.sp, p.recompute,
            p.schedule if p.pp > 1 else "", p.v, p.cp_mode if p.cp > 1 else "", p.dtype, p.fuse,
            (p.pp, p.mb) if interleaved else None, (p.pp, len(p.split)) if p.split is not None else None,
            (p.dp, p.ep) if p.ep > 1 else None)


def _merge_rejections(result: PlanSearch, part: PlanSearch) -> None:
    """Add one shape's rejections and estimates (``_Search.walk``) to the search's."""
    for reason, n in part.rejected.items():
        result.rejected[reason] = result.rejected.get(reason, 0) + n
        result.rejected_examples.setdefault(reason, part.rejected_examples[reason])
    result.evaluated += part.evaluated


def _reject(result: PlanSearch, reason: str, example: "str | Callable[[], str]") -> None:
    """Count a rejection; the first of each reason is kept as its example (a callable is called only
    then: the search rejects thousands of plans and writes a few of them out)."""
    result.rejected[reason] = result.rejected.get(reason, 0) + 1
    if reason not in result.rejected_examples:
        result.rejected_examples[reason] = example() if callable(example) else example


def _shape_text(sizes: dict) -> str:
    return " ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "dp=1"


def _best_of_families(fits: list[Candidate], misses: dict[str, str]) -> dict:
    """Each family's fastest plan (``fits`` is sorted, but for the choice first: a tie's simplest plan
    stands for its family), or why none of the family fits."""
    out: dict = {}
    for c in fits:
        out.setdefault(family(c.plan), c)
    for name, _ in FAMILIES:
        if name not in out and name in misses:
            out[name] = misses[name]
    return {name: out[name] for name, _ in reversed(FAMILIES) if name in out}


def _distinct(candidates: list[Candidate], keep: int) -> list[Candidate]:
    """The best plan of each mesh shape in order (the first is the winner's), so the runners-up show
    real choices rather than the winner with another ZeRO stage."""
    seen, out = set(), []
    for c in candidates:
        shape = (c.plan.dp, c.plan.tp, c.plan.pp, c.plan.cp, c.plan.ep)
        if shape not in seen:
            seen.add(shape)
            out.append(c)
        if len(out) == keep:
            break
    return out


def why_slower(loser: Candidate, best: Candidate, measured_nodes: int = 0) -> str:
    """One line: how much slower and which time term grew most (and by what); for a plan predicted
    faster than the choice, why it did not lead."""
    from .report_cost import _ms

    slower = loser.step / best.step - 1
    if slower < 0:
        extra = [t for t in unchecked_terms(loser.plan, measured_nodes)
                 if t not in unchecked_terms(best.plan, measured_nodes)]
        if extra:  # faster by less than the model's error, on terms nothing measured
            return (f"{slower:+.1%} step time, within {UNCHECKED_MARGIN:.0%} of the choice but resting on "
                    f"{'; '.join(extra)}, which no measurement has checked and the choice does not rest on")
        return f"{slower:+.1%} step time: within {TIE:.1%} of the choice, which is the simpler plan"
    deltas = {k: loser.estimate.time[k] - best.estimate.time[k] for k in TIME_TERMS}
    term = max(deltas, key=deltas.get)
    axes = _exposed_by_axis(loser.estimate)
    detail = ""
    if term == "exposed_comm" and axes:
        axis = max(axes, key=axes.get)
        detail = f", mostly {axis} ({_ms(axes[axis])})"
    if term == "compute" and loser.plan.recompute != "none":
        detail = f" (recompute={loser.plan.recompute})"
    return f"{slower:+.1%} step time: {TIME_TERMS[term]} +{_ms(deltas[term])}{detail}"


def _exposed_by_axis(est: Estimate) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in est.collectives:
        out[c.axis] = out.get(c.axis, 0.0) + c.exposed_seconds
    return out


__all__ = ["PlanTarget", "PlanSearch", "Candidate", "search", "why_slower", "MEMORY_HEADROOM", "family",
           "unchecked_terms", "FAMILIES", "UNCHECKED_MARGIN"]
