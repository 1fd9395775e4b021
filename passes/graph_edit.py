"""Small helpers every pass uses to read and edit the fx graph while keeping its annotations."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_aggregate

from usc.compiler.ir import META, NodeAnn


def flat_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in argument order (a node used twice appears twice)."""
    found: list[fx.Node] = []
    map_aggregate((node.args, node.kwargs), lambda a: found.append(a) if isinstance(a, fx.Node) else None)
    return found


def val(node: fx.Node) -> Any:
    return node.meta.get("val")


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    value = val(node)
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def is_float(node: fx.Node) -> bool:
    value = val(node)
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def erase_node(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` (it has no users), and its submodule when no other node calls it."""
    target = node.target if node.op == "call_module" else None
    gm.graph.erase_node(node)
    if target is not None and not any(n.op == "call_module" and n.target == target for n in gm.graph.nodes):
        gm.delete_submodule(target)


def reads_placeholders(node: fx.Node, names) -> bool:
    """Whether ``node`` is computed from any of the placeholders named ``names``."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and current.name in names:
            return True
        stack.extend(current.all_input_nodes)
    return False


def fake_value(target, args, kwargs, module=None):
    """Run ``target`` on the fake values of its node arguments to learn the output's global shape."""
    vals = map_aggregate((args, kwargs), lambda a: val(a) if isinstance(a, fx.Node) else a)
    fake_args, fake_kwargs = vals
    fake_mode = detect_fake_mode([v for v in _tensors(vals)])
    fn = module.global_fn if module is not None else target
    if fake_mode is None:
        return fn(*fake_args, **fake_kwargs)
    with fake_mode:
        return fn(*fake_args, **fake_kwargs)


def _tensors(tree) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_aggregate(tree, lambda a: out.append(a) if isinstance(a, torch.Tensor) else None)
    return out


class GraphEditor:
    """Inserts annotated nodes into one GraphModule; names inserted modules uniquely."""

    def __init__(self, gm: fx.GraphModule, mesh=None) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.mesh = mesh
        self._count = 0

    def call_function(self, before: fx.Node, target, args: tuple, kwargs: dict | None = None, *,
                      ann: NodeAnn) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = fake_value(target, args, kwargs)
        node.meta[META] = ann
        return node

    def call_module(self, before: fx.Node, module: torch.nn.Module, args: tuple, *, ann: NodeAnn,
                    stem: str, same_value_as: fx.Node | None = None) -> fx.Node:
        self._count += 1
        name = f"usc_{stem}_{self._count}"
        while hasattr(self.gm, name):
            self._count += 1
            name = f"usc_{stem}_{self._count}"
        self.gm.add_submodule(name, module)
        with self.graph.inserting_before(before):
            node = self.graph.call_module(name, args)
        node.meta["val"] = val(same_value_as) if same_value_as is not None else fake_value(None, args, {}, module)
        node.meta[META] = ann
        return node
