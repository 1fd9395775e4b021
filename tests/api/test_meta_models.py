"""Plan-only use on the models people have: Hugging Face models built on the meta device (no memory,
no weights) lint, plan and compile without a device mismatch, and the planner plans for the global
batch it is told, not the example's."""

import pytest
import torch

import usc
from usc.testing.hf import hf_llama

transformers = pytest.importorskip("transformers")


def meta_llama(**sizes):
    shape = dict(vocab_size=98, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, attn_implementation=None)
    return hf_llama(device="meta", **{**shape, **sizes})


def tokens(batch: int, seq: int = 16):
    ids = torch.randint(0, 98, (batch, seq), generator=torch.Generator().manual_seed(0))
    return ids, ids


@pytest.mark.parametrize("plan", ["dp=2 tp=2", "tp=2 pp=2 mb=2", "dp=2 zero=3"])
def test_lint_of_a_meta_model_reports_memory(plan):
    report = usc.lint(meta_llama(), plan, example_inputs=tokens(4))
    assert report.stages if "pp" in plan else report.activation_bytes > 0  # both run the program on fake tensors
    assert "tensor parallel" in str(report) or "tp" not in plan


def test_compile_of_a_meta_model_is_plan_only():
    step = usc.compile(meta_llama(), "dp=2 tp=2", example_inputs=tokens(4))
    assert step.report.mesh.world_size == 4
    with pytest.raises(RuntimeError, match="needs 4 processes"):  # a meta model runs, on a launched mesh
        step(*tokens(4))


def test_plan_takes_the_global_batch_not_the_example_batch():
    """An example batch of 1 only gives shapes: global_batch=64 lets the planner use dp=8."""
    chosen = usc.plan(meta_llama(), "gpus=8 global_batch=64", example_inputs=tokens(1))
    assert chosen.size("dp") > 1 and chosen.world_size == 8

