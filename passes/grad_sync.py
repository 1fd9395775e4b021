"""Gradient synchronisation: the Megatron ``f`` operator, placed by a rule instead of by hand.

Requires: every node has a layout (propagation ran).
Establishes: wherever a value replicated on an axis feeds a computation that is split on that
    axis (its output is sharded or partial there), each rank's gradient of that value is only a
    partial sum. Such edges get a ``GradAllReduce`` (identity forward, all-reduce backward), one
    per producer and axis, shared by all its consumers that need it — so q/k/v share one, and
    gate/up share one. For parameters whose every use is such an edge (data parallelism: all of
    them), no node is inserted: the parameter's ``partial_grad_axes`` tells the runtime's
    bucketed reducer to sum its gradient over those axes during backward instead. The same holds
    through ops that are linear in the gradient between the parameter and its uses (``w.t()``,
    reshapes, casts, slices): a partial sum passes through them unchanged, so ``x @ w.t()`` also
    leaves its dp sum to the reducer instead of an all-reduce per use and microbatch. An
    ``AllGather`` whose consumers all need it switches its backward to reduce-scatter.
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
import torch
from torch.distributed.tensor import Replicate

from usc.compiler.ir import META, set_ann
from usc.runtime.collectives import AllGather, GradAllReduce
from usc.runtime.moe import ExpertParallelMoE
from usc.runtime.vocab import ShardedGather, VocabParallelEmbedding

from .graph_edit import GraphEditor, flat_inputs
from usc.runtime.op_classes import MULTI_OUTPUT_VIEWS, VIEWS

LOCAL_OPS = (VocabParallelEmbedding, ShardedGather, ExpertParallelMoE)
aten = torch.ops.aten
# one tensor in, its gradient a linear map of the output's: a partial sum in gives a partial sum out
# (the single-output views, and copies and casts)
GRAD_LINEAR = (VIEWS - MULTI_OUTPUT_VIEWS - {aten.detach.default}) | {
    aten._to_copy.default, aten.clone.default, aten.contiguous.default}


def grad_sync_pass(gm: fx.GraphModule, ctx, *, params: set[str]) -> fx.GraphModule:
    """Insert f operators / mark parameter gradient reductions (see the module docstring)."""
    needs = _partial_grad_edges(gm)
    editor = GraphEditor(gm)
    for param in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in params]:
        _defer_to_reducer(param, needs, ctx.mesh.axes)
    for producer, by_consumer in needs.items():
        if _is_module(gm, producer, AllGather):
            by_consumer = _fold_into_all_gather(gm, producer, by_consumer, ctx.mesh.axes)
        _insert_f(editor, producer, by_consumer, ctx.mesh.axes)
    gm.graph.lint()
    gm.recompile()
    return gm


def _is_module(gm: fx.GraphModule, node: fx.Node, cls) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), cls)


def _is_compute(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_function":
        return True
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), LOCAL_OPS)


def _partial_grad_edges(gm: fx.GraphModule) -> dict[fx.Node, dict[fx.Node, tuple[int, ...]]]:
    """producer -> {consumer: axis indices where that edge's gradient is a partial sum}."""
    out: dict[fx.Node, dict[fx.Node, tuple[int, ...]]] = defaultdict(dict)
    for node in gm.graph.nodes:
        if not _is_compute(gm, node):
            continue
        result = node.meta[META].layout.placements
        # each input once, in argument order: the producers' order here is the order the f operators
        # are inserted in, so a set (ordered by the nodes' addresses) would give each process its own
        # program -- and ranks whose backward all-reduces run in different orders
        for x in dict.fromkeys(flat_inputs(node)):
            meta = x.meta[META]
            if not meta.needs_grad:
                continue
            axes = tuple(i for i, (p, q) in enumerate(zip(meta.layout.placements, result))
                         if isinstance(p, Replicate) and not isinstance(q, Replicate))
            if axes:
                out[x][node] = axes
    return out


def _linear_closure(param: fx.Node) -> list[fx.Node]:
    """The parameter and every node reached from it through GRAD_LINEAR ops only."""
    closure, i = [param], 0
    while i < len(closure):
        for user in closure[i].users:
            if (user.op == "call_function" and user.target in GRAD_LINEAR and user not in closure
                    and [x for x in user.all_input_nodes] == [closure[i]]):
                closure.append(user)
        i += 1
    return closure


def _defer_to_reducer(param: fx.Node, needs: dict, axis_names) -> None:
    """Axes on which *every* use of the parameter -- directly or through GRAD_LINEAR ops -- needs
    the reduction go to the bucketed reducer; those edges then need no f operator."""
    closure = _linear_closure(param)
    inside = set(closure)
    exits = [(node, user) for node in closure for user in node.users if user not in inside]
    if not exits:
        return
    deferred = [i for i in range(len(axis_names))
                if all(i in needs.get(node, {}).get(user, ()) for node, user in exits)
                and all(isinstance(n.meta[META].layout.placements[i], Replicate) for n in closure)]
    if not deferred:
        return
    set_ann(param, partial_grad_axes=tuple(axis_names[i] for i in deferred))
    for node in closure:
        if node in needs:
            needs[node] = {c: tuple(i for i in axes if i not in deferred) for c, axes in needs[node].items()}


def _fold_into_all_gather(gm, gather: fx.Node, by_consumer, axis_names) -> dict:
    module = gm.get_submodule(gather.target)
    i = axis_names.index(module.axis)
    if all(i in by_consumer.get(u, ()) for u in gather.users):
        module.grad = "partial"  # backward: reduce-scatter instead of taking the local chunk
        return {c: tuple(a for a in axes if a != i) for c, axes in by_consumer.items()}
    return by_consumer


def _insert_f(editor: GraphEditor, producer: fx.Node, by_consumer, axis_names) -> None:
    groups: dict[tuple[int, ...], list[fx.Node]] = defaultdict(list)
    for consumer, axes in by_consumer.items():
        if axes:
            groups[axes].append(consumer)
    for axes, consumers in groups.items():
        first = min(consumers, key=_position)
        current = producer
        for i in axes:
            ann = producer.meta[META].__class__(
                producer.meta[META].layout, needs_grad=True, module=consumers[0].meta[META].module,
                source=consumers[0].meta[META].source,
                reason=f"gradient of a value replicated on {axis_names[i]} that feeds a computation split "
                       f"on {axis_names[i]} is a partial sum (Megatron's f operator)")
            current = editor.call_module(first, GradAllReduce(axis_names[i]), (current,), ann=ann,
                                         stem=f"grad_all_reduce_{axis_names[i]}", same_value_as=producer)
        for consumer in consumers:
            consumer.replace_input_with(producer, current)


def _position(node: fx.Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)
