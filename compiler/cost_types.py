"""The cost model's data: a model's profile (what one trace measured, per layer), a plan point (the
plan as numbers) and an estimate (what the cost model predicts for one), in compiler/cost_model.py's
terms (see there and docs/cost_model.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, NamedTuple

from usc.runtime.loss_value import LossValueReduction

BYTES_FP32 = 4


class ScaleKey(NamedTuple):
    """How an amount scales: with the batch (split by dp*mb), with the sequence (split by cp),
    split by tp, and float (bf16 halves it); bf16_only: it exists only under dtype=bf16 (a cast to
    a value's own dtype is the value itself in float32 and a copy under bf16)."""

    batch: bool
    seq: bool
    tp: bool
    is_float: bool = True
    bf16_only: bool = False


@dataclass(frozen=True)
class CollectiveCost:
    """A collective of one layer measured in a probe plan: payload per call at the probe's batch and
    sequence as if unsplit (global-equivalent), and how it scales."""

    axis: str
    kind: str
    direction: str
    key: ScaleKey
    amount: float
    ring: bool = False  # cp ring send/recv: calls per step depend on cp
    ring_steps: int = -1  # with ring: cp + ring_steps calls per step (K/V blocks cp-1 each way; dK/dV cp)
    count: int = 1  # calls merged into this entry (amount is their sum)
    reissued: bool = False  # a forward collective that recompute=full issues again in backward


@dataclass(frozen=True)
class UnitCost:
    """One pipeline unit (a numbered layer such as ``layers.3``, or a module outside the layers)."""

    name: str
    balance: float = 0.0  # the pipeline split's cost estimate (passes/pipeline_split.node_flops)
    flops_matmul: float = 0.0  # forward FLOPs of linears/matmuls at (B0, S0): scales with tokens
    flops_attention: float = 0.0  # forward FLOPs of attention at (B0, S0): scales with B*S^2
    # (sp, cp > 1) -> forward FLOPs at (B0, S0) of the matrix products every tp rank runs whole (their
    # output replicated over tp: a router, experts tp leaves whole, GPT-2's fused projections without
    # sp); part of flops_matmul
    flops_tp_whole: dict = field(default_factory=dict)
    params_rep: int = 0  # fp32 bytes of trainable parameters tp does not split
    params_tp: int = 0  # ... that tp splits
    params_tp_reduced: int = 0  # replicated parameters whose gradients are summed over tp under sp
    acts: dict = field(default_factory=dict)  # sp (bool) -> {ScaleKey: bytes}
    input_bytes: dict = field(default_factory=dict)  # sp -> {ScaleKey: bytes} of the unit's input
    collectives: dict = field(default_factory=dict)  # sp -> tuple[CollectiveCost]
    blocks: int = 1  # units merged into this one (a pipeline stage)
    params_expert: int = 0  # fp32 bytes of MoE expert weights ep splits (not in params_rep/params_tp)
    params_expert_tp: int = 0  # ... of them, the bytes tp splits too (each expert's hidden size)
    moe_layers: int = 0  # MoE layers in the unit (each dispatches and combines its tokens over ep)
    params_saved: tuple = (0, 0)  # (replicated, tp-split) bytes of parameters autograd saves (ZeRO-3 re-gathers)
    boundary: dict = field(default_factory=dict)  # sp -> {ScaleKey: bytes} crossing a pipeline cut after this unit
    boundary_grad: dict = field(default_factory=dict)  # sp -> ... of those values that have a gradient
    # sp -> ... of those values no op before the cut saves: the sending stage holds them for each
    # microbatch in flight (until its backward starts from them) beside what it saves
    boundary_unsaved: dict = field(default_factory=dict)
    largest_acts: dict = field(default_factory=dict)  # sp -> acts of the largest merged unit
    # (recompute mode, cp > 1, sp) -> {ScaleKey: bytes} forward holds for backward under that mode; and
    # the unit's steps in program order, each ({ScaleKey: bytes} backward makes again when it recomputes
    # the step, {ScaleKey: bytes} the step holds) -- a step is one recompute region or a value saved
    # outside them (passes/cost_profile._under_recompute)
    held: dict = field(default_factory=dict)
    recomputed: dict = field(default_factory=dict)
    parts: tuple = ()  # the units merged into this one, in order (empty: a unit of its own)
    # (replicated, tp-split) bytes of parameters whose gradient the graph sums over dp, not a bucket
    params_unreduced: tuple = (0, 0)
    # (replicated, tp-split, ep-split, of all three the float32) bytes of frozen parameters
    # (requires_grad off) in their own dtype: held whole by every dp rank, with no gradient or
    # optimizer state (not in params_rep/params_tp/params_expert)
    params_frozen: tuple = (0, 0, 0, 0)
    # (name, replicated, tp-split bytes) of parameters other units also use (tied embedding / lm
    # head): in params_rep/params_tp of each user, once per merged stage
    tied: tuple = ()
    # matrix-product calls of one forward (linears, matmuls; not attention): each call costs the
    # device a fixed time beside its FLOPs (the hardware profile's matmul_half_work)
    matmul_calls: int = 0
    expert_calls: int = 0  # of matmul_calls, the routed experts' products: an ep rank runs its E/ep share
    # sp -> {ScaleKey: bytes} of the output gradients schedule=zb records where each weight's branch
    # meets the activations, held from a microbatch's input-gradient pass to its weight-gradient pass
    weight_joins: dict = field(default_factory=dict)
    # backward FLOPs of the unit's products and attention at the profile's shapes: 2 x (flops_matmul +
    # flops_attention) where everything trains, less behind frozen weights (no weight gradient) and
    # none where nothing before the unit trains; -1: not measured (read as twice the forward's)
    flops_backward: float = -1.0

    @property
    def backward_ratio(self) -> float:
        """Backward FLOPs per forward FLOP (2 where every product takes both gradients)."""
        forward = self.flops_matmul + self.flops_attention
        return 2.0 if self.flops_backward < 0 or forward <= 0 else self.flops_backward / forward


@dataclass(frozen=True)
class ModelProfile:
    """Per-unit costs of a model, measured at global batch ``batch`` and sequence ``seq``."""

    name: str
    batch: int
    seq: int
    units: tuple[UnitCost, ...]
    tp_divides: int = 0  # gcd of every dim tp splits (heads, kv heads, hidden, vocab); 0: tp impossible
    cp_possible: bool = True
    sp_possible: bool = True  # sp compiles where tp does (else tp is planned without it)
    layers: int = 0  # numbered layers (what pp cuts between)
    experts: int = 0  # experts per MoE layer (0: dense)
    # how the returned loss is summed (axes, dtype), as the runtime does it for the probe's plan
    loss_value: LossValueReduction = LossValueReduction()
    # an attention (its module) that runs across the inputs' dim 0, which dp and mb split as the batch:
    # a sequence-first model, whose dp is a ring over its sequence and whose microbatches are refused
    dim0_attention: str = ""
    _stages: dict = field(default_factory=dict, compare=False, repr=False)  # (pp, cuts) -> merged stages (cache)

    @property
    def param_bytes(self) -> tuple[int, int]:
        """(replicated, tp-split) fp32 bytes of the dense parameters, a tied weight once."""
        _, extra_rep, extra_tp = tied_once(self.units)
        return (sum(u.params_rep for u in self.units) - extra_rep,
                sum(u.params_tp for u in self.units) - extra_tp)

    @property
    def param_count(self) -> int:
        return sum(self.param_bytes) // BYTES_FP32

    @property
    def forward_flops_per_token(self) -> float:
        tokens = self.batch * self.seq
        return sum(u.flops_matmul + u.flops_attention for u in self.units) / tokens


@dataclass(frozen=True)
class PlanPoint:
    """The numbers of one plan the cost model reads (a usc.Plan plus the batch and sequence)."""

    global_batch: int
    seq: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    mb: int = 1
    sp: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"
    v: int = 1
    cp_mode: str = "ring"
    dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    fuse: bool = False
    gpus_per_node: int = 8
    bucket_mb: float = 25.0
    order: tuple[str, ...] = ("dp", "pp", "cp", "ep", "tp")  # mesh axes outermost first
    split: tuple[str, ...] | None = None  # split=a|b cut points; None: the FLOP-balanced cut

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def nodes(self) -> int:
        """Nodes the whole mesh spans (``gpus_per_node`` ranks each, as ``crosses_node`` lays them)."""
        return -(-self.world // self.gpus_per_node)

    def with_(self, **changes) -> "PlanPoint":
        """``dataclasses.replace(self, **changes)`` for the planner's inner loop (which makes tens of
        thousands of points): a copy of the fields, without replace's per-call walk of them. Names
        are checked; PlanPoint has no ``__post_init__`` to skip."""
        unknown = set(changes) - self.__dict__.keys()
        if unknown:
            raise TypeError(f"PlanPoint has no field {sorted(unknown)[0]!r}")
        new = object.__new__(PlanPoint)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def text(self) -> str:
        """The plan text (axes > 1 in mesh order, options that differ from the defaults). The point's
        ``dp`` counts replicas of an expert, as the cost model divides the batch (dp * ep ranks see
        their own data); a written plan carves ep from dp, so its dp is ``dp * ep``."""
        sizes = written_sizes({"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep})
        items = [f"{a}={sizes[a]}" for a in self.order if sizes[a] > 1]
        extras = [("zero", self.zero, 0), ("mb", self.mb, 1), ("sp", "on" if self.sp else "off", "off"),
                  ("recompute", self.recompute, "none"), ("dtype", self.dtype, "fp32"),
                  ("fuse", "on" if self.fuse else "off", "off"),
                  ("reduce_dtype", self.reduce_dtype, "fp32")]
        if self.pp > 1:
            extras += [("schedule", self.schedule, "1f1b"), ("v", self.v, 1),
                       ("split", "|".join(self.split) if self.split else "auto", "auto")]
        if self.cp > 1:
            extras += [("cp_mode", self.cp_mode, "ring")]
        items += [f"{k}={v}" for k, v, default in extras if v != default]
        return " ".join(items) or "dp=1"


def written_sizes(sizes: dict) -> dict:
    """A point's axis sizes as a plan writes them: dp holds the ep ranks (a point's dp counts the
    replicas of an expert, ep beside it)."""
    return dict(sizes, dp=sizes["dp"] * sizes["ep"])


@dataclass(frozen=True)
class CollectiveEstimate:
    axis: str
    kind: str
    direction: str
    group_size: int
    bytes_per_step: float
    calls_per_step: float
    seconds: float
    exposed_seconds: float


@dataclass(frozen=True)
class Estimate:
    """Per-rank costs of one plan (the bottleneck pipeline stage), and the step's payload bytes over
    all ranks (with pp the stages differ, so one rank's times world size is not the total)."""

    plan: PlanPoint
    memory: dict  # params, grads, optimizer, activations, gathered -> bytes
    flops_per_rank: float  # per step, forward + backward (+ recompute)
    model_flops: float  # per step for the whole global batch, without recompute (MFU numerator)
    collectives: tuple[CollectiveEstimate, ...]
    time: dict  # compute, exposed_comm, bubble, optimizer, step -> seconds
    tokens_per_second: float
    mfu: float
    hardware: str
    traffic_estimate: Callable[[], dict] = field(default=dict, repr=False, compare=False)  # see traffic
    # seconds the profile adds to each pipeline transfer across nodes at this mesh's scale
    # (``pipeline_transfer_seconds_by_nodes``; 0: none), said beside the time breakdown
    pipeline_transfer: float = 0.0

    @cached_property
    def traffic(self) -> dict[str, float]:
        """Payload bytes per axis of one step, every rank's summed (computed when first asked: the
        planner never asks, and with pp it visits every stage)."""
        return self.traffic_estimate()

    @property
    def memory_total(self) -> int:
        return int(sum(self.memory.values()))

    @property
    def largest_memory_term(self) -> str:
        return max(self.memory, key=self.memory.get)

    def fits(self, capacity: float) -> bool:
        return self.memory_total <= capacity

    def bytes_by_axis(self) -> dict[str, float]:
        """Payload bytes per step of one rank of the bottleneck stage, per axis."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.axis] = out.get(c.axis, 0.0) + c.bytes_per_step
        return out


def tied_once(units: list[UnitCost]) -> tuple[tuple, int, int]:
    """The tied weights of merged units, each once, and the (replicated, tp-split) bytes of the extra
    copies the units' sums hold: a stage keeps one tensor however many of its units use it."""
    seen: dict = {}
    extra_rep = extra_tp = 0
    for name, rep, split in (t for u in units for t in u.tied):
        if name in seen:
            extra_rep, extra_tp = extra_rep + rep, extra_tp + split
        seen.setdefault(name, (name, rep, split))
    return tuple(seen.values()), extra_rep, extra_tp
