"""ZeRO-0/1/2 on real gloo processes: step time, the dp bytes each rank hands its collectives, and
the gradient bytes a rank holds at its peak.

    python benchmarks/zero_steps.py [--ranks 4] [--steps 5]

Ranks train a Llama-style model whose parameters outweigh its activations (hidden 512, 4 layers,
~17M parameters, 3 sequences of 64 per rank and microbatch), so the gradient sums dominate the step. Each plan runs
a few warm-up steps, then ``--steps`` timed ones; printed: the median step time over ranks'
medians, the dp payload per step by kind (``comm.stats``: the bytes handed in, not those on the
wire -- a ring reduce-scatter puts (n-1)/n of them on the wire, an all-reduce twice that), and the
largest gradient bytes a rank held (``peak_state_bytes``).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import usc  # noqa: E402
from usc.runtime.launch import launch_local  # noqa: E402
from usc.testing.models import LlamaConfig, TinyLlama, token_batch  # noqa: E402

CFG = LlamaConfig(vocab=4096, hidden=512, heads=8, kv_heads=4, mlp=1408, layers=4, max_seq=64)
PLANS = ("dp={n}", "dp={n} zero=1", "dp={n} zero=2", "dp={n} mb=3 zero=1", "dp={n} mb=3 zero=2")


def run(plan: str, steps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = int(os.environ["WORLD_SIZE"])
    batch = token_batch(CFG.vocab, 3 * n * (3 if "mb=3" in plan else 1), 64)
    step = usc.compile(TinyLlama(CFG), plan, example_inputs=batch)
    for _ in range(2):
        step.step(*batch)  # warm up (the optimizer state exists from the first step)
    comm = step._rank().mesh.comm("dp")
    before = dict(comm.stats.bytes)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step.step(*batch)
        times.append(time.perf_counter() - start)
    moved = {k: (v - before.get(k, 0)) / steps for k, v in comm.stats.bytes.items() if v - before.get(k, 0)}
    return {"step_s": statistics.median(times), "moved": moved, "grads": step._rank().peak_state_bytes["grads"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"| plan ({args.ranks} gloo processes) | step (median) | dp bytes handed in per step and rank | "
          "gradient bytes held at the peak |")
    print("|---|---|---|---|")
    for template in PLANS:
        plan = template.format(n=args.ranks)
        results = launch_local(run, args.ranks, plan, args.steps)
        moved = results[0]["moved"]
        kinds = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(moved.items()) if v > 2**16)
        print(f"| `{plan}` | {statistics.median(r['step_s'] for r in results) * 1e3:.0f} ms | {kinds} | "
              f"{max(r['grads'] for r in results) / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
