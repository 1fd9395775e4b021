"""Localize: make the graph a per-rank program by rewriting the global shapes it carries.

Requires: every node has a layout.
Establishes: shape arguments (view/reshape/expand/new_*) are this rank's local shapes (a view of a
    transpose or permute is a reshape: its input's memory order is the rank's kernel's), and every
    sharded dim divides evenly by the mesh axes sharding it (else a ShardingError names the module).
    ``meta["val"]`` keeps the global value; ``Layout.local_shape`` gives the local one.
"""

from __future__ import annotations

from math import prod

import torch
import torch.fx as fx

from usc.compiler.errors import ShardingError
from usc.compiler.ir import META

from .graph_edit import shape_of, val
from .propagate import located

aten = torch.ops.aten
SHAPE_ARG = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1,
             aten.expand.default: 1, aten.new_zeros.default: 1, aten.new_ones.default: 1,
             aten.new_empty.default: 1, aten.new_full.default: 1}


def localize_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Rewrite shape arguments to local shapes (see the module docstring)."""
    changed = False
    for node in gm.graph.nodes:
        if META not in node.meta or node.meta[META].layout is None:
            continue
        _check_divisible(node, ctx.mesh)
        if node.target is aten.view.default and _reordered(node.args[0]):
            # a view of a transpose or permute: the trace's strides let it view (export drops a
            # `.contiguous()` it saw as a no-op), but a rank's kernel may lay its input out otherwise
            # (a math attention's [B, H, S, D] where the trace's kernel gave [B, S, H, D] in memory):
            # reshape views where it can and copies where it must -- the same values either way
            node.target = aten.reshape.default
            changed = True
        index = SHAPE_ARG.get(node.target)
        if index is not None:
            local = list(node.meta[META].layout.local_shape(shape_of(node), ctx.mesh))
            args = list(node.args)
            if list(args[index]) != local:
                args[index] = local
                node.args = tuple(args)
                changed = True
    if changed:
        gm.recompile()
    return gm


def _reordered(node) -> bool:
    """``node`` is a transpose or permute (through views of it)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in (aten.view.default,
                                                                                           aten.reshape.default):
        node = node.args[0]
    return isinstance(node, fx.Node) and node.target in (aten.transpose.int, aten.permute.default)


def _check_divisible(node: fx.Node, mesh) -> None:
    value = val(node)
    values = value if isinstance(value, (tuple, list)) else [value]
    for v in values:
        if not isinstance(v, torch.Tensor):
            continue
        for dim, axes in node.meta[META].layout.sharded_dims().items():
            n = prod(mesh.shape[a] for a in axes)
            if dim < v.dim() and v.shape[dim] % n:
                names = " x ".join(f"{mesh.axes[a]}={mesh.shape[a]}" for a in axes)
                err = ShardingError(f"dim {dim} of size {v.shape[dim]} (shape {list(v.shape)}) is split over "
                                    f"{names}, which does not divide it",
                                    hint=f"choose mesh sizes that divide {v.shape[dim]}")
                if _is_all_to_all(node):
                    err = ShardingError(f"cp_mode=ulysses trades sequence shards for head shards: {names} must "
                                        f"divide the {v.shape[dim]} attention heads",
                                        hint=f"use cp_mode=ring or zigzag, or a cp size that divides {v.shape[dim]}")
                err = located(err, node)
                err.axis = mesh.axes[axes[0]]
                raise err


def _is_all_to_all(node: fx.Node) -> bool:
    if node.op != "call_module":
        return False
    return type(node.graph.owning_module.get_submodule(node.target)).__name__ == "AllToAll"
