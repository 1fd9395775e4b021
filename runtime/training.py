"""The parts of a training step the user reaches: exact global-norm gradient clipping and named
optimizer parameters.

Clipping (Pascanu et al. 2013, "On the difficulty of training recurrent neural networks"; the
form of ``torch.nn.utils.clip_grad_norm_``): every gradient is scaled by
``min(1, max_norm / (norm + 1e-6))`` where ``norm`` is the L2 norm of the whole model's gradient
as one device would compute it. On a mesh a rank holds pieces of that gradient, some of them
copies of another rank's piece, so each piece is counted once:

- a tensor replicated over an axis (tp-replicated norms, dp replicas without ZeRO-3, every
  non-expert weight over ep) is counted on coordinate 0 of that axis only;
- a tensor sharded over an axis (tp slices, ep experts, ZeRO-3 and ZeRO-2 slices over dp) is
  counted on every coordinate: the pieces are disjoint;
- under pp a weight counts on the rank that owns it (tied embedding / lm head: the first stage
  using it), after its stages' gradients were summed.

The squared sums then travel once over every mesh axis (one float64 all-reduce per axis), so every
rank holds the same norm and applies the same scale. Squares are summed in float64: the norm is
the reference's within float32 rounding of the gradients themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from .random import draw as _registers_the_draw_op  # noqa: F401 - torch.ops.usc.draw exists from here on
from .random import shard_block

DRAW = torch.ops.usc.draw.default

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing
CLIP_EPSILON = 1e-6


class NamedParameters(list):
    """The parameters an optimizer factory receives, with the model names each one holds.

    A plain ``factory(params)`` sees a list of parameters; a factory that groups by name
    (``usc.training.param_groups``) reads ``names[i]``: the state_dict names the i-th parameter
    holds (one name, or every name of a ZeRO bucket's flat slice)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], names: Sequence[tuple[str, ...]]) -> None:
        super().__init__(params)
        self.names = [tuple(n) for n in names]
        if len(self.names) != len(self):
            raise ValueError(f"{len(self)} parameters but {len(self.names)} name entries")


class GroupedOptimizer:
    """An optimizer factory that splits parameters into groups by name (``group_of(name)``).

    The executor keeps each group in its own gradient buckets so a ZeRO slice never mixes two
    groups (weight decay is per group; a flat slice has one group)."""

    def group_of(self, name: str) -> int:
        raise NotImplementedError

    def __call__(self, params: NamedParameters) -> torch.optim.Optimizer:
        raise NotImplementedError


def bucket_groups(factory, state_specs) -> Callable[[str], int] | None:
    """The optimizer group of each state entry (by ``spec.name``) when ``factory`` groups by name,
    else None: the gradient reducer keeps each group in its own buckets, and the compile report packs
    them the same way. A tied weight is grouped by the name named_parameters() gives it."""
    if not isinstance(factory, GroupedOptimizer):
        return None
    canonical = {s.name: s.aliases[0] if s.aliases else s.name for s in state_specs}
    return lambda name: factory.group_of(canonical[name])


@dataclass(frozen=True)
class GradPiece:
    """A gradient tensor this rank holds; ``counted``: its square enters this rank's sum."""

    grad: torch.Tensor
    counted: bool


def counted_once(placements, axes: Sequence[str], coord: Sequence[int], *, sharded: Iterable[str] = (),
                 skip: Iterable[str] = ()) -> bool:
    """Whether this coordinate counts a tensor laid out with ``placements``: coordinate 0 of every
    axis the tensor is replicated on (``sharded`` names axes sliced outside the layout: ZeRO's dp;
    ``skip`` axes decided elsewhere: pp ownership)."""
    free = set(sharded) | set(skip)
    return all(isinstance(p, Shard) or c == 0 for axis, p, c in zip(axes, placements, coord) if axis not in free)


def slice_pieces(flat: torch.Tensor, sizes: Sequence[int], rank: int, n: int) -> list[tuple[int, int, torch.Tensor]]:
    """(index, start, piece) of each tensor in a flat buffer (sizes in order, padded to n slices)
    that this rank's slice ``flat`` (slice ``rank`` of n) holds a part of: the piece holds that
    tensor's flattened elements [start, start + piece.numel())."""
    lo = rank * flat.numel()
    hi, offset, out = lo + flat.numel(), 0, []
    for index, size in enumerate(sizes):
        start, end = max(offset, lo), min(offset + size, hi)
        if start < end:
            out.append((index, start - offset, flat[start - lo: end - lo]))
        offset += size
    return out


def global_norm(pieces: Sequence[GradPiece], reduce_over: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                device: torch.device | None = None) -> float:
    """The L2 norm of the whole gradient: this rank's counted squares summed in float64, then
    summed over every axis by ``reduce_over`` (one all-reduce each)."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for piece in pieces:
        if piece.counted and piece.grad.numel():
            total += piece.grad.detach().double().pow(2).sum()
    for reduce in reduce_over:
        total = reduce(total)
    return float(total.sqrt())


def clip_(pieces: Sequence[GradPiece], norm: float, max_norm: float) -> float:
    """Scale every piece (counted or not: copies must stay copies) as clip_grad_norm_ does; returns
    the factor applied."""
    coef = max_norm / (norm + CLIP_EPSILON)
    if coef >= 1.0:
        return 1.0
    grads = [p.grad for p in pieces if p.grad.numel()]
    if grads:
        torch._foreach_mul_(grads, coef)  # one dispatch for every gradient
    return coef


def _eval_draw(func, key, shape, op, batch_dim, microbatches, dtype, distribution, a, b, shards=None):
    """Dropout is ``x * keep`` (passes/random_ops.py): in evaluation every element is kept, unscaled."""
    if distribution == "keep":
        return torch.ones(tuple(shard_block(shape, shards or ())[0]), dtype=dtype, device=key.device)
    return func(key, shape, op, batch_dim, microbatches, dtype, distribution, a, b, shards)


# Ops whose behaviour depends on the module mode, and their evaluation form.
_EVAL_FORMS = {DRAW: _eval_draw}


class EvalMode(torch.overrides.TorchFunctionMode):
    """Runs a traced training program as ``model.eval()`` would: dropout off (the mode stack is
    per thread, so every simulated rank enters its own)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        form = _EVAL_FORMS.get(func)
        if form is not None and not kwargs:
            return form(func, *args)
        return func(*args, **(kwargs or {}))


# The axes that split the batch: a DistributedSampler spans their ranks (ep is carved from dp).
DATA_AXES = ("dp", "ep")


def data_local(spec, mesh) -> tuple[tuple, tuple[int, ...]]:
    """(placements, shape) of an input a rank receives as its own data shard: the data axes'
    split of the batch dim already done (Replicate there), every other axis still to apply."""
    placements, rows = [], 1
    for axis, size, p in zip(mesh.axes, mesh.shape, spec.layout.placements):
        sharded = axis in DATA_AXES and isinstance(p, Shard) and p.dim == 0
        rows *= size if sharded else 1
        placements.append(Replicate() if sharded else p)
    shape = tuple(spec.global_shape)
    return tuple(placements), (shape[0] // rows,) + shape[1:] if shape else shape


def data_shard(spec, mesh, coord) -> tuple[int, int]:
    """(index, count) of the rank at ``coord`` among the data shards of an input's batch dim: the
    order in which the global batch's rows are dealt to ranks (outer axis first)."""
    index, count = 0, 1
    for axis, size, c, p in zip(mesh.axes, mesh.shape, coord, spec.layout.placements):
        if axis in DATA_AXES and isinstance(p, Shard) and p.dim == 0:
            index, count = index * size + c, count * size
    return index, count
