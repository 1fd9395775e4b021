"""ThreadComm collectives equal a reference computed from every rank's full input."""

import pytest
import torch
from usc.runtime.comm import CommStats, solo_comm
from usc.runtime.errors import CollectiveError
from usc.runtime.mesh import run_in_threads, simulated_meshes

SIZES = [1, 2, 4]


def _input(rank: int, shape=(4, 8)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(rank))


def _run(size: int, fn):
    """fn(comm, rank) on every rank of a 1-axis simulated mesh of `size` ranks."""
    meshes = simulated_meshes(("x",), (size,), timeout=10.0)
    return run_in_threads(meshes, lambda m: fn(m.comm("x"), m.rank), timeout=20.0)


@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_sum_is_rank_order_sum_bitwise_on_every_rank(size):
    results = _run(size, lambda c, r: c.all_reduce(_input(r)))
    expected = _input(0)
    for r in range(1, size):
        expected = expected + _input(r)
    for got in results:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_max(size):
    results = _run(size, lambda c, r: c.all_reduce(_input(r), op="max"))
    expected = torch.stack([_input(r) for r in range(size)]).amax(0)
    assert all(torch.equal(got, expected) for got in results)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_concatenates_in_rank_order(size, dim):
    results = _run(size, lambda c, r: c.all_gather(_input(r), dim))
    expected = torch.cat([_input(r) for r in range(size)], dim=dim)
    assert all(torch.equal(got, expected) for got in results)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_is_this_ranks_chunk_of_the_sum(size, dim):
    results = _run(size, lambda c, r: c.reduce_scatter(_input(r), dim))
    total = sum(_input(r) for r in range(size))
    for r, got in enumerate(results):
        torch.testing.assert_close(got, total.chunk(size, dim)[r])


@pytest.mark.parametrize("size", SIZES)
def test_all_to_all_even(size):
    results = _run(size, lambda c, r: c.all_to_all(_input(r), split_dim=1, cat_dim=0))
    for r, got in enumerate(results):
        expected = torch.cat([_input(src).chunk(size, 1)[r] for src in range(size)], dim=0)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("size", SIZES)
def test_all_to_all_single_uneven(size):
    # rank r sends (r + j + 1) rows to rank j
    def splits_in(r):
        return [r + j + 1 for j in range(size)]

    def exchange(comm, r):
        t = _input(r, (sum(splits_in(r)), 3))
        out_splits = [splits_in(src)[r] for src in range(size)]
        return comm.all_to_all_single(t, out_splits, splits_in(r))

    results = _run(size, exchange)
    for r, got in enumerate(results):
        pieces = [_input(src, (sum(splits_in(src)), 3)).split(splits_in(src))[r] for src in range(size)]
        assert torch.equal(got, torch.cat(pieces))


@pytest.mark.parametrize("size", [2, 4])
def test_send_recv_ring_and_barrier(size):
    def ring(comm, r):
        comm.send(_input(r), (r + 1) % size)
        got = comm.recv(torch.empty(4, 8), (r - 1) % size)
        comm.barrier()
        return got

    results = _run(size, ring)
    for r, got in enumerate(results):
        assert torch.equal(got, _input((r - 1) % size))


def test_tagged_messages_match_by_tag_not_by_order():
    """A pipeline with v>1 sends two same-shaped messages to one peer; the receiver asks in the
    other order. Each recv gets the message of its tag."""
    def swap(comm, r):
        if r == 0:
            comm.send(_input(10), 1, tag=7)
            comm.send(_input(11), 1, tag=3)
            return None
        return comm.recv(torch.empty(4, 8), 0, tag=3), comm.recv(torch.empty(4, 8), 0, tag=7)

    first, second = _run(2, swap)[1]
    assert torch.equal(first, _input(11)) and torch.equal(second, _input(10))


def test_bad_tag_is_refused():
    with pytest.raises(ValueError, match="tag"):
        solo_comm("pp", 0, 1.0).send(torch.ones(1), 0, tag=-1)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_async_variants_return_work_and_valid_tensor(kind):
    def launch(comm, r):
        args = (_input(r),) if kind == "all_reduce" else (_input(r), 0)
        out, work = getattr(comm, kind)(*args, async_op=True)
        work.wait()
        assert work.is_completed()
        sync = getattr(comm, kind)(*args)
        return torch.equal(out, sync)

    assert all(_run(2, launch))


def test_inputs_are_never_modified():
    def run_all(comm, r):
        x = _input(r)
        before = x.clone()
        comm.all_reduce(x)
        comm.all_gather(x, 0)
        comm.reduce_scatter(x, 0)
        comm.all_to_all(x, 0, 1)
        return torch.equal(x, before)

    assert all(_run(2, run_all))


def test_stats_count_calls_and_payload_bytes():
    def run_some(comm, r):
        comm.all_reduce(torch.zeros(10))  # 40 bytes
        comm.all_gather(torch.zeros(4, 2), 0)  # 32 bytes
        comm.all_gather(torch.zeros(4, 2), 1)
        return comm.stats

    stats = _run(2, run_some)[0]
    assert isinstance(stats, CommStats)
    assert stats.calls == {"all-reduce": 1, "all-gather": 2}
    assert stats.bytes == {"all-reduce": 40, "all-gather": 64}
    assert stats.total_bytes == 104
    assert _run(1, run_some)[0].total_bytes == 0  # a group of one moves nothing


def test_ranks_on_different_code_paths_get_a_clear_error():
    def diverge(comm, r):
        return comm.all_reduce(torch.ones(2)) if r == 0 else comm.all_gather(torch.ones(2), 0)

    with pytest.raises(CollectiveError, match="different code paths") as info:
        _run(2, diverge)
    assert "all-reduce" in str(info.value) and "all-gather" in str(info.value)


def test_mismatched_shapes_name_every_ranks_shape():
    with pytest.raises(CollectiveError, match=r"different shapes.*\(2,\).*\(3,\)"):
        _run(2, lambda c, r: c.all_reduce(torch.ones(2 + r)))


def test_indivisible_reduce_scatter_is_a_value_error():
    with pytest.raises(ValueError, match="not divisible by the group size 2"):
        _run(2, lambda c, r: c.reduce_scatter(torch.ones(3), 0))
