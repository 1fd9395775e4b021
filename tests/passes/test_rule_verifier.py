"""Sharding rules verified, not trusted: the verifier (OpInfo samples on simulated ranks vs one
device) on the hand table, shown able to fail on wrong rules; then small programs written afresh
that train the same model as one device (float64, SGD, 3 steps) or are refused clearly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import usc
from usc.passes.sharding_rules import SHARDING_RULES, Decision
from usc.testing.equivalence import assert_equivalent
from usc.testing.verify_rules import hand_rules, rule_ops, table, verify

aten = torch.ops.aten
R = Replicate()
F64 = torch.float64


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def train_like_one_device(factory, plan, *batch):
    """3 SGD steps in float64 on the mesh equal 3 on one device (losses and parameters)."""
    return assert_equivalent(lambda: factory().double(), plan, [batch], steps=3, optimizer=sgd,
                             rtol=1e-9, atol=1e-10, param_atol=1e-9)


# ---------------------------------------------------------------- the verifier

CI_OPS = [aten._to_copy.default, aten.to.dtype, aten.amax.default, aten.gather.default, aten.index_select.default,
          aten.view.default, aten.reshape.default, aten.slice.Tensor, aten.repeat_interleave.self_int,
          aten.matmul.default, aten.mm.default, aten.linear.default, aten.sum.dim_IntList, aten.mean.dim,
          aten.mul.Tensor, aten.add.Tensor, aten.relu.default, aten._softmax.default, aten.squeeze.default,
          aten.cat.default, aten.transpose.int, aten.embedding.default, aten.where.self, aten.expand.default]


def test_every_rule_op_has_samples():
    """The sweep covers every aten op of the table: each has OpInfo samples or usc's own."""
    from usc.testing.verify_rules import _opinfos_by_name, calls_of, extra_calls, opinfos_for

    index = _opinfos_by_name()
    bare = []
    for op in rule_ops(SHARDING_RULES):
        calls = extra_calls(op) or [c for info in opinfos_for(op, index) for c in calls_of(op, info, 1)]
        if not calls:
            bare.append(str(op))
    assert bare == []


def test_ci_subset_of_rules_computes_the_op_forward_and_backward():
    results = verify(hand_rules, CI_OPS, sizes=(2, 5), samples_per_info=1)
    failures = [f"{r.op}: {f}" for r in results for f in r.failures]
    assert failures == [], "\n".join(failures[:10])
    assert sum(r.passed for r in results) > 100
    assert "| **24 ops**" in table(results)


def test_zigzag_views_are_checked_per_chunk():
    results = verify(hand_rules, [aten.view.default], sizes=(2,), orders=("zigzag",), samples_per_info=1)
    assert results[0].passed > 0 and results[0].failures == []


def _source_with(op, rule):
    def source(target, view):
        return rule(view) if target is op else hand_rules(target, view)
    return source


def test_verifier_fails_a_partial_kept_through_relu():
    def wrong(view):
        if isinstance(view.placements[0], Partial):
            return Decision(view.placements, view.placements[0])
        return hand_rules(aten.relu.default, view)

    results = verify(_source_with(aten.relu.default, wrong), [aten.relu.default], sizes=(2,), samples_per_info=1)
    assert any("forward" in f and "P(sum)" in f for f in results[0].failures)


def test_verifier_fails_a_partial_kept_through_an_int_cast():
    """The rule the table had: a cast keeps partial sums whatever the dtype."""
    def wrong(view):
        return Decision(view.placements, view.placements[0])

    results = verify(_source_with(aten._to_copy.default, wrong), [aten._to_copy.default], sizes=(2,))
    assert any("torch.int32" in f or "int" in f for f in results[0].failures)


def test_verifier_fails_a_max_whose_gradient_goes_everywhere():
    """A Partial(max) resolved by a detached all-reduce cuts the gradient: the backward check sees it."""
    from usc.runtime import collectives

    original = collectives._AllReduceMaxFn.apply
    collectives._AllReduceMaxFn.apply = lambda x, comm, op: comm.all_reduce(x.detach(), op)
    try:
        results = verify(hand_rules, [aten.amax.default], sizes=(2,), samples_per_info=1)
    finally:
        collectives._AllReduceMaxFn.apply = original
    assert any("backward" in f for f in results[0].failures)


def test_verifier_fails_gather_that_shards_the_source_along_the_ids():
    def wrong(view):  # the old rule: follow whichever operand is sharded
        px, pi = view.placements
        chosen = px if isinstance(px, Shard) else pi if isinstance(pi, Shard) else R
        return Decision((chosen, chosen), chosen)

    results = verify(_source_with(aten.gather.default, wrong), [aten.gather.default], sizes=(2,), samples_per_info=1)
    assert results[0].failures


# ---------------------------------------------------------------- programs written afresh


class MaxPool(nn.Module):
    """Max over a dim that a plan splits, feeding the loss."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.proj = nn.Linear(7, 5)

    def forward(self, x):
        return self.proj(x).tanh().amax(dim=self.dim).pow(2).mean()


@pytest.mark.parametrize("dim, plan", [(1, "cp=2"), (0, "dp=2")])
def test_max_across_ranks_routes_its_gradient_to_the_owner(dim, plan):
    train_like_one_device(lambda: MaxPool(dim), plan, torch.randn(6, 10, 7, generator=gen(0), dtype=F64))


class PartialCast(nn.Module):
    """A row-parallel output (no bias) cast to int and to bool before its sum exists anywhere."""

    def __init__(self, to):
        super().__init__()
        self.up, self.down, self.to = nn.Linear(6, 10), nn.Linear(10, 6, bias=False), to

    def forward(self, x):
        h = self.down(F.gelu(self.up(x)))
        steps = (h * 4).to(self.to).to(h.dtype)
        return (h * steps).pow(2).mean()


@pytest.mark.parametrize("to", [torch.int32, torch.bool])
def test_cast_of_a_partial_sum_is_taken_after_the_sum(to):
    x = torch.randn(6, 5, 6, generator=gen(1), dtype=F64)
    report = usc.lint(PartialCast(to).double(), "tp=2", example_inputs=(x,))
    assert {c.module: c.style for c in report.tp_choices}.get("down") == "rowwise"
    train_like_one_device(lambda: PartialCast(to), "tp=2", x)


class TableLookup(nn.Module):
    """torch.gather from a trained table with per-sample ids (batch data)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(13, 7, generator=gen(2)))

    def forward(self, idx):
        return torch.gather(self.table, 0, idx).sin().sum(1).pow(2).mean()


def test_gather_with_a_batch_of_ids_from_a_replicated_table():
    idx = torch.randint(0, 13, (6, 7), generator=gen(3))
    idx[0, 0] = 12  # ids beyond a half table: sliced table + global ids would crash
    train_like_one_device(TableLookup, "dp=2", idx)


class IndexSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(13, 7, generator=gen(4)))

    def forward(self, ids):
        return torch.index_select(self.table, 0, ids.flatten()).cos().pow(2).mean()


def test_index_select_with_a_batch_of_ids():
    train_like_one_device(IndexSelect, "dp=2", torch.randint(0, 13, (6, 3), generator=gen(5)))


class ClassDimOne(nn.Module):
    """cross_entropy on [B, C, S] logits: PyTorch reads classes from dim 1."""

    def __init__(self, classes):
        super().__init__()
        self.head = nn.Linear(5, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.head(x).transpose(1, 2), y)


@pytest.mark.parametrize("plan", ["dp=2", "dp=2 mb=2", "cp=2"])
@pytest.mark.parametrize("classes", [7, 12])  # 12 == S: a wrong class dim would not even crash
def test_cross_entropy_with_classes_on_dim_one(plan, classes):
    x = torch.randn(4, 12, 5, generator=gen(6), dtype=F64)
    y = torch.randint(0, classes, (4, 12), generator=gen(7))
    train_like_one_device(lambda: ClassDimOne(classes), plan, x, y)


class GroupedSum(nn.Module):
    """Sum over groups of 4 consecutive positions: a group must not straddle a rank's two zig-zag chunks."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 5)

    def forward(self, x):
        h = self.proj(x)
        b, s, d = h.shape
        return h.view(b, s // 4, 4, d).sum(2).tanh().pow(2).mean()


@pytest.mark.parametrize("mode", ["zigzag", "ring", "ulysses"])
@pytest.mark.parametrize("seq", [8, 16])
def test_grouped_view_under_context_parallel(mode, seq):
    x = torch.randn(2, seq, 5, generator=gen(8), dtype=F64)
    train_like_one_device(GroupedSum, f"cp=2 cp_mode={mode}", x)


class Strided(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 5)

    def forward(self, x):
        h = self.proj(x)
        return (h[:, ::2] * h[:, 1::2]).pow(2).mean()


@pytest.mark.parametrize("plan", ["cp=2", "dp=2", "cp=2 cp_mode=zigzag"])
def test_strided_slice(plan):
    train_like_one_device(Strided, plan, torch.randn(4, 12, 5, generator=gen(9), dtype=F64))


class RepeatFlat(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 3)

    def forward(self, x):
        return torch.repeat_interleave(self.proj(x), 2).cumsum(0).sin().mean()


def test_repeat_interleave_without_dim_under_cp():
    """Without a dim the input is flattened: the sequence shards cannot survive it, so it is gathered."""
    train_like_one_device(RepeatFlat, "cp=2", torch.randn(2, 6, 5, generator=gen(11), dtype=F64))


class RepeatFlatSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 3)

    def forward(self, x):
        flat = torch.repeat_interleave(self.proj(x), 2)
        return (flat * torch.linspace(0, 1, flat.numel(), dtype=flat.dtype)).sin().sum()


def test_repeat_interleave_without_dim_trains_under_cp():
    train_like_one_device(RepeatFlatSum, "cp=2", torch.randn(2, 6, 5, generator=gen(10), dtype=F64))
