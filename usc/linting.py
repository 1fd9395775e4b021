"""usc-lint's glue: parse, trace, check the plan against the model, compile, walk every rank's
program, and run every lint rule -- collecting all problems instead of stopping at the first.

    >>> import usc
    >>> from usc.testing.models import TinyLlama, token_batch
    >>> result = usc.linting.lint_plan(TinyLlama(), "dp=2 tp=2", example_inputs=token_batch(128, 8, 32))
    >>> result.exit_code()
    0
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from usc.compiler import lint_checks  # noqa: F401 - registers the rules
from usc.compiler.errors import CompileError
from usc.compiler.hardware import HardwareProfile, hardware_profile, with_plan_memory
from usc.compiler.lint_facts import ModelFacts, model_facts
from usc.compiler.lint_rules import Finding, LintInput, counts, run_rules
from usc.compiler.pass_runner import pipeline_stages
from usc.compiler.report import Report
from usc.dsl import Plan, PlanError
from usc.passes.mesh_order_check import check_mesh_order, rank_programs
from usc.passes.pipeline_schedule import build_schedule, refuse_unimplemented
from usc.passes.pipeline_schedule_check import ScheduleError, check_schedule, render_timeline
from usc.passes.pipeline_split import node_flops
from usc.runtime.graph_code import lazy_graph_modules

from .build import _as_plan, _Compiled, _resolve_auto
from .model_call import trainable

PLAN_ONLY = ("USC100", "USC101")  # what can be said of a plan that does not parse


@dataclass
class LintResult:
    """Everything usc-lint prints: the report (None when the plan does not compile), the findings,
    the schedule picture of a pp plan, and the profile memory was checked against."""

    plan_text: str
    plan: Plan | None
    report: Report | None
    findings: list[Finding]
    hardware: HardwareProfile | None = None
    schedule_picture: str | None = None
    facts: ModelFacts | None = None
    exceptions: list[BaseException] = field(default_factory=list)
    traced: object = field(default=None, repr=False)  # the trace, reusable for another plan with the same mb
    compiled: object = field(default=None, repr=False)  # the _Compiled behind the report

    def counts(self) -> dict[str, int]:
        return counts(self.findings)

    def exit_code(self, *, strict: bool = False) -> int:
        """1 when there are errors (with strict, also warnings), else 0: what CI reads."""
        n = self.counts()
        return 1 if n["error"] or (strict and n["warning"]) else 0

    def location(self, finding: Finding) -> tuple[int, int] | None:
        """(line, column) in the plan text the finding points at, when known."""
        if finding.line is not None:
            return finding.line, finding.column or 1
        if self.plan is not None and finding.item and finding.item in self.plan.positions:
            return self.plan.positions[finding.item]
        return None


def pipeline_schedule(plan: Plan):
    """(schedule, metrics, bubble_at, picture) of a pp plan; bubble_at(mb) gives the bubble with
    another microbatch count (for the suggestion of USC206)."""
    refuse_unimplemented(plan)
    pp, v, mb, name = plan.size("pp"), int(plan.get("v")), int(plan.get("mb")), plan.get("schedule")
    schedule = build_schedule(name, pp, v, mb)

    def bubble_at(m: int) -> float:
        return check_schedule(build_schedule(name, pp, v, m)).bubble_fraction

    return schedule, check_schedule(schedule), bubble_at, render_timeline(schedule)


def stage_flops(program) -> tuple[float, ...]:
    """Estimated FLOPs per pipeline stage (the split pass's own cost)."""
    return tuple(sum(node_flops(n) for n in stage.graph.nodes if n.op == "call_function")
                 for stage in pipeline_stages(program.gm))


def _within_the_batch(bubble_at, program, plan: Plan):
    """``bubble_at`` for the microbatch counts this batch allows (the global batch's rows split
    into that many microbatches, each divided among the dp x ep data shards); others raise."""
    rows = next((int(spec.global_shape[0]) for spec in program.inputs if len(spec.global_shape)), 0) \
        * int(plan.get("mb"))
    shards = plan.size("dp") * plan.size("ep")

    def allowed(m: int) -> float:
        if rows and (rows % m or (rows // m) % shards):
            raise ValueError(f"mb={m} does not split the global batch of {rows} among {shards} data shards")
        return bubble_at(m)
    return allowed


def _as_error(plan: Plan, err: Exception, item: str) -> PlanError:
    return err if isinstance(err, PlanError) else plan.error_at(item, str(err))


def _compiled_input(plan: Plan, compiled: _Compiled, facts, hardware) -> tuple[LintInput, str | None]:
    program, errors = compiled.program, []
    schedule = metrics = bubble_at = picture = None
    if plan.size("pp") > 1:
        try:
            schedule, metrics, bubble_at, picture = pipeline_schedule(plan)
        except (PlanError, ValueError, ScheduleError) as err:
            errors.append(_as_error(plan, err, "schedule"))
    if bubble_at is not None:
        bubble_at = _within_the_batch(bubble_at, program, plan)
    problems = []
    if plan.size("pp") == 1 or schedule is not None:
        mb = int(plan.get("mb")) if plan.size("pp") == 1 else 1  # a pipeline's microbatches are its actions
        problems = check_mesh_order(rank_programs(program, schedule), program, microbatches=mb,
                                    bucket_bytes=compiled.bucket_bytes, zero_stage=int(plan.get("zero")))
    inp = LintInput(plan, facts, compiled.report, program, hardware, metrics, bubble_at, stage_flops(program),
                    tuple(problems), tuple(errors))
    return inp, picture


def lint_plan(model, plan, *, example_inputs, loss_fn=None, hardware: str | HardwareProfile | None = "h100",
              traced=None, stamp: bool = True, optimizer=None) -> LintResult:
    """Lint ``plan`` for ``model``: every finding (codes USC1xx/2xx/3xx), the report and pictures.

    ``traced`` reuses a trace of the same model and microbatch shape (``usc-lint --diff`` traces once).
    ``stamp``: trace a repeated layer once and stamp it per layer (``compiler/stamp.py``; the same
    graph as the full trace, verified on each model, faster for deep models). ``optimizer``: the
    factory compile will get (one that groups parameters by name packs gradient buckets per group).
    """
    text = plan if isinstance(plan, str) else str(plan)
    profile = hardware_profile(hardware) if hardware is not None else None
    try:
        plan = _as_plan(plan)
        if plan.auto:  # the planner chooses first (for this hardware unless the plan names one); lint checks it
            wrapped = trainable(model, loss_fn)
            plan = _resolve_auto(wrapped, plan, wrapped.flatten(example_inputs),
                                 None if plan.is_set("hardware") else profile)
    except (PlanError, CompileError) as err:
        return LintResult(text, None, None, run_rules(LintInput(errors=(err,)), select=PLAN_ONLY), profile,
                          exceptions=[err])
    if profile is not None:
        profile = with_plan_memory(profile, plan)
    compiled = _Compiled(model, plan, loss_fn=loss_fn, optimizer=optimizer)
    batch = compiled.flat_batch((example_inputs,))
    try:
        traced = traced if traced is not None else compiled.trace(batch, stamp=stamp)
    except (PlanError, CompileError) as err:
        return LintResult(text, plan, None, run_rules(LintInput(plan, errors=(err,)), select=PLAN_ONLY), profile,
                          exceptions=[err])
    facts = model_facts(traced)
    before = LintInput(plan, facts, hardware=profile)
    found = run_rules(before)
    if counts(found)["error"]:
        return LintResult(text, plan, None, found, profile, facts=facts, traced=traced)
    try:
        with lazy_graph_modules():  # nothing runs: generate no Python for the passes' graphs
            compiled._build(batch, traced=traced)
    except (PlanError, CompileError) as err:
        return LintResult(text, plan, None, run_rules(replace(before, errors=(err,))), profile, facts=facts,
                          exceptions=[err], traced=traced)
    inp, picture = _compiled_input(plan, compiled, facts, profile)
    findings = run_rules(inp)
    compiled.report.findings = findings
    return LintResult(text, plan, compiled.report, findings, profile, picture, facts, list(inp.errors), traced,
                      compiled)


def first_error(result: LintResult) -> PlanError | CompileError | None:
    """The exception ``usc.lint`` raises for a result with errors (the compiler's own when it raised)."""
    if result.exceptions:
        return result.exceptions[0]
    error = next((f for f in result.findings if f.severity == "error"), None)
    if error is None:
        return None
    if result.plan is None:
        return PlanError(error.message, hint=error.hint or None)
    return result.plan.error_at(error.item or "", error.message, hint=error.hint or None)
