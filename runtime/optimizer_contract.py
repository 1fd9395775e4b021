"""The optimizer contract: which optimizers may step on slices of parameters.

A plan that splits parameters (tp, ep, ZeRO) hands the optimizer this rank's slices. An
element-wise optimizer (each element's update reads only that element's gradient and state:
SGD, Adam, AdamW, ...) gives exactly the update it would give the whole parameter. One that
reads across elements (Adafactor's row and column statistics, Muon's orthogonalisation, Shampoo's
preconditioners, a norm-based clip inside ``step``) would compute them per slice: a different
model, silently. Such an optimizer is refused under those plans, naming it and the plan.

A user optimizer declares itself element-wise with a class attribute ``usc_element_wise = True``
(and a subclass of a listed optimizer that is not element-wise sets it to False).
"""

from __future__ import annotations

import torch

from usc.compiler.errors import CompileError

ELEMENT_WISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
                torch.optim.ASGD)


def is_element_wise(optimizer) -> bool:
    declared = getattr(type(optimizer), "usc_element_wise", None)
    return bool(declared) if declared is not None else isinstance(optimizer, ELEMENT_WISE)


def check_optimizer(optimizer, split: dict[str, str]) -> None:
    """``split``: parameter name -> how the plan splits it (e.g. "tp=2"). Raises when the optimizer
    would step on slices it cannot step on."""
    if not split or is_element_wise(optimizer):
        return
    name = type(optimizer).__name__
    how = sorted(set(split.values()))
    params = ", ".join(sorted(split)[:3]) + (f" (+{len(split) - 3} more)" if len(split) > 3 else "")
    raise CompileError(
        f"optimizer {name} is not element-wise, and the plan ({', '.join(how)}) gives it slices of {params}: "
        f"its update would read statistics of each slice instead of the whole parameter. Use a plan that "
        f"keeps these parameters whole (no tp/ep split, zero=0), an element-wise optimizer (SGD, Adam, AdamW, "
        f"...), or, if {name} is element-wise, declare it with `{name}.usc_element_wise = True`")
