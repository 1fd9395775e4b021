"""The planner's choice for one GPU, held against measurement on that GPU.

    python benchmarks/gpu_plans.py [--out DIR] [--shapes 1B:8,3B:4]
    python benchmarks/gpu_plans.py --report benchmarks/data/gpu_plans_h200.json   # a saved run's table
    python benchmarks/gpu_plans.py --dry        # the same logic on the CPU, a tiny shape (no GPU)

For each shape (``calibrate.SHAPES``) and global batch (sequences of 4,096 tokens):

1. ``usc.plan(model, "gpus=1 dtype=bf16", hardware=<this GPU's profile>)`` on a meta-device model:
   the plan the planner chooses, its predicted step time and memory.
2. That plan and its neighbours -- every microbatch count that divides the batch, fused and unfused,
   and selective recompute at the chosen microbatch count -- each compiled with ``usc.compile`` on
   the GPU and trained (AdamW, bf16 compute, float32 weights): the median of 3 steps after 2
   warm-ups between CUDA events, and ``torch.cuda.max_memory_allocated`` over the timed steps; a
   plan that runs out of memory says so. Beside each, ``cost_model.estimate`` for the same plan.
   The measured ranking is the check: the planner's choice should be the fastest plan that fits,
   or within the cost model's error of it.
3. Where the chosen plan's peak is: one step replayed from the CUDA allocator's history
   (``torch.cuda.memory._record_memory_history``), the tensors alive at the peak grouped by the
   line of usc or torch that allocated them.
4. ``scaled_dot_product_attention`` at the shape's head size (128 for the 3B shape), causal, bf16,
   forward and backward, as ``gpu_step.py`` measures heads of 64.

Nothing here is fitted. Writes ``gpu_plans.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from calibrate import SHAPES, estimate_shape  # noqa: E402
from gpu_step import SEQ, this_gpu_profile  # noqa: E402

WARMUP, STEPS = 2, 3


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-5)


class Where:
    """CUDA (the benchmark) or the CPU (``--dry``: a tiny shape, wall-clock times, no memory)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.seq = 64 if dry else SEQ

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return 0 if self.dry else torch.cuda.max_memory_allocated()

    def free(self) -> None:
        gc.collect()
        if not self.dry:
            torch.cuda.empty_cache()


def shape_config(name: str, where: Where):
    make, config = SHAPES[name]
    if where.dry:
        from dataclasses import replace
        config = replace(config, vocab=301, hidden=48, heads=4, kv_heads=2, mlp=112, layers=2, max_seq=128)
    return make, config


def chosen_plan(name: str, batch: int, hw, where: Where) -> dict:
    import usc

    make, config = shape_config(name, where)
    with torch.device("meta"):
        model = make(config)
    tokens = torch.zeros(batch, where.seq, dtype=torch.long, device="meta")
    plan = usc.plan(model, "gpus=1 gpus_per_node=1 dtype=bf16", example_inputs=(tokens, tokens), hardware=hw,
                    keep=8)
    return dict(plan=str(plan), search=str(plan.search))


def neighbours(chosen: str, batch: int) -> list[str]:
    """The chosen plan, every microbatch count dividing the batch (fused), the chosen count unfused and
    with selective recompute; each once, in that order."""
    from usc.dsl import parse_plan

    parsed = parse_plan(chosen)
    mb = int(parsed.get("mb"))
    plans = [chosen]
    plans += [f"dtype=bf16 fuse=on mb={m}" for m in (1, 2, 4, 8, 16) if batch % m == 0 and m <= batch]
    plans += [f"dtype=bf16 mb={mb}", f"dtype=bf16 fuse=on mb={mb} recompute=selective"]
    seen, out = set(), []
    for text in plans:
        key = _canonical(text)
        if key not in seen:
            seen.add(key)
            out.append(text)
    return out


def _canonical(text: str) -> tuple:
    from usc.dsl import parse_plan

    p = parse_plan(text)
    return tuple(str(p.get(k)) for k in ("mb", "fuse", "recompute", "dtype"))


def measure_plan(name: str, plan: str, batch: int, where: Where, *, breakdown: bool = False) -> dict:
    import usc

    make, config = shape_config(name, where)
    torch.manual_seed(0)
    with torch.device(where.device):
        model = make(config)
    tokens = torch.randint(0, config.vocab, (batch, where.seq), device=where.device)
    start = time.perf_counter()
    compiled = usc.compile(model, plan, example_inputs=(tokens, tokens), device=where.device,
                           optimizer=_optimizer)
    del model
    compile_s = time.perf_counter() - start
    losses, times = [], []
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            where.reset_peak()
        where.sync()
        t = time.perf_counter()
        losses.append(compiled.step(tokens, tokens))
        where.sync()
        times.append(time.perf_counter() - t)
    out = dict(seconds=statistics.median(times[WARMUP:]), peak_bytes=where.peak(), compile_seconds=compile_s,
               losses=losses)
    if breakdown and not where.dry:
        out["breakdown"] = peak_breakdown(lambda: compiled.step(tokens, tokens))
    del compiled
    return out


def peak_breakdown(step, top: int = 16) -> dict:
    """One ``step()`` recorded by the CUDA allocator: the bytes alive at its peak, those allocated
    before the step (weights, gradients, optimizer state) apart, the rest grouped by the innermost
    frame in usc (else torch, else any) that allocated them."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=500_000)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return replay(snap["device_traces"][torch.cuda.current_device()], before, top)


def _frame_key(frames: list[dict]) -> str:
    for marker in ("/usc/", "/torch/"):
        for f in frames:
            if marker in f.get("filename", ""):
                return f"{f['filename'].split(marker)[-1]}:{f.get('line')} {f.get('name')}"
    f = frames[0] if frames else {}
    return f"{f.get('filename', '?')}:{f.get('line')} {f.get('name')}"


def replay(trace: list[dict], before: int, top: int = 16) -> dict:
    """The allocation history's peak: live bytes after each alloc, and what was alive then."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
        if action == "alloc":
            live[addr] = (size, _frame_key(event.get("frames", [])))
            current += size
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action in ("free_completed",) and addr in live:
            current -= live.pop(addr)[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, key in at_peak.values():
        groups[key][0] += size
        groups[key][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return dict(before_step_bytes=before, step_peak_bytes=peak, events=len(trace),
                groups=[dict(where=k, bytes=b, count=n) for k, (b, n) in ranked[:top]],
                other_bytes=sum(b for _, (b, _) in ranked[top:]))


def measure_attention(name: str, where: Where) -> dict:
    from gpu_step import _median_ms

    _, config = shape_config(name, where)
    head_dim = config.hidden // config.heads
    q, k, v = (torch.randn(1, config.heads, SEQ, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    fwd_flops = 4.0 * SEQ * SEQ * head_dim * config.heads / 2
    fwd = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    both = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad))
    peak = this_gpu_profile().peak_flops("bf16")
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
    return dict(head_dim=head_dim, heads=config.heads, forward=fwd_flops / (fwd / 1e3) / peak,
                forward_backward=3.5 * fwd_flops / (both / 1e3) / peak, forward_ms=fwd, forward_backward_ms=both,
                backend=str(torch.nn.attention.SDPBackend(choice)))


def predicted(name: str, plan: str, batch: int, hw, where: Where) -> dict:
    est = estimate_shape(name, plan, batch, where.seq, hw)
    return dict(seconds=est.time["step"], memory_bytes=sum(est.memory.values()), memory=est.memory, mfu=est.mfu,
                model_flops=est.model_flops)


def _run(part: str, fn, results: dict, deadline: float) -> None:
    if time.perf_counter() > deadline:
        results[part] = dict(error="skipped: the run's time budget is spent")
        print(f"[{part}: skipped]", flush=True)
        return
    start = time.perf_counter()
    try:
        results[part] = fn()
    except torch.cuda.OutOfMemoryError as exc:
        results[part] = dict(error=f"OutOfMemoryError: {str(exc).splitlines()[0][:200]}")
        print(f"{part}: out of memory", flush=True)
    except Exception as exc:  # noqa: BLE001 - each part reports and the next runs
        results[part] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        print(f"{part}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    Where(dry=not torch.cuda.is_available()).free()
    print(f"[{part}: {time.perf_counter() - start:.1f} s]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default="1B:8,3B:4", help="SHAPE:SEQUENCES per step, comma separated")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds; parts after it are skipped")
    parser.add_argument("--dry", action="store_true", help="the CPU, a tiny shape: checks the logic, not the GPU")
    parser.add_argument("--report", metavar="JSON", help="print the table of a saved run (no GPU needed)")
    args = parser.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return 0
    if not args.dry and not torch.cuda.is_available():
        print("gpu_plans: no CUDA device is visible; nothing to measure (--dry runs the logic on the CPU)")
        return 0
    where = Where(args.dry)
    deadline = time.perf_counter() + args.budget
    hw = this_gpu_profile() if not args.dry else __import__("usc.compiler.hardware", fromlist=["x"]).hardware_profile("h100")
    results: dict = dict(device="cpu (dry)" if args.dry else torch.cuda.get_device_name(0), torch=torch.__version__,
                         profile=hw.name, seq=where.seq, shapes={})
    for item in args.shapes.split(","):
        name, batch = item.split(":")
        batch = int(batch)
        shape: dict = dict(batch=batch, plans={})
        results["shapes"][name] = shape
        _run(f"{name} planner", lambda: chosen_plan(name, batch, hw, where), shape, deadline)
        chosen = shape[f"{name} planner"].get("plan")
        if chosen is None:
            continue
        shape["chosen"] = chosen
        if not args.dry:
            _run(f"{name} attention", lambda: measure_attention(name, where), shape, deadline)
        broken_down = False  # the peak's breakdown: of the chosen plan, or the first after it that runs
        for plan in neighbours(chosen, batch):
            row = shape["plans"].setdefault(plan, {})
            _run("predicted", lambda: predicted(name, plan, batch, hw, where), row, deadline)
            _run("measured", lambda: measure_plan(name, plan, batch, where, breakdown=not broken_down), row, deadline)
            broken_down = broken_down or "seconds" in row["measured"]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_plans.json").write_text(json.dumps(results, indent=1, default=str))
    report(results)
    return 0


def report(results: dict) -> None:
    print(f"\n{results['device']}, torch {results['torch']}, profile {results['profile']}, sequence {results['seq']}")
    for name, shape in results["shapes"].items():
        print(f"\n{name}, {shape['batch']} sequences per step; planner's choice: {shape.get('chosen', '-')}")
        att = shape.get(f"{name} attention", {})
        if "forward" in att:
            print(f"attention heads {att['heads']} x {att['head_dim']}: forward {att['forward']:.3f} of peak, "
                  f"forward+backward {att['forward_backward']:.3f} ({att['backend']})")
        print("plan                                          pred s   meas s  meas/pred  pred GB  meas GB  pred MFU  meas MFU")
        for plan, row in shape["plans"].items():
            p, m = row.get("predicted", {}), row.get("measured", {})
            if "seconds" in m:
                ms, mg = f"{m['seconds']:.3f}", f"{m['peak_bytes'] / 1e9:.1f}"
                ratio = f"{m['seconds'] / p['seconds']:.2f}" if "seconds" in p else "-"
                mmfu = f"{p['mfu'] * p['seconds'] / m['seconds']:.3f}" if "seconds" in p else "-"
            else:
                ms, mg, ratio, mmfu = (m.get("error", "-")[:40], "-", "-", "-")
            ps = f"{p['seconds']:.3f}" if "seconds" in p else "-"
            pg = f"{p['memory_bytes'] / 1e9:.1f}" if "memory_bytes" in p else "-"
            pm = f"{p['mfu']:.3f}" if "mfu" in p else "-"
            print(f"{plan:<44}  {ps:>6}   {ms:>6}  {ratio:>9}  {pg:>7}  {mg:>7}  {pm:>8}  {mmfu:>8}")
        for plan, row in shape["plans"].items():
            b = row.get("measured", {}).get("breakdown")
            if b:
                print(f"\nat the peak of one step of {plan}: {b['before_step_bytes'] / 1e9:.1f} GB held before the "
                      f"step, {b['step_peak_bytes'] / 1e9:.1f} GB more at the peak:")
                for g in b["groups"]:
                    print(f"  {g['bytes'] / 1e9:7.2f} GB  {g['count']:>5}  {g['where']}")
                print(f"  {b['other_bytes'] / 1e9:7.2f} GB  other")


if __name__ == "__main__":
    raise SystemExit(main())
