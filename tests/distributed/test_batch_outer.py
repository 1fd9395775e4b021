"""A batch merged inside another dim (torch's MultiheadAttention works sequence-first inside):
sharded through the rows that treat it alike, gathered or refused where the rows are coupled.

``nn.TransformerEncoder(batch_first=True)`` gathered the batch in every attention layer under dp=2
and was refused under any mb > 1, naming a reshape as mixing samples (passes/batch_outer.py)."""

import pytest
import torch
from torch import nn

import usc
from usc.testing import assert_equivalent

FLOAT64 = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), rtol=1e-10, atol=1e-10, param_atol=1e-10)
BATCH, SEQ, WIDTH = 6, 7, 15


class Encoder(nn.Module):
    """torch's own encoder, batch first, as a user writes it (odd sizes: 3 heads of 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 3, dim_feedforward=22, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        return (self.head(self.encoder(self.embed(x))).squeeze(-1) - y).pow(2).mean()


class SequenceFirstRows(nn.Module):
    """The merge torch's attention makes, by hand, with ``op`` applied to the merged rows."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.up = nn.Linear(4, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.rows = nn.Parameter(torch.randn(SEQ * BATCH, WIDTH) * 0.1)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = self.up(x).transpose(0, 1)                     # [S, B, W]
        rows = h.reshape(SEQ * x.shape[0], WIDTH)          # sequence-major rows: the batch inside
        rows = ROW_OPS[self.op](self, self.mid(rows))
        h = rows.view(SEQ, x.shape[0], WIDTH).transpose(0, 1)
        return (self.head(torch.tanh(h)).squeeze(-1) - y).pow(2).mean()


ROW_OPS = {
    "row_wise": lambda m, r: torch.relu(r) * 2 + m.mid.bias,
    "softmax_over_rows": lambda m, r: r.softmax(0),
    "cumsum_over_rows": lambda m, r: r.cumsum(0),
    "a_table_of_rows": lambda m, r: r + m.rows,
}


def make(cls, *args):
    def build():
        torch.manual_seed(0)
        return cls(*args).double()
    return build


def batches(n: int = 2, batch: int = BATCH):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, SEQ, 4, generator=g, dtype=torch.float64),
             torch.randn(batch, SEQ, generator=g, dtype=torch.float64)) for _ in range(n)]


def dp_gathers(model, plan: str, batch) -> list:
    report = usc.lint(model, plan, example_inputs=batch)
    return [c for c in report.collectives if c.kind == "all-gather" and c.axis == "dp"]


@pytest.mark.parametrize("plan", ["dp=2", "mb=2", "dp=3 mb=2", "dp=2 mb=3", "mb=6"])
def test_torch_transformer_encoder_trains_like_one_device(plan):
    assert_equivalent(make(Encoder), plan, batches(), **FLOAT64)


def test_torch_transformer_encoder_keeps_the_batch_sharded():
    """Before: one forward and one backward all-gather of the batch per attention layer."""
    assert dp_gathers(make(Encoder)(), "dp=2", batches(1)[0]) == []
    assert dp_gathers(make(SequenceFirstRows, "row_wise")(), "dp=3", batches(1)[0]) == []


@pytest.mark.parametrize("op", list(ROW_OPS))
def test_merged_rows_train_like_one_device_under_dp(op):
    """Rows used alike are sharded; rows coupled (softmax, cumsum over them) or added to a table of
    rows of their own (whose order would have to follow) are gathered: the same model either way."""
    assert_equivalent(make(SequenceFirstRows, op), "dp=2", batches(), **FLOAT64)
    coupled = op != "row_wise"
    assert bool(dp_gathers(make(SequenceFirstRows, op)(), "dp=2", batches(1)[0])) == coupled


def test_row_wise_merged_rows_train_like_one_device_under_microbatches():
    assert_equivalent(make(SequenceFirstRows, "row_wise"), "dp=2 mb=3", batches(), **FLOAT64)


@pytest.mark.parametrize("op", ["softmax_over_rows", "cumsum_over_rows"])
def test_coupled_merged_rows_are_refused_under_microbatches_naming_the_op(op):
    name = op.split("_")[0]
    with pytest.raises(usc.PlanError, match=rf"(?s)mb=2 runs the batch in microbatches.*{name}"):
        usc.simulate(make(SequenceFirstRows, op)(), "mb=2", example_inputs=batches(1)[0])
