"""Zero-bubble's split backward of one stage: I (input gradients, now) and W (weight gradients, later).

Qi et al. 2024 ("Zero Bubble Pipeline Parallelism") split a stage's backward into B -- the
gradients of the stage inputs, which the previous stage waits for -- and W, the weight gradients,
which nothing downstream waits for and can fill the bubble. Done as two plain autograd calls, W
would walk the whole graph again (the input-gradient chain included), so I+W would cost more than
one backward. As torch.distributed.pipelining's ``_backward.py`` (stage_backward_input/weight),
I instead records, while it runs, the gradient arriving at each autograd node where a weight's
branch joins the input-gradient chain (an "intermediate": e.g. a linear's backward node, whose
output gradient gives dW = dY^T X). W then starts from those recorded gradients and walks only
the short branches down to the weights: no input gradient is computed twice.

A weight whose branch reaches the loss without joining the input chain (or a stage whose inputs
need no gradient, like the first) gets its gradient in W by an ordinary backward restricted to
it, so every weight's gradient is exactly what one backward gives.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Group:
    """Weights whose branches hang off the same intermediates, with the gradients I recorded there."""

    params: list[Node]  # AccumulateGrad nodes
    intermediates: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)


@dataclass
class WeightWork:
    """What W still has to do for one microbatch of one stage."""

    groups: list[_Group]
    rest: list[torch.Tensor]  # weights that get a plain restricted backward
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor | None]
    weights: dict[Node, torch.Tensor]


def _graph(roots: list[Node]) -> tuple[set[Node], dict[Node, list[Node]]]:
    """Every node reachable from the roots, and each node's parents (the nodes that feed it grads)."""
    seen, parents, queue = set(roots), defaultdict(list), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return seen, parents


def _leaf_nodes(nodes: set[Node], tensors: list[torch.Tensor]) -> dict[Node, torch.Tensor]:
    """The AccumulateGrad node of each leaf tensor that the graph reaches."""
    wanted = {id(t): t for t in tensors}
    return {n: wanted[id(n.variable)] for n in nodes if hasattr(n, "variable") and id(n.variable) in wanted}


def _ancestors(starts, parents: dict[Node, list[Node]]) -> set[Node]:
    found, queue = set(starts), deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


def _joins(param: Node, chain: set[Node], parents: dict[Node, list[Node]]) -> tuple[set[Node], bool]:
    """Where the weight's branch (walked upward) first meets the input chain, and whether some path
    from a root reaches the weight without meeting it."""
    joins, seen, queue, escapes = set(), {param}, deque([param]), False
    while queue:
        node = queue.popleft()
        above = parents.get(node, [])
        escapes |= not above  # a root outside the chain
        for parent in above:
            if parent in chain:
                joins.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return joins, escapes


def _groups(params: list[Node], chain: set[Node], parents) -> tuple[list[_Group], list[Node]]:
    """Weights grouped by shared intermediates (union of overlapping sets); the rest need a plain W."""
    groups: list[_Group] = []
    rest = []
    for param in params:
        joins, escapes = _joins(param, chain, parents)
        if escapes or not joins:
            rest.append(param)
            continue
        overlapping = [g for g in groups if joins & set(g.intermediates)]
        merged = _Group([param], sorted(joins, key=id))
        for g in overlapping:
            groups.remove(g)
            merged = _Group(g.params + merged.params, list({*g.intermediates, *merged.intermediates}))
        groups.append(merged)
    return groups, rest


def input_grads(roots: list[torch.Tensor], root_grads: list, inputs: list[torch.Tensor],
                weights: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: the gradients of ``inputs`` (None where unused); the graph is kept for ``weight_grads``."""
    root_nodes = [t.grad_fn for t in roots if t.grad_fn is not None]
    nodes, parents = _graph(root_nodes)
    input_nodes = _leaf_nodes(nodes, inputs)
    weight_nodes = _leaf_nodes(nodes, weights)
    chain = _ancestors(list(input_nodes), parents)
    groups, rest = _groups(list(weight_nodes), chain, parents) if input_nodes else ([], list(weight_nodes))
    work = WeightWork(groups, [weight_nodes[n] for n in rest], roots, root_grads, weight_nodes)
    if not input_nodes:
        return [None] * len(inputs), work
    handles = [node.register_prehook(_recorder(group, node)) for group in groups for node in group.intermediates]
    try:
        found = torch.autograd.grad(roots, inputs, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return list(found), work


def _recorder(group: _Group, node: Node):
    def record(grad_outputs):
        group.grads[node] = grad_outputs

    return record


def weight_grads(work: WeightWork) -> None:
    """W: accumulate every weight's gradient into ``.grad`` (as a full backward would have)."""
    for group in work.groups:
        _group_weight_grads(group, work.weights)
    if work.rest:
        torch.autograd.backward(work.roots, work.root_grads, inputs=work.rest)
    work.groups, work.roots = [], []


def _group_weight_grads(group: _Group, weights: dict[Node, torch.Tensor]) -> None:
    edges, seeds = [], []
    for node in group.intermediates:
        for index, grad in enumerate(group.grads.get(node, ())):
            if grad is not None:
                edges.append(GradientEdge(node, index))
                seeds.append(grad)
    if not edges:
        return
    # With several intermediates one may feed another: pin each to the gradient I recorded there, so
    # nothing arriving from an upstream intermediate is counted twice.
    handles = [node.register_prehook(lambda _, saved=group.grads.get(node): saved)
               for node in group.intermediates] if len(group.intermediates) > 1 else []
    try:
        found = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in group.params], seeds,
                                    retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for param_node, grad in zip(group.params, found):
        if grad is None:
            continue
        weight = weights[param_node]
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad.add_(grad)
