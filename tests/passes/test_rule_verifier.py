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

# OpInfo sample generators torch leaves open must not be finalized inside a later trace
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

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

CI_OPS = [aten._to_copy.default, aten.amax.default, aten.gather.default, aten.index_select.default,
          aten.view.default, aten.slice.Tensor, aten.repeat_interleave.self_int, aten.matmul.default,
          aten.linear.default, aten.sum.dim_IntList, aten.mul.Tensor, aten.relu.default, aten.squeeze.default,
          aten.embedding.default, aten.scaled_dot_product_attention.default]


# torch's OpInfo samples of aten.scatter.reduce call the deprecated form of torch.scatter (torch warns)
@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter:UserWarning")
def test_every_rule_op_has_samples():
    """The sweep covers every aten op of the table: each has OpInfo samples or usc's own."""
    from usc.testing.verify_rules import _opinfos_by_name, calls_of, extra_calls, opinfos_for

    from usc.testing.verify_rules import _collect_left_generators

    index = _opinfos_by_name()
    bare = []
    try:
        for op in rule_ops(SHARDING_RULES):
            calls = extra_calls(op) or [c for info in opinfos_for(op, index) for c in calls_of(op, info, 1)]
            if not calls:
                bare.append(str(op))
    finally:
        _collect_left_generators()
    assert bare == []


def test_the_verifier_leaves_no_sample_generator_for_a_later_trace():
    """torch's sample generators left in reference cycles are collected when the verifier returns:
    one finalised later, inside another test's trace, traces its no_grad exit and fails there."""
    import gc
    import types

    verify(hand_rules, [aten.mul.Tensor, aten.squeeze.default], sizes=(2,), samples_per_info=1)
    left = [o.gi_code.co_name for o in gc.get_objects()
            if type(o) is types.GeneratorType and o.gi_code.co_name.startswith("sample_inputs")]
    assert left == []


def test_ci_subset_of_rules_computes_the_op_forward_and_backward():
    results = verify(hand_rules, CI_OPS, sizes=(2, 5), samples_per_info=1)
    failures = [f"{r.op}: {f}" for r in results for f in r.failures]
    assert failures == [], "\n".join(failures[:10])
    assert sum(r.passed for r in results) > 60
    assert f"| **{len(CI_OPS)} ops**" in table(results)


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


def test_verifier_offers_the_output_dtype_so_a_pointwise_rule_keeping_a_partial_is_checked():
    """A pointwise rule keeps a partial sum only for a floating output; the verifier gave rules no
    output dtype, so that branch never ran under it. A loss rule that keeps partials (as add does)
    is caught; the table's own passes."""
    from usc.passes.sharding_rules import pointwise

    keeps = pointwise("add")
    results = verify(_source_with(aten.mse_loss.default, keeps), [aten.mse_loss.default], sizes=(2,))
    assert any("(P(sum), P(sum)) -> P(sum): forward" in f for f in results[0].failures)
    table_rules = verify(hand_rules, [aten.mse_loss.default, aten.mul.Tensor], sizes=(2,), samples_per_info=1)
    assert [f for r in table_rules for f in r.failures] == [] and all(r.passed for r in table_rules)


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


class Lookup(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.emb = nn.Embedding(14, 6, **options)
        self.head = nn.Linear(6, 14)

    def forward(self, ids, y):
        return F.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), y.flatten())


def _ids(seed):
    ids = torch.randint(0, 14, (4, 6), generator=gen(seed))
    ids[:, 0] = 0  # padding ids on either half of the table, and repeats for the frequency scaling
    ids[:, 1] = 9
    return ids


@pytest.mark.parametrize("padding_idx", [0, 9])
@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "cp=2", "dp=2 mb=2", "tp=2 dp=2"])
def test_embedding_padding_idx_is_exact(plan, padding_idx):
    train_like_one_device(lambda: Lookup(padding_idx=padding_idx), plan, _ids(12), _ids(13))


@pytest.mark.parametrize("plan", ["dp=2", "cp=2", "tp=2"])
def test_embedding_scale_grad_by_freq_is_refused_split(plan):
    with pytest.raises(usc.CompileError, match=f"embedding 'emb': scale_grad_by_freq .* under {plan} "):
        usc.lint(Lookup(scale_grad_by_freq=True), plan, example_inputs=(_ids(14), _ids(15)))


def test_embedding_scale_grad_by_freq_is_exact_whole_and_refused_in_microbatches():
    """Microbatches split the batch the frequencies are counted over: the batch-coupling proof refuses
    at mb (a plan-vs-model mismatch: PlanError with its caret), naming the embedding and its option."""
    train_like_one_device(lambda: Lookup(scale_grad_by_freq=True), "dp=1", _ids(14), _ids(15))
    with pytest.raises(usc.PlanError) as refused:
        usc.lint(Lookup(scale_grad_by_freq=True), "dp=1 mb=2", example_inputs=(_ids(14), _ids(15)))
    err = refused.value
    assert (err.line, err.column, err.width) == (1, 6, 4)  # the caret under mb=2
    assert "embedding 'emb': scale_grad_by_freq counts each id over the whole batch" in err.message
    assert "mb=1" in err.hint


def test_embedding_max_norm_is_refused_even_on_one_device():
    with pytest.raises(usc.CompileError, match="max_norm"):
        usc.lint(Lookup(max_norm=1.0), "dp=1", example_inputs=(_ids(16), _ids(17)))


def test_embedding_sparse_gradient_is_refused_on_a_mesh():
    with pytest.raises(usc.CompileError, match="sparse"):
        usc.lint(Lookup(sparse=True), "dp=2", example_inputs=(_ids(18), _ids(19)))


class Unused(nn.Module):
    """A parameter and a buffer forward never reads."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.spare = nn.Parameter(torch.randn(3, generator=gen(20)))
        self.register_buffer("stat", torch.arange(4.0))

    def forward(self, x):
        return self.b(self.a(x).tanh()).pow(2).mean()


@pytest.mark.parametrize("plan", ["pp=2 mb=2", "dp=2", "tp=2", "dp=2 pp=2 mb=2"])
def test_state_nobody_reads_survives_the_plan(plan, tmp_path):
    x = torch.randn(4, 6, generator=gen(21), dtype=F64)
    train_like_one_device(Unused, plan, x)
    model = Unused().double()
    spare, stat = model.spare.detach().clone(), model.stat.clone()  # the model's own refuse reads once trained past
    sim = usc.simulate(model, plan, example_inputs=(x,), optimizer=sgd)
    sim.step(x)
    full = sim.full_state_dict()
    assert torch.equal(full["spare"], spare) and torch.equal(full["stat"], stat)
    sim.save(tmp_path / "ckpt")
    other = Unused().double()
    with torch.no_grad():
        other.spare.mul_(-3)
        other.stat.add_(7)
    restored = usc.simulate(other, plan, example_inputs=(x,), optimizer=sgd)
    restored.load(tmp_path / "ckpt")
    again = restored.full_state_dict()
    assert torch.equal(again["spare"], full["spare"]) and torch.equal(again["stat"], full["stat"])


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 10), nn.Linear(10, 6)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))).pow(2).mean()


def adafactor(params):
    return torch.optim.Adafactor(params, lr=0.05)


def muon(params):
    params = list(params)
    return torch.optim.Muon([p for p in params if p.dim() == 2], lr=0.05)


@pytest.mark.parametrize("factory, name, plan", [(adafactor, "Adafactor", "tp=2"), (muon, "Muon", "tp=2"),
                                                 (adafactor, "Adafactor", "dp=2 zero=1"),
                                                 (adafactor, "Adafactor", "dp=2 zero=3")])
def test_an_optimizer_that_is_not_element_wise_is_refused_on_slices(factory, name, plan):
    x = torch.randn(4, 3, 6, generator=gen(22), dtype=F64)
    with pytest.raises(usc.CompileError) as info:
        usc.simulate(TwoLayers().double(), plan, example_inputs=(x,), optimizer=factory).step(x)
    message = str(info.value)
    assert name in message and plan.split()[-1].split("=")[0] in message and "fc1.weight" in message


@pytest.mark.parametrize("plan", ["dp=2", "pp=2 mb=2"])
def test_an_optimizer_that_is_not_element_wise_trains_on_whole_parameters(plan):
    x = torch.randn(4, 3, 6, generator=gen(23), dtype=F64)
    assert_equivalent(lambda: TwoLayers().double(), plan, [(x,)], steps=3, optimizer=adafactor,
                      rtol=1e-9, atol=1e-10, param_atol=1e-9)


class ScaledSGD(torch.optim.SGD):
    usc_element_wise = False  # pretends to read across elements: refused like Adafactor


class Elementwise(torch.optim.Optimizer):
    usc_element_wise = True

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * torch.sign(p.grad) * p.grad.abs().sqrt())


def test_a_declared_element_wise_optimizer_steps_on_tp_slices():
    x = torch.randn(4, 3, 6, generator=gen(24), dtype=F64)
    assert_equivalent(lambda: TwoLayers().double(), "tp=2", [(x,)], steps=3, optimizer=Elementwise,
                      rtol=1e-9, atol=1e-10, param_atol=1e-9)
    with pytest.raises(usc.CompileError, match="ScaledSGD"):
        usc.simulate(TwoLayers().double(), "tp=2", example_inputs=(x,),
                     optimizer=lambda p: ScaledSGD(p, lr=0.1)).step(x)


class InPlaceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(0.5)  # in place on a matmul output that selective recompute would keep
        out = self.fc2(F.gelu(h))
        out += x
        return out


class InPlaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([InPlaceBlock() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("plan", ["recompute=selective", "dp=2 recompute=selective", "tp=2 recompute=selective"])
def test_selective_recompute_over_in_place_ops(plan):
    train_like_one_device(InPlaceNet, plan, torch.randn(4, 6, 8, generator=gen(25), dtype=F64))


class UpcastNorm(nn.Module):
    """An RMSNorm that computes its statistics in float32 and casts back to the input's dtype."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        v = h.float().pow(2).mean(-1, keepdim=True)
        h = (h.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)
        return self.fc2(h).pow(2).mean()


@pytest.mark.parametrize("plan", ["dtype=bf16", "dp=2 dtype=bf16", "tp=2 dtype=bf16"])
def test_bf16_with_a_float32_upcast_and_a_cast_back(plan):
    torch.manual_seed(0)
    model = UpcastNorm()
    reference = UpcastNorm()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 6, 8, generator=gen(26))
    sim = usc.simulate(model, plan, example_inputs=(x,), optimizer=sgd)
    losses = [sim.step(x) for _ in range(3)]
    opt = sgd(reference.parameters())
    for got in losses:  # bf16 computes to about 3 significant digits of the float32 run
        loss = reference(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert got == pytest.approx(loss.item(), rel=3e-2)


# ---------------------------------------------------------------- collectives keep their stated backward

from usc.testing.verify_collectives import Contract, check, contracts  # noqa: E402


@pytest.mark.parametrize("contract", contracts(), ids=str)
@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_node_keeps_its_forward_and_backward(contract, size):
    assert check(contract, size) is None


def test_collective_check_fails_a_max_whose_gradient_is_split_evenly():
    from usc.runtime.collectives import AllReduce, _AllReduceSumFn

    class EvenMax(AllReduce):  # forward max, backward to every rank: the check must see it
        def forward(self, x):
            return _AllReduceSumFn.apply(x, self.comm) * 0 + self.comm.all_reduce(x.detach(), "max") + \
                (x - x.detach()) / self.comm.size

    problem = check(Contract(EvenMax("x", "max"), Partial("max"), "owner", R, "whole"), 2)
    assert problem is not None and "backward" in problem


class TakeAlong(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 13, generator=gen(27)))

    def forward(self, idx):  # per-sample positions into the sample's own row
        return torch.take_along_dim(self.table, idx, dim=1).sin().pow(2).mean()


class ScatterRows(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w, self.dim = nn.Parameter(torch.randn(6, 4, generator=gen(28))), dim

    def forward(self, idx):
        shape = (6, 13) if self.dim == 1 else (13, 4)
        out = torch.zeros(shape, dtype=self.w.dtype).scatter_add(self.dim, idx, self.w)
        return out.cos().pow(2).mean()


@pytest.mark.parametrize("factory, high", [(TakeAlong, 13), (lambda: ScatterRows(1), 13), (lambda: ScatterRows(0), 13)])
def test_take_along_dim_and_scatter_with_a_batch_of_ids(factory, high):
    train_like_one_device(factory, "dp=2", torch.randint(0, high, (6, 4), generator=gen(29)))


def test_derived_rules_verified_on_a_subset():
    """The fallback chain (DTensor strategies, decompositions) checked like the hand rules: a norm's
    partial (DTensor's _NormPartial, a p-norm reduction) is not taken for a partial sum, and a
    data-dependent op falls back to whole tensors instead of raising."""
    from usc.testing.verify_rules import derived_rules

    ops = [aten.linalg_vector_norm.default, aten.argwhere.default, aten.cumsum.default, aten.view_as_complex.default]
    results = verify(derived_rules, ops, sizes=(2, 5), samples_per_info=2)
    failures = [f"{r.op}: {f}" for r in results for f in r.failures]
    assert failures == [], "\n".join(failures[:10])
    assert sum(r.passed for r in results) > 5
