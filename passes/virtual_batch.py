"""The batch over a virtual data-parallel axis: propagation with the batch's dim 0 sharded.

batch_outer reads which dim of each tensor carries the batch from it; batch_coupling reads which
ops couple samples (the collectives propagation needed on that axis).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from usc.compiler.ir import Layout, MeshSpec
from usc.compiler.pass_runner import CompileContext

from .graph_edit import shape_of
from .propagate import propagate_pass

aten = torch.ops.aten
VIRTUAL = "dp"


def virtual_propagation(gm: fx.GraphModule, ctx, user_inputs, params, group: int = 1) -> fx.GraphModule:
    """A copy of the graph propagated with the batch's dim 0 sharded over a small virtual dp axis
    (raises what propagation raises); each piece a whole number of ``group`` samples."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph)
    _functional_twins(copy)
    mesh = virtual_mesh(gm, user_inputs, group)
    layouts = {name: Layout((Shard(0),)) for name in user_inputs if _rank(gm, name) > 0}
    plan = ctx.plan.with_options(mb=1, sp=None, cp_mode=None)
    return propagate_pass(copy, CompileContext(mesh, plan), input_layouts=layouts, grad_inputs=set(params))


def virtual_mesh(gm: fx.GraphModule, user_inputs, group: int = 1) -> MeshSpec:
    """The one-axis mesh the batch is split over: its size the batch's smallest prime factor, or,
    where samples go in groups of ``group`` (a slice taking every group-th sample: pairs interleaved
    in the batch), the smallest prime factor of the number of groups, so each piece holds whole groups."""
    batch = batch_size(gm, user_inputs)
    groups = batch // group if group > 1 and batch % group == 0 and batch > group else batch
    return MeshSpec((VIRTUAL,), (virtual_size(groups),))


def _functional_twins(gm: fx.GraphModule) -> None:
    """In-place ops (``div_`` in a router) read as their out-of-place twins: what they couple is the
    same, and the sharding rules are written for the twins."""
    for node in gm.graph.nodes:
        twin = _twin(node.target)
        if twin is not None:
            node.target = twin


def _twin(target):
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def virtual_size(batch: int) -> int:
    """The smallest prime factor of the microbatch's batch size: every reshape that keeps the batch
    outermost divides by it. A microbatch of one sample cannot show a split; the build then traces a
    two-sample probe of the model, analysed in its place (``probe``)."""
    return next((p for p in range(2, batch + 1) if batch % p == 0), 2)


def _rank(gm: fx.GraphModule, name: str) -> int:
    node = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name), None)
    shape = shape_of(node) if node is not None else None
    return len(shape) if shape is not None else 0


def batch_size(gm: fx.GraphModule, user_inputs) -> int:
    shapes = [shape_of(n) for n in gm.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    return next((s[0] for s in shapes if s), 1)


__all__ = ["VIRTUAL", "virtual_propagation", "virtual_mesh", "virtual_size", "batch_size"]
