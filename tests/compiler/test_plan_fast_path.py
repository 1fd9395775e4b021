"""The planner's fast paths change nothing it chooses: the profile measured on three blocks of a
stack and stamped equals the profile of the whole trace, and the search with the cost model's activation
cache returns the same plans, estimates and rejections as without it.

The Hugging Face model and Llama-3-8B's shapes (32 layers on the meta device) run in the deep tier
(``USC_DEEP_TIER=1``): each traces its model whole once more.
"""

import os
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from usc.compiler import cost_model, planner
from usc.compiler.hardware import H100
from usc.compiler.planner import PlanTarget, search
from usc.compiler.trace import trace
from usc.model_call import trainable
from usc.passes import cost_profile
from usc.passes.cost_profile import profile_model
from usc.planning import refusal
from usc.testing.models import LLAMA3_8B, LlamaBlock, LlamaConfig, TinyLlama, token_batch

DEEP = os.environ.get("USC_DEEP_TIER") == "1"

LAYERS = 6  # three more than the three blocks the profile measures: they are stamped
VOCAB = 96
CONFIG = LlamaConfig(vocab=VOCAB, hidden=48, heads=6, kv_heads=2, mlp=72, layers=LAYERS)


def hf_qwen2() -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=72,
                                      num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=2,
                                      max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config)


def hf_causal_lm(config: str, model: str, **extra) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config)(vocab_size=VOCAB, hidden_size=48, intermediate_size=72,
                                        num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=2,
                                        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        **extra)
    return getattr(transformers, model)(cfg)


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


class ScaledOddLlama(TinyLlama):
    """TinyLlama whose forward scales the residual stream after every odd block: every block is the
    same module, the work between them differs (the graph's own nodes, not a block's)."""

    def forward(self, tokens, labels):
        seq = tokens.shape[1]
        x = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            if i % 2:
                x = torch.tanh(x) * 2
        logits = self.lm_head(self.norm(x))
        return nn.functional.cross_entropy(logits[:, :-1, :].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


MODELS = {"tiny-llama": lambda: TinyLlama(CONFIG), "hf-qwen2": hf_qwen2, "alternating": alternating_llama,
          "scaled-odd": lambda: ScaledOddLlama(CONFIG)}


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


def test_a_block_every_fourth_unlike_the_others_is_traced_whole():
    """Only blocks 0-2 are traced: block 3, the one that differs (as a no-RoPE or full-attention
    layer every fourth does), is never seen by the trace; its setting is."""
    torch.manual_seed(0)
    model = TinyLlama(CONFIG)
    model.layers = nn.ModuleList(SecondMLPBlock(CONFIG, again=i % 4 == 3) for i in range(LAYERS))
    model = trainable(model, None)
    batch = model.flatten(token_batch(VOCAB, 6, 12))
    fast, whole = profile_model(model, batch), profile_model(model, batch, traced=trace(model, batch))
    assert fast == whole
    acts = [sum(u.acts[False].values()) for u in fast.units if u.name.startswith("layers.")]
    assert acts[1] == acts[2] == acts[4] < acts[3]


def test_a_frozen_block_is_not_stamped_as_a_trainable_one():
    """Block 4 frozen (a user fine-tuning the others): it has no gradients to hold or reduce, which a
    copy of trainable block 1 would count."""
    torch.manual_seed(0)
    model = TinyLlama(CONFIG)
    model.layers[4].requires_grad_(False)
    model = trainable(model, None)
    batch = model.flatten(token_batch(VOCAB, 6, 12))
    fast, whole = profile_model(model, batch), profile_model(model, batch, traced=trace(model, batch))
    assert fast == whole
    units = {u.name: u for u in fast.units}
    assert units["layers.4"].params_tp == 0 < units["layers.3"].params_tp


def test_work_between_blocks_that_differs_is_traced_whole():
    fast, whole = _profiles("scaled-odd")
    assert fast == whole
    acts = [sum(u.acts[False].values()) for u in fast.units if u.name.startswith("layers.")]
    assert acts[0] != acts[1] and acts[1] == acts[3] != acts[2]  # the odd blocks' units hold the tanh


@pytest.mark.parametrize("name", ["tiny-llama", "hf-qwen2"])
def test_a_stack_of_equal_blocks_is_traced_once_on_three_of_them(name, monkeypatch):
    """The fast path is taken (one trace, of KEEP_BLOCKS blocks) where the blocks repeat: were it
    to fall back to the whole trace, the profile would still be right and only the planner slow."""
    traced_blocks = []

    def counting(model, example_inputs, **options):
        traced_blocks.append(max(len(m) for m in model.modules() if isinstance(m, nn.ModuleList)))
        return trace(model, example_inputs, **options)

    monkeypatch.setattr(cost_profile, "trace", counting)
    torch.manual_seed(0)
    tokens, labels = token_batch(VOCAB, 6, 12)
    model = trainable(MODELS[name](), None)
    batch = model.flatten({"input_ids": tokens, "labels": labels} if name.startswith("hf") else (tokens, labels))
    profile = profile_model(model, batch)
    assert traced_blocks == [cost_profile.KEEP_BLOCKS] == [3]
    assert profile.layers == LAYERS


@pytest.mark.skipif(not DEEP, reason="each model traced whole: the deep tier (USC_DEEP_TIER=1)")
@pytest.mark.parametrize("config, model", [
    ("CohereConfig", "CohereForCausalLM"),  # the residual stream carries the embedding's partial sums
    ("SmolLM3Config", "SmolLM3ForCausalLM"),  # every fourth layer without RoPE
    ("Gemma2Config", "Gemma2ForCausalLM"),  # sliding and full attention alternate
])
def test_hugging_face_models_whose_blocks_differ_quietly_profile_as_their_whole_trace(config, model):
    torch.manual_seed(0)
    net = trainable(hf_causal_lm(config, model), None)
    tokens, labels = token_batch(VOCAB, 6, 12)
    batch = net.flatten({"input_ids": tokens, "labels": labels})
    assert profile_model(net, batch) == profile_model(net, batch, traced=trace(net, batch))


@pytest.mark.parametrize("layers, traced", [(12, 6), pytest.param(13, 7, marks=pytest.mark.skipif(
    not DEEP, reason="a second length traced whole: the deep tier (USC_DEEP_TIER=1)"))])
def test_two_kinds_of_block_alternating_are_stamped_as_their_whole_trace(layers, traced, monkeypatch):
    """transformers' Gemma 2 alternates sliding and full attention: six or seven of its blocks are
    traced (each kind three times, the last one of the kind the stack ends on), the rest stamped by
    kind, and the profile is the whole trace's, field for field. It used to be traced whole (20 s
    to plan 26 layers at the 2B shape on meta, 4 s now)."""
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", layers)
    counted = []

    def counting(model, example_inputs, **options):
        counted.append(max(len(m) for m in model.modules() if isinstance(m, nn.ModuleList)))
        return trace(model, example_inputs, **options)

    torch.manual_seed(0)
    net = trainable(hf_causal_lm("Gemma2Config", "Gemma2ForCausalLM"), None)
    batch = net.flatten(dict(zip(("input_ids", "labels"), token_batch(VOCAB, 6, 12))))
    monkeypatch.setattr(cost_profile, "trace", counting)
    fast = profile_model(net, batch)
    assert counted == [traced]
    monkeypatch.undo()
    assert fast.layers == layers and fast == profile_model(net, batch, traced=trace(net, batch))


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
