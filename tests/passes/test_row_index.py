"""Indexing that picks each row of its own batch (x[arange(B)[:, None], idx]) is batch-local: the
first pass rewrites it as x[:, idx] (passes/row_index.py), so dp splits it without a gather and
microbatches run it; anything that is not exactly that identity is left as traced."""

import pytest
import torch
from torch import nn

import usc
from usc.passes.row_index import batch_row_index
from usc.compiler.trace import trace
from usc.testing import assert_equivalent

aten = torch.ops.aten


class RowPick(nn.Module):
    """Scores per sample, read back at positions shared by every row (Hugging Face's padding mask)."""

    def __init__(self, rows_from: str = "arange"):
        super().__init__()
        self.proj = nn.Linear(5, 7)
        self.rows_from = rows_from
        self.register_buffer("positions", torch.tensor([8, 0, 3, 3]))

    def forward(self, x):
        h = self.proj(x)                                      # [B, S, 7]
        b = h.shape[0]
        rows = torch.arange(b) if self.rows_from == "arange" else torch.arange(b).flip(0)
        picked = h[rows.view(b, 1, 1), self.positions.view(1, -1, 1), torch.arange(7).view(1, 1, 7)]
        return (picked * picked).mean()


def batch(seed: int, rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 9, 5, generator=g),)


def _indexes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.index.Tensor]


def test_the_batch_arange_index_becomes_a_whole_dim():
    traced = trace(RowPick(), batch(0))
    assert batch_row_index(traced.gm) == 1
    (index,) = _indexes(traced.gm)
    assert index.args[1][0] is None
    assert not [n for n in traced.gm.graph.nodes if n.target is aten.arange.default and n.args == (6,)]


def test_rows_in_another_order_are_left_as_traced():
    traced = trace(RowPick("flipped"), batch(0))
    assert batch_row_index(traced.gm) == 0
    (index,) = _indexes(traced.gm)
    assert index.args[1][0] is not None


@pytest.mark.parametrize("plan", ["dp=2", "dp=3", "mb=3", "dp=2 mb=3"])
def test_row_picking_is_batch_local(plan):
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    result = assert_equivalent(lambda: RowPick().double(), plan,
                               [tuple(t.double() if t.is_floating_point() else t for t in batch(s)) for s in range(2)],
                               optimizer=sgd, rtol=1e-10, atol=1e-12, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10
    report = usc.lint(RowPick(), plan, example_inputs=batch(0))
    assert not [c for c in report.collectives if c.kind == "all-gather"]


def test_rows_in_another_order_still_train_equal_under_dp():
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    result = assert_equivalent(lambda: RowPick("flipped"), "dp=2", [batch(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6
