"""A graph without hidden effects: every write is dataflow before the first pass.

``torch.export``'s training IR keeps an in-place write as a side effect: ``a[:, 0].mul_(3.0)``
is a ``mul_`` on a ``select`` whose result nothing reads, and ``self.count.add_(1)`` an ``add_``
on a buffer placeholder. Every pass treats the graph as dataflow (propagation drops nodes nobody
reads), so such writes were silently removed. Here a program with any mutating op is
functionalized by torch itself (``ExportedProgram.run_decompositions({})``: writes through views
become ``select_scatter`` / ``slice_scatter`` / ``copy`` / ``fill`` whose results later reads
use; ops usc has rules for, such as ``linear``, are kept). A program without writes is left
exactly as traced.

What functionalization turns into extra graph outputs is made explicit instead:
- a write to a buffer becomes a ``StateWrite`` node (``runtime/state_write.py``) at the end of the
  graph: the executor's buffer takes the new value after each forward, as on one device;
- a write to a user input is visible to every later read in the graph; the caller's own tensor is
  not updated (a rank holds a slice of it), which ``gm.meta`` records for the report's warnings.

Two more guarantees:
- ``distinct_inputs``: the same tensor passed twice (``example_inputs=(ids, ids)``) would be traced
  as one input read twice (export deduplicates by identity); later steps pass different tensors,
  so each repeat is traced from its own copy.
- ``verify_functional``: a mutating op left in a graph (a pass that wrote one, or a trace this module
  did not see) raises a CompileError naming the op and the user's source line. The pass runner
  runs it before the first pass and between passes.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.export.graph_signature import OutputKind

from .errors import CompileError
from .source_info import module_path, user_source

aten = torch.ops.aten

WRITE_KINDS = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)
INPUT_WRITES = "usc_input_writes"  # gm.meta key: user inputs the forward writes (names)
STATE_WRITE = "usc_state_write"  # node.meta key of a buffer's write-back: the buffer's name


class HiddenEffectError(CompileError):
    """A mutating op whose write nothing in the graph reads."""


def distinct_inputs(value, seen: set[int] | None = None):
    """``value`` with every repeat of a tensor already seen replaced by a copy (nested tuples,
    lists and dicts walked): traced inputs stay as many as the caller passes."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return value.clone()
        seen.add(id(value))
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(distinct_inputs(v, seen) for v in value)
    if isinstance(value, dict):
        return {k: distinct_inputs(v, seen) for k, v in value.items()}
    return value


def is_mutating(node: fx.Node) -> bool:
    """An ATen op whose schema writes one of its arguments (``mul_``, ``copy_``, ``index_put_``...)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def is_state_write(node: fx.Node) -> bool:
    """A buffer's write-back: an effect that no value reads, kept by every pass."""
    return bool(node.meta.get(STATE_WRITE))


def functionalize(exported):
    """``exported`` with every write as dataflow; the same object when it writes nothing."""
    if not any(is_mutating(n) for n in _all_nodes(exported.graph_module)):
        return exported  # (bodies of torch.no_grad regions included: an EMA buffer is written there)
    _refuse_overlapping_writes(exported.graph_module)
    return decomposed(exported)  # no_grad regions are inlined first (compiler/inline_regions.py)


def decomposed(exported):
    """``exported.run_decompositions({})``, without torch's own deprecation notice that it raises as it
    copies the program's pytree specs (torch 2.13): nothing the user or usc can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        return exported.run_decompositions({})


EXACT_OVERLAP_LIMIT = 2**26  # storage elements up to which overlap is checked element by element


class OverlappingWriteError(CompileError):
    """An in-place op that reads memory it writes: eager's result depends on the visiting order."""


def _refuse_overlapping_writes(gm: fx.GraphModule) -> None:
    """``a.add_(x[:, 0:1])`` where ``a = x[:, 0:2]``: eager PyTorch reads some elements after it
    wrote them (in an order it does not define), functionalization reads all before writing. Rather
    than train either silently, such a write is refused (PyTorch itself refuses some of them)."""
    for node in _all_nodes(gm):
        if not is_mutating(node) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        written = node.args[0].meta.get("val")
        read = [a.meta.get("val") for a in node.all_input_nodes[1:]]
        if _elementwise(node):  # reading the very element it writes is defined (``x[:, 0] *= s``)
            read = [r for r in read if not _same_elements(written, r)]
        if isinstance(written, torch.Tensor) and any(_overlap(written, r) for r in read):
            src = user_source(node)
            raise OverlappingWriteError(
                f"in-place op {node.target} in module '{module_path(node) or '<root>'}'{f' ({src})' if src else ''} "
                "reads memory it writes (a view of the same tensor): PyTorch's result then depends on the "
                "order it visits elements\n  fix: read from a copy, e.g. a.add_(b.clone())")


def _elementwise(node: fx.Node) -> bool:
    """A copy or a pointwise op: element i of the result reads element i of each tensor input."""
    target = node.target
    return target is torch.ops.aten.copy_.default or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)


def _same_elements(a, b) -> bool:
    """The same elements of the same storage, in the same order (a tensor and an alias of it)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset() \
        and a.shape == b.shape and a.stride() == b.stride()


def _overlap(a: torch.Tensor, b) -> bool:
    if not isinstance(b, torch.Tensor) or a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    spans = [_span(t) for t in (a, b)]
    if spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]:
        return False
    size = max(spans[0][1], spans[1][1]) + 1
    if size > EXACT_OVERLAP_LIMIT:
        return True  # too large to check element by element: a shared span is taken as overlap
    mask = torch.zeros(size, dtype=torch.bool)
    mask[_offsets(a)] = True
    return bool(mask[_offsets(b)].any())


def _span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.storage_offset(), t.storage_offset() + last


def _offsets(t: torch.Tensor) -> torch.Tensor:
    index = torch.full((), t.storage_offset(), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        index = index.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    return index.reshape(-1)


def differentiable_copies(gm: fx.GraphModule) -> bool:
    """``aten.copy(self, src)`` (a functionalized ``copy_``) has no derivative in eager autograd:
    write it as what it computes, ``src`` cast to self's dtype and broadcast to self's shape.
    True when the graph changed."""
    aten = torch.ops.aten
    copies = [n for n in gm.graph.nodes if n.target is aten.copy.default]
    for node in copies:
        target, src = node.args[0], node.args[1]
        want, have = target.meta["val"], src.meta["val"]
        with gm.graph.inserting_before(node):
            value = src
            if have.dtype != want.dtype:
                value = _like(gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": want.dtype}),
                              node, have.to(want.dtype))
            if tuple(have.shape) != tuple(want.shape):
                value = _like(gm.graph.call_function(aten.expand.default, (value, list(want.shape))), node, want)
            value = _like(gm.graph.call_function(aten.clone.default, (value,)), node, want)
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
    return bool(copies)


def _like(new: fx.Node, old: fx.Node, val) -> fx.Node:
    new.meta.update({k: v for k, v in old.meta.items() if k != "val"})
    new.meta["val"] = val
    return new


def user_output_specs(exported) -> list:
    """The output specs that are the forward's own result (not a write functionalization added)."""
    return [o for o in exported.graph_signature.output_specs if o.kind not in WRITE_KINDS]


def explicit_writes(exported) -> fx.GraphModule:
    """The graph module with functionalization's write outputs turned into explicit nodes: a
    ``StateWrite`` per written buffer; a written user input is recorded in ``gm.meta``."""
    from usc.runtime.state_write import StateWrite

    gm = exported.graph_module
    changed = differentiable_copies(gm)
    specs = exported.graph_signature.output_specs
    if not any(o.kind in WRITE_KINDS for o in specs):
        if changed:  # the Python torch.export generated is the graph's otherwise
            gm.recompile()
        return gm
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    by_target = {s.target: s.arg.name for s in exported.graph_signature.input_specs if s.target is not None}
    kept, inputs_written = [], []
    for spec, value in zip(specs, values):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            buffer = placeholders[by_target[spec.target]]
            with gm.graph.inserting_before(output):
                name = f"write_{buffer.name}"
                gm.add_submodule(name, StateWrite(spec.target, buffer.name))
                node = gm.graph.call_module(name, (buffer, value))
            node.meta.update({k: value.meta[k] for k in ("stack_trace", "nn_module_stack") if k in value.meta})
            node.meta["val"] = None
            node.meta[STATE_WRITE] = spec.target
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            inputs_written.append(spec.target)
        else:
            kept.append(value)
    output.args = (tuple(kept),)
    gm.meta[INPUT_WRITES] = tuple(inputs_written)
    gm.graph.lint()
    gm.recompile()
    return gm


def input_write_warnings(gm: fx.GraphModule) -> list[str]:
    """What the report says about writes to user inputs."""
    return [f"forward writes its input '{name}': every later read in the forward sees the write, but the "
            "caller's tensor is not changed (each rank holds a piece of it); write to a copy to say so"
            for name in gm.meta.get(INPUT_WRITES, ())]


def _all_nodes(gm: fx.GraphModule):
    """Every node of ``gm`` and of the graphs inside it (pipeline stages, no_grad bodies)."""
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            yield from sub.graph.nodes


def verify_functional(gm: fx.GraphModule) -> None:
    """Raise HiddenEffectError at the first mutating op (stages of a pipeline included)."""
    for node in _all_nodes(gm):
        if is_mutating(node):
            raise HiddenEffectError(_describe(node, module_path(node), user_source(node)))


def _describe(node: fx.Node, module: str, source: str) -> str:
    target = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    via = f" on '{target.name}' ({target.target})" if target is not None and target.op != "placeholder" \
        else f" on input '{target.name}'" if target is not None else ""
    at = f" in module '{module or '<root>'}'" + (f" ({source})" if source else "")
    return (f"in-place op {node.target}{via}{at} writes a tensor and nothing in the graph reads the write: "
            "every pass treats the program as dataflow, so the write would be lost\n  fix: usc functionalizes "
            "writes when it traces; a pass that inserts an in-place op must use its functional form")


def masked_writes_as_where(gm: fx.GraphModule) -> fx.GraphModule:
    """``x[mask] = value`` (``index_put`` with one boolean mask over consecutive dims of x -- the
    leading ones, or after whole dims: ``x[:, m] = v``, ``logits[..., banned] = -inf`` -- and a value
    that broadcasts over the dims after the mask) as ``torch.where(mask, value, x)``: the same values
    and gradients, but element-wise, so every plan's rules read it as such -- as ``index_put`` it
    reads as a gather of the whole tensor (under ``mb=`` a refusal: it seemed to mix samples)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index_put.default:
            continue
        x, indices, value = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        whole = len(indices) - 1  # the dims before the mask, taken whole (None)
        if accumulate or not indices or any(i is not None for i in indices[:whole]) \
                or not isinstance(indices[-1], fx.Node) or not isinstance(value, fx.Node):
            continue
        xv, mask, vv = (n.meta.get("val") for n in (x, indices[-1], value))
        if not all(isinstance(t, torch.Tensor) for t in (xv, mask, vv)) or mask.dtype is not torch.bool:
            continue
        end = whole + mask.dim()
        rest = tuple(xv.shape[end:])
        if tuple(mask.shape) != tuple(xv.shape[whole:end]) or not _broadcasts(tuple(vv.shape), rest):
            continue
        with gm.graph.inserting_before(node):
            m = indices[-1]
            for _ in range(whole):
                m = _call(gm, aten.unsqueeze.default, (m, 0), node)
            for _ in rest:
                m = _call(gm, aten.unsqueeze.default, (m, -1), node)
            v = value if vv.dtype == xv.dtype else _call(gm, aten._to_copy.default, (value,), node, dtype=xv.dtype)
            where = _call(gm, aten.where.self, (m, v, x), node)
        node.replace_all_uses_with(where)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _broadcasts(shape: tuple, onto: tuple) -> bool:
    return len(shape) <= len(onto) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(onto)))


def _call(gm: fx.GraphModule, target, args: tuple, like: fx.Node, **kwargs) -> fx.Node:
    """``target(*args, **kwargs)`` as a node with ``like``'s source and module, its value computed on
    the arguments' fake values."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        value = target(*vals, **kwargs)
    return _like(gm.graph.call_function(target, args, kwargs), like, value)


__all__ = ["distinct_inputs", "input_write_warnings", "functionalize", "explicit_writes", "verify_functional", "user_output_specs",
           "is_mutating", "is_state_write", "masked_writes_as_where", "HiddenEffectError", "OverlappingWriteError", "STATE_WRITE", "INPUT_WRITES", "WRITE_KINDS"]
