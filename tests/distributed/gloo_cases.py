"""Rank-side functions for the gloo tests (module level, so the harness can pickle them)."""

import io
import os
import time

import torch

import usc
from usc.testing.models import TinyDeepSeek, TinyGPT2, TinyLlama, TinyMixtral, shifted_batch, token_batch

MODELS = {
    "llama": (TinyLlama, lambda seed: token_batch(128, 4, 16, seed=seed)),
    "gpt2": (TinyGPT2, lambda seed: shifted_batch(128, 4, 16, seed=seed)),
}
# mixture-of-experts models: their own table, so the dense-model suites do not run them
MOE_MODELS = {
    "mixtral": (TinyMixtral, lambda seed: token_batch(128, 4, 16, seed=seed)),
    "deepseek": (TinyDeepSeek, lambda seed: token_batch(128, 4, 16, seed=seed)),
    # float64: dp=4 leaves one sequence per rank, where AdamW amplifies float32 rounding past 1e-5
    "deepseek64": (lambda: TinyDeepSeek().double(), lambda seed: token_batch(128, 4, 16, seed=seed)),
}


def train_cases(rank: int, world_size: int, cases: list[tuple[str, str]], steps: int) -> list:
    """Every rank builds the same model from the same seed and passes the same global batches."""
    torch.set_num_threads(1)
    out = []
    for model_name, plan in cases:
        factory, batch = {**MODELS, **MOE_MODELS}[model_name]
        torch.manual_seed(0)
        model = factory()
        batches = [batch(seed) for seed in range(steps)]
        step = usc.compile(model, plan, example_inputs=batches[0])
        losses = [step.step(*b) for b in batches]
        # Bytes travel by value; tensors would travel as shared memory of an exiting process.
        buffer = io.BytesIO()
        torch.save({k: v.detach().clone() for k, v in step.full_state_dict().items()}, buffer)
        out.append((losses, buffer.getvalue() if rank == 0 else None))
    return out


def die_mid_training(rank: int, world_size: int, plan: str) -> str:
    torch.manual_seed(0)
    model = TinyLlama()
    batch = token_batch(128, 4, 16)
    step = usc.compile(model, plan, example_inputs=batch)
    step.step(*batch)
    if rank == 1:
        os._exit(1)  # a rank dies between steps
    start = time.monotonic()
    try:
        step.step(*batch)
    except usc.CollectiveError as err:
        return f"{time.monotonic() - start:.1f}|{err}"
    return "no error"


def save_after_two_steps(rank: int, world_size: int, plan: str, path: str) -> list[float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLlama()
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    step = usc.compile(model, plan, example_inputs=batches[0])
    losses = [step.step(*b) for b in batches]
    step.save(path)
    return losses
