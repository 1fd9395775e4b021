"""Shard propagation: give every node a layout and insert the redistributions between them.

Requires: placeholders carry their layout in ``input_layouts`` (parameters from the tensor-
    parallel rules, the batch sharded over dp); shapes in ``meta["val"]`` are global.
Establishes: every node has ``meta["usc"]`` with a layout; wherever a consumer needs a different
    placement than its producer gives, an explicit collective node (AllReduce, AllGather,
    ReduceScatter, LocalShard) sits on the edge; ops whose local form differs from the global
    one (vocab-parallel embedding, sharded gather, a sharded mean, a row-parallel bias, a
    sharded cross-entropy) are expanded into nodes that compute it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from usc.compiler.errors import ShardingError, UnsupportedOpError
from usc.compiler.functional import is_state_write
from usc.compiler.ir import META, Layout, MeshSpec, NodeAnn
from usc.compiler.trace import module_path, user_source
from usc.runtime.collectives import AllGather, AllReduce, AllToAll, LocalShard, ReduceScatter
from usc.runtime.vocab import ShardedGather, VocabParallelEmbedding

from .expansions import EXPANSIONS, ExpansionContext, refuse_unsupported
from .graph_edit import GraphEditor, flat_inputs, is_float, shape_of
from .derived_rules import rule_for
from .sharding_rules import Decision, OpView, is_shard

R = Replicate()
RULE_LINK = "usc_rule_link"  # which link of the rule chain placed the node (the report lists them)
NO_GRAD_TARGETS = {torch.ops.aten.detach.default}


@dataclass
class Propagation:
    """State of one propagation run over a graph."""

    gm: fx.GraphModule
    mesh: MeshSpec
    input_layouts: dict[str, Layout]
    grad_inputs: set[str]
    sequence_parallel: bool = False
    cp_mode: str = "ring"
    microbatches: int = 1
    capacity_factor: float | None = None
    editor: GraphEditor = field(init=False)
    cache: dict[tuple[fx.Node, Layout], fx.Node] = field(default_factory=dict)
    reduced: dict[fx.Node, fx.Node] = field(default_factory=dict)  # partial value -> first reduced copy

    def __post_init__(self) -> None:
        self.editor = GraphEditor(self.gm)


def propagate_pass(gm: fx.GraphModule, ctx, *, input_layouts: dict[str, Layout], grad_inputs: set[str]):
    """Place every node on the mesh (see the module docstring)."""
    state = Propagation(gm, ctx.mesh, input_layouts, grad_inputs, sequence_parallel=bool(ctx.plan.get("sp")),
                        cp_mode=ctx.plan.get("cp_mode"), microbatches=int(ctx.plan.get("mb")),
                        capacity_factor=ctx.plan.get("capacity_factor"))
    refuse_unsupported(gm)
    for node in list(gm.graph.nodes):
        if node.graph is gm.graph and (node.users or node.op in ("output", "placeholder") or is_state_write(node)):
            place(state, node)
    _remove_dead(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _remove_dead(gm: fx.GraphModule) -> None:
    """Drop nodes an expansion made unused (e.g. a gather and flatten the loss looked through).
    Nothing here has side effects: collectives without users are dead too."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op not in ("placeholder", "output") and not node.users and not is_state_write(node):
            gm.graph.erase_node(node)


def place(state: Propagation, node: fx.Node) -> None:
    if node.op == "placeholder":
        layout = state.input_layouts.get(node.name, Layout.replicated(len(state.mesh.axes)))
        node.meta[META] = NodeAnn(layout, needs_grad=node.name in state.grad_inputs)
        return
    if node.op == "get_attr":
        node.meta[META] = NodeAnn(Layout.replicated(len(state.mesh.axes)))
        return
    if node.op == "output":
        return
    expand = EXPANSIONS.get(_op_key(state.gm, node))
    if expand is not None:
        new_nodes = expand(ExpansionContext(state.gm, state.mesh, state.editor, state.cp_mode, state.microbatches,
                                            state.capacity_factor),
                           node)
        if new_nodes is not None:
            for new in new_nodes:
                place(state, new)
            return
    _apply_rules(state, node)


def _op_key(gm: fx.GraphModule, node: fx.Node):
    return type(gm.get_submodule(node.target)) if node.op == "call_module" else node.target


def _apply_rules(state: Propagation, node: fx.Node) -> None:
    _use_reduced_copies(state, node)
    inputs = flat_inputs(node)
    layouts = [x.meta[META].layout for x in inputs]
    required, output = _decide(state, node, inputs, layouts)
    for x, have, need in zip(inputs, layouts, required):
        if have != need:
            node.replace_input_with(x, redistribute(state, x, need, node))
    needs_grad = is_float(node) and any(x.meta[META].needs_grad for x in inputs) and _differentiable(node)
    ann = NodeAnn(output, needs_grad=needs_grad, module=module_path(node), source=user_source(node))
    if any(isinstance(p, Partial) for p in output.placements):
        # where the partial sums were made: a view or negation passing them on is not their cause
        passed_on = [x for x in flat_inputs(node) if any(isinstance(p, Partial) for p in x.meta[META].layout.placements)]
        origin = passed_on[0].meta[META].extra.get("partial_origin") if passed_on else None
        ann.extra["partial_origin"] = origin or (ann.module, ann.source)
    node.meta[META] = ann


def _use_reduced_copies(state: Propagation, node: fx.Node) -> None:
    """A partial value already reduced for another consumer is used reduced here too: keeping the
    partial would only be correct, and costs a second reduction further down."""
    for x in dict.fromkeys(flat_inputs(node)):
        if x in state.reduced:
            node.replace_input_with(x, state.reduced[x])


def _differentiable(node: fx.Node) -> bool:
    return node.target not in NO_GRAD_TARGETS


def _decide(state: Propagation, node: fx.Node, inputs, layouts) -> tuple[list[Layout], Layout]:
    rule = rule_for(_op_key(state.gm, node))
    node.meta[RULE_LINK] = getattr(rule, "link", "hand rule" if rule is not None else "replicated")
    shapes = tuple(shape_of(x) or () for x in inputs)
    required: list[list] = [list(lay.placements) for lay in layouts]
    out = []
    for i, (axis, size) in enumerate(zip(state.mesh.axes, state.mesh.shape)):
        view = OpView(node, tuple(lay.placements[i] for lay in layouts), shapes, shape_of(node), axis, size,
                      sequence_parallel=state.sequence_parallel and axis == "tp", order=state.mesh.order(axis),
                      out_dtype=_out_dtype(node))
        decision = _rule_decision(state, node, rule, view)
        for j, p in enumerate(decision.inputs):
            required[j][i] = p
        out.append(decision.output)
    return [Layout(tuple(r)) for r in required], Layout(tuple(out))


def _out_dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    value = value[0] if isinstance(value, (tuple, list)) and value else value
    return value.dtype if isinstance(value, torch.Tensor) else None


def _rule_decision(state: Propagation, node: fx.Node, rule, view: OpView) -> Decision:
    if view.size == 1:
        return Decision(tuple(R for _ in view.placements), R)
    try:
        if rule is None:
            return _no_rule(view)
        return rule(view)
    except ShardingError as err:
        err = located(err, node)
        err.axis = view.axis
        raise err from None


def _no_rule(view: OpView) -> Decision:
    if all(p == R for p in view.placements):
        return Decision(view.placements, R)
    placed = ", ".join(str(p) for p in view.placements)
    raise UnsupportedOpError(
        f"no sharding rule for {view.node.target} with inputs placed ({placed}) on mesh axis '{view.axis}': "
        f"no hand rule, no DTensor strategy or decomposition, and it is not a pure op that could run replicated",
        hint=f"register a rule in usc.passes.sharding_rules.SHARDING_RULES, or compute {view.node.target} "
             f"outside the model's forward (or on whole tensors: a plan without '{view.axis}')")


def located(err: ShardingError, node: fx.Node) -> ShardingError:
    """Name the op, the module and the user's source line in a rule's error."""
    if getattr(err, "node", None) is not None:
        return err
    where = module_path(node) or "<root>"
    src = user_source(node)
    op = getattr(node.target, "__name__", str(node.target))
    new = type(err)(f"{op} in module '{where}'{f' ({src})' if src else ''}: {err.reason}", hint=err.hint)
    inputs = flat_inputs(node)
    new.bad_inputs = tuple(inputs[i].name for i in getattr(err, "bad_args", ()) if i < len(inputs))
    new.node = node
    new.module = where
    new.source = src
    return new


# ---------------------------------------------------------------- redistribution

def redistribute(state: Propagation, x: fx.Node, target: Layout, consumer: fx.Node) -> fx.Node:
    """The cheapest chain of collectives from x's layout to ``target`` (cached per producer)."""
    key = (x, target)
    if key in state.cache:
        return state.cache[key]
    current = x
    layout = x.meta[META].layout
    n = len(state.mesh.axes)
    # Several axes sharding one dim split it outer axis first. Changing an outer axis's shard of a
    # dim that an inner axis also shards needs the inner shard undone first (and redone after).
    for j in reversed(range(n)):
        if _blocks_outer_shard(layout, target, j):
            current, layout = _unshard_step(state, current, layout, j, layout.placements[j], R, consumer)
    # Reduce and gather inner axes first: an inner axis subdivides the chunks of an outer one.
    for i in reversed(range(n)):
        have, need = layout.placements[i], target.placements[i]
        if have != need and not isinstance(have, Replicate):
            current, layout = _unshard_step(state, current, layout, i, have, need, consumer)
    for i in range(n):
        have, need = layout.placements[i], target.placements[i]
        if have != need:
            current, layout = _shard_step(state, current, layout, i, need, consumer)
    state.cache[key] = current
    partial = any(isinstance(p, Partial) for p in x.meta[META].layout.placements)
    if partial and not any(isinstance(p, Partial) for p in target.placements):
        state.reduced.setdefault(x, current)
    return current


def _blocks_outer_shard(layout: Layout, target: Layout, j: int) -> bool:
    """Axis j shards dim d now, and an outer axis i < j must shard or unshard that same dim: the
    outer axis owns the coarse chunks, so j's fine split must be undone first (and redone after)."""
    have = layout.placements[j]
    if not is_shard(have):
        return False
    return any(layout.placements[i] != target.placements[i]
               and (is_shard(target.placements[i], have.dim) or is_shard(layout.placements[i], have.dim))
               for i in range(j))


def _unshard_step(state, x, layout, i, have, need, consumer):
    axis = state.mesh.axes[i]
    order = state.mesh.order(axis)
    if isinstance(have, Partial):
        if is_shard(need) and have.reduce_op == "sum":
            return _insert(state, x, layout.with_axis(i, need), ReduceScatter(axis, need.dim, order),
                           "reduce_scatter", consumer, f"partial sums on {axis} feed an op that wants Shard({need.dim})")
        return _insert(state, x, layout.with_axis(i, R), AllReduce(axis, op=have.reduce_op), "all_reduce",
                       consumer, f"partial {have.reduce_op} on {axis} feeds an op that needs the whole value")
    if is_shard(have):
        if is_shard(need) and state.mesh.order(axis) == "contiguous":
            return _insert(state, x, layout.with_axis(i, need), AllToAll(axis, have.dim, need.dim), "all_to_all",
                           consumer, f"resharded from dim {have.dim} to dim {need.dim} on {axis}")
        return _insert(state, x, layout.with_axis(i, R), AllGather(axis, have.dim, order=order), "all_gather",
                       consumer, f"dim {have.dim} is sharded on {axis} but the op needs it whole")
    return x, layout


def _shard_step(state, x, layout, i, need, consumer):
    axis = state.mesh.axes[i]
    if is_shard(need):
        return _insert(state, x, layout.with_axis(i, need), LocalShard(axis, need.dim, state.mesh.order(axis)),
                       "local_shard",
                       consumer, f"take this rank's slice of dim {need.dim} on {axis} (no communication)")
    raise ShardingError(f"cannot produce {need} on axis '{axis}' from {layout.placements[i]}")


def _insert(state, x, layout, module, stem, consumer, reason):
    """A reduction is caused by the producer of the partial sums (a row-parallel linear, say);
    a gather or a slice by the consumer that needs the other layout."""
    base = x.meta[META]
    if isinstance(module, (AllReduce, ReduceScatter)) and (base.extra.get("partial_origin") or base.module):
        where, source = base.extra.get("partial_origin") or (base.module, base.source)
    else:
        where, source = module_path(consumer) or base.module, user_source(consumer) or base.source
    ann = NodeAnn(layout, needs_grad=base.needs_grad, module=where, source=source, reason=reason)
    node = state.editor.call_module(consumer, module, (x,), ann=ann, stem=stem, same_value_as=x)
    return node, layout


__all__ = ["propagate_pass", "redistribute", "located", "ShardedGather", "VocabParallelEmbedding", "Shard"]
