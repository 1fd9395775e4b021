"""The correctness contract on real gloo processes (one process per rank, as under torchrun)."""

import pytest
import torch

from gloo_cases import check_cases, die_mid_training, train_cases
from harness import run_world
from usc.testing.equivalence import reference_run

pytestmark = pytest.mark.distributed
STEPS = 3
WORLDS = {2: [("llama", "dp=2"), ("llama", "tp=2"), ("gpt2", "dp=2"), ("gpt2", "tp=2"),
              ("llama", "tp=2 sp=on"), ("gpt2", "tp=2 sp=on"), ("llama", "cp=2"), ("gpt2", "cp=2"),
              ("llama", "cp=2 cp_mode=zigzag"), ("gpt2", "cp=2 cp_mode=zigzag"),
              ("llama", "dp=2 zero=1"), ("gpt2", "dp=2 zero=1"), ("llama", "dp=2 zero=2"), ("gpt2", "dp=2 zero=2"),
              ("llama", "dp=2 zero=3"), ("gpt2", "dp=2 zero=3"), ("llama", "pp=2 mb=2"), ("gpt2", "pp=2 mb=2"),
              ("llama", "pp=2 mb=4 schedule=zb"), ("gpt2", "pp=2 mb=2 schedule=zb"),
              ("gpt2", "pp=2 mb=2 schedule=interleaved v=2")],
          4: [("llama", "dp=2 tp=2"), ("llama", "tp=4"), ("gpt2", "dp=2 tp=2"), ("gpt2", "tp=4"),
              ("llama", "dp=2 tp=2 sp=on"), ("gpt2", "dp=2 tp=2 sp=on"),
              ("llama", "dp=2 pp=2 zero=1 mb=2"), ("gpt2", "dp=2 pp=2 zero=1 mb=2")]}


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_gloo_ranks_match_one_device(world):
    results = run_world(train_cases, world, WORLDS[world], STEPS, timeout=240)
    check_cases(results, world, WORLDS[world], STEPS)


def test_dead_rank_turns_into_a_clear_timeout_error():
    results = run_world(die_mid_training, 2, "dp=2 timeout=3", timeout=90, may_die=[1])
    elapsed, message = results[0].split("|", 1)
    assert float(elapsed) < 20
    assert "rank 0" in message and "dp" in message


def test_gloo_checkpoint_loads_in_the_simulator_under_another_plan(tmp_path):
    import usc
    from gloo_cases import save_after_two_steps
    from usc.testing.models import TinyLlama, token_batch

    path = str(tmp_path / "ckpt")
    run_world(save_after_two_steps, 2, "dp=2 zero=2", path, timeout=120)
    batches = [token_batch(128, 4, 16, seed=s) for s in range(4)]
    torch.manual_seed(0)
    reference = TinyLlama()
    expected = reference_run(reference, batches, lambda p: torch.optim.AdamW(p))
    sim = usc.simulate(TinyLlama(), "tp=2", example_inputs=batches[0])
    sim.load(path)
    losses = [sim.step(*b) for b in batches[2:]]
    assert losses == pytest.approx(expected[2:], rel=1e-5, abs=1e-6)


def test_gloo_zero1_bf16_gather_saves_the_float32_weights(tmp_path):
    """ZeRO-1 under dtype=bf16 on real gloo processes: the slices travel in bf16, and the checkpoint
    holds the float32 weights the simulator's run of the same plan ends with when it gathers in
    float32 (a reference that does not rest on the save's own float32 gather)."""
    import usc
    from gloo_cases import save_after_two_steps
    from usc.testing.models import TinyLlama, token_batch

    plan = "dp=2 zero=1 dtype=bf16"
    path = str(tmp_path / "ckpt")
    losses = run_world(save_after_two_steps, 2, plan, path, timeout=120)
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    torch.manual_seed(0)
    sim = usc.simulate(TinyLlama(), plan, example_inputs=batches[0])
    for rank in sim.ranks:
        rank.optimizer.gather_dtype = None
    assert losses[0] == pytest.approx([sim.step(*b) for b in batches], rel=1e-6)
    one = usc.simulate(TinyLlama(), "dtype=bf16", example_inputs=batches[0])
    one.load(path)
    expected, loaded = sim.full_state_dict(), one.full_state_dict()
    assert all(torch.allclose(loaded[k], expected[k], rtol=0, atol=1e-7) for k in expected)
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in loaded.values() if t.is_floating_point())
