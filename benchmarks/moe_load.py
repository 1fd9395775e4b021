"""Expert-parallel traffic and load, measured: all-to-all bytes per step, tokens per expert and per
rank, and their imbalance, for the tiny Mixtral and DeepSeek models.

    python benchmarks/moe_load.py

Batch 8 x 64 tokens, top-2 of 8 experts, one AdamW step per plan (simulator); numbers are for
layer 0 (``Simulated.moe_stats()``), next to what ``usc-lint`` predicts for balanced routing.
"""

import torch

import usc
from usc.testing.models import TinyDeepSeek, TinyMixtral, token_batch

PLANS = ["dp=2 ep=2", "dp=4 ep=4", "dp=4 ep=2 tp=2", "dp=4 ep=4 capacity_factor=1.0"]


def measure(name: str, factory, batch) -> None:
    print(f"\n{name}:")
    for plan in PLANS:
        torch.manual_seed(0)
        sim = usc.simulate(factory(), plan, example_inputs=batch)
        sim.step(*batch)
        layer = sim.moe_stats()["layers.0.moe"]
        sent = [b.get("dispatch forward", 0) + b.get("combine forward", 0) + b.get("dispatch backward", 0)
                + b.get("combine backward", 0) for b in layer.all_to_all_bytes]
        predicted = sum(c.bytes_per_step for c in sim.report.collectives
                        if c.kind == "all-to-all" and c.module == "layers.0.moe")
        print(f"  {plan:<30} all-to-all bytes/step per rank (layer 0): measured {sent}  lint (balanced) "
              f"{predicted}\n  {'':<30} tokens per expert {list(layer.tokens_per_expert)}  imbalance "
              f"{layer.imbalance:.2f}\n  {'':<30} tokens per rank {list(layer.tokens_per_rank)}  imbalance "
              f"{layer.rank_imbalance:.2f}")


def main() -> None:
    batch = token_batch(128, 8, 64)
    measure("TinyMixtral (ModuleList experts, aux loss)", TinyMixtral, batch)
    measure("TinyDeepSeek (shared expert + stacked experts)", TinyDeepSeek, batch)


if __name__ == "__main__":
    main()
