"""GPU smoke check: ``python -m usc.smoke`` on a machine with CUDA GPUs prints one table.

1. Simulated meshes on CUDA tensors: every rank a thread of this process, all on cuda:0, for dp,
   tp, sp, cp (ring, zig-zag, Ulysses), pp, ep and ZeRO-3, against one device.
2. An NCCL world over every visible GPU (one process per GPU, ``launch_local``) with the same
   parallelisms sized to the GPU count, against one device. One GPU makes a world of one process
   (dp=1, with and without microbatches): the launch, NCCL's process group on ``cuda:LOCAL_RANK`` and the
   compiled step, without a collective that crosses devices.
3. The fused Triton kernels (``fuse=on``) against eager, in float32 and bfloat16 (last: their first
   use compiles and tunes them).

Each row trains a few SGD steps (SGD: a uniform gradient scale would show in the loss) from the
same weights and reports the largest relative loss difference to one device. Without a GPU it
says so and exits 0: the fake-device tier (tests/runtime/test_fake_cuda.py) is what runs on a
CPU-only machine. ``python -m usc.smoke --dry`` runs the same table on the CPU (CPU tensors, the
kernels under Triton's interpreter, a gloo world of ``--processes`` processes), so the table's
logic is tested without a GPU.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

STEPS = 3
SIMULATED_TIMEOUT = 60  # seconds a simulated row may wait in a collective
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
    # a hang fails its row in a minute rather than the default five: the table goes on
    sim = usc.simulate(model, f"{plan} timeout={SIMULATED_TIMEOUT}", example_inputs=batch, optimizer=_sgd,
                       device=device)
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
    if gpus == 1:  # ZeRO needs dp>1: microbatches instead
        return [("dp=1", "dense"), ("dp=1 mb=2", "dense")]
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


@dataclass(frozen=True)
class Where:
    """Where the smoke runs: on GPUs (CUDA tensors, compiled kernels, NCCL), or ``--dry`` on the CPU
    (the same checks on CPU tensors, kernels under Triton's interpreter, a gloo world)."""

    device: str
    world: str  # the multi-process check's name
    processes: int
    title: str


def gpu_setting() -> Where:
    gpus = torch.cuda.device_count()
    return Where("cuda", "nccl world", gpus, f"{gpus} x {torch.cuda.get_device_name(0)}")


def dry_setting(processes: int = 2) -> Where:
    return Where("cpu", "gloo world", processes, f"CPU (--dry: interpreted kernels, {processes} gloo processes)")


def check_rows(where: Where, *, simulated=SIMULATED, fused=FUSED, report=None) -> list[Row]:
    """Every row of the table: simulated meshes, the multi-process world, fused kernels vs eager
    (slowest last: their first use compiles and tunes the kernels). ``report(row)`` is called as
    each row finishes."""
    from usc.runtime.launch import launch_local

    rows = []

    def add(row: Row) -> None:
        rows.append(row)
        if report is not None:
            report(row)

    reference = {kind: _simulated_losses("dp=1", kind, where.device) for kind in {k for _, k in simulated} | {"dense"}}
    for plan, kind in simulated:
        add(_compare(f"simulated on {where.device}", plan, kind, "threads",
                     lambda: _simulated_losses(plan, kind, where.device), reference[kind], TOLERANCE["fp32"]))
    if where.processes < 1:
        add(Row(where.world, "-", "0 processes", "skipped: no device", None, 0.0))
    for plan, kind in nccl_plans(where.processes) if where.processes >= 1 else []:
        if kind not in reference:
            reference[kind] = _simulated_losses("dp=1", kind, where.device)
        add(_compare(where.world, plan, kind, f"{where.processes} processes",
                     lambda: launch_local(_nccl_worker, where.processes, plan, kind)[0], reference[kind],
                     TOLERANCE["fp32"]))
    for plan, precision in fused:
        eager = _simulated_losses(plan.replace("fuse=on", "fuse=off"), "dense", where.device)
        add(_compare(f"triton vs eager {precision}", plan, "dense", f"1 {where.device}",
                     lambda: _simulated_losses(plan, "dense", where.device), eager, TOLERANCE[precision]))
    return rows


def passed(rows: list[Row]) -> bool:
    return all(r.result == "equal" or r.result.startswith("skipped") for r in rows)


def run(out=sys.stdout, *, dry: bool = False, processes: int = 2) -> int:
    """The table; exit status 0 when every row is equal (or skipped). Without a GPU and without
    ``dry`` it says so and exits 0."""
    if not dry and not torch.cuda.is_available():
        print("usc.smoke: no CUDA device is visible; nothing to check here (on a CPU-only machine the "
              "fake-device tier runs: pytest tests/runtime/test_fake_cuda.py; python -m usc.smoke --dry "
              "runs this table on the CPU)", file=out)
        return 0
    where = dry_setting(processes) if dry else gpu_setting()
    print(f"usc.smoke on {where.title}: each row as it finishes, then the table", file=out, flush=True)
    rows = check_rows(where, report=lambda r: print(f"  {r.check} | {r.plan} | {r.result} | {r.diff} | "
                                                    f"{r.seconds:.1f} s", file=out, flush=True))
    _print_table(rows, where.title, out)
    return 0 if passed(rows) else 1


def _print_table(rows: list[Row], title: str, out) -> None:
    print(f"usc.smoke on {title}, torch {torch.__version__}, "
          f"{STEPS} SGD steps each, max relative loss difference to one device", file=out)
    header = ("check", "plan", "world", "result", "max rel diff", "seconds")
    table = [header] + [(r.check, r.plan, r.world, r.result, "-" if r.diff is None else f"{r.diff:.2e}",
                         f"{r.seconds:.1f}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)), file=out)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m usc.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="run the table on the CPU: simulated meshes on CPU "
                        "tensors, the kernels under Triton's interpreter, a gloo world instead of NCCL")
    parser.add_argument("--processes", type=int, default=2, help="--dry: processes of the gloo world (default 2)")
    args = parser.parse_args(argv)
    if args.dry:  # before triton is imported: the interpreter is chosen at import
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run(dry=args.dry, processes=args.processes)


if __name__ == "__main__":
    raise SystemExit(main())
