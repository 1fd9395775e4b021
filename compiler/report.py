"""The compile report: every collective the compiler inserted, where, why and how many bytes.

It reads only the compiled graph (collectives are ordinary nodes, so the graph printed is the
program run) and the program's state layouts; ``usc-lint`` prints it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
import torch.fx as fx

from .fusion_cost import fusion_summary, kernel_sources
from .ir import META, MeshSpec
from .pass_runner import pipeline_stages
from .report_cost import cost_dict
from .program import Program
from .report_stages import StageRecord, shared_weights, stage_table, state_of_pp_rank
from .recompute_report import RecomputeRecord, recompute_records, recompute_summary, region_bodies
from usc.runtime.pipeline import deferred_inputs
from usc.runtime.zero import gathered_in
from usc.runtime.sizes import shape_bytes

KIND_ORDER = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send/recv")


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective issued on every step (per rank)."""

    kind: str
    axis: str
    group_size: int
    direction: str  # "forward" | "backward"
    shape: tuple[int, ...]  # this rank's tensor
    dtype: str
    bytes_per_call: int
    calls_per_step: int
    module: str
    source: str
    reason: str
    node: str

    @property
    def bytes_per_step(self) -> int:
        return self.bytes_per_call * self.calls_per_step


@dataclass
class Report:
    model: str
    plan: str
    mesh: MeshSpec
    collectives: list[CollectiveRecord]
    tp_choices: list = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    param_bytes_per_rank: int = 0
    compile_seconds: float = 0.0
    pass_timings: list = field(default_factory=list)
    exposed_comm_seconds: float | None = None
    attention_flops: dict = field(default_factory=dict)  # cp axis -> multiply-adds per rank
    memory: dict = field(default_factory=dict)  # ZeRO stage -> predicted bytes per rank by kind
    zero_stage: int = 0
    findings: list = field(default_factory=list)  # usc-lint findings (compiler/lint_rules.py), set by lint
    stages: list[StageRecord] = field(default_factory=list)  # pipeline stages (pp > 1)
    fusion: dict = field(default_factory=dict)  # fuse=on: kernels and bytes per step, eager vs fused
    kernels: list = field(default_factory=list)  # fuse=on: each generated kernel (KernelInfo)
    cost: object = None  # the cost model's Estimate for this plan (usc.lint(..., hardware=...))
    plan_search: object = None  # the planner's PlanSearch when the plan came from `auto`
    activation_estimate: Callable[[], int] | None = field(default=None, repr=False)
    _activation_bytes: int | None = field(default=None, repr=False)
    recompute: list[RecomputeRecord] = field(default_factory=list)  # tensors of recompute regions
    recompute_mode: str = "none"
    activation_estimate_by_recompute: Callable[[], dict[str, int]] | None = field(default=None, repr=False)
    _activation_by_recompute: dict[str, int] | None = field(default=None, repr=False)
    traffic: dict = field(default_factory=dict)  # (axis, kind) -> payload bytes per step, every rank's summed
    clipping: list[CollectiveRecord] = field(default_factory=list)  # issued only by step(max_grad_norm=...)
    op_rules: dict = field(default_factory=dict)  # aten op -> link of the rule chain that placed it

    @property
    def activation_bytes(self) -> int | None:
        """Bytes of activations rank 0 saves for backward in one (micro)batch: its program run on
        fake tensors, so it costs no memory (computed on first use)."""
        if self._activation_bytes is None and self.activation_estimate is not None:
            self._activation_bytes = self.activation_estimate()
        return self._activation_bytes

    @property
    def activation_bytes_by_recompute(self) -> dict[str, int] | None:
        """Predicted activation bytes per rank for recompute=none|selective|full (this plan's rules
        kept), each from that plan's rank-0 program run on fake tensors (computed on first use)."""
        if self._activation_by_recompute is None and self.activation_estimate_by_recompute is not None:
            self._activation_by_recompute = self.activation_estimate_by_recompute()
        return self._activation_by_recompute

    @property
    def recompute_summary(self) -> dict[str, dict]:
        """'input'/'kept' (saved) and 'recomputed': tensors, bytes and ops per decision."""
        return recompute_summary(self.recompute)

    def count(self, kind: str | None = None, *, axis: str | None = None, direction: str | None = None,
              module_prefix: str | None = None) -> int:
        return sum(1 for c in self.collectives
                   if (kind is None or c.kind == kind) and (axis is None or c.axis == axis)
                   and (direction is None or c.direction == direction)
                   and (module_prefix is None or c.module.startswith(module_prefix)))

    def totals_by_axis(self) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for c in self.collectives:
            totals[c.axis]["calls"] += c.calls_per_step
            totals[c.axis][f"{c.direction}_bytes"] += c.bytes_per_step
            totals[c.axis]["bytes"] += c.bytes_per_step
        return {axis: dict(v) for axis, v in totals.items()}

    def to_dict(self) -> dict:
        return {
            "model": self.model, "plan": self.plan, "mesh": dict(zip(self.mesh.axes, self.mesh.shape)),
            "world_size": self.mesh.world_size,
            "collectives": [asdict(c) | {"bytes_per_step": c.bytes_per_step} for c in self.collectives],
            "clipping_collectives": [asdict(c) for c in self.clipping],
            "totals_by_axis": self.totals_by_axis(),
            "tensor_parallel": [asdict(c) for c in self.tp_choices],
            "warnings": list(self.warnings),
            "param_bytes_per_rank": self.param_bytes_per_rank,
            "compile_seconds": round(self.compile_seconds, 3),
            "exposed_comm_seconds": self.exposed_comm_seconds,
            "attention_flops_per_rank": self.attention_flops,
            "memory_per_rank_by_zero_stage": self.memory,
            "activation_bytes_per_rank": self.activation_bytes,
            "recompute": {"mode": self.recompute_mode, "summary": self.recompute_summary,
                          "tensors": [asdict(r) for r in self.recompute],
                          "activation_bytes_by_mode": self.activation_bytes_by_recompute},
            "zero_stage": self.zero_stage,
            "p2p_bytes_per_step": self.p2p_bytes_per_step,
            "findings": [{"code": f.code, "severity": f.severity, "message": f.message, "hint": f.hint,
                          "module": f.module} for f in self.findings],
            "pipeline_stages": [asdict(s) for s in self.stages],
            "fusion": self.fusion,
            "kernels": [{"name": k.name, "used_by": list(k.used_by)} for k in self.kernels],
            **cost_dict(self),
        }

    @property
    def p2p_bytes_per_step(self) -> int:
        return sum(c.bytes_per_step for c in self.collectives if c.kind == "send/recv")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        from .report_text import render
        return render(self)


def _local(node: fx.Node, mesh: MeshSpec) -> tuple[tuple[int, ...], torch.dtype]:
    value = node.meta["val"]
    return node.meta[META].layout.local_shape(tuple(value.shape), mesh), runs_in(node)


RUNS_IN = "usc_runs_in"  # set by passes/compute_dtype.py on the traced graph's float32 values
ISLAND = "usc_float32_island"  # likewise, under every plan: a value a bf16 run keeps in float32


def runs_in(node: fx.Node) -> torch.dtype:
    """The dtype ``node``'s value has when the program runs: a float32-traced value of a dtype=bf16
    program is bfloat16 unless the model computes it in float32 on purpose (a float64 model's values
    likewise, unless cast or made in float64)."""
    value = node.meta["val"]
    if value.dtype not in (torch.float32, torch.float64):
        return value.dtype
    return _compute_mark(node, RUNS_IN, value.dtype, value.dtype)


def in_float32_island(node: fx.Node) -> bool:
    """Whether a dtype=bf16 run keeps ``node``'s float32-traced value in float32."""
    return bool(_compute_mark(node, ISLAND, False))


def _compute_mark(node: fx.Node, key: str, default, dtype: torch.dtype = torch.float32):
    """``node.meta[key]`` as the compute-dtype pass set it; a node a later pass made (a collective,
    the loss's decomposition over the vocabulary) takes the mark of the value it computes from, its
    first ``dtype`` input's, walked up."""
    at = node
    while key not in at.meta:
        inputs = [a for a in at.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == dtype]
        if not inputs:
            return default
        at = inputs[0]
    return at.meta[key]


def graph_collectives(gm: fx.GraphModule, mesh: MeshSpec, microbatches: int = 1) -> list[CollectiveRecord]:
    """Collectives of the graph (and of its pipeline stages); each runs once per microbatch."""
    records = []
    for part in program_parts(gm):
        records += _graph_collectives(part, mesh)
    records += pipeline_transfers(gm, mesh) + step_count_collectives(gm, mesh)
    return [replace(c, calls_per_step=c.calls_per_step * microbatches) for c in records]


def step_count_collectives(gm: fx.GraphModule, mesh: MeshSpec) -> list[CollectiveRecord]:
    """What the program that sums a step's token counts before its first microbatch issues per
    microbatch, on every rank (runtime/loss_value.py ``StepCounts``): the batch's gathers its count
    reads (labels flattened across a cp split)."""
    counts = gm.meta.get("usc_step_counts")
    if counts is None:
        return []
    return [replace(r, module="<step token count>", reason=f"the step's token count, before its first microbatch: "
                                                          f"{r.reason}")
            for r in _graph_collectives(counts.program, mesh)]


def program_parts(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The per-rank program: the graph itself, or its pipeline stages."""
    return pipeline_stages(gm) or [gm]


def pipeline_transfers(gm: fx.GraphModule, mesh: MeshSpec) -> list[CollectiveRecord]:
    """Activations sent forward between pipeline stages, and their gradients sent back."""
    if not pipeline_stages(gm):
        return []
    stages = {node: m for node in gm.graph.nodes if node.op == "call_module"
              for m in [gm.get_submodule(node.target)] if isinstance(m, fx.GraphModule)}
    index = {node: i for i, node in enumerate(stages)}
    records = []
    for consumer in stages:
        for arg in consumer.args:
            producer = arg.args[0] if arg.op == "call_function" else arg
            if producer not in stages:
                continue
            position = arg.args[1] if arg.op == "call_function" else 0
            outputs = next(n for n in stages[producer].graph.nodes if n.op == "output").args[0]
            inner = outputs[position] if isinstance(outputs, (tuple, list)) else outputs
            shape, dtype = _local(inner, mesh)
            where = f"stage {index[producer]} -> stage {index[consumer]}"
            directions = ["forward"] + (["backward"] if inner.meta[META].needs_grad else [])
            for direction in directions:
                records.append(CollectiveRecord("send/recv", "pp", mesh.size("pp"), direction, shape,
                                                str(dtype).replace("torch.", ""), shape_bytes(shape, dtype), 1, where,
                                                inner.meta[META].source, "pipeline stage boundary", inner.name))
    return records


def _graph_collectives(gm: fx.GraphModule, mesh: MeshSpec) -> list[CollectiveRecord]:
    """The collectives of one graph (no pipeline stages), forward and backward, in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(getattr(module, "body", None), fx.GraphModule):  # a recompute region
            out += _recomputed_collectives(module.body, _graph_collectives(module.body, mesh))
            continue
        fwd, bwd = getattr(module, "forward_collective", None), getattr(module, "backward_collective", None)
        if fwd is None:
            continue
        ann = node.meta[META]
        source = node.args[0]
        if hasattr(module, "traffic"):
            out += _p2p_records(node, module, mesh)
            continue
        for direction, kind, shaped in (("forward", fwd(), source), ("backward", bwd() if ann.needs_grad else None, node)):
            if kind is None or kind == "none":
                continue
            shape, dtype = _local(shaped, mesh)
            out.append(CollectiveRecord(kind, module.axis, mesh.size(module.axis), direction, shape,
                                        str(dtype).replace("torch.", ""), shape_bytes(shape, dtype), 1,
                                        ann.module or "<root>", ann.source, ann.reason, node.name))
    return out


part_collectives = _graph_collectives


def _recomputed_collectives(body: fx.GraphModule, records: list[CollectiveRecord]) -> list[CollectiveRecord]:
    """A region's collectives run in forward and, those the recompute pass marked as re-issued (all
    but the ones after the region's last saving op, passes/recompute.py), again when backward
    recomputes the region; selective regions hold none that communicate in forward."""
    again = {n.name for n in body.graph.nodes
             if META in n.meta and n.meta[META].extra.get("recompute_reissued")}
    return records + [replace(c, direction="backward",
                              reason=f"re-issued by recompute in backward; {c.reason}")
                      for c in records if c.direction == "forward" and c.node in again]


def _p2p_records(node: fx.Node, module, mesh: MeshSpec) -> list[CollectiveRecord]:
    """Nodes whose traffic is not one tensor per call (ring attention, ZeRO-3 gathers) say it."""
    shape, dtype = _local(node.args[getattr(module, "traffic_input", -1)], mesh)
    ann = node.meta[META]
    default = ann.reason or "ring attention: K/V blocks passed to the next rank"
    return [CollectiveRecord(kind, module.axis, mesh.size(module.axis), direction, call_shape,
                             str(dtype).replace("torch.", ""), nbytes, calls, ann.module or "<root>", ann.source,
                             why[0] if why else default, node.name)
            for direction, kind, call_shape, nbytes, calls, *why in module.traffic(shape, dtype, mesh.size(module.axis))
            if calls]


def attention_flops_per_rank(gm: fx.GraphModule, mesh: MeshSpec) -> dict[str, list[int]]:
    """Per cp rank: multiply-adds of the attention it computes (shows zig-zag balance); the ring
    node knows its own schedule, so the report only asks it."""
    out: dict[str, list[int]] = {}
    parts = program_parts(gm) + [body for _, body in region_bodies(gm)]
    for node, gm in ((n, part) for part in parts for n in part.graph.nodes):
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if module is None or not hasattr(module, "traffic"):
            continue
        if not hasattr(module, "attention_work"):
            continue
        n = mesh.size(module.axis)
        per_rank = module.attention_work(_local(node.args[0], mesh)[0], n)
        totals = out.setdefault(module.axis, [0] * n)
        out[module.axis] = [a + x for a, x in zip(totals, per_rank)]
    return out


JOINT_AXES = (("dp", "ep"),)  # axes the runtime's mesh also offers as one group (runtime/mesh.py)


def _joint(axes: tuple[str, ...]) -> tuple[str, ...]:
    """Gradients summed over dp and ep (all data-parallel ranks) are one all-reduce over 'dp+ep'."""
    for pair in JOINT_AXES:
        if all(a in axes for a in pair):
            first = min(axes.index(a) for a in pair)
            rest = [a for a in axes if a not in pair]
            axes = tuple(rest[:first]) + ("+".join(pair),) + tuple(rest[first:])
    return axes


def _pack_buckets(program: Program, bucket_bytes: int, *, graph_reduces_zero3: bool = True, pp_rank: int = 0,
                  group_of: Callable[[str], int] | None = None
                  ) -> list[tuple[tuple[str, ...], list[str], int, bool, torch.dtype]]:
    """(axes, parameter names, bytes, deferred, dtype) per gradient bucket of a pp rank, packed as the
    runtime packs them (runtime/reducer.py): in reverse order of the parameters, one open bucket per
    set of axes, dtype and deferred or not (a pipeline's weights whose gradient is final only at the
    step's end, ``deferred_inputs``) and optimizer group (``group_of``: an optimizer factory that
    groups parameters by name, ``runtime.training.bucket_groups``), closed once it holds bucket_bytes.
    ZeRO-3 parameters get their dp sum inside the graph, so dp is not theirs here."""
    deferred = deferred_inputs(program.gm, program.mesh.size("pp"), pp_rank) \
        if program.gm.meta.get("usc_stage_costs") else set()
    done, open_buckets = [], {}
    for spec in reversed(state_of_pp_rank(program, pp_rank)):
        in_graph = graph_reduces_zero3 and spec.zero3
        axes = _joint(tuple(a for a in spec.grad_axes if program.mesh.size(a) > 1 and not (in_graph and a == "dp")))
        if not axes:
            continue
        key = (axes, spec.placeholder in deferred, spec.dtype, group_of(spec.name) if group_of else 0)
        shape = spec.layout.local_shape(spec.global_shape, program.mesh)
        names, nbytes = open_buckets.get(key, ([], 0))
        open_buckets[key] = (names + [spec.name], nbytes + shape_bytes(shape, spec.dtype))
        if open_buckets[key][1] >= bucket_bytes:
            done.append((*key, *open_buckets.pop(key)))
    return [(axes, names, nbytes, late, dtype) for axes, late, dtype, _, names, nbytes in
            done + [(*key, names, nbytes) for key, (names, nbytes) in open_buckets.items()]]


def _padded(nbytes: int, dtype: torch.dtype, n: int) -> int:
    """Elements of a bucket of ``nbytes`` in ``dtype``, padded to a multiple of ``n`` (a reduce-scatter's
    input: runtime.reducer pads so every rank's slice is the same size)."""
    return -(-(nbytes // dtype.itemsize) // n) * n


def gradient_buckets(program: Program, bucket_bytes: int, zero_stage: int = 0, *, pp_rank: int = 0,
                     microbatches: int = 1, compute_dtype: torch.dtype | None = None,
                     reduce_dtype: torch.dtype | None = None,
                     group_of: Callable[[str], int] | None = None) -> list[CollectiveRecord]:
    """Gradient reductions per bucket (all-reduce; reduce-scatter over dp at zero=1/2: once per step
    at zero=1, once per microbatch at zero=2, the other axes once on the summed slice), in the dtype
    they travel in (``reduce_dtype``, reduce_dtype=bf16's, else the weights'), and with zero=1/2 the
    all-gather of the updated slices after the optimizer step (of pp rank ``pp_rank``), in the dtype
    the runtime gathers them in (``runtime.zero.gathered_in``: the plan's compute dtype where it is
    narrower than the weights)."""
    records = []
    buckets = _pack_buckets(program, bucket_bytes, pp_rank=pp_rank, group_of=group_of)
    if zero_stage in (1, 2):
        weights = [dtype for axes, _, _, _, dtype in buckets if "dp" in axes]
        narrow = gathered_in(weights, compute_dtype)
    for axes, names, nbytes, late, dtype in buckets:
        label = names[0] if len(names) == 1 else f"{names[-1]} .. {names[0]} ({len(names)} params)"
        wire = reduce_dtype or dtype
        numel = nbytes // dtype.itemsize
        if zero_stage in (1, 2) and "dp" in axes:  # the reducer reduce-scatters over dp first
            axes = ("dp",) + tuple(a for a in axes if a != "dp")
        for axis in axes:  # reduced one axis after the other; after the dp reduce-scatter only a slice is left
            n = program.mesh.size(axis)
            kind = "reduce-scatter" if zero_stage in (1, 2) and axis == "dp" else "all-reduce"
            calls = microbatches if kind == "reduce-scatter" and zero_stage == 2 and not late else 1
            if kind == "reduce-scatter":
                numel = _padded(numel * dtype.itemsize, dtype, n)
            reason = ("data-parallel gradient sum, launched when the step's backward is done (the gradient "
                      "is final only then)" if late else
                      "data-parallel gradient sum, launched during backward as the bucket fills"
                      + (" (every microbatch's)" if calls > 1 else ""))
            records.append(CollectiveRecord(kind, axis, n, "backward", (numel,), _dtype_name(wire),
                                            numel * wire.itemsize, calls, label, "gradient bucket", reason,
                                            "reducer"))
            if kind == "reduce-scatter":
                numel //= n
        if zero_stage in (1, 2) and "dp" in axes:  # each rank hands its (padded) slice to the gather
            n = program.mesh.size("dp")
            numel, gather = _padded(nbytes, dtype, n) // n, narrow or dtype
            records.append(CollectiveRecord("all-gather", "dp", n, "optimizer", (numel,), _dtype_name(gather),
                                            numel * gather.itemsize, 1, label,
                                            "ZeRO step", "each rank updated its slice; the slices are gathered"
                                            + (" in the compute dtype" if narrow is not None else ""),
                                            "optimizer"))
    return records


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def memory_by_zero_stage(program: Program, bucket_bytes: int, *, optimizer_states: int = 2,
                         microbatches: int = 1, group_of: Callable[[str], int] | None = None) -> dict[int, dict]:
    """Predicted bytes per rank in parameters, frozen parameters, gradients and optimizer state for
    ZeRO stages 0-3.

    Rajbhandari et al. 2020: stage 1 shards the optimizer state over dp, stage 2 also the
    gradients, stage 3 also the parameters. Sharded buffers are the gradient buckets reduced over
    dp, each padded to a multiple of dp; with pp, rank 0's stages' parameters. optimizer_states: tensors of the parameter's size the
    optimizer keeps per parameter (2 for Adam/AdamW: exp_avg, exp_avg_sq). Gradients are counted
    at their peak: stage 1 holds whole gradients while microbatches accumulate (a pipeline's stage
    always has several); with one, each bucket's whole gradient is dropped once it is
    reduce-scattered, as stage 2's are.
    """
    local = {s.name: shape_bytes(s.layout.local_shape(s.global_shape, program.mesh), s.dtype)
             for s in state_of_pp_rank(program) if s.kind == "param"}
    trainable = {s.name for s in program.state if s.trainable}
    params = sum(b for name, b in local.items() if name in trainable)
    # frozen parameters: no gradient, no optimizer state, nothing for ZeRO to shard
    frozen = sum(local.values()) - params
    dp = program.mesh.size("dp")
    buckets = [(axes, nbytes, late, _padded(nbytes, dtype, dp) // dp * dtype.itemsize) for axes, _, nbytes, late, dtype
               in _pack_buckets(program, bucket_bytes, graph_reduces_zero3=False, group_of=group_of)]
    sharded = sum(nbytes for axes, nbytes, _, _ in buckets if "dp" in axes) if dp > 1 else 0
    padded_slice = sum(piece for axes, _, _, piece in buckets if "dp" in axes) if dp > 1 else 0
    # a deferred bucket (a pipeline's tied weight) holds its whole gradient until the step's end, in
    # place of its slice
    late = sum(nbytes - piece for axes, nbytes, late, piece in buckets if late and "dp" in axes) if dp > 1 else 0
    whole, part = params - sharded, padded_slice
    accumulates = microbatches > 1 or program.mesh.size("pp") > 1
    return {
        0: {"params": params, "frozen": frozen, "grads": params, "optimizer": optimizer_states * params},
        1: {"params": params, "frozen": frozen, "grads": params if accumulates else whole + part,
            "optimizer": optimizer_states * (whole + part)},
        2: {"params": params, "frozen": frozen, "grads": whole + part + late,
            "optimizer": optimizer_states * (whole + part)},
        3: {"params": whole + part, "frozen": frozen, "grads": whole + part,
            "optimizer": optimizer_states * (whole + part)},
    }


def _loss_value_records(program: Program, payloads: list, module: str = "<loss value>") -> list[CollectiveRecord]:
    """The all-reduces that return the step's loss (runtime/loss_value.py: what the runtime sends)."""
    return [CollectiveRecord("all-reduce", axis, program.mesh.size(axis), "forward", shape,
                             str(dtype).replace("torch.", ""), shape_bytes(shape, dtype), 1, module, "step()",
                             what, "executor")
            for axis, shape, dtype, what in payloads if program.mesh.size(axis) > 1]


def loss_value_records(program: Program) -> list[CollectiveRecord]:
    """The runtime sums the partial loss over these axes once per step to return it (no gradient), then
    over the other axes (but pp, whose loss the pipeline already shares) as the finite-loss verdict, so a
    NaN on any rank stops every rank (runtime/loss_value.py)."""
    reduction = program.loss_value
    return _loss_value_records(program, reduction.count_payloads(), "<step token count>") + _loss_value_records(
        program, reduction.axis_payloads() + reduction.verdict_payloads())


def clipping_records(program: Program) -> list[CollectiveRecord]:
    """step(max_grad_norm=...) sums every rank's squared gradient norm (each element counted once,
    runtime/training.py) with one float64 all-reduce per mesh axis, once per step, on every rank.
    Not in the step's list: a step without clipping issues none."""
    return [CollectiveRecord("all-reduce", axis, program.mesh.size(axis), "optimizer", (1,), "float64", 8, 1,
                             "<grad norm>", "step(max_grad_norm=)", "global gradient norm for clipping: "
                             "squared sums of the gradient pieces this rank counts", "executor")
            for axis in program.mesh.axes if program.mesh.size(axis) > 1]


def pipeline_loss_records(program: Program) -> list[CollectiveRecord]:
    """With pp, the last stage's loss sum and token count (two float64) reach every pp rank once per step."""
    return _loss_value_records(program, program.loss_value.pipeline_payloads())


def shared_gradient_records(program: Program) -> list[CollectiveRecord]:
    """With pp, each weight that stages on two pp ranks use (tied embedding / lm head) gets both
    stages' gradients: summed over pp once per step, by every pp rank (one holding no copy adds zeros)."""
    records = []
    for spec in shared_weights(program):
        shape = spec.layout.local_shape(spec.global_shape, program.mesh)
        records.append(CollectiveRecord("all-reduce", "pp", program.mesh.size("pp"), "backward", shape,
                                        str(spec.dtype).replace("torch.", ""), shape_bytes(shape, spec.dtype), 1,
                                        spec.name, "step()", "a weight stages on two pp ranks use (tied): "
                                        "their gradients summed", "executor"))
    return records


def step_traffic(program: Program, *, bucket_bytes: int, zero_stage: int, microbatches: int,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 group_of: Callable[[str], int] | None = None) -> dict[tuple[str, str], int]:
    """Payload bytes per (axis, kind) of one step summed over every rank, as their Comms count them.
    Without pp every rank issues the report's list; with pp a stage's collectives run on its world/pp
    ranks, a transfer is counted at both ends and each pp rank sums the gradients of its own stages;
    every rank issues the loss-value sums and the pp sums of tied weights' gradients."""
    mesh = program.mesh
    per_stage = mesh.world_size // mesh.size("pp")
    counted = [(r, per_stage * microbatches) for part in program_parts(program.gm)
               for r in _graph_collectives(part, mesh)]
    counted += [(r, mesh.world_size * microbatches) for r in step_count_collectives(program.gm, mesh)]
    counted += [(r, 2 * per_stage * microbatches) for r in pipeline_transfers(program.gm, mesh)]
    counted += [(r, per_stage) for rank in range(mesh.size("pp"))
                for r in gradient_buckets(program, bucket_bytes, zero_stage, pp_rank=rank, microbatches=microbatches,
                                          compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                          group_of=group_of)]
    every_rank = pipeline_loss_records(program) + loss_value_records(program) + shared_gradient_records(
        program)
    counted += [(r, mesh.world_size) for r in every_rank]
    out: dict[tuple[str, str], int] = defaultdict(int)
    for record, ranks in counted:
        out[(record.axis, record.kind)] += record.bytes_per_step * ranks
    return dict(out)


def build_report(program: Program, *, model: str, plan: str, bucket_bytes: int, compile_seconds: float,
                 warnings: list[str] | None = None, zero_stage: int = 0, microbatches: int = 1,
                 recompute_mode: str = "none", compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, group_of: Callable[[str], int] | None = None) -> Report:
    """``compute_dtype``: the plan's (bf16 under dtype=bf16), the dtype ZeRO-1/2's gather moves;
    ``reduce_dtype``: the plan's (bf16 under reduce_dtype=bf16), the dtype gradient sums travel in;
    ``group_of``: the optimizer's groups by name, each in buckets of its own
    (``runtime.training.bucket_groups``; None: the default optimizer, one group)."""
    collectives = graph_collectives(program.gm, program.mesh, microbatches) + gradient_buckets(
        program, bucket_bytes, zero_stage, microbatches=microbatches, compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype, group_of=group_of)
    collectives += pipeline_loss_records(program) + loss_value_records(program)
    collectives += shared_gradient_records(program)
    memory = memory_by_zero_stage(program, bucket_bytes, microbatches=microbatches, group_of=group_of)
    params = memory[zero_stage]["params"]
    warnings = list(warnings or []) + list(program.warnings) + [
        f"{c.module}: {c.reason}" for c in program.tp_choices if c.style == "replicate"]
    return Report(model, plan, program.mesh, collectives, list(program.tp_choices), warnings, params,
                  compile_seconds, list(program.timings),
                  attention_flops=attention_flops_per_rank(program.gm, program.mesh),
                  memory=memory, zero_stage=zero_stage, stages=stage_table(program),
                  recompute=recompute_records(program.gm, program.mesh), recompute_mode=recompute_mode,
                  fusion=fusion_summary(program.gm, program_parts(program.gm), program.mesh, microbatches),
                  kernels=kernel_sources(program.gm, program_parts(program.gm)),
                  traffic=step_traffic(program, bucket_bytes=bucket_bytes, zero_stage=zero_stage,
                                       microbatches=microbatches, compute_dtype=compute_dtype,
                                       reduce_dtype=reduce_dtype, group_of=group_of),
                  op_rules=op_rules(program.gm),
                  clipping=clipping_records(program))



def op_rules(gm: fx.GraphModule) -> dict[str, str]:
    """Each op of the program and the link of the rule chain that placed it (hand rule, DTensor
    strategy, decomposition, ...), as the propagation pass recorded (an op placed by several links
    on different nodes lists them all)."""
    found: dict[str, set[str]] = defaultdict(set)
    for part in program_parts(gm):
        for node in part.graph.nodes:
            link = node.meta.get("usc_rule_link")
            if link is not None and node.op == "call_function":
                found[str(node.target)].add(link)
    return {op: ", ".join(sorted(links)) for op, links in sorted(found.items())}
