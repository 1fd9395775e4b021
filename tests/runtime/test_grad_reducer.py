"""GradReducer on the simulator: sums equal the reference, buckets launch during backward."""

import copy

import pytest
import torch
from torch import nn
from usc.runtime.mesh import run_in_threads, simulated_meshes
from usc.runtime.reducer import GradReducer
from usc.runtime.timeline import Timeline


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).double()


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank))


def _local_grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    m(_batch(rank)).square().sum().backward()
    return {n: p.grad for n, p in m.named_parameters()}


def _summed(model: nn.Module, ranks) -> dict[str, torch.Tensor]:
    per_rank = [_local_grads(model, r) for r in ranks]
    return {n: sum(g[n] for g in per_rank) for n in per_rank[0]}


@pytest.mark.parametrize("dp", [2, 4])
def test_reduced_grads_are_the_sum_and_buckets_launch_during_backward(dp):
    base = _model()
    meshes = simulated_meshes(("dp",), (dp,), timeout=10.0)

    def rank(mesh):
        model = copy.deepcopy(base)
        reducer = GradReducer([(n, p, ("dp",)) for n, p in model.named_parameters()], mesh, bucket_bytes=128)
        model(_batch(mesh.rank)).square().sum().backward()
        launched_before_finish = reducer.launched_during_backward
        overlapped = reducer.finish()
        return (
            launched_before_finish,
            overlapped,
            len(reducer.buckets),
            {n: p.grad for n, p in model.named_parameters()},
        )

    expected = _summed(base, range(dp))
    for launched, overlapped, n_buckets, grads in run_in_threads(meshes, rank, timeout=30.0):
        assert n_buckets >= 3 and launched == overlapped == n_buckets  # every bucket overlapped backward
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name])


def test_buckets_are_filled_in_reverse_order_and_respect_the_size_cap():
    model = _model()
    mesh = simulated_meshes(("dp",), (2,), timeout=1.0)[0]
    params = [(n, p, ("dp",)) for n, p in model.named_parameters()]
    reducer = GradReducer(params, mesh, bucket_bytes=8 * 8 * 8)  # one 8x8 float64 weight
    assert [b.names() for b in reducer.buckets] == [
        ["4.bias", "4.weight", "2.bias", "2.weight"],
        ["0.bias", "0.weight"],
    ]
    reducer.remove_hooks()


def test_tied_weight_is_reduced_once_with_its_accumulated_gradient():
    torch.manual_seed(1)
    embedding = torch.randn(5, 3, dtype=torch.float64)
    meshes = simulated_meshes(("dp",), (2,), timeout=10.0)

    def loss(weight, rank):
        x = _batch(rank)[:, :3]
        return ((x @ weight.T) @ weight).square().sum()  # the same weight used twice

    def rank(mesh):
        weight = nn.Parameter(embedding.clone())
        reducer = GradReducer(
            [("embed", weight, ("dp",)), ("lm_head", weight, ("dp",))], mesh, bucket_bytes=1
        )
        loss(weight, mesh.rank).backward()
        reducer.finish()
        return weight.grad

    expected = sum(_tied_grad(loss, embedding, r) for r in range(2))
    for grad in run_in_threads(meshes, rank, timeout=10.0):
        torch.testing.assert_close(grad, expected)


def _tied_grad(loss, embedding, rank):
    weight = embedding.clone().requires_grad_()
    loss(weight, rank).backward()
    return weight.grad


def test_several_axes_no_axis_and_missing_gradients():
    """dp x cp mesh: 'shared' summed over both axes, 'dp_only' over dp, 'local' not at all,
    'unused' never gets a gradient (treated as zeros)."""
    meshes = simulated_meshes(("dp", "cp"), (2, 2), timeout=10.0)

    def rank(mesh):
        params = {
            k: nn.Parameter(torch.ones(4, dtype=torch.float64))
            for k in ["shared", "dp_only", "local", "unused"]
        }
        axes = {"shared": ("dp", "cp"), "dp_only": ("dp",), "local": (), "unused": ("dp", "cp")}
        reducer = GradReducer([(k, p, axes[k]) for k, p in params.items()], mesh, bucket_bytes=1)
        scale = float(mesh.rank + 1)
        (scale * (params["shared"] + params["dp_only"] + params["local"])).sum().backward()
        reducer.finish()
        return {k: p.grad for k, p in params.items()}

    results = run_in_threads(meshes, rank, timeout=10.0)
    for r, grads in enumerate(results):
        dp_peers = [p for p in range(4) if p % 2 == r % 2]  # same cp coordinate
        assert grads["shared"].tolist() == [1.0 + 2 + 3 + 4] * 4
        assert grads["dp_only"].tolist() == [float(sum(p + 1 for p in dp_peers))] * 4
        assert grads["local"].tolist() == [float(r + 1)] * 4
        assert grads["unused"].tolist() == [0.0] * 4


def test_no_sync_accumulates_micro_batches_then_reduces_once():
    base = _model()
    meshes = simulated_meshes(("dp",), (2,), timeout=10.0)

    def rank(mesh):
        model = copy.deepcopy(base)
        reducer = GradReducer([(n, p, ("dp",)) for n, p in model.named_parameters()], mesh, bucket_bytes=256)
        with reducer.no_sync():
            model(_batch(mesh.rank)).square().sum().backward()
        model(_batch(mesh.rank + 2)).square().sum().backward()
        reducer.finish()
        return {n: p.grad for n, p in model.named_parameters()}

    expected = _summed(base, range(4))  # ranks 0,1 saw batches (0, 2) and (1, 3)
    for grads in run_in_threads(meshes, rank, timeout=10.0):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name])


def test_second_backward_without_finish_is_a_clear_error():
    meshes = simulated_meshes(("dp",), (2,), timeout=10.0)

    def rank(mesh):
        w = nn.Parameter(torch.ones(2))
        GradReducer([("w", w, ("dp",))], mesh)
        w.sum().backward()
        w.sum().backward()

    with pytest.raises(RuntimeError, match=r"'w' received a second gradient.*no_sync"):
        run_in_threads(meshes, rank, timeout=10.0)


def test_bucket_spans_are_recorded_on_the_timeline():
    meshes = simulated_meshes(("dp",), (2,), timeout=10.0)
    timelines = [Timeline(rank=r) for r in range(2)]

    def rank(mesh):
        model = _model()
        reducer = GradReducer(
            [(n, p, ("dp",)) for n, p in model.named_parameters()],
            mesh,
            bucket_bytes=10**9,
            timeline=timelines[mesh.rank],
        )
        model(_batch(mesh.rank)).sum().backward()
        reducer.finish()

    run_in_threads(meshes, rank, timeout=10.0)
    assert [s.name for s in timelines[1].spans] == ["grad-bucket0['dp']"]
