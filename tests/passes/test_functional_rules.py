"""Sharding rules of the ops functionalized writes become: a write that leaves a sharded dim alone
keeps the shard (no communication); a write along a sharded dim gathers it."""

from __future__ import annotations

import torch
from torch import nn

import usc
from usc.compiler.trace import trace

aten = torch.ops.aten


class Writes(nn.Module):
    def __init__(self, along_features: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 6)
        self.along_features = along_features

    def forward(self, x, y):
        a = self.up(x)  # (B, T, 10): dp shards B, tp shards the 10 features
        if self.along_features:
            a[..., 0] = 0.0  # writes one feature column: needs the features whole
        else:
            a[:, 1].mul_(2.0)  # writes one position of every sample and feature
            a[:, 2:4] = a[:, 0:2] * 0.5
        return ((self.down(torch.tanh(a)) - y) ** 2).mean()


BATCH = (torch.randn(6, 5, 6), torch.randn(6, 5, 6))


def test_writes_become_scatter_ops():
    targets = {n.target for n in trace(Writes(False), BATCH).gm.graph.nodes}
    assert {aten.select_scatter.default, aten.slice_scatter.default} <= targets
    assert not any(getattr(t, "_schema", None) is not None and t._schema.is_mutable for t in targets)


def test_a_write_that_keeps_the_sharded_dims_costs_no_communication():
    plain = usc.lint(Writes(False), "dp=2 tp=2", example_inputs=BATCH)
    assert plain.count("all-gather") == 0
    assert plain.count("all-reduce", axis="tp", direction="forward", module_prefix="down") == 1  # row-parallel
    assert plain.count("all-reduce", axis="tp", direction="forward") == 2  # and the finite-loss verdict


def test_a_write_along_the_tp_sharded_features_gathers_them():
    report = usc.lint(Writes(True), "dp=2 tp=2", example_inputs=BATCH)
    assert report.count("all-gather", axis="tp", direction="forward") >= 1
    assert report.count("all-gather", axis="dp") == 0
