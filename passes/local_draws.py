"""Local draws: a rank draws only its block of a random tensor, not the whole of it.

Requires: propagation ran (every node has a layout; redistributions are explicit nodes); random ops
    are ``usc::draw`` nodes, each fed by its own ``RandomKey`` node (random_ops).
Establishes: a draw whose every reader is the same ``LocalShard`` (Replicate -> Shard(dim) on one
    mesh axis, contiguous chunks) draws that shard itself: the ``LocalShard`` nodes are gone, the
    draw carries ``shards`` = (dim, parts, ...) in the order the splits applied and the layout they
    gave, and its key module lists the axes, whose coordinates of this rank it appends to the key.
    Repeated while the draw's readers are again one such split (dp on the batch, then tp on heads).
    The values are those the whole draw held there (a draw is a function of the global element
    index, runtime/random.py), so nothing a rank computes changes.

Why: propagation places a draw as it places any op without tensor inputs -- replicated -- and its
readers slice it, so every rank drew the whole tensor of the global batch (or microbatch): memory
and hashing that grew with dp, cp and tp instead of shrinking (an attention-dropout mask is
[batch, heads, seq, seq] per layer). A zigzag split (cp's load-balanced chunk order) is left as it
was: its rank's block is two chunks, not one.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from usc.compiler.ir import META, set_ann
from usc.runtime.collectives import LocalShard
from usc.runtime.random import RandomKey

from .graph_edit import erase_node
from .random_ops import DRAW, DRAW_SHARDS as SHARDS


def local_draws_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Fold each draw's local-shard readers into the draw (see the module docstring)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is DRAW:
            changed |= _fold(gm, node, ctx.mesh)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _fold(gm: fx.GraphModule, draw: fx.Node, mesh) -> bool:
    key = draw.args[0]
    if not (isinstance(key, fx.Node) and key.op == "call_module" and len(key.users) == 1):
        return False
    module = gm.get_submodule(key.target)
    if not isinstance(module, RandomKey):
        return False
    rank = len(draw.args[1])
    shards = list(draw.args[SHARDS] or ()) if len(draw.args) > SHARDS else []
    axes = list(module.axes)
    folded = False
    while True:
        split = _one_split(gm, draw, rank)
        if split is None:
            break
        axis, dim = split
        readers = list(draw.users)
        layout = readers[0].meta[META].layout
        for reader in readers:
            reader.replace_all_uses_with(draw)
            erase_node(gm, reader)
        shards += [dim, mesh.size(axis)]
        axes.append(axis)
        set_ann(draw, layout=layout)
        folded = True
    if folded:
        module.axes = tuple(axes)
        args = list(draw.args) + [None] * (SHARDS + 1 - len(draw.args))
        args[SHARDS] = shards
        draw.args = tuple(args)
        old = key.meta.get("val")
        if isinstance(old, torch.Tensor):
            key.meta["val"] = old.new_empty(3 + len(axes))
    return folded


def _one_split(gm: fx.GraphModule, draw: fx.Node, rank: int) -> tuple[str, int] | None:
    """(axis, dim) when every reader of ``draw`` is a contiguous LocalShard of that one split."""
    splits = set()
    for reader in draw.users:
        if reader.op != "call_module" or len(reader.args) != 1:
            return None
        module = gm.get_submodule(reader.target)
        if type(module) is not LocalShard or module.order != "contiguous":
            return None
        splits.add((module.axis, module.dim % rank if rank else module.dim))
    return splits.pop() if len(splits) == 1 else None


__all__ = ["local_draws_pass"]
