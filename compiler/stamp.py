"""Trace repeated layers once and stamp them: compile and lint time grow with distinct blocks, not layers.

``torch.export`` spends its time walking every layer's Python (most of a lint of Llama-3-8B's 32
layers). Transformers repeat one block: a ``ModuleList`` of identical layers that forward runs in
order. ``trace_stamped`` traces the model with only the first two, and with the first three, of
those layers (the ModuleList is shortened in place for the trace, then restored), stamps
the two-layer graph to three layers and checks that it equals the three-layer trace node for node
(ops, arguments, shapes, module paths, names). When it does, the layers grow linearly and the
two-layer graph is stamped to all N layers: layer i's nodes are layer 1's with layer i's
parameters, reading layer i-1's outputs where layer 1 read layer 0's. When it does not (forward
depends on the number of layers, or the layers are not a plain loop), the full trace is used.

Assumed, not checked: forward runs every layer of the list once, in order (``for layer in
self.layers``). A forward that uses a fixed prefix of a longer list (``self.layers[:4]`` of 32) passes
the 2-vs-3 check and would be stamped to all 32; lint is the only user (``usc.compile`` and
``usc.simulate`` always trace every layer).

Node names come out as export's own (fx names a node from its op and a counter, in insertion
order, as export does), so the compiled program and the report are the same as the full trace's.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch.fx as fx
from torch import nn

from usc.runtime.graph_code import graph_module, lazy_graph_modules

from .errors import CompileError
from .trace import StateInput, Traced, module_path, trace

MIN_LAYERS = 4  # below this, stamping saves nothing


def block_signature(module: nn.Module) -> tuple:
    """Type, parameters (name, shape, dtype, trainable) and buffers of a block: equal blocks have equal ones."""
    return (type(module).__name__,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()))


def repeated_layers(model: nn.Module) -> tuple[str, int] | None:
    """(path, count) of the longest ModuleList of structurally identical modules, if any."""
    best = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= MIN_LAYERS and path:
            first = block_signature(module[0])
            if all(block_signature(m) == first for m in module) and (best is None or len(module) > best[1]):
                best = (path, len(module))
    return best


def _trace_with(model: nn.Module, path: str, keep: int, example_inputs, wrapper_source: str) -> Traced:
    # The list is shortened in place, not replaced in its parent: the module that runs forward may
    # hold the same list under another owner (usc's tracing wrapper registers the user's children
    # as its own, and the user's forward reads its own attribute). Replacing it in one owner traced
    # every layer, the ones left out as lifted constants, and stamping never matched.
    layers = model.get_submodule(path)
    full = layers._modules
    layers._modules = type(full)(list(full.items())[:keep])
    try:
        return trace(model, example_inputs, wrapper_source=wrapper_source)
    finally:
        layers._modules = full


def _layer_of(node: fx.Node, prefix: str) -> int | None:
    match = re.match(rf"^{re.escape(prefix)}\.(\d+)(\.|$)", module_path(node))
    return int(match.group(1)) if match else None


def _renamed(text: str, prefix: str, old: int, new: int, sep: str = ".") -> str:
    """'layers.1.mlp' -> 'layers.7.mlp' (sep '_' for placeholder names: 'p_layers_1_mlp...')."""
    p = re.escape(prefix.replace(".", sep))
    return re.sub(rf"(?<![A-Za-z0-9]){p}{re.escape(sep)}{old}(?![0-9])", f"{prefix.replace('.', sep)}{sep}{new}",
                  text)


def _stamped_meta(meta: dict, prefix: str, old: int, new: int) -> dict:
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {_renamed(k, prefix, old, new): (_renamed(v[0], prefix, old, new), v[1])
                                  for k, v in stack.items()}
    return out


def _new_node(graph: fx.Graph, node: fx.Node, args, kwargs, meta: dict, name: str | None = None) -> fx.Node:
    """A copy of ``node``; a placeholder's target is its argument name, so a renamed one gets it too."""
    target = name if node.op == "placeholder" and name else node.target
    # fx names a node '<base>_<count>' in insertion order, as export did: the same base in the same
    # order gives export's names
    name = name or re.sub(r"_\d+$", "", node.name)
    new = graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
    new.meta = meta
    return new


def stamp(traced: Traced, prefix: str, layers: int, model: nn.Module) -> Traced:
    """The two-layer trace ``traced`` (layers 0 and 1 of ``prefix``) stamped to ``layers`` layers."""
    graph, env = fx.Graph(), {}
    state = {s.placeholder: s for s in traced.state}
    nodes = list(traced.gm.graph.nodes)
    computing = [n for n in nodes if n.op not in ("placeholder", "output")]
    region = [n for n in computing if _layer_of(n, prefix) == 1]
    previous = [n for n in computing if _layer_of(n, prefix) == 0]
    if not region or len(region) != len(previous) or any(_layer_of(n, prefix) not in (0, 1, None) for n in computing):
        raise ValueError(f"the trace does not hold two equal layers of {prefix}")
    params1 = [n for n in nodes if n.op == "placeholder" and n.name in state
               and state[n.name].name.startswith(f"{prefix}.1.")]
    new_state: list[StateInput] = []
    last: dict = {}  # layer-1 node -> the env key of its counterpart in the last layer
    for node in nodes:
        if node.op == "placeholder":
            env[node] = _new_node(graph, node, (), {}, dict(node.meta), node.name)
            new_state += [state[node.name]] if node.name in state else []
            if params1 and node is params1[-1]:
                _stamp_params(graph, params1, prefix, layers, env, new_state, state)
            continue

        def read(a):  # after the layers, what read layer 1 reads the last layer
            return env[last[a]] if a in last else env[a]

        env[node] = _new_node(graph, node, fx.map_arg(node.args, read), fx.map_arg(node.kwargs, read),
                              dict(node.meta))
        if node is region[-1]:
            last = _stamp_layers(graph, region, previous, prefix, layers, env)
    with lazy_graph_modules():  # Python code generated on first call only
        gm = graph_module(traced.gm, graph)
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    return replace(traced, gm=gm, state=new_state, module_types=types)


def _stamp_params(graph, params1, prefix, layers, env, new_state, state) -> None:
    for i in range(2, layers):
        for node in params1:
            name = _renamed(node.name, prefix, 1, i, sep="_")
            env[(node, i)] = _new_node(graph, node, (), {}, dict(node.meta), name)
            s = state[node.name]
            new_state.append(StateInput(name, _renamed(s.name, prefix, 1, i), s.kind,
                                        tuple(_renamed(a, prefix, 1, i) for a in s.aliases), s.trainable))


def _stamp_layers(graph, region, previous, prefix, layers, env) -> dict:
    """Copies of layer 1 for layers 2..N-1; a copy reads layer i-1's copy where layer 1 read layer 0.
    Returns layer-1 node -> env key of its counterpart in the last layer."""
    from_previous = dict(zip(previous, region))  # layer 0's node -> layer 1's node at the same place
    last = {n: n for n in region}
    for i in range(2, layers):
        mine: dict = {}

        def source(a, i=i, mine=mine, last=last):
            if a in mine:
                return env[mine[a]]
            if a in from_previous:  # layer 1 read layer 0 here: layer i reads layer i-1
                return env[last[from_previous[a]]]
            return env[(a, i)] if (a, i) in env else env[a]

        for node in region:
            key = ("copy", node, i)
            env[key] = _new_node(graph, node, fx.map_arg(node.args, source), fx.map_arg(node.kwargs, source),
                                 _stamped_meta(node.meta, prefix, 1, i))
            mine[node] = key
        last = mine
    return last


def graphs_equal(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Node for node: name, op, target, arguments (by name), shape/dtype and module path."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    if len(na) != len(nb):
        return False
    for x, y in zip(na, nb):
        if (x.name, x.op, x.target, module_path(x)) != (y.name, y.op, y.target, module_path(y)):
            return False
        if str(fx.map_arg(x.args, lambda n: n.name)) != str(fx.map_arg(y.args, lambda n: n.name)):
            return False
        if str(x.kwargs) != str(y.kwargs) or _val(x) != _val(y):
            return False
    return True


def _val(node: fx.Node):
    return value_signature(node.meta.get("val"))


def value_signature(value):
    """(shape, dtype) of a traced value, a tuple of them for a tuple of values, else its repr."""
    if isinstance(value, (tuple, list)):
        return tuple(value_signature(v) for v in value)
    return (tuple(value.shape), value.dtype) if hasattr(value, "shape") else repr(value)


def trace_stamped(model: nn.Module, example_inputs, *, wrapper_source: str = "") -> Traced:
    """``trace`` with repeated layers traced once (see the module docstring); same result."""
    found = repeated_layers(model)
    if found is None:
        return trace(model, example_inputs, wrapper_source=wrapper_source)
    path, count = found
    try:
        two = _trace_with(model, path, 2, example_inputs, wrapper_source)
        three = _trace_with(model, path, 3, example_inputs, wrapper_source)
        check = stamp(two, path, 3, model)
    except (CompileError, ValueError, KeyError, IndexError):  # forward wants all its layers: trace them
        check = None
    if check is None or check.state != three.state or not graphs_equal(check.gm, three.gm):
        return trace(model, example_inputs, wrapper_source=wrapper_source)
    return replace(stamp(two, path, count, model), stamped=(two, three, count))


__all__ = ["trace_stamped", "stamp", "repeated_layers", "graphs_equal", "value_signature", "block_signature"]
