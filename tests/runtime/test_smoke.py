"""python -m usc.smoke: says so and exits 0 without a GPU; its NCCL plans fit the GPU count."""

from __future__ import annotations

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


@pytest.mark.parametrize("gpus", [2, 3, 4, 8])
def test_the_nccl_plans_use_every_visible_gpu(gpus):
    plans = nccl_plans(gpus)
    assert plans
    for plan, _ in plans:
        assert parse_plan(plan).world_size == gpus, plan
    axes = {axis for plan, _ in plans for axis in parse_plan(plan).mesh_axes}
    assert axes >= ({"dp"} | ({"ep", "tp", "cp", "pp"} if gpus % 2 == 0 else set()))
