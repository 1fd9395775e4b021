"""A step's inputs checked where one device would check them: before anything runs, on every rank alike.

One device raises IndexError when an id or a label falls outside its embedding or its classes. A mesh
must do the same, and on every rank at once: a rank whose shard holds the bad id would otherwise raise
alone while its peers wait in a collective, and under vocabulary parallelism (runtime/vocab.py) an
out-of-range index is no rank's slice and silently becomes zeros.

So every rank checks the *global* batch the user passed (every rank receives the same one), exactly as
each op would receive it: an op's index that is a pure function of the batch (the shift and ignore
masking of the labels, a reshape) is cut out of the program as a small graph of its own
(``IndexUse``) and evaluated on every data shard's slice of the batch, the slice the op sees on
the rank that holds it. Every rank therefore reaches the same verdict with no collective. The check
runs on the host when the batch is on the CPU (where data loaders leave it: no device sync); a batch
already on an accelerator is checked there by the op itself (a device assert, as on one device).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from .layout import local_chunk, zigzag_permute
from .vocab import ShardedGather, VocabParallelEmbedding


class BadInput(ValueError):
    """A step's batch cannot be trained on: which input, the bad value, the rank. Every rank checks the
    same global batch and raises the same error before any collective runs, so none is left waiting."""

    raised_by_every_rank = True

    def __init__(self, message: str, *, input: str, value, rank: int) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.input, self.value, self.rank = input, value, rank


class InputOutOfRange(BadInput, IndexError):
    """An id or a label outside the range the op indexes (an IndexError on one device too)."""


class InputDtypeError(BadInput, TypeError):
    """A floating or boolean tensor where the model indexes with integers (or the reverse)."""


@dataclass(frozen=True)
class IndexUse:
    """One op's index that is a pure function of the batch: ``index(*inputs)`` gives it, and it must lie
    in [0, size) except for ``ignore`` (a loss's ignore_index)."""

    op: str  # what indexes, for the message: "embedding 'embed_tokens.weight'"
    inputs: tuple[str, ...]  # the batch placeholders the index is computed from
    index: Callable[..., torch.Tensor]
    size: int
    ignore: int | None = None


# Ops that index with a tensor: target -> (index argument, size of the indexed dim, ignore_index, what
# the index picks). node.meta["val"] holds the traced (global) shapes, a vocabulary slice's included.
def _val(node) -> torch.Tensor:
    return node.meta["val"]


def _ce_classes(node) -> int:
    logits = _val(node.args[0])
    return logits.shape[1] if logits.dim() > 1 else logits.shape[0]


def _ce_ignore(node, position: int) -> int:
    return node.args[position] if len(node.args) > position else node.kwargs.get("ignore_index", -100)


_ROWS = "embedding rows"
_CLASSES = "classes"
INDEXING_OPS: dict = {
    torch.ops.aten.embedding.default: (1, lambda n: _val(n.args[0]).shape[0], None, _ROWS),
    torch.ops.aten.gather.default: (2, lambda n: _val(n.args[0]).shape[n.args[1]], None, _CLASSES),
    torch.ops.aten.cross_entropy_loss.default: (1, _ce_classes, lambda n: _ce_ignore(n, 4), _CLASSES),
    torch.ops.aten.nll_loss_forward.default: (1, _ce_classes, lambda n: n.args[4], _CLASSES),
    torch.ops.aten.nll_loss.default: (1, _ce_classes, lambda n: _ce_ignore(n, 4), _CLASSES),
}

# Vocabulary-parallel modules (call_module nodes), whose out-of-range index is no rank's and would
# silently read zeros: index argument, global size of what they index.
VOCAB_MODULES: dict = {
    VocabParallelEmbedding: (1, lambda n, m: _val(n.args[0]).shape[0], _ROWS),
    ShardedGather: (1, lambda n, m: _val(n.args[0]).shape[m.dim], _CLASSES),
}


def _indexing(gm: fx.GraphModule, node: fx.Node):
    """(index node, size, ignore_index, what it picks) when `node` indexes with a tensor, else None."""
    if node.op == "call_function" and node.target in INDEXING_OPS:
        position, size, ignore, what = INDEXING_OPS[node.target]
        if len(node.args) <= position or "val" not in getattr(node.args[0], "meta", {}):
            return None
        return node.args[position], size(node), ignore(node) if ignore else None, what
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        rule = VOCAB_MODULES.get(type(module))
        if rule is not None and "val" in getattr(node.args[0], "meta", {}):
            return node.args[rule[0]], rule[1](node, module), None, rule[2]
    return None


def _pure_ancestors(index: fx.Node, batch_names: set[str]) -> list[fx.Node] | None:
    """The nodes `index` is computed from, in graph order, when they read the batch and nothing else
    (no state, no collective, no module): else None."""
    seen, stack = {}, [index]
    while stack:
        node = stack.pop()
        if node.name in seen:
            continue
        if node.op == "placeholder" and node.name not in batch_names or node.op not in ("placeholder", "call_function"):
            return None
        seen[node.name] = node
        stack.extend(node.all_input_nodes)
    if not any(n.op == "placeholder" for n in seen.values()):
        return None
    order = {n: i for i, n in enumerate(index.graph.nodes)}
    return sorted(seen.values(), key=order.__getitem__)


def _extract(nodes: list[fx.Node], index: fx.Node) -> tuple[tuple[str, ...], Callable]:
    """A GraphModule of its own computing `index` from the batch placeholders among `nodes`."""
    graph, env = fx.Graph(), {}
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        env[node].args, env[node].kwargs = _on_cpu(env[node].args), _on_cpu(env[node].kwargs)
    graph.output(env[index])
    names = tuple(n.name for n in nodes if n.op == "placeholder")
    return names, fx.GraphModule(torch.nn.Module(), graph)


def _on_cpu(args):
    """The checks run on the host's batch: a device tracing baked in (``labels.to(logits.device)``,
    ``arange(device=...)``; ``meta`` for a model built there) is the CPU's here."""
    if isinstance(args, dict):
        return {k: torch.device("cpu") if isinstance(v, torch.device) else v for k, v in args.items()}
    return tuple(torch.device("cpu") if isinstance(v, torch.device) else v for v in args)


def _describe(node: fx.Node, what: str, size: int) -> str:
    """'the 128 embedding rows of embed_tokens': what the index picks, and the module when traced."""
    stack = node.meta.get("nn_module_stack")
    where = list(stack.values())[-1][0] if isinstance(stack, dict) and stack else ""
    return f"the {size} {what}" + (f" of {where}" if where else "")


def index_uses(program) -> list[IndexUse]:
    """Every op of the program (pipeline stages included) whose index is a pure function of the batch."""
    batch_names = {spec.placeholder for spec in program.inputs}
    uses = []
    for gm in [m for m in program.gm.modules() if isinstance(m, fx.GraphModule)]:
        for node in gm.graph.nodes:
            found = _indexing(gm, node)
            if found is None or not isinstance(found[0], fx.Node):
                continue
            index, size, ignore, what = found
            nodes = _pure_ancestors(index, batch_names)
            if nodes is None:
                continue
            names, fn = _extract(nodes, index)
            uses.append(IndexUse(_describe(node, what, int(size)), names, fn, int(size), ignore))
    return uses


# ---------------------------------------------------------------------------------------------- checks
def check_dtypes(specs: Sequence, batch: tuple, names: Sequence[str], rank: int) -> None:
    """A tensor of another kind than the program was traced with (float ids, integer pixels); a
    Python value in the batch other than the one the trace baked in (the program would compute with
    the traced one, whatever this batch says)."""
    for spec, value, name in zip(specs, batch, names):
        if spec.dtype is None:
            if isinstance(value, torch.Tensor) or type(value) is not type(spec.constant) or value != spec.constant:
                raise BadInput(
                    f"input {name} is {value!r} but the program was compiled with {spec.constant!r}: a Python value "
                    "in the batch is part of the compiled program (the trace computes with it); pass the same value "
                    "on every step, or a tensor (torch.tensor(...)) for one that changes", input=name, value=value,
                    rank=rank)
            continue
        if not isinstance(value, torch.Tensor):
            raise BadInput(f"input {name} is {value!r} but the program was compiled for a {spec.dtype} tensor of "
                           f"shape {list(spec.global_shape)}; pass a tensor", input=name, value=value, rank=rank)
        if _kind(value.dtype) != _kind(spec.dtype):
            raise InputDtypeError(
                f"input {name} has dtype {value.dtype} but the program was compiled for {spec.dtype}; "
                f"pass {_kind(spec.dtype)} tensors (ids and labels index the model: .long())",
                input=name, value=value.dtype, rank=rank)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "boolean"
    return "floating" if dtype.is_floating_point else "complex" if dtype.is_complex else "integer"


@dataclass(frozen=True)
class ShardView:
    """How the executor cuts a global input for a coordinate: ``cut(spec, value, coord)``."""

    specs: dict  # placeholder -> InputSpec
    coords: list[tuple[int, ...]]  # one coordinate per distinct data shard
    cut: Callable


def check_ranges(uses: Sequence[IndexUse], micro: Sequence[tuple], view: ShardView, names: dict, rank: int) -> None:
    """Evaluate each use on every shard of every microbatch (as each rank's op will see it); the first
    index out of range is an InputOutOfRange naming the input, the value, the op and this rank."""
    order = list(view.specs)
    for use in uses:
        for piece, coord in itertools.product(micro, view.coords):
            values = dict(zip(order, piece))
            if not all(_on_host(values[n]) for n in use.inputs):
                break  # a batch on an accelerator: its ops check it there
            index = use.index(*(view.cut(view.specs[n], values[n], coord) for n in use.inputs))
            _raise_outside(use, index, names, rank)


def _on_host(value) -> bool:
    """A real CPU tensor (a fake one, usc-lint's and the fake-device tier's, holds no values)."""
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and not is_fake(value)


def _raise_outside(use: IndexUse, index: torch.Tensor, names: dict, rank: int) -> None:
    outside = (index < 0) | (index >= use.size)
    if use.ignore is not None:
        outside &= index != use.ignore
    if not bool(outside.any()):
        return
    value = int(index[outside][0])
    name = " / ".join(names.get(n, n) for n in use.inputs)
    allowed = f"[0, {use.size})" + (f" or {use.ignore} (ignored)" if use.ignore is not None else "")
    raise InputOutOfRange(
        f"input {name} holds {value}, outside {allowed}: it indexes {use.op} (one device raises IndexError "
        f"here); fix the data, or the model's size", input=name, value=value, rank=rank)


def shard_coords(specs: Sequence, mesh) -> list[tuple[int, ...]]:
    """One mesh coordinate per distinct slice of the batch: the axes some input is sharded on vary,
    the others stay at this rank's coordinate."""
    sharded = {i for spec in specs for i, p in enumerate(spec.layout.placements) if hasattr(p, "dim")}
    ranges = [range(mesh.shape[i]) if i in sharded else (c,) for i, c in enumerate(mesh.coord)]
    return list(itertools.product(*ranges))


def shard_view(program, mesh, local_batch: bool) -> ShardView:
    """The slices to check: every data shard of a global batch, or this rank's own (local=True)."""
    specs = {spec.placeholder: spec for spec in program.inputs}
    if local_batch:
        return ShardView(specs, [mesh.coord], lambda spec, value, coord: value)
    return ShardView(specs, shard_coords(program.inputs, mesh), cut_for(program.mesh, mesh))


def cut_for(program_mesh, mesh) -> Callable:
    """``cut(spec, value, coord)``: the slice of a global input the rank at `coord` receives (the
    executor's own cut, zigzag permutation of context parallelism included)."""
    def cut(spec, value, coord):
        for axis, placement in zip(program_mesh.axes, spec.layout.placements):
            if axis in program_mesh.zigzag and hasattr(placement, "dim"):
                value = zigzag_permute(value, placement.dim, mesh.size(axis))
        return local_chunk(value, spec.layout.placements, mesh.shape, coord)

    return cut
