"""python -m usc.smoke: says so and exits 0 without a GPU; its NCCL plans fit the GPU count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from usc.dsl import parse_plan
from usc.smoke import nccl_plans


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the smoke run is real")
def test_without_a_gpu_it_says_so_and_exits_zero():
    done = subprocess.run([sys.executable, "-m", "usc.smoke"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device is visible" in done.stdout


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_the_nccl_plans_use_every_visible_gpu(gpus):
    plans = nccl_plans(gpus)
    assert plans
    for plan, _ in plans:
        assert parse_plan(plan).world_size == gpus, plan
    axes = {axis for plan, _ in plans for axis in parse_plan(plan).mesh_axes}
    assert axes >= ({"dp"} | ({"ep", "tp", "cp", "pp"} if gpus % 2 == 0 else set()))


# ------------------------------------------------------------------ the table, run on the CPU (--dry)
def test_dry_run_table_on_the_cpu():
    """The smoke's own checks on CPU tensors: a simulated plan against one device, in one table;
    a world of no processes is skipped. (The fused-kernel rows take minutes under the interpreter: the
    deep tier runs the whole table, below.)"""
    import io

    from usc.smoke import _print_table, check_rows, dry_setting, passed

    rows = check_rows(dry_setting(processes=0), simulated=[("dp=2 tp=2", "dense")], fused=[])
    assert [(r.check, r.plan, r.result) for r in rows] == [
        ("simulated on cpu", "dp=2 tp=2", "equal"), ("gloo world", "-", "skipped: no device")]
    assert rows[0].diff is not None and rows[0].diff <= 1e-4 and passed(rows)
    out = io.StringIO()
    _print_table(rows, dry_setting(0).title, out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("usc.smoke on CPU (--dry") and lines[1].split()[:2] == ["check", "plan"]
    assert len(lines) == 2 + len(rows) and lines[2].split()[:4] == ["simulated", "on", "cpu", "dp=2"]


def test_a_differing_or_failing_row_fails_the_smoke():
    from usc.smoke import _compare, passed

    equal = _compare("c", "dp=2", "dense", "threads", lambda: [1.0, 2.0], [1.0, 2.0 + 1e-6], 1e-4)
    differs = _compare("c", "dp=2", "dense", "threads", lambda: [1.0, 2.1], [1.0, 2.0], 1e-4)

    def broken():
        raise RuntimeError("NCCL error: unhandled system error\nmore")
    failed = _compare("c", "dp=2", "dense", "threads", broken, [1.0], 1e-4)
    assert (equal.result, differs.result) == ("equal", "DIFFERS") and differs.diff == pytest.approx(0.05)
    assert failed.result == "ERROR RuntimeError: NCCL error: unhandled system error" and failed.diff is None
    assert passed([equal]) and not passed([equal, differs]) and not passed([equal, failed])


@pytest.mark.skipif(os.environ.get("USC_DEEP_TIER") != "1", reason="deep tier: set USC_DEEP_TIER=1 (minutes)")
def test_the_whole_dry_smoke_passes_with_a_gloo_world():
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "usc.smoke", "--dry", "--processes", "2"], capture_output=True,
                          text=True, timeout=3000, env=env)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()  # each row as it finishes, then the table under its header
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("check ")) + 1:]
    assert len(rows) == 10 + 2 + len(nccl_plans(2)) and all(" equal " in row for row in rows), done.stdout
