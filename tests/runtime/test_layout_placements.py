"""Placements: local_chunk / assemble round-trip, shapes, and gather_full with collectives."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from usc.runtime.layout import assemble, gather_full, local_chunk, local_shape
from usc.runtime.mesh import run_in_threads, simulated_meshes

PLACEMENT = st.one_of(st.just(Replicate()), st.just(Partial()), st.builds(Shard, st.integers(0, 2)))


@st.composite
def sharded_case(draw):
    """A 2-d mesh, one placement per axis, and a global shape that divides evenly."""
    mesh_shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    ndim = draw(st.integers(1, 3))
    placements = [draw(PLACEMENT) for _ in mesh_shape]
    placements = [Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements]
    shape = []
    for d in range(ndim):
        divisor = math.prod(m for m, p in zip(mesh_shape, placements) if p == Shard(d))
        shape.append(divisor * draw(st.integers(1, 3)))
    return tuple(shape), placements, mesh_shape


def _coords(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


@settings(max_examples=60, deadline=None)
@given(sharded_case(), st.integers(0, 2**16))
def test_local_chunk_then_assemble_round_trips(case, seed):
    shape, placements, mesh_shape = case
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    chunks = {c: local_chunk(full, placements, mesh_shape, c) for c in _coords(mesh_shape)}
    for chunk in chunks.values():
        assert tuple(chunk.shape) == local_shape(shape, placements, mesh_shape)
    assert torch.equal(assemble(chunks, placements, mesh_shape), full)


def test_outer_axis_splits_first():
    rows = torch.arange(4.0).reshape(4, 1)
    placements = [Shard(0), Shard(0)]
    got = [local_chunk(rows, placements, (2, 2), c).item() for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert got == [0.0, 1.0, 2.0, 3.0]


def test_partial_keeps_value_on_coordinate_zero():
    x = torch.ones(2)
    assert torch.equal(local_chunk(x, [Partial()], (3,), (0,)), x)
    assert torch.equal(local_chunk(x, [Partial()], (3,), (2,)), torch.zeros(2))
    chunks = {(c,): torch.full((2,), float(c)) for c in range(3)}
    assert torch.equal(assemble(chunks, [Partial()], (3,)), torch.full((2,), 3.0))


def test_indivisible_dim_names_shape_axes_and_fix():
    with pytest.raises(ValueError, match=r"dim 1 of shape \(4, 6\) is not divisible by 4.*pad"):
        local_shape((4, 6), [Shard(1), Shard(1)], (2, 2))


def test_placement_count_must_match_mesh():
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        local_shape((4,), [Shard(0)], (2, 2))


def test_assemble_reports_missing_coordinates():
    with pytest.raises(ValueError, match=r"missing \[\(1,\)\]"):
        assemble({(0,): torch.ones(1)}, [Shard(0)], (2,))


@pytest.mark.parametrize(
    "placements",
    [
        [Shard(0), Shard(1)],
        [Shard(1), Shard(1)],
        [Replicate(), Shard(0)],
        [Partial(), Shard(1)],
        [Shard(0), Partial()],
        [Partial(), Partial()],
    ],
    ids=str,
)
def test_gather_full_with_collectives_matches_assemble(placements):
    full = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    meshes = simulated_meshes(("dp", "tp"), (2, 2), timeout=10.0)
    results = run_in_threads(
        meshes,
        lambda m: gather_full(local_chunk(full, placements, m.shape, m.coord), placements, m),
        timeout=20.0,
    )
    for got in results:
        torch.testing.assert_close(got, full)
