"""Attention masks: a mask proven causal becomes ``is_causal=True``, under every plan.

Hugging Face decoders (transformers 5, sdpa and eager) build their causal mask inside forward from
``arange`` positions (comparisons of key and query positions, and a packed-sequence check on
positions that restart), broadcast to ``[B, 1, S, S]``, as a boolean or an additive
(``-inf`` / ``finfo.min``) tensor. Run eagerly with nothing padded they give sdpa no mask and
``is_causal=True``; traced, they keep the mask (their skip is off while tracing). As an explicit
mask it costs every layer a ``[B, 1, S, S]`` float copy that sdpa makes and saves for backward
(measured: 2.1 of 49.4 MB of a 4-layer HF Llama's activations at 4 x 256 tokens) and forgoes the
kernels' causal path (flash attention on CUDA); under cp it would also have to be sliced per ring
step and forgo the ring's causal fast path (skipped future blocks, zig-zag balance).

The proof is by evaluation, not by pattern: the mask's whole ancestry is a pure function of no
input, parameter or buffer (factories such as ``arange``, shapes and deterministic ops), so its
value is a constant fixed by the traced shapes. That constant is computed once on the CPU and
compared element by element with the lower-triangular mask; only an exact match (visible entries
True / 0, hidden ones False / -inf / the dtype's most negative finite value, every batch and
head) takes the causal path. Anything else -- a mask built from the batch (padding, packed
documents from ``position_ids``), a sliding window shorter than the sequence, a mask too large to
evaluate here -- stays an explicit mask, which ring, zig-zag and Ulysses attention slice by the
query and key blocks each rank sees (``expansions.context_parallel_attention``).

Requires: the traced graph (global shapes, before propagation).
Establishes: every ``scaled_dot_product_attention`` whose mask is a constant equal to the causal
    mask has no mask and ``is_causal=True``; the mask's now unused ancestors are gone.
"""

from __future__ import annotations

from math import prod

import torch
import torch.fx as fx

from .graph_edit import val

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default

# The largest tensor the proof evaluates, in bytes: a bool [1, 1, 16384, 16384] mask (or
# [8, 1, 4096, 4096]) is 2^28. Beyond it the mask stays explicit (correct, without the causal fast
# path); the cost of the proof is compile-time memory and one pass over the mask.
MAX_BYTES = 1 << 28


def attention_masks_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace masks proven causal by ``is_causal=True`` (see the module docstring)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is SDPA and is_causal_mask(sdpa_mask(node), node):
            _use_causal_flag(gm, node)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def sdpa_args(node: fx.Node) -> dict:
    """Every argument of a ``scaled_dot_product_attention`` node by name, defaults filled in."""
    values = dict(zip(SDPA_ARGS, SDPA_DEFAULTS))
    values.update(zip(SDPA_ARGS, node.args))
    values.update(node.kwargs)
    return values


def sdpa_mask(node: fx.Node) -> fx.Node | None:
    if len(node.args) > 3:
        return node.args[3]
    return node.kwargs.get("attn_mask")


def is_causal_mask(mask, node: fx.Node) -> bool:
    """True only when ``mask`` is a graph constant whose value equals the causal mask of ``node``'s
    query and key lengths, for every broadcast batch and head."""
    if not isinstance(mask, fx.Node):
        return False
    q, k = val(node.args[0]), val(node.args[1])
    if q is None or k is None or q.shape[-2] != k.shape[-2]:
        return False
    ancestry = _ancestry(mask)
    if ancestry is None:
        return False
    key = (_signature(ancestry), int(q.shape[-2]))
    if key not in _PROVEN:  # every layer reads one mask, and each compile of the model (a lint's stamps) has it
        value = constant_value(mask)
        if len(_PROVEN) >= 64:
            _PROVEN.pop(next(iter(_PROVEN)))
        _PROVEN[key] = value is not None and equals_causal(value, int(q.shape[-2]))
    return _PROVEN[key]


_PROVEN: dict[str, bool] = {}  # the proof's result by the mask's program and length (a second of CPU at 16 x 4096^2)


def _signature(ancestry: list[fx.Node]) -> str:
    """The mask's program as text: each op with its arguments (earlier ops by position) and shape."""
    at = {n: i for i, n in enumerate(ancestry)}
    return repr([(str(n.target), fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", at[a])),
                  _shape_of(n)) for n in ancestry])


def _shape_of(n: fx.Node):
    value = val(n)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)


def equals_causal(mask: torch.Tensor, length: int) -> bool:
    """Element-wise: the visible entries are exactly the lower triangle (diagonal included)."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False  # a row or column dim of 1 broadcasts one pattern to every position: not causal
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == lower).all())
    if not mask.is_floating_point():
        return False  # sdpa takes bool or float masks only
    hidden = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    return bool(((mask == 0) == lower).all() and (hidden == ~lower).all())


# ----------------------------------------------------------------------- constant evaluation

def constant_value(node: fx.Node) -> torch.Tensor | None:
    """The value of ``node`` when it depends on nothing but constants and shapes (else None),
    computed on the CPU."""
    ancestry = _ancestry(node)
    if ancestry is None:
        return None
    env: dict[fx.Node, object] = {}
    try:
        for n in ancestry:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*args, **_on_cpu(kwargs))
    except Exception:  # noqa: BLE001 - an op that will not run here just means "not proven"
        return None
    value = env[node]
    return value if isinstance(value, torch.Tensor) else None


def _ancestry(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and its ancestors in graph order, if all are deterministic aten ops of bounded size."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if not _foldable(n):
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _foldable(n: fx.Node) -> bool:
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False  # placeholders (inputs, parameters, buffers), modules, Python callables
    if torch.Tag.nondeterministic_seeded in n.target.tags:
        return False
    value = val(n)
    values = value if isinstance(value, (tuple, list)) else [value]
    return all(prod(v.shape) * v.element_size() <= MAX_BYTES for v in values if isinstance(v, torch.Tensor))


def _on_cpu(kwargs: dict) -> dict:
    """Factories name the model's device (meta for plan-only models, cuda): evaluate on the CPU."""
    return {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}


# ----------------------------------------------------------------------- the rewrite

def _use_causal_flag(gm: fx.GraphModule, node: fx.Node) -> None:
    values = sdpa_args(node)
    mask = values["attn_mask"]
    node.args = (values["query"], values["key"], values["value"], None, values["dropout_p"], True)
    node.kwargs = {k: values[k] for k in ("scale", "enable_gqa") if k in node.kwargs or values[k]}
    _erase_unused(gm, mask)


def _erase_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """The mask's ancestors that nothing else reads (they are side-effect free: see _foldable)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        stack.extend(inputs)
