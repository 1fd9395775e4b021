"""Errors raised by the communication layer, written for the person reading the log.

A failed collective on one rank is almost never caused by that rank: a peer died, hung, or took
another code path. So every message says who we are (rank, collective, mesh axis, the global
ranks of the group, the timeout), what was observed, and where to look next.
"""

from __future__ import annotations

from dataclasses import dataclass

# Shown under every CollectiveError: the usual causes, most likely first.
FAILURE_HINT = (
    "likely cause: a peer rank died or raised, or the ranks took different code paths "
    "(a different collective, shape or order on one of them).\n"
    "fix: check the other ranks' logs for the first error; every rank must issue the same "
    "collectives in the same order."
)

# Shown under every CollectiveTimeout: it adds the 'legitimately slow' case.
TIMEOUT_HINT = (
    "likely cause: a peer rank died, hangs, or took a different code path and never issued "
    "this collective.\n"
    "fix: check the other ranks' logs for the first error; if the step is legitimately slow, "
    "raise timeout=SECONDS in the plan."
)


@dataclass(frozen=True)
class CollectiveContext:
    """Which collective failed where: enough to find the matching call on the other ranks."""

    rank: int  # global rank of the reporting process (or simulated rank)
    kind: str  # "all-reduce", "all-gather", ...
    axis: str  # mesh axis the group spans
    group_ranks: tuple[int, ...]  # global ranks of the group, in group order
    timeout: float  # seconds

    def describe(self) -> str:
        """One line: 'rank 3: all-reduce over mesh axis 'tp' (group ranks (2, 3), timeout 5s)'."""
        return (
            f"rank {self.rank}: {self.kind} over mesh axis {self.axis!r} "
            f"(group ranks {self.group_ranks}, timeout {self.timeout:g}s)"
        )


class CollectiveError(RuntimeError):
    """A collective failed on this rank; the message names the call and suggests a fix."""

    hint = FAILURE_HINT

    def __init__(self, context: CollectiveContext, detail: str):
        self.context = context
        self.detail = detail
        super().__init__(f"{context.describe()} failed: {detail}\n{self.hint}")


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within its timeout (some peer never arrived)."""

    hint = TIMEOUT_HINT


class LaunchError(RuntimeError):
    """The processes started do not match the mesh the plan needs (wrong torchrun command)."""


class NonFiniteLoss(FloatingPointError):
    """A step's loss was NaN or infinite: which step, which rank, and the usual causes. Every rank
    sees the same global loss, so every rank raises it at the same point."""

    raised_by_every_rank = True

    def __init__(self, step: int, rank: int, value: float, *, cause: str | None = None) -> None:
        causes = f"cause: {cause}" if cause else (
            "usual causes: a learning rate too high, inputs outside the embedding's range, or a division by a "
            "zero token count (every label ignored)")
        super().__init__(f"step {step}: the loss is {value} on rank {rank}; the optimizer step was skipped (no "
                         f"rank stepped). {causes[0].upper()}{causes[1:]}")
        self.step, self.rank, self.value = step, rank, value
