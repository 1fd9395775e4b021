"""Each rank fed only its own data shard (usc.data): the same training as one device on the
global batch, on real gloo processes; the sampler spans dp x ep ranks, not tp/cp/pp peers."""

import io

import pytest
import torch

import usc
from harness import run_world
from usc.testing.equivalence import reference_run
from usc.testing.models import TinyGPT2, shifted_batch

BATCHES = [shifted_batch(128, 8, 16, seed=s) for s in range(3)]


def _train_on_local_shards(rank, world_size, plan):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    step = usc.compile(TinyGPT2(), plan, example_inputs=BATCHES[0])
    losses = [step.step(*usc.data.local_slice(step, *b), local=True, max_grad_norm=0.5) for b in BATCHES]
    tokens = step.metrics.tokens
    sampler = usc.data.sampler(list(range(40)), step, shuffle=True, seed=3)
    buffer = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in step.full_state_dict().items()}, buffer)
    return losses, buffer.getvalue() if rank == 0 else None, usc.data.shard(step), list(sampler), tokens


def _reference():
    torch.manual_seed(0)
    model = TinyGPT2()
    opt = torch.optim.AdamW(model.parameters())
    losses = []
    for batch in BATCHES:
        loss = model(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.distributed
@pytest.mark.parametrize("plan, shards", [("dp=2 tp=2", [(0, 2), (0, 2), (1, 2), (1, 2)]),
                                          ("dp=4 mb=2", [(0, 4), (1, 4), (2, 4), (3, 4)])])
def test_local_shards_train_like_one_device(plan, shards):
    results = run_world(_train_on_local_shards, 4, plan, timeout=240)
    model, expected = _reference()
    for losses, _, _, _, _ in results:
        assert losses == pytest.approx(expected, rel=1e-5)  # padding differs per shard: global token mean
    full = torch.load(io.BytesIO(results[0][1]))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-5)
    assert [r[2] for r in results] == shards
    samples = [r[3] for r in results]
    count = shards[0][1]
    by_shard = {s: samples[i] for i, s in enumerate(shards)}
    assert all(samples[i] == by_shard[s] for i, s in enumerate(shards))  # tp peers read the same samples
    assert sorted(sum((by_shard[(i, count)] for i in range(count)), [])) == list(range(40))  # disjoint, complete
    assert all(r[4] == BATCHES[0][1].numel() for r in results)  # metrics count the global batch's tokens


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


@pytest.mark.parametrize("plan", ["dp=2 tp=2", "dp=4 mb=2"])
def test_simulated_local_shards_train_like_one_device(plan):
    """The simulator feeds each rank its own shard (one batch per data shard): SGD steps in float64
    equal one device on the global batch, the loss being the global token mean."""
    torch.manual_seed(0)
    model = TinyGPT2().double()
    expected_model = TinyGPT2().double()
    expected_model.load_state_dict(model.state_dict())
    sim = usc.simulate(model, plan, example_inputs=BATCHES[0], optimizer=_sgd)
    coords = usc.data.shard_coords(sim)
    assert [usc.data.shard(sim, coord=c) for c in coords] == [(i, len(coords)) for i in range(len(coords))]
    losses = [sim.step(*[usc.data.local_slice(sim, *b, coord=c) for c in coords], local=True) for b in BATCHES]
    assert losses == pytest.approx(reference_run(expected_model, BATCHES, _sgd), rel=1e-12)
    assert sim.metrics.tokens == BATCHES[0][1].numel()
    full = sim.full_state_dict()
    for name, value in expected_model.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-10, atol=1e-12)
    assert sim(*BATCHES[0]) == pytest.approx(expected_model(*BATCHES[0]).item(), rel=1e-12)  # global again


def test_simulated_local_step_takes_one_batch_per_data_shard():
    sim = usc.simulate(TinyGPT2(), "dp=2 tp=2", example_inputs=BATCHES[0])
    with pytest.raises(ValueError, match="one batch per data shard: plan 'dp=2 tp=2' has 2 .* got 1"):
        sim.step(BATCHES[0], local=True)
    with pytest.raises(TypeError, match="pass coord="):
        usc.data.local_slice(sim, *BATCHES[0])
