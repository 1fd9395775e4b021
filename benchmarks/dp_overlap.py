"""How much of data-parallel gradient communication hides behind backward, on real gloo processes.

    python benchmarks/dp_overlap.py

Two local processes train a 4-layer Llama-style model (hidden 256) with dp=2, once with one big
bucket (the reduction can only start when backward is over) and once with 1 MiB buckets (launched
from gradient hooks during backward). Prints per rank: step time, communication time, exposed
(not overlapped) communication, and how many buckets were launched during backward.
"""

import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import usc  # noqa: E402
from usc.runtime.launch import launch_local  # noqa: E402
from usc.testing.models import LlamaConfig, TinyLlama, token_batch  # noqa: E402

CFG = LlamaConfig(vocab=512, hidden=256, heads=8, kv_heads=4, mlp=768, layers=4, max_seq=256)


def run(plan: str, trace_dir: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch = token_batch(CFG.vocab, 8, 128)
    step = usc.compile(TinyLlama(CFG), plan, example_inputs=batch)
    for _ in range(2):
        step.step(*batch)  # warm up
    rank = int(os.environ["RANK"])
    start = time.perf_counter()
    step.step(*batch, trace=os.path.join(trace_dir, "trace.json"))
    elapsed = time.perf_counter() - start
    with open(os.path.join(trace_dir, f"trace.rank{rank}.json")) as f:
        events = json.load(f)["traceEvents"]
    comm = sum(e["dur"] for e in events if e.get("cat", "").startswith("comm")) / 1e6
    reducer = step._rank().reducer
    return {"rank": rank, "step_s": elapsed, "comm_s": comm, "exposed_s": step.report.exposed_comm_seconds,
            "buckets": len(reducer.buckets)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for plan in ("dp=2 bucket_mb=1000", "dp=2 bucket_mb=1"):
            results = launch_local(run, 2, plan, tmp)
            for r in results:
                print(f"{plan:<22} rank {r['rank']}: step {r['step_s'] * 1e3:7.1f} ms, comm spans "
                      f"{r['comm_s'] * 1e3:6.1f} ms, exposed {r['exposed_s'] * 1e3:6.1f} ms, buckets {r['buckets']}")


if __name__ == "__main__":
    main()
