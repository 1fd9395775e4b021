"""Pipeline split: cut the per-rank program into pp stages, one GraphModule each.

Requires: every earlier pass ran (the stage programs are the final per-rank programs, cut).
Establishes: with pp>1 the returned GraphModule is an orchestrator whose ``submod_k`` children are
    the ``pp * v`` stages in order (stage s runs on pp rank s % pp); every value crossing a cut is
    an explicit input/output of the stages (the runtime sends it between pp ranks). Nodes of one
    layer (module path up to its first index, e.g. ``layers.3``) stay together; layers are assigned to stages contiguously so the
    estimated compute per stage (FLOPs from the global shapes) is balanced (``split=auto``), or so
    that stage k+1 starts at the k-th layer ``split=a|b|...`` names; nodes outside layers
    go with what they consume (or, with no computed input, with their first consumer). Values
    computed from buffers and constants alone (RoPE tables, and this rank's cp piece of them)
    are recomputed on each stage that uses them rather than sent. The
    orchestrator's meta["usc_stage_costs"] lists, per stage, its layers and estimated FLOPs per
    microbatch (what the balance was computed from; the report prints it).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from usc.compiler.hardware import hardware_profile
from usc.compiler.ir import META
from usc.compiler.partition import CutError, NoCutFits, balanced_cut, manual_cut
from usc.compiler.trace import module_path
from usc.runtime.collectives import CollectiveNode
from usc.runtime.op_classes import ATTENTION, MATMUL_OPERANDS, is_grouped_matmul, is_routed_experts

from .graph_edit import shape_of
from .pipeline_schedule import Compute, ComputeOp, build_schedule
from .saved_values import base_of, saved_values
from .zero3 import layer_key

aten = torch.ops.aten


def routed_expert_products(node: fx.Node) -> tuple[int, float, int, int]:
    """(rows, weight elements of one expert, experts, products in all) of a ``usc::moe`` node: its
    rows are the (token, chosen expert) pairs; its experts are stacked [E, in, out] matrices or E of
    each."""
    _, _, indices, experts, stacked = node.args[:5]
    return expert_products(indices, experts, stacked)


def expert_products(indices: fx.Node, experts, stacked: bool) -> tuple[int, float, int, int]:
    """``routed_expert_products`` of a block's indices and expert weights (a ``usc::moe`` node's
    arguments, or the runtime node's that replaced it: x, router weights, indices, then the experts')."""
    matrices = [shape_of(e) for e in experts if len(shape_of(e)) == (3 if stacked else 2)]
    count = matrices[0][0] if stacked else len(matrices) // 3
    per_expert = sum(math.prod(m) for m in matrices) / count
    return math.prod(shape_of(indices)), per_expert, count, count * len(matrices) if stacked else len(matrices)


def expert_flops(indices: fx.Node, experts, stacked: bool) -> float:
    """Forward FLOPs of a block's routed experts: each (token, chosen expert) pair through one
    expert's matrices."""
    rows, per_expert, _, _ = expert_products(indices, experts, stacked)
    return 2.0 * rows * per_expert


def node_flops(node: fx.Node) -> float:
    """A rough cost: 2 * multiply-adds for matmuls and attention, else the output size."""
    out = shape_of(node)
    if out is None:
        return 0.0
    if node.target in MATMUL_OPERANDS:
        _, right, dim = MATMUL_OPERANDS[node.target]
        return 2.0 * math.prod(out) * shape_of(node.args[right])[dim]
    if is_grouped_matmul(node.target):  # [S, K] rows through their experts' [K, N]: S * K * N
        return 2.0 * math.prod(out) * shape_of(node.args[0])[-1]
    if is_routed_experts(node.target):
        _, _, indices, experts, stacked = node.args[:5]
        return expert_flops(indices, experts, stacked)
    if node.target in ATTENTION:
        b, h, s, d = shape_of(node.args[0])
        return 4.0 * b * h * s * shape_of(node.args[1])[2] * d
    return float(math.prod(out))


def assign_stages(gm: fx.GraphModule, pp: int, cuts: tuple[str, ...] | None = None,
                  budget: "MemoryBudget | None" = None, notes: list[str] | None = None) -> dict[fx.Node, int]:
    """Stage of every computing node: layers balanced by FLOPs, or cut where ``cuts`` name.

    With ``budget`` (automatic cuts only), a FLOP-balanced cut that puts more on some stage than
    the device memory holds gives way to the most balanced cut that fits; what happened is
    appended to ``notes``."""
    computing = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    units: list[str] = []
    for node in computing:
        key = layer_key(module_path(node))
        if module_path(node) and key not in units:
            units.append(key)
    if len(units) < pp:
        raise ValueError(f"pp={pp} needs at least {pp} layers to cut between; the model has {len(units)} "
                         f"({', '.join(units)})")
    cost = {u: 0.0 for u in units}
    for node in computing:
        if module_path(node):
            cost[layer_key(module_path(node))] += node_flops(node)
    if cuts is None:
        costs = [cost[u] for u in units]
        cut = balanced_cut(costs, pp)
        if budget is not None:
            cut = budget.refit(gm, units, costs, cut, notes if notes is not None else [])
            gm.meta["usc_stage_memory"] = budget.stage_bytes(cut)
        stage_of_unit = dict(zip(units, cut))
    else:
        stage_of_unit = dict(zip(units, manual_cut(units, cuts)))
    stage: dict[fx.Node, int] = {}
    for node in computing:  # layer nodes first; the rest follow what they consume
        if module_path(node):
            stage[node] = stage_of_unit[layer_key(module_path(node))]
    for node in computing:
        if node not in stage:
            inputs = [stage[x] for x in node.all_input_nodes if x in stage]
            if inputs:
                stage[node] = max(inputs)
    for node in reversed(computing):
        if node not in stage:
            users = [stage[u] for u in node.users if u in stage]
            stage[node] = min(users) if users else 0
    for node in computing:  # a value is never consumed on an earlier stage than it is made
        if node.target is operator.getitem and node.args[0] in stage:
            stage[node] = stage[node.args[0]]  # a multi-output node's tuple never crosses a cut (fused regions)
            continue
        inputs = [stage[x] for x in node.all_input_nodes if x in stage]
        if inputs and max(inputs) > stage[node]:
            stage[node] = max(inputs)
    return stage


def stage_costs(stage: dict[fx.Node, int], stages: int) -> list[dict]:
    """Per stage: the layers (module paths up to their first index) in order, and estimated FLOPs."""
    out = [{"modules": [], "flops": 0.0} for _ in range(stages)]
    for node, s in stage.items():
        key = layer_key(module_path(node)) if module_path(node) else None
        if key is not None and key not in out[s]["modules"]:
            out[s]["modules"].append(key)
        out[s]["flops"] += node_flops(node)
    return out


@dataclass(frozen=True)
class MemoryBudget:
    """The memory check of the automatic split: what one device holds for a stage, estimated from
    the per-rank graph, against the device memory ``capacity``.

    A stage holds its layers' parameters with their gradients and AdamW state (``state_factor``
    bytes per parameter byte after ZeRO sharding over dp), plus each layer's activations -- the
    values its ops keep for backward (``saved_values``, by op class); with ``recompute=full`` only
    what enters the layer -- for the peak number of microbatches in flight on that stage under the
    plan's schedule (``in_flight``). With v chunks per rank each chunk gets 1/v of the memory."""

    capacity: int | None  # bytes per device; None: estimate only, never move a cut
    in_flight: tuple[int, ...]  # per stage: peak microbatches whose activations it holds
    state_factor: float
    full_recompute: bool
    act_itemsize: int | None  # bf16 compute: 2 bytes per float activation element
    chunks: int
    mesh: object
    schedule: str = "1f1b"
    estimates: dict = field(default_factory=dict, compare=False)  # per unit: "state" and "acts" bytes

    def stage_bytes(self, stage_of_unit: list[int]) -> list[dict]:
        """Per stage: estimated state bytes, activation bytes per microbatch, microbatches in flight."""
        out = [{"state_bytes": 0.0, "activation_bytes": 0.0, "in_flight": n} for n in self.in_flight]
        for k, state, acts in zip(stage_of_unit, self.estimates.get("state", ()), self.estimates.get("acts", ())):
            out[k]["state_bytes"] += state
            out[k]["activation_bytes"] += acts
        return out

    def refit(self, gm: fx.GraphModule, units: list[str], costs: list[float], cut: list[int],
              notes: list[str]) -> list[int]:
        state, acts = self._unit_bytes(gm, units)
        self.estimates.clear()
        self.estimates.update(state=state, acts=acts)
        if self.capacity is None:
            return cut
        prefix_state, prefix_acts = _prefix(state), _prefix(acts)
        limit = self.capacity / self.chunks

        def need(start: int, stop: int, part: int) -> float:
            return (prefix_state[stop] - prefix_state[start]
                    + self.in_flight[part] * (prefix_acts[stop] - prefix_acts[start]))

        def fits(start: int, stop: int, part: int) -> bool:
            return need(start, stop, part) <= limit

        def worst(stages: list[int]) -> tuple[int, float]:
            bounds = [(stages.index(k), len(stages) - stages[::-1].index(k)) for k in range(len(self.in_flight))]
            return max(((k, need(a, b, k)) for k, (a, b) in enumerate(bounds)), key=lambda kv: kv[1])

        stage, bytes_needed = worst(cut)
        if bytes_needed <= limit:
            return cut
        try:
            refitted = balanced_cut(costs, len(self.in_flight), fits)
        except NoCutFits:
            gpipe = ", or schedule=1f1b (gpipe keeps every microbatch in flight)" if self.schedule == "gpipe" else ""
            notes.append(f"no split of the {len(units)} layers into {len(self.in_flight)} stages fits "
                         f"{_gib(limit)} per stage: the FLOP-balanced one puts {_gib(bytes_needed)} on stage "
                         f"{stage}; use more pipeline stages, ZeRO over dp (zero=1), recompute=full{gpipe}")
            return cut
        ratio = _imbalance(costs, refitted)
        notes.append(f"the FLOP-balanced split puts {_gib(bytes_needed)} on stage {stage}, over the "
                     f"{_gib(limit)} a stage may hold; split for memory instead (stage FLOPs largest/smallest "
                     f"{ratio:.2f})")
        return refitted

    def _unit_bytes(self, gm: fx.GraphModule, units: list[str]) -> tuple[list[float], list[float]]:
        index = {u: i for i, u in enumerate(units)}

        def unit_of(node: fx.Node) -> int | None:
            return index.get(layer_key(module_path(node))) if module_path(node) else None

        state, acts = [0.0] * len(units), [0.0] * len(units)
        saved: set[tuple[fx.Node, int]] = set()
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.meta.get("usc_trainable"):
                for i in {unit_of(u) for u in node.users} - {None}:
                    state[i] += self._local_bytes(node) * self.state_factor
            elif node.op in ("call_function", "call_module") and unit_of(node) is not None:
                i = unit_of(node)
                if self.full_recompute:  # the layer keeps only what enters it
                    kept = [x for x in node.all_input_nodes if x.op != "placeholder" and unit_of(x) != i]
                else:
                    kept = saved_values(gm, node)
                saved.update((base_of(x), i) for x in kept if base_of(x).op != "placeholder")
        for value, i in saved:
            acts[i] += self._local_bytes(value, activation=True)
        return state, acts

    def _local_bytes(self, node: fx.Node, *, activation: bool = False) -> float:
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)):
            return sum(self._tensor_bytes(node, v, activation) for v in value if isinstance(v, torch.Tensor))
        return self._tensor_bytes(node, value, activation) if isinstance(value, torch.Tensor) else 0.0

    def _tensor_bytes(self, node: fx.Node, value: torch.Tensor, activation: bool) -> float:
        shape = tuple(value.shape)
        ann = node.meta.get(META)
        # a multi-output node's layout describes its first output; another output of lower rank
        # is counted whole (an upper bound)
        if ann is not None and all(dim < len(shape) for dim in ann.layout.sharded_dims()):
            shape = ann.layout.local_shape(shape, self.mesh)
        itemsize = value.dtype.itemsize
        if activation and self.act_itemsize is not None and value.dtype.is_floating_point:
            itemsize = self.act_itemsize
        return float(math.prod(shape) * itemsize)


def memory_budget(ctx, params: set[str]) -> MemoryBudget:
    """The split's memory estimate and check for this plan; the check needs a device memory
    (``memory=``, or the ``hardware=`` written), else the estimate is only reported."""
    plan = ctx.plan
    capacity = None
    if plan.is_set("memory"):
        capacity = int(plan.get("memory"))
    elif plan.is_set("hardware"):
        capacity = hardware_profile(plan.get("hardware")).hbm_bytes
    pp, v, mb = ctx.mesh.size("pp"), int(plan.get("v")), int(plan.get("mb"))
    dp = ctx.mesh.size("dp")
    zero = int(plan.get("zero")) if dp > 1 else 0
    # parameter + gradient + AdamW's two moments, each 1/dp once ZeRO shards it
    factor = {0: 4.0, 1: 2.0 + 2.0 / dp, 2: 1.0 + 3.0 / dp}.get(zero, 4.0 / dp)
    return MemoryBudget(capacity, stage_in_flight(plan.get("schedule"), pp, v, mb), factor,
                        plan.get("recompute") == "full", 2 if plan.get("dtype") == "bf16" else None, v, ctx.mesh,
                        plan.get("schedule"))


def stage_in_flight(schedule: str, pp: int, v: int, mb: int) -> tuple[int, ...]:
    """Per stage: the most microbatches whose forward ran and whose backward (B or I) has not, in
    the plan's schedule."""
    live = [0] * (pp * v)
    peak = [0] * (pp * v)
    for acts in build_schedule(schedule, pp, v, mb).actions.values():
        for act in acts:
            if isinstance(act, Compute) and act.op is not ComputeOp.WEIGHT_GRAD:
                live[act.stage] += 1 if act.op is ComputeOp.FORWARD else -1
                peak[act.stage] = max(peak[act.stage], live[act.stage])
    return tuple(peak)


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for value in values:
        out.append(out[-1] + value)
    return out


def _imbalance(costs: list[float], stages: list[int]) -> float:
    totals = [0.0] * (max(stages) + 1)
    for c, s in zip(costs, stages):
        totals[s] += c
    return max(totals) / max(min(totals), 1e-30)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def constant_nodes(gm: fx.GraphModule, constants: set[str]) -> set[fx.Node]:
    """Nodes computed from buffers and constants alone (RoPE tables, masks): the same on every
    microbatch and cheap, so each stage computes its own copy instead of receiving it. A collective
    node that moves nothing in forward (a LocalShard taking this rank's cp piece of a table)
    is such a computation too; the cost model's profile (usc.passes.cost_profile) counts the same nodes as
    never crossing a cut."""
    free: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in constants:
                free.add(node)
        elif _computes_locally(gm, node) and all(x in free for x in node.all_input_nodes):
            free.add(node)
    return {n for n in free if n.op != "placeholder"}


def _computes_locally(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An op, attribute or collective node whose forward needs no other rank (its value can be made
    again on any stage; on constants it has no gradient, so its backward collective never runs)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return isinstance(module, CollectiveNode) and module.forward_collective() is None
    return node.op in ("call_function", "get_attr")


def copy_constants_per_stage(gm: fx.GraphModule, stage: dict[fx.Node, int], free: set[fx.Node]) -> None:
    """Give every stage that uses a constant-only value made on another stage its own copy of the
    nodes computing it (edits gm and ``stage``), so that value never crosses a cut."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if n in free]:
        users = [u for u in node.users if u in stage and u not in free and stage[u] != stage[node]]
        if any(u not in order for u in users):  # a copy made for an earlier value uses this one
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for s in sorted({stage[u] for u in users}):
            first = min((u for u in users if stage[u] == s), key=order.__getitem__)
            copy = _copy_with_inputs(gm, node, free, stage, s, first)
            for user in (u for u in users if stage[u] == s):
                user.replace_input_with(node, copy)
    for node in reversed([n for n in gm.graph.nodes if n in free]):
        if not node.users:
            gm.graph.erase_node(node)
            stage.pop(node, None)


def _copy_with_inputs(gm, node, free, stage, s, before):
    """node and the constant-only nodes it needs that are not on stage s, copied before ``before``."""
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(n: fx.Node) -> fx.Node:
        if n not in free or stage.get(n) == s:
            return n
        if n not in copies:
            for arg in n.all_input_nodes:
                copy_of(arg)
            with gm.graph.inserting_before(before):
                copies[n] = gm.graph.node_copy(n, lambda a: copies.get(a, a))
            stage[copies[n]] = s
        return copies[n]

    return copy_of(node)


def pipeline_split_pass(gm: fx.GraphModule, ctx, *, constants: frozenset[str] = frozenset(),
                        params: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Cut the program into pp stage GraphModules (see the module docstring)."""
    pp = ctx.mesh.size("pp")
    if pp == 1:
        return gm
    v = int(ctx.plan.get("v"))
    cuts = ctx.plan.get("split")
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in params:
            node.meta["usc_trainable"] = True
    notes: list[str] = []
    try:
        stage = assign_stages(gm, pp * v, None if cuts == "auto" else tuple(cuts), memory_budget(ctx, params), notes)
    except CutError as err:
        raise ctx.plan.error_at("split", str(err), hint="name the first module of each stage after the first, "
                                                        "e.g. split=layers.2|layers.4") from None
    except ValueError as err:
        where = "v" if v > 1 else "pp"
        raise ctx.plan.error_at(where, str(err).replace(f"pp={pp * v}", f"pp={pp}" if v == 1 else f"pp*v={pp * v}"),
                                hint="use fewer pipeline stages") from None
    copy_constants_per_stage(gm, stage, constant_nodes(gm, set(constants)) & set(stage))
    gm.recompile()
    split = split_module(gm, None, lambda node: stage[node], keep_original_order=True)
    split.meta["usc_pipeline_stages"] = pp * v
    split.meta["usc_stage_costs"] = stage_costs(stage, pp * v)
    for cost, memory in zip(split.meta["usc_stage_costs"], gm.meta.pop("usc_stage_memory", ())):
        cost.update(memory)
    split.meta["usc_split_notes"] = notes
    for key in ("usc_count_transform", "usc_step_counts"):  # how the step counts tokens (passes/loss_count.py)
        if key in gm.meta:
            split.meta[key] = gm.meta[key]
    return split
