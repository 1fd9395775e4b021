"""Expose the token count of a mean loss, so microbatches combine into the global mean.

Requires: the graph returns one scalar loss; a mean cross-entropy was expanded into
    sum / count (``meta["usc_token_mean"]``), and propagation made the count whole (its reduction
    over dp/cp is a node before the division). Under microbatches batch_coupling classified the loss
    (``gm.meta["usc_loss_combine"]``): "token_mean" when its one token mean is added to terms that do
    not depend on the batch (weighting by counts keeps those whole, as the weights add up to 1).
Establishes: such a graph returns ``(loss, count)``; the runtime weights microbatch m by count_m / N
    (runtime/pipeline.py), so the step is the global token mean. A mean whose count the model keeps
    off zero itself (``count.clamp(min=m)``, ``count + eps``) records that floor or offset
    (``gm.meta["usc_count_transform"]``), and the runtime applies it to each microbatch's count and to
    N. A ratio of sums the user wrote (its count guarded by batch_coupling) returns a third value,
    its numerator where its count is 0 (else 0), which the runtime adds: a microbatch counting
    nothing keeps a numerator that is not 0. Any other graph, and any graph whose loss is defined
    per microbatch (batch_coupling=per_microbatch: equal weights), is returned unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from usc.compiler.errors import CompileError
from usc.compiler.ir import META
from usc.runtime.collectives import AllReduce

from .graph_edit import GraphEditor

aten = torch.ops.aten


def expose_loss_count_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Return the mean loss's count as a second output (see the module docstring)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    loss = values[0] if isinstance(values, (tuple, list)) else values
    loss = _reduce_non_sum_partials(gm, ctx, output, loss)
    means = _token_means(gm, loss)
    if not means:
        return gm
    mean = means[0]
    num, den = mean.args
    count, values = den, ()
    if isinstance(den, fx.Node) and den.meta.get("usc_count_guard"):  # count + (count == 0): the count itself
        count = den.args[0]
        if mean.meta.get("usc_token_ratio"):  # the user's numerator need not be 0 where the count is
            values = (_numerator_if_empty(gm, ctx, output, loss, [m.args[0] for m in means], count),)
    elif mean.meta.get("usc_count_transform"):  # count.clamp(min=m) or count + eps: never 0
        count = den.args[0]
        gm.meta["usc_count_transform"] = mean.meta["usc_count_transform"]
    output.args = ((loss, count, *values),)
    gm.recompile()
    return gm


def _numerator_if_empty(gm: fx.GraphModule, ctx, output: fx.Node, loss: fx.Node, nums: list, count) -> fx.Node:
    """The numerators' sum where the count is 0, else 0, in the loss's layout: a microbatch that counts
    nothing divides its numerators by a guarded 1, and the runtime's weight (its count, 0) would drop
    them -- a ratio the user wrote need not have a numerator of 0 there (a sum the mask does not cover)."""
    editor, ann = GraphEditor(gm), loss.meta[META]
    total = None
    for num in nums:
        num = _in_layout(editor, ctx, output, num, ann)
        total = num if total is None else editor.call_function(output, aten.add.Tensor, (total, num), ann=ann)
    empty = editor.call_function(output, aten.eq.Scalar, (count, 0), ann=count.meta[META])
    return editor.call_function(output, aten.mul.Tensor, (empty, total), ann=ann)


def _in_layout(editor: GraphEditor, ctx, output: fx.Node, value: fx.Node, ann) -> fx.Node:
    """``value`` summed over the axes it is partial on and the loss is not (the loss added a term
    after reducing the token mean, so the numerator is still a partial sum there)."""
    have = value.meta[META]
    for i, (mine, theirs) in enumerate(zip(have.layout.placements, ann.layout.placements)):
        if mine == theirs:
            continue
        if not (isinstance(mine, Partial) and mine.reduce_op == "sum" and isinstance(theirs, Replicate)):
            raise CompileError(f"the token mean's numerator is {mine} on mesh axis {ctx.mesh.axes[i]!r} where the "
                               f"loss is {theirs}: usc cannot weigh microbatches by their token counts here "
                               "(plan options: batch_coupling=per_microbatch, or mb=1)")
        value = _all_reduced(editor, ctx, output, value, i, "sum",
                             "a token mean's numerator, for a microbatch that counts nothing")
    return value


def _all_reduced(editor: GraphEditor, ctx, output: fx.Node, value: fx.Node, axis: int, op: str,
                 reason: str) -> fx.Node:
    """``value`` all-reduced (``op``) over mesh axis ``axis``, annotated whole there."""
    ann = value.meta[META]
    ann = dataclasses.replace(ann, layout=ann.layout.with_axis(axis, Replicate()), reason=reason)
    return editor.call_module(output, AllReduce(ctx.mesh.axes[axis], op=op), (value,), ann=ann, stem="all_reduce",
                              same_value_as=value)


def _reduce_non_sum_partials(gm: fx.GraphModule, ctx, output: fx.Node, loss):
    """A loss left as partial maxima (a max over a split dim) is reduced here: the runtime sums
    partial losses over their axes, which is right for sums only (a max loss under dp=2 tp=2
    reported and trained twice the max). The max all-reduce routes the gradient to its owner."""
    ann = loss.meta.get(META) if isinstance(loss, fx.Node) else None
    if ann is None:
        return loss
    editor, reduced = GraphEditor(gm), loss
    for i, placement in enumerate(ann.layout.placements):
        if isinstance(placement, Partial) and placement.reduce_op != "sum":
            reduced = _all_reduced(editor, ctx, output, reduced, i, placement.reduce_op,
                                   f"the loss is a partial {placement.reduce_op}")
    if reduced is not loss:
        values = output.args[0]
        output.args = ((reduced, *values[1:]) if isinstance(values, (tuple, list)) else reduced,)
        gm.recompile()
    return reduced


def _token_means(gm: fx.GraphModule, loss) -> list[fx.Node]:
    """The token means whose count weights the microbatches: the loss itself, or the token means of a
    loss batch_coupling found to be them plus batch-independent terms (several only where the user
    wrote them as ratios over one count)."""
    combine = gm.meta.get("usc_loss_combine")
    if combine == "per_microbatch" or not isinstance(loss, fx.Node):
        return []
    if loss.meta.get("usc_token_mean"):
        return [loss]
    means = [n for n in gm.graph.nodes if n.meta.get("usc_token_mean")]
    if combine != "token_mean" or not means:
        return []
    return means if len(means) == 1 or all(m.meta.get("usc_token_ratio") for m in means) else []
