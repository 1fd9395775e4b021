"""Kernels per step and estimated memory traffic of the pointwise/norm part, eager vs fused (fuse=on).

Run by hand: ``python benchmarks/fusion_traffic.py``. Compiles (no execution: usc.lint on a model
on the meta device) a Llama-style model and reports, per kind of fused region and in total, the
kernels launched per training step (forward + backward) and the bytes moved to and from memory as
eager ATen ops and as the generated kernels (compiler/fusion_cost.py states the model).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import usc
from usc.compiler.fusion_cost import eager_traffic, fused_nodes, fused_traffic, Traffic
from usc.compiler.report import program_parts
from usc.testing.models import LlamaConfig, TinyLlama


def region_kind(module) -> str:
    ops = [str(n.target).split(".")[1] for n in module.fused_region.graph.nodes if n.op == "call_function"]
    if "mean" in ops:
        return "residual add + RMSNorm" if ops[0] == "add" else "RMSNorm"
    if "silu" in ops:
        return "SwiGLU silu(gate) * up"
    if ops == ["cross_entropy_loss"]:
        return "cross-entropy (per-row)"
    if ops == ["mul", "mul", "add"]:
        return "RoPE x*cos + rot(x)*sin"
    return "+".join(ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="fuse=on")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    cfg = LlamaConfig(vocab=32000, hidden=1024, heads=16, kv_heads=8, mlp=2816, layers=4, max_seq=args.seq)
    with torch.device("meta"):
        model = TinyLlama(cfg)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long)
    compiled = usc.compile(model, args.plan, example_inputs=(tokens, tokens))
    program = compiled.program
    kinds: dict[str, list[Traffic]] = defaultdict(lambda: [Traffic(), Traffic(), 0])
    for node, module in fused_nodes(program.gm, program_parts(program.gm)):
        row = kinds[region_kind(module)]
        row[0] += eager_traffic(module.fused_region, program.mesh)
        row[1] += fused_traffic(module, node, program.mesh)
        row[2] += 1
    print(f"Llama-style, {cfg.layers} layers, hidden {cfg.hidden}, mlp {cfg.mlp}, batch {args.batch} x {args.seq}, "
          f"plan '{args.plan}' (per rank, per step: forward + backward)")
    print(f"{'region':<28} {'n':>3} {'kernels eager':>14} {'fused':>6} {'ratio':>6} {'MiB eager':>10} "
          f"{'fused':>8} {'ratio':>6}")
    total_e, total_f = Traffic(), Traffic()
    for kind, (eager, fused, n) in sorted(kinds.items()):
        total_e, total_f = total_e + eager, total_f + fused
        print(f"{kind:<28} {n:>3} {eager.kernels:>14} {fused.kernels:>6} {eager.kernels / fused.kernels:>5.1f}x "
              f"{eager.bytes / 2**20:>10.1f} {fused.bytes / 2**20:>8.1f} {eager.bytes / fused.bytes:>5.1f}x")
    print(f"{'total':<28} {sum(k[2] for k in kinds.values()):>3} {total_e.kernels:>14} {total_f.kernels:>6} "
          f"{total_e.kernels / total_f.kernels:>5.1f}x {total_e.bytes / 2**20:>10.1f} {total_f.bytes / 2**20:>8.1f} "
          f"{total_e.bytes / total_f.bytes:>5.1f}x")
    print(compiled.report.fusion)


if __name__ == "__main__":
    main()
