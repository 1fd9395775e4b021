"""Where plan-only lint time goes at scale: Llama-3-8B (32 layers) and -70B (80 layers) shapes on the
meta device, 1024 ranks.

    python benchmarks/lint_scale.py            # targets on a 2-core CPU: 8B < 2 s, 70B < 3 s
    python benchmarks/lint_scale.py --full     # without stamping repeated layers (the reference)

Prints per phase, as wall/CPU seconds: trace (export), model facts, compile (passes + report), lint
(schedule, whole-mesh order check, rules) and the activation estimate (rank 0's program on fake
tensors), then the total. CPU time (this process's) is what the run costs when the machine is
shared; on an idle machine wall time is about the CPU time. The first export in a process pays
torch's one-time warm-up (about 1 s), counted in the first case's trace.
"""

from __future__ import annotations

import argparse
import time

import torch

from usc.build import _Compiled
from usc.compiler.lint_facts import model_facts
from usc.compiler.lint_rules import run_rules
from usc.linting import _compiled_input
from usc.testing.models import LLAMA3_8B, LlamaConfig, TinyLlama

LLAMA3_70B = LlamaConfig(vocab=128256, hidden=8192, heads=64, kv_heads=8, mlp=28672, layers=80, max_seq=8192,
                         rope_theta=500000.0, eps=1e-5)
CASES = [("Llama-3-8B", LLAMA3_8B, "dp=128 tp=8", 2.0), ("Llama-3-70B", LLAMA3_70B, "dp=128 tp=8", 3.0),
         ("Llama-3-70B", LLAMA3_70B, "dp=16 pp=8 tp=8 mb=8", 3.0)]


def phases(config: LlamaConfig, plan: str, *, stamp: bool) -> dict[str, float]:
    with torch.device("meta"):
        model = TinyLlama(config)
    tokens = torch.zeros(128, 4096, dtype=torch.long, device="meta")
    batch = (tokens, tokens)
    times, start = {}, (time.perf_counter(), time.process_time())

    def lap(name: str) -> None:
        nonlocal start
        now = (time.perf_counter(), time.process_time())
        times[name] = (now[0] - start[0], now[1] - start[1])
        start = now

    compiled = _Compiled(model, plan)
    traced = compiled.trace(batch, stamp=stamp)
    lap("trace")
    facts = model_facts(traced)
    lap("facts")
    compiled._build(batch, traced=traced)
    lap("compile")
    inp, _ = _compiled_input(compiled.plan, compiled, facts, None)
    run_rules(inp)
    lap("lint")
    _ = compiled.report.activation_bytes
    lap("activations")
    times["total"] = tuple(sum(t[i] for t in times.values()) for i in (0, 1))
    return times


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--full", action="store_true", help="trace every layer (no stamping)")
    stamp = not args.parse_args().full
    for name, config, plan, target in CASES:
        t = phases(config, plan, stamp=stamp)
        detail = "  ".join(f"{k} {v[0]:.2f}/{v[1]:.2f}" for k, v in t.items() if k != "total")
        wall, cpu = t["total"]
        verdict = "under" if cpu < target else "OVER"
        print(f"{name:<12} {plan:<22} {detail}  total {wall:.2f} s wall, {cpu:.2f} s CPU "
              f"({verdict} the {target:g} s target in CPU time)", flush=True)


if __name__ == "__main__":
    main()
