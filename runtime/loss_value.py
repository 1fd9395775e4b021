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
    step_counts: tuple[tuple[str, ...], ...] = ()  # per count summed before the first microbatch: its axes

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

    def count_payloads(self) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """(axis, shape, dtype, what) of the sum of the step's token counts before its first microbatch
        (a loss whose token means divide by the step's count: passes/loss_count.py)."""
        groups: dict[tuple[str, ...], int] = {}
        for axes in self.step_counts:
            groups[axes] = groups.get(axes, 0) + 1
        return [(axis, (n,), PIPELINE_DTYPE, "the step's token counts, summed before its first microbatch")
                for axes, n in groups.items() for axis in axes]

    def payloads(self) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """Every all-reduce, in the order the runtime issues them."""
        return self.count_payloads() + self.pipeline_payloads() + self.axis_payloads() + self.verdict_payloads()


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


class StepDivisor(torch.nn.Module):
    """What a token mean divides by when its microbatches' weights differ from the other loss terms'
    (passes/loss_count.py, "count_first"): the step's count (with the model's floor or offset) over
    the number of microbatches, set by the runtime before the step's first forward from ``StepCounts``.
    Weighted 1/M like every other term, microbatch m's numerator then adds numerator_m / N to the step."""

    def __init__(self, index: int, dtype: torch.dtype):
        super().__init__()
        self.index, self.dtype = index, dtype
        self.value: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError("a token mean's step count was not set before the forward: the runtime sums the "
                               "step's counts first (StepCounts); call the compiled step, not its graph")
        return self.value

    def extra_repr(self) -> str:
        return f"index={self.index}"


@dataclass(frozen=True)
class StepCounts:
    """The token counts of a loss whose token means divide by the step's count (passes/loss_count.py):
    ``program`` computes this rank's part of each count from the placeholders ``reads`` (the batch and
    buffers, no weight); the runtime sums it over the microbatches, then over ``axes`` (each count's
    mesh axes, a float64 all-reduce per axis), and applies ``transforms`` (the model's floor or offset)."""

    program: torch.nn.Module
    reads: tuple[str, ...]
    axes: tuple[tuple[str, ...], ...]
    transforms: tuple[tuple[str, float] | None, ...]

    def groups(self) -> list[tuple[tuple[str, ...], list[int]]]:
        """(axes, the counts summed over them): one all-reduce of a float64 vector per axis and group."""
        out: dict[tuple[str, ...], list[int]] = {}
        for i, axes in enumerate(self.axes):
            out.setdefault(axes, []).append(i)
        return list(out.items())

    def divisors(self, totals: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
        """What each token mean divides by: its step count (floored or offset as the model wrote) / M."""
        return [step_count(totals[i], transform) / microbatches for i, transform in enumerate(self.transforms)]


__all__ = ["LossValueReduction", "PIPELINE_DTYPE", "StepCounts", "StepDivisor", "loss_parts", "microbatch_share",
           "step_count"]
