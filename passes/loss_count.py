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
    nothing keeps a numerator that is not 0. A loss whose token means are added to terms weighted
    otherwise ("count_first": a z-loss over every token, a mean over the samples, a second token mean
    over another mask, terms that do not depend on the batch beside a floored count) keeps returning
    its loss alone: each token mean divides by a ``StepDivisor`` the runtime sets before the first
    microbatch to the step's count / M, summed by the program that counts (``StepCounts``, cut from
    this graph: the count's local part, the axes its all-reduces sum it over). Any other graph, and
    any graph whose loss is defined per microbatch (batch_coupling=per_microbatch: equal weights), is
    returned unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from usc.compiler.errors import CompileError
from usc.compiler.ir import META
from usc.runtime.collectives import AllReduce, CollectiveNode
from usc.runtime.loss_value import StepCounts, StepDivisor

from .graph_edit import GraphEditor, erase_node, val

aten = torch.ops.aten


def expose_loss_count_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Return the mean loss's count as a second output (see the module docstring)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    loss = values[0] if isinstance(values, (tuple, list)) else values
    loss = _reduce_non_sum_partials(gm, ctx, output, loss)
    if gm.meta.get("usc_loss_combine") == "count_first":
        _divide_by_step_counts(gm, [n for n in gm.graph.nodes if n.meta.get("usc_token_mean")])
        gm.recompile()
        return gm
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


def _divide_by_step_counts(gm: fx.GraphModule, means: list[fx.Node]) -> None:
    """Each token mean ``num / den`` becomes ``num / StepDivisor()``: the runtime sums the step's count
    before the first microbatch (``StepCounts``, read off the graph's own count: its local part, and the
    axes its all-reduces sum it over) and sets the divisor to (that count, floored or offset as the
    model wrote) / M, so with the weights 1/M every other term has, microbatch m adds num_m / N. The
    per-microbatch count, its guard and its all-reduces are then dead and dropped."""
    locals_, axes, transforms, dens = [], [], [], []
    for index, mean in enumerate(means):
        num, den = mean.args
        if den.meta.get("usc_count_guard"):  # count + (count == 0): the guard is for microbatches only
            count, transform = den.args[0], None
        else:
            count, transform = den, mean.meta.get("usc_count_transform")
            if transform is not None:
                count = den.args[0]
        local, summed = _local_count(gm, count)
        locals_.append(local)
        axes.append(summed)
        transforms.append(transform)
        dens.append(den)
        name = f"usc_step_divisor_{index}"
        # an integer count (a sum of a boolean mask) divides in the numerator's dtype: N / M is no integer
        dtype = val(den).dtype if val(den).dtype.is_floating_point else val(num).dtype
        gm.add_submodule(name, StepDivisor(index, dtype))
        with gm.graph.inserting_before(mean):
            divisor = gm.graph.call_module(name, ())
        divisor.meta.update({"val": val(den).to(dtype), META: den.meta[META]})
        mean.args = (num, divisor)
    program, reads = _count_program(gm, locals_)
    _drop_dead(gm, dens)
    gm.meta["usc_step_counts"] = StepCounts(program, reads, tuple(axes), tuple(transforms))


def _local_count(gm: fx.GraphModule, count: fx.Node) -> tuple[fx.Node, tuple[str, ...]]:
    """(this rank's part of a whole count, the mesh axes its all-reduces sum it over)."""
    axes = []
    while count.op == "call_module" and isinstance(gm.get_submodule(count.target), AllReduce) \
            and gm.get_submodule(count.target).op == "sum":
        axes.append(gm.get_submodule(count.target).axis)
        count = count.args[0]
    return count, tuple(reversed(axes))


def _count_program(gm: fx.GraphModule, locals_: list[fx.Node]) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """A program of the placeholders the counts read that returns the counts' local parts (with the
    collectives the batch's layout needs on the way: labels flattened across a cp split are gathered)."""
    needed, stack = set(), list(locals_)
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        collective = node.op == "call_module" and isinstance(gm.get_submodule(node.target), CollectiveNode)
        if node.op not in ("placeholder", "call_function", "get_attr") and not collective:
            raise CompileError(f"a token mean's count is computed through {node.format_node()}, not from the batch "
                               "alone: usc cannot sum the step's count before its first microbatch (plan options: "
                               "batch_coupling=per_microbatch, or mb=1)")
        needed.add(node)
        stack.extend(node.all_input_nodes)
    graph, env, reads = fx.Graph(), {}, []
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            reads.append(node.name)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in locals_))
    return fx.GraphModule(gm, graph), tuple(reads)


def _drop_dead(gm: fx.GraphModule, roots: list[fx.Node]) -> None:
    """Erase what only the replaced denominators used (their guards, counts and all-reduces)."""
    ancestors, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    for node in reversed(list(gm.graph.nodes)):
        if node in ancestors and node.op != "placeholder" and not node.users:
            erase_node(gm, node)


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
