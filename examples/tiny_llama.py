"""The tiny Llama used by the README: a factory for usc-lint and a training script.

    usc-lint examples/tiny_llama.py:factory --plan "dp=2 tp=2"
    python examples/train_tiny_llama.py
"""

import torch

from usc.testing.models import LlamaConfig, TinyLlama, token_batch

CONFIG = LlamaConfig(vocab=128, hidden=64, heads=4, kv_heads=2, mlp=128, layers=2, max_seq=64)


def factory():
    """(model, example_inputs) for usc-lint: a 2-layer Llama and a batch of 8 sequences of 32 tokens."""
    torch.manual_seed(0)
    return TinyLlama(CONFIG), token_batch(CONFIG.vocab, 8, 32)
