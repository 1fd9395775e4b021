"""Contiguous partition of a sequence of units (layers) into pipeline stages, balanced by cost or cut
where ``split=`` names: the pipeline split pass cuts the traced graph with it, and the cost model
predicts the same stages with it."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable

Fits = Callable[[int, int, int], bool]
"""``fits(start, stop, part)``: whether units ``start..stop-1`` may form part ``part``."""


class NoCutFits(ValueError):
    """No contiguous partition satisfies the ``fits`` predicate."""


def balanced_cut(costs: list[float], parts: int, fits: Fits | None = None) -> list[int]:
    """Stage of each unit: contiguous, minimising the largest stage cost (exact DP; units are few).

    With ``fits``, only partitions whose every part fits are considered (the pipeline split's
    memory check); NoCutFits when there is none."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (parts + 1) for _ in range(n + 1)]
    cut = [[0] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(1, n + 1):
        for p in range(1, min(parts, i) + 1):
            for j in range(p - 1, i):
                if fits is not None and not fits(j, i, p - 1):
                    continue
                value = max(best[j][p - 1], prefix[i] - prefix[j])
                if value < best[i][p]:
                    best[i][p], cut[i][p] = value, j
    if math.isinf(best[n][parts]):
        raise NoCutFits(f"no contiguous split of {n} units into {parts} parts fits")
    stages, i = [0] * n, n
    for p in range(parts, 0, -1):
        j = cut[i][p]
        for unit in range(j, i):
            stages[unit] = p - 1
        i = j
    return stages


class CutError(ValueError):
    """A split= path that names no layer, or cut points out of order."""


def manual_cut(units: list[str], cuts: tuple[str, ...]) -> list[int]:
    """Stage of each unit when stage k+1 starts at the layer ``cuts[k]`` names."""
    starts = []
    for path in cuts:
        if path not in units:
            inside = [u for u in units if path.startswith(u + ".")]
            close = inside[:1] or difflib.get_close_matches(path, units, n=3)
            why = (f"'{path}' is inside layer '{inside[0]}'; stages are cut between whole layers" if inside
                   else f"'{path}' matches no layer of the model")
            raise CutError(f"{why} (layers: {', '.join(units)})"
                           + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""))
        starts.append(units.index(path))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise CutError(f"cut points must name layers in model order after the first layer "
                       f"('{units[0]}' already starts stage 0): got {'|'.join(cuts)}")
    return [sum(1 for s in starts if s <= i) for i in range(len(units))]
