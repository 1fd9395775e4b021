"""``assert_equivalent``: N optimizer steps on a mesh equal the same steps on one device.

The reference is the plain model trained with the same optimizer; the mesh run is
``usc.simulate`` (every rank in this process) unless a runner is given. Two definitions of "one
device" differ from the plain model's, and the reference follows them (README, "What equal means"):

- a program that draws random numbers (dropout, rand) is compared with usc's own one-device run
  (``reference="usc"``): usc draws counter-based numbers, the same on every plan, not torch's;
- a plan with ``batch_coupling=per_microbatch`` defines the step loss as the mean of its microbatch
  losses: the eager reference computes exactly that (``microbatches`` pieces of dim 0).
"""

from __future__ import annotations

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


def microbatch_mean_loss(model: nn.Module, batch: tuple, microbatches: int) -> torch.Tensor:
    """Megatron's per-microbatch loss: the mean of the losses of ``microbatches`` pieces of dim 0."""
    if microbatches == 1:
        return model(*batch)
    pieces = [v.chunk(microbatches, 0) if isinstance(v, torch.Tensor) else [v] * microbatches for v in batch]
    return sum(model(*(p[m] for p in pieces)) for m in range(microbatches)) / microbatches


def reference_run(model: nn.Module, batches: Sequence[tuple], optimizer: OptimizerFactory, *,
                  microbatches: int = 1):
    """Losses and per-parameter max |grad| over the steps, on one device."""
    opt = optimizer(model.parameters())
    losses, grad_max = [], {}
    for batch in batches:
        loss = microbatch_mean_loss(model, batch, microbatches)
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


def usc_reference_run(model: nn.Module, batches: Sequence[tuple], optimizer: OptimizerFactory, *,
                      seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """usc's own one-device run (plan ``dp=1``): losses and final parameters. Its random draws are the
    ones every plan with the same seed makes (runtime/random.py)."""
    import usc

    sim = usc.simulate(model, f"dp=1 seed={seed}", example_inputs=batches[0], optimizer=optimizer)
    return [sim.step(*b) for b in batches], sim.full_state_dict()


def assert_equivalent(model_factory: Callable[[], nn.Module], plan: str, batches: Sequence[tuple], *,
                      steps: int | None = None, optimizer: OptimizerFactory = _adamw, rtol: float = 1e-5,
                      atol: float = 1e-6, param_atol: float = 1e-5,
                      runner: Callable | None = None, reference: str = "eager") -> EquivalenceResult:
    """Train a fresh model from ``model_factory`` for ``steps`` steps on one device and on the mesh
    of ``plan``; assert per-step losses (rtol/atol) and final parameters (param_atol) agree.
    ``reference``: "eager" (the plain model; per microbatch under batch_coupling=per_microbatch)
    or "usc" (usc's one-device run with the plan's seed: for programs that draw random numbers).

    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> result = assert_equivalent(TinyLlama, "dp=2 tp=2", [batch] * 2)
    """
    import usc

    batches = list(batches)
    steps = steps or len(batches)
    batches = [batches[i % len(batches)] for i in range(steps)]
    torch.manual_seed(0)
    kind, reference = reference, model_factory()
    mesh_model = model_factory()
    mesh_model.load_state_dict(reference.state_dict())
    parsed = usc.Plan(plan) if isinstance(plan, str) else plan
    if kind not in ("eager", "usc"):
        raise ValueError(f"reference must be 'eager' or 'usc', not {kind!r}")
    if kind == "usc":
        ref_losses, ref_state = usc_reference_run(reference, batches, optimizer,
                                                  seed=int(parsed.get("seed")))
        grad_max = {}
    else:
        per_microbatch = parsed.get("batch_coupling") == "per_microbatch"
        ref_losses, grad_max = reference_run(reference, batches, optimizer,
                                             microbatches=int(parsed.get("mb")) if per_microbatch else 1)
        ref_state = reference.state_dict()
    if runner is None:
        sim = usc.simulate(mesh_model, plan, example_inputs=batches[0], optimizer=optimizer)
        losses = [sim.step(*b) for b in batches]
        full = sim.full_state_dict()
    else:
        losses, full = runner(mesh_model, plan, batches, optimizer)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > atol + rtol * abs(b):
            raise AssertionError(f"plan '{plan}': step {i} loss {a!r} != single-device {b!r} "
                                 f"(diff {abs(a - b):.3g})")
    zero = {n for n, g in grad_max.items() if bool((g < ZERO_GRAD).any())}
    lr = max(g["lr"] for g in optimizer([nn.Parameter(torch.zeros(1))]).param_groups)
    worst, name = compare_states(full, ref_state, atol=param_atol, grad_max=grad_max,
                                 zero_grad_atol=steps * lr)
    return EquivalenceResult(ref_losses, losses, worst, name, tuple(sorted(zero)))
