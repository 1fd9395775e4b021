"""Samples the OpInfo database does not reach: overloads its ops never dispatch to (``add.Scalar``,
``_softmax``, ``_to_copy``), and the layouts models give usc (a [batch, seq, hidden] activation, a
batch of ids for a gather, logits [N, C, S]). Sizes are divisible by 2, 3 and 5 where a dim may be
sharded, and otherwise odd."""

from __future__ import annotations

import torch

aten = torch.ops.aten
F64 = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _ids(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


A = (6, 10, 7)  # batch, seq, hidden

# op -> [(function of the tensors, tensors)]
EXTRA: dict = {
    aten._softmax.default: [(lambda x: aten._softmax.default(x, 1, False), (_x(*A),)),
                            (lambda x: aten._softmax.default(x, -1, False), (_x(*A),))],
    aten._log_softmax.default: [(lambda x: aten._log_softmax.default(x, 2, False), (_x(*A),))],
    aten._to_copy.default: [(lambda x: aten._to_copy.default(x, dtype=torch.int32), (_x(*A) * 4,)),
                            (lambda x: aten._to_copy.default(x, dtype=torch.bool), (_x(*A).relu(),)),
                            (lambda x: aten._to_copy.default(x, dtype=torch.float32), (_x(*A),))],
    aten.to.dtype_layout: [(lambda x: aten.to.dtype_layout(x, dtype=torch.int64), (_x(*A) * 3,))],
    aten.type_as.default: [(lambda x, y: aten.type_as.default(x, y), (_x(*A) * 3, _ids(5, *A)))],
    aten.alias.default: [(lambda x: aten.alias.default(x), (_x(*A),))],
    aten.lift_fresh_copy.default: [(lambda x: aten.lift_fresh_copy.default(x), (_x(*A),))],
    aten.detach.default: [(lambda x: aten.detach.default(x), (_x(*A),))],
    aten.contiguous.default: [(lambda x: aten.contiguous.default(x), (_x(*A).transpose(0, 1),))],
    aten.dropout.default: [(lambda x: aten.dropout.default(x, 0.0, True), (_x(*A),)),
                           (lambda x: aten.dropout.default(x, 0.5, False), (_x(*A),))],
    aten._unsafe_view.default: [(lambda x: aten._unsafe_view.default(x, [60, 7]), (_x(*A),))],
    aten.view.default: [
        (lambda x: aten.view.default(x, [6, 5, 2, 7]), (_x(*A),)),  # seq -> groups of 2
        (lambda x: aten.view.default(x, [6, 10, 7, 1]), (_x(*A),)),
        (lambda x: aten.view.default(x, [60, 7]), (_x(*A),)),
        (lambda x: aten.view.default(x, [6, 2, 5, 7]), (_x(*A),))],
    aten.constant_pad_nd.default: [(lambda x: aten.constant_pad_nd.default(x, [1, 2]), (_x(*A),)),
                                   (lambda x: aten.constant_pad_nd.default(x, [0, 0, 1, 0]), (_x(*A),))],
    aten.clamp.default: [(lambda x: aten.clamp.default(x, -0.5, 0.5), (_x(*A),))],
    aten.clamp_min.default: [(lambda x: aten.clamp_min.default(x, 0.1), (_x(*A),))],
    aten.clamp_max.default: [(lambda x: aten.clamp_max.default(x, 0.2), (_x(*A),))],
    aten.pow.Tensor_Scalar: [(lambda x: aten.pow.Tensor_Scalar(x, 2), (_x(*A),)),
                             (lambda x: aten.pow.Tensor_Scalar(x, 3), (_x(*A),))],
    aten.count_nonzero.default: [(lambda x: aten.count_nonzero.default(x), (_x(*A).relu(),)),
                                 (lambda x: aten.count_nonzero.default(x, 1), (_x(*A).relu(),))],
    aten.count_nonzero.dim_IntList: [(lambda x: aten.count_nonzero.dim_IntList(x, [0, 2]), (_x(*A).relu(),)),
                                     (lambda x: aten.count_nonzero.dim_IntList(x, [-1]), (_x(*A).relu(),))],
    aten.amax.default: [(lambda x: aten.amax.default(x, [1]), (_x(*A),)),
                        (lambda x: aten.amax.default(x, [0], True), (_x(*A),)),
                        (lambda x: aten.amax.default(x, []), (_x(*A),))],
    aten.gather.default: [
        (lambda t, i: aten.gather.default(t, 0, i), (_x(14, 7), _ids(14, 6, 7))),  # a batch of ids
        (lambda t, i: aten.gather.default(t, 1, i), (_x(6, 11), _ids(11, 6, 4))),
        (lambda t, i: aten.gather.default(t, 1, i), (_x(6, 11, 5), _ids(11, 6, 4, 3)))],
    aten.index_select.default: [
        (lambda t, i: aten.index_select.default(t, 0, i), (_x(13, 7), _ids(13, 10))),
        (lambda t, i: aten.index_select.default(t, 1, i), (_x(6, 13), _ids(13, 10)))],
    aten.cross_entropy_loss.default: [
        (lambda x, y: aten.cross_entropy_loss.default(x, y), (_x(6, 7, 10), _ids(7, 6, 10))),  # [B, C, S]
        (lambda x, y: aten.cross_entropy_loss.default(x, y), (_x(30, 7), _ids(7, 30)))],
    aten.repeat_interleave.self_int: [(lambda x: aten.repeat_interleave.self_int(x, 2), (_x(6, 10),)),
                                      (lambda x: aten.repeat_interleave.self_int(x, 3, 1), (_x(*A),))],
    aten.matmul.default: [(lambda a, b: aten.matmul.default(a, b), (_x(6, 10, 7), _x(7, 4))),
                          (lambda a, b: aten.matmul.default(a, b), (_x(6, 10, 7), _x(6, 7, 5)))],
}


def _with_scalar(op):
    return lambda x: op(x, 0.25)


for name in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge"):
    EXTRA[getattr(aten, name).Scalar] = [(_with_scalar(getattr(aten, name).Scalar), (_x(*A),))]
EXTRA[aten.rsub.Scalar] = [(lambda x: aten.rsub.Scalar(x, 0.25), (_x(*A),))]
EXTRA[aten.relu.default] = [(lambda x: aten.relu.default(x), (_x(*A),))]
EXTRA[aten.triu.default] = [(lambda x: aten.triu.default(x), (_x(6, 10, 10),))]
EXTRA[aten.tril.default] = [(lambda x: aten.tril.default(x, -1), (_x(6, 10, 10),))]
EXTRA[aten.softmax.int] = [(lambda x: aten.softmax.int(x, 1), (_x(*A),))]
EXTRA[aten.log_softmax.int] = [(lambda x: aten.log_softmax.int(x, -1), (_x(*A),))]
EXTRA[aten.maximum.default] = [(lambda a, b: aten.maximum.default(a, b), (_x(*A), _x(*A, seed=1)))]
EXTRA[aten.minimum.default] = [(lambda a, b: aten.minimum.default(a, b), (_x(*A), _x(10, 7, seed=1)))]
EXTRA[aten.where.self] = [(lambda c, a, b: aten.where.self(c, a, b), (_x(*A) > 0, _x(*A), _x(7)))]
EXTRA[aten.masked_fill.Scalar] = [(lambda x, m: aten.masked_fill.Scalar(x, m, -1.5), (_x(*A), _x(10, 1) > 0))]
EXTRA[aten.eq.Tensor] = [(lambda a, b: aten.eq.Tensor(a, b), (_ids(3, *A), _ids(3, *A, seed=1)))]
EXTRA[aten.expand.default] = [(lambda x: aten.expand.default(x, [6, 10, 7]), (_x(10, 1),)),
                              (lambda x: aten.expand.default(x, [4, 6, 10]), (_x(6, 10),))]
EXTRA[aten.zeros_like.default] = [(lambda x: aten.zeros_like.default(x), (_x(*A),))]
EXTRA[aten.ones_like.default] = [(lambda x: aten.ones_like.default(x), (_x(*A),))]
EXTRA[aten.full_like.default] = [(lambda x: aten.full_like.default(x, 2.5), (_x(*A),))]
EXTRA[aten.embedding.default] = [(lambda w, i: aten.embedding.default(w, i), (_x(13, 10), _ids(13, 6, 10)))]
EXTRA[aten.linear.default] = [(lambda x, w, b: aten.linear.default(x, w, b), (_x(*A), _x(10, 7), _x(10))),
                              (lambda x, w: aten.linear.default(x, w), (_x(*A), _x(10, 7)))]
EXTRA[aten.layer_norm.default] = [(lambda x, w, b: aten.layer_norm.default(x, [7], w, b), (_x(*A), _x(7), _x(7)))]
EXTRA[aten.logical_and.default] = [(lambda a, b: aten.logical_and.default(a, b), (_x(*A) > 0, _x(*A) < 0.5))]
EXTRA[aten.slice.Tensor] = [(lambda x: aten.slice.Tensor(x, 1, 0, None, 2), (_x(*A),)),  # x[:, ::2]
                            (lambda x: aten.slice.Tensor(x, 1, 1), (_x(*A),)),
                            # every other row from the second, rows a multiple of 2, 3 and 6
                            (lambda x: aten.slice.Tensor(x, 0, 1, None, 2), (_x(12, 5),)),
                            (lambda x: aten.slice.Tensor(x, 0, 0, None, 3), (_x(12, 5),))]
EXTRA[aten.sum.dim_IntList] = [(lambda x: aten.sum.dim_IntList(x, [1]), (_x(*A),))]
EXTRA[aten.mean.dim] = [(lambda x: aten.mean.dim(x, [1], True), (_x(*A),))]
EXTRA[aten.scaled_dot_product_attention.default] = [
    (lambda q, k, v: aten.scaled_dot_product_attention.default(q, k, v, is_causal=True),
     (_x(2, 6, 10, 4), _x(2, 6, 10, 4, seed=1), _x(2, 6, 10, 4, seed=2)))]
EXTRA[aten.fill.Tensor] = [(lambda x, v: aten.fill.Tensor(x, v), (_x(*A), _x(1).squeeze(0)))]


def _probabilities(*shape, seed=0):
    return torch.rand(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * 0.9 + 0.05


def _loss_samples(reduction: int) -> dict:
    """op -> (function of the tensors, tensors) for one reduction (closures: the tracer takes every
    parameter of the function as an input)."""
    two = (_x(*A), _x(*A, seed=1))

    def binary(op):
        return lambda a, b: op(a, b, reduction)

    out = {op: (binary(op), two) for op in (aten.mse_loss.default, aten.l1_loss.default,
                                            aten.soft_margin_loss.default)}
    out[aten.smooth_l1_loss.default] = (lambda a, b: aten.smooth_l1_loss.default(a, b, reduction, 0.5), two)
    out[aten.huber_loss.default] = (lambda a, b: aten.huber_loss.default(a, b, reduction, 0.7), two)
    out[aten.kl_div.default] = (lambda a, b: aten.kl_div.default(a, b, reduction, True), two)
    out[aten.binary_cross_entropy.default] = (
        lambda p, y, w: aten.binary_cross_entropy.default(p, y, w, reduction),
        (_probabilities(*A), _probabilities(*A, seed=1), _x(7, seed=2).abs()))
    out[aten.binary_cross_entropy_with_logits.default] = (  # weight [S, 1], pos_weight [H]
        lambda x, y, w, pw: aten.binary_cross_entropy_with_logits.default(x, y, w, pw, reduction),
        (_x(*A), _probabilities(*A, seed=1), _x(10, 1, seed=2).abs(), _x(7, seed=3).abs()))
    out[aten.margin_ranking_loss.default] = (
        lambda a, b, y: aten.margin_ranking_loss.default(a, b, y, 0.1, reduction), (*two, _signs(*A, seed=2)))
    out[aten.hinge_embedding_loss.default] = (
        lambda x, y: aten.hinge_embedding_loss.default(x, y, 1.0, reduction), (_x(*A), _signs(*A, seed=1)))
    out[aten.poisson_nll_loss.default] = (
        lambda x, t: aten.poisson_nll_loss.default(x, t, True, False, 1e-8, reduction), (_x(*A), _x(*A, seed=1).abs()))
    # rows [N, D]: a sample's features reduced to one value
    rows = (_x(*ROWS), _x(*ROWS, seed=1))
    out[aten.cosine_embedding_loss.default] = (
        lambda a, b, y: aten.cosine_embedding_loss.default(a, b, y, 0.1, reduction), (*rows, _signs(ROWS[0], seed=2)))
    out[aten.triplet_margin_loss.default] = (
        lambda a, p, n: aten.triplet_margin_loss.default(a, p, n, 1.0, 2.0, 1e-6, False, reduction),
        (*rows, _x(*ROWS, seed=2)))
    out[aten.multi_margin_loss.default] = (
        lambda x, y: aten.multi_margin_loss.default(x, y, 1, 1.0, None, reduction),
        (_x(*ROWS), torch.randint(0, ROWS[1], (ROWS[0],), generator=torch.Generator().manual_seed(3))))
    labels = torch.full(ROWS, -1, dtype=torch.int64)  # each row's classes, then -1 ends the list
    labels[:, :2] = torch.randint(0, ROWS[1], (ROWS[0], 2), generator=torch.Generator().manual_seed(4))
    out[aten.multilabel_margin_loss.default] = (
        lambda x, y: aten.multilabel_margin_loss.default(x, y, reduction), (_x(*ROWS), labels))
    return out


ROWS = (10, 7)


def _signs(*shape, seed=0):
    return (_x(*shape, seed=seed) > 0).to(F64) * 2 - 1


def _weighted_margin_sample(reduction: int):
    """multi_margin with class weights as many as the rows: a rule that read rows by their size would
    split the weights too."""
    return (lambda x, y, w: aten.multi_margin_loss.default(x, y, 1, 1.0, w, reduction),
            (_x(6, 6), torch.randint(0, 6, (6,), generator=torch.Generator().manual_seed(5)), _x(6, seed=6).abs()))


# the loss ops: per element (reduction none: 0) and reduced (mean: 1, sum: 2), on [batch, seq, hidden]
for _reduction in (0, 1, 2):
    for _op, _sample in _loss_samples(_reduction).items():
        EXTRA.setdefault(_op, []).append(_sample)
    EXTRA[aten.multi_margin_loss.default].append(_weighted_margin_sample(_reduction))
