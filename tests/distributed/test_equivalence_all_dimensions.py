"""Property-based equivalence over every landed dimension at once: hypothesis draws a plan
(`usc.testing.strategies.plans`) and a model shape that the plan divides, and the simulated mesh
must train exactly like one device (float64, tight bounds; see test_equivalence_properties for
why float64).

CI runs the profile's bounded examples (6 each, up to 16 simulated ranks and up to 8 gloo processes);
the deep tier (USC_DEEP_TIER=1) adds plans of up to 64 simulated ranks, and
`pytest --hypothesis-profile=deep` draws 200 each. A failure found here becomes a named
regression test beside the code it fixed (e.g. test_public_api's indivisible-weight case).
"""

import io
import math
import os
from unittest import mock

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

import usc
from usc.testing import assert_equivalent
from usc.testing.models import (GPT2Config, LlamaConfig, MoEConfig, TinyDeepSeek, TinyGPT2, TinyLlama, TinyMixtral,
                                shifted_batch, token_batch)
from usc.testing.strategies import plans

from gloo_cases import train_from_state
from harness import run_world

FLOAT64 = {"rtol": 1e-10, "atol": 1e-12, "param_atol": 1e-9}


@st.composite
def plan_and_model(draw, *, max_ranks: int):
    """A plan and a (family, config, batch size, sequence length) every axis of it divides."""
    text = draw(plans(max_ranks=max_ranks, experts=True, fuse=True))
    plan = usc.parse_plan(text)
    dp, tp, cp, pp = (plan.size(axis) for axis in ("dp", "tp", "cp", "pp"))
    ulysses = cp > 1 and plan.get("cp_mode") == "ulysses"
    # Ulysses trades the cp sequence shard for a head shard on top of tp's: heads divide by both
    head_unit = tp * cp if ulysses else tp
    heads = head_unit * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4]))
    layers = pp * int(plan.get("v")) * draw(st.sampled_from([1, 2]))
    seq = math.lcm(2 * cp, cp * tp if plan.get("sp") else 1) * draw(st.sampled_from([1, 2]))
    ep = plan.size("ep")
    batch = dp * ep * (plan.get("mb") or 1) * draw(st.sampled_from([1, 2]))
    vocab = 8 * tp * draw(st.sampled_from([1, 2]))
    if ep > 1 or draw(st.integers(0, 3)) == 0:  # mixture of experts: 8 experts, top-2
        # Mixtral's auxiliary loss is a product of batch means, which microbatches average (as
        # Megatron does, so not the one-batch value; documented): DeepSeek's block then
        single = int(plan.get("mb") or 1) == 1
        family = draw(st.sampled_from(["mixtral", "deepseek"])) if single else "deepseek"
        kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1)
                                         if heads % d == 0 and d % (head_unit if ulysses else 1) == 0]))
        unit = 4 * tp * draw(st.sampled_from([1, 2]))
        # aux_dtype=None: the load-balancing loss in the model's float64, not Mixtral's float32 (a
        # float32 island that AdamW lifts to 3e-6 in a router weight under any ep split, and exact to
        # 1e-15 in float64; the float32 form is tested in test_expert_parallel.py)
        cfg = MoEConfig(vocab=vocab, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads, mlp=unit,
                        shared_mlp=unit, layers=layers, max_seq=seq, aux_dtype=None)
        return text, family, cfg, batch, seq
    if draw(st.booleans()):
        kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1)
                                         if heads % d == 0 and d % (head_unit if ulysses else 1) == 0]))
        cfg = LlamaConfig(vocab=vocab, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads,
                          mlp=4 * tp * draw(st.sampled_from([1, 2])), layers=layers, max_seq=seq)
        return text, "llama", cfg, batch, seq
    cfg = GPT2Config(vocab=vocab, hidden=heads * head_dim, heads=heads, layers=layers, max_seq=seq)
    return text, "gpt2", cfg, batch, seq


FAMILIES = {"llama": (TinyLlama, token_batch), "gpt2": (TinyGPT2, shifted_batch),
            "mixtral": (TinyMixtral, token_batch), "deepseek": (TinyDeepSeek, token_batch)}
# The routers score in float32 (softmax(..., dtype=float), as Mixtral and DeepSeek do): the mesh
# runs the same float32 ops on the same rows, but a sum over a different token split can round
# differently, so MoE models get a little more room than dense ones.
MOE_FLOAT64 = {"rtol": 1e-7, "atol": 1e-9, "param_atol": 1e-6}


def _check(case, *, runner=None):
    plan, family, cfg, batch, seq = case
    model, make_batch = FAMILIES[family]
    batches = [make_batch(cfg.vocab, batch, seq, seed=s) for s in range(2)]
    # fuse=on: the fusion pass rewrites the graph as always, but the fused regions run their eager
    # ops here (Triton's interpreter costs ~0.1 s a launch and serialises the simulated ranks). The
    # generated kernels are checked per kernel and by the fuse=on equivalence tests.
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}):
        bounds = MOE_FLOAT64 if family in ("mixtral", "deepseek") else FLOAT64
        assert_equivalent(lambda: model(cfg).double(), plan, batches, runner=runner, **bounds)


def _on_gloo(family, cfg):
    """An assert_equivalent runner: the mesh run on real gloo processes, one per rank."""
    def run(mesh_model, plan, batches, optimizer):
        state = io.BytesIO()
        torch.save(mesh_model.state_dict(), state)
        world = usc.parse_plan(plan).world_size
        results = run_world(train_from_state, world, family, cfg, state.getvalue(), plan, batches, timeout=120)
        assert all(r[0] == results[0][0] for r in results), f"{plan}: ranks disagree on the losses"
        return results[0][0], torch.load(io.BytesIO(results[0][1]))
    return run


@given(case=plan_and_model(max_ranks=16))
def test_any_plan_up_to_16_ranks_trains_like_one_device(case):
    _check(case)


@pytest.mark.skipif(os.environ.get("USC_DEEP_TIER") != "1",
                    reason="deep tier (USC_DEEP_TIER=1): 64 simulated ranks, ~1 min an example here")
@given(case=plan_and_model(max_ranks=64))
def test_any_plan_up_to_64_ranks_trains_like_one_device(case):
    _check(case)


@pytest.mark.distributed
@given(case=plan_and_model(max_ranks=8))
@settings(max_examples=max(2, settings.default.max_examples // 2))  # a world per example: half as many
def test_any_plan_up_to_8_ranks_trains_like_one_device_on_gloo(case):
    _check(case, runner=_on_gloo(case[1], case[2]))
