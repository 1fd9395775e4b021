"""``usc.plan`` and the plan item ``auto``: the planner strung to the parser, the profiler and the
compiler's own support checks (so the planner proposes only what ``usc.compile`` runs)."""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import replace

from usc.compiler.cost_model import Estimate, ModelProfile, PlanPoint, estimate
from usc.compiler.errors import CompileError
from usc.compiler.hardware import HardwareProfile, hardware_profile, with_plan_memory
from usc.compiler.moe import MoEPatternError, traced_blocks
from usc.compiler.planner import PlanSearch, PlanTarget, search
from usc.dsl import OPTIONS, Plan, PlanError, parse_plan
from usc.passes.cost_profile import at_sequence, batch_and_sequence, profile_model
from usc.passes.plan_checks import check_supported

# Options only the planner reads; they describe the target, not the plan it returns.
TARGET_OPTIONS = ("gpus", "seq", "global_batch", "hardware")
# Options the planner chooses (the rest of what a user writes is carried into the returned plan).
CHOSEN_OPTIONS = ("zero", "mb", "sp", "recompute", "schedule", "v", "cp_mode", "fuse")


def as_auto_plan(spec: "str | Plan") -> Plan:
    plan = spec if isinstance(spec, Plan) else parse_plan(spec)
    return plan if plan.auto else replace(plan, auto=True)


def plan_target(plan: Plan, example_inputs: tuple, hw: HardwareProfile) -> PlanTarget:
    """The cluster and training shape: written options first, then the example batch and the launch."""
    batch, seq = batch_and_sequence(example_inputs)
    gpus = plan.get("gpus") or (plan.world_size if plan.axes else int(os.environ.get("WORLD_SIZE", "1")))
    fixed = [(name, size) for name, size in plan.axes]
    fixed += [(name, value) for name, value in plan.options if name in CHOSEN_OPTIONS + ("dtype",)]
    per_node = plan.get("gpus_per_node") if plan.is_set("gpus_per_node") else hw.gpus_per_node
    dtype, assumed = default_dtype(plan, hw)
    return PlanTarget(gpus=gpus, seq=plan.get("seq") or seq, global_batch=plan.get("global_batch") or batch,
                      gpus_per_node=per_node, dtype=dtype, fixed=tuple(fixed), assumption=assumed)


def default_dtype(plan: Plan, hw: HardwareProfile) -> tuple[str, str]:
    """The compute dtype to plan for, and the assumption to print when the user did not write one:
    bf16 where the hardware runs it faster than fp32 (what people train in), else fp32."""
    if plan.is_set("dtype"):
        return plan.get("dtype"), ""
    if hw.has_fast_bf16:
        speedup = hw.peak_bf16_flops / hw.peak_fp32_flops
        return "bf16", (f"dtype=bf16 assumed: no dtype written and the {hw.name} runs bf16 matmuls "
                        f"{speedup:.0f}x faster than fp32 (write dtype=fp32 to plan for float32)")
    return "fp32", f"dtype=fp32 assumed: no dtype written and bf16 is no faster than fp32 on the {hw.name}"


def point_of(plan: Plan, *, global_batch: int, seq: int) -> PlanPoint:
    """The cost model's view of a written plan."""
    sizes = {axis: plan.size(axis) for axis in ("dp", "tp", "pp", "cp", "ep")}
    if sizes["dp"] % sizes["ep"] == 0:  # ep ranks are carved from dp: the cost model's dp is per expert
        sizes["dp"] //= sizes["ep"]
    order = tuple(plan.mesh_axes) + tuple(a for a in ("dp", "pp", "cp", "ep", "tp") if a not in plan.mesh_axes)
    return PlanPoint(global_batch, seq, **sizes, zero=int(plan.get("zero")), mb=int(plan.get("mb")),
                     sp=bool(plan.get("sp")), recompute=plan.get("recompute"), schedule=plan.get("schedule"),
                     v=int(plan.get("v")), cp_mode=plan.get("cp_mode"), dtype=plan.get("dtype"),
                     reduce_dtype=plan.get("reduce_dtype"), fuse=bool(plan.get("fuse")), gpus_per_node=int(plan.get("gpus_per_node")),
                     bucket_mb=float(plan.get("bucket_mb")), order=order,
                     split=None if plan.get("split") == "auto" else tuple(plan.get("split")))


def refusal(point: PlanPoint) -> str | None:
    """Why ``usc.compile`` would refuse this plan today (None: it runs it)."""
    try:
        check_supported(parse_plan(point.text()))
    except PlanError as err:
        return str(err).splitlines()[0].split(": ", 1)[-1]
    return None


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off for the block. Tracing and the search make hundreds of thousands
    of short-lived objects, and each full collection walks every object torch has made (8B at 512
    GPUs: 2.5 s CPU with it on, 2.1 s off; 9 MB more peak memory). What the block leaves for it is
    collected after, once."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def choose(model, spec: "str | Plan", example_inputs: tuple, *, hardware=None, keep: int = 5,
           profile: ModelProfile | None = None) -> Plan:
    """The body of ``usc.plan`` (see there)."""
    plan = as_auto_plan(spec)
    hw = with_plan_memory(hardware_profile(hardware or plan.get("hardware")), plan)
    target = plan_target(plan, example_inputs, hw)
    with collector_paused():
        if profile is None:
            profile, scaled = _profile_at(model, tuple(example_inputs), target.seq, plan)
            if scaled:
                target = replace(target, assumption="\n  ".join(filter(None, (target.assumption, scaled))))
        _refuse_dim0_split(plan, profile)
        result = search(profile, target, hw, supported=refusal, keep=keep)
    if result.best is None and not result.evaluated:  # nothing reached the memory check: the spec's words
        raise plan.error_at("auto", f"no plan for {target.gpus} GPUs runs what the spec writes:\n{result}",
                            hint="change what the reasons above name (an axis, mb, a schedule), or leave it "
                                 "to the planner")
    if result.best is None:
        raise plan.error_at("auto", f"no plan for {target.gpus} GPUs fits this model:\n{result}",
                            hint="add GPUs, lower global_batch or seq, or write options that save memory")
    return replace(_written_back(plan, result.best.plan), search=result)


def _refuse_dim0_split(plan: Plan, profile: ModelProfile) -> None:
    """A model that attends across its inputs' dim 0 (sequence-first) has no batch there for dp and mb
    to split: its dp would be a ring over the sequence (which no estimate here counts) and its
    microbatches are refused by compile. Planned only with dp and mb written as 1."""
    written_out = plan.is_set("dp") and plan.size("dp") == 1 and plan.is_set("mb") and int(plan.get("mb")) == 1
    if profile.dim0_attention and not written_out:
        raise CompileError(
            f"usc.plan splits dim 0 of the inputs as the batch (dp, mb), and attention in module "
            f"'{profile.dim0_attention}' attends across it: the model is sequence-first ([S, B, ...])\n"
            f"  fix: feed the model batch-first ([B, S, ...], transposed inside forward if it computes "
            f"sequence-first), or write dp=1 mb=1 to plan the other axes")


def _profile_at(model, example: tuple, seq: int, plan: Plan) -> tuple[ModelProfile, str]:
    """The model's profile at the sequence planned for (the example lengthened to it: activations do
    not all grow linearly with the sequence), and what was assumed where the lengthened example does
    not trace (the profile of the example as given, its activations scaled to ``seq``)."""
    blocks = lambda m: moe_blocks(m, plan)  # noqa: E731
    _, given = batch_and_sequence(example)
    if seq == given:
        return profile_model(model, example, moe_blocks=blocks), ""
    try:
        return profile_model(model, at_sequence(example, seq), moe_blocks=blocks), ""
    except (CompileError, PlanError) as err:
        why = str(err).splitlines()[0]
    return profile_model(model, example, moe_blocks=blocks), (
        f"activations scaled from the example's sequence {given} to seq={seq} (the example lengthened "
        f"to {seq} does not trace: {why}); pass an example at seq={seq} to measure them")


def _written_back(plan: Plan, point: PlanPoint) -> Plan:
    """The chosen plan's text plus what the user wrote that the planner does not choose (rules, timeout...)."""
    chosen = parse_plan(point.text())
    keep = [(n, v) for n, v in plan.options
            if n not in TARGET_OPTIONS and n not in CHOSEN_OPTIONS and n not in dict(chosen.options)]
    return Plan(axes=chosen.axes, options=chosen.options + tuple(keep), rules=plan.rules)


def estimate_plan(model, plan: Plan, example_inputs: tuple, hardware="h100",
                  profile: ModelProfile | None = None) -> Estimate:
    """The cost model's estimate of ``plan`` for the example's batch and sequence (what usc-lint prints)."""
    hw = hardware_profile(hardware)
    batch, seq = batch_and_sequence(example_inputs)
    profile = profile or profile_model(model, tuple(example_inputs))
    point = point_of(plan, global_batch=batch, seq=seq)
    if not plan.is_set("gpus_per_node"):
        point = replace(point, gpus_per_node=hw.gpus_per_node)
    return estimate(profile, point, hw)


def moe_blocks(model, plan) -> list:
    """The model's mixture-of-experts blocks (rules with the action ``expert`` mark more), as
    usc.compile traces them and the planner profiles them."""
    rules = {path: rule for path, _ in model.named_modules() for rule in plan.rules
             if rule.matches(path) and any(a.name == "expert" for a in rule.actions)}
    try:
        return traced_blocks(model, frozenset(rules))
    except MoEPatternError as err:
        raise plan.error_at(rules[err.path], f"rule 'expert' on {err}",
                            hint="see README, 'Mixture of experts', for the patterns usc knows") from None


__all__ = ["choose", "estimate_plan", "moe_blocks", "point_of", "plan_target", "refusal", "PlanSearch", "OPTIONS"]

