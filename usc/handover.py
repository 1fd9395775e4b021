"""The user's model once a compiled program has taken it over.

Each rank holds its own copy of the model's state (its slices, in its own dtype and device) and
trains that; the module the user passed to ``usc.compile`` keeps the tensors it was compiled with.
Called, or saved, after the program has trained past it, it would be the untrained model with no
error -- so from the program's first step or checkpoint load on, calling the model or reading its
``state_dict()`` raises ``ModelOutOfDate`` until the trained values are loaded back into it
(``model.load_state_dict(step.full_state_dict())``)."""

from __future__ import annotations

import weakref

import torch
from torch import nn


class ModelOutOfDate(RuntimeError):
    """The model handed to ``usc.compile`` was called or saved after the compiled program trained
    past it: its own tensors are the ones it was compiled with."""


class ModelChanged(RuntimeError):
    """The model handed to ``usc.compile`` was changed after it in a way the compiled program does
    not follow (a parameter frozen or unfrozen): the program would go on training as compiled."""


def frozen_names(model: nn.Module) -> frozenset:
    """The names of the model's parameters that do not train (``requires_grad=False``)."""
    return frozenset(name for name, p in model.named_parameters() if not p.requires_grad)


def refuse_changed_training(model: "nn.Module | None", compiled_frozen: frozenset, call: str) -> None:
    """Raise ModelChanged when the model's frozen parameters are not the ones the program was
    compiled with (gradual unfreezing, a backbone frozen after the first epochs): the program keeps
    training what it was compiled to train."""
    if model is None:
        return
    now = frozen_names(model)
    if now == compiled_frozen:
        return
    changes = [f"{len(names)} parameter(s) {how} ('{names[0]}'" + (", ..." if len(names) > 1 else "") + ")"
               for names, how in ((sorted(compiled_frozen - now), "unfrozen"), (sorted(now - compiled_frozen), "frozen"))
               if names]
    raise ModelChanged(
        f"{call}: requires_grad changed on the model after usc.compile, {' and '.join(changes)}: the compiled "
        "program trains the parameters that had "
        "requires_grad when it was compiled (their gradients, optimizer state and ZeRO slices are laid out for "
        "them), so it would go on training as compiled, with no error\n"
        "  fix: compile again from the trained values once the set changes -- "
        "model.load_state_dict(step.full_state_dict()), set requires_grad, step = usc.compile(model, ...) "
        "(the optimizer's state starts afresh); or set requires_grad as wanted before compiling")


class _Watch:
    """Whether the watched model is behind the program that took it over: the program's state
    version (steps taken, checkpoints loaded) against the one last loaded into the model."""

    def __init__(self, model: nn.Module, program) -> None:
        self.model = weakref.ref(model)
        self.program = weakref.ref(program)
        self.synced = program.state_version

    def behind(self, module: nn.Module):
        """The program the module is behind, or None (a copy of the model, or the program gone:
        then the model's own tensors are the only state there is)."""
        program = self.program()
        if module is not self.model() or program is None or program.state_version == self.synced:
            return None
        if any(t.is_meta for t in module.parameters()):  # built on meta: no values to take for trained ones
            return None
        return program

    def refuse(self, module: nn.Module, use: str) -> None:
        program = self.behind(module)
        if program is None:
            return
        name = type(module).__name__
        raise ModelOutOfDate(
            f"{name} {use} after usc's compiled program moved past it ({program.steps_taken} step(s) taken, "
            f"{program.loads_done} checkpoint(s) loaded): the program holds the trained values, the {name} still "
            "holds the ones it was compiled with, so this would use the untrained model\n"
            "  fix: model.load_state_dict(step.full_state_dict()) copies the trained values into it (every rank "
            "calls it: it is a collective; a model built on the meta device: load_state_dict(..., assign=True)); "
            "or keep to the compiled program: step.eval_step(*batch) evaluates, step.save(path) checkpoints")

    def loaded(self, module: nn.Module, incompatible=None) -> None:
        program = self.program()
        if module is self.model() and program is not None:
            self.synced = program.state_version


_WATCHES: "weakref.WeakKeyDictionary[nn.Module, _Watch]" = weakref.WeakKeyDictionary()


def refuse_if_behind(model: nn.Module, use: str) -> None:
    """Raise ModelOutOfDate when a program took ``model`` over and moved past it (usc.compile of the
    same model again: it would start from the values the model was first compiled with)."""
    watcher = _WATCHES.get(model)
    if watcher is not None:
        watcher.refuse(model, use)


def watch(model: nn.Module, program) -> None:
    """Guard ``model`` (the module given to usc.compile) against use after ``program`` trains past it:
    a forward pre-hook and a state_dict pre-hook refuse while it is behind; a load_state_dict into it
    brings it level again. A model built on meta (the only kind ``init=`` fills from a checkpoint) is
    not refused: it holds no values to mistake for trained ones until trained values are loaded in."""
    watcher = _WATCHES[model] = _Watch(model, program)
    # usc's own traces (lint, plan, a second compile: it asks refuse_if_behind first) read no values
    model.register_forward_pre_hook(
        lambda module, args: None if torch.compiler.is_exporting() else watcher.refuse(module, "was called"))
    model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: watcher.refuse(module, "had its state_dict read"))
    model.register_load_state_dict_post_hook(watcher.loaded)
