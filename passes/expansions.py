"""Expansions: ops whose sharded form is not the same op run on local pieces.

Each expansion replaces one node by a few nodes that compute exactly the same global value and
whose every piece has an ordinary sharding rule. The propagation pass calls an expansion before
the op's rule and places the new nodes one by one. An expansion returns None when the node's
layouts do not need it (the op then goes through its rule unchanged).

Table: ``EXPANSIONS[op] = expand(ctx, node) -> list[new nodes] | None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from usc.compiler.errors import CompileError
from usc.compiler.ir import META, MeshSpec, NodeAnn
from usc.compiler.trace import module_path, user_source
from usc.runtime.collectives import AllGather, AllReduce, AllToAll, LocalShard, ReduceScatter
from usc.runtime.op_classes import RESHAPES
from usc.runtime.ring_attention import RingAttention
from usc.runtime.vocab import ShardedGather, VocabParallelEmbedding

from .attention_masks import sdpa_args
from .graph_edit import GraphEditor, shape_of
from .sharding_rules import REDUCED_LOSSES, loss_reduction

aten = torch.ops.aten


@dataclass
class ExpansionContext:
    gm: fx.GraphModule
    mesh: MeshSpec
    editor: GraphEditor
    cp_mode: str = "ring"
    microbatches: int = 1
    capacity_factor: float | None = None  # MoE expert capacity (expert_parallel)


EXPANSIONS: dict = {}


def register(*ops):
    def wrap(fn):
        for op in ops:
            EXPANSIONS[op] = fn
        return fn
    return wrap


def _layout(node: fx.Node):
    return node.meta[META].layout


def _sharded_axes(node: fx.Node, dim: int | None = None) -> list[int]:
    return [i for i, p in enumerate(_layout(node).placements)
            if isinstance(p, Shard) and (dim is None or p.dim == dim)]


class _Builder:
    """Emits nodes before ``node`` with a blank annotation (propagation fills it in)."""

    def __init__(self, ctx: ExpansionContext, node: fx.Node) -> None:
        self.ctx, self.node, self.created = ctx, node, []

    def _ann(self) -> NodeAnn:
        return NodeAnn(layout=None, module=module_path(self.node), source=user_source(self.node))

    def call(self, target, *args, **kwargs) -> fx.Node:
        new = self.ctx.editor.call_function(self.node, target, args, kwargs, ann=self._ann())
        self._inherit(new)
        return new

    def module(self, module, *args, stem: str) -> fx.Node:
        new = self.ctx.editor.call_module(self.node, module, args, ann=self._ann(), stem=stem)
        self._inherit(new)
        return new

    def _inherit(self, new: fx.Node) -> None:
        for key in ("nn_module_stack", "stack_trace", "usc_source"):
            if key in self.node.meta:
                new.meta[key] = self.node.meta[key]
        self.created.append(new)

    def finish(self, result: fx.Node) -> list[fx.Node]:
        result.meta.setdefault("usc_replaces", self.node.name)  # what a reader of the original graph knew it as
        self.node.replace_all_uses_with(result)
        self.ctx.gm.graph.erase_node(self.node)
        return self.created


@register(aten.embedding.default)
def vocab_parallel_embedding(ctx: ExpansionContext, node: fx.Node):
    """Megatron vocab-parallel embedding: rows outside this rank's slice give zeros; the outputs
    are partial sums that the propagation pass all-reduces where a consumer needs them whole."""
    weight, ids = node.args[0], node.args[1]
    _check_embedding_options(ctx, node)
    axes = _sharded_axes(weight, 0)
    if not axes:
        return None
    if len(axes) > 1:
        raise CompileError(f"embedding '{module_path(node)}' is vocab-sharded on several mesh axes; use one")
    padding_idx = node.args[2] if len(node.args) > 2 else -1
    b = _Builder(ctx, node)
    out = b.module(VocabParallelEmbedding(ctx.mesh.axes[axes[0]], padding_idx), weight, ids, stem="vocab_embedding")
    return b.finish(out)


def _embedding_options(node: fx.Node) -> dict:
    names = ["weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse"]
    values = dict(zip(names, [None, None, -1, False, False]))
    values.update(zip(names, node.args))
    values.update(node.kwargs)
    return values


def _check_embedding_options(ctx: ExpansionContext, node: fx.Node) -> None:
    """padding_idx is exact on every layout (the local lookup keeps the padding row's gradient at
    zero, and the vocab-parallel one passes it on). scale_grad_by_freq divides each row's gradient
    by its id's count in the batch: exact only where every rank sees the whole batch at once.
    sparse gradients are not what the gradient reducer, ZeRO or the optimizer shards take."""
    options = _embedding_options(node)
    where = module_path(node) or "<root>"
    split = [ctx.mesh.axes[i] for i in _sharded_axes(options["indices"])] + \
        [ctx.mesh.axes[i] for i in _sharded_axes(options["weight"], 0)]
    if options["scale_grad_by_freq"] and (split or ctx.microbatches > 1):
        by = ", ".join(f"{a}={ctx.mesh.size(a)}" for a in split) or f"mb={ctx.microbatches}"
        raise CompileError(f"embedding '{where}': scale_grad_by_freq counts each id over the whole batch, but "
                           f"under {by} each rank sees only part of the ids (or of the vocabulary); drop "
                           "scale_grad_by_freq, or keep the batch and the table whole (dp=1 cp=1 mb=1, no vocab split)")
    if options["sparse"] and any(size > 1 for size in ctx.mesh.shape):
        raise CompileError(f"embedding '{where}': sparse=True gives a sparse gradient, which usc's gradient "
                           f"reduction and sharded optimizers do not take; use sparse=False (the default)")


UNSUPPORTED = {
    aten.embedding_renorm_.default: (
        "max_norm renormalises the embedding rows in place during forward, which a compiled step does not "
        "replay", "drop max_norm, or renormalise the weight yourself under torch.no_grad() between steps"),
}


def refuse_unsupported(gm: fx.GraphModule) -> None:
    """Ops usc cannot run as written, refused by name before they are silently dropped (an in-place
    op whose result nobody reads is dead code to the graph)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in UNSUPPORTED:
            why, fix = UNSUPPORTED[node.target]
            raise CompileError(f"{node.target} in module '{module_path(node) or '<root>'}': {why}; {fix}")


@register(aten.gather.default)
def sharded_gather(ctx: ExpansionContext, node: fx.Node):
    x, dim, index = node.args[0], node.args[1], node.args[2]
    dim = dim % len(shape_of(x))
    axes = _sharded_axes(x, dim)
    if not axes:
        return None
    if len(axes) > 1:
        raise CompileError(f"gather in '{module_path(node)}' along a dim sharded on several mesh axes")
    b = _Builder(ctx, node)
    return b.finish(b.module(ShardedGather(ctx.mesh.axes[axes[0]], dim), x, index, stem="sharded_gather"))


@register(aten.linear.default)
def split_row_parallel_bias(ctx: ExpansionContext, node: fx.Node):
    """A row-parallel linear gives partial sums; its bias must be added once, after the reduction."""
    if len(node.args) < 3 or node.args[2] is None or not _sharded_axes(node.args[1], 1):
        return None
    b = _Builder(ctx, node)
    product = b.call(aten.linear.default, node.args[0], node.args[1])
    return b.finish(b.call(aten.add.Tensor, product, node.args[2]))


@register(aten.mean.dim, aten.mean.default)
def sharded_mean(ctx: ExpansionContext, node: fx.Node):
    """mean over a sharded dim = (sum of local sums) / global count: a Partial(sum) of local sums
    divided by the *global* count, which the static shapes give."""
    x = node.args[0]
    shape = shape_of(x)
    dims = list(range(len(shape))) if node.target == aten.mean.default or not node.args[1] else \
        [d % len(shape) for d in node.args[1]]
    if not any(isinstance(p, Shard) and p.dim in dims for p in _layout(x).placements):
        return None
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    b = _Builder(ctx, node)
    total = b.call(aten.sum.dim_IntList, x, dims, keepdim)
    return b.finish(b.call(aten.div.Tensor, total, float(prod(shape[d] for d in dims))))


REDISTRIBUTIONS = (AllGather, AllReduce, AllToAll, LocalShard, ReduceScatter)


def _underlying(ctx: ExpansionContext, node: fx.Node) -> fx.Node:
    """The value before any redistribution the propagation pass inserted."""
    while node.op == "call_module" and isinstance(ctx.gm.get_submodule(node.target), REDISTRIBUTIONS):
        node = node.args[0]
    return node


def _peel_flatten(ctx: ExpansionContext, logits: fx.Node, labels: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``loss(x.view(-1, V), y.view(-1))`` is the same loss on ``x`` [..., V] and ``y`` [...]; using
    them avoids a reshape that a sequence shard cannot survive."""
    if logits.target not in RESHAPES or labels.target not in RESHAPES:
        return logits, labels
    x, y = _underlying(ctx, logits.args[0]), _underlying(ctx, labels.args[0])
    xs, ys = shape_of(x), shape_of(y)
    if xs is None or ys is None or len(xs) < 3 or tuple(xs[:-1]) != tuple(ys):
        return logits, labels
    return x, y


def _peel_shift(ctx: ExpansionContext, logits: fx.Node, labels: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
    """The causal-LM shift ``loss(x[:, :-1], y[:, 1:])`` equals ``loss(x, y shifted left with the last
    position ignored)``: the logits keep their sequence shards; only the (small) labels move.
    Returns (logits, labels, shifted?) without editing the graph."""
    if logits.target != aten.slice.Tensor or labels.target != aten.slice.Tensor:
        return logits, labels, False
    x, y = _underlying(ctx, logits.args[0]), _underlying(ctx, labels.args[0])
    xs, ys = shape_of(x), shape_of(y)
    seq = xs[1] if xs and len(xs) >= 2 else None
    lo = list(logits.args) + [0, None, None][len(logits.args) - 1:]
    la = list(labels.args) + [0, None, None][len(labels.args) - 1:]
    x_ok = lo[1] == 1 and (lo[2] or 0) == 0 and seq is not None and lo[3] in (-1, seq - 1)
    y_ok = la[1] == 1 and la[2] == 1 and (la[3] is None or la[3] >= (seq or 0))
    if not (x_ok and y_ok and ys and ys[1] == seq and len(ys) == len(xs) - 1):
        return logits, labels, False
    return x, labels, True


def _shifted_labels(b, labels: fx.Node, ignore_index: int) -> fx.Node:
    """labels[:, 1:] followed by one ignored position: the same length as the unshifted logits."""
    first = b.call(aten.slice.Tensor, labels, 1, 0, 1)
    pad = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, first, 0), ignore_index)
    return b.call(aten.cat.default, [labels, pad], 1)


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze_what_is_one(ctx: ExpansionContext, node: fx.Node):
    """``squeeze()`` drops every dim of size 1 -- globally. On a rank holding a one-row slice of a
    split dim it would drop that dim too (``logits.squeeze()`` of a [B, 1] regression head, a
    microbatch of one row per rank). Written as ``squeeze(dims)`` naming the dims of global size 1,
    the local op drops exactly those, and the split dim keeps its shard."""
    x = node.args[0]
    shape = shape_of(x)
    split = [p.dim for p in _layout(x).placements if isinstance(p, Shard)]
    if not split or shape is None:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = list(range(len(shape))) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    ones = sorted({d % len(shape) for d in dims if shape[d % len(shape)] == 1}) if shape else []
    if sorted(d % len(shape) for d in dims) == ones:
        return None  # names only dims of size 1, none of them split: the local op drops the same ones
    b = _Builder(ctx, node)
    return b.finish(b.call(aten.squeeze.dims, x, ones))


@register(aten.cross_entropy_loss.default)
def sharded_cross_entropy(ctx: ExpansionContext, node: fx.Node):
    """Cross-entropy written so every piece shards (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019):

    with logits sharded on the vocab: global max by all-reduce(max), sum of exp by all-reduce(sum),
    the target logit from its owner by all-reduce(sum) — the full logits are never gathered.
    With tokens sharded (dp, cp): mean = (sum of per-shard sums) / (global count of counted
    tokens), never a mean of per-shard means. A flatten before the loss and the causal-LM label
    shift are looked through, so sequence shards (cp) stay sharded up to the loss.
    """
    logits, labels = node.args[0], node.args[1]
    weight, reduction, ignore_index, smoothing = (list(node.args[2:]) + [None, 1, -100, 0.0][len(node.args) - 2:])[:4]
    reduction = node.kwargs.get("reduction", reduction)
    ignore_index = node.kwargs.get("ignore_index", ignore_index)
    weight = node.kwargs.get("weight", weight)
    smoothing = float(node.kwargs.get("label_smoothing", smoothing) or 0.0)
    shift = False
    if is_soft_target(node):
        return _soft_target_cross_entropy(ctx, node, weight, reduction, smoothing)
    if reduction != 0:  # per-token losses keep the caller's shape: nothing to look through
        logits, labels = _peel_flatten(ctx, logits, labels)
        logits, labels, shift = _peel_shift(ctx, logits, labels)
    sources = (logits, _underlying(ctx, labels.args[0]) if shift else labels)
    whole = all(isinstance(p, Replicate) for n in sources for p in _layout(_underlying(ctx, n)).placements)
    if whole and not (ctx.microbatches > 1 and reduction == 1):
        return None  # (with microbatches a mean loss is expanded anyway: its count is needed)
    b = _Builder(ctx, node)
    if shift:
        labels = _shifted_labels(b, labels, ignore_index)
    if len(shape_of(logits)) != len(shape_of(labels)) + 1:
        raise CompileError(f"cross_entropy in '{module_path(node)}': logits {list(shape_of(logits))} and labels "
                           f"{list(shape_of(labels))} are not [N, C, ...] and [N, ...]")
    logits = _classes_last(b, logits, peeled=logits is not node.args[0])
    classes = shape_of(logits)[-1]
    # the offset is a constant for the gradient: take the max of detached logits, so the all-reduce
    # that resolves it across ranks has no backward
    top = b.call(aten.amax.default, b.call(aten.detach.default, logits), [-1], True)
    shifted = b.call(aten.sub.Tensor, logits, top)
    log_total = b.call(aten.log.default, b.call(aten.sum.dim_IntList, b.call(aten.exp.default, shifted), [-1]))
    counted = b.call(aten.ne.Scalar, labels, ignore_index)
    safe = b.call(aten.mul.Tensor, labels, counted)
    target = b.call(aten.gather.default, shifted, -1, b.call(aten.unsqueeze.default, safe, -1))
    per_token = b.call(aten.sub.Tensor, log_total, b.call(aten.squeeze.dim, target, -1))
    weighs = _class_weights(b, weight, safe, counted)
    per_token = b.call(aten.mul.Tensor, per_token, weighs)
    if smoothing:
        # label smoothing adds eps / C x the (class-weighted) sum over classes of -log p:
        # sum_c w_c (log_total - shifted_c) = log_total x sum_c w_c - sum_c w_c shifted_c
        if weight is None:
            spread = b.call(aten.sub.Tensor, b.call(aten.mul.Tensor, log_total, float(classes)),
                            b.call(aten.sum.dim_IntList, shifted, [-1]))
        else:
            spread = b.call(aten.sub.Tensor, b.call(aten.mul.Tensor, log_total, b.call(aten.sum.default, weight)),
                            b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, shifted, weight), [-1]))
        spread = b.call(aten.mul.Tensor, spread, counted)
        per_token = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, per_token, 1.0 - smoothing),
                           b.call(aten.mul.Tensor, spread, smoothing / classes))
    return b.finish(_reduced_tokens(b, per_token, weighs, reduction))


def is_soft_target(node: fx.Node) -> bool:
    """A cross-entropy whose target holds class probabilities (the logits' shape, floating), not
    class indices: distillation, mixup, labels smoothed by hand."""
    target = node.args[1]
    value = target.meta.get("val") if isinstance(target, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _soft_target_cross_entropy(ctx: ExpansionContext, node: fx.Node, weight, reduction: int, smoothing: float):
    """Cross-entropy against class probabilities, as PyTorch defines it: per sample
    -sum_c w_c t_c log p_c with t smoothed to t (1 - eps) + eps / C; the mean divides by the number of
    samples (weights do not enter it). Every piece shards: the class sums over a vocabulary split
    by all-reduce, the samples over dp/cp by the global count of the mean."""
    logits, target = node.args[0], node.args[1]
    peeled = False
    if reduction != 0:  # loss(x.view(-1, C), t.view(-1, C)) is the loss on x and t [..., C]: no gather of a split
        x, t = _flattened(ctx, logits), _flattened(ctx, target)
        if x is not None and t is not None and shape_of(x) == shape_of(t):
            logits, target, peeled = x, t, True
    whole = all(isinstance(p, Replicate) for n in (logits, target) for p in _layout(_underlying(ctx, n)).placements)
    if whole:
        return None
    b = _Builder(ctx, node)
    logits, target = _classes_last(b, logits, peeled=peeled), _classes_last(b, target, peeled=peeled)
    classes = shape_of(logits)[-1]
    top = b.call(aten.amax.default, b.call(aten.detach.default, logits), [-1], True)
    shifted = b.call(aten.sub.Tensor, logits, top)
    log_total = b.call(aten.log.default, b.call(aten.sum.dim_IntList, b.call(aten.exp.default, shifted), [-1], True))
    log_probs = b.call(aten.sub.Tensor, shifted, log_total)
    if smoothing:
        target = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, target, 1.0 - smoothing), smoothing / classes)
    if weight is not None:
        target = b.call(aten.mul.Tensor, target, weight)
    per_sample = b.call(aten.neg.default, b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, log_probs, target), [-1]))
    if reduction == 0:
        return b.finish(per_sample)
    return b.finish(b.call(aten.sum.default if reduction == 2 else aten.mean.default, per_sample))


def _flattened(ctx: ExpansionContext, node: fx.Node) -> fx.Node | None:
    """The [..., C] value a [N, C] node flattens (through the gathers propagation put in front of the
    flatten), or None."""
    if not isinstance(node, fx.Node) or node.target not in RESHAPES:
        return None
    source = _underlying(ctx, node.args[0])
    shape, flat = shape_of(source), shape_of(node)
    if shape is None or flat is None or len(shape) < 3 or len(flat) != 2 or shape[-1] != flat[-1]:
        return None
    return source


def _class_weights(b, weight, safe: fx.Node, counted: fx.Node) -> fx.Node:
    """What each token weighs: its class's weight (1 without weights), 0 where ignored. PyTorch's
    mean divides by the weights of the counted tokens' classes."""
    if weight is None:
        return counted
    picked = b.call(aten.embedding.default, b.call(aten.unsqueeze.default, weight, -1), safe)
    return b.call(aten.mul.Tensor, b.call(aten.squeeze.dim, picked, -1), counted)


def _reduced_tokens(b, per_token: fx.Node, weighs: fx.Node, reduction: int) -> fx.Node:
    """Per-token losses (already weighted) reduced as ``reduction`` asks: none, sum, or the token
    mean, a sum over the global weight of the counted tokens."""
    if reduction == 0:
        return per_token
    total = b.call(aten.sum.default, per_token)
    if reduction == 2:
        return total
    count = b.call(aten.sum.default, weighs)
    # a microbatch (or rank) whose every token is ignored divides 0 by 1, not by 0: the runtime weighs
    # it by its count, 0, and a NaN would survive that weight (a batch with no counted token at all
    # still gives NaN: the step divides by the global count)
    guarded = b.call(aten.add.Tensor, count, b.call(aten.eq.Scalar, count, 0))
    guarded.meta["usc_count_guard"] = True
    mean = b.call(aten.div.Tensor, total, guarded)
    mean.meta["usc_token_mean"] = True  # expose_loss_count_pass returns its denominator too
    return mean


@register(aten.nll_loss_nd.default, aten.nll_loss.default, aten.nll_loss2d.default)
def sharded_nll_loss(ctx: ExpansionContext, node: fx.Node):
    """``nll_loss(log_probs, labels)`` (after a ``log_softmax`` of the user's): the target's
    log-probability picked from its owner under a vocabulary split, and the token mean as for
    cross-entropy (a sum over the global weight of the counted tokens)."""
    log_probs, labels = node.args[0], node.args[1]
    weight, reduction, ignore_index = (list(node.args[2:]) + [None, 1, -100][len(node.args) - 2:])[:3]
    weight = node.kwargs.get("weight", weight)
    reduction = node.kwargs.get("reduction", reduction)
    ignore_index = node.kwargs.get("ignore_index", ignore_index)
    if reduction != 0:
        log_probs, labels = _peel_flatten(ctx, log_probs, labels)
    whole = all(isinstance(p, Replicate) for n in (log_probs, labels) for p in _layout(_underlying(ctx, n)).placements)
    if whole and not (ctx.microbatches > 1 and reduction == 1):
        return None
    if len(shape_of(log_probs)) != len(shape_of(labels)) + 1:
        raise CompileError(f"nll_loss in '{module_path(node)}': log-probabilities {list(shape_of(log_probs))} and "
                           f"labels {list(shape_of(labels))} are not [N, C, ...] and [N, ...]")
    b = _Builder(ctx, node)
    log_probs = _classes_last(b, log_probs, peeled=log_probs is not node.args[0])
    counted = b.call(aten.ne.Scalar, labels, ignore_index)
    safe = b.call(aten.mul.Tensor, labels, counted)
    picked = b.call(aten.gather.default, log_probs, -1, b.call(aten.unsqueeze.default, safe, -1))
    weighs = _class_weights(b, weight, safe, counted)
    per_token = b.call(aten.mul.Tensor, b.call(aten.neg.default, b.call(aten.squeeze.dim, picked, -1)), weighs)
    return b.finish(_reduced_tokens(b, per_token, weighs, reduction))


@register(*REDUCED_LOSSES)
def sharded_elementwise_loss(ctx: ExpansionContext, node: fx.Node):
    """mse / l1 / smooth-l1 / huber / soft-margin / binary cross-entropy / margin and embedding
    losses with a reduction, on sharded inputs: the same op per element or per row
    (``reduction='none'``) then the sum, or the mean over the global count -- no input is gathered
    where the rows or elements may stay split."""
    index = REDUCED_LOSSES[node.target]
    reduction = loss_reduction(node, index)
    if reduction == 0 or all(isinstance(p, Replicate) for n in node.all_input_nodes for p in _layout(n).placements):
        return None
    b = _Builder(ctx, node)
    schema = node.target._schema.arguments  # arguments left at their defaults, written out up to the reduction
    args = list(node.args) + [node.kwargs.get(a.name, a.default_value) for a in schema[len(node.args):index + 1]]
    args[index] = 0
    kwargs = {k: v for k, v in node.kwargs.items() if k not in {a.name for a in schema[:index + 1]}}
    per_element = b.call(node.target, *args, **kwargs)
    return b.finish(b.call(aten.sum.default if reduction == 2 else aten.mean.default, per_element))


def _classes_last(b, logits: fx.Node, peeled: bool) -> fx.Node:
    """PyTorch's cross-entropy reads classes from dim 1 of [N, C, d1, ...] logits; the expansion
    reduces over the last dim, so move dim 1 there. (Logits seen through a flatten are [..., C].)"""
    rank = len(shape_of(logits))
    if peeled or rank <= 2:
        return logits
    return b.call(aten.permute.default, logits, [0, *range(2, rank), 1])


@register(aten.scaled_dot_product_attention.default)
def context_parallel_attention(ctx: ExpansionContext, node: fx.Node):
    """Attention over a sequence sharded on an axis (context parallelism, cp_mode):

    ring / zigzag: K/V blocks travel around the ring while each rank attends its queries to them,
    merged by online softmax (Liu et al. 2023); no rank holds the full scores or the full K/V.
    ulysses: all-to-all from sequence shards to head shards, ordinary attention, and back
    (Jacobs et al. 2023).

    An explicit mask (one ``attention_masks_pass`` did not prove causal) is sliced, not gathered per
    step: under ring / zigzag each rank keeps its query rows of it (in the axis's chunk order) over
    all keys, and every ring step reads the columns of the block it holds; under Ulysses the heads
    are split, so each rank takes the whole mask (its heads of it, for a per-head mask)."""
    args = sdpa_args(node)
    q = args["query"]
    axes = [i for i, p in enumerate(_layout(q).placements) if isinstance(p, Shard) and p.dim == 2]
    if not axes:
        return None
    axis = ctx.mesh.axes[axes[0]]
    _check_cp_attention(node, args)
    b = _Builder(ctx, node)
    qkv = (args["query"], *(_repeat_kv(b, t, shape_of(q)[1]) for t in (args["key"], args["value"])))
    mask = () if args["attn_mask"] is None else (args["attn_mask"],)
    if ctx.cp_mode == "ulysses":
        heads = [b.module(AllToAll(axis, 2, 1, whole_elsewhere=True), t, stem="all_to_all") for t in qkv]
        out = b.call(aten.scaled_dot_product_attention.default, *heads, *(mask or (None,)), 0.0, args["is_causal"],
                     scale=args["scale"])
        out = b.module(AllToAll(axis, 1, 2), out, stem="all_to_all")
        return b.finish(_in_memory_order_of(b, out, node.meta.get("val")))
    layout = "zigzag" if ctx.mesh.order(axis) == "zigzag" else "contiguous"
    order = _memory_order(node.meta.get("val"))
    # a contiguous traced output (a trace on the meta device, whose attention is plain matmuls): the
    # ring's output follows q, as the device kernels' does for the usual transposed q
    ring = RingAttention(axis, causal=bool(args["is_causal"]), scale=args["scale"], layout=layout, masked=bool(mask),
                         out_order=None if order == tuple(range(len(order or ()))) else order)
    return b.finish(b.module(ring, *qkv, *mask, stem="ring_attention"))


def _memory_order(traced) -> tuple[int, ...] | None:
    """The dims of the traced attention's output, outermost in memory first (None: not dense, or not
    a tensor): the ring kernel stores its output so, at no cost, as the kernel it replaces did."""
    if not isinstance(traced, torch.Tensor):
        return None
    order = tuple(sorted(range(traced.dim()), key=lambda d: (-traced.stride(d), d)))
    step = 1
    for d in reversed(order):
        if traced.shape[d] != 1 and traced.stride(d) != step:
            return None
        step *= traced.shape[d]
    return order


def _in_memory_order_of(b: _Builder, out: fx.Node, traced) -> fx.Node:
    """The all-to-all's output laid out in memory as the traced attention's was: CPU and CUDA
    attention kernels return [B, H, S, D] stored as [B, S, H, D], and export drops a model's
    ``.transpose(1, 2).contiguous()`` as a no-op, so the ``view`` after it needs that layout."""
    order = _memory_order(traced)
    if order is None or order == tuple(range(len(order))):
        return out
    inverse = sorted(range(len(order)), key=order.__getitem__)
    dense = b.call(aten.clone.default, b.call(aten.permute.default, out, order),
                   memory_format=torch.contiguous_format)
    return b.call(aten.permute.default, dense, inverse)


def _repeat_kv(b: _Builder, t: fx.Node, heads: int) -> fx.Node:
    """enable_gqa's grouped key/value heads, repeated to the query's (Hugging Face's ``repeat_kv``:
    head j serves query heads j*g .. j*g+g-1), so ring and Ulysses see one K/V head per query head."""
    shape = shape_of(t)
    if shape[1] == heads:
        return t
    groups = heads // shape[1]
    wide = b.call(aten.expand.default, b.call(aten.unsqueeze.default, t, 2),
                  [shape[0], shape[1], groups, *shape[2:]])
    return b.call(aten.reshape.default, wide, [shape[0], heads, *shape[2:]])


def _check_cp_attention(node: fx.Node, args: dict) -> None:
    where = module_path(node) or "<root>"
    if args["dropout_p"]:
        raise CompileError(f"attention in '{where}': context parallelism supports scaled_dot_product_attention "
                           "without dropout (set the attention dropout to 0)")
    mask = args["attn_mask"]
    shape = shape_of(mask) if mask is not None else None
    if mask is not None and (shape is None or not 2 <= len(shape) <= 4):
        raise CompileError(f"attention in '{where}': context parallelism takes an attention mask of 2 to 4 dims "
                           f"([B|1, H|1, S, S]), got shape {shape}; build the mask with its query and key dims last")
