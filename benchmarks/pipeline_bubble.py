"""Idle fraction per pipeline rank of each schedule, measured on real gloo processes (p=4, m=8).

    python benchmarks/pipeline_bubble.py                   # pp=4, mb=8, emulated device compute
    python benchmarks/pipeline_bubble.py --pp 2 --real     # real CPU compute (one process per core)
    python benchmarks/pipeline_bubble.py --dp 2 --pp 2 --hidden 1024 --seq 2 --bucket-mb 4 --schedules 1f1b \
        --compare-overlap
                                           # dp=2 x pp=2: the dp gradient reduction overlapped or not

Each rank runs usc's pipeline executor on its own process (gloo send/recv between stages) and
records its spans (Chrome trace). Idle fraction of a rank = 1 - (time in forward/backward/weight
spans - time blocked on receives inside them) / step time.

Why emulated compute by default: on a machine with fewer cores than ranks, processes that compute
at once share cores, so a rank's busy time stretches with how many others are busy and the idle
fraction measures the operating system's scheduler, not the pipeline. With ``--emulate`` (the
default) every layer is a linear whose forward, input-gradient and weight-gradient each also hold
the rank for a fixed time without using a core (``time.sleep``, as an accelerator kernel would), so
p ranks on fewer cores behave like p devices. The executor, the schedules, the stage split and the
gloo transfers are the real ones; only the arithmetic is replaced by waiting. ``--real`` measures
plain CPU compute instead (meaningful where each rank has a core of its own).

The expected idle fraction of a step with unit-time actions is printed next to each measurement:
(p-1)/(m+p-1) for gpipe and 1f1b (a bubble of (p-1)/m relative to the work), (p-1)/(v*m+p-1) for
interleaved; zb fills part of the bubble with deferred weight-gradient steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import usc  # noqa: E402
from usc.passes.sharding_rules import SHARDING_RULES, pointwise  # noqa: E402
from usc.runtime.launch import launch_local  # noqa: E402
from usc.testing.models import LlamaConfig, TinyLlama, token_batch  # noqa: E402

CFG = LlamaConfig(vocab=256, hidden=128, heads=4, kv_heads=2, mlp=384, layers=8, max_seq=128)
SCHEDULES = ("gpipe", "1f1b", "interleaved v=2", "zb")


@torch.library.custom_op("uscbench::hold", mutates_args=())
def hold(x: torch.Tensor, forward_ms: float, backward_ms: float) -> torch.Tensor:
    """The identity that also holds the rank for ``forward_ms`` (emulated device time); its
    gradient holds it for ``backward_ms``."""
    time.sleep(forward_ms / 1e3)
    return x.clone()


@hold.register_fake
def _(x, forward_ms, backward_ms):
    return torch.empty_like(x)


def _hold_setup(ctx, inputs, output):
    ctx.backward_ms = inputs[2]


def _hold_backward(ctx, grad):
    return hold(grad, ctx.backward_ms, 0.0), None, None


hold.register_autograd(_hold_backward, setup_context=_hold_setup)
SHARDING_RULES[torch.ops.uscbench.hold.default] = pointwise("unary")  # elementwise: any sharding passes through


class TimedLayer(nn.Module):
    """tanh(x W^T) where the forward, the input gradient and the weight gradient each hold the rank
    for ``ms``: the waits sit on the input path and on the weight's own branch, so zb's split
    backward pays each once, as with a real linear.

    ``weight_branch=False`` (runs with dp > 1): a parameter passed through an op of our own would
    have its dp gradient sum inserted into the graph per microbatch rather than left to the
    gradient reducer, so the weight feeds the matmul directly and the input path holds for both."""

    def __init__(self, hidden: int, ms: float, weight_branch: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)
        self.ms, self.weight_branch = ms, weight_branch

    def forward(self, x):
        if not self.weight_branch:
            return torch.tanh(hold(x, self.ms, 2 * self.ms) @ self.weight.t())
        return torch.tanh(hold(x, self.ms, self.ms) @ hold(self.weight, 0.0, self.ms).t())


class TimedNet(nn.Module):
    """8 layers of emulated device time; a mean-square loss."""

    def __init__(self, hidden: int = 64, layers: int = 8, ms: float = 5.0, weight_branch: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TimedLayer(hidden, ms, weight_branch) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def run(plan: str, trace_dir: str, emulate_ms: float | None, hidden: int = 64, overlap: bool = True,
        seq: int = 32) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if emulate_ms is None:
        model, batch = TinyLlama(CFG), token_batch(CFG.vocab, 16, 64)
    else:
        model = TimedNet(hidden, ms=emulate_ms, weight_branch=usc.parse_plan(plan).size("dp") == 1)
        batch = (torch.randn(16, seq, hidden),)
    step = usc.compile(model, plan, example_inputs=batch)
    if not overlap:  # A/B: every backward action under no_sync, the whole reduction after the pipeline
        step._rank()._final_backward = {}
    step.step(*batch)  # warm up
    rank = int(os.environ["RANK"])
    step.step(*batch)
    start = time.perf_counter()
    step.step(*batch, trace=os.path.join(trace_dir, "t.json"))
    wall = time.perf_counter() - start
    with open(os.path.join(trace_dir, f"t.rank{rank}.json")) as f:
        events = json.load(f)["traceEvents"]
    busy = sum(e["dur"] for e in events if e.get("cat") == "compute") / 1e6
    waiting = sum(e["dur"] for e in events if e.get("cat") == "comm-sync") / 1e6
    return {"rank": rank, "wall": wall, "idle": 1 - (busy - waiting) / wall}


def expected_idle(schedule: str, p: int, m: int) -> str:
    if schedule in ("gpipe", "1f1b"):
        return f"{(p - 1) / (m + p - 1):.0%}"
    if schedule.startswith("interleaved"):
        v = int(schedule.split("v=")[1])
        return f"{(p - 1) / (v * m + p - 1):.0%}"
    return "below 1f1b"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--mb", type=int, default=8)
    parser.add_argument("--emulate", type=float, default=5.0, metavar="MS",
                        help="milliseconds of emulated device time per layer and per pass (default 5)")
    parser.add_argument("--real", action="store_true", help="real CPU compute (TinyLlama, 8 layers) instead")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (ranks = dp * pp)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the emulated layers")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence of the emulated model's batch (16 sequences)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset")
    parser.add_argument("--bucket-mb", type=float, default=None, help="gradient bucket size (plan's bucket_mb)")
    parser.add_argument("--compare-overlap", action="store_true",
                        help="also run with the dp reduction after the pipeline instead of overlapped")
    args = parser.parse_args()
    emulate = None if args.real else args.emulate
    what = "real CPU compute, 8-layer Llama-style model" if args.real else \
        f"emulated device compute, {args.emulate:g} ms per layer per forward / input-grad / weight-grad"
    dp = f"dp={args.dp} " if args.dp > 1 else ""
    print(f"{dp}pp={args.pp} mb={args.mb}, {what}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules.split(","):
            for overlap in (True, False) if args.compare_overlap else (True,):
                plan = f"{dp}pp={args.pp} mb={args.mb} schedule={schedule}"
                if args.bucket_mb is not None:
                    plan += f" bucket_mb={args.bucket_mb:g}"
                results = launch_local(run, args.dp * args.pp, plan, tmp, emulate, args.hidden, overlap, args.seq)
                idle = ", ".join(f"{r['idle']:.0%}" for r in results)
                label = schedule + ("" if not args.compare_overlap else
                                    " (dp overlapped)" if overlap else " (dp after)")
                print(f"schedule={label:<15} step {max(r['wall'] for r in results) * 1e3:6.0f} ms; "
                      f"idle per rank: {idle}  (unit-time model: {expected_idle(schedule, args.pp, args.mb)})")


if __name__ == "__main__":
    main()
