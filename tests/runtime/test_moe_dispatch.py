"""ExpertParallelMoE (all-to-all dispatch and combine) equals a plain per-token reference.

Random routings on a simulated dp x ep mesh, including experts that get no token, ranks that
send nothing to a peer, and capacity limits (the first C assignments per expert in global token
order are kept). Outputs and the gradients of the hidden states, the router weights and the
expert weights are compared with a reference that loops over tokens.
"""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from usc.runtime.mesh import run_in_threads, simulated_meshes
from usc.runtime.moe import ExpertParallelMoE

HIDDEN, FFN = 4, 6


def _expert(x, gate, up, down):
    return (F.silu(x @ gate) * (x @ up)) @ down


def reference(x, weights, indices, gate, up, down, capacity):
    """out[t] = sum over kept slots j of weights[t, j] * expert_{indices[t, j]}(x[t]); stacked [E, in, out]."""
    out = x * 0.0
    seen = [0] * gate.shape[0]
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            seen[e] += 1
            if capacity is None or seen[e] <= capacity:
                out[t] = out[t] + weights[t, j] * _expert(x[t:t + 1], gate[e], up[e], down[e])[0]
    return out


@st.composite
def routings(draw):
    dp, ep = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    experts = ep * draw(st.integers(1, 3))
    k = draw(st.integers(1, min(3, experts)))
    per_rank = draw(st.integers(1, 5))
    tokens = per_rank * dp * ep
    used = draw(st.lists(st.integers(0, experts - 1), min_size=k, max_size=experts, unique=True))
    indices = [draw(st.permutations(used))[:k] for _ in range(tokens)]  # experts outside `used` get nothing
    capacity = draw(st.one_of(st.none(), st.integers(0, tokens * k)))
    return dp, ep, experts, torch.tensor(indices, dtype=torch.int64), capacity, draw(st.booleans()), draw(st.integers(0, 99))


def _tensors(experts, tokens, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float64)
    stacked = [torch.randn(experts, *shape, generator=gen, dtype=torch.float64)
               for shape in ((HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN))]
    return x, weights, stacked


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _rank_run(mesh, args):
    dp, ep, experts, indices, capacity, stacked, seed = args
    tokens, k = indices.shape
    x, weights, full = _tensors(experts, tokens, k, seed)
    chunk = mesh.coord_of("dp") * ep + mesh.coord_of("ep")
    rows = slice(chunk * tokens // (dp * ep), (chunk + 1) * tokens // (dp * ep))
    if stacked:
        local = experts // ep
        mine = slice(mesh.coord_of("ep") * local, (mesh.coord_of("ep") + 1) * local)
        params = [_leaf(w[mine]) for w in full]
    else:  # nn.Linear experts: every rank holds every expert's [out, in] weight
        params = [_leaf(w[e].t()) for w in full for e in range(experts)]
    moe = ExpertParallelMoE("ep", num_experts=experts, top_k=k, stacked=stacked, capacity=capacity,
                            token_axes=("dp", "ep")).bind(mesh)
    xs, ws = _leaf(x[rows]), _leaf(weights[rows])
    out = moe(xs, ws, indices[rows], *params)
    out.backward(torch.ones_like(out))
    return out.detach(), xs.grad, ws.grad, [p.grad for p in params], moe.load


@settings(max_examples=25, deadline=None)
@given(routings())
def test_dispatch_and_combine_equal_the_per_token_reference(args):
    dp, ep, experts, indices, capacity, stacked, seed = args
    tokens, k = indices.shape
    x, weights, full = _tensors(experts, tokens, k, seed)
    leaves = [_leaf(t) for t in (x, weights, *full)]
    expected = reference(leaves[0], leaves[1], indices, *leaves[2:], capacity)
    expected.backward(torch.ones_like(expected))
    meshes = simulated_meshes(("dp", "ep"), (dp, ep), timeout=20.0)
    results = run_in_threads(meshes, lambda m: _rank_run(m, args), timeout=60.0)
    close = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), expected.detach(), **close)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), leaves[0].grad, **close)
    weight_grad = torch.zeros_like(weights) if leaves[1].grad is None else leaves[1].grad
    torch.testing.assert_close(torch.cat([r[2] for r in results]), weight_grad, **close)
    for i, leaf in enumerate(leaves[2:5]):
        grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        if stacked:  # each rank holds E/ep experts; the dp replicas' partial gradients add up
            held = [sum(results[d * ep + e][3][i] for d in range(dp)) for e in range(ep)]
            torch.testing.assert_close(torch.cat(held), grad, **close)
        else:
            summed = sum(torch.stack(r[3][i * experts:(i + 1) * experts]) for r in results)
            torch.testing.assert_close(summed.transpose(1, 2), grad, **close)
    kept = tokens * k if capacity is None else sum(min(capacity, int((indices == e).sum())) for e in range(experts))
    assert sum(sum(r[4]) for r in results) == kept


def test_an_expert_with_no_token_still_gets_a_zero_gradient_on_every_rank():
    """The bucketed reducer needs every rank to produce a gradient for every parameter."""
    indices = torch.tensor([[0], [0], [0], [0]])  # expert 1 (on ep rank 1) never chosen
    args = (1, 2, 2, indices, None, False, 0)
    meshes = simulated_meshes(("dp", "ep"), (1, 2), timeout=20.0)
    results = run_in_threads(meshes, lambda m: _rank_run(m, args), timeout=60.0)
    for _, _, _, grads, _ in results:
        assert all(g is not None for g in grads)
    assert results[1][4] == [0] and results[0][4] == [4]
    assert all(float(g.abs().sum()) == 0.0 for g in results[1][3][1::2])  # expert 1's weights


def _saved_and_recompute_peak(mesh, indices, experts):
    """(bytes of the tensors the layer's forward saves for backward that it made itself, the most bytes
    backward holds at once of the tensors it recomputes under non-reentrant checkpointing, the rows
    this rank's experts received)."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import checkpoint

    from usc.testing.memory_counters import count_step_activations

    tokens, k = indices.shape
    x, weights, full = _tensors(experts, tokens, k, 3)
    ep = mesh.size("ep")
    rows = slice(mesh.coord_of("ep") * tokens // ep, (mesh.coord_of("ep") + 1) * tokens // ep)
    local = experts // ep
    params = [_leaf(w[mesh.coord_of("ep") * local:(mesh.coord_of("ep") + 1) * local]) for w in full]
    moe = ExpertParallelMoE("ep", num_experts=experts, top_k=k, stacked=True).bind(mesh)
    xs, ws, chosen = _leaf(x[rows]), _leaf(weights[rows]), indices[rows].clone()
    inputs = {t.untyped_storage()._cdata for t in (xs, ws, chosen, *params)}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in inputs:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(xs, ws, chosen, *params).sum().backward()
    received = sum(moe.load)
    step = SimpleNamespace(state={i: t for i, t in enumerate((xs, ws, chosen, *params))},
                           step=lambda _: checkpoint(moe, xs, ws, chosen, *params,
                                                     use_reentrant=False).sum().backward())
    return sum(saved.values()), count_step_activations(step, ()).peak_in_backward, received


def test_the_layer_saves_only_what_its_gradients_read_and_recomputation_holds_no_more():
    """Per rank (ep=2, 7 tokens of 2 slots each on each rank, uneven routing): forward saves the
    received rows grouped by expert, four [rows, F] tensors per expert row (the two projections,
    the activation, their product: each read by a gradient), the combined [T*k, H] slots the
    router weights multiply and the three index tensors the gradients are gathered by -- no copy
    of the exchanged rows (the combine's ``index_add`` saved its source, a third [T*k, H] buffer).
    Under recompute=full, non-reentrant checkpointing stops at the last tensor backward needs,
    inside the layer's forward: backward then holds what forward saves and at most one [T*k, H]
    buffer more (the combined rows while they are placed), not every buffer the forward had named
    (dispatch send and receive, the experts' outputs and their permuted copy)."""
    experts, k = 4, 2
    # 18 assignments to the experts of ep rank 0, 10 to those of ep rank 1
    indices = torch.tensor([[0, 2], [1, 0], [0, 3], [1, 2], [0, 1], [3, 0], [2, 1]] * 2)
    meshes = simulated_meshes(("ep",), (2,), timeout=20.0)
    results = run_in_threads(meshes, lambda m: _saved_and_recompute_peak(m, indices, experts), timeout=60.0)
    assert [r[2] for r in results] == [18, 10]
    for saved, peak, received in results:
        slots = 7 * k
        floats = received * HIDDEN + received * 4 * FFN + slots * HIDDEN  # float64
        indices_saved = 2 * slots + received  # each assignment's row and slot, each received row's place
        expected = 8 * (floats + indices_saved)
        assert saved == expected, (saved, expected)
        # beyond what forward saves: one [T*k, H] buffer and the routing's few small index tensors
        assert saved <= peak < saved + 1.5 * 8 * slots * HIDDEN, (peak, saved)
