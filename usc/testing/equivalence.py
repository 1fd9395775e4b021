"""``assert_equivalent``: N optimizer steps on a mesh equal the same steps on one device.

The reference is the plain model trained with the same optimizer; the mesh run is
``usc.simulate`` (every rank in this process) unless a runner is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

OptimizerFactory = Callable[..., torch.optim.Optimizer]


@dataclass
class EquivalenceResult:
    reference_losses: list[float]
    losses: list[float]
    max_param_diff: float
    worst_param: str
    zero_grad_params: tuple[str, ...]  # parameters with elements whose gradient was numerically zero


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def reference_loss(model: nn.Module, batch) -> torch.Tensor:
    """The loss as a user reads it on one device: ``model(**batch)`` for a dict batch, ``model(*batch)``
    otherwise; the output itself, its ``.loss`` (Hugging Face), or the scalar of a tuple (nanoGPT).
    Written independently of usc's own loss finding, which it checks."""
    out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
    if isinstance(out, tuple):
        (out,) = [v for v in out if isinstance(v, torch.Tensor) and v.dim() == 0]
    return out if isinstance(out, torch.Tensor) else out.loss


def reference_run(model: nn.Module, batches: Sequence, optimizer: OptimizerFactory):
    """Losses and per-parameter max |grad| over the steps, on one device."""
    opt = optimizer(model.parameters())
    losses, grad_max = [], {}
    for batch in batches:
        loss = reference_loss(model, batch)
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                seen = grad_max.get(name)
                grad_max[name] = p.grad.abs() if seen is None else torch.maximum(seen, p.grad.abs())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grad_max


ZERO_GRAD = 1e-7  # a gradient this small is rounding noise of a gradient that is exactly zero


def compare_states(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *, atol: float,
                   grad_max: dict[str, torch.Tensor], zero_grad_atol: float) -> tuple[float, str]:
    """Max |difference| over parameters; raise naming the first parameter beyond tolerance.

    An element whose true gradient is zero (GPT-2's key bias: softmax ignores a per-row constant)
    gets only rounding noise as gradient, which AdamW normalises into steps of up to ``lr`` in any
    direction, on one device and on a mesh alike; such elements are held to ``zero_grad_atol``.
    """
    worst, worst_name = 0.0, ""
    for name, expected in ref.items():
        if name not in full:
            raise AssertionError(f"parameter '{name}' is missing from the mesh run's full_state_dict")
        got = full[name]
        if got.shape != expected.shape:
            raise AssertionError(f"parameter '{name}': shape {list(got.shape)} != reference {list(expected.shape)}")
        delta = (got.float() - expected.float()).abs()
        noise = grad_max[name] < ZERO_GRAD if name in grad_max else torch.zeros_like(delta, dtype=torch.bool)
        limit = torch.where(noise, zero_grad_atol, atol)
        bad = delta > limit
        if bool(bad.any()):
            i = int(bad.flatten().nonzero()[0])
            raise AssertionError(f"parameter '{name}' differs from the single-device run by "
                                 f"{delta.flatten()[i].item():.3g} at flat index {i} (allowed "
                                 f"{limit.flatten()[i].item():.3g})")
        checked = delta[~noise]
        diff = checked.max().item() if checked.numel() else 0.0
        if diff > worst:
            worst, worst_name = diff, name
    return worst, worst_name


def assert_equivalent(model_factory: Callable[[], nn.Module], plan: str, batches: Sequence[tuple], *,
                      steps: int | None = None, optimizer: OptimizerFactory = _adamw, rtol: float = 1e-5,
                      atol: float = 1e-6, param_atol: float = 1e-5,
                      runner: Callable | None = None) -> EquivalenceResult:
    """Train a fresh model from ``model_factory`` for ``steps`` steps on one device and on the mesh
    of ``plan``; assert per-step losses (rtol/atol) and final parameters (param_atol) agree.

    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> result = assert_equivalent(TinyLlama, "dp=2 tp=2", [batch] * 2)
    """
    import usc

    batches = list(batches)
    steps = steps or len(batches)
    batches = [batches[i % len(batches)] for i in range(steps)]
    torch.manual_seed(0)
    reference = model_factory()
    mesh_model = model_factory()
    mesh_model.load_state_dict(reference.state_dict())
    ref_losses, grad_max = reference_run(reference, batches, optimizer)
    if runner is None:
        sim = usc.simulate(mesh_model, plan, example_inputs=batches[0], optimizer=optimizer)
        losses = [sim.step(b) for b in batches]
        full = sim.full_state_dict()
    else:
        losses, full = runner(mesh_model, plan, batches, optimizer)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > atol + rtol * abs(b):
            raise AssertionError(f"plan '{plan}': step {i} loss {a!r} != single-device {b!r} "
                                 f"(diff {abs(a - b):.3g})")
    zero = {n for n, g in grad_max.items() if bool((g < ZERO_GRAD).any())}
    lr = max(g["lr"] for g in optimizer([nn.Parameter(torch.zeros(1))]).param_groups)
    worst, name = compare_states(full, reference.state_dict(), atol=param_atol, grad_max=grad_max,
                                 zero_grad_atol=steps * lr)
    return EquivalenceResult(ref_losses, losses, worst, name, tuple(sorted(zero)))
