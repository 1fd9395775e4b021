"""Activations torch writes as composite ops that no DTensor strategy places -- log_sigmoid (preference
losses), hardswish (MobileNet-style blocks), glu (gated units) -- were placed by running them whole:
under dp every rank gathered the batch, and under microbatches the model was refused as mixing samples.
Each has a rule now (element-wise; glu along its dim), verified by the rule sweep, and these models
equal one device (float64, SGD) with no all-gather over dp."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import usc
from usc.testing import assert_equivalent

ACTIVATIONS = {
    "log_sigmoid": lambda h: F.logsigmoid(h),
    "hardswish": lambda h: F.hardswish(h),
    "glu": lambda h: F.glu(h, -1),
    "torch_modules": lambda h: nn.Hardswish()(nn.GLU()(h)),
}


class Block(nn.Module):
    def __init__(self, activation: str) -> None:
        super().__init__()
        self.activation = ACTIVATIONS[activation]
        self.up, self.down = nn.Linear(7, 18), nn.Linear(9 if activation in ("glu", "torch_modules") else 18, 3)

    def forward(self, x, y):
        return F.mse_loss(self.down(self.activation(self.up(x))), y)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5, 7, generator=g), torch.randn(6, 5, 3, generator=g)


@pytest.mark.parametrize("plan", ["dp=2", "dp=3 mb=2", "tp=2", "pp=1 mb=3"])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_activations_equal_one_device(activation, plan):
    result = assert_equivalent(lambda: Block(activation).double(), plan, [tuple(t.double() for t in batch())] * 2,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), rtol=1e-10, atol=1e-10,
                               param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_activations_do_not_gather_the_batch(activation):
    report = usc.lint(Block(activation), "dp=2", example_inputs=batch())
    assert not [c for c in report.collectives if c.axis == "dp" and c.kind == "all-gather"]
