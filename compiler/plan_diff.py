"""Two plans side by side: what changes in collectives per axis, memory per rank and step time, and why.

    usc-lint FILE.py:FACTORY --diff "tp=8" "tp=4 cp=2"

Rows are computed from the two compile reports; each changed row says which plan axes moved and
what that does to the quantity (``WHY``: one sentence per (quantity, axis) pair). The step-time
rows (step time, compute, exposed communication, bubble) come from the cost model
(``estimate_time(report, plan) -> {part: seconds}``), which usc-lint passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .report import Report
from usc.runtime.sizes import human_bytes

AXES = ("dp", "tp", "cp", "pp", "ep")

# What a change of one axis does to a quantity, in one sentence (the quantity's own axis first).
WHY: dict[tuple[str, str], str] = {
    ("tp", "tp"): "each tp collective moves the activation of the rank's tokens; a bigger group splits "
                  "weights finer but adds ring steps",
    ("tp", "cp"): "cp splits the sequence, so every tp collective carries 1/cp of the tokens",
    ("tp", "dp"): "dp splits the batch, so every tp collective carries 1/dp of the sequences",
    ("tp", "pp"): "pp gives each rank 1/pp of the layers and their tp collectives",
    ("dp", "tp"): "tp shards the weights, so the gradient buckets carry 1/tp of them",
    ("dp", "pp"): "pp gives each rank 1/pp of the layers, so it reduces only its stage's gradients",
    ("dp", "dp"): "a larger dp group adds ring steps; bytes per rank stay ~2x the gradients",
    ("dp", "cp"): "cp ranks also sum gradients of the replicated weights (over dp x cp)",
    ("cp", "cp"): "ring attention passes K/V blocks cp-1 times forward and dK/dV back",
    ("cp", "tp"): "tp splits the heads, so the K/V blocks passed around the cp ring shrink by tp",
    ("pp", "pp"): "pipeline stages send their boundary activations forward and gradients back",
    ("pp", "tp"): "boundary activations are this rank's tp/sp share",
    ("parameters", "tp"): "tp shards the weight matrices",
    ("parameters", "pp"): "pp keeps only the rank's stage trained here",
    ("parameters", "dp"): "zero=3 shards parameters over dp",
    ("gradients", "tp"): "gradients follow the parameters' tp shards",
    ("gradients", "dp"): "zero=2/3 keep only this rank's 1/dp slice of the gradients",
    ("optimizer state", "tp"): "AdamW state follows the parameters' tp shards",
    ("optimizer state", "dp"): "zero>=1 keeps only this rank's 1/dp slice of the AdamW state",
    ("activations", "tp"): "tp splits the hidden activations inside attention and MLP (all of them with sp=on)",
    ("activations", "cp"): "cp splits every activation along the sequence",
    ("activations", "dp"): "dp splits the batch",
    ("step time", "tp"): "tp trades compute per rank for collectives on the critical path",
    ("step time", "cp"): "cp trades compute per rank for ring traffic it mostly overlaps",
    ("step time", "pp"): "pp adds the pipeline bubble and boundary sends, and cuts compute per rank",
    ("step time", "dp"): "dp cuts compute per rank and adds the gradient reduction (mostly overlapped)",
}
OPTION_WHY = {"zero": "the ZeRO stage decides which of gradients/optimizer state/parameters are sliced over dp",
              "mb": "microbatches divide the activations per step and the pipeline bubble",
              "sp": "sp=on shards the norms' activations over tp",
              "dtype": "bf16 halves the bytes of activations and of the collectives that carry them"}


@dataclass(frozen=True)
class DiffRow:
    section: str  # "collectives" | "memory" | "time"
    name: str
    left: str
    right: str
    why: str
    ratio: float | None = None  # right / left, for quantities

    @staticmethod
    def of(section: str, name: str, left: float, right: float, show, why: str) -> "DiffRow":
        return DiffRow(section, name, show(left), show(right), why, right / left if left else None)

    @property
    def changed(self) -> bool:
        return self.left != self.right


def _sizes(plan) -> dict[str, int]:
    return {a: plan.size(a) for a in AXES}


def _moved(plan_a, plan_b) -> list[str]:
    a, b = _sizes(plan_a), _sizes(plan_b)
    return [axis for axis in AXES if a[axis] != b[axis]]


def _why(quantity: str, plan_a, plan_b) -> str:
    moved = _moved(plan_a, plan_b)
    axis_changes = [f"{axis} {plan_a.size(axis)} -> {plan_b.size(axis)}: {WHY[(quantity, axis)]}"
                    for axis in moved if (quantity, axis) in WHY]
    options = [f"{name} {plan_a.get(name)} -> {plan_b.get(name)}: {text}" for name, text in OPTION_WHY.items()
               if plan_a.get(name) != plan_b.get(name)]
    return "; ".join(axis_changes + options)


def _axis_rows(a: Report, b: Report, plan_a, plan_b) -> list[DiffRow]:
    ta, tb = a.totals_by_axis(), b.totals_by_axis()
    rows = []
    for axis in [x for x in AXES if x in ta or x in tb]:
        ca, cb = ta.get(axis, {}), tb.get(axis, {})
        rows.append(DiffRow.of("collectives", f"{axis} calls/step", ca.get("calls", 0), cb.get("calls", 0), str, ""))
        rows.append(DiffRow.of("collectives", f"{axis} bytes/step", ca.get("bytes", 0), cb.get("bytes", 0),
                               human_bytes, _why(axis, plan_a, plan_b)))
    return rows


def _memory_rows(a: Report, b: Report, plan_a, plan_b) -> list[DiffRow]:
    from .lint_checks import memory_terms

    ma, mb = dict(memory_terms(a)), dict(memory_terms(b))
    rows = []
    for name in ("parameters", "gradients", "optimizer state", "activations"):
        if name in ma and name in mb:
            rows.append(DiffRow.of("memory", name, ma[name], mb[name], human_bytes, _why(name, plan_a, plan_b)))
        else:  # activations of pipeline stages are not estimated
            rows.append(DiffRow("memory", name, human_bytes(ma[name]) if name in ma else "n/a",
                                human_bytes(mb[name]) if name in mb else "n/a", _why(name, plan_a, plan_b)))
    rows.append(DiffRow.of("memory", "total", sum(ma.values()), sum(mb.values()), human_bytes, ""))
    return rows


TIME_PARTS = (("step", "step time"), ("compute", "compute"), ("host", "host wait"), ("exposed_comm", "exposed comm"),
              ("bubble", "bubble"))


def human_seconds(t: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale or unit == "us":
            return f"{t / scale:.3g} {unit}"
    return f"{t} s"


def _time_rows(a: Report, b: Report, plan_a, plan_b, estimate_time) -> list[DiffRow]:
    """Step time and its parts from the cost model (``estimate_time(report, plan) -> {part: seconds}``)."""
    if estimate_time is None:
        return [DiffRow("time", "step time", "n/a", "n/a", "no cost model given (estimate_time=None)")]
    ta, tb = estimate_time(a, plan_a), estimate_time(b, plan_b)
    return [DiffRow.of("time", label, ta.get(part, 0.0), tb.get(part, 0.0), human_seconds,
                       _why("step time", plan_a, plan_b) if part == "step" else "")
            for part, label in TIME_PARTS]


def diff_reports(a: Report, b: Report, plan_a, plan_b, *,
                 estimate_time: Callable[[Report, object], dict] | None = None) -> list[DiffRow]:
    """Rows comparing two compiled plans of one model (the plans give the 'why'); ``estimate_time``
    (the cost model) gives the step time and its parts per plan."""
    return _axis_rows(a, b, plan_a, plan_b) + _memory_rows(a, b, plan_a, plan_b) + \
        _time_rows(a, b, plan_a, plan_b, estimate_time)


def render_diff(rows: list[DiffRow], label_a: str, label_b: str) -> str:
    name_w = max(len(r.name) for r in rows)
    left_w = max(len(label_a), *(len(r.left) for r in rows))
    right_w = max(len(label_b), *(len(r.right) for r in rows))
    lines = [f"  {'':<{name_w}}  {label_a:>{left_w}}  {label_b:>{right_w}}"]
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            lines.append(f"{section}:")
        mark = "*" if r.changed else " "
        ratio = f"x{r.ratio:.2f}" if r.changed and r.ratio is not None else ""
        lines.append(f"{mark} {r.name:<{name_w}}  {r.left:>{left_w}}  {r.right:>{right_w}}  {ratio}".rstrip())
        if r.changed and r.why:
            lines.append(f"      why: {r.why}")
    lines.append("(* changed)")
    return "\n".join(lines)
