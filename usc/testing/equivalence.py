"""``assert_equivalent``: N optimizer steps on a mesh equal the same steps on one device.

The reference is the plain model trained with the same optimizer; the mesh run is
``usc.simulate`` (every rank in this process) unless a runner is given. The simulated run checks
after every step that peers holding copies of a tensor hold the same numbers (the plan option
``replica_check=1``, unless the plan writes its own): a divergence is named where it starts.

Every element is held to the float32 bound. Where float32 misses, the miss is either a bug or
float32 rounding that AdamW amplified (an element whose true gradient is zero -- GPT-2's key bias,
the rows of unseen tokens -- gets rounding noise as gradient, and AdamW normalises that into steps
of up to ``lr``). A float64 run of the same plan tells them apart: rounding shrinks by 2**29 there,
so the mesh must then equal one device to ``FLOAT64_TOL``; a bug does not shrink.

Two definitions of "one device" differ from the plain model's, and the reference follows them
(README, "What equal means"):

- a program that draws random numbers (dropout, rand) is compared with usc's own one-device run
  (``reference="usc"``): usc draws counter-based numbers, the same on every plan, not torch's;
- a plan with ``batch_coupling=per_microbatch`` defines the step loss as the mean of its microbatch
  losses: the eager reference computes exactly that (``microbatches`` pieces of dim 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

OptimizerFactory = Callable[..., torch.optim.Optimizer]
# (model, batches) -> (per-step losses, full state dict): one way of training on the mesh
MeshRun = Callable[[nn.Module, list], tuple[list[float], dict[str, torch.Tensor]]]
FLOAT64_TOL = 1e-10  # float64 rounding after a few AdamW steps of the tiny models stays below 1e-12


@dataclass
class EquivalenceResult:
    reference_losses: list[float]
    losses: list[float]
    max_param_diff: float
    worst_param: str
    float32_miss: str | None = None  # what float32 missed when the float64 run had to decide


def adamw(params) -> torch.optim.Optimizer:
    """The equivalence checks' default optimizer: AdamW at torch's defaults, as users train."""
    return torch.optim.AdamW(params)


def reference_loss(model: nn.Module, batch) -> torch.Tensor:
    """The loss as a user reads it on one device: ``model(**batch)`` for a dict batch, ``model(*batch)``
    otherwise; the output itself, its ``.loss`` (Hugging Face), or the scalar of a tuple (nanoGPT).
    Written independently of usc's own loss finding, which it checks."""
    out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
    if isinstance(out, tuple):
        (out,) = [v for v in out if isinstance(v, torch.Tensor) and v.dim() == 0]
    return out if isinstance(out, torch.Tensor) else out.loss


def microbatch_mean_loss(model: nn.Module, batch, microbatches: int) -> torch.Tensor:
    """Megatron's per-microbatch loss: the mean of the losses of ``microbatches`` pieces of dim 0."""
    if microbatches == 1:
        return reference_loss(model, batch)
    if isinstance(batch, Mapping):
        pieces = {k: v.chunk(microbatches, 0) if isinstance(v, torch.Tensor) else [v] * microbatches
                  for k, v in batch.items()}
        parts = [{k: p[m] for k, p in pieces.items()} for m in range(microbatches)]
    else:  # a tuple, its elements tensors or dicts/lists of them (forward(self, batch) taking a dict)
        parts = [tree_map(lambda v, m=m: v.chunk(microbatches, 0)[m] if isinstance(v, torch.Tensor) else v,
                          tuple(batch)) for m in range(microbatches)]
    return sum(reference_loss(model, part) for part in parts) / microbatches


def reference_run(model: nn.Module, batches: Sequence, optimizer: OptimizerFactory, *,
                  microbatches: int = 1) -> list[float]:
    """Per-step losses on one device (``model`` is trained in place); with ``microbatches`` the loss
    is defined per microbatch (batch_coupling=per_microbatch)."""
    opt = optimizer(model.parameters())
    losses = []
    for batch in batches:
        loss = microbatch_mean_loss(model, batch, microbatches)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compare_states(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *, atol: float) -> tuple[float, str]:
    """Max |difference| over parameters; raise naming the first parameter beyond ``atol``."""
    worst, worst_name = 0.0, ""
    for name, expected in ref.items():
        if name not in full:
            raise AssertionError(f"parameter '{name}' is missing from the mesh run's full_state_dict")
        got = full[name]
        if got.shape != expected.shape:
            raise AssertionError(f"parameter '{name}': shape {list(got.shape)} != reference {list(expected.shape)}")
        delta = (got.double() - expected.double()).abs()
        diff = delta.max().item() if delta.numel() else 0.0
        if diff > atol:
            i = int(delta.flatten().argmax())
            raise AssertionError(f"parameter '{name}' differs from the single-device run by {diff:.3g} at flat "
                                 f"index {i} (allowed {atol:.3g})")
        if diff > worst:
            worst, worst_name = diff, name
    return worst, worst_name


def compare_losses(losses: Sequence[float], expected: Sequence[float], *, rtol: float, atol: float) -> None:
    if len(losses) != len(expected):
        raise AssertionError(f"{len(losses)} losses != {len(expected)} steps of the single-device run")
    for i, (a, b) in enumerate(zip(losses, expected)):
        if abs(a - b) > atol + rtol * abs(b):
            raise AssertionError(f"step {i} loss {a!r} != single-device {b!r} (diff {abs(a - b):.3g})")


def as_float64(batch):
    """The batch with its floating-point tensors in float64 (token ids stay integers)."""
    if isinstance(batch, Mapping):
        return {k: as_float64((v,))[0] for k, v in batch.items()}
    return tree_map(lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v, tuple(batch))


# (model, batches, optimizer) -> (per-step losses, final state dict): one definition of one device
Reference = Callable[[nn.Module, list, OptimizerFactory], tuple[list[float], dict[str, torch.Tensor]]]


def eager_reference(microbatches: int = 1) -> Reference:
    """The plain model (its loss defined per microbatch when ``microbatches`` > 1)."""
    def run(model, batches, optimizer):
        return reference_run(model, batches, optimizer, microbatches=microbatches), model.state_dict()
    return run


def usc_reference(seed: int = 0) -> Reference:
    """usc's own one-device run (plan ``dp=1``): its random draws are the ones every plan with the
    same seed makes (runtime/random.py)."""
    def run(model, batches, optimizer):
        return usc_reference_run(model, batches, optimizer, seed=seed)
    return run


def usc_reference_run(model: nn.Module, batches: Sequence[tuple], optimizer: OptimizerFactory, *,
                      seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    import usc

    sim = usc.simulate(model, f"dp=1 seed={seed}", example_inputs=batches[0], optimizer=optimizer)
    return [sim.step(b) for b in batches], sim.full_state_dict()


def reference_for(plan, kind: str) -> Reference:
    """The one-device definition a plan is compared with: ``kind`` "eager" or "usc" (random programs)."""
    import usc

    parsed = plan if isinstance(plan, usc.Plan) else usc.parse_plan(plan)
    if kind == "usc":
        return usc_reference(int(parsed.get("seed")))
    if kind != "eager":
        raise ValueError(f"reference must be 'eager' or 'usc', not {kind!r}")
    per_microbatch = parsed.get("batch_coupling") == "per_microbatch"
    return eager_reference(int(parsed.get("mb")) if per_microbatch else 1)


def _judge(model_factory, batches: list, optimizer, outcome, *, rtol: float, atol: float,
           param_atol: float, reference: Reference | None = None) -> EquivalenceResult:
    """Compare a mesh run's (losses, full state) with one device trained from the same weights."""
    torch.manual_seed(0)
    expected, ref_state = (reference or eager_reference())(model_factory(), batches, optimizer)
    losses, full = outcome
    compare_losses(losses, expected, rtol=rtol, atol=atol)
    worst, name = compare_states(full, ref_state, atol=param_atol)
    return EquivalenceResult(expected, list(losses), worst, name)


def check_equivalent(model_factory: Callable[[], nn.Module], batches: Sequence[tuple], outcome, *,
                     rerun: MeshRun, optimizer: OptimizerFactory = adamw, rtol: float = 1e-5,
                     atol: float = 1e-6, param_atol: float = 1e-5, what: str = "the mesh run",
                     reference: Reference | None = None) -> EquivalenceResult:
    """``outcome`` (losses, full state) of a mesh run from ``model_factory()`` (seeded 0) against one
    device; where it misses, ``rerun(model, batches)`` repeats the mesh run in float64, which must
    then equal one device to FLOAT64_TOL (the float32 miss was rounding) or the check fails."""
    batches = list(batches)
    try:
        return _judge(model_factory, batches, optimizer, outcome, rtol=rtol, atol=atol, param_atol=param_atol,
                      reference=reference)
    except AssertionError as err:
        miss = f"{what}: {err}"
    double = lambda: model_factory().double()  # noqa: E731 - seeded by _judge and by the rerun alike
    batches64 = [as_float64(b) for b in batches]
    torch.manual_seed(0)
    try:
        result = _judge(double, batches64, optimizer, rerun(double(), batches64), rtol=FLOAT64_TOL,
                        atol=FLOAT64_TOL, param_atol=FLOAT64_TOL, reference=reference)
    except AssertionError as err:
        raise AssertionError(f"{miss}\nand a float64 run of the same plan misses too (not float32 rounding): "
                             f"{err}") from None
    result.float32_miss = miss
    return result


def simulate_run(plan: str, optimizer: OptimizerFactory = adamw) -> MeshRun:
    """Train with ``usc.simulate`` (every rank in this process)."""
    import usc

    def run(model: nn.Module, batches: list):
        sim = usc.simulate(model, plan, example_inputs=batches[0], optimizer=optimizer)
        return [sim.step(b) for b in batches], sim.full_state_dict()

    return run


def assert_equivalent(model_factory: Callable[[], nn.Module], plan: str, batches: Sequence[tuple], *,
                      steps: int | None = None, optimizer: OptimizerFactory = adamw, rtol: float = 1e-5,
                      atol: float = 1e-6, param_atol: float = 1e-5,
                      runner: Callable | None = None, replica_check: int = 1,
                      reference: str = "eager") -> EquivalenceResult:
    """Train a fresh model from ``model_factory`` for ``steps`` steps on one device and on the mesh
    of ``plan``; assert per-step losses (rtol/atol) and final parameters (param_atol) agree, or,
    where float32 misses, that a float64 run of the same plan agrees to FLOAT64_TOL.
    ``reference``: "eager" (the plain model; per microbatch under batch_coupling=per_microbatch) or
    "usc" (usc's one-device run with the plan's seed: for programs that draw random numbers).

    >>> from usc.testing.models import TinyLlama, token_batch
    >>> batch = token_batch(128, 4, 16)
    >>> result = assert_equivalent(TinyLlama, "dp=2 tp=2", [batch] * 2)
    """
    batches = list(batches)
    steps = steps or len(batches)
    batches = [batches[i % len(batches)] for i in range(steps)]
    if runner is None:
        run = simulate_run(_checked(plan, replica_check), optimizer)
    else:
        run = lambda model, b: runner(model, plan, b, optimizer)  # noqa: E731
    torch.manual_seed(0)
    outcome = run(model_factory(), batches)
    return check_equivalent(model_factory, batches, outcome, rerun=run, optimizer=optimizer, rtol=rtol,
                            atol=atol, param_atol=param_atol, what=f"plan '{plan}'",
                            reference=reference_for(plan, reference))


# bfloat16 keeps 8 significand bits: each rounding is off by at most u = 2**-8 relative.
BF16_U = 2.0**-8
# A weight's gradient is one matmul's output whose operands went through bf16: the weight copy, the
# layer input and the incoming gradient are rounded, then the product: four roundings per step; the
# errors of successive steps add up (SGD sums the gradients).
BF16_ROUNDINGS_PER_STEP = 4


def _sgd(lr: float) -> OptimizerFactory:
    return lambda params: torch.optim.SGD(params, lr=lr)


def assert_bf16_close(model_factory: Callable[[], nn.Module], plan: str, batch: tuple, *, steps: int = 3,
                      lr: float = 0.3) -> EquivalenceResult:
    """``steps`` SGD steps on ``batch`` under a ``dtype=bf16`` plan against float32 on one device.

    Step i's loss must be within (i + 1) * 2u of the float32 loss (relative; u = BF16_U), and each
    parameter's update (final - initial) within steps * BF16_ROUNDINGS_PER_STEP * u of the float32
    update (relative, norm-wise). The float32 run must learn (its loss falls by more than four times
    the last step's loss bound), so a bf16 path that never learns fails both checks.
    """
    batches = [batch] * steps
    torch.manual_seed(0)
    reference = model_factory()
    initial = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    mesh_model = model_factory()
    mesh_model.load_state_dict(initial)
    expected = reference_run(reference, batches, _sgd(lr))
    bounds = [(i + 1) * 2 * BF16_U * abs(e) for i, e in enumerate(expected)]
    if expected[0] - expected[-1] <= 4 * bounds[-1]:
        raise AssertionError(f"the float32 run does not learn enough to tell ({expected}): raise lr or steps")
    losses, full = simulate_run(plan, _sgd(lr))(mesh_model, batches)
    for i, (got, want, bound) in enumerate(zip(losses, expected, bounds)):
        if abs(got - want) > bound:
            raise AssertionError(f"plan '{plan}': step {i} loss {got:.5g} != float32 {want:.5g} (bf16 bound {bound:.3g})")
    worst, worst_name = _worst_update_error(full, reference.state_dict(), initial,
                                            limit=steps * BF16_ROUNDINGS_PER_STEP * BF16_U, plan=plan)
    return EquivalenceResult(expected, losses, worst, worst_name)


def _worst_update_error(full: dict, ref: dict, initial: dict, *, limit: float, plan: str) -> tuple[float, str]:
    """Max over parameters of |update - float32 update| / |float32 update|; raise past ``limit``."""
    worst, worst_name = 0.0, ""
    for name, start in initial.items():
        if not start.is_floating_point() or name not in full:
            continue  # integer buffers; constants the mesh run does not return
        want = ref[name].double() - start.double()
        miss = float((full[name].double() - start.double() - want).norm())
        error = miss / float(want.norm()) if miss else 0.0  # an unmoved tensor must stay unmoved
        if error > limit:
            raise AssertionError(f"plan '{plan}': parameter '{name}' moved {error:.3g} (relative) away from the "
                                 f"float32 update (bf16 bound {limit:.3g})")
        if error > worst:
            worst, worst_name = error, name
    return worst, worst_name


def _checked(plan, every: int):
    """``plan`` with the replica guard every ``every`` steps, unless it sets replica_check itself."""
    import usc

    if isinstance(plan, str) and plan.endswith(".usc"):
        return plan  # a plan file: as written
    parsed = plan if isinstance(plan, usc.Plan) else usc.parse_plan(plan)
    return parsed if parsed.is_set("replica_check") or parsed.auto else parsed.with_options(replica_check=every)
