"""Input layouts: where the plan puts each parameter, buffer and model input on the mesh.

Data parallelism shards every model input on its first (batch) dim over dp. Tensor parallelism
shards weights as the plan's rules say, or as the Megatron pairs found in the graph suggest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from usc.compiler.ir import Layout, MeshSpec
from usc.compiler.trace import Traced, module_path

from .tensor_parallel import (PairGroup, TPChoice, find_pairs, is_token_embedding, style_layouts,
                              weight_param)

aten = torch.ops.aten
R = Replicate()
DATA_AXES = ("dp", "ep")  # the batch is split over both: dp=4 ep=2 is a mesh dp=2 x ep=2


@dataclass
class LayoutChoice:
    layouts: dict[str, Layout]
    choices: list[TPChoice] = field(default_factory=list)
    groups: list[PairGroup] = field(default_factory=list)


def batch_layouts(traced: Traced, plan, mesh: MeshSpec) -> dict[str, Layout]:
    """Every input's dim 0 split over dp (and ep), dim 1 over cp where it is the sequence: the dim 1
    of the first input with two dims (the token ids). An input whose dim 1 is something else (a
    classifier's multi-label targets [B, labels]) is whole on cp."""
    n = len(mesh.axes)
    out = {}
    values = [traced.placeholder(name).meta.get("val") for name in traced.user_inputs]
    sequence = next((v.shape[1] for v in values if isinstance(v, torch.Tensor) and v.dim() > 1), None)
    for name in traced.user_inputs:
        placements = [R] * n
        value = traced.placeholder(name).meta.get("val")
        dp = mesh.size("dp") * mesh.size("ep")  # ep ranks are carved from the dp ranks
        if dp > 1 and isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % dp:
                mb = int(plan.get("mb"))  # the trace holds one microbatch of the batch
                what = f"the batch of input '{name}' (shape {list(value.shape)})" if mb == 1 else (
                    f"the microbatch of input '{name}' (shape {list(value.shape)}: the batch of "
                    f"{value.shape[0] * mb} in mb={mb} microbatches)")
                raise plan.error_at("dp", f"dp={dp} does not divide {what}",
                                    hint=f"pass a global batch whose first dim is a multiple of {dp * mb}"
                                         f"{f' (dp x mb)' if mb > 1 else ''}")
            for axis in DATA_AXES:
                if mesh.size(axis) > 1:
                    placements[mesh.axes.index(axis)] = Shard(0)
        cp = mesh.size("cp")
        if cp > 1 and isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[1] == sequence:
            pieces = 2 * cp if "cp" in mesh.zigzag else cp
            if value.shape[1] % pieces:
                raise plan.error_at("cp", f"cp={cp} needs the sequence of input '{name}' (dim 1 of "
                                          f"{list(value.shape)}) to divide into {pieces} pieces",
                                    hint=f"use a sequence length that is a multiple of {pieces}")
            placements[mesh.axes.index("cp")] = Shard(1)
        out[name] = Layout(tuple(placements))
    return out


def _weighted_nodes(gm: fx.GraphModule, params: set[str]) -> list[fx.Node]:
    out = []
    for node in gm.graph.nodes:
        if node.target == aten.linear.default and weight_param(node)[0].name in params:
            out.append(node)
        elif node.target == aten.embedding.default and getattr(node.args[0], "name", None) in params:
            out.append(node)
    return out


def _weight_shape(node: fx.Node) -> tuple[int, ...]:
    """As the op reads it: [out, in] for a linear, also one over a transposed (Conv1D) weight."""
    weight = node.args[1] if node.target == aten.linear.default else node.args[0]
    return tuple(weight.meta["val"].shape)


def _split_dim(style: str, node: fx.Node) -> int | None:
    if style in ("colwise", "vocab"):
        return 0 if node.target == aten.linear.default or style == "vocab" else 1
    if style == "rowwise":
        return 1
    return None


def tp_layouts(traced: Traced, plan, mesh: MeshSpec, replicated: dict[int, str],
               replicated_cols: dict[str, str] | None = None) -> LayoutChoice:
    """Per-parameter tp placements from explicit rules, then from the Megatron pairs.

    ``replicated``: pair groups (by index) kept whole after an earlier attempt failed, with why;
    ``replicated_cols``: single column-parallel linears (by node name) kept whole, e.g. the k/v
    projections when tp does not divide the key/value heads (their pair stays split).
    """
    replicated_cols = replicated_cols or {}
    tp = mesh.size("tp")
    result = LayoutChoice({})
    if tp == 1:
        return result
    params = {s.placeholder for s in traced.state if s.kind == "param"}
    gm = traced.gm
    groups, heads = find_pairs(gm, params)
    result.groups = groups
    auto: dict[fx.Node, tuple[str, str]] = {}
    for index, group in enumerate(groups):
        indivisible = {c.name: why for c in group.cols if (why := _indivisible(c, "colwise", tp))}
        whole = replicated.get(index) or _indivisible(group.row, "rowwise", tp)
        if whole or len(indivisible) == len(group.cols):
            for node in group.cols + [group.row]:
                auto[node] = ("replicate", whole or next(iter(indivisible.values())))
            continue
        names = ", ".join(module_path(c).rsplit(".", 1)[-1] for c in group.cols)
        for col in group.cols:
            if col.name in replicated_cols or col.name in indivisible:
                auto[col] = ("replicate", replicated_cols.get(col.name) or indivisible[col.name])
                continue
            auto[col] = ("colwise", f"column-parallel; pairs with row-parallel {module_path(group.row)} "
                                    f"(one all-reduce per direction for {names} -> "
                                    f"{module_path(group.row).rsplit('.', 1)[-1]})")
        auto[group.row] = ("rowwise", f"row-parallel; closes the pair opened by {names}")
    for head in heads:
        # a classifier head of 5 labels, say: automatic TP keeps it whole rather than refusing the plan
        indivisible = _indivisible(head, "vocab", tp)
        auto[head] = ("replicate", indivisible) if indivisible else (
            "vocab", "feeds the loss: logits split on the vocabulary, vocab-parallel cross-entropy")
    user_inputs = set(traced.user_inputs)
    for node in _weighted_nodes(gm, params):
        if node.target == aten.embedding.default and node not in auto and is_token_embedding(node, user_inputs):
            # a vocabulary tp does not divide (GPT-2's 50257): kept whole, as a head is; usc-lint says
            # what that costs and how to pad
            indivisible = _indivisible(node, "vocab", tp)
            auto[node] = ("replicate", indivisible) if indivisible else (
                "vocab", "token embedding: each rank holds a vocabulary slice")
    _assign(result, plan, mesh, _weighted_nodes(gm, params), auto, tp)
    return result


def _indivisible(node: fx.Node, style: str, tp: int) -> str | None:
    """Why automatic TP must keep this linear whole (its split dimension is not a multiple of tp),
    or None. Explicit rules are not softened this way: they raise in `_assign`."""
    dim = _split_dim(style, node)
    shape = _weight_shape(node)
    if dim is None or shape[dim] % tp == 0:
        return None
    return f"kept replicated: tp={tp} does not divide dim {dim} (size {shape[dim]}) of its weight {list(shape)}"


def _assign(result: LayoutChoice, plan, mesh: MeshSpec, nodes, auto, tp: int) -> None:
    n, tp_index = len(mesh.axes), mesh.axes.index("tp")
    for node in nodes:
        path = module_path(node)
        explicit = plan.tp_rule(path)
        if explicit is not None:
            rule, style = explicit
            reason, is_explicit = f"plan rule '{rule}'", True
        elif node in auto:
            (style, reason), rule, is_explicit = auto[node], None, False
        else:
            continue
        dim = _split_dim(style, node)
        shape = _weight_shape(node)
        if dim is not None and shape[dim] % tp:
            msg = (f"tp={tp} does not divide dim {dim} (size {shape[dim]}) of the weight of '{path}' "
                   f"(shape {list(shape)}) for {style}")
            raise plan.error_at(rule if rule is not None else "tp", msg,
                                hint=f"use a tp size that divides {shape[dim]}, or add a rule '{path}: replicate'")
        for placeholder, placements in style_layouts(style, node, n, tp_index).items():
            layout = Layout(placements)
            if result.layouts.get(placeholder, layout) != layout:
                raise plan.error_at(rule if rule is not None else "tp",
                                    f"the weight of '{path}' is shared with another module that splits it "
                                    f"differently", hint="give both modules the same rule")
            result.layouts[placeholder] = layout
        result.choices.append(TPChoice(path, style, reason, is_explicit))


def merge_layouts(mesh: MeshSpec, *parts: dict[str, Layout]) -> dict[str, Layout]:
    """Combine per-axis choices: a later part's non-replicated placement on an axis wins."""
    merged: dict[str, Layout] = {}
    for part in parts:
        for name, layout in part.items():
            base = merged.get(name, Layout.replicated(len(mesh.axes)))
            placements = tuple(q if not isinstance(q, Replicate) else p
                               for p, q in zip(base.placements, layout.placements))
            merged[name] = Layout(placements)
    return merged
