"""The usc-lint rule registry: every check has a code, a name, a severity and an explanation.

Codes follow ruff's style: ``USC1xx`` are errors (the plan cannot run, or would run wrong or
hang), ``USC2xx`` warnings (it runs, but slower or bigger than it should), ``USC3xx`` notes
(a cheaper variant exists). A rule is registered beside its check function with :func:`rule`
(``compiler/lint_checks.py``); ``usc-lint --explain USC201`` prints its explanation.

    >>> from usc.compiler import lint_checks  # registers the rules
    >>> RULES["USC201"].name, RULES["USC201"].severity
    ('tp-crosses-node', 'warning')
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

SEVERITIES = ("error", "warning", "note")
_FIRST_DIGIT = {"error": "1", "warning": "2", "note": "3"}


@dataclass(frozen=True)
class Finding:
    """One problem found in a plan. ``item`` is the plan item it points at (an axis or option name,
    for its line and column); ``module`` the model module it is about, when there is one."""

    code: str
    message: str
    item: str | None = None
    hint: str = ""
    module: str = ""
    line: int | None = None  # a position in the plan text, when known without ``item``
    column: int | None = None

    @property
    def rule(self) -> "LintRule":
        return RULES[self.code]

    @property
    def severity(self) -> str:
        return self.rule.severity


@dataclass(frozen=True)
class LintInput:
    """What the checks read: plain values the glue computed (no check traces or compiles).

    plan: the parsed Plan. facts: ModelFacts of the traced model (None when tracing failed).
    report / program: the compile report and per-rank program (None when compiling failed).
    hardware: a HardwareProfile (device capacity). schedule: ScheduleMetrics of a pp plan.
    bubble_at: mb -> bubble fraction of the plan's schedule (to suggest a microbatch count).
    stage_flops: estimated FLOPs per pipeline stage. order_problems: whole-mesh order check
    results. errors: exceptions raised while parsing/tracing/compiling.
    """

    plan: Any = None
    facts: Any = None
    report: Any = None
    program: Any = None
    hardware: Any = None
    schedule: Any = None
    bubble_at: Callable[[int], float] | None = None
    stage_flops: tuple[float, ...] = ()
    order_problems: tuple = ()
    errors: tuple[BaseException, ...] = ()


Check = Callable[[LintInput], Iterable[Finding]]


@dataclass(frozen=True)
class LintRule:
    code: str
    name: str
    severity: str
    explanation: str
    check: Check = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"{self.code}: severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not (len(self.code) == 6 and self.code.startswith("USC") and self.code[3] == _FIRST_DIGIT[self.severity]):
            raise ValueError(f"{self.code}: a {self.severity} code is USC{_FIRST_DIGIT[self.severity]}xx")


RULES: dict[str, LintRule] = {}


def rule(code: str, name: str, severity: str, explanation: str) -> Callable[[Check], Check]:
    """Register ``check`` under ``code``; the explanation is what ``--explain`` prints."""

    def register(check: Check) -> Check:
        if code in RULES:
            raise ValueError(f"lint rule {code} registered twice")
        RULES[code] = LintRule(code, name, severity, " ".join(explanation.split()), check)
        return check

    return register


def run_rules(inp: LintInput, *, select: Iterable[str] | None = None) -> list[Finding]:
    """Every registered check (or those in ``select``), errors first, each list in code order."""
    codes = sorted(RULES) if select is None else sorted(select)
    found = [f for code in codes for f in RULES[code].check(inp)]
    return sorted(found, key=lambda f: (SEVERITIES.index(f.severity), f.code))


def explain(code: str) -> str:
    """The text ``usc-lint --explain CODE`` prints."""
    key = code.strip().upper()
    if key not in RULES:
        from difflib import get_close_matches

        near = get_close_matches(key, RULES, n=1)
        raise KeyError(f"no lint rule '{code}'" + (f"; did you mean {near[0]}?" if near else "") +
                       " (usc-lint --explain with no code lists them)")
    r = RULES[key]
    return f"{r.code} ({r.name}) [{r.severity}]\n\n{textwrap.fill(r.explanation, 100)}"


def rules_table() -> str:
    """One line per rule: code, severity, name."""
    return "\n".join(f"{r.code}  {r.severity:<7}  {r.name}" for r in (RULES[c] for c in sorted(RULES)))


def counts(findings: Iterable[Finding]) -> dict[str, int]:
    out = {s: 0 for s in SEVERITIES}
    for f in findings:
        out[f.severity] += 1
    return out
