"""Batch coupling under microbatching: what mixes the samples that ``mb=M`` runs apart.

``mb=M`` runs the program once per microbatch (a 1/M slice of the batch's dim 0) and combines
the M losses. That is exact only where the program treats samples independently up to a loss that
is linear in them. dp splits the same dim and propagation proves each op (it gathers or refuses);
microbatches are run one after another, so nothing can be gathered across them. This pass runs the
same proof: it propagates the traced graph over a *virtual* dp axis (the batch's dim 0 sharded)
and reads the result:

- every collective propagation needed on that axis is a computation that couples samples
  (softmax / cumsum / sort / var / normalize over the batch, batch statistics, a product of batch
  means such as a MoE load-balancing loss): refused, naming the op, its module and source line;
- the loss is walked back through its linear combination (add, sub, scale by a constant) to its
  reductions, each classified by what it reduces (the batch dim, or a batch sum already):
  a token mean (cross-entropy: microbatches weighted by their token counts, loss_count exposes
  them), a mean over the batch (weight 1/M), a sum (weight 1: the pass multiplies it by M, so one
  weight 1/M serves every term), a term that does not depend on the batch, or anything else
  (max, a nonlinear function of batch reductions): refused. Token means beside terms weighted
  otherwise divide by the step's count, summed before the first microbatch ("count_first"), where
  that count is computed from the batch alone (no weight, no random draw); else refused.

``batch_coupling=per_microbatch`` (plan option) instead *defines* the step loss as the mean of the
microbatch losses, each computed on its microbatch alone (Megatron's definition for auxiliary
losses under pipelining); ``usc.testing`` trains its one-device reference the same way.

Requires: the traced graph, random ops already ``usc::draw`` nodes (random_ops).
Establishes: with mb > 1, the program's microbatch losses combine into the one-device loss with
    weights 1/M (or token counts, ``gm.meta["usc_loss_combine"] == "token_mean"``; or weights 1/M
    with each token mean divided by the step's count, "count_first"), or a PlanError
    at ``mb`` was raised; each draw's batch dim is set, so a microbatch draws its rows of the full
    batch's tensor. With mb == 1 the graph is returned unchanged.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from usc.compiler.errors import CompileError
from usc.compiler.ir import META, Layout
from usc.compiler.trace import module_path, user_source
from usc.runtime.collectives import AllGather, AllReduce, AllToAll, LocalShard, ReduceScatter
from usc.runtime.ring_attention import RingAttention
from usc.runtime.op_classes import RESHAPES

from .batch_outer import MERGES, batch_outer_pass, merged_groups, region_stop
from .graph_edit import fake_value, reads_placeholders, shape_of, val
from .random_ops import DRAW, random_ops_pass
from .row_index import ARANGES, row_index_pass
from .expansions import is_soft_target
from .sharding_rules import REDUCED_LOSSES, is_elementwise, loss_reduction
from .virtual_batch import VIRTUAL, batch_size, virtual_mesh, virtual_propagation

aten = torch.ops.aten
# RingAttention: attention over the batch's dim 0 (a sequence-first model's dim 0 is its sequence),
# which propagation runs as a ring over the split
COUPLING_COLLECTIVES = (AllGather, AllReduce, AllToAll, ReduceScatter, RingAttention)
OPTIONS = ("options: mb=1 (no microbatching); batch_coupling=per_microbatch (each microbatch computes the loss "
           "on its own samples and the step averages the microbatch losses, as Megatron does for auxiliary "
           "losses); or compute the term per sample")


def batch_coupling_pass(gm: fx.GraphModule, ctx, *, user_inputs: tuple[str, ...] = (),
                        params: frozenset[str] = frozenset(), probe: fx.GraphModule | None = None,
                        resized=None, constant_values=None, doubled=None) -> fx.GraphModule:
    """Make the microbatch losses combine exactly, or refuse (see the module docstring).
    ``probe``: the model traced on two samples, analysed in place of a graph whose microbatch holds
    one (its nodes carry the same names). ``resized``: () -> (graph, samples, lifted constants), the
    model traced on another number of samples, asked for only when a loss term is scaled by a
    number that may be the batch size or a slice of the batch may hide a fixed bound.
    ``constant_values``: the graph's lifted constants by placeholder (a scale made of them is read).
    ``doubled``: () -> the model traced on twice the microbatch's samples, analysed in place of a
    microbatch that holds one group of samples a strided slice pairs (``_sample_groups``)."""
    microbatches = int(ctx.plan.get("mb"))
    if microbatches == 1:
        return gm
    per_microbatch = ctx.plan.get("batch_coupling") == "per_microbatch"
    draws = any(n.target is DRAW for n in gm.graph.nodes)
    if per_microbatch and not draws:
        gm.meta["usc_loss_combine"] = "per_microbatch"
        return gm
    group, strided = _sample_groups(gm, user_inputs, doubled)
    batch = batch_size(gm, user_inputs)
    if probe is None and group > 1 and batch == group and doubled is not None:
        probe = getattr(_probed(doubled), "gm", None)  # a microbatch of one group cannot show a split into groups
    analysed = gm if probe is None else batch_outer_pass(_with_draws(probe, ctx), ctx, user_inputs=user_inputs,
                                                        params=params)
    for graph in {id(g): g for g in (gm, analysed)}.values():
        _mark_token_ratios(graph, user_inputs, params)
    fits = group > 1 and batch_size(analysed, user_inputs) % group == 0
    virtual = _virtual_propagation(analysed, ctx, user_inputs, params, group if fits else 1)
    _set_draw_batch_dims(gm, virtual, microbatches)
    if draws:  # a ratio over a count of draws with a batch dim (known only now) is a token mean too
        _mark_token_ratios(gm, user_inputs, params)
    if per_microbatch:
        gm.meta["usc_loss_combine"] = "per_microbatch"
        gm.recompile()
        return gm
    coupling = _first_coupling(virtual, user_inputs) or _fixed_batch_slice(gm, resized, user_inputs) \
        or _fixed_batch_blocks(gm, doubled, user_inputs)
    if coupling is not None:
        misfit = "" if fits or group == 1 else (
            f"; {_name(strided)} pairs samples in groups of {group}, and a microbatch of {batch} samples does not "
            f"hold whole groups: make the samples per microbatch (the global batch / (mb x dp)) a multiple of "
            f"{group}")
        raise ctx.plan.error_at("mb", f"mb={microbatches} runs the batch in microbatches, but {coupling}{misfit}",
                                hint=OPTIONS)
    layouts = {n.name: n.meta[META].layout for n in virtual.graph.nodes if META in n.meta}
    # a node an expansion replaced (a per-token cross-entropy the user reduces) has its result's layout
    layouts.update({n.meta["usc_replaces"]: n.meta[META].layout for n in virtual.graph.nodes
                    if META in n.meta and n.meta.get("usc_replaces") not in (None, *layouts)})
    terms = loss_terms(gm, _batch_dependent(gm, user_inputs), batch_size(gm, user_inputs), constant_values)
    kinds = [_with_path_scales(term, _kind(term, layouts), layouts) for term in terms]
    batch = batch_size(gm, user_inputs)
    kinds, unread = _read_batch_constants(kinds, batch, resized, user_inputs, gm, constant_values)
    if unread is not None:
        raise ctx.plan.error_at("mb", f"mb={microbatches} runs the batch in microbatches, but {unread}", hint=OPTIONS)
    combine = _refuse_unclear(ctx, microbatches, kinds, batch, params)
    _weight_sums(gm, kinds, microbatches)
    gm.meta["usc_loss_combine"] = combine
    gm.recompile()
    return gm


def _sample_groups(gm: fx.GraphModule, user_inputs, doubled=None) -> tuple[int, fx.Node | None]:
    """(the least common multiple of k over the slices taking every k-th sample of a value whose
    dim 0 is the batch's -- ``logp[0::2]``, pairs interleaved in the batch -- and the reshapes
    grouping its samples k by k -- ``h.view(-1, 2, d)`` --, and one such op): the microbatch analysis
    splits the batch into pieces of whole groups, as a microbatch whose size is a multiple of k keeps
    them (1, None: no such op)."""
    batch, group, strided = batch_size(gm, user_inputs), 1, None
    dependent = _batch_dependent(gm, user_inputs)
    for node in gm.graph.nodes:
        if node not in dependent or not isinstance(node.args[0] if node.args else None, fx.Node):
            continue
        shape = shape_of(node.args[0])
        if not shape or shape[0] != batch:
            continue
        if node.target is aten.slice.Tensor and _dim(node) == 0:
            step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        elif node.target in RESHAPES and _splits_dim0(shape_of(node), batch):  # x.view(-1, k, d): groups of k
            step = batch // shape_of(node)[0]
        elif node.target in RESHAPES and _one_group(node, batch, doubled):
            step = batch
        else:
            continue
        if isinstance(step, int) and step > 1:
            group, strided = math.lcm(group, step), strided or node
    return group, strided


def _mark_token_ratios(gm: fx.GraphModule, user_inputs, params) -> None:
    """A loss term written as a ratio of two batch sums whose denominator reads no weight --
    ``(losses * mask).sum() / mask.sum()``, a masked token mean -- is a token mean: marked as
    cross-entropy's expanded mean is, so microbatches weigh by their denominators (loss_count) and
    the denominator's sum over a split is a count, not a coupling. A denominator kept off zero by
    a positive floor or offset (``mask.sum().clamp(min=1)``, ``mask.sum() + 1e-6``) is one too: the
    runtime applies the same floor or offset to the step's count (``usc_count_transform``)."""
    dependent = _batch_dependent(gm, user_inputs)
    for term in loss_terms(gm, dependent):
        node = term.root
        if node.target is not aten.div.Tensor or not _whole_sum(_unscaled(node.args[0])):
            continue
        count, transform = count_transform(node.args[1])
        # the denominator depends on the batch (a constant one makes the term a sum) and reads no weight
        if _whole_sum(count) and count in dependent and not reads_placeholders(count, params):
            node.meta["usc_token_mean"] = node.meta["usc_token_ratio"] = True
            if transform is None:
                _guard_count(gm, node)
            else:
                node.meta["usc_count_transform"] = transform


def _unscaled(node):
    """A value seen through its scalings by numbers (``1e-2 * zsq.sum()`` is a scaled whole sum)."""
    while isinstance(node, fx.Node) and node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
                                                         aten.div.Scalar) and len(node.args) == 2:
        numbers = [isinstance(a, (int, float)) and not isinstance(a, bool) for a in node.args]
        if numbers[1]:
            node = node.args[0]
        elif numbers[0] and node.target in (aten.mul.Tensor, aten.mul.Scalar):
            node = node.args[1]
        else:
            break
    return node


def count_transform(den) -> tuple[fx.Node | None, tuple[str, float] | None]:
    """(count, transform) of a token mean's denominator: ``count.clamp(min=m)`` with m > 0 is
    (count, ("clamp_min", m)), ``count + eps`` with eps > 0 is (count, ("add", eps)), anything
    else (den, None) -- a floor or offset that keeps the denominator off zero, applied alike to a
    microbatch's count and to the step's."""
    if not isinstance(den, fx.Node) or den.op != "call_function" or not den.args:
        return den, None
    args = list(den.args) + [den.kwargs.get(k) for k in ("min", "max")][len(den.args) - 1:]
    if den.target is aten.clamp_min.default or (den.target is aten.clamp.default and (len(args) < 3 or args[2] is None)):
        floor = args[1] if len(args) > 1 else None
        if _positive(floor):
            return den.args[0], ("clamp_min", float(floor))
    if den.target in (aten.add.Tensor, aten.add.Scalar) and len(den.args) == 2 and _positive(den.args[1]) \
            and den.kwargs.get("alpha", 1) == 1:
        return den.args[0], ("add", float(den.args[1]))
    return den, None


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _guard_count(gm: fx.GraphModule, div: fx.Node) -> None:
    """``num / den`` -> ``num / (den + (den == 0))``, as the cross-entropy expansion divides: a
    microbatch whose mask is all zeros adds 0, not NaN, to the step (weighted by its count, 0); a
    batch with nothing counted still divides by 0 in the step. Names follow the division's, so the
    graph and its two-sample probe name them alike."""
    den = div.args[1]
    if den.meta.get("usc_count_guard"):
        return
    with gm.graph.inserting_before(div):
        zero = gm.graph.create_node("call_function", aten.eq.Scalar, (den, 0), name=f"{div.name}_count_is_zero")
        guarded = gm.graph.create_node("call_function", aten.add.Tensor, (den, zero), name=f"{div.name}_count")
    for new in (zero, guarded):
        new.meta.update({k: v for k, v in div.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
        new.meta["val"] = fake_value(new.target, new.args, {})
    guarded.meta["usc_count_guard"] = True
    div.args = (div.args[0], guarded)
    gm.recompile()


def _whole_sum(node) -> bool:
    """A sum of every element (to a scalar)."""
    return isinstance(node, fx.Node) and node.target in (aten.sum.default, aten.sum.dim_IntList,
                                                         aten.count_nonzero.default, aten.count_nonzero.dim_IntList) \
        and shape_of(node) == ()


# ------------------------------------------------------------------ the proof over a virtual dp axis

def _with_draws(probe: fx.GraphModule, ctx) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(probe.graph, {}))
    return random_ops_pass(row_index_pass(fx.GraphModule(probe, graph), ctx), ctx)


def _virtual_propagation(gm: fx.GraphModule, ctx, user_inputs, params, group: int = 1) -> fx.GraphModule:
    try:
        return virtual_propagation(gm, ctx, user_inputs, params, group)
    except CompileError as err:  # a rule refused the op, or no rule places it
        mesh = virtual_mesh(gm, user_inputs, group)  # the split the refusal names
        hint = getattr(err, "hint", "") or ""
        # the refusal names the virtual axis (dp=N): say so, or a dp=1 plan reads "under dp=2"
        raise ctx.plan.error_at("mb", f"mb={ctx.plan.get('mb')} runs the batch in microbatches, and usc cannot show "
                                      f"that the program treats samples independently (split as {mesh} would split "
                                      f"the batch): {err}",
                                hint=f"{OPTIONS}{'; ' + hint if hint else ''}") from None


def _first_coupling(virtual: fx.GraphModule, user_inputs) -> str | None:
    """A collective on the virtual axis other than a token count's sum (the runtime weights by it)."""
    counts, dependent = _token_counts(virtual), _batch_dependent(virtual, user_inputs)
    for node in virtual.graph.nodes:
        if node.op != "call_module" or node in counts:
            continue
        module = virtual.get_submodule(node.target)
        on_batch = isinstance(module, COUPLING_COLLECTIVES) and module.axis == VIRTUAL
        if on_batch and not _sums_the_loss(node, module, dependent):
            return _describe_coupling(node, module)
        if isinstance(module, LocalShard) and module.axis == VIRTUAL \
                and _rows_of_their_own(node.args[0], module.dim, frozenset(user_inputs)):
            return _describe_rows(node)
    return None


_WHOLE = 2**62  # a slice's end past any size: ``x[i:]``


def _fixed_batch_slice(gm: fx.GraphModule, resized, user_inputs) -> str | None:
    """A slice of the batch dim that keeps a whole microbatch by a bound the model fixed (``x[:2]`` on
    a microbatch of 2, or of 1: a slice past the end keeps everything), which on the batch keeps only
    some samples: the microbatch's trace shows no coupling. A bound that is the number of samples
    (``x[:x.size(0)]``) follows it in the model traced on another number; one that does not is named."""
    dependent, batch = _batch_dependent(gm, user_inputs), batch_size(gm, user_inputs)
    suspects = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor and n.args[0] in dependent
                and _dim(n) == 0 and (shape_of(n.args[0]) or (None,))[0] == batch and _keeps_all_by_a_bound(n, batch)]
    if not suspects:
        return None
    other = _probed(resized)
    graph, samples = (other[0], other[1]) if other is not None else (None, 0)
    theirs = {n.name: n for n in graph.graph.nodes} if graph is not None else {}
    for node in suspects:
        other = theirs.get(node.name)
        if other is None or not (_bounds_follow(node, batch) and _bounds_follow(other, samples)):
            start, end = _bounds(node)
            bounds = f"{'' if start in (None, 0) else start}:{'' if end is None or end >= _WHOLE else end}"
            return (f"{_name(node)} slices the batch dim by a bound the model fixes ([{bounds}]): on a microbatch of "
                    f"{batch} it keeps every sample, on the batch it would keep only some")
    return None


def _fixed_batch_blocks(gm: fx.GraphModule, doubled, user_inputs) -> str | None:
    """A reshape that splits the batch dim into a number of blocks the model fixes
    (``h.reshape(2, -1, d)``, then a reduction inside each block): the microbatch's blocks are
    pieces of the microbatch, the batch's are pieces of the batch, and where the proof's split of
    the microbatch falls on the blocks it shows no coupling. Read against the model traced on twice
    the samples: a split whose outer factor follows the number of samples is per-sample groups
    (``x.view(-1, 2, d)``: pairs), one that stays is named."""
    dependent, batch = _batch_dependent(gm, user_inputs), batch_size(gm, user_inputs)
    suspects = [n for n in gm.graph.nodes if n.target in RESHAPES and n.args[0] in dependent
                and (shape_of(n.args[0]) or (None,))[0] == batch
                and (_splits_dim0(shape_of(n), batch) or _blocks_of_one(shape_of(n.args[0]), shape_of(n), batch))]
    if not suspects:
        return None
    graph = getattr(_probed(doubled), "gm", None)
    theirs = {n.name: n for n in graph.graph.nodes} if graph is not None else {}
    for node in suspects:
        twin, blocks = theirs.get(node.name), shape_of(node)[0]
        if twin is None or (shape_of(twin) or (None,))[0] != 2 * blocks:
            fixed = ("whatever the number of samples" if twin is not None else "a number the model may fix (traced "
                     "on twice the samples, it did not show whether it does)")
            return (f"{_name(node)} splits the batch dim into {blocks} blocks, {fixed}: on a "
                    f"microbatch each block holds {batch // blocks} of its samples, on the batch samples "
                    "of every microbatch (split the samples into groups of a fixed size instead: x.view(-1, k, ...))")
    return None


def _one_group(node: fx.Node, batch: int, doubled) -> bool:
    """``[b, d] -> [1, b, d]`` where the model groups its samples b by b (``view(-1, 2, d)`` on a
    microbatch of 2): on twice the samples it makes two groups. Attention's reshapes moving the batch
    inside one block (``[1, b * heads, d]`` at a sequence of 1) keep one."""
    shape = shape_of(node)
    if not shape or len(shape) < 2 or shape[0] != 1 or shape[1] != batch:
        return False
    twin = next((n for n in getattr(_probed(doubled), "gm", fx.GraphModule({}, fx.Graph())).graph.nodes
                 if n.name == node.name), None)
    return twin is not None and (shape_of(twin) or (None,))[0] == 2


def _blocks_of_one(before, after, batch: int) -> bool:
    """``[b, d] -> [b, 1, d]`` by a reshape: as many blocks as samples, one sample each -- what a fixed
    number of blocks looks like on a microbatch of that many samples (``h.reshape(2, -1, d)`` at 2)."""
    return bool(before) and bool(after) and len(after) > 2 and after[0] == batch and after[1] == 1 \
        and len(before) > 1 and before[1] != 1


def _splits_dim0(shape, batch: int) -> bool:
    """An output shape that splits a batch dim of ``batch`` into outer blocks (more than one, fewer than
    the samples; one block holding every sample moves the batch inside, as attention's reshapes do)."""
    return bool(shape) and len(shape) > 1 and 1 < shape[0] < batch and batch % shape[0] == 0 \
        and math.prod(shape[:2]) % batch == 0


def _bounds(node: fx.Node) -> tuple:
    args = list(node.args) + [None] * 4
    return node.kwargs.get("start", args[2]), node.kwargs.get("end", args[3])


def _keeps_all_by_a_bound(node: fx.Node, size: int) -> bool:
    """The slice keeps all of a dim of ``size``, with a bound other than ``x[:]``'s."""
    start, end = _bounds(node)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    first = 0 if start is None else (start + size if start < 0 else start)
    last = size if end is None else (end + size if end < 0 else min(end, size))
    trivial = start in (None, 0) and (end is None or end >= _WHOLE)
    return not trivial and step == 1 and first <= 0 and last >= size


def _bounds_follow(node: fx.Node, size: int) -> bool:
    """Each bound is trivial (0, past the end) or the number of samples itself (``x[:n]``, ``x[-n:]``)."""
    start, end = _bounds(node)
    return start in (None, 0, -size) and (end is None or end >= _WHOLE or end == size)


_SLICES = {aten.slice.Tensor, aten.narrow.default}  # keep every dim (a part of one)
# element-wise in form, but every element one value: rows alike, whatever they are made like
_FILLED_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default}


def _rows_of_their_own(value, dim: int, user_inputs: frozenset[str], depth: int = 0) -> bool:
    """Whether ``value``'s rows along ``dim`` -- the dim the batch's split slices it along
    (LocalShard) -- come from a table or positions of their own: a parameter, buffer or constant, or
    an arange, reached through slices, unsqueezes, element-wise ops and embedding lookups. A
    microbatch's program, traced at its own size, takes such a table's first rows, not its own.
    Rows broadcast from a dim of one (expand), draws (each microbatch draws its own rows) and
    anything not followed here count as rows alike, as before."""
    if not isinstance(value, fx.Node) or depth > 64:
        return False
    shape = shape_of(value)
    if shape is None or dim >= len(shape) or shape[dim] == 1 or value.target is DRAW:
        return False
    if value.op in ("placeholder", "get_attr"):  # state (an input's rows are its samples, split alike)
        return value.name not in user_inputs
    if value.target in ARANGES:
        return True
    if value.target in _SLICES:
        return _rows_of_their_own(value.args[0], dim, user_inputs, depth + 1)
    if value.target is aten.unsqueeze.default:
        at = value.args[1] % len(shape)
        return at != dim and _rows_of_their_own(value.args[0], dim - (at < dim), user_inputs, depth + 1)
    if value.target is aten.embedding.default:  # rows of the lookup: the indices' dims, then the width
        indices = value.args[1]
        return dim < len(shape) - 1 and _rows_of_their_own(indices, dim, user_inputs, depth + 1)
    if value.target is aten.expand.default or (is_elementwise(value.target) and value.target not in _FILLED_LIKE):
        for arg in value.all_input_nodes:
            arg_shape = shape_of(arg)
            if arg_shape is None:
                continue
            aligned = dim - (len(shape) - len(arg_shape))
            if aligned >= 0 and arg_shape[aligned] != 1 and _rows_of_their_own(arg, aligned, user_inputs, depth + 1):
                return True
    return False


def _describe_rows(node: fx.Node) -> str:
    consumer = next(iter(node.users), None)
    op = _op_name(consumer) if consumer is not None else "the output"
    return (f"{op} in {_where(node)} meets rows of a table or of positions along the inputs' dim 0, which usc "
            "splits as the batch: each microbatch would take the table's first rows, not its own (if dim 0 is "
            "the model's sequence, [S, B, ...], feed the model batch-first)")


def _sums_the_loss(node: fx.Node, module, dependent: set[fx.Node]) -> bool:
    """A scalar's sum over the batch that reaches the loss only through its linear combination
    (a batch-independent term added to a partial loss forces it): the microbatch weights sum it."""
    if not (isinstance(module, AllReduce) and module.op == "sum" and shape_of(node) == ()):
        return False
    todo, seen = [node], set()
    while todo:
        for user in todo.pop().users:
            if user in seen or user.op == "output":
                continue
            if user.target not in LINEAR or shape_of(user) != () or LINEAR[user.target](user, dependent) is None:
                return False
            seen.add(user)
            todo.append(user)
    return True


def _token_counts(virtual: fx.GraphModule) -> set[fx.Node]:
    """The nodes computing the denominators of token means (and their reductions over the batch)."""
    found: set[fx.Node] = set()
    todo = [n.args[1] for n in virtual.graph.nodes if n.meta.get("usc_token_mean")]
    while todo:
        node = todo.pop()
        if isinstance(node, fx.Node) and node not in found and node.op != "placeholder":
            found.add(node)
            todo.extend(a for a in node.all_input_nodes)
    return found


def _where(node: fx.Node) -> str:
    ann = node.meta.get(META)
    return f"module '{ann.module or '<root>'}'{f' ({ann.source})' if ann.source else ''}" if ann else "the model"


def _describe_coupling(node: fx.Node, module) -> str:
    consumer = next(iter(node.users), None)
    op = _op_name(consumer) if consumer is not None else "the output"
    ann = node.meta.get(META)
    where = _where(node)
    merged = _describe_merge(node, consumer) if isinstance(module, AllGather) and consumer is not None else None
    if merged is not None:
        return merged
    if isinstance(module, AllReduce):
        return (f"{op} in {where} is not linear in a sum or mean over the batch (a batch statistic, or a "
                f"product of batch means such as a load-balancing loss): its value on a microbatch is not its "
                "share of the value on the batch")
    if isinstance(module, RingAttention):
        return (f"attention in {where} attends across the inputs' dim 0, which usc splits as the batch: the "
                "model uses dim 0 as its sequence (a sequence-first model, [S, B, ...]), so microbatches would "
                "each attend within their own slice of it; feed the model batch-first ([B, S, ...], transposed "
                "inside forward if it computes sequence-first)")
    return (f"{op} in {where} mixes samples across the batch dim (it needs the whole batch: "
            f"{ann.reason if ann else 'gathered'})")


def _describe_merge(gather: fx.Node, reshape: fx.Node) -> str | None:
    """A gather before a reshape that merges the batch inside another dim: the use of the merged
    rows that stopped batch_outer from keeping them sharded is the coupling to name."""
    source = gather.args[0] if gather.args else None
    if reshape.target not in MERGES or not isinstance(source, fx.Node) or META not in source.meta:
        return None
    placement = source.meta[META].layout.placements[0]
    if not isinstance(placement, Shard):
        return None
    for group, dim in merged_groups(reshape):
        if placement.dim in group[1:]:
            stop = region_stop(reshape, group, dim)
            use = (f"{_op_name(stop)} in {_where(stop)}" if stop is not None and stop.op != "output"
                   else "the program's output")
            return (f"{_op_name(reshape)} {list(shape_of(source))} -> {list(shape_of(reshape))} in {_where(reshape)} "
                    f"merges the batch (dim {placement.dim}) inside dim {dim}, and {use} does not treat the "
                    "merged rows alike (it reduces, reorders or draws across them, or meets rows of its own), "
                    "so the samples cannot be run apart")
    return None


# ------------------------------------------------------------------ draws: which dim is the batch

def _set_draw_batch_dims(gm: fx.GraphModule, virtual: fx.GraphModule, microbatches: int) -> None:
    """Each draw's batch dim: that of the tensor it is drawn like, or the dim along which the
    virtual propagation slices the draw for the batch (a draw of a batch-shaped tensor)."""
    by_name = {n.name: n for n in virtual.graph.nodes}
    for node in gm.graph.nodes:
        if node.target is not DRAW:
            continue
        like = node.meta.get("usc_draw_like")
        dim = _shard_dim(by_name[like]) if like in by_name else _sliced_dim(by_name.get(node.name))
        args = list(node.args)
        args[3], args[4] = (-1 if dim is None else dim), microbatches
        node.args = tuple(args)


def _shard_dim(node: fx.Node) -> int | None:
    placement = node.meta[META].layout.placements[0] if META in node.meta else Replicate()
    return placement.dim if isinstance(placement, Shard) else None


def _sliced_dim(node: fx.Node | None) -> int | None:
    """Follow a replicated draw through ops that keep its shape to a slice over the batch."""
    if node is None:
        return None
    shape, todo, seen = shape_of(node), [node], set()
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            module = user.graph.owning_module.get_submodule(user.target) if user.op == "call_module" else None
            if isinstance(module, LocalShard) and module.axis == VIRTUAL:
                return module.dim
            if shape_of(user) == shape and META in user.meta and user.meta[META].layout.placements[0] == Replicate():
                todo.append(user)
    return None


# ------------------------------------------------------------------ the loss as a sum of terms

@dataclass
class Term:
    """One reduction the loss is a linear combination of, with the constants scaling it on the way."""

    root: fx.Node
    constants: tuple[float, ...]  # the numbers it is multiplied by (a division by c as 1 / c)
    batch_dependent: bool
    read: bool = False  # its scale was read against the model traced on another number of samples
    # where its constants were read beyond the ops above it: "partial" (between the batch's reduction
    # and it), "elements" (the linear ops on the elements it reduces), or ""
    path: str = ""
    scaled_by: tuple[str, ...] = ()  # the nodes whose numbers its constants are
    dependent: frozenset = frozenset()  # the graph's batch-dependent nodes
    batch: int = 0  # the graph's number of samples
    values: object = None  # the graph's lifted constants by placeholder

    @property
    def scale(self) -> float:
        return math.prod(c for c in self.constants if isinstance(c, (int, float)) and not isinstance(c, bool))


def _batch_dependent(gm: fx.GraphModule, user_inputs) -> set[fx.Node]:
    """What depends on the batch's samples: the inputs with a batch dim, random draws with one (a
    microbatch draws its rows of the batch's draw), and what is computed from them (a 0-d input, such
    as a token count the batch carries, is every microbatch's whole)."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if (node.op == "placeholder" and node.name in user_inputs and shape_of(node) != ()) \
                or (node.target is DRAW and node.args[3] >= 0) or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _scalar(node) -> bool:
    return isinstance(node, fx.Node) and shape_of(node) == ()


def _independent(arg, dependent: set[fx.Node]) -> bool:
    return not isinstance(arg, fx.Node) or arg not in dependent


def _sum_parts(node, dependent):
    return [(a, ()) for a in node.args[:2]]


class _Scale(NamedTuple):
    """A batch-independent tensor a term is multiplied (or divided) by, its value read on demand."""

    node: fx.Node
    divide: bool


def _scaled_part(node, dependent):
    """x * c, c * x, x / c: the batch-dependent side, scaled by a batch-independent one."""
    a, b = node.args[0], node.args[1]
    if node.target in (aten.div.Tensor, aten.div.Scalar, operator.truediv):
        return [(a, (_as_scale(b, True),))] if _independent(b, dependent) else None
    if _independent(b, dependent):
        return [(a, (_as_scale(b, False),))]
    return [(b, (_as_scale(a, False),))] if _independent(a, dependent) else None


def _as_scale(value, divide: bool):
    if isinstance(value, fx.Node):
        return _Scale(value, divide)
    return _reciprocal(value) if divide else value


def _scale_value(scale, values) -> float | None:
    """The number a scale is: itself, or the value of a scalar tensor computed from the model's lifted
    constants and factory ops alone (``torch.tensor(x.size(0))``, ``torch.full((), n)``,
    ``torch.ones(n).sum()``: the trace holds the number it was made with); None otherwise."""
    if not isinstance(scale, _Scale):
        return scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
    if values is None or shape_of(scale.node) != ():
        return None
    needed, todo = set(), [scale.node]
    while todo:
        node = todo.pop()
        if node in needed:
            continue
        value = node.meta.get("val")
        if node.op == "placeholder" and node.name not in values or node.op not in ("placeholder", "call_function") \
                or node.target is DRAW or (isinstance(value, torch.Tensor) and value.numel() > _SMALL):
            return None
        needed.add(node)
        todo.extend(node.all_input_nodes)
    env: dict[fx.Node, object] = {}
    try:
        for node in scale.node.graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                env[node] = values[node.name]
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            env[node] = node.target(*args, **kwargs)
        number = float(env[scale.node])
    except Exception:  # noqa: BLE001 - a value that cannot be computed here stays unread
        return None
    if scale.divide:
        return 1 / number if number else None
    return number


_SMALL = 1 << 16  # the most elements a value computed for a scale may hold (a count of ones, a table)


def _reciprocal(value):
    """A divisor as the number the term is multiplied by (a tensor divisor stays as it is)."""
    return 1 / value if isinstance(value, (int, float)) and not isinstance(value, bool) and value else value


def _first_part(node, dependent):
    return [(node.args[0], ())]


# Ops through which the loss stays a linear combination of its terms: node -> [(part, scales)],
# or None when the op is not linear in its batch-dependent input (the node is then a term).
LINEAR = {
    aten.add.Tensor: _sum_parts, aten.sub.Tensor: _sum_parts, operator.add: _sum_parts, operator.sub: _sum_parts,
    aten.mul.Tensor: _scaled_part, aten.mul.Scalar: _scaled_part, aten.div.Tensor: _scaled_part,
    aten.div.Scalar: _scaled_part, operator.mul: _scaled_part, operator.truediv: _scaled_part,
    aten.neg.default: _first_part, aten._to_copy.default: _first_part, aten.to.dtype: _first_part,
    aten.clone.default: _first_part, aten.alias.default: _first_part, aten.view.default: _first_part,
    aten.squeeze.default: _first_part, aten.reshape.default: _first_part,
}


def loss_terms(gm: fx.GraphModule, dependent: set[fx.Node], batch: int = 0, values=None) -> list[Term]:
    """The reductions the (scalar) loss is a linear combination of (``batch``: the graph's number of
    samples; ``values``: its lifted constants by placeholder, to read a scale made of them)."""
    dependent = frozenset(dependent)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = output.args[0]
    loss = returned[0] if isinstance(returned, (tuple, list)) else returned
    terms, todo = [], [(loss, (), ())]
    while todo:
        node, constants, names = todo.pop()
        if not isinstance(node, fx.Node):
            continue
        split = LINEAR.get(node.target)
        parts = split(node, dependent) if split is not None and _scalar(node) else None
        if parts is None:
            terms.append(Term(node, constants, node in dependent, dependent=dependent, batch=batch, values=values,
                              scaled_by=names))
            continue
        for part, scales in parts:
            numbers = tuple(v for v in (_scale_value(c, values) for c in scales) if v is not None)
            todo.append((part, constants + numbers, names + (node.name,) * bool(numbers)))
    return terms


def _mean_or_sum(index: int):
    return lambda n: {1: "mean", 2: "sum"}.get(loss_reduction(n, index))


def _token_mean_or_sum(n: fx.Node) -> str | None:
    return {1: "token_mean", 2: "sum"}.get(loss_reduction(n, 3))


# What a term reduces, by op: "sum" / "mean" / "token_mean" (a count of tokens that depends on the labels).
REDUCTIONS = {
    aten.sum.default: lambda n: "sum", aten.sum.dim_IntList: lambda n: "sum",
    aten.mean.default: lambda n: "mean", aten.mean.dim: lambda n: "mean",
    # probability targets: a mean over the samples, not over counted tokens
    aten.cross_entropy_loss.default: lambda n: "mean" if is_soft_target(n) and loss_reduction(n, 3) == 1
    else _token_mean_or_sum(n),
    aten.nll_loss_nd.default: _token_mean_or_sum, aten.nll_loss.default: _token_mean_or_sum,
    aten.nll_loss2d.default: _token_mean_or_sum,
    **{op: _mean_or_sum(index) for op, index in REDUCED_LOSSES.items()},
}


TOKEN_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default,
                aten.nll_loss2d.default}


def _with_path_scales(term: Term, kind: str, layouts: dict[str, Layout]) -> tuple[Term, str]:
    """(term, kind), the term's constants joined by the numbers that scale what it reduces: between
    the batch's reduction and the term (a value partial over the batch split), or on the elements a
    sum or mean reduces (``(per_token / x.size(0)).sum()``)."""
    source = _laid_out_source(term.root, layouts) if kind in ("sum", "mean") else None
    if source is None:
        return term, kind
    if isinstance(layouts[source.name].placements[0], Partial):
        path = "partial"
    elif term.root.target in _REDUCES:
        path = "elements"
    else:
        return term, kind
    scales, names = _path_scales(term, path)
    return replace(term, constants=term.constants + scales, scaled_by=term.scaled_by + names, path=path), kind


def _path_scales(term: Term, path: str) -> tuple[tuple, tuple]:
    """(numbers, their nodes) on the term's ``path`` (see ``_with_path_scales``)."""
    if path == "partial":
        return _batch_reduction(term)[1:]
    if path == "elements":
        return _element_scales(term)
    return (), ()


_ALONG = RESHAPES | {aten.neg.default, aten.clone.default, aten._to_copy.default, aten.to.dtype, aten.alias.default,
                     aten.flatten.using_ints, aten.squeeze.dim, aten.unsqueeze.default, aten.permute.default,
                     aten.transpose.int, aten.contiguous.default}


def _element_scales(term: Term) -> tuple[tuple, tuple]:
    """The numbers the elements a sum or mean reduces are multiplied by, walked back through views
    and scalings while they stay a linear function of one batch-dependent value."""
    _, scales, names = _walk_scales(term, term.root.args[0], lambda node: node.target not in _ALONG | _SCALES)
    return scales, names


def _walk_scales(term: Term, start, stop) -> tuple:
    """(the node the walk stopped at, or None, numbers, their nodes): back from ``start`` through ops
    of one batch-dependent input, collecting what each scaling multiplies by (a scaling by a tensor
    is linear too and passed; ``c / x`` is not and ends the walk), until ``stop(node)``."""
    node, scales, names = start, [], []
    while isinstance(node, fx.Node) and node in term.dependent:
        inputs = [a for a in node.all_input_nodes if a in term.dependent]
        if stop(node) or len(inputs) != 1:
            return (node if stop(node) else None), tuple(scales), tuple(names)
        if node.target in _SCALES:
            if node.target in (aten.div.Tensor, aten.div.Scalar) and node.args[0] is not inputs[0]:
                return None, tuple(scales), tuple(names)
            factor = _factor(node, inputs[0], term.values)
            if factor is not None:
                scales.append(factor)
                names.append(node.name)
        node = inputs[0]
    return None, tuple(scales), tuple(names)


def _factor(node: fx.Node, through: fx.Node, values) -> float | None:
    """The number a scaling ``node`` multiplies ``through`` by (a divisor as its reciprocal), or None."""
    if len(node.args) != 2 or through not in node.args[:2]:
        return None
    other = node.args[1] if node.args[0] is through else node.args[0]
    divide = node.target in (aten.div.Tensor, aten.div.Scalar) and other is node.args[1]
    if node.target in (aten.div.Tensor, aten.div.Scalar) and other is node.args[0]:
        return None  # c / x is not a scaling of x
    return _scale_value(_as_scale(other, divide), values)


def _kind(term: Term, layouts: dict[str, Layout]) -> str:
    """How a term combines over microbatches: 'constant', 'sum', 'mean', 'token_mean' or 'other'."""
    if not term.batch_dependent:
        return "constant"
    if term.root.meta.get("usc_token_mean"):  # a ratio of batch sums (_mark_token_ratios)
        return "token_mean"
    reduce = REDUCTIONS.get(term.root.target)
    reduction = reduce(term.root) if reduce is not None else None
    source = _laid_out_source(term.root, layouts)
    placement = layouts[source.name].placements[0] if source is not None else None
    if reduction is None:
        return "other"
    if term.root.target in TOKEN_LOSSES:
        # its expansion looks through the flatten and shift before it (their gathers die); a gather
        # that stays is a coupling, refused before the terms are read
        return reduction
    if placement is None:
        return "other"
    if isinstance(placement, Partial) and placement.reduce_op == "sum" and reduction != "token_mean":
        # a reduction of a value already reduced over the batch: a sum over microbatches, or a mean
        # where the batch was reduced by one (``per_token.mean(0).mean()``)
        return _batch_reduction(term)[0]
    return reduction if isinstance(placement, Shard) else "other"


_MEANS = {aten.mean.dim, aten.mean.default}
_SCALES = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_REDUCES = _MEANS | {aten.sum.dim_IntList, aten.sum.default}


def _batch_reduction(term: Term) -> tuple[str, tuple, tuple]:
    """('mean' or 'sum', scales, their nodes) of the value a term reduces, when that value was already reduced
    over the batch: walked back from the term to the op that reduced the batch dim -- a mean makes
    the value a mean over the batch, a sum (or a walk that ends elsewhere: a product contracting
    the batch, two reduced values added) a sum -- with the numbers it was multiplied by on the way
    (``.sum(0) / x.size(0)``: a scale the microbatch's size may give, read like a term's)."""
    root = term.root
    inputs = [a for a in root.all_input_nodes if a in term.dependent]
    if len(inputs) != 1:
        return "sum", (), ()
    reduced, scales, names = _walk_scales(
        term, inputs[0], lambda node: node.target in _REDUCES and _reduces_dim0(node, term.batch))
    return ("mean" if reduced is not None and reduced.target in _MEANS else "sum"), scales, names


def _reduces_dim0(node: fx.Node, batch: int) -> bool:
    """A sum or mean over dim 0 of a value whose dim 0 is the batch (all dims, or a list with 0)."""
    shape = shape_of(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not shape or shape[0] != batch:
        return False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return dims in (None, []) or 0 in [d % len(shape) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]


# Ops that keep the batch outermost: a loss expansion may peel them (``loss(x.view(-1, V), ...)`` is
# rewritten on ``x``), so the propagated copy no longer holds them; their input's layout decides.
_BATCH_KEEPING = RESHAPES | {aten.flatten.using_ints, aten.slice.Tensor}


def _laid_out_source(root: fx.Node, layouts: dict[str, Layout]) -> fx.Node | None:
    """The loss term's input, or the nearest value it views whose layout the propagation recorded."""
    node = root.all_input_nodes[0] if root.all_input_nodes else None
    while node is not None and node.name not in layouts and node.op == "call_function" \
            and node.target in _BATCH_KEEPING and (node.target is not aten.slice.Tensor or _dim(node) != 0):
        node = node.args[0]
    return node if node is not None and node.name in layouts else None


def _dim(node: fx.Node) -> int:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)


def _name(node: fx.Node) -> str:
    where, src = module_path(node) or "<root>", user_source(node)
    return f"{_op_name(node)} in module '{where}'{f' ({src})' if src else ''}"


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)) if node.op == "call_function" else str(target)


def _refuse_unclear(ctx, microbatches: int, kinds, batch: int, params=frozenset()) -> str:
    """How the microbatches' losses combine -- 'mean' (weights 1/M), 'token_mean' (weights by one
    count) or 'count_first' (token means whose weights differ from the other terms': each divides by
    the step's count, summed before the first microbatch) -- or a PlanError for terms whose
    combination is not one of the exact forms."""
    error = None
    other = next((t for t, k in kinds if k == "other"), None)
    token = [t for t, k in kinds if k == "token_mean"]
    mixed = [t for t, k in kinds if k in ("sum", "mean")]
    ambiguous = next((t for t, k in kinds if k != "constant" and _may_follow_batch(t, batch)), None)
    floored = token and token[0].root.meta.get("usc_count_transform") and len(kinds) > 1
    mixed_counts = (len(token) > 1 and not _one_count(token)) or (token and mixed)
    if other is not None:
        error = (f"the loss term {_name(other.root)} is not a sum or mean over the batch (e.g. a max, or a nonlinear "
                 "function of batch reductions): microbatch losses do not combine into it")
    elif ambiguous is not None:
        error = (f"the loss term {_name(ambiguous.root)} is scaled by {ambiguous.scale:g}, which may be taken from the "
                 f"shape of the microbatch (of {batch} samples), and the model traced on another number of samples did "
                 "not show whether it is: a batch's size differs between a microbatch and the batch (write .mean() "
                 "instead of .sum() / n)")
    elif mixed_counts or floored:
        unknown = next((t for t in token if not _countable_first(t.root, params)), None)
        if unknown is None:
            return "count_first"
        error = (f"the loss adds a token mean ({_name(unknown.root)}) to other batch terms weighted differently, and "
                 f"its count ({_name(_count_nodes(unknown.root)[0])}) is not computed from the batch alone (it reads a "
                 "weight or a random draw), so the step's count cannot be summed before its first microbatch")
    if error is not None:
        raise ctx.plan.error_at("mb", f"mb={microbatches} runs the batch in microbatches, but {error}", hint=OPTIONS)
    return "token_mean" if token else "mean"


def _count_nodes(mean: fx.Node) -> list:
    """What a token mean's count is computed from: a loss op's target (and class weights), expanded
    later; a ratio's denominator without the guard, floor or offset."""
    if mean.target in TOKEN_LOSSES:
        return [a for a in mean.args[1:3] if isinstance(a, fx.Node)]
    den = mean.args[1]
    return [den.args[0] if isinstance(den, fx.Node) and den.meta.get("usc_count_guard") else count_transform(den)[0]]


def _countable_first(mean: fx.Node, params) -> bool:
    """Whether a token mean's count is computed from the batch (and buffers) alone -- no weight, no
    random draw -- so the runtime can sum the step's count before the first microbatch runs."""
    start = _count_nodes(mean)
    if not all(isinstance(node, fx.Node) for node in start):
        return False
    seen, stack = set(), list(start)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if (node.op == "placeholder" and node.name in params) or node.op not in ("placeholder", "call_function") \
                or node.target is DRAW:
            return False
        stack.extend(node.all_input_nodes)
    return True


# scales compare within a float32 rounding: a scale made as a tensor (``torch.tensor(1 / n)``) is
# rounded to the default dtype, and a fixed scale never comes within it of one that follows the size
_ROUNDING = 1e-6


def _one_count(token: list) -> bool:
    """Token means the user wrote as ratios over one count (a masked cross-entropy and a masked
    z-loss divided by the same ``mask.sum()``): weighted by that count they add up exactly."""
    if not all(t.root.meta.get("usc_token_ratio") and not t.root.meta.get("usc_count_transform") for t in token):
        return False
    return len({_computation(t.root.args[1].args[0]) for t in token}) == 1


def _computation(node, depth: int = 12):
    """A key equal for values computed alike (``mask.sum()`` written twice makes two nodes, one value)."""
    if not isinstance(node, fx.Node):
        return node if not isinstance(node, (list, tuple)) else tuple(_computation(a, depth) for a in node)
    if node.op == "placeholder" or depth == 0:
        return node.name
    return (str(node.target), tuple(_computation(a, depth - 1) for a in node.args),
            tuple(sorted((k, _computation(v, depth - 1)) for k, v in node.kwargs.items())))


def _read_batch_constants(kinds, batch: int, resized, user_inputs, gm: fx.GraphModule, values):
    """(kinds, error): terms whose scale may be taken from the microbatch's shape (``.sum() /
    x.size(0)``, ``* (1 / labels.numel())``, kl_div's batchmean), read against the model traced on
    another number of samples: a scale that stays is a fixed one, and the term keeps its kind; a sum
    whose scale follows 1 / (the number of samples) is a mean over the batch; anything else stays
    unread (refused by name). ``error``: a number scaling a batch-dependent value that follows the
    number of samples where no term read it (``(per_token / x.size(0)).exp().sum()``), named."""
    flagged = [i for i, (t, k) in enumerate(kinds) if k != "constant" and _may_follow_batch(t, batch)]
    dependent = _batch_dependent(gm, user_inputs)
    suspects = [n for n in gm.graph.nodes if n.target in _SCALES and n in dependent
                and _maybe_of_size(_node_factor(n, dependent, values), batch)]
    if resized is None or not (flagged or suspects):
        return kinds, None
    other = _probed(resized)
    if other is None:
        return kinds, None
    graph, samples, their_values = other
    theirs = {t.root.name: t for t in loss_terms(graph, _batch_dependent(graph, user_inputs), samples, their_values)}
    out = list(kinds)
    for i in flagged:
        term, kind = kinds[i]
        other_term = theirs.get(term.root.name)
        if other_term is None:
            continue
        mine = term.scale
        their = other_term.scale * math.prod(_path_scales(other_term, term.path)[0])
        if math.isclose(mine, their, rel_tol=_ROUNDING):
            out[i] = (replace(term, read=True), kind)
        elif kind == "sum" and math.isclose(mine * batch, their * samples, rel_tol=_ROUNDING):
            out[i] = (replace(term, read=True), "mean")
    read = {name for term, _ in out for name in term.scaled_by}  # a term's own numbers: read, or refused as unread
    their_nodes, their_dependent = {n.name: n for n in graph.graph.nodes}, _batch_dependent(graph, user_inputs)
    for node in suspects:
        twin = their_nodes.get(node.name)
        if node.name in read or twin is None or twin not in their_dependent:
            continue
        mine, their = _node_factor(node, dependent, values), _node_factor(twin, their_dependent, their_values)
        if their is not None and not math.isclose(mine, their, rel_tol=_ROUNDING):
            return out, (f"{_name(node)} scales a value of the batch by {mine:g}, a number that follows the "
                         f"microbatch's size ({their:g} with one sample more), where usc cannot read how the "
                         "microbatches' losses combine (scale the loss itself, or write the mean with .mean())")
    return out, None


def _probed(probe):
    """What a lazy probe of the model traced on another number of samples gives (``resized``: (graph,
    samples, lifted constants); ``doubled``: the trace), or None where it was not given or the model
    refuses that batch (what needed it stays unread)."""
    if probe is None:
        return None
    try:
        return probe()
    except Exception:  # noqa: BLE001 - the model's own refusal of that batch, whatever it raises
        return None


def _node_factor(node: fx.Node, dependent, values) -> float | None:
    inputs = [a for a in node.all_input_nodes if a in dependent]
    return _factor(node, inputs[0], values) if len(inputs) == 1 else None


def _maybe_of_size(value: float | None, batch: int) -> bool:
    """A number that may be the microbatch's size or a multiple, or one over it (any, for a size of 1)."""
    if value is None or value == 0:
        return False
    return batch <= 1 or _whole_multiple(value, batch) or _whole_multiple(1 / value, batch)


def _may_follow_batch(term: Term, batch: int) -> bool:
    """Whether the term's scale may come from the microbatch's size: one of its numbers, or its
    reciprocal, is a whole multiple of the size (a microbatch of one sample: any term -- every number
    is a multiple of 1, and a division by the size is a division by 1)."""
    if term.read:
        return False
    return batch <= 1 or any(_maybe_of_size(c, batch) for c in term.constants)


def _whole_multiple(value: float, batch: int) -> bool:
    whole = round(value)
    return whole > 0 and abs(value - whole) <= _ROUNDING * abs(value) and whole % batch == 0


def _weight_sums(gm: fx.GraphModule, kinds, microbatches: int) -> None:
    """Sum terms are multiplied by M, so weights 1/M (the runtime's default) add them up unscaled."""
    for term, kind in kinds:
        if kind != "sum":
            continue
        node = term.root
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node, float(microbatches)))
        scaled.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        scaled.meta["val"] = val(node)
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


__all__ = ["batch_coupling_pass", "loss_terms", "Term"]
