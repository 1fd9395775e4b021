"""Hugging Face models for tests and benchmarks: built from their config classes with random weights
(nothing is downloaded), wrapped so that forward returns the loss usc trains. Needs ``transformers``.

>>> model = hf_llama(num_hidden_layers=1)   # doctest: +SKIP
>>> model(ids, ids)                          # the model's own causal-LM loss  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import nn

# A small Llama every test can afford: GQA (4 heads over 2 K/V heads), SDPA attention.
SMALL_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   attn_implementation="sdpa")


class CausalLMLoss(nn.Module):
    """``model(input_ids=ids, labels=labels).loss``: the model's own loss (Hugging Face shifts the
    labels inside)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids, labels):
        return self.m(input_ids=ids, labels=labels).loss


def hf_llama_model(*, device: str | None = None, **config):
    """Hugging Face's LlamaForCausalLM from ``SMALL_LLAMA`` updated by ``config`` (any LlamaConfig
    field), random weights, as users hold it; ``device="meta"`` builds it without memory (plan-only use)."""
    import transformers

    cfg = transformers.LlamaConfig(**{**SMALL_LLAMA, **config, "use_cache": False})
    with torch.device(device) if device is not None else _here():
        return transformers.LlamaForCausalLM(cfg)


def hf_llama(*, device: str | None = None, **config) -> CausalLMLoss:
    """``hf_llama_model`` whose forward takes (ids, labels) and returns the loss."""
    return CausalLMLoss(hf_llama_model(device=device, **config))


class _here:
    """The current default device (a no-op context)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


__all__ = ["CausalLMLoss", "SMALL_LLAMA", "hf_llama", "hf_llama_model"]
