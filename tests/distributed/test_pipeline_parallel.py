"""Pipeline parallelism: stages cut from the traced graph, run by schedule, equal to one device."""

import pytest

import usc
from gloo_cases import MODELS
from usc.testing import assert_equivalent
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, shifted_batch, token_batch

FLOAT32_PLANS = ["pp=2 mb=2", "pp=2 mb=4 schedule=gpipe", "dp=2 pp=2 zero=1 mb=2", "dp=2 pp=2 zero=2 mb=2"]


@pytest.mark.parametrize("plan", FLOAT32_PLANS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_pipeline_matches_one_device(model, plan):
    factory, batch = MODELS[model]
    result = assert_equivalent(factory, plan, [batch(seed) for seed in range(3)])
    assert result.max_param_diff <= 1e-5


FOUR_LAYERS = {
    "llama": (lambda: TinyLlama(LlamaConfig(layers=4)).double(), lambda s: token_batch(128, 4, 16, seed=s)),
    "gpt2": (lambda: TinyGPT2(GPT2Config(layers=4)).double(), lambda s: shifted_batch(128, 4, 16, seed=s)),
}


@pytest.mark.parametrize("plan", ["pp=4 mb=4", "pp=2 tp=2 mb=2", "dp=2 pp=2 tp=2 mb=2 schedule=gpipe",
                                  "cp=2 pp=2 mb=2"])
@pytest.mark.parametrize("model", sorted(FOUR_LAYERS))
def test_pipeline_is_exact_in_float64(model, plan):
    """GPT-2's tied embedding and lm head land on the first and last stage: their gradients are summed."""
    factory, batch = FOUR_LAYERS[model]
    result = assert_equivalent(factory, plan, [batch(s) for s in range(2)], rtol=1e-12, atol=1e-12,
                               param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


def test_stages_are_balanced_and_contiguous():
    sim = usc.simulate(TinyLlama(LlamaConfig(layers=4)), "pp=2 mb=2", example_inputs=token_batch(128, 4, 16))
    modules = []
    for name, stage in sim.program.gm.named_children():
        paths = {n.meta["usc"].module for n in stage.graph.nodes if n.op == "call_function" and "usc" in n.meta}
        modules.append({p.split(".")[1] for p in paths if p.startswith("layers.")})
    assert modules == [{"0", "1"}, {"2", "3"}]


def test_lint_lists_the_stage_boundary_transfers():
    report = usc.lint(TinyLlama(), "pp=2 mb=4", example_inputs=token_batch(128, 4, 16))
    transfers = [c for c in report.collectives if c.axis == "pp"]
    hidden = [c for c in transfers if c.shape == (1, 16, 64)]
    assert {c.direction for c in hidden} == {"forward", "backward"}
    assert all(c.calls_per_step == 4 and c.module == "stage 0 -> stage 1" for c in transfers)


def test_unexecutable_schedules_are_refused_by_name():
    batch = token_batch(128, 4, 16)
    with pytest.raises(usc.PlanError, match="zb"):
        usc.lint(TinyLlama(), "pp=2 mb=2 schedule=zb", example_inputs=batch)
    with pytest.raises(usc.PlanError, match="need pp>1"):
        usc.lint(TinyLlama(), "schedule=gpipe", example_inputs=batch)
    # embedding, 2 blocks, final norm, lm head: 5 pieces to cut between
    with pytest.raises(usc.PlanError, match="pp=8 needs at least 8 layers"):
        usc.lint(TinyLlama(), "pp=8 mb=8", example_inputs=token_batch(128, 8, 16))
