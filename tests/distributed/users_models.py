"""Models users bring, built from config objects with random weights (nothing is downloaded): Hugging
Face families at tiny, odd sizes, plus a torchtitan-style Llama and a nanoGPT-style GPT written here in
those projects' styles. Each builder returns a module whose forward(*batch) returns the loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

transformers = None  # imported on first use: the tier is skipped where transformers is missing

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 98, 48, 80, 6, 2, 2, 10, 6


def _tf():
    global transformers
    if transformers is None:
        import transformers as tf

        transformers = tf
    return transformers


class LossOf(nn.Module):
    """The model's own loss from ``labels`` (Hugging Face shifts causal-LM labels inside).

    ``in_model_dtype``: the same loss computed here in the model's dtype. Hugging Face's losses cast
    the logits to float32, which would make a float64 second opinion a float32 one at the loss."""

    def __init__(self, model: nn.Module, input_name: str = "input_ids", *, shift: bool = True) -> None:
        super().__init__()
        self.m = model
        self.input_name = input_name
        self.shift = shift
        self.in_model_dtype = False

    def forward(self, inputs, labels):
        if not self.in_model_dtype:
            return self.m(**{self.input_name: inputs}, labels=labels).loss
        logits = self.m(**{self.input_name: inputs}).logits
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _no_dropout(cfg):
    """Training-mode dropout would draw differently on one device and on a mesh; the tier compares
    exact training, so every dropout probability the config names is zero."""
    for name, value in list(vars(cfg).items()):
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(cfg, name, 0.0)
    return cfg


def _decoder_config(name: str, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  use_cache=False, tie_word_embeddings=False)
    common.update(extra)
    return _no_dropout(getattr(_tf(), name)(**common))


def _causal_lm(config_name: str, model_name: str, **extra):
    def build():
        return LossOf(getattr(_tf(), model_name)(_decoder_config(config_name, **extra)))
    return build


def _gpt2():
    cfg = _tf().GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                           bos_token_id=0, eos_token_id=0, use_cache=False)
    return LossOf(_tf().GPT2LMHeadModel(_no_dropout(cfg)))


def _gpt_neox():
    cfg = _tf().GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, rotary_pct=0.5, use_parallel_residual=True,
                              max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    return LossOf(_tf().GPTNeoXForCausalLM(_no_dropout(cfg)))


def _falcon():
    cfg = _tf().FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             num_kv_heads=KV_HEADS, new_decoder_architecture=True, use_cache=False, bias=False,
                             max_position_embeddings=64)
    return LossOf(_tf().FalconForCausalLM(_no_dropout(cfg)))


def _bloom():
    cfg = _tf().BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, use_cache=False)
    return LossOf(_tf().BloomForCausalLM(_no_dropout(cfg)))


def _bert_mlm():
    cfg = _tf().BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=FFN, max_position_embeddings=64)
    return LossOf(_tf().BertForMaskedLM(_no_dropout(cfg)), shift=False)


def _vit():
    cfg = _tf().ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_size=FFN, image_size=12, patch_size=4, num_channels=3, num_labels=5)
    return LossOf(_tf().ViTForImageClassification(_no_dropout(cfg)), input_name="pixel_values", shift=False)


def _gptj():
    cfg = _tf().GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=4, n_positions=64,
                           use_cache=False, tie_word_embeddings=False)
    return LossOf(_tf().GPTJForCausalLM(_no_dropout(cfg)))


def _opt():
    cfg = _tf().OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=FFN,
                          num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN, max_position_embeddings=64,
                          use_cache=False)
    return LossOf(_tf().OPTForCausalLM(_no_dropout(cfg)))


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


class TitanTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = TitanLlama()

    def forward(self, tokens, labels):
        return loss_fn(self.model(tokens), labels)


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


class NanoTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = NanoGPT()

    def forward(self, idx, targets):
        return self.gpt(idx, targets)[1]


def _moe(config_name: str, model_name: str, **extra):
    """Mixture-of-experts families: 4 experts, top-2, at the dense tier's sizes."""
    return _causal_lm(config_name, model_name, **extra)


MOE_FAMILIES = {
    "mixtral": _moe("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _moe("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=40, shared_expert_intermediate_size=40),
    "qwen3_moe": _moe("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=40, head_dim=8),
    "deepseek_v3": _moe("DeepseekV3Config", "DeepseekV3ForCausalLM", n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=40, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        num_key_value_heads=HEADS),
    "gpt_oss": _moe("GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                    sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
}

FAMILIES = {
    "llama": _causal_lm("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": _causal_lm("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _causal_lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "mistral": _causal_lm("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "gemma": _causal_lm("GemmaConfig", "GemmaForCausalLM", head_dim=8),
    "gemma2": _causal_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, attn_implementation="eager"),
    "gemma3": _causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8),
    "phi3": _causal_lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "olmo": _causal_lm("OlmoConfig", "OlmoForCausalLM", pad_token_id=0),
    "olmo2": _causal_lm("Olmo2Config", "Olmo2ForCausalLM", pad_token_id=0),
    "granite": _causal_lm("GraniteConfig", "GraniteForCausalLM"),
    "cohere": _causal_lm("CohereConfig", "CohereForCausalLM", pad_token_id=0),
    "starcoder2": _causal_lm("Starcoder2Config", "Starcoder2ForCausalLM", sliding_window=None),
    "stablelm": _causal_lm("StableLmConfig", "StableLmForCausalLM"),
    "smollm3": _causal_lm("SmolLM3Config", "SmolLM3ForCausalLM", pad_token_id=0),
    "helium": _causal_lm("HeliumConfig", "HeliumForCausalLM", head_dim=8, pad_token_id=0),
    "glm4": _causal_lm("Glm4Config", "Glm4ForCausalLM", head_dim=8, pad_token_id=0),
    "gpt_neox": _gpt_neox,
    "falcon": _falcon,
    "bloom": _bloom,
    "gpt2": _gpt2,
    "gptj": _gptj,
    "opt": _opt,
    "bert_mlm": _bert_mlm,
    "vit": _vit,
    "torchtitan_llama": TitanTrain,
    "nanogpt": NanoTrain,
    **MOE_FAMILIES,
}


def batches(family: str, n: int = 2, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches for the family (images and class labels for ViT, tokens otherwise)."""
    out = []
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        if family == "vit":
            out.append((torch.randn(batch, 3, 12, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)))
        else:
            ids = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
            out.append((ids, ids))
    return out
