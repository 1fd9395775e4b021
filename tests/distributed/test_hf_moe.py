"""Transformers-5 mixture-of-experts models as Hugging Face ships them: stacked ``gate_up_proj`` /
``down_proj`` experts called with top-k indices and weights, router modules with a ``weight [E, H]``.

Built from tiny configs with random weights (nothing downloaded); odd sizes (hidden 24, vocab 98,
4 or 8 experts); SGD steps so that a uniformly scaled gradient would show. Each plan equals one
device. The routers are initialised wider than HF's default (std 0.02) so that the top-k choices are
not near-ties that rounding differences between plans could flip.
"""

import pytest
import torch
import torch.nn.functional as F

import usc
from usc.compiler.moe import ExpertsModule, RouterModule, find_blocks
from usc.testing import assert_equivalent

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 98, 24
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                                      num_experts_per_tok=2))


def _qwen2_moe():  # shared expert behind a sigmoid gate, top-k weights not renormalised
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
        shared_expert_intermediate_size=28, norm_topk_prob=False))


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=True))


def _gpt_oss():  # biased experts, interleaved gate/up, clamped SwiGLU; router: top-k then softmax
    cfg = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 20}, head_dim=6, num_local_experts=4,
                                    num_experts_per_tok=2, layer_types=["full_attention"] * 2,
                                    attn_implementation="eager")
    return transformers.GptOssForCausalLM(cfg)


def _deepseek_v3():  # sigmoid router, correction bias, 2 groups of which 1 is kept, scaled, shared expert
    cfg = transformers.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, n_routed_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=20, n_group=2, topk_group=1,
                                        n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=None,
                                        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
                                        routed_scaling_factor=2.5)
    return transformers.DeepseekV3ForCausalLM(cfg)


FAMILIES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss,
            "deepseek_v3": _deepseek_v3}


def _wide_routers(model: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(7)
    for block in find_blocks(model):
        module = model.get_submodule(block.path)
        if isinstance(block, RouterModule):
            module.weight.data.copy_(torch.randn(module.weight.shape, generator=gen) * 0.5)
    return model


def family(name: str):
    return lambda: _wide_routers(FAMILIES[name]())


def batch(seed: int, rows: int = 4, seq: int = 6):
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return ids, ids


def collated(seed: int) -> dict:
    ids, labels = batch(seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("plan", ["dp=2 ep=2", "dp=2 ep=2 tp=2"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hf_moe_families_equal_one_device(name, plan):
    result = assert_equivalent(family(name), plan, [collated(s) for s in range(3)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_experts_and_routers_are_recognised_by_interface(name):
    model = FAMILIES[name]()
    blocks = find_blocks(model)
    experts = [b for b in blocks if isinstance(b, ExpertsModule)]
    routers = [b for b in blocks if isinstance(b, RouterModule)]
    assert len(experts) == len(routers) == 2
    assert all(b.verified for b in blocks)
    assert experts[0].form.kind == "fused"
    assert (experts[0].form.limit > 0, experts[0].form.interleaved, experts[0].form.bias) == \
        ((True, True, True) if name == "gpt_oss" else (False, False, False))


def test_expert_weights_are_split_over_ep():
    sim = usc.simulate(family("qwen3_moe")(), "dp=2 ep=2", example_inputs=collated(0))
    full = sim.full_state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert tuple(full.shape) == (4, 40, HIDDEN)
    # dp=2 ep=2 is the mesh ep=2 (2 ranks): rank 1 holds experts 2 and 3
    assert torch.equal(sim.rank_state(1)["model.layers.1.mlp.experts.gate_up_proj"], full[2:])


def test_load_statistics_count_every_assignment():
    ids = collated(0)["input_ids"]
    sim = usc.simulate(family("gpt_oss")(), "dp=2 ep=2", example_inputs=collated(0))
    sim.step(collated(0))
    stats = sim.moe_stats()
    assert sorted(stats) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for layer in stats.values():
        assert sum(layer.tokens_per_expert) == ids.numel() * 2  # dropless: every (token, slot)
        assert sum(layer.tokens_per_rank) == ids.numel() * 2


def test_mixtral_load_balancing_loss_equals_one_device():
    """output_router_logits=True: Mixtral adds its auxiliary loss from the router logits it records."""
    def make():
        cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                         output_router_logits=True, router_aux_loss_coef=0.05)
        return _wide_routers(transformers.MixtralForCausalLM(cfg))

    result = assert_equivalent(make, "dp=2 ep=2", [collated(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6
    torch.manual_seed(0)
    without = _wide_routers(_mixtral())(**collated(0)).loss.item()
    assert abs(result.losses[0] - without) > 1e-3  # the auxiliary loss is in


# ------------------------------------------------- DeepSeek-V3's MoE block (group-limited routing)
class DeepSeekV3MoEModel(torch.nn.Module):
    """Embedding, HF's DeepseekV3MoE (sigmoid router with correction bias, 4 groups of which 2 are
    kept, top-3 renormalised and scaled by 2.5, one shared expert), lm head.

    More groups and a larger top-k than the whole model's test, with a non-zero correction bias."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        cfg = transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, moe_intermediate_size=20,
                                            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.moe = DeepseekV3MoE(cfg)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        for p in self.moe.experts.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.moe.gate.weight.data.copy_(torch.randn(self.moe.gate.weight.shape, generator=gen) * 0.5)
        self.moe.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.1)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.moe(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), labels.reshape(-1))


def test_deepseek_v3_router_rule_is_group_limited_with_correction_and_scale():
    blocks = {type(b): b for b in find_blocks(DeepSeekV3MoEModel())}
    router = blocks[RouterModule]
    assert router.correction == "e_score_correction_bias"
    assert (router.rule.scoring, router.rule.normalize, router.rule.groups, router.rule.topk_group,
            router.rule.scale) == ("sigmoid", True, 4, 2, 2.5)


@pytest.mark.parametrize("plan", ["dp=2 ep=2", "dp=4 ep=4", "dp=2 ep=2 tp=2"])
def test_deepseek_v3_moe_block_equals_one_device(plan):
    result = assert_equivalent(DeepSeekV3MoEModel, plan, [batch(s, rows=8) for s in range(3)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6
