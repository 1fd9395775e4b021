"""The replica guard: peers that hold copies of one tensor must hold the same numbers.

A dp replica of a weight, a LayerNorm weight replicated over tp, a buffer every rank keeps: each
is updated on every rank independently, from values that are supposed to be identical. A bug
that breaks that (an activation that differs between tp ranks — dropout drawn per rank — a
gradient reduced over the wrong group, a write that reached one rank only) shows up first as
replicas that drift apart, long before the loss looks wrong. With ``replica_check=N`` in the plan
the executor compares, every N steps, a fingerprint of each such tensor across its peers and
raises ``ReplicaDiverged`` naming the first tensor (program order) that differs and the ranks.

Cost: two float64 sums per tensor and one all-gather of the fingerprints per mesh axis (plus one
small all-reduce per axis so that every rank stops together, also on other pipeline stages).
Replicas are updated by the same ops on the same values, so they agree bitwise: the fingerprints
are compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import Replicate

from .mesh import rank_of_coord


class ReplicaDiverged(RuntimeError):
    """Copies of a tensor that must be identical across peers differ."""


@dataclass(frozen=True)
class Watched:
    name: str  # state_dict name
    placeholder: str
    axes: tuple[str, ...]  # mesh axes over which this rank's tensor has identical copies
    index: int  # in program.state


@dataclass(frozen=True)
class Finding:
    index: int  # in program.state
    axis: int  # mesh axis index
    ranks: tuple[int, ...]  # the first peer, then those that differ from it
    text: str


def replicated_axes(spec, mesh_axes: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    """The axes over which every peer holds the same local tensor of a state entry. Not pp (each
    pipeline rank holds its own stages), not dp for a ZeRO-3 slice (each dp rank holds its own)."""
    return tuple(a for a, p in zip(mesh_axes, spec.layout.placements)
                 if isinstance(p, Replicate) and sizes[a] > 1 and a != "pp" and not (spec.zero3 and a == "dp"))


def fingerprint(t: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[sum, position-weighted sum] in float64: equal copies give equal numbers; a change to one
    element, or two elements swapped, changes them. A complex element (a RoPE table's) counts as
    the sum of its real and imaginary parts (a plain cast would drop the imaginary part, with a warning)."""
    flat = t.detach().reshape(-1)
    flat = (torch.view_as_real(flat).sum(-1) if flat.is_complex() else flat).to(torch.float64)
    if weights is None:
        weights = position_weights(flat.numel(), flat.device)
    return torch.stack([flat.sum(), torch.dot(flat, weights)])


def position_weights(n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64, device=device).remainder_(13).add_(1)


class ReplicaGuard:
    """Compares the fingerprints of one rank's replicated state with its peers' every ``every`` steps."""

    def __init__(self, program, mesh, state: dict[str, torch.Tensor], every: int,
                 agreed_dtype: Callable[[str], torch.dtype | None] = lambda placeholder: None) -> None:
        """``agreed_dtype(placeholder)``: the dtype in which a tensor's copies agree where they do not
        agree exactly (ZeRO's compute-dtype gather: a rank's own slice keeps its float32 values)."""
        self.mesh, self.state, self.every, self.agreed_dtype = mesh, state, every, agreed_dtype
        sizes = {a: mesh.size(a) for a in mesh.axes}
        self._cache: dict[tuple, torch.Tensor] = {}  # position weights by (numel, device)
        self.names = [s.name for s in program.state]
        self.watched = [Watched(s.name, s.placeholder, replicated_axes(s, tuple(mesh.axes), sizes), i)
                        for i, s in enumerate(program.state)
                        if s.kind in ("param", "buffer") and s.placeholder in state]

    def after_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.check(step)

    def check(self, step: int) -> None:
        """Every rank of the mesh calls it (collectives over every axis); all raise, or none."""
        findings = [self._check_axis(axis) for axis in self.mesh.axes if self.mesh.size(axis) > 1]
        found = next((f for f in findings if f is not None), None)
        # what diverged and where, on every rank: ranks of other pipeline stages and groups stop too
        index = self._everywhere(torch.tensor([found.index + 1.0 if found else 0.0], dtype=torch.float64))
        if not int(index):
            return
        mine = found is not None and found.index + 1 == int(index)
        where = self._everywhere(torch.tensor([float(found.axis), *found.ranks[:2]], dtype=torch.float64)
                                 if mine else torch.zeros(3, dtype=torch.float64))
        if found:
            raise ReplicaDiverged(f"after step {step}: {found.text}\n  fix: {_FIX}")
        axis, first, other = (int(v) for v in where)
        raise ReplicaDiverged(f"after step {step}: '{self.names[int(index) - 1]}' differs between its copies on mesh "
                              f"axis '{self.mesh.axes[axis]}': rank {first} holds another value than rank {other} "
                              f"(rank {self.mesh.rank} stops with them)\n  fix: {_FIX}")

    def _agreed(self, placeholder: str) -> torch.Tensor:
        value, dtype = self.state[placeholder], self.agreed_dtype(placeholder)
        return value if dtype is None else value.detach().to(dtype)

    def _everywhere(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise max of ``t`` over the whole mesh."""
        t = t.to(self.mesh.device)  # NCCL reduces device tensors only
        for axis in self.mesh.axes:
            if self.mesh.size(axis) > 1:
                t = self.mesh.comm(axis).all_reduce(t, "max")
        return t

    def _check_axis(self, axis: str) -> Finding | None:
        mine = [w for w in self.watched if axis in w.axes]
        if not mine:  # peers on one axis hold the same stages and layouts: they all skip
            return None
        prints = torch.stack([fingerprint(self._agreed(w.placeholder), self._weights(self.state[w.placeholder]))
                              for w in mine])
        table = self.mesh.comm(axis).all_gather(prints.reshape(1, -1), 0)  # (peers, 2 * tensors)
        for i, watched in enumerate(mine):
            column = table[:, 2 * i: 2 * i + 2]
            differs = [p for p in range(column.shape[0]) if not torch.equal(column[p], column[0])]
            if differs:
                ranks = [self._peer_rank(axis, p) for p in [0, *differs]]
                return Finding(watched.index, list(self.mesh.axes).index(axis), tuple(ranks),
                               _message(watched.name, axis, ranks, column[0], column[differs[0]]))
        return None

    def _weights(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.numel(), t.device)
        if key not in self._cache:
            self._cache[key] = position_weights(t.numel(), t.device)
        return self._cache[key]

    def _peer_rank(self, axis: str, index: int) -> int:
        coord = list(self.mesh.coord)
        coord[list(self.mesh.axes).index(axis)] = index
        return rank_of_coord(coord, self.mesh.shape)


def _message(name: str, axis: str, ranks: list[int], first: torch.Tensor, other: torch.Tensor) -> str:
    others = ", ".join(str(r) for r in ranks[1:])
    return (f"'{name}' differs between its copies on mesh axis '{axis}': rank {ranks[0]} holds another value "
            f"than rank{'s' if len(ranks) > 2 else ''} {others} (fingerprints {first.tolist()} vs {other.tolist()})")


_FIX = ("something gives these peers different values where they must agree (a random op drawn per "
        "rank, a write that reached one rank, a gradient reduced over the wrong group); replica_check=1 "
        "finds the first step it happens, and the plan axis named is where to look")

__all__ = ["ReplicaGuard", "ReplicaDiverged", "fingerprint", "replicated_axes"]
