"""Plan items usc cannot run yet, or that contradict each other: refused by name, never ignored.

A table of checks, one per rule: each names the plan item the error points at (its line and
column), when it applies, and what to say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from usc.dsl import OPTIONS

SUPPORTED_AXES = ("dp", "tp", "cp", "pp", "ep")
EXECUTED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
NOT_BUILT: tuple[str, ...] = ()  # options whose value other than the default is refused


@dataclass(frozen=True)
class PlanCheck:
    item: Callable[[object], str]  # the axis/option the error points at
    fails: Callable[[object], bool]
    message: Callable[[object], str]
    hint: str


def _shown(value) -> str:
    return "on" if value is True else "off" if value is False else str(value)


CHECKS = [
    PlanCheck(lambda p: "zero", lambda p: bool(p.get("zero")) and p.size("dp") == 1,
              lambda p: "ZeRO shards optimizer state, gradients and parameters over dp and needs dp>1",
              "add dp=N (N>1) or remove zero="),
    *[PlanCheck(lambda p, n=name: n, lambda p, n=name: p.is_set(n) and p.get(n) != OPTIONS[n].default,
                lambda p, n=name: f"option {n} is not implemented yet (only {n}={_shown(OPTIONS[n].default)} today)",
                f"remove the {name} option") for name in NOT_BUILT],
    PlanCheck(lambda p: "sp", lambda p: bool(p.get("sp")) and p.size("tp") == 1,
              lambda p: "sp=on (sequence parallelism) shards activations over the tp axis and needs tp>1",
              "add tp=N (N>1) or remove sp=on"),
    PlanCheck(lambda p: "schedule", lambda p: p.size("pp") > 1 and p.get("schedule") not in EXECUTED_SCHEDULES,
              lambda p: f"schedule={p.get('schedule')} can be drawn (usc-lint --schedule) but not executed yet; "
                        f"{', '.join(EXECUTED_SCHEDULES)} run", "use schedule=zb"),
    PlanCheck(lambda p: "v", lambda p: p.size("pp") > 1 and int(p.get("v")) > 1 and p.get("schedule") != "interleaved",
              lambda p: f"v={p.get('v')} virtual stages per rank need schedule=interleaved "
                        f"(schedule={p.get('schedule')} runs one stage per rank)", "add schedule=interleaved"),
    PlanCheck(lambda p: "mb", lambda p: p.size("pp") > 1 and p.get("schedule") == "interleaved"
              and int(p.get("mb")) % p.size("pp") != 0,
              lambda p: f"schedule=interleaved sends microbatches through the chunks in groups of pp, so mb must be "
                        f"a multiple of pp={p.size('pp')}, got mb={p.get('mb')}",
              "use mb=a multiple of pp"),
    # ZB-H1 runs each backward as two passes (input gradients, then weight gradients): a selective
    # region allows one backward, and a fully recomputed one would run, and communicate, twice
    # (found by the all-dimension property suite: cp=2 pp=2 schedule=zb recompute=full was off).
    PlanCheck(lambda p: "recompute", lambda p: p.size("pp") > 1 and p.get("schedule") == "zb"
              and p.get("recompute") != "none",
              lambda p: f"recompute={p.get('recompute')} with schedule=zb is not implemented yet (zb splits every "
                        "backward into an input-gradient and a weight-gradient pass)",
              "use schedule=1f1b or interleaved with recompute, or zb without it"),
    PlanCheck(lambda p: "zero", lambda p: p.size("pp") > 1 and int(p.get("zero")) == 3,
              lambda p: "zero=3 with pp>1 is not implemented yet", "use zero=1 or zero=2"),
    PlanCheck(lambda p: "schedule" if p.is_set("schedule") else "v",
              lambda p: p.size("pp") == 1 and (p.is_set("schedule") or p.is_set("v")),
              lambda p: "schedule and v choose how pipeline stages run and need pp>1", "add pp=N"),
    PlanCheck(lambda p: "split", lambda p: p.get("split") != "auto" and p.size("pp") == 1,
              lambda p: "split names pipeline cut points and needs pp>1", "add pp=N or remove split="),
    PlanCheck(lambda p: "split", lambda p: p.get("split") != "auto" and p.size("pp") > 1
              and len(p.get("split")) != p.size("pp") * int(p.get("v")) - 1,
              lambda p: f"split names {len(p.get('split'))} cut point(s) but pp={p.size('pp')}"
                        f"{' v=' + str(p.get('v')) if int(p.get('v')) > 1 else ''} has "
                        f"{p.size('pp') * int(p.get('v'))} stages: name the module each stage after the "
                        f"first starts at ({p.size('pp') * int(p.get('v')) - 1} paths, 'a|b|...')",
              "use split=auto to let usc choose"),
    PlanCheck(lambda p: "cp_mode", lambda p: p.is_set("cp_mode") and p.size("cp") == 1,
              lambda p: "cp_mode chooses how attention runs under context parallelism and needs cp>1",
              "add cp=N (N>1) or remove cp_mode"),
    PlanCheck(lambda p: "ep", lambda p: p.size("ep") > 1 and p.size("dp") % p.size("ep") != 0,
              lambda p: f"ep={p.size('ep')} must divide dp={p.size('dp')}: expert-parallel ranks are carved from "
                        "the data-parallel ranks", "use dp=N with N a multiple of ep (e.g. 'dp=4 ep=2')"),
    PlanCheck(lambda p: "zero", lambda p: p.size("ep") > 1 and bool(p.get("zero")),
              lambda p: "zero>0 with ep>1 is not implemented yet", "remove zero= or ep="),
    *[PlanCheck(lambda p: "capacity_factor", lambda p, a=axis: p.is_set("capacity_factor") and p.size(a) > 1,
                lambda p, a=axis: f"capacity_factor with {a}>1 is not implemented yet (tokens drop by their "
                                  "global order in the batch)", f"remove capacity_factor= or {axis}=")
      for axis in ("cp", "pp")],
    PlanCheck(lambda p: "capacity_factor", lambda p: p.is_set("capacity_factor") and int(p.get("mb")) > 1,
              lambda p: "capacity_factor with mb>1 is not implemented yet (capacity is per batch)",
              "remove capacity_factor= or mb="),
    PlanCheck(lambda p: "auto", lambda p: p.auto,
              lambda p: "auto must be resolved by the planner before compiling (usc.compile/lint/simulate and "
                        "usc.plan do it)", "call usc.plan(model, plan, example_inputs=...)"),
    *[PlanCheck(lambda p, n=name: n, lambda p, n=name: p.is_set(n) and not p.auto,
                lambda p, n=name: f"option {n} describes what to plan for and is only read with auto",
                f"add auto, or remove {name}=") for name in ("gpus", "seq", "global_batch", "hardware")],
]
RULE_ACTIONS = ("colwise", "rowwise", "vocab", "replicate", "recompute", "expert")


def check_supported(plan) -> None:
    """Refuse, by name and position, plan items whose pass does not exist yet."""
    for axis in plan.mesh_axes:
        if axis not in SUPPORTED_AXES and plan.size(axis) > 1:
            raise plan.error_at(axis, f"mesh axis '{axis}' is not implemented yet (supported today: "
                                      f"{', '.join(SUPPORTED_AXES)})", hint=f"remove {axis}={plan.size(axis)}")
    for check in CHECKS:
        if check.fails(plan):
            raise plan.error_at(check.item(plan), check.message(plan), hint=check.hint)
    for rule in plan.rules:
        for action in rule.actions:
            if action.name not in RULE_ACTIONS:
                raise plan.error_at(rule, f"rule action '{action}' is not implemented yet "
                                          f"(supported today: {', '.join(RULE_ACTIONS)})")
