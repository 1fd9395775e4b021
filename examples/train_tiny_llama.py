"""Train a tiny Llama with "dp=2 tp=2" on 4 local CPU processes and compare with one device.

    python examples/train_tiny_llama.py            # starts its own 4 gloo processes
    torchrun --nproc-per-node 4 examples/train_tiny_llama.py --under-torchrun   # or let torchrun do it

Every rank builds the same model from the same seed and passes the same global batch; the
compiled program takes each rank's share (its dp slice of the batch, its tp slice of the weights).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import usc  # noqa: E402
from tiny_llama import CONFIG, factory  # noqa: E402
from usc.runtime.launch import launch_local  # noqa: E402
from usc.testing.models import token_batch  # noqa: E402

PLAN = "dp=2 tp=2"
STEPS = 5


def batches():
    return [token_batch(CONFIG.vocab, 8, 32, seed=step) for step in range(STEPS)]


def train_on_mesh() -> list[float]:
    """Runs on every rank (under torchrun or launch_local)."""
    torch.set_num_threads(1)
    model, example = factory()
    step = usc.compile(model, PLAN, example_inputs=example)
    return [step.step(*batch) for batch in batches()]


def train_on_one_device() -> list[float]:
    model, _ = factory()
    optimizer = torch.optim.AdamW(model.parameters())
    losses = []
    for batch in batches():
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--under-torchrun", action="store_true", help="this process is one rank of torchrun")
    if parser.parse_args().under_torchrun:
        losses = train_on_mesh()
        if int(os.environ["RANK"]) == 0:
            print("losses:", " ".join(f"{x:.6f}" for x in losses))
        return
    world = usc.parse_plan(PLAN).world_size
    print(f"training {STEPS} steps of a tiny Llama with plan \"{PLAN}\" on {world} local gloo processes ...")
    mesh_losses = launch_local(train_on_mesh, world)[0]
    single = train_on_one_device()
    print(f"\n{'step':>4}  {'mesh (' + PLAN + ')':>18}  {'one device':>12}  {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(mesh_losses, single)):
        print(f"{i:>4}  {a:>18.6f}  {b:>12.6f}  {abs(a - b):>9.2e}")
    worst = max(abs(a - b) for a, b in zip(mesh_losses, single))
    print(f"\nlargest loss difference: {worst:.2e} ({'equal within float32 rounding' if worst < 1e-5 else 'DIFFERENT'})")
    model, example = factory()
    report = usc.lint(model, PLAN, example_inputs=example)
    print("\nlint summary:")
    for axis, totals in report.totals_by_axis().items():
        print(f"  {axis}: {totals['calls']} collectives per step, {totals['bytes'] / 1024:.1f} KiB per rank")
    print(f"  tensor parallel: {sum(c.style != 'replicate' for c in report.tp_choices)} weights split "
          f"(run `usc-lint examples/tiny_llama.py:factory --plan \"{PLAN}\"` for every collective)")


if __name__ == "__main__":
    main()
