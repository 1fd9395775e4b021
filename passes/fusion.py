"""Fusion: replace maximal chains of pointwise ops plus at most one row reduction by one fused node.

Requires: localize ran (shapes are per rank: a region's row length is the local one); collectives
    are call_module nodes (never fused).
Establishes: with ``fuse=on``, every region of two or more fusable ops (a residual add + RMSNorm,
    SwiGLU's silu(gate) * up, softmax, the pieces of a vocab-parallel cross-entropy ...) is one
    ``call_module`` node running a ``usc.runtime.fused.FusedRegion`` whose kernel source was
    generated from the region (passes/triton_codegen.py); each value used outside the region is a
    ``getitem`` of it, annotated like the node it replaces. A whole mean/sum cross-entropy is first
    split into per-row losses (one region: its kernel never writes the log-probabilities) and
    their sum / count. Nothing else in the graph changes.

Regions are found by rules over op classes (``OP_CLASS``), not by module classes, so a user's own
pointwise chain fuses too. The kernel works row by row over the last dimension (a row reduction
sees the whole row, in tiles when it is long: passes/triton_tiles.py), which is why a region has
one *row space* (leading shape, row length) and at most one reduction: its inputs (prologue) and uses (epilogue) are then computed
without leaving on-chip memory (the point of fused kernels; cf. Liger kernels, Hsu et al. 2024).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.fx as fx

from usc.compiler.ir import META, set_ann
from usc.runtime.fused import FusedRegion

from .graph_edit import fake_value, flat_inputs
from .triton_codegen import generate

aten = torch.ops.aten

POINTWISE, REDUCTION, OTHER = "pointwise", "row-reduction", "other"

# Op classes: a rule per ATen op (the kernel generator has the matching lowering table).
OP_CLASS = {
    **{op: POINTWISE for op in (
        aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
        aten.exp.default, aten.log.default, aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default,
        aten.pow.Tensor_Scalar, aten.silu.default, aten.gelu.default, aten.tanh.default, aten.sigmoid.default,
        aten.relu.default, aten.detach.default)},
    # reductions over the last dim only (checked by REDUCES_LAST_DIM): the kernel's row
    **{op: REDUCTION for op in (
        aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.layer_norm.default,
        aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
        aten.cross_entropy_loss.default)},
}
FREE_OPS = {aten.detach.default}  # launch no kernel of their own: a region of them alone gains nothing
# Worth a kernel even alone: eager cross-entropy writes (and backward reads) the [rows, vocab]
# log-probabilities; the fused kernel never does.
WORTH_ALONE = {aten.cross_entropy_loss.default}
SUPPORTED_POWERS = {-2.0, -1.0, 0.5, 1.0, 2.0, 3.0, 4.0}


def _dims_arg(node: fx.Node):
    if node.target is aten.cross_entropy_loss.default:
        return [-1]
    if node.target in (aten.layer_norm.default,):
        return [-len(node.args[1])]
    if node.target in (aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int):
        return [node.args[1]]
    return node.args[1] if len(node.args) > 1 else None


def reduces_last_dim(node: fx.Node, ndim: int) -> bool:
    """Only a reduction over exactly the last dim keeps one program per row."""
    dims = _dims_arg(node)
    if not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    return dims[0] in (-1, ndim - 1)


@dataclass(frozen=True)
class RowSpace:
    """The rows a region's kernel walks: leading shape and row length (per rank)."""

    lead: tuple[int, ...]
    length: int

    def domain(self, shape: tuple[int, ...]) -> str | None:
        """How a value of ``shape`` lives in the row space: a whole row ('vec'), one value per row
        kept as a trailing 1 ('row'), one value per row without it ('flat'), or not at all."""
        if shape == self.lead + (self.length,):
            return "vec"
        if shape == self.lead + (1,) and self.length != 1:
            return "row"
        if shape == self.lead and len(self.lead) > 0:
            return "flat"
        return None


@dataclass(frozen=True)
class Region:
    nodes: tuple[fx.Node, ...]  # graph order
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]  # values used outside the region (graph order)
    space: RowSpace


ShapeFn = Callable[[fx.Node], "tuple[int, ...] | None"]


def op_class(node: fx.Node, shape_of: ShapeFn) -> str:
    """The op class of one node: pointwise / row-reduction / other (see OP_CLASS and the checks)."""
    cls = OP_CLASS.get(node.target) if node.op == "call_function" else None
    if cls is None or not _float_tensor(node) or not shape_of(node):
        return OTHER
    if node.target is aten.pow.Tensor_Scalar and float(node.args[1]) not in SUPPORTED_POWERS:
        return OTHER
    if node.target is aten.gelu.default and node.kwargs.get("approximate", "none") not in ("none", "tanh"):
        return OTHER
    if node.target in (aten.add.Tensor, aten.sub.Tensor) and node.kwargs.get("alpha", 1) != 1:
        return OTHER
    if any(not isinstance(a, (fx.Node, int, float, bool, type(None), list, tuple)) for a in node.args):
        return OTHER
    if cls == REDUCTION and not _reduction_ok(node, shape_of):
        return OTHER
    return cls


def _reduction_ok(node: fx.Node, shape_of: ShapeFn) -> bool:
    source = node.args[0]
    shape = shape_of(source)
    if shape is None or not shape or not reduces_last_dim(node, len(shape)):
        return False
    if node.target is aten.layer_norm.default:
        return all(a is None or isinstance(a, fx.Node) for a in node.args[2:4])
    if node.target is aten.cross_entropy_loss.default:
        return _per_row_cross_entropy(node, shape_of)
    if node.target in (aten._softmax.default, aten._log_softmax.default):
        return node.args[2] is False  # half_to_float
    if node.target in (aten.softmax.int, aten.log_softmax.int):
        return len(node.args) < 3 or node.args[2] is None
    return node.kwargs.get("dtype") is None


def _cross_entropy_args(node: fx.Node) -> tuple:
    """(weight, reduction, ignore_index, label_smoothing) with ATen's defaults."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    values = dict(zip(names, (None, 1, -100, 0.0)))
    values.update(zip(names, node.args[2:]))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    return tuple(values[k] for k in names)


def _per_row_cross_entropy(node: fx.Node, shape_of: ShapeFn) -> bool:
    """reduction='none' on [rows, classes] logits and [rows] labels, no class weights or smoothing
    (a mean or sum loss is split into per-row losses first: split_cross_entropy)."""
    weight, reduction, _, smoothing = _cross_entropy_args(node)
    logits, labels = shape_of(node.args[0]), shape_of(node.args[1])
    return weight is None and not smoothing and reduction == 0 and len(logits) == 2 and labels == logits[:1]


def split_cross_entropy(gm: fx.GraphModule, shape_of: ShapeFn) -> bool:
    """cross_entropy(x, y, reduction=mean|sum) -> sum(cross_entropy(x, y, reduction=none)) [/ count of
    counted labels], the mean's denominator exactly as ATen counts it (ignore_index excluded)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
            continue
        weight, reduction, ignore, smoothing = _cross_entropy_args(node)
        logits, labels = shape_of(node.args[0]), shape_of(node.args[1])
        if weight is not None or smoothing or reduction not in (1, 2) or len(logits) != 2 or labels != logits[:1]:
            continue
        edit = _NodeMaker(gm, node)
        rows = edit.call(aten.cross_entropy_loss.default, node.args[0], node.args[1], None, 0, ignore, 0.0)
        loss = edit.call(aten.sum.default, rows)
        if reduction == 1:
            counted = edit.call(aten.ne.Scalar, node.args[1], ignore, grad=False)
            loss = edit.call(aten.div.Tensor, loss, edit.call(aten.sum.default, counted, grad=False))
        node.replace_all_uses_with(loss)
        gm.graph.erase_node(node)
        changed = True
    return changed


class _NodeMaker:
    """New nodes before ``at`` with its value computed on fake tensors and its annotation (layout,
    module) when it has one: the replaced loss computes on replicated values only."""

    def __init__(self, gm: fx.GraphModule, at: fx.Node) -> None:
        self.gm, self.at = gm, at

    def call(self, target, *args, grad: bool = True) -> fx.Node:
        with self.gm.graph.inserting_before(self.at):
            node = self.gm.graph.call_function(target, args)
        node.meta["val"] = fake_value(target, args, {})
        if META in self.at.meta:
            node.meta[META] = _copy_ann(self.at, grad)
        return node


def _copy_ann(node: fx.Node, grad: bool):
    ann = node.meta[META]
    return replace(ann, needs_grad=ann.needs_grad and grad, extra={})


def _float_tensor(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def node_space(node: fx.Node, cls: str, shape_of: ShapeFn) -> RowSpace:
    """The row space a node would open a region with."""
    shape = shape_of(node.args[0]) if cls == REDUCTION else shape_of(node)
    if not shape:
        return RowSpace((), 1)
    return RowSpace(tuple(shape[:-1]), shape[-1])


COMPOSITE_ROW_OPS = {aten.layer_norm.default, aten._softmax.default, aten.softmax.int,
                     aten._log_softmax.default, aten.log_softmax.int}  # whole rows in, whole rows out
# The domains a region member may have when a node of a given output domain reads it. Inputs from
# outside are loaded by broadcasting them to the node's output shape (torch's own rule), so any
# of them is fine; a member kept 'flat' next to a whole row would broadcast along the wrong dim.
MEMBER_DOMAINS = {"vec": {"vec", "row"}, "row": {"row"}, "flat": {"flat"}}


def fits(node: fx.Node, space: RowSpace, shape_of: ShapeFn, cls: str, in_region: Callable[[fx.Node], bool]
         ) -> bool:
    """The node computes in ``space``: its output and the members it reads live in the row space."""
    out = space.domain(tuple(shape_of(node)))
    if out is None:
        return False
    if cls == REDUCTION:
        whole_rows = node.target in COMPOSITE_ROW_OPS
        return space.domain(tuple(shape_of(node.args[0]))) == "vec" and (out == "vec") == whole_rows
    allowed = MEMBER_DOMAINS[out]
    return all(space.domain(tuple(shape_of(a))) in allowed for a in flat_inputs(node) if in_region(a))


class _Regions:
    """Union of nodes into regions, growing in graph order (each node joins its producers' regions
    when the row spaces agree, one reduction at most, and no cycle through an outside node)."""

    def __init__(self, gm: fx.GraphModule, shape_of: ShapeFn) -> None:
        self.gm, self.shape_of = gm, shape_of
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.region_of: dict[fx.Node, int] = {}
        self.members: dict[int, list[fx.Node]] = {}
        self.space: dict[int, RowSpace] = {}
        self.reductions: dict[int, int] = {}
        self.classes: dict[fx.Node, str] = {}
        self._next = 0

    def add(self, node: fx.Node, cls: str) -> None:
        producers = sorted({self.region_of[a] for a in flat_inputs(node) if a in self.region_of})
        for rid in producers:  # join the first compatible producer region, then absorb the others
            if self._can_join(node, cls, rid):
                self._join(node, cls, rid)
                for other in producers:
                    if other != rid and other in self.members and self._can_merge(rid, other):
                        self._merge(rid, other)
                return
        self._open(node, cls)

    def _open(self, node: fx.Node, cls: str) -> None:
        space = node_space(node, cls, self.shape_of)
        if not fits(node, space, self.shape_of, cls, lambda a: False):
            return
        rid, self._next = self._next, self._next + 1
        self.members[rid] = [node]
        self.region_of[node] = rid
        self.space[rid] = space
        self.reductions[rid] = int(cls == REDUCTION)
        self.classes[node] = cls

    def _can_join(self, node: fx.Node, cls: str, rid: int) -> bool:
        if cls == REDUCTION and self.reductions[rid]:
            return False
        if not fits(node, self.space[rid], self.shape_of, cls, self.region_of.__contains__):
            return False
        return not self._cycle(set(self.members[rid]) | {node})

    def _join(self, node: fx.Node, cls: str, rid: int) -> None:
        self.members[rid].append(node)
        self.region_of[node] = rid
        self.reductions[rid] += int(cls == REDUCTION)
        self.classes[node] = cls

    def _can_merge(self, a: int, b: int) -> bool:
        if self.space[a] != self.space[b] or self.reductions[a] + self.reductions[b] > 1:
            return False
        union = set(self.members[a]) | set(self.members[b])
        if not all(fits(n, self.space[a], self.shape_of, self.classes[n], union.__contains__) for n in union):
            return False
        return not self._cycle(union)

    def _merge(self, a: int, b: int) -> None:
        for node in self.members.pop(b):
            self.region_of[node] = a
            self.members[a].append(node)
        self.reductions[a] += self.reductions.pop(b)
        self.members[a].sort(key=self.order.__getitem__)

    def _cycle(self, group: set[fx.Node]) -> bool:
        """True when a node outside ``group`` is reached from it and reaches back into it: the
        fused node could then not be placed anywhere in the graph."""
        last = max(self.order[n] for n in group)
        seen: set[fx.Node] = set()
        frontier = [u for n in group for u in n.users if u not in group]
        while frontier:
            node = frontier.pop()
            if node in seen or self.order[node] > last:
                continue
            seen.add(node)
            if any(u in group for u in node.users):
                return True
            frontier.extend(node.users)
        return False

    def regions(self) -> list[Region]:
        out = []
        for rid, nodes in self.members.items():
            nodes = sorted(nodes, key=self.order.__getitem__)
            if sum(n.target not in FREE_OPS for n in nodes) < 2 and not WORTH_ALONE & {n.target for n in nodes}:
                continue
            members = set(nodes)
            inputs = _unique(a for n in nodes for a in flat_inputs(n) if a not in members)
            outputs = tuple(n for n in nodes if any(u not in members for u in n.users))
            out.append(Region(tuple(nodes), inputs, outputs, self.space[rid]))
        return sorted(out, key=lambda r: self.order[r.nodes[0]])


def _unique(nodes) -> tuple[fx.Node, ...]:
    return tuple(dict.fromkeys(nodes))


def find_regions(gm: fx.GraphModule, shape_of: ShapeFn) -> list[Region]:
    """Maximal regions of pointwise ops plus at most one row reduction, in graph order."""
    regions = _Regions(gm, shape_of)
    for node in gm.graph.nodes:
        cls = op_class(node, shape_of)
        if cls != OTHER:
            regions.add(node, cls)
    return regions.regions()


def meta_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The shape in ``meta['val']`` (a graph built without a mesh: tests, single device)."""
    value = node.meta.get("val")
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def local_shape_fn(mesh) -> ShapeFn:
    """This rank's shape of a node: the global one cut by its layout."""
    def shape_of(node: fx.Node):
        shape = meta_shape(node)
        ann = node.meta.get(META)
        if shape is None or ann is None or ann.layout is None:
            return shape
        return tuple(ann.layout.local_shape(shape, mesh))
    return shape_of


def fusion_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace fusable regions by fused nodes when the plan says fuse=on (see the module docstring)."""
    if not ctx.plan.get("fuse"):
        return gm
    return fuse_graph(gm, local_shape_fn(ctx.mesh))


def fuse_graph(gm: fx.GraphModule, shape_of: ShapeFn = meta_shape) -> fx.GraphModule:
    """Find the regions of ``gm`` and replace each by a FusedRegion with its generated kernel."""
    if split_cross_entropy(gm, shape_of):
        gm.recompile()
    return fuse_regions(gm, find_regions(gm, shape_of), lambda region: build_fused(region, shape_of))


def build_fused(region: Region, shape_of: ShapeFn) -> FusedRegion:
    """The fused node's module: the region's eager ops and its generated kernel."""
    kernel = generate(region, shape_of, dtype_of=lambda n: n.meta["val"].dtype)
    row_shape = region.space.lead + (region.space.length,)
    modules = sorted({n.meta[META].module for n in region.nodes if META in n.meta and n.meta[META].module})
    return FusedRegion(eager_graph(region), kernel, row_shape=row_shape,
                       out_shapes=tuple(tuple(shape_of(o)) for o in region.outputs),
                       label=", ".join(modules))


def eager_graph(region: Region) -> fx.GraphModule:
    """The region's own ops as a GraphModule taking its inputs and returning its outputs (a tuple)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for index, node in enumerate(region.inputs):
        env[node] = graph.placeholder(f"in{index}")
        env[node].meta = dict(node.meta)
    for node in region.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] for o in region.outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def fuse_regions(gm: fx.GraphModule, regions: list[Region], build: Callable[[Region], torch.nn.Module]
                 ) -> fx.GraphModule:
    """Replace each region by one call_module node (the module ``build`` makes for it)."""
    modules = [build(region) for region in regions]  # from the graph as the regions saw it
    renamed: dict[fx.Node, fx.Node] = {}  # an earlier region's output -> its getitem
    for index, (region, module) in enumerate(zip(regions, modules)):
        renamed.update(_replace(gm, region, module, f"usc_fused_{index}", renamed))
    if regions:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm


def _replace(gm: fx.GraphModule, region: Region, module: torch.nn.Module, name: str,
             renamed: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    late = _users_inside_span(gm, region)
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(region.nodes[-1]):
        fused = gm.graph.call_module(name, tuple(renamed.get(a, a) for a in region.inputs))
    fused.meta["val"] = tuple(o.meta.get("val") for o in region.outputs)
    if META in region.outputs[0].meta:
        fused.meta[META] = region.outputs[0].meta[META]
        set_ann(fused, reason=f"fused region of {len(region.nodes)} ops")
    cursor, members, items = fused, set(region.nodes), {}
    for index, out in enumerate(region.outputs):
        with gm.graph.inserting_after(cursor):
            item = gm.graph.call_function(operator.getitem, (fused, index))
        item.meta = dict(out.meta)
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        cursor = items[out] = item
    for node in late:  # they read a region output: now after the fused node, in their order
        cursor.append(node)
        cursor = node
    return items


def _users_inside_span(gm: fx.GraphModule, region: Region) -> list[fx.Node]:
    """Outside nodes placed between the region's first and last node that depend on a member.
    The fused node takes the last member's place, so they move after it; none of them feeds the
    region back (find_regions refuses such cycles), so the order stays valid."""
    members, late, inside = set(region.nodes), [], False
    for node in gm.graph.nodes:
        if node is region.nodes[0]:
            inside = True
        if node is region.nodes[-1]:
            break
        if inside and node not in members and any(a in members or a in late for a in flat_inputs(node)):
            late.append(node)
    return late
