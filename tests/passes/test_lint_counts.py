"""usc-lint's collective list, asserted on the schedule of collectives before any values."""

import time

import pytest
import torch

import usc
from usc.testing.models import (
    LLAMA3_8B, GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, seeded, shifted_batch, token_batch)


def llama(cfg: LlamaConfig = LlamaConfig()) -> TinyLlama:
    """TinyLlama(cfg) from seed 0: one trace for the plans a test lints or compiles it under."""
    return seeded(TinyLlama, cfg)


@pytest.fixture(scope="module")
def llama_tp2():
    return usc.lint(TinyLlama(LlamaConfig(layers=3)), "tp=2", example_inputs=token_batch(128, 4, 16))


@pytest.mark.parametrize("layer", range(3))
def test_megatron_block_has_two_all_reduces_each_way(llama_tp2, layer):
    block = f"layers.{layer}."
    forward = [c.module for c in llama_tp2.collectives if c.direction == "forward" and c.module.startswith(block)]
    backward = [c.module for c in llama_tp2.collectives if c.direction == "backward" and c.module.startswith(block)]
    assert sorted(forward) == [f"{block}mlp.down_proj", f"{block}self_attn.o_proj"]
    assert sorted(backward) == [f"{block}mlp.gate_proj", f"{block}self_attn.q_proj"]
    assert all(c.kind == "all-reduce" and c.axis == "tp" and c.group_size == 2
               for c in llama_tp2.collectives if c.module.startswith(block))


def test_vocab_parallel_embedding_and_loss_are_listed(llama_tp2):
    embed = [c for c in llama_tp2.collectives if c.module == "embed_tokens"]
    assert [(c.kind, c.direction) for c in embed] == [("all-reduce", "forward")]
    head = [c for c in llama_tp2.collectives if c.module == "lm_head"]
    assert [(c.kind, c.direction) for c in head] == [("all-reduce", "backward")]
    loss = [c for c in llama_tp2.collectives if c.module == "<root>"]
    # max, sum of exp, target logit: three small all-reduces; the logits are never gathered.
    assert [(c.kind, c.direction) for c in loss] == [("all-reduce", "forward")] * 3
    assert max(c.bytes_per_call for c in loss) < 128 * 4 * 16 * 4 / 2
    assert not [c for c in llama_tp2.collectives if c.kind == "all-gather"]
    # + one all-reduce of the returned loss over tp: every rank agrees on the finite-loss verdict (8 bytes:
    # a token-mean loss travels in float64 with its count, runtime/loss_value.py)
    verdict = [c for c in llama_tp2.collectives if c.module == "<loss value>"]
    assert [(c.kind, c.axis, c.bytes_per_call) for c in verdict] == [("all-reduce", "tp", 8)]
    assert len(llama_tp2.collectives) == 3 * 4 + 1 + 1 + 3 + 1


def test_bytes_per_call_are_local_activation_bytes(llama_tp2):
    down = next(c for c in llama_tp2.collectives if c.module == "layers.0.mlp.down_proj")
    assert down.shape == (4, 16, 64)
    assert down.bytes_per_call == 4 * 16 * 64 * 4
    assert llama_tp2.totals_by_axis()["tp"]["calls"] == len(llama_tp2.collectives)


def test_data_parallel_reduces_gradients_in_buckets():
    small = usc.lint(llama(), "dp=2 bucket_mb=0.05", example_inputs=token_batch(128, 4, 16))
    big = usc.lint(llama(), "dp=2", example_inputs=token_batch(128, 4, 16))
    buckets = lambda r: [c for c in r.collectives if c.source == "gradient bucket"]  # noqa: E731
    assert len(buckets(big)) == 1 and len(buckets(small)) > 3
    param_bytes = sum(p.numel() * 4 for p in TinyLlama().parameters())
    assert sum(c.bytes_per_call for c in buckets(small)) == param_bytes
    assert all(c.axis == "dp" and c.direction == "backward" for c in buckets(small))
    # The only forward collective under dp: the global count of counted tokens for the mean loss.
    forward = [c for c in big.collectives if c.direction == "forward" and c.module != "<loss value>"]
    assert [(c.kind, c.shape) for c in forward] == [("all-reduce", ())]


def test_fused_qkv_pair_falls_back_with_a_warning():
    report = usc.lint(TinyGPT2(GPT2Config()), "tp=2", example_inputs=shifted_batch(128, 4, 16))
    styles = {c.module: c.style for c in report.tp_choices}
    assert styles["h.0.c_attn"] == "replicate" and styles["h.0.c_proj"] == "replicate"
    assert styles["h.0.c_fc"] == "colwise" and styles["h.0.mlp_proj"] == "rowwise"
    assert any("h.0.c_attn" in w and "does not divide" in w for w in report.warnings)


def test_llama3_8b_shape_lints_on_meta_without_weights():
    with torch.device("meta"):
        model = TinyLlama(LLAMA3_8B)
    tokens = torch.zeros(16, 128, dtype=torch.long, device="meta")
    start = time.perf_counter()
    report = usc.lint(model, "dp=16 tp=8", example_inputs=(tokens, tokens))
    elapsed = time.perf_counter() - start
    assert all(p.is_meta for p in model.parameters())
    assert report.mesh.world_size == 128
    assert report.count("all-reduce", axis="tp", direction="forward") == 32 * 2 + 1 + 3 + 1  # + the loss verdict
    assert report.count("all-reduce", axis="tp", direction="backward") == 32 * 2 + 1
    # 8.03e9 parameters in fp32 split 8 ways (norms replicated): about 4 GB per rank.
    assert 3.9e9 < report.param_bytes_per_rank < 4.1e9
    print(f"Llama-3-8B shape, dp=16 tp=8, lint: {elapsed:.2f} s")
