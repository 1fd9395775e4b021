"""Casts recorded as the model wrote them.

The model is traced in float32, so ``h.to(torch.float32)`` and ``h.float()`` are no-ops at trace
time: torch returns ``h`` itself, and ``torch.export`` then records every later use of ``h`` as a
use of the cast (a Hugging Face RMSNorm upcasts its input, and the residual stream's add after the
norm reads "the cast"); torch's functionalization drops such casts altogether. Under dtype=bf16
those casts are the model's own precision (a norm's statistics, the loss's upcast logits;
``passes/compute_dtype.py`` reads them), so they must stay in the graph, each with exactly its own
uses.

While tracing, ``held_casts()`` turns such a cast into ``usc::held_cast`` (a new value, opaque to
functionalization); ``release_casts`` writes each back as ``aten.to.dtype`` afterwards, so a
float32 program runs them as the no-ops they are. A cast is a new value only where that is
invisible: ``writes_through_held_casts`` finds a later in-place write to the cast or to its source
(which eager torch would show through the alias), and the trace is then taken again without them.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

_NAMED = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
          torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16}


@torch.library.custom_op("usc::held_cast", mutates_args=())
def held_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cast to the dtype ``x`` already has, kept as a node while tracing (never run by a step)."""
    return x.to(dtype, copy=True)


@held_cast.register_fake
def _held_cast_fake(x, dtype):
    return torch.empty_like(x, dtype=dtype)


HELD = torch.ops.usc.held_cast.default


class held_casts(TorchFunctionMode):
    """Within it, a cast to a tensor's own dtype, with the dtype named, returns a held cast."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = _named_dtype(func, args, kwargs)
        if dtype is not None and isinstance(args[0], torch.Tensor) and args[0].dtype == dtype:
            return held_cast(args[0], dtype)
        return func(*args, **kwargs)


def _named_dtype(func, args, kwargs):
    """The dtype ``func`` casts to when it names one and changes nothing else; else None."""
    if func in _NAMED:
        return _NAMED[func] if not kwargs and len(args) == 1 else None
    if func is torch.Tensor.type:
        return args[1] if len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs else None
    if func is not torch.Tensor.to or not args or not isinstance(args[0], torch.Tensor):
        return None
    if kwargs.get("copy") or kwargs.get("memory_format") is not None:
        return None
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            return None  # ``x.to(other)``: other's dtype, which a compute dtype may change
        elif isinstance(a, (str, torch.device)):
            device = a
        else:
            return None  # non_blocking / copy given by position
    if device is not None and torch.device(device) != args[0].device:
        return None
    return dtype


def writes_through_held_casts(gm: fx.GraphModule) -> bool:
    """An in-place write, after a held cast, to the cast or to the value it casts: eager torch shows
    it through the alias, which a held cast (a new value) does not."""
    held: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is HELD:
            held |= {_storage(node), _storage(node.args[0])}
        elif _mutates(node) and _storage(node.args[0]) in held:
            return True
    return False


def release_casts(gm: fx.GraphModule) -> None:
    """Every held cast back to ``aten.to.dtype``."""
    for sub in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        held = [n for n in sub.graph.nodes if n.target is HELD]
        for node in held:
            node.target = torch.ops.aten.to.dtype
        if held:
            sub.recompile()


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable and bool(node.args)


def _storage(node) -> int | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None
