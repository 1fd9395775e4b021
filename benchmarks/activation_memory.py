"""Measured activation bytes per rank (saved for backward) under sp and cp, same global sequence.

    python benchmarks/activation_memory.py

A 4-layer Llama-style model, batch 2 x 512 tokens; prints bytes per rank and the ratio to the
single-device run.
"""

import torch

import usc
from usc.testing.models import memory_benchmark_models

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
    for name, factory, batch in memory_benchmark_models():
        measure(name, factory, batch)


if __name__ == "__main__":
    main()
