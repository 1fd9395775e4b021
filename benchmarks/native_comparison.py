"""usc against hand-written PyTorch-native parallelism: same model, mesh, batch, optimizer.

    python benchmarks/native_comparison.py                      # every case, 20 timed steps
    python benchmarks/native_comparison.py --steps 40 --only dp4,tp4

For each case, two worlds of 4 real gloo CPU processes (usc.runtime.launch.launch_local, one
thread per process) train the same Llama-style model (4 layers, hidden 256, 8 heads / 4 kv
heads, SwiGLU 768, vocab 2048) from the same seed on the same global batch (8 x 128 tokens) with
AdamW: one world runs `usc.compile(model, plan).step`, the other the PyTorch-native version
(benchmarks/native_parallel.py says what each shards). Each timed step starts after a barrier;
a step's time is the slowest rank's, and the table gives the median over the timed steps (after
`--warmup` untimed ones). Memory per rank, two measures:
  - state: bytes of parameters + gradients + AdamW state this rank holds at the gradient peak
    (after backward), counted from the tensors (local shards) — exact, noise-free;
  - RSS: peak resident set during the timed steps (VmHWM, reset after warm-up) minus the
    resident set before the model was built (both after malloc_trim), max over ranks — includes
    activations, communication buffers and allocator slack.
The first-step losses of both sides must agree (same weights, same batch): the max difference
is printed. Timings are wall-clock on a shared machine: the environment (cores, load) is printed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import native_parallel  # noqa: E402
import usc  # noqa: E402
from usc.runtime.launch import launch_local  # noqa: E402
from usc.testing.models import LlamaConfig, TinyLlama, token_batch  # noqa: E402

CFG = LlamaConfig(vocab=2048, hidden=256, heads=8, kv_heads=4, mlp=768, layers=4, max_seq=128)
BATCH, SEQ, MICROBATCHES, WORLD = 8, 128, 4, 4


@dataclass(frozen=True)
class Case:
    plan: str
    build: str  # name of the native_parallel builder


CASES = {
    "dp4": Case("dp=4", "build_ddp"),
    "tp4": Case("tp=4", "build_tp"),
    "dp2tp2": Case("dp=2 tp=2", "build_dp_tp"),
    "zero3dp4": Case("dp=4 zero=3", "build_fsdp"),
    "pp4": Case(f"pp=4 mb={MICROBATCHES} schedule=1f1b", "build_pp"),
}


# ------------------------------------------------------------------------------- memory probes
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _trim() -> None:
    """Return freed heap pages to the OS so RSS reflects live memory (glibc keeps them otherwise)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


# ------------------------------------------------------------------------------------ workers
class _UscTrainer:
    def __init__(self, model, plan: str, batch: tuple) -> None:
        self.compiled = usc.compile(model, plan, example_inputs=batch)

    def step(self, batch: tuple) -> float:
        return self.compiled.step(*batch)

    @property
    def state_bytes(self) -> int:
        return sum(self.compiled._rank().peak_state_bytes.values())


def _trainer(side: str, case: Case, batch: tuple):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    if side == "usc":
        return _UscTrainer(model, case.plan, batch)
    builder = getattr(native_parallel, case.build)
    options = {"microbatches": MICROBATCHES} if case.build == "build_pp" else {}
    return builder(model, rank, world, **options)


def run_side(side: str, name: str, warmup: int, steps: int) -> dict:
    """One rank of one world: build, warm up, time `steps` steps; per-step times and memory."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # usc's Mesh and the native meshes reuse the default group
    batch = token_batch(CFG.vocab, BATCH, SEQ)
    _trim()
    base_kib = _status_kib("VmRSS")
    trainer = _trainer(side, CASES[name], batch)
    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup:
            _trim()
            _reset_peak_rss()
        dist.barrier()
        start = time.perf_counter()
        losses.append(trainer.step(batch))
        times.append(time.perf_counter() - start)
    peak_kib = _status_kib("VmHWM")
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times[warmup:], "first_loss": losses[0], "state": trainer.state_bytes,
            "rss": (peak_kib - base_kib) * 1024}


# ------------------------------------------------------------------------------------- report
def _summary(results: list[dict]) -> dict:
    slowest = [max(step) for step in zip(*(r["times"] for r in results))]
    return {"median": statistics.median(slowest), "state": max(r["state"] for r in results),
            "rss": max(r["rss"] for r in results), "first_loss": results[0]["first_loss"]}


def environment() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load}; "
            f"torch {torch.__version__}, gloo, {WORLD} processes x 1 thread; Python {platform.python_version()}")


def table(rows: list[tuple[str, dict, dict]]) -> str:
    lines = ["| plan | usc ms | native ms | usc/native | state MiB usc / native | RSS MiB usc / native | "
             "first-step loss diff |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    mib = 2**20
    for plan, u, n in rows:
        lines.append(f"| `{plan}` | {u['median'] * 1e3:.1f} | {n['median'] * 1e3:.1f} | "
                     f"{u['median'] / n['median']:.2f} | {u['state'] / mib:.1f} / {n['state'] / mib:.1f} | "
                     f"{u['rss'] / mib:.0f} / {n['rss'] / mib:.0f} | {abs(u['first_loss'] - n['first_loss']):.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {','.join(CASES)}")
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"environment: {environment()}")
    print(f"model: Llama-style {CFG.layers} layers, hidden {CFG.hidden}, vocab {CFG.vocab}; global batch "
          f"{BATCH} x {SEQ}; AdamW; {args.warmup} warm-up + {args.steps} timed steps\n", flush=True)
    rows = []
    for name in names:
        sides = {side: _summary(launch_local(run_side, WORLD, side, name, args.warmup, args.steps))
                 for side in ("native", "usc")}
        rows.append((CASES[name].plan, sides["usc"], sides["native"]))
        print(f"{CASES[name].plan:<28} usc {sides['usc']['median'] * 1e3:7.1f} ms   native "
              f"{sides['native']['median'] * 1e3:7.1f} ms   (load {os.getloadavg()[0]:.2f})", flush=True)
    print()
    print(table(rows))
    print(f"\nenvironment at the end: {environment()}")


if __name__ == "__main__":
    main()
