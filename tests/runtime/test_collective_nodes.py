"""Differentiable collectives: forward and gradients equal a single-process reference."""

import copy

import pytest
import torch
from torch import nn
from usc.runtime.collectives import (
    AllGather,
    AllReduce,
    AxisIndex,
    GradAllReduce,
    LocalShard,
    ReduceScatter,
)
from usc.runtime.mesh import run_in_threads, simulated_meshes


def _rand(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _on_ranks(size: int, fn):
    """fn(mesh) on every rank of a simulated 1-axis mesh named 'tp'."""
    return run_in_threads(simulated_meshes(("tp",), (size,), timeout=10.0), fn, timeout=30.0)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_local_shard_then_all_gather_is_identity_with_identity_gradient(size):
    x_full, w = _rand(0, 4, 8), _rand(1, 4, 8)

    def rank(mesh):
        x = x_full.clone().requires_grad_()
        y = AllGather("tp", dim=1).bind(mesh)(LocalShard("tp", dim=1).bind(mesh)(x))
        (y * w).sum().backward()
        return y.detach(), x.grad

    for y, grad in _on_ranks(size, rank):
        assert torch.equal(y, x_full)
        torch.testing.assert_close(grad, w)


@pytest.mark.parametrize("size", [2, 4])
def test_all_gather_with_partial_gradient_reduce_scatters_it(size):
    shards = [_rand(10 + r, 2, 3) for r in range(size)]
    weights = [_rand(20 + r, 2 * size, 3) for r in range(size)]  # a different loss term per rank

    def rank(mesh):
        x = shards[mesh.rank].clone().requires_grad_()
        y = AllGather("tp", dim=0, grad="partial").bind(mesh)(x)
        (y * weights[mesh.rank]).sum().backward()
        return x.grad

    total_weight = sum(weights)
    for r, grad in enumerate(_on_ranks(size, rank)):
        torch.testing.assert_close(grad, total_weight.chunk(size, 0)[r])


@pytest.mark.parametrize("size", [2, 4])
def test_reduce_scatter_forward_and_all_gather_backward(size):
    partials = [_rand(30 + r, 3, 2 * size) for r in range(size)]
    weights = [_rand(40 + r, 3, 2) for r in range(size)]

    def rank(mesh):
        x = partials[mesh.rank].clone().requires_grad_()
        y = ReduceScatter("tp", dim=1).bind(mesh)(x)
        (y * weights[mesh.rank]).sum().backward()
        return y.detach(), x.grad

    total = sum(partials)
    for r, (y, grad) in enumerate(_on_ranks(size, rank)):
        torch.testing.assert_close(y, total.chunk(size, 1)[r])
        torch.testing.assert_close(grad, torch.cat(weights, dim=1))


@pytest.mark.parametrize("size", [2, 4])
def test_all_reduce_is_megatron_g_and_grad_all_reduce_is_f(size):
    partials = [_rand(50 + r, 5) for r in range(size)]
    w = _rand(60, 5)
    loss_weights = [_rand(70 + r, 5) for r in range(size)]

    def rank(mesh):
        p = partials[mesh.rank].clone().requires_grad_()
        y = AllReduce("tp").bind(mesh)(p)  # g: sum forward, identity backward
        (y * w).sum().backward()
        x = torch.ones(5, dtype=torch.float64, requires_grad=True)
        z = GradAllReduce("tp").bind(mesh)(x)  # f: identity forward, sum of grads backward
        (z * loss_weights[mesh.rank]).sum().backward()
        return y.detach(), p.grad, z.detach(), x.grad

    for y, p_grad, z, x_grad in _on_ranks(size, rank):
        torch.testing.assert_close(y, sum(partials))
        torch.testing.assert_close(p_grad, w)
        assert torch.equal(z, torch.ones(5, dtype=torch.float64))
        torch.testing.assert_close(x_grad, sum(loss_weights))


def test_all_reduce_max_routes_the_gradient_to_the_owner():
    """max over ranks, differentiated: each element's gradient goes to the rank holding the max
    (split evenly where ranks tie, as torch.amax splits it), zero elsewhere."""
    def rank(mesh):
        x = torch.tensor([float(mesh.rank), -float(mesh.rank), 1.0], requires_grad=True)
        y = AllReduce("tp", op="max").bind(mesh)(x)
        (y * torch.tensor([2.0, 3.0, 4.0])).sum().backward()
        return y.detach(), x.grad

    for r, (y, grad) in enumerate(_on_ranks(4, rank)):
        assert y.tolist() == [3.0, 0.0, 1.0]
        assert grad.tolist() == [2.0 if r == 3 else 0.0, 3.0 if r == 0 else 0.0, 1.0]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_then_row_parallel_mlp_equals_two_linears(size):
    """picotron-style: sharded Megatron MLP == nn.Linear pair, in forward and every gradient."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(6, 8).double(), nn.Linear(8, 6).double()
    x_full, target = _rand(80, 3, 6), _rand(81, 3, 6)
    x_ref = x_full.clone().requires_grad_()
    y_ref = fc2(torch.relu(fc1(x_ref)))
    ((y_ref - target) ** 2).sum().backward()

    def rank(mesh):
        a, b = copy.deepcopy(fc1), copy.deepcopy(fc2)
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
        column, row = LocalShard("tp", dim=0).bind(mesh), LocalShard("tp", dim=1).bind(mesh)
        f, g = GradAllReduce("tp").bind(mesh), AllReduce("tp").bind(mesh)
        x = x_full.clone().requires_grad_()
        h = torch.relu(f(x) @ column(a.weight).T + column(a.bias))
        y = g(h @ row(b.weight).T) + b.bias
        ((y - target) ** 2).sum().backward()
        return y.detach(), x.grad, a.weight.grad, a.bias.grad, b.weight.grad, b.bias.grad

    expected = (y_ref.detach(), x_ref.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad)
    for got in _on_ranks(size, rank):
        for g_, e in zip(got, expected):
            torch.testing.assert_close(g_, e)


def test_axis_index_is_the_coordinate():
    meshes = simulated_meshes(("dp", "tp"), (2, 2), timeout=5.0)
    assert [AxisIndex("tp").bind(m)() for m in meshes] == [0, 1, 0, 1]
    assert [AxisIndex("dp").bind(m)() for m in meshes] == [0, 0, 1, 1]
    assert AxisIndex("pp").bind(meshes[3])() == 0  # absent axis: size 1


NODES = [
    (AllReduce("tp"), "all-reduce", "all-reduce", None),
    (AllReduce("tp", op="max"), "all-reduce", "all-reduce", "all-reduce"),
    (GradAllReduce("tp"), "all-reduce", None, "all-reduce"),
    (AllGather("tp", dim=1), "all-gather", "all-gather", None),
    (AllGather("tp", dim=1, grad="partial"), "all-gather", "all-gather", "reduce-scatter"),
    (ReduceScatter("tp", dim=0), "reduce-scatter", "reduce-scatter", "all-gather"),
    (LocalShard("tp", dim=0), "all-gather", None, "all-gather"),
    (AxisIndex("tp"), "none", None, None),
]


@pytest.mark.parametrize(
    "node, kind, fwd, bwd", NODES, ids=lambda v: repr(v) if isinstance(v, nn.Module) else None
)
def test_node_describes_its_collectives(node, kind, fwd, bwd):
    assert (node.kind, node.forward_collective(), node.backward_collective()) == (kind, fwd, bwd)


def test_node_repr_reads_as_constructor():
    assert repr(AllGather("tp", dim=1, grad="partial")) == "AllGather(axis='tp', dim=1, grad='partial')"
    assert repr(AllReduce("dp")) == "AllReduce(axis='dp', op='sum')"
    assert repr(GradAllReduce("tp")) == "GradAllReduce(axis='tp')"


def test_unbound_node_says_to_bind():
    with pytest.raises(RuntimeError, match=r"AllReduce\(axis='tp', op='sum'\) is not bound.*bind\(mesh\)"):
        AllReduce("tp")(torch.ones(2))


def test_copies_come_out_unbound():
    node = ReduceScatter("tp", dim=0).bind(simulated_meshes(("tp",), (2,), timeout=1.0)[0])
    with pytest.raises(RuntimeError, match="not bound"):
        copy.deepcopy(node)(torch.ones(2))


def test_bad_node_arguments_are_rejected():
    with pytest.raises(ValueError, match="'sum' or 'max'"):
        AllReduce("tp", op="mean")
    with pytest.raises(ValueError, match="'replicated' or 'partial'"):
        AllGather("tp", dim=0, grad="sum")
