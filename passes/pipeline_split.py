"""Pipeline split: cut the per-rank program into pp stages, one GraphModule each.

Requires: every earlier pass ran (the stage programs are the final per-rank programs, cut).
Establishes: with pp>1 the returned GraphModule is an orchestrator whose ``submod_k`` children are
    the ``pp * v`` stages in order (stage s runs on pp rank s % pp); every value crossing a cut is
    an explicit input/output of the stages (the runtime sends it between pp ranks). Nodes of one
    layer (module path up to its first index, e.g. ``layers.3``) stay together; layers are assigned to stages contiguously so the
    estimated compute per stage (FLOPs from the global shapes) is balanced (``split=auto``), or so
    that stage k+1 starts at the k-th layer ``split=a|b|...`` names; nodes outside layers
    go with what they consume (or, with no computed input, with their first consumer). Values
    computed from buffers and constants alone (RoPE tables) are recomputed on each stage that
    uses them rather than sent. The
    orchestrator's meta["usc_stage_costs"] lists, per stage, its layers and estimated FLOPs per
    microbatch (what the balance was computed from; the report prints it).
"""

from __future__ import annotations

import difflib
import math
import operator

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from usc.compiler.partition import balanced_cut
from usc.compiler.trace import module_path

from .graph_edit import shape_of
from .zero3 import layer_key

aten = torch.ops.aten


def node_flops(node: fx.Node) -> float:
    """A rough cost: 2 * multiply-adds for matmuls and attention, else the output size."""
    out = shape_of(node)
    if out is None:
        return 0.0
    if node.target in (aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
                       aten.addmm.default):
        contracted = shape_of(node.args[1] if node.target != aten.addmm.default else node.args[2])
        k = contracted[-1] if node.target == aten.linear.default else contracted[-2]
        return 2.0 * math.prod(out) * k
    if node.target == aten.scaled_dot_product_attention.default:
        b, h, s, d = shape_of(node.args[0])
        return 4.0 * b * h * s * shape_of(node.args[1])[2] * d
    return float(math.prod(out))


class CutError(ValueError):
    """A split= path that names no layer, or cut points out of order."""


def manual_cut(units: list[str], cuts: tuple[str, ...]) -> list[int]:
    """Stage of each unit when stage k+1 starts at the layer ``cuts[k]`` names."""
    starts = []
    for path in cuts:
        if path not in units:
            inside = [u for u in units if path.startswith(u + ".")]
            close = inside[:1] or difflib.get_close_matches(path, units, n=3)
            why = (f"'{path}' is inside layer '{inside[0]}'; stages are cut between whole layers" if inside
                   else f"'{path}' matches no layer of the model")
            raise CutError(f"{why} (layers: {', '.join(units)})"
                           + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""))
        starts.append(units.index(path))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise CutError(f"cut points must name layers in model order after the first layer "
                       f"('{units[0]}' already starts stage 0): got {'|'.join(cuts)}")
    return [sum(1 for s in starts if s <= i) for i in range(len(units))]


def assign_stages(gm: fx.GraphModule, pp: int, cuts: tuple[str, ...] | None = None) -> dict[fx.Node, int]:
    """Stage of every computing node: layers balanced by FLOPs, or cut where ``cuts`` name."""
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
        stage_of_unit = dict(zip(units, balanced_cut([cost[u] for u in units], pp)))
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


def constant_nodes(gm: fx.GraphModule, constants: set[str]) -> set[fx.Node]:
    """Nodes computed from buffers and constants alone (RoPE tables, masks): the same on every
    microbatch and cheap, so each stage computes its own copy instead of receiving it."""
    free: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in constants:
                free.add(node)
        elif node.op in ("call_function", "get_attr") and all(x in free for x in node.all_input_nodes):
            free.add(node)
    return {n for n in free if n.op != "placeholder"}


def copy_constants_per_stage(gm: fx.GraphModule, stage: dict[fx.Node, int], free: set[fx.Node]) -> None:
    """Give every stage that uses a constant-only value made on another stage its own copy of the
    nodes computing it (edits gm and ``stage``), so that value never crosses a cut."""
    for node in [n for n in gm.graph.nodes if n in free]:
        users = [u for u in node.users if u in stage and u not in free and stage[u] != stage[node]]
        for s in sorted({stage[u] for u in users}):
            first = next(u for u in gm.graph.nodes if u in users and stage[u] == s)
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


def pipeline_split_pass(gm: fx.GraphModule, ctx, *, constants: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Cut the program into pp stage GraphModules (see the module docstring)."""
    pp = ctx.mesh.size("pp")
    if pp == 1:
        return gm
    v = int(ctx.plan.get("v"))
    cuts = ctx.plan.get("split")
    try:
        stage = assign_stages(gm, pp * v, None if cuts == "auto" else tuple(cuts))
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
    return split
