"""Mesh coordinates, groups and constructors (simulated; the torchrun path is in test_gloo_world)."""

import pytest
import torch
from usc.runtime.errors import LaunchError
from usc.runtime.mesh import Mesh, axis_groups, coord_of_rank, rank_of_coord, run_in_threads, simulated_meshes


def test_row_major_innermost_axis_on_neighbouring_ranks():
    assert [coord_of_rank(r, (2, 4)) for r in range(3)] == [(0, 0), (0, 1), (0, 2)]
    assert all(rank_of_coord(coord_of_rank(r, (2, 3, 2)), (2, 3, 2)) == r for r in range(12))
    assert axis_groups((2, 4), 1) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert axis_groups((2, 4), 0) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_simulated_mesh_views():
    meshes = simulated_meshes(("dp", "tp"), (2, 4), timeout=5.0)
    m = meshes[6]
    assert (m.rank, m.coord, m.world_size) == (6, (1, 2), 8)
    assert (m.size("tp"), m.coord_of("dp"), m.size("pp"), m.coord_of("pp")) == (4, 1, 1, 0)
    tp, dp = m.comm("tp"), m.comm("dp")
    assert (tp.size, tp.rank, tp.group_ranks) == (4, 2, (4, 5, 6, 7))
    assert (dp.size, dp.rank, dp.group_ranks) == (2, 1, (2, 6))
    assert m.describe() == "dp=2 tp=4"


def test_absent_and_size_one_axes_get_identity_comms():
    meshes = simulated_meshes(("dp", "pp", "tp"), (2, 1, 1), timeout=5.0)
    x = torch.arange(4.0)
    for axis in ("pp", "tp", "cp"):
        comm = meshes[1].comm(axis)
        assert (comm.size, comm.rank, comm.group_ranks) == (1, 0, (1,))
        assert torch.equal(comm.all_reduce(x), x) and torch.equal(comm.all_gather(x, 0), x)
        assert torch.equal(comm.reduce_scatter(x, 0), x)
        comm.barrier()


def test_every_rank_of_a_mesh_sees_its_own_groups():
    meshes = simulated_meshes(("dp", "cp", "tp"), (2, 2, 2), timeout=5.0)
    sums = run_in_threads(
        meshes,
        lambda m: [m.comm(a).all_reduce(torch.tensor([float(m.rank)])).item() for a in m.axes],
        timeout=10.0,
    )
    assert sums[0] == [0 + 4, 0 + 2, 0 + 1]
    assert sums[7] == [3 + 7, 5 + 7, 6 + 7]


def test_invalid_meshes_are_rejected():
    with pytest.raises(ValueError, match="different lengths"):
        simulated_meshes(("dp",), (2, 2), timeout=1.0)
    with pytest.raises(ValueError, match="distinct"):
        simulated_meshes(("dp", "dp"), (2, 2), timeout=1.0)
    with pytest.raises(ValueError, match="positive"):
        simulated_meshes(("dp",), (0,), timeout=1.0)


def test_from_environment_outside_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LaunchError, match=r"needs 8 processes \(dp=2 tp=4\).*torchrun --nproc-per-node 8"):
        Mesh.from_environment(("dp", "tp"), (2, 4), timeout=5.0)


def test_from_environment_with_wrong_world_size_says_what_launch_is_needed(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(LaunchError, match=r"needs 8 processes \(dp=2 tp=4\) but torchrun started 4"):
        Mesh.from_environment(("dp", "tp"), (2, 4), timeout=5.0)
