"""Models as people call them: the batch as they hold it, the loss where the model puts it.

A batch is a tuple (``model(*batch)``), a mapping (``model(**batch)``, a Hugging Face collator's
``{"input_ids", "attention_mask", "labels"}``) or one tensor; a tuple's elements may themselves be
dicts, lists or tuples of tensors (``forward(self, batch)`` taking a dict as one argument). The
compiled program takes a flat tuple of tensors (what dp slices along dim 0, mb chunks, cp splits
along dim 1): ``BatchLayout`` maps one to the other. ``Trainable`` is the module usc traces: it calls the user's model the way its batch
says, with the training defaults (no KV cache), and returns the one scalar loss found in the output
by ``LOSS_RULES`` — so logits, router logits and caches are never graph outputs and are neither kept
alive nor communicated.

>>> import torch
>>> layout = BatchLayout.of({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.zeros(2, 3)})
>>> layout.keys
('input_ids', 'labels')
"""

from __future__ import annotations

import contextlib

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from usc.compiler.errors import TraceError

# A collator's all-ones attention_mask says "no padding": the model is called without it, so it
# builds no [B, 1, S, S] mask (attention keeps its causal fast path, cp needs no mask slicing).
DROPPABLE_MASKS = ("attention_mask",)
# Keyword arguments a model's forward accepts that usc sets for training when the batch does not:
# Hugging Face models return a KV cache by default, which training never reads.
TRAINING_KWARGS = {"use_cache": False}


class BatchError(ValueError):
    """A step's batch does not have the structure the program was compiled for."""


@dataclass(frozen=True)
class BatchLayout:
    """How a batch as the user holds it maps to the flat tuple the program takes.

    kind: "tuple" (positional), "mapping" (keyword) or "tensor" (one positional input);
    keys: the mapping's keys in order (their values are the flat tuple, tensors or not);
    dropped: keys left out because their value is an all-ones attention mask;
    tree: a tuple whose elements hold containers (a dict forward takes as one argument): its
    structure (a pytree spec), the flat tuple being its leaves, each named in ``paths``
    (``[0]['input_ids']``); None for a flat tuple."""

    kind: str
    keys: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    tree: object = None
    paths: tuple[str, ...] = ()

    @staticmethod
    def of(batch) -> "BatchLayout":
        if isinstance(batch, Mapping):
            dropped = tuple(k for k in batch if k in DROPPABLE_MASKS and _all_ones(batch[k]))
            return BatchLayout("mapping", tuple(k for k in batch if k not in dropped), dropped)
        if isinstance(batch, torch.Tensor):
            return BatchLayout("tensor")
        if any(isinstance(v, (Mapping, tuple, list)) for v in batch):
            leaves, tree = tree_flatten_with_path(tuple(batch))
            return BatchLayout("tuple", tree=tree, paths=tuple(keystr(path) for path, _ in leaves))
        return BatchLayout("tuple")

    @property
    def nested(self) -> bool:
        return self.tree is not None

    def flatten(self, batch) -> tuple:
        """The flat tuple for ``batch``; a batch of another structure is a BatchError naming the difference."""
        if self.kind == "mapping":
            return self._flatten_mapping(batch)
        if self.nested:
            return self._flatten_nested(batch)
        if isinstance(batch, Mapping):
            raise BatchError(f"the program was compiled for a {self.kind} batch but got a mapping with keys "
                             f"{sorted(batch)}: pass batches of one structure")
        return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)

    def _flatten_mapping(self, batch) -> tuple:
        if not isinstance(batch, Mapping):
            raise BatchError(f"the program was compiled for a mapping batch with keys {list(self.keys)} but got a "
                             f"{type(batch).__name__}")
        if set(batch) - set(self.dropped) != set(self.keys):
            raise BatchError(f"batch keys {sorted(batch)} differ from the compiled ones "
                             f"{sorted(self.keys + self.dropped)}")
        for key in self.dropped:
            if key in batch and not _all_ones(batch[key]):
                raise BatchError(f"'{key}' masks padding in this batch, but the program was compiled from a batch "
                                 f"whose '{key}' was all ones (no padding) and leaves it out: compile with an "
                                 "example batch that pads")
        return tuple(batch[k] for k in self.keys)

    def _flatten_nested(self, batch) -> tuple:
        if isinstance(batch, Mapping) and self.tree.num_children == 1 and self.tree.child(0).type is not None \
                and issubclass(self.tree.child(0).type, Mapping):
            batch = (batch,)  # step(batch) for a forward taking the one dict: the compiled layout says which
        batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        leaves, tree = tree_flatten(batch)
        if tree != self.tree:
            got = tuple(keystr(path) for path, _ in tree_flatten_with_path(batch)[0])
            raise BatchError(f"the program was compiled for a batch holding {', '.join(self.paths)} but this batch "
                             f"holds {', '.join(got) or 'nothing'}: pass batches of one structure")
        return tuple(leaves)

    def arguments(self, flat: tuple, extra: dict) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of the model's call on ``flat``."""
        if self.kind == "mapping":  # the batch's own keys win over the training defaults
            return (), {**extra, **dict(zip(self.keys, flat))}
        if self.nested:
            return tuple(tree_unflatten(list(flat), self.tree)), dict(extra)
        return tuple(flat), dict(extra)

    def input_names(self) -> tuple[str, ...]:
        """Each flat input as the user names it: 'input_ids' (a mapping's key), batch[0]['tokens'], batch[i]."""
        if self.kind == "mapping":
            return tuple(repr(k) for k in self.keys)
        return tuple(f"batch{p}" for p in self.paths)

    def call(self, model: nn.Module, flat: tuple, extra: dict):
        args, kwargs = self.arguments(flat, extra)
        return model(*args, **kwargs)


def _all_ones(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "meta" and bool((value == 1).all())


# =============================================================================== the loss
def _is_scalar_loss(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _loss_entry(output):
    """``output.loss`` or ``output["loss"]`` (Hugging Face's ModelOutput has both), else None."""
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None) if not isinstance(output, (tuple, list, torch.Tensor)) else None


def _one_scalar(output) -> torch.Tensor | None:
    if not isinstance(output, (tuple, list)):
        return None
    found = [v for v in output if _is_scalar_loss(v)]
    return found[0] if len(found) == 1 else None


# Where a model puts its loss, tried in order: the output itself, its `loss` (HF ModelOutput, a
# dict), the one scalar floating tensor of a tuple (nanoGPT's `(logits, loss)`).
LOSS_RULES: tuple[tuple[str, Callable], ...] = (
    ("a scalar tensor", lambda out: out if _is_scalar_loss(out) else None),
    ("`loss` of the output", lambda out: v if _is_scalar_loss(v := _loss_entry(out)) else None),
    ("the one scalar floating tensor of a tuple", _one_scalar),
)


def loss_of(output, model_name: str) -> torch.Tensor:
    for _, rule in LOSS_RULES:
        loss = rule(output)
        if loss is not None:
            return loss
    raise TraceError(f"{model_name}.forward returned {describe(output)}: usc found no loss in it (looked for "
                     f"{'; '.join(name for name, _ in LOSS_RULES)})\n  fix: put the labels in the batch so the "
                     "model computes its loss (Hugging Face: labels=...), or pass loss_fn=(output, target) -> loss")


def describe(value, depth: int = 0) -> str:
    """A short account of what a model returned: types, tensor shapes, dict keys."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if depth > 1:
        return type(value).__name__
    if isinstance(value, Mapping):
        items = ", ".join(f"{k}={describe(v, depth + 1)}" for k, v in value.items())
        return f"{type(value).__name__}({items})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(describe(v, depth + 1) for v in value)})"
    return type(value).__name__ if value is not None else "None"


# ============================================================================ the traced module
class Trainable(nn.Module):
    """The module usc traces: the user's model called as its batch says, returning the loss.

    The model's children, parameters and buffers are registered under their own names, so module
    paths and state_dict names stay the model's. With ``loss_fn`` the loss is
    ``loss_fn(model(...), target)``, the target being the batch's last element (tuple) or its
    ``labels`` (mapping, not passed to the model)."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None = None) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in model.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        self._wrapped = (model,)
        self._loss_fn = loss_fn
        self.layout: BatchLayout | None = None
        self._extra = _training_kwargs(model)
        self.training = model.training  # the wrapper reports the model's own train()/eval() state

    @property
    def user_model(self) -> nn.Module:
        """The model the user passed, whose forward this wrapper calls (kept out of its submodules)."""
        return self._wrapped[0]

    def flatten(self, batch) -> tuple:
        """The flat tuple of ``batch`` (the first batch seen fixes the layout)."""
        if self.layout is None:
            self.layout = BatchLayout.of(batch)
        return self.layout.flatten(batch)

    def check_call(self, flat: tuple) -> None:
        """A BatchError, before tracing, when the model's forward cannot take the batch ``flat`` (a
        missing or unexpected argument): the model's signature and what the batch holds."""
        model, layout = self.user_model, self.layout or BatchLayout("tuple")
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):
            return
        called, what = layout, "the batch"
        if self._loss_fn is not None:
            inputs, _ = _split_target(layout, flat)
            called, flat = inputs.layout, inputs.flat
            what = "the batch less its target (loss_fn= takes the last element, or 'labels')"
        args, kwargs = called.arguments(flat, self._extra)
        given = ("keys " + ", ".join(repr(k) for k in called.keys) if called.kind == "mapping"
                 else f"{len(args)} positional value{'s' * (len(args) != 1)}")
        name = type(model).__name__
        shown = ", ".join(str(p.replace(annotation=p.empty, default=p.empty) if p.default is p.empty
                              else p.replace(annotation=p.empty)) for p in signature.parameters.values())
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            one = ("; a forward that takes the dict as one argument gets it inside a tuple (example_inputs=(batch,))"
                   if called.kind == "mapping" and _positional(signature) == 1 else "")
            raise BatchError(f"{name}.forward({shown}) cannot take {what} ({given}): {err}; pass example_inputs "
                             f"(and each step's batch) as {name}'s forward takes them: a tuple for its "
                             f"positional arguments, a dict for keyword arguments{one}") from None
        for param, value in bound.arguments.items():
            if isinstance(value, Mapping) and value and set(value) <= set(signature.parameters) \
                    and any(isinstance(v, torch.Tensor) for v in value.values()):
                keys = ", ".join(repr(k) for k in value)
                raise BatchError(f"{name}.forward({shown}) takes {keys} as arguments of their own, but {what} "
                                 f"passes a dict of them as forward's '{param}': pass the dict itself "
                                 "(example_inputs=batch, step(batch)), which usc calls as model(**batch)")

    def batch_hint(self) -> str:
        """For a trace error: the forward arguments the batch fills with a whole dict (a collator's
        batch passed inside a tuple, where forward may take its keys as arguments of their own)."""
        layout = self.layout
        if layout is None or not layout.nested:
            return ""
        try:
            names = list(inspect.signature(self.user_model.forward).parameters)
        except (TypeError, ValueError):
            names = []
        given = [names[i] if i < len(names) else f"batch[{i}]" for i, child in enumerate(layout.tree.children())
                 if child.type is not None and issubclass(child.type, Mapping)]
        if not given:
            return ""
        return (f"the batch passes a dict as forward's {', '.join(repr(g) for g in given)}; if forward takes the "
                "dict's keys as arguments of their own, pass the dict itself (example_inputs=batch, step(batch)), "
                "which usc calls as model(**batch)")

    def forward(self, *flat):
        model, layout = self.user_model, self.layout or BatchLayout("tuple")
        with _root_state_of(self, model):
            if self._loss_fn is None:
                return loss_of(layout.call(model, flat, self._extra), type(model).__name__)
            inputs, target = _split_target(layout, flat)
            return self._loss_fn(inputs.call(model, inputs.flat, self._extra), target)


def _positional(signature: inspect.Signature) -> int:
    """How many positional parameters a forward has (any number for ``*args``)."""
    kinds = [p.kind for p in signature.parameters.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return -1
    return sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)


@contextlib.contextmanager
def _root_state_of(wrapper: nn.Module, model: nn.Module):
    """The model's own root-level parameters and buffers are the wrapper's while it runs: the tracer
    swaps the wrapper's (for graph inputs), and the model must read and write those, not the
    originals (which would become constants: never trained, their writes lost)."""
    saved = {kind: dict(getattr(model, kind)) for kind in ("_parameters", "_buffers")}
    for kind, own in saved.items():
        ours = getattr(wrapper, kind)
        getattr(model, kind).update({name: ours[name] for name in own if name in ours})
    try:
        yield
    finally:
        for kind, own in saved.items():
            getattr(model, kind).update(own)


@dataclass(frozen=True)
class _Inputs:
    layout: BatchLayout
    flat: tuple

    def call(self, model, flat, extra):
        return self.layout.call(model, flat, extra)


def _split_target(layout: BatchLayout, flat: tuple) -> tuple[_Inputs, object]:
    """(the model's inputs, the loss target): the last element, or a mapping's ``labels``."""
    if layout.kind == "mapping" and "labels" in layout.keys:
        i = layout.keys.index("labels")
        keys = layout.keys[:i] + layout.keys[i + 1:]
        return _Inputs(BatchLayout("mapping", keys), flat[:i] + flat[i + 1:]), flat[i]
    if layout.nested:  # the last positional argument, whatever it holds
        args = tree_unflatten(list(flat), layout.tree)
        inputs = BatchLayout.of(args[:-1])
        return _Inputs(inputs, inputs.flatten(args[:-1])), args[-1]
    return _Inputs(BatchLayout("tuple"), flat[:-1]), flat[-1]


def _training_kwargs(model: nn.Module) -> dict:
    """TRAINING_KWARGS the model's forward accepts (passed per call: the model's config is untouched)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in TRAINING_KWARGS.items() if k in params}


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Paths of the layers Hugging Face's ``gradient_checkpointing_enable()`` checkpoints: its
    ``GradientCheckpointingLayer`` blocks with the flag set (the flag acts only while training; the
    model class carries one too, for its own bookkeeping)."""
    if not model.training:
        return []
    return [path for path, m in model.named_modules() if vars(m).get("gradient_checkpointing") is True
            and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]


def with_checkpointed_layers(plan, model: nn.Module):
    """``plan`` with a ``recompute`` rule for each checkpointed layer, so the layers the model
    checkpoints are recomputed in backward on the mesh too. Put before the written rules: a written
    rule on the same module wins."""
    from usc.dsl.plan import Action, Rule

    paths = checkpointed_modules(model)
    if not paths:
        return plan
    return replace(plan, rules=tuple(Rule(p, (Action("recompute"),)) for p in paths) + tuple(plan.rules))


def trainable(model: nn.Module, loss_fn: Callable | None = None) -> Trainable:
    """``model`` wrapped for tracing; the wrapper's class carries the model's class name, so every
    message and report names the user's model."""
    cls = type(type(model).__name__, (Trainable,), {"__module__": Trainable.__module__,
                                                     "__doc__": Trainable.__doc__})
    return cls(model, loss_fn)


__all__ = ["BatchLayout", "BatchError", "Trainable", "trainable", "with_checkpointed_layers", "loss_of", "describe", "LOSS_RULES"]
