"""One GPU, measured with CUDA events, beside what the cost model predicts for it.

    python benchmarks/gpu_step.py [--out DIR] [--model 1B] [--steps 5]
    python benchmarks/gpu_step.py --report benchmarks/data/gpu_step_h200.json   # a saved run's table

1. **Matrix products**: the bf16 products of one decoder layer of the model's shape (q, k, v, o,
   gate, up, down and the lm head) at 256-16,384 rows, forward only, each the median of 20 timed
   calls: achieved FLOP/s over the profile's peak, beside the profile's ``matmul_rate`` (efficiency
   times rows / (rows + matmul_half_rows)), and the (efficiency, half_rows) that fit the measured
   curve best.
2. **Attention**: ``scaled_dot_product_attention`` (causal, bf16, the model's heads) at sequence
   4,096, forward and backward, counted as 4 * s^2 * d * heads / 2 FLOPs forward and 2.5 times that
   backward.
3. **The host's time per layer**: ``usc.compile`` steps of a Llama too narrow for the device to
   matter (hidden 64) at 2 and 10 layers, ``dp=1 mb=4``: their difference per layer per microbatch is
   usc's own ``unit_overhead`` on this host (the h100 profile holds nanotron's, fitted on the sweep).
4. **Training steps** of the model (``usc.testing.models.TinyLlama`` at ``calibrate.SHAPES``), one
   global batch of ``4 x 4096`` tokens, AdamW, bf16 compute with float32 weights:
   - eager PyTorch as a user writes it (``torch.autocast``; gradient accumulation over the
     microbatches), the reference;
   - ``usc.compile(model, "dp=1 mb=M dtype=bf16")`` on the same GPU;
   each the median of ``--steps`` steps after two warm-up steps (CUDA events around each step),
   with ``torch.cuda.max_memory_allocated`` over the timed steps; beside the cost model's step time
   and memory for the same plan (``cost_model.estimate`` on the hardware profile of this GPU).

Nothing here is fitted: the table shows the model's assumptions against a measurement that does not
read them. Writes ``gpu_step.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from calibrate import SHAPES, estimate_shape  # noqa: E402

from usc.compiler.hardware import hardware_profile  # noqa: E402
from usc.dsl import parse_plan  # noqa: E402

SEQ = 4096
ROWS = [256, 512, 1024, 2048, 4096, 8192, 16384]
PLANS = [("dp=1 mb=4 dtype=bf16", 4), ("dp=1 mb=2 dtype=bf16", 4)]  # (plan, global batch in sequences)


def this_gpu_profile():
    """The built-in profile of this GPU: h100's for an H100; an H200 is an H100's compute with
    HBM3e (datasheet: 141 GB at 4.8 TB/s)."""
    name = torch.cuda.get_device_name(0)
    hw = hardware_profile("a100" if "A100" in name else "h100")
    if "H200" in name:
        hw = replace(hw, name="h200", hbm_bytes=141e9, hbm_bandwidth=4.8e12)
    return hw


def _median_ms(fn, repeat: int = 20, warmup: int = 3, before_timing=None) -> float:
    """Median milliseconds of ``fn()`` between two CUDA events, after ``warmup`` calls (then
    ``before_timing()``, if given)."""
    for _ in range(warmup):
        fn()
    if before_timing is not None:
        torch.cuda.synchronize()
        before_timing()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer_products(config) -> list[tuple[str, int, int, int]]:
    """(name, in, out, calls per layer) of one decoder layer, plus the lm head (once per model)."""
    head_dim = config.hidden // config.heads
    kv = config.kv_heads * head_dim
    return [("q", config.hidden, config.hidden, 1), ("k", config.hidden, kv, 1), ("v", config.hidden, kv, 1),
            ("o", config.hidden, config.hidden, 1), ("gate", config.hidden, config.mlp, 1),
            ("up", config.hidden, config.mlp, 1), ("down", config.mlp, config.hidden, 1),
            ("lm_head", config.hidden, config.vocab, 0)]


def measure_matmuls(config, hw) -> list[dict]:
    out = []
    peak = hw.peak_flops("bf16")
    for rows in ROWS:
        flops = seconds = 0.0
        per_op = {}
        for name, k, n, per_layer in layer_products(config):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            ms = _median_ms(lambda: F.linear(x, w))
            f = 2.0 * rows * k * n
            per_op[name] = f / (ms / 1e3) / peak
            weight = per_layer * config.layers or 1  # a layer's products once per layer, the head once
            flops += weight * f
            seconds += weight * ms / 1e3
        out.append(dict(rows=rows, measured=flops / seconds / peak, predicted=profile_rate(config, hw, rows) / peak,
                        per_op=per_op))
    return out


def profile_rate(config, hw, rows: int) -> float:
    """The profile's FLOP/s over the same products, weighted as measure_matmuls weighs them."""
    flops = seconds = 0.0
    for _, k, n, per_layer in layer_products(config):
        weight = per_layer * config.layers or 1
        flops += weight * 2.0 * rows * k * n
        seconds += weight * hw.matmul_seconds(2.0 * rows * k * n, 1, rows, "bf16")
    return flops / seconds


def fit_call_rate(points: list[dict], config) -> tuple[float, float]:
    """(efficiency, half_work) of each product's rate = eff * W / (W + half), W its multiply-adds,
    closest in log error over every product and row count measured (``per_op``)."""
    sizes = {name: k * n for name, k, n, _ in layer_products(config)}
    samples = [(p["rows"] * sizes[name], e) for p in points for name, e in p["per_op"].items()]
    return _fit_saturating(samples, (10 ** (7 + 5 * i / 400) for i in range(401)))  # 1e7..1e12, log-spaced


def fit_rate(points: list[dict]) -> tuple[float, float]:
    """(efficiency, half_rows) of rate = eff * rows / (rows + half) closest in log error."""
    return _fit_saturating([(p["rows"], p["measured"]) for p in points],
                           range(0, 2049, 8))


def _fit_saturating(samples: list[tuple[float, float]], halves) -> tuple[float, float]:
    """(eff, half) of e = eff * x / (x + half) closest in log error to the (x, e) samples, half from
    ``halves``: for a given half the best eff is the geometric mean of e / (x / (x + half))."""
    best = (math.inf, (0.0, 0.0))
    for half in halves:
        logs = [math.log(e * (x + half) / x) for x, e in samples]
        eff = math.exp(sum(logs) / len(logs))
        err = sum((math.log(eff * x / (x + half)) - math.log(e)) ** 2 for x, e in samples)
        best = min(best, (err, (eff, half)))
    return best[1]


def sdpa_backends(config) -> dict:
    """The backend ``scaled_dot_product_attention`` picks for the model's q, k, v (laid out as the
    model makes them: heads transposed out of (b, s, h, d)) at 1 and 2 sequences."""
    head_dim = config.hidden // config.heads
    out = {}
    for b in (1, 2):
        q, k, v = (torch.randn(b, SEQ, config.heads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True).transpose(1, 2) for _ in range(3))
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
        out[f"batch {b}"] = str(torch.nn.attention.SDPBackend(choice))
    return out


def measure_attention(config, hw) -> dict:
    head_dim = config.hidden // config.heads
    q, k, v = (torch.randn(1, config.heads, SEQ, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(1, config.heads, SEQ, head_dim, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 4.0 * SEQ * SEQ * head_dim * config.heads / 2
    fwd = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    both = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad))
    peak = hw.peak_flops("bf16")
    return dict(forward=fwd_flops / (fwd / 1e3) / peak, forward_backward=3.5 * fwd_flops / (both / 1e3) / peak,
                forward_ms=fwd, forward_backward_ms=both)


def _timed_steps(step_fn, steps: int) -> tuple[float, float]:
    """(median step seconds, peak bytes allocated over the timed steps) after two warm-up steps."""
    ms = _median_ms(step_fn, repeat=steps, warmup=2, before_timing=torch.cuda.reset_peak_memory_stats)
    return ms / 1e3, torch.cuda.max_memory_allocated()


def _model(name: str):
    make, config = SHAPES[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        return make(config)


def eager_step(name: str, global_batch: int, mb: int, steps: int) -> dict:
    model = _model(name)
    config = SHAPES[name][1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, config.vocab, (global_batch, SEQ), device="cuda")

    def step():
        for chunk in tokens.chunk(mb):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(chunk, chunk) / mb
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, peak = _timed_steps(step, steps)
    # where the peak is: after one microbatch's forward (activations held) and after its backward
    torch.cuda.reset_peak_memory_stats()
    chunk = tokens.chunk(mb)[0]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(chunk, chunk)
    forward_peak = torch.cuda.max_memory_allocated()
    loss.backward()
    backward_peak = torch.cuda.max_memory_allocated()
    opt.zero_grad(set_to_none=True)
    del model, opt, loss
    torch.cuda.empty_cache()
    return dict(seconds=seconds, peak_bytes=peak, forward_peak_bytes=forward_peak, backward_peak_bytes=backward_peak)


def usc_step(name: str, plan: str, global_batch: int, steps: int) -> dict:
    import usc

    config = SHAPES[name][1]
    model = _model(name)
    tokens = torch.randint(0, config.vocab, (global_batch, SEQ), device="cuda")
    start = time.perf_counter()
    compiled = usc.compile(model, plan, example_inputs=(tokens, tokens), device="cuda",
                           optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5))
    del model
    losses = []
    seconds, peak = _timed_steps(lambda: losses.append(compiled.step(tokens, tokens)), steps)
    compile_s = time.perf_counter() - start
    out = dict(seconds=seconds, peak_bytes=peak, first_loss=losses[0], last_loss=losses[-1],
               wall_with_compile=compile_s, metrics=str(getattr(compiled, "metrics", "")))
    del compiled
    torch.cuda.empty_cache()
    return out


HOST_PROBE_LAYERS = (2, 10)  # the narrow Llama's depths: their difference is the per-layer time


def measure_host_time(device: str = "cuda", steps: int = 5, microbatches: int = 4) -> dict:
    """usc's host time per layer per microbatch (the profile's ``unit_overhead``): steps of a Llama too
    narrow for the device to matter (hidden 64, 64 tokens a sequence) at 2 and 10 layers, ``dp=1
    mb=4``; the step time's growth per layer per microbatch is what issuing a layer's forward and
    backward costs the host (on a CPU, where the host runs the kernels, it is their time too)."""
    import usc
    from usc.testing.models import LlamaConfig, TinyLlama

    out = {}
    for layers in HOST_PROBE_LAYERS:
        torch.manual_seed(0)
        model = TinyLlama(LlamaConfig(layers=layers)).to(device)
        tokens = torch.randint(0, 128, (microbatches, 64), device=device)
        compiled = usc.compile(model, f"dp=1 mb={microbatches}", example_inputs=(tokens, tokens), device=device,
                               optimizer=lambda params: torch.optim.SGD(params, lr=1e-3))
        for _ in range(2):
            compiled.step(tokens, tokens)
        times = []
        for _ in range(steps):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            compiled.step(tokens, tokens)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[f"{layers} layers"] = statistics.median(times)
    few, many = HOST_PROBE_LAYERS
    out["per layer per microbatch"] = (out[f"{many} layers"] - out[f"{few} layers"]) / ((many - few) * microbatches)
    return out


def predicted(name: str, plan: str, global_batch: int, hw) -> dict:
    est = estimate_shape(name, plan, global_batch, SEQ, hw)
    return dict(seconds=est.time["step"], time=est.time, memory_bytes=sum(est.memory.values()),
                memory=est.memory, mfu=est.mfu, model_flops=est.model_flops)


def _run(part: str, fn, results: dict) -> None:
    start = time.perf_counter()
    try:
        results[part] = fn()
    except Exception as exc:  # noqa: BLE001 - each part reports and the next runs
        results[part] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        print(f"{part}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"[{part}: {time.perf_counter() - start:.1f} s]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--model", default="1B", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--report", metavar="JSON", help="print the table of a saved run (no GPU needed)")
    args = parser.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return 0
    if not torch.cuda.is_available():
        print("gpu_step: no CUDA device is visible; nothing to measure")
        return 0
    hw = this_gpu_profile()
    config = SHAPES[args.model][1]
    results: dict = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, profile=hw.name,
                         model=args.model)
    _run("matmul", lambda: measure_matmuls(config, hw), results)
    _run("attention", lambda: measure_attention(config, hw), results)
    _run("sdpa backends", lambda: sdpa_backends(config), results)
    _run("host time", lambda: measure_host_time("cuda", args.steps), results)
    for plan, gbs in PLANS:
        mb = parse_plan(plan).get("mb")
        _run(f"predicted {plan}", lambda: predicted(args.model, plan, gbs, hw), results)
        _run(f"eager mb={mb}", lambda: eager_step(args.model, gbs, mb, args.steps), results)
        _run(f"usc {plan}", lambda: usc_step(args.model, plan, gbs, args.steps), results)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_step.json").write_text(json.dumps(results, indent=1, default=str))
    report(results)
    return 0


def report(results: dict) -> None:
    print(f"\n{results['device']}, torch {results['torch']}, profile {results['profile']}, model {results['model']}")
    if isinstance(results.get("matmul"), list):
        points = results["matmul"]
        eff, half = fit_rate(points)
        print("rows     measured/peak  profile's rate/peak")
        for p in points:
            print(f"{p['rows']:>6}   {p['measured']:.3f}          {p['predicted']:.3f}")
        print(f"fit: matmul_efficiency {eff:.3f}, matmul_half_rows {half}")
        if all("per_op" in p for p in points):
            eff, work = fit_call_rate(points, SHAPES[results["model"]][1])
            print(f"fit per product call: matmul_efficiency {eff:.3f}, matmul_half_work {work:.3g} multiply-adds")
    att = results.get("attention", {})
    if "forward" in att:
        print(f"attention s={SEQ}: forward {att['forward']:.3f} of peak ({att['forward_ms']:.2f} ms), "
              f"forward+backward {att['forward_backward']:.3f} ({att['forward_backward_ms']:.2f} ms); as the cost "
              f"model counts it (3x the forward's FLOPs): attention_efficiency {att['forward_backward'] * 3 / 3.5:.3f}")
    host = results.get("host time", {})
    if "per layer per microbatch" in host:
        print(f"usc's host time per layer per microbatch (unit_overhead): {host['per layer per microbatch'] * 1e3:.2f} ms "
              f"(the {results['profile']} profile holds {hardware_profile('h100').unit_overhead * 1e3:.1f} ms, nanotron's)")
    if "sdpa backends" in results:
        print(f"sdpa backend for the model's q, k, v: {results['sdpa backends']}")
    print("plan                    eager s  usc s   predicted s  usc/pred  eager GB  usc GB  predicted GB")
    for plan, _ in PLANS:
        mb = parse_plan(plan).get("mb")
        e, u, p = (results.get(k, {}) for k in (f"eager mb={mb}", f"usc {plan}", f"predicted {plan}"))

        def num(d, key, scale=1.0):
            return f"{d[key] / scale:.3f}" if key in d else "ERROR"

        ratio = f"{u['seconds'] / p['seconds']:.2f}" if "seconds" in u and "seconds" in p else "-"
        print(f"{plan:<22}  {num(e, 'seconds')}    {num(u, 'seconds')}  {num(p, 'seconds')}        {ratio}     "
              f"{num(e, 'peak_bytes', 1e9)}    {num(u, 'peak_bytes', 1e9)}   {num(p, 'memory_bytes', 1e9)}")


if __name__ == "__main__":
    raise SystemExit(main())
