"""What autograd keeps for backward, read from the graph by op class (no run): the pipeline
split's memory estimate, ZeRO-3's choice of which layers backward gathers again and recompute's
count of the collectives backward re-issues use it."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from usc.runtime.op_classes import VIEWS

aten = torch.ops.aten

# ops autograd saves nothing for (their backward needs no values)
_SAVE_NOTHING = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.cat.default, aten.sum.default,
                 aten.sum.dim_IntList, aten.mean.dim, aten.arange.default, aten.ne.Scalar, aten.eq.Scalar,
                 aten.repeat_interleave.self_int, aten.clone.default, aten._to_copy.default, aten.zeros_like.default,
                 aten.full.default, aten.ones_like.default} | VIEWS
# ops whose backward reads their output rather than their inputs
_SAVE_OUTPUT = {aten.rsqrt.default, aten.exp.default, aten.tanh.default, aten.sigmoid.default,
                aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int}


def base_of(node: fx.Node) -> fx.Node:
    """The node whose storage a view chain reads."""
    while node.op == "call_function" and node.target in VIEWS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def saved_values(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """What autograd keeps for ``node``'s backward, by op class: nothing for additions, views and
    reductions to a sum; the output for exp, rsqrt, softmax and the like (and attention, which keeps
    its inputs too); the inputs otherwise (matmuls, products, activations -- and, to stay an upper
    bound, any op not listed). Collectives keep nothing, but ring attention keeps what attention
    keeps (q, k, v, its output and the LSE)."""
    if node.op == "call_module":
        from usc.runtime.collectives import CollectiveNode
        from usc.runtime.ring_attention import RingAttention
        from usc.runtime.vocab import VocabParallelEmbedding

        module = gm.get_submodule(node.target)
        if isinstance(module, RingAttention):
            return [*node.all_input_nodes, node]
        if isinstance(module, VocabParallelEmbedding):  # like an embedding: the ids, not the table
            return [node.args[1]]
        return [] if isinstance(module, CollectiveNode) else list(node.all_input_nodes)
    if node.target == aten.embedding.default:
        return [node.args[1]]  # the indices; the table's gradient is a scatter of the output's
    if node.target in _SAVE_NOTHING:
        return []
    if node.target in _SAVE_OUTPUT:
        return [node]
    if node.target == aten.scaled_dot_product_attention.default:
        return [*node.all_input_nodes, node]
    return list(node.all_input_nodes)




def saves_for_backward(gm: fx.GraphModule, value: fx.Node, *,
                       ignoring: Callable[[fx.Node], bool] = lambda node: False) -> bool:
    """Whether some op keeps ``value`` -- or a view of it -- for backward; ops (and views) for which
    ``ignoring`` holds are not asked."""
    closure, i = [value], 0
    while i < len(closure):
        for user in closure[i].users:
            if user in closure or ignoring(user):
                continue
            if user.op == "call_function" and user.target in VIEWS:
                closure.append(user)
            elif user.op in ("call_function", "call_module") and any(
                    base_of(kept) in closure or kept in closure for kept in saved_values(gm, user)):
                return True
        i += 1
    return False
