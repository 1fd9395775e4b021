"""Imported once by the forkserver that starts every `run_world` rank (harness.py), so each forked
rank inherits what its first compile would otherwise pay for again: torch.export's and usc's
imports (about 1.6 s of CPU per process) and their first-use setup, which one small lint warms (about
1.1 s more). Nothing here holds state a test could see: the lint's program is dropped, and no
process group, thread or random draw outlives the import (the forkserver forks from a single thread)."""

import threading

import torch

import usc
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

import gloo_cases  # noqa: F401  (the ranks' module-level functions live here)


def _warm() -> None:
    state = torch.random.get_rng_state()
    try:
        config = LlamaConfig(vocab=64, hidden=16, heads=2, kv_heads=1, mlp=24, layers=1, max_seq=8)
        usc.lint(TinyLlama(config), "dp=2", example_inputs=token_batch(64, 2, 8))
    finally:
        torch.random.set_rng_state(state)


_warm()
if threading.active_count() != 1:  # an ImportError is what the forkserver's preload reports (by skipping)
    raise ImportError("warming started a thread: a forkserver must fork from a single thread")
