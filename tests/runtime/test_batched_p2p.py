"""Point-to-point as NCCL needs it: batches of sends and receives (batch_isend_irecv), no tags,
matched in post order; the same on gloo processes and in the simulator. And the device a mesh
owns: chosen before the process group, refused when absent."""

import pytest
import torch
from harness import run_world

from usc.runtime.comm import ProcessGroupComm
from usc.runtime.errors import LaunchError
from usc.runtime.mesh import Mesh, _select_device, run_in_threads, simulated_meshes

pytestmark = pytest.mark.distributed


def _x(rank: int, n: int, shape=(3, 5)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * rank + n), dtype=torch.float64)


def _ring_of_batches(comm, rank: int, size: int) -> list[bool]:
    """Each rank sends two messages to each neighbour and receives two from each, all four
    sends and four receives in ONE batch; then a second batch to check post-order matching."""
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    like = torch.empty(3, 5, dtype=torch.float64)
    ok = []
    for round_ in range(2):
        sends = [(_x(rank, 10 * round_ + n), peer) for n, peer in enumerate((nxt, nxt, prev, prev))]
        recvs = [(like, prev), (like, prev), (like, nxt), (like, nxt)]
        got, sent = comm.batch_p2p(sends, recvs)
        sent.wait()
        # from prev: its messages 0, 1 (to its next = me); from nxt: its messages 2, 3 (to its prev = me)
        want = [_x(prev, 10 * round_), _x(prev, 10 * round_ + 1), _x(nxt, 10 * round_ + 2), _x(nxt, 10 * round_ + 3)]
        ok += [torch.equal(g, w) for g, w in zip(got, want)]
    return ok


def _gloo_ring_world(rank: int, world_size: int) -> list[bool]:
    mesh = Mesh.from_environment(("pp",), (world_size,), timeout=30.0)
    assert mesh.device == torch.device("cpu") and isinstance(mesh.comm("pp"), ProcessGroupComm)
    return _ring_of_batches(mesh.comm("pp"), rank, world_size)


def test_batched_sends_and_receives_match_in_post_order_on_gloo():
    results = run_world(_gloo_ring_world, 3, timeout=90.0)
    assert all(all(ok) and len(ok) == 8 for ok in results), results


def test_batched_sends_and_receives_match_in_post_order_in_the_simulator():
    meshes = simulated_meshes(("pp",), (3,), timeout=30.0)
    results = run_in_threads(meshes, lambda m: _ring_of_batches(m.comm("pp"), m.rank, 3), timeout=30.0)
    assert all(all(ok) and len(ok) == 8 for ok in results), results


def test_batched_p2p_counts_the_bytes_it_moves():
    meshes = simulated_meshes(("pp",), (3,), timeout=30.0)
    run_in_threads(meshes, lambda m: _ring_of_batches(m.comm("pp"), m.rank, 3), timeout=30.0)
    stats = meshes[0].comm("pp").stats
    assert stats.calls["send/recv"] == 2
    assert stats.bytes["send/recv"] == 2 * 8 * 3 * 5 * 8  # two batches of 4 sends + 4 receives


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_before_any_group():
    with pytest.raises(LaunchError, match="CUDA is not available.*device='cpu'"):
        _select_device("cuda")


def test_the_cpu_is_chosen_without_cuda_and_odd_devices_are_refused():
    if not torch.cuda.is_available():
        assert _select_device(None) == torch.device("cpu")
    with pytest.raises(LaunchError, match="'cuda' \\(NCCL\\) or 'cpu' \\(gloo\\)"):
        _select_device("meta")
