"""Compile time at scale: usc.lint and usc.compile for Llama-3-8B and 70B shapes on the meta device.

    python benchmarks/compile_time.py                         # both models, 128 / 512 / 1024 ranks
    python benchmarks/compile_time.py --models 8b --ranks 128

Plan-only mode: the models are built on the meta device (no weights allocated) and the mesh is
larger than this one process, so nothing runs; `usc.lint` returns the report and `usc.compile`
returns the per-rank program, ready for torchrun. Each row is timed in a fresh interpreter (so
no cache from an earlier row helps), after a warm-up lint of a tiny model in the same process
(imports excluded). Prints a markdown table with the wall time of each call, its CPU time (the
process's, which load from other processes inflates less), the time in passes, and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import usc  # noqa: E402
from usc.testing.models import LLAMA3_8B, LlamaConfig, TinyLlama, token_batch  # noqa: E402

LLAMA3_70B = LlamaConfig(vocab=128256, hidden=8192, heads=64, kv_heads=8, mlp=28672, layers=80, max_seq=8192,
                         rope_theta=500000.0, eps=1e-5)
MODELS = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}
SEQ, MB = 4096, 8
# tp=8 within a node, pp=4 across nodes, dp over the rest (ZeRO-1 over dp), 1F1B over 8 microbatches
PLANS = {128: f"dp=4 pp=4 tp=8 zero=1 mb={MB} schedule=1f1b",
         512: f"dp=16 pp=4 tp=8 zero=1 mb={MB} schedule=1f1b",
         1024: f"dp=32 pp=4 tp=8 zero=1 mb={MB} schedule=1f1b"}


def _inputs(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch on meta: one sequence per dp rank per microbatch."""
    tokens = torch.zeros(dp * MB, SEQ, dtype=torch.long, device="meta")
    return tokens, tokens


def measure_one(model_name: str, ranks: int) -> dict:
    """In this process: warm up on a tiny model, then time lint and compile of one row."""
    torch.set_num_threads(1)
    usc.lint(TinyLlama(LlamaConfig()), "dp=2 tp=2", example_inputs=token_batch(128, 4, 16))
    plan = PLANS[ranks]
    dp = usc.parse_plan(plan).size("dp")
    with torch.device("meta"):
        model = TinyLlama(MODELS[model_name])
    start, cpu = time.perf_counter(), time.process_time()
    report = usc.lint(model, plan, example_inputs=_inputs(dp))
    lint_s, lint_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    usc.compile(model, plan, example_inputs=_inputs(dp))  # the per-rank program, ready for torchrun
    compile_s, compile_cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"model": model_name, "ranks": ranks, "plan": plan, "lint_s": lint_s, "compile_s": compile_s,
            "lint_cpu": lint_cpu, "compile_cpu": compile_cpu,
            "passes_s": sum(seconds for _, seconds, _ in report.pass_timings),
            "collectives": len(report.collectives),
            "param_gib": report.param_bytes_per_rank / 2**30,
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _row_in_subprocess(model_name: str, ranks: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--row", model_name, str(ranks)], check=True,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8b,70b")
    parser.add_argument("--ranks", default="128,512,1024")
    parser.add_argument("--row", nargs=2, metavar=("MODEL", "RANKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(measure_one(args.row[0], int(args.row[1]))))
        return
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"environment: {os.cpu_count()} cores, load average {load}; torch {torch.__version__}; "
          f"Python {platform.python_version()}\n")
    print("| model | ranks | plan | usc.lint s (CPU s) | of which passes s | usc.compile s (CPU s) | "
          "collectives | params/rank GiB | peak RSS GiB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for model_name in args.models.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            r = _row_in_subprocess(model_name, ranks)
            print(f"| Llama-3-{model_name.upper()} | {ranks} | `{r['plan']}` | "
                  f"{r['lint_s']:.1f} ({r['lint_cpu']:.1f}) | {r['passes_s']:.1f} | "
                  f"{r['compile_s']:.1f} ({r['compile_cpu']:.1f}) | {r['collectives']} | "
                  f"{r['param_gib']:.2f} | {r['rss_gib']:.2f} |", flush=True)
    print(f"\nload average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
