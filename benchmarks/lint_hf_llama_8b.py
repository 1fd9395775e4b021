"""Time usc.lint on Hugging Face's LlamaForCausalLM at Llama-3-8B shape, built on the meta device
(config object only: nothing downloaded, no weights allocated) and passed as users hold it: the
model object and a collator's dict batch (``input_ids``, ``attention_mask``, ``labels``).

    python benchmarks/lint_hf_llama_8b.py ["dp=16 tp=8"]

Prints wall and process CPU seconds of the lint (trace + passes + report) after one warm-up lint
of a 2-layer model (torch's first export in a process pays its imports and caches), and the load
average (the machine is shared: wall time under load is not the lint's own).
"""

import os
import sys
import time

import torch

import usc
from usc.testing.hf import hf_llama_model

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)


def meta_llama(**shape) -> torch.nn.Module:
    return hf_llama_model(device="meta", **shape, attn_implementation=None)


def collated(rows: int = 16, seq: int = 4096) -> dict:
    ids = torch.zeros(rows, seq, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main() -> None:
    plan = sys.argv[1] if len(sys.argv) > 1 else "dp=16 tp=8"
    batch = collated()
    usc.lint(meta_llama(**{**LLAMA3_8B, "num_hidden_layers": 2}), plan, example_inputs=batch)
    model = meta_llama(**LLAMA3_8B)
    wall, cpu = time.perf_counter(), time.process_time()
    report = usc.lint(model, plan, example_inputs=batch)
    print(f"HF Llama-3-8B shape on meta, plan '{plan}': lint {time.perf_counter() - wall:.2f} s wall, "
          f"{time.process_time() - cpu:.2f} s CPU; {len(report.collectives)} collectives listed; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
