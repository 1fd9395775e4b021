"""Sharding rules for the ops functionalization writes (``compiler/functional.py``).

A write through a view, ``a[:, 0].mul_(3.0)``, becomes ``select_scatter(a, mul(select(a)), 1, 0)``;
``a[..., 1, :1] = 0.0`` a ``fill`` and a ``slice_scatter``; ``x.copy_(y)`` a cast and broadcast of y. A buffer's
write-back is a ``StateWrite`` node. Registered into ``sharding_rules.SHARDING_RULES`` on import.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from usc.runtime.state_write import StateWrite

from .sharding_rules import R, Decision, OpView, is_partial, is_shard, norm_dim, pointwise, register

aten = torch.ops.aten


def _scatter_rule(removes_dim: bool):
    """``*_scatter(base, src, dim, ...)``: base and src keep a shard of any dim but the written one
    (src lacks that dim when a select wrote it); partial sums on both stay partial (the op is
    linear in the pair); anything else is made whole."""

    def rule(view: OpView) -> Decision:
        base, src = view.placements[0], view.placements[1]
        dim = norm_dim(view.arg(2, 0), len(view.shapes[0]))
        if is_partial(base, "sum") and is_partial(src, "sum"):
            return Decision(view.placements, base)
        to_src = (lambda d: d - 1 if d > dim else d) if removes_dim else (lambda d: d)
        from_src = (lambda d: d + 1 if d >= dim else d) if removes_dim else (lambda d: d)
        chosen = base.dim if is_shard(base) and base.dim != dim else None
        if chosen is None and is_shard(src) and from_src(src.dim) != dim:
            chosen = from_src(src.dim)
        if chosen is None:
            return Decision(tuple(R for _ in view.placements), R)
        return Decision((Shard(chosen), Shard(to_src(chosen))) + tuple(R for _ in view.placements[2:]),
                        Shard(chosen))

    return rule


register(aten.select_scatter.default)(_scatter_rule(removes_dim=True))
register(aten.slice_scatter.default)(_scatter_rule(removes_dim=False))
# fill(self, value) is value at self's shape (a functionalized copy_ is rewritten before any pass:
# compiler/functional.differentiable_copies)
register(aten.fill.Tensor, aten.fill.Scalar)(pointwise("none"))


@register(StateWrite)
def state_write_rule(view: OpView) -> Decision:
    """The value written is made to the buffer's own placement (every rank's copy of a replicated
    buffer takes the same whole value)."""
    return Decision((view.placements[0], view.placements[0]), R)


__all__ = ["state_write_rule"]
