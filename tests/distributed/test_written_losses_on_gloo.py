"""Loss and model paths users write, on real gloo processes, not simulated ranks: cross-entropy with
class weights and smoothing under tp (its vocabulary-parallel class sums), a masked mean whose first
microbatch counts no token under dp and microbatches (the guarded count, weighted by the runtime),
BART under pp with microbatches (the labels' new_zeros made from their shard, stages across
processes); a ratio of sums whose numerator the mask does not cover, plus a regularizer, under dp
and microbatches (the numerator of a microbatch counting nothing, summed over dp), and a floored
count under pp (the floor applied to the step's count on every stage); a token mean beside a z-loss
over every token under dp and microbatches, and two token means over different masks under pp (each
dividing by the step's count, summed before the first microbatch). Float64, SGD, against the model
trained on one device."""

import io

import pytest
import torch

import usc
from gloo_cases import train_written, written_case
from harness import run_world

CASES = [("cross_entropy_weight_smoothing", "tp=2"), ("masked_mean_all_ignored_microbatch", "dp=3 mb=2"),
         ("bart", "pp=2 mb=2"), ("unmasked_plus_regularizer", "dp=3 mb=2"), ("clamped", "pp=2 mb=3"),
         ("z_loss_every_token", "dp=3 mb=2"), ("two_masks", "pp=2 mb=3")]


def one_device(case: str):
    factory, batches = written_case(case)
    torch.manual_seed(0)
    model = factory()
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
    for batch in batches:
        optimizer.zero_grad()
        out = model(**batch) if isinstance(batch, dict) else model(*batch)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.distributed
@pytest.mark.parametrize("case, plan", CASES, ids=[c for c, _ in CASES])
def test_written_losses_on_gloo_equal_one_device(case, plan):
    results = run_world(train_written, usc.parse_plan(plan).world_size, case, plan, timeout=240)
    losses, state = results[0][0], torch.load(io.BytesIO(results[0][1]))
    assert all(r[0] == losses for r in results), "ranks disagree on the losses"
    expected, model = one_device(case)
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-10
    assert max(float((state[n] - p.detach()).abs().max()) for n, p in model.named_parameters()) <= 1e-10
