"""Small reference models built from configs with random weights (no hub, no downloads).

They are written the way users write models — plain ``nn.Module`` code with no usc-specific
hooks — so the compiler meets them as it would meet a user's model.

>>> model = TinyLlama(LlamaConfig())
>>> tokens = torch.randint(0, 128, (4, 16))
>>> loss = model(tokens, tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 128
    layers: int = 2
    max_seq: int = 64
    rope_theta: float = 10000.0
    eps: float = 1e-6


@dataclass(frozen=True)
class GPT2Config:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    max_seq: int = 64
    eps: float = 1e-5


LLAMA3_8B = LlamaConfig(vocab=128256, hidden=4096, heads=32, kv_heads=8, mlp=14336, layers=32, max_seq=8192,
                        rope_theta=500000.0, eps=1e-5)


class RMSNorm(nn.Module):
    """RMSNorm written out of pointwise ops, as Llama does it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """GPT-style init: N(0, std) for matrices, zeros for biases (norm weights stay at one)."""
    for name, param in model.named_parameters():
        if param.dim() > 1:
            nn.init.normal_(param, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(param)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.down_proj = nn.Linear(cfg.mlp, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Llama-style decoder: embedding, RMSNorm, causal attention with RoPE and GQA, SwiGLU, lm head.

    ``forward(tokens, labels)`` returns the mean next-token cross-entropy; labels are shifted
    inside, as Hugging Face causal LMs do.
    """

    def __init__(self, cfg: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        head_dim = cfg.hidden // cfg.heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        init_weights(self)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        shifted = logits[:, :-1, :].reshape(-1, logits.shape[-1])
        return F.cross_entropy(shifted, labels[:, 1:].reshape(-1))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.mlp_proj = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.c_attn(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class TinyGPT2(nn.Module):
    """GPT-2-style decoder: learned positions, LayerNorm, GELU MLP, lm head tied to the embedding."""

    def __init__(self, cfg: GPT2Config = GPT2Config()) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        init_weights(self)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


@dataclass(frozen=True)
class MoEConfig:
    """A Llama-style decoder whose MLPs are mixtures of SwiGLU experts."""

    vocab: int = 128
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 32  # each routed expert's hidden size
    shared_mlp: int = 64  # the shared expert's (DeepSeek)
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    max_seq: int = 64
    aux_loss_coef: float = 0.01
    # the load-balancing loss is taken in float32 as Mixtral writes it; None: in the model's dtype
    aux_dtype: torch.dtype | None = torch.float32
    router_std: float = 0.5  # large enough that top-k choices are not near-ties
    rope_theta: float = 10000.0
    eps: float = 1e-6


class MixtralExpert(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.w2 = nn.Linear(cfg.mlp, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """Mixtral's MoE block (as Hugging Face writes it): softmax router, top-k renormalised, a
    ModuleList of experts, a dropless loop over experts; returns (output, router logits)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = nn.ModuleList(MixtralExpert(cfg) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        flat = x.view(-1, h)
        logits = self.gate(flat)
        weights = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(selected == e)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view(b, s, h), logits


def load_balancing_loss(logits: torch.Tensor, experts: int, top_k: int,
                        dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """Switch/Mixtral auxiliary loss: E * sum_e (fraction of assignments to e) * (mean prob of e),
    in ``dtype`` (None: the logits')."""
    dtype = dtype or logits.dtype
    probs = F.softmax(logits, dim=-1, dtype=dtype)
    _, selected = torch.topk(probs, top_k, dim=-1)
    mask = (selected.unsqueeze(-1) == torch.arange(experts, device=logits.device)).to(dtype)
    return experts * (mask.mean(0) * probs.mean(0).unsqueeze(0)).sum()


class MoEDecoderBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, moe: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.moe = moe

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out = self.moe(self.post_attention_layernorm(x))
        if isinstance(out, tuple):
            return x + out[0], out[1]
        return x + out, None


class _MoEDecoder(nn.Module):
    """Embedding, MoE decoder blocks, lm head; forward(tokens, labels) -> mean cross-entropy
    (+ the auxiliary loss of blocks that return router logits)."""

    def __init__(self, cfg: MoEConfig, make_moe) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(MoEDecoderBlock(cfg, make_moe(cfg)) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        head_dim = cfg.hidden // cfg.heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        emb = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        init_weights(self)
        for layer in self.layers:
            nn.init.normal_(layer.moe.gate.weight, std=cfg.router_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        seq = tokens.shape[1]
        x = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        aux = []
        for layer in self.layers:
            x, logits = layer(x, cos, sin)
            if logits is not None:
                aux.append(load_balancing_loss(logits, cfg.experts, cfg.top_k, cfg.aux_dtype))
        logits = self.lm_head(self.norm(x))
        loss = F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return loss + cfg.aux_loss_coef * sum(aux) / len(aux) if aux else loss


class TinyMixtral(_MoEDecoder):
    """Mixtral-style: every MLP is top-2 of 8 SwiGLU experts (a ModuleList), with the
    load-balancing auxiliary loss added to the LM loss."""

    def __init__(self, cfg: MoEConfig = MoEConfig()) -> None:
        super().__init__(cfg, MixtralSparseMoeBlock)


class DeepSeekMoE(nn.Module):
    """DeepSeek-style MoE: sigmoid router, top-k renormalised, routed experts as stacked weights
    [E, in, out], plus an always-on shared expert."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.mlp))
        self.w3 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.mlp))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.mlp, cfg.hidden))
        self.shared_expert = LlamaMLP(LlamaConfig(hidden=cfg.hidden, mlp=cfg.shared_mlp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.gate(flat).float())
        weights, selected = torch.topk(scores, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        routed = torch.zeros_like(flat)
        for e in range(self.w1.shape[0]):
            token, slot = torch.where(selected == e)
            h = flat[token]
            y = (F.silu(h @ self.w1[e]) * (h @ self.w3[e])) @ self.w2[e]
            routed.index_add_(0, token, y * weights[token, slot, None])
        return routed.view_as(x) + self.shared_expert(x)


class TinyDeepSeek(_MoEDecoder):
    """DeepSeek-style: every MLP is a shared expert plus top-2 of 8 routed experts (stacked weights)."""

    def __init__(self, cfg: MoEConfig = MoEConfig()) -> None:
        super().__init__(cfg, DeepSeekMoE)


class DropoutNet(nn.Module):
    """Two residual MLP blocks with dropout inside: a recompute that drew new random numbers would
    change the gradients. forward(tokens [B, S] < 32, labels) -> mean cross-entropy."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(p), nn.Linear(32, 16))
                                    for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class TorchEncoderLM(nn.Module):
    """A language model on torch's own ``nn.TransformerEncoder``, written as torch's examples write it.

    ``batch_first=False`` is torch's default layout: the tokens are read as ``[S, B]``.
    ``causal=True`` builds the causal mask in forward and gives no ``is_causal`` hint."""

    def __init__(self, vocab: int = 64, width: int = 16, heads: int = 2, ffn: int = 24, layers: int = 2, *,
                 batch_first: bool = True, causal: bool = False) -> None:
        super().__init__()
        self.batch_first, self.causal = batch_first, causal
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=ffn, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1 if self.batch_first else 0]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=self.head.weight.dtype) \
            if self.causal else None
        hidden = self.encoder(self.embed(tokens), mask=mask)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


def seeded(factory, *args, seed: int = 0, **kwargs):
    """``factory(*args, **kwargs)`` built from ``seed``, the global RNG left as it was: the same
    weights on every call, so a test that lints or compiles one model under several plans gets one
    trace from the trace memo (tests/conftest.py) where what it checks (sizes, collectives, bytes,
    regions) reads no values."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory(*args, **kwargs)


def token_batch(vocab: int, batch: int, seq: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (tokens, labels) batch of random ids; labels equal tokens (the model shifts)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    return tokens, tokens.clone()


def shifted_batch(vocab: int, batch: int, seq: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) with labels already shifted and padded with -100 (ignore_index).

    Rows end in a different number of padded positions, so data-parallel shards hold different
    numbers of counted tokens: the case where a mean of per-shard means would be wrong.
    """
    tokens, _ = token_batch(vocab, batch, seq, seed=seed)
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    for row in range(batch):
        pad = (row * 3) % max(seq // 2, 1)
        if pad:
            labels[row, seq - 1 - pad:] = -100
    return tokens, labels


def memory_benchmark_models() -> list[tuple[str, object, tuple]]:
    """(name, model factory, batch) of the activation-memory benchmarks: a Llama-style and a
    GPT-2-style model, 4 layers, 2 x 512 tokens."""
    llama = LlamaConfig(vocab=256, hidden=128, heads=8, kv_heads=4, mlp=256, layers=4, max_seq=512)
    gpt2 = GPT2Config(vocab=256, hidden=128, heads=8, layers=4, max_seq=512)
    return [("Llama-style, 4 layers, 2 x 512 tokens", lambda: TinyLlama(llama), token_batch(256, 2, 512)),
            ("GPT-2-style, 4 layers, 2 x 512 tokens", lambda: TinyGPT2(gpt2), shifted_batch(256, 2, 512))]
