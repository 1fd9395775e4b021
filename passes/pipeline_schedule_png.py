"""The schedule timeline as a picture (``usc-lint --schedule --schedule-png FILE``).

The same dry run as ``render_timeline`` (unit costs F=1, B=2, I=W=1), drawn with matplotlib: one
row per rank, one box per compute action as long as its cost, coloured by what it computes and
labelled with the microbatch (``c1:3`` is chunk 1, microbatch 3 when v > 1, drawn in a lighter
tint than chunk 0); the white gaps are the bubble. matplotlib is an optional dependency
(``pip install matplotlib`` or the ``test`` extra).

Example::

    >>> from usc.passes.pipeline_schedule import build_schedule
    >>> draw_timeline(build_schedule("zb", pp=4, v=1, mb=8), "zb.png")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .pipeline_schedule import Compute, ComputeOp, Schedule
from .pipeline_schedule_check import UNIT_COSTS, simulate, timeline_metrics

# Colour of each kind of work (colour-blind safe Okabe-Ito palette); one legend entry each.
COLOURS: Mapping[ComputeOp, tuple[str, str]] = {
    ComputeOp.FORWARD: ("#56B4E9", "F forward"),
    ComputeOp.BACKWARD: ("#009E73", "B backward"),
    ComputeOp.INPUT_GRAD: ("#E69F00", "I input gradient"),
    ComputeOp.WEIGHT_GRAD: ("#CC79A7", "W weight gradient"),
}


class MissingMatplotlib(ImportError):
    """--schedule-png needs matplotlib, which usc does not require."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MissingMatplotlib(
            "drawing the schedule needs matplotlib, which is not installed; "
            "run `pip install matplotlib` (or install usc with the `test` extra)"
        ) from err
    return plt


def _label(act: Compute, schedule: Schedule) -> str:
    if schedule.v == 1:
        return str(act.mb)
    return f"c{act.stage // schedule.pp}:{act.mb}"


def _shade(colour: str, chunk: int, v: int) -> tuple[float, float, float]:
    """Later chunks of a rank (v > 1) in lighter tints of the same colour."""
    mix = 0.55 * chunk / max(v - 1, 1)
    rgb = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return tuple(c + (1.0 - c) * mix for c in rgb)


@dataclass(frozen=True)
class Box:
    """One drawn compute action: its row, start, length, colour and label."""

    rank: int
    start: float
    length: float
    colour: tuple[float, float, float]
    label: str


def timeline_boxes(schedule: Schedule, *, costs: Mapping[ComputeOp, float] = UNIT_COSTS) -> list[Box]:
    """What ``draw_timeline`` draws, as data (sends and recvs take no time and are not drawn)."""
    boxes = []
    for rank, row in enumerate(simulate(schedule, costs=costs).slots):
        for slot in row:
            if isinstance(slot.action, Compute):
                colour = _shade(COLOURS[slot.action.op][0], slot.action.stage // schedule.pp, schedule.v)
                boxes.append(Box(rank, slot.start, slot.end - slot.start, colour, _label(slot.action, schedule)))
    return boxes


def draw_timeline(schedule: Schedule, path: str | Path, *,
                  costs: Mapping[ComputeOp, float] = UNIT_COSTS) -> Path:
    """Write the timeline of ``schedule`` to ``path`` (format from the suffix, e.g. .png or .svg)."""
    plt = _pyplot()
    timeline = simulate(schedule, costs=costs)
    metrics = timeline_metrics(timeline)
    width = max(6.0, min(40.0, 0.35 * timeline.makespan + 1.5))
    fig, ax = plt.subplots(figsize=(width, 0.55 * schedule.pp + 1.4))
    for box in timeline_boxes(schedule, costs=costs):
        ax.barh(box.rank, box.length, left=box.start, height=0.8, color=box.colour, edgecolor="black",
                linewidth=0.6)
        ax.text(box.start + box.length / 2, box.rank, box.label, ha="center", va="center",
                fontsize=7 if schedule.v > 1 else 8)
    used = {slot.action.op for row in timeline.slots for slot in row if isinstance(slot.action, Compute)}
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[op][0]) for op in COLOURS if op in used]
    ax.legend(handles, [COLOURS[op][1] for op in COLOURS if op in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if schedule.pp < 3 else -0.2), ncol=4, frameon=False, fontsize=8)
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.set_ylim(schedule.pp - 0.5, -0.5)  # rank 0 on top, as in the text picture
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time (one forward = 1)" + ("; lighter boxes: later chunks" if schedule.v > 1 else ""))
    ax.set_title(f"{schedule.name}  pp={schedule.pp} v={schedule.v} mb={schedule.mb}:  bubble "
                 f"{metrics.bubble_fraction:.1%} of {timeline.makespan:g} (idle/compute {metrics.bubble_ratio:.3f})",
                 fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
