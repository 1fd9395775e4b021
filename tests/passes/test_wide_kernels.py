"""Generated kernels at real widths: a row longer than one tile is read in tiles (online max/sum for
softmax and cross-entropy), and a broadcast input's gradient (a norm weight) is accumulated per
program, never as a [rows, length] float32 buffer. Checked under Triton's interpreter against
eager PyTorch: 128k-wide rows (131071 columns: 16 tiles, the last one ragged) at a few rows, and
every width from 1 to 70 with 16-column tiles."""

import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from usc.passes.fusion import fuse_graph
from usc.runtime import fused
from usc.runtime.fused import FusedRegion

sys.path.insert(0, str(Path(__file__).parent))
from test_fused_kernels import aten_graph  # noqa: E402

WIDE = 131071  # a 128k vocabulary, odd: the last tile is ragged


def fused_module(fn, *args) -> torch.fx.GraphModule:
    gm = fuse_graph(aten_graph(fn, *args))
    assert [m for m in gm.modules() if isinstance(m, FusedRegion)], "nothing was fused"
    return gm


def outputs_and_grads(run, args, seed=0):
    """(outputs, input gradients) of ``run`` on fresh leaves of ``args``, for a fixed random
    upstream gradient (so a uniform scale of the gradient would show)."""
    leaves = [a.clone().requires_grad_(a.dtype.is_floating_point) for a in args]
    out = run(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in out]
    torch.autograd.backward(out, ups)
    return [o.detach() for o in out], [a.grad for a in leaves if a.requires_grad]


def check(fn, *args, rtol=1e-5, atol=1e-5):
    gm = fused_module(fn, *args)
    regions = [m for m in gm.modules() if isinstance(m, FusedRegion)]
    want_out, want_grad = outputs_and_grads(fn, args)
    got_out, got_grad = outputs_and_grads(lambda *a: tuple(gm(*a)), args)
    truth = None
    for i, (g, w) in enumerate(zip(got_out + got_grad, want_out + want_grad)):
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        except AssertionError:
            # float32 apart from eager (a gradient of cancelling terms: rmsnorm over one column):
            # decide with float64 -- the kernel may be no farther from it than eager float32 is
            if truth is None:
                truth = sum(outputs_and_grads(fn, [a.double() if a.is_floating_point() else a for a in args]), [])
            t = truth[i]
            kernel, eager = (g.double() - t).abs(), (w.double() - t).abs()
            assert torch.all(kernel <= 4 * eager + 1e-6 * t.abs().max()), (i, kernel.max(), eager.max())
    assert all(m.launches == {"forward": 1, "backward": 1} for m in regions)  # kernels ran, not eager
    return regions


@contextmanager
def tiles_of(columns: int, programs: int = fused.HOST_PROGRAMS):
    with mock.patch.object(fused, "MAX_BLOCK", columns), mock.patch.object(fused, "HOST_PROGRAMS", programs):
        yield


def rmsnorm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def labels_with_ignored(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[1::3] = -100
    labels[0] = vocab - 1  # the last column: in the ragged tile
    return labels


# ----------------------------------------------------------------------------- 128k-wide rows
def test_cross_entropy_over_a_128k_vocabulary():
    logits = torch.randn(4, WIDE) * 3
    check(lambda x, y: F.cross_entropy(x, y), logits, labels_with_ignored(4, WIDE, 0))


def test_log_softmax_over_a_128k_row_with_masked_columns():
    """-inf columns (an attention mask) in whole tiles at the start of a row: the online max stays
    -inf there and no inf - inf appears."""
    x = torch.randn(2, WIDE)
    x[0, : 3 * 8192] = float("-inf")
    x[1, 5:WIDE:7] = float("-inf")
    check(lambda t: torch.log_softmax(t * 0.5, -1).clamp(min=-1e4), x)


def test_softmax_over_a_128k_row():
    check(lambda t: torch.softmax(t * 0.5, -1), torch.randn(3, WIDE) * 4)


def test_rmsnorm_weight_gradient_over_a_128k_row_is_summed_per_program():
    """5 rows on 2 programs (rows 0, 2, 4 and 1, 3): the weight gradient is accumulated across a
    program's rows in a [2, N] buffer."""
    with tiles_of(fused.MAX_BLOCK, programs=2):
        check(rmsnorm, torch.randn(5, WIDE), torch.randn(WIDE), rtol=1e-5, atol=1e-4)


def test_bf16_cross_entropy_computes_in_float32():
    """bf16 logits are converted to float32 after loading: the loss equals float32 math on the same
    bf16 values, rounded once to bf16 (within one bf16 ulp: 2^-7 relative)."""
    logits = (torch.randn(3, WIDE) * 3).to(torch.bfloat16)
    labels = labels_with_ignored(3, WIDE, 1)
    per_row = fused_module(lambda x, y: F.cross_entropy(x, y, reduction="none"), logits, labels)
    got = per_row(logits, labels)[0]
    want = F.cross_entropy(logits.float(), labels, reduction="none")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=0)


def test_wide_rows_run_in_tiles_with_more_warps():
    assert fused.launch_config(WIDE) == (fused.MAX_BLOCK, 16)
    assert fused.launch_config(4096) == (4096, 8)
    assert fused.launch_config(70) == (128, 4)


# --------------------------------------------------------------------- the broadcast gradient
def test_a_broadcast_gradient_never_gets_a_buffer_of_rows_by_length():
    """Everything the backward allocates, by size: the input's own gradient [rows, N] once (in the
    input's dtype), the weight's per-program copies [P, N]; nothing else of rows x N."""
    rows, n = 37, 96
    x, w = torch.randn(rows, n), torch.randn(n)
    gm = fused_module(rmsnorm, x, w)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = gm(xs, ws)[0]
    up = torch.randn_like(out)
    shapes = []
    real_empty, real_zeros = torch.empty, torch.zeros

    def record(factory):
        def make(*size, **kw):
            t = factory(*size, **kw)
            shapes.append((tuple(t.shape), t.dtype))
            return t
        return make

    with tiles_of(32, programs=4), mock.patch.object(fused.torch, "empty", record(real_empty)), \
            mock.patch.object(fused.torch, "zeros", record(real_zeros)):
        out.backward(up)
    assert sorted(shapes, key=str) == sorted([((rows, n), torch.float32), ((4, n), torch.float32)], key=str)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    rmsnorm(xe, we).backward(up)
    torch.testing.assert_close(ws.grad, we.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xe.grad, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------- every width, 16-column tiles
width = st.integers(1, 70)
lead = st.lists(st.integers(1, 4), min_size=1, max_size=2)


@settings(max_examples=4)
@given(lead, st.integers(2, 70), st.integers(1, 5))  # one column: layer_norm is bias exactly, eager's rounding is not
def test_norms_in_tiles(lead, n, programs):
    x, r, w, b = torch.randn(*lead, n), torch.randn(*lead, n), torch.randn(n), torch.randn(n)
    with tiles_of(16, programs):
        check(lambda x, r, w: (x + r, rmsnorm(x + r, w)), x, r, w)
        check(lambda x, r, w, b: F.layer_norm(x + r, (n,), w, b, 1e-5), x, r, w, b)


@settings(max_examples=4)
@given(lead, width, st.booleans())
def test_softmax_in_tiles(lead, n, log):
    soft = torch.log_softmax if log else torch.softmax
    with tiles_of(16):
        check(lambda x: soft(x * 0.125, -1), torch.randn(*lead, n) * 5)


@settings(max_examples=4)
@given(st.integers(1, 9), width, st.sampled_from(["mean", "sum", "none"]), st.integers(0, 2**16))
def test_cross_entropy_in_tiles(rows, vocab, reduction, seed):
    labels = labels_with_ignored(rows, vocab, seed)
    with tiles_of(16):
        check(lambda x, y: F.cross_entropy(x, y, reduction=reduction), torch.randn(rows, vocab) * 3, labels)


@settings(max_examples=4)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.sampled_from([2, 6, 34, 66]), st.integers(1, 3))
def test_rope_tables_broadcast_over_batch_and_heads_in_tiles(b, h, s, d, programs):
    """cos/sin [S, D] are broadcast over batch and heads: their gradients accumulate per program."""
    def rope(q, rotated, cos, sin):
        return q.transpose(1, 2) * cos + rotated * sin
    with tiles_of(16, programs):
        check(rope, torch.randn(b, s, h, d), torch.randn(b, h, s, d), torch.randn(s, d), torch.randn(s, d))


@settings(max_examples=4)
@given(lead, width)
def test_amax_gradient_shared_by_ties_in_tiles(lead, n):
    """amax's gradient goes to every column holding the max (counted over all tiles)."""
    x = torch.randint(-3, 3, (*lead, n)).float()  # many ties, in different tiles
    with tiles_of(16):
        check(lambda t: torch.exp(t - torch.amax(t, -1, keepdim=True)), x)


@pytest.mark.parametrize("n", [1, 16, 17])
def test_one_column_and_tile_edges(n):
    torch.manual_seed(n)
    with tiles_of(16, programs=2):
        check(rmsnorm, torch.randn(3, n), torch.randn(n))
        check(lambda x: torch.softmax(x * 0.5, -1), torch.randn(3, n))


def test_a_row_with_nothing_to_write_is_still_a_kernel():
    """A backward whose inputs need no gradient (a draw times a constant) writes nothing: both branches
    of its row must still be Python blocks."""
    from usc.passes.triton_tiles import row_body

    compile("\n".join(row_body([], [])), "<kernel>", "exec")
