"""usc-lint's three outputs: text (report, memory table, schedule picture, findings), JSON, and
GitHub Actions annotations (``::error file=...,line=...::message``)."""

from __future__ import annotations

import json

from usc.compiler.lint_checks import memory_terms
from usc.runtime.sizes import human_bytes

from .linting import LintResult

_GITHUB_LEVEL = {"error": "error", "warning": "warning", "note": "notice"}


def memory_table(result: LintResult) -> list[str]:
    report = result.report
    if report is None:
        return []
    terms = memory_terms(report)
    total = sum(b for _, b in terms)
    lines = [f"memory per rank (predicted, zero={report.zero_stage}):"]
    lines += [f"  {name:<16} {human_bytes(nbytes):>11}" for name, nbytes in terms]
    if report.activation_bytes is None:
        lines.append(f"  {'activations':<16} {'n/a':>11}  (pipeline stages: not in this table; with --hardware the "
                     "cost model's memory per rank (time breakdown) counts them)")
    capacity = ""
    if result.hardware is not None:
        capacity = f"  ({total / result.hardware.hbm_bytes:.0%} of the {result.hardware.name}'s " \
                   f"{human_bytes(result.hardware.hbm_bytes)})"
    lines.append(f"  {'total':<16} {human_bytes(total):>11}{capacity}")
    return lines


def _where(result: LintResult, finding, plan_file: str | None) -> str:
    at = result.location(finding)
    name = plan_file or "plan"
    return f"{name}:{at[0]}:{at[1]}: " if at else f"{name}: "


def _caret(result: LintResult, finding) -> list[str]:
    """The plan line the finding points at, and a caret under the word (as PlanError shows it)."""
    at = result.location(finding)
    lines = result.plan_text.splitlines()
    if at is None or not 1 <= at[0] <= len(lines) or at[1] > len(lines[at[0] - 1]):
        return []
    text = lines[at[0] - 1]
    word = (text[at[1] - 1:].split() or [""])[0]
    return [f"    {text}", "    " + " " * (at[1] - 1) + "^" * max(1, len(word))]


def finding_lines(result: LintResult, plan_file: str | None = None) -> list[str]:
    lines = []
    for f in result.findings:
        lines.append(f"{_where(result, f, plan_file)}{f.code} [{f.severity}] {f.message}")
        if f.severity == "error":
            lines += _caret(result, f)
        if f.hint:
            lines.append(f"    hint: {f.hint}")
    n = result.counts()
    lines.append(f"found {n['error']} error(s), {n['warning']} warning(s), {n['note']} note(s)"
                 + ("; usc-lint --explain CODE says more" if result.findings else ""))
    return lines


def render_text(result: LintResult, plan_file: str | None = None) -> str:
    parts = []
    if result.report is not None:
        parts += [str(result.report), ""] + memory_table(result)
    if result.schedule_picture:
        parts += ["", "pipeline schedule (unit costs: forward 1, backward 2):", result.schedule_picture]
    if parts:
        parts.append("")
    return "\n".join(parts + finding_lines(result, plan_file))


def _finding_dict(result: LintResult, f) -> dict:
    at = result.location(f)
    return {"code": f.code, "name": f.rule.name, "severity": f.severity, "message": f.message, "hint": f.hint,
            "module": f.module, "line": at[0] if at else None, "column": at[1] if at else None}


def render_json(result: LintResult) -> str:
    data = result.report.to_dict() if result.report is not None else {"plan": result.plan_text}
    data["findings"] = [_finding_dict(result, f) for f in result.findings]
    data["counts"] = result.counts()
    first = next((e for e in result.exceptions), None)
    if result.report is None and first is not None:  # the compiler's own error, with its position
        data |= {"error": type(first).__name__, "message": str(first),
                 "line": getattr(first, "line", None), "column": getattr(first, "column", None)}
    elif result.report is None:  # refused by a check before compiling: the first error, as a PlanError
        error = next(f for f in data["findings"] if f["severity"] == "error")
        data |= {"error": "PlanError", "message": error["message"], "line": error["line"], "column": error["column"]}
    return json.dumps(data, indent=2)


def _escape(text: str, *, prop: bool = False) -> str:
    """GitHub's workflow-command escaping (actions/toolkit, command.ts)."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def render_github(result: LintResult, file: str, *, positions: bool = True) -> str:
    """One annotation per finding; ``positions``: ``file`` holds the plan, so line/col point into it."""
    lines = []
    for f in result.findings:
        at = result.location(f) if positions else None
        props = [f"file={_escape(file, prop=True)}"]
        if at:
            props += [f"line={at[0]}", f"col={at[1]}"]
        props.append(f"title={_escape(f'{f.code} {f.rule.name}', prop=True)}")
        message = f.message + (f" (hint: {f.hint})" if f.hint else "")
        lines.append(f"::{_GITHUB_LEVEL[f.severity]} {','.join(props)}::{_escape(message)}")
    return "\n".join(lines)
