"""Ring attention: exact attention over a sequence sharded along one mesh axis (context parallel).

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context". Rank r of
the cp group holds Q_r, K_r, V_r ([B, H, S_local, D]) for its part of the sequence. At step
s = 0..n-1 it attends Q_r to the K/V block that originated at rank (r - s) mod n while passing its
current block on to rank r + 1. Blocks are merged with their log-sum-exps, so no rank ever holds
the full S x S scores or the full K/V:

    O = sigmoid(LSE1 - LSE2) * O1 + sigmoid(LSE2 - LSE1) * O2,   LSE = logaddexp(LSE1, LSE2)

Each tile is one call of an attention kernel that returns its log-sum-exp (``attention_kernels``:
on the CPU ``aten._scaled_dot_product_flash_attention_for_cpu``, on CUDA the memory-efficient
kernel), so a step holds O(block) memory, never a block x block score matrix. A tile whose rows see
only part of its keys is cut in two calls: the keys every row sees (no mask) and the diagonal
square, which is exactly the kernel's own causal mask. Backward follows FlashAttention-2 (Dao
2023, alg. 2): each call's backward kernel gets the *final* output and LSE of its rows, so it
recomputes P = exp(QK^T * scale - LSE) and D_i = rowsum(dO * O) of the whole row; dQ accumulates
locally and dK/dV travel around the ring with their K/V block, so after n steps each block's
gradient is back on its owner. Where no kernel applies (a dtype the kernel lacks, or one that
failed its first-use check against the reference tile math), the tile is computed in explicit
tensor math (``_tile_scores``).

Layouts (which global positions a rank holds; positions are increasing in local index in both):

- "contiguous": rank r holds [r * S_local, (r + 1) * S_local).
- "zigzag": the sequence is cut into 2n chunks of S_local / 2 and rank r holds chunks r and
  2n - 1 - r, so every rank does the same causal work (Brandon et al. 2023, "Striped Attention";
  the zig-zag variant of Megatron-LM's context parallelism).

Causal masks come from global positions, per tile: a tile is one layout chunk of this rank's
query rows against the prefix of the key block that some row of the chunk may see. A block
entirely in the future yields no tile (no compute); a tile every row sees whole is unmasked.

Example (simulated, 2 ranks, zig-zag; each rank's q/k/v is its two chunks concatenated)::

    meshes = simulated_meshes(("cp",), (2,), timeout=10.0)
    def rank_fn(mesh):
        q = k = v = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(mesh.rank))
        return ring_attention(q, k, v, mesh.comm("cp"), causal=True, scale=None, layout="zigzag")
    outs = run_in_threads(meshes, rank_fn, timeout=10.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .attention_kernels import AttentionKernel, kernel_for
from .collectives import CollectiveNode
from .comm import Comm

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


# ===================================================================== the schedule as data
@dataclass(frozen=True)
class Chunk:
    """Local rows [start, start + length) of a rank hold global positions [position, ...)."""

    start: int
    position: int
    length: int


@dataclass(frozen=True)
class Tile:
    """Query rows [q_lo, q_hi) against keys [k_lo, k_hi) of a block; `masked`: some row sees
    only part of those keys, so the causal mask applies. (k_lo > 0 only under an explicit mask,
    whose tiles are one query chunk against one key chunk.)"""

    q_lo: int
    q_hi: int
    k_hi: int
    masked: bool
    k_lo: int = 0

    @property
    def keys(self) -> slice:
        return slice(self.k_lo, self.k_hi)


def layout_chunks(layout: Layout, rank: int, n: int, s_local: int) -> tuple[Chunk, ...]:
    """The chunks of the global sequence that `rank` holds, in local order."""
    _check_layout(layout, s_local)
    if layout == "contiguous":
        return (Chunk(0, rank * s_local, s_local),)
    half = s_local // 2
    return (Chunk(0, rank * half, half), Chunk(half, (2 * n - 1 - rank) * half, half))


def block_tiles(q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk], *, causal: bool) -> list[Tile]:
    """The work of one ring step: which query rows meet which keys (empty: skip the block)."""
    s_local = sum(c.length for c in k_chunks)
    if not causal:
        return [Tile(0, s_local, s_local, False)]
    tiles = []
    for qc in q_chunks:
        last_q = qc.position + qc.length - 1
        # positions grow with the local index, so the keys a row may see form a prefix
        k_hi = sum(min(max(last_q - kc.position + 1, 0), kc.length) for kc in k_chunks)
        if k_hi:
            masked = _position(k_chunks, k_hi - 1) > qc.position
            tiles.append(Tile(qc.start, qc.start + qc.length, k_hi, masked))
    return tiles


@dataclass(frozen=True)
class Call:
    """One attention-kernel call: query rows [q_lo, q_hi) against keys [k_lo, k_hi); `causal`:
    the keys are the rows' own positions (a square on the diagonal), the kernel's causal mask."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool


def tile_calls(tile: Tile, q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk]) -> list[Call] | None:
    """A tile as kernel calls: whole, or (masked) the keys every row sees plus the diagonal
    square; None when the masked keys are not the rows' own positions (no kernel mask fits)."""
    if not tile.masked:
        return [Call(tile.q_lo, tile.q_hi, 0, tile.k_hi, False)]
    first = _position(q_chunks, tile.q_lo)
    split = sum(1 for i in range(tile.k_hi) if _position(k_chunks, i) < first)
    square = tile.k_hi - split == tile.q_hi - tile.q_lo and all(
        _position(k_chunks, split + i) == first + i for i in range(tile.q_hi - tile.q_lo))
    if not square:
        return None
    whole = [Call(tile.q_lo, tile.q_hi, 0, split, False)] if split else []
    return whole + [Call(tile.q_lo, tile.q_hi, split, tile.k_hi, True)]


# An explicit mask's tiles: each chunk is cut into at most MASK_PIECES pieces of at least
# MIN_PIECE rows, so a mask's structure (the causal diagonal, document boundaries) leaves most tiles
# hidden or shown whole, while the tiles stay few (at most 64 per chunk pair and step).
MASK_PIECES, MIN_PIECE = 8, 64


def masked_schedule(layout: Layout, rank: int, n: int, s_local: int) -> list[list[Tile]]:
    """Under an explicit mask: each step's block as tiles of (query piece, key piece) within each
    (query chunk, key chunk) pair, each classified on its own by the mask (``_mask_calls``)."""
    mine = [p for c in layout_chunks(layout, rank, n, s_local) for p in _pieces(c)]
    blocks = [[p for c in layout_chunks(layout, (rank - s) % n, n, s_local) for p in _pieces(c)] for s in range(n)]
    return [[Tile(q_lo, q_hi, k_hi, False, k_lo) for q_lo, q_hi in mine for k_lo, k_hi in block] for block in blocks]


def _pieces(chunk: Chunk) -> list[tuple[int, int]]:
    """Local [lo, hi) ranges cutting a chunk into near-equal pieces."""
    count = max(1, min(MASK_PIECES, chunk.length // MIN_PIECE))
    cuts = [chunk.start + chunk.length * i // count for i in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def ring_schedule(layout: Layout, rank: int, n: int, s_local: int, *, causal: bool) -> list[list[Tile]]:
    """The tiles `rank` computes at each ring step s (against the block of rank (rank - s) % n)."""
    mine = layout_chunks(layout, rank, n, s_local)
    return [
        block_tiles(mine, layout_chunks(layout, (rank - s) % n, n, s_local), causal=causal) for s in range(n)
    ]


def _position(chunks: Sequence[Chunk], index: int) -> int:
    for c in chunks:
        if c.start <= index < c.start + c.length:
            return c.position + index - c.start
    raise IndexError(f"local index {index} is outside the chunks {chunks}")


def _positions(chunks: Sequence[Chunk], device: torch.device) -> torch.Tensor:
    """Global positions of a rank's rows, on the device of the scores they mask."""
    return torch.cat([torch.arange(c.position, c.position + c.length, device=device) for c in chunks])


def _check_layout(layout: str, s_local: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"ring attention layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and s_local % 2:
        raise ValueError(
            f"zigzag layout splits each rank's {s_local} positions into two chunks: the local "
            f"sequence length must be even (pad the sequence to a multiple of 2 * cp)"
        )


# ======================================================================== cost model helpers
def attention_flops(
    S_local: int, n: int, rank: int, causal: bool, layout: Layout, B: int, H: int, D: int
) -> int:
    """Multiply-adds of QK^T and PV that `rank` computes in forward (1 multiply-add = 2 FLOPs).

    Skipped blocks cost 0. A masked (diagonal) tile counts fully: it is computed whole and then
    masked, which is what the kernel does.
    """
    tiles = [t for step in ring_schedule(layout, rank, n, S_local, causal=causal) for t in step]
    return sum(2 * B * H * (t.q_hi - t.q_lo) * t.k_hi * D for t in tiles)


def p2p_bytes_per_step(k_local_shape: Sequence[int], dtype: torch.dtype, n: int) -> int:
    """Bytes one rank sends in one forward ring step (its current K and V block); 0 if n == 1.

    Forward sends n - 1 such blocks; backward additionally sends n - 1 K/V blocks and n dK/dV
    blocks (these in float32, or float64 for float64 inputs).
    """
    if n == 1:
        return 0
    return 2 * math.prod(k_local_shape) * torch.empty((), dtype=dtype).element_size()


# ============================================================================ the ring kernel
def _pass_on(comm: Comm, t: torch.Tensor, *, async_op: bool = False):
    """Send t to the next rank of the ring and receive the previous rank's. Both halves are posted
    together (no send-first cycle can deadlock); with async_op the caller computes meanwhile and
    waits on the returned Work before using the block."""
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    return comm.send_recv(t.contiguous(), nxt, prev, async_op=async_op)


def _tile_scores(q, k, tile: Tile, q_pos, k_pos, scale: float, mask=None) -> torch.Tensor:
    """Scores of a tile; `mask`: the explicit mask's tile (bool: True takes part; float: added)."""
    s = (q[..., tile.q_lo : tile.q_hi, :] @ k[..., tile.keys, :].transpose(-2, -1)) * scale
    if tile.masked:
        visible = k_pos[tile.keys] <= q_pos[tile.q_lo : tile.q_hi, None]
        s = s.masked_fill(~visible, float("-inf"))
    if mask is None:
        return s
    return s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The LSE with -inf (a row that sees no key) as 0: exp(scores - it) is then 0, not NaN."""
    return torch.where(torch.isneginf(lse), 0.0, lse)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o_t, lse_t) -> None:
    """Fold a tile's normalised output into the running (out, lse) of its rows, in place. A row
    that has seen no key yet on either side (an explicit mask hides a whole block) stays 0."""
    lse_old = lse[..., rows, :]
    lse_new = torch.logaddexp(lse_old, lse_t)
    empty = torch.isneginf(lse_new)
    keep = torch.where(empty, 0.0, torch.sigmoid(lse_old - lse_t))
    take = torch.where(empty, 0.0, torch.sigmoid(lse_t - lse_old))
    out[..., rows, :] = keep * out[..., rows, :] + take * o_t
    lse[..., rows, :] = lse_new


@dataclass(frozen=True)
class _Ring:
    """What forward and backward share: the group, the schedule, the positions and the kernel.
    `mask`: this rank's rows of an explicit mask over the whole key sequence (global order), or None."""

    comm: Comm
    schedule: list[list[Tile]]
    q_pos: torch.Tensor
    block_pos: list[torch.Tensor]  # global positions of the block seen at each step
    scale: float
    calls: list[list[list[Call] | None]]  # per step, per tile: its kernel calls (None: tile math)
    kernel: AttentionKernel | None
    mask: torch.Tensor | None = None

    @classmethod
    def build(cls, comm: Comm, s_local: int, d: int, causal: bool, scale: float | None, layout: Layout,
              device: torch.device, dtype: torch.dtype, mask: torch.Tensor | None = None,
              needs_mask_grad: bool = False):
        n, r = comm.size, comm.rank
        chunks = [layout_chunks(layout, b, n, s_local) for b in range(n)]
        schedule = ring_schedule(layout, r, n, s_local, causal=causal) if mask is None else \
            masked_schedule(layout, r, n, s_local)
        block_pos = [_positions(chunks[(r - s) % n], device) for s in range(n)]
        if mask is None:
            calls = [[tile_calls(t, chunks[r], chunks[(r - s) % n]) for t in tiles] for s, tiles in enumerate(schedule)]
        else:
            key = (layout, r, n, s_local, not needs_mask_grad, mask._version)
            calls = _memo(mask, key, lambda: _mask_calls(mask, schedule, block_pos, kernel_ok=key[4]))
        kernel = kernel_for(device, dtype)
        if kernel is None:  # every call becomes tile math; a skipped tile ([]) stays skipped
            calls = [[None if c else c for c in step] for step in calls]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        return cls(comm, schedule, _positions(chunks[r], device), block_pos, scale, calls, kernel, mask)

    def work(self, step: int) -> list[tuple[Tile, list[Call] | None]]:
        """The tiles of a step with their kernel calls (None: computed in tile math; []: skipped)."""
        return list(zip(self.schedule[step], self.calls[step]))

    def mask_tile(self, step: int, tile: Tile) -> torch.Tensor | None:
        """The explicit mask's entries for a tile: its query rows, the block's keys (global columns)."""
        return None if self.mask is None else _mask_of(self.mask, tile, self.block_pos[step])

    def add_mask_grad(self, dmask: torch.Tensor, step: int, tile: Tile, ds: torch.Tensor) -> None:
        """d(loss)/d(additive mask) is the scores' gradient, summed over the dims the mask broadcasts."""
        lead = ds.dim() - dmask.dim()
        g = ds.sum(dim=tuple(range(lead))) if lead else ds
        dims = [i for i in range(g.dim()) if dmask.shape[i] == 1 and g.shape[i] != 1]
        g = g.sum(dim=dims, keepdim=True) if dims else g
        target = dmask if dmask.shape[-2] == 1 else dmask[..., tile.q_lo: tile.q_hi, :]
        if dmask.shape[-1] == 1:
            target += g
        else:
            target.index_add_(-1, self.block_pos[step][tile.keys], g)


def _mask_of(mask: torch.Tensor, tile: Tile, cols: torch.Tensor) -> torch.Tensor:
    rows = mask if mask.shape[-2] == 1 else mask[..., tile.q_lo: tile.q_hi, :]
    return rows if rows.shape[-1] == 1 else rows.index_select(-1, cols[tile.keys])


def _memo(mask: torch.Tensor, key: tuple, compute):
    """The tile classification of a mask, kept on the mask tensor itself: every layer of a model
    receives the same mask tensor in a step, so its values are read on the host once per step, not
    once per layer (the key holds the tensor's version: an in-place write reclassifies)."""
    cache = mask.__dict__.setdefault("_usc_ring_tiles", {})
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _mask_calls(mask: torch.Tensor, schedule: list[list[Tile]], block_pos: list[torch.Tensor], *,
                kernel_ok: bool = True) -> list[list[list[Call] | None]]:
    """What each tile of an explicit mask needs, read from the mask's values: nothing ([]) where it
    hides every key (False / -inf: such keys add exactly nothing), one unmasked kernel call where it
    hides none (True / 0) and the mask needs no gradient (a kernel gives no score gradient), tile
    math with the mask (None) otherwise. Documents packed in a sequence and sliding windows hide
    most blocks. One host read for the whole call (none on fake tensors)."""
    tiles = [(s, t) for s, step in enumerate(schedule) for t in step]
    if _is_fake(mask):
        return [[None] * len(step) for step in schedule]
    flags = []
    for s, t in tiles:
        m = _mask_of(mask, t, block_pos[s])
        hidden, visible = (~m, m) if m.dtype == torch.bool else (torch.isneginf(m), m == 0)
        flags.append(torch.stack([hidden.all(), visible.all()]))
    read = iter(torch.stack(flags).tolist())
    calls = []
    for step in schedule:
        calls.append([])
        for t in step:
            hidden, visible = next(read)
            whole = visible and kernel_ok
            calls[-1].append([] if hidden else [Call(t.q_lo, t.q_hi, t.k_lo, t.k_hi, False)] if whole else None)
    return calls


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def _zeros_in_order(like: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """Zeros of `like`'s shape and dtype, stored with dims in `order` (outermost first); None: as
    `like` is stored."""
    if order is None:
        return torch.zeros_like(like)
    inverse = sorted(range(len(order)), key=list(order).__getitem__)
    stored = like.new_zeros([like.shape[d] for d in order])
    return stored.permute(inverse)


def _ring_forward(ring: _Ring, q, k, v, out_order: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised output (stored in `out_order`, see ``ring_attention``) and per-row LSE
    ([B, H, S_local, 1]) in the compute dtype."""
    comm, kv = ring.comm, torch.stack([k, v])
    out = _zeros_in_order(q, out_order)
    lse = q.new_full((*q.shape[:-1], 1), float("-inf"))
    for step in range(len(ring.schedule)):
        # the next block travels while this one is computed (async send/recv, waited after)
        following, transfer = _pass_on(comm, kv, async_op=True) if step < comm.size - 1 else (None, None)
        k_blk, v_blk = kv.to(q.dtype).unbind(0)
        for tile, calls in ring.work(step):
            if calls is not None:
                for c in calls:
                    keys = slice(c.k_lo, c.k_hi)
                    o_t, lse_t = ring.kernel.forward(q[..., c.q_lo: c.q_hi, :], k_blk[..., keys, :],
                                                     v_blk[..., keys, :], c.causal, ring.scale)
                    _merge(out, lse, slice(c.q_lo, c.q_hi), o_t, lse_t)
                continue
            s = _tile_scores(q, k_blk, tile, ring.q_pos, ring.block_pos[step], ring.scale, ring.mask_tile(step, tile))
            lse_t = torch.logsumexp(s, dim=-1, keepdim=True)
            o_t = torch.exp(s - _finite(lse_t)) @ v_blk[..., tile.keys, :]
            _merge(out, lse, slice(tile.q_lo, tile.q_hi), o_t, lse_t)
        if transfer is not None:
            transfer.wait()
        kv = following
    return out, lse


def _ring_backward(ring: _Ring, q, k, v, out, lse, dout, dmask=None) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV (compute dtype); dK/dV ride the ring with their block and end on its owner. `dmask`
    (an additive mask that needs a gradient) collects the scores' gradient in place."""
    comm, kv = ring.comm, torch.stack([k, v])
    delta = (dout * out).sum(dim=-1, keepdim=True)  # D_i = rowsum(dO * O), FlashAttention-2
    dq = torch.zeros_like(q)
    dkv = q.new_zeros((2, *k.shape))
    for step in range(len(ring.schedule)):
        more = comm.size > 1 and step < comm.size - 1
        following, transfer = _pass_on(comm, kv, async_op=True) if more else (None, None)
        k_blk, v_blk = kv.to(q.dtype).unbind(0)
        for tile, calls in ring.work(step):
            if calls is not None:
                for c in calls:
                    rows, keys = slice(c.q_lo, c.q_hi), slice(c.k_lo, c.k_hi)
                    dq_t, dk_t, dv_t = ring.kernel.backward(
                        dout[..., rows, :], q[..., rows, :], k_blk[..., keys, :], v_blk[..., keys, :],
                        out[..., rows, :], lse[..., rows, :], c.causal, ring.scale)
                    dq[..., rows, :] += dq_t
                    dkv[0, ..., keys, :] += dk_t
                    dkv[1, ..., keys, :] += dv_t
                continue
            rows, keys = slice(tile.q_lo, tile.q_hi), tile.keys
            s = _tile_scores(q, k_blk, tile, ring.q_pos, ring.block_pos[step], ring.scale, ring.mask_tile(step, tile))
            p = torch.exp(s - _finite(lse[..., rows, :]))
            dkv[1, ..., keys, :] += p.transpose(-2, -1) @ dout[..., rows, :]
            ds = p * (dout[..., rows, :] @ v_blk[..., keys, :].transpose(-2, -1) - delta[..., rows, :])
            if dmask is not None:
                ring.add_mask_grad(dmask, step, tile, ds)
            dq[..., rows, :] += (ds @ k_blk[..., keys, :]) * ring.scale
            dkv[0, ..., keys, :] += (ds.transpose(-2, -1) @ q[..., rows, :]) * ring.scale
        if comm.size > 1:
            dkv = _pass_on(comm, dkv)  # n passes: the last one brings it home
            if transfer is not None:
                transfer.wait()
            kv = following
    return dq, dkv[0], dkv[1]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 math for float32 and narrower inputs; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, comm: Comm, causal: bool, scale: float | None, layout: Layout,
                out_order: tuple[int, ...] | None):
        qc = q.to(_compute_dtype(q.dtype))
        mc = mask if mask is None or mask.dtype == torch.bool else mask.to(qc.dtype)
        ring = _Ring.build(comm, q.shape[-2], q.shape[-1], causal, scale, layout, q.device, qc.dtype, mc,
                           ctx.needs_input_grad[3])
        out, lse = _ring_forward(ring, qc, k, v, out_order)
        ctx.ring, ctx.mask_dtype = ring, None if mask is None else mask.dtype
        ctx.save_for_backward(qc, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        qc, k, v, out, lse = ctx.saved_tensors
        dmask = torch.zeros_like(ctx.ring.mask) if ctx.needs_input_grad[3] else None
        dq, dk, dv = _ring_backward(ctx.ring, qc, k, v, out, lse, dout.to(qc.dtype), dmask)
        dmask = None if dmask is None else dmask.to(ctx.mask_dtype)
        return dq.to(dout.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    *,
    causal: bool,
    scale: float | None,
    layout: Layout,
    mask: torch.Tensor | None = None,
    out_order: Sequence[int] | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, sharded along `comm`'s axis.

    q, k, v: [B, H, S_local, D], this rank's positions in `layout` (see the module docstring).
    Equals torch's scaled_dot_product_attention on the full sequence, restricted to these rows.
    `scale` None means 1 / sqrt(D). `mask` (with causal=False): this rank's query rows of an
    sdpa mask, [B|1, H|1, S_local|1, S|1] (bool: True takes part; float: added to the scores),
    its key columns whole and in global order; each step uses the columns of the block it holds.
    A row that sees no key at all gives 0, as torch's sdpa does.

    `out_order`: how the output is stored, its dims outermost first (None: as q is stored). The CPU
    and CUDA attention kernels return [B, H, S, D] stored as [B, S, H, D], order (0, 2, 1, 3); a
    model's ``.transpose(1, 2).reshape(...)`` after attention traces to a ``view`` that holds only in
    that order, so the compiled node asks for the order its traced attention had.
    """
    _check_inputs(q, k, v, layout)
    if mask is not None:
        _check_mask(mask, q, comm.size, causal)
    if out_order is not None and sorted(out_order) != list(range(q.dim())):
        raise ValueError(f"ring_attention: out_order {tuple(out_order)} is not an order of q's {q.dim()} dims")
    order = None if out_order is None else tuple(out_order)
    return _RingAttentionFn.apply(q, k, v, mask, comm, causal, scale, layout, order)


def _check_mask(mask: torch.Tensor, q: torch.Tensor, n: int, causal: bool) -> None:
    if causal:
        raise ValueError("ring_attention: an explicit mask and causal=True together (sdpa refuses them too)")
    rows, cols = (mask.shape[-2] if mask.dim() > 1 else 0), mask.shape[-1]
    if not 2 <= mask.dim() <= 4 or rows not in (1, q.shape[-2]) or cols not in (1, n * q.shape[-2]):
        raise ValueError(f"ring_attention: the mask {tuple(mask.shape)} must be [B|1, H|1, S_local|1, S|1] "
                         f"with S_local={q.shape[-2]} query rows and S={n * q.shape[-2]} keys")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"ring_attention: the mask must be bool or floating point, got {mask.dtype}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"ring_attention: q, k, v must all be [B, H, S_local, D] of one shape, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (repeat kv heads for GQA first)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"ring_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _check_layout(layout, q.shape[-2])


# ================================================================================ graph node
KV_BLOCKS = "ring attention: K/V blocks passed to the next rank"
GRAD_BLOCKS = "ring attention: dK/dV blocks passed back around the ring, in float32 for bf16 inputs"


class RingAttention(CollectiveNode):
    """Context-parallel attention over mesh axis `axis`: send/recv around the ring both ways.

    Inputs are the local [B, H, S_local, D] shards in `layout`; on a group of one it is plain
    attention. `global_fn` is the single-device op it replaces (for shape inference). `masked`:
    a fourth input is an explicit sdpa mask, this rank's query rows over all keys. `out_order`: the
    output's memory order (see ``ring_attention``), the traced attention's.
    """

    kind = "send/recv"
    traffic_input = 2  # the report's block shape: K/V travel; a mask (input 3) stays put

    def __init__(
        self, axis: str, causal: bool = False, scale: float | None = None, layout: Layout = "contiguous",
        masked: bool = False, out_order: Sequence[int] | None = None,
    ):
        super().__init__(axis)
        _check_layout(layout, 0)
        self.causal, self.scale, self.layout, self.masked = causal, scale, layout, masked
        self.out_order = None if out_order is None else tuple(out_order)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        return ring_attention(q, k, v, self.comm, causal=self.causal, scale=self.scale, layout=self.layout,
                              mask=mask, out_order=self.out_order)

    def global_fn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        """The whole-sequence attention this node computes a shard of (works on fake tensors)."""
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, mask, 0.0, self.causal, scale=self.scale
        )

    def traffic(self, local_shape: Sequence[int], dtype: torch.dtype, n: int) -> list[tuple]:
        """(direction, kind, shape, bytes per call, calls per step, why) of this rank's sends: forward
        passes its K/V block n-1 times; backward passes K/V n-1 times and dK/dV n times, those in the
        ring's compute dtype (float32 for bf16 inputs: ``_compute_dtype``)."""
        if n == 1:
            return []
        shape = tuple(local_shape)
        block = p2p_bytes_per_step(local_shape, dtype, n)
        grads = p2p_bytes_per_step(local_shape, _compute_dtype(dtype), n)
        return [("forward", "send/recv", shape, block, n - 1, KV_BLOCKS),
                ("backward", "send/recv", shape, block, n - 1, KV_BLOCKS),
                ("backward", "send/recv", shape, grads, n, GRAD_BLOCKS)]

    def attention_work(self, q_local_shape: Sequence[int], n: int) -> list[int]:
        """Multiply-adds each rank of the ring computes (see attention_flops), for the report."""
        b, h, s, d = q_local_shape
        return [attention_flops(s, n, r, self.causal, self.layout, b, h, d) for r in range(n)]

    def forward_collective(self) -> str | None:
        return "send/recv"

    def backward_collective(self) -> str | None:
        return "send/recv"

    def extra_repr(self) -> str:
        masked = ", masked=True" if self.masked else ""
        order = f", out_order={self.out_order}" if self.out_order is not None else ""
        return f"axis={self.axis!r}, causal={self.causal}, scale={self.scale}, layout={self.layout!r}{masked}{order}"
