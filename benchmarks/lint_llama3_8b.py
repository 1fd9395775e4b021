"""Time usc.lint on a 32-layer Llama-3-8B-shaped model on the meta device (no weights allocated).

    python benchmarks/lint_llama3_8b.py            # target: under 5 s on a 2-core CPU machine

Prints the trace time, the pass times and the total, and the peak resident memory.
"""

import resource
import time

import torch

import usc
from usc.testing.models import LLAMA3_8B, TinyLlama


def main() -> None:
    start = time.perf_counter()
    with torch.device("meta"):
        model = TinyLlama(LLAMA3_8B)
    built = time.perf_counter()
    tokens = torch.zeros(16, 4096, dtype=torch.long, device="meta")
    report = usc.lint(model, "dp=16 tp=8", example_inputs=(tokens, tokens))
    done = time.perf_counter()
    print(f"model built on meta: {built - start:.2f} s")
    print(f"usc.lint (trace + passes + report): {done - built:.2f} s")
    for name, seconds, nodes in report.pass_timings:
        print(f"  pass {name:<10} {seconds:.3f} s  ({nodes} nodes)")
    print(f"collectives listed: {len(report.collectives)}; parameters per rank: "
          f"{report.param_bytes_per_rank / 2**30:.2f} GiB (not allocated)")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
