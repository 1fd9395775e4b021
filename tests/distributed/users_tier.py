"""How the "models users bring" tier judges a case: the family's model trained on a simulated mesh
against the same model trained on one device, both called as the user calls it.

Equality is judged honestly about float32 rounding. First float32 with AdamW (losses rtol 1e-5, parameters 1e-5),
whose own second opinion on a miss is the same plan in float64 (``check_equivalent``). Hugging Face
computes norms, RoPE and losses in float32 islands (``.float()``) whatever the model's dtype, so a
float64 run of an HF model still carries float32 rounding and often misses the float64 bound too;
then SGD in float32 at the same bounds decides: AdamW divides by the root of the squared gradient,
so rounding noise on a near-zero gradient becomes a step of up to lr in any direction, where SGD
moves each parameter by lr x gradient and a real mismatch still shows. Every outcome says which
opinion decided and what the others missed by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

import usc
from usc.testing.equivalence import adamw, check_equivalent
from users_models import FAMILIES, Family, batches

def user_loss(family: Family, model: torch.nn.Module, batch) -> torch.Tensor:
    """The loss as the family's users compute it on one device, written apart from usc's loss finding:
    ``model(**batch).loss`` (Hugging Face), ``model(idx, targets)[1]`` (nanoGPT), or the trainer's
    ``loss_fn(model(tokens), labels)`` (torchtitan)."""
    if isinstance(batch, Mapping):
        return model(**batch).loss
    if family.loss_fn is not None:
        return family.loss_fn(model(batch[0]), batch[1])
    return model(*batch)[1]


def _eager(family: Family):
    def run(model, steps, optimizer):
        opt, losses = optimizer(model.parameters()), []
        for batch in steps:
            loss = user_loss(family, model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, model.state_dict()
    return run


# Families whose forward draws random numbers while training (PhiMoE's sparsemixer samples its experts
# with ``exponential_``): usc draws them counter-based, the same on every plan, so their one device is
# usc's own one-device run with the same seed (README, "What equal means"), not torch's generator.
DRAWS = {"phimoe"}


def _usc_one_device(family: Family):
    def run(model, steps, optimizer):
        sim = usc.simulate(model, "dp=1", example_inputs=steps[0], loss_fn=family.loss_fn, optimizer=optimizer)
        return [sim.step(b) for b in steps], sim.full_state_dict()
    return run


def _mesh(family: Family, plan: str, optimizer):
    def run(model, steps):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        sim = usc.simulate(model, plan, example_inputs=steps[0], loss_fn=family.loss_fn, optimizer=optimizer)
        changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
        assert not changed, f"compiling changed the user's model: {changed[:3]}"  # looking must not touch
        return [sim.step(b) for b in steps], sim.full_state_dict()
    return run


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@dataclass
class Outcome:
    family: str
    plan: str
    decided_by: str          # "float32 AdamW", "float64 AdamW" or "float32 SGD"
    max_param_diff: float
    misses: tuple[str, ...] = ()

    def __str__(self) -> str:
        missed = "; ".join(self.misses)
        return f"{self.family} [{self.plan}]: equal by {self.decided_by} (max param diff {self.max_param_diff:.2g})" + \
            (f" after misses: {missed}" if missed else "")


def judge(name: str, plan: str, *, steps: int = 2) -> Outcome:
    """The family trained on ``plan`` equals one device (or AssertionError); a usc refusal propagates."""
    family, data = FAMILIES[name], batches(name, steps)
    checked = f"{plan} replica_check=1"
    reference = _usc_one_device(family) if name in DRAWS else _eager(family)
    try:
        result = _check(family, checked, data, adamw, reference)
        decided = "float64 AdamW" if result.float32_miss else "float32 AdamW"
        return Outcome(name, plan, decided, result.max_param_diff, (result.float32_miss,) if result.float32_miss else ())
    except AssertionError as miss:
        adamw_miss = _first_lines(miss)
    result = _check(family, checked, data, _sgd, reference)
    return Outcome(name, plan, "float32 SGD", result.max_param_diff, (adamw_miss,))


def _check(family: Family, plan: str, data: list, optimizer, reference):
    run = _mesh(family, plan, optimizer)
    torch.manual_seed(0)
    outcome = run(family.build(), data)  # a refusal of the plan itself propagates from here
    return check_equivalent(family.build, data, outcome, rerun=_float64_opinion(run), optimizer=optimizer,
                            what=f"plan '{plan}'", reference=reference)


def _float64_opinion(run):
    """The float64 rerun, where a refusal counts as a miss: Hugging Face's grouped-mm experts refuse
    float64 weights (torch._grouped_mm takes float32 / bfloat16 / float16 only), so usc cannot check
    their form in float64, and SGD in float32 decides."""
    def rerun(model, steps):
        try:
            return run(model, steps)
        except usc.CompileError as err:
            raise AssertionError(f"the float64 run is refused: {str(err).splitlines()[0]}") from None
    return rerun


def _first_lines(err: Exception) -> str:
    return " / ".join(line.strip() for line in str(err).splitlines()[:3])


__all__ = ["Outcome", "judge", "user_loss"]
