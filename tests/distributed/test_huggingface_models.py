"""Models users bring are not written for us: Hugging Face's Llama and GPT-2, built from configs with
random weights (nothing is downloaded), trained on a mesh equal one device."""

import pytest
import torch

import usc
from usc.testing import assert_equivalent
from usc.testing.hf import CausalLMLoss, hf_llama

transformers = pytest.importorskip("transformers")


def llama():
    return hf_llama()


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    return CausalLMLoss(transformers.GPT2LMHeadModel(cfg))


def batch(seed: int):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
    return ids, ids


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "dp=2 tp=2 sp=on zero=2", "dp=2 zero=3",
                                  # ZeRO's reduce-scatter once per step, and in every microbatch
                                  "dp=2 mb=2 zero=1", "dp=2 mb=2 zero=2"])
def test_hf_llama_matches_one_device(plan):
    result = assert_equivalent(llama, plan, [batch(s) for s in range(2)])
    assert result.max_param_diff <= 1e-5


def test_hf_llama_tensor_parallel_finds_the_megatron_pairs():
    report = usc.lint(llama(), "tp=2", example_inputs=batch(0))
    styles = {c.module: c.style for c in report.tp_choices}
    assert styles["m.model.layers.0.self_attn.q_proj"] == "colwise"
    assert styles["m.model.layers.0.self_attn.o_proj"] == "rowwise"
    assert styles["m.model.layers.0.mlp.down_proj"] == "rowwise"
    assert styles["m.lm_head"] == "vocab"
    assert report.count("all-reduce", axis="tp", direction="forward", module_prefix="m.model.layers.0.") == 2


@pytest.mark.parametrize("plan", ["dp=2", "dp=2 zero=2"])
def test_hf_gpt2_matches_one_device(plan):
    result = assert_equivalent(gpt2, plan, [batch(s) for s in range(2)])
    assert result.max_param_diff <= 1e-5


def test_hf_gpt2_under_cp_keeps_the_sequence_split_through_its_conv1d():
    """GPT-2's Conv1D flattens [batch, seq, in] to [batch*seq, in] for ``addmm``: under cp alone the
    sequence shard is the inner factor of those rows, and the projections ran on the gathered whole
    sequence (every cp rank computing and holding all of it). Read as a linear on [batch, seq, in],
    the shard passes: no all-gather over cp in a block, a rank holds its half, and it trains as one
    device does."""
    report = usc.lint(gpt2(), "cp=2", example_inputs=batch(0))
    assert report.count("all-gather", axis="cp", direction="forward", module_prefix="m.transformer.h.") == 0
    assert report.count("send/recv", axis="cp", direction="forward", module_prefix="m.transformer.h.0.") == 1
    result = assert_equivalent(gpt2, "cp=2", [batch(s) for s in range(2)])
    assert result.max_param_diff <= 1e-5


def test_hf_attention_mask_under_cp_is_proven_causal():
    """The mask Llama builds from positions is evaluated at compile time and found causal: ring
    attention runs causal (rank 1 attends two blocks, rank 0 one; an explicit mask costs both two)."""
    flops = usc.lint(llama(), "cp=2", example_inputs=batch(0)).attention_flops["cp"]
    assert flops[1] == 2 * flops[0]
