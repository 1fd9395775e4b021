"""Measure a model's per-layer costs once, for the cost model and the planner.

``profile_model`` traces the model once, compiles the traced graph for two small probe plans
(``dp=2 cp=2 tp=2`` with and without ``sp=on``, shrunk to what the model and batch allow) and runs
rank 0 of each on fake tensors (no memory, no processes). Every tensor autograd saves is attributed to
the graph node that made it; that node's layout in the probe says whether the batch (dp), the
sequence (cp) and tp split it, which is all the cost model needs to rescale it to any plan. The
collectives of the probe programs are rescaled the same way. Compiling a probe reuses the one trace.

This is glue (it uses the tracer, the passes and the runtime's fake-tensor execution) and so lives
in ``usc``; the cost model itself (``usc.compiler.cost_model``) is pure arithmetic.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from functools import reduce
from typing import NamedTuple

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.utils._pytree import tree_flatten

from usc.compiler.cost_model import CollectiveCost, ModelProfile, ScaleKey, UnitCost
from usc.compiler.errors import CompileError
from usc.compiler.ir import META
from usc.compiler.moe import traced_blocks
from usc.compiler.report import graph_collectives, in_float32_island
from usc.compiler.stamp import block_signature, value_signature
from usc.compiler.trace import Traced, module_path, trace
from usc.dsl import PlanError, parse_plan
from usc.passes import parallelize
from usc.passes.compute_dtype import CASTS
from usc.passes.pipeline_split import constant_nodes, expert_flops, node_flops, routed_expert_products
from usc.passes.recompute import (KEEP_COLLECTIVE, KEPT, RECOMPUTE_ALL, RECOMPUTED, RULES, DecisionRule,
                                  communicates_forward, recompute_regions, records_saved_tensor,
                                  reissued_in_backward)
from usc.runtime.collectives import AllGather, AllReduce, AllToAll, ReduceScatter
from usc.runtime.ring_attention import GRAD_BLOCKS, RingAttention
from usc.passes.saved_values import base_of, saves_for_backward
from usc.passes.zero3 import layer_key
from usc.runtime.moe import ExpertParallelMoE
from usc.runtime.op_classes import ATTENTION, MATMUL_OPERANDS, MATMULS, VIEWS, is_grouped_matmul, is_routed_experts
from usc.runtime.sizes import shape_bytes
from usc.runtime.graph_code import lazy_graph_modules

aten = torch.ops.aten
RECOMPUTE_MODES = ("selective", "full")
# A plan without cp runs, where the probe (cp=2) runs ring attention, the local attention that
# selective recompute recomputes with the rest of the block: read the probe that way for it.
_LOCAL_ATTENTION = DecisionRule(lambda w: isinstance(w.module, RingAttention) and w.block is not None
                                and w.mode == "selective", RECOMPUTED, "attention of a plan without cp")
RULES_WITHOUT_CP = RULES[:RULES.index(KEEP_COLLECTIVE)] + [_LOCAL_ATTENTION] + RULES[RULES.index(KEEP_COLLECTIVE):]


# collectives that are the identity on a mesh axis of size 1 (ring attention is read as local
# attention by its own rule)
_MOVES = (AllGather, AllReduce, AllToAll, ReduceScatter)


def _identity_without(node: fx.Node, axes: frozenset) -> bool:
    """A collective of one of the probe's ``axes`` that moves data in forward: in a plan without
    those axes it is not there (its output is its input)."""
    if not axes or node.op != "call_module":
        return False
    module = node.graph.owning_module.get_submodule(node.target)
    return isinstance(module, _MOVES) and module.axis in axes and communicates_forward(module)


def _without(axes: frozenset, rules: list) -> list:
    """``rules`` for a plan without ``axes``: selective recompute neither keeps the outputs of the
    probe's collectives over them nor ends a region there -- the plan has no such collective -- so
    they read as recomputed (each is its input, ``_through``)."""
    if not axes:
        return rules
    absent = DecisionRule(lambda w: w.block is not None and w.mode == "selective" and _identity_without(w.node, axes),
                          RECOMPUTED, f"{'/'.join(sorted(axes))} collective: the identity of a plan without it")
    at = rules.index(KEEP_COLLECTIVE)
    return rules[:at] + [absent] + rules[at:]


def _through(node: fx.Node, axes: frozenset, moved: dict[str, str], nodes: dict[str, fx.Node]) -> fx.Node:
    """The node that makes ``node``'s storage in a plan without ``axes``: through the probe's
    collectives over them (each the identity there) to the maker of their input's storage (``moved``,
    from the fake run: a reshape may copy or not)."""
    while _identity_without(node, axes) and moved.get(node.name):
        node = nodes[moved[node.name]]
    return node


def batch_and_sequence(example_inputs: tuple) -> tuple[int, int]:
    """(global batch, sequence) of the first input with two dims (token ids [B, S])."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    held = ", ".join(f"Tensor{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
                     for v in example_inputs) or "nothing"
    raise CompileError(f"the planner needs an example input shaped [batch, sequence, ...] (token ids), but the "
                       f"example holds {held}: pass a batch of the model's inputs with the batch and sequence dims")


def at_sequence(example_inputs: tuple, seq: int) -> tuple:
    """The example made ``seq`` long: every input whose second dim is the example's sequence (token
    ids, masks, labels, positions) tiled along it and cut to ``seq``, the rest as they are. A profile
    of it measures the activations at the sequence planned for instead of scaling them from the
    example's: what a rank holds does not grow linearly with the sequence everywhere (attention
    scores an eager attention keeps, tokens gathered whole over cp such as a mixture-of-experts
    block's)."""
    _, current = batch_and_sequence(example_inputs)
    if seq == current:
        return tuple(example_inputs)
    reps = -(-seq // current)
    return tuple(v.repeat(1, reps, *[1] * (v.dim() - 2))[:, :seq]
                 if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == current else v
                 for v in example_inputs)


def profile_model(model: torch.nn.Module, example_inputs: tuple, *, traced: Traced | None = None,
                  moe_blocks=traced_blocks) -> ModelProfile:
    """Per-unit costs of ``model`` at the example's batch and sequence (one trace, two probe compiles).

    A stack of identical blocks (an ``nn.ModuleList`` of same-shaped layers, the 32 or 80 decoder
    layers) is measured on its first ``KEEP_BLOCKS`` blocks and the steady one is stamped for the
    rest, so profiling time does not grow with depth; a model whose forward needs every block, or
    whose first two blocks trace to different programs, is traced whole. ``traced``: profile this
    trace as it is. ``moe_blocks(model)``: the mixture-of-experts blocks to trace whole, as
    usc.compile traces them (``usc.build.moe_blocks`` with a plan's ``expert`` rules)."""
    if traced is not None:
        return _profile(traced, example_inputs)
    with _shallow_stacks(model) as stacks:
        try:
            shallow = trace(model, tuple(example_inputs), moe_blocks=moe_blocks(model)) if stacks else None
        except (CompileError, PlanError):  # the cut model is a shortcut: a list of experts cut to
            shallow = None                  # KEEP_BLOCKS no longer matches its router; trace it whole
    stamped = None
    if shallow is not None and all(_blocks_repeat(shallow, path) for path in stacks):
        copied = tuple(f"{path}.{i}" for path, stack in stacks.items() for i in stack.copied)
        measured = _profile(shallow, example_inputs, blocks=copied)
        stamped = _stamp(measured, stacks) if measured is not None else None
    return stamped or _profile(trace(model, tuple(example_inputs), moe_blocks=moe_blocks(model)), example_inputs)


def _profile(traced: Traced, example_inputs: tuple, *, blocks: tuple[str, ...] = ()) -> ModelProfile | None:
    """The profile of ``traced``; None when one of ``blocks`` (the blocks to be stamped) does not keep
    its own nodes in the probes (``_block_keeps_its_nodes``)."""
    batch, seq = batch_and_sequence(example_inputs)
    with lazy_graph_modules():  # the probes run node by node on fake tensors: no Python for them
        probe_sp, probe_plain = _probe_programs(traced, batch, seq)
    sp_possible = probe_sp is not None
    probe_sp = probe_sp or probe_plain
    units = _unit_order(traced.gm)
    if not all(_block_keeps_its_nodes(program, units, block) for program in (probe_sp, probe_plain)
               for block in blocks):
        return None
    flops, calls, expert_calls = _flops_by_unit(traced.gm, units)
    backward = _backward_flops_by_unit(traced, units)
    routed = _routed_expert_weights(traced.gm)
    per_sp = {sp: _probe_costs(program, units) for sp, program in ((True, probe_sp), (False, probe_plain))}
    joins = {sp: _weight_joins(program, units) for sp, program in ((True, probe_sp), (False, probe_plain))}
    whole = _tp_whole(traced, probe_sp, probe_plain, sp_possible, units)
    params = _param_bytes(probe_sp, units, routed)  # with sp, replicated norm weights also get their tp sum
    saved = _regathered_params(probe_sp, units, per_sp[False][3], routed)
    unreduced, tied = _unreduced_params(probe_sp, units, routed), _tied_params(probe_sp, units, routed)
    frozen = _frozen_params(probe_sp, units, routed)
    expert_bytes, experts = _experts(probe_plain, units, routed)
    moe_units = _moe_units(traced.gm, probe_plain, units)
    built = []
    for name in units:
        balance, matmul, attention = flops.get(name, (0.0, 0.0, 0.0))
        rep, split, reduced = params.get(name, (0, 0, 0))
        built.append(UnitCost(name, balance, matmul, attention, {key: whole[key].get(name, 0.0) for key in whole},
                              rep, split, reduced,
                              acts={sp: per_sp[sp][0].get(name, {}) for sp in per_sp},
                              input_bytes={sp: per_sp[sp][1].get(name, {}) for sp in per_sp},
                              held={(*how, sp): held.get(name, {}) for sp in per_sp
                                    for how, (held, _) in per_sp[sp][5].items()},
                              recomputed={(*how, sp): again.get(name, ()) for sp in per_sp
                                          for how, (_, again) in per_sp[sp][5].items()},
                              collectives={sp: tuple(per_sp[sp][2].get(name, ())) for sp in per_sp},
                              params_expert=expert_bytes.get(name, (0, 0))[0],
                              params_expert_tp=expert_bytes.get(name, (0, 0))[1],
                              moe_layers=int(name in moe_units),
                              params_saved=saved.get(name, (0, 0)),
                              params_unreduced=unreduced.get(name, (0, 0)), tied=tied.get(name, ()),
                              params_frozen=frozen.get(name, (0, 0, 0, 0)),
                              boundary={sp: per_sp[sp][4][name][0] for sp in per_sp},
                              boundary_grad={sp: per_sp[sp][4][name][1] for sp in per_sp},
                              boundary_unsaved={sp: per_sp[sp][4][name][2] for sp in per_sp},
                              matmul_calls=calls.get(name, 0), expert_calls=expert_calls.get(name, 0),
                              flops_backward=backward.get(name, 0.0),
                              weight_joins={sp: joins[sp].get(name, {}) for sp in joins}))
    layers = sum(1 for u in units if u.rsplit(".", 1)[-1].isdigit())
    return ModelProfile(traced.model_name, batch, seq, tuple(built), tp_divides=_tp_divides(probe_plain, batch, seq),
                        cp_possible="cp" in probe_plain.mesh.axes, sp_possible=sp_possible, layers=layers, experts=experts,
                        loss_value=probe_plain.loss_value, dim0_attention=_attention_across_dim0(probe_plain))


def _attention_across_dim0(program) -> str:
    """The module of an attention the probe runs as a ring over dp (it attends across the inputs'
    dim 0, which dp splits as the batch), or ""."""
    for node in program.gm.graph.nodes:
        if node.op == "call_module":
            module = program.gm.get_submodule(node.target)
            if isinstance(module, RingAttention) and module.axis == "dp":
                ann = node.meta.get(META)
                return (ann.module if ann is not None else "") or "<root>"
    return ""


# ------------------------------------------------------------------------------- repeated blocks

# Blocks measured of a stack: the first (it reads what comes before the stack and makes what every
# block reads after it: in TinyLlama the probe's cp pieces of the RoPE tables), the second (the
# steady block, stamped for the blocks not traced) and the last (its output leaves the stack). The
# first two must trace to the same program (``_blocks_repeat``), or the stack is traced whole.
KEEP_BLOCKS = 3
STEADY = 1


PLAIN = (bool, int, float, str, type(None))


def _block_kinds(blocks) -> tuple[int, ...] | None:
    """Per block, 0 when it is set as block 0 and 1 when as block 1 -- all 0 for a stack of equal
    blocks, 0, 1, 0, 1 ... for two kinds alternating (Gemma 2's and GPT-OSS's sliding and full
    attention) -- or None where the blocks are no stack the profile may stamp. Blocks are set alike
    when they have the same type, parameters (shapes, dtypes, trainable), buffers and plain settings
    (the bools, numbers and strings its modules hold: a layer type, a sliding window, whether it
    applies RoPE), a setting that is each block's own index (``layer_idx``) aside. Only the first
    blocks are traced: a block every fourth one unlike the others (no RoPE, a full-attention layer)
    must show here."""
    def settings(m) -> dict:
        return {(path, name): value for path, sub in m.named_modules() for name, value in vars(sub).items()
                if not name.startswith("_") and (isinstance(value, PLAIN) or isinstance(value, (tuple, list))
                                                 and all(isinstance(v, PLAIN) for v in value))}

    first = block_signature(blocks[0])  # a frozen block is not a trainable one's copy
    if not all(block_signature(b) == first for b in blocks[1:]):
        return None
    each = [settings(b) for b in blocks]
    index = {k for k in each[0] if all(type(s.get(k)) is int and s.get(k) == i for i, s in enumerate(each))}
    own = [{k: v for k, v in s.items() if k not in index} for s in each]
    if all(s == own[0] for s in own):
        return (0,) * len(blocks)
    # two kinds strictly alternating: the trace holds blocks 0 and 1 to one program (_blocks_repeat)
    return tuple(i % 2 for i in range(len(blocks))) if all(s == own[i % 2] for i, s in enumerate(own)) else None


@dataclass(frozen=True)
class _Stack:
    """A list of blocks cut for the trace: its length, the blocks kept, and per block the traced
    block it is stamped from (``copied``: those that stand for untraced ones)."""

    length: int
    kept: int
    templates: tuple[int, ...]

    @property
    def copied(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.templates[self.kept - 1:-1])))


def _stack_of(kinds: tuple[int, ...]) -> _Stack | None:
    """How a stack of blocks of these kinds is cut and stamped; None when too short to gain.
    One kind: blocks 0, 1 and 2 traced, the steady block 1 stamped between the first and the last.
    Two kinds alternating: six or seven traced (each kind three times, the last traced of the kind
    the list ends on), each untraced block stamped from the second block of its kind (2 or 3): the
    first of each kind is where values every block of that kind reads are made (a mask laid out for
    them), which the profile holds once, with their maker. With five traced (a kind twice) the
    profile of transformers' Gemma 2 at 11 layers differed from the whole trace's in what block 1
    holds; with six and seven it equals it (10-13 layers, tested)."""
    length = len(kinds)
    if not any(kinds):
        kept, templates = KEEP_BLOCKS, (0,) + (STEADY,) * (length - 2) + (KEEP_BLOCKS - 1,)
    else:
        kept = 6 if kinds[-1] else 7
        templates = tuple(range(kept - 1)) + tuple(3 if kinds[i] else 2 for i in range(kept - 1, length - 1)) \
            + (kept - 1,)
    return _Stack(length, kept, templates) if length > kept else None


@contextlib.contextmanager
def _shallow_stacks(model: torch.nn.Module):
    """Temporarily cut each ModuleList of blocks the profile may stamp to the blocks ``_stack_of``
    keeps; yields {path: _Stack}.

    The list is shortened in place, not replaced in its parent: the module whose forward runs may
    hold the same list under another owner (``usc.plan`` traces usc's wrapper, which registers the
    user's children as its own while the user's forward reads its own attribute). Replacing it in
    the wrapper traced all the blocks, and the profile cost as much as a full trace."""
    cut: dict[str, tuple[torch.nn.ModuleList, _Stack]] = {}
    for path, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.ModuleList) or len(module) <= KEEP_BLOCKS:
            continue
        kinds = _block_kinds(module)
        stack = _stack_of(kinds) if kinds is not None else None
        if stack is None or any(path.startswith(other + ".") for other in cut):
            continue
        cut[path] = (module, stack)
    full = {path: module._modules for path, (module, _) in cut.items()}
    try:
        for path, (module, stack) in cut.items():
            module._modules = type(full[path])(list(full[path].items())[:stack.kept])
        yield {path: stack for path, (_, stack) in cut.items()}
    finally:
        for path, (module, _) in cut.items():
            module._modules = full[path]


def _blocks_repeat(traced: Traced, path: str) -> bool:
    """Blocks 0 and 1 of the stack at ``path`` trace to the same program: node for node (with the
    graph's own nodes between a block and the next, which the profile counts with the block) the same
    op, target, shape, dtype, module path and arguments, where block 1 reads its own nodes where
    block 0 read its own, block 1's parameters where block 0 read block 0's (or the same shared
    one), and outside values of the same shape and dtype where block 0 read outside values (block
    0's output for the stack's input; a layer type's own mask)."""
    nodes = [n for n in traced.gm.graph.nodes if n.op not in ("placeholder", "output")]

    def starts(i: int) -> int | None:
        prefix = f"{path}.{i}"
        return next((k for k, n in enumerate(nodes) if (module_path(n) + ".").startswith(prefix + ".")), None)

    first, second, third = starts(0), starts(1), starts(2)
    if None in (first, second, third) or not first < second < third:
        return False
    a, b = nodes[first:second], nodes[second:third]
    if len(a) != len(b):
        return False
    state = {s.placeholder: s.name for s in traced.state}
    at_a, at_b = {n: k for k, n in enumerate(a)}, {n: k for k, n in enumerate(b)}
    zero, one = f"{path}.0", f"{path}.1"

    def renamed(text: str) -> str:
        return one + text[len(zero):] if text == zero or text.startswith(zero + ".") else text

    def same_arg(x, y) -> bool:
        if not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
            return not isinstance(x, fx.Node) and not isinstance(y, fx.Node) and repr(x) == repr(y)
        if x in at_a or y in at_b:
            return at_a.get(x) == at_b.get(y)
        if x.op == "placeholder" and x.name in state:  # its own parameter or buffer, or the one both share
            return x is y or (y.op == "placeholder" and state.get(y.name) == renamed(state[x.name]))
        # a value from outside: the same one, block 0's output for the stack's input, or another of the
        # same shape (a sliding-window mask for a full one: the same costs, which is all a profile holds)
        return (y.op != "placeholder" or y.name not in state) and \
            value_signature(x.meta.get("val")) == value_signature(y.meta.get("val"))

    for x, y in zip(a, b):
        if (x.op, x.target, value_signature(x.meta.get("val")), renamed(module_path(x))) != \
                (y.op, y.target, value_signature(y.meta.get("val")), module_path(y)):
            return False
        (flat_x, spec_x), (flat_y, spec_y) = tree_flatten((x.args, x.kwargs)), tree_flatten((y.args, y.kwargs))
        if spec_x != spec_y or not all(same_arg(p, q) for p, q in zip(flat_x, flat_y)):
            return False
    return True


def _block_keeps_its_nodes(program, units: list[str], block: str) -> bool:
    """Every node of the probe that runs inside ``block`` (from its first node to the first node of
    the block after it) is counted with it, and no node outside. A node a pass inserted is counted
    with the module its layout rule names -- a reduction with where its partial sums were made, which
    may be a module before the stack (a vocab-parallel embedding whose sums the residual stream
    carries through every block): that module would then hold every block's share, as many as
    were traced, and the block stamped would miss it."""
    where = _units_by_node(program.gm, units)
    stack, index = block.rsplit(".", 1)
    mine, following = block + ".", f"{stack}.{int(index) + 1}."
    state = "before"
    for node in program.gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        path = module_path(node) + "."
        if state == "before" and path.startswith(mine):
            state = "inside"
        elif state == "inside" and path.startswith(following):
            state = "after"
        if (state == "inside") != (where.get(node.name) == block):
            return False
    return state == "after"


def _stamp(profile: ModelProfile, stacks: dict[str, _Stack]) -> ModelProfile | None:
    """Each stack's blocks from the traced block its ``_Stack.templates`` names (the untraced ones
    copies); None when a traced block is missing or another unit sits between two (the caller then
    traces the model whole). The last traced block stays the last: its output leaves the stack."""
    units = list(profile.units)
    for path, stack in stacks.items():
        names = [u.name for u in units]
        traced = [f"{path}.{i}" for i in range(stack.kept)]
        if not set(traced) <= set(names):
            return None
        first = names.index(traced[0])
        if names[first:first + stack.kept] != traced:
            return None
        measured = units[first:first + stack.kept]
        units[first:first + stack.kept] = [replace(measured[t], name=f"{path}.{i}")
                                           for i, t in enumerate(stack.templates)]
    layers = sum(1 for u in units if u.name.rsplit(".", 1)[-1].isdigit())
    return replace(profile, units=tuple(units), layers=layers)


# ------------------------------------------------------------------------------------------ probes

def _probe_programs(traced: Traced, batch: int, seq: int):
    """Compile the largest probe the model allows: each axis 2 where it divides, dropped where not;
    and the same with sp (None when sp cannot compile where tp can: the planner then plans tp alone)."""
    axes = [a for a, ok in (("dp", batch % 2 == 0), ("cp", seq % 2 == 0), ("tp", True)) if ok]
    while True:
        try:
            plain = _probe(traced, axes)
            break
        except (PlanError, CompileError):
            if not axes:
                raise
            axes.remove("cp" if "cp" in axes else "tp" if "tp" in axes else "dp")
    if "tp" not in axes or (seq // (2 if "cp" in axes else 1)) % 2:
        return plain, plain
    return _sp_probe(traced, axes), plain


def _probe(traced: Traced, axes, sp: bool = False):
    """The program of ``traced`` with each of ``axes`` of size 2 (``sp=on`` with ``sp``)."""
    return parallelize(traced, parse_plan(" ".join([f"{a}=2" for a in axes] + ["sp=on"] * sp) or "dp=1"))


def _sp_probe(traced: Traced, axes):
    """``_probe`` with sp, or None where sp cannot compile (a reshape sp's sequence split cannot follow)."""
    try:
        return _probe(traced, axes, sp=True)
    except (PlanError, CompileError):
        return None


def _unit_of(node: fx.Node, current: str) -> str:
    path = module_path(node) or (node.meta[META].module if META in node.meta else "")
    return layer_key(path) if path else current


def _unit_order(gm: fx.GraphModule) -> list[str]:
    units: list[str] = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_module") and module_path(node):
            key = layer_key(module_path(node))
            if key not in units:
                units.append(key)
    return units or ["<root>"]


def _units_by_node(gm: fx.GraphModule, units: list[str]) -> dict[str, str]:
    """Unit of every node; nodes outside any module (the loss) go with the unit before them."""
    out, current = {}, units[0]
    for node in gm.graph.nodes:
        current = _unit_of(node, current)
        out[node.name] = current if current in units else units[-1]
    return out


def model_forward_flops(gm: fx.GraphModule) -> float:
    """Matmul and attention FLOPs of one forward at the graph's shapes: what the cost model's model
    FLOPs (and MFU) count, the sum of every unit's ``flops_matmul + flops_attention``."""
    return sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function"
               and (n.target in MATMULS or n.target in ATTENTION or is_grouped_matmul(n.target)
                    or is_routed_experts(n.target)))


def _flops_by_unit(gm: fx.GraphModule, units: list[str]
                   ) -> tuple[dict[str, tuple[float, float, float]], dict[str, int], dict[str, int]]:
    """(balance, matmul, attention) forward FLOPs per unit at the example's shapes, the unit's
    matrix-product calls (MATMULS and grouped expert products with work to do) of one forward, and
    of those the routed experts' (each expert's products: an ep rank runs its share)."""
    where = _units_by_node(gm, units)
    out: dict[str, list[float]] = {u: [0.0, 0.0, 0.0] for u in units}
    calls: dict[str, int] = {}
    experts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        cost = node_flops(node)
        unit = out[where[node.name]]
        if module_path(node):
            unit[0] += cost
        if node.target in MATMULS or is_grouped_matmul(node.target):  # an expert group's one kernel
            unit[1] += cost
            if cost > 0:
                calls[where[node.name]] = calls.get(where[node.name], 0) + 1
        elif is_routed_experts(node.target):  # usc's experts: each expert's products, one call each
            unit[1] += cost
            # the runtime loops over the experts (under ep a rank runs its share: UnitCost.expert_calls)
            products = routed_expert_products(node)[3]
            calls[where[node.name]] = calls.get(where[node.name], 0) + products
            experts[where[node.name]] = experts.get(where[node.name], 0) + products
        elif node.target in ATTENTION:
            unit[2] += cost
    return {u: tuple(v) for u, v in out.items()}, calls, experts


def _needs_gradient(traced: Traced) -> set[str]:
    """The nodes of the trace autograd gives a gradient: those a trainable parameter reaches through
    floating-point values (a frozen weight, a buffer or the batch starts no gradient)."""
    trainable = {s.placeholder for s in traced.state if s.kind == "param" and s.trainable}
    out: set[str] = set()
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in trainable:
                out.add(node.name)
            continue
        values = [v for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        if any(v.is_floating_point() for v in values) and any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def _backward_flops_by_unit(traced: Traced, units: list[str]) -> dict[str, float]:
    """Backward FLOPs of the matrix products and attention per unit, at the example's shapes: a
    product computes one gradient per operand that needs one (the input's and the weight's: twice
    its forward when both do, once behind a frozen weight or on the batch itself, none where
    nothing before it trains); attention twice its forward when its inputs need a gradient."""
    gm = traced.gm
    where = _units_by_node(gm, units)
    needs = _needs_gradient(traced)
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not (node.target in MATMULS or node.target in ATTENTION
                                               or is_grouped_matmul(node.target) or is_routed_experts(node.target)):
            continue
        if node.target in MATMUL_OPERANDS:
            left, right, _ = MATMUL_OPERANDS[node.target]
            operands = [node.args[left], node.args[right]]
            factor = sum(isinstance(a, fx.Node) and a.name in needs for a in operands)
        else:  # einsum, attention, expert products: twice when anything they read needs a gradient
            factor = 2 * any(a.name in needs for a in node.all_input_nodes)
        out[where[node.name]] = out.get(where[node.name], 0.0) + factor * node_flops(node)
    return out


def _tp_whole(traced: Traced, probe_sp, probe_plain, sp_possible: bool, units: list[str]) -> dict[tuple, dict]:
    """(sp, cp > 1) -> ``_tp_whole_flops`` per unit. Where tp splits a product depends on cp: sp
    cannot split the tokens of a sequence cp already splits (GPT-2's projections run whole on every
    tp rank under cp=2 sp=on, split without cp). The probes hold cp where the model allows it; when
    they show any product whole on tp, the same probes without cp say what plans without cp run."""
    with_cp = "cp" in probe_plain.mesh.axes
    found = {(sp, with_cp): _tp_whole_flops(program, units) for sp, program in ((True, probe_sp), (False, probe_plain))}
    if not with_cp or not any(any(v.values()) for v in found.values()):
        return {**found, **{(sp, not with_cp): flops for (sp, _), flops in found.items()}}
    axes = [a for a in probe_plain.mesh.axes if a != "cp"]
    plain = _probe(traced, axes)
    sp_program = (_sp_probe(traced, axes) if sp_possible else None) or plain
    return {**found, (True, False): _tp_whole_flops(sp_program, units), (False, False): _tp_whole_flops(plain, units)}


def _tp_whole_flops(program, units: list[str]) -> dict[str, float]:
    """Per unit: forward FLOPs (unsplit, at the probe's shapes) of the matrix products whose output
    the probe replicates over tp -- every tp rank runs them whole: a router, experts tp keeps whole
    (transformers' fused gate_up), a product on tokens tp does not split. A product tp splits has
    a sharded or partial output."""
    if "tp" not in program.mesh.axes:
        return {}
    index = program.mesh.axes.index("tp")
    where = _units_by_node(program.gm, units)
    out: dict[str, float] = {}
    for node in program.gm.graph.nodes:
        if META not in node.meta or not isinstance(node.meta[META].layout.placements[index], Replicate):
            continue
        if node.op == "call_function" and (node.target in MATMULS or is_grouped_matmul(node.target)):
            flops = node_flops(node)
        elif node.op == "call_module" and isinstance(module := program.gm.get_submodule(node.target),
                                                     ExpertParallelMoE):
            _, _, indices, *experts = node.args
            flops = expert_flops(indices, experts, module.stacked)
        else:
            continue
        out[where[node.name]] = out.get(where[node.name], 0.0) + flops
    return out


def _key(node: fx.Node, mesh, *, is_float: bool | None = None, bf16_only: bool = False) -> tuple[ScaleKey, int]:
    """How the value of ``node`` scales, and the factor from its probe-local size to unsplit.
    ``is_float``: a float32 value, which dtype=bf16 computes in half the bytes (float64 stays)."""
    if is_float is None:
        value = node.meta.get("val")
        is_float = isinstance(value, torch.Tensor) and value.dtype == torch.float32
    is_float = is_float and not in_float32_island(node)  # a float32 island stays float32 under bf16
    placements = node.meta[META].layout.placements if META in node.meta else ()
    split = {a for a, p in zip(mesh.axes, placements) if isinstance(p, Shard)}
    factor = math.prod(mesh.size(a) for a in split)
    return ScaleKey("dp" in split, "cp" in split, "tp" in split, is_float, bf16_only), factor


def _probe_costs(program, units: list[str]):
    """Per unit: saved activations and unit inputs ({ScaleKey: bytes}), collectives, the parameters
    autograd saves, pipeline-cut crossings and, per recompute mode, what forward holds and what
    backward recomputes; unsplit."""
    where = _units_by_node(program.gm, units)
    saved, saved_params, moved = _saved_tensors(program)
    acts: dict[str, dict] = {}
    nodes = {n.name: n for n in program.gm.graph.nodes}
    for name, nbytes, is_float, bf16_only in saved:
        node = nodes[name]
        key, factor = _key(node, program.mesh, is_float=is_float, bf16_only=bf16_only)
        bucket = acts.setdefault(where[name], {})
        bucket[key] = bucket.get(key, 0) + nbytes * factor
    # per (mode, cp, tp): under selective, a plan without cp reads the probe's ring attention as
    # local attention and its cp collectives as identities, one without tp its tp collectives; full
    # recompute keeps no collective's output and reads the same for every plan (measured: reading
    # its collectives as identities too changes no estimate of the validation models)
    present = {n.graph.owning_module.get_submodule(n.target).axis for n in program.gm.graph.nodes
               if _identity_without(n, frozenset({"cp", "tp"}))}
    under_recompute, readings, asked = {}, {}, {}
    for mode, cp, tp in [(mode, cp, tp) for mode in RECOMPUTE_MODES for cp in (True, False) for tp in (True, False)]:
        absent = frozenset(axis for axis, there in (("cp", cp), ("tp", tp)) if not there) & present
        reading = (mode, cp or mode == "full", absent)
        if reading not in readings:
            rules = _without(absent, RULES if reading[1] else RULES_WITHOUT_CP)
            # under full no rule after full recompute's own decides a node: the rules up to it are the
            # question (the same for every reading, as the rules a plan without cp or tp adds come after)
            question = (mode, tuple(rules[:rules.index(RECOMPUTE_ALL) + 1])) if mode == "full" else reading
            if question not in asked:
                asked[question] = recompute_regions(program.gm, mode, lambda path: False, rules=rules)
            readings[reading] = _under_recompute(program, mode, where, saved, asked[question], absent=absent,
                                                 moved=moved)
        under_recompute[mode, cp, tp] = readings[reading]
    full = next(answer for question, answer in asked.items() if question[0] == "full")
    return acts, _unit_inputs(program, where), _collectives(program, where, nodes, full[0]), saved_params, \
        _boundaries(program, where, units, {name for name, *_ in saved}), under_recompute


def _under_recompute(program, mode: str, where: dict[str, str], saved: list, asked: tuple, *,
                     absent: frozenset = frozenset(), moved: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Per unit under ``recompute=mode``: ({ScaleKey: bytes} forward holds for backward, and the
    unit's steps in program order, each ({ScaleKey: bytes} backward makes again when it recomputes
    the step, {ScaleKey: bytes} the step holds from forward) -- a step is one recompute region, or a
    value saved outside every region). The regions are the recompute pass's own (``asked``: what
    ``recompute_regions`` answered of the probe, which cuts nothing). Forward holds what autograd
    saves for nodes outside the regions (the fake run's storages), each region's inputs (activation
    checkpointing keeps them; state and the batch are not activations) and, under selective, the
    outputs of the region's kept matmuls (the selective policy stores them); a region's output
    that an op outside every region saves stays too; a value several regions read is held once, by
    the unit that made it (the RoPE tables every block reads), as a step where it is made; one a
    single region reads, by that region's unit and step. Backward recomputes what the region's other
    nodes would have saved, one region at a time (``cost_model._recompute_peak``)."""
    gm, mesh, moved = program.gm, program.mesh, moved or {}
    regions, decisions, _ = asked
    region_of = {n.name: i for i, run in enumerate(regions) for n in run}
    nodes = {n.name: n for n in gm.graph.nodes}
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    start = [position[run[0].name] for run in regions]
    held: dict[str, list[tuple[str, ScaleKey, float, int]]] = {}  # value -> [(unit, key, bytes, step)], each once
    again: dict[tuple[str, int], dict] = {}  # (unit, step) -> what backward makes again there
    made_again: set[str] = set()
    for name, nbytes, is_float, bf16_only in saved:
        key, factor = _key(nodes[name], mesh, is_float=is_float, bf16_only=bf16_only)
        aliased = _through(nodes[name], absent, moved, nodes)  # itself where nothing is absent
        if aliased.name != name:  # an absent collective's output is its input's storage: counted once
            if aliased.name in made_again or aliased.name in held or not _local_bytes(aliased, mesh):
                continue
            name, ((key, nbytes), factor) = aliased.name, (_local_bytes(aliased, mesh), 1)
        if name not in region_of or _saved_outside_regions(gm, nodes[name], region_of):
            # a node may own several saved storages (attention's output and its log-sum-exp)
            held.setdefault(name, []).append((where[name], key, nbytes * factor, position[name]))
        elif decisions[nodes[name]] != KEPT:
            made_again.add(name)
            if _casts_held_input(nodes[name], region_of):
                key = key._replace(bf16_only=True)
            bucket = again.setdefault((where[name], start[region_of[name]]), {})
            bucket[key] = bucket.get(key, 0) + nbytes * factor

    def value_of(x: fx.Node) -> fx.Node:
        return _through(_held_value(x, mesh), absent, moved, nodes)

    entering = [{value_of(x) for n in run for x in n.all_input_nodes if x not in inside}
                 for run, inside in ((run, set(run)) for run in regions)]
    readers = Counter(value for values in entering for value in values)
    for index, (run, values) in enumerate(zip(regions, entering)):
        kept = {n for n in run if decisions[n] == KEPT} if mode == "selective" else set()
        for value in values | kept:
            if value.op != "placeholder" and value.name not in held and _local_bytes(value, mesh):
                shared = readers[value] > 1 and value not in kept
                unit = where[value.name] if shared else where[run[0].name]
                step = position[value.name] if shared else start[index]
                held[value.name] = [(unit, *_local_bytes(value, mesh), step)]
    if mode == "selective":
        saved_names = {_through(nodes[name], absent, moved, nodes).name for name, *_ in saved}
        _release_kept(gm, mesh, regions, decisions, where, start, again, position, saved_names, absent)
    steps: dict[str, dict[int, tuple[dict, dict]]] = {}
    for unit, key, amount, step in (entry for entries in held.values() for entry in entries):
        bucket = steps.setdefault(unit, {}).setdefault(step, ({}, {}))[1]
        bucket[key] = bucket.get(key, 0) + amount
    for (unit, step), bucket in again.items():
        steps.setdefault(unit, {}).setdefault(step, ({}, {}))[0].update(bucket)
    ordered = {unit: tuple(by_step[k] for k in sorted(by_step)) for unit, by_step in steps.items()}
    return _sum_by_unit(entry[:3] for entries in held.values() for entry in entries), ordered


def _casts_held_input(node: fx.Node, region_of: dict[str, int]) -> bool:
    """Whether ``node`` is a cast whose input comes from outside its recompute region (the region's
    input, which forward holds): a storage saved through it (transformers' RMSNorm,
    ``h.to(torch.float32)`` of the block's input) is that input itself in float32 and a float32 copy
    the recomputation makes only under bf16."""
    source = node.args[0] if node.target in CASTS and node.args else None
    return isinstance(source, fx.Node) and region_of.get(source.name) != region_of.get(node.name)


def _release_kept(gm, mesh, regions, decisions, where, start, again, position, saved: set[str], absent) -> None:
    """Under selective, a kept matmul output that no op saves and that recomputation reads is let go
    when its region is recomputed: the checkpoint's cache hands it to the recomputed op that reads
    it and keeps no reference (Llama's q, k, v and attention output projections; the gate and up
    projections stay, saved by the activation and the product). Recomputation stops at the region's
    last op that saves a tensor, so an output read only after it (the down projection's, by the
    residual add) is not read again and stays. Counted as negative bytes of the step's recomputation."""
    for index, run in enumerate(regions):
        savers = [position[n.name] for n in run if records_saved_tensor(gm, n)]
        if not savers:
            continue
        inside = set(run)
        for node in run:
            if decisions[node] != KEPT or node.name in saved:
                continue
            readers, frontier = [], list(node.users)
            while frontier:  # through views and the collectives the plan does not have
                user = frontier.pop()
                if user.op == "call_function" and user.target in VIEWS or _identity_without(user, absent):
                    frontier.extend(user.users)
                else:
                    readers.append(user)
            last = max(savers)
            if any(r in inside and decisions.get(r) == RECOMPUTED and position[r.name] < last for r in readers):
                key, amount = _local_bytes(node, mesh)
                bucket = again.setdefault((where[node.name], start[index]), {})
                bucket[key] = bucket.get(key, 0) - amount


def _held_value(node: fx.Node, mesh) -> fx.Node:
    """The node whose storage holding ``node`` keeps: the base of a view chain (a tensor)."""
    base = base_of(node)
    return base if _local_bytes(base, mesh) else node


def _saved_outside_regions(gm: fx.GraphModule, node: fx.Node, region_of: dict[str, int]) -> bool:
    """Whether an op outside every region keeps ``node`` (made inside one) -- or a view of it -- for
    backward. Checkpointing keeps no value made inside a region, so a region's output stays only
    when such an op saves it (an op of another region reads it as that region's input, counted
    there); one only summed outside (the residual stream's add) is freed."""
    return saves_for_backward(gm, node, ignoring=lambda user: user.name in region_of)


def _local_bytes(node: fx.Node, mesh) -> tuple[ScaleKey, float] | None:
    """(key, unsplit bytes) of the tensor ``node`` makes, from its layout; None for a non-tensor."""
    value = node.meta.get("val")
    if META not in node.meta or not isinstance(value, torch.Tensor):
        return None
    key, factor = _key(node, mesh)
    local = math.prod(node.meta[META].layout.local_shape(tuple(value.shape), mesh)) * value.element_size()
    return key, local * factor


def _weight_joins(program, units: list[str]) -> dict[str, dict]:
    """Per unit, {ScaleKey: bytes} of the gradients schedule=zb's input pass records for its weight
    pass (runtime/pipeline_backward.py): one at each op where a trainable parameter's branch meets
    the batch's (a linear's product, a norm's scale) -- the gradient of that op's output, held from
    the microbatch's input-gradient pass to its weight-gradient pass."""
    gm, mesh = program.gm, program.mesh
    where = _units_by_node(gm, units)
    params = {s.placeholder for s in program.state if s.kind == "param" and s.trainable}
    batch = {spec.placeholder for spec in program.inputs}
    weights, data, out = set(), set(), []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            (weights if node.name in params else data if node.name in batch else set()).add(node)
            continue
        inputs = node.all_input_nodes
        from_data, from_weights = any(x in data for x in inputs), any(x in weights for x in inputs)
        if from_data:
            data.add(node)
        elif from_weights:
            weights.add(node)  # a cast, view or gather of parameters alone: still the weight's branch
        if from_data and from_weights and node.name in where:
            amount = _local_bytes(node, mesh)
            if amount is not None:
                out.append((where[node.name], *amount))
    return _sum_by_unit(out)


def _sum_by_unit(entries) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for unit, key, amount in entries:
        bucket = out.setdefault(unit, {})
        bucket[key] = bucket.get(key, 0) + amount
    return out


def _boundaries(program, where: dict[str, str], units: list[str], saved: set[str]
                ) -> dict[str, tuple[dict, dict, dict]]:
    """Per unit: ({ScaleKey: bytes} of the values made at or before it and used after it -- what a
    pipeline cut after the unit sends forward --, the same for those with a gradient, sent back, and
    for those whose storage no saved tensor of a unit before the cut accounts for). A stage keeps
    what it sent until the microbatch's backward starts from it; ``saved`` (the nodes saved storages
    are counted under) tells where that is already counted: a value an op after the cut saves
    through a cast into a float32 island (transformers' RMSNorm, ``h.to(torch.float32)``) is counted
    under the cast, in the receiving stage's unit."""
    order = {u: i for i, u in enumerate(units)}
    out = {u: ({}, {}, {}) for u in units}
    # values computed from buffers alone (RoPE tables, and the probe's cp pieces of them: LocalShard
    # nodes) are recomputed on each stage, never sent: the split's own rule
    recomputed = constant_nodes(program.gm, {s.placeholder for s in program.state if not s.trainable})
    for node in program.gm.graph.nodes:
        value = node.meta.get("val")
        if node.op not in ("call_function", "call_module") or not isinstance(value, torch.Tensor) \
                or node in recomputed:
            continue
        last_use = max((order[where[u.name]] for u in node.users if u.op != "output"), default=-1)
        first = order[where[node.name]]
        if last_use <= first:
            continue
        key, factor = _key(node, program.mesh)
        local = math.prod(node.meta[META].layout.local_shape(tuple(value.shape), program.mesh)) * value.element_size()
        unsaved = node.name not in saved and base_of(node).name not in saved
        for unit in units[first:last_use]:
            for crossing in out[unit][:1] + (out[unit][1:2] if node.meta[META].needs_grad else ()) \
                    + (out[unit][2:] if unsaved else ()):
                crossing[key] = crossing.get(key, 0) + local * factor
    return out


def _unit_inputs(program, where: dict[str, str]) -> dict[str, dict]:
    """Bytes of the activations each unit reads from outside itself (what full recompute keeps)."""
    state = {s.placeholder for s in program.state}
    out: dict[str, dict] = {}
    for node in program.gm.graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        for arg in node.all_input_nodes:
            if arg.name in state or where.get(arg.name) == where[node.name] or "val" not in arg.meta:
                continue
            value = arg.meta["val"]
            if not isinstance(value, torch.Tensor):
                continue
            key, factor = _key(arg, program.mesh, is_float=value.dtype == torch.float32)
            local = value.numel() * value.element_size() / factor
            seen = out.setdefault(where[node.name], {})
            seen.setdefault(("arg", arg.name), (key, local * factor))
    return {u: _sum_keys(v.values()) for u, v in out.items()}


def _sum_keys(pairs) -> dict:
    total: dict = {}
    for key, amount in pairs:
        total[key] = total.get(key, 0) + amount
    return total


def _collectives(program, where: dict[str, str], nodes: dict[str, fx.Node], full_regions: list
                 ) -> dict[str, list[CollectiveCost]]:
    """Per unit, the probe's collectives; ``full_regions``: the regions recompute=full would cut
    (``recompute_regions``' answer, asked once a probe by ``_probe_costs``), whose collectives before
    the last saving op backward issues again."""
    out: dict[str, list[CollectiveCost]] = {}
    reissued = {node.name for run in full_regions for node in reissued_in_backward(program.gm, run)}
    for record in graph_collectives(program.gm, program.mesh):
        node = nodes.get(record.node)
        if node is None or record.axis not in ("tp", "cp", "dp"):
            continue
        payload = node if record.direction == "backward" else node.args[-1 if record.kind == "send/recv" else 0]
        key, factor = _key(payload, program.mesh)
        grads = record.reason == GRAD_BLOCKS  # the ring's dK/dV: cp calls, in float32 whatever the compute dtype
        if grads:
            key = key._replace(is_float=False)
        ring = record.kind == "send/recv" and record.axis == "cp"
        again = record.direction == "forward" and record.node in reissued
        out.setdefault(where.get(record.node, next(iter(where.values()))), []).append(
            CollectiveCost(record.axis, record.kind, record.direction, key, record.bytes_per_call * factor,
                           ring, ring_steps=0 if grads else -1, reissued=again))
    return out


EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")  # MoE experts in a ModuleList named `experts`


class RoutedExperts(NamedTuple):
    """The experts ``usc::moe`` nodes route to (a recognised block's, whatever their names): the
    placeholders of the stacked expert weights, which ep splits (experts in a list stay whole on ep,
    every rank keeps them all: dense parameters to the cost model), and the most experts one node
    holds."""

    weights: frozenset
    most: int


def _routed_expert_weights(gm: fx.GraphModule) -> RoutedExperts:
    names, most = set(), 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_routed_experts(node.target):
            if node.args[4]:  # stacked
                names |= {a.name for a in node.args[3] if isinstance(a, fx.Node) and a.op == "placeholder"}
            most = max(most, routed_expert_products(node)[2])
    return RoutedExperts(frozenset(names), most)


def _moe_units(gm: fx.GraphModule, program, units: list[str]) -> set[str]:
    """Units holding a mixture-of-experts block: a ``usc::moe`` node of ``gm``, or experts in a list
    named ``experts`` (by the names of ``program``'s parameters)."""
    where = _units_by_node(gm, units)
    return ({where[n.name] for n in gm.graph.nodes if n.op == "call_function" and is_routed_experts(n.target)}
            | {_param_unit(s.name, units) for s in program.state if s.kind == "param" and EXPERT.search(s.name)})


def _is_expert(spec, routed: RoutedExperts) -> bool:
    """A weight ep splits (passes/expert_parallel.expert_layouts)."""
    return spec.placeholder in routed.weights


def _experts(program, units: list[str], routed: RoutedExperts) -> tuple[dict[str, tuple[int, int]], int]:
    """((expert bytes, of them tp-split) per unit, experts per MoE layer): the bytes of the weights ep
    splits (``routed``), the count of experts in a list named ``experts`` by their names or of
    those the ``usc::moe`` nodes route to."""
    nbytes: dict[str, tuple[int, int]] = {}
    indices: dict[str, set] = {}
    for spec in program.state:
        if spec.kind != "param" or not spec.trainable:
            continue
        unit = _param_unit(spec.name, units)
        if _is_expert(spec, routed):
            rep, split = _split_bytes(program, spec)
            total, tp_split = nbytes.get(unit, (0, 0))
            nbytes[unit] = (total + rep + split, tp_split + split)
        match = EXPERT.search(spec.name)
        if match:
            indices.setdefault(unit, set()).add(match.group(2))
    return nbytes, max([len(i) for i in indices.values()] + [routed.most])


def _param_unit(name: str, units: list[str]) -> str:
    unit = layer_key(name.rsplit(".", 1)[0]) if "." in name else "<root>"
    return unit if unit in units else units[-1 if unit == "<root>" else 0]


def _param_bytes(program, units: list[str], routed: RoutedExperts) -> dict[str, tuple[int, int, int]]:
    """(replicated, tp-split, tp-reduced) fp32 bytes of trainable dense parameters per unit, unsplit.
    A weight several units use is in each (a stage holds a copy)."""
    out: dict[str, list[int]] = {}
    for spec, held_by in _dense_params(program, units, routed):
        rep, split = _split_bytes(program, spec)
        for unit in held_by:
            row = out.setdefault(unit, [0, 0, 0])
            row[0] += rep
            row[1] += split
            if rep and "tp" in spec.grad_axes:
                row[2] += rep
    return {u: tuple(v) for u, v in out.items()}


def _frozen_params(program, units: list[str], routed: RoutedExperts) -> dict[str, tuple[int, int, int, int]]:
    """Per unit: (replicated, tp-split, ep-split, float32) bytes of its frozen parameters
    (``requires_grad`` off) in their own dtype, the last of all three kinds. A rank holds them whole
    whatever the ZeRO stage (they have no gradient for dp to reduce, so nothing shards them) and keeps
    neither gradients nor optimizer state for them."""
    out: dict[str, list[int]] = {}

    def add(unit: str, rep: int, split: int, expert: int, spec) -> None:
        row = out.setdefault(unit, [0, 0, 0, 0])
        for k, nbytes in enumerate((rep, split, expert)):
            row[k] += nbytes
        row[3] += rep + split + expert if spec.dtype == torch.float32 else 0

    for spec, held_by in _dense_params(program, units, routed, trainable=False):
        for unit in held_by:
            add(unit, *_split_bytes(program, spec), 0, spec)
    for spec in program.state:
        if spec.kind == "param" and not spec.trainable and _is_expert(spec, routed):
            add(_param_unit(spec.name, units), 0, 0, shape_bytes(spec.global_shape, spec.dtype), spec)
    return {unit: tuple(row) for unit, row in out.items()}


def _regathered_params(program, units: list[str], saved: set[str], routed: RoutedExperts
                       ) -> dict[str, tuple[int, int]]:
    """Per unit: (replicated, tp-split) bytes ZeRO-3 gathers again in backward. ZeRO-3 gathers the
    parameters of a layer with the layer of their first use, and gathers them all again in backward
    when autograd keeps one of them (passes/zero3.py); ``saved``: the parameters autograd keeps."""
    where = _units_by_node(program.gm, units)
    placeholders = {n.name: n for n in program.gm.graph.nodes if n.op == "placeholder"}
    order = {n: i for i, n in enumerate(program.gm.graph.nodes)}
    groups: dict[str, list] = {}
    for spec, held_by in _dense_params(program, units, routed):
        if held_by:
            first = min(placeholders[spec.placeholder].users, key=order.__getitem__)
            groups.setdefault(where[first.name], []).append(spec)
    return {unit: tuple(map(sum, zip(*(_split_bytes(program, s) for s in members))))
            for unit, members in groups.items() if any(s.name in saved for s in members)}


def _dense_params(program, units: list[str], routed: RoutedExperts, *, trainable: bool = True) -> list[tuple]:
    """(spec, units that hold it) of every trainable dense parameter (``trainable=False``: every frozen
    one): the unit its name says, or every unit that reads it when several do (a tied embedding / lm
    head); none for one the graph never reads (export passes the second name of a tied weight as an
    unused input)."""
    where = _units_by_node(program.gm, units)
    placeholders = {n.name: n for n in program.gm.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in program.state:
        if spec.kind != "param" or spec.trainable != trainable or _is_expert(spec, routed):
            continue
        users = placeholders[spec.placeholder].users
        readers = list(dict.fromkeys(where[u.name] for u in users if u.name in where))
        held_by = readers if len(readers) > 1 else [_param_unit(spec.name, units)] if readers else []
        out.append((spec, held_by))
    return out


def _split_bytes(program, spec) -> tuple[int, int]:
    """(replicated, tp-split) fp32 bytes of a parameter, unsplit: one of them is zero."""
    nbytes = shape_bytes(spec.global_shape, spec.dtype)
    split = any(isinstance(p, Shard) for a, p in zip(program.mesh.axes, spec.layout.placements) if a == "tp")
    return (0, nbytes) if split else (nbytes, 0)


def _tied_params(program, units: list[str], routed: RoutedExperts) -> dict[str, tuple]:
    """Per unit: (name, replicated, tp-split bytes) of the parameters it shares with other units."""
    out: dict[str, tuple] = {}
    for spec, held_by in _dense_params(program, units, routed):
        for unit in held_by if len(held_by) > 1 else ():
            out[unit] = out.get(unit, ()) + ((spec.name, *_split_bytes(program, spec)),)
    return out


def _unreduced_params(program, units: list[str], routed: RoutedExperts) -> dict[str, tuple[int, int]]:
    """Per unit: (replicated, tp-split) bytes of the parameters whose gradient no bucket sums over dp
    (the graph sums it, e.g. a position table read at positions every dp rank shares)."""
    out: dict[str, tuple[int, int]] = {}
    if "dp" not in program.mesh.axes:  # the probe could not split the batch: nothing to tell
        return out
    for spec, held_by in _dense_params(program, units, routed):
        if "dp" not in spec.grad_axes:
            for unit in held_by:
                out[unit] = tuple(a + b for a, b in zip(out.get(unit, (0, 0)), _split_bytes(program, spec)))
    return out


def _tp_divides(program, batch: int, seq: int) -> int:
    """gcd of every model dim tp splits (heads, kv heads, hidden, vocab); 0 when nothing splits."""
    if "tp" not in program.mesh.axes:
        return 0
    index = program.mesh.axes.index("tp")
    sizes = []
    for node in program.gm.graph.nodes:
        value = node.meta.get("val")
        if META not in node.meta or not isinstance(value, torch.Tensor):
            continue
        placement = node.meta[META].layout.placements[index]
        if isinstance(placement, Shard) and value.shape[placement.dim] not in (batch, seq, batch * seq):
            sizes.append(int(value.shape[placement.dim]))
    return reduce(math.gcd, sizes, 0)


# ------------------------------------------------------------------------------- fake execution

def _saved_tensors(program) -> tuple[list[tuple[str, int, bool, bool]], set[str], dict[str, str]]:
    """(node, bytes, is_float, bf16_only) of every storage rank 0 saves for backward in one forward,
    on fake tensors (a storage made inside a node, e.g. ring attention's blocks, belongs to that
    node), the names of the parameters autograd saves, and for each collective that moves data the
    node that made its input's storage (``_through``). A storage an op saves through a cast into
    or out of a float32 island (``h.to(torch.float32)`` of the bf16 stream, and its cast back) is the
    value itself in this float32 probe but a copy of the cast's dtype under bf16: it is counted as
    the cast's, and where the value is saved itself too, the cast's copy exists only under bf16."""
    from usc.runtime.executor import fake_rank_zero

    with fake_rank_zero(program) as (rank, batch):
        recorder = _Recorder(rank.gm, frozenset(program.mesh.axes))
        rank.gm = recorder
        # a parameter autograd saves is not an activation: a trainable one ZeRO-3 gathers again in
        # backward, a frozen one (a plain tensor here) is held all step anyway
        params = {rank.state[s.placeholder].untyped_storage()._cdata: s.name for s in program.state
                  if s.kind == "param"}
        trainable = {s.name for s in program.state if isinstance(rank.state[s.placeholder], torch.nn.Parameter)}
        seen: dict[int, dict[str, tuple[int, bool]]] = {}  # storage -> {value saved through: (bytes, float)}
        owners: dict[int, str] = {}
        saved_params: set[str] = set()

        def measure(t: torch.Tensor) -> None:
            storage = t.untyped_storage()
            if storage._cdata in params:
                if params[storage._cdata] in trainable:  # ZeRO-3 gathers these again in backward
                    saved_params.add(params[storage._cdata])
                return
            if storage._cdata not in owners:
                owner = recorder.owner.get(storage._cdata)
                if owner is None:  # made inside the running node: find the value it has the size of
                    owner = _same_size(recorder.nodes[recorder.current], t.numel(), program.mesh)
                owners[storage._cdata] = owner
            owner = owners[storage._cdata]
            via = _island_cast(recorder.nodes[recorder.current], recorder.nodes.get(owner), storage._cdata, recorder)
            seen.setdefault(storage._cdata, {}).setdefault(via or owner, (storage.nbytes(), t.dtype == torch.float32))

        rank._measure = measure
        micro = rank._split(batch)
        rank._set_step_divisors(micro)  # a loss dividing by the step's count
        rank._loss(micro[0])
        moved = recorder.moved
    out = []
    for cdata, through in seen.items():
        direct = owners[cdata] in through
        for k, (name, (nbytes, is_float)) in enumerate(through.items()):
            out.append((name, nbytes, is_float, name != owners[cdata] and (direct or k > 0)))
    return out, saved_params, moved


def _island_cast(running: fx.Node, owner: fx.Node | None, storage: int, recorder) -> str | None:
    """The input of ``running`` through which it saves ``storage`` when that input is a cast into or
    out of a float32 island of the owner's value (an alias here, a copy under bf16); else None."""
    if owner is None:
        return None
    for arg in running.all_input_nodes:
        value = recorder.env.get(arg)
        if arg.target in CASTS and arg is not owner and isinstance(value, torch.Tensor) \
                and value.untyped_storage()._cdata == storage and isinstance(arg.args[0], fx.Node) \
                and in_float32_island(arg) != in_float32_island(arg.args[0]):
            return arg.name
    return None


def _same_size(node: fx.Node, numel: int, mesh) -> str:
    """The node, or the input of it, whose per-rank value has ``numel`` elements (a tensor an op saves
    from inside, e.g. softmax probabilities, scales like the value it has the size of)."""
    for candidate in [node, *node.all_input_nodes]:
        value = candidate.meta.get("val")
        if META in candidate.meta and isinstance(value, torch.Tensor):
            if math.prod(candidate.meta[META].layout.local_shape(tuple(value.shape), mesh)) == numel:
                return candidate.name
    return node.name


def _copies_unsplit(node: fx.Node, out, env: dict) -> bool:
    """Whether ``node``, a reshape that is a view of its input on this rank, copies on the whole
    (unsplit) value: a reshape merging a repeated dim with a split one (Hugging Face's ``repeat_kv``:
    the key/value heads expanded and merged) is a view where tp leaves one head a rank and a copy
    where it leaves more, as on every plan without tp. The probe runs with tp, so its rank would
    save the expanded view where a plan without tp saves a copy of every repeated head: the fake run
    makes that copy, the larger of the two (a plan whose tp leaves one head a rank is counted over)."""
    if node.target is not torch.ops.aten.reshape.default or not isinstance(out, torch.Tensor) \
            or not isinstance(node.args[0], fx.Node):
        return False
    given, whole = env.get(node.args[0]), node.args[0].meta.get("val")
    if not isinstance(given, torch.Tensor) or not isinstance(whole, torch.Tensor) \
            or out.untyped_storage()._cdata != given.untyped_storage()._cdata \
            or any(isinstance(x, torch.SymInt) for x in (*whole.shape, *whole.stride())) \
            or not any(stride == 0 and size > 1 for size, stride in zip(whole.shape, whole.stride())):
        return False  # only a repeated (expanded) value: other layouts are the traced kernels' own
    shape = node.meta["val"].shape if isinstance(node.meta.get("val"), torch.Tensor) else None
    if shape is None:
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        unsplit = torch.empty_strided(tuple(whole.shape), tuple(whole.stride()), dtype=whole.dtype, device="meta")
        return not unsplit.reshape(tuple(shape))._is_view()


class _Recorder(fx.Interpreter):
    """Runs the rank's program node by node, remembering which node made each storage."""

    def __init__(self, gm: fx.GraphModule, axes: frozenset = frozenset()) -> None:
        super().__init__(gm)
        self.owner: dict[int, str] = {}
        self.current = ""
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.alive: list[torch.Tensor] = []
        self.axes = axes
        self.moved: dict[str, str] = {}  # a collective that moves data -> the node that made its input's storage

    def __call__(self, *args):
        return self.run(*args)

    def run_node(self, n: fx.Node):
        self.current = n.name
        if n.op == "call_module" and n.args and isinstance(n.args[0], fx.Node) and _identity_without(n, self.axes):
            # read before the node runs: the interpreter frees a value after its last reader
            value = self.env.get(n.args[0])
            if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata in self.owner:
                self.moved[n.name] = self.owner[value.untyped_storage()._cdata]
        out = super().run_node(n)
        if _copies_unsplit(n, out, self.env):
            out = out.clone(memory_format=torch.contiguous_format)
        for value in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(value, torch.Tensor):
                self.owner.setdefault(value.untyped_storage()._cdata, n.name)
                self.alive.append(value)  # fake tensors cost nothing; kept, no storage address is reused
        return out


__all__ = ["profile_model", "batch_and_sequence"]
