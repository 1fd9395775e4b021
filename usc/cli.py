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


def _load_factory(spec: str):
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
    p.add_argument("target", help="FILE.py:FACTORY, FACTORY() returning (model, example_inputs)")
    p.add_argument("--plan", help="plan text, e.g. \"dp=2 tp=2\"")
    p.add_argument("--plan-file", help="a .usc file with the plan")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    import usc

    args = parser().parse_args(argv)
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
    print(report.to_json() if args.json else str(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
