"""Cost model of fusion: kernels launched and bytes moved to and from memory per step, for the fused
regions of a program, as eager ops and as fused kernels (read by the report).

Counted from the per-rank shapes and dtypes of the region's nodes; a model, not a measurement:
- eager forward: one kernel per op (views and ``detach`` none), reading its tensor inputs and
  writing its output;
- eager backward: per op, one kernel per input that needs a gradient (reads the output's gradient
  and the op's inputs, writes that gradient), one more to sum a broadcast input's gradient, and one
  add per extra use of a value (gradient accumulation);
- fused forward: one kernel reading each region input once and writing each output once;
- fused backward: one kernel reading the inputs and the outputs' gradients and writing one gradient
  per input, plus one sum per input loaded by broadcast (a norm weight's gradient over rows).
Fused nodes are found by duck typing (a module with ``fused_region`` and ``kernel``), so the
compiler imports nothing of the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.fx as fx

from .ir import META, MeshSpec

FREE_TARGETS = ("aten.detach.default", "aten.view.default", "aten._unsafe_view.default")
# ATen runs cross-entropy as log_softmax + nll_loss: forward writes and reads the [rows, classes]
# log-probabilities; backward writes nll's one-hot gradient, then log_softmax_backward reads it and
# the log-probabilities and writes the logits' gradient. (kernels, full-logits passes) per direction.
TWO_KERNEL_OPS = {"aten.cross_entropy_loss.default": ((2, 3), (2, 4))}


@dataclass(frozen=True)
class Traffic:
    kernels: int = 0
    bytes: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.kernels + other.kernels, self.bytes + other.bytes)


@dataclass(frozen=True)
class KernelInfo:
    name: str
    source: str
    used_by: tuple[str, ...]  # module paths of the regions running it


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def local_bytes(node, mesh: MeshSpec | None) -> int:
    value = _value(node)
    if value is None:
        return 0
    shape = tuple(value.shape)
    ann = node.meta.get(META)
    if mesh is not None and ann is not None and ann.layout is not None:
        shape = ann.layout.local_shape(shape, mesh)
    return prod(shape) * value.element_size()


def _needs_grad(node: fx.Node) -> bool:
    value, ann = _value(node), node.meta.get(META)
    return value is not None and value.dtype.is_floating_point and (ann is None or ann.needs_grad)


def eager_traffic(region: fx.GraphModule, mesh: MeshSpec | None) -> Traffic:
    """Forward and backward of the region's ops run one by one (see the module docstring)."""
    total = Traffic()
    for node in region.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = [a for a in node.all_input_nodes if _value(a) is not None]
        out = local_bytes(node, mesh)
        reads = sum(local_bytes(a, mesh) for a in inputs)
        if str(node.target) in TWO_KERNEL_OPS:
            total += _two_kernel_op(node, out, reads, mesh)
            continue
        if str(node.target) not in FREE_TARGETS:
            total += Traffic(1, reads + out)
        total += _eager_backward(node, inputs, out, reads, mesh)
    for node in region.graph.nodes:  # gradient accumulation: one add per extra use
        uses = len([u for u in node.users if u.op == "call_function"])
        if uses > 1 and _needs_grad(node):
            total += Traffic(uses - 1, 3 * (uses - 1) * local_bytes(node, mesh))
    return total


def _two_kernel_op(node: fx.Node, out: int, reads: int, mesh) -> Traffic:
    (fwd_kernels, fwd_passes), (bwd_kernels, bwd_passes) = TWO_KERNEL_OPS[str(node.target)]
    logits = local_bytes(node.args[0], mesh)
    total = Traffic(fwd_kernels, fwd_passes * logits + (reads - logits) + out)
    if _needs_grad(node):
        total += Traffic(bwd_kernels, bwd_passes * logits + out)
    return total


def _eager_backward(node: fx.Node, inputs, out: int, reads: int, mesh) -> Traffic:
    if not _needs_grad(node) or str(node.target) in FREE_TARGETS:
        return Traffic()
    total = Traffic()
    for arg in inputs:
        if not _needs_grad(arg):
            continue
        own = local_bytes(arg, mesh)
        total += Traffic(1, out + reads + max(own, out))
        if own < out:  # broadcast input: its gradient is summed down
            total += Traffic(1, out + own)
    return total


def fused_traffic(module, node: fx.Node, mesh: MeshSpec | None) -> Traffic:
    """The fused node's forward kernel and its backward kernel (plus broadcast gradient sums)."""
    region = module.fused_region
    placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
    outputs = [o for o in next(n for n in region.graph.nodes if n.op == "output").args[0]]
    ins = sum(local_bytes(p, mesh) for p in placeholders)
    outs = sum(local_bytes(o, mesh) for o in outputs)
    total = Traffic(1, ins + outs)
    grads = [load for load in module.kernel.loads if load.grad]
    if not grads or not any(_needs_grad(o) for o in outputs):
        return total
    row = prod(module.row_shape) * (8 if module.kernel.compute_dtype == "float64" else 4)
    per_row = [row if load.domain == "vec" else row // max(module.row_shape[-1], 1) for load in grads]
    total += Traffic(1, ins + outs + sum(per_row))
    for load, written in zip(grads, per_row):
        own = local_bytes(placeholders[load.input], mesh)
        if own < written:
            total += Traffic(1, written + own)
    return total


def fused_nodes(gm: fx.GraphModule, parts) -> list[tuple[fx.Node, object]]:
    return [(node, part.get_submodule(node.target)) for part in parts for node in part.graph.nodes
            if node.op == "call_module" and hasattr(part.get_submodule(node.target), "fused_region")]


def fusion_summary(gm: fx.GraphModule, parts, mesh: MeshSpec | None, microbatches: int = 1) -> dict:
    """Per step (forward + backward, every microbatch): the fused regions' kernels and bytes, as
    eager ops and fused; empty when nothing is fused."""
    found = fused_nodes(gm, parts)
    if not found:
        return {}
    eager = sum((eager_traffic(m.fused_region, mesh) for _, m in found), Traffic())
    fused = sum((fused_traffic(m, n, mesh) for n, m in found), Traffic())
    return {"regions": len(found), "kernels_eager": eager.kernels * microbatches,
            "kernels_fused": fused.kernels * microbatches, "bytes_eager": eager.bytes * microbatches,
            "bytes_fused": fused.bytes * microbatches,
            "distinct_kernels": len({m.kernel.name for _, m in found})}


def kernel_sources(gm: fx.GraphModule, parts) -> list[KernelInfo]:
    """Each distinct generated kernel once, with the regions that run it."""
    by_name: dict[str, tuple[str, list[str]]] = {}
    for node, module in fused_nodes(gm, parts):
        source, users = by_name.setdefault(module.kernel.name, (module.kernel.source, []))
        users.append(module.label or node.name)
    return [KernelInfo(name, source, tuple(users)) for name, (source, users) in by_name.items()]
