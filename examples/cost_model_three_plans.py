"""The worked example of docs/cost_model.md: three plans for Llama-3-8B on 64 H100s, by the cost model.

    python examples/cost_model_three_plans.py

Builds the model on the meta device (no weights), profiles it once and estimates each plan: memory
per rank by term, step time by term, tokens/s and MFU; then prints the model's symbolic formulas.
"""

import sympy
import torch

from usc.compiler.cost_formulas import formulas
from usc.compiler.cost_model import estimate
from usc.compiler.hardware import H100
from usc.dsl import parse_plan
from usc.planning import point_of
from usc.passes.cost_profile import profile_model
from usc.testing.models import LLAMA3_8B, TinyLlama

PLANS = ["dp=64 zero=1 mb=4 dtype=bf16",
         "dp=8 tp=8 sp=on zero=1 mb=32 dtype=bf16",
         "dp=16 pp=4 mb=16 zero=1 dtype=bf16"]
SEQ, BATCH = 4096, 256
GIB = 2**30


def main() -> None:
    with torch.device("meta"):
        model = TinyLlama(LLAMA3_8B)
    tokens = torch.zeros(8, SEQ, dtype=torch.long, device="meta")
    profile = profile_model(model, (tokens, tokens))
    print(f"Llama-3-8B shape: {profile.param_count / 1e9:.2f} B parameters, {profile.layers} layers; "
          f"global batch {BATCH} x {SEQ} tokens on 64 H100 (8 per node)\n")
    print("| plan | params | grads | optimizer | activations | total GiB | compute | waiting on the host | "
          "exposed comm | bubble | step | tokens/s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for text in PLANS:
        est = estimate(profile, point_of(parse_plan(text), global_batch=BATCH, seq=SEQ), H100)
        m, t = est.memory, est.time
        print(f"| `{text}` | {m['params'] / GIB:.1f} | {m['grads'] / GIB:.1f} | {m['optimizer'] / GIB:.1f} | "
              f"{m['activations'] / GIB:.1f} | {est.memory_total / GIB:.1f} | {t['compute'] * 1e3:.0f} ms | "
              f"{t['host'] * 1e3:.0f} ms | {t['exposed_comm'] * 1e3:.0f} ms | {t['bubble'] * 1e3:.0f} ms | {t['step'] * 1e3:.0f} ms | "
              f"{est.tokens_per_second:,.0f} | {est.mfu:.1%} |")
    print("\nper-axis exposed communication (ms):")
    for text in PLANS:
        est = estimate(profile, point_of(parse_plan(text), global_batch=BATCH, seq=SEQ), H100)
        axes = {}
        for c in est.collectives:
            axes[c.axis] = axes.get(c.axis, 0.0) + c.exposed_seconds * 1e3
        print(f"  {text}: " + ", ".join(f"{a} {v:.0f}" for a, v in sorted(axes.items())))
    print("\nsymbolic per-rank formulas (bytes, FLOPs; fp32 sizes, sp=off, equal stages):")
    for name, expr in formulas(profile).items():
        print(f"  {name} = {sympy.sstr(expr)}")


if __name__ == "__main__":
    main()
