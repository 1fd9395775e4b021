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

from usc.runtime.materialize import has_meta_tensors


class ModelOutOfDate(RuntimeError):
    """The model handed to ``usc.compile`` was called or saved after the compiled program trained
    past it: its own tensors are the ones it was compiled with."""


class ModelChanged(RuntimeError):
    """The model handed to ``usc.compile`` was changed after it in a way the compiled program does
    not follow (a parameter frozen or unfrozen): the program would go on training as compiled."""


def value_marks(model: nn.Module) -> dict:
    """{name: (tensor identity, version counter)} of the model's parameters: torch bumps a tensor's
    version on every in-place write (``load_state_dict`` copies in place; ``assign=True`` replaces)."""
    return {name: (id(p), p._version) for name, p in model.named_parameters()}


def note_given(program, state: dict) -> None:
    """The tensors ``program.full_state_dict()`` handed out: loaded into the model, they make it level."""
    program._given_ids = {id(t) for t in state.values() if isinstance(t, torch.Tensor)}


def frozen_names(model: nn.Module) -> frozenset:
    """The names of the model's parameters that do not train (``requires_grad=False``)."""
    return frozenset(name for name, p in model.named_parameters() if not p.requires_grad)


def refuse_model_changes(model: "nn.Module | None", compiled_frozen: frozenset, call: str,
                            watcher: "_Watch | None" = None) -> None:
    """Raise ModelChanged when the model's frozen parameters are not the ones the program was
    compiled with (gradual unfreezing, a backbone frozen after the first epochs), or when values were
    written into the model after the program read them (``model.load_state_dict(pretrained)`` after
    compile): the program keeps training what it was compiled to train, from its own values."""
    if model is None:
        return
    written = watcher.changed_values(model) if watcher is not None and watcher.model() is model else []
    if written:
        raise ModelChanged(
            f"{call}: the model's values were written after the compiled program read them ({len(written)} "
            f"parameter(s): '{written[0]}'" + (", ..." if len(written) > 1 else "") + "; a load_state_dict or an "
            "in-place write): the program trains its own copy, read when it was made, and would not see them\n"
            "  fix: to train from the new values, load them before compiling, or compile again now "
            "(step = usc.compile(model, ...); the optimizer's state starts afresh); to go on with the "
            "program's values, model.load_state_dict(step.full_state_dict())")
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
        self.marks = value_marks(model)  # the parameters as the program read them
        self.loading_program_values = False

    def behind(self, module: nn.Module):
        """The program the module is behind, or None (a copy of the model, or the program gone:
        then the model's own tensors are the only state there is)."""
        program = self.program()
        if module is not self.model() or program is None or program.state_version == self.synced:
            return None
        if has_meta_tensors(module):  # built on meta: no values to take for trained ones
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

    def loading(self, module, state_dict, prefix, *args) -> None:
        """Before a load into the model: is it the program's own values (``step.full_state_dict()``)?"""
        program = self.program()
        given = getattr(program, "_given_ids", None) or ()
        tensors = [t for t in state_dict.values() if isinstance(t, torch.Tensor)]
        self.loading_program_values = bool(tensors) and all(id(t) in given for t in tensors)

    def loaded(self, module: nn.Module, incompatible=None) -> None:
        """After it: level with the program (not behind it). Values that are not the program's are the
        user's own, which the program does not take: its next step refuses them (``changed_values``)."""
        program = self.program()
        if module is self.model() and program is not None:
            self.synced = program.state_version
            if self.loading_program_values:
                self.marks = value_marks(module)
        self.loading_program_values = False

    def changed_values(self, module: nn.Module) -> list:
        """The parameters written (replaced, loaded into, changed in place) since the program read them."""
        now = value_marks(module)
        return sorted(name for name, mark in now.items() if self.marks.get(name, mark) != mark)


_WATCHES: "weakref.WeakKeyDictionary[nn.Module, list[_Watch]]" = weakref.WeakKeyDictionary()


def refuse_if_behind(model: nn.Module, use: str) -> None:
    """Raise ModelOutOfDate when a program took ``model`` over and moved past it (usc.compile of the
    same model again: it would start from the values the model was first compiled with)."""
    for watcher in _WATCHES.get(model, ()):
        watcher.refuse(model, use)


def watch(model: nn.Module, program) -> None:
    """Guard ``model`` (the module given to usc.compile) against use after ``program`` trains past it:
    a forward pre-hook and a state_dict pre-hook refuse while it is behind; a load_state_dict into it
    brings it level again. A model built on meta (the only kind ``init=`` fills from a checkpoint) is
    not refused: it holds no values to mistake for trained ones until trained values are loaded in."""
    watcher = _Watch(model, program)
    _WATCHES.setdefault(model, []).append(watcher)
    program._watcher = watcher  # its own: a step checks the model against what this program read
    # usc's own traces (lint, plan, a second compile: it asks refuse_if_behind first) read no values
    model.register_forward_pre_hook(
        lambda module, args: None if torch.compiler.is_exporting() else watcher.refuse(module, "was called"))
    model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: watcher.refuse(module, "had its state_dict read"))
    model.register_load_state_dict_pre_hook(watcher.loading)
    model.register_load_state_dict_post_hook(watcher.loaded)
