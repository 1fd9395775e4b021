"""Measure this machine, write a hardware profile the cost model reads, and check it on real plans.

    python benchmarks/calibrate.py --out cpu_here.toml            # measure (4 gloo processes), write the profile
    python benchmarks/calibrate.py --out cpu_here.toml --validate # then predict vs measure 6 plans' step time
    python benchmarks/calibrate.py --profile cpu_here.toml --validate   # check an existing profile
    python benchmarks/calibrate.py --profile cpu_here.toml --validate --model hf-llama  # transformers' Llama

What is measured, each on 4 local processes at once (so the cores they share count, as in training):
- usc's own gloo collectives (runtime Comm: all-reduce, all-gather, reduce-scatter, send/recv) over
  message sizes, on groups of 2 and 4; a least-squares fit of the cost model's formula
  (``collective_seconds`` with ring latency steps) to the all-reduces gives the link's bandwidth and
  per-step latency, and each other kind's factor over the formula (``all_gather_factor``...) is the
  geometric mean of its measured / formula;
- matmuls over rows per call at the validation model's widths, fp32 and bf16, each rank calling
  them for a quarter of a second while every other rank does too (the rate a step's compute gets
  when all ranks share the cores): the fit
  ``flops(rows) = peak * rows / (rows + half_rows)`` gives the peak and the fall-off the cost
  model's matmul efficiency uses (efficiency 1.0: the peak is what was sustained);
- memory bandwidth (an in-place multiply of 128 MiB: read + write);
- the executor's cost per layer that does not grow with size (Python, op dispatch): usc steps of a
  very narrow Llama at 1 and 5 layers, ``dp=4``; the difference per layer is ``unit_overhead``;
- the cores the processes may run on (``host_cores``, read, not fitted): with fewer cores than ranks
  a pipeline's bubble is what a timeline with idle ranks' cores handed to busy ones leaves;
- with fewer cores than ranks, what a blocking collective waits for its group to meet after compute
  (``sync_skew_by_ranks``, groups of 2 and 4, at ``sync_skew_gap``): a loop of matmuls and a 4 KiB
  all-reduce against each alone, every rank at once.

--validate then runs each plan of PLANS on 4 gloo processes (wall clock of ``step()`` over STEPS
steps after WARMUP, the slowest rank's mean) and prints it beside ``usc.lint``'s prediction on the
profile, with the machine's load average (``uptime``) at the time of each measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import torch

import usc
from usc.compiler.cost_model import collective_seconds
from usc.compiler.hardware import FACTOR_FIELDS, hardware_profile
from usc.runtime.launch import launch_local
from usc.testing.hf import hf_llama_model
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, token_batch

WORLD = 4
SIZES = [2**k for k in range(12, 24, 2)]  # 4 KiB .. 4 MiB payloads
ROWS = [16, 64, 256, 1024, 4096]
# The validation model: wide enough that matmuls, not Python, take most of a step's time.
MODEL = LlamaConfig(vocab=512, hidden=256, heads=8, kv_heads=4, mlp=768, layers=4, max_seq=256)
BATCH, SEQ = 8, 128
PLANS = ["dp=4", "dp=2 tp=2", "tp=4", "dp=2 pp=2 mb=4", "dp=4 zero=3", "pp=4 mb=4", "dp=2 cp=2"]
WARMUP, STEPS = 2, 4


def _tiny_llama():
    return TinyLlama(MODEL), token_batch(MODEL.vocab, BATCH, SEQ)


def _hf_llama():
    """Hugging Face's LlamaForCausalLM at the validation model's shape, called as users call it: a
    collator's dict batch (input_ids, attention_mask, labels), the loss in ``output.loss``."""
    model = hf_llama_model(vocab_size=MODEL.vocab, hidden_size=MODEL.hidden, intermediate_size=MODEL.mlp,
                           num_hidden_layers=MODEL.layers, num_attention_heads=MODEL.heads,
                           num_key_value_heads=MODEL.kv_heads, max_position_embeddings=MODEL.max_seq)
    ids = token_batch(MODEL.vocab, BATCH, SEQ)[0]
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# --validate --model NAME: the model the plans are measured on (same widths: the profile's matmuls)
MODELS = {"tiny-llama": _tiny_llama, "hf-llama": _hf_llama}


def _call(step, batch):
    return step.step(batch) if isinstance(batch, dict) else step.step(*batch)


def _seconds(fn, repeat: int = 5) -> float:
    """Median wall clock of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sustained(fn, seconds: float = 0.25) -> float:
    """Mean wall clock of ``fn()`` called over and over for ``seconds``, every rank at once (right
    after a barrier): the rate a rank gets while all ranks compute, as in a training step. A median
    of a few short calls instead catches each process while it holds a core to itself, which with
    more processes than cores is not the rate a step sees."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# ------------------------------------------------------------------------- measured on every rank

def _collective_calls(comm, n: int, nbytes: int):
    """(kind, call) with the payload as collective_seconds counts it (what a rank hands over)."""
    whole = torch.ones(nbytes // 4)
    peer = (comm.rank + 1) % n, (comm.rank - 1) % n
    return [("all-reduce", lambda: comm.all_reduce(whole)),
            ("all-gather", lambda: comm.all_gather(whole, 0)),
            ("reduce-scatter", lambda: comm.reduce_scatter(whole, 0)),
            ("send/recv", lambda: comm.send_recv(whole, *peer))]


def _measure_collectives(comms: dict) -> list[tuple[str, int, int, float]]:
    rows = []
    for n, comm in comms.items():
        for nbytes in SIZES:
            for kind, call in _collective_calls(comm, n, nbytes):
                if kind == "send/recv" and n != 2:
                    continue
                comm.barrier()
                rows.append((kind, n, nbytes, _seconds(call)))
    return rows


def _matmul_flops(rows: int, width: int, dtype: torch.dtype, barrier, seconds: float = 0.25) -> float:
    """FLOP/s per rank of a [rows, width] @ [width, 3 * width] matmul (the validation model's QKV and
    MLP shapes), looped on every rank at once right after ``barrier()``."""
    a, b = torch.randn(rows, width, dtype=dtype), torch.randn(width, width * 3, dtype=dtype)
    barrier()
    return 2 * rows * width * width * 3 / _sustained(lambda: a @ b, seconds)


def _measure_matmuls(width: int, barrier) -> list[tuple[str, int, float]]:
    return [(str(dtype).split(".")[-1], rows, _matmul_flops(rows, width, dtype, barrier))
            for dtype in (torch.float32, torch.bfloat16) for rows in ROWS]


def _measure_memory(barrier) -> float:
    t = torch.ones(2**25)  # 128 MiB
    barrier()
    return 2 * t.numel() * 4 / _sustained(lambda: t.mul_(1.0), seconds=0.5)


# The meeting's measurement: the compute between two meetings written to the profile (about a layer's
# forward or backward on the validation model), two more printed as checks of the proportional
# reading below it and above it; a payload whose transfer is negligible (4 KiB), so the difference
# is the wait, not the bytes
SKEW_GAP, SKEW_CHECKS = 0.015, (0.006, 0.03)
PAYLOAD = 1024


def _loop_seconds(fn, barrier, calls: int = 16) -> float:
    """Mean seconds of one ``fn()`` over ``calls`` in a row, every rank at once (between barriers)."""
    barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    barrier()
    return (time.perf_counter() - start) / calls


def _measure_sync_skew(comms: dict, barrier, gaps=(SKEW_GAP, *SKEW_CHECKS), repeats: int = 5
                       ) -> list[tuple[int, float, float]]:
    """(group size, compute gap, seconds) a small blocking all-reduce adds beyond itself and the work
    before it when every rank computes the same work between meetings: a loop of work and meeting
    against a loop of each alone, alternated ``repeats`` times, the median difference. With more
    ranks than cores the OS runs ranks in turns, so they finish the same work up to a time slice
    apart, and a core may idle while the last of a group finishes."""
    a, b = torch.randn(256, MODEL.hidden), torch.randn(MODEL.hidden, 3 * MODEL.hidden)
    one = _sustained(lambda: a @ b)
    agreed = torch.tensor([one])
    comms[WORLD].all_reduce(agreed)  # every rank does the same work: the ranks' mean call time
    one = agreed.item() / WORLD
    small = torch.ones(PAYLOAD)
    rows = []
    for gap in gaps:
        times = max(1, round(gap / one))
        compute = lambda: [a @ b for _ in range(times)]  # noqa: E731,B023
        for n, comm in comms.items():
            meet = lambda: comm.all_reduce(small)  # noqa: E731,B023
            extra = []
            for _ in range(repeats):
                alone, meeting = _loop_seconds(compute, barrier), _loop_seconds(meet, barrier)
                extra.append(_loop_seconds(lambda: (compute(), meet()), barrier) - alone - meeting)  # noqa: B023
            rows.append((n, times * one, statistics.median(extra)))
    return rows


def measure_rank() -> dict:
    """Everything a rank measures (run under launch_local on WORLD processes)."""
    from usc.runtime.mesh import Mesh

    torch.set_num_threads(1)
    flat = Mesh.from_environment(("dp",), (WORLD,), timeout=300)
    pairs = Mesh.from_environment(("dp", "tp"), (WORLD // 2, 2), timeout=300)
    barrier = flat.comm("dp").barrier
    return {"collectives": _measure_collectives({WORLD: flat.comm("dp"), 2: pairs.comm("tp")}),
            "matmuls": _measure_matmuls(MODEL.hidden, barrier), "memory": _measure_memory(barrier),
            "skew": _measure_sync_skew({WORLD: flat.comm("dp"), 2: pairs.comm("tp")}, barrier), "load": load()}


def overhead_rank(layers: int) -> float:
    """Mean step of a Llama so narrow that its time is the executor's per-op cost, dp=WORLD."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    narrow = LlamaConfig(vocab=64, hidden=16, heads=2, kv_heads=2, mlp=32, layers=layers, max_seq=16)
    batch = token_batch(narrow.vocab, WORLD, 8)
    step = usc.compile(TinyLlama(narrow), f"dp={WORLD}", example_inputs=batch)
    for _ in range(WARMUP):
        step.step(*batch)
    return _seconds(lambda: step.step(*batch), repeat=16)  # the noisiest of the fits: more repeats


# ---------------------------------------------------------------------------------------- fits

def fit_link(rows: list) -> tuple[float, float]:
    """(bandwidth, latency) minimising the relative error of collective_seconds over the measurements."""
    a = []
    for kind, n, nbytes, seconds in rows:
        # collective_seconds is linear in 1/bandwidth and latency: its value at (1, 0) and (inf, 1)
        per_byte = collective_seconds(kind, nbytes, n, 1.0, 0.0, ring=True)
        per_step = collective_seconds(kind, nbytes, n, math.inf, 1.0, ring=True)
        a.append((per_byte / seconds, per_step / seconds))
    (inv_bw, latency), *_ = np.linalg.lstsq(np.array(a), np.ones(len(a)), rcond=None)
    return 1.0 / inv_bw, max(latency, 1e-7)


def kind_factors(rows: list, bandwidth: float, latency: float) -> dict[str, float]:
    """Per kind other than all-reduce: the geometric mean of measured / formula (gloo's all-gather
    and reduce-scatter are not its all-reduce's ring halves: measured 2-3x the formula)."""
    out = {}
    for kind in sorted({r[0] for r in rows} - {"all-reduce"}):
        ratios = [seconds / collective_seconds(k, nbytes, n, bandwidth, latency, ring=True)
                  for k, n, nbytes, seconds in rows if k == kind]
        out[kind] = math.exp(statistics.mean(map(math.log, ratios)))
    return out


def fit_matmul(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(peak, half_rows) of flops = peak * rows / (rows + half): linear in 1/flops = (1 + half/rows)/peak."""
    a = np.array([[1.0, 1.0 / r] for r, _ in points])
    y = np.array([1.0 / f for _, f in points])
    (c0, c1), *_ = np.linalg.lstsq(a, y, rcond=None)
    return 1.0 / c0, max(c1 / c0, 1.0)


def calibrate() -> dict:
    ranks = launch_local(measure_rank, WORLD)
    slowest = {}
    for r in ranks:  # a collective ends when its slowest rank does
        for kind, n, nbytes, seconds in r["collectives"]:
            slowest[(kind, n, nbytes)] = max(seconds, slowest.get((kind, n, nbytes), 0.0))
    collectives = [(*k, s) for k, s in slowest.items()]
    # the link from the all-reduces (gloo's ring); each other kind's factor over the formula
    bandwidth, latency = fit_link([c for c in collectives if c[0] == "all-reduce"])
    factors = kind_factors(collectives, bandwidth, latency)
    matmul = {d: fit_matmul([(rows, min(r2[2] for r in ranks for r2 in r["matmuls"] if r2[:2] == (d, rows)))
                             for rows in ROWS]) for d in ("float32", "bfloat16")}
    memory = min(r["memory"] for r in ranks)
    shallow, deep = (statistics.mean(launch_local(overhead_rank, WORLD, n)) for n in (1, 5))
    profile = {"name": "cpu-gloo-here", "peak_bf16_flops": matmul["bfloat16"][0], "peak_fp32_flops": matmul["float32"][0],
               "hbm_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // WORLD,
               "hbm_bandwidth": memory, "intra_node_bandwidth": bandwidth, "intra_node_latency": latency,
               "inter_node_bandwidth": bandwidth, "inter_node_latency": latency, "gpus_per_node": WORLD,
               "matmul_efficiency": 1.0, "matmul_half_rows": matmul["float32"][1], "comm_efficiency": 1.0,
               "unit_overhead": max(0.0, (deep - shallow) / 4), "latency_steps": "ring",
               # the ranks run their kernels on the host: the per-layer overhead adds to the compute
               "host_launch": "sync",
               # gloo's transfers run on the same cores as compute: with more ranks than cores
               # nothing is left to hide them behind (set by the machine, not fitted)
               "comm_overlap": 0.0 if WORLD >= _cores() else 1.0,
               # the cores the ranks share: a rank idle in a pipeline bubble gives its core to the
               # busy ones (no effect where every rank has a core of its own)
               "host_cores": _cores(),
               **{FACTOR_FIELDS[kind]: f for kind, f in factors.items()}}
    # (group size, gap, wait): rank 0's gaps (the ranks' differ by rounding), the ranks' mean wait
    skew = [(n, gap, max(0.0, statistics.mean(r["skew"][i][2] for r in ranks))) for i, (n, gap, _) in enumerate(ranks[0]["skew"])]
    if WORLD > _cores():  # ranks that own a core each meet without waiting for the OS
        profile["sync_skew_by_ranks"] = [(n, wait) for n, gap, wait in sorted(skew) if gap == skew[0][1]]
        profile["sync_skew_gap"] = skew[0][1]
    return {"profile": profile, "collectives": sorted(collectives), "load": [r["load"] for r in ranks][0],
            "matmul_fits": matmul, "overhead_steps": (shallow, deep), "skew": skew}


def _cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def write_toml(profile: dict, path: str, comment: str) -> None:
    lines = [f"# {line}" for line in comment.splitlines()]
    for key, value in profile.items():
        if isinstance(value, (list, tuple)):  # a table of pairs: [[nodes or ranks per node, value], ...]
            lines.append(f"{key} = [{', '.join(f'[{int(n)}, {float(b):.6g}]' for n, b in value)}]")
        else:
            lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}"
                         if isinstance(value, int) else f"{key} = {float(value):.6g}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def print_fit(result: dict) -> None:
    p = result["profile"]
    print(f"load average during the measurement: {result['load']}")
    factors = ", ".join(f"{k} {v:.2f}" for k, v in p.items() if k.endswith("_factor"))
    print(f"link (all-reduce): {p['intra_node_bandwidth'] / 1e9:.3f} GB/s, "
          f"{p['intra_node_latency'] * 1e6:.1f} us per ring step; factors over the formula: {factors}")
    print("| collective | ranks | payload | measured | formula with the fit |")
    print("|---|---|---|---|---|")
    for kind, n, nbytes, seconds in result["collectives"]:
        factor = p.get(FACTOR_FIELDS[kind], 1.0)
        model = factor * collective_seconds(kind, nbytes, n, p["intra_node_bandwidth"],
                                            p["intra_node_latency"], ring=True)
        print(f"| {kind} | {n} | {nbytes / 1024:.0f} KiB | {seconds * 1e3:.2f} ms | {model * 1e3:.2f} ms |")
    for dtype, (peak, half) in result["matmul_fits"].items():
        print(f"matmul {dtype}: peak {peak / 1e9:.2f} GFLOP/s per rank, half at {half:.0f} rows")
    print(f"memory: {p['hbm_bandwidth'] / 1e9:.2f} GB/s per rank; unit overhead {p['unit_overhead'] * 1e3:.2f} ms "
          f"(steps at 1 and 5 layers: {result['overhead_steps'][0] * 1e3:.1f}, {result['overhead_steps'][1] * 1e3:.1f} ms)")
    for n, gap, seconds in result["skew"]:
        print(f"meeting after {gap * 1e3:.1f} ms of compute, groups of {n}: {seconds * 1e3:.2f} ms waited")
    if p.get("sync_skew_by_ranks"):
        waits = ", ".join(f"{w * 1e3:.2f} ms over {n} ranks" for n, w in p["sync_skew_by_ranks"])
        print(f"sync skew: {waits} per blocking collective after {p['sync_skew_gap'] * 1e3:.1f} ms of compute "
              f"(written; less in proportion after less, the same after more)")


# ---------------------------------------------------------------------------------- validation

PROBE_ROWS = 1024  # the speed probe: one fp32 matmul of the validation model's width, all ranks at once


def _probe_flops() -> float:
    """FLOP/s per rank of the probe matmul, every rank looping it at once (as the calibration's)."""
    return _matmul_flops(PROBE_ROWS, MODEL.hidden, torch.float32, torch.distributed.barrier, seconds=0.5)


def step_rank(plan: str, model_name: str = "tiny-llama") -> tuple[float, str, float]:
    """(mean wall clock of step() after warm-up, load average at the time, the probe's FLOP/s
    around the steps: the machine's speed while this plan ran) on this rank."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = MODELS[model_name]()
    step = usc.compile(model, plan, example_inputs=batch)
    for _ in range(WARMUP):
        _call(step, batch)
    before = _probe_flops()
    start = time.perf_counter()
    for _ in range(STEPS):
        _call(step, batch)
    seconds = (time.perf_counter() - start) / STEPS
    return seconds, load(), (before + _probe_flops()) / 2


def validate(profile_path: str, model_name: str = "tiny-llama") -> list[dict]:
    """Each plan's prediction and measured step. The machine's matmul rate moves (this host's
    measured fp32 rate per rank swung between ~22 and ~44 GFLOP/s within minutes): the probe matmul,
    timed on every rank right before and after the measured steps, against the profile's own rate
    for it (the matmul fit at PROBE_ROWS) says how much faster or slower matmuls ran than when the
    profile was measured; the last columns predict with the profile's matmul peaks scaled by that
    (the other rates as measured). Nothing of the plan's own step enters the prediction."""
    hw = hardware_profile(profile_path)
    calibrated = hw.matmul_rate(PROBE_ROWS, "fp32")
    model, batch = MODELS[model_name]()
    rows = []
    for plan in PLANS:
        predicted = usc.lint(model, plan, example_inputs=batch, hardware=hw).cost.time["step"]
        ranks = launch_local(step_rank, WORLD, plan, model_name)
        measured = max(s for s, _, _ in ranks)
        speed = statistics.mean(p for _, _, p in ranks) / calibrated
        now = replace(hw, peak_fp32_flops=hw.peak_fp32_flops * speed,
                      peak_bf16_flops=hw.peak_bf16_flops * speed)
        at_speed = usc.lint(model, plan, example_inputs=batch, hardware=now).cost.time["step"]
        rows.append({"plan": plan, "predicted": predicted, "measured": measured, "load": ranks[0][1],
                     "speed": speed, "at_speed": at_speed})
        print(f"| `{plan}` | {predicted * 1e3:.0f} | {measured * 1e3:.0f} | {predicted / measured - 1:+.0%} | "
              f"{ranks[0][1]} | {speed:.2f} | {at_speed * 1e3:.0f} | {at_speed / measured - 1:+.0%} |",
              flush=True)
    return rows


def ranking_agrees(rows: list[dict]) -> bool:
    by = lambda key: [r["plan"] for r in sorted(rows, key=lambda r: r[key])]  # noqa: E731
    print("predicted ranking:", " < ".join(by("predicted")))
    print("measured ranking: ", " < ".join(by("measured")))
    return by("predicted") == by("measured")


# ---------------------------------------------------------------------- published measurements

# Model shapes of the publications (Llama 3 family, from the model cards' configs). "llama-1B" of the
# nanotron benchmarks is taken as Llama-3.2-1B's shape: its FLOPs per token (6N + 12*L*h*S, 9.0 GFLOP)
# equal the logs' model_tflops_per_gpu / tokens_per_sec_per_gpu (251e12 / 27,700 = 9.06 GFLOP).
SHAPES = {
    "1B": (TinyLlama, LlamaConfig(vocab=128256, hidden=2048, heads=32, kv_heads=8, mlp=8192, layers=16, max_seq=8192)),
    "3B": (TinyLlama, LlamaConfig(vocab=128256, hidden=3072, heads=24, kv_heads=8, mlp=8192, layers=28, max_seq=8192)),
    "8B": (TinyLlama, LlamaConfig(vocab=128256, hidden=4096, heads=32, kv_heads=8, mlp=14336, layers=32,
                                  max_seq=8192)),
    "70B": (TinyLlama, LlamaConfig(vocab=128256, hidden=8192, heads=64, kv_heads=8, mlp=28672, layers=80,
                                   max_seq=8192)),
    "2-70B": (TinyLlama, LlamaConfig(vocab=32000, hidden=8192, heads=64, kv_heads=8, mlp=28672, layers=80,
                                     max_seq=4096)),  # Llama 2 70B
    "405B": (TinyLlama, LlamaConfig(vocab=128256, hidden=16384, heads=128, kv_heads=8, mlp=53248, layers=126,
                                    max_seq=8192)),
    # "llama-1B" of nanotron's benchmark runs (old_bench, bench_cluster): the model their config
    # generator writes (github.com/huggingface/bench_cluster, bench_cluster/create_configs.py:
    # HuggingFaceFW/ablation-model-fineweb-v1 -- 24 layers, hidden 2048, MLP 4096, 32 heads without
    # GQA, GPT-2's 50,257-token vocabulary, the lm head tied to the embedding) under its base config's
    # ZeRO-1 and tp_mode REDUCE_SCATTER (sp). nanotron's trainer pads the vocabulary to a multiple of
    # tp (`_vocab_size_with_padding`): 50,264 at tp=8, taken for every row (50,258-50,260 at tp=2-4,
    # 0.01% of the head's work). Its FLOPs per token (9.07 GFLOP as usc counts them) match those logs
    # as Llama-3.2-1B's (9.03) do; the runs' own generator names the model. The head is untied here:
    # 0.1B parameters more held and updated, about 9% of the state.
    "nanotron-1B": (TinyLlama, LlamaConfig(vocab=50264, hidden=2048, heads=32, kv_heads=32, mlp=4096, layers=24,
                                           max_seq=4096)),
    # GPT-3-style 530B of Korthikanti et al. 2022 (Table: 105 layers, hidden 20480, 128 heads, seq 2048)
    "530B": (TinyGPT2, GPT2Config(vocab=51200, hidden=20480, heads=128, layers=105, max_seq=2048)),
}
NANOTRON = "huggingface.co/nanotron/old_bench llama-1B/8_GPUS/{} log_metrics.csv, iterations 8-12"
TITAN = "pytorch/torchtitan docs/performance.md"
# (model, hardware, plan as the cost model reads it, global batch, seq, published tokens/s/GPU,
#  published MFU, source, whether the publication gives the whole setup)
PUBLISHED = [
    # nanotron's runs written in its mesh order, (pp, dp, tp) outermost first (nanotron/parallel/context.py):
    # usc lays its groups out the same way, so tp stays inside a node and pp crosses them
    ("nanotron-1B", "h100", "dp=2 tp=4 sp=on zero=1 mb=64 dtype=bf16", 1024, 4096, 27_700, 0.254,
     NANOTRON.format("dp-2_tp-4_pp-1_mbz-8"), True),
    ("nanotron-1B", "h100", "pp=2 tp=4 sp=on mb=128 dtype=bf16", 1024, 4096, 25_900, 0.238,
     NANOTRON.format("dp-1_tp-4_pp-2_mbz-8"), True),
    ("nanotron-1B", "h100", "pp=2 dp=2 tp=2 sp=on zero=1 mb=510 dtype=bf16", 1020, 4096, 11_200, 0.103,
     NANOTRON.format("dp-2_tp-2_pp-2_mbz-1"), True),
    ("nanotron-1B", "h100", "pp=8 tp=8 sp=on mb=64 dtype=bf16", 1024, 4096, 3_470, 0.032,
     "huggingface.co/nanotron/bench_cluster llama-1B/64_GPUS/dp-1_tp-8_pp-8_mbz-16", True),
    ("8B", "h100", "dp=8 zero=3 recompute=selective dtype=bf16", 16, 8192, 5_762, None,
     TITAN + " (Llama 3.1 8B, 8 H100 96GB 500W, FSDP, local batch 2)", False),
    ("8B", "a100", "dp=64 zero=3 recompute=selective dtype=bf16", 64, 8192, 2_973, 0.582,
     TITAN + " (Llama 3 8B, 64 A100, FSDP2, local batch 1)", False),
    ("70B", "a100", "dp=64 zero=3 recompute=full dtype=bf16", 64, 8192, 331, 0.517,
     TITAN + " (Llama 3 70B, 64 A100, FSDP2, full AC)", False),
    # NVIDIA's DGX Cloud benchmarking recipes (NGC catalog), MaxText (JAX) on H100 in bf16, FSDP over every
    # GPU (16 nodes x 8: dcn_fsdp=16, ici_fsdp=8), the last step's log line; the remat policy is not given
    # (read as full recompute, the one that fits 80 GB in usc's memory model)
    ("70B", "h100", "dp=128 zero=3 recompute=full dtype=bf16", 256, 8192, 1_052, 0.512,
     "NVIDIA DGXC Benchmarking, MaxText Llama3 70B 25.02: 128 H100, per-device batch 2, 15.570 s/step, "
     "506.6 TFLOP/s/device", False),
    ("2-70B", "h100", "dp=64 zero=3 recompute=full dtype=bf16", 128, 4096, 1_036, 0.466,
     "NVIDIA DGXC Benchmarking, MaxText Llama2 70B 25.01.1: 64 H100, 7.908 s/step, 460.5 TFLOP/s/device "
     "(layout not shown: read as FSDP over all 64)", False),
    ("405B", "h100", "dp=16 tp=8 sp=on zero=3 recompute=full mb=2 dtype=bf16", 32, 8192, 109, 0.29,
     TITAN + " (Llama 3.1 405B, 128 H100, FSDP2+TP, local batch 2)", False),
    ("405B", "h100", "dp=64 pp=16 tp=8 sp=on zero=1 mb=32 schedule=interleaved v=2 dtype=bf16", 2048, 8192,
     None, 0.43, "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 (8,192 GPUs)", False),
    # 2240 A100: tp=8 pp=35 dp=8, global batch 2240, microbatch 1 (the paper's table, as recalled: the
    # abstract's MFUs are verified, the parallel layout is not)
    ("530B", "a100", "dp=8 pp=35 tp=8 sp=on mb=280 recompute=selective dtype=bf16", 2240, 2048, None, 0.542,
     "Korthikanti et al. 2022 (arXiv 2205.05198), sp + selective recompute", False),
    ("530B", "a100", "dp=8 pp=35 tp=8 mb=280 recompute=full dtype=bf16", 2240, 2048, None, 0.421,
     "Korthikanti et al. 2022 (arXiv 2205.05198), full recompute", False),
]


def model_profile(name: str, profiles: dict = {}):  # noqa: B006 - a cache
    """The cost model's profile of the shape ``name`` (SHAPES), built on the meta device once per process."""
    from usc.passes.cost_profile import profile_model

    if name not in profiles:
        make, config = SHAPES[name]
        with torch.device("meta"):
            model = make(config)
        tokens = torch.zeros(8, min(4096, config.max_seq), dtype=torch.long, device="meta")
        profiles[name] = profile_model(model, (tokens, tokens))
    return profiles[name]


def estimate_shape(name: str, plan: str, global_batch: int, seq: int, hw):
    """The cost model's estimate of ``plan`` for the shape ``name`` (SHAPES) on the profile ``hw``."""
    from usc.compiler.cost_model import estimate
    from usc.dsl import parse_plan
    from usc.planning import point_of

    point = point_of(parse_plan(plan), global_batch=global_batch, seq=seq)
    return estimate(model_profile(name), replace(point, gpus_per_node=hw.gpus_per_node), hw)


def published_rows(runs: list = PUBLISHED) -> list[dict]:
    """Each publication's configuration estimated by the cost model, beside what was measured."""
    rows = []
    for name, hw_name, plan, batch, seq, tps, mfu, source, complete in runs:
        hw = hardware_profile(hw_name)
        est = estimate_shape(name, plan, batch, seq, hw)
        point = est.plan
        per_gpu = est.tokens_per_second / point.world
        # the publication's own FLOPs per token where it gives tokens/s and MFU; else usc's count
        mfu_same_count = mfu * per_gpu / tps if (tps and mfu) else est.mfu
        rows.append(dict(model=name, hw=hw_name, plan=plan, gpus=point.world, published_tps=tps, published_mfu=mfu,
                         predicted_tps=per_gpu, predicted_mfu=mfu_same_count, memory=est.memory_total,
                         source=source, complete=complete))
    return rows


def print_published(rows: list[dict]) -> None:
    print("| model | GPUs | plan | tokens/s/GPU published | predicted | MFU published | predicted | "
          "memory/rank (GiB) | setup complete | source |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tps = f"{r['published_tps']:,}" if r["published_tps"] else "not given"
        mfu = f"{r['published_mfu']:.1%}" if r["published_mfu"] else "not given"
        print(f"| {r['model']} ({r['hw']}) | {r['gpus']} | `{r['plan']}` | {tps} | {r['predicted_tps']:,.0f} | {mfu} | "
              f"{r['predicted_mfu']:.1%} | {r['memory'] / 2**30:.1f} | {'yes' if r['complete'] else 'partly'} | "
              f"{r['source']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="measure and write the profile here (.toml)")
    parser.add_argument("--profile", help="an existing profile to validate")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-llama",
                        help="the model --validate measures (hf-llama: transformers' LlamaForCausalLM, "
                             "same shape)")
    parser.add_argument("--published", action="store_true", help="only the published-vs-predicted table")
    args = parser.parse_args()
    if args.published:
        return print_published(published_rows())
    path = args.out or args.profile
    if not path:
        parser.error("give --out (measure) or --profile (validate an existing one)")
    if args.out:
        result = calibrate()
        print_fit(result)
        write_toml(result["profile"], args.out, f"measured by benchmarks/calibrate.py on {time.strftime('%Y-%m-%d %H:%M')}"
                   f" UTC, {WORLD} gloo processes, load average {result['load']}")
        print(f"wrote {args.out}")
    if args.validate:
        print("\n| plan | predicted (ms) | measured (ms) | error | load (1/5/15 min) "
              "| matmul rate vs calibration | predicted at that rate (ms) | error |"
              "\n|---|---|---|---|---|---|---|---|")
        rows = validate(path, args.model)
        within = lambda key: sum(abs(r[key] / r["measured"] - 1) <= 0.25 for r in rows)  # noqa: E731
        print(f"within 25%: {within('predicted')} of {len(rows)}; at the matmul rate while each ran: "
              f"{within('at_speed')} of {len(rows)}")
        print("ranking agrees" if ranking_agrees(rows) else "ranking differs")


if __name__ == "__main__":
    sys.exit(main())
