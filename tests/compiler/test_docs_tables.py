"""docs/cost_model.md's tables of predictions are what the benchmarks print now: a change to the cost
model that moves a figure must regenerate the table that shows it. Deep tier (about a minute: the
8B-530B profiles on meta and the sweep's 199 rows)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    ("calibrate.py", "--published"),
    ("playbook_sweep.py", "--tp-scaling"),
    ("playbook_sweep.py", "--planner"),
    ("playbook_sweep.py", "--microbatch-cost"),
    ("planner_speed.py", "--table"),
]


@pytest.mark.skipif(os.environ.get("USC_DEEP_TIER") != "1", reason="deep tier: set USC_DEEP_TIER=1 (about a minute)")
@pytest.mark.parametrize("script,option", COMMANDS)
def test_each_table_row_a_benchmark_prints_is_in_the_docs(script, option):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), option], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| model", "|---"))]
    assert rows, f"{script} {option} printed no table"
    docs = set((ROOT / "docs" / "cost_model.md").read_text(encoding="utf-8").splitlines())
    stale = [row for row in rows if row not in docs]
    assert not stale, f"rows of `python benchmarks/{script} {option}` not in docs/cost_model.md:\n" + "\n".join(stale)
