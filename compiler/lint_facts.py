"""Facts about a traced model that plan checks need: attention heads, vocabularies, experts, the
batch and the sequence. Read from the ATen graph (shapes are global), so they hold for any model
the tracer accepts, not only ours.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

import torch
import torch.fx as fx

from usc.runtime.op_classes import LINEARS

from .trace import Traced, module_path

aten = torch.ops.aten
_EXPERT = re.compile(r"^(.*?\bexperts)\.(\d+)(\.|$)")


@dataclass(frozen=True)
class Attention:
    module: str
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class ModelFacts:
    attention: tuple[Attention, ...]
    vocab: tuple[tuple[str, int], ...]  # (embedding module, rows)
    experts: tuple[tuple[str, int], ...]  # (experts container module, number of experts)
    batch: int | None  # dim 0 of the first batched input (one microbatch)
    sequence: int | None  # dim 1 of the first input with two or more dims
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (name, shape) of the model inputs


def _shape(node) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def _nearest_linear(start: fx.Node) -> fx.Node | None:
    """The closest linear producing ``start`` (breadth first backwards): the projection of q/k/v."""
    seen, todo = {start}, deque([start])
    while todo:
        node = todo.popleft()
        if node.op == "call_function" and node.target in LINEARS:
            return node
        for x in node.all_input_nodes:
            if x not in seen:
                seen.add(x)
                todo.append(x)
    return None


def _projected_heads(k: fx.Node, head_dim: int) -> int | None:
    """Heads of k/v before any repeat (GQA): the producing linear's output width / head_dim."""
    linear = _nearest_linear(k)
    out = _shape(linear) if linear is not None else None
    return out[-1] // head_dim if out and head_dim and out[-1] % head_dim == 0 else None


def attention_facts(gm: fx.GraphModule) -> tuple[Attention, ...]:
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
            continue
        q, k = _shape(node.args[0]), node.args[1]
        heads, head_dim = q[1], q[-1]
        kv = _projected_heads(k, head_dim) or _shape(k)[1]
        found.append(Attention(module_path(node), heads, kv))
    return tuple(found)


def vocab_facts(gm: fx.GraphModule) -> tuple[tuple[str, int], ...]:
    return tuple((module_path(n), _shape(n.args[0])[0]) for n in gm.graph.nodes
                 if n.op == "call_function" and n.target == aten.embedding.default and _shape(n.args[0]))


def expert_facts(traced: Traced) -> tuple[tuple[str, int], ...]:
    """Containers named ``experts`` holding numbered sub-modules (Mixtral, DeepSeek-MoE style)."""
    indices: dict[str, set[int]] = {}
    for path in traced.module_types:
        match = _EXPERT.match(path)
        if match:
            indices.setdefault(match.group(1), set()).add(int(match.group(2)))
    return tuple((path, len(ids)) for path, ids in indices.items())


def model_facts(traced: Traced) -> ModelFacts:
    nodes = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    inputs = tuple((name, _shape(nodes[name])) for name in traced.user_inputs if _shape(nodes[name]))
    batch = next((s[0] for _, s in inputs if len(s) >= 1), None)
    sequence = next((s[1] for _, s in inputs if len(s) >= 2), None)
    return ModelFacts(attention_facts(traced.gm), vocab_facts(traced.gm), expert_facts(traced), batch, sequence,
                      inputs)
