"""The same runtime on real gloo processes: ProcessGroupComm, GradReducer, dead peers, launch."""

import copy
import os
import signal
import time

import pytest
import torch
from harness import WorldFailure, run_world
from torch import nn
from torch.distributed.tensor import Partial, Shard
from usc.runtime.collectives import AllReduce, GradAllReduce, LocalShard
from usc.runtime.comm import ProcessGroupComm
from usc.runtime.errors import CollectiveError
from usc.runtime.launch import launch_local
from usc.runtime.layout import gather_full, local_chunk
from usc.runtime.mesh import Mesh
from usc.runtime.reducer import GradReducer
from usc.runtime.timeline import Timeline

pytestmark = pytest.mark.distributed


def _x(global_rank: int, shape=(4, 6)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(global_rank), dtype=torch.float64)


def _check_group_collectives(comm: ProcessGroupComm) -> None:
    """Every collective of one group against a reference built from the members' inputs."""
    me, members = comm.global_rank, comm.group_ranks
    inputs = [_x(r) for r in members]
    torch.testing.assert_close(comm.all_reduce(_x(me)), sum(inputs))
    assert torch.equal(comm.all_reduce(_x(me), op="max"), torch.stack(inputs).amax(0))
    assert torch.equal(comm.all_gather(_x(me), 1), torch.cat(inputs, 1))
    torch.testing.assert_close(comm.reduce_scatter(_x(me), 1), sum(inputs).chunk(comm.size, 1)[comm.rank])
    expected = torch.cat([x.chunk(comm.size, 0)[comm.rank] for x in inputs], dim=1)
    assert torch.equal(comm.all_to_all(_x(me), split_dim=0, cat_dim=1), expected)


def _check_async(comm: ProcessGroupComm) -> None:
    me, inputs = comm.global_rank, [_x(r) for r in comm.group_ranks]
    reduced, w1 = comm.all_reduce(_x(me), async_op=True)
    gathered, w2 = comm.all_gather(_x(me), 1, async_op=True)
    scattered, w3 = comm.reduce_scatter(_x(me), 0, async_op=True)
    for work in (w3, w1, w2):
        work.wait()
    torch.testing.assert_close(reduced, sum(inputs))
    assert torch.equal(gathered, torch.cat(inputs, 1))
    torch.testing.assert_close(scattered, sum(inputs).chunk(comm.size, 0)[comm.rank])


def _check_uneven_all_to_all_and_p2p(comm: ProcessGroupComm) -> None:
    size, r = comm.size, comm.rank

    def splits(src):  # rows group rank src sends to each peer
        return [src + j + 1 for j in range(size)]

    t = _x(comm.group_ranks[r], (sum(splits(r)), 2))
    got = comm.all_to_all_single(t, [splits(s)[r] for s in range(size)], splits(r))
    pieces = [_x(comm.group_ranks[s], (sum(splits(s)), 2)).split(splits(s))[r] for s in range(size)]
    assert torch.equal(got, torch.cat(pieces))
    peer = (r + 1) % size
    if r == 0:
        comm.send(_x(comm.global_rank), peer)
        assert torch.equal(
            comm.recv(torch.empty(4, 6, dtype=torch.float64), peer), _x(comm.group_ranks[peer])
        )
    else:
        received = comm.recv(torch.empty(4, 6, dtype=torch.float64), peer)
        comm.send(_x(comm.global_rank), peer)
        assert torch.equal(received, _x(comm.group_ranks[peer]))
    # tagged messages: two of one shape, received in the other order than sent (pipelines with v>1)
    if r == 0:
        works = [comm.send(_x(100 + t), peer, async_op=True, tag=t) for t in (5, 9)]
        for work in works:
            work.wait()
    elif r == 1:
        late, early = (comm.recv(torch.empty(4, 6, dtype=torch.float64), 0, tag=t) for t in (9, 5))
        assert torch.equal(late, _x(109)) and torch.equal(early, _x(105))
    comm.barrier()


def _check_layout_and_megatron_mlp(mesh: Mesh) -> None:
    full = _x(99, (4, 8))
    for placements in ([Shard(0), Shard(1)], [Shard(1), Shard(1)], [Partial(), Shard(0)]):
        chunk = local_chunk(full, placements, mesh.shape, mesh.coord)
        torch.testing.assert_close(gather_full(chunk, placements, mesh), full)
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(6, 8).double(), nn.Linear(8, 6).double()
    x_ref, x = _x(7, (3, 6)).requires_grad_(), _x(7, (3, 6)).requires_grad_()
    reference = fc2(torch.relu(fc1(x_ref)))
    reference.sum().backward()
    a, b = copy.deepcopy(fc1), copy.deepcopy(fc2)
    a.zero_grad(set_to_none=True)
    column, row = LocalShard("tp", dim=0).bind(mesh), LocalShard("tp", dim=1).bind(mesh)
    h = torch.relu(GradAllReduce("tp").bind(mesh)(x) @ column(a.weight).T + column(a.bias))
    y = AllReduce("tp").bind(mesh)(h @ row(b.weight).T) + b.bias
    y.sum().backward()
    torch.testing.assert_close(y, reference)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(a.weight.grad, fc1.weight.grad)


def _collectives_world(rank: int, world_size: int) -> dict:
    mesh = Mesh.from_environment(("dp", "tp"), (2, 2), timeout=30.0)
    assert mesh.coord == (rank // 2, rank % 2) and mesh.world_size == world_size
    timeline = Timeline(rank=rank)
    mesh.set_timeline(timeline)
    for axis in mesh.axes:
        comm = mesh.comm(axis)
        assert isinstance(comm, ProcessGroupComm)
        _check_group_collectives(comm)
        _check_async(comm)
        _check_uneven_all_to_all_and_p2p(comm)
    _check_layout_and_megatron_mlp(mesh)
    return {
        "groups": {a: mesh.comm(a).group_ranks for a in mesh.axes},
        "all_reduce_bytes": mesh.comm("tp").stats.bytes["all-reduce"],
        "comm_spans": sum(s.category in ("comm", "comm-sync") for s in timeline.spans),
    }


def test_process_group_comm_on_a_2x2_gloo_mesh():
    results = run_world(_collectives_world, 4, timeout=60.0)
    assert [r["groups"] for r in results] == [
        {"dp": (0, 2), "tp": (0, 1)},
        {"dp": (1, 3), "tp": (0, 1)},
        {"dp": (0, 2), "tp": (2, 3)},
        {"dp": (1, 3), "tp": (2, 3)},
    ]
    # 3 explicit all-reduces of 4x6 float64 (sum, max, async) + 2 from the MLP (f backward, g forward)
    assert results[0]["all_reduce_bytes"] == 3 * 4 * 6 * 8 + 2 * 3 * 6 * 8
    assert all(r["comm_spans"] > 20 for r in results)


def _reducer_world(rank: int, world_size: int) -> dict:
    mesh = Mesh.from_environment(("dp", "tp"), (2, 2), timeout=30.0)
    params = {k: nn.Parameter(torch.ones(64, dtype=torch.float64)) for k in ["a", "b", "c", "both"]}
    axes = {"a": ("dp",), "b": ("dp",), "c": ("dp",), "both": ("dp", "tp")}
    reducer = GradReducer([(k, p, axes[k]) for k, p in params.items()], mesh, bucket_bytes=64 * 8)
    scale = float(rank + 1)
    loss = sum((scale * p).sum() for p in params.values())
    loss.backward()
    launched_in_backward = reducer.launched_during_backward
    reducer.finish()
    return {"launched": launched_in_backward, "grads": {k: p.grad[0].item() for k, p in params.items()}}


def test_grad_reducer_on_gloo():
    results = run_world(_reducer_world, 4, timeout=60.0)
    for rank, result in enumerate(results):
        dp_sum = float(sum(r + 1 for r in range(4) if r % 2 == rank % 2))
        assert result["grads"] == {"a": dp_sum, "b": dp_sum, "c": dp_sum, "both": 10.0}
        assert result["launched"] == 4  # all four buckets overlapped backward


def _dead_peer_world(rank: int, world_size: int, exit_rank: int):
    mesh = Mesh.from_environment(("dp",), (world_size,), timeout=5.0)
    mesh.comm("dp").barrier()  # everyone is connected
    if rank == exit_rank:
        os._exit(1)
    start = time.monotonic()
    try:
        mesh.comm("dp").all_reduce(torch.ones(4))
    except CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_a_dead_rank_makes_its_peers_fail_fast_with_a_clear_error():
    start = time.monotonic()
    results = run_world(_dead_peer_world, 2, 1, timeout=30.0, may_die={1})
    assert time.monotonic() - start < 20.0
    kind, message, elapsed = results[0]
    assert kind in ("CollectiveError", "CollectiveTimeout") and elapsed < 15.0
    for part in [
        "rank 0: all-reduce over mesh axis 'dp'",
        "group ranks (0, 1)",
        "timeout 5s",
        "other ranks' logs",
    ]:
        assert part in message, message


def _silent_peer_world(rank: int, world_size: int):
    mesh = Mesh.from_environment(("dp",), (world_size,), timeout=1.0)
    mesh.comm("dp").barrier()
    if rank == 1:
        time.sleep(3.0)  # alive (no connection error), but never issues the collective
        return None
    start = time.monotonic()
    try:
        mesh.comm("dp").all_reduce(torch.ones(4))
    except CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", 0.0


def test_a_silent_peer_makes_the_collective_time_out():
    kind, message, elapsed = run_world(_silent_peer_world, 2, timeout=30.0)[0]
    assert kind == "CollectiveTimeout" and elapsed < 2.5, message
    assert "raise timeout=SECONDS in the plan" in message


def test_launch_local_is_its_own_torchrun():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert launch_local(_launched, 2, 5.0, timeout=60.0) == [(0, 10.0), (1, 10.0)]
    # torch's launcher sets handlers of its own in the caller; Ctrl-C must stay a KeyboardInterrupt
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _launched(value: float):
    mesh = Mesh.from_environment(("dp", "tp"), (2, 1), timeout=30.0)
    return mesh.rank, mesh.comm("dp").all_reduce(torch.tensor([value])).item()


def _one_rank_raises(rank: int, world_size: int):
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(30.0)  # would hang the suite if the harness waited for it


def test_harness_raises_the_first_failure_and_kills_the_rest():
    start = time.monotonic()
    with pytest.raises(WorldFailure, match=r"(?s)rank 1 failed.*ValueError: rank one is broken"):
        run_world(_one_rank_raises, 2, timeout=20.0)
    assert time.monotonic() - start < 10.0


def _preloaded(rank: int, world_size: int) -> list[str]:
    import sys

    return [m for m in ("warm_ranks", "torch._dynamo", "usc.api") if m not in sys.modules]


def test_ranks_start_with_the_tracer_already_imported():
    """Every rank forks from a server that imported torch.export and usc and ran one small lint
    (tests/distributed/warm_ranks.py). multiprocessing skips a preload module that fails to import
    without a word: this is what says so."""
    assert run_world(_preloaded, 2, timeout=60) == [[], []]


class _Work:
    """A torch Work stand-in whose future another thread completes."""

    def __init__(self):
        self.future = torch.futures.Future()

    def is_completed(self):
        return self.future.done()

    def get_future(self):
        return self.future

    def wait(self):
        self.future.wait()
        return True


def test_a_completing_collective_wakes_its_waiter_at_once(monkeypatch):
    """A CPU wait is woken by its collective's completion (the future's callback), not found by a
    look after a sleep: a sleep-poll that backs off to its 10 ms slice noticed a wait of W up to half
    of W late, and every blocking collective of a step paid it. No sleep is taken here, the wait
    returns once the work completes, and one that never completes still times out."""
    import threading

    from usc.runtime import comm

    monkeypatch.setattr(comm.time, "sleep", lambda s: pytest.fail(f"the wait slept {s} s to poll"))
    work = _Work()
    threading.Timer(0.05, lambda: work.future.set_result(None)).start()
    start = time.monotonic()
    comm.wait_in_slices(work, timeout=30.0)
    assert work.is_completed() and 0.04 < time.monotonic() - start < 20.0
    with pytest.raises(TimeoutError, match="no completion within 0.05s"):
        comm.wait_in_slices(_Work(), timeout=0.05)
    failed = _Work()
    threading.Timer(0.02, lambda: failed.future.set_exception(RuntimeError("peer closed"))).start()
    with pytest.raises(RuntimeError, match="peer closed"):
        comm.wait_in_slices(failed, timeout=30.0)
