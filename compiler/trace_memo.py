"""A memo of traces, off unless turned on: a test suite compiles the same small model under dozens of
plans, and each compile would trace it again (about half of this suite's time was torch.export
tracing models it had already traced).

``trace`` (compiler/trace.py) asks ``lookup`` first and ``store``s what it traced. A trace is reused only
for a model that is the same program: the key holds every module's class and every attribute it
carries (numbers, strings, configs, dataclasses, functions by identity, tensors with their values),
every parameter's and buffer's name, shape, dtype, device, requires_grad and tying, the inputs
(values included), the tracing options, and the global state tracing reads (default dtype, grad and
autocast modes, deterministic algorithms, usc's environment variables, the torch function modes
active). An attribute of any other kind (an object the key cannot describe, a closure, a hook)
makes the model unkeyable: it is traced every time. What the model printed and warned while traced
is replayed on every reuse.

A reused trace is a copy of the graph the first compile got (nodes and their metadata copied, the
submodules and constants shared: what every pass does before editing), in a fresh ``Traced``
record: a caller that edits its graph or sets a per-compile field (``batch_probe``) reaches neither
the memo nor another compile.

Turned on by ``memoize_traces(True)`` (the test suite's conftest does; ``USC_TRACE_MEMO=0`` there
turns it off). Nothing in usc's own API turns it on.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import types
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from usc.runtime.graph_code import lazy_graph_modules

from .ir import copy_graph_module

_MEMO: OrderedDict | None = None
_ENTRIES = 48  # the most recent traces kept (a test file reuses its own; older ones only hold memory)
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called")
_SKIP = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"} | set(_HOOK_DICTS)


class Unkeyable(Exception):
    """The model holds something the key cannot describe: it is traced every time."""


def memoize_traces(on: bool = True) -> None:
    """Turn the memo on (empty) or off (and drop what it holds)."""
    global _MEMO
    _MEMO = OrderedDict() if on else None


def enabled() -> bool:
    return _MEMO is not None


def _tensor(t: torch.Tensor) -> tuple:
    """Shape, dtype, device, requires_grad and (off the meta device) a digest of the values."""
    if type(t) not in (torch.Tensor, nn.Parameter):
        raise Unkeyable(f"a tensor of type {type(t).__name__}")
    head = ("tensor", tuple(t.shape), t.dtype, str(t.device), t.requires_grad, t.layout)
    if t.device.type == "meta":
        return head
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise Unkeyable(f"a {t.device.type} {t.layout} tensor")
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return head + (hashlib.sha1(data.numpy().tobytes()).hexdigest(),)


def _value(v: Any, depth: int = 0) -> Any:
    """A hashable description of ``v`` that differs where ``v`` could change a trace; Unkeyable if none."""
    if depth > 12:
        raise Unkeyable("nesting too deep")
    if v is None or isinstance(v, (bool, int, str, bytes, torch.dtype, torch.device, torch.Size, torch.layout,
                                   torch.memory_format)):
        return (type(v), v)
    if isinstance(v, float):
        return (float, repr(v))
    if isinstance(v, enum.Enum):
        return (type(v), v.name)
    if isinstance(v, torch.Tensor):
        return _tensor(v)
    if isinstance(v, (tuple, list)):
        return (type(v),) + tuple(_value(x, depth + 1) for x in v)
    if isinstance(v, (set, frozenset)):
        return (type(v),) + tuple(sorted(repr(_value(x, depth + 1)) for x in v))
    if isinstance(v, dict):
        return (type(v),) + tuple((_value(k, depth + 1), _value(x, depth + 1)) for k, x in v.items())
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType,
                      types.BuiltinMethodType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if getattr(v, "__closure__", None):
            raise Unkeyable(f"the closure {getattr(v, '__qualname__', v)}")
        return ("function", v)  # by identity: the same function object runs the same code
    if isinstance(v, types.MethodType):
        raise Unkeyable("a bound method held as an attribute")
    if isinstance(v, type):
        return _class(v)
    if isinstance(v, nn.Module):  # held outside the module tree (usc's own call wrapper holds the model so)
        return ("module", _module(v, depth + 1))
    if dataclasses.is_dataclass(v):
        return (type(v),) + tuple((f.name, _value(getattr(v, f.name), depth + 1)) for f in dataclasses.fields(v))
    if _is_config(v):
        return (type(v), _value({k: x for k, x in vars(v).items()}, depth + 1))
    raise Unkeyable(f"an attribute of type {type(v).__name__}")


_SHELL = {"__module__", "__doc__", "__qualname__", "__dict__", "__weakref__"}


def _class(cls: type):
    """A class by identity; one that only renames its bases (usc's call wrapper makes one per model,
    named after the model's class) by its name and bases."""
    if set(vars(cls)) <= _SHELL:
        return ("renamed", cls.__name__, cls.__module__, tuple(_class(b) for b in cls.__bases__))
    return ("class", cls)


def _is_config(v) -> bool:
    """A Hugging Face configuration (PretrainedConfig, GenerationConfig: plain attributes in their
    __dict__), recognised without importing transformers."""
    cls = type(v)
    return cls.__module__.startswith("transformers.") and any(c.__name__.endswith("Config") for c in cls.__mro__)


def _global_state() -> tuple:
    return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.are_deterministic_algorithms_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cpu"), torch.get_autocast_dtype("cuda"),
            tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("USC_"))),
            tuple(type(mode) for mode in torch.overrides._get_current_function_mode_stack()))


def _usc_own(hook) -> bool:
    """usc's guard of a model a program took over (usc/handover.py): it stands aside in traces. (The
    ``*_with_kwargs`` and ``always_called`` dicts hold flags of hooks found in the other dicts.)"""
    if isinstance(hook, bool):
        return True
    hook = getattr(hook, "hook", hook)  # torch's _WrappedHook
    return getattr(getattr(hook, "__func__", hook), "__module__", "") == "usc.handover"


def _module(model: nn.Module, depth: int = 0) -> tuple:
    """Every module's class and attributes, every parameter and buffer (values and tying) of ``model``."""
    modules = []
    for path, module in model.named_modules(remove_duplicate=False):
        if any(not _usc_own(hook) for name in _HOOK_DICTS for hook in (getattr(module, name, None) or {}).values()):
            raise Unkeyable(f"hooks on {path or 'the model'}")
        attrs = tuple((k, _value(v, depth + 1)) for k, v in vars(module).items() if k not in _SKIP)
        modules.append((path, _class(type(module)), attrs, tuple(sorted(module._non_persistent_buffers_set))))
    ids: dict[int, str] = {}
    tensors = []
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            tensors.append((kind, name, ids.setdefault(id(t), name), _tensor(t)))
    return tuple(modules), tuple(tensors)


def key(model: nn.Module, example_inputs: tuple, options: tuple):
    """The memo's key for tracing ``model(*example_inputs)`` with ``options``; None when unkeyable."""
    try:
        return (_module(model), _value(tuple(example_inputs)), _value(options), _global_state())
    except Unkeyable:
        return None


def lookup(k):
    """(traced, printed text, warnings) stored under ``k``, or None."""
    if _MEMO is None or k is None:
        return None
    hit = _MEMO.get(k)
    if hit is not None:
        _MEMO.move_to_end(k)
    return hit


def store(k, traced, printed: str, caught: list) -> None:
    if _MEMO is not None and k is not None:
        _MEMO[k] = (traced, printed, caught)
        while len(_MEMO) > _ENTRIES:
            _MEMO.popitem(last=False)


def fresh(traced):
    """A record of ``traced`` over a copy of its graph (the submodules and constants shared): whoever
    receives it may edit the graph or the record without reaching the memo or another compile."""
    with lazy_graph_modules():  # its Python generated on first call only (most are never called)
        gm = copy_graph_module(traced.gm)
    gm.meta = dict(getattr(traced.gm, "meta", {}))
    return dataclasses.replace(traced, gm=gm)


def replay_warnings(caught: list) -> None:
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
