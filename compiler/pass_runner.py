"""The pass runner: runs an ordered list of passes over one GraphModule.

It checks that the program is dataflow before the first pass (``functional.verify_functional``:
no in-place op whose write nothing reads), runs the IR verifier and that check again after every
pass when asked (tests and ``USC_DEBUG=1``), can switch a pass off by name, records time and node
count per pass, and names the pass that failed.
The list itself is built by ``usc.passes.build_pipeline``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from .errors import CompileError
from .functional import HiddenEffectError, verify_functional
from .ir import META, MeshSpec


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: Callable[..., fx.GraphModule]
    options: dict = field(default_factory=dict)
    annotated: bool = True  # the graph carries layouts after it (passes before propagation leave none)


@dataclass
class CompileContext:
    """What every pass may read: the mesh and the plan. Passes never touch the runtime."""

    mesh: MeshSpec
    plan: Any
    timings: list[tuple[str, float, int]] = field(default_factory=list)


class PassFailed(CompileError):
    pass


def verify_annotated(gm: fx.GraphModule) -> None:
    """The legal form after propagation: every computing node carries a layout of the mesh's rank
    (for a pipeline orchestrator: every node of every stage)."""
    stages = pipeline_stages(gm)
    if stages:
        for stage in stages:
            verify_annotated(stage)
        return
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_module", "placeholder"):
            ann = node.meta.get(META)
            if ann is None or ann.layout is None:
                raise AssertionError(f"node {node.name} ({node.target}) has no layout")


def run_pipeline(gm: fx.GraphModule, ctx: CompileContext, passes: list[PassSpec], *,
                 verify: Callable[[fx.GraphModule], None] | None = None,
                 disabled: frozenset[str] = frozenset()) -> fx.GraphModule:
    if verify is None and os.environ.get("USC_DEBUG") == "1":
        verify = verify_annotated
    verify_functional(gm)  # every pass assumes dataflow
    for spec in passes:
        if spec.name in disabled:
            continue
        start = time.perf_counter()
        gm = spec.fn(gm, ctx, **spec.options)
        ctx.timings.append((spec.name, time.perf_counter() - start, len(gm.graph.nodes)))
        if verify is not None and spec.annotated:
            try:
                verify(gm)
                verify_functional(gm)
            except (AssertionError, HiddenEffectError) as err:
                raise PassFailed(f"after pass '{spec.name}': {err}") from err
    return gm


def pipeline_stages(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The stages of a pipeline orchestrator (marked by the split pass), else []. Other child
    GraphModules (a higher-order op's body, e.g. torch.no_grad regions) are not stages."""
    if not gm.meta.get("usc_pipeline_stages"):
        return []
    return [m for _, m in gm.named_children() if isinstance(m, fx.GraphModule)]
