"""``usc-lint FILE.py:FACTORY --plan "dp=2 tp=2"``: show every collective and check the plan before anything runs.

FACTORY is a function in FILE.py that returns ``(model, example_inputs)``. Findings carry codes
(USC1xx errors, USC2xx warnings, USC3xx notes; ``--explain CODE``). Exit status: 0 when the plan
has no errors, 1 when it has errors (with ``--strict``: or warnings), 2 for bad command-line use.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from usc.compiler.hardware import HardwareProfileError
from usc.dsl import PlanError


class UsageError(Exception):
    """Bad command-line use: exit status 2."""


def _load_factory(spec: str | None):
    if spec is None:
        raise UsageError("give the model as FILE.py:FACTORY")
    if ":" not in spec:
        raise UsageError(f"expected FILE.py:FACTORY, got '{spec}'")
    path, name = spec.rsplit(":", 1)
    file = Path(path)
    if not file.exists():
        raise UsageError(f"no such file '{path}'")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.parent.resolve()))
    module_spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise UsageError(f"'{path}' has no function '{name}'")
    return getattr(module, name)


def _plan_text(args) -> str:
    if args.plan_file:
        return Path(args.plan_file).read_text()
    if args.plan is None:
        raise UsageError("give --plan \"dp=2 tp=2\" or --plan-file PLAN.usc")
    return args.plan


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="usc-lint", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", help="FILE.py:FACTORY, FACTORY() returning (model, example_inputs)")
    p.add_argument("--plan", help="plan text, e.g. \"dp=2 tp=2\"")
    p.add_argument("--plan-file", help="a .usc file with the plan")
    p.add_argument("--json", action="store_true", help="print the report and findings as JSON (= --format json)")
    p.add_argument("--format", choices=("text", "json", "github"), default=None,
                   help="text (default), json, or github (GitHub Actions annotations ::error file=...::msg)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    p.add_argument("--hardware", metavar="h100|a100|FILE",
                   help="the GPU: memory is checked against its capacity (default h100); given, the report adds "
                        "the cost model's time breakdown (compute, exposed communication, bubble, tokens/s, MFU)")
    p.add_argument("--explain", nargs="?", const="", metavar="CODE",
                   help="explain a rule code (e.g. USC201); without a code, list every rule")
    p.add_argument("--diff", nargs=2, metavar=("PLAN_A", "PLAN_B"),
                   help="compare two plans side by side: collectives, memory per rank, step time, and why")
    p.add_argument("--kernels", action="store_true",
                   help="print the Triton source generated for every fused region (plans with fuse=on)")
    p.add_argument("--schedule", action="store_true",
                   help="print the pipeline schedule of the plan's pp/mb/schedule/v (timeline per rank, "
                        "bubble, in-flight microbatches) and exit; needs no model")
    p.add_argument("--schedule-png", metavar="FILE",
                   help="with --schedule: also draw the timeline to FILE (.png, .svg; needs matplotlib)")
    return p


def print_schedule(plan_text: str, as_json: bool, png: str | None = None) -> int:
    """The schedule is data: generated, checked and drawn without running (or tracing) anything."""
    from usc.dsl import parse_plan
    from usc.passes.pipeline_schedule import build_schedule, refuse_unimplemented
    from usc.passes.pipeline_schedule_check import check_schedule, render_timeline

    plan = parse_plan(plan_text)
    refuse_unimplemented(plan)
    pp, v, mb, name = plan.size("pp"), int(plan.get("v")), int(plan.get("mb")), plan.get("schedule")
    schedule = build_schedule(name, pp, v, mb)
    metrics = check_schedule(schedule)
    if png is not None:
        from usc.passes.pipeline_schedule_png import draw_timeline

        draw_timeline(schedule, png)
    if as_json:
        print(json.dumps({"schedule": str(schedule), "makespan": metrics.makespan,
                          "bubble_fraction": metrics.bubble_fraction, "bubble_ratio": metrics.bubble_ratio,
                          "peak_in_flight": list(metrics.peak_in_flight)}))
        return 0
    print(f"schedule {name}: pp={pp} v={v} mb={mb} (unit costs: forward 1, backward 2)")
    print(render_timeline(schedule))
    print(f"makespan {metrics.makespan:g}; bubble {metrics.bubble_fraction:.1%} of the makespan "
          f"(idle/compute {metrics.bubble_ratio:.3f}); peak in-flight microbatches per rank "
          f"{', '.join(str(n) for n in metrics.peak_in_flight)}")
    return 0


def explain_rules(code: str) -> int:
    from usc.compiler import lint_checks  # noqa: F401 - registers the rules
    from usc.compiler.lint_rules import explain, rules_table

    if not code:
        print(rules_table())
        return 0
    try:
        print(explain(code))
    except KeyError as err:
        print(f"usc-lint: {err.args[0]}", file=sys.stderr)
        return 2
    return 0


def _output_format(args) -> str:
    return "json" if args.json else (args.format or "text")


def print_diff(args) -> int:
    """Lint both plans (one trace when their microbatches agree) and print them side by side."""
    from usc.compiler.plan_diff import diff_reports, render_diff
    from usc.lint_format import finding_lines
    from usc.linting import lint_plan

    model, example_inputs = _load_factory(args.target)()
    results, traced, traced_mb = [], None, None
    for text in args.diff:
        mb = _mb(text)
        result = lint_plan(model, text, example_inputs=example_inputs, hardware=args.hardware or "h100",
                           traced=traced if mb == traced_mb else None)
        traced, traced_mb = result.traced, mb
        results.append(result)
    a, b = results
    for label, result in (("A", a), ("B", b)):
        if result.report is None:
            print(f"plan {label} \"{result.plan_text}\" does not compile:", file=sys.stderr)
            print("\n".join(finding_lines(result)), file=sys.stderr)
            return 1
    rows = diff_reports(a.report, b.report, a.plan, b.plan,
                        estimate_time=_cost_model(model, example_inputs, args.hardware or "h100"))
    if _output_format(args) == "json":
        print(json.dumps({"a": a.plan_text, "b": b.plan_text,
                          "rows": [r.__dict__ | {"changed": r.changed} for r in rows]}, indent=2))
    else:
        print(f"A: {a.plan_text}\nB: {b.plan_text}\n")
        print(render_diff(rows, "A", "B"))
    return max(a.exit_code(strict=args.strict), b.exit_code(strict=args.strict))


def _cost_model(model, example_inputs, hardware):
    """(report, plan) -> {step, compute, exposed_comm, bubble, ...} seconds: the cost model, profiled once."""
    from usc.planning import estimate_plan
    from usc.passes.cost_profile import profile_model

    batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    profile = profile_model(model, batch)
    return lambda report, plan: estimate_plan(model, plan, batch, hardware, profile).time


def _mb(text: str) -> str | None:
    try:
        from usc.dsl import parse_plan
        return str(parse_plan(text).get("mb"))
    except PlanError:
        return None


def lint_target(args) -> int:
    from usc.build import as_batch
    from usc.lint_format import render_github, render_json, render_text
    from usc.linting import lint_plan

    plan = _plan_text(args)
    model, example_inputs = _load_factory(args.target)()
    result = lint_plan(model, plan, example_inputs=example_inputs, hardware=args.hardware or "h100")
    if result.compiled is not None:  # the cost model's breakdown with --hardware, the planner's reasons for auto
        result.compiled._attach_cost(as_batch(example_inputs), args.hardware)
    fmt = _output_format(args)
    if args.kernels and result.report is not None:
        from usc.compiler.report_text import render_kernels

        print(render_kernels(result.report))
        return result.exit_code(strict=args.strict)
    if fmt == "json":
        print(render_json(result))
    elif fmt == "github":
        # positions are in the plan: they point into the file only when the plan came from one
        print(render_github(result, args.plan_file or args.target.rsplit(":", 1)[0], positions=bool(args.plan_file)))
    elif result.report is None and result.exceptions:  # the compiler's own message, with its caret
        err = result.exceptions[0]
        print(f"usc-lint: {result.findings[0].code if result.findings else ''} {type(err).__name__}: {err}",
              file=sys.stderr)
    else:
        print(render_text(result, args.plan_file))
    return result.exit_code(strict=args.strict)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.schedule_png and not args.schedule:
        print("usc-lint: --schedule-png draws the pipeline schedule; add --schedule", file=sys.stderr)
        raise SystemExit(2)
    try:
        if args.explain is not None:
            return explain_rules(args.explain)
        if args.schedule:
            try:
                return print_schedule(_plan_text(args), args.json, args.schedule_png)
            except (PlanError, ValueError, ImportError) as err:
                print(f"usc-lint: {type(err).__name__}: {err}", file=sys.stderr)
                return 1
        if args.diff:
            return print_diff(args)
        return lint_target(args)
    except UsageError as err:
        print(f"usc-lint: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except HardwareProfileError as err:
        print(f"usc-lint: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
