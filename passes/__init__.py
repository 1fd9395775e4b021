"""Graph passes. ``build_pipeline`` is the one place that orders them; ``parallelize`` runs them.

Each pass is ``name_pass(gm, ctx, **options) -> gm`` in its own module, with ``Requires:`` and
``Establishes:`` in its docstring.
"""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Shard

from usc.compiler.errors import ShardingError, UnsupportedOpError
from usc.compiler.functional import input_write_warnings
from usc.compiler.ir import MeshSpec, copy_graph_module
from usc.compiler.pass_runner import CompileContext, PassSpec, run_pipeline
from usc.compiler.program import Program, build_program
from usc.compiler.trace import Traced, lifted_constants
from usc.runtime.graph_code import lazy_graph_modules

from . import functional_rules  # noqa: F401 - registers the rules of functionalized writes
from .fusion import fusion_pass
from .expert_parallel import expert_layouts
from .attention_masks import attention_masks_pass
from .batch_coupling import batch_coupling_pass
from .batch_outer import batch_outer_pass
from .compute_dtype import compute_dtype_pass
from .grad_sync import grad_sync_pass
from .layouts import batch_layouts, merge_layouts, tp_layouts
from .local_draws import local_draws_pass
from .localize import localize_pass
from .loss_count import expose_loss_count_pass
from .pipeline_split import pipeline_split_pass
from .plan_checks import check_supported
from .propagate import propagate_pass
from .random_ops import random_ops_pass
from .recompute import recompute_pass
from .row_index import row_index_pass
from .state_writes import state_writes_pass
from .tensor_parallel import conv1d_as_linear
from .zero3 import zero3_pass

def build_pipeline(*, input_layouts, grad_inputs: set[str], params: set[str],
                   constants: frozenset[str] = frozenset(), user_inputs: tuple[str, ...] = (),
                   batch_probe: fx.GraphModule | None = None, resized_probe=None,
                   constant_values=None, doubled_probe=None) -> list[PassSpec]:
    """The ordered pass list. Order matters:
    random_ops and batch_coupling read the traced graph (no layouts yet): random draws first, so the
    microbatch analysis sees them as draws and can give each its batch dim;
    propagate first (every later pass reads layouts); local_draws then folds the slices a draw's
    readers take into the draw; grad_sync needs the final layouts and the
    inserted redistributions (an AllGather can absorb an f); localize then rewrites shapes for one
    rank, so nothing after it reasons about global shapes in arguments; expose_loss_count and
    zero3 edit the finished per-rank program; pipeline_split cuts it last."""
    return [
        # first: an index picking each row of its own batch (a padding mask) reads the batch dim whole
        PassSpec("row_index", row_index_pass, annotated=False),
        # a mask proven causal (and its constant subgraph) is gone before anything places it
        PassSpec("attention_masks", attention_masks_pass, annotated=False),
        PassSpec("random_ops", random_ops_pass, annotated=False),
        # before batch_coupling: a buffer written from the batch is named as such
        PassSpec("state_writes", state_writes_pass, {"user_inputs": tuple(user_inputs)}, annotated=False),
        # before batch_coupling and propagate: a batch merged inside another dim is merged outside
        PassSpec("batch_outer", batch_outer_pass, {"user_inputs": tuple(user_inputs), "params": frozenset(params)},
                 annotated=False),
        PassSpec("batch_coupling", batch_coupling_pass, {"user_inputs": tuple(user_inputs), "params": frozenset(params),
                                                         "probe": batch_probe, "resized": resized_probe,
                                                         "constant_values": constant_values,
                                                         "doubled": doubled_probe},
                 annotated=False),
        PassSpec("compute_dtype", compute_dtype_pass, {"params": frozenset(params)}, annotated=False),
        PassSpec("propagate", propagate_pass, {"input_layouts": input_layouts, "grad_inputs": grad_inputs}),
        # right after propagate: a draw its readers slice draws only the slice
        PassSpec("local_draws", local_draws_pass),
        PassSpec("grad_sync", grad_sync_pass, {"params": params}),
        PassSpec("localize", localize_pass),
        PassSpec("expose_loss_count", expose_loss_count_pass),
        PassSpec("zero3", zero3_pass, {"params": params}),
        # after localize (a kernel's rows are per-rank shapes) and after every pass that inserts
        # collectives or gathers, so regions never cross one
        PassSpec("fusion", fusion_pass),
        # last: the stages are cuts of the finished per-rank program
        PassSpec("pipeline_split", pipeline_split_pass, {"constants": constants, "params": frozenset(params)}),
        # after the split: regions are cut from each stage's final program, and a region never
        # spans a stage boundary
        PassSpec("recompute", recompute_pass, {"params": params}),
    ]


def parallelize(traced: Traced, plan, *, verify=None) -> Program:
    """Run the passes for ``plan``; a Megatron pair the graph cannot split falls back to replicated."""
    zigzag = ("cp",) if plan.get("cp_mode") == "zigzag" and plan.size("cp") > 1 else ()
    mesh = MeshSpec(tuple(plan.mesh_axes), tuple(plan.mesh_shape), zigzag)
    check_supported(plan)
    params = {s.placeholder for s in traced.state if s.trainable}
    replicated: dict[int, str] = {}
    replicated_cols: dict[str, str] = {}
    # under every plan, before any layout is read: GPT-2's Conv1D as the linear it computes (its
    # flatten would merge a cp or sp shard of the sequence into the rows, gathering it whole)
    conv1d_as_linear(traced.gm, {s.placeholder for s in traced.state if s.kind == "param"})
    while True:
        tp = tp_layouts(traced, plan, mesh, replicated, replicated_cols)
        layouts = merge_layouts(mesh, batch_layouts(traced, plan, mesh), tp.layouts,
                                expert_layouts(traced, plan, mesh))
        _check_tp_splits_something(plan, mesh, tp, layouts, traced)  # a fallback below only keeps more whole
        ctx = CompileContext(mesh, plan)
        constants = frozenset(s.placeholder for s in traced.state if not s.trainable)
        passes = build_pipeline(input_layouts=layouts, grad_inputs=params, params=params, constants=constants,
                                user_inputs=tuple(traced.user_inputs),
                                batch_probe=traced.batch_probe.gm if traced.batch_probe is not None else None,
                                resized_probe=traced.resized_probe, constant_values=lifted_constants(traced),
                                doubled_probe=traced.doubled_probe)
        try:
            # the passes' graphs as lazy modules: a pass's recompile only marks its Python stale,
            # generated once when the program first runs (each rank shares it: runtime/executor.py)
            with lazy_graph_modules():
                gm = run_pipeline(copy_graph_module(traced.gm), ctx, passes, verify=verify)
            break
        except ShardingError as err:
            index = _group_of(err, tp.groups, replicated)
            if index is None:
                raise _as_plan_error(plan, err) from None
            reason = f"kept replicated: {err.reason}"
            at_fault = _cols_at_fault(err, tp.groups[index], replicated_cols)
            if at_fault:
                replicated_cols.update({name: reason for name in at_fault})
            else:
                replicated[index] = reason
    program = build_program(gm, mesh, traced.state, traced.user_inputs, tp.choices, ctx.timings)
    program.warnings.extend(plan_warnings(mesh, plan))
    program.warnings.extend(f"pp split: {note}" for note in gm.meta.get("usc_split_notes", ()))
    program.warnings.extend(input_write_warnings(traced.gm))
    return program


def _check_tp_splits_something(plan, mesh: MeshSpec, tp, layouts, traced: Traced) -> None:
    """A tp axis that could split layers but splits no weight runs the whole model on every tp rank:
    refused, with the first reason a layer was kept whole (a size tp does not divide, an op with no
    rule). Weights the plan's own rules keep whole are what was asked for."""
    if mesh.size("tp") == 1 or any(c.explicit for c in tp.choices):
        return
    index = mesh.axes.index("tp")
    weights = {s.placeholder for s in traced.state}
    if any(isinstance(layout.placements[index], Shard) for name, layout in layouts.items() if name in weights):
        return
    first = next((c for c in tp.choices if c.style == "replicate"), None)
    if first is None:  # no layer tp knows how to split (no Megatron pair, head or embedding found)
        return
    raise plan.error_at("tp", f"tp={mesh.size('tp')} cannot split any layer of this model: '{first.module}' "
                              f"{first.reason}",
                        hint="choose a tp size that divides the heads, the hidden sizes and the vocabulary")


def plan_warnings(mesh: MeshSpec, plan) -> list[str]:
    """Plans that are correct but slower than an equivalent one."""
    out = []
    if plan.get("sp") and mesh.size("cp") > 1 and mesh.axes.index("tp") < mesh.axes.index("cp"):
        out.append("tp is outside cp in the mesh: sequence shards of the two axes nest the wrong way round and "
                   "need extra cp gathers; write cp before tp (e.g. 'cp=2 tp=2 sp=on') to keep tp innermost")
    return out


def _group_of(err: ShardingError, groups, replicated) -> int | None:
    module = getattr(err, "module", None)
    for index, group in enumerate(groups):
        if index not in replicated and module in group.region:
            return index
    return None


def _cols_at_fault(err: ShardingError, group, replicated_cols) -> list[str]:
    """The column-parallel linears feeding exactly the inputs a rule rejected (not all of them)."""
    bad = set(getattr(err, "bad_inputs", ()))
    cols = [c.name for c in group.cols if c.name not in replicated_cols and group.reached[c.name] & bad]
    return cols if cols and len(cols) < len(group.cols) else []


def _as_plan_error(plan, err: ShardingError):
    if isinstance(err, UnsupportedOpError):
        return err  # the graph's problem, not the plan text's: no caret into the plan
    axis = getattr(err, "axis", None) or "tp"
    return plan.error_at(axis, str(err), hint=err.hint or None)


__all__ = ["build_pipeline", "parallelize", "check_supported", "Program"]
