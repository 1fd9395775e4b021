"""The usc-lint checks, each registered beside its code (``compiler/lint_rules.py``).

A check reads a :class:`LintInput` (plain values: the plan, model facts, the report, the per-rank
program, the hardware profile, schedule metrics) and yields :class:`Finding` values. Thresholds
are named constants with their source.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Iterable, Iterator

import torch

from usc.dsl import PlanError

from .ir import META
from .lint_rules import Finding, LintInput, rule
from usc.runtime.sizes import human_bytes, shape_bytes

# Narayanan et al. 2021 (Megatron-LM at scale) keep the pipeline bubble (p-1)/m small by taking
# m >> p; a quarter of the step idle is where more microbatches or interleaving clearly pay.
MAX_BUBBLE = 0.25
# The slowest stage sets the pace of every stage: 15% over the mean is 15% of the step lost.
MAX_STAGE_IMBALANCE = 0.15
# ZeRO-3 gathers every layer's parameters over all dp ranks twice per step; past a few hundred
# ranks each slice is tiny and the collectives are latency bound (ZeRO++, Wang et al. 2023, and
# FSDP's hybrid sharding shard within a group for this reason).
MAX_ZERO3_RANKS = 512
# Hopper tensor-core GEMM kernels tile the rows (tokens) by 128 (CUTLASS sm90 default tile
# 128x128/128x256): a matmul with fewer rows than one tile leaves tensor cores idle.
MIN_MATMUL_ROWS = 128
# Gradient buckets: NCCL needs messages of ~1 MiB and more to reach bus bandwidth (nccl-tests
# doc/PERFORMANCE.md); many smaller buckets pay the per-call latency again and again.
SMALL_BUCKET_BYTES = 2**20
MANY_BUCKETS = 4


def _positioned(err: PlanError) -> dict:
    return {"line": err.line, "column": err.column} if err.positioned else {}


def _layer_pattern(module: str) -> str:
    """'layers.3.mlp' -> 'layers.*.mlp': one finding per repeated block, not per layer."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def _grouped(modules: Iterable[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for m in modules:
        out[_layer_pattern(m)].append(m)
    return out


def _times(modules: list[str]) -> str:
    return f" ({len(modules)} of them)" if len(modules) > 1 else ""


# ------------------------------------------------------------------------------------------ errors
@rule("USC100", "plan-error", "error", """
    The plan text does not parse, or the compiler refused it: an unknown word, a value out of
    range, an option that needs another (zero= needs dp>1), a size that does not divide the
    model (tp=3 on a hidden size of 64), or a feature that is parsed but not built yet. The
    message points at the plan item with its line and column and suggests a fix.""")
def plan_error(inp: LintInput) -> Iterator[Finding]:
    for err in inp.errors:
        if isinstance(err, PlanError):
            yield Finding("USC100", err.message, hint=err.hint or "", **_positioned(err))


@rule("USC101", "compile-error", "error", """
    The model cannot be traced or compiled for this plan (a TraceError or CompileError): the
    message names the module and the operation that failed and what to change in the model.""")
def compile_error(inp: LintInput) -> Iterator[Finding]:
    for err in inp.errors:
        if not isinstance(err, PlanError):
            yield Finding("USC101", f"{type(err).__name__}: {err}")


@rule("USC102", "vocab-not-divisible", "error", """
    A plan rule splits an embedding on its vocabulary (`vocab`), giving every tp rank an equal
    slice of the rows, and tp does not divide the vocabulary size. Pad the vocabulary to a
    multiple of tp (Megatron pads to a multiple of 128 x tp), choose a tp that divides it, or drop
    the rule: without one, usc keeps such an embedding whole on every tp rank (USC209).""")
def vocab_not_divisible(inp: LintInput) -> Iterator[Finding]:
    tp = inp.plan.size("tp")
    if inp.facts is None or tp == 1:
        return
    for module, rows in inp.facts.vocab:
        written = inp.plan.tp_rule(module)
        rule = written[0] if written is not None and written[1] == "vocab" else None
        if rows % tp and rule is not None:
            yield Finding("USC102", f"tp={tp} does not divide the vocabulary of '{module}' ({rows} rows), which "
                                    f"the rule '{rule}' splits", rule.glob,
                          hint=f"pad the vocabulary to {math.ceil(rows / tp) * tp}, use a tp that divides "
                               f"{rows}, or drop the rule (the embedding then stays whole on every tp rank)",
                          module=module)


def _vocab_hint(rows: int, tp: int) -> str:
    """How to split an embedding whose vocabulary tp does not divide."""
    padded = math.ceil(rows / (64 * tp)) * 64 * tp
    return (f"pad the vocabulary to a multiple of {tp} to split it (to {padded}, a multiple of 64 x tp; "
            f"transformers: model.resize_token_embeddings({rows}, pad_to_multiple_of={64 * tp}))")


@rule("USC103", "heads-not-divisible-by-cp", "error", """
    Ulysses context parallelism (Jacobs et al. 2023) turns a sequence-sharded q/k/v into a
    head-sharded one with an all-to-all, so cp must divide the number of attention heads and of
    key/value heads. Use cp_mode=ring or zigzag (no head constraint), or a cp that divides both.""")
def heads_not_divisible_by_cp(inp: LintInput) -> Iterator[Finding]:
    cp = inp.plan.size("cp")
    if inp.facts is None or cp == 1 or inp.plan.get("cp_mode") != "ulysses":
        return
    bad = [a for a in inp.facts.attention if a.heads % cp or a.kv_heads % cp]
    for pattern, items in _grouped(a.module for a in bad).items():
        a = next(x for x in bad if x.module == items[0])
        yield Finding("USC103", f"cp={cp} (ulysses) does not divide the {a.heads} heads / {a.kv_heads} kv heads "
                                f"of '{pattern}'{_times(items)}", "cp_mode",
                      hint="use cp_mode=ring or cp_mode=zigzag", module=items[0])


@rule("USC104", "experts-not-divisible", "error", """
    Expert parallelism places whole experts on ep ranks, so ep must divide the number of experts
    of every mixture-of-experts layer.""")
def experts_not_divisible(inp: LintInput) -> Iterator[Finding]:
    ep = inp.plan.size("ep")
    if inp.facts is None or ep == 1:
        return
    for module, n in inp.facts.experts:
        if n % ep:
            yield Finding("USC104", f"ep={ep} does not divide the {n} experts of '{module}'", "ep",
                          hint=f"use an ep that divides {n}", module=module)


@rule("USC105", "sequence-not-divisible", "error", """
    Context parallelism splits every sequence into cp equal pieces (cp_mode=zigzag into 2 x cp
    chunks, rank i holding chunks i and 2cp-1-i so that causal work is balanced), so the
    sequence length must be a multiple of cp (2 x cp for zigzag).""")
def sequence_not_divisible(inp: LintInput) -> Iterator[Finding]:
    cp = inp.plan.size("cp")
    if inp.facts is None or inp.facts.sequence is None or cp == 1:
        return
    pieces = 2 * cp if inp.plan.get("cp_mode") == "zigzag" else cp
    if inp.facts.sequence % pieces:
        how = f"2 x cp = {pieces} zigzag chunks" if pieces != cp else f"{cp} pieces"
        yield Finding("USC105", f"the sequence of {inp.facts.sequence} tokens does not split into {how}", "cp",
                      hint=f"use a sequence length that is a multiple of {pieces}")


@rule("USC109", "batch-not-divisible", "error", """
    Data parallelism gives every dp rank an equal share of each microbatch, and mb splits the
    global batch into equal microbatches: the global batch must be a multiple of dp x mb.""")
def batch_not_divisible(inp: LintInput) -> Iterator[Finding]:
    dp = inp.plan.size("dp")
    if inp.facts is None or inp.facts.batch is None or dp == 1:
        return
    if inp.facts.batch % dp:
        mb = int(inp.plan.get("mb"))
        name, shape = next((n, s) for n, s in inp.facts.inputs if s and s[0] == inp.facts.batch)
        yield Finding("USC109", f"dp={dp} does not divide dim 0 of input '{name}' ({list(shape)}: one microbatch "
                                f"of the global batch {inp.facts.batch * mb}, mb={mb})", "dp",
                      hint=f"use a global batch that is a multiple of {dp * mb}")


def memory_terms(report) -> list[tuple[str, int]]:
    """Predicted bytes per rank: parameters (frozen ones apart), gradients, optimizer state, activations
    (when known)."""
    m = report.memory.get(report.zero_stage, {})
    terms = [("parameters", m.get("params", 0)), ("gradients", m.get("grads", 0)),
             ("optimizer state", m.get("optimizer", 0))]
    if m.get("frozen"):
        terms.insert(1, ("frozen parameters", m["frozen"]))
    if report.activation_bytes is not None:
        terms.append(("activations", report.activation_bytes))
    return terms


@rule("USC106", "out-of-memory", "error", """
    The predicted bytes per rank (parameters, gradients and AdamW state at the plan's ZeRO stage,
    plus the activations saved for backward) exceed the device's memory (the hardware profile's
    hbm_bytes; usc-lint --hardware picks the profile). The message names the largest term: shard
    it (zero= for optimizer state and gradients, tp/pp for parameters, cp/sp or recompute for
    activations) or use more ranks.""")
def out_of_memory(inp: LintInput) -> Iterator[Finding]:
    if inp.report is None or inp.hardware is None:
        return
    terms = memory_terms(inp.report)
    total = sum(b for _, b in terms)
    if total <= inp.hardware.hbm_bytes:
        return
    name, largest = max(terms, key=lambda t: t[1])
    fixes = {"parameters": "raise tp or pp, or zero=3", "frozen parameters": "raise tp or pp (zero= shards only "
             "what trains)", "gradients": "zero=2 or more tp/pp",
             "optimizer state": "zero=1 (or 2/3) shards it over dp", "activations": "raise cp/tp with sp=on, or mb"}
    yield Finding("USC106", f"{human_bytes(total)} per rank does not fit the {inp.hardware.name}'s "
                            f"{human_bytes(inp.hardware.hbm_bytes)}; the largest term is {name} "
                            f"({human_bytes(largest)})", "zero" if name in ("optimizer state", "gradients") else None,
                  hint=fixes[name])


@rule("USC107", "collective-order-mismatch", "error", """
    Before anything runs, usc walks the program of every rank of the mesh and checks that the
    ranks of each process group issue the same collectives in the same order with the same
    shapes and dtypes. A mismatch would hang (or silently mix tensors) at run time; the message
    names the two ranks and the first call where their programs differ.""")
def collective_order_mismatch(inp: LintInput) -> Iterator[Finding]:
    for problem in inp.order_problems:
        if problem.kind == "collective":
            yield Finding("USC107", str(problem))


@rule("USC108", "unmatched-send-recv", "error", """
    Every pipeline send must have its receive on the peer rank, with the same shape and dtype
    (the runtime tags each message with what it carries and for which microbatch, and matches a
    receive to the send of the same message). A receive whose send never comes hangs the step;
    the message names both ranks and the transfer.""")
def unmatched_send_recv(inp: LintInput) -> Iterator[Finding]:
    for problem in inp.order_problems:
        if problem.kind == "p2p":
            yield Finding("USC108", str(problem))


# ---------------------------------------------------------------------------------------- warnings
def gpus_per_node(inp: LintInput) -> int:
    if inp.plan.is_set("gpus_per_node") or inp.hardware is None:
        return int(inp.plan.get("gpus_per_node"))
    return int(inp.hardware.gpus_per_node)


def nodes_spanned(axes: tuple[str, ...], shape: tuple[int, ...], axis: str, per_node: int) -> int:
    """The most nodes one group of ``axis`` spans (ranks are row-major, innermost axis adjacent)."""
    index = axes.index(axis)
    stride = math.prod(shape[index + 1:])
    world = math.prod(shape)
    bases = [r for r in range(world) if (r // stride) % shape[index] == 0]
    return max(len({(b + i * stride) // per_node for i in range(shape[index])}) for b in bases)


@rule("USC201", "tp-crosses-node", "warning", """
    Tensor parallelism all-reduces (or reduce-scatters and all-gathers) activations twice per
    layer in forward and twice in backward, on the critical path. Inside a node these run over
    NVLink (hundreds of GB/s); a tp group that spans nodes runs them over the network, several
    times slower. Keep tp <= gpus_per_node and write tp as the innermost (last) axis; scale
    across nodes with dp, pp or cp instead (the Ultra-Scale Playbook's first rule).""")
def tp_crosses_node(inp: LintInput) -> Iterator[Finding]:
    tp = inp.plan.size("tp")
    if tp == 1:
        return
    per_node = gpus_per_node(inp)
    spans = nodes_spanned(inp.plan.mesh_axes, inp.plan.mesh_shape, "tp", per_node)
    if spans > 1:
        inner = [a for a in inp.plan.mesh_axes[inp.plan.mesh_axes.index("tp") + 1:] if inp.plan.size(a) > 1]
        why = f"tp={tp} > gpus_per_node={per_node}" if tp > per_node else \
            f"the axes inside tp ({', '.join(inner)}) spread each tp group over {spans} nodes"
        yield Finding("USC201", f"each tp group spans {spans} nodes: {why}", "tp",
                      hint=f"keep tp <= {per_node} and write it last in the plan")


@rule("USC202", "row-before-column", "warning", """
    Megatron's pairing is column-parallel then row-parallel (Shoeybi et al. 2019): the column
    split leaves its output sharded on exactly the dimension the row split needs, so a block
    costs one all-reduce per direction. Written the other way round (rowwise first), the row
    split's partial sums must be all-reduced before the column split, and the column split's
    sharded output must be gathered again: an extra synchronisation inside every block. Swap
    the rules (the first linear colwise, the second rowwise).""")
def row_before_column(inp: LintInput) -> Iterator[Finding]:
    if inp.report is None:
        return
    parents: dict[str, list] = defaultdict(list)
    for choice in inp.report.tp_choices:
        if choice.style in ("colwise", "rowwise"):
            parents[choice.module.rpartition(".")[0]].append(choice)
    bad = {}
    for parent, choices in parents.items():
        first_col = next((i for i, c in enumerate(choices) if c.style == "colwise"), None)
        if choices[0].style == "rowwise" and first_col is not None:
            bad[parent] = (choices[0].module, choices[first_col].module)
    for pattern, items in _grouped(bad).items():
        row, col = bad[items[0]]
        yield Finding("USC202", f"row-parallel '{row}' comes before column-parallel '{col}' in "
                                f"'{pattern}'{_times(items)}: an extra all-reduce/all-gather per block",
                      hint=f"make '{row.rpartition('.')[2]}' colwise and '{col.rpartition('.')[2]}' rowwise",
                      module=items[0])


def _attention_warnings(inp: LintInput, code: str, count) -> Iterator[Finding]:
    tp = inp.plan.size("tp")
    if inp.facts is None or tp == 1:
        return
    bad = [a for a in inp.facts.attention if count(a) % tp]
    for pattern, items in _grouped(a.module for a in bad).items():
        n = count(next(a for a in bad if a.module == items[0]))
        what = "attention heads" if code == "USC203" else "key/value heads"
        # the cost model profiles tp at 2 and scales: where 2 splits the heads, it counts them split
        estimate = ("; the cost estimate, profiled at tp=2 where they split, counts their work and "
                    "all-reduces split tp ways (too fast for this plan)") if n % 2 == 0 else ""
        yield Finding(code, f"tp={tp} does not divide the {n} {what} of '{pattern}'{_times(items)}: its "
                            f"projections stay replicated on every tp rank{estimate}", "tp",
                      hint=f"use a tp that divides {n}" + (" (or repeat kv heads up to tp)" if code == "USC204" else ""),
                      module=items[0])


@rule("USC203", "heads-not-divisible", "warning", """
    Tensor-parallel attention splits q/k/v by whole heads (Megatron), so tp must divide the
    number of attention heads. When it does not, usc keeps that attention block's projections
    whole on every tp rank: correct, but the tp ranks repeat its compute and hold its weights
    tp times.""")
def heads_not_divisible(inp: LintInput) -> Iterator[Finding]:
    yield from _attention_warnings(inp, "USC203", lambda a: a.heads)


@rule("USC204", "kv-heads-not-divisible", "warning", """
    With grouped-query attention the key/value projections have fewer heads than the queries;
    tp must divide the kv heads too, or k/v stay replicated on every tp rank (Megatron then
    replicates kv heads; usc keeps the projections whole). Correct, but the k/v compute and
    weights are repeated tp times.""")
def kv_heads_not_divisible(inp: LintInput) -> Iterator[Finding]:
    yield from _attention_warnings(inp, "USC204", lambda a: a.kv_heads if a.heads % inp.plan.size("tp") == 0 else 0)


@rule("USC205", "stage-imbalance", "warning", """
    The pipeline runs at the pace of its slowest stage. usc cuts between layers to balance the
    estimated FLOPs, but layers are indivisible and the first and last stages carry the
    embedding and the lm head with the loss: when the largest stage has more than 15% more
    work than the mean, every other stage idles for the difference. Use a pp that divides the
    layer count, or fewer stages.""")
def stage_imbalance(inp: LintInput) -> Iterator[Finding]:
    flops = inp.stage_flops
    if len(flops) < 2 or not sum(flops):
        return
    mean = sum(flops) / len(flops)
    worst = max(range(len(flops)), key=lambda i: flops[i])
    excess = flops[worst] / mean - 1
    if excess > MAX_STAGE_IMBALANCE:
        shares = ", ".join(f"{f / mean:.2f}" for f in flops)
        yield Finding("USC205", f"pipeline stage {worst} has {excess:.0%} more compute than the mean stage "
                                f"(per stage, relative to the mean: {shares})", "pp",
                      hint="use a pp that divides the number of layers, or fewer stages")


def _microbatches_for(inp: LintInput, target: float) -> int | None:
    mb, pp = int(inp.plan.get("mb")), inp.plan.size("pp")
    for m in range(mb + 1, 16 * pp + 1):
        if m % pp == 0 or inp.plan.get("schedule") != "interleaved":
            try:
                if inp.bubble_at(m) <= target:
                    return m
            except ValueError:
                continue
    return None


@rule("USC206", "pipeline-bubble", "warning", """
    The pipeline bubble is the time ranks idle while the pipeline fills and drains: for GPipe
    and 1F1B (p-1)/m of the compute with p stages and m microbatches (Narayanan et al. 2021).
    Above 25% of the step, raise mb (the message says how many microbatches bring it under), or
    use an interleaved (v>1) or zero-bubble (schedule=zb) schedule.""")
def pipeline_bubble(inp: LintInput) -> Iterator[Finding]:
    if inp.schedule is None or inp.schedule.bubble_fraction <= MAX_BUBBLE:
        return
    better = _microbatches_for(inp, MAX_BUBBLE) if inp.bubble_at is not None else None
    hint = f"mb={better} brings it to {inp.bubble_at(better):.0%}" if better else "use more microbatches"
    yield Finding("USC206", f"the pipeline idles {inp.schedule.bubble_fraction:.0%} of the step "
                            f"(pp={inp.plan.size('pp')}, mb={inp.plan.get('mb')}, "
                            f"schedule={inp.plan.get('schedule')})", "mb",
                  hint=hint + "; or an interleaved / zero-bubble schedule")


@rule("USC207", "zero3-too-wide", "warning", """
    ZeRO-3 all-gathers each layer's parameters over every dp rank in forward and again in
    backward. Over more than 512 ranks each rank's slice is tiny and the gathers are latency
    bound, across many nodes. Shard within a smaller group (zero=3 over a dp axis of <= 512 with
    pp or tp taking the rest), or use zero=1/2, which communicate once per step.""")
def zero3_too_wide(inp: LintInput) -> Iterator[Finding]:
    dp = inp.plan.size("dp")
    if int(inp.plan.get("zero")) == 3 and dp > MAX_ZERO3_RANKS:
        yield Finding("USC207", f"zero=3 shards parameters over {dp} dp ranks (more than {MAX_ZERO3_RANKS}): "
                                "every layer's gathers are latency bound", "zero",
                      hint="use zero=1 or 2, or move ranks from dp to pp/tp")


def tokens_per_rank(program) -> int | None:
    """Rows of this rank's matmuls: its share of one microbatch's tokens (batch x sequence)."""
    if program is None or not program.inputs:
        return None
    spec = program.inputs[0]
    shape = spec.layout.local_shape(spec.global_shape, program.mesh)
    return math.prod(shape[:2]) if shape else None


@rule("USC208", "small-microbatch", "warning", """
    Each rank's matmuls have as many rows as it holds tokens of one microbatch (batch / dp / mb
    times sequence / cp). GPU tensor-core kernels tile the rows by 128 (CUTLASS's Hopper tiles
    are 128 x 128 or 128 x 256): with fewer rows a tile is partly empty and the matmuls run far
    below peak. Fewer dp ranks or microbatches, a longer sequence, or a smaller cp give each
    rank more rows.""")
def small_microbatch(inp: LintInput) -> Iterator[Finding]:
    rows = tokens_per_rank(inp.program)
    if rows is not None and rows < MIN_MATMUL_ROWS:
        yield Finding("USC208", f"each rank's matmuls see {rows} tokens per microbatch (< {MIN_MATMUL_ROWS} "
                                "rows of one tensor-core tile)", "mb" if int(inp.plan.get("mb")) > 1 else "dp",
                      hint="fewer microbatches or dp ranks, or a longer sequence")


@rule("USC209", "kept-replicated", "warning", """
    A Megatron pair (or the embedding / lm head) that tp cannot split stays whole on every tp
    rank, with its reason in the report: a reshape the tp size does not divide (GPT-2's fused
    q/k/v viewed as [.., 3, heads, dim]) or an op with no sharding rule. Correct, but that
    layer's compute and weights are repeated tp times.""")
def kept_replicated(inp: LintInput) -> Iterator[Finding]:
    if inp.report is None:
        return
    tp = inp.plan.size("tp")
    # attention blocks USC203/USC204 already name (heads that tp does not divide)
    heads_bad = {a.module for a in (inp.facts.attention if inp.facts else ()) if a.heads % tp or a.kv_heads % tp}
    kept = [c for c in inp.report.tp_choices if c.style == "replicate" and not c.explicit
            and c.module.rpartition(".")[0] not in heads_bad]
    vocab = dict(inp.facts.vocab) if inp.facts else {}
    for pattern, items in _grouped(c.module for c in kept).items():
        choice = next(c for c in kept if c.module == items[0])
        rows = vocab.get(items[0])
        hint = _vocab_hint(rows, tp) if rows and rows % tp else ""
        yield Finding("USC209", f"'{pattern}'{_times(items)} {choice.reason}", "tp", hint=hint, module=items[0])


@rule("USC210", "tp-outside-cp", "warning", """
    When tp and cp both shard the sequence (sp=on with cp>1), the axis written last lies on
    neighbouring ranks and its shards nest inside the other's. With tp written before cp the
    nesting is the wrong way round and the compiler needs extra cp all-gathers to undo it.
    Write cp before tp ('cp=2 tp=2 sp=on'): the same program with fewer collectives, and tp
    innermost, within a node.""")
def tp_outside_cp(inp: LintInput) -> Iterator[Finding]:
    axes = inp.plan.mesh_axes
    if inp.plan.get("sp") and inp.plan.size("cp") > 1 and inp.plan.size("tp") > 1 and axes.index("tp") < axes.index("cp"):
        yield Finding("USC210", "tp is written outside cp with sp=on: sequence shards nest the wrong way round "
                                "and need extra cp gathers", "cp", hint="write cp before tp, e.g. 'cp=2 tp=2 sp=on'")


@rule("USC211", "dp-splits-a-sequence", "warning", """
    usc splits dim 0 of every input as the batch. A sequence-first model ([S, B, ...] inputs,
    torch's default for nn.Transformer* and nn.LSTM) has its sequence there: dp then runs the
    attention across it as a ring over the dp ranks -- the same numbers as one device, but context
    parallelism under dp's name (K/V blocks sent around the ring in every attention layer), and
    microbatches are refused. Feed the model batch-first (transpose inside forward if it computes
    sequence-first) for data parallelism as such.""")
def dp_splits_a_sequence(inp: LintInput) -> Iterator[Finding]:
    if inp.report is None:
        return
    rings = [c.module for c in inp.report.collectives if c.axis == "dp" and c.kind == "send/recv"]
    for pattern, items in _grouped(dict.fromkeys(rings)).items():
        yield Finding("USC211", f"dp splits the inputs' dim 0, which '{pattern}'{_times(items)} attends across: "
                                "the model is sequence-first, and its attention runs as a ring over the dp ranks",
                      "dp", module=items[0], hint="feed the model batch-first ([B, S, ...])")


# ------------------------------------------------------------------------------------------- notes
@rule("USC301", "small-gradient-buckets", "note", """
    Gradients are summed over dp in buckets launched during backward (bucket_mb, default 25
    MiB). Many buckets below 1 MiB each pay a collective's latency every time and run below the
    network's bandwidth (nccl-tests: bus bandwidth needs messages of about 1 MiB and more).
    Raise bucket_mb so that they are fused into fewer, larger calls.""")
def small_gradient_buckets(inp: LintInput) -> Iterator[Finding]:
    if inp.report is None:
        return
    by_axis: dict[str, list[int]] = defaultdict(list)
    for c in inp.report.collectives:
        if c.source == "gradient bucket":
            by_axis[c.axis].append(c.bytes_per_call)
    for axis, sizes in by_axis.items():
        if len(sizes) > MANY_BUCKETS and sum(sizes) / len(sizes) < SMALL_BUCKET_BYTES:
            yield Finding("USC301", f"{len(sizes)} gradient buckets on {axis} of {human_bytes(sum(sizes) // len(sizes))} "
                                    f"on average", "bucket_mb",
                          hint=f"bucket_mb={max(1, math.ceil(sum(sizes) / 2**20 / MANY_BUCKETS))} or more")


def _depends(later, earlier, position: dict) -> bool:
    """Whether ``later`` reads (transitively) the value of ``earlier``: nodes before it need no look."""
    seen, todo = set(), [later]
    while todo:
        node = todo.pop()
        for x in node.all_input_nodes:
            if x is earlier:
                return True
            if x not in seen and position[x] > position[earlier]:
                seen.add(x)
                todo.append(x)
    return False


def fusable_pairs(gm) -> list[tuple[str, str, str, str]]:
    """(kind, axis, module, module) of consecutive collectives of one kind and axis, in one
    direction, of which neither reads the other: one call over both tensors would do."""
    from .report import program_parts

    pairs = []
    for part in program_parts(gm):
        position = {n: i for i, n in enumerate(part.graph.nodes)}
        for direction in ("forward_collective", "backward_collective"):
            nodes = []
            for n in part.graph.nodes:
                module = part.get_submodule(n.target) if n.op == "call_module" else None
                kind = getattr(module, direction, None)
                kind = kind() if kind is not None else None
                if kind and kind not in ("none", "send/recv") and not hasattr(module, "traffic"):
                    # same kind and the same arguments (axis, reduce op, dim): one call can carry both
                    nodes.append((n, kind, module.axis, (type(module), module.extra_repr())))
            for (a, ka, xa, sa), (b, kb, xb, sb) in zip(nodes, nodes[1:]):
                if (ka, xa, sa) == (kb, xb, sb) and not _depends(b, a, position):
                    pairs.append((ka, xa, a.meta[META].module or a.name, b.meta[META].module or b.name))
    return pairs


@rule("USC302", "fusable-collectives", "note", """
    Two consecutive collectives of the same kind on the same axis, of which neither needs the
    other's result, could be one call over both tensors (concatenated, or coalesced as NCCL
    groups do): one latency instead of two. Common when two row-parallel linears feed one op,
    or under rules that split sibling layers the same way.""")
def fusable_collectives(inp: LintInput) -> Iterator[Finding]:
    if inp.program is None:
        return
    grouped: dict[tuple, int] = defaultdict(int)
    for kind, axis, a, b in fusable_pairs(inp.program.gm):
        grouped[(kind, axis, _layer_pattern(a), _layer_pattern(b))] += 1
    for (kind, axis, a, b), n in grouped.items():
        yield Finding("USC302", f"the {kind}s on {axis} of '{a}' and '{b}' are independent and adjacent"
                                + (f" ({n} times)" if n > 1 else "") + ": one call would do", module=a)


@rule("USC303", "frozen-float32-weights", "note", """
    Under dtype=bf16 each step computes with a bf16 copy of every float32 weight, made once per step.
    A frozen parameter (requires_grad off) never changes, so in float32 it is held twice -- its float32
    value and the step's copy -- for nothing: the step only reads the copy. Cast the frozen weights
    to bf16 before compiling (for each frozen p: p.data = p.data.to(torch.bfloat16)); the step
    computes the same numbers (the copy was that rounding) and they take a third of the bytes. A
    checkpoint then holds them in bf16.""")
def frozen_float32_weights(inp: LintInput) -> Iterator[Finding]:
    if inp.program is None or inp.plan is None or inp.plan.get("dtype") != "bf16":
        return
    frozen = [s for s in inp.program.state if s.kind == "param" and not s.trainable and s.dtype == torch.float32]
    if frozen:
        nbytes = sum(shape_bytes(s.global_shape, s.dtype) for s in frozen)
        yield Finding("USC303", f"{len(frozen)} frozen parameters are float32 ({human_bytes(nbytes)} for the model) "
                                "under dtype=bf16: each rank holds them and a bf16 copy each step", "dtype",
                      hint="cast the frozen parameters to bf16 before compiling (p.data = p.data.to(torch.bfloat16)): "
                           "the same numbers, a third of the bytes")
