"""Local ops for vocabulary parallelism (Megatron-LM): each rank owns a contiguous vocab slice.

They are graph nodes like the collectives (``call_module`` targets bound to a mesh), but move no
data: the reduction that completes them is a separate ``AllReduce`` node the compiler inserts,
so usc-lint shows it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Bound(nn.Module):
    kind = "none"
    nobody: torch.Tensor | None = None  # the last call saw an index outside every rank's slice

    def __init__(self, axis: str) -> None:
        super().__init__()
        self.axis = axis
        self._mesh = None

    def bind(self, mesh) -> None:
        self._mesh = mesh

    def _offset(self, local_size: int) -> int:
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__} on axis '{self.axis}' used before bind(mesh)")
        return self._mesh.coord_of(self.axis) * local_size

    def _kept(self, local: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
        """1 where this rank holds the index, else 0, and NaN everywhere when some index is outside
        the whole axis (every rank's slice): that index is no rank's, and would silently read zeros.
        The NaN reaches the loss, whose verdict every rank shares (a NonFiniteLoss, no step), with
        no host sync here. A batch on the CPU never gets this far (runtime/input_checks.py)."""
        inside = (local >= 0) & (local < size)
        n = self._mesh.size(self.axis)
        offset = self._offset(size)
        nobody = ((local + offset < 0) | (local + offset >= size * n)).any()
        self.nobody = nobody  # read only once a step failed, to say why (RankExecutor._check_finite)
        return inside.to(dtype) + torch.where(nobody, float("nan"), 0.0).to(dtype)

    def forward_collective(self) -> None:
        return None

    def backward_collective(self) -> None:
        return None

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}"


class VocabParallelEmbedding(_Bound):
    """embedding(weight_slice, ids) where this rank holds rows [offset, offset + V/n) of the table.

    Ids outside the slice give zero rows, so the sum over ranks (Partial(sum)) is the full lookup.
    """

    def __init__(self, axis: str, padding_idx: int = -1) -> None:
        super().__init__(axis)
        self.padding_idx = padding_idx

    @staticmethod
    def global_fn(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.embedding.default(weight, ids)

    def forward(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = weight.shape[0]
        offset = self._offset(rows)
        local = ids - offset
        inside = (local >= 0) & (local < rows)
        pad = self.padding_idx - offset if 0 <= self.padding_idx - offset < rows else None
        out = F.embedding(torch.where(inside, local, 0), weight, padding_idx=pad)
        return out * self._kept(local, rows, out.dtype).unsqueeze(-1)


class ShardedGather(_Bound):
    """gather(x, dim, index) with x sharded on ``dim``: the owner of each index contributes it,
    others contribute zero (Partial(sum)). Used for the target logit of vocab-parallel cross-entropy."""

    def __init__(self, axis: str, dim: int) -> None:
        super().__init__(axis)
        self.dim = dim

    def global_fn(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gather.default(x, self.dim, index)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        size = x.shape[self.dim]
        local = index - self._offset(size)
        inside = (local >= 0) & (local < size)
        picked = torch.gather(x, self.dim, torch.where(inside, local, 0))
        return picked * self._kept(local, size, picked.dtype)

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, dim={self.dim}"


def saw_index_no_rank_holds(gm: nn.Module, to_host) -> bool:
    """Whether a vocabulary-parallel op of this rank's program met an index outside every rank's slice
    in its last call (``to_host``: the executor's host read; called only once a step failed)."""
    return any(m.nobody is not None and to_host(m.nobody.float(), assumed=0.0)
               for m in gm.modules() if isinstance(m, _Bound))
