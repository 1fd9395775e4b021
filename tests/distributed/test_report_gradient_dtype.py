"""The compile report lists each gradient reduction in the dtype the reducer sends it in -- bf16 under
reduce_dtype=bf16, the weights' own dtype otherwise (float64 for a float64 model) -- with the element
count the reducer pads to, so its bytes equal what every rank's Comms count."""

from collections import Counter

import pytest
import torch

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
