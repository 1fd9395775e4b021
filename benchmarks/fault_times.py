"""Time to error of each bad-input row of the fault tier on the simulator, per plan kind.

    python benchmarks/fault_times.py

TinyLlama (4 x 16 tokens, vocabulary 128) trains one step under each plan, then meets each bad batch of
tests/distributed/fault_cases.py (and a NaN on rank 1 only); the row prints the error every rank raised
and the milliseconds from the call to the error. A good step follows each row.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

import usc  # noqa: E402
from fault_cases import BAD_INPUTS, bad_batch, batches, heal, nan_on_one_rank, sgd  # noqa: E402
from usc.testing.models import TinyLlama  # noqa: E402

PLANS = ["dp=2", "tp=2", "pp=2 mb=2", "dp=2 zero=3"]


def row_times(plan: str) -> dict[str, str]:
    torch.manual_seed(0)
    sim = usc.simulate(TinyLlama(), plan, example_inputs=batches()[0], optimizer=sgd)
    sim.step(*batches()[0])
    out = {}
    for row in [*BAD_INPUTS, "NaN on one rank"]:
        batch = bad_batch(row, batches()[1]) if row in BAD_INPUTS else batches()[1]
        if row == "NaN on one rank":
            nan_on_one_rank(sim.ranks[1])
        start = time.perf_counter()
        try:
            sim.step(*batch)
            error = "none (!)"
        except Exception as exc:  # noqa: BLE001 - the row reports what was raised
            error = type(exc).__name__
        out[row] = f"{error} {1000 * (time.perf_counter() - start):.0f} ms"
        heal(sim.ranks[1])
    return out


def main() -> None:
    table = {plan: row_times(plan) for plan in PLANS}
    print("| row | " + " | ".join(PLANS) + " |")
    print("|---|" + "---|" * len(PLANS))
    for row in table[PLANS[0]]:
        print(f"| {row} | " + " | ".join(table[plan][row] for plan in PLANS) + " |")


if __name__ == "__main__":
    main()
