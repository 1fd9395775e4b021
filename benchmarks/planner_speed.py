"""Time usc.plan on Llama-3 shapes on the meta device (no weights allocated), and print its choices.

    python benchmarks/planner_speed.py                 # 8B (32 layers) at 512 H100s; target < 10 s
    python benchmarks/planner_speed.py --table         # 8B and 70B at 8, 64, 512 GPUs (the note's table)

usc.plan profiles the model once (a trace of two of its identical blocks, two probe compiles run on
fake tensors) and then scores every plan analytically; the time of each part is printed.
"""

import argparse
import time

import torch

import usc
from usc.compiler.planner import PlanTarget, search
from usc.planning import refusal
from usc.passes.cost_profile import profile_model
from usc.testing.models import LLAMA3_8B, LlamaConfig, TinyLlama

LLAMA3_70B = LlamaConfig(vocab=128256, hidden=8192, heads=64, kv_heads=8, mlp=28672, layers=80, max_seq=8192,
                         rope_theta=500000.0, eps=1e-5)
SHAPES = {"8B": LLAMA3_8B, "70B": LLAMA3_70B}


def meta_model(config):
    with torch.device("meta"):
        model = TinyLlama(config)
    tokens = torch.zeros(8, 4096, dtype=torch.long, device="meta")  # shapes only; seq/batch come from the spec
    return model, (tokens, tokens)


def one(name: str, gpus: int, seq: int, batch: int) -> None:
    model, example = meta_model(SHAPES[name])
    start = time.perf_counter()
    plan = usc.plan(model, f"gpus={gpus} gpus_per_node=8 seq={seq} global_batch={batch} dtype=bf16",
                    example_inputs=example, hardware="h100")
    total = time.perf_counter() - start
    print(plan.search)
    print(f"\nusc.plan total: {total:.2f} s (of which search {plan.search.seconds:.2f} s)")


def table() -> None:
    print("| model | GPUs | seq | global batch | chosen plan | step (s) | tokens/s | MFU | memory/rank (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        model, example = meta_model(SHAPES[name])
        profile = profile_model(model, example)
        for gpus, seq in ((8, 4096), (64, 4096), (512, 4096), (64, 32768), (512, 131072)):
            batch = 1024 if gpus == 512 else 256
            if seq > 4096:
                batch = max(gpus // 8, 8)
            target = PlanTarget(gpus=gpus, seq=seq, global_batch=batch, gpus_per_node=8, dtype="bf16")
            from usc.compiler.hardware import H100
            result = search(profile, target, H100, supported=refusal)
            best = result.best
            if best is None:
                print(f"| {name} | {gpus} | {seq} | {batch} | none fits | | | | |")
                continue
            est = best.estimate
            print(f"| {name} | {gpus} | {seq} | {batch} | `{best.plan.text()}` | {est.time['step']:.2f} | "
                  f"{est.tokens_per_second:,.0f} | {est.mfu:.1%} | {est.memory_total / 2**30:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--model", default="8B", choices=sorted(SHAPES))
    parser.add_argument("--gpus", type=int, default=512)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=1024)
    args = parser.parse_args()
    if args.table:
        table()
    else:
        one(args.model, args.gpus, args.seq, args.global_batch)


if __name__ == "__main__":
    main()
