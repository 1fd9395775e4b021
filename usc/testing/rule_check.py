"""Check one sharding decision by running it: the op on every simulated rank's local pieces,
combined by the collective the output placement implies, against the op on the whole tensors,
forward and backward, in float64.

The ranks are threads with real collective nodes (``usc.runtime.collectives``), so the backward of
the combining collective is checked along with the rule. Gradient conventions are the runtime's
(see ``runtime/collectives.py`` and ``passes/grad_sync.py``):

- a Shard input's local gradients are the chunks of the global gradient;
- a Partial(sum) input's local gradient is the whole global gradient on every rank;
- a Replicate input's local gradient is the whole gradient on every rank when the output is
  replicated too, and a partial sum over the ranks otherwise (grad_sync adds the reduction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten

from usc.passes.graph_edit import flat_inputs
from usc.passes.localize import SHAPE_ARG
from usc.runtime.collectives import AllGather, AllReduce, LocalShard
from usc.runtime.layout import zigzag_unpermute
from usc.runtime.mesh import run_in_threads, simulated_meshes

ATOL = RTOL = 1e-7  # float64: a correct rule agrees to rounding


class Skip(Exception):
    """The decision cannot be run on these sizes (a sharded dim the mesh does not divide)."""


@dataclass(frozen=True)
class Call:
    """One concrete call of an op: its graph node (the rule reads constant arguments from it) and
    the values of its flat tensor inputs and its output, all global."""

    node: fx.Node
    inputs: tuple[torch.Tensor, ...]
    output: object


def pieces(order: str, size: int) -> int:
    """How many equal chunks a sharded dim is cut into (zigzag: two per rank)."""
    return 2 * size if order == "zigzag" else size


def split_partial(value: torch.Tensor, size: int, seed: int) -> list[torch.Tensor]:
    """Summands of ``value``: value/n plus noise that cancels. Not proportional to value, so a
    non-linear op applied to each summand shows."""
    g = torch.Generator().manual_seed(seed)
    noise = [torch.randn(value.shape, generator=g, dtype=value.dtype) for _ in range(size - 1)]
    noise.append(-sum(noise) if noise else torch.zeros_like(value))
    return [value / size + e for e in noise]


def _local_input(value, placement, mesh, axis, order, partial_parts):
    if isinstance(placement, Replicate):
        return value.clone()
    if isinstance(placement, Shard):
        if value.dim() <= placement.dim or value.shape[placement.dim] % pieces(order, mesh.size(axis)):
            raise Skip(f"dim {placement.dim} of {tuple(value.shape)} not divisible")
        return LocalShard(axis, placement.dim, order).bind(mesh)(value).clone()
    if isinstance(placement, Partial) and placement.reduce_op == "sum" and value.is_floating_point():
        return partial_parts[mesh.comm(axis).rank].clone()
    raise Skip(f"input placement {placement} on a {value.dtype} tensor")


def _combine(out, placement, mesh, axis, order):
    """The global value of a local output under its claimed placement, through the collective
    the runtime would insert."""
    if not isinstance(out, torch.Tensor):
        return out
    if isinstance(placement, Replicate):
        return out
    if isinstance(placement, Shard):
        return AllGather(axis, placement.dim, order=order).bind(mesh)(out)
    if isinstance(placement, Partial):
        if not (out.is_floating_point() or out.is_complex()) and placement.reduce_op == "sum":
            return AllReduce(axis, "sum").bind(mesh)(out.double()).to(out.dtype)
        return AllReduce(axis, placement.reduce_op).bind(mesh)(out)
    raise Skip(f"output placement {placement}")


def _localized_args(call: Call, locals_, output_placement, mesh, axis, order):
    """The node's arguments with this rank's pieces in place of its tensor inputs, and shape
    arguments rewritten as ``localize_pass`` does."""
    it = iter(locals_)
    args = fx.node.map_arg(call.node.args, lambda _: next(it))
    kwargs = fx.node.map_arg(call.node.kwargs, lambda _: next(it))
    index = SHAPE_ARG.get(call.node.target)
    if index is not None and isinstance(output_placement, Shard):
        shape = list(call.output.shape)
        d = output_placement.dim
        if shape[d] % pieces(order, mesh.size(axis)):
            raise Skip("output dim not divisible")
        shape[d] //= mesh.size(axis)
        args = tuple(shape if i == index else a for i, a in enumerate(args))
    return args, kwargs


def _loss(outputs, grads) -> torch.Tensor | None:
    flat, _ = tree_flatten(outputs)
    terms = [(o * g).sum() for o, g in zip([o for o in flat if _is_float(o)], grads)]
    return sum(terms) if terms else None


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _upstream(call: Call, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    flat, _ = tree_flatten(call.output)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in flat if _is_float(o)]


def global_grads(call: Call, grads) -> list[torch.Tensor | None]:
    leaves = [x.detach().clone().requires_grad_(_is_float(x)) for x in call.inputs]
    it = iter(leaves)
    args = fx.node.map_arg(call.node.args, lambda _: next(it))
    kwargs = fx.node.map_arg(call.node.kwargs, lambda _: next(it))
    loss = _loss(call.node.target(*args, **kwargs), grads)
    wanted = [x for x in leaves if x.requires_grad]
    if loss is None or not wanted or not loss.requires_grad:
        return [None] * len(leaves)
    found = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    return [(next(found) if x.requires_grad else None) for x in leaves]


def run_decision(call: Call, inputs, output, *, size: int, order: str = "contiguous", axis: str = "dp",
                 seed: int = 0, backward: bool = True) -> str | None:
    """Run one decision (input placements -> output placement) on ``size`` simulated ranks.
    Returns None when it computes the op, else what differs. Raises Skip when not runnable."""
    if any(isinstance(p, Shard) and p.dim < 0 for p in (*inputs, output)):
        return f"negative dim in {inputs} -> {output}"
    parts = [split_partial(x, size, seed + i) if _is_float(x) else None for i, x in enumerate(call.inputs)]
    grads = _upstream(call, seed) if backward else []
    want = None
    if backward:
        try:
            want = global_grads(call, grads)
        except RuntimeError:  # e.g. scale_grad_by_freq with sparse: no backward on one device either
            backward, grads = False, []

    def rank(mesh):
        locals_ = [_local_input(x, p, mesh, axis, order, parts[i]) for i, (x, p) in enumerate(zip(call.inputs, inputs))]
        leaves = [t.requires_grad_() if _is_float(t) and backward else t for t in locals_]
        args, kwargs = _localized_args(call, leaves, output, mesh, axis, order)
        out = call.node.target(*args, **kwargs)
        flat, spec = tree_flatten(out)
        combined = [_combine(o, output, mesh, axis, order) for o in flat]
        loss = _loss(combined, grads) if backward else None
        local_grads = [None] * len(leaves)
        wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if loss is not None and wanted and loss.requires_grad:
            got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
            local_grads = [(next(got) if isinstance(t, torch.Tensor) and t.requires_grad else None) for t in leaves]
            local_grads = [g if g is not None or not (isinstance(t, torch.Tensor) and t.requires_grad)
                           else torch.zeros_like(t) for g, t in zip(local_grads, leaves)]
        return [c.detach() if isinstance(c, torch.Tensor) else c for c in combined], local_grads

    try:
        results = run_in_threads(simulated_meshes((axis,), (size,), timeout=30.0), rank, timeout=60.0)
    except Skip:
        raise
    except Exception as exc:  # noqa: BLE001 - a decision that crashes on local pieces is a finding
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    expected, _ = tree_flatten(call.output)
    for r, (combined, _) in enumerate(results):
        problem = _compare_outputs(combined, expected)
        if problem:
            return f"forward, rank {r}: {problem}"
    if not backward:
        return None
    for i, (p, g) in enumerate(zip(inputs, want)):
        if g is None:
            continue
        problem = _compare_grad(g, [res[1][i] for res in results], p, output, order, size)
        if problem:
            return f"backward of input {i} ({p}): {problem}"
    return None


def _compare_outputs(got: list, expected: list) -> str | None:
    if len(got) != len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for g, e in zip(got, expected):
        if not isinstance(e, torch.Tensor):
            continue
        problem = _differ(g, e)
        if problem:
            return problem
    return None


def _differ(got, expected: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}, expected a tensor"
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    if expected.is_floating_point() or expected.is_complex():
        ok = torch.allclose(got, expected, rtol=RTOL, atol=ATOL, equal_nan=True)
    else:
        ok = torch.equal(got, expected)
    if ok:
        return None
    diff = (got.double() - expected.double()).abs().nan_to_num(0).max().item() if got.numel() else 0.0
    return f"values differ (max |diff| {diff:.3g})"


def _compare_grad(want: torch.Tensor, local: list, placement, output, order: str, size: int) -> str | None:
    if any(g is None for g in local):
        return "no local gradient"
    local = [g.to_dense() if g.is_sparse else g for g in local]
    want = want.to_dense() if want.is_sparse else want
    if isinstance(placement, Shard):
        whole = torch.cat(local, placement.dim)
        if order == "zigzag":
            whole = zigzag_unpermute(whole, placement.dim, size)
        return _differ(whole, want)
    summed = isinstance(placement, Replicate) and not isinstance(output, Replicate)
    if summed:
        return _differ(sum(local), want)
    for r, g in enumerate(local):
        problem = _differ(g, want)
        if problem:
            return f"rank {r}: {problem}"
    return None
