"""Per-op sharding rules, one mesh axis at a time, as a table: ``SHARDING_RULES[op] = rule``.

A rule sees one node on one mesh axis (``OpView``: the current placement and global shape of
each tensor input) and returns a ``Decision``: the placement each input must have (the
propagation pass inserts the redistribution when it differs) and the placement of the output.

Every rule is written for *local* execution: the op runs unchanged on each rank's local pieces,
and the output placement says how those local results relate to the global value. Shapes stay
global; ``localize_pass`` rewrites shape arguments at the end.

An op with no rule is accepted only when all its inputs are replicated (then every rank computes
the same thing); otherwise ``ShardingError`` names it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from usc.compiler.errors import ShardingError
from usc.runtime.collectives import AllToAll
from usc.runtime.ring_attention import RingAttention
from usc.runtime.vocab import ShardedGather, VocabParallelEmbedding

aten = torch.ops.aten
R = Replicate()
P_SUM = Partial("sum")


@dataclass(frozen=True)
class OpView:
    """What a rule sees: one node, one mesh axis."""

    node: fx.Node
    placements: tuple[Placement, ...]  # of the flat tensor inputs, in argument order
    shapes: tuple[tuple[int, ...], ...]  # their global shapes
    out_shape: tuple[int, ...] | None  # global output shape (first element for tuple outputs)
    axis: str
    size: int
    sequence_parallel: bool = False  # sp=on and this is the tp axis
    out_dtype: torch.dtype | None = None  # of the (first) output; None when unknown
    order: str = "contiguous"  # chunk order of the axis: "zigzag" cuts a sharded dim into 2 * size pieces

    @property
    def pieces(self) -> int:
        """How many equal chunks a dim sharded on this axis is cut into."""
        return 2 * self.size if self.order == "zigzag" else self.size

    def arg(self, index: int, default=None):
        args = self.node.args
        return args[index] if index < len(args) else self.node.kwargs.get(_ARG_NAMES.get(index, ""), default)


_ARG_NAMES: dict[int, str] = {}


@dataclass(frozen=True)
class Decision:
    inputs: tuple[Placement, ...]
    output: Placement


Rule = Callable[[OpView], Decision]
SHARDING_RULES: dict[object, Rule] = {}


def register(*ops) -> Callable[[Rule], Rule]:
    def wrap(fn: Rule) -> Rule:
        for op in ops:
            SHARDING_RULES[op] = fn
        return fn
    return wrap


def is_shard(p: Placement, dim: int | None = None) -> bool:
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


def is_partial(p: Placement, op: str | None = None) -> bool:
    return isinstance(p, Partial) and (op is None or p.reduce_op == op)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def all_replicated(view: OpView) -> Decision:
    return Decision((R,) * len(view.placements), R)


def keep(view: OpView, placement: Placement) -> Decision:
    """Single-input ops that keep the input's placement."""
    return Decision((placement,), placement)


# ---------------------------------------------------------------- pointwise (with broadcasting)

def _aligned_dim(in_rank: int, out_rank: int, in_dim: int) -> int:
    return in_dim + out_rank - in_rank


def _broadcast_choice(view: OpView, placements: tuple[Placement, ...]) -> Decision:
    """Follow the first input sharded on a non-broadcast dim; the rest match it or replicate."""
    out = view.out_shape or ()
    chosen = None
    for p, shape in zip(placements, view.shapes):
        if is_shard(p):
            od = _aligned_dim(len(shape), len(out), p.dim)
            if shape[p.dim] == out[od]:
                chosen = od
                break
    if chosen is None:
        return Decision(tuple(R for _ in placements), R)
    need = []
    for shape in view.shapes:
        d = chosen - (len(out) - len(shape))
        need.append(Shard(d) if d >= 0 and shape[d] == out[chosen] else R)
    return Decision(tuple(need), Shard(chosen))


def pointwise(linear: str = "none") -> Rule:
    """linear: 'none' (partial inputs are reduced first; casts), 'unary' (f(P) = P: neg, clone),
    'add' (P + P = P), 'mul' (P * R = P and P / R = P: a partial numerator keeps, the rest reduce)."""

    def rule(view: OpView) -> Decision:
        partial = [is_partial(p, "sum") for p in view.placements]
        if any(partial) and _float_output(view):
            kept = _keep_partial(view, linear, partial)
            if kept is not None:
                return kept
        reduced = _sequence_shard(view) if any(partial) else R
        cleaned = tuple(reduced if isinstance(p, Partial) else p for p in view.placements)
        return _broadcast_choice(view, cleaned)

    rule.elementwise = True
    return rule


_POINTWISE = pointwise()


# Losses that reduce a per-element loss of same-shaped inputs: op -> index of its reduction argument.
ELEMENTWISE_LOSSES = {
    aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2, aten.huber_loss.default: 2,
    aten.soft_margin_loss.default: 2, aten.kl_div.default: 2, aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4, aten.margin_ranking_loss.default: 4,
    aten.hinge_embedding_loss.default: 3, aten.poisson_nll_loss.default: 5,
}
# Losses of [N, D] rows (a sample's features reduced to one value each): op -> index of its reduction.
ROWWISE_LOSSES = {
    aten.cosine_embedding_loss.default: 4, aten.triplet_margin_loss.default: 7, aten.multi_margin_loss.default: 5,
    aten.multilabel_margin_loss.default: 2,
}
# how many of their first tensor inputs hold the rows (multi_margin's class weights do not)
_ROW_INPUTS = {aten.cosine_embedding_loss.default: 3, aten.triplet_margin_loss.default: 3,
               aten.multi_margin_loss.default: 2, aten.multilabel_margin_loss.default: 2}
REDUCED_LOSSES = {**ELEMENTWISE_LOSSES, **ROWWISE_LOSSES}


def loss_reduction(node: fx.Node, index: int) -> int:
    """0 (none), 1 (mean) or 2 (sum): the reduction argument of a loss op."""
    args = node.args
    return int(node.kwargs.get("reduction", args[index] if len(args) > index else 1))


@register(*ELEMENTWISE_LOSSES)
def elementwise_loss_rule(view: OpView) -> Decision:
    """Per element (``reduction='none'``) such a loss is element-wise (partial inputs reduced first:
    it is not linear); reduced, it needs its inputs whole (sharded, the expansion rewrites it as the
    per-element loss and a sum or mean first)."""
    if loss_reduction(view.node, ELEMENTWISE_LOSSES[view.node.target]) == 0:
        return _POINTWISE(view)
    return Decision(tuple(R for _ in view.placements), R)


@register(*ROWWISE_LOSSES)
def rowwise_loss_rule(view: OpView) -> Decision:
    """Per row (``reduction='none'``) such a loss reduces each row's features to one value: rows may be
    split -- dim 0 of every input with the rows, the batch -- and the output [N] keeps their split; a
    split of the features, a partial sum (it is not linear), 1-D inputs (one sample) or any reduction
    needs the inputs whole (reduced and sharded, the expansion rewrites it per row first)."""
    ps, two_d = view.placements, len(view.shapes[0]) == 2
    batched = [two_d and i < _ROW_INPUTS[view.node.target] for i in range(len(ps))]
    split = any(p == Shard(0) and b for p, b in zip(ps, batched))
    rows_only = all((p == Shard(0) and b) or isinstance(p, Replicate) for p, b in zip(ps, batched))
    if loss_reduction(view.node, ROWWISE_LOSSES[view.node.target]) == 0 and split and rows_only:
        return Decision(tuple(Shard(0) if b else R for b in batched), Shard(0))
    return Decision(tuple(R for _ in ps), R)


def is_elementwise(op) -> bool:
    """An op whose hand rule is ``pointwise``: each output element made from the inputs' elements at
    the same (broadcast) index."""
    return getattr(SHARDING_RULES.get(op), "elementwise", False)


def _float_output(view: OpView) -> bool:
    """Only a floating-point result is linear in its input: int(a) + int(b) is not int(a + b), so a
    cast to an integer or bool type (or a comparison) needs the whole value first."""
    return view.out_dtype is not None and (view.out_dtype.is_floating_point or view.out_dtype.is_complex)


def _sequence_shard(view: OpView) -> Placement:
    """Sequence parallelism (Korthikanti et al. 2022): outside the tp regions, partial sums are
    reduce-scattered along the sequence (dim 1 of [batch, seq, hidden] activations) instead of
    all-reduced, so norms and residual adds work on a 1/tp slice of the sequence."""
    out = view.out_shape or ()
    if view.sequence_parallel and len(out) == 3 and out[1] % view.size == 0:
        return Shard(1)
    return R


def _keep_partial(view: OpView, linear: str, partial: list[bool]) -> Decision | None:
    ps = view.placements
    if linear == "unary" and len(ps) == 1:
        return Decision(ps, P_SUM)
    if linear == "add":
        scalars = [a for a in view.node.args if isinstance(a, (int, float)) and a != 0]
        return Decision(ps, P_SUM) if all(partial) and len(ps) == 2 and not scalars else None
    if linear != "mul":
        return None
    keep_at = 0 if partial[0] else (None if view.node.target in _DIVISIONS else partial.index(True))
    if keep_at is None or any(is_shard(p) for p in ps):
        return None
    return Decision(tuple(P_SUM if i == keep_at else R for i in range(len(ps))), P_SUM)


_DIVISIONS = {aten.div.Tensor, aten.div.Scalar}

register(aten.neg.default, aten.clone.default, aten.detach.default, aten.alias.default,
         aten.contiguous.default, aten.lift_fresh_copy.default)(pointwise("unary"))
# A cast of partial sums is not the cast of their sum under a narrower compute dtype (each part
# rounded), and a norm's upcast would otherwise hold its own reduction apart from the value it casts
# (the residual stream then left partial, full-size on every rank): the value is reduced first.
register(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
         aten.type_as.default)(pointwise("none"))
register(aten.add.Tensor, aten.sub.Tensor)(pointwise("add"))
register(aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)(pointwise("mul"))
register(
    aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default, aten.abs.default,
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.erf.default, aten.reciprocal.default, aten.square.default, aten.sin.default, aten.cos.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.bitwise_not.default,
    aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.clamp.default,
    aten.clamp_min.default, aten.clamp_max.default, aten.maximum.default, aten.minimum.default,
    aten.dropout.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.log1p.default, aten.expm1.default,
    # composites no DTensor strategy places (their decompositions return a buffer beside the value,
    # or branch): element-wise all the same
    aten.log_sigmoid.default, aten.hardswish.default,
)(pointwise("none"))


@register(aten.glu.default)
def glu_rule(view: OpView) -> Decision:
    """``glu(x, dim)``: the first half of ``dim`` times the sigmoid of the second, element-wise
    otherwise: a shard on another dim keeps; a shard on ``dim`` (its halves on different ranks) or a
    partial sum (the product is not linear) is made whole."""
    p = view.placements[0]
    dim = norm_dim(view.arg(1, -1), len(view.shapes[0]))
    if is_shard(p) and p.dim != dim:
        return Decision((p,), p)
    return Decision((R,), R)


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
def new_filled_rule(view: OpView) -> Decision:
    """``x.new_zeros(shape)``: made from ``x``'s dtype and device only, its values never read -- so
    ``x`` stays as it is (no gather). Of ``x``'s own shape (transformers' ``shift_tokens_right``) it
    takes ``x``'s shard, each rank making its piece (localize writes the local shape); of another
    shape it is whole."""
    p = view.placements[0]
    if is_shard(p) and tuple(view.out_shape or ()) == tuple(view.shapes[0]):
        return Decision((p,), p)
    return Decision((p,), R)


# ---------------------------------------------------------------- reductions

def _reduced_dims(view: OpView, dims_index: int = 1) -> tuple[list[int], bool]:
    ndim = len(view.shapes[0])
    dims = view.arg(dims_index)
    if dims is None or dims == []:
        dims = list(range(ndim))
    elif isinstance(dims, int):
        dims = [dims]
    keepdim = bool(view.arg(dims_index + 1, False))
    return sorted(norm_dim(d, ndim) for d in dims), keepdim


def _after_reduction(dim: int, reduced: list[int], keepdim: bool) -> int:
    return dim if keepdim else dim - sum(1 for r in reduced if r < dim)


def reduction(kind: str) -> Rule:
    """sum/mean/amax over some dims. Sum over a sharded dim gives Partial(sum), amax Partial(max).
    A mean over a sharded dim never reaches here: the propagation pass expands it to sum / N."""

    def rule(view: OpView) -> Decision:
        p = view.placements[0]
        reduced, keepdim = (list(range(len(view.shapes[0]))), False) if _no_dims(view) else _reduced_dims(view)
        if is_partial(p, "sum") and kind in ("sum", "mean"):
            return keep(view, p)
        if isinstance(p, Partial):
            p = R
        if is_shard(p):
            if p.dim in reduced:
                if kind == "mean":
                    raise ShardingError("mean over a sharded dim must be expanded to sum / count first")
                return Decision((p,), Partial("max") if kind == "amax" else P_SUM)
            return Decision((p,), Shard(_after_reduction(p.dim, reduced, keepdim)))
        return Decision((R,), R)

    return rule


def _no_dims(view: OpView) -> bool:
    return view.node.target in (aten.sum.default, aten.mean.default)


register(aten.sum.default, aten.sum.dim_IntList)(reduction("sum"))


@register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero_rule(view: OpView) -> Decision:
    """A count over a sharded dim is a partial sum of the pieces' counts; a partial input is not
    (the count of a sum is no sum of counts): gathered."""
    p = view.placements[0]
    if isinstance(p, Partial) or not is_shard(p):
        return Decision((R,), R)
    reduced, _ = _reduced_dims(view)
    if p.dim in reduced:
        return Decision((p,), P_SUM)
    return Decision((p,), Shard(_after_reduction(p.dim, reduced, False)))
register(aten.mean.default, aten.mean.dim)(reduction("mean"))
register(aten.amax.default)(reduction("amax"))


@register(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def softmax_rule(view: OpView) -> Decision:
    p = view.placements[0]
    dim = norm_dim(view.arg(1), len(view.shapes[0]))
    if isinstance(p, Partial) or is_shard(p, dim):
        return Decision((R,), R)
    return keep(view, p)


@register(aten.triu.default, aten.tril.default)
def triangle_rule(view: OpView) -> Decision:
    p = view.placements[0]
    ndim = len(view.shapes[0])
    if isinstance(p, Partial) or (is_shard(p) and p.dim >= ndim - 2):
        return Decision((R,), R)
    return keep(view, p)


# ---------------------------------------------------------------- shape ops

def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape into groups of source dims and destination dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj, a, b = [], [], 1, 1
        while True:
            if a <= b and i < len(src):
                gi.append(i); a *= src[i]; i += 1  # noqa: E702
            elif j < len(dst):
                gj.append(j); b *= dst[j]; j += 1  # noqa: E702
            else:
                break
            if a == b and (i == len(src) or src[i] != 1 or j == len(dst)) and gi and gj:
                break
        groups.append((gi, gj))
    return groups


def _resolve_shape(shape, numel: int) -> tuple[int, ...]:
    shape = list(shape)
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = numel // known if known else 0
    return tuple(shape)


def _sp_sequence(view: OpView, p: Placement) -> bool:
    """``p`` is sp's sequence shard: dim 1 of a [batch, seq, features] value (``_sequence_shard``)."""
    return view.sequence_parallel and len(view.shapes[0]) == 3 and p.dim == 1


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)
def view_rule(view: OpView) -> Decision:
    p = view.placements[0]
    if not is_shard(p):
        return keep(view, p)
    src = view.shapes[0]
    dst = view.out_shape
    for gi, gj in view_groups(src, dst):
        if p.dim not in gi:
            continue
        outer_src = next(d for d in gi if src[d] != 1)
        outer_dst = next((d for d in gj if dst[d] != 1), None)
        if p.dim != outer_src or outer_dst is None:
            if view.axis != "tp" or _sp_sequence(view, p):
                # dp/cp, and sp's sequence shard (a head tp keeps whole sees it): gather and reshape
                # whole (correct; the cross-entropy expansion looks through this gather for the common
                # [B, S, V] -> [B*S, V] flatten before a loss). A tp feature split raises: its pair
                # falls back to replicated.
                return Decision((R,), R)
            raise ShardingError(
                f"reshape {list(src)} -> {list(dst)} moves sharded dim {p.dim} (size {src[p.dim]}) inside "
                f"another dim; only the outermost dim of a merged or split group can stay sharded")
        if dst[outer_dst] % view.pieces and view.axis != "tp":
            return Decision((R,), R)  # gather and reshape whole, as above
        if dst[outer_dst] % view.pieces:
            # each of the ``pieces`` chunks a rank holds must be whole groups of the inner factors
            # (zig-zag: a rank's two chunks are not adjacent, so a group must not straddle them)
            factors = " x ".join(str(dst[d]) for d in gj)
            cut = f"{view.axis}={view.size}" + (f" in {view.pieces} zig-zag chunks" if view.order == "zigzag" else "")
            raise ShardingError(
                f"reshape {list(src)} -> {list(dst)} splits sharded dim {p.dim} (size {src[p.dim]}) into "
                f"{factors}; {cut} does not divide its outermost factor {dst[outer_dst]}",
                hint=f"use a {view.axis} size whose chunk count divides {dst[outer_dst]}")
        return Decision((p,), Shard(outer_dst))
    return keep(view, p)


@register(aten.transpose.int)
def transpose_rule(view: OpView) -> Decision:
    p = view.placements[0]
    if not is_shard(p):
        return keep(view, p)
    ndim = len(view.shapes[0])
    a, b = norm_dim(view.arg(1), ndim), norm_dim(view.arg(2), ndim)
    swap = {a: b, b: a}
    return Decision((p,), Shard(swap.get(p.dim, p.dim)))


@register(aten.t.default)
def t_rule(view: OpView) -> Decision:
    p = view.placements[0]
    return Decision((p,), Shard(1 - p.dim) if is_shard(p) and len(view.shapes[0]) == 2 else p)


@register(aten.permute.default)
def permute_rule(view: OpView) -> Decision:
    p = view.placements[0]
    if not is_shard(p):
        return keep(view, p)
    ndim = len(view.shapes[0])
    order = [norm_dim(d, ndim) for d in view.arg(1)]
    return Decision((p,), Shard(order.index(p.dim)))


@register(aten.unsqueeze.default)
def unsqueeze_rule(view: OpView) -> Decision:
    p = view.placements[0]
    if not is_shard(p):
        return keep(view, p)
    d = norm_dim(view.arg(1), len(view.shapes[0]) + 1)
    return Decision((p,), Shard(p.dim + 1 if p.dim >= d else p.dim))


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(view: OpView) -> Decision:
    p = view.placements[0]
    if not is_shard(p):
        return keep(view, p)
    src, out = view.shapes[0], view.out_shape
    dims = view.arg(1)
    dims = list(range(len(src))) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    dims = [norm_dim(d, len(src)) for d in dims]
    if p.dim in dims and src[p.dim] == view.pieces:
        return Decision((R,), R)  # the local piece has size 1 there: squeezing it locally would drop it
    removed = [d for d in dims if src[d] == 1]
    return Decision((p,), Shard(p.dim - sum(1 for r in removed if r < p.dim)))


@register(aten.expand.default)
def expand_rule(view: OpView) -> Decision:
    p = view.placements[0]
    if not is_shard(p):
        return Decision((R,), R) if isinstance(p, Partial) else keep(view, p)
    offset = len(view.out_shape) - len(view.shapes[0])
    if view.shapes[0][p.dim] != view.out_shape[p.dim + offset]:
        return Decision((R,), R)
    return Decision((p,), Shard(p.dim + offset))


def _dim_arg_rule(dim_index: int, removes_dim: bool = False) -> Rule:
    """Ops that cut along one dim (slice, select, chunk, split, unbind, narrow): that dim must be
    whole — unless the cut keeps all of it (``x[:, 0:]``, as Hugging Face models write)."""

    def rule(view: OpView) -> Decision:
        p = view.placements[0]
        ndim = len(view.shapes[0])
        dim = norm_dim(view.arg(dim_index, 0), ndim)
        if view.out_shape == view.shapes[0] and view.node.target == aten.slice.Tensor:
            return Decision(view.placements, p)  # a slice that keeps everything
        if is_shard(p, dim) and _strided_locally(view, dim):
            return Decision(view.placements, p)  # every other row of each piece: the same rows
        if is_shard(p, dim):
            return Decision((R,) + tuple(R for _ in view.placements[1:]), R)
        if removes_dim and is_shard(p) and p.dim > dim:
            return Decision(view.placements, Shard(p.dim - 1))
        return Decision(view.placements, p)

    return rule


def _strided_locally(view: OpView, dim: int) -> bool:
    """``x[start::step]`` along a split dim whose pieces each hold a whole number of strides, with the
    start inside the first: each rank's slice of its piece is its piece of the global slice (pairs
    interleaved in the batch, ``logps[0::2]`` / ``logps[1::2]``, stay with their rank)."""
    if view.node.target != aten.slice.Tensor:
        return False
    size = view.shapes[0][dim]
    start, end, step = view.arg(2, None), view.arg(3, None), view.arg(4, 1)
    start = 0 if start is None else start
    return (isinstance(step, int) and step > 1 and size % view.pieces == 0 and (size // view.pieces) % step == 0
            and isinstance(start, int) and 0 <= start < step and (end is None or end >= size))


register(aten.slice.Tensor)(_dim_arg_rule(1))
register(aten.narrow.default)(_dim_arg_rule(1))
register(aten.select.int)(_dim_arg_rule(1, removes_dim=True))
register(aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default)(_dim_arg_rule(2))
register(aten.unbind.int)(_dim_arg_rule(1, removes_dim=True))


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(view: OpView) -> Decision:
    """pad(x, [left_last, right_last, left_prev, ...]): a padded dim must be whole; others keep."""
    p = view.placements[0]
    ndim = len(view.shapes[0])
    padded = {ndim - 1 - i // 2 for i, amount in enumerate(view.arg(1)) if amount}
    if isinstance(p, Partial) or (is_shard(p) and p.dim in padded):
        return Decision((R,), R)
    return keep(view, p)


@register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(view: OpView) -> Decision:
    """Repeating elements in place keeps chunk r of the input as chunk r of the output (GQA's
    key/value heads stay aligned with the query heads of the same rank). Without a dim the input
    is flattened first: only a 1-d input keeps its shards then."""
    p = view.placements[0]
    if view.arg(2) is None and len(view.shapes[0]) != 1 and not isinstance(p, Replicate):
        return Decision((R,), R)
    return keep(view, p)


@register(aten.cat.default, aten.stack.default)
def cat_rule(view: OpView) -> Decision:
    ndim = len(view.out_shape)
    stacked = view.node.target == aten.stack.default
    skipped = [] if stacked else [i for i, shape in enumerate(view.shapes) if _legacy_empty(shape, ndim)]
    if skipped and len(skipped) < len(view.shapes):
        # torch.cat skips a 1-d empty piece next to wider ones (an empty cache's first update):
        # it stays whole, the others decide
        rest = [i for i in range(len(view.shapes)) if i not in skipped]
        kept = cat_rule(replace(view, placements=tuple(view.placements[i] for i in rest),
                                shapes=tuple(view.shapes[i] for i in rest)))
        inputs = dict(zip(rest, kept.inputs))
        return Decision(tuple(inputs.get(i, R) for i in range(len(view.shapes))), kept.output)
    ps = view.placements
    dim = norm_dim(view.arg(1, 0), ndim)
    ps = ps if stacked else _whole_pieces_sliced(view, ps, dim)
    first = ps[0]
    same = all(p == first for p in ps)
    if not same or (is_shard(first) and (first.dim == dim and not stacked)) or is_partial(first, "max"):
        return Decision(tuple(R for _ in ps), R)
    if is_shard(first) and stacked and first.dim >= dim:
        return Decision(ps, Shard(first.dim + 1))
    return Decision(ps, first)


def _legacy_empty(shape: tuple[int, ...], ndim: int) -> bool:
    """A piece torch.cat leaves out: 1-d with no elements, among pieces of more dims."""
    return ndim > 1 and tuple(shape) == (0,)


def _whole_pieces_sliced(view: OpView, ps: tuple, dim: int) -> tuple:
    """cat of a batch-sharded piece and a whole one along another dim (ViT's class token, expanded
    to the batch, before the patches): the whole piece is sliced like the other (free) instead of
    gathering the batch."""
    shard = next((p for p in ps if is_shard(p) and p.dim != dim), None)
    if shard is None or not all(p == R or p == shard for p in ps):
        return ps
    return tuple(shard for _ in ps)


@register(operator.getitem)
def getitem_rule(view: OpView) -> Decision:
    return keep(view, view.placements[0])


# ---------------------------------------------------------------- matmuls

@register(aten.linear.default)
def linear_rule(view: OpView) -> Decision:
    """Megatron column-/row-parallel linear (Shoeybi et al. 2019), and plain batch sharding.

    W is [out, in]. W Shard(0): column-parallel, output sharded on features, input must be whole.
    W Shard(1): row-parallel, input sharded on features, output a partial sum (the bias, if any,
    was split off by the propagation pass so it is added once, after the reduction).
    """
    px, pw = view.placements[0], view.placements[1]
    pb = view.placements[2:]
    last = len(view.shapes[0]) - 1
    if is_shard(pw, 0):
        return Decision((R, pw) + tuple(Shard(0) for _ in pb), Shard(last))
    if is_shard(pw, 1):
        if pb:
            raise ShardingError("row-parallel linear with a bias must be split into linear + add first")
        return Decision((Shard(last), pw), P_SUM)
    if is_partial(px, "sum") and not pb:
        return Decision((px, R), px)
    if is_shard(px) and px.dim != last:
        return Decision((px, R) + tuple(R for _ in pb), px)
    return Decision((R, R) + tuple(R for _ in pb), R)


@register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul_rule(view: OpView) -> Decision:
    """[..., M, K] @ [..., K, N]: batch dims pass through, M and N shard the output, K gives a partial."""
    pa, pb = view.placements
    ra, rb = len(view.shapes[0]), len(view.shapes[1])
    out = len(view.out_shape)
    if ra < 2 or rb < 2:  # a vector operand drops a dim the cases below count on
        return Decision((R, R), R)
    if is_shard(pa, ra - 1) and is_shard(pb, rb - 2):
        return Decision((pa, pb), P_SUM)
    if is_shard(pa) and pa.dim == ra - 2 and not isinstance(pb, (Shard, Partial)):
        return Decision((pa, R), Shard(out - 2))
    if is_shard(pb) and pb.dim == rb - 1 and not isinstance(pa, (Shard, Partial)):
        return Decision((R, pb), Shard(out - 1))
    if is_shard(pa) and pa.dim < ra - 2 and (pb == pa or rb == 2):
        return Decision((pa, pb if rb > 2 else R), Shard(pa.dim + out - ra))
    if is_partial(pa, "sum") and pb == R:
        return Decision((pa, R), pa)
    if is_partial(pb, "sum") and pa == R:
        return Decision((R, pb), pb)
    return Decision((R, R), R)


@register(aten.addmm.default)
def addmm_rule(view: OpView) -> Decision:
    """bias + mat1 @ mat2 (Hugging Face's Conv1D): the product's rule, with the bias following the
    output's columns; a partial product would add the bias on every rank, so it is reduced first."""
    bias_shape, shapes = view.shapes[0], view.shapes[1:]
    product = matmul_rule(OpView(view.node, view.placements[1:], shapes, view.out_shape, view.axis, view.size))
    if isinstance(product.output, Partial):
        return Decision((R, R, R), R)
    cols = is_shard(product.output, 1) and len(bias_shape) >= 1 and bias_shape[-1] == view.out_shape[-1]
    rows = is_shard(product.output, 0) and len(bias_shape) == 2 and bias_shape[0] == view.out_shape[0]
    bias = Shard(len(bias_shape) - 1) if cols else Shard(0) if rows else R
    return Decision((bias,) + product.inputs, product.output)


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(view: OpView) -> Decision:
    """q, k, v are [B, H, S, D]: batch or heads may be sharded (the same on all three); an optional
    attention mask follows by broadcasting. Sequence sharding is context parallelism (not here)."""
    q, k, v = view.placements[:3]
    rank = len(view.shapes[0])  # [..., S, D]: every dim before the sequence is a batch dim
    if len({len(s) for s in view.shapes[:3]}) > 1:  # q, k, v broadcast against each other
        return all_replicated(view)
    if any(is_shard(p, rank - 1) for p in (q, k, v)):
        err = ShardingError(f"attention inputs are split on the head dimension: {view.axis}={view.size} does "
                            "not divide the number of (key/value) heads",
                            hint=f"use a {view.axis} size that divides the heads and the key/value heads")
        err.bad_args = tuple(i for i, p in enumerate((q, k, v)) if is_shard(p, rank - 1))
        raise err
    dim = next((p.dim for p in (q, k, v) if is_shard(p) and p.dim < rank - 2), None)
    qkv = (Shard(dim),) * 3 if dim is not None else (R, R, R)
    mask = []
    for shape in view.shapes[3:]:
        d = None if dim is None else dim - (rank - len(shape))
        mask.append(Shard(d) if d is not None and d >= 0 and shape[d] == view.out_shape[dim] else R)
    return Decision(qkv + tuple(mask), Shard(dim) if dim is not None else R)


@register(aten.layer_norm.default)
def layer_norm_rule(view: OpView) -> Decision:
    x = view.placements[0]
    normalized = len(view.arg(1))
    ndim = len(view.shapes[0])
    if isinstance(x, Partial) or (is_shard(x) and x.dim >= ndim - normalized):
        x = R
    return Decision((x,) + tuple(R for _ in view.placements[1:]), x)


@register(aten.embedding.default)
def embedding_rule(view: OpView) -> Decision:
    """W [V, H] replicated: the output follows the ids. W sharded on H: output sharded on features.
    W sharded on the vocab is vocab parallelism, expanded by the propagation pass before this."""
    pw, pi = view.placements[:2]
    out_rank = len(view.out_shape)
    if is_shard(pw, 1):
        return Decision((pw, R), Shard(out_rank - 1))
    if is_shard(pw, 0):
        raise ShardingError("vocab-parallel embedding must be expanded first")
    ids = R if isinstance(pi, Partial) else pi
    if view.arg(3) and is_shard(ids):  # scale_grad_by_freq counts ids over the whole batch
        ids = R
    return Decision((R, ids), ids)


@register(aten.gather.default)
def gather_rule(view: OpView) -> Decision:
    px, pi = view.placements[:2]
    dim = norm_dim(view.arg(1), len(view.shapes[0]))
    if is_shard(px, dim):
        raise ShardingError("gather along a sharded dim must be expanded first")
    return index_decision(px, pi, dim, view.shapes[0], view.shapes[1])


def index_decision(px: Placement, pi: Placement, dim: int, x_shape, index_shape) -> Decision:
    """gather-like ops (out[.., i, ..] = x[.., index[.., i, ..], ..] along ``dim``), by the layout of
    each operand: indices split along ``dim`` (a batch of ids) pick from the whole source; a split
    along another dim needs the source split the same way, which only lines up when both have the
    same size there; a source's partial sum passes through (the op is linear in it)."""
    if is_partial(px, "sum") and pi == R:
        return Decision((px, R), px)
    d = pi.dim if is_shard(pi) else px.dim if is_shard(px) else None
    if d == dim:
        return Decision((R, pi), pi)
    if d is not None and d < min(len(x_shape), len(index_shape)) and x_shape[d] == index_shape[d]:
        return Decision((Shard(d), Shard(d)), Shard(d))
    return Decision((R, R), R)


@register(aten.take_along_dim.default)
def take_along_dim_rule(view: OpView) -> Decision:
    """gather with broadcasting; without a dim both operands are flattened (kept whole)."""
    dim = view.arg(2)
    if dim is None or len(view.shapes[0]) != len(view.shapes[1]):
        return all_replicated(view)
    px, pi = view.placements[:2]
    dim = norm_dim(dim, len(view.shapes[0]))
    if is_shard(px, dim) or isinstance(pi, Partial):
        return all_replicated(view)
    return index_decision(px, pi, dim, view.shapes[0], view.shapes[1])


@register(aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter.reduce,
          aten.scatter.value_reduce, aten.scatter_reduce.two)
def scatter_rule(view: OpView) -> Decision:
    """out = x with src written at index along ``dim``: split along another dim, all of x, index
    and src split alike (same size there) keep the split; ids split along ``dim`` write rows of a
    whole x that another rank writes too, so everything is kept whole."""
    dim = norm_dim(view.arg(1), len(view.shapes[0]))
    d = next((p.dim for p in view.placements if is_shard(p) and p.dim != dim), None)
    rank = len(view.shapes[0])
    same = d is not None and all(len(s) == rank and s[d] == view.shapes[0][d] for s in view.shapes)
    if same and not any(isinstance(p, Partial) for p in view.placements):
        return Decision((Shard(d),) * len(view.placements), Shard(d))
    return all_replicated(view)


@register(aten.index_select.default)
def index_select_rule(view: OpView) -> Decision:
    """index_select(x, dim, ids): ids split -> rows of the output split, from the whole source;
    the source split on another dim keeps that split."""
    px, pi = view.placements[:2]
    dim = norm_dim(view.arg(1), len(view.shapes[0]))
    if is_shard(pi):
        return Decision((R, pi), Shard(dim))
    if is_partial(px, "sum") or (is_shard(px) and px.dim != dim):
        return Decision((px, R), px)
    return Decision((R, R), R)


# ---------------------------------------------------------------- usc's own local ops

def _module(view: OpView):
    return view.node.graph.owning_module.get_submodule(view.node.target)


@register(VocabParallelEmbedding)
def vocab_embedding_rule(view: OpView) -> Decision:
    """On its own axis: the weight holds a vocab slice, ids are whole, output rows are partial sums."""
    if view.axis == _module(view).axis:
        return Decision((Shard(0), R), P_SUM)
    return embedding_rule(view)


@register(ShardedGather)
def sharded_gather_rule(view: OpView) -> Decision:
    module = _module(view)
    if view.axis == module.axis:
        return Decision((Shard(module.dim), R), P_SUM)
    px, pi = view.placements
    if is_shard(px, module.dim):
        return Decision((R, pi), pi) if is_shard(pi) else Decision((R, R), R)
    return index_decision(px, pi, module.dim, view.shapes[0], view.shapes[1])


@register(RingAttention)
def ring_attention_rule(view: OpView) -> Decision:
    """On its own axis q, k, v and the output are sequence shards, and an explicit mask holds this
    rank's query rows (whole when it broadcasts one row) over all keys; elsewhere it is attention."""
    if view.axis == _module(view).axis:
        mask = tuple(_mask_rows(shape, view.shapes[0][2]) for shape in view.shapes[3:])
        return Decision((Shard(2),) * 3 + mask, Shard(2))
    return sdpa_rule(view)


def _mask_rows(shape: tuple[int, ...], seq: int) -> Placement:
    rows = len(shape) - 2
    return Shard(rows) if rows >= 0 and shape[rows] == seq and seq > 1 else R


@register(AllToAll)
def all_to_all_rule(view: OpView) -> Decision:
    module = _module(view)
    if view.axis == module.axis:
        return Decision((Shard(module.from_dim),), Shard(module.to_dim))
    if module.whole_elsewhere and is_shard(view.placements[0], module.from_dim):
        return Decision((R,), R)
    return keep(view, view.placements[0])

