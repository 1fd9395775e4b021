"""Ring attention: the schedule (which tiles, how many bytes), then values and gradients equal to
torch's scaled_dot_product_attention on the full sequence, in the simulator and on gloo."""

import io

import pytest
import torch
import torch.nn.functional as F
from harness import run_world
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from usc.runtime.mesh import Mesh, run_in_threads, simulated_meshes
from usc.runtime.ring_attention import (
    RingAttention,
    Tile,
    attention_flops,
    p2p_bytes_per_step,
    ring_attention,
    ring_schedule,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


# ======================================================================== global <-> local
def _shard(x: torch.Tensor, n: int, layout: str) -> list[torch.Tensor]:
    """Each rank's [B, H, S_local, D] piece of a global [B, H, S, D] tensor."""
    if layout == "contiguous":
        return list(x.chunk(n, dim=2))
    chunks = x.chunk(2 * n, dim=2)
    return [torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim=2) for r in range(n)]


def _unshard(pieces: list[torch.Tensor], layout: str) -> torch.Tensor:
    """Inverse of _shard: the pieces back in global sequence order."""
    if layout == "contiguous":
        return torch.cat(pieces, dim=2)
    halves = [p.chunk(2, dim=2) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=2)


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=dtype) for _ in range(4)]  # q, k, v, dout


def _reference(q, k, v, dout, causal, scale):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring_on_ranks(n, layout, causal, scale, q, k, v, dout):
    """Run ring attention forward+backward on n simulated ranks; (out, dq, dk, dv) in global order."""
    pieces = [_shard(t, n, layout) for t in (q, k, v, dout)]

    def rank_fn(mesh):
        r = mesh.rank
        ql, kl, vl = (pieces[i][r].clone().requires_grad_() for i in range(3))
        out = ring_attention(ql, kl, vl, mesh.comm("cp"), causal=causal, scale=scale, layout=layout)
        out.backward(pieces[3][r])
        return out.detach(), ql.grad, kl.grad, vl.grad

    results = run_in_threads(simulated_meshes(("cp",), (n,), timeout=30), rank_fn, timeout=30)
    return [_unshard([res[i] for res in results], layout) for i in range(4)]


def _assert_matches_reference(n, layout, causal, shape, dtype, scale=None, seed=0):
    q, k, v, dout = _inputs(shape, dtype, seed)
    tol = TOLERANCE[dtype]
    for got, want in zip(
        _ring_on_ranks(n, layout, causal, scale, q, k, v, dout), _reference(q, k, v, dout, causal, scale)
    ):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# ============================================================================== schedule
def test_contiguous_causal_schedule_skips_future_blocks_and_masks_only_the_diagonal():
    # rank 1 of 4: step 0 its own block (masked), steps 1 blocks 0 (whole), 2-3 blocks 3, 2 (future)
    assert ring_schedule("contiguous", 1, 4, 8, causal=True) == [
        [Tile(0, 8, 8, True)],
        [Tile(0, 8, 8, False)],
        [],
        [],
    ]


def test_zigzag_causal_schedule_does_half_a_block_per_step_off_the_diagonal():
    # rank 0 of 2 holds chunks 0 and 3; rank 1 holds chunks 1 and 2 (chunks of 2 positions)
    assert ring_schedule("zigzag", 0, 2, 4, causal=True) == [
        [Tile(0, 2, 2, True), Tile(2, 4, 4, True)],  # chunk 0 vs 0; chunk 3 vs 0 and 3
        [Tile(2, 4, 4, False)],  # chunk 3 vs chunks 1, 2: a later block, only the late half
    ]
    assert ring_schedule("zigzag", 1, 2, 4, causal=True)[1] == [Tile(0, 2, 2, False), Tile(2, 4, 2, False)]


def test_non_causal_schedule_is_one_whole_tile_per_step():
    assert ring_schedule("zigzag", 2, 3, 6, causal=False) == [[Tile(0, 6, 6, False)]] * 3


def test_causal_zigzag_balances_the_work_and_contiguous_does_not():
    def spread(layout):
        work = [attention_flops(64, 4, r, True, layout, 2, 4, 16) for r in range(4)]
        return (max(work) - min(work)) / max(work)

    assert spread("zigzag") < 0.10
    assert spread("contiguous") > 0.5  # rank 0 does 1 block, rank 3 does 4
    assert attention_flops(64, 4, 0, False, "zigzag", 2, 4, 16) == 4 * 2 * 2 * 4 * 64 * 64 * 16


def test_forward_sends_n_minus_1_kv_blocks_and_backward_brings_dkv_home():
    n, shape = 4, (1, 2, 4, 8)
    q, k, v, dout = _inputs((1, 2, 16, 8), torch.float32)

    def rank_fn(mesh):
        comm = mesh.comm("cp")
        ql, kl, vl = (_shard(t, n, "zigzag")[mesh.rank].requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, comm, causal=True, scale=None, layout="zigzag")
        forward = (comm.stats.calls["send/recv"], comm.stats.bytes["send/recv"])
        out.backward(_shard(dout, n, "zigzag")[mesh.rank])
        return forward, comm.stats.calls["send/recv"]

    results = run_in_threads(simulated_meshes(("cp",), (n,), timeout=30), rank_fn, timeout=30)
    # forward: n-1 exchanges (one send + one recv each) of one stacked K/V block; bytes = bytes sent
    assert all(fwd == (n - 1, (n - 1) * p2p_bytes_per_step(shape, torch.float32, n)) for fwd, _ in results)
    # backward: n-1 K/V exchanges and n dK/dV exchanges on top
    assert all(total == (n - 1) + (n - 1) + n for _, total in results)
    assert p2p_bytes_per_step(shape, torch.bfloat16, 1) == 0
    assert p2p_bytes_per_step(shape, torch.bfloat16, 2) == 2 * 64 * 2


# ================================================================================ values
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ring_attention_equals_full_attention(n, causal, layout):
    _assert_matches_reference(n, layout, causal, (2, 3, 4 * n, 8), torch.float64)


def test_explicit_scale_and_float32():
    _assert_matches_reference(4, "zigzag", True, (1, 2, 16, 4), torch.float32, scale=0.3)


@hyp_settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    half=st.integers(1, 4),
    d=st.sampled_from([1, 4, 8]),
    n=st.sampled_from([1, 2, 3, 4]),
    causal=st.booleans(),
    layout=st.sampled_from(["contiguous", "zigzag"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_ring_attention_equals_full_attention_properties(b, h, half, d, n, causal, layout, dtype):
    _assert_matches_reference(n, layout, causal, (b, h, 2 * half * n, d), dtype, seed=b * 100 + h)


def test_bad_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="must be even"):
        _ring_on_ranks(1, "zigzag", True, None, *_inputs((1, 1, 3, 2), torch.float64))
    with pytest.raises(ValueError, match="layout must be one of"):
        RingAttention("cp", layout="striped")


# ================================================================================== node
def test_ring_attention_node_binds_describes_and_infers_the_global_shape():
    node = RingAttention("cp", causal=True, scale=0.5, layout="zigzag")
    assert repr(node) == "RingAttention(axis='cp', causal=True, scale=0.5, layout='zigzag')"
    stored = RingAttention("cp", layout="zigzag", out_order=[0, 2, 1, 3])
    assert repr(stored) == "RingAttention(axis='cp', causal=False, scale=None, layout='zigzag', out_order=(0, 2, 1, 3))"
    assert (node.kind, node.forward_collective(), node.backward_collective()) == ("send/recv",) * 3
    with torch._subclasses.FakeTensorMode():
        fake = torch.empty(2, 4, 32, 8)
        assert node.global_fn(fake, fake, fake).shape == (2, 4, 32, 8)
    q, k, v, dout = _inputs((1, 2, 8, 4), torch.float64)
    out_ref = _reference(q, k, v, dout, True, 0.5)[0]

    def rank_fn(mesh):
        local = [_shard(t, 2, "zigzag")[mesh.rank] for t in (q, k, v)]
        return RingAttention("cp", causal=True, scale=0.5, layout="zigzag").bind(mesh)(*local)

    outs = run_in_threads(simulated_meshes(("cp",), (2,), timeout=30), rank_fn, timeout=30)
    torch.testing.assert_close(_unshard(outs, "zigzag"), out_ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("order", [(0, 2, 1, 3), (0, 1, 2, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_output_is_stored_in_the_order_asked_for(order, dtype):
    """`out_order` decides how the output is stored whatever q's storage (real and fake tensors,
    a dtype computed wider and cast back), values and gradients unchanged; a bad order is refused."""
    q, k, v, dout = _inputs((2, 3, 12, 5), dtype)
    ref = _reference(q, k, v, dout, True, None)
    if dtype == torch.float64:  # bf16: the kernel's own rounding differs; the layout is what is checked
        pieces = [_shard(t, 2, "zigzag") for t in (q, k, v, dout)]

        def rank_fn(mesh):
            ql, kl, vl = (pieces[i][mesh.rank].clone().requires_grad_() for i in range(3))
            out = ring_attention(ql, kl, vl, mesh.comm("cp"), causal=True, scale=None, layout="zigzag",
                                 out_order=order)
            out.backward(pieces[3][mesh.rank])
            return out.detach(), ql.grad, kl.grad, vl.grad

        results = run_in_threads(simulated_meshes(("cp",), (2,), timeout=30), rank_fn, timeout=30)
        for res in results:
            assert res[0].permute(order).is_contiguous()
        for i in range(4):
            torch.testing.assert_close(_unshard([res[i] for res in results], "zigzag"), ref[i], atol=1e-10, rtol=1e-10)
    mesh = simulated_meshes(("cp",), (1,), timeout=30)[0]
    with torch._subclasses.FakeTensorMode():
        fake = torch.empty(2, 3, 10, 5, dtype=dtype)  # stored [B, H, S, D], unlike the kernel's output
        out = ring_attention(fake, fake, fake, mesh.comm("cp"), causal=True, scale=None, layout="contiguous",
                             out_order=order)
        assert out.permute(order).is_contiguous() and out.shape == fake.shape and out.dtype == dtype
    with pytest.raises(ValueError, match="out_order"):
        ring_attention(q, k, v, mesh.comm("cp"), causal=True, scale=None, layout="contiguous", out_order=(0, 1, 1, 3))


# ================================================================================== gloo
def _to_bytes(tensors) -> bytes:
    buffer = io.BytesIO()
    torch.save([t.detach().clone() for t in tensors], buffer)
    return buffer.getvalue()


def _gloo_ring_world(rank: int, world_size: int, layout: str, q, k, v, dout) -> bytes:
    mesh = Mesh.from_environment(("cp",), (world_size,), timeout=30.0)
    ql, kl, vl = (_shard(t, world_size, layout)[rank].requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, mesh.comm("cp"), causal=True, scale=None, layout=layout)
    out.backward(_shard(dout, world_size, layout)[rank])
    return _to_bytes([out, ql.grad, kl.grad, vl.grad])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_on_gloo_processes(layout):
    q, k, v, dout = _inputs((1, 2, 8, 4), torch.float64)
    results = run_world(_gloo_ring_world, 2, layout, q, k, v, dout, timeout=60.0)
    per_rank = [torch.load(io.BytesIO(r)) for r in results]
    got = [_unshard([p[i] for p in per_rank], layout) for i in range(4)]
    for g, want in zip(got, _reference(q, k, v, dout, True, None)):
        torch.testing.assert_close(g, want, atol=1e-10, rtol=1e-10)
