"""The planner's activation estimate against an independent count, on every model family users bring.

    python benchmarks/planner_memory_families.py                  # every recompute mode at dp=2, selective at cp=2
    python benchmarks/planner_memory_families.py "dp=2 recompute=full,dp=2" llama mixtral

For each family of tests/distributed/users_models.py (transformers' models from tiny configs, a
torchtitan-style Llama, a nanoGPT-style GPT) and each plan, ``users_models.planned_and_counted``:
``usc.plan`` pinned to the plan on 2 GPUs (6 sequences of 10 tokens, float32), its activations per
rank against ``usc.testing.memory_counters.count_peaks`` over one real step of the same plan in the
simulator (every storage the step's forwards and recomputations touch, by weak reference, the most
alive at once -- nothing of the cost model's). A mixture-of-experts family may get ep=2 beside the pinned
axis; a line says ERROR where no plan of that kind fits.
"""

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

import users_models  # noqa: E402

import usc  # noqa: E402

PLANS = ["dp=2", "dp=2 recompute=selective", "dp=2 recompute=full", "cp=2 recompute=selective"]


def measure(name: str, plan: str) -> str:
    start = time.process_time()
    try:
        chosen, estimated, counted = users_models.planned_and_counted(name, plan)
    except usc.PlanError as error:
        return f"{name:18s} {plan:34s} ERROR {str(error).splitlines()[0][:90]}"
    return (f"{name:18s} {str(chosen):48s} estimated {estimated / 1e3:8.1f} KB  counted {counted / 1e3:8.1f} KB  "
            f"{estimated / counted - 1:+6.1%}  ({time.process_time() - start:.0f} s CPU)")


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    plans = argv[0].split(",") if argv else PLANS
    names = argv[1:] or list(users_models.FAMILIES)
    for name in names:
        for plan in plans:
            print(measure(name, plan), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
