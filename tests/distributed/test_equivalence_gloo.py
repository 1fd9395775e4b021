"""The correctness contract on real gloo processes (one process per rank, as under torchrun)."""

import io

import pytest
import torch

from gloo_cases import MODELS, die_mid_training, train_cases
from harness import run_world
from usc.testing.equivalence import compare_states, reference_run

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


def _reference(model_name: str):
    factory, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = factory()
    losses, grad_max = reference_run(model, [batch(s) for s in range(STEPS)], lambda p: torch.optim.AdamW(p))
    return losses, grad_max, model.state_dict()


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_gloo_ranks_match_one_device(world):
    results = run_world(train_cases, world, WORLDS[world], STEPS, timeout=240)
    for index, (model_name, plan) in enumerate(WORLDS[world]):
        ref_losses, grad_max, ref_state = _reference(model_name)
        per_rank = [r[index][0] for r in results]
        assert all(losses == per_rank[0] for losses in per_rank), f"{plan}: ranks disagree on the loss"
        assert per_rank[0] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), f"{model_name} {plan}"
        full = torch.load(io.BytesIO(results[0][index][1]))
        worst, _ = compare_states(full, ref_state, atol=1e-5, grad_max=grad_max, zero_grad_atol=STEPS * 1e-3)
        assert worst <= 1e-5


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
    expected, _ = reference_run(reference, batches, lambda p: torch.optim.AdamW(p))
    sim = usc.simulate(TinyLlama(), "tp=2", example_inputs=batches[0])
    sim.load(path)
    losses = [sim.step(*b) for b in batches[2:]]
    assert losses == pytest.approx(expected[2:], rel=1e-5, abs=1e-6)
