"""Ring attention time (forward + backward) under the mask kinds of context parallelism, and what
proving a Hugging Face mask causal costs at compile time.

    python benchmarks/cp_masks.py          # ring attention per mask kind
    python benchmarks/cp_masks.py proof    # lint CPU time of a meta HF Llama, cp=2 against dp=1

cp=2 simulated ranks (threads of this process), B=1, H=4, D=64, S=2048, float32 on the CPU; per
layout: is_causal (the fast path a proven causal mask takes), the same causal pattern passed as an
explicit bool mask, 8 packed documents (a document mask), and a random bool mask (every tile mixed).
Prints the median of 3 timed runs (after one warm-up) and the tile kinds rank 0 runs.
"""

from __future__ import annotations

import statistics
import time

import torch

from usc.runtime.layout import zigzag_index
from usc.runtime.mesh import run_in_threads, simulated_meshes
from usc.runtime.ring_attention import _mask_calls, _positions, layout_chunks, masked_schedule, ring_attention

N, B, H, D, S = 2, 1, 4, 64, 2048


def masks() -> dict[str, torch.Tensor | None]:
    pos = torch.arange(S)
    causal = pos[None, :] <= pos[:, None]
    doc = pos // (S // 8)
    return {"is_causal": None, "causal as a mask": causal[None, None],
            "8 documents": (causal & (doc[:, None] == doc[None, :]))[None, None],
            "random": (torch.rand(S, S, generator=torch.Generator().manual_seed(0)) < 0.5)[None, None]}


def run(layout: str, mask: torch.Tensor | None) -> float:
    order = zigzag_index(S, N) if layout == "zigzag" else torch.arange(S)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))

    def rank(mesh):
        rows = order.chunk(N)[mesh.rank]
        mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        local = None if mask is None else mask[..., rows, :]
        start = time.perf_counter()
        out = ring_attention(*mine, mesh.comm("cp"), causal=mask is None, scale=None, layout=layout, mask=local)
        out.sum().backward()
        return time.perf_counter() - start

    meshes = simulated_meshes(("cp",), (N,), timeout=600.0)
    return max(run_in_threads(meshes, rank, timeout=600.0))


def kinds(layout: str, mask: torch.Tensor) -> str:
    order = zigzag_index(S, N) if layout == "zigzag" else torch.arange(S)
    s_local = S // N
    blocks = [_positions(layout_chunks(layout, (0 - s) % N, N, s_local), "cpu") for s in range(N)]
    calls = [c for step in _mask_calls(mask[..., order.chunk(N)[0], :], masked_schedule(layout, 0, N, s_local),
                                       blocks) for c in step]
    return (f"{sum(c == [] for c in calls)} skipped, {sum(bool(c) for c in calls)} kernel, "
            f"{sum(c is None for c in calls)} tensor math")


def main() -> None:
    torch.set_num_threads(1)
    for layout in ("contiguous", "zigzag"):
        print(f"\n{layout}, cp={N}, S={S}:")
        for name, mask in masks().items():
            run(layout, mask)
            seconds = statistics.median(run(layout, mask) for _ in range(3))
            detail = "" if mask is None else f"   rank 0 tiles: {kinds(layout, mask)}"
            print(f"  {name:<18} {seconds * 1e3:8.1f} ms{detail}")


def proof() -> None:
    """Process CPU time of usc.lint on a 2-layer Hugging Face Llama built on meta, batch 1: the
    difference between cp=2 and dp=1 is mostly the evaluation of the causal mask's subgraph."""
    import transformers

    import usc

    class Loss(torch.nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            self.m = transformers.LlamaForCausalLM(config)

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels).loss

    for seq in (4096, 16384):
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                          use_cache=False)
        with torch.device("meta"):
            model = Loss(config)
        ids = torch.zeros(1, seq, dtype=torch.long)
        for plan in ("dp=1", "cp=2"):
            start = time.process_time()
            usc.lint(model, plan, example_inputs=(ids, ids))
            print(f"  S={seq:<6} {plan:<5} lint {time.process_time() - start:6.2f} s CPU")


if __name__ == "__main__":
    import sys

    proof() if sys.argv[1:] == ["proof"] else main()
