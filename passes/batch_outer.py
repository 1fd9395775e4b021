"""Batch outermost: a reshape that merges the batch *inside* another dim, rewritten to merge it outside.

torch's ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``) works sequence-first
inside: its output projection runs on ``[S, B, H, D] -> [S*B, E]``, rows ordered sequence-major,
and the result is viewed back to ``[S, B, E]``. The batch is the inner factor of the merged rows,
so a rank's samples are not one contiguous block of them: data parallelism would have to gather
the batch there, and microbatching cannot prove the samples stay apart (propagation only follows
a batch that is the outermost factor of a merged dim).

The rows' order does not matter to the ops between the merge and the reshape that splits the
rows back into the same factors, as long as each treats rows alike (a linear layer on the rows,
element-wise ops, the rows carried through other reshapes and copies). Then the program is
unchanged if the merge takes the batch first (``[B, S, ...] -> [B*S, ...]``) and the split
gives ``[B, S, ...]`` and permutes back. This pass makes that rewrite, so the batch stays a
contiguous outer factor and is sharded through the region instead of gathered.

Which factor is the batch is read off a propagation of the graph over a virtual data-parallel
axis (the batch's dim 0 sharded), run only when some merge's region qualifies. A region that
holds anything else (a reduction over the rows, a random draw, the program's output, another
tensor with the same rows) is left alone: propagation gathers the batch there, as before.

Requires: the traced graph with random ops already ``usc::draw`` nodes (random_ops).
Establishes: no qualifying reshape merges the batch (as propagation places it) inside another
    dim; the program computes the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from usc.compiler.errors import CompileError
from usc.compiler.ir import META

from .graph_edit import fake_value, shape_of
from .sharding_rules import view_groups
from .virtual_batch import virtual_propagation

aten = torch.ops.aten
MERGES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
COPIES = (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
          aten._to_copy.default, aten.to.dtype)
LINEARS = (aten.linear.default,)
_COPIED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


@dataclass
class Region:
    """A merge whose merged rows are only used row-wise, up to reshapes that split them back."""

    merge: fx.Node
    group: list[int]            # the merge's source dims forming the merged dim (sizes > 1)
    splits: list[tuple[fx.Node, list[int]]]  # each split-back and the dims it splits the rows into


def batch_outer_pass(gm: fx.GraphModule, ctx, *, user_inputs: tuple[str, ...] = (),
                     params: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Rewrite each qualifying merge so the batch is its outer factor (see the module docstring)."""
    if not _splits_batch(ctx):
        return gm
    regions = [r for node in gm.graph.nodes for r in _regions(node)]
    if not regions:
        return gm
    virtual = _batch_placements(gm, ctx, user_inputs, params)
    if virtual is None:
        return gm
    chosen = [(region, placement.dim) for region in regions
              if isinstance(placement := virtual.get(region.merge.args[0].name), Shard)
              and placement.dim in region.group[1:]]
    for region, batch in chosen:
        _rewrite(gm, region, batch)
    if chosen:
        gm.graph.lint()
        gm.recompile()
    return gm


def _splits_batch(ctx) -> bool:
    """dp (or ep) or microbatches split the batch; under cp the sequence is split too, and a merge of
    the two keeps only one of them outermost: left as it is (cp's sequence stays the outer factor)."""
    plan = ctx.plan
    if plan.size("cp") > 1:
        return False
    return any(plan.size(axis) > 1 for axis in ("dp", "ep")) or int(plan.get("mb") or 1) > 1


def _batch_placements(gm, ctx, user_inputs, params) -> dict[str, object] | None:
    """Each node's placement on the virtual batch axis, or None where the graph does not propagate
    (the passes after this one report why)."""
    try:
        virtual = virtual_propagation(gm, ctx, user_inputs, params)
    except CompileError:
        return None
    return {n.name: n.meta[META].layout.placements[0] for n in virtual.graph.nodes if META in n.meta}


# ------------------------------------------------------------------ which merges qualify

def merged_groups(node: fx.Node) -> list[tuple[list[int], int]]:
    """The groups of >= 2 source dims (sizes > 1) a reshape merges into one dim, with that dim."""
    if node.op != "call_function" or node.target not in MERGES:
        return []
    src, out = shape_of(node.args[0]), shape_of(node)
    if src is None or out is None:
        return []
    found = []
    for gi, gj in view_groups(src, out):
        big_src = [d for d in gi if src[d] != 1]
        big_dst = [d for d in gj if out[d] != 1]
        if len(big_src) >= 2 and len(big_dst) == 1 and len(gj) == 1:
            found.append((big_src, big_dst[0]))
    return found


def _regions(merge: fx.Node) -> list[Region]:
    return [r for group, dim in merged_groups(merge) if (r := _region(merge, group, dim)) is not None]


def _region(merge: fx.Node, group: list[int], dim: int) -> Region | None:
    splits, stop = _walk(merge, group, dim)
    return Region(merge, group, splits) if stop is None and splits else None


def region_stop(merge: fx.Node, group: list[int], dim: int) -> fx.Node | None:
    """The first use of a merge's rows that does not treat them alike (None: every use does)."""
    return _walk(merge, group, dim)[1]


def _walk(merge: fx.Node, group: list[int], dim: int) -> tuple[list[tuple[fx.Node, list[int]]], fx.Node | None]:
    """Follow the merged rows from the merge: the reshapes splitting them back, and the first use
    that does not treat them alike."""
    sizes = [shape_of(merge.args[0])[d] for d in group]
    carried: dict[fx.Node, int] = {merge: dim}
    splits: list[tuple[fx.Node, list[int]]] = []
    todo = [merge]
    while todo:
        node = todo.pop(0)
        for user in node.users:
            if user in carried or any(user is s for s, _ in splits):
                continue
            split = _split_back(user, carried[node], sizes)
            if split is not None:
                splits.append((user, split))
                continue
            out_dim = _row_wise(user, carried)
            if out_dim is None:
                return splits, user
            carried[user] = out_dim
            todo.append(user)
    return splits, None


def _split_back(node: fx.Node, dim: int, sizes: list[int]) -> list[int] | None:
    """The output dims a reshape splits the merged rows into, when they are the merge's factors."""
    if node.op != "call_function" or node.target not in MERGES:
        return None
    src, out = shape_of(node.args[0]), shape_of(node)
    for gi, gj in view_groups(src, out):
        if gi == [dim]:
            big = [d for d in gj if out[d] != 1]
            return big if len(big) == len(gj) and [out[d] for d in big] == sizes else None
    return None


def _row_wise(node: fx.Node, carried: dict[fx.Node, int]) -> int | None:
    """The merged dim in ``node``'s output when ``node`` treats the rows alike; else None."""
    if node.op != "call_function":
        return None
    target, args = node.target, node.args
    inputs = [a for a in node.all_input_nodes if a in carried]
    dim = carried[inputs[0]]
    rank = len(shape_of(inputs[0]) or ())
    if target in COPIES:
        return dim
    if target in LINEARS:
        return dim if args[0] in carried and dim < rank - 1 and len(inputs) == 1 else None
    if target is aten.transpose.int:
        a, b = (int(d) % rank for d in args[1:3])
        return {a: b, b: a}.get(dim, dim)
    if target is aten.permute.default:
        return [int(d) % rank for d in args[1]].index(dim)
    if target in MERGES:
        src, out = shape_of(args[0]), shape_of(node)
        for gi, gj in view_groups(src, out):
            if dim in gi:
                big_src = [d for d in gi if src[d] != 1]
                big_dst = [d for d in gj if out[d] != 1]
                return big_dst[0] if big_src == [dim] and len(big_dst) == 1 else None
        return None
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        out_rank = len(shape_of(node) or ())
        at = out_rank - rank + dim
        for arg in node.all_input_nodes:
            shape = shape_of(arg) or ()
            offset = at - (out_rank - len(shape))
            if arg in carried:
                if len(shape) != rank or carried[arg] != dim:
                    return None
            elif 0 <= offset and shape[offset] != 1:
                return None  # another tensor with rows of its own: their order would have to follow
        return at
    return None


# ------------------------------------------------------------------ the rewrite

def _rewrite(gm: fx.GraphModule, region: Region, batch: int) -> None:
    merge = region.merge
    source = merge.args[0]
    src = shape_of(source)
    order = [batch] + [d for d in region.group if d != batch]
    perm = list(range(len(src)))
    for slot, d in zip(region.group, order):
        perm[slot] = d
    with gm.graph.inserting_before(merge):
        permuted = _node(gm, aten.permute.default, (source, perm), like=merge)
    merge.target = aten.reshape.default  # the permuted source is not contiguous
    merge.args = (permuted, list(shape_of(merge)))
    for split, dims in region.splits:
        out = list(shape_of(split))
        new = list(out)
        for slot, d in zip(dims, order):
            new[slot] = src[d]
        split.target = aten.reshape.default
        split.args = (split.args[0], new)
        split.meta["val"] = fake_value(aten.reshape.default, split.args, {})
        # the split gives the factors in the merge's new order; put them back in the old one
        back = list(range(len(out)))
        for slot, d in zip(dims, region.group):
            back[slot] = dims[order.index(d)]
        users = list(split.users)
        with gm.graph.inserting_after(split):
            restored = _node(gm, aten.permute.default, (split, back), like=split)
        if any(u.target in (aten.view.default, aten._unsafe_view.default) for u in users):
            with gm.graph.inserting_after(restored):  # a view after it needs contiguous rows
                restored = _node(gm, aten.clone.default, (restored,), like=split,
                                 kwargs={"memory_format": torch.contiguous_format})
        for user in users:
            user.replace_input_with(split, restored)


def _node(gm, target, args, *, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
    node = gm.graph.call_function(target, args, kwargs or {})
    node.meta["val"] = fake_value(target, args, kwargs or {})
    for key in _COPIED_META:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


__all__ = ["batch_outer_pass", "merged_groups", "region_stop", "MERGES"]
