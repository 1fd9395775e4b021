"""ZeRO-3 placement: gather each layer's parameter slices just before the layer, prefetching one
layer ahead.

Requires: localize ran (local shapes final); parameters reduced over dp carry "dp" in their
    ``partial_grad_axes`` (grad_sync).
Establishes: with zero=3 and dp>1, every such parameter placeholder holds this rank's 1/dp slice
    (``meta["usc"].extra["zero3"]``); its uses read a ``ZeroGather`` output instead. Parameters are
    grouped per layer (the module path up to its first index, e.g. ``layers.3``); the ``ZeroFetch``
    of group i+1 sits before group i's first use, so its all-gather overlaps group i's compute.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from usc.compiler.ir import META, NodeAnn
from usc.compiler.trace import module_path
from usc.runtime.zero3 import ZeroFetch, ZeroGather

from .compute_dtype import COMPUTE
from .graph_edit import GraphEditor
from .saved_values import saves_for_backward


def layer_key(path: str) -> str:
    """'layers.3.mlp.up_proj' -> 'layers.3'; a module outside a numbered list is its own group."""
    match = re.match(r"^(.*?\.\d+)(\.|$)", path)
    return match.group(1) if match else (path or "<root>")


def zero3_pass(gm: fx.GraphModule, ctx, *, params: set[str]) -> fx.GraphModule:
    """Shard parameters over dp and gather them per layer (see the module docstring)."""
    if int(ctx.plan.get("zero")) != 3 or ctx.mesh.size("dp") == 1:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        ann = node.meta.get(META)
        if node.op == "placeholder" and node.name in params and "dp" in ann.partial_grad_axes and node.users:
            first = min(node.users, key=order.__getitem__)
            groups.setdefault(layer_key(module_path(first)), []).append(node)
    ranked = sorted(groups.items(), key=lambda kv: min(order[u] for p in kv[1] for u in p.users))
    firsts = [min((u for p in members for u in p.users), key=order.__getitem__) for _, members in ranked]
    editor = GraphEditor(gm, ctx.mesh)
    for i, (key, members) in enumerate(ranked):
        _gather_group(editor, key, members, fetch_at=firsts[max(i - 1, 0)], use_at=firsts[i],
                      wire_dtype=COMPUTE.get(ctx.plan.get("dtype")))
    gm.graph.lint()
    gm.recompile()
    return gm


def _gather_group(editor: GraphEditor, key: str, members: list[fx.Node], *, fetch_at: fx.Node,
                  use_at: fx.Node, wire_dtype: torch.dtype | None) -> None:
    mesh_layout = members[0].meta[META].layout
    shapes = [m.meta[META].layout.local_shape(tuple(m.meta["val"].shape), editor.mesh) for m in members]
    users = {m: list(m.users) for m in members}
    ann = NodeAnn(mesh_layout, module=key, source="", reason="ZeRO-3: gather this layer's parameters")
    fetch = editor.call_module(fetch_at, ZeroFetch("dp", key, shapes, wire_dtype), tuple(members), ann=ann, stem="zero_fetch",
                               same_value_as=members[0])
    regather = any(saves_for_backward(editor.gm, m) for m in members)
    gather = editor.call_module(use_at, ZeroGather("dp", key, shapes, regather=regather, wire_dtype=wire_dtype), (fetch, *members),
                                ann=NodeAnn(mesh_layout, needs_grad=True, module=key,
                                            reason="ZeRO-3: full parameters of this layer; gradients "
                                                   "reduce-scattered in backward"),
                                stem="zero_gather", same_value_as=members[0])
    for index, member in enumerate(members):
        with editor.graph.inserting_before(use_at):
            full = editor.graph.call_function(operator.getitem, (gather, index))
        full.meta["val"] = member.meta["val"]
        full.meta[META] = NodeAnn(member.meta[META].layout, needs_grad=True, module=key)
        for user in users[member]:
            user.replace_input_with(member, full)
        member.meta[META].extra["zero3"] = True
