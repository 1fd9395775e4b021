"""ZeRO-1/2 under dtype=bf16 gather the updated slices in bfloat16 (half the bytes), and change
nothing the program computes: every forward takes the weights in bf16 anyway, a rank's own slice
keeps its float32 master values, and checkpoints, full_state_dict and the replica guard read the
float32 values (runtime/zero.py)."""

import pytest
import torch

import usc
from usc.runtime.zero import ZeroOptimizer
from usc.testing.models import TinyLlama, token_batch

SGD = lambda params: torch.optim.SGD(params, lr=0.3, momentum=0.9)  # noqa: E731


def _train(plan: str, batch, *, steps: int = 3, float32_gather: bool = False):
    torch.manual_seed(0)
    sim = usc.simulate(TinyLlama(), plan, example_inputs=batch, optimizer=SGD)
    if float32_gather:  # the gather as it was: every slice in float32
        for rank in sim.ranks:
            rank.optimizer.gather_dtype = None
    losses = [sim.step(*batch) for _ in range(steps)]
    return sim, losses


PLANS = ["dp=2 zero=1 dtype=bf16 replica_check=1", "dp=3 mb=2 zero=2 dtype=bf16 replica_check=1"]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("reference_kind", ["float32 gather", "no ZeRO"])
def test_a_bf16_gather_trains_exactly_what_a_float32_gather_trains(plan, reference_kind):
    """Bit for bit: the same losses and the same float32 weights after three steps (and the replica
    guard, on every step, finds the dp copies agreeing) as the same plan gathering float32 slices,
    and as the plan without ZeRO -- no gather at all, whole weights on every rank, the runtime path
    that shares no code with the slices'."""
    batch = token_batch(128, 6, 15)
    sim, losses = _train(plan, batch)
    if reference_kind == "float32 gather":
        reference, reference_losses = _train(plan, batch, float32_gather=True)
    else:
        without = " ".join(p for p in plan.split() if not p.startswith("zero="))
        reference, reference_losses = _train(without, batch)
        assert not isinstance(reference.ranks[0].optimizer, ZeroOptimizer)
    assert isinstance(sim.ranks[0].optimizer, ZeroOptimizer) and sim.ranks[0].optimizer.gather_dtype == torch.bfloat16
    assert losses == reference_losses
    full, expected = sim.full_state_dict(), reference.full_state_dict()
    assert all(torch.equal(full[name], expected[name]) for name in expected)
    # the weights are the float32 masters, not their bf16 values
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in full.values() if t.is_floating_point())


def test_the_gather_moves_bf16_and_the_report_says_so():
    batch = token_batch(128, 6, 15)
    sim, _ = _train("dp=2 zero=1 dtype=bf16", batch, steps=1)
    comm = sim.ranks[0].mesh.comm("dp")
    before = comm.stats.bytes["all-gather"]
    sim.step(*batch)
    moved = comm.stats.bytes["all-gather"] - before
    slices = sum(m.numel() for m in sim.ranks[0].optimizer.masters)
    assert moved == 2 * slices  # bf16: two bytes an element of this rank's slices
    listed = [c for c in sim.report.collectives if c.kind == "all-gather" and c.axis == "dp"]
    assert listed and all(c.dtype == "bfloat16" for c in listed)
    assert sum(c.bytes_per_step for c in listed) == moved


@pytest.mark.parametrize("plan, listed_dtype", [("dp=2 zero=1 dtype=bf16", "bfloat16"), ("dp=2 zero=1", "float64")])
def test_the_report_lists_the_gather_the_runtime_runs_for_float64_weights(plan, listed_dtype):
    """A float64 model: under dtype=bf16 the forward casts its weights to bf16 too, so the runtime
    gathers bf16 slices, and the report lists that gather (it said float32 when it read the dtype off
    the traced graph); without dtype= it gathers float64 and the report says so. Bytes equal the Comm's
    count either way."""
    torch.manual_seed(0)
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(TinyLlama().double(), plan, example_inputs=batch, optimizer=SGD)
    sim.step(*batch)
    moved = sim.ranks[0].mesh.comm("dp").stats.bytes["all-gather"]
    listed = [c for c in sim.report.collectives if c.kind == "all-gather" and c.axis == "dp"]
    assert listed and all(c.dtype == listed_dtype for c in listed)
    assert sum(c.bytes_per_step for c in listed) == moved


def test_a_checkpoint_after_bf16_gathers_holds_the_float32_weights(tmp_path):
    """Saved under dp=2 ZeRO-1 after bf16 gathers, loaded on one device: the float32 masters of
    every slice, as a float32 gather would have left them."""
    batch = token_batch(128, 6, 15)
    sim, _ = _train("dp=2 zero=1 dtype=bf16", batch)
    reference, _ = _train("dp=2 zero=1 dtype=bf16", batch, float32_gather=True)
    sim.save(tmp_path / "ckpt")
    one = usc.simulate(TinyLlama(), "dtype=bf16", example_inputs=batch, optimizer=SGD)
    one.load(tmp_path / "ckpt")
    expected = reference.full_state_dict()
    assert all(torch.equal(one.full_state_dict()[name], expected[name]) for name in expected)
