"""Text of the cost model's answers: the time breakdown of one plan and the planner's choice."""

from __future__ import annotations

from usc.dsl import parse_plan
from usc.runtime.sizes import human_bytes

from .cost_model import TIME_TERMS


def cost_sections(report) -> list[str]:
    """What the report adds when the cost model ran: the planner's choice, the time breakdown."""
    lines = []
    if report.plan_search is not None:
        lines += ["", str(report.plan_search)]
    elif report.cost is not None:
        lines += [""] + render_time_breakdown(report.cost)
    return lines


def cost_dict(report) -> dict:
    """The JSON form of the same sections."""
    out = {}
    if report.cost is not None:
        out["time_breakdown"] = estimate_dict(report.cost)
    if report.plan_search is not None:
        s = report.plan_search
        out["planner"] = {"chosen": s.best.plan.text() if s.best else None,
                          "alternatives": [{"plan": c.plan.text(), "why_lost": s.why_lost(c),
                                            **estimate_dict(c.estimate)} for c in s.alternatives],
                          "rejected": dict(s.rejected), "evaluated": s.evaluated,
                          "skipped_shapes": s.skipped_shapes, "skipped_zero_stages": s.skipped_zero_stages,
                          "families": {name: best if isinstance(best, str) else
                                       {"plan": best.plan.text(), **estimate_dict(best.estimate)}
                                       for name, best in s.families.items()},
                          "unchecked_terms": s.unchecked_terms if s.best is not None else []}
    return out


def estimate_dict(est) -> dict:
    return {"hardware": est.hardware, "seconds": dict(est.time), "tokens_per_second": est.tokens_per_second,
            "mfu": est.mfu, "memory_bytes": {k: int(v) for k, v in est.memory.items()},
            "pipeline_transfer_seconds": est.pipeline_transfer}


def _ms(seconds: float) -> str:
    """Milliseconds, or microseconds for the tiny steps of small models."""
    return f"{seconds * 1e3:,.1f} ms" if abs(seconds) >= 1e-3 or seconds == 0 else f"{seconds * 1e6:,.1f} us"


def render_time_breakdown(est) -> list[str]:
    """The usc-lint section: per step, compute / exposed communication / bubble, tokens/s and MFU."""
    t = est.time
    step = t["step"]
    lines = [f"time breakdown per step on {est.hardware} (cost model estimate, {est.plan.world} GPUs):"]
    for key, label in TIME_TERMS.items():
        if key == "host" and not t[key]:
            continue  # the device outruns the host's launches: nothing waits
        lines.append(f"  {label:<22} {_ms(t[key]):>12}  {t[key] / step:6.1%}")
    lines.append(f"  {'step':<22} {_ms(step):>12}")
    exposed = {}
    for c in est.collectives:
        exposed[c.axis] = exposed.get(c.axis, 0.0) + c.exposed_seconds
    if exposed:
        parts = ", ".join(f"{axis} {_ms(s)}" for axis, s in sorted(exposed.items(), key=lambda kv: -kv[1]))
        lines.append(f"  exposed communication by axis: {parts}")
    if est.pipeline_transfer:
        lines.append(f"  each pipeline transfer across nodes takes {_ms(est.pipeline_transfer)} beyond its bytes at "
                     f"{est.plan.nodes} nodes (the profile's pipeline_transfer_seconds_by_nodes, read from measured runs)")
    lines.append(f"  {est.tokens_per_second:,.0f} tokens/s, MFU {est.mfu:.1%}; memory per rank "
                 f"{human_bytes(est.memory_total)} (largest: {est.largest_memory_term})")
    return lines


def render_search(search) -> str:
    """The planner's answer: the choice, its estimate, the runners-up and why each lost."""
    t = search.target
    head = (f"planner: {t.gpus} GPUs ({t.gpus_per_node} per node, {search.hardware}), seq {t.seq}, "
            f"global batch {t.global_batch}; {search.evaluated} plans estimated in {search.seconds:.2f} s"
            + (f" ({search.skipped_shapes} mesh shapes and {search.skipped_zero_stages} ZeRO stages of the others "
               "skipped: their step floor is over every plan shown)"
               if search.skipped_shapes or search.skipped_zero_stages else ""))
    lines = [head] + ([f"  {t.assumption}"] if t.assumption else [])
    if search.best is None:
        lines.append("  no plan fits: " + "; ".join(f"{n} x {r} (e.g. {search.rejected_examples[r]})"
                                                    for r, n in search.rejected.items()))
        return "\n".join(lines)
    best = search.best
    lines.append(f"  chosen: {parse_plan(best.plan.text())}")  # as the report's header writes it
    lines += ["  " + line for line in render_time_breakdown(best.estimate)]
    if search.alternatives:
        lines.append("  alternatives (best plan of each other mesh shape) and why they lost:")
        for c in search.alternatives:
            lines.append(f"    {c.plan.text():<58} {c.estimate.tokens_per_second:>12,.0f} tok/s  "
                         f"{search.why_lost(c)}")
    lines += _families(search) + _unchecked(search)
    if search.rejected:
        lines.append("  dropped:")
        for reason, n in sorted(search.rejected.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {n:>5} x {reason} (e.g. {search.rejected_examples[reason]})")
    return "\n".join(lines)


def _families(search) -> list[str]:
    """The best plan of each family (pure dp+ZeRO, dp+tp, dp+pp, dp+tp+pp, +cp, +ep) or why none fits."""
    if not search.families:
        return []
    lines = ["  best of each family (step time, MFU, memory per rank):"]
    for name, best in search.families.items():
        if isinstance(best, str):
            lines.append(f"    {name:<9} {best}")
            continue
        est = best.estimate
        lines.append(f"    {name:<9} {best.plan.text():<58} {_ms(best.step):>12}  MFU {est.mfu:5.1%}  "
                     f"{human_bytes(est.memory_total)}")
    return lines


def _unchecked(search) -> list[str]:
    """Flags a choice that rests on a term no measurement has checked, with the best plan that does not."""
    terms = search.unchecked_terms
    if not terms:
        return []
    lines = [f"  caution: the choice rests on terms no measurement has checked: {'; '.join(terms)}"]
    checked = search.best_checked
    if checked is not None:
        lines.append(f"    best plan relying on none: {checked.plan.text()} ({_ms(checked.step)}, "
                     f"{checked.step / search.best.step - 1:+.1%} predicted step time)")
    return lines
