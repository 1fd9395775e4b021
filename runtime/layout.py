"""How a global tensor is laid out on the mesh: pure functions on DTensor-style placements.

`placements` has one entry per mesh axis, outermost axis first (PyTorch's Replicate, Shard(dim),
Partial()). When several axes shard the same tensor dim the outer axis splits first: the chunk
index along that dim is row-major over those axes' coordinates. E.g. mesh (dp=2, tp=2) with
(Shard(0), Shard(0)) puts rows in the order (dp0,tp0), (dp0,tp1), (dp1,tp0), (dp1,tp1).

A Partial axis means the global value is the SUM of the local tensors along that axis.
`local_chunk` realises that by keeping the full value on coordinate 0 of the axis and zeros
elsewhere (any split that sums correctly would do; this one is exact in floating point).

Example::

    p = (Replicate(), Shard(1))
    chunks = {c: local_chunk(x, p, (2, 2), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert torch.equal(assemble(chunks, p, (2, 2)), x)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

if TYPE_CHECKING:
    from .mesh import Mesh


def _check_placements(placements: Sequence[Placement], mesh_shape: Sequence[int], ndim: int) -> None:
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"need one placement per mesh axis: {len(mesh_shape)} axes {tuple(mesh_shape)}, "
            f"got {len(placements)} placements {tuple(placements)}"
        )
    for p in placements:
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            raise ValueError(f"{p} does not exist on a {ndim}-d tensor (placements {tuple(placements)})")
        if isinstance(p, Partial) and p.reduce_op != "sum":
            raise ValueError(f"only Partial(sum) is supported, got {p}")
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise TypeError(f"unknown placement {p!r}; use Replicate(), Shard(dim) or Partial()")


def _sharding_axes(placements: Sequence[Placement], ndim: int) -> dict[int, list[int]]:
    """Tensor dim -> mesh axes (outermost first) that shard it."""
    by_dim: dict[int, list[int]] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            by_dim.setdefault(p.dim % ndim, []).append(axis)
    return by_dim


def _chunk_index(axes: list[int], mesh_shape: Sequence[int], coord: Sequence[int]) -> tuple[int, int]:
    """(index, count) of this coordinate's chunk: row-major over the sharding axes."""
    index, count = 0, 1
    for axis in axes:
        index = index * mesh_shape[axis] + coord[axis]
        count *= mesh_shape[axis]
    return index, count


def local_shape(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Shape of each rank's local tensor; ValueError if a sharded dim does not divide evenly."""
    shape = list(global_shape)
    _check_placements(placements, mesh_shape, len(shape))
    for dim, axes in _sharding_axes(placements, len(shape)).items():
        count = _chunk_index(axes, mesh_shape, [0] * len(mesh_shape))[1]
        if shape[dim] % count:
            raise ValueError(
                f"dim {dim} of shape {tuple(global_shape)} is not divisible by {count} = the product "
                f"of the mesh axes {axes} sharding it (placements {tuple(placements)}, mesh "
                f"{tuple(mesh_shape)}); pad the dim or pick sizes that divide it"
            )
        shape[dim] //= count
    return tuple(shape)


def _region(
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
) -> tuple[slice, ...]:
    """The slice of the global tensor that the rank at `coord` holds."""
    sizes = local_shape(global_shape, placements, mesh_shape)
    region = [slice(None)] * len(global_shape)
    for dim, axes in _sharding_axes(placements, len(global_shape)).items():
        index = _chunk_index(axes, mesh_shape, coord)[0]
        region[dim] = slice(index * sizes[dim], (index + 1) * sizes[dim])
    return tuple(region)


def local_box(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the region of the global tensor the rank at `coord` holds."""
    sizes = local_shape(global_shape, placements, mesh_shape)
    region = _region(global_shape, placements, mesh_shape, coord)
    return tuple(r.start or 0 for r in region), sizes


def _on_partial_origin(placements: Sequence[Placement], coord: Sequence[int]) -> bool:
    """True if this coordinate is 0 on every Partial axis (it carries the value)."""
    return all(c == 0 for p, c in zip(placements, coord) if isinstance(p, Partial))


def local_chunk(
    t: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int]
) -> torch.Tensor:
    """This rank's local tensor of the full tensor `t` (a new contiguous tensor).

    Shard axes slice, Replicate axes keep everything, Partial axes keep the value on coordinate 0
    and zeros elsewhere (see the module docstring).
    """
    piece = t[_region(t.shape, placements, mesh_shape, coord)]
    if not _on_partial_origin(placements, coord):
        return torch.zeros_like(piece, memory_format=torch.contiguous_format)
    return piece.clone(memory_format=torch.contiguous_format)


def assemble(
    chunks: Mapping[tuple[int, ...], torch.Tensor], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> torch.Tensor:
    """The full tensor from every coordinate's local tensor (inverse of local_chunk).

    Shard axes are concatenated, Replicate axes read from coordinate 0, Partial axes summed (in
    row-major coordinate order, so the result is deterministic).
    """
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    missing = [c for c in coords if c not in chunks]
    if missing:
        raise ValueError(f"assemble needs a chunk for every mesh coordinate; missing {missing[:4]}")
    sample = chunks[coords[0]]
    _check_placements(placements, mesh_shape, sample.dim())
    full_shape = _global_shape(sample.shape, placements, mesh_shape)
    full = sample.new_zeros(full_shape)
    for coord in coords:
        if all(c == 0 for p, c in zip(placements, coord) if isinstance(p, Replicate)):
            full[_region(full_shape, placements, mesh_shape, coord)] += chunks[coord]
    return full


def _global_shape(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    full = list(shape)
    for dim, axes in _sharding_axes(placements, len(full)).items():
        full[dim] *= _chunk_index(axes, mesh_shape, [0] * len(mesh_shape))[1]
    return tuple(full)


def gather_full(t: torch.Tensor, placements: Sequence[Placement], mesh: Mesh) -> torch.Tensor:
    """The full tensor on every rank, with collectives (for full_state_dict under torchrun).

    Partial axes are all-reduced first (on the smaller local tensor); sharded axes are then
    all-gathered innermost first, which is what makes the outer-axis-splits-first order come out
    right: the inner gather builds each outer chunk, the outer gather concatenates them.
    A fully replicated `t` is returned as is (no copy).
    """
    _check_placements(placements, mesh.shape, t.dim())
    for axis, p in zip(mesh.axes, placements):
        if isinstance(p, Partial):
            t = mesh.comm(axis).all_reduce(t, "sum")
    for axis, p in reversed(list(zip(mesh.axes, placements))):
        if isinstance(p, Shard):
            t = mesh.comm(axis).all_gather(t, p.dim % t.dim())
    return t


def zigzag_index(length: int, n: int, device=None) -> torch.Tensor:
    """Global positions in zigzag order: the sequence cut in 2n chunks, rank r's contiguous piece
    of the permuted tensor holding chunks r and 2n-1-r (balanced causal attention work)."""
    if length % (2 * n):
        raise ValueError(f"zigzag needs the sequence length ({length}) to divide by 2 x {n}")
    chunk = length // (2 * n)
    order = [c for r in range(n) for c in (r, 2 * n - 1 - r)]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in order])


def zigzag_permute(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """Global order -> zigzag order along dim (then a contiguous chunk is a rank's zigzag piece)."""
    return t.index_select(dim, zigzag_index(t.shape[dim], n, t.device))


def zigzag_unpermute(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """Zigzag order -> global order along dim."""
    return t.index_select(dim, torch.argsort(zigzag_index(t.shape[dim], n, t.device)))
