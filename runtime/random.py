"""Counter-based random numbers: a draw is a function of (seed, step, op, global element index).

Why not torch's generator: its stream depends on how many numbers were drawn before, on which
device, in which order -- so two tensor-parallel ranks holding replicas of an activation draw
different dropout masks, and a shard cannot draw "its slice" of what one device would draw.
Here every element's value is a hash of its coordinates in the one-device tensor (as in JAX's
partitionable threefry bits, and Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"):
replicas draw identical values, shards draw their slice, a microbatch draws its rows of the full
batch's tensor, and drawing again gives the same numbers. The hash is Wellons' "lowbias32"
(three rounds per word), written with int64 torch ops on 32-bit values so CPU and CUDA agree bitwise;
the key is mixed on the device, so a draw never waits for the host.

``usc::draw`` is a custom op tagged ``nondeterministic_seeded``, so no generic sharding rule places it
(a shard would draw its own numbers) and local_draws gives each rank its block; recompute draws it
again from its key, which is made once per forward and kept. Its key comes from a :class:`RandomKey` node the executor sets
before each forward: (seed, step, microbatch).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads the word index j over the key (as in Weyl sequences)
DISTRIBUTIONS = ("uniform", "normal", "exponential", "keep", "bernoulli")
SIGNIFICAND_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}  # with the implicit leading bit


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values. A product wraps mod 2^64 in int64, which
    keeps its low 32 bits exact, so masking after each multiply is all the care needed."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _mix(x: int | torch.Tensor) -> int | torch.Tensor:
    """mix32 of one word: a Python int, or a 0-dim int64 tensor left on its device (no host sync)."""
    if isinstance(x, torch.Tensor):
        return mix32(x & MASK32)
    return int(mix32(torch.tensor(x & MASK32, dtype=torch.int64)))


def op_key(seed: int | torch.Tensor, step: int | torch.Tensor, op: int) -> int | torch.Tensor:
    """The 32-bit key of one op's draws in one step (a tensor when seed and step are: the
    executor's key stays on the device)."""
    k = _mix(op * GOLDEN + 1)
    k = _mix(k ^ (step & MASK32)) ^ _mix((step >> 32) + GOLDEN)
    return _mix(k ^ (seed & MASK32)) ^ _mix(((seed >> 32) & MASK32) + 2 * GOLDEN)


def words(index: torch.Tensor, key: int | torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` independent 32-bit words per element index (int64, below 2^63)."""
    lo, hi = index & MASK32, index >> 32
    out = []
    for j in range(count):
        k = _mix(key ^ ((j * GOLDEN) & MASK32))
        out.append(mix32((mix32(mix32(lo ^ k) ^ hi) + k) & MASK32))  # three rounds, keyed twice
    return out


def global_index(shape: Sequence[int], batch_dim: int | None, microbatch: int | torch.Tensor, microbatches: int,
                 device, *, local: Sequence[int] | None = None,
                 offset: Sequence[int | torch.Tensor] | None = None) -> torch.Tensor:
    """The flat index of every element in the one-device tensor. Under microbatching the program
    sees one microbatch's tensor; along its batch dim microbatch m holds rows m*n .. m*n + n - 1
    of the full batch's tensor (rows are split along dim 0 of the inputs, in order).
    ``local``/``offset``: only the block of ``shape`` (the microbatch's whole tensor) of that size
    starting at that offset per dim (a rank's shard); default the whole tensor."""
    full = list(shape)
    if batch_dim is not None:
        full[batch_dim] *= microbatches
    local = list(shape) if local is None else list(local)
    offset = [0] * len(shape) if offset is None else list(offset)
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        coord = torch.arange(local[dim], dtype=torch.int64, device=device) + offset[dim]
        if dim == batch_dim:
            coord = coord + microbatch * shape[dim]
        view = [1] * len(shape)
        view[dim] = local[dim]
        index = index + coord.view(view) * stride
        stride *= full[dim]
    return index.expand(tuple(local)) if len(shape) else index


def shard_block(shape: Sequence[int], shards: Sequence[int], coords: Sequence[int | torch.Tensor] = ()
                ) -> tuple[list[int], list[int | torch.Tensor]]:
    """(local shape, offset per dim) of the block a rank holds of a tensor of ``shape`` split by
    ``shards`` = (dim, parts, dim, parts, ...), in the order the splits apply (each a contiguous
    chunk of what the previous ones left), the rank's chunk of split i being ``coords[i]`` (0 for
    every split when ``coords`` is empty: the shape alone)."""
    local, offset = list(shape), [0] * len(shape)
    for i in range(0, len(shards), 2):
        dim, parts = shards[i], shards[i + 1]
        if local[dim] % parts:
            raise ValueError(f"a draw of shape {tuple(shape)} cannot split dim {dim} ({local[dim]}) into {parts}")
        local[dim] //= parts
        if coords:
            offset[dim] = offset[dim] + coords[i // 2] * local[dim]
    return local, offset


def uniform_from(ws: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [0, 1) with as many random bits as ``dtype`` holds (exact in it: never 1.0)."""
    if dtype == torch.float64:
        return ((ws[0] >> 5).double() * 2.0**26 + (ws[1] >> 6).double()) * 2.0**-53
    bits = SIGNIFICAND_BITS[dtype]
    return ((ws[0] >> (32 - bits)).double() * 2.0**-bits).to(dtype)


def draw_values(index: torch.Tensor, key: int | torch.Tensor, dtype: torch.dtype, distribution: str, a: float,
                b: float) -> torch.Tensor:
    """The values of one draw at ``index``: uniform [a, b), normal(a, b), exponential (rate a), keep (0 or 1/(1-a)),
    bernoulli (1 with probability a). Keep and bernoulli compare 32 bits, whatever the dtype, so a
    mask is the same in float32 and float64."""
    if distribution == "uniform":
        return (uniform_from(words(index, key, 2), dtype) * (b - a) + a).to(dtype)
    if distribution == "normal":
        ws = words(index, key, 4)
        u1 = 1.0 - uniform_from(ws[:2], torch.float64)  # (0, 1]: log is finite
        u2 = uniform_from(ws[2:], torch.float64)
        # Box and Muller 1958
        return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2) * b + a).to(dtype)
    if distribution == "exponential":  # rate a, by inversion: -log(u) / a with u in (0, 1]
        u = 1.0 - uniform_from(words(index, key, 2), torch.float64)
        return (-torch.log(u) / a).to(dtype)
    u = words(index, key, 1)[0].double() * 2.0**-32
    if distribution == "keep":
        scale = 0.0 if a >= 1.0 else 1.0 / (1.0 - a)
        return (u >= a).to(dtype) * scale
    return (u < a).to(dtype)


@torch.library.custom_op("usc::draw", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def draw(key: torch.Tensor, shape: Sequence[int], op: int, batch_dim: int, microbatches: int,
         dtype: torch.dtype, distribution: str, a: float, b: float, shards: Optional[Sequence[int]] = None
         ) -> torch.Tensor:
    """One op's draw over the (microbatch's) whole tensor of ``shape``. key = [seed, step, microbatch,
    coordinates...]; batch_dim -1: the tensor does not depend on the batch (every microbatch draws the
    same). ``shards`` = (dim, parts, ...): draw only this rank's block, its chunk of split i at
    key[3 + i] (``RandomKey.axes``): the values are those of the whole draw there, the others are
    never made."""
    seed, step, microbatch = key[:3].unbind()  # 0-dim views: the key is never read on the host
    shards = shards or ()
    local, offset = shard_block(shape, shards, key[3:].unbind() if shards else ())
    index = global_index(shape, batch_dim if batch_dim >= 0 else None, microbatch, microbatches, key.device,
                         local=local, offset=offset)
    return draw_values(index, op_key(seed, step, op), dtype, distribution, a, b).contiguous()


@draw.register_fake
def _(key, shape, op, batch_dim, microbatches, dtype, distribution, a, b, shards=None):
    return torch.empty(tuple(shard_block(shape, shards or ())[0]), dtype=dtype, device=key.device)


class RandomKey(nn.Module):
    """(seed, step, microbatch) as a tensor on the program's device; the executor sets step and
    microbatch before each forward (``set_random_keys``). ``axes``: the mesh axes its draw is split
    over (``usc.passes.local_draws``), whose coordinates of this rank follow in the key."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed, self.step, self.microbatch = seed, 0, 0
        self.device = torch.device("cpu")
        self.axes: tuple[str, ...] = ()
        self.coords: tuple[int, ...] = ()

    def bind(self, mesh) -> None:
        self.device = mesh.device
        self.coords = tuple(mesh.comm(axis).rank for axis in self.axes)

    def forward(self) -> torch.Tensor:
        # filled on the device (fill_ takes the number as a kernel argument): torch.tensor(list,
        # device=cuda), or key[i] = number, copy host memory to the device and wait for it
        values = (self.seed, self.step, self.microbatch, *self.coords)
        if len(self.coords) != len(self.axes):
            raise RuntimeError(f"{type(self).__name__} drawing over mesh axes {self.axes} is not bound to a "
                               "mesh: call bind(mesh) with this rank's Mesh first (the executor binds every module)")
        key = torch.empty(len(values), dtype=torch.int64, device=self.device)
        for i, value in enumerate(values):
            key.select(0, i).fill_(value)
        return key


def set_random_keys(module: nn.Module, *, step: int | None = None, microbatch: int | None = None) -> None:
    """Point every RandomKey under ``module`` at this step and microbatch."""
    for part in module.modules():
        if isinstance(part, RandomKey):
            if step is not None:
                part.step = step
            if microbatch is not None:
                part.microbatch = microbatch


__all__ = ["draw", "RandomKey", "set_random_keys", "global_index", "shard_block", "draw_values", "op_key", "DISTRIBUTIONS"]
