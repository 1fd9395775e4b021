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
