"""A forward's write to a buffer (``self.count.add_(1)``, running statistics), as a graph node.

The compiler functionalizes every write (``compiler/functional.py``); what a buffer holds after
the forward becomes the value this node receives. The write is deferred: the executor applies it
after the step's last backward, so every microbatch and every recomputation in the step reads the
buffer as the step began — as the one forward of one device does — and the buffer holds the new
value for the next step.
"""

from __future__ import annotations

import torch
from torch import nn


class StateWrite(nn.Module):
    """``buffer := value`` at the end of the step. Inputs: (buffer, value); no output."""

    _is_impure = True  # torch.fx's dead-code elimination keeps it

    def __init__(self, name: str, placeholder: str) -> None:
        super().__init__()
        self.name, self.placeholder = name, placeholder  # state_dict name, graph input
        self.pending: dict[str, torch.Tensor] | None = None  # the executor's, per rank

    def forward(self, buffer: torch.Tensor, value: torch.Tensor) -> None:
        if self.pending is not None:
            self.pending[self.placeholder] = value.detach()

    def extra_repr(self) -> str:
        return f"{self.name!r}"


def apply_writes(pending: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Copy each pending value into the buffer this rank holds (then forget them)."""
    with torch.no_grad():
        for placeholder, value in pending.items():
            if placeholder in state:
                state[placeholder].copy_(value.to(state[placeholder].dtype))
    pending.clear()
