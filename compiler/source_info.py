"""Where a graph node came from: the module path that made it and the user's source line (what
every error and report names). Read by the tracer and by the graph checks it runs (functional.py),
so it sits beneath both."""

from __future__ import annotations

import os

import torch
import torch.fx as fx

TORCH_DIR = os.path.dirname(torch.__file__)
USC_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
                 for d in ("usc", "compiler", "passes", "runtime", "dsl"))


def module_path(node: fx.Node) -> str:
    """The innermost module path that produced ``node`` ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def user_source(node: fx.Node) -> str:
    """'file:line' of the deepest frame outside torch itself, e.g. 'model.py:42'."""
    if node.meta.get("usc_source"):
        return node.meta["usc_source"]
    trace = node.meta.get("stack_trace") or ""
    best = ""
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path = line.split('"')[1]
            if not path.startswith(TORCH_DIR) and not path.startswith(USC_DIRS):
                number = line.split("line ")[1].split(",")[0]
                best = f"{os.path.basename(path)}:{number}"
    return best
