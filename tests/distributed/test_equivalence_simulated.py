"""The correctness contract under the simulator: 3 AdamW steps on a mesh equal one device.

float32: losses within rtol 1e-5 / atol 1e-6, final parameters within 1e-5 (elements whose true
gradient is zero, like GPT-2's key bias, are held to AdamW's step bound instead; see
usc.testing.equivalence.compare_states).
"""

import pytest

from gloo_cases import MODELS, optimizer_for
from usc.testing import assert_equivalent
from usc.testing.models import TinyGPT2, TinyLlama, shifted_batch, token_batch

PLANS = ["dp=2", "tp=2", "dp=2 tp=2", "tp=4"]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_three_steps_match_one_device(model, plan):
    factory, batch = MODELS[model]
    result = assert_equivalent(factory, plan, [batch(seed) for seed in range(3)], optimizer=optimizer_for(model))
    assert len(result.losses) == 3
    assert result.max_param_diff <= 1e-5


def test_uneven_token_counts_use_global_mean():
    """dp shards hold different numbers of counted tokens (ignore_index padding): the loss must be
    the global token mean, not the mean of the shard means."""
    tokens, labels = shifted_batch(128, 4, 16)
    counted = (labels != -100).sum(dim=1)
    assert counted[:2].sum() != counted[2:].sum()  # the two dp shards really differ
    assert_equivalent(TinyGPT2, "dp=2", [(tokens, labels)], steps=2)


def test_explicit_rules_match_auto_choice():
    rules = ("dp=2 tp=2 layers.*.self_attn.[qkv]_proj: colwise layers.*.self_attn.o_proj: rowwise "
             "layers.*.mlp.gate_proj: colwise layers.*.mlp.up_proj: colwise layers.*.mlp.down_proj: rowwise")
    assert_equivalent(TinyLlama, rules, [token_batch(128, 4, 16)], steps=2)


def test_replicate_rule_keeps_module_whole():
    import usc
    report = usc.lint(TinyLlama(), "tp=2 layers.*.mlp.*: replicate", example_inputs=token_batch(128, 4, 16))
    assert report.count("all-reduce", direction="forward", module_prefix="layers.0.mlp") == 0
    assert_equivalent(TinyLlama, "tp=2 layers.*.mlp.*: replicate", [token_batch(128, 4, 16)], steps=2)
