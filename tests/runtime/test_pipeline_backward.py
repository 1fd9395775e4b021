"""Zero-bubble's split backward: I then W give exactly one backward's gradients, and W does not
walk the input-gradient chain again."""

import torch

from usc.runtime.pipeline_backward import input_grads, weight_grads


class Counted(torch.autograd.Function):
    """Identity whose backward counts its calls (a piece of the input-gradient chain)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Counted.calls += 1
        return g


def _leaves(seed: int, *shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


def _reference(loss_of, tensors):
    copies = [t.detach().clone().requires_grad_() for t in tensors]
    loss_of(*copies).backward()
    return [c.grad for c in copies]


def _split(loss_of, x, weights, grad_out=None):
    loss = loss_of(x, *weights)
    (dx,), work = input_grads([loss], [grad_out], [x], weights)
    assert all(w.grad is None for w in weights)  # nothing of W ran yet
    weight_grads(work)
    return dx


def test_two_layers_match_one_backward_and_the_chain_runs_once():
    def loss_of(x, w1, w2, b):
        return (torch.tanh(Counted.apply(x @ w1)) @ w2 + b).pow(2).sum()

    x, w1, w2, b = _leaves(0, (3, 4), (4, 5), (5, 2), (2,))
    expected = _reference(loss_of, [x, w1, w2, b])
    Counted.calls = 0
    dx = _split(loss_of, x, [w1, w2, b])
    assert Counted.calls == 1  # a plain backward over the weights would run it a second time
    torch.testing.assert_close(dx, expected[0], rtol=0, atol=1e-12)
    for w, g in zip((w1, w2, b), expected[1:]):
        torch.testing.assert_close(w.grad, g, rtol=0, atol=1e-12)


def test_weight_used_twice_and_weight_off_the_input_chain():
    """A tied weight joins the chain at two nodes, one feeding the other; a weight in a term that
    never meets the input (a penalty) gets a plain restricted backward."""
    def loss_of(x, w, p):
        return (torch.relu(x @ w) @ w.T).sum() + (p * p).sum() + (x.sum() * p).sum()

    x, w, p = _leaves(1, (3, 4), (4, 4), (2,))
    expected = _reference(loss_of, [x, w, p])
    dx = _split(loss_of, x, [w, p])
    for got, want in zip((dx, w.grad, p.grad), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_no_input_gradient_and_accumulation_over_microbatches():
    def loss_of(x, w):
        return (x @ w).sum()

    x, w = _leaves(2, (3, 4), (4, 2))
    x.requires_grad_(False)
    for _ in range(2):  # two microbatches accumulate into .grad
        (dx,), work = input_grads([loss_of(x, w)], [None], [x], [w])
        assert dx is None  # x needs no gradient: everything is W's
        weight_grads(work)
    torch.testing.assert_close(w.grad, 2 * x.sum(0)[:, None].expand(4, 2), rtol=0, atol=1e-12)
