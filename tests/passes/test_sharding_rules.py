"""Sharding rules and propagation on small hand-built graphs: the collectives inserted first, then the
numbers (one SGD step on the mesh equals one SGD step of the plain module)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from usc.passes.sharding_rules import view_groups

import usc

LR = 0.1


# ---------------------------------------------------------------- view_groups

@pytest.mark.parametrize("src, dst, groups", [
    ((2, 3, 4), (6, 4), [([0, 1], [0]), ([2], [1])]),  # merge the two outer dims
    ((6, 4), (2, 3, 4), [([0], [0, 1]), ([1], [2])]),  # split the outer dim
    ((4, 16, 64), (4, 16, 4, 16), [([0], [0]), ([1], [1]), ([2], [2, 3])]),  # hidden -> heads x head_dim
    ((4, 16, 4, 16), (4, 16, 64), [([0], [0]), ([1], [1]), ([2, 3], [2])]),  # and back
    ((2, 3, 4), (24,), [([0, 1, 2], [0])]),  # flatten everything
    ((2, 3), (3, 2), [([0, 1], [0, 1])]),  # no common boundary inside: one group
    ((4, 1, 16), (4, 16), [([0, 1], [0]), ([2], [1])]),  # a size-1 dim joins the group before it
    ((4, 16), (4, 16, 1), [([0], [0]), ([1], [1]), ([], [2])]),  # a trailing new size-1 dim stands alone
    ((8,), (8,), [([0], [0])]),
])
def test_view_groups(src, dst, groups):
    assert view_groups(src, dst) == groups


@pytest.mark.parametrize("src, dst", [((2, 3, 4), (4, 6)), ((5, 12), (3, 4, 5)), ((1, 7, 2), (14, 1))])
def test_view_groups_cover_each_dim_once_with_equal_products(src, dst):
    groups = view_groups(src, dst)
    assert [d for gi, _ in groups for d in gi] == list(range(len(src)))
    assert [d for _, gj in groups for d in gj] == list(range(len(dst)))
    for gi, gj in groups:
        assert math.prod(src[d] for d in gi) == math.prod(dst[d] for d in gj)


# ---------------------------------------------------------------- a Megatron MLP, found automatically

class MLP(nn.Module):
    """Linear(16, 32) -> GELU -> Linear(32, 16), both with bias; loss = out.pow(2).mean().

    ``input_scale`` puts a trainable op in front, so the MLP's input needs a gradient.
    """

    def __init__(self, input_scale: bool = False):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16)) if input_scale else None
        self.fc1 = nn.Linear(16, 32, bias=True)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 16, bias=True)
        with torch.no_grad():  # a large bias: adding it once per rank would be plainly visible
            self.fc2.bias.copy_(torch.linspace(0.5, 1.0, 16))

    def forward(self, x):
        if self.scale is not None:
            x = x * self.scale
        return self.fc2(self.act(self.fc1(x))).pow(2).mean()


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def one_step_reference(model: nn.Module, *inputs):
    """Loss and weights after one plain SGD step on one device."""
    loss = model(*inputs)
    loss.backward()
    with torch.no_grad():
        return loss.item(), {n: (p - LR * p.grad).detach() for n, p in model.named_parameters()}


def assert_one_step_matches(factory, plan, *inputs):
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    sim = usc.simulate(model, plan, example_inputs=inputs, optimizer=sgd)
    loss = sim.step(*inputs)
    expected_loss, expected = one_step_reference(reference, *inputs)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    full = sim.full_state_dict()
    assert sorted(full) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return sim


def mlp_input(batch=4):
    return torch.randn(batch, 8, 16, generator=torch.Generator().manual_seed(0))


def schedule(report):
    """The compiled program's collectives (the runtime's once-per-step loss-value sum left out)."""
    return [(c.kind, c.axis, c.direction, c.module) for c in report.collectives if c.module != "<loss value>"]


def test_tp_mlp_is_a_megatron_pair_with_one_forward_all_reduce():
    report = usc.lint(MLP(), "tp=2", example_inputs=(mlp_input(),))
    assert {c.module: c.style for c in report.tp_choices} == {"fc1": "colwise", "fc2": "rowwise"}
    # The input needs no gradient, so Megatron's f has nothing to reduce in backward.
    assert schedule(report) == [("all-reduce", "tp", "forward", "fc2")]
    assert report.collectives[0].shape == (4, 8, 16)


def test_tp_mlp_with_trainable_input_reduces_its_gradient_once():
    report = usc.lint(MLP(input_scale=True), "tp=2", example_inputs=(mlp_input(),))
    assert sorted(schedule(report)) == [("all-reduce", "tp", "backward", "fc1"),
                                        ("all-reduce", "tp", "forward", "fc2")]


@pytest.mark.parametrize("input_scale", [False, True])
def test_tp_mlp_one_sgd_step_equals_one_device(input_scale):
    sim = assert_one_step_matches(lambda: MLP(input_scale), "tp=2", mlp_input())
    # Each rank holds half of fc1 (rows) and half of fc2 (columns), but all of fc2's bias.
    local = sim.rank_state(1)
    assert local["fc1.weight"].shape == (16, 16) and local["fc2.weight"].shape == (16, 16)
    assert local["fc2.bias"].shape == (16,)


def test_dp_mlp_only_reduces_gradients():
    report = usc.lint(MLP(), "dp=2", example_inputs=(mlp_input(4),))
    assert schedule(report) == [("all-reduce", "dp", "backward", "fc1.weight .. fc2.bias (4 params)")]
    assert report.collectives[0].shape == (16 * 32 + 32 + 32 * 16 + 16,)
    assert_one_step_matches(MLP, "dp=2", mlp_input(4))


class ThreeLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x))))).pow(2).mean()


def test_three_linear_chain_trains_like_one_device():
    assert_one_step_matches(ThreeLinears, "tp=2", torch.randn(4, 16, generator=torch.Generator().manual_seed(1)))


def test_three_linear_chain_pairs_do_not_overlap():
    report = usc.lint(ThreeLinears(), "tp=2", example_inputs=(torch.randn(4, 16),))
    styles = {c.module: c.style for c in report.tp_choices}
    assert (styles["fc1"], styles["fc2"]) == ("colwise", "rowwise")
    assert {c.kind for c in report.collectives} == {"all-reduce"}


# ---------------------------------------------------------------- ops without a rule

class Scan(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=0)


class Sorter(nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=0).values


@torch.library.custom_op("usc_test::halve_", mutates_args={"x"})
def halve_(x: torch.Tensor) -> None:
    x.mul_(0.5)


@halve_.register_fake
def _(x):
    return None


class Noise(nn.Module):
    """A custom op that writes its input: no link of the rule chain knows what it does to a shard."""

    def forward(self, x):
        y = x * 2
        halve_(y)
        return y + x


class Ruleless(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.lin(x)).pow(2).mean()


def test_op_without_rule_on_a_sharded_tensor_names_op_and_module():
    x = torch.randn(4, 16)
    with pytest.raises(usc.CompileError) as info:
        usc.lint(Ruleless(Noise()), "dp=2", example_inputs=(x,))
    message = str(info.value)
    assert not isinstance(info.value, usc.PlanError)
    assert "auto_functionalized" in message and "module 'inner'" in message and "'dp'" in message
    assert "S(0)" in message and "test_sharding_rules.py" in message
    usc.lint(Ruleless(Noise()), "dp=1", example_inputs=(x,))  # whole tensors: no rule needed


@pytest.mark.parametrize("inner", [Scan, Sorter])
def test_op_coupling_the_batch_runs_on_the_whole_batch(inner):
    """cumsum and sort across the batch have no hand rule: DTensor's strategy gathers the batch first."""
    assert_one_step_matches(lambda: Ruleless(inner()), "dp=2", torch.randn(6, 16, generator=torch.Generator().manual_seed(2)))


def test_no_rule_hint_names_the_op_and_the_real_remedies():
    """The hint must not promise a plan rule that changes nothing (a replicate rule only places weights)."""
    x = torch.randn(4, 16)
    with pytest.raises(usc.CompileError) as info:
        usc.lint(Ruleless(Noise()), "dp=2", example_inputs=(x,))
    assert "auto_functionalized" in info.value.hint and "SHARDING_RULES" in info.value.hint
    assert "replicate" not in info.value.hint


# ---------------------------------------------------------------- means over a sharded batch

class MeanAll(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).mean()


class MeanOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).mean(0).pow(2).sum()


def test_mean_over_the_sharded_batch_equals_one_device():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2)) + 1.0
    sim = assert_one_step_matches(MeanAll, "dp=2", x)
    # sum of local sums / global count: the activations are never gathered.
    graph = [c for c in sim.report.collectives if c.module != "<loss value>"]
    assert [c.kind for c in graph if c.direction == "forward"] == []
    # the runtime sums the partial loss once to return it, and says so in the report
    assert [c.module for c in sim.report.collectives if c.direction == "forward"] == ["<loss value>"]


def test_mean_over_batch_then_square_reduces_the_means_not_the_batch():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    sim = assert_one_step_matches(MeanOverBatch, "dp=2", x)
    forward = [(c.kind, c.shape) for c in sim.report.collectives
               if c.direction == "forward" and c.module != "<loss value>"]
    assert forward == [("all-reduce", (16,))]  # the [16] partial sums; pow needs them whole


# ---------------------------------------------------------------- cat of an empty cache

class EmptyCacheAttention(nn.Module):
    """Keys and values concatenated after an empty 1-d tensor, as a Hugging Face cache's first update
    does in a training forward (GraniteMoE): torch.cat leaves the empty piece out."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(30, 3 * 30, bias=False)
        self.out = nn.Linear(30, 30, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 6, 5).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        k, v = torch.cat([torch.tensor([]), k], dim=-2), torch.cat([torch.tensor([]), v], dim=-2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, 30)).pow(2).mean()


def test_cat_leaves_a_1d_empty_piece_whole():
    """The empty piece is not sliced like the keys (a [0] tensor has no head dim to shard: the planner's
    memory count failed on it); the other pieces decide the output."""
    from torch.distributed.tensor import Replicate, Shard
    from usc.passes.sharding_rules import OpView, cat_rule

    graph = torch.fx.Graph()
    empty, keys = graph.placeholder("empty"), graph.placeholder("keys")
    node = graph.call_function(torch.ops.aten.cat.default, ([empty, keys], 2))
    view = OpView(node, (Replicate(), Shard(1)), ((0,), (4, 6, 9, 5)), (4, 6, 9, 5), "tp", 2)
    assert cat_rule(view).inputs == (Replicate(), Shard(1)) and cat_rule(view).output == Shard(1)
    view = OpView(node, (Shard(0), Shard(0)), ((0,), (4, 6, 9, 5)), (4, 6, 9, 5), "dp", 2)
    assert cat_rule(view).inputs == (Replicate(), Shard(0)) and cat_rule(view).output == Shard(0)


@pytest.mark.parametrize("plan", ["dp=2 tp=3", "dp=3 cp=2"])
def test_attention_over_an_empty_cache_trains_like_one_device_and_is_planned(plan):
    x = torch.randn(6, 8, 30, generator=torch.Generator().manual_seed(1))
    assert_one_step_matches(EmptyCacheAttention, plan, x)
    torch.manual_seed(0)
    assert usc.plan(EmptyCacheAttention(), "gpus=6", example_inputs=(x,)).world_size == 6
