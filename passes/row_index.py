"""Indexing that picks each row of its own batch: ``x[arange(B)[:, None, ...], idx]`` as ``x[:, idx]``.

Hugging Face builds a padding mask by indexing the ``attention_mask`` with an ``arange`` over the
batch broadcast against the key positions (``padding_mask[batch_idx, kv_idx]``). Traced, that is
``aten.index.Tensor(mask, [arange(B).view(B, 1, 1, 1), kv_idx])``: the ``arange`` is a constant of
the global batch size, so on a rank that holds rows of the batch (dp, microbatches) it names rows
the rank does not have, and the op would need the whole batch gathered (and is refused under
``mb>1``, where no microbatch sees it). Picking row b for output row b is no coupling at all: the
same values come from ``x[:, idx]`` (the batch dim sliced whole, the other indices advanced) with
the batch dim moved to where the ``arange`` broadcast it. This rewrite makes that explicit, so the
op is batch-local under every plan.

A per-row pick, ``x[arange(B), idx]`` with ``idx`` of shape [B] (a sequence classifier's last real
token, a label's logit), is ``x.gather(1, idx % S)`` under the same reading: row b reads row b.

Only an exact identity is rewritten: the first index is ``arange(B)`` (start 0, step 1, B = the
indexed tensor's dim 0) reshaped by ``unsqueeze`` / ``view`` / ``reshape`` to all-ones dims but one,
the other indices are tensors, and their broadcast shape is 1 at that dim.

>>> import torch
>>> x, kv = torch.arange(12).view(3, 4), torch.tensor([3, 0])
>>> rows = torch.arange(3).view(3, 1, 1)
>>> torch.equal(x[rows, kv.view(1, 1, 2)], x[:, kv.view(1, 1, 2)].view(3, 1, 2))
True
"""

from __future__ import annotations

import torch
import torch.fx as fx

from usc.runtime.op_classes import RESHAPES

from .graph_edit import val

aten = torch.ops.aten
ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_RESHAPES = RESHAPES | {aten.unsqueeze.default}  # what an arange index passes through to broadcast


def row_index_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    """The pass form: every row-picking index rewritten (see the module docstring).

    Requires: the traced graph (global shapes). Establishes: no ``index.Tensor`` whose first index
    is an ``arange`` over the indexed tensor's own dim 0. A pass, not part of the tracer: the stamped
    trace of repeated layers compares export's own node names."""
    batch_row_index(gm)
    return gm


def batch_row_index(gm: fx.GraphModule) -> int:
    """Rewrite every row-picking ``index.Tensor`` in place (see the module docstring); the count."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.index.Tensor and (
                _rewrite(gm, node) or _rewrite_per_row(gm, node)):
            rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _is_row_arange(node, rows: int) -> bool:
    """``node`` holds 0, 1, ..., rows - 1 (an arange seen through reshapes)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in ARANGES):
        return False
    numbers = list(node.args)
    if node.target is aten.arange.default:
        numbers = [0, *numbers]
    if len(numbers) == 2:
        numbers.append(1)
    return (all(isinstance(v, int) for v in numbers) and numbers == [0, rows, 1]
            and val(node) is not None and not val(node).dtype.is_floating_point)


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> bool:
    x, indices = node.args[0], list(node.args[1])
    if len(indices) < 2 or not all(isinstance(i, fx.Node) and val(i) is not None for i in indices):
        return False  # a None index (a whole dim) or one without a traced value: left as traced
    xv, first = val(x), indices[0]
    if xv is None:
        return False
    rows = xv.shape[0]
    shape = tuple(val(first).shape)
    big = [d for d, n in enumerate(shape) if n != 1]
    if rows < 2 or len(big) != 1 or shape[big[0]] != rows or not _is_row_arange(first, rows):
        return False
    others = tuple(torch.broadcast_shapes(*(tuple(val(i).shape) for i in indices[1:])))
    full = len(max(shape, others, key=len))
    at = big[0] + full - len(shape)  # the arange's dim in the broadcast index shape
    padded = (1,) * (full - len(others)) + others
    if padded[at] != 1:
        return False
    rest = tuple(xv.shape[len(indices):])
    without = padded[:at] + padded[at + 1:]
    order = list(range(1, 1 + at)) + [0] + list(range(1 + at, 1 + len(without) + len(rest)))
    # named after the node they replace: the batch-coupling probe (the model traced on two samples)
    # is read by the names of the graph it stands for
    with gm.graph.inserting_before(node):
        picked = gm.graph.create_node("call_function", aten.index.Tensor, (x, [None, *indices[1:]]),
                                      name=f"{node.name}_rows")
        shaped = gm.graph.create_node("call_function", aten.view.default, (picked, [rows, *without, *rest]),
                                      name=f"{node.name}_rows_view")
        moved = gm.graph.create_node("call_function", aten.permute.default, (shaped, order),
                                     name=f"{node.name}_rows_moved")
    value = aten.index.Tensor(xv, [None, *(val(i) for i in indices[1:])])
    for new in (picked, shaped, moved):
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta["val"] = value = (value if new is picked else new.target(value, *new.args[1:]))
    return _replace(gm, node, [picked, shaped, moved], first)


def _replace(gm: fx.GraphModule, node: fx.Node, made: list[fx.Node], arange: fx.Node) -> bool:
    """``node`` replaced by the last of ``made`` when it has the node's shape (else ``made`` is taken
    out again: not the identity this module claims), and the arange chain dropped once unread."""
    if tuple(val(made[-1]).shape) != tuple(val(node).shape):
        for new in reversed(made):
            gm.graph.erase_node(new)
        return False
    node.replace_all_uses_with(made[-1])
    gm.graph.erase_node(node)
    _erase_unused(gm, arange)
    return True


def _rewrite_per_row(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``x[arange(B), idx]`` with ``idx`` of shape [B]: row b's element ``idx[b]`` along dim 1 -- the
    pooled logits of a sequence classifier (``logits[arange(B), last_token]``), or a label's logit.
    Rewritten as ``x.gather(1, idx % S)`` (the remainder keeps a negative index's meaning), row-local
    under every split of the batch."""
    x, indices = node.args[0], list(node.args[1])
    if len(indices) != 2 or not all(isinstance(i, fx.Node) and val(i) is not None for i in indices):
        return False
    xv, first, idx = val(x), indices[0], indices[1]
    if xv is None or xv.dim() < 2:
        return False
    rows, length, rest = xv.shape[0], xv.shape[1], tuple(xv.shape[2:])
    if rows < 2 or tuple(val(first).shape) != (rows,) or tuple(val(idx).shape) != (rows,) \
            or not _is_row_arange(first, rows) or val(idx).dtype.is_floating_point:
        return False
    steps = [(aten.remainder.Scalar, (idx, length), "wrapped"),
             (aten.view.default, (None, [rows, 1, *[1] * len(rest)]), "column"),
             (aten.expand.default, (None, [rows, 1, *rest]), "spread"),
             (aten.gather.default, (x, 1, None), "picked"),
             (aten.squeeze.dim, (None, 1), "rows")]
    made: list[fx.Node] = []
    with gm.graph.inserting_before(node):
        for target, args, stem in steps:
            args = tuple(made[-1] if a is None else a for a in args)
            new = gm.graph.create_node("call_function", target, args, name=f"{node.name}_{stem}")
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            new.meta["val"] = target(*(val(a) if isinstance(a, fx.Node) else a for a in args))
            made.append(new)
    return _replace(gm, node, made, first)


def _erase_unused(gm: fx.GraphModule, node) -> None:
    """The arange chain, once nothing reads it."""
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users:
        source = node.args[0] if node.target in _RESHAPES else None
        gm.graph.erase_node(node)
        node = source
