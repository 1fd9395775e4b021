"""The planner's fast paths change nothing it chooses: the profile measured on five blocks of a stack
and stamped equals the profile of the whole trace, and the search with the cost model's activation
cache returns the same plans, estimates and rejections as without it.

The Hugging Face model and Llama-3-8B's shapes (32 layers on the meta device) run in the deep tier
(``USC_DEEP_TIER=1``): each traces its model whole once more.
"""

import os
from dataclasses import replace

import pytest
import torch
from torch import nn

from usc.compiler import cost_model, planner
from usc.compiler.hardware import H100
from usc.compiler.planner import PlanTarget, search
from usc.compiler.trace import trace
from usc.model_call import trainable
from usc.passes.cost_profile import profile_model
from usc.planning import refusal
from usc.testing.models import LLAMA3_8B, LlamaBlock, LlamaConfig, TinyLlama, token_batch

DEEP = os.environ.get("USC_DEEP_TIER") == "1"

LAYERS = 6  # one more than the five blocks the profile measures: one is stamped
VOCAB = 96
CONFIG = LlamaConfig(vocab=VOCAB, hidden=48, heads=6, kv_heads=2, mlp=72, layers=LAYERS)


def hf_qwen2() -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=72,
                                      num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=2,
                                      max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config)


class SecondMLPBlock(LlamaBlock):
    """A Llama block that, when ``again``, runs its MLP a second time: the same parameters as every
    other block, different work."""

    def __init__(self, cfg: LlamaConfig, again: bool) -> None:
        super().__init__(cfg)
        self.again = again

    def forward(self, x, cos, sin):
        x = super().forward(x, cos, sin)
        return x + self.mlp(x) if self.again else x


def alternating_llama() -> nn.Module:
    model = TinyLlama(CONFIG)
    model.layers = nn.ModuleList(SecondMLPBlock(CONFIG, again=i % 2 == 1) for i in range(LAYERS))
    return model


MODELS = {"tiny-llama": lambda: TinyLlama(CONFIG), "hf-qwen2": hf_qwen2, "alternating": alternating_llama}


def _profiles(name: str):
    """(fast profile, whole-trace profile) of the model as ``usc.plan`` sees it (in usc's wrapper)."""
    torch.manual_seed(0)
    tokens, labels = token_batch(VOCAB, 6, 12)
    model = trainable(MODELS[name](), None)
    batch = model.flatten({"input_ids": tokens, "labels": labels} if name.startswith("hf") else (tokens, labels))
    return profile_model(model, batch), profile_model(model, batch, traced=trace(model, batch))


@pytest.fixture(scope="module", params=["tiny-llama", pytest.param("hf-qwen2", marks=pytest.mark.skipif(
    not DEEP, reason="a second model traced whole: the deep tier (USC_DEEP_TIER=1)"))])
def profiles(request):
    return _profiles(request.param)


def test_stamped_profile_is_the_whole_trace_profile(profiles):
    fast, whole = profiles
    assert whole.layers == LAYERS and [u.name for u in fast.units] == [u.name for u in whole.units]
    assert fast == whole  # every unit's FLOPs, parameters, activations, collectives, recompute terms


def test_blocks_that_differ_are_traced_whole():
    torch.manual_seed(0)
    model = trainable(alternating_llama(), None)
    profile = profile_model(model, model.flatten(token_batch(VOCAB, 6, 12)))
    acts = [sum(u.acts[False].values()) for u in profile.units if u.name.startswith("layers.")]
    # even blocks alike, odd blocks alike (the MLP's saved tensors twice): the measured pattern, not
    # block 3 stamped over block 4
    assert len(acts) == LAYERS and acts[2] == acts[4] < acts[3] == acts[5]


def _uncached(profile, key, units, compute):
    return compute()


@pytest.mark.parametrize("gpus, hbm", [(24, 700_000), (12, 1_000_000)])
def test_search_is_the_same_without_the_activation_cache(profiles, gpus, hbm, monkeypatch):
    fast, _ = profiles
    hw = replace(H100, name="small", hbm_bytes=hbm)  # memory binds: ZeRO, microbatches, recompute all matter
    target = PlanTarget(gpus=gpus, seq=48, global_batch=24, gpus_per_node=4, dtype="bf16")
    cached = search(fast, target, hw, supported=refusal)
    monkeypatch.setattr(cost_model, "cached", _uncached)
    plain = search(replace(fast, _stages={}), target, hw, supported=refusal)
    assert cached.best is not None and cached.rejected["does not fit in memory"] > 0
    assert cached.best.plan == plain.best.plan
    assert cached.best.estimate.time == plain.best.estimate.time
    assert cached.best.estimate.memory == plain.best.estimate.memory
    assert str(cached).split("\n", 1)[1] == str(plain).split("\n", 1)[1]  # runners-up, families, rejections


@pytest.mark.parametrize("gpus, hbm", [(24, 700_000), (12, 1_000_000), (24, 250_000), (8, 400_000)])
def test_search_is_the_same_without_stopping_at_the_first_stage_over_the_capacity(profiles, gpus, hbm,
                                                                                  monkeypatch):
    """The memory check stops at a stage over both the capacity and the family's closest miss: the
    choice, the runners-up, the closest misses and every rejection count are those of the full check."""
    fast, _ = profiles
    hw = replace(H100, name="small", hbm_bytes=hbm)
    target = PlanTarget(gpus=gpus, seq=48, global_batch=24, gpus_per_node=4, dtype="bf16")
    early = search(fast, target, hw, supported=refusal)
    full_check = cost_model.peak_memory
    monkeypatch.setattr(planner, "peak_memory", lambda profile, plan, stop_above=None: full_check(profile, plan))
    full = search(fast, target, hw, supported=refusal)
    assert early.rejected["does not fit in memory"] > 0
    assert (early.best and early.best.plan) == (full.best and full.best.plan) and early.families == full.families
    assert str(early).split("\n", 1)[1] == str(full).split("\n", 1)[1]


@pytest.mark.skipif(not DEEP, reason="Llama-3-8B's 32 layers traced whole: the deep tier (USC_DEEP_TIER=1)")
def test_llama3_8b_plan_is_the_same_from_the_whole_trace():
    with torch.device("meta"):
        model = trainable(TinyLlama(LLAMA3_8B), None)
    tokens = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    batch = model.flatten((tokens, tokens))
    fast, whole = profile_model(model, batch), profile_model(model, batch, traced=trace(model, batch))
    assert whole.layers == 32 and fast == whole
    target = PlanTarget(gpus=512, seq=4096, global_batch=1024, gpus_per_node=8, dtype="bf16")
    chosen = search(fast, target, H100, supported=refusal)
    assert str(chosen).split("\n", 1)[1] == str(search(whole, target, H100, supported=refusal)).split("\n", 1)[1]
