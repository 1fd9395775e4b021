"""Idle fraction per pipeline rank of each schedule on real gloo processes (p=4 or 2, m=8).

    python benchmarks/pipeline_bubble.py        # pp=4
    python benchmarks/pipeline_bubble.py 2      # pp=2 (one process per core on a 2-core machine)

Local processes train an 8-layer Llama-style model with pp=P and 8 microbatches. Each rank
records its forward/backward spans (Chrome trace); idle fraction = 1 - busy time / step time,
where busy time counts the F/B spans minus the time blocked in receives inside them.
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

CFG = LlamaConfig(vocab=256, hidden=128, heads=4, kv_heads=2, mlp=384, layers=8, max_seq=128)


def run(plan: str, trace_dir: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch = token_batch(CFG.vocab, 16, 64)
    step = usc.compile(TinyLlama(CFG), plan, example_inputs=batch)
    step.step(*batch)  # warm up
    rank = int(os.environ["RANK"])
    start = time.perf_counter()
    step.step(*batch, trace=os.path.join(trace_dir, "t.json"))
    wall = time.perf_counter() - start
    with open(os.path.join(trace_dir, f"t.rank{rank}.json")) as f:
        events = json.load(f)["traceEvents"]
    busy = sum(e["dur"] for e in events if e.get("cat") == "compute") / 1e6
    waiting = sum(e["dur"] for e in events if e.get("cat") == "comm-sync") / 1e6
    return {"rank": rank, "wall": wall, "idle": 1 - (busy - waiting) / wall}


def main() -> None:
    pp = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("gpipe", "1f1b", "interleaved v=2", "zb"):
            results = launch_local(run, pp, f"pp={pp} mb=8 schedule={schedule}", tmp)
            idle = ", ".join(f"{r['idle']:.0%}" for r in results)
            print(f"schedule={schedule:<15} step {max(r['wall'] for r in results) * 1e3:6.0f} ms; "
                  f"idle per rank: {idle}")


if __name__ == "__main__":
    main()
