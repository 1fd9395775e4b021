"""The sharding IR: what the passes decide about each torch.fx node, stored under ``node.meta["usc"]``.

A node's *layout* is one placement per mesh axis, in PyTorch's own vocabulary
(``Replicate()``, ``Shard(dim)``, ``Partial(op)``), so a reader who knows DTensor reads it at once.
Shapes in ``node.meta["val"]`` stay *global* through every pass; the local shape of a rank is
derived from the layout (``local_shape``), never stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from usc.runtime.graph_code import graph_module

META = "usc"
R = Replicate()

__all__ = ["META", "R", "Shard", "Partial", "Replicate", "Placement", "MeshSpec", "Layout", "NodeAnn",
           "ann", "set_ann", "layout_of", "describe_placement"]


@dataclass(frozen=True)
class MeshSpec:
    """The logical mesh: axis names (outermost first) and their sizes. Rank order is row-major."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    zigzag: tuple[str, ...] = ()  # axes whose Shard placements hold zigzag chunks (cp_mode=zigzag)

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"mesh axes {self.axes} and shape {self.shape} differ in length")

    def order(self, axis: str) -> str:
        """How a Shard on ``axis`` cuts a dim: 'contiguous' chunks, or 'zigzag' (chunks r, 2n-1-r)."""
        return "zigzag" if axis in self.zigzag else "contiguous"

    def size(self, axis: str) -> int:
        if "+" in axis:  # a joint group of neighbouring axes ('dp+ep')
            return prod(self.size(a) for a in axis.split("+"))
        return self.shape[self.axes.index(axis)] if axis in self.axes else 1

    @property
    def world_size(self) -> int:
        return prod(self.shape)

    def __str__(self) -> str:
        return " ".join(f"{a}={n}" for a, n in zip(self.axes, self.shape)) or "single device"


def describe_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return "Replicate()"


@dataclass(frozen=True)
class Layout:
    """One placement per mesh axis (mesh order). ``Layout.replicated(n)`` is the single-device view."""

    placements: tuple[Placement, ...]

    @staticmethod
    def replicated(n_axes: int) -> "Layout":
        return Layout((R,) * n_axes)

    def with_axis(self, index: int, placement: Placement) -> "Layout":
        items = list(self.placements)
        items[index] = placement
        return Layout(tuple(items))

    def sharded_dims(self) -> dict[int, list[int]]:
        """tensor dim -> mesh axis indices sharding it (outer axis first)."""
        dims: dict[int, list[int]] = {}
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard):
                dims.setdefault(p.dim, []).append(i)
        return dims

    def local_shape(self, shape: tuple[int, ...], mesh: MeshSpec) -> tuple[int, ...]:
        out = list(shape)
        for dim, axes in self.sharded_dims().items():
            out[dim] //= prod(mesh.shape[a] for a in axes)
        return tuple(out)

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def render(self, mesh: MeshSpec) -> str:
        return "{" + ", ".join(f"{a}: {describe_placement(p)}" for a, p in zip(mesh.axes, self.placements)) + "}"


@dataclass(frozen=True)
class NodeAnn:
    """What the passes decided about one node.

    layout: the placement of the node's value on each mesh axis.
    needs_grad: the value is a float tensor that depends on a parameter (so it has a gradient).
    partial_grad_axes: for parameters only — the axes over which its gradient arrives as a
        partial sum and must be summed by the runtime's bucketed reducer (data parallelism).
    module / source: the model module path and user source line that produced the node.
    reason: why an inserted node is there (shown by usc-lint).
    """

    layout: Layout
    needs_grad: bool = False
    partial_grad_axes: tuple[str, ...] = ()
    module: str = ""
    source: str = ""
    reason: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)


def ann(node: fx.Node) -> NodeAnn:
    return node.meta[META]


def set_ann(node: fx.Node, base: NodeAnn | None = None, **changes) -> NodeAnn:
    value = replace(base or node.meta[META], **changes)
    node.meta[META] = value
    return value


def layout_of(node: fx.Node) -> Layout:
    return node.meta[META].layout


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A fresh graph over the same (shared) submodules: cheap, and safe to mutate. Under
    ``lazy_graph_modules()`` its Python code is generated on first call only."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return graph_module(gm, graph)
