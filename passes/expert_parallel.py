"""Expert parallelism: where expert weights live, and the ``usc::moe`` node made a runtime node.

The tracer leaves each recognised mixture-of-experts block as one ``usc::moe`` node (see
``usc.compiler.moe``). Here:
  * ``expert_layouts`` places expert weights: stacked [E, ...] weights are split over ``ep`` along
    the expert dim (each ep rank holds E/ep experts), and under tp each expert's hidden size F is
    split Megatron-style (gate/up by output, down by input); ``nn.Linear`` experts in a ModuleList
    are split over tp only (each is its own parameter; every rank keeps them all);
  * the expansion replaces the node by ``ExpertParallelMoE`` (all-to-all dispatch and combine over
    ep, dropping by the plan's ``capacity_factor`` in global token order);
  * the sharding rule says how that node lays out on each mesh axis: on ep the tokens stay split
    and experts are split; on the axis that splits F (tp) tokens must be whole and the output is a
    partial sum (the experts' down projection is row-parallel); on other axes (dp, cp) tokens stay
    split and weights whole.

Gradient reduction follows from these layouts (``grad_sync``): non-expert parameters feed values
split over dp and ep, so they are summed over both; stacked expert weights are split on ep, so
they are summed over dp only — the ranks that hold the same experts.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from usc.compiler.errors import CompileError
from usc.compiler.ir import META, Layout, MeshSpec
from usc.compiler.moe import moe as _moe_op  # noqa: F401 - registers torch.ops.usc.moe
from usc.compiler.trace import Traced, module_path
from usc.runtime.moe import ExpertForm, ExpertParallelMoE

from .expansions import ExpansionContext, _Builder
from .expansions import register as register_expansion
from .graph_edit import shape_of
from .sharding_rules import Decision, OpView, _module, is_shard, norm_dim
from .sharding_rules import register as register_rule

MOE_OP = torch.ops.usc.moe.default
R = Replicate()


# ================================================================================ input layouts
def moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == MOE_OP]


def expert_args(node: fx.Node) -> tuple[list[fx.Node], bool, ExpertForm]:
    """(the flat list of expert weights, stacked, the expert form) of a usc::moe node."""
    return list(node.args[3]), bool(node.args[4]), ExpertForm.parse(node.args[5])


def num_experts_of(node: fx.Node) -> int:
    experts, stacked, _ = expert_args(node)
    return shape_of(experts[0])[0] if stacked else len(experts) // 3


# (form kind, stacked) -> per weight role, the dim of the expert's hidden size F that tp splits
# (Megatron: gate/up by output, down by input). None: kept whole on tp. The fused gate_up of
# transformers 5 holds [gate; up] (or interleaved) along one dim, which a contiguous tp chunk would
# cut into gate-only and up-only halves: those experts stay whole on tp and every tp rank runs them.
F_DIMS = {("swiglu", True): (2, 2, 1), ("swiglu", False): (0, 0, 1),
          ("fused", True): (None, None, None, None)}


def _f_dims(node: fx.Node) -> list[int | None]:
    """The tp-split dim of each expert weight of ``node``, in the op's order."""
    experts, stacked, form = expert_args(node)
    dims = F_DIMS[(form.kind, stacked)]
    if stacked:
        return list(dims[:len(experts)])
    n = len(experts) // 3
    return [d for d in dims for _ in range(n)]


def expert_layouts(traced: Traced, plan, mesh: MeshSpec) -> dict[str, Layout]:
    """Placements of expert weights on ep and tp (see the module docstring)."""
    nodes = moe_nodes(traced.gm)
    ep, tp = mesh.size("ep"), mesh.size("tp")
    if ep > 1 and not nodes:
        raise plan.error_at("ep", f"ep={ep} but the model has no mixture-of-experts block usc recognises",
                            hint="mark the block with a rule 'path.to.block: expert', or remove ep=")
    out: dict[str, Layout] = {}
    for node in nodes:
        count = num_experts_of(node)
        if count % ep:
            raise plan.error_at("ep", f"ep={ep} does not divide the {count} experts of module "
                                      f"'{module_path(node)}'", hint=f"use an ep size that divides {count}")
        experts, stacked, _ = expert_args(node)
        for w, f_dim in zip(experts, _f_dims(node)):
            out[w.name] = _weight_layout(plan, mesh, node, w, f_dim, stacked, tp)
    return out


def _weight_layout(plan, mesh: MeshSpec, node: fx.Node, weight: fx.Node, f_dim: int | None, stacked: bool,
                   tp: int) -> Layout:
    placements = [R] * len(mesh.axes)
    if stacked and mesh.size("ep") > 1:
        placements[mesh.axes.index("ep")] = Shard(0)
    if tp > 1 and f_dim is not None:
        size = shape_of(weight)[f_dim]
        if size % tp:
            raise plan.error_at("tp", f"tp={tp} does not divide the expert hidden size {size} of module "
                                      f"'{module_path(node)}'", hint=f"use a tp size that divides {size}")
        placements[mesh.axes.index("tp")] = Shard(f_dim)
    return Layout(tuple(placements))


# ================================================================================== expansion
@register_expansion(MOE_OP)
def expert_parallel_moe(ctx: ExpansionContext, node: fx.Node):
    """usc::moe -> ExpertParallelMoE(x, weights, indices, *experts)."""
    x, weights, indices = node.args[:3]
    experts, stacked, form = expert_args(node)
    capacity, token_axes = None, ()
    if ctx.capacity_factor is not None:
        capacity, token_axes = _capacity(ctx, node, x)
    module = ExpertParallelMoE("ep", num_experts=num_experts_of(node), top_k=shape_of(indices)[-1],
                               stacked=stacked, capacity=capacity, token_axes=token_axes,
                               path=module_path(node), form=form)
    b = _Builder(ctx, node)
    new = b.module(module, x, weights, indices, *experts, stem="expert_parallel_moe")
    new.meta["val"] = node.meta["val"]
    return b.finish(new)


def _capacity(ctx: ExpansionContext, node: fx.Node, x: fx.Node) -> tuple[int, tuple[str, ...]]:
    """C = ceil(capacity_factor * tokens * k / E) over the (micro)batch's global tokens, and the axes
    splitting those tokens (their dim-0 chunk order is the global token order)."""
    shape = shape_of(x)
    tokens, k = math.prod(shape[:-1]), shape_of(node.args[2])[-1]
    capacity = math.ceil(ctx.capacity_factor * tokens * k / num_experts_of(node))
    weight_axes = {i for w in node.args[3] for i, p in enumerate(w.meta[META].layout.placements)
                   if is_shard(p) and ctx.mesh.axes[i] != "ep"}
    axes = []
    for i, p in enumerate(x.meta[META].layout.placements):
        if i in weight_axes or isinstance(p, Replicate):
            continue
        if not is_shard(p, 0):
            raise CompileError(f"capacity_factor in '{module_path(node)}': tokens split along dim "
                               f"{getattr(p, 'dim', p)} on {ctx.mesh.axes[i]} have no global order usc "
                               "can drop by; split the batch only (dp, ep)")
        axes.append(ctx.mesh.axes[i])
    if "ep" in ctx.mesh.axes and "ep" not in axes and ctx.mesh.size("ep") > 1:
        axes.append("ep")
    return capacity, tuple(a for a in ctx.mesh.axes if a in axes)


# ============================================================================== sharding rules
@register_rule(ExpertParallelMoE)
def expert_parallel_rule(view: OpView) -> Decision:
    """Inputs (x, weights, indices, *expert weights); see the module docstring."""
    experts = view.placements[3:]
    if view.axis == _module(view).axis:
        token = _token_placement(view, default=Shard(0))
        stacked = _module(view).stacked
        return Decision((token,) * 3 + tuple(Shard(0) if stacked else R for _ in experts), token)
    if any(is_shard(p) for p in experts):  # the axis splitting each expert's F (tp)
        return Decision((R,) * 3 + tuple(experts), Partial("sum"))
    token = _token_placement(view, default=R)
    return Decision((token,) * 3 + tuple(R for _ in experts), token)


def _token_placement(view: OpView, *, default):
    """x's split along a token dim (any but the last), if the router outputs can follow it."""
    p = view.placements[0]
    if is_shard(p) and p.dim < len(view.shapes[0]) - 1:
        return p
    return default


@register_rule(torch.ops.aten.topk.default)
def topk_rule(view: OpView) -> Decision:
    """top-k along one dim: that dim must be whole; a split along another dim passes through."""
    p = view.placements[0]
    dim = norm_dim(view.arg(2, -1), len(view.shapes[0]))
    if isinstance(p, Partial) or is_shard(p, dim):
        return Decision((R,), R)
    return Decision((p,), p)


__all__ = ["expert_layouts", "expert_parallel_moe", "expert_parallel_rule", "moe_nodes", "topk_rule"]
