"""The cost model against the simulator: predicted bytes per rank vs measured, collectives vs counted.

One profile of a 4-layer tiny Llama (one trace, probe compiles) is rescaled to every plan; each plan
then runs one step in the simulator, where the executor measures parameters, gradients (at their peak)
and optimizer state per rank, a counter of its own (usc.testing.memory_counters) the activations,
and every Comm counts the payload bytes it was handed (``comm.stats``). A 4-layer tiny GPT-2 (lm head tied to the
embedding, learned positions) checks the tied weight: held once per pipeline rank, its gradient
summed over pp when two ranks hold it, and the position table's gradient summed in the graph.
"""

from collections import Counter

import pytest
import torch

import usc
from usc.compiler.cost_model import estimate
from usc.compiler.hardware import H100
from usc.planning import point_of
from usc.passes.cost_profile import profile_model
from usc.testing.memory_counters import count_peaks
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, token_batch

MODELS = {"llama": (TinyLlama, LlamaConfig(layers=4)), "gpt2": (TinyGPT2, GPT2Config(layers=4))}
BATCH, SEQ = 8, 32
PLANS = ["dp=2", "tp=2", "tp=2 sp=on", "cp=2", "cp=2 cp_mode=zigzag", "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3",
         "dp=2 tp=2 sp=on zero=1", "cp=2 tp=2 sp=on", "dp=2 mb=2", "dp=2 dtype=bf16", "pp=2 mb=2",
         "dp=2 cp=2 tp=2 sp=on zero=2", "pp=2 mb=4 schedule=gpipe", "dp=2 pp=2 mb=2 zero=1", "pp=4 mb=4",
         "tp=2 pp=2 mb=2", "cp=2 pp=2 mb=2", "dp=2 tp=2 sp=on pp=2 mb=2 zero=2",
         "dp=2 pp=2 v=2 mb=4 schedule=interleaved",
         # ZeRO-1 holds whole gradients while microbatches accumulate, ZeRO-2 only its slices
         # (reduce-scattered in every microbatch's backward)
         "dp=2 mb=4 zero=1", "dp=2 mb=4 zero=2",
         # full recompute re-issues a block's forward collectives in backward, all but the one after
         # its last saving op (checkpointing stops there); selective regions hold none
         "tp=2 recompute=full", "cp=2 recompute=full", "dp=2 tp=2 recompute=selective", "dp=2 tp=2 zero=3",
         # split= cuts by hand: the cost model follows the same cut
         "pp=2 mb=2 split=layers.1", "dp=2 pp=3 mb=4 split=layers.0|layers.3",
         # bf16 with ZeRO-3: the bf16 weight copies linears save go with the gathered weight
         "dp=2 zero=3 dtype=bf16",
         # bf16 pipelines: one bf16 copy of the stage's weights per step, not one per microbatch in flight
         "pp=2 mb=4 dtype=bf16", "pp=2 mb=4 schedule=gpipe dtype=bf16",
         # bf16 activations over tp/sp and cp: the ring's dK/dV travel in float32
         "tp=2 sp=on dtype=bf16", "cp=2 dtype=bf16",
         # pipelines under recompute: the peak is a recomputation in backward, when a cut holds one
         # transfer buffer, not forward's three (each was 6-19% over while counted at three)
         "pp=2 mb=4 recompute=full", "tp=2 pp=2 mb=2 recompute=full", "pp=2 mb=4 recompute=selective",
         "dp=2 pp=2 v=2 mb=4 schedule=interleaved recompute=full",
         # selective without tp or cp: the probe's tp and cp collectives (region boundaries there)
         # read as identities, and the kept projections recomputation reads and nothing saves let
         # go when their region is recomputed (were +2.9% and -6.1%)
         "dp=2 recompute=selective", "cp=2 recompute=selective",
         # zero-bubble: a microbatch's graph lives from its forward to its weight pass and, past its
         # input pass, holds the output gradients recorded for the weight pass -- the last rank holds
         # as much as the first (were 29-54% under while read as 1F1B's)
         "pp=2 mb=4 schedule=zb", "pp=4 mb=8 schedule=zb", "dp=2 pp=2 mb=2 schedule=zb"]
GPT2_PLANS = ["dp=2", "pp=2 mb=2", "dp=2 pp=2 mb=2", "dp=2 zero=3", "dp=2 pp=2 mb=4 zero=2",
              "dp=2 recompute=selective", "cp=2 recompute=selective", "pp=2 mb=4 schedule=zb"]
CASES = [("llama", plan) for plan in PLANS] + [("gpt2", plan) for plan in GPT2_PLANS]
# The cost model sums every stage's collectives over that stage's ranks: exact on every plan.
MODEL_NOT_EXACT: dict[tuple[str, str], set[str]] = {}
# A tied weight is held once per rank that reads it (its second name, which export also lifts, is
# no state of its own): every kind of state is within 5% on every case.
STATE_NOT_WITHIN: dict[tuple[str, str], set[str]] = {}
# The activation estimate is held to the peak an independent counter sees (usc.testing.memory_counters:
# every storage a step's forwards and recomputations touch, by weak reference, the most alive at
# once, with pipelines too), not to usc's own saved-tensor measurement.


@pytest.fixture(scope="module")
def profiles():
    """model -> its profile, made when a test first needs it."""
    return {}


def profile_of(model: str, profiles: dict):
    if model not in profiles:
        torch.manual_seed(0)
        make, config = MODELS[model]
        profiles[model] = profile_model(make(config), token_batch(config.vocab, BATCH, SEQ))
    return profiles[model]


@pytest.fixture(scope="module")
def runs():
    return {}


def run(model: str, plan: str, runs: dict):
    """One simulated step: measured state bytes per rank, activation bytes, counted payload bytes."""
    if (model, plan) not in runs:
        torch.manual_seed(0)
        make, config = MODELS[model]
        batch = token_batch(config.vocab, BATCH, SEQ)
        sim = usc.simulate(make(config), plan, example_inputs=batch)
        sim.step(*batch)  # counters start at zero: compiling moves nothing
        counted = Counter()
        for mesh in sim.meshes:
            for axis in mesh.axes:
                for kind, nbytes in mesh.comm(axis).stats.bytes.items():
                    counted[(axis, kind)] += nbytes
        state = [dict(rank.peak_state_bytes, optimizer=after["optimizer"])  # AdamW state exists after step 1
                 for rank, after in zip(sim.ranks, sim.memory_bytes())]
        acts = count_peaks(sim, batch)  # any schedule: a pipeline's microbatches in flight included
        if sim.plan.size("pp") > 1:
            # a pipeline rank's count follows the simulated ranks' timing (a transfer's buffer passes
            # between threads): once in four whole-suite runs, `tp=2 pp=2 mb=2 recompute=full`'s rank 2
            # held one 32 KiB buffer more than in every run alone (627,713 bytes against 594,945). The
            # lesser of two steps' counts per rank is the one with the least such overlap
            acts = [min(a, b) for a, b in zip(acts, count_peaks(sim, batch))]
        runs[(model, plan)] = (sim, state, acts, counted)
    return runs[(model, plan)]


def predicted(profile, sim):
    return estimate(profile, point_of(sim.plan, global_batch=BATCH, seq=SEQ), H100)


@pytest.mark.parametrize("model, plan", CASES)
def test_state_bytes_within_5_percent(profiles, runs, model, plan):
    sim, state, _, _ = run(model, plan, runs)
    est = predicted(profile_of(model, profiles), sim)
    kinds = ("params", "grads", "optimizer")
    for kind in set(kinds) - STATE_NOT_WITHIN.get((model, plan), set()):
        measured = max(s[kind] for s in state)
        assert est.memory[kind] == pytest.approx(measured, rel=0.05), (kind, est.memory[kind], measured)


@pytest.mark.parametrize("model, plan", CASES)
def test_activation_bytes_within_5_percent_of_an_independent_count(profiles, runs, model, plan):
    """The busiest rank's activations (a pipeline's first rank holds the most microbatches in flight;
    its transfer buffers counted) against the most any rank held at once."""
    sim, _, peaks, _ = run(model, plan, runs)
    est = predicted(profile_of(model, profiles), sim)
    assert est.memory["activations"] == pytest.approx(max(peaks), rel=0.05), (est.memory["activations"], peaks)


@pytest.mark.parametrize("model, plan", CASES)
def test_report_collective_bytes_equal_counted_bytes(runs, model, plan):
    sim, _, _, counted = run(model, plan, runs)
    assert dict(sim.report.traffic) == dict(counted)


@pytest.mark.parametrize("model, plan", CASES)
def test_cost_model_collective_bytes_equal_counted_bytes(profiles, runs, model, plan):
    sim, _, _, counted = run(model, plan, runs)
    skip = MODEL_NOT_EXACT.get((model, plan), set())
    by_axis = Counter()
    for (axis, _), nbytes in counted.items():
        by_axis[axis] += nbytes
    traffic = predicted(profile_of(model, profiles), sim).traffic
    assert {a: round(v) for a, v in traffic.items() if a not in skip} == {
        a: v for a, v in by_axis.items() if a not in skip}
    for axis in skip:  # what cannot be exact is still close
        assert traffic[axis] == pytest.approx(by_axis[axis], rel=0.15)


# Hugging Face's Llama keeps float32 islands under dtype=bf16 (its RMSNorm's statistics, the loss's
# upcast logits): the profile, traced in float32, must count them at full size -- the casts into and
# out of them, the value itself in float32, as the copies they are under bf16, and the loss's
# decomposition over the vocabulary (made by a pass after the islands were marked) as float32.
# Counted at half size, the estimate was 10-25% under the independent count on these plans.
HF_SHAPES = {
    "wide": (dict(vocab_size=250, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4), 128),
    "big-vocab": (dict(vocab_size=2000, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2), 32),
}
HF_CASES = [("wide", "dp=2 dtype=bf16"), ("wide", "tp=2 dtype=bf16"), ("wide", "dp=2 dtype=bf16 recompute=full"),
            ("big-vocab", "dp=2 dtype=bf16"),
            # selective recompute where the plan lacks an axis the probe has (was -4.3% at cp=2)
            ("wide", "cp=2 recompute=selective"), ("wide", "dp=2 dtype=bf16 recompute=selective")]


@pytest.fixture(scope="module")
def hf_profiles():
    return {}


@pytest.mark.parametrize("shape, plan", HF_CASES)
def test_hf_llama_bf16_activations_within_5_percent_of_an_independent_count(hf_profiles, shape, plan):
    from usc.testing.hf import hf_llama

    config, seq = HF_SHAPES[shape]
    batch = token_batch(config["vocab_size"], 8, seq)
    if shape not in hf_profiles:
        torch.manual_seed(0)
        hf_profiles[shape] = profile_model(hf_llama(**config), batch)
    torch.manual_seed(0)
    sim = usc.simulate(hf_llama(**config), plan, example_inputs=batch)
    est = estimate(hf_profiles[shape], point_of(sim.plan, global_batch=8, seq=seq), H100)
    peaks = count_peaks(sim, batch)  # the first step's (a step before it changes no count: measured)
    assert est.memory["activations"] == pytest.approx(max(peaks), rel=0.05), (est.memory["activations"], peaks)
