"""A pipeline's bubble when its ranks share a host's cores (CPU processes: more ranks than cores).

On GPUs each rank owns its device: a stage idle in the pipeline's fill and drain leaves its device
idle, and the bubble is ``(p - 1)`` microbatch times for 1F1B and GPipe (``bubble_units``). When ``R``
ranks share ``C < R`` cores, a rank's measured rate is its share while all ranks compute
(calibrate.py measures it so); a rank idle in its bubble hands its core to the busy ones, which then
run faster, up to one core each. The bubble is then what a timeline simulated with the cores shared
that way leaves over ``m`` microbatch times (processor sharing: ``k`` busy ranks of the node each run
at ``min(R/C, R/k)`` times their contended rate).

The pipeline's replicas (dp, tp, cp ranks) on the node run the same timeline at the same moments,
so ``k`` busy stages of one pipeline are ``k * R / p`` busy ranks. Simulated for 1F1B and GPipe with
``v = 1``; other schedules keep their GPU bubble. Each stage runs at its own cost (the time model's
forward and backward of each stage): the last stage, with the head and the loss, is often heavier
than the others, and the time a lighter stage idles goes to it. Counted as copies of the heaviest stage,
a 4-stage pipeline on 2 cores was predicted 20-40% slower than measured (docs/cost_model.md).

    >>> round(shared_bubble_units("1f1b", pp=4, mb=4, ranks=4, cores=4), 9)  # own cores: p - 1
    3.0
    >>> shared_bubble_units("1f1b", pp=4, mb=4, ranks=4, cores=2) < 3.0
    True
"""

from __future__ import annotations

import functools

F_COST, B_COST = 1.0, 2.0  # one stage's forward and backward of one microbatch (backward ~ 2x forward)
SIMULATED = ("1f1b", "gpipe")


def _program(schedule: str, pp: int, mb: int, stage: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s actions in order: ("F"|"B", microbatch)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(mb)] + [("B", i) for i in range(mb)]
    warm = min(pp - stage - 1, mb)
    out = [("F", i) for i in range(warm)]
    for i in range(mb - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", i) for i in range(mb - warm, mb)]


@functools.lru_cache(maxsize=1024)
def shared_bubble_units(schedule: str, pp: int, mb: int, ranks: int, cores: float,
                        costs: tuple[tuple[float, float], ...] | None = None, unit: float = F_COST + B_COST) -> float:
    """Idle time in units of one microbatch's forward + backward on a stage (as ``bubble_units``) of
    a ``pp``-stage pipeline whose node runs ``ranks`` ranks on ``cores`` cores; 0 for pp = 1.

    ``costs``: per stage, its (forward, backward) of one microbatch at the contended rate, in the
    units of ``unit``, the forward + backward of the stage the bubble is counted on (None: every
    stage alike, F_COST and B_COST). Stages of unequal cost (the last one's head and loss) leave the
    lighter ranks idle sooner, and their cores go to the busy ones: the step is the timeline's end,
    ``(mb + units) * unit``, which may be under ``mb * unit`` (negative units) when the stage
    counted on ran faster than its contended rate while the others waited."""
    if pp <= 1:
        return 0.0
    costs = costs or ((F_COST, B_COST),) * pp
    alone = max(1.0, ranks / cores) if cores > 0 else 1.0  # a rank alone on a core vs its contended share
    programs = [_program(schedule, pp, mb, s) for s in range(pp)]
    position = [0] * pp
    left = [0.0] * pp  # work left of the current action (0: not started)
    done: set[tuple[str, int, int]] = set()
    now = 0.0

    def ready(s: int) -> bool:
        if position[s] >= len(programs[s]):
            return False
        op, i = programs[s][position[s]]
        if op == "F":
            return s == 0 or ("F", s - 1, i) in done
        return s == pp - 1 or ("B", s + 1, i) in done

    while any(position[s] < len(programs[s]) for s in range(pp)):
        busy = [s for s in range(pp) if ready(s)]
        if not busy:
            raise ValueError(f"{schedule} pp={pp} mb={mb}: no stage can run (a schedule error)")
        speed = min(alone, pp / len(busy))  # k busy stages are k * ranks / pp busy ranks
        for s in busy:
            if left[s] == 0.0:
                left[s] = costs[s][0] if programs[s][position[s]][0] == "F" else costs[s][1]
        step = min(left[s] for s in busy) / speed
        now += step
        for s in busy:
            left[s] -= step * speed
            if left[s] <= 1e-12 * unit:
                op, i = programs[s][position[s]]
                done.add((op, s, i))
                position[s] += 1
                left[s] = 0.0
    return now / unit - mb


__all__ = ["shared_bubble_units", "SIMULATED"]
