"""The cost model: bytes, FLOPs, collectives and step time per rank for any plan, from ONE trace.

A :class:`ModelProfile` holds per-layer quantities measured once (``usc.passes.cost_profile.profile_model``
traces the model and compiles two small probe plans); :func:`estimate` turns it into per-rank costs
for a :class:`PlanPoint` analytically, in microseconds, so the planner can score thousands of plans
without tracing again. Every measured quantity is a sum of :class:`Amount` buckets keyed by how it
scales (``ScaleKey``): with the global batch B (split over dp and the mb microbatches), with the
sequence S (split over cp), and whether tp splits it. The formulas (docs/cost_model.md):

    tokens per rank per microbatch   t  = B/(dp*mb) * S/cp
    parameters                       P  = P_rep + P_tp/tp       (fp32; the stage's layers)
    gradients / AdamW state          P, 2P                      (ZeRO: /dp from stage 2 / 1)
    activations (one microbatch)     A  = sum_k a_k * B^[b_k]/(dp*mb)^[b_k] * S^[s_k]/cp^[s_k] / tp^[t_k]
    peak activations, pp rank k      A * in_flight(schedule, pp, mb, k)   (1F1B: min(pp - k, mb));
                                     zb: max over its actions of A * (F..W held) + J * (I..W held)
    FLOPs (forward)                  F  = f_mm * t / tp + f_attn * t * S/cp / tp;  backward 2F
    collective time (ring)           all-reduce 2(n-1)/n * bytes/bw, all-gather (n-1) * bytes/bw, ...
    step                             mb * (compute + tp + cp + pp) + bubble + exposed dp + optimizer

Assumptions are named constants below, each with its reason.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from functools import partial
from typing import NamedTuple

from .cost_types import (BYTES_FP32, CollectiveCost, CollectiveEstimate, Estimate, ModelProfile,  # noqa: F401
                         PlanPoint, ScaleKey, UnitCost, tied_once)
from .hardware import BUSBW_FIELDS, HardwareProfile
from usc.runtime.sizes import shape_bytes
from .partition import balanced_cut, manual_cut
from .shared_cores import SIMULATED, shared_bubble_units

# The sustained fraction of the matmul peak (and its fall-off with each call's work, or with the rows
# per microbatch), the fraction of link bandwidth collectives reach and the host's per-layer launch
# time are fields of the hardware profile (compiler/hardware.py), which a calibration measures.
# Element-wise work is memory bound: it moves ``pointwise_traffic`` bytes (a hardware profile field,
# the runtime's kernels as much as the GPU's) per saved activation byte in forward + backward.
# The terms of a step's time (``Estimate.time``, less "step"), as reports name them.
TIME_TERMS = {"compute": "compute", "host": "waiting on the host", "exposed_comm": "exposed communication",
              "bubble": "pipeline bubble", "optimizer": "optimizer step"}
# fuse=on: generated kernels run a chain of element-wise ops in one pass, so intermediates are not
# written to and read back from HBM; we take half the traffic (typical of fused norm/activation chains).
FUSED_POINTWISE = 0.5
# AdamW touches params, grads and two states (read) and writes params and states: ~2x their bytes.
OPTIMIZER_TRAFFIC = 2.0
# Experts each token is routed to when the profile cannot tell (Mixtral, DeepSeek-MoE's routed top-2/6/8).
MOE_TOP_K = 2


# ---------------------------------------------------------------------------------------- scaling

def scale(key: ScaleKey, amount: float, profile: ModelProfile, plan: PlanPoint) -> float:
    """``amount`` measured at the profile's (B0, S0), unsplit, for one rank's microbatch of ``plan``."""
    return _scaled(key, amount, _scale_factors(profile, plan))


def _scale_factors(profile: ModelProfile, plan: PlanPoint) -> tuple[float, float, int, bool]:
    """What ``scale`` applies: (per batch key, per sequence key, the tp split, whether bf16 halves)."""
    return (plan.global_batch / profile.batch / (plan.dp * plan.ep * plan.mb),  # ep ranks see their own data
            plan.seq / profile.seq / plan.cp, plan.tp, plan.dtype == "bf16")


def _scaled(key: ScaleKey, value: float, factors: tuple[float, float, int, bool]) -> float:
    per_batch, per_seq, tp, halve = factors
    if key.bf16_only and not halve:
        return 0.0
    if key.batch:
        value *= per_batch
    if key.seq:
        value *= per_seq
    if key.tp:
        value /= tp
    if halve and key.is_float:
        value /= 2
    return value


def _acts(buckets: dict, profile: ModelProfile, plan: PlanPoint) -> float:
    """``scale`` summed over a {ScaleKey: bytes} bucket, its factors computed once per bucket (the
    planner sums tens of thousands of buckets)."""
    if not buckets:
        return 0
    factors = _scale_factors(profile, plan)
    return sum(_scaled(key, value, factors) for key, value in buckets.items())


def tokens_per_microbatch(profile: ModelProfile, plan: PlanPoint) -> float:
    return plan.global_batch * plan.seq / (plan.dp * plan.ep * plan.mb * plan.cp)


def _params(u: UnitCost, plan: PlanPoint) -> float:
    """fp32 bytes of the unit's parameters one rank holds (before ZeRO)."""
    return (u.params_rep + u.params_tp / plan.tp + (u.params_expert - u.params_expert_tp) / plan.ep
            + u.params_expert_tp / (plan.ep * plan.tp))


def _frozen(u: UnitCost, plan: PlanPoint) -> float:
    """Bytes of the unit's frozen parameters one rank holds (no ZeRO stage shards them)."""
    rep, split, expert, _ = u.params_frozen
    return rep + split / plan.tp + expert / plan.ep


def _frozen_copy(u: UnitCost, plan: PlanPoint) -> float:
    """Bytes of the step's bf16 copy of the unit's float32 frozen parameters (a bf16 plan casts all
    float state once per step; parameters frozen in bf16 need no copy)."""
    total, fp32 = sum(u.params_frozen[:3]), u.params_frozen[3]
    return _frozen(u, plan) * fp32 / total / 2 if total and plan.dtype == "bf16" else 0.0


def _unreduced(u: UnitCost, plan: PlanPoint) -> float:
    """fp32 bytes of those whose gradient the graph sums over dp (no bucket: ZeRO does not shard them)."""
    return u.params_unreduced[0] + u.params_unreduced[1] / plan.tp


# ----------------------------------------------------------------------------------- pipeline stages

def stage_units(profile: ModelProfile, pp: int, cuts: tuple[str, ...] | None = None) -> list[list[UnitCost]]:
    """Units per stage: contiguous, minimising the largest stage's estimated FLOPs, or cut where
    ``cuts`` (split=a|b) name -- the cut the pipeline split pass makes (same costs, same functions)."""
    units = list(profile.units)
    if pp == 1:
        return [units]
    stage = manual_cut([u.name for u in units], cuts) if cuts else balanced_cut([u.balance for u in units], pp)
    return [[u for u, s in zip(units, stage) if s == k] for k in range(pp)]


def merged_stages(profile: ModelProfile, pp: int, cuts: tuple[str, ...] | None = None) -> list[UnitCost]:
    """One summed UnitCost per stage (cached per pp and cuts): estimating a plan then costs a few
    dict sums. A stage's ``boundary`` is the cut after it (the last stage's crosses no cut)."""
    if cuts is not None and len(cuts) != pp - 1:
        cuts = None  # split= names the pp*v cuts; a per-rank view of v>1 chunks keeps the balanced one
    if (pp, cuts) not in profile._stages:
        profile._stages[(pp, cuts)] = [merge_units(units) for units in stage_units(profile, pp, cuts)]
    return profile._stages[(pp, cuts)]


def merge_units(units: list[UnitCost]) -> UnitCost:
    if not units:  # more stages than units (pp*v > units: the planner estimates plans compile refuses)
        return UnitCost("(no unit)")

    def add(dicts) -> dict:
        out: dict = {}
        for d in dicts:
            for k, v in d.items():
                out[k] = out.get(k, 0) + v
        return out

    def merge_comms(lists) -> tuple:
        out: dict = {}
        for c in (c for cs in lists for c in cs):
            k = (c.axis, c.kind, c.direction, c.key, c.ring, c.ring_steps, c.reissued)
            old = out.get(k)
            out[k] = c if old is None else replace(old, amount=old.amount + c.amount, count=old.count + c.count)
        return tuple(out.values())

    sps = {sp for u in units for sp in u.acts}
    tied, extra_rep, extra_tp = tied_once(units)
    largest = {sp: max((u.acts.get(sp, {}) for u in units), key=lambda d: sum(d.values()), default={}) for sp in sps}
    modes = {m for u in units for m in u.held}
    return UnitCost(units[0].name if len(units) == 1 else f"{units[0].name}..{units[-1].name}",
                    sum(u.balance for u in units), sum(u.flops_matmul for u in units),
                    sum(u.flops_attention for u in units),
                    {key: sum(u.flops_tp_whole.get(key, 0.0) for u in units)
                     for key in {k for u in units for k in u.flops_tp_whole}},
                    sum(u.params_rep for u in units) - extra_rep,
                    sum(u.params_tp for u in units) - extra_tp, sum(u.params_tp_reduced for u in units),
                    {sp: add(u.acts.get(sp, {}) for u in units) for sp in sps},
                    {sp: add(u.input_bytes.get(sp, {}) for u in units) for sp in sps},
                    {sp: merge_comms(u.collectives.get(sp, ()) for u in units) for sp in sps},
                    blocks=sum(u.blocks for u in units), largest_acts=largest,
                    held={m: add(u.held.get(m, {}) for u in units) for m in modes},
                    weight_joins={sp: add(u.weight_joins.get(sp, {}) for u in units) for sp in sps},
                    parts=tuple(p for u in units for p in (u.parts or (u,))),
                    params_expert=sum(u.params_expert for u in units),
                    params_expert_tp=sum(u.params_expert_tp for u in units),
                    moe_layers=sum(u.moe_layers for u in units),
                    params_saved=(sum(u.params_saved[0] for u in units), sum(u.params_saved[1] for u in units)),
                    boundary=units[-1].boundary, boundary_grad=units[-1].boundary_grad,
                    boundary_unsaved=units[-1].boundary_unsaved,
                    params_unreduced=tuple(map(sum, zip(*(u.params_unreduced for u in units)))), tied=tied,
                    params_frozen=tuple(map(sum, zip(*(u.params_frozen for u in units)))),
                    matmul_calls=sum(u.matmul_calls for u in units),
                    expert_calls=sum(u.expert_calls for u in units),
                    flops_backward=sum(u.backward_ratio * (u.flops_matmul + u.flops_attention) for u in units))


def in_flight(plan: PlanPoint, stage: int = 0) -> float:
    """Microbatches whose activations pipeline rank ``stage`` holds at once (Narayanan et al. 2021):
    under 1F1B rank k starts p - k forwards before its first backward, so the first rank holds the
    most and the last one microbatch."""
    p, m = plan.pp, plan.mb
    if p == 1:
        return 1.0  # gradient accumulation: one microbatch at a time
    if plan.schedule == "gpipe":
        return float(m)
    if plan.schedule == "interleaved":  # each chunk holds 1/v of the stage; p*v + p - 1 - 2k chunk-mbs
        return min(float(m), (p * plan.v + p - 1 - 2 * stage) / plan.v)
    return float(min(p - stage, m))  # 1f1b (zb's activations are read off its schedule: zb_holding)


def zb_program(pp: int, mb: int, stage: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s actions under ZB-H1, in order: ("F"|"I"|"W", microbatch). Written out here
    as ``shared_cores`` writes 1F1B (the compiler does not read the runtime's passes); equal to the
    runtime's schedule builder on every rank (tests/compiler/test_planner.py): 1F1B's order of F and
    I, rank r's first r steady steps without W, then one W per step and the rest at the end."""
    warmup = min(pp - stage - 1, mb)
    out, done = [("F", i) for i in range(warmup)], 0
    for i in range(mb):
        out += [] if warmup + i >= mb else [("F", warmup + i)]
        out.append(("I", i))
        if warmup + i >= mb or i >= stage:
            out.append(("W", done))
            done += 1
    return out + [("W", m) for m in range(done, mb)]


@functools.lru_cache(maxsize=4096)
def zb_holding(pp: int, mb: int, stage: int) -> tuple[tuple[int, int], ...]:
    """The (microbatches, of them past their input-gradient pass) pipeline rank ``stage`` holds
    after each action of schedule=zb (``zb_program``): a microbatch's graph lives from its forward
    to its weight-gradient pass (the input pass keeps it for the weights), and once past the input
    pass it also holds the output gradients recorded for the weight pass (the first rank records
    none: its inputs need no gradient, so its weight pass is a plain backward). The last rank,
    which 1F1B leaves one microbatch, holds two at pp=2 and four at pp=4 mb=8 (counted
    independently on usc's and transformers' Llama: tests/distributed/test_cost_model_validation.py)."""
    held, past, states = set(), set(), set()
    for op, m in zb_program(pp, mb, stage):
        if op == "F":
            held.add(m)
        elif op == "I":
            past.add(m)
        else:
            held.discard(m)
            past.discard(m)
        states.add((len(held), len(past & held)))
    return tuple(sorted(states)) or ((0, 0),)


def bubble_units(plan: PlanPoint) -> float:
    """Idle time in units of one microbatch's forward+backward on a stage (docs/cost_model.md)."""
    p = plan.pp
    if p == 1:
        return 0.0
    if plan.schedule == "interleaved":
        return (p - 1) / plan.v
    if plan.schedule in ("zb", "dualpipe"):
        return (p - 1) / 3  # ZB-H1 (Qi et al. 2024): about a third of 1F1B's bubble
    return float(p - 1)


def _simulates_shared_cores(plan: PlanPoint, hw: HardwareProfile) -> bool:
    """Whether the plan's ranks share fewer cores than they are and its bubble is simulated so."""
    return plan.pp > 1 and 0 < hw.host_cores < min(plan.world, plan.gpus_per_node) and plan.v == 1 \
        and plan.schedule in SIMULATED


def pipeline_bubble_units(plan: PlanPoint, hw: HardwareProfile, costs: tuple[tuple[float, float], ...] | None = None,
                          unit: float = 3.0) -> float:
    """``bubble_units``, or on a host whose ranks share fewer cores (``host_cores``) the bubble left
    once idle ranks hand their cores to the busy ones (compiler/shared_cores.py; 1F1B and GPipe);
    ``costs``: there, each stage's (forward, backward) in the units of ``unit`` (None: alike)."""
    if _simulates_shared_cores(plan, hw):
        ranks = min(plan.world, plan.gpus_per_node)
        return shared_bubble_units(plan.schedule, plan.pp, plan.mb, ranks, hw.host_cores, costs, unit)
    return bubble_units(plan)


# ------------------------------------------------------------------------------------------ memory

# Per pipeline cut a rank sits on, the boundary tensors (one microbatch's hidden state) it holds
# besides the activations: the one it is sending until the peer takes it, the buffer posted for its
# next receive and the one received and not yet used. Measured (4-layer Llama and GPT-2, 12 pp plans,
# an independent count): 2.7-4.0 per cut on a first or last stage, 6.0 on a middle one (two cuts).
P2P_BUFFERS_PER_CUT = 3


def p2p_buffers(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost]) -> tuple[float, ...]:
    """Per pipeline rank, bytes of the transfer buffers it holds (``P2P_BUFFERS_PER_CUT`` per cut; with
    v chunks per rank, each chunk's cuts)."""
    p = len(stages)
    if p == 1:
        return (0.0,)
    sp = plan.sp and plan.tp > 1

    def compute():
        hidden = max(_acts(stages[i].boundary.get(sp, {}), profile, plan) for i in range(p - 1))
        return tuple(P2P_BUFFERS_PER_CUT * (2 * plan.v - (k == 0) - (k == p - 1)) * hidden for k in range(p))
    return memo(profile, ("p2p", id(stages), sp, _scale_of(plan), plan.v), compute)


def stage_memory(profile: ModelProfile, plan: PlanPoint, units: list[UnitCost], stage: int = 0,
                 p2p: float = 0.0) -> dict[str, float]:
    """Bytes one rank of pipeline stage ``stage`` (made of ``units``) holds at the step's peak;
    ``p2p``: its pipeline transfer buffers (``p2p_buffers``), counted with the activations."""
    held, grads, optimizer, params, sharded = _state_bytes(plan, units)
    gathered = 0.0
    if plan.zero >= 3 and plan.dp > 1:  # two layers whole at once (the current one, one prefetched)
        biggest = max((_params(u, plan) / u.blocks for u in units), default=0.0)
        gathered = 2 * biggest
    return {"params": held, "frozen": sum(_frozen(u, plan) for u in units), "grads": grads, "optimizer": optimizer,
            "activations": stage_activations(profile, plan, units, params, sharded, stage, p2p),
            "gathered": gathered}


def _state_bytes(plan: PlanPoint, units: list[UnitCost]) -> tuple[float, float, float, float, float]:
    """(parameters held, gradients, optimizer state, parameters before ZeRO, after) of one rank of
    the stage ``units``, in bytes (``stage_memory``'s)."""
    params = unreduced = 0
    for u in units:
        params += _params(u, plan)
        unreduced += _unreduced(u, plan)
    sharded = (params - unreduced) / plan.dp + unreduced  # ZeRO shards what the dp buckets reduce
    # ZeRO-1 accumulates whole gradients over the microbatches (a pipeline's stage always has
    # several); with one, each bucket's whole gradient is dropped once it is sent, as ZeRO-2's are
    grads = sharded if plan.zero >= 2 or (plan.zero == 1 and plan.mb == 1 and plan.pp == 1) else params
    if plan.zero == 2 and plan.pp > 1 and plan.dp > 1:  # a tied weight's gradient is final only at the
        # step's end (summed over pp first): its bucket holds it whole until then, in place of its slice
        tied = {name: rep + split / plan.tp for u in units for name, rep, split in u.tied}
        grads += sum(tied.values()) * (1 - 1 / plan.dp)
    optimizer = 2 * (sharded if plan.zero >= 1 else params)
    held = sharded if plan.zero >= 3 else params
    return held, grads, optimizer, params, sharded


def stage_activations(profile: ModelProfile, plan: PlanPoint, units: list[UnitCost], params: float,
                      sharded: float | None = None, stage: int = 0, p2p: float = 0.0) -> float:
    """Peak bytes saved for backward: one microbatch's worth times the microbatches in flight, and
    the transfer buffers ``p2p`` (``p2p_buffers``). ``params``: fp32 bytes of the stage's parameters
    one rank holds before ZeRO, ``sharded``: after (stage_memory's; None: as ``params``)."""
    how = (plan.recompute, plan.cp > 1, plan.tp > 1, plan.sp and plan.tp > 1)
    per_mb, live = cached(profile, ("activations", how, _scale_of(plan)), units,
                          lambda: _microbatch_activations(profile, plan, units, how))
    copies = 0.0
    if plan.dtype == "bf16":
        # the step's one bf16 copy of the parameters the rank holds, shared by its microbatches (the
        # weights linears save are these). Under ZeRO-3 those are the rank's shards: the gathered
        # bf16 weights go with the gather and are gathered again in backward (an independent count,
        # 4-layer Llama dp=2 bf16 zero=3: 1467620 bytes alive when backward begins, the shards'
        # copies included; without them the estimate was 10.9% under)
        copies = (sharded if plan.zero >= 3 and plan.dp > 1 and sharded is not None else params) / 2 \
            + sum(_frozen_copy(u, plan) for u in units)
    if plan.pp > 1 and plan.recompute == "none":
        # a stage keeps each microbatch's outputs -- what it sent on -- until that microbatch's
        # backward starts from them; those no op of the stage saves are counted here (an independent
        # count, transformers' Llama pp=2 mb=3, whose next stage's RMSNorm saves the stream through
        # its float32 cast: the first rank's two in-flight residual streams, without which the
        # estimate was 8.1% under). With v chunks a rank sends v a microbatch. (Under recompute a
        # region's input is counted where it is read and the estimate holds within 5% as it is.)
        per_mb += _acts(units[-1].boundary_unsaved.get(plan.sp and plan.tp > 1, {}), profile, plan) * plan.v
    if plan.schedule == "zb" and plan.pp > 1:
        joins = cached(profile, ("joins", _scale_of(plan), plan.sp and plan.tp > 1), units,
                       lambda: sum(_acts(u.weight_joins.get(plan.sp and plan.tp > 1, {}), profile, plan)
                                   for u in units))
        # a stage whose inputs carry no gradient (the first; one behind frozen layers) records nothing
        # in its input pass: its weight pass is a plain backward
        joins = joins if stage > 0 and _input_has_gradient(profile, units) else 0.0
        held = max(f * per_mb + i * joins for f, i in zb_holding(plan.pp, plan.mb, stage)) + copies
    else:
        held = per_mb * in_flight(plan, stage) + copies
    if not live:
        return held + p2p
    # Under recompute the peak is a recomputation in backward, when a cut holds the one buffer its
    # gradient arrived in, not forward's P2P_BUFFERS_PER_CUT (an independent count, 4-layer Llama
    # pp=2 mb=2 recompute=full, first stage: 2 x 0.078 MB held + 0.593 recomputing a layer + one
    # 0.033 buffer = 0.783 MB, 0.792 counted; with three buffers the estimate was 7.1% over)
    return held + max(p2p, live + p2p / P2P_BUFFERS_PER_CUT)


def _input_has_gradient(profile: ModelProfile, units: list[UnitCost]) -> bool:
    """Whether a value crossing the pipeline cut into this stage (``units``) carries a gradient: not
    when every layer before the stage is frozen."""
    first = units[0].parts[0] if units[0].parts else units[0]
    before = next((k for k, u in enumerate(profile.units) if u is first), 0) - 1
    return before >= 0 and any(sum(d.values()) for d in profile.units[before].boundary_grad.values())


def _microbatch_activations(profile: ModelProfile, plan: PlanPoint, units: list[UnitCost],
                            how: tuple) -> tuple[float, float]:
    """(bytes one microbatch saves for backward, the most recomputing a unit adds in backward)."""
    if plan.recompute == "none":
        return sum(_acts(u.acts.get(how[3], {}), profile, plan) for u in units), 0.0
    # what forward holds (region inputs, kept matmul outputs, all outside the blocks), and in
    # backward the tensors of the one unit being recomputed
    per_mb = sum(_acts(u.held.get(how, {}), profile, plan) for u in units)
    return per_mb, max((_recompute_peak(profile, plan, u.parts or (u,), how) for u in units), default=0.0)


def _scale_of(plan: PlanPoint) -> tuple:
    """What ``scale`` reads of a plan: plans equal in it scale every measured amount alike."""
    return plan.global_batch, plan.dp * plan.ep * plan.mb, plan.seq, plan.cp, plan.tp, plan.dtype == "bf16"


def cached(profile: ModelProfile, key: tuple, units: list[UnitCost], compute):
    """``compute()`` once per key and stage, kept in the profile's cache: the planner asks the same
    stage's activations for every ZeRO stage and schedule (a fifth of its search time each)."""
    key = (*key, *map(id, units))
    hit = profile._stages.get(key)
    if hit is None or len(hit[0]) != len(units) or any(a is not b for a, b in zip(hit[0], units)):
        hit = profile._stages[key] = (tuple(units), compute())  # the units kept: their ids stay theirs
    return hit[1]


def memo(profile: ModelProfile, key: tuple, compute):
    """``compute()`` once per key, kept in the profile's cache; the key names everything it reads (a
    stage list by ``id``: ``merged_stages`` keeps its lists for the profile's life, so an id is never
    reused). Values are shared by every caller: tuples, not lists."""
    hit = profile._stages.get(key, _MISSING)
    if hit is _MISSING:
        hit = profile._stages[key] = compute()
    return hit


_MISSING = object()


def _recompute_peak(profile: ModelProfile, plan: PlanPoint, parts: tuple, key: tuple) -> float:
    """The most backward adds to what forward held: it recomputes one region at a time, last first,
    and by then has freed what the regions (and values saved outside them) after it held."""
    factors, walks = _scale_factors(profile, plan), {}

    def acts(buckets: dict) -> float:
        return sum(_scaled(k, v, factors) for k, v in buckets.items()) if buckets else 0

    def walk(steps: tuple) -> tuple[float, float]:
        """(the most a unit's recomputation adds beyond what its own later steps freed, all it
        holds); a stack's stamped blocks share their steps: walked once."""
        if id(steps) not in walks:
            most, freed = -math.inf, 0.0
            for again, held in reversed(steps):
                most = max(most, acts(again) - freed)
                freed += acts(held)
            walks[id(steps)] = (most, freed)
        return walks[id(steps)]

    most, freed = 0.0, 0.0
    for unit in reversed(parts):
        steps = unit.recomputed.get(key, ())
        if steps:
            inside, held = walk(steps)
            most, freed = max(most, inside - freed), freed + held
    return most


# ------------------------------------------------------------------------------------ communication

def crosses_node(plan: PlanPoint, axis: str) -> bool:
    """Whether one group of ``axis`` spans nodes: its ranks are stride apart (row-major mesh)."""
    return _group_layout(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep, plan.order, plan.gpus_per_node, axis)[0]


@functools.lru_cache(maxsize=4096)
def _group_layout(dp: int, tp: int, pp: int, cp: int, ep: int, order: tuple, gpus_per_node: int, axis: str
                  ) -> tuple[bool, int]:
    """(whether one group of ``axis`` spans nodes, how many of its ranks share a node): its ranks are
    stride apart in the row-major mesh. Cached: the planner asks it for every collective of every plan."""
    sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    order = list(order)
    stride = math.prod(sizes[a] for a in order[order.index(axis) + 1:])
    return stride * sizes[axis] > gpus_per_node, max(1, min(sizes[axis], gpus_per_node // stride))


class Link(NamedTuple):
    """What a group's collectives run over: sustained bandwidth (bytes/s, per rank and direction),
    latency per algorithm step, and whether steps grow as n-1 (ring: gloo) or log2 n (NCCL's trees)."""

    bandwidth: float
    latency: float
    ring: bool = False
    factors: tuple = ()  # (kind, factor): what a kind takes over the formula (a profile's *_factor fields)
    measured: tuple = ()  # (kind, bandwidth): kinds that run at a measured bus bandwidth instead (the
    #                       profile's *_busbw_by_nodes at this group's node count)


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float, latency: float,
                       ring: bool = False, factors: tuple = (), measured: tuple = ()) -> float:
    """Seconds of one collective; ``nbytes`` is this rank's payload, ``bandwidth`` what the link
    sustains. Bandwidth term of the ring algorithms (Patarasuk & Yuan 2009), which NCCL uses for
    large messages; latency term of the (double binary) trees NCCL switches to when messages are
    small: 2*log2(n) steps for all-reduce, log2(n) for the others (Sanders et al. 2009; NCCL's tuning
    model) -- or a ring's n-1 steps per phase (gloo's ring algorithms). The latency term is also what
    makes the bus bandwidth grow with the message size (busbw = bytes / (bytes/bw + steps*latency)).
    ``factors``: a library whose kinds are not equally efficient (gloo's all-gather and
    reduce-scatter, measured by calibrate.py) takes each kind's factor times the formula.
    ``measured``: (kind, bandwidth) of kinds whose bus bandwidth over this group was measured (a
    profile's busbw by node count): their bandwidth term runs at it."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    for k, bw in measured:
        if k == kind:
            bandwidth = bw
    if factors:
        factor = dict(factors).get(kind, 1.0)
        if factor != 1.0:
            return factor * collective_seconds(kind, nbytes, n, bandwidth, latency, ring)
    steps = n - 1 if ring else math.ceil(math.log2(n))
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes / bandwidth + 2 * steps * latency
    if kind == "all-gather":  # payload is the local shard; n-1 shards arrive
        return (n - 1) * nbytes / bandwidth + steps * latency
    if kind in ("reduce-scatter", "all-to-all"):  # payload is the whole input; (n-1)/n leaves
        return (n - 1) / n * nbytes / bandwidth + steps * latency
    return nbytes / bandwidth + latency  # send/recv


def _link(hw: HardwareProfile, plan: PlanPoint, axis: str) -> Link:
    """A group that spans nodes drives every NIC its ranks in a node own: NCCL's rings and trees
    cross nodes once per node and channel, one channel per NIC, so a group with g ranks in each
    node moves g NIC shares (2-node H100 all-reduce measures 435 GB/s bus bandwidth at 1 GB, far
    above one 50 GB/s NIC: docs/cost_model.md, "Published vs predicted"). A pipeline transfer is one
    rank's send: one NIC. Where the profile measured a kind's bus bandwidth by node count (groups
    filling whole nodes), a crossing group runs that kind at the figure for as many nodes as its
    ranks would fill -- what falls with scale is the collective's length, its ranks in sequence,
    not the network: the Ultra-Scale Playbook's sweep runs dp groups of one rank per node (tp=8)
    over 32 nodes at 33% MFU, which the per-node figure, shared by eight such groups, puts at 16%
    (docs/cost_model.md, "The playbook's sweep") -- and never above the NICs its ranks own."""
    crosses = crosses_node(plan, axis)
    bandwidth, latency = hw.link(crosses_node=crosses)
    measured = ()
    if crosses and axis != "pp":
        per_node = ranks_per_node(plan, axis)
        bandwidth = min(bandwidth * per_node, hw.intra_node_bandwidth)
        if hw.measured_nodes:
            key = (getattr(plan, axis), per_node)
            measured = hw.link_cache.get(key)
            if measured is None:
                measured = hw.link_cache[key] = _measured_links(hw, *key)
    return Link(bandwidth * hw.comm_efficiency, latency, hw.latency_steps == "ring", hw.collective_factors,
                measured)


def _measured_links(hw: HardwareProfile, ranks: int, per_node: int) -> tuple:
    """(kind, bandwidth) of the kinds ``hw`` measured by node count, for a crossing group of
    ``ranks`` ranks, ``per_node`` of them in each node: the figure at the nodes its ranks would fill,
    at most its NICs' peak."""
    fills = max(2, round(ranks / hw.gpus_per_node))
    nics = per_node * hw.inter_node_bandwidth
    return tuple((kind, min(hw.busbw_across(kind, fills), nics)) for kind in BUSBW_FIELDS
                 if hw.busbw_across(kind, fills) is not None)


def _gradient_link(hw: HardwareProfile, plan: PlanPoint) -> Link:
    """The dp link of a step's gradient reduction and ZeRO-1/2's gather: ``_link``'s, at most what the
    profile holds such reductions sustain inside training steps for a group with this many ranks per
    node (``gradient_busbw_by_ranks_per_node``; reduce-scatter and all-gather at the by-nodes tables'
    ratio to all-reduce where the profile has them). On the h100 profile that figure grows about as the
    square root of the ranks per node, not in proportion to the NICs they own, so a dp group of one rank
    per node (tp=8) moves half the bytes of a tp=4 group at more than half its bandwidth: the Ultra-Scale
    Playbook's sweep measured tp=8 meshes 3-15% faster across 16-32 nodes, which the NIC reading
    alone ranked the other way (docs/cost_model.md, "The playbook's sweep")."""
    link = _link(hw, plan, "dp")
    if not hw.gradient_busbw_by_ranks_per_node or not crosses_node(plan, "dp"):
        return link
    per_node = ranks_per_node(plan, "dp")
    key = ("gradient", plan.dp, per_node)
    cached = hw.link_cache.get(key)
    if cached is None:
        figure = hw.gradient_busbw(per_node)
        fills = max(2, round(plan.dp / hw.gpus_per_node))
        all_reduce = hw.busbw_across("all-reduce", fills)
        # the kinds the by-nodes tables measured keep their ratio to all-reduce (a reduce-scatter moves
        # half an all-reduce's bytes and measured about half its busbw at 256 MB: the same time)
        measured = tuple((kind, min(bw, figure * (hw.busbw_across(kind, fills) / all_reduce if all_reduce else 1.0)))
                         for kind, bw in link.measured)
        cached = hw.link_cache[key] = (min(link.bandwidth, figure), measured)
    return link._replace(bandwidth=cached[0], measured=cached[1])


def ranks_per_node(plan: PlanPoint, axis: str) -> int:
    """How many ranks of one group of ``axis`` share a node (row-major mesh, as crosses_node)."""
    return _group_layout(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep, plan.order, plan.gpus_per_node, axis)[1]


def layer_collectives(profile: ModelProfile, plan: PlanPoint, units: list[UnitCost], hw: HardwareProfile
                      ) -> list[CollectiveEstimate]:
    """tp/sp and cp collectives of the stage for one microbatch (from the probes, rescaled); with
    recompute=full the forward collectives recomputation re-issues count again, in backward."""
    sp = plan.sp and plan.tp > 1
    sizes = {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp}
    out: dict[tuple, list[float]] = {}
    # (the dp entries are the loss's token count, summed in the graph: a few bytes)
    for unit in units:
        for c in unit.collectives.get(sp, ()):
            n = sizes.get(c.axis, 1)
            if n <= 1:
                continue
            per_call = scale(c.key, c.amount / c.count, profile, plan)
            calls = c.count * (n + c.ring_steps if c.ring else 1)
            again = c.reissued and plan.recompute == "full"
            issues = [(c.direction, calls)] + ([("backward", calls)] if again else [])
            link = _link(hw, plan, c.axis)
            for direction, k in issues:
                acc = out.setdefault((c.axis, c.kind, direction, n), [0.0, 0.0, 0.0])
                acc[0] += per_call * k
                acc[1] += k
                acc[2] += k * collective_seconds(c.kind, per_call, n, *link)
    return [CollectiveEstimate(axis, kind, direction, n, b, calls, s, s) for (axis, kind, direction, n), (b, calls, s)
            in out.items()]


def gradient_collectives(plan: PlanPoint, units: list[UnitCost], hw: HardwareProfile, backward_seconds: float
                         ) -> list[CollectiveEstimate]:
    """Gradient sums over dp (and cp), ZeRO gathers; overlapped with the last backward as buckets fill.
    Parameters whose gradient the graph sums itself are in no bucket (their sums are layer collectives).
    ZeRO-1 and -2 reduce-scatter over dp (runtime/zero.py): ZeRO-1 once, in the last microbatch's
    backward; ZeRO-2 in every microbatch's (``backward_seconds`` is one microbatch's backward, so each
    send overlaps its own), the other axes once on the summed slice."""
    params = sum(_params(u, plan) - _unreduced(u, plan) for u in units)
    grad_bytes = params / (2 if plan.reduce_dtype == "bf16" else 1)
    out = []
    # Buckets are reduced over one axis after the other (dp first): after ZeRO's dp reduce-scatter
    # the cp and tp sums move only this rank's slice.
    sliced = plan.dp if plan.zero >= 1 else 1
    dense = sum(u.params_rep + u.params_tp / plan.tp - _unreduced(u, plan) for u in units) / (
        2 if plan.reduce_dtype == "bf16" else 1)
    for axis, n in (("dp", plan.dp), ("cp", plan.cp), ("ep", plan.ep)):
        if n <= 1:
            continue
        kind = "reduce-scatter" if axis == "dp" and plan.zero >= 1 else "all-reduce"
        payload = grad_bytes if axis == "dp" else (dense if axis == "ep" else grad_bytes) / sliced
        if axis == "dp" and plan.zero == 3:  # in the graph, on the compute-dtype copies' gradients
            payload = params / _weight_wire(plan)
        sends = plan.mb if axis == "dp" and plan.zero == 2 else 1
        link = _gradient_link(hw, plan) if axis == "dp" else _link(hw, plan, axis)
        # ZeRO-2 under pp: a tied weight's gradient is final only at the step's end (summed over pp
        # first); its own bucket goes once, after the backward, not in every microbatch's
        late = sum({name: rep + split / plan.tp for u in units for name, rep, split in u.tied}.values()) / (
            2 if plan.reduce_dtype == "bf16" else 1) if sends > 1 and plan.pp > 1 else 0.0
        payload -= late
        calls = max(1.0, math.ceil((grad_bytes - late) / (plan.bucket_mb * 2**20)))
        seconds = collective_seconds(kind, payload, n, link.bandwidth, link.latency * calls, link.ring,
                                     link.factors, link.measured)
        last_bucket = collective_seconds(kind, min(payload, plan.bucket_mb * 2**20), n, *link)
        exposed = max(seconds - hw.comm_overlap * backward_seconds, last_bucket)
        tail = collective_seconds(kind, late, n, *link) if late else 0.0
        out.append(CollectiveEstimate(axis, kind, "backward", n, payload * sends + late, calls * sends + (late > 0),
                                      seconds * sends + tail, exposed * sends + tail))
    tp_reduced = sum(u.params_tp_reduced for u in units) / sliced
    if plan.sp and plan.tp > 1 and tp_reduced:  # norm weights see a sequence shard under sp: sum over tp
        link = _link(hw, plan, "tp")
        seconds = collective_seconds("all-reduce", tp_reduced, plan.tp, *link)
        out.append(CollectiveEstimate("tp", "all-reduce", "backward", plan.tp, tp_reduced, 1, seconds, seconds))
    if plan.dp > 1 and plan.zero in (1, 2):  # updated slices gathered after the step: not overlapped
        link = _gradient_link(hw, plan)
        shard = params / plan.dp / _weight_wire(plan)  # in the compute dtype (runtime/zero.py)
        seconds = collective_seconds("all-gather", shard, plan.dp, *link)
        out.append(CollectiveEstimate("dp", "all-gather", "optimizer", plan.dp, shard, 1, seconds, seconds))
    if plan.dp > 1 and plan.zero == 3:  # per layer gathers in forward and backward (prefetched)
        link = _link(hw, plan, "dp")
        layers = max(1, sum(u.blocks for u in units))
        # backward gathers again only the parameters autograd saved (an embedding saves its indices)
        saved = sum(u.params_saved[0] + u.params_saved[1] / plan.tp for u in units)
        payload = (params + saved) / plan.dp / _weight_wire(plan)
        seconds = collective_seconds("all-gather", payload / (2 * layers), plan.dp, *link) * 2 * layers
        out.append(CollectiveEstimate("dp", "all-gather", "forward+backward", plan.dp, payload * plan.mb,
                                      2 * layers * plan.mb, seconds * plan.mb, 0.0))
    return out


def _weight_wire(plan: PlanPoint) -> int:
    """ZeRO gathers weights in the compute dtype (ZeRO-3 the copies the executor cast, runtime/zero3.py's
    wire_dtype; ZeRO-1/2 the updated slices, runtime/zero.py's gather_dtype): half the fp32 bytes
    under dtype=bf16."""
    return 2 if plan.dtype == "bf16" else 1


def shared_gradient_collectives(profile: ModelProfile, plan: PlanPoint, hw: HardwareProfile
                                ) -> list[CollectiveEstimate]:
    """With pp, the sum over pp of the gradient of each weight that stages on two pp ranks use (a tied
    embedding / lm head), once per step before the dp reduction; every pp rank joins, one that holds
    no copy with zeros (runtime/pipeline.py, ``_sum_shared_grads``). Gradients stay fp32."""
    if plan.pp == 1 or not any(u.tied for u in profile.units):
        return []
    # (the planner also scores plans with more stages than units, which compile refuses)
    chunks = plan.pp * plan.v if plan.pp * plan.v <= len(profile.units) else plan.pp
    ranks: dict[tuple, set[int]] = {}
    for k, stage in enumerate(merged_stages(profile, chunks, plan.split)):
        for weight in stage.tied:
            ranks.setdefault(weight, set()).add(k % plan.pp)
    link = _link(hw, plan, "pp")
    out = []
    for (_, rep, split), held in ranks.items():
        if len(held) > 1:
            nbytes = rep + split / plan.tp
            seconds = collective_seconds("all-reduce", nbytes, plan.pp, *link)
            out.append(CollectiveEstimate("pp", "all-reduce", "backward", plan.pp, nbytes, 1, seconds,
                                          seconds))
    return out


def expert_collectives(profile: ModelProfile, plan: PlanPoint, units: list[UnitCost], hw: HardwareProfile
                       ) -> list[CollectiveEstimate]:
    """Expert parallel (GShard, Lepikhin et al. 2020): per MoE layer, tokens dispatched to their experts' ranks and
    combined back -- two all-to-alls forward, two backward, each of top_k copies of the hidden states."""
    layers = sum(u.moe_layers for u in units)
    if plan.ep == 1 or not layers:
        return []
    sp = plan.sp and plan.tp > 1
    hidden = sum(_acts(u.input_bytes.get(sp, {}), profile, plan) / u.blocks for u in units) / len(units)
    payload = MOE_TOP_K * hidden * layers
    link = _link(hw, plan, "ep")
    seconds = 2 * layers * collective_seconds("all-to-all", payload / layers, plan.ep, *link)
    return [CollectiveEstimate("ep", "all-to-all", d, plan.ep, 2 * payload, 2 * layers, seconds, seconds)
            for d in ("forward", "backward")]


def pipeline_collectives(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost], k: int,
                         hw: HardwareProfile) -> list[CollectiveEstimate]:
    """Stage k's activations to and from its neighbours and their gradients, per microbatch. Bytes
    are what its ranks hand to Comm, which counts a transfer at both ends: what it receives from the
    cut before it and sends over the cut after it. Time is one transfer each way (the cut after it;
    the last stage's, the cut before it): the other end of a transfer is its neighbour's time."""
    if len(stages) == 1:
        return []
    sp = plan.sp and plan.tp > 1
    cuts = [stages[i] for i in (k - 1, k) if 0 <= i < len(stages) - 1]  # stage i's boundary: the cut after it
    timed = len(cuts) - 1 if k < len(stages) - 1 else 0  # which cut's transfer is on the time
    link = _link(hw, plan, "pp")
    scale = _pipeline_transfer_seconds(plan, hw)
    out = []
    for direction, crossing in (("forward", lambda cut: cut.boundary), ("backward", lambda cut: cut.boundary_grad)):
        nbytes = [_acts(crossing(cut).get(sp, {}), profile, plan) for cut in cuts]  # the hidden state
        seconds = collective_seconds("send/recv", nbytes[timed], 2, *link) + scale
        out.append(CollectiveEstimate("pp", "send/recv", direction, plan.pp, sum(nbytes), len(cuts),
                                      seconds, seconds))
    return out


def _pipeline_transfer_seconds(plan: PlanPoint, hw: HardwareProfile) -> float:
    """What a pipeline transfer across nodes takes beyond its bytes at the mesh's scale (the profile's
    ``pipeline_transfer_seconds_by_nodes`` at the nodes the whole mesh spans); 0 without a pipeline or
    inside a node."""
    if plan.pp == 1 or not crosses_node(plan, "pp"):
        return 0.0
    return hw.pipeline_transfer_seconds(plan.nodes)


# ---------------------------------------------------------------------------------------- time

def stage_flops(profile: ModelProfile, plan: PlanPoint, units: list[UnitCost]) -> float:
    """Forward FLOPs of one microbatch on one rank of the stage."""
    return sum(stage_flops_by_kind(profile, plan, units))


def stage_flops_by_kind(profile: ModelProfile, plan: PlanPoint, units: list[UnitCost]) -> tuple[float, float]:
    """(matmul, attention) forward FLOPs of one microbatch on one rank of the stage: attention's
    score and value products grow with the plan's sequence and run at their own rate; tp divides the
    products it splits, and every tp rank runs the rest whole."""
    tokens = tokens_per_microbatch(profile, plan)
    probe_tokens = profile.batch * profile.seq
    key = (plan.sp and plan.tp > 1, plan.cp > 1)
    whole = sum(u.flops_tp_whole.get(key, 0.0) for u in units)  # every tp rank runs these
    mm = ((sum(u.flops_matmul for u in units) - whole) / plan.tp + whole) * tokens / probe_tokens
    attn = sum(u.flops_attention for u in units) * tokens / probe_tokens * (plan.seq / profile.seq) / plan.tp
    return mm, attn


def estimate(profile: ModelProfile, plan: PlanPoint, hw: HardwareProfile, *, memory: dict | None = None
             ) -> Estimate:
    """Per-rank memory, FLOPs, collectives and step time of ``plan``. Memory is the fullest stage's;
    time is the slowest stage's (``_slowest``), which the others wait for.
    ``memory``: ``peak_memory(profile, plan)`` when the caller has it already (the planner's check)."""
    stages = merged_stages(profile, plan.pp, plan.split)
    costs = _stage_costs(profile, plan, stages, hw) if len(stages) > 1 else None
    slowest = _slowest(profile, plan, stages, costs)
    # one stage: its memory is the peak the caller may have computed already
    state, flops, time, comms = _stage_estimate(profile, plan, stages, slowest, hw, costs,
                                                state=memory if len(stages) == 1 else None)
    if memory is None:
        memory = peak_memory(profile, plan) if plan.pp > 1 else state
    # forward and backward as the step runs them: 3x forward where everything trains (6N per token),
    # less where frozen weights take no gradient
    model_flops = (1 + _model_backward_ratio(profile)) * profile.forward_flops_per_token * plan.global_batch * \
        plan.seq * (1 + _attention_growth(profile, plan))
    step = time["step"]
    peak = hw.peak_flops(plan.dtype) * plan.world
    comms += loss_value_collectives(profile, plan)
    return Estimate(plan, memory, flops, model_flops, tuple(comms), time, plan.global_batch * plan.seq / step,
                    model_flops / (step * peak), hw.name, traffic_estimate=partial(step_traffic, profile, plan, hw),
                    pipeline_transfer=_pipeline_transfer_seconds(plan, hw))


def _model_backward_ratio(profile: ModelProfile) -> float:
    """Backward FLOPs per forward FLOP of the whole model (2 where every product takes both gradients)."""
    def compute():
        forward = sum(u.flops_matmul + u.flops_attention for u in profile.units)
        return sum(u.backward_ratio * (u.flops_matmul + u.flops_attention) for u in profile.units) / forward \
            if forward > 0 else 2.0
    return memo(profile, ("backward ratio",), compute)


def step_traffic(profile: ModelProfile, plan: PlanPoint, hw: HardwareProfile) -> dict[str, float]:
    """Payload bytes per axis of one step summed over every rank, as their Comms count them: each
    pipeline stage's world/pp ranks issue that stage's collectives (with v > 1 a rank runs v of the
    pp*v stages), every rank the loss-value sums and the pp sums of tied weights' gradients."""
    stages = merged_stages(profile, plan.pp * plan.v, plan.split)
    out: dict[str, float] = {}
    per_rank = [(c, plan.world // plan.pp) for k in range(len(stages))
                for c in _per_step(_microbatch_collectives(profile, plan, stages, k, hw), plan.mb)
                + gradient_collectives(plan, [stages[k]], hw, 0.0)]
    every_rank = loss_value_collectives(profile, plan) + shared_gradient_collectives(profile, plan, hw)
    for c, ranks in per_rank + [(c, plan.world) for c in every_rank]:
        out[c.axis] = out.get(c.axis, 0.0) + c.bytes_per_step * ranks
    return out


def peak_memory(profile: ModelProfile, plan: PlanPoint, *, stop_above: float = math.inf) -> dict[str, float]:
    """Per-rank memory of the stage that holds the most (what estimate() reports, without the time).
    ``stop_above``: return the first stage whose total exceeds it (the peak is at least that) instead
    of looking at the rest -- the planner's memory check needs no more for a plan that cannot fit."""
    most, most_total = None, -1.0
    stages = merged_stages(profile, plan.pp, plan.split)
    repeats = _repeats_previous(profile, stages)
    for stage, (unit, p2p) in enumerate(zip(stages, p2p_buffers(profile, plan, stages))):
        if repeats[stage] and 1 < stage < len(stages) - 1:
            # a middle stage like the middle stage before it holds what that one holds with no more
            # microbatches in flight (in_flight falls with the stage) and the same transfer buffers:
            # it is not the peak (a deep pipeline of stamped blocks is three stages to look at)
            continue
        memory = stage_memory(profile, plan, [unit], stage, p2p)
        total = sum(memory.values())
        if total > most_total:
            most, most_total = memory, total
            if total > stop_above:
                break
    return most


def _repeats_previous(profile: ModelProfile, stages: list[UnitCost]) -> tuple[bool, ...]:
    """Per stage, whether its unit holds what the previous stage's holds: every field but the names
    (merged stamped blocks), its merged parts compared alike (kept in the profile's cache)."""
    def content(u: UnitCost) -> tuple:
        return tuple(getattr(u, f) for f in _CONTENT_FIELDS) + tuple(content(p) for p in u.parts)

    def compute():
        keys = [content(u) for u in stages]
        return tuple(k > 0 and keys[k] == keys[k - 1] for k in range(len(keys)))
    return memo(profile, ("repeats", id(stages)), compute)


_CONTENT_FIELDS = tuple(f for f in UnitCost.__dataclass_fields__ if f not in ("name", "parts", "balance"))


def _attention_growth(profile: ModelProfile, plan: PlanPoint) -> float:
    """Attention FLOPs per token grow with S: the extra fraction at the plan's S over the probe's."""
    attn = sum(u.flops_attention for u in profile.units)
    total = sum(u.flops_matmul + u.flops_attention for u in profile.units)
    return attn / total * (plan.seq / profile.seq - 1) if total else 0.0


def _microbatch_passes(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost], k: int,
                       hw: HardwareProfile):
    """Stage k's one microbatch: (forward FLOPs, forward seconds, backward seconds, of them the host's
    waits, its per-microbatch collectives, the backward's FLOP ratio, recompute's extra share), the
    launches included."""
    unit = stages[k]
    fwd_flops, compute, pointwise = _stage_compute(profile, plan, unit, hw)
    ratio, backs = _backward_shares(unit)
    extra = {"full": 1.0, "selective": 0.0}.get(plan.recompute, 0.0) * backs  # selective: pointwise only
    forward, backward = _passes(compute, pointwise, ratio, backs, extra)
    per_mb_comms = _stage_microbatch_collectives(profile, plan, k, hw)
    per_mb_comm = sum(c.exposed_seconds for c in per_mb_comms)
    # launches and Python, per layer whatever its size: where the host queues kernels ahead of the
    # device only what exceeds the device's own time for the microbatch shows; else all of it adds
    overhead = hw.unit_overhead * unit.blocks
    waits = 0.0  # what of it the device waits for, per microbatch: the step's "host" term
    if hw.host_launch == "async":
        overhead = waits = max(0.0, overhead - (forward + backward + per_mb_comm))
    forward, backward = _with_launches(forward, backward, overhead)
    per_mb_comms = _with_meetings(per_mb_comms, forward + backward, hw)
    return fwd_flops, forward, backward, waits, per_mb_comms, ratio, extra


def _with_meetings(comms: list[CollectiveEstimate], compute: float, hw: HardwareProfile
                   ) -> list[CollectiveEstimate]:
    """The microbatch's blocking collectives (tp/sp, cp, ep, the loss's token count over dp) each
    with the wait for its group's ranks to meet added, per call (``hw.skew`` of the group's size and
    of the compute between two meetings: the microbatch's over its calls); pipeline transfers are in
    the simulated timeline instead. Only a profile whose ranks share cores has such a wait."""
    if not hw.sync_skew_by_ranks:
        return comms
    meetings = sum(c.calls_per_step for c in comms if c.axis != "pp")
    if not meetings:
        return comms
    gap = compute / meetings
    return [_with_exposed(c, c.exposed_seconds + c.calls_per_step * hw.skew(c.group_size, gap))
            if c.axis != "pp" else c for c in comms]


def _stage_costs(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost], hw: HardwareProfile
                 ) -> tuple[tuple[float, float], ...]:
    """Every stage's (forward, backward + its collectives) seconds of one microbatch, launches
    included: which stage is slowest (``_slowest``), and where ranks share cores the simulated
    bubble's stages (``_shared_stage_costs``)."""
    out = []
    for s in range(len(stages)):
        _, forward, backward, _, comms, _, _ = _microbatch_passes(profile, plan, stages, s, hw)
        out.append((forward, backward + sum(c.exposed_seconds for c in comms)))
    return tuple(out)


def _shared_stage_costs(plan: PlanPoint, hw: HardwareProfile, costs: tuple[tuple[float, float], ...] | None
                        ) -> tuple[tuple[float, float], ...] | None:
    """The stages' ``costs`` where the ranks share the host's cores and the bubble is simulated
    (``pipeline_bubble_units``), else None: there a light stage's idle time speeds the others, so each
    stage's own cost matters, not only the slowest's."""
    return costs if _simulates_shared_cores(plan, hw) else None


def _stage_estimate(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost], k: int,
                    hw: HardwareProfile, costs: tuple[tuple[float, float], ...] | None, *, state: dict | None = None):
    units = [stages[k]]
    fwd_flops, forward, backward, waits, per_mb_comms, ratio, extra = _microbatch_passes(profile, plan, stages, k, hw)
    per_mb = forward + backward + sum(c.exposed_seconds for c in per_mb_comms)
    grads = gradient_collectives(plan, units, hw, backward)
    if grads and hw.sync_skew_by_ranks:  # the gradient reduction ends the backward: its ranks meet there once
        grads[0] = _with_exposed(grads[0], grads[0].exposed_seconds + hw.skew(grads[0].group_size, plan.mb * backward))
    comms = _per_step(per_mb_comms, plan.mb) + grads + shared_gradient_collectives(profile, plan, hw)
    if state is None:
        state = stage_memory(profile, plan, units, k, p2p_buffers(profile, plan, stages)[k])
    optimizer = OPTIMIZER_TRAFFIC * (state["params"] + state["grads"] + state["optimizer"]) / hw.hbm_bandwidth
    bubble = pipeline_bubble_units(plan, hw, _shared_stage_costs(plan, hw, costs), per_mb) * per_mb
    # where the ranks share cores, the stage counted on may have run faster than its contended rate
    # while lighter stages waited: the timeline's end is the step, taken off its compute
    sped = min(0.0, bubble)
    bubble -= sped
    zero3_exposed = _zero3_exposed(comms, hw.comm_overlap * plan.mb * (forward + backward))
    comms = [_with_exposed(c, zero3_exposed) if c.direction == "forward+backward" else c for c in comms]
    exposed = sum(c.exposed_seconds for c in comms)
    time = {"compute": plan.mb * (forward + backward - waits) + sped, "host": plan.mb * waits, "exposed_comm": exposed,
            "bubble": bubble, "optimizer": optimizer}
    time["step"] = sum(time.values())
    flops = plan.mb * (1 + ratio + extra) * fwd_flops
    return state, flops, time, comms


def _with_launches(forward: float, backward: float, seconds: float) -> tuple[float, float]:
    """A microbatch's forward and backward seconds with ``seconds`` of launches and Python added: a
    third to forward, two thirds to backward (which launches about twice forward's kernels)."""
    return forward + seconds / 3, backward + 2 * seconds / 3


def _passes(compute: float, pointwise: float, ratio: float, backs: float, extra: float) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on a stage, launches aside: its matmul and
    attention seconds ``compute`` (backward ``ratio`` of them, ``extra`` more recomputed) and the
    pointwise traffic of forward and backward ``pointwise`` (a third forward, ``backs`` of two thirds
    backward; ``_backward_shares``)."""
    return compute + pointwise / 3, (ratio + extra) * compute + backs * 2 * pointwise / 3


def _backward_shares(unit: UnitCost) -> tuple[float, float]:
    """(backward FLOPs per forward FLOP, the share of forward's pointwise work backward repeats) of a
    stage: 2 and 1 where everything trains; behind frozen weights only input gradients (1 and 1);
    a stage before anything that trains runs no backward (0 and 0)."""
    ratio = unit.backward_ratio
    return ratio, min(1.0, ratio)


def _stage_compute(profile: ModelProfile, plan: PlanPoint, unit: UnitCost, hw: HardwareProfile
                   ) -> tuple[float, float, float]:
    """(forward FLOPs, seconds of them, seconds of the pointwise memory traffic of forward and backward)
    of one microbatch on one rank of the stage ``unit``: each kind of FLOP at its rate (backward runs
    twice the forward's, recompute adds one)."""
    mm_flops, attn_flops = stage_flops_by_kind(profile, plan, [unit])
    rows = tokens_per_microbatch(profile, plan)
    calls = unit.matmul_calls - unit.expert_calls * (1 - 1 / plan.ep)  # a rank runs E/ep experts
    compute = (hw.matmul_seconds(mm_flops, calls, rows, plan.dtype)
               + attn_flops / hw.attention_rate(rows, plan.dtype))
    acts = _acts(unit.acts.get(plan.sp and plan.tp > 1, {}), profile, plan)
    pointwise = hw.pointwise_traffic * acts / hw.hbm_bandwidth * (FUSED_POINTWISE if plan.fuse else 1.0)
    return mm_flops + attn_flops, compute, pointwise


def step_floor(profile: ModelProfile, base: PlanPoint, hw: HardwareProfile, microbatches: list[int],
               schedules: list[tuple[str, int]]) -> float:
    """Seconds no plan of ``base``'s mesh shape steps in, whatever its ZeRO stage, recompute, schedule
    (of ``schedules``: (name, v)) and microbatch count (of ``microbatches``): what ``estimate`` puts
    on the busiest stage's path at one microbatch without recompute -- its FLOPs and pointwise traffic,
    the per-layer collectives it waits for -- plus the least bubble those schedules leave. None of it
    shrinks as the step is cut into more microbatches: the FLOPs and bytes of a step stay, each
    microbatch's matmuls run no faster on fewer rows, and each call keeps its own latency. The
    planner skips a mesh shape whose floor is over every plan it could still have to show."""
    point = base.with_(mb=1, zero=0, recompute="none", schedule="1f1b", v=1)
    stages = merged_stages(profile, point.pp, point.split)
    k = _busiest(profile, point, stages)
    _, compute, pointwise = _stage_compute(profile, point, stages[k], hw)
    comm = sum(c.exposed_seconds for c in _stage_microbatch_collectives(profile, point, k, hw))
    floor = sum(_passes(compute, pointwise, *_backward_shares(stages[k]), 0.0)) + comm
    if point.pp > 1:
        # each microbatch's forward and backward take at least floor / mb, and the bubble is units of them
        floor *= 1 + min(pipeline_bubble_units(base.with_(schedule=s, v=v, mb=m), hw) / m
                         for s, v in schedules for m in microbatches)
        if any(_simulates_shared_cores(base.with_(schedule=s, v=v), hw) for s, v in schedules):
            # ranks sharing cores: a stage heavier than the rest runs alone at up to a core while the
            # others wait (``_shared_stage_costs``), no faster: the floor is its work at that rate
            ranks = min(base.world, base.gpus_per_node)
            floor = min(floor, floor / max(1.0, ranks / hw.host_cores))
    return floor


def gradient_floor(profile: ModelProfile, base: PlanPoint, hw: HardwareProfile, microbatches: list[int],
                   zeros: tuple[int, ...]) -> dict[int, float]:
    """Per ZeRO stage of ``zeros`` (the walk's), the seconds no plan of ``base``'s mesh shape at that
    stage adds at the step's end on top of ``step_floor``, whatever its recompute and schedule, the
    least over the microbatch counts (of ``microbatches``): the exposed part of the gradient sums and ZeRO's gathers
    (``gradient_collectives``) and the optimizer's memory traffic, on the stage ``step_floor`` reads.
    A sum hides behind one microbatch's backward, ZeRO-3's gathers behind the microbatches' forwards
    and backwards (``_stage_estimate``): at their longest under full recompute with every launch
    counted, so what shows is the least any plan of the shape shows. Dearer than ``step_floor`` (a
    ZeRO stage and microbatch count at a time): the planner asks it only of a shape it would walk."""
    point = base.with_(mb=1, zero=0, recompute="none", schedule="1f1b", v=1)
    stages = merged_stages(profile, point.pp, point.split)
    unit = stages[_busiest(profile, point, stages)]
    ratio, backs = _backward_shares(unit)
    launches = hw.unit_overhead * unit.blocks
    least = {zero: math.inf for zero in zeros}
    for m in microbatches:
        _, compute, pointwise = _stage_compute(profile, point.with_(mb=m), unit, hw)
        forward, backward = _passes(compute, pointwise, ratio, backs, backs)  # full recompute's extra pass
        forward, backward = _with_launches(forward, backward, launches)
        both = forward + backward
        for zero in least:
            plan = point.with_(zero=zero, mb=m)
            comms = gradient_collectives(plan, [unit], hw, backward)
            exposed = sum(c.exposed_seconds for c in comms if c.direction != "forward+backward")
            exposed += _zero3_exposed(comms, hw.comm_overlap * m * both)
            held, grads, optimizer = _state_bytes(plan, [unit])[:3]
            least[zero] = min(least[zero], exposed + OPTIMIZER_TRAFFIC * (held + grads + optimizer) / hw.hbm_bandwidth)
    return least


def _slowest(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost],
             costs: tuple[tuple[float, float], ...] | None) -> int:
    """The pipeline stage whose microbatch takes longest (``costs``: ``_stage_costs``; None for one
    stage), which the others wait for: where fixed per-call and per-layer times dominate, a stage of
    more layers outlasts the one with the most FLOPs (a small model whose head and loss carry most of
    them). Ties go to the stage with the most FLOPs."""
    busiest = _busiest(profile, plan, stages)
    if costs is None:
        return busiest
    times = [forward + rest for forward, rest in costs]
    longest = max(times)
    return busiest if times[busiest] >= longest * (1 - 1e-9) else times.index(longest)


def _busiest(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost]) -> int:
    """The stage with the most FLOPs forward and backward at the plan's sequence (attention grows as
    S^2; a stage of frozen layers runs less backward), kept in the profile's cache: every stage's
    FLOPs scale alike with the microbatch's tokens."""
    return memo(profile, ("busiest", id(stages), tokens_per_microbatch(profile, plan), plan.seq, plan.tp,
                          plan.sp, plan.cp > 1),
                lambda: max(range(len(stages)), key=lambda k: stage_flops(profile, plan, [stages[k]])
                            * (1 + stages[k].backward_ratio)))


def _stage_microbatch_collectives(profile: ModelProfile, plan: PlanPoint, k: int, hw: HardwareProfile
                                  ) -> list[CollectiveEstimate]:
    """``_microbatch_collectives`` of stage k of the plan's own cut, kept in the profile's cache: they
    do not depend on the ZeRO stage, and the planner asks them again for each of the four."""
    return list(memo(profile, ("microbatch collectives", plan.with_(zero=0), k, hw), lambda: tuple(
        _microbatch_collectives(profile, plan, merged_stages(profile, plan.pp, plan.split), k, hw))))


def _microbatch_collectives(profile: ModelProfile, plan: PlanPoint, stages: list[UnitCost], k: int,
                            hw: HardwareProfile) -> list[CollectiveEstimate]:
    """Stage k's collectives of one microbatch (tp/sp, cp, pipeline transfers, experts), each with the
    seconds it adds to the critical path as its exposed time."""
    units = [stages[k]]
    comms = (layer_collectives(profile, plan, units, hw) + pipeline_collectives(profile, plan, stages, k, hw)
             + expert_collectives(profile, plan, units, hw))
    return [_with_exposed(c, _exposed_layer_comm(c, profile, plan, units, hw)) for c in comms]


def _per_step(comms: list[CollectiveEstimate], m: int) -> list[CollectiveEstimate]:
    return [CollectiveEstimate(c.axis, c.kind, c.direction, c.group_size, c.bytes_per_step * m,
                               c.calls_per_step * m, c.seconds * m, c.exposed_seconds * m) for c in comms]


def _with_exposed(c: CollectiveEstimate, seconds: float) -> CollectiveEstimate:
    """``c`` with its exposed time set (dataclasses.replace, without its per-call field walk: the
    planner makes tens of thousands of these)."""
    return CollectiveEstimate(c.axis, c.kind, c.direction, c.group_size, c.bytes_per_step, c.calls_per_step,
                              c.seconds, seconds)


def loss_value_collectives(profile: ModelProfile, plan: PlanPoint) -> list[CollectiveEstimate]:
    """What every rank issues once per step to return the loss: the runtime's own description of it
    (runtime/loss_value.py) for this plan's pp."""
    sizes = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep}  # all it reads

    def compute():
        reduction = replace(profile.loss_value, pipelined=plan.pp > 1).over(sizes)
        return tuple(CollectiveEstimate(axis, "all-reduce", "forward", sizes[axis], shape_bytes(shape, dtype),
                                        1, 0.0, 0.0)
                     for axis, shape, dtype, _ in reduction.payloads() if sizes.get(axis, 1) > 1)
    return list(memo(profile, ("loss value", *sizes.values()), compute))


def _exposed_layer_comm(c: CollectiveEstimate, profile, plan, units, hw) -> float:
    """tp/sp and pipeline transfers sit on the critical path; the cp ring hides behind attention."""
    if c.axis == "cp" and c.kind == "send/recv":
        attention = sum(u.flops_attention for u in units) * (3 * tokens_per_microbatch(profile, plan)
                                                            / (profile.batch * profile.seq))
        attention *= plan.seq / profile.seq / plan.tp / (
            hw.peak_flops(plan.dtype) * (hw.attention_efficiency or hw.matmul_efficiency))
        return max(0.0, c.seconds - hw.comm_overlap * attention)
    return c.seconds


def _zero3_exposed(grads: list[CollectiveEstimate], compute: float) -> float:
    gathers = sum(c.seconds for c in grads if c.direction == "forward+backward")
    return max(0.0, gathers - compute)


__all__ = ["ScaleKey", "CollectiveCost", "UnitCost", "ModelProfile", "PlanPoint", "Estimate",
           "CollectiveEstimate", "estimate", "step_floor", "scale", "stage_units", "in_flight", "bubble_units",
           "pipeline_bubble_units", "gradient_floor",
           "crosses_node", "collective_seconds", "peak_memory", "shared_gradient_collectives", "Link"]
