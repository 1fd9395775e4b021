"""Activation bytes saved for backward per rank under recompute=none|selective|full: measured in
the simulator against the report's prediction, and the step time the recomputation costs.

    python benchmarks/recompute_memory.py

A 4-layer Llama-style model and a 4-layer GPT-2-style model, batch 2 x 512 tokens, on one device
and on dp=2 tp=2. "measured" is Simulated.activation_bytes (the largest rank); "predicted" is
report.activation_bytes_by_recompute (rank 0's program of each mode run on fake tensors).
"""

import statistics
import time

import torch

import usc
from usc.testing.models import memory_benchmark_models

MODES = ("none", "selective", "full")
MESHES = ("dp=1", "dp=2 tp=2")


def step_seconds(sim, batch, repeats: int = 3) -> float:
    sim.step(*batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sim.step(*batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, factory, batch) -> None:
    print(f"\n{name}:")
    print(f"  {'plan':<30} {'measured':>12} {'predicted':>12} {'diff':>7} {'x none':>7} {'step':>8}")
    for mesh in MESHES:
        torch.manual_seed(0)
        predicted = usc.lint(factory(), mesh, example_inputs=batch).activation_bytes_by_recompute
        base = None
        for mode in MODES:
            plan = f"{mesh} recompute={mode}"
            torch.manual_seed(0)
            sim = usc.simulate(factory(), plan, example_inputs=batch)
            measured = max(sim.activation_bytes(*batch))
            base = base or measured
            seconds = step_seconds(sim, batch)
            diff = (predicted[mode] - measured) / measured
            print(f"  {plan:<30} {measured / 2**20:9.2f} MiB {predicted[mode] / 2**20:9.2f} MiB {diff:+7.1%} "
                  f"{measured / base:7.3f} {seconds:7.2f}s")


def main() -> None:
    torch.set_num_threads(1)
    for name, factory, batch in memory_benchmark_models():
        measure(name, factory, batch)


if __name__ == "__main__":
    main()
