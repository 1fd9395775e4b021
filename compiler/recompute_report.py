"""What recompute keeps and recomputes, read from the compiled graph (its region bodies).

A region (``usc.runtime.recompute.Recompute``, cut by passes/recompute.py) keeps its inputs and,
under selective recompute, the outputs of its matmul nodes; every other tensor it makes is
recomputed in backward. Bytes are this rank's local tensor sizes (from the symbolic/global shapes
and the layouts), the sizes the tensors have when they exist.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from .ir import META, MeshSpec
from usc.runtime.sizes import human_bytes, shape_bytes

SAVED_DECISIONS = ("input", "kept")


@dataclass(frozen=True)
class RecomputeRecord:
    """One tensor of a recompute region: 'input' and 'kept' are saved, 'recomputed' is not."""

    block: str
    node: str
    op: str
    decision: str  # "input" | "kept" | "recomputed"
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    reason: str = ""


def region_bodies(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """(block label, body) of every recompute region of a program (pipeline stages included)."""
    parts = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
    out = []
    for part in parts:
        for node in part.graph.nodes:
            if node.op == "call_module":
                module = part.get_submodule(node.target)
                body = getattr(module, "body", None)
                if isinstance(body, fx.GraphModule) and hasattr(module, "kept"):
                    out.append((module.label, body))
    return out


def recompute_records(gm: fx.GraphModule, mesh: MeshSpec) -> list[RecomputeRecord]:
    records = []
    for label, body in region_bodies(gm):
        for node in body.graph.nodes:
            decision = "input" if node.op == "placeholder" else node.meta.get(META) and \
                node.meta[META].extra.get("recompute")
            value = node.meta.get("val")
            if node.meta.get("usc_region_input") == "param":
                continue  # parameters are not activations
            if decision not in ("input", "kept", "recomputed") or not isinstance(value, torch.Tensor) \
                    or (decision == "recomputed" and is_view(node)):  # a view owns no memory
                continue
            ann = node.meta.get(META)
            shape = ann.layout.local_shape(tuple(value.shape), mesh) if ann is not None else tuple(value.shape)
            reason = "saved as the region's input" if decision == "input" else ann.extra.get("recompute_reason", "")
            records.append(RecomputeRecord(label, node.name, _op_name(node), decision, shape,
                                           str(value.dtype).replace("torch.", ""), shape_bytes(shape, value.dtype),
                                           reason))
    return records


def recompute_summary(records: list[RecomputeRecord]) -> dict[str, dict]:
    """decision -> {'tensors': n, 'bytes': b, 'ops': {op: n}} (what usc-lint prints)."""
    out: dict[str, dict] = {}
    for r in records:
        entry = out.setdefault(r.decision, {"tensors": 0, "bytes": 0, "ops": defaultdict(int)})
        entry["tensors"] += 1
        entry["bytes"] += r.nbytes
        entry["ops"][r.op] += 1
    return {k: {**v, "ops": dict(v["ops"])} for k, v in out.items()}


def is_view(node: fx.Node) -> bool:
    """The node's value aliases an input (view, transpose, chunk pieces ...): it owns no memory."""
    target = node.target
    if target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and source.op == "call_function" and is_view(source)
    return bool(getattr(target, "is_view", False)) or target is torch.ops.aten._unsafe_view.default


def _op_name(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "call_module":
        return type(node.graph.owning_module.get_submodule(node.target)).__name__
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def render_recompute(report) -> list[str]:
    """The usc-lint lines: what regions keep and recompute, and activation bytes per mode."""
    lines = []
    summary = report.recompute_summary
    if summary:
        blocks = len({r.block for r in report.recompute})
        what = "recompute rules" if report.recompute_mode == "none" else f"recompute={report.recompute_mode}"
        lines.append(f"{what}: regions in {blocks} module(s); per rank and microbatch:")
        for decision, what in (("input", "saved (region inputs)"), ("kept", "saved (matmul outputs)"),
                               ("recomputed", "recomputed in backward")):
            if decision in summary:
                s = summary[decision]
                ops = ", ".join(f"{op} x{n}" for op, n in sorted(s["ops"].items(), key=lambda kv: -kv[1])[:6])
                lines.append(f"  {what:<24} {s['tensors']:>4} tensors {human_bytes(s['bytes']):>10}  ({ops})")
    by_mode = report.activation_bytes_by_recompute
    if by_mode:
        parts = [f"{mode} {human_bytes(n)}" + (" <- this plan" if mode == report.recompute_mode else "")
                 for mode, n in by_mode.items()]
        lines.append("activations saved per rank by recompute mode (estimated): " + ", ".join(parts))
    return lines
