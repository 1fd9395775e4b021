"""Each generated kernel, forward and backward, equals the eager ops it replaces (within 1e-5),
over shapes drawn by hypothesis (row lengths that are not a multiple of the block included); the
generated source of one fixed region is golden; without triton or a usable device the fused node
runs its eager ops after a one-line notice."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from usc.passes.fusion import find_regions, fuse_graph, meta_shape
from usc.runtime import fused
from usc.runtime.fused import FusedRegion

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "fused_residual_rmsnorm.py"


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def aten_graph(fn, *args) -> torch.fx.GraphModule:
    """The ATen graph usc compiles (torch.export, non-strict), of a plain function."""
    return torch.export.export(_Fn(fn), args, strict=False).graph_module


def check_against_eager(fn, *args, n_regions=1):
    """Fuse fn's graph; forward outputs and input gradients match eager within 1e-5, and every
    fused node ran its forward and backward kernel (not the eager fallback). Where float32 misses
    (rounding that an ill-conditioned row amplifies: a LayerNorm of 4 values close together), the
    same inputs in float64 decide, within 1e-10: a wrong kernel misses there too."""
    try:
        _check(fn, args, n_regions, 1e-5)
    except AssertionError:
        if any(a.dtype != torch.float32 for a in args if a.is_floating_point()):
            raise
        _check(fn, tuple(a.double() if a.is_floating_point() else a for a in args), n_regions, 1e-10)
    finally:
        _draws[0] = 0  # the next example draws its inputs afresh from the same seeds


def _check(fn, args, n_regions, tol):
    gm = fuse_graph(aten_graph(fn, *args))
    regions = [m for m in gm.modules() if isinstance(m, FusedRegion)]
    assert len(regions) == n_regions
    eager_in = [a.clone().requires_grad_(a.dtype.is_floating_point) for a in args]
    fused_in = [a.clone().requires_grad_(a.dtype.is_floating_point) for a in args]
    expected = fn(*eager_in)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = tuple(gm(*fused_in))
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(e.shape, generator=gen, dtype=e.dtype) for e in expected]
    torch.autograd.backward(expected, grads)
    torch.autograd.backward(got, grads)
    for a, b in zip(eager_in, fused_in):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=tol, atol=tol)
    assert all(m.launches == {"forward": 1, "backward": 1} for m in regions)


lead = st.lists(st.integers(1, 5), min_size=1, max_size=2)
row = st.integers(2, 70)  # 2..70: most are not a power of two (the block is the next one)


_draws = [0]  # draws so far in this example


def rand(*shape):
    """Normal values seeded by the shape and the draw's place in the example: hypothesis replays a
    failing example and must see the same numbers."""
    _draws[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(hash((shape, _draws[0])) % 2**62))


@settings(max_examples=4)
@given(lead, row)
def test_residual_rmsnorm(lead, n):
    def block(x, r, w):
        h = x + r
        return h, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    check_against_eager(block, rand(*lead, n), rand(*lead, n), rand(n))


@settings(max_examples=4)
@given(lead, row)
def test_residual_layernorm(lead, n):
    def block(x, r, w, b):
        h = x + r
        return h, F.layer_norm(h, (n,), w, b, 1e-5)
    check_against_eager(block, rand(*lead, n), rand(*lead, n), rand(n), rand(n))


@settings(max_examples=4)
@given(lead, st.integers(1, 70))
def test_swiglu(lead, n):
    check_against_eager(lambda g, u: F.silu(g) * u, rand(*lead, n), rand(*lead, n))


@settings(max_examples=4)
@given(lead, st.integers(1, 70), st.sampled_from(["none", "tanh"]))
def test_bias_gelu(lead, n, approximate):
    check_against_eager(lambda x, b: F.gelu(x + b, approximate=approximate), rand(*lead, n), rand(n))


@settings(max_examples=4)
@given(lead, row, st.booleans())
def test_scaled_softmax_and_log_softmax(lead, n, log):
    soft = torch.log_softmax if log else torch.softmax
    check_against_eager(lambda x: soft(x * 0.125, -1), rand(*lead, n))


@settings(max_examples=4)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.sampled_from([2, 6, 16, 34]))
def test_rope_with_broadcast_tables_and_transposed_input(b, h, s, d):
    """cos/sin [S, D] broadcast over batch and heads; q is a transposed (non-contiguous) view."""
    def rope(q, rotated, cos, sin):
        q = q.transpose(1, 2)
        return q * cos + rotated * sin
    check_against_eager(rope, rand(b, s, h, d), rand(b, h, s, d), rand(s, d), rand(s, d))


@settings(max_examples=4)
@given(lead, row)
def test_logsumexp_pieces_with_amax_gradient(lead, n):
    """Cross-entropy's pieces as the vocab-parallel expansion writes them: a max shift, exp, a
    row sum kept flat (no trailing 1), log. Two reductions: two regions (amax, sub, exp | sum, log)."""
    def lse(x):
        m = torch.amax(x, -1, keepdim=True)
        return torch.log(torch.sum(torch.exp(x - m), -1))
    check_against_eager(lse, rand(*lead, n), n_regions=2)


@settings(max_examples=4)
@given(st.integers(1, 9), row, st.sampled_from(["mean", "sum", "none"]), st.integers(0, 2**16))
def test_cross_entropy_rows_with_ignored_labels(rows, vocab, reduction, seed):
    """The whole cross-entropy (single device): per-row losses in one kernel that never writes the
    log-probabilities; the mean divides by the counted labels only."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[torch.rand(rows, generator=gen) < 0.3] = -100
    if reduction == "mean":
        labels[0] = 0  # at least one counted label (else the mean is 0/0 on both sides)
    check_against_eager(lambda x, y: F.cross_entropy(x, y, reduction=reduction), rand(rows, vocab), labels)


@settings(max_examples=4)
@given(lead, st.integers(1, 70))
def test_a_users_own_pointwise_chain(lead, n):
    def chain(x, y):
        z = torch.sigmoid(x) * 0.5 + torch.tanh(y) - torch.relu(x) / (y.pow(2) + 1.0)
        return torch.sqrt(z.pow(2) + 0.5) * torch.exp(-x.abs().neg().neg().clamp(max=3).neg()).reciprocal()
    x, y = rand(*lead, n), rand(*lead, n)
    gm = fuse_graph(aten_graph(chain, x, y))
    fused_ops = [n.target for m in gm.modules() if isinstance(m, FusedRegion) for n in m.eager.graph.nodes]
    assert torch.ops.aten.sigmoid.default in fused_ops and torch.ops.aten.reciprocal.default in fused_ops
    # abs and clamp are not in the op table: they split the chain into two regions
    check_against_eager(chain, x, y, n_regions=2)


def test_regions_stop_at_ops_outside_the_table():
    def f(x, w):
        h = torch.relu(x) * 2.0
        y = h @ w  # a matmul: not pointwise
        return torch.sigmoid(y) + 1.0
    gm = aten_graph(f, rand(4, 8), rand(8, 8))
    regions = find_regions(gm, meta_shape)
    assert [[str(n.target) for n in r.nodes] for r in regions] == [
        ["aten.relu.default", "aten.mul.Tensor"], ["aten.sigmoid.default", "aten.add.Tensor"]]


def test_one_reduction_per_region():
    def two_norms(x):
        a = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)
    regions = find_regions(aten_graph(two_norms, rand(3, 10)), meta_shape)
    assert [sum(str(n.target) == "aten.mean.dim" for n in r.nodes) for r in regions] == [1, 1]


def test_equal_regions_share_one_kernel():
    def two_layers(x, y, w):
        return F.silu(x) * y, F.silu(y) * x
    gm = fuse_graph(aten_graph(two_layers, rand(4, 12), rand(4, 12), rand(12)))
    names = {m.kernel.name for m in gm.modules() if isinstance(m, FusedRegion)}
    assert len([m for m in gm.modules() if isinstance(m, FusedRegion)]) == 2 and len(names) == 1


def residual_rmsnorm_source() -> str:
    def block(x, r, w):
        h = x + r
        return h, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    gm = fuse_graph(aten_graph(block, rand(4, 16, 64), rand(4, 16, 64), rand(64)))
    return next(m for m in gm.modules() if isinstance(m, FusedRegion)).kernel.source


def test_generated_source_is_golden():
    """A change here must be deliberate: regenerate with USC_UPDATE_GOLDEN=1 and explain it."""
    source = residual_rmsnorm_source()
    if os.environ.get("USC_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(source)
    assert source == GOLDEN.read_text(), "generated Triton source changed (USC_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("cause, message", [
    ("no-triton", "triton is not installed"),
    ("no-interpreter", "no CUDA device for the kernels"),
])
def test_without_triton_or_device_the_eager_ops_run_after_one_notice(monkeypatch, capsys, cause, message):
    monkeypatch.setattr(fused, "_NOTICES", set())
    if cause == "no-triton":
        monkeypatch.setitem(__import__("sys").modules, "triton", None)  # import triton raises ImportError
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")

    def block(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    x, w = rand(3, 10), rand(10)
    gm = fuse_graph(aten_graph(block, x, w))
    for _ in range(2):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = gm(xs, ws)[0]
        out.sum().backward()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    block(xe, we).sum().backward()
    torch.testing.assert_close(out, block(x, w))
    torch.testing.assert_close(xs.grad, xe.grad)
    torch.testing.assert_close(ws.grad, we.grad)
    err = capsys.readouterr().err
    assert err.count("usc: fused kernels fall back to eager ops") == 1 and message in err
    assert all(m.launches == {"forward": 0, "backward": 0} for m in gm.modules() if isinstance(m, FusedRegion))


def test_launches_on_the_interpreter_leave_its_overflow_checks_to_other_kernels(monkeypatch):
    """A fused launch on Triton's interpreter runs without its per-op int32 overflow checks (compiled
    kernels have none unless built with debug=True: on the interpreter they were a third of a launch);
    the interpreter's own setting is back after it, for any other kernel the process interprets."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder = interpreter.interpreter_builder
    seen = []
    original = interpreter.GridExecutor.__call__

    def spy(self, *args, **kwargs):
        seen.append(builder.options.sanitize_overflow)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", spy)

    def block(x, r, w):
        h = x + r
        return h, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    check_against_eager(block, rand(3, 37), rand(3, 37), rand(37))
    assert seen == [False, False] and builder.options.sanitize_overflow is True
