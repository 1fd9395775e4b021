"""The compile report lists each gradient reduction in the dtype the reducer sends it in -- bf16 under
reduce_dtype=bf16, the weights' own dtype otherwise (float64 for a float64 model) -- with the element
count the reducer pads to, so its bytes equal what every rank's Comms count."""

from collections import Counter

import pytest
import torch
from torch import nn

import usc
from usc.testing.models import TinyLlama, token_batch

CASES = [("dp=2 reduce_dtype=bf16", torch.float32, "bfloat16"),
         ("dp=2 reduce_dtype=bf16", torch.float64, "bfloat16"),
         ("dp=3 zero=1 reduce_dtype=bf16", torch.float32, "bfloat16"),
         ("dp=2 cp=2 tp=2 sp=on mb=2 zero=2 reduce_dtype=bf16", torch.float64, "bfloat16"),
         ("dp=3 zero=1", torch.float64, "float64"),
         ("dp=2 tp=2 mb=2 zero=2", torch.float64, "float64")]


def _counted(sim) -> Counter:
    counted = Counter()
    for mesh in sim.meshes:
        for axis in mesh.axes:
            for kind, nbytes in mesh.comm(axis).stats.bytes.items():
                counted[(axis, kind)] += nbytes
    return counted


@pytest.mark.parametrize("plan, weights, listed", CASES)
def test_gradient_reductions_are_listed_in_the_dtype_they_travel_in(plan, weights, listed):
    torch.manual_seed(0)
    batch = token_batch(128, 6 if "dp=3" in plan else 4, 12 if "cp=2" in plan else 15)
    sim = usc.simulate(TinyLlama().to(weights), plan, example_inputs=batch,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    sim.step(*batch)
    gradients = [c for c in sim.report.collectives if c.source == "gradient bucket"]
    assert gradients and {c.dtype for c in gradients} == {listed}
    assert dict(sim.report.traffic) == dict(_counted(sim))


GROUPED = ["dp=2", "dp=3 zero=1", "dp=2 mb=2 zero=2 reduce_dtype=bf16"]


@pytest.mark.parametrize("plan", GROUPED)
def test_an_optimizer_that_groups_by_name_gets_the_buckets_it_runs(plan):
    """usc.training.param_groups keeps decayed and non-decayed weights in buckets of their own; the
    report packs them the same way (small buckets, so several of each): the same calls, labels and
    bytes as the reducer's buckets, and the report's bytes equal to the Comms' counts."""
    torch.manual_seed(0)
    batch = token_batch(128, 6 if "dp=3" in plan else 4, 15)
    grouped = usc.training.param_groups(lambda groups: torch.optim.SGD(groups, lr=0.1), weight_decay=0.1)
    sim = usc.simulate(TinyLlama(), plan + " bucket_mb=0.02", example_inputs=batch, optimizer=grouped)
    sim.step(*batch)
    listed = [c for c in sim.report.collectives if c.source == "gradient bucket" and c.axis == "dp"]
    buckets = [b for b in sim.ranks[0].reducer.buckets if "dp" in b.axes]
    assert len(listed) == len(buckets) > 2
    names = [{n for n, _ in b.params} for b in buckets]
    assert all(len({grouped.group_of(n) for n in group}) == 1 for group in names)  # no bucket mixes groups
    assert sorted(c.module for c in listed) == sorted(
        b.params[0][0] if len(b.params) == 1 else f"{b.params[-1][0]} .. {b.params[0][0]} ({len(b.params)} params)"
        for b in buckets)
    assert dict(sim.report.traffic) == dict(_counted(sim))


@pytest.mark.parametrize("plan", ["tp=2 sp=on dtype=bf16", "dp=2 pp=2 mb=2 dtype=bf16", "cp=2 dtype=bf16"])
def test_a_float64_model_under_bf16_lists_its_activations_in_bf16(plan):
    """The executor casts every float state and input to bf16, so a float64 model runs in bf16: its
    tp/cp collectives and pipeline transfers move bf16 (the report listed them at float64's size)."""
    torch.manual_seed(0)
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(TinyLlama().double(), plan, example_inputs=batch, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    sim.step(*batch)
    assert dict(sim.report.traffic) == dict(_counted(sim))


def test_a_float64_model_that_casts_is_refused_under_bf16_naming_the_cast():
    """transformers' Llama casts (its rotary table to float32, its norm's statistics): read as a
    float32 model's casts, a float64 model's would meet bf16 weights in float64 (torch's dtype error
    at the first step, before)."""
    from usc.testing.hf import hf_llama

    model = hf_llama(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2).double()
    with pytest.raises(usc.PlanError, match=r"(?s)weights are float64 while it casts to float32 in module .*model\.float\(\)"):
        usc.simulate(model, "dp=2 dtype=bf16", example_inputs=token_batch(64, 4, 8))


def test_a_float32_model_with_a_float64_buffer_is_a_float32_model_under_bf16():
    """Only float64 weights make a float64 model: a float32 model keeping one float64 buffer (a table
    computed in double precision) and casting as HF models do trains under dtype=bf16."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("scale", torch.full((8,), 0.5, dtype=torch.float64))

        def forward(self, x, y):
            h = self.lin(x).to(torch.float32) * self.scale.to(torch.float32)
            return (h.to(x.dtype) - y).pow(2).mean()

    torch.manual_seed(0)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    sim = usc.simulate(Scaled(), "dp=2 dtype=bf16", example_inputs=batch)
    assert sim.step(*batch) > 0
