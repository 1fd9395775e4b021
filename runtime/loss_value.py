"""How a step's loss value reaches every rank: one description that the runtime follows and that the
report and the cost model count (compiler/report.py, compiler/cost_model.py), so the bytes they
predict are the bytes the runtime sends.

The program's loss is partial (a sum) on some mesh axes; the runtime all-reduces it over each of
them once per step, with no gradient. A loss that is a token mean comes with its token count, kept
as a float64 tensor on the device (no host sync per microbatch): ``loss * count`` promotes to
float64, so the weighted sum travels in float64. With pp the pipeline first sums the last stage's
(token-weighted loss sum, token count) pair over pp, both float64, and the loss it returns is
float64. Any other loss travels in its own dtype, half types in float32.

Where ranks hold copies of the loss (every other axis but pp, whose loss the pipeline already
shares), the value is summed once more with every copy but one zeroed: a NaN anywhere stays NaN
(0 * NaN), so all ranks reach one finite-loss verdict and none steps on a NaN another saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

PIPELINE_DTYPE = torch.float64  # the pipeline accumulates the loss sum and the count in float64


@dataclass(frozen=True)
class LossValueReduction:
    """The all-reduces that return a step's loss. ``axes``: those the loss is partial on;
    ``loss_dtype``: what the program computes it in; ``counted``: the program returns (loss, token
    count); ``pipelined``: pp > 1."""

    axes: tuple[str, ...] = ()
    loss_dtype: torch.dtype = torch.float32
    counted: bool = False
    pipelined: bool = False
    verdict: tuple[str, ...] = ()  # axes the loss is a copy on, summed for one finite-loss verdict

    def over(self, sizes: Mapping[str, int]) -> "LossValueReduction":
        """This reduction on a mesh of these axis sizes: its verdict axes are those of size > 1 the loss
        is a copy on (pp excluded: the pipeline shares the loss already)."""
        return replace(self, verdict=tuple(a for a, n in sizes.items() if n > 1 and a not in self.axes and a != "pp"))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the loss value is summed in over ``axes``."""
        if self.counted or self.pipelined:
            return PIPELINE_DTYPE
        return torch.float32 if self.loss_dtype.itemsize < 4 else self.loss_dtype

    def pipeline_payloads(self) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """(axis, shape, dtype, what) of the pp sum of the last stage's pair, if pipelined."""
        return [("pp", (2,), PIPELINE_DTYPE, "the last stage's loss sum and token count")] if self.pipelined else []

    def axis_payloads(self) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """(axis, shape, dtype, what) of the loss value's sum over each axis it is partial on."""
        return [(axis, (), self.dtype, "the returned loss is a partial sum on this axis") for axis in self.axes]

    def verdict_payloads(self) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """(axis, shape, dtype, what) of the finite-loss verdict's sum over each axis the loss is a copy on."""
        return [(axis, (), self.dtype, "every rank agrees on the finite-loss verdict") for axis in self.verdict]

    def payloads(self) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """Every all-reduce, in the order the runtime issues them."""
        return self.pipeline_payloads() + self.axis_payloads() + self.verdict_payloads()


def loss_parts(out) -> tuple[torch.Tensor, torch.Tensor | float, torch.Tensor | None]:
    """(loss, count, empty) of a program's output: a token mean's program returns (loss, token
    count[, its numerator where the count is 0, else 0]) (passes/loss_count.py); any other returns
    its loss, counted once."""
    if not isinstance(out, (tuple, list)):
        return out, 1.0, None
    if len(out) < 2:
        return out[0], 1.0, None
    return out[0], out[1].detach().to(torch.float64), out[2] if len(out) > 2 else None


def microbatch_share(loss: torch.Tensor, count, empty: torch.Tensor | None, transform) -> torch.Tensor:
    """A microbatch's part of the step's loss sum: its loss times what it divided by (its count, with
    the model's floor or offset), in float64 when counted; plus, where it counted nothing, its
    numerator -- its guarded mean divided that by 1, and times a count of 0 it would be dropped
    (a sum the mask does not cover)."""
    share = loss * step_count(count, transform)
    return share if empty is None else share + empty.to(share.dtype)


def step_count(count, transform: tuple[str, float] | None):
    """The denominator of a count: a floor or offset the model keeps its denominator off zero with
    (``count.clamp(min=1)``, ``count + eps``) applies to each microbatch's count and to the step's."""
    if transform is None or not isinstance(count, torch.Tensor):
        return count
    kind, constant = transform
    return count.clamp(min=constant) if kind == "clamp_min" else count + constant


__all__ = ["LossValueReduction", "PIPELINE_DTYPE", "loss_parts", "microbatch_share", "step_count"]
