"""dtype=bf16 on Hugging Face decoders as users build them: their RMSNorm casts its input to float32
and back, and at trace time (float32) that cast is the input itself, so the residual stream's later
uses are recorded through it. The matmuls after it must still run in bfloat16 with their weights."""

import os
import sys

import pytest
import torch

import usc

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))

from users_models import FAMILIES  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_bf16_step_runs_and_stays_near_float32(family):
    batch = FAMILIES[family].batch(0, 6)
    losses = {}
    for plan in ("dp=2", "dp=2 dtype=bf16"):
        torch.manual_seed(0)
        sim = usc.simulate(FAMILIES[family].build(), plan, example_inputs=batch)
        losses[plan] = sim.step(batch)
    assert losses["dp=2 dtype=bf16"] == pytest.approx(losses["dp=2"], rel=2e-2)


def test_auto_plans_bf16_and_the_plan_runs():
    batch = FAMILIES["llama"].batch(0, 6)
    torch.manual_seed(0)
    sim = usc.simulate(FAMILIES["llama"].build(), "auto gpus=2", example_inputs=batch)
    assert sim.plan.get("dtype") == "bf16"
    assert torch.isfinite(torch.tensor(sim.step(batch)))
