"""``usc-lint FILE.py:FACTORY --plan "dp=2 tp=2"``: show every collective before anything runs.

FACTORY is a function in FILE.py that returns ``(model, example_inputs)``. Exit status: 0 when
the plan compiles, 1 when the plan or the model has an error (printed with its position), 2 for
bad command-line use.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from usc.compiler.errors import CompileError
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
    p.add_argument("--json", action="store_true", help="print the report as JSON")
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
    from usc.passes.pipeline_schedule import build_schedule
    from usc.passes.pipeline_schedule_check import check_schedule, render_timeline

    plan = parse_plan(plan_text)
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


def main(argv: list[str] | None = None) -> int:
    import usc

    args = parser().parse_args(argv)
    if args.schedule_png and not args.schedule:
        print("usc-lint: --schedule-png draws the pipeline schedule; add --schedule", file=sys.stderr)
        raise SystemExit(2)
    if args.schedule:
        try:
            return print_schedule(_plan_text(args), args.json, args.schedule_png)
        except UsageError as err:
            print(f"usc-lint: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except (PlanError, ValueError, NotImplementedError, ImportError) as err:
            print(f"usc-lint: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
    try:
        plan = _plan_text(args)
        model, example_inputs = _load_factory(args.target)()
    except UsageError as err:
        print(f"usc-lint: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        report = usc.lint(model, plan, example_inputs=example_inputs)
    except (PlanError, CompileError) as err:
        if args.json:
            print(json.dumps({"error": type(err).__name__, "message": str(err),
                              "line": getattr(err, "line", None), "column": getattr(err, "column", None)}))
        else:
            print(f"usc-lint: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if args.kernels:
        from usc.compiler.report_text import render_kernels
        print(render_kernels(report))
        return 0
    print(report.to_json() if args.json else str(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
