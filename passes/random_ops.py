"""Random ops with defined semantics: every draw becomes a counter-based ``usc::draw`` node.

Requires: the traced graph (global shapes, before propagation).
Establishes: no op draws from torch's generator. Each random op is rewritten to a ``usc::draw``
    of its whole (global) tensor keyed by (seed, step, op number, element index) -- see
    runtime/random.py -- fed by a ``RandomKey`` node just before it: dropout is ``x * keep``,
    bernoulli compares a uniform draw, rand/randn(_like) are draws. The draw is replicated on
    every mesh axis, so propagation gives each rank its slice of it (tp replicas: the same values;
    dp/cp/sp shards: their slice of what one device draws). A random op with no such form is
    refused (CompileError) rather than left to draw rank-dependent numbers.
    Each draw starts with batch_dim -1; batch_coupling fills in the batch dim under microbatching.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from usc.compiler.errors import CompileError
from usc.compiler.trace import module_path, user_source
from usc.runtime.random import RandomKey, draw  # noqa: F401 - importing draw registers usc::draw

from .attention_masks import sdpa_args
from .graph_edit import val

aten = torch.ops.aten
KEY_MODULE = "usc_random_key"
DRAW = torch.ops.usc.draw.default
DRAW_DTYPE = 5  # the draw's dtype argument: (key, shape, op, batch_dim, microbatches, dtype, ...)
DRAW_SHARDS = 9  # ... and its shards, last: (..., distribution, a, b, shards)


class _Rewriter:
    """Inserts the nodes that replace one random op, carrying its module path and source."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, op: int, seed: int) -> None:
        self.gm, self.node, self.op, self.seed = gm, node, op, seed

    def _meta(self, new: fx.Node, value) -> fx.Node:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.node.meta:
                new.meta[key] = self.node.meta[key]
        new.meta["val"] = value
        return new

    def _fake(self, fn: Callable):
        mode = _fake_mode(self.gm)
        with mode:
            return fn()

    def draw(self, shape, dtype, distribution: str, a: float = 0.0, b: float = 1.0,
             like: fx.Node | None = None) -> fx.Node:
        graph = self.gm.graph
        with graph.inserting_before(self.node):
            # one key module per draw: a recompute region that takes a draw moves its key module along
            name = f"{KEY_MODULE}_{self.op}"
            if not hasattr(self.gm, name):
                self.gm.add_submodule(name, RandomKey(self.seed))
            # the traced device (meta for a model built there): the runtime makes both on the program's
            device = _device_of(val(like) if like is not None else val(self.node))
            key = self._meta(graph.call_module(name, ()),
                             self._fake(lambda: torch.zeros(3, dtype=torch.int64, device=device)))
            new = graph.call_function(DRAW, (key, list(shape), self.op, -1, 1, dtype, distribution, float(a),
                                             float(b)))
        self._meta(new, self._fake(lambda: torch.empty(tuple(shape), dtype=dtype, device=device)))
        new.meta["usc_draw_like"] = like.name if like is not None else None
        return new

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.gm.graph.inserting_before(self.node):
            new = self.gm.graph.call_function(target, args, kwargs)
        values = [val(a) if isinstance(a, fx.Node) else a for a in args]
        return self._meta(new, self._fake(lambda: target(*values, **kwargs)))


def _device_of(value) -> torch.device | None:
    """The device of a node's value (of its first tensor, for a tuple such as native_dropout's)."""
    if isinstance(value, (tuple, list)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    return value.device if isinstance(value, torch.Tensor) else None


def _fake_mode(gm: fx.GraphModule):
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    mode = detect_fake_mode(vals)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def _shape_dtype(node: fx.Node) -> tuple[list[int], torch.dtype]:
    value = val(node)
    return [int(s) for s in value.shape], value.dtype


# ---------------------------------------------------------------- one rule per random op

def _dropout(r: _Rewriter) -> fx.Node | None:
    x, p, train = (list(r.node.args) + [None, 0.5, True][len(r.node.args):])[:3]
    p = r.node.kwargs.get("p", p)
    train = r.node.kwargs.get("train", train)
    if not train or not p:
        return x  # dropout that is off draws nothing
    shape, dtype = _shape_dtype(x)
    return r.call(aten.mul.Tensor, x, r.draw(shape, dtype, "keep", p, like=x))


def _native_dropout(r: _Rewriter) -> None:
    """native_dropout(x, p, train) -> (x * keep, keep != 0), read through its getitem users (the
    functionalized graph's form of nn.Dropout)."""
    x, p, train = (list(r.node.args) + [None, 0.5, True][len(r.node.args):])[:3]
    shape, dtype = _shape_dtype(x)
    on = bool(p) and train is not False
    keep = r.draw(shape, dtype, "keep", p, like=x) if on else None
    for user in list(r.node.users):
        index = user.args[1]
        if index == 0:
            value = r.call(aten.mul.Tensor, x, keep) if on else x
        else:
            value = r.call(aten.ne.Scalar, keep, 0) if on else r.call(aten.ones_like.default, x, dtype=torch.bool)
        user.replace_all_uses_with(value)
        r.gm.graph.erase_node(user)
    return None


def _bernoulli(r: _Rewriter) -> fx.Node:
    x = r.node.args[0]
    shape, dtype = _shape_dtype(x)
    u = r.draw(shape, dtype, "uniform", like=x)
    return r.call(aten._to_copy.default, r.call(aten.lt.Tensor, u, x), dtype=dtype)


def _bernoulli_p(r: _Rewriter) -> fx.Node:
    x, p = r.node.args[0], r.node.kwargs.get("p", r.node.args[1] if len(r.node.args) > 1 else 0.5)
    shape, dtype = _shape_dtype(x)
    return r.draw(shape, dtype, "bernoulli", p, like=x)


def _fresh(distribution: str) -> Callable[[_Rewriter], fx.Node]:
    """rand / randn (size, dtype=...): a draw of the output's shape."""
    def rule(r: _Rewriter) -> fx.Node:
        shape, dtype = _shape_dtype(r.node)
        return r.draw(shape, dtype, distribution)
    return rule


def _like(distribution: str) -> Callable[[_Rewriter], fx.Node]:
    """rand_like / randn_like (x): a draw of x's shape, with x's batch dim."""
    def rule(r: _Rewriter) -> fx.Node:
        shape, dtype = _shape_dtype(r.node)
        return r.draw(shape, dtype, distribution, like=r.node.args[0])
    return rule


def _uniform(r: _Rewriter) -> fx.Node:
    """uniform(x, from, to): router noise is written this way (``empty_like(x).uniform_(a, b)``)."""
    x, low, high = (list(r.node.args) + [None, 0.0, 1.0][len(r.node.args):])[:3]
    shape, dtype = _shape_dtype(r.node)
    return r.draw(shape, dtype, "uniform", r.node.kwargs.get("from", low), r.node.kwargs.get("to", high), like=x)


def _normal(r: _Rewriter) -> fx.Node:
    """normal_functional(x, mean, std)."""
    x, mean, std = (list(r.node.args) + [None, 0.0, 1.0][len(r.node.args):])[:3]
    shape, dtype = _shape_dtype(r.node)
    return r.draw(shape, dtype, "normal", r.node.kwargs.get("mean", mean), r.node.kwargs.get("std", std), like=x)


def _bernoulli_p_like(r: _Rewriter) -> fx.Node:
    """bernoulli_(x, p): x's shape and dtype, drawn with probability p."""
    x = r.node.args[0]
    p = r.node.kwargs.get("p", r.node.args[1] if len(r.node.args) > 1 else 0.5)
    shape, dtype = _shape_dtype(x)
    return r.draw(shape, dtype, "bernoulli", p, like=x)


def _exponential(r: _Rewriter) -> fx.Node:
    """exponential(x, lambd): x's shape and dtype (Gumbel-style router sampling, ``empty_like(x).exponential_()``)."""
    x = r.node.args[0]
    lambd = r.node.kwargs.get("lambd", r.node.args[1] if len(r.node.args) > 1 else 1.0)
    shape, dtype = _shape_dtype(x)
    return r.draw(shape, dtype, "exponential", lambd, like=x)


def _attention_dropout(r: _Rewriter) -> fx.Node:
    """scaled_dot_product_attention with dropout_p > 0 (Hugging Face GPT-2 and BERT by default): the
    fused kernel draws its mask from torch's generator, so the attention is written out as the math
    PyTorch documents -- softmax(q k^T * scale + mask) dropped out, times v -- with the dropout a
    counter-based draw over the [.., L, S] weights. Memory: the weights, as eager attention holds them."""
    given = sdpa_args(r.node)
    q, k, v = given["query"], given["key"], given["value"]
    mask, p = given["attn_mask"], float(given["dropout_p"])
    causal, scale, gqa = bool(given["is_causal"]), given["scale"], bool(given["enable_gqa"])
    qv, kv = val(q), val(k)
    if scale is None:
        scale = 1.0 / float(qv.shape[-1]) ** 0.5
    if gqa and qv.dim() >= 3 and qv.shape[-3] != kv.shape[-3]:
        repeats = qv.shape[-3] // kv.shape[-3]
        k = r.call(aten.repeat_interleave.self_int, k, repeats, -3)
        v = r.call(aten.repeat_interleave.self_int, v, repeats, -3)
    scores = r.call(aten.mul.Scalar, r.call(aten.matmul.default, q, r.call(aten.transpose.int, k, -2, -1)), scale)
    length, keys = int(qv.shape[-2]), int(kv.shape[-2])
    if causal:
        seen = r.call(aten.tril.default, r.call(aten.ones.default, [length, keys], dtype=torch.bool,
                                                device=qv.device))
        scores = r.call(aten.masked_fill.Scalar, scores, r.call(aten.logical_not.default, seen), float("-inf"))
    if isinstance(mask, fx.Node):
        if val(mask).dtype == torch.bool:
            scores = r.call(aten.masked_fill.Scalar, scores, r.call(aten.logical_not.default, mask), float("-inf"))
        else:
            scores = r.call(aten.add.Tensor, scores, mask)
    weights = r.call(aten._softmax.default, scores, -1, False)
    shape, dtype = _shape_dtype(weights)
    dropped = r.call(aten.mul.Tensor, weights, r.draw(shape, dtype, "keep", p, like=weights))
    return r.call(aten.matmul.default, dropped, v)


# In-place draws into a tensor (``empty_like(x).uniform_(a, b)``): its later readers read the draw.
IN_PLACE = {aten.uniform_.default: _uniform, aten.normal_.default: _normal, aten.bernoulli_.float: _bernoulli_p_like,
            aten.exponential_.default: _exponential}

RANDOM_RULES: dict[object, Callable[[_Rewriter], fx.Node | None]] = {
    **IN_PLACE,
    aten.dropout.default: _dropout,
    aten.native_dropout.default: _native_dropout,
    aten.bernoulli.default: _bernoulli,
    aten.bernoulli.p: _bernoulli_p,
    aten.rand.default: _fresh("uniform"),
    aten.randn.default: _fresh("normal"),
    aten.rand_like.default: _like("uniform"),
    aten.randn_like.default: _like("normal"),
    aten.uniform.default: _uniform,
    aten.normal_functional.default: _normal,
    aten.exponential.default: _exponential,
    aten.scaled_dot_product_attention.default: _attention_dropout,  # only with dropout_p > 0 (is_random)
}


def is_random(node: fx.Node) -> bool:
    """Draws from torch's generator (not usc's counter-based one)."""
    target = node.target
    if target in RANDOM_ONLY_WITH_DROPOUT:  # attention draws only when its dropout_p is non-zero
        return _dropout_p(node) != 0.0
    if target in RNN_OPS:  # between layers, in training, when its dropout is non-zero
        return _rnn_draws(node)
    if target in RANDOM_RULES:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags \
        and target is not DRAW


# Attention ops tagged as seeded because of their optional dropout: random only with dropout_p > 0.
RANDOM_ONLY_WITH_DROPOUT = {aten.scaled_dot_product_attention.default}


# Recurrent ops tagged as seeded because of their dropout between layers.
RNN_OPS = {op for name in ("lstm", "gru", "rnn_tanh", "rnn_relu") for op in
           (getattr(aten, name).input, getattr(aten, name).data)}


def _rnn_draws(node: fx.Node) -> bool:
    """An RNN op draws (its dropout masks between layers) only in training, with more than one layer
    and a non-zero dropout; a value not known while tracing counts as a draw."""
    args = dict(zip((a.name for a in node.target._schema.arguments), node.args))
    args.update(node.kwargs)
    layers, dropout, train = args.get("num_layers"), args.get("dropout"), args.get("train")
    known = all(isinstance(v, (bool, int, float)) for v in (layers, dropout, train))
    return not known or bool(train and layers > 1 and dropout != 0.0)


def _dropout_p(node: fx.Node) -> float:
    value = sdpa_args(node)["dropout_p"]
    return value if isinstance(value, (int, float)) else float("nan")


def random_ops_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace every random op by a counter-based draw (see the module docstring)."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and is_random(n)]
    if not found:
        return gm
    for op, node in enumerate(found):
        rule = RANDOM_RULES.get(node.target)
        if rule is None:
            raise _no_counter_form(node)
        new = rule(_Rewriter(gm, node, op, int(ctx.plan.get("seed"))))
        if node.target in IN_PLACE:
            _read_after(gm, node, node.args[0], new)
        if new is not None:  # None: the rule rewired the op's users itself
            node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _read_after(gm: fx.GraphModule, node: fx.Node, written: fx.Node, value: fx.Node) -> None:
    """Readers of the tensor an in-place draw wrote, after the write, read the draw."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    written.replace_all_uses_with(value, delete_user_cb=lambda user: order.get(user, -1) > order[node])


def _no_counter_form(node: fx.Node) -> CompileError:
    where, src = module_path(node) or "<root>", user_source(node)
    supported = ", ".join(sorted(str(t).replace("aten.", "") for t in RANDOM_RULES))
    return CompileError(
        f"{node.target} in module '{where}'{f' ({src})' if src else ''} draws random numbers from torch's "
        f"generator, whose values would differ between ranks and from one device\n  fix: write it with an op usc "
        f"draws counter-based ({supported}), or move it out of forward")


__all__ = ["random_ops_pass", "is_random", "RANDOM_RULES", "RANDOM_ONLY_WITH_DROPOUT", "KEY_MODULE", "draw"]
