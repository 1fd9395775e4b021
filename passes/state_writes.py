"""Buffer writes under microbatches: a write computed from the batch has no per-microbatch form.

Requires: the traced graph, with each buffer write a ``StateWrite`` node (compiler/functional.py).
Establishes: under mb>1, no buffer is written from a value that depends on the batch — such a
    program is refused (PlanError on ``mb``), naming the buffer and the line. On one device the
    forward runs once on the whole batch and the buffer takes one value from it (a running mean
    of the batch, say); each microbatch would compute its own, and none of them is that value.
    Writes that do not read the batch (a step counter) are exact under any mb: the executor
    applies them once, after the step.
"""

from __future__ import annotations

import torch.fx as fx

from usc.compiler.functional import STATE_WRITE, is_state_write
from usc.compiler.trace import user_source

from .graph_edit import reads_placeholders


def state_writes_pass(gm: fx.GraphModule, ctx, *, user_inputs: tuple[str, ...] = ()) -> fx.GraphModule:
    """Refuse a batch-dependent buffer write under mb>1 (see the module docstring)."""
    mb = int(ctx.plan.get("mb"))
    if mb == 1:
        return gm
    for node in gm.graph.nodes:
        if is_state_write(node) and reads_placeholders(node.args[1], set(user_inputs)):
            src = user_source(node)
            raise ctx.plan.error_at(
                "mb", f"mb={mb} runs the batch in microbatches, but the forward writes buffer "
                      f"'{node.meta[STATE_WRITE]}'{f' ({src})' if src else ''} from a value that depends on the "
                      "batch: each microbatch would compute its own value, and none is the one of the whole batch",
                hint="use mb=1, or update the buffer outside forward (after the step)")
    return gm


__all__ = ["state_writes_pass"]
