"""When torch.fx generates a graph module's Python. Generating it is most of what copying or
recompiling a graph costs, and most graphs usc makes never run (plan-only lint, the planner's
probes, each pass's intermediate graph), so they are lazy: the Python is generated on first call.
The one module that names torch's lazy graph module, a private API."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module


def lazy_graph_modules():
    """A context in which the graph modules torch.fx makes (``copy_graph_module``, ``split_module``)
    generate their Python on first call only: a pass's ``recompile`` marks it stale, so graphs that
    never run (plan-only lint, the planner's probes, each pass's intermediate graph) cost none."""
    return _use_lazy_graph_module(True)


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A graph module of ``graph`` over ``root``'s submodules: lazy inside ``lazy_graph_modules()``."""
    return _make_graph_module(root, graph)


def generate_code(gm: fx.GraphModule) -> None:
    """Generate ``gm``'s Python now where a lazy graph module deferred it (copies of ``gm``'s instance
    then share it, not each generating its own)."""
    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()
