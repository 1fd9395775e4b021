"""Models users bring, built from config objects with random weights (nothing is downloaded): Hugging
Face families at tiny, odd sizes, plus a torchtitan-style Llama and a nanoGPT-style GPT written here in
those projects' styles.

Each family is what a user hands ``usc.compile``: the model object itself (no wrapper) and batches
as the user holds them -- a collator's dict (``input_ids``, ``attention_mask``, ``labels``; pixels
and class labels for ViT; masked-LM labels with -100 for BERT), nanoGPT's ``(idx, targets)``, or
torchtitan's ``(tokens, labels)`` with the trainer's ``loss_fn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

transformers = None  # imported on first use: the tier is skipped where transformers is missing

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 98, 48, 80, 6, 2, 2, 10, 6
IMAGE, PATCH, CLASSES = 12, 4, 5


def _tf():
    global transformers
    if transformers is None:
        import transformers as tf

        transformers = tf
    return transformers


@dataclass(frozen=True)
class Family:
    """One model family as a user brings it.

    build: the model (random weights; call under ``torch.device("meta")`` for a plan-only model);
    batch: (seed, rows) -> one batch as the user holds it; loss_fn: the trainer's loss where the
    model returns logits (torchtitan), passed to usc as ``loss_fn=``; moe: a mixture-of-experts model
    (its tier adds ep plans)."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, int], object]
    loss_fn: Callable | None = None
    moe: bool = False


# ---------------------------------------------------------------- batches as users hold them

def _ids(seed: int, rows: int, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def causal_lm_batch(seed: int, rows: int = BATCH) -> dict:
    """A causal-LM collator's batch, no padding (Hugging Face shifts the labels inside the model)."""
    ids = _ids(seed, rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def masked_lm_batch(seed: int, rows: int = BATCH) -> dict:
    """A masked-LM collator's batch: about a quarter of the tokens replaced by [MASK] (id 1) and
    labelled, the rest labelled -100 (ignored), so ranks hold different numbers of counted tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, SEQ), generator=g)
    masked = torch.rand(rows, SEQ, generator=g) < 0.25
    masked[0, 0] = True  # at least one counted token
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(masked, torch.ones_like(ids), ids), "token_type_ids": torch.zeros_like(ids),
            "attention_mask": torch.ones_like(ids), "labels": labels}


def image_batch(seed: int, rows: int = BATCH) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(rows, 3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (rows,), generator=g)}


def token_pair_batch(seed: int, rows: int = BATCH) -> tuple:
    """(inputs, next-token targets), as nanoGPT's and torchtitan's data loaders give them."""
    ids = _ids(seed, rows, SEQ + 1)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ---------------------------------------------------------------- Hugging Face families

def _no_dropout(cfg):
    """Training-mode dropout would draw differently on one device and on a mesh; the tier compares
    exact training, so every dropout probability the config names is zero."""
    for name, value in list(vars(cfg).items()):
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(cfg, name, 0.0)
    return cfg


def _decoder_config(name: str, layers: int = LAYERS, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  tie_word_embeddings=False)
    common.update(extra)
    return _no_dropout(getattr(_tf(), name)(**common))


def _hf(model_name: str, config: Callable):
    return lambda: getattr(_tf(), model_name)(config())


def _hf_decoder(model_name: str, config_name: str, **extra):
    """A build that also takes ``layers`` (LAYERS unless given): the op-coverage trace builds one."""
    return lambda layers=LAYERS: getattr(_tf(), model_name)(_decoder_config(config_name, layers, **extra))


def causal_lm(config_name: str, model_name: str, **extra) -> Family:
    return Family(_hf_decoder(model_name, config_name, **extra), causal_lm_batch)


def moe(config_name: str, model_name: str, **extra) -> Family:
    """Mixture-of-experts families: 4 experts, top-2, at the dense tier's sizes, HF's own init."""
    return Family(_hf_decoder(model_name, config_name, **extra), causal_lm_batch, moe=True)


def _config(name: str, **values):
    return lambda: _no_dropout(getattr(_tf(), name)(**values))


def _gpt2_config():
    return _config("GPT2Config", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                   bos_token_id=0, eos_token_id=0)()


OTHER_DECODERS = {
    "gpt_neox": Family(_hf("GPTNeoXForCausalLM", _config(
        "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, rotary_pct=0.5, use_parallel_residual=True, max_position_embeddings=64,
        tie_word_embeddings=False)), causal_lm_batch),
    "falcon": Family(_hf("FalconForCausalLM", _config(
        "FalconConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS, new_decoder_architecture=True, bias=False, max_position_embeddings=64)),
        causal_lm_batch),
    "bloom": Family(_hf("BloomForCausalLM", _config(
        "BloomConfig", vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS)), causal_lm_batch),
    "gpt2": Family(_hf("GPT2LMHeadModel", _gpt2_config), causal_lm_batch),
    "gptj": Family(_hf("GPTJForCausalLM", _config(
        "GPTJConfig", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=4, n_positions=64,
        tie_word_embeddings=False)), causal_lm_batch),
    "opt": Family(_hf("OPTForCausalLM", _config(
        "OPTConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=FFN,
        num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN, max_position_embeddings=64)), causal_lm_batch),
    "phi": Family(_hf("PhiForCausalLM", _config(
        "PhiConfig", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, partial_rotary_factor=0.5, max_position_embeddings=64)), causal_lm_batch),
}

ENCODERS = {
    "bert_mlm": Family(_hf("BertForMaskedLM", _config(
        "BertConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=64)), masked_lm_batch),
    "vit": Family(_hf("ViTForImageClassification", _config(
        "ViTConfig", hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
        image_size=IMAGE, patch_size=PATCH, num_channels=3, num_labels=CLASSES)), image_batch),
}


# ---------------------------------------------------------------- written here, in others' styles

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """torchtitan's complex-number RoPE table (models/llama3/model.py)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk)


class TitanAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = TitanAttention(dim, heads)
        self.feed_forward = TitanFeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama shape: built-in RMSNorm, complex RoPE, a ModuleDict of layers, logits out;
    the loss is a separate ``loss_fn`` (here applied by ``TitanTrain``)."""

    def __init__(self, vocab: int = VOCAB, dim: int = HIDDEN, heads: int = HEADS, hidden: int = FFN,
                 layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // heads, 64), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, heads, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def loss_fn(pred, labels):
    """torchtitan's cross-entropy loss: logits flattened over batch and sequence."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


class NanoBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's shape: forward(idx, targets) -> (logits, loss), the lm head tied to the embedding."""

    def __init__(self, vocab: int = VOCAB, dim: int = HIDDEN, heads: int = HEADS, layers: int = LAYERS) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(64, dim)
        self.h = nn.ModuleList(NanoBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class TitanTrain(nn.Module):
    """torchtitan's trainer step on one device: ``loss_fn(model(tokens), labels)``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TitanLlama()

    def forward(self, tokens, labels):
        return loss_fn(self.model(tokens), labels)


WRITTEN_HERE = {
    "torchtitan_llama": Family(TitanLlama, token_pair_batch, loss_fn=loss_fn),
    "nanogpt": Family(NanoGPT, token_pair_batch),
}

DENSE_DECODERS = {
    "llama": causal_lm("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": causal_lm("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": causal_lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "mistral": causal_lm("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "gemma": causal_lm("GemmaConfig", "GemmaForCausalLM", head_dim=8),
    "gemma2": causal_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, attn_implementation="eager"),
    "gemma3": causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8),
    "phi3": causal_lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "olmo": causal_lm("OlmoConfig", "OlmoForCausalLM", pad_token_id=0),
    "olmo2": causal_lm("Olmo2Config", "Olmo2ForCausalLM", pad_token_id=0),
    "granite": causal_lm("GraniteConfig", "GraniteForCausalLM"),
    "cohere": causal_lm("CohereConfig", "CohereForCausalLM", pad_token_id=0),
    "starcoder2": causal_lm("Starcoder2Config", "Starcoder2ForCausalLM", sliding_window=None),
    "stablelm": causal_lm("StableLmConfig", "StableLmForCausalLM"),
    "smollm3": causal_lm("SmolLM3Config", "SmolLM3ForCausalLM", pad_token_id=0),
    "helium": causal_lm("HeliumConfig", "HeliumForCausalLM", head_dim=8, pad_token_id=0),
    "glm4": causal_lm("Glm4Config", "Glm4ForCausalLM", head_dim=8, pad_token_id=0),
    **OTHER_DECODERS,
}

MOE_FAMILIES = {
    "mixtral": moe("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": moe("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=40, shared_expert_intermediate_size=40),
    "qwen3_moe": moe("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=40, head_dim=8),
    "deepseek_v3": moe("DeepseekV3Config", "DeepseekV3ForCausalLM", n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=40, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                       q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                       num_key_value_heads=HEADS),
    "gpt_oss": moe("GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                   sliding_window=32),  # layer_types: transformers' default, sliding and full by turns
    "olmoe": moe("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2, pad_token_id=0),
    "granitemoe": moe("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "phimoe": moe("PhimoeConfig", "PhimoeForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=None),
    "deepseek_v2": moe("DeepseekV2Config", "DeepseekV2ForCausalLM", n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=40, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
                       kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=8,
                       num_key_value_heads=HEADS),
    "glm4_moe": moe("Glm4MoeConfig", "Glm4MoeForCausalLM", n_routed_experts=4, num_experts_per_tok=2, head_dim=8,
                    moe_intermediate_size=40, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                    pad_token_id=0),
}

FAMILIES: dict[str, Family] = {**DENSE_DECODERS, **ENCODERS, **WRITTEN_HERE, **MOE_FAMILIES}
# Hugging Face decoders (from ``causal_lm`` / ``moe``) whose layers are all alike at LAYERS: one
# attention kind, the same MLP or MoE block in each. A check of what each layer computes holds on one
# of them (``build(layers=1)``) as on two, in about 60% of the tracing. Not here: DeepSeek V2/V3 and
# GLM-4-MoE (a dense first layer, MoE after), Gemma 2 and GPT-OSS (sliding and full attention by turns).
ALIKE_LAYERS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "phi3", "olmo", "olmo2", "granite",
                "cohere", "starcoder2", "stablelm", "smollm3", "helium", "glm4", "mixtral", "qwen2_moe",
                "qwen3_moe", "olmoe", "granitemoe", "phimoe")
HF_DECODERS = [name for name in FAMILIES if name not in ENCODERS and name not in WRITTEN_HERE]


def batches(family: str, n: int = 2, rows: int = BATCH) -> list:
    """n batches of the family, as its users hold them."""
    return [FAMILIES[family].batch(seed, rows) for seed in range(n)]


def build(family: str) -> nn.Module:
    return FAMILIES[family].build()


@lru_cache(maxsize=None)
def traced_ops(family: str, layers: int | None = None) -> frozenset:
    """The ops of the family's traced training program (the model called as its batch says, its
    mixture-of-experts layers as plain ops): aten ops and the custom ops a library registers.
    ``layers``: that many decoder layers instead of LAYERS (Hugging Face decoders from
    ``causal_lm`` / ``moe`` only)."""
    from usc.compiler.trace import trace
    from usc.model_call import trainable

    fam = FAMILIES[family]
    torch.manual_seed(0)
    model = trainable(fam.build() if layers is None else fam.build(layers=layers), fam.loss_fn)
    graph = trace(model, model.flatten(fam.batch(0, BATCH))).gm.graph
    return frozenset(n.target for n in graph.nodes
                     if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))


def planned_and_counted(family: str, plan: str, dtype: str = "fp32"):
    """(``usc.plan`` pinned to ``plan`` on 2 GPUs for 6 sequences of 10 tokens in ``dtype``, its
    activations per rank, the most bytes a rank of that plan holds at once over one real step in
    the simulator by ``usc.testing.memory_counters.count_peaks`` -- nothing of the cost model's)."""
    import usc
    from usc.testing.memory_counters import count_peaks

    fam = FAMILIES[family]
    torch.manual_seed(0)
    batch = fam.batch(0, BATCH)
    chosen = usc.plan(fam.build(), f"gpus=2 {plan} seq={SEQ} global_batch={BATCH} dtype={dtype} fuse=off",
                      example_inputs=batch, loss_fn=fam.loss_fn)
    torch.manual_seed(0)
    sim = usc.simulate(fam.build(), chosen, example_inputs=batch, loss_fn=fam.loss_fn)
    counted = max(count_peaks(sim, sim.flat_batch((batch,))))
    return chosen, chosen.search.best.estimate.memory["activations"], counted
