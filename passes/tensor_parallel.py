"""Tensor parallelism: choose how each weight is split over the tp axis.

Plan rules (`GLOB: colwise|rowwise|vocab|replicate`) decide where given. Elsewhere the compiler
finds the Megatron pairs itself (Shoeybi et al. 2019): a linear whose output reaches another
linear's input through ops that keep features apart (pointwise ops, reshapes, attention) is
column-parallel and that other linear is row-parallel — attention q/k/v + output projection,
MLP gate/up + down — so each pair costs one all-reduce per direction. A linear that feeds the
loss (the lm head) and the token embedding are split on the vocabulary.

Nothing here inserts a collective: the choices become parameter layouts and the propagation pass
derives every collective from them. A pair that cannot be split (a reshape the tp size does not
divide, e.g. a fused q/k/v projection viewed as [.., 3, heads, dim]) falls back to replicated,
and the report says why.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from usc.compiler.trace import module_path
from usc.runtime.op_classes import COPIES, RESHAPES

aten = torch.ops.aten
R = Replicate()
CARRIERS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.chunk.default, aten.split.Tensor, aten.unbind.int,
    operator.getitem, aten.cat.default, aten.repeat_interleave.self_int, aten.expand.default,
    aten.scaled_dot_product_attention.default, aten.clone.default, aten.contiguous.default, aten._to_copy.default,
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.div.Tensor, aten.silu.default,
    aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.dropout.default,
    aten.slice.Tensor, aten.select.int, aten.to.dtype, aten.to.dtype_layout, aten.alias.default,
    # complex-number RoPE (torchtitan): pairs of features become one complex feature and back, per head
    aten.view_as_complex.default, aten.view_as_real.default, aten.flatten.using_ints, aten.unflatten.int,
    aten.type_as.default,
    # GPT-2's tanh-approximated GELU, written out
    aten.pow.Tensor_Scalar, aten.mul.Scalar, aten.add.Scalar, aten.div.Scalar,
    # writes through views, functionalized (compiler/functional.py); propagation gathers where one
    # writes along the split features
    aten.select_scatter.default, aten.slice_scatter.default, aten.fill.Scalar, aten.fill.Tensor,
}

# Nodes that only check a value (export's dtype/shape assertions) are not uses of it.
IGNORED_USERS = {aten._assert_tensor_metadata.default}
# what a loss's logits pass through on their way from the lm head: reshapes, copies, casts, slices
TO_LOSS = RESHAPES | COPIES | {aten.slice.Tensor}


@dataclass(frozen=True)
class TPChoice:
    """How one module's weight is split, and why (shown in the report)."""

    module: str
    style: str  # colwise | rowwise | vocab | replicate
    reason: str
    explicit: bool = False


@dataclass
class PairGroup:
    """Column-parallel linears feeding one row-parallel linear; ``region`` = modules in between."""

    row: fx.Node
    cols: list[fx.Node]
    region: set[str] = field(default_factory=set)
    reached: dict[str, set[str]] = field(default_factory=dict)  # col node name -> names of nodes it feeds


def _users(node: fx.Node) -> list[fx.Node]:
    return list(node.users)


def reach(start: fx.Node) -> tuple[set[fx.Node], set[fx.Node], bool, set[fx.Node]]:
    """Follow ``start``'s value forward through CARRIERS. Returns (linears it enters as input,
    cross-entropy nodes it reaches through TO_LOSS ops only, escaped, nodes visited)."""
    rows, losses, escaped, seen = set(), set(), False, set()
    stack = [(u, start, True) for u in _users(start)]
    while stack:
        node, src, loss_path = stack.pop()
        if node in seen or node.target in IGNORED_USERS:
            continue
        seen.add(node)
        if node.target == aten.linear.default and node.args[0] is src:
            rows.add(node)
        elif node.target == aten.cross_entropy_loss.default and loss_path and node.args[0] is src:
            losses.add(node)
        elif node.target in CARRIERS:
            stack.extend((u, node, loss_path and node.target in TO_LOSS) for u in _users(node))
        else:
            escaped = True
    return rows, losses, escaped, seen


def weight_param(node: fx.Node) -> tuple[fx.Node, bool]:
    """A linear's or embedding's weight placeholder, and whether the linear reads it transposed
    (``linear(x, W.t())``: GPT-2's Conv1D after ``conv1d_as_linear``)."""
    weight = node.args[1] if node.target == aten.linear.default else node.args[0]
    if weight.op == "call_function" and weight.target == aten.t.default:
        return weight.args[0], True
    return weight, False


def conv1d_as_linear(gm: fx.GraphModule, params: set[str]) -> None:
    """GPT-2's ``Conv1D`` computes ``addmm(bias, x, W)`` with ``W`` stored [in, out]; rewritten as the
    same value ``linear(x, W.t(), bias)`` so pairs are found through it and a row-parallel bias is
    split off by the propagation pass like any linear's. Run under every plan (``parallelize``): the
    flatten it drops would merge a cp or sp shard of the sequence into the rows. Idempotent."""
    changed = False
    for node in list(gm.graph.nodes):
        if not _is_conv1d(node, params):
            continue
        bias, x, weight = node.args
        unflattened = _unflattened_input(node)
        with gm.graph.inserting_before(node):
            transposed = gm.graph.call_function(aten.t.default, (weight,))
            transposed.meta = {**node.meta, "val": weight.meta["val"].t()}
            linear = gm.graph.call_function(aten.linear.default, (unflattened or x, transposed, bias))
            linear.meta = dict(node.meta)
            if unflattened is not None:  # the views back to [..., out] now see that shape already
                linear.meta["val"] = next(iter(node.users)).meta["val"]
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


def _unflattened_input(node: fx.Node) -> fx.Node | None:
    """Conv1D flattens [B, S, in] to [B*S, in] for addmm and views the result back to [B, S, out].
    A linear applies to [B, S, in] directly; without the flatten, a sequence shard (sp) or a batch
    shard passes through instead of meeting a reshape that merges it into another dim."""
    x = node.args[1]
    if x.op != "call_function" or x.target != aten.view.default:
        return None
    lead = tuple(x.args[0].meta["val"].shape[:-1])
    out = node.meta["val"].shape[-1]
    backs = [u.target == aten.view.default and tuple(u.meta["val"].shape) == lead + (out,) for u in node.users]
    return x.args[0] if backs and all(backs) and len(lead) > 1 else None


def _is_conv1d(node: fx.Node, params: set[str]) -> bool:
    if node.target != aten.addmm.default or node.kwargs or len(node.args) != 3:
        return False
    bias, _, weight = node.args
    return (getattr(weight, "name", None) in params and getattr(bias, "name", None) in params
            and bias.meta["val"].dim() == 1)


def find_pairs(gm: fx.GraphModule, params: set[str]) -> tuple[list[PairGroup], list[fx.Node]]:
    """Megatron pairs and vocab-parallel lm heads among linears whose weight is a parameter."""
    by_row: dict[fx.Node, PairGroup] = {}
    heads = []
    for node in gm.graph.nodes:
        if node.target != aten.linear.default or weight_param(node)[0].name not in params:
            continue
        if node in by_row:
            continue  # already the row-parallel half of a pair: it cannot also open one
        rows, losses, escaped, seen = reach(node)
        if losses and not rows and not escaped:
            heads.append(node)
        elif len(rows) == 1 and not escaped and not losses:
            row = next(iter(rows))
            group = by_row.setdefault(row, PairGroup(row, []))
            group.cols.append(node)
            group.region |= {module_path(n) for n in seen}
            group.reached[node.name] = {n.name for n in seen}
    return list(by_row.values()), heads


def style_layouts(style: str, node: fx.Node, n_axes: int, tp_index: int) -> dict[str, tuple]:
    """placeholder name -> per-axis placements for the weights of one linear or embedding node."""
    def on_tp(p):
        placements = [R] * n_axes
        placements[tp_index] = p
        return tuple(placements)

    weight, transposed = weight_param(node)
    bias = node.args[2] if node.target == aten.linear.default and len(node.args) > 2 else None
    rows, cols = (Shard(1), Shard(0)) if transposed else (Shard(0), Shard(1))  # of the stored weight
    out = {}
    if style in ("colwise", "vocab"):
        out[weight.name] = on_tp(rows)
        if bias is not None:
            out[bias.name] = on_tp(Shard(0))
    elif style == "rowwise":
        out[weight.name] = on_tp(cols)
    if node.target == aten.embedding.default and style == "colwise":
        out[weight.name] = on_tp(Shard(1))
    return out


def is_token_embedding(node: fx.Node, user_inputs: set[str]) -> bool:
    """An embedding looked up by a model input (token ids), not by computed positions."""
    ids = node.args[1]
    while ids.op != "placeholder" and ids.target in TO_LOSS | {aten.slice.Tensor}:
        ids = ids.args[0]
    return ids.op == "placeholder" and ids.name in user_inputs
