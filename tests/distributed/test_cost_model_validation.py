"""The cost model against the simulator: predicted bytes per rank vs measured, collectives vs counted.

One profile of a 4-layer tiny Llama (one trace, probe compiles) is rescaled to every plan; each plan
then runs one step in the simulator, where the executor measures parameters, gradients (at their peak)
and optimizer state per rank, autograd's saved tensors give the activations, and every Comm counts
the payload bytes it was handed (``comm.stats``).
"""

from collections import Counter

import pytest
import torch

import usc
from usc.compiler.cost_model import estimate
from usc.compiler.hardware import H100
from usc.planning import point_of
from usc.profiling import profile_model
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

CONFIG = LlamaConfig(layers=4)
BATCH, SEQ = 8, 32
PLANS = ["dp=2", "tp=2", "tp=2 sp=on", "cp=2", "cp=2 cp_mode=zigzag", "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3",
         "dp=2 tp=2 sp=on zero=1", "cp=2 tp=2 sp=on", "dp=2 mb=2", "dp=2 dtype=bf16", "pp=2 mb=2",
         "dp=2 cp=2 tp=2 sp=on zero=2", "pp=2 mb=4 schedule=gpipe", "dp=2 pp=2 mb=2 zero=1", "pp=4 mb=4",
         "tp=2 pp=2 mb=2", "cp=2 pp=2 mb=2", "dp=2 tp=2 sp=on pp=2 mb=2 zero=2",
         "dp=2 pp=2 v=2 mb=4 schedule=interleaved"]
# The cost model sums every stage's collectives over that stage's ranks: exact on every plan.
MODEL_NOT_EXACT: dict[str, set[str]] = {}


@pytest.fixture(scope="module")
def profile():
    torch.manual_seed(0)
    return profile_model(TinyLlama(CONFIG), token_batch(CONFIG.vocab, BATCH, SEQ))


@pytest.fixture(scope="module")
def runs():
    return {}


def run(plan: str, runs: dict):
    """One simulated step: measured state bytes per rank, activation bytes, counted payload bytes."""
    if plan not in runs:
        torch.manual_seed(0)
        batch = token_batch(CONFIG.vocab, BATCH, SEQ)
        sim = usc.simulate(TinyLlama(CONFIG), plan, example_inputs=batch)
        sim.step(*batch)  # counters start at zero: compiling moves nothing
        counted = Counter()
        for mesh in sim.meshes:
            for axis in mesh.axes:
                for kind, nbytes in mesh.comm(axis).stats.bytes.items():
                    counted[(axis, kind)] += nbytes
        state = [dict(rank.peak_state_bytes, optimizer=after["optimizer"])  # AdamW state exists after step 1
                 for rank, after in zip(sim.ranks, sim.memory_bytes())]
        acts = sim.activation_bytes(*batch) if sim.plan.size("pp") == 1 else None
        runs[plan] = (sim, state, acts, counted)
    return runs[plan]


def predicted(profile, sim):
    return estimate(profile, point_of(sim.plan, global_batch=BATCH, seq=SEQ), H100)


@pytest.mark.parametrize("plan", PLANS)
def test_state_bytes_within_5_percent(profile, runs, plan):
    sim, state, _, _ = run(plan, runs)
    est = predicted(profile, sim)
    kinds = ("params", "grads", "optimizer")
    for kind in kinds:
        measured = max(s[kind] for s in state)
        assert est.memory[kind] == pytest.approx(measured, rel=0.05), (kind, est.memory[kind], measured)


@pytest.mark.parametrize("plan", [p for p in PLANS if "pp=" not in p])
def test_activation_bytes_within_15_percent(profile, runs, plan):
    sim, _, acts, _ = run(plan, runs)
    est = predicted(profile, sim)
    assert est.memory["activations"] == pytest.approx(max(acts), rel=0.15), (est.memory["activations"], acts)


@pytest.mark.parametrize("plan", PLANS)
def test_report_collective_bytes_equal_counted_bytes(runs, plan):
    sim, _, _, counted = run(plan, runs)
    assert dict(sim.report.traffic) == dict(counted)


@pytest.mark.parametrize("plan", PLANS)
def test_cost_model_collective_bytes_equal_counted_bytes(profile, runs, plan):
    sim, _, _, counted = run(plan, runs)
    skip = MODEL_NOT_EXACT.get(plan, set())
    by_axis = Counter()
    for (axis, _), nbytes in counted.items():
        by_axis[axis] += nbytes
    model = predicted(profile, sim).traffic
    assert {a: round(v) for a, v in model.items() if a not in skip} == {
        a: v for a, v in by_axis.items() if a not in skip}
    for axis in skip:  # what cannot be exact is still close
        assert model[axis] == pytest.approx(by_axis[axis], rel=0.15)
