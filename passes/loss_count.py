"""Expose the token count of a mean loss, so microbatches combine into the global mean.

Requires: the graph returns one scalar loss; a mean cross-entropy was expanded into
    sum / count (``meta["usc_token_mean"]``), and propagation made the count whole (its reduction
    over dp/cp is a node before the division).
Establishes: such a graph returns ``(loss, count)``; the runtime weights microbatch m by count_m / N
    (ALGORITHMS.md, "Losses and averaging"). Any other graph is returned unchanged.
"""

from __future__ import annotations

import torch.fx as fx


def expose_loss_count_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Return the mean loss's denominator as a second output (see the module docstring)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    loss = values[0] if isinstance(values, (tuple, list)) else values
    if not (isinstance(loss, fx.Node) and loss.meta.get("usc_token_mean")):
        return gm
    output.args = ((loss, loss.args[1]),)
    gm.recompile()
    return gm
