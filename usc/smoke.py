"""GPU smoke check: ``python -m usc.smoke`` on a machine with CUDA GPUs prints one table.

1. Simulated meshes on CUDA tensors: every rank a thread of this process, all on cuda:0, for dp,
   tp, sp, cp (ring, zig-zag, Ulysses), pp, ep and ZeRO-3, against one device.
2. The fused Triton kernels (``fuse=on``) against eager, in float32 and bfloat16.
3. An NCCL world over every visible GPU (one process per GPU, ``launch_local``) with the same
   parallelisms sized to the GPU count, against one device.

Each row trains a few SGD steps (SGD: a uniform gradient scale would show in the loss) from the
same weights and reports the largest relative loss difference to one device. Without a GPU it
says so and exits 0: the fake-device tier (tests/runtime/test_fake_cuda.py) is what runs on a
CPU-only machine.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

STEPS = 3
# float32 plans reorder sums (tp, cp, pp), so a few ulps per step; bf16 rounds at 2^-8
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


@dataclass
class Row:
    check: str
    plan: str
    world: str
    result: str
    diff: float | None
    seconds: float


def _model(kind: str):
    from usc.testing.models import MoEConfig, TinyLlama, TinyMixtral, token_batch

    torch.manual_seed(0)
    if kind == "moe":
        return TinyMixtral(MoEConfig()), token_batch(MoEConfig().vocab, 8, 16)
    return TinyLlama(), token_batch(128, 8, 16)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _simulated_losses(plan: str, kind: str, device: str) -> list[float]:
    import usc

    model, batch = _model(kind)
    sim = usc.simulate(model, plan, example_inputs=batch, optimizer=_sgd, device=device)
    return [sim.step(*batch) for _ in range(STEPS)]


def _compare(check: str, plan: str, kind: str, world: str, run, reference: list[float], tol: float) -> Row:
    start = time.perf_counter()
    try:
        losses = run()
    except Exception as exc:  # noqa: BLE001 - a smoke table reports every failure and goes on
        return Row(check, plan, world, f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:80]}",
                   None, time.perf_counter() - start)
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))
    return Row(check, plan, world, "equal" if diff <= tol else "DIFFERS", diff, time.perf_counter() - start)


SIMULATED = [("dp=2", "dense"), ("tp=2", "dense"), ("dp=2 tp=2 sp=on", "dense"), ("cp=2", "dense"),
             ("cp=2 cp_mode=zigzag", "dense"), ("cp=2 cp_mode=ulysses", "dense"), ("pp=2 mb=2", "dense"),
             ("pp=2 mb=4 schedule=zb", "dense"), ("dp=2 zero=3", "dense"), ("dp=2 ep=2", "moe")]
FUSED = [("fuse=on", "fp32"), ("fuse=on dtype=bf16", "bf16")]


def nccl_plans(gpus: int) -> list[tuple[str, str]]:
    """The NCCL world's plans for `gpus` processes (each needs exactly that many ranks)."""
    half = f"dp={gpus // 2} " if gpus % 2 == 0 and gpus > 2 else ""
    plans = [(f"dp={gpus}", "dense"), (f"dp={gpus} zero=3", "dense")]
    if gpus % 2 == 0:  # ep carves from dp; tp, cp and pp of 2 leave dp = gpus / 2
        plans += [(f"dp={gpus} ep=2", "moe"), (f"{half}tp=2", "dense"), (f"{half}tp=2 sp=on", "dense"), (f"{half}cp=2", "dense"),
                  (f"{half}cp=2 cp_mode=zigzag", "dense"), (f"{half}pp=2 mb=2", "dense")]
    return plans


def _nccl_worker(plan: str, kind: str) -> list[float]:
    """One process of the NCCL world (module level: started with spawn)."""
    import usc

    model, batch = _model(kind)
    step = usc.compile(model, plan, example_inputs=batch, optimizer=_sgd)  # cuda:LOCAL_RANK, NCCL
    return [step.step(*batch) for _ in range(STEPS)]


def run(out=sys.stdout) -> int:
    if not torch.cuda.is_available():
        print("usc.smoke: no CUDA device is visible; nothing to check here (on a CPU-only machine the "
              "fake-device tier runs: pytest tests/runtime/test_fake_cuda.py)", file=out)
        return 0
    from usc.runtime.launch import launch_local

    gpus = torch.cuda.device_count()
    rows = []
    reference = {kind: _simulated_losses("dp=1", kind, "cuda") for kind in ("dense", "moe")}
    for plan, kind in SIMULATED:
        rows.append(_compare("simulated on cuda", plan, kind, "threads", lambda: _simulated_losses(plan, kind, "cuda"),
                             reference[kind], TOLERANCE["fp32"]))
    for plan, precision in FUSED:
        eager = _simulated_losses(plan.replace("fuse=on", "fuse=off"), "dense", "cuda")
        rows.append(_compare(f"triton vs eager {precision}", plan, "dense", "1 GPU",
                             lambda: _simulated_losses(plan, "dense", "cuda"), eager, TOLERANCE[precision]))
    if gpus < 2:
        rows.append(Row("nccl world", "-", "1 GPU", "skipped: needs 2 or more GPUs", None, 0.0))
    for plan, kind in nccl_plans(gpus) if gpus >= 2 else []:
        rows.append(_compare("nccl world", plan, kind, f"{gpus} GPUs",
                             lambda: launch_local(_nccl_worker, gpus, plan, kind)[0], reference[kind],
                             TOLERANCE["fp32"]))
    _print_table(rows, torch.cuda.get_device_name(0), out)
    return 0 if all(r.result in ("equal",) or r.result.startswith("skipped") for r in rows) else 1


def _print_table(rows: list[Row], device: str, out) -> None:
    print(f"usc.smoke on {torch.cuda.device_count()} x {device}, torch {torch.__version__}, "
          f"{STEPS} SGD steps each, max relative loss difference to one device", file=out)
    header = ("check", "plan", "world", "result", "max rel diff", "seconds")
    table = [header] + [(r.check, r.plan, r.world, r.result, "-" if r.diff is None else f"{r.diff:.2e}",
                         f"{r.seconds:.1f}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)), file=out)


if __name__ == "__main__":
    raise SystemExit(run())
