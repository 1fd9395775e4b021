"""The cost model against the Ultra-Scale Playbook's benchmark sweep (what each constant is fitted on, what is held out).

    python benchmarks/playbook_sweep.py             # every row: published vs predicted, by group
    python benchmarks/playbook_sweep.py --markdown  # the tables docs/cost_model.md shows
    python benchmarks/playbook_sweep.py --tp-scaling  # the TP and TP/SP scaling figures (3B, tp=2..32)
    python benchmarks/playbook_sweep.py --planner   # usc.plan's choice per cell against the measured best
    python benchmarks/playbook_sweep.py --fit       # refit the h100 profile's two fitted constants
    python benchmarks/playbook_sweep.py --fit-gradient  # refit its gradient bandwidth by ranks per node
    python benchmarks/playbook_sweep.py --implied   # the gradient bandwidth each row implies
    python benchmarks/playbook_sweep.py --fit-pipeline  # refit the sweep cluster's pipeline transfer time
    python benchmarks/playbook_sweep.py --microbatch-cost  # what one more microbatch costs, measured vs predicted

Hugging Face measured thousands of nanotron configurations of Llama-style models on 1-64 nodes of 8
H100 (EFA between nodes), sequence 4,096, global batch 256 sequences (Tazi et al., "The Ultra-Scale
Playbook", 2025, the interactive figure of its "Finding the best training configuration" section).
``data/playbook_sweep.csv`` holds the rows read from that figure: per (model, nodes) cell the three
fastest configurations, every pure-dp and pure-tp one, and the pipelined ones among the fifteen
fastest on 2+ nodes. The h100 profile's two fitted constants (the host's launch time, element-wise
traffic) are fitted on the one-node rows (``--fit``); its matrix products' rate is measured
(benchmarks/gpu_step.py); its gradient bandwidth by ranks per node is fitted on the 1B and 3B rows on
2-32 nodes (``--fit-gradient``, read off the rows with ``--implied``); the 8B rows and every 64-node
row are held out. Its bus bandwidth by node count comes from the same cluster's collective
measurements (the playbook's bandwidth figure). The rows are predicted with ``data/playbook_cluster.toml``:
the h100 profile plus the time a pipeline transfer took on 64 of that cluster's nodes under nanotron
(``--fit-pipeline``, fitted on the 64-node pipelined rows with each model held out in turn), which
the h100 profile does not hold (usc's runtime has not been measured on it, and a published run on
1,024 nodes of another cluster could not have paid it).

Each row is read as the plan usc would run: nanotron's pp/dp/tp mesh, ZeRO-1 or none, GradAcc
microbatches of MBS sequences, tensor parallel with sequence parallelism (nanotron's reduce-scatter
mode), 1F1B, no recompute, bf16. The models' shapes are not published: 1B, 3B and 8B are read as
Llama 3.2 1B, Llama 3.2 3B and Llama 3 8B, whose FLOPs per token the sweep's own figures (its MFU
over its tokens/s) exceed by 7%, 19% and 16% -- so the models it ran are somewhat larger, and what
is compared is MFU, each side counting its own model's FLOPs (a step time that scales with the
FLOPs gives the same MFU), with tokens/s/GPU beside it.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from calibrate import SHAPES, estimate_shape, model_profile  # noqa: E402

from usc.compiler.cost_model import estimate  # noqa: E402
from usc.compiler.hardware import hardware_profile  # noqa: E402
from usc.dsl import parse_plan  # noqa: E402
from usc.planning import point_of  # noqa: E402

DATA = Path(__file__).parent / "data" / "playbook_sweep.csv"
# The sweep's cluster and runtime: the h100 profile plus the pipeline transfer time nanotron's 64-node
# runs show (``--fit-pipeline``), which usc's own runtime has not been measured on
CLUSTER = str(Path(__file__).parent / "data" / "playbook_cluster.toml")
SEQ = 4096
GROUPS = {"best": "2+ nodes, the three fastest of the cell", "dp": "2+ nodes, pure dp (tp=pp=1)",
          "tp": "2+ nodes, pure tp (dp=pp=1)", "pp": "2+ nodes, pipelined (pp>1, tp<=8), among the cell's fifteen fastest"}


def rows(path: Path = DATA) -> list[dict]:
    with open(path) as f:
        out = []
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            out.append({k: (v if k in ("model", "groups") else float(v) if "." in v else int(v))
                        for k, v in r.items()})
        return out


def plan_text(r: dict) -> str:
    # nanotron's mesh is (pp, dp, tp), outermost first (nanotron/parallel/context.py): written in that
    # order, usc lays its groups out the same way, so the same groups cross nodes
    parts = [f"pp={r['pp']}", f"dp={r['dp']}", f"tp={r['tp']}", f"mb={r['gradacc']}"]
    if r["zero"] and r["dp"] > 1:
        parts.append(f"zero={r['zero']}")
    if r["tp"] > 1:
        parts.append("sp=on")
    return " ".join(parts + ["dtype=bf16"])


def predict(data: list[dict], hw_name=CLUSTER) -> list[dict]:
    hw = hardware_profile(hw_name)
    out = []
    for r in data:
        est = estimate_shape(r["model"], plan_text(r), r["gbs"], SEQ, hw)
        point = est.plan
        tps = est.tokens_per_second / point.world
        out.append(dict(r, plan=plan_text(r), predicted_tps=tps, predicted_mfu=est.mfu,
                        predicted_memory=est.memory_total / 1e9, estimate=est))
    return out


FITTED = ("unit_overhead", "pointwise_traffic")


def fit(data: list[dict], base: str = "h100") -> dict:
    """The h100 profile's two fitted fields (FITTED) minimising the squared log error of MFU over
    ``data``: a coarse grid, then a fine one around its best. The matrix products' own rate
    (``matmul_efficiency``, ``matmul_half_work``) is measured, not fitted (benchmarks/gpu_step.py)."""
    import itertools

    import numpy as np

    hw = hardware_profile(base)

    def error(values) -> float:
        trial = replace(hw, **dict(zip(FITTED, map(float, values))))
        return sum(math.log(p["predicted_mfu"] / p["mfu_percent"] * 100) ** 2 for p in predict(data, trial))

    coarse = (np.arange(0.0, 0.0081, 0.0004), np.arange(3.0, 30.1, 1.0))
    o, t = min(itertools.product(*coarse), key=error)
    fine = (np.arange(max(0.0, o - 0.0004), o + 0.00041, 0.0001), np.arange(max(1.0, t - 1.0), t + 1.01, 0.25))
    best = min(itertools.product(*fine), key=error)
    return dict(zip(FITTED, (round(float(best[0]), 4), round(float(best[1]), 2))))


GRADIENT_FIT_MODELS = ("1B", "3B")  # the cells the gradient table is fitted on; 8B's are held out


def gradient_rows(data: list[dict]) -> list[dict]:
    """The rows whose dp groups can span nodes and whose tp stays in a node: 2-32 nodes, tp <= 8 (the
    64-node rows are flagged and left out, as the planner flags plans beyond 32 nodes)."""
    return [r for r in data if 1 < r["nodes"] <= 32 and r["tp"] <= 8]


def fit_gradient(data: list[dict], base: str = "h100") -> tuple[float, float]:
    """(b1, a) of the h100 profile's gradient_busbw_by_ranks_per_node, written as b1 * g**a at g = 1, 2,
    4, 8 ranks per node: the pair minimising the squared log error of MFU over ``data`` (a coarse grid,
    then a fine one around its best)."""
    hw = hardware_profile(base)

    def error(values) -> float:
        b1, a = values
        trial = replace(hw, gradient_busbw_by_ranks_per_node=gradient_table(b1, a))
        return sum(math.log(p["predicted_mfu"] / p["mfu_percent"] * 100) ** 2 for p in predict(data, trial))

    coarse = ([b * 1e9 for b in range(8, 65, 4)], [a / 10 for a in range(0, 11)])
    b1, a = min(itertools.product(*coarse), key=error)
    fine = ([b1 + d * 1e9 for d in range(-3, 4) if b1 + d * 1e9 > 0], [max(0.0, a + d / 100) for d in range(-8, 9, 2)])
    return min(itertools.product(*fine), key=error)


def gradient_table(b1: float, a: float, per_node: int = 8) -> tuple:
    """The (ranks per node, busbw) pairs of b1 * g**a at g = 1, 2, 4, ... ``per_node``."""
    return tuple((g, b1 * g ** a) for g in (1 << i for i in range(per_node.bit_length())) if g <= per_node)


def gradient_fit_report(base: str = "h100") -> list[str]:
    """Fit the gradient table on GRADIENT_FIT_MODELS' rows; each side's MFU points with and without it."""
    data = gradient_rows(rows())
    fit_on = [r for r in data if r["model"] in GRADIENT_FIT_MODELS]
    held = [r for r in data if r["model"] not in GRADIENT_FIT_MODELS]
    b1, a = fit_gradient(fit_on, base)
    hw = hardware_profile(base)
    table = gradient_table(b1, a)
    lines = [f"fitted on {len(fit_on)} rows ({', '.join(GRADIENT_FIT_MODELS)}, 2-32 nodes, tp <= 8): "
             f"b1 = {b1 / 1e9:.0f} GB/s, a = {a:.2f}: gradient_busbw_by_ranks_per_node = "
             f"[{', '.join(f'[{g}, {bw / 1e9:.2f}e9]' for g, bw in table)}]"]
    for name, sel in (("fitted on", fit_on), ("held out", held)):
        for label, profile in (("without the table", replace(hw, gradient_busbw_by_ranks_per_node=())),
                               ("with it", replace(hw, gradient_busbw_by_ranks_per_node=table))):
            points = [abs(p["predicted_mfu"] * 100 - p["mfu_percent"]) for p in predict(sel, profile)]
            lines.append(f"{name} ({len(sel)} rows), {label}: within 5 MFU points {sum(d <= 5 for d in points)}"
                         f" of {len(sel)}, rms {math.sqrt(sum(d * d for d in points) / len(points)):.2f} points")
    # the same fit on each other pair of models, the third held out: how stable the two constants are
    models = sorted({r["model"] for r in data})
    for pair in itertools.combinations(models, 2):
        if set(pair) == set(GRADIENT_FIT_MODELS):
            continue
        b1, a = fit_gradient([r for r in data if r["model"] in pair], base)
        rest = [r for r in data if r["model"] not in pair]
        counts = []
        for table in (gradient_table(b1, a), ()):
            points = [abs(p["predicted_mfu"] * 100 - p["mfu_percent"])
                      for p in predict(rest, replace(hw, gradient_busbw_by_ranks_per_node=table))]
            counts.append(sum(d <= 5 for d in points))
        lines.append(f"fitted on {' and '.join(pair)} instead: b1 = {b1 / 1e9:.0f} GB/s, a = {a:.2f}; the "
                     f"{len(rest)} rows held out within 5 MFU points: {counts[0]} (by-nodes reading alone: {counts[1]})")
    return lines


def _mfu_error(data: list[dict], hw) -> float:
    return sum(math.log(p["predicted_mfu"] / p["mfu_percent"] * 100) ** 2 for p in predict(data, hw))


def fit_pipeline_seconds(data: list[dict], nodes: int, base: str = "h100", grid=None) -> float:
    """The seconds per pipeline transfer at ``nodes`` nodes (``pipeline_transfer_seconds_by_nodes``
    holding that one figure for every node count) minimising the squared log error of MFU over
    ``data``: a coarse grid of 10 ms steps, then 1 ms steps around its best."""
    hw = hardware_profile(base)

    def error(seconds: float) -> float:
        return _mfu_error(data, replace(hw, pipeline_transfer_seconds_by_nodes=((nodes, seconds),)))

    coarse = grid or [i / 100 for i in range(0, 41)]
    best = min(coarse, key=error)
    return min((max(0.0, best + d / 1000) for d in range(-9, 10)), key=error)


def pipeline_fit_report(base: str = "h100") -> list[str]:
    """Fit the pipeline transfer's seconds on the 64-node pipelined rows, each model held out in turn;
    then the figure each node count's pipelined rows would take on their own (2-32 nodes: what says
    the table's lower pair is 0)."""
    hw = hardware_profile(base)
    data = rows()
    sixty_four = [r for r in data if r["nodes"] == 64]
    piped = [r for r in sixty_four if r["pp"] > 1]
    fitted = fit_pipeline_seconds(piped, 64, base)
    table = ((32, 0.0), (64, fitted))
    lines = [f"fitted on the {len(piped)} pipelined rows of 64 nodes: {fitted:.3f} s per transfer: "
             f"pipeline_transfer_seconds_by_nodes = [[32, 0.0], [64, {fitted:.3f}]]"]
    for label, profile in (("without the table", replace(hw, pipeline_transfer_seconds_by_nodes=())),
                           ("with it", replace(hw, pipeline_transfer_seconds_by_nodes=table))):
        points = [abs(p["predicted_mfu"] * 100 - p["mfu_percent"]) for p in predict(sixty_four, profile)]
        lines.append(f"64 nodes, all {len(points)} rows, {label}: within 5 MFU points {sum(d <= 5 for d in points)}")
    for held in sorted({r["model"] for r in piped}):
        others = [r for r in piped if r["model"] != held]
        seconds = fit_pipeline_seconds(others, 64, base)
        rest = [r for r in sixty_four if r["model"] == held]
        profile = replace(hw, pipeline_transfer_seconds_by_nodes=((32, 0.0), (64, seconds)))
        points = [abs(p["predicted_mfu"] * 100 - p["mfu_percent"]) for p in predict(rest, profile)]
        lines.append(f"{held} held out: fitted on the others' {len(others)} "
                     f"rows, {seconds:.3f} s; {held}'s {len(rest)} rows at 64 nodes within 5 MFU points "
                     f"{sum(d <= 5 for d in points)}")
    small = [0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05]
    for nodes in sorted({r["nodes"] for r in data if 1 < r["nodes"] < 64}):
        sel = [r for r in data if r["nodes"] == nodes and r["pp"] > 1]
        if sel:
            best = min(small, key=lambda s: _mfu_error(sel, replace(hw, pipeline_transfer_seconds_by_nodes=((nodes, s),))))
            lines.append(f"{nodes} nodes, {len(sel)} pipelined rows on their own: {best * 1e3:.1f} ms per transfer "
                         f"(of {', '.join(f'{s * 1e3:g}' for s in small)} ms)")
    return lines


def implied_bandwidth(base: str = "h100") -> list[str]:
    """Per pure-dp/dp+tp row on 2-32 nodes (pp=1, tp <= 8: only the dp groups cross nodes): the bus
    bandwidth of the gradient reduction that makes the model's step the measured one, every other term
    as modelled -- found by bisection on a flat gradient table, the other links' caps lifted -- then the
    range by ranks of the dp group per node. What the gradient table is read from."""
    from usc.compiler.cost_model import ranks_per_node

    hw = hardware_profile(base)
    lifted = replace(hw, inter_node_bandwidth=1e15, **{
        name: tuple((n, b * 1e4) for n, b in getattr(hw, name)) for name in
        ("all_reduce_busbw_by_nodes", "all_gather_busbw_by_nodes", "reduce_scatter_busbw_by_nodes")})
    lines, by_g = [], {}
    for r in gradient_rows(rows()):
        if r["pp"] != 1 or r["dp"] < 2:
            continue
        measured = r["gbs"] * SEQ / (r["nodes"] * 8) / r["tok_s_gpu"]

        def step(bw: float) -> float:
            trial = replace(lifted, gradient_busbw_by_ranks_per_node=((1, bw),))
            return estimate_shape(r["model"], plan_text(r), r["gbs"], SEQ, trial).time["step"]

        lo, hi = 1e9, 1e13
        if measured <= step(hi):
            value = math.inf  # even an unbounded link is too slow: the rest of the model is over
        elif measured >= step(lo):
            value = lo
        else:
            for _ in range(40):
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if step(mid) > measured else (lo, mid)
            value = hi
        est = estimate_shape(r["model"], plan_text(r), r["gbs"], SEQ, hw)
        g = ranks_per_node(est.plan, "dp")
        by_g.setdefault((g, r["zero"]), []).append(value)
        lines.append(f"| {r['model']} | {r['nodes']} | `{plan_text(r)}` | {g} | {value / 1e9:.1f} |")
    lines.append("")
    for (g, zero), values in sorted(by_g.items()):
        finite = [v for v in values if math.isfinite(v)]
        lines.append(f"{g} rank(s) per node, ZeRO-{zero}: {len(values)} rows, implied "
                     f"{min(finite) / 1e9:.0f}-{max(finite) / 1e9:.0f} GB/s (median "
                     f"{statistics.median(finite) / 1e9:.0f}); the table holds {hw.gradient_busbw(g) / 1e9:.0f}"
                     if finite else f"{g} rank(s) per node, ZeRO-{zero}: {len(values)} rows, none finite")
    return lines


def summary(predicted: list[dict], group: str) -> str:
    """How the held-out rows (2+ nodes) of ``group`` fare; "fitted" is the one-node rows."""
    if group == "fitted":
        sel, name = [p for p in predicted if p["nodes"] == 1], "one node (the rows fitted on)"
    else:
        sel, name = [p for p in predicted if p["nodes"] > 1 and group in p["groups"].split("+")], GROUPS[group]
    if not sel:
        return f"{group}: no rows"
    errors = [p["predicted_mfu"] / p["mfu_percent"] * 100 - 1 for p in sel]
    points = [abs(p["predicted_mfu"] - p["mfu_percent"] / 100) for p in sel]
    return (f"{name}: {len(sel)} rows, MFU error median {statistics.median(errors):+.0%} "
            f"(median |error| {statistics.median(abs(e) for e in errors):.0%}); within 5 MFU points "
            f"{sum(d <= 0.05 for d in points)} of {len(sel)}")


def memory_summary(predicted: list[dict]) -> str:
    """The model's memory per rank against the GPU memory each run reported (held out: nothing in
    the memory model is fitted)."""
    errors = [p["predicted_memory"] / p["gpu_memory_gb"] - 1 for p in predicted]
    return (f"memory per rank, all {len(errors)} rows: error median {statistics.median(errors):+.1%} "
            f"(median |error| {statistics.median(abs(e) for e in errors):.1%}); within 15% "
            f"{sum(abs(e) <= 0.15 for e in errors)} of {len(errors)}")


def ranking(predicted: list[dict]) -> list[str]:
    """Per cell: the configuration the cost model ranks first among the cell's rows, and what it measured."""
    lines = []
    cells = sorted({(p["model"], p["nodes"]) for p in predicted}, key=lambda c: (c[0], c[1]))
    for model, nodes in cells:
        cell = [p for p in predicted if (p["model"], p["nodes"]) == (model, nodes)]
        chosen = max(cell, key=lambda p: p["predicted_mfu"])
        best = max(cell, key=lambda p: p["tok_s_gpu"])
        lines.append(f"| {model} | {nodes} | {len(cell)} | `{chosen['plan']}` | {chosen['mfu_percent']:.1f}% | "
                     f"{chosen['predicted_mfu']:.1%} | `{best['plan']}` | {best['mfu_percent']:.1f}% | "
                     f"{chosen['tok_s_gpu'] / best['tok_s_gpu'] - 1:+.0%} |")
    return lines


# The playbook's "Throughput Scaling with TP (3B Model)" and "... with TP/SP" figures: tokens/s/GPU
# and the "Maximum Batch Size" at tp=2..32, sequence 4,096. The batch each bar ran at is not stated:
# read here as one microbatch of the maximum batch size per step, dp=1.
TP_SCALING = {False: ([13_923, 12_421, 10_903, 6_246, 2_146], [3, 8, 12, 16, 20]),
              True: ([14_167, 13_460, 10_889, 6_159, 3_610], [4, 10, 20, 40, 100])}
TP_SIZES = (2, 4, 8, 16, 32)


def tp_scaling(hw_name="h100") -> list[str]:
    """Published vs predicted tokens/s/GPU of the TP and TP/SP figures; the last column scales the
    prediction by the sweep's FLOPs per token over Llama 3.2 3B's (1.195: its 3B is larger)."""
    hw = hardware_profile(hw_name)
    profile = model_profile("3B")
    lines = []
    for sp, (published, batches) in TP_SCALING.items():
        for tp, tps, batch in zip(TP_SIZES, published, batches):
            point = point_of(parse_plan(f"tp={tp} dtype=bf16" + (" sp=on" if sp else "")), global_batch=batch, seq=SEQ)
            est = estimate(profile, replace(point, gpus_per_node=hw.gpus_per_node), hw)
            predicted = est.tokens_per_second / tp
            lines.append(f"| {'tp+sp' if sp else 'tp'} | {tp} | {batch} | {tps:,} | {predicted:,.0f} | "
                         f"{predicted / 1.195:,.0f} ({predicted / 1.195 / tps - 1:+.0%}) |")
    return lines


# The space the sweep covered: nanotron's dp/tp/pp with ZeRO-0/1, no recompute, no fusion, 1F1B, tp
# within a node (what most published sweeps cover, and what the planner is held to here)
NANOTRON_SPACE = (("zero", 1), ("recompute", "none"), ("fuse", False), ("cp", 1), ("schedule", "1f1b"))


def measured_or_bound(plan, cell: list[dict]) -> tuple[str, float | None]:
    """What the sweep says of ``plan`` in its (model, nodes) cell: ("measured", MFU %) when a row is
    that configuration (same dp/tp/pp sizes, microbatch count and, with dp > 1, ZeRO stage; nanotron's
    layout), else ("at most", MFU %) read off the ranks the file keeps -- every pipelined row among a
    cell's fifteen fastest on 2+ nodes is kept, so one missing ran below all of those; any other missing
    row ranks after the first rank the file lacks, below the row before it -- or ("not run", None)
    for a pure-dp or pure-tp plan (the file keeps all of those). A bound holds if the sweep ran the
    configuration at all (it may not have fit)."""
    for r in cell:
        if (r["dp"], r["tp"], r["pp"], r["gradacc"]) == (plan.dp, plan.tp, plan.pp, plan.mb) and (
                plan.dp == 1 or r["zero"] == plan.zero):
            return "measured", r["mfu_percent"]
    if (plan.tp == 1 and plan.pp == 1) or (plan.dp == 1 and plan.pp == 1):
        return "not run", None
    by_rank = {r["rank"]: r["mfu_percent"] for r in cell}
    if plan.pp > 1 and cell[0]["nodes"] > 1:
        return "at most", min(m for k, m in by_rank.items() if k <= 15)
    gap = next(k for k in range(1, len(by_rank) + 2) if k not in by_rank)
    return "at most", by_rank[gap - 1]


def planner_vs_sweep(hw_name=CLUSTER) -> list[str]:
    """Per (model, nodes) cell: the plan usc.plan's search chooses in the sweep's space, its predicted
    MFU, and the MFU the sweep measured for its fastest configuration."""
    from usc.compiler.planner import PlanTarget, search
    from usc.planning import refusal

    hw = hardware_profile(hw_name)
    best = {}
    for r in rows():
        cell = (r["model"], r["nodes"])
        if cell not in best or r["tok_s_gpu"] > best[cell]["tok_s_gpu"]:
            best[cell] = r
    lines = []
    data = rows()
    for (model, nodes), measured in sorted(best.items(), key=lambda c: (c[0][0], c[0][1])):
        target = PlanTarget(gpus=8 * nodes, seq=SEQ, global_batch=256, gpus_per_node=8, dtype="bf16",
                            fixed=NANOTRON_SPACE)
        result = search(model_profile(model), target, hw, supported=refusal)
        chosen = result.best
        kind, mfu = measured_or_bound(chosen.plan, [r for r in data if (r["model"], r["nodes"]) == (model, nodes)])
        said = "not in the sweep" if mfu is None else f"{mfu:.1f}%" if kind == "measured" else f"at most {mfu:.1f}%"
        lines.append(f"| {model} | {nodes} | `{chosen.plan.text()}` | {chosen.estimate.mfu:.1%} | {said} | "
                     f"`{plan_text(measured)}` | {measured['mfu_percent']:.1f}% | "
                     f"{(chosen.estimate.mfu - measured['mfu_percent'] / 100) * 100:+.1f} | "
                     f"{'; '.join(result.unchecked_terms) or '-'} |")
    return lines


def markdown(predicted: list[dict]) -> None:
    print("| model | nodes | plan | groups | tokens/s/GPU published | predicted | MFU published | predicted "
          "| memory GB published | predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in predicted:
        print(f"| {p['model']} | {p['nodes']} | `{p['plan']}` | {p['groups']} | {p['tok_s_gpu']:,} | "
              f"{p['predicted_tps']:,.0f} | {p['mfu_percent']:.1f}% | {p['predicted_mfu']:.1%} | "
              f"{p['gpu_memory_gb']:.1f} | {p['predicted_memory']:.1f} |")


def misses(predicted: list[dict], points: float = 0.05) -> list[str]:
    """Every row (all 199, fitted ones included) whose predicted MFU is more than ``points`` from the
    measured, as markdown rows, then a count by node count."""
    out = [f"| {p['model']} | {p['nodes']} | `{p['plan']}` | {p['groups']} | {p['mfu_percent']:.1f}% | "
           f"{p['predicted_mfu']:.1%} | {(p['predicted_mfu'] - p['mfu_percent'] / 100) * 100:+.1f} |"
           for p in predicted if abs(p["predicted_mfu"] - p["mfu_percent"] / 100) > points]
    by_nodes: dict = {}
    for p in predicted:
        total, missed = by_nodes.get(p["nodes"], (0, 0))
        by_nodes[p["nodes"]] = (total + 1, missed + (abs(p["predicted_mfu"] - p["mfu_percent"] / 100) > points))
    counts = ", ".join(f"{n} node{'s' * (n > 1)}: {m} of {t}" for n, (t, m) in sorted(by_nodes.items()))
    return out + ["", f"outside {points * 100:.0f} MFU points: {len(out)} of {len(predicted)} rows ({counts})"]


def flops_per_token_ratio(p: dict) -> float:
    """The sweep's FLOPs per token over usc's for one predicted row: its MFU per token/s over the
    prediction's (a row's MFU is its tokens/s times its FLOPs per token over the peak)."""
    return (p["mfu_percent"] / 100 / p["tok_s_gpu"]) / (p["predicted_mfu"] / p["predicted_tps"])


def flops_consistency(predicted: list[dict]) -> dict[tuple[str, bool], list[float]]:
    """Per (model, pipelined): the FLOPs-per-token ratios of its rows. One model has one FLOPs count
    per token whatever its mesh, so within a model the ratio should not move with pp."""
    out: dict = {}
    for p in predicted:
        out.setdefault((p["model"], p["pp"] > 1), []).append(flops_per_token_ratio(p))
    return out


def by_tokens(predicted: list[dict]) -> list[dict]:
    """``predicted`` with each row's measured MFU made again from its tokens/s and its model's FLOPs
    per token as the sweep's own non-pipelined rows count them (``flops_consistency``): the
    comparison in MFU points where the figure's MFU and tokens/s disagree."""
    ratios = flops_consistency(predicted)
    per_model = {model: statistics.median(r) for (model, piped), r in ratios.items() if not piped}
    return [dict(p, mfu_percent=100 * p["tok_s_gpu"] * p["predicted_mfu"] / p["predicted_tps"] * per_model[p["model"]])
            for p in predicted]


def microbatch_costs(hw_name="h100", models=("1B", "3B", "8B")) -> list[dict]:
    """The one-node rows that differ only in their microbatch count (same mesh and ZeRO stage, the
    same 256 sequences cut finer): what one more microbatch adds to the step, per layer, measured and
    predicted. The cost model charges ``unit_overhead`` per layer per microbatch where the host takes
    longer to issue a microbatch's kernels than the device takes to run them (small per-rank work:
    tp's slices of one sequence), and nothing where the device is the slower (dp's whole layers)."""
    groups: dict[tuple, list[dict]] = {}
    for p in predict([r for r in rows() if r["nodes"] == 1 and r["model"] in models], hw_name):
        groups.setdefault((p["model"], p["pp"], p["dp"], p["tp"], p["zero"]), []).append(p)
    out = []
    for (model, pp, dp, tp, zero), members in groups.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda p: p["gradacc"])
        few, many = members[0], members[-1]
        extra = (many["gradacc"] - few["gradacc"]) * SHAPES[model][1].layers
        seconds = lambda tps: few["gbs"] * SEQ / (8 * tps)  # noqa: E731 - a step from tokens/s/GPU, 8 GPUs
        out.append(dict(model=model, mesh=f"pp={pp} dp={dp} tp={tp} zero={zero}", few=few, many=many,
                        measured=(seconds(many["tok_s_gpu"]) - seconds(few["tok_s_gpu"])) / extra,
                        predicted=(seconds(many["predicted_tps"]) - seconds(few["predicted_tps"])) / extra))
    return out


def microbatch_cost(hw_name="h100") -> list[str]:
    """``microbatch_costs`` as the markdown rows docs/cost_model.md shows."""
    return [f"| {c['model']} | {c['mesh']} | {c['few']['gradacc']} -> {c['many']['gradacc']} | "
            f"{c['few']['mfu_percent']:.1f}% -> {c['many']['mfu_percent']:.1f}% | "
            f"{c['few']['predicted_mfu']:.1%} -> {c['many']['predicted_mfu']:.1%} | "
            f"{c['measured'] * 1e3:.2f} | {c['predicted'] * 1e3:.2f} |" for c in microbatch_costs(hw_name)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="every row as a markdown table")
    parser.add_argument("--hardware", default=CLUSTER, help="the profile to predict with (default: the sweep's cluster, benchmarks/data/playbook_cluster.toml)")
    parser.add_argument("--tp-scaling", action="store_true", help="the TP and TP/SP scaling figures")
    parser.add_argument("--planner", action="store_true",
                        help="usc.plan's choice in the sweep's space per cell against the cell's measured best")
    parser.add_argument("--fit", action="store_true", help="fit unit_overhead and pointwise_traffic on the "
                        "one-node rows (the multi-node rows are not used)")
    parser.add_argument("--fit-gradient", action="store_true", help="fit the h100 profile's gradient bandwidth "
                        "by ranks per node on the 1B and 3B rows of 2-32 nodes (the 8B rows held out)")
    parser.add_argument("--fit-pipeline", action="store_true", help="fit the sweep cluster's pipeline transfer "
                        "seconds at 64 nodes (data/playbook_cluster.toml) on that node count's pipelined rows, "
                        "each model held out in turn")
    parser.add_argument("--implied", action="store_true", help="the gradient bandwidth each pp=1 row on 2-32 "
                        "nodes implies, by ranks of the dp group per node (what --fit-gradient's law is read from)")
    parser.add_argument("--misses", action="store_true",
                        help="every row whose predicted MFU is more than 5 points from the measured (by the "
                        "figure's MFU, then by its tokens/s), and the FLOPs per token each model's rows imply")
    parser.add_argument("--microbatch-cost", action="store_true",
                        help="what one more microbatch adds per layer, measured vs predicted (one-node rows)")
    args = parser.parse_args()
    if args.microbatch_cost:
        print("| model | mesh | microbatches | measured MFU | predicted MFU | measured ms per layer per extra "
              "microbatch | predicted |")
        print("|---|---|---|---|---|---|---|")
        return print("\n".join(microbatch_cost(args.hardware)))
    if args.planner:
        print("| model | nodes | usc.plan's choice | predicted MFU | the choice measured | the sweep's fastest "
              "| measured MFU | points | unchecked terms |")
        print("|---|---|---|---|---|---|---|---|---|")
        return print("\n".join(planner_vs_sweep(args.hardware)))
    if args.tp_scaling:
        print("| mode | tp | batch | tokens/s/GPU published | predicted | predicted at the sweep's FLOPs |")
        print("|---|---|---|---|---|---|")
        return print("\n".join(tp_scaling(args.hardware)))
    if args.implied:
        print("| model | nodes | plan | dp ranks per node | implied gradient busbw (GB/s) |")
        print("|---|---|---|---|---|")
        return print("\n".join(implied_bandwidth(args.hardware)))
    if args.fit_pipeline:
        return print("\n".join(pipeline_fit_report(args.hardware)))
    if args.fit_gradient:
        return print("\n".join(gradient_fit_report(args.hardware)))
    if args.fit:
        one_node = [r for r in rows() if r["nodes"] == 1]
        fitted = ", ".join(f"{k} = {v}" for k, v in fit(one_node, args.hardware).items())
        return print(f"fitted on {len(one_node)} one-node rows: {fitted}")
    predicted = predict(rows(), args.hardware)
    if args.misses:
        print("| model | nodes | plan | groups | MFU published | predicted | points |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(misses(predicted)))
        print("\nThe sweep's FLOPs per token over usc's, read off each row's MFU and tokens/s:")
        for (model, piped), ratios in sorted(flops_consistency(predicted).items()):
            print(f"  {model} {'pipelined' if piped else 'not pipelined'}: {len(ratios)} rows, "
                  f"{min(ratios):.3f}-{max(ratios):.3f} (median {statistics.median(ratios):.3f})")
        print("\nThe same rows, each measured MFU made again from its tokens/s at its model's FLOPs per token "
              "as the non-pipelined rows count them:")
        again = misses(by_tokens(predicted))
        return print("\n".join(again[:-2] + again[-1:]))
    if args.markdown:
        markdown(predicted)
    for group in ("fitted", *GROUPS):
        print(summary(predicted, group))
    print(memory_summary(predicted))
    print("\n| model | nodes | rows | cost model's first | its measured MFU | predicted | measured best "
          "| its MFU | chosen vs best (tokens/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(ranking(predicted)))


if __name__ == "__main__":
    sys.exit(main())
