"""Recompute: decide per node what backward keeps and what it recomputes; cut regions to recompute.

Requires: every other pass ran (regions are cut from the final per-rank program, or from each
    pipeline stage); nodes carry ``meta["usc"]`` with their module path.
Establishes: with ``recompute=selective|full`` every computing node of a transformer block
    (module path up to its first index, e.g. ``layers.3``, as ZeRO-3 and the pipeline split group
    nodes), and every node of a module a ``recompute`` rule matches, carries
    ``meta["usc"].extra["recompute"]``: "kept" (output stored for backward), "recomputed" (run
    again in backward) or "boundary" (runs once, outside any region), and the reason in
    ``extra["recompute_reason"]``. Each
    maximal convex run of kept/recomputed nodes of one block is replaced by one ``call_module`` to a
    ``usc.runtime.recompute.Recompute`` whose ``body`` holds the run; uses of the run's values read
    ``getitem`` nodes of that call. A collective backward issues again when it recomputes its
    region carries ``extra["recompute_reissued"] = True`` (the report counts it twice). Nothing
    else changes; with recompute=none and no rule the graph is returned untouched.

The decision is a table of rules (first match wins), after Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models") and the Ultra-Scale Playbook:
- full: the whole block is recomputed from its input; the block's collectives are re-issued in
  backward (about one more forward's worth of tp/cp traffic, as in Megatron's full recompute) --
  all but those after the region's last saving op, where checkpointing stops recomputing
  (``reissued_in_backward``).
- selective: matmul outputs are kept; norms, rotary embeddings, activations and the attention core
  are recomputed. A collective that communicates in forward is a boundary: its output is saved
  and it is never re-issued (cheaper than communicating again; ring attention already keeps only
  q, k, v, its output and the LSE, and recomputes block scores in its own backward).
- both: usc's counter-based draws (every dropout mask, rand, router noise: random_ops) are
  recomputed like any op -- a draw is a function of its key (seed, step, microbatch) and the
  element's index, so drawing it again gives the forward's numbers on any rank and any thread --
  while their keys, which read the executor's step and microbatch, are boundaries made once; a
  random op drawing from torch's generator (none is left after random_ops) would be a boundary; ZeRO-3's gathers and in-place ops
  (which could write a region's input that recomputation reads) are boundaries.
"""

from __future__ import annotations

import copy
import operator
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from usc.compiler.ir import META, NodeAnn
from usc.compiler.pass_runner import pipeline_stages
from usc.compiler.trace import module_path
from usc.runtime.op_classes import MATMULS
from usc.runtime.random import RandomKey, draw as _registers_the_draw_op  # noqa: F401
from usc.runtime.recompute import Recompute
from usc.runtime.zero3 import ZeroFetch, ZeroGather

from .saved_values import saved_values

aten = torch.ops.aten
DRAW = torch.ops.usc.draw.default
KEPT, RECOMPUTED, BOUNDARY = "kept", "recomputed", "boundary"


def block_of(path: str) -> str | None:
    """'layers.3.mlp.up_proj' -> 'layers.3'; None outside a numbered list of blocks."""
    match = re.match(r"^(.*?\.\d+)(\.|$)", path)
    return match.group(1) if match else None


def node_module(node: fx.Node) -> str:
    ann = node.meta.get(META)
    return (ann.module if ann is not None and ann.module else "") or module_path(node)


def node_block(node: fx.Node) -> str | None:
    """The block ``node`` is recomputed with: its module's. A collective usc placed between two ops
    of one block -- its input made there, every user there -- is that block's, whatever module it
    is reported under: a reduction of partial sums is attributed to the op that made them (the
    embedding's, deferred into the first block's projections when a model normalizes q and k
    whole), and outside every block it would cut the block's region in pieces, each holding its
    own inputs."""
    block = block_of(node_module(node))
    if block is None and node.op == "call_module" and node.all_input_nodes and node.users \
            and hasattr(node.graph.owning_module.get_submodule(node.target), "forward_collective"):
        around = {block_of(node_module(x)) for x in node.all_input_nodes} | \
            {block_of(node_module(u)) for u in node.users}
        if len(around) == 1:
            return around.pop()
    return block


@dataclass(frozen=True)
class Where:
    """What a decision rule may read about one node."""

    node: fx.Node
    gm: fx.GraphModule
    module: object | None  # the call_module target, if any
    mode: str  # the plan's recompute mode
    marked: bool  # a `recompute` rule matches the node's module (or a parent)
    block: str | None


@dataclass(frozen=True)
class DecisionRule:
    applies: Callable[[Where], bool]
    decision: str | None  # None: not considered for recompute at all
    why: str


def _is_zero3(w: Where) -> bool:
    if isinstance(w.module, (ZeroFetch, ZeroGather)):
        return True
    source = w.node.args[0] if w.node.target is operator.getitem and w.node.args else None
    return isinstance(source, fx.Node) and source.op == "call_module" \
        and isinstance(w.gm.get_submodule(source.target), ZeroGather)


def _is_random(w: Where) -> bool:
    """Draws random numbers from a generator: a seeded op, except dropout that is off (p=0 or not
    training), and except usc's counter-based draw, a function of its key: drawn again from the
    same key it gives the same numbers, so a region may recompute it (its key stays outside)."""
    target, args = w.node.target, w.node.args
    if target is DRAW:
        return False
    if target is aten.scaled_dot_product_attention.default:
        return bool(args[4] if len(args) > 4 else w.node.kwargs.get("dropout_p", 0.0))
    if target in (aten.dropout.default, aten.native_dropout.default):
        return bool(args[1]) and bool(args[2])
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _mutates(w: Where) -> bool:
    """An in-place op (``add_``, ``relu_`` ...): rerunning it would change a tensor twice."""
    schema = getattr(w.node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _communicates_forward(w: Where) -> bool:
    return communicates_forward(w.module)


def communicates_forward(module) -> bool:
    """A collective node that moves data in forward (not Megatron's f, the identity forward)."""
    kind = getattr(module, "forward_collective", None)
    return kind is not None and kind() not in (None, "none")


# selective: communicate once, keep the result (cheaper than re-issuing it in backward)
KEEP_COLLECTIVE = DecisionRule(_communicates_forward, BOUNDARY, "collective: output kept, not re-issued")
# full: every node of a block that reaches it is recomputed; no rule after it decides a node under full
RECOMPUTE_ALL = DecisionRule(lambda w: w.mode == "full", RECOMPUTED, "recompute=full")
RULES = [
    # placeholders and the output are the region's edges, never inside one
    DecisionRule(lambda w: w.node.op not in ("call_function", "call_module"), None, "not computed"),
    # gathered parameters enter regions as inputs; ZeRO-3's hook re-gathers them in backward
    DecisionRule(_is_zero3, BOUNDARY, "ZeRO-3 gather"),
    # drawn once: a region never re-draws from a generator (see the module docstring)
    DecisionRule(_is_random, BOUNDARY, "random op: output kept"),
    # a draw's key reads the step and microbatch the executor set for this forward: made once and
    # kept, so a recomputed draw hashes the forward's key whatever microbatch runs meanwhile
    DecisionRule(lambda w: isinstance(w.module, RandomKey), BOUNDARY, "random key: made once, kept"),
    # an in-place op may write a region's input, which a recomputation would then read changed
    DecisionRule(_mutates, BOUNDARY, "in-place op: runs once"),
    DecisionRule(lambda w: w.marked, RECOMPUTED, "a recompute rule marks its module"),
    DecisionRule(lambda w: w.block is None, None, "outside the transformer blocks"),
    RECOMPUTE_ALL,
    DecisionRule(lambda w: w.mode != "selective", None, "recompute=none"),
    KEEP_COLLECTIVE,
    DecisionRule(lambda w: w.node.target in MATMULS, KEPT, "matmul output kept"),
    DecisionRule(lambda w: True, RECOMPUTED, "pointwise / norm / attention: recomputed"),
]


def decide(node: fx.Node, gm: fx.GraphModule, mode: str, marked: Callable[[str], bool], *,
           rules: list[DecisionRule] = RULES) -> DecisionRule:
    """The first rule of ``rules`` that applies to ``node`` (the last one always does)."""
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    path = node_module(node)
    where = Where(node, gm, module, mode, marked(path), node_block(node))
    return next(rule for rule in rules if rule.applies(where))


def rule_marker(plan) -> Callable[[str], bool]:
    """Whether a `recompute` rule matches a module path or one of its parents."""
    globs = [r for r in plan.rules if any(a.name == "recompute" for a in r.actions)]

    def marked(path: str) -> bool:
        parts = path.split(".") if path else []
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(rule.matches(p) for rule in globs for p in prefixes)

    return marked


def recompute_pass(gm: fx.GraphModule, ctx, *, params: set[str] = frozenset()) -> fx.GraphModule:
    """Mark nodes kept/recomputed and wrap recompute regions (see the module docstring)."""
    mode = ctx.plan.get("recompute")
    marked = rule_marker(ctx.plan)
    if mode == "none" and not any(any(a.name == "recompute" for a in r.actions) for r in ctx.plan.rules):
        return gm
    for part in pipeline_stages(gm) or [gm]:
        _recompute_graph(part, mode, marked, params)
    return gm


def _recompute_graph(gm: fx.GraphModule, mode: str, marked, params: set[str]) -> None:
    regions, decisions, reasons = recompute_regions(gm, mode, marked)
    for node, decision in decisions.items():
        node.meta[META].extra.update(recompute=decision, recompute_reason=reasons[node])
    for run in regions:
        for node in reissued_in_backward(gm, run):
            node.meta[META].extra["recompute_reissued"] = True
    for index, run in enumerate(regions):
        extract_region(gm, run, kept=tuple(n.name for n in run if decisions[n] == KEPT), index=index,
                       params=params)
    gm.graph.lint()
    gm.recompile()


def recompute_regions(gm: fx.GraphModule, mode: str, marked: Callable[[str], bool], *,
                      rules: list[DecisionRule] = RULES) -> tuple[list[list[fx.Node]], dict, dict]:
    """The runs of ``gm`` that become recompute regions, and every considered node's decision and
    reason (a run that frees nothing is turned into boundaries). Reads the graph, changes nothing:
    the cost model's profile asks it of a probe program (with ``rules`` that read the probe's ring
    attention as the local attention of a plan without cp)."""
    decisions, reasons = {}, {}
    for node in gm.graph.nodes:
        rule = decide(node, gm, mode, marked, rules=rules)
        if rule.decision is not None:
            decisions[node], reasons[node] = rule.decision, rule.why
    regions = []
    for run in convex_runs(gm, decisions):
        if worth_recomputing(run, decisions):
            regions.append(run)
        else:  # e.g. a lone residual add: nothing to free
            decisions.update({n: BOUNDARY for n in run})
            reasons.update({n: "nothing in its run saves a tensor" for n in run})
    return regions, decisions, reasons


def reissued_in_backward(gm: fx.GraphModule, run: list[fx.Node]) -> list[fx.Node]:
    """The collectives of a region (nodes in program order) that backward issues again when it
    recomputes the region: those that run before the region's last op that saves a tensor.

    Non-reentrant checkpointing stops a recomputation as soon as every tensor the forward saved
    exists again (torch.utils.checkpoint's early stop), so a collective after the region's last
    saving op runs once -- under recompute=full, tp's all-reduce (sp: reduce-scatter) that closes a
    block before its residual add; the all-reduce after attention, the sp all-gathers and the cp ring
    (which saves its own q, k, v) run again. Selective regions hold no collective that communicates
    in forward (they are boundaries), so nothing is re-issued there."""
    saving = [i for i, node in enumerate(run) if records_saved_tensor(gm, node)]
    last = saving[-1] if saving else -1
    return [node for node in run[:last + 1]
            if node.op == "call_module" and communicates_forward(gm.get_submodule(node.target))]


def records_saved_tensor(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether autograd records ``node`` with a saved tensor: it has a gradient and its op keeps
    something (``saved_values``, by op class)."""
    ann = node.meta.get(META)
    return ann is not None and ann.needs_grad and bool(saved_values(gm, node))


def worth_recomputing(run: list[fx.Node], decisions: dict) -> bool:
    """A region frees memory only if a recomputed node would otherwise save a tensor (what autograd
    keeps, by op class: ``saved_values``, the model the cost profile reads too). A module call
    counts: what it keeps is its own."""
    return any(decisions[n] == RECOMPUTED and (n.op == "call_module" or (
        bool(saved_values(n.graph.owning_module, n)) and not getattr(n.target, "is_view", False))) for n in run)


def convex_runs(gm: fx.GraphModule, decisions: dict) -> list[list[fx.Node]]:
    """Per block, maximal runs (graph order) of kept/recomputed nodes. A run closes when a node
    outside it uses one of its values, so no path leaves a run and comes back: every run is convex
    and can become one call placed after its last node."""
    open_runs: dict[str, list[fx.Node]] = {}
    run_of: dict[fx.Node, str] = {}
    done: list[list[fx.Node]] = []

    def close(key: str) -> None:
        run = open_runs.pop(key)
        for n in run:
            run_of.pop(n, None)
        done.append(run)

    for node in gm.graph.nodes:
        inside = decisions.get(node) in (KEPT, RECOMPUTED)
        key = node_block(node) or node_module(node) if inside else None
        for source in sorted({run_of[x] for x in node.all_input_nodes if x in run_of} - {key}):
            close(source)
        if inside:
            open_runs.setdefault(key, []).append(node)
            run_of[node] = key
    for key in list(open_runs):
        close(key)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(done, key=lambda run: order[run[0]])


def extract_region(gm: fx.GraphModule, run: list[fx.Node], *, kept: tuple[str, ...], index: int,
                   params: set[str] = frozenset()) -> fx.Node:
    """Replace ``run`` (convex, in graph order) by a call to a Recompute module holding it."""
    inside = set(run)
    inputs = list(dict.fromkeys(x for n in run for x in n.all_input_nodes if x not in inside))
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    body, env = fx.Graph(), {}
    for x in inputs:
        env[x] = body.placeholder(x.name)
        env[x].meta = copy.copy(x.meta)
        env[x].meta["usc_region_input"] = "param" if _is_param(gm, x, params) else "activation"
    for n in run:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[o] for o in outputs))
    label = block_of(node_module(run[0])) or node_module(run[0])
    kept = tuple(env[n].name for n in run if n.name in kept)
    name = _free_name(gm, f"usc_recompute_{index}")
    gm.add_submodule(name, Recompute(fx.GraphModule(gm, body, class_name="RecomputeRegion"), kept=kept, label=label))
    with gm.graph.inserting_after(run[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    call.meta["nn_module_stack"] = run[0].meta.get("nn_module_stack", {})
    first = outputs[0].meta[META] if outputs else run[0].meta[META]
    call.meta[META] = NodeAnn(first.layout, needs_grad=any(o.meta[META].needs_grad for o in outputs), module=label,
                              reason=f"recompute region of {label}")
    previous = call
    for i, out in enumerate(outputs):
        with gm.graph.inserting_after(previous):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta = copy.copy(out.meta)
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
        previous = item
    moved = [n.target for n in run if n.op == "call_module"]
    for n in reversed(run):
        gm.graph.erase_node(n)
    for target in moved:
        gm.delete_submodule(target)
    return call


def _is_param(gm: fx.GraphModule, x: fx.Node, params: set[str]) -> bool:
    """A parameter entering a region (saved, but not an activation)."""
    if x.op == "placeholder":
        return x.name in params
    source = x.args[0] if x.target is operator.getitem and x.args else None
    return isinstance(source, fx.Node) and source.op == "call_module" \
        and isinstance(gm.get_submodule(source.target), ZeroGather)


def _free_name(gm: fx.GraphModule, name: str) -> str:
    stem, k = name, 0
    while hasattr(gm, name):
        k += 1
        name = f"{stem}_{k}"
    return name
