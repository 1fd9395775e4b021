"""Plain-text rendering of a Report (what usc-lint prints)."""

from __future__ import annotations

from usc.runtime.sizes import human_bytes

from .recompute_report import render_recompute


def fusion_line(f: dict) -> str:
    """Fused regions: kernels and bytes per step (forward + backward), as eager ops and fused."""
    return (f"fused regions: {f['regions']} ({f['distinct_kernels']} distinct kernels); per step "
            f"{f['kernels_eager']} -> {f['kernels_fused']} kernels "
            f"({f['kernels_eager'] / max(f['kernels_fused'], 1):.1f}x fewer), "
            f"{human_bytes(f['bytes_eager'])} -> {human_bytes(f['bytes_fused'])} moved "
            f"({f['bytes_eager'] / max(f['bytes_fused'], 1):.1f}x fewer; estimated from shapes and dtypes)")


def render_kernels(report) -> str:
    """Every generated kernel's source (usc-lint --kernels)."""
    if not report.kernels:
        return "no fused kernels: the plan has fuse=off (add fuse=on)"
    parts = []
    for k in report.kernels:
        parts += [f"# kernel {k.name}, used by: {'; '.join(k.used_by)}", k.source]
    return "\n".join(parts)


def render(report) -> str:
    mesh = report.mesh
    lines = [f"usc-lint: {report.model}   plan \"{report.plan}\"   mesh {mesh} ({mesh.world_size} ranks)", ""]
    if report.tp_choices:
        lines.append("tensor parallel:")
        width = max(len(c.module) for c in report.tp_choices)
        for c in report.tp_choices:
            how = "rule" if c.explicit else "auto"
            lines.append(f"  {c.module:<{width}}  {c.style:<9} [{how}] {c.reason}")
        lines.append("")
    lines.append("collectives per rank per step:")
    if not report.collectives:
        lines.append("  (none: every rank computes the whole model)")
    header = f"  {'#':>3}  {'kind':<14} {'axis':<4} {'n':>3}  {'dir':<3}  {'shape':<16} {'dtype':<8} " \
             f"{'bytes/call':>10} {'bytes/step':>10}  module (source)"
    if report.collectives:
        lines.append(header)
    for i, c in enumerate(report.collectives, 1):
        shape = "[" + ", ".join(str(s) for s in c.shape) + "]"
        where = f"{c.module} ({c.source})" if c.source else c.module
        lines.append(f"  {i:>3}  {c.kind:<14} {c.axis:<4} {c.group_size:>3}  {c.direction[:3].replace('for', 'fwd').replace('bac', 'bwd'):<3}  {shape:<16} "
                     f"{c.dtype:<8} {human_bytes(c.bytes_per_call):>10} {human_bytes(c.bytes_per_step):>10}  {where}")
    if report.clipping:
        axes = ", ".join(c.axis for c in report.clipping)
        lines.append(f"  with step(max_grad_norm=...): +{len(report.clipping)} all-reduce float64[1] (the squared "
                     f"gradient norm) over {axes}")
    lines.append("")
    lines.append("totals per axis:")
    for axis, t in report.totals_by_axis().items():
        extra = f", {human_bytes(t['optimizer_bytes'])} after the optimizer step" if t.get("optimizer_bytes") else ""
        lines.append(f"  {axis}: {t['calls']} calls/step, {human_bytes(t.get('forward_bytes', 0))} forward, "
                     f"{human_bytes(t.get('backward_bytes', 0))} backward{extra}")
    if not report.collectives:
        lines.append("  (none)")
    lines.append(f"parameters per rank: {human_bytes(report.param_bytes_per_rank)}; compiled in "
                 f"{report.compile_seconds:.2f} s")
    for axis, flops in report.attention_flops.items():
        spread = (max(flops) - min(flops)) / max(max(flops), 1)
        lines.append(f"attention multiply-adds per {axis} rank: {', '.join(f'{f:,}' for f in flops)} "
                     f"(spread {spread:.0%}); send/recv {human_bytes(report.p2p_bytes_per_step)} per step")
    lines += stage_lines(report)
    if report.memory:
        lines.append("predicted bytes per rank (params + grads + AdamW state), by ZeRO stage:")
        for stage, m in report.memory.items():
            mark = "  <- this plan" if stage == report.zero_stage else ""
            frozen = f"frozen params {human_bytes(m['frozen'])}, " if m.get("frozen") else ""
            lines.append(f"  zero={stage}: params {human_bytes(m['params'])}, {frozen}grads {human_bytes(m['grads'])}, "
                         f"optimizer {human_bytes(m['optimizer'])}, total "
                         f"{human_bytes(m['params'] + m.get('frozen', 0) + m['grads'] + m['optimizer'])}{mark}")
    if report.activation_bytes is not None:
        lines.append(f"activations saved for backward per rank (one microbatch, estimated on fake tensors): "
                     f"{human_bytes(report.activation_bytes)}")
    lines += render_recompute(report)
    if report.fusion:
        lines.append(fusion_line(report.fusion))
    if report.exposed_comm_seconds is not None:
        lines.append(f"exposed communication in the last traced step: {report.exposed_comm_seconds * 1e3:.2f} ms")
    derived = {op: link for op, link in report.op_rules.items() if link != "hand rule"}
    if derived:
        lines.append("ops placed without a hand rule: " + ", ".join(f"{op} ({link})" for op, link in derived.items()))
    for w in report.warnings:
        lines.append(f"warning: {w}")
    from .report_cost import cost_sections
    lines += cost_sections(report)
    return "\n".join(lines)


def stage_lines(report) -> list[str]:
    """The pipeline stage table: layers, FLOPs, parameter bytes and what crosses each cut."""
    if not report.stages:
        return []
    flops = [s.flops for s in report.stages]
    lines = [f"pipeline stages (FLOPs per microbatch estimated from the shapes; largest/smallest "
             f"{max(flops) / max(min(flops), 1):.2f}):"]
    for s in report.stages:
        memory = "" if s.memory_bytes is None else (
            f", memory ~{human_bytes(s.memory_bytes)} (state {human_bytes(s.state_bytes)} + {s.in_flight} "
            f"microbatch{'es' if s.in_flight != 1 else ''} x {human_bytes(s.activation_bytes)})")
        lines.append(f"  stage {s.index} on pp rank {s.rank}: {s.flops / 1e6:,.2f} MFLOP, parameters "
                     f"{human_bytes(s.param_bytes)}{memory}: {', '.join(s.modules) or '(no layer)'}")
        for t in s.sends:
            shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
            back = " (gradient back)" if t.grad else ""
            lines.append(f"    -> stage {t.to_stage}: {t.value} {shape} {t.dtype} {human_bytes(t.bytes)}{back}")
    return lines
