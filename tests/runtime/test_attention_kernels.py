"""Ring attention on block kernels: every tile is kernel calls (the diagonal is the kernel's own
causal mask), each kernel pair is checked at first use, a wrong one is refused, and a ring step
allocates O(block) memory, not a block x block score matrix."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from usc.runtime import attention_kernels, ring_attention as ring_module
from usc.runtime.attention_kernels import AttentionKernel, kernel_for
from usc.runtime.mesh import run_in_threads, simulated_meshes
from usc.runtime.ring_attention import layout_chunks, ring_attention, ring_schedule, tile_calls

sys.path.insert(0, str(Path(__file__).parent))
from test_ring_attention import _inputs, _reference, _ring_on_ranks  # noqa: E402


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_tile_of_every_rank_is_kernel_calls_covering_exactly_its_visible_keys(layout, n):
    s_local = 6
    for rank in range(n):
        mine = layout_chunks(layout, rank, n, s_local)
        for step, tiles in enumerate(ring_schedule(layout, rank, n, s_local, causal=True)):
            theirs = layout_chunks(layout, (rank - step) % n, n, s_local)
            for tile in tiles:
                calls = tile_calls(tile, mine, theirs)
                assert calls is not None, (rank, step, tile)
                seen = torch.zeros(tile.q_hi - tile.q_lo, s_local, dtype=torch.bool)
                for c in calls:
                    block = torch.ones(c.q_hi - c.q_lo, c.k_hi - c.k_lo, dtype=torch.bool)
                    seen[:, c.k_lo: c.k_hi] |= block.tril() if c.causal else block
                q_pos = torch.tensor([ring_module._position(mine, i) for i in range(tile.q_lo, tile.q_hi)])
                k_pos = torch.tensor([ring_module._position(theirs, i) for i in range(s_local)])
                assert torch.equal(seen, k_pos[None, :] <= q_pos[:, None]), (rank, step, tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_kernel_pair_passes_its_check(dtype):
    kernel = kernel_for(torch.device("cpu"), dtype)
    assert kernel is not None and kernel.name == "flash_attention_for_cpu"


def test_a_wrong_kernel_is_refused_and_the_ring_stays_exact(monkeypatch):
    right = attention_kernels.KERNELS["cpu"][0]

    def off_by_a_bit(q, k, v, causal, scale):  # the LSE of another scale: merges would be wrong
        out, lse = right.forward(q, k, v, causal, scale * 1.01)
        return out, lse

    broken = AttentionKernel("broken", off_by_a_bit, right.backward)
    monkeypatch.setitem(attention_kernels.KERNELS, "cpu", (broken, (torch.float32,)))
    monkeypatch.setattr(attention_kernels, "_checked", {})
    with pytest.warns(UserWarning, match="broken attention kernel on cpu torch.float32 disagrees"):
        assert kernel_for(torch.device("cpu"), torch.float32) is None
    q, k, v, dout = _inputs((1, 2, 12, 8), torch.float32, seed=3)
    for got, want in zip(_ring_on_ranks(3, "zigzag", True, None, q, k, v, dout),
                         _reference(q, k, v, dout, True, None)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """The largest tensor any op creates (bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _largest_in_ring_step(monkeypatch, use_kernels: bool) -> int:
    if not use_kernels:
        monkeypatch.setattr(ring_module, "kernel_for", lambda device, dtype: None)
    else:  # the first-use check allocates its own test problem: run it outside the measurement
        assert kernel_for(torch.device("cpu"), torch.float32) is not None
    s_local, d = 96, 8
    q, k, v, dout = _inputs((1, 2, 2 * s_local, d), torch.float32, seed=1)

    def rank_fn(mesh):  # dispatch modes are per thread: one watch per rank
        piece = slice(mesh.rank * s_local, (mesh.rank + 1) * s_local)
        ql, kl, vl = (t[:, :, piece].clone().requires_grad_() for t in (q, k, v))
        with _LargestTensor() as watch:
            out = ring_attention(ql, kl, vl, mesh.comm("cp"), causal=True, scale=None, layout="contiguous")
            out.backward(dout[:, :, piece])
        return watch.largest

    return max(run_in_threads(simulated_meshes(("cp",), (2,), timeout=30), rank_fn, timeout=60))


def test_a_ring_step_allocates_a_block_not_a_score_matrix(monkeypatch):
    """Block [1, 2, 96, 8] fp32: the K/V pair a step passes on is 2 x 6 KiB; the score tile of the
    tensor-math path is 96 x 96 per head (72 KiB)."""
    block = 2 * 1 * 2 * 96 * 8 * 4
    with_kernels = _largest_in_ring_step(monkeypatch, True)
    tile_math = _largest_in_ring_step(monkeypatch, False)
    assert with_kernels <= block < tile_math
    assert tile_math >= 2 * 96 * 96 * 4


@pytest.mark.parametrize("first_use", ["forward", "recompute"])
def test_the_kernel_check_leaves_activation_checkpointing_untouched(monkeypatch, first_use):
    """The check's own autograd runs apart from a checkpointed region: the region saves the same
    tensors in its forward and its recompute, and the check never meets the recompute's stop."""
    monkeypatch.setattr(attention_kernels, "_checked", {})
    calls = {"n": 0}

    def region(x):
        calls["n"] += 1
        if first_use == "forward" or calls["n"] == 2:  # the check runs in the forward or the recompute
            assert kernel_for(torch.device("cpu"), torch.float64) is not None
        return (x.sin() * x).exp().sum()

    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False).backward()
    y = x.detach().clone().requires_grad_()
    (y.sin() * y).exp().sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    assert attention_kernels._checked[("cpu", torch.float64)] is not None
