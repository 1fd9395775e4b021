"""usc against hand-written PyTorch-native parallelism: same model, mesh, batch, optimizer.

    python benchmarks/native_comparison.py                      # every case, 20 timed steps
    python benchmarks/native_comparison.py --steps 40 --only dp4,tp4

For each case, 4 real gloo CPU processes (usc.runtime.launch.launch_local, one thread each) build
the same Llama-style model (4 layers, hidden 256, 8 heads / 4 kv heads, SwiGLU 768, vocab 2048)
twice from the same seed: once compiled by usc (`usc.compile(model, plan).step`), once wrapped by
the PyTorch-native API (benchmarks/native_parallel.py says what each shards). Both train on the
same global batch (8 x 128 tokens) with AdamW, their steps alternating in the same processes (the
order flips every step) so that load from other processes hits both alike. Each step starts
after a barrier; a step's time is the slowest rank's. Reported: the median step time of each
side, the median of the per-step usc/native ratios, and the ratio of CPU seconds per step summed
over ranks (less sensitive to load than wall time). Memory per rank, two measures:
  - state: bytes of parameters + gradients + AdamW state this rank holds at the gradient peak
    (after backward), counted from the tensors (local shards) — exact, noise-free;
  - RSS: in a separate world per side, the peak resident set during steps after the first (VmHWM,
    reset) minus the resident set before the model was built (both after malloc_trim), max over
    ranks — includes activations, communication buffers and allocator slack.
The first-step losses of both sides must agree (same weights, same batch): the difference is
printed. Timings are wall-clock on a shared machine: the environment (cores, load) is printed.
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
SIDES = ("native", "usc")


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


def _timed(trainer, batch: tuple) -> tuple[float, float, float]:
    """(loss, wall seconds, CPU seconds of this process) of one step, started after a barrier."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = trainer.step(batch)
    return loss, time.perf_counter() - wall, time.process_time() - cpu


def run_timing(name: str, warmup: int, steps: int) -> dict:
    """One rank of the timing world: both sides in this process, their steps alternating (the
    order flips every step), so a burst of load from other processes hits both sides alike."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # usc's Mesh and the native meshes reuse the default group
    batch = token_batch(CFG.vocab, BATCH, SEQ)
    trainers = {side: _trainer(side, CASES[name], batch) for side in SIDES}
    out = {side: {"wall": [], "cpu": [], "losses": []} for side in SIDES}
    for i in range(warmup + steps):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            loss, wall, cpu = _timed(trainers[side], batch)
            out[side]["losses"].append(loss)
            if i >= warmup:
                out[side]["wall"].append(wall)
                out[side]["cpu"].append(cpu)
    for side in SIDES:
        out[side]["state"] = trainers[side].state_bytes
    dist.barrier()
    dist.destroy_process_group()
    return out


def run_memory(side: str, name: str, steps: int) -> int:
    """One rank of a memory world (one side only): RSS growth over the pre-model baseline, peak
    during steps after the first."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batch = token_batch(CFG.vocab, BATCH, SEQ)
    _trim()
    base_kib = _status_kib("VmRSS")
    trainer = _trainer(side, CASES[name], batch)
    trainer.step(batch)
    _trim()
    _reset_peak_rss()
    for _ in range(steps):
        trainer.step(batch)
    peak_kib = _status_kib("VmHWM")
    dist.barrier()
    dist.destroy_process_group()
    return (peak_kib - base_kib) * 1024


# ------------------------------------------------------------------------------------- report
def _summary(timing: list[dict], rss: list[int] | None, side: str) -> dict:
    ranks = [t[side] for t in timing]
    slowest = [max(step) for step in zip(*(r["wall"] for r in ranks))]
    cpu = [sum(step) for step in zip(*(r["cpu"] for r in ranks))]
    return {"wall": slowest, "median": statistics.median(slowest), "cpu": statistics.median(cpu),
            "state": max(r["state"] for r in ranks), "rss": max(rss) if rss else float("nan"),
            "first_loss": ranks[0]["losses"][0]}


def measure(name: str, warmup: int, steps: int, rss_steps: int) -> tuple[dict, dict]:
    timing = launch_local(run_timing, WORLD, name, warmup, steps)
    out = {}
    for side in SIDES:
        rss = launch_local(run_memory, WORLD, side, name, rss_steps) if rss_steps else None
        out[side] = _summary(timing, rss, side)
    pair = [u / n for u, n in zip(out["usc"]["wall"], out["native"]["wall"])]
    out["usc"]["ratio"] = statistics.median(pair)
    return out["usc"], out["native"]


def environment() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load}; "
            f"torch {torch.__version__}, gloo, {WORLD} processes x 1 thread; Python {platform.python_version()}")


def table(rows: list[tuple[str, dict, dict]]) -> str:
    lines = ["| plan | usc ms | native ms | usc/native (wall) | usc/native (CPU) | state MiB usc / native | "
             "RSS MiB usc / native | first-step loss diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    mib = 2**20
    for plan, u, n in rows:
        lines.append(f"| `{plan}` | {u['median'] * 1e3:.0f} | {n['median'] * 1e3:.0f} | {u['ratio']:.2f} | "
                     f"{u['cpu'] / n['cpu']:.2f} | {u['state'] / mib:.1f} / {n['state'] / mib:.1f} | "
                     f"{u['rss'] / mib:.0f} / {n['rss'] / mib:.0f} | {abs(u['first_loss'] - n['first_loss']):.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (medians reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rss-steps", type=int, default=3, help="steps of each memory world (0: skip RSS)")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {','.join(CASES)}")
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"environment: {environment()}")
    print(f"model: Llama-style {CFG.layers} layers, hidden {CFG.hidden}, vocab {CFG.vocab}; global batch "
          f"{BATCH} x {SEQ}; AdamW; {args.warmup} warm-up + {args.steps} timed steps per side\n", flush=True)
    rows = []
    for name in names:
        usc_side, native = measure(name, args.warmup, args.steps, args.rss_steps)
        rows.append((CASES[name].plan, usc_side, native))
        print(f"{CASES[name].plan:<28} usc {usc_side['median'] * 1e3:7.1f} ms   native {native['median'] * 1e3:7.1f} ms"
              f"   ratio {usc_side['ratio']:.2f}   (load {os.getloadavg()[0]:.2f})", flush=True)
    print()
    print(table(rows))
    print(f"\nenvironment at the end: {environment()}")


if __name__ == "__main__":
    main()
