"""The training loop a user writes: clipping, schedules, param groups, metrics and eval mode,
each against the same loop on one device (float64 and SGD, so a wrong norm cannot hide)."""

import math

import pytest
import torch

import usc
from usc.testing.models import DropoutNet, LlamaConfig, TinyDeepSeek, TinyGPT2, TinyLlama, shifted_batch, token_batch

# every plan kind; odd sizes where the plan allows (the batch is 6 sequences of 12 tokens)
CLIP_PLANS = ["dp=1", "dp=2", "dp=3", "tp=2", "tp=2 sp=on", "cp=2", "pp=2 mb=2", "dp=2 tp=2",
              "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3", "dp=2 tp=2 zero=3", "mb=3", "dp=3 pp=2 zero=1 mb=2",
              "pp=3 mb=3"]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _one_device(model, batches, max_norm):
    """The reference: torch's own clip_grad_norm_ on the plain model."""
    opt = _sgd(model.parameters())
    losses, norms = [], []
    for batch in batches:
        loss = model(*batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


def _run_clipped(factory, plan, batches, max_norm):
    torch.manual_seed(0)
    reference, mesh_model = factory(), factory()
    mesh_model.load_state_dict(reference.state_dict())
    expected, expected_norms = _one_device(reference, batches, max_norm)
    sim = usc.simulate(mesh_model, plan, example_inputs=batches[0], optimizer=_sgd)
    losses, norms = [], []
    for batch in batches:
        losses.append(sim.step(*batch, max_grad_norm=max_norm))
        norms.append(sim.metrics.grad_norm)
    return reference, sim, (expected, expected_norms), (losses, norms)


def _llama64():
    return TinyLlama(LlamaConfig(layers=3)).double()


@pytest.mark.parametrize("plan", CLIP_PLANS)
def test_clipping_matches_one_device_in_float64(plan):
    batches = [token_batch(128, 6, 12, seed=s) for s in range(3)]
    reference, sim, (expected, expected_norms), (losses, norms) = _run_clipped(_llama64, plan, batches, 0.05)
    assert min(expected_norms) > 0.05 * 4  # the clip bites on every step
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    assert losses == pytest.approx(expected, rel=1e-10)
    full = sim.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("plan", ["pp=2 mb=2", "dp=2 tp=2", "tp=2 zero=3 dp=2"])
def test_clipping_counts_a_tied_weight_once(plan):
    """GPT-2 ties wte and lm_head: under pp the two stages hold one weight; it counts once."""
    batches = [shifted_batch(128, 4, 16, seed=s) for s in range(2)]
    factory = lambda: TinyGPT2().double()  # noqa: E731
    _, _, (expected, expected_norms), (losses, norms) = _run_clipped(factory, plan, batches, 0.05)
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    assert losses == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("plan", ["dp=2 ep=2", "dp=4 ep=2 tp=2"])
def test_clipping_counts_experts_once_under_ep(plan):
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    factory = lambda: TinyDeepSeek().double()  # noqa: E731
    _, _, (expected, expected_norms), (losses, norms) = _run_clipped(factory, plan, batches, 0.05)
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    assert losses == pytest.approx(expected, rel=1e-10)


def test_infinite_max_norm_measures_without_clipping():
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    _, sim, (expected, expected_norms), (losses, norms) = _run_clipped(_llama64, "dp=2 tp=2", batches, math.inf)
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    sim.step(*batches[0])
    assert sim.metrics.grad_norm is None  # not asked: no collective spent on it
