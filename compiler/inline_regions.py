"""Regions of ``forward`` that ``torch.export`` keeps as higher-order ops, inlined as plain ATen ops.

``with torch.no_grad():`` / ``torch.set_grad_enabled`` become ``wrap_with_set_grad_enabled`` and
``with torch.autocast(...):`` becomes ``wrap_with_autocast``: one node holding a subgraph. No
sharding rule can see into such a node ("no sharding rule for wrap_with_autocast"), so the tracer
inlines them, keeping what each region means:

  * a grad-disabled region's outputs are ``aten.detach``-ed: no gradient flows back through them,
    as on one device (nested regions are inlined the same way) -- except a tensor of the forward the
    region writes in place, which keeps its gradient as torch keeps it (the new values, the gradient
    passed through); likewise a write through a detached alias anywhere (``v.detach().clamp_()``);
  * an autocast region is traced again under the same ``torch.autocast`` and run through
    ``run_decompositions({})``, which writes the casts autocast makes (``_to_copy`` to bf16 before a
    matmul, back to float32 for the ops autocast keeps in float32) as ordinary nodes, keeping
    composite ops such as ``aten.linear`` whole. A disabled region (``enabled=False``) inlines its ops
    as written.

``torch.utils.checkpoint`` regions need nothing here: non-strict export traces through them and
the forward values are the same; recomputation is usc's own ``recompute`` (see README, Recompute).

>>> import torch
>>> class M(torch.nn.Module):
...     def forward(self, x):
...         with torch.no_grad():
...             y = x * 2
...         return (x * y).sum()
>>> exported = torch.export.export(M(), (torch.ones(3),), strict=False)
>>> inline_regions(exported) is exported and not region_nodes(exported.graph_module)
True
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from .functional import decomposed

aten = torch.ops.aten
HOP = torch.ops.higher_order


def region_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in REGIONS]


def inline_regions(exported):
    """Inline every region node of an ExportedProgram's graph, in place (outer first; an inlined
    region's inner regions in later rounds); the same program.

    Requires: an exported program. Establishes: no wrap_with_set_grad_enabled / wrap_with_autocast
    node; each region's ops in its place, with the region's meaning kept (see the module docstring)."""
    gm = exported.graph_module
    detached_writes = _writes_through_detached(gm)
    if not region_nodes(gm) and not detached_writes:
        return exported
    for write in detached_writes:
        _keep_gradient_through(gm, write)
    while nodes := region_nodes(gm):
        for node in nodes:
            REGIONS[node.target](gm, node)
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        gm.graph.erase_node(node)  # the regions' subgraphs, no longer called
    gm.graph.lint()
    gm.recompile()
    return exported


def _writes_through_detached(gm: fx.GraphModule) -> list[fx.Node]:
    """In-place ops that write a tensor through a detached alias of it (``v.detach().clamp_(min=eps)``):
    as under no_grad, torch records no op, later uses read the new values and the gradient reaches
    the tensor as it was."""
    writes = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and _in_place(node.target):
            chain = _alias_chain(node.args[0] if node.args else None)
            if any(n.target is aten.detach.default for n in chain):
                writes.append(node)
    return writes


def _alias_chain(node) -> list[fx.Node]:
    """``node`` and the tensors it is a view or an alias of, back to the first that is not one."""
    chain = []
    while isinstance(node, fx.Node):
        chain.append(node)
        if not (node.op == "call_function" and _aliases(node.target) and node.args):
            break
        node = node.args[0]
    return chain


def _keep_gradient_through(gm: fx.GraphModule, write: fx.Node) -> None:
    """The tensor past the detach a write reaches through, and its views taken before the write: each
    read after the write reads the new values, with the gradient passed through (``_read_new_values``)."""
    chain = _alias_chain(write.args[0])
    cut = next(i for i, n in enumerate(chain) if n.target is aten.detach.default)
    written = _written_tensors(chain[cut].args[0])
    if written:
        _read_new_values(gm, written[-1], write, anchor=write.next)


def _read_new_values(gm: fx.GraphModule, base: fx.Node, write: fx.Node, *, anchor: fx.Node,
                     zero: fx.Node | None = None) -> None:
    """Reads after ``write`` (a no-grad region or an in-place op through a detached alias) of ``base``,
    a tensor written in place there, and of every view of it taken before: torch records no op for
    the write, so each reads the new values and its gradient reaches ``base`` as it was. ``base``'s
    reads become ``base.detach() + (base - base.detach())`` (the detach taken after the write, the
    zero before it: the values exactly, the gradient passed through); each view is taken again of
    that, as written (``v = h[:, :3]`` before ``h.mul_(2)`` under no_grad, read after: the doubled
    values, ``v``'s gradient to ``h`` unscaled -- the functional program would regenerate ``v`` from
    the written values and scale it). A view stays a view of what it viewed, so a later write to
    either is seen by both. New nodes go before ``anchor``; ``zero``: ``base - base.detach()`` taken
    before the write, made here (before ``write``) if not given."""
    views = _views_taken_before(base, write)
    if not any(_after(u, write) for t in [base, *views] for u in t.users):
        return
    if zero is None:
        with gm.graph.inserting_before(write):
            zero = _zero_with_gradient(gm, base)
    with gm.graph.inserting_before(anchor):
        frozen = _detached(gm, base)
        value = _plus(gm, frozen, zero)
        again = {base: value}
        for view in views:  # parents before their views
            node = gm.graph.call_function(view.target, (again[view.args[0]], *view.args[1:]), dict(view.kwargs))
            node.meta.update({k: v for k, v in view.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            again[view] = node
    made = {frozen, value, *again.values()}
    for old, new in again.items():
        for user in [u for u in old.users if u not in made and _after(u, write)]:
            user.replace_input_with(old, new)


def _views_taken_before(base: fx.Node, write: fx.Node) -> list[fx.Node]:
    """Every view of ``base`` taken before ``write`` (views of views too, parents first; not a
    detached alias, which has no gradient to keep, nor an in-place op)."""
    out, todo = [], [base]
    while todo:
        t = todo.pop(0)
        for u in t.users:
            # (a view out of a list, split's, is not followed: torch refuses it once its base is written)
            if u is not write and u.op == "call_function" and u.args and u.args[0] is t and u not in out \
                    and _aliases(u.target) and not _in_place(u.target) and u.target is not aten.detach.default \
                    and not _after(u, write) and _floating(u):
                out.append(u)
                todo.append(u)
    return out


def _floating(node: fx.Node) -> bool:
    return isinstance(v := node.meta.get("val"), torch.Tensor) and v.dtype.is_floating_point


# ------------------------------------------------------------------------------ the regions
def _grad_region(gm: fx.GraphModule, node: fx.Node) -> None:
    enabled, submodule, *args = node.args
    sub = _submodule(gm, submodule)
    zeros: dict[fx.Node, fx.Node] = {}
    written = _written_inputs(sub) if not enabled else set()
    aliases = _output_aliases(sub) if not enabled else {}
    bases = list(dict.fromkeys(chain[-1] for j in written if (chain := _written_tensors(args[j]))))
    # taken before the region's ops: a written tensor (a returned input, a written base) is its new
    # values plus this zero after them
    with gm.graph.inserting_before(node):
        zeros = {t: _zero_with_gradient(gm, t) for t in dict.fromkeys(
            [args[j] for j in aliases.values() if _written_tensors(args[j])] + bases)}
    outputs = _inline(gm, node, sub, args)
    if not enabled:
        with gm.graph.inserting_before(node):
            outputs = [_detached(gm, out) for out in outputs]
            for i, j in aliases.items():
                if args[j] in zeros:
                    outputs[i] = _plus(gm, outputs[i], zeros[args[j]])
        # a written tensor read after the region (written through a view, not returned; the tensor a
        # view the region wrote was taken of; a view of either taken before the region)
        for base in bases:
            _read_new_values(gm, base, node, anchor=node, zero=zeros[base])
    for zero in zeros.values():  # a written tensor neither returned nor read again
        if not zero.users:
            frozen = zero.args[1]
            gm.graph.erase_node(zero)
            gm.graph.erase_node(frozen)
    _replace_outputs(gm, node, outputs)


def _written_tensors(arg) -> list[fx.Node]:
    """The tensors of the forward a write to the region input ``arg`` writes: ``arg`` and, where it is
    a view, what it views (``u = v[:, 0]`` written: ``v`` too); none where that reaches a placeholder
    (a model input or a buffer: its writes are state writes) or a tensor that is not floating."""
    chain = _alias_chain(arg)
    if not chain or chain[-1].op == "placeholder":
        return []
    floating = all(isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype.is_floating_point for n in chain)
    return chain if floating else []


def _after(user: fx.Node, region: fx.Node) -> bool:
    """Whether ``user`` comes after the region node (the region's own users are its outputs)."""
    node = region.next
    while node.op != "root":
        if node is user:
            return True
        node = node.next
    return False


def _base(node) -> fx.Node | None:
    """The tensor an in-place op or a view reads through (``v[:, 0].clamp_()`` -> ``v``), or None."""
    chain = _alias_chain(node)
    return chain[-1] if chain else None


def _written_inputs(sub: fx.GraphModule) -> set[int]:
    """Indices of the region's inputs some in-place op writes (``v.clamp_(min=eps)``, ``v.mul_(2)``,
    ``v[:, 0].clamp_()``: through a view)."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return {placeholders.index(base) for n in sub.graph.nodes
            if n.op == "call_function" and _in_place(n.target) and (base := _base(n)) in placeholders}


def _output_aliases(sub: fx.GraphModule) -> dict[int, int]:
    """{output index: input index} of the region's outputs that are one of its inputs, written in
    place (``return v.clamp_(min=eps)``, ``v.mul_(2).add_(1)``). A view of an input made in the region
    is not: torch gives it no gradient (made under no_grad), and it stays detached."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    aliases = {}
    for i, value in enumerate(out if isinstance(out, (tuple, list)) else [out]):
        node = value
        while isinstance(node, fx.Node) and node.op == "call_function" and _in_place(node.target) and node.args:
            node = node.args[0]
        if node is not value and node in placeholders:
            aliases[i] = placeholders.index(node)
    return aliases


def _in_place(target) -> bool:
    name = target._schema.name.split("::")[-1] if isinstance(target, torch._ops.OpOverload) else ""
    return name.endswith("_") and not name.startswith("_")


def _aliases(target) -> bool:
    """An op whose output is its first input or a view of it (in-place ops, views)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    return target._schema.returns[0].alias_info is not None


def _zero_with_gradient(gm: fx.GraphModule, written: fx.Node) -> fx.Node:
    """``written - written.detach()``: zero, with the gradient of ``written``. A tensor written in place
    under no_grad keeps its place in autograd: later uses read the new values and their gradient
    reaches the tensor as it was (torch records no op for the write). The region's output plus this
    zero is exactly the new values with that gradient (a detached output lost it: ``gaussian_nll_loss``
    clamps its variance so, and the variance's head trained on nothing)."""
    frozen = _detached(gm, written)
    zero = gm.graph.call_function(aten.sub.Tensor, (written, frozen))
    zero.meta.update({k: v for k, v in written.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
    return zero


def _plus(gm: fx.GraphModule, value, zero: fx.Node):
    if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    out = gm.graph.call_function(aten.add.Tensor, (value, zero))
    out.meta.update({k: v for k, v in value.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
    return out


def _autocast_region(gm: fx.GraphModule, node: fx.Node) -> None:
    device, dtype, enabled, cache, submodule, *args = node.args
    sub = _submodule(gm, submodule)
    if enabled:
        sub = _with_autocast_casts(sub, args, device=device, dtype=dtype, cache=cache)
    _replace_outputs(gm, node, _inline(gm, node, sub, args))


# which higher-order op inlines how
REGIONS = {HOP.wrap_with_set_grad_enabled: _grad_region, HOP.wrap_with_autocast: _autocast_region}


# ------------------------------------------------------------------------------ the mechanics
def _submodule(gm: fx.GraphModule, ref: fx.Node) -> fx.GraphModule:
    return getattr(gm, ref.target)


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, args: list) -> list:
    """Copy ``sub``'s nodes before ``node`` (its placeholders bound to ``args``); its outputs.

    Nodes without a module path or source line take the region's (the casts autocast adds)."""
    env: dict[fx.Node, object] = {}
    placeholders = iter(args)
    outputs: list = []
    with gm.graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                outputs = list(fx.node.map_arg(inner.args[0], lambda n: env[n]))
            elif inner.op == "get_attr":
                env[inner] = gm.graph.get_attr(_adopt(gm, sub, inner.target))
            else:
                env[inner] = _copied(gm, inner, env, node)
    return outputs


def _copied(gm: fx.GraphModule, inner: fx.Node, env: dict, region: fx.Node) -> fx.Node:
    new = gm.graph.node_copy(inner, lambda n: env[n])
    for key in ("nn_module_stack", "stack_trace"):
        if not new.meta.get(key) and region.meta.get(key):
            new.meta[key] = region.meta[key]
    return new


def _adopt(gm: fx.GraphModule, sub: fx.GraphModule, target: str) -> str:
    """A submodule or constant of the region registered on ``gm`` under a fresh name."""
    value = getattr(sub, target)
    name, i = f"_inlined_{target.replace('.', '_')}", 0
    while hasattr(gm, f"{name}_{i}"):
        i += 1
    if isinstance(value, nn.Module):
        gm.add_module(f"{name}_{i}", value)
    else:
        setattr(gm, f"{name}_{i}", value)
    return f"{name}_{i}"


def _detached(gm: fx.GraphModule, value):
    if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    out = gm.graph.call_function(aten.detach.default, (value,))
    out.meta.update({k: v for k, v in value.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
    return out


def _replace_outputs(gm: fx.GraphModule, node: fx.Node, outputs: list) -> None:
    """The region's ``getitem(node, i)`` users read output i; then the region node goes."""
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


# ------------------------------------------------------------------------------ autocast casts
class _AutocastRegion(nn.Module):
    def __init__(self, sub: fx.GraphModule, device: str, dtype: torch.dtype, cache: bool) -> None:
        super().__init__()
        self.sub, self.device, self.dtype, self.cache = sub, device, dtype, cache

    def forward(self, *args):
        with torch.autocast(self.device, dtype=self.dtype, cache_enabled=self.cache):
            return tuple(self.sub(*args))


def _with_autocast_casts(sub: fx.GraphModule, args: list, *, device: str, dtype: torch.dtype,
                         cache: bool) -> fx.GraphModule:
    """``sub`` traced under the region's autocast: the casts autocast makes become graph nodes.

    Traced on empty tensors of the arguments' shapes on the CPU (autocast decides by dtype and op,
    not by values); the module paths of the ops are carried over by name from ``sub``."""
    example = tuple(_example(a) for a in args)
    exported = torch.export.export(_AutocastRegion(sub, device, dtype, cache), example, strict=False)
    graph = decomposed(exported).graph_module
    _carry_module_paths(graph, sub)
    return graph  # the region holds no parameters of its own: every placeholder is one of its arguments


def _example(arg):
    value = arg.meta["val"] if isinstance(arg, fx.Node) else arg
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(value.shape, dtype=value.dtype, device="cpu", requires_grad=value.requires_grad)


def _carry_module_paths(graph: fx.GraphModule, sub: fx.GraphModule) -> None:
    by_name = {n.name: n for n in sub.graph.nodes}
    for node in graph.graph.nodes:
        original = by_name.get(node.name)
        for key in ("nn_module_stack", "stack_trace"):
            node.meta[key] = original.meta.get(key) if original is not None else None


__all__ = ["inline_regions", "region_nodes", "REGIONS"]
