"""Measured activation bytes per rank (saved for backward) under sp and cp, same global sequence.

    python benchmarks/activation_memory.py

A 4-layer Llama-style model, batch 2 x 512 tokens; prints bytes per rank and the ratio to the
single-device run.
"""

import torch

import usc
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, shifted_batch, token_batch

PLANS = ["dp=1", "cp=2", "cp=4", "cp=2 cp_mode=zigzag", "cp=4 cp_mode=zigzag", "cp=2 cp_mode=ulysses",
         "tp=2", "tp=2 sp=on", "tp=2 cp=2 sp=on"]


def measure(name, factory, batch) -> None:
    base = None
    print(f"\n{name}:")
    for plan in PLANS:
        torch.manual_seed(0)
        sim = usc.simulate(factory(), plan, example_inputs=batch)
        per_rank = sim.activation_bytes(*batch)
        peak = max(per_rank)
        base = base or peak
        print(f"  {plan:<22} {peak / 2**20:8.2f} MiB per rank (max over ranks)  x{peak / base:.3f} of one device")


def main() -> None:
    torch.set_num_threads(1)
    llama = LlamaConfig(vocab=256, hidden=128, heads=8, kv_heads=4, mlp=256, layers=4, max_seq=512)
    measure("Llama-style, 4 layers, 2 x 512 tokens", lambda: TinyLlama(llama), token_batch(256, 2, 512))
    gpt2 = GPT2Config(vocab=256, hidden=128, heads=8, layers=4, max_seq=512)
    measure("GPT-2-style, 4 layers, 2 x 512 tokens", lambda: TinyGPT2(gpt2), shifted_batch(256, 2, 512))


if __name__ == "__main__":
    main()
