"""Tracing: turn a user's ``nn.Module`` into one ATen-level torch.fx graph with global shapes.

Why ``torch.export.export(strict=False)`` and not ``torch.fx.symbolic_trace``: real models
(Hugging Face's Llama for one) defeat symbolic tracing ("co_varnames is too small"), while
non-strict export traces them. Export's training IR keeps the ops the sharding rules care about
(``aten.linear``, ``aten.embedding``, ``aten.scaled_dot_product_attention``,
``aten.cross_entropy_loss``) instead of decomposing them, lifts parameters and buffers to graph
inputs (so the runtime feeds each rank its own shards), records every node's module path in
``nn_module_stack`` and its global shape as a fake tensor in ``meta["val"]``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import tempfile
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch.export.graph_signature import InputKind

from .errors import CompileError, TraceError
from .source_info import TORCH_DIR, USC_DIRS, module_path, user_source  # noqa: F401 (re-exported)
from .casts import held_casts, release_casts, writes_through_held_casts
from .functional import distinct_inputs, explicit_writes, functionalize, masked_writes_as_where, user_output_specs
from .inline_regions import inline_regions
from .moe import MoEBlock, patched
from . import trace_memo



@dataclass(frozen=True)
class StateInput:
    """A parameter, buffer or constant lifted to a graph input."""

    placeholder: str
    name: str  # state_dict name (the first one, when tied)
    kind: str  # "param" | "buffer" | "constant"
    aliases: tuple[str, ...] = ()  # every state_dict name of this tensor (tied weights)
    trainable: bool = False  # a parameter with requires_grad


@dataclass
class Traced:
    gm: fx.GraphModule
    state: list[StateInput]
    user_inputs: list[str]
    module_types: dict[str, str]
    model_name: str
    constants: dict = field(default_factory=dict)  # lifted tensor constants by name
    # (two-layer trace, three-layer trace, layers) when repeated layers were stamped (compiler/stamp.py)
    stamped: tuple = field(default=(), compare=False, repr=False)
    # the same model traced on two samples, when a microbatch holds one: the batch-coupling analysis
    # shards the batch dim, which a dim of size 1 cannot show (passes/batch_coupling.py)
    batch_probe: object = field(default=None, compare=False, repr=False)
    # () -> (graph, samples, lifted constants): the model traced on one sample more than a microbatch
    # holds, on demand (the microbatch analysis tells a number the batch's size gives from a fixed one by it)
    resized_probe: object = field(default=None, compare=False, repr=False)
    # () -> Traced: the model on twice the microbatch's samples, on demand (a microbatch holding one
    # group of the samples a strided slice pairs cannot show a split into groups)
    doubled_probe: object = field(default=None, compare=False, repr=False)

    def placeholder(self, name: str) -> fx.Node:
        return next(n for n in self.gm.graph.nodes if n.op == "placeholder" and n.name == name)


def lifted_constants(traced: Traced) -> dict[str, torch.Tensor]:
    """The tensor constants the trace lifted to inputs (``torch.tensor(n)`` in forward), by placeholder."""
    return {s.placeholder: traced.constants[s.name] for s in traced.state
            if s.kind == "constant" and s.name in traced.constants}


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device) if device.type == "meta" else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _failing_module(exc: BaseException, model: nn.Module) -> tuple[str, str]:
    """(module path, 'file:line') of the innermost model module whose forward raised."""
    paths = {id(m): name for name, m in model.named_modules()}
    user = getattr(model, "user_model", None)  # usc's loss wrapper: the user's model is its root
    if user is not None:
        paths.setdefault(id(user), "")
    found = ("", "")
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    frames = [f for e in reversed(chain) for f in traceback.walk_tb(e.__traceback__)]
    for frame, lineno in frames:
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        library = frame.f_code.co_filename.startswith((TORCH_DIR,) + USC_DIRS)  # torch's or usc's own frames
        if isinstance(owner, nn.Module) and id(owner) in paths and not library:
            found = (paths[id(owner)] or "<root>", f"{os.path.basename(frame.f_code.co_filename)}:{lineno}")
    return found


def _trace_error(exc: BaseException, model: nn.Module) -> TraceError:
    where, line = _failing_module(exc, model)
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = str(exc)
    if "data-dependent" in text or "Could not guard" in text or "GuardOnDataDependent" in type(exc).__name__:
        fix = ("Python control flow that depends on tensor values cannot be traced: replace the `if` on a "
               "tensor with torch.where, or move it out of forward")
    else:
        fix = "make forward traceable by torch.export (no data-dependent Python control flow, no .item())"
    at = f" in module '{where}' ({line})" if where else ""
    hint = getattr(model, "batch_hint", lambda: "")()  # a dict passed where forward may want its keys
    error = TraceError(f"usc could not trace {type(model).__name__}{at}: {reason}\n  fix: {fix}"
                       + (f"\n  note: {hint}" if hint else ""))
    error.__cause__ = exc
    return error


def _state_inputs(exported, model: nn.Module) -> list[StateInput]:
    aliases: dict[int, list[str]] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        aliases.setdefault(id(tensor), []).append(name)
    by_name = {n: names for names in aliases.values() for n in names}
    kinds = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant"}
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for spec in exported.graph_signature.input_specs:
        if spec.kind in kinds:
            trainable = spec.kind == InputKind.PARAMETER and params[spec.target].requires_grad
            out.append(StateInput(spec.arg.name, spec.target, kinds[spec.kind], tuple(by_name.get(spec.target, ())),
                                  trainable))
    return out


@contextlib.contextmanager
def _quiet_torch_logs():
    """Export logs guard failures and whole graphs at WARNING; our TraceError says it better."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export", "torch._dynamo"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _Held:
    def __init__(self, file) -> None:
        self.file = file

    def replay(self) -> str:
        """Pass on what the model itself printed while it was traced (and return it)."""
        self.file.seek(0)
        text = self.file.read()
        self.file.close()
        if text:
            sys.stderr.write(text)
        return text


@contextlib.contextmanager
def _held_output():
    """Hold stdout/stderr (at the file-descriptor level) while tracing: on failure torch prints the
    partial graph before raising, which would bury our TraceError. A model's own prints are
    replayed after a successful trace."""
    sys.stdout.flush()
    sys.stderr.flush()
    file = tempfile.TemporaryFile(mode="w+")
    saved = [os.dup(1), os.dup(2)]
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    try:
        with contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
            yield _Held(file)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _attribute_wrapper_frames(gm: fx.GraphModule, source: str) -> None:
    """Nodes traced inside usc's own loss wrapper come from the user's loss_fn: say so."""
    for node in gm.graph.nodes:
        if not user_source(node) and any(d in (node.meta.get("stack_trace") or "") for d in USC_DIRS):
            node.meta["usc_source"] = source


def _mask_kept(mask, is_causal=None, size=None) -> bool:
    """torch.nn's ``_detect_is_causal_mask`` while tracing: a hint the caller gave is kept; a mask given
    without one is kept as the mask (False). torch compares the mask's values with a causal mask to
    decide, which export cannot (the values are not known while tracing) -- every causal LM built on
    ``nn.TransformerEncoder`` with its mask made in forward failed to trace there. Keeping the mask
    computes the same attention, and usc's attention-mask pass turns a mask it proves causal into
    ``is_causal=True`` anyway (passes/attention_masks.py)."""
    return bool(is_causal) if is_causal is not None else False


def _gaussian_nll_loss(input, target, var, full: bool = False, eps: float = 1e-6, reduction: str = "mean"):
    """``F.gaussian_nll_loss`` while tracing: the same loss, its variance clamped to ``eps`` without
    a gradient through the clamp, as torch computes it. torch first raises on a negative variance, a
    check of the values that export cannot trace (every model with ``nn.GaussianNLLLoss`` failed to
    trace); here a negative variance makes the loss NaN instead, so the step is refused (NonFiniteLoss)
    and the weights stay as they were."""
    if isinstance(var, (int, float)):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = torch.full_like(input, float(var))
    else:
        var = torch.where(var < 0, var.new_full((), float("nan")), var)
    if var.shape != input.shape:
        if var.shape == input.shape[:-1]:  # one variance per row of features
            var = var.unsqueeze(-1)
        elif var.dim() != input.dim() or [v for i, v in zip(input.shape, var.shape) if i != v] != [1]:
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def _phimoe_multiplier(scores, multiplier, selected_experts, masked_gates, mask_for_one):
    """transformers' ``PhimoeMultiplier`` (PhiMoE's sparse-mixer gradient estimator) as an expression
    whose derivative is its backward: the values ``multiplier * mask_for_one``; to ``scores`` the
    gradient ``g * multiplier * (one_hot(selected_experts) - masked_gates)``, to the rest none. Traced
    as the Function, usc would differentiate its forward (the gradient to ``multiplier`` instead)."""
    chosen = torch.zeros_like(scores).scatter_add(-1, selected_experts, torch.ones_like(scores).narrow(
        -1, 0, selected_experts.shape[-1]))
    direction = (chosen - masked_gates).detach()
    estimate = multiplier.detach() * (direction * scores).sum(-1, keepdim=True)
    return (multiplier * mask_for_one).detach() + (estimate - estimate.detach())


# autograd.Functions of libraries people bring whose backward is not their forward's derivative, as
# traceable expressions with that backward: (module, class) -> the expression, applied in the
# Function's place while the model is traced (``_gradient_customisations``)
GRADIENT_FORMS = {("transformers.models.phimoe.modeling_phimoe", "PhimoeMultiplier"): _phimoe_multiplier}


@contextlib.contextmanager
def _traceable_torch_modules():
    """torch.nn helpers whose value checks export cannot trace, replaced by traceable equivalents for
    the trace (``_mask_kept``, ``_gaussian_nll_loss``)."""
    from torch.nn import functional
    from torch.nn.modules import transformer

    saved = transformer._detect_is_causal_mask, functional.gaussian_nll_loss
    transformer._detect_is_causal_mask, functional.gaussian_nll_loss = _mask_kept, _gaussian_nll_loss
    try:
        yield
    finally:
        transformer._detect_is_causal_mask, functional.gaussian_nll_loss = saved


# ------------------------------------------------------------------ Python state forward writes
_SCALARS = (torch.Tensor, bool, int, float)
_TORCH_OWN = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping (hooks, training)


def _modules_of(model: nn.Module) -> dict[str, nn.Module]:
    """{path: module} of the model usc traces, the user's own model at the root (usc's loss wrapper
    holds it outside its submodules)."""
    modules = dict(model.named_modules())
    user = getattr(model, "user_model", None)
    if user is not None:
        modules[""] = user
    return modules


def _python_state(model: nn.Module) -> dict[tuple[str, str], object]:
    """{(module path, attribute): value} of every plain attribute of the model's modules that holds a
    tensor (not a parameter or buffer), a number or None: what forward could keep across calls."""
    out = {}
    for path, module in _modules_of(model).items():
        for name, value in vars(module).items():
            if name not in _TORCH_OWN and (value is None or isinstance(value, _SCALARS)):
                out[(path, name)] = value
    return out


def _global_state(model: nn.Module) -> dict[tuple[str, str], object]:
    """{(Python module, name): value} of every module-level name holding a tensor, a number, a flag or
    None in the Python modules that define the model's classes (not torch's or usc's): what forward
    could rebind with ``global`` and read back next call."""
    names = {cls.__module__ for module in _modules_of(model).values() for cls in type(module).__mro__}
    out = {}
    for name in sorted(names):
        if name.startswith(("torch.", "usc.", "builtins")) or name == "torch":
            continue
        python_module = sys.modules.get(name)
        for key, value in vars(python_module).items() if python_module is not None else ():
            if not key.startswith("__") and (value is None or isinstance(value, _SCALARS)) \
                    and not isinstance(value, nn.Parameter):
                out[(name, key)] = value
    return out


def _rebound(before: dict, now: dict) -> list:
    """The names forward rebound; one None before is a cache forward fills on first use, not listed."""
    return [key for key, value in before.items() if value is not None and key in now and _changed(value, now[key])]


def _restore_globals(before: dict, rebound: list) -> None:
    """Module-level names as they were before the trace: a name forward rebound (refused) gets its
    value back, and a cache forward filled (None before) with a tensor of the trace -- a fake one,
    that the model's next eager call would read -- is emptied, to be filled afresh."""
    for (name, key), value in before.items():
        python_module = sys.modules.get(name)
        now = getattr(python_module, key, None) if python_module is not None else None
        if (name, key) in rebound or (value is None and isinstance(now, torch.Tensor)):
            setattr(python_module, key, value)


def _changed(before, after) -> bool:
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        return before is not after
    if after is None or not isinstance(after, _SCALARS):
        return False  # a value forward clears, or keeps for inspection as another type: not read back as state
    return type(before) is not type(after) or before != after


@contextlib.contextmanager
def _host_state_kept(model: nn.Module):
    """Refuses a model whose forward changes host state the traced program cannot replay: a plain
    attribute or a module-level name it could read again next call (a counter, ``self.stat =
    h.mean(0).detach()``, ``global STEP; STEP += 1``), or a draw from Python's or NumPy's global generator (a layer drop by ``random.random()``). usc traces
    forward and replays that program each step, so the attribute keeps its traced value and the draw
    its traced outcome: the model would train differently with no error (torch's export restores
    attributes and only warns, for tensors)."""
    before, generators, globals_before = _python_state(model), _host_generators(), _global_state(model)
    seen: list = []
    drew: list = []
    rebound: list = []

    def look(module, args, output):
        now = _python_state(model)
        seen.extend(key for key, value in before.items() if key in now and _changed(value, now[key]))
        drew.extend(name for name, state in _host_generators().items() if not _same_state(state, generators[name]))
        rebound.extend(_rebound(globals_before, _global_state(model)))

    handle = model.register_forward_hook(look)
    try:
        yield
    finally:
        handle.remove()
        _restore_globals(globals_before, rebound)
    if drew:
        raise TraceError(
            f"{type(getattr(model, 'user_model', model)).__name__}.forward draws from {drew[0]}: usc traces "
            "forward once and replays that program every step, so the draw made while tracing would be made "
            "again every step (a layer always dropped or always kept, the same noise) -- a different model with "
            "no error\n  fix: draw with torch (torch.rand, torch.bernoulli, nn.Dropout), which usc draws anew "
            "every step; a random layer drop as torch.where(torch.rand(()) < p, h, h + layer(h))")
    if rebound:
        where, name = rebound[0]
        raise TraceError(
            f"{type(getattr(model, 'user_model', model)).__name__}.forward sets the module-level name `{name}` of "
            f"{where} (it held {_describe(globals_before[(where, name)])} before the call): usc traces forward once "
            "and replays that program every step, so a global forward changes keeps its traced value (a step "
            "counter that never counts, a schedule that never moves) and the model would train differently from "
            "one device's with no error\n"
            f"  fix: keep it as a buffer of the model written in place (self.register_buffer('{name}', ...) once, "
            f"then self.{name}.add_(1) in forward), or set it outside forward, between steps, and pass what "
            "forward needs as an input")
    if seen:
        path, name = seen[0]
        owner = f"{type(model).__name__}" + (f" module '{path}'" if path else "")
        raise TraceError(
            f"{owner} sets its attribute `{name}` in forward (it held {_describe(before[(path, name)])} before the "
            "call): usc traces forward once and replays that program every step, so an attribute forward changes "
            "keeps its traced value and the model would train differently from one device's with no error\n"
            f"  fix: keep it as a buffer written in place (self.register_buffer('{name}', ...) once, then "
            f"self.{name}.copy_(...) or .add_(1) in forward), or compute it outside forward (a value kept only "
            "to look at later would never be updated: drop it from forward)")


def _host_generators() -> dict[str, object]:
    """The states of the random generators torch does not trace: Python's and NumPy's global ones."""
    import random

    import numpy

    return {"Python's `random` module": random.getstate(), "NumPy's global generator (np.random)":
            numpy.random.get_state()}


def _same_state(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):  # NumPy's key array
        return hasattr(b, "shape") and a.shape == b.shape and bool((a == b).all())
    return a == b


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


# ------------------------------------------------------------------ gradients forward customises
class _Applied(NamedTuple):
    args: tuple
    kwargs: dict
    where: str


def _user_frame(depth: int = 2) -> str:
    """'file:line' of the first caller outside torch and usc."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith((TORCH_DIR,) + USC_DIRS):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else ""


@contextlib.contextmanager
def _gradient_customisations():
    """Records, while the model is traced, each ``torch.autograd.Function`` subclass applied (not
    torch's or usc's own: their backward is their forward's derivative) and each gradient hook
    forward registers on a tensor: the traced program holds neither (usc differentiates the ops the
    forward ran), so ``_refuse_lost_gradients`` checks them after the trace. A Function of
    ``GRADIENT_FORMS`` is applied as its expression instead."""
    from torch.autograd.function import Function

    applied: dict[type, _Applied] = {}
    hooks: list[str] = []
    apply, register_hook = Function.__dict__["apply"], torch.Tensor.register_hook

    def recording_apply(cls, *args, **kwargs):
        form = GRADIENT_FORMS.get((cls.__module__, cls.__qualname__))
        if form is not None:
            return form(*args, **kwargs)
        if cls not in applied and not cls.__module__.startswith(("torch.", "usc.")):
            applied[cls] = _Applied(args, kwargs, _user_frame())
        return apply.__func__(cls, *args, **kwargs)

    def recording_hook(self, hook):
        caller = sys._getframe(1)  # torch's and usc's own hooks are theirs to keep
        if not caller.f_code.co_filename.startswith((TORCH_DIR,) + USC_DIRS):
            hooks.append(f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
        return register_hook(self, hook)

    Function.apply, torch.Tensor.register_hook = classmethod(recording_apply), recording_hook
    try:
        yield applied, hooks
    finally:
        Function.apply, torch.Tensor.register_hook = apply, register_hook


def _hooks_on_the_model(model: nn.Module) -> list[str]:
    """The backward hooks the model carries (a module's full backward or backward pre-hook, a
    parameter's gradient or post-accumulate hook; torch's global ones): torch runs them in backward,
    the program usc traces holds none of them (usc's own gradient-ready hooks are not the model's)."""
    from torch.nn.modules import module as torch_module

    found = [f"a global module backward hook ({kind})" for kind in ("_global_backward_hooks",
             "_global_backward_pre_hooks") if getattr(torch_module, kind, None)]
    for path, module in _modules_of(model).items():
        if module._backward_hooks or module._backward_pre_hooks:
            found.append(f"module '{path or '<root>'}' has a backward hook (register_full_backward_hook or "
                         "register_full_backward_pre_hook)")
    for name, param in model.named_parameters():
        if getattr(param, "_backward_hooks", None):
            found.append(f"parameter '{name}' has a gradient hook (register_hook)")
        after = getattr(param, "_post_accumulate_grad_hooks", None) or {}
        if any(not type(getattr(h, "__self__", None)).__module__.startswith("usc.") for h in after.values()):
            found.append(f"parameter '{name}' has a post-accumulate-grad hook")
    return found


def _refuse_lost_gradients(model: nn.Module, applied: dict, hooks: list[str]) -> None:
    name = type(getattr(model, "user_model", model)).__name__
    carried = _hooks_on_the_model(model)
    if carried:
        raise TraceError(
            f"{name}: {carried[0]}{f' (and {len(carried) - 1} more)' if len(carried) > 1 else ''}: usc "
            "differentiates the program it traced, which runs no hook in backward, so the gradient the hook "
            "changes would pass unchanged -- a different model with no error\n  fix: remove the hook before "
            "compiling and write the change into forward with detach (h = h.detach() + s * (h - h.detach()) "
            "has h's values and s times its gradient), or clip by norm with step(..., max_grad_norm=)")
    if hooks:
        raise TraceError(
            f"{name}.forward registers a gradient hook on a tensor ({hooks[0]}): usc differentiates the program "
            "it traced, which holds no hook, so the gradient the hook changes would pass unchanged -- a different "
            "model with no error\n  fix: write the change into forward with detach: h = h.detach() + s * (h - "
            "h.detach()) has h's values and s times its gradient")
    for cls, call in applied.items():
        problem = _backward_problem(cls, call)
        if problem is not None:
            raise TraceError(
                f"{name}.forward applies the autograd.Function {cls.__qualname__} ({call.where}), {problem}: usc "
                "differentiates the forward it traced, so the Function's own backward is not run\n  fix: where the "
                "backward is meant to differ from the forward's derivative (a straight-through estimator, a "
                "gradient reversal), write it with detach: f(x).detach() + g(x) - g(x).detach() has f's values "
                "and g's gradient (x + (torch.round(x) - x).detach() rounds with an identity gradient)")


class _PlainContext:
    """The ``ctx`` a Function's forward is called with to differentiate it directly."""

    def __init__(self, inputs) -> None:
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in inputs)
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _backward_problem(cls, call: _Applied) -> str | None:
    """None where the Function's backward is its forward's derivative on random inputs of the traced
    shapes (a fused kernel's), else what differs or why it could not be checked."""
    from torch.autograd.function import Function
    from torch.utils._pytree import tree_flatten, tree_map

    def real(a):
        if not isinstance(a, torch.Tensor):
            return a
        if a.device.type == "meta" or (a.device.type == "cuda" and not torch.cuda.is_available()):
            raise _Unchecked(f"its inputs are on {a.device.type}")
        if a.is_floating_point():
            return torch.randn(tuple(a.shape), dtype=a.dtype, device=a.device).requires_grad_(a.requires_grad)
        return torch.zeros(tuple(a.shape), dtype=a.dtype, device=a.device)

    def differentiable(tree):
        return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]

    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)
            inputs, kwargs = tree_map(real, call.args), tree_map(real, call.kwargs)
            wrt = differentiable(inputs)
            if not wrt:
                return None
            own = differentiable(Function.__dict__["apply"].__func__(cls, *inputs, **kwargs))
            direct = differentiable(cls.forward(*inputs, **kwargs) if _has_setup_context(cls) else
                                    cls.forward(_PlainContext(inputs), *inputs, **kwargs))
            if len(own) != len(direct):  # outputs marked non-differentiable, or outputs that carry none
                return (f"whose outputs carry a gradient {len(own)} times where its forward's derivative "
                        f"does {len(direct)} times")
            if not own:
                return None
            grads = [torch.randn_like(o) for o in own]
            by_backward = torch.autograd.grad(own, wrt, grads, allow_unused=True)
            by_derivative = torch.autograd.grad(direct, wrt, grads, allow_unused=True)
    except _Unchecked as why:
        warnings.warn(f"{cls.__qualname__}'s backward is replaced by the derivative of its forward and could not "
                      f"be checked against it here ({why}): a backward meant to differ from that derivative (a "
                      "straight-through estimator, a gradient reversal) would be lost; trace the model on a "
                      "device to check it", stacklevel=2)
        return None
    except Exception as exc:  # noqa: BLE001 - a check that cannot run says why
        return f"whose backward could not be checked against its forward's derivative ({type(exc).__name__}: {exc})"
    for i, (a, b) in enumerate(zip(by_backward, by_derivative)):
        a = torch.zeros_like(wrt[i]) if a is None else a
        b = torch.zeros_like(wrt[i]) if b is None else b
        tolerance = {torch.float64: 1e-9, torch.float32: 1e-4}.get(wrt[i].dtype, 2e-2)
        scale = max(float(a.abs().max()), float(b.abs().max()), 1e-12)
        if float((a - b).abs().max()) > tolerance * scale:
            return (f"whose backward is not its forward's derivative (input {i}'s gradient differs by "
                    f"{float((a - b).abs().max()):.3g}, largest {scale:.3g})")
    return None


class _Unchecked(Exception):
    pass


def _has_setup_context(cls) -> bool:
    from torch.autograd.function import _SingleLevelFunction

    return getattr(cls, "setup_context", None) is not getattr(_SingleLevelFunction, "setup_context", None)


_TRACING = threading.local()


def in_trace() -> bool:
    """Whether this thread is inside usc's export of a model: its tensors are read for their metadata
    only (made fake), which a guard on a model's values lets through (usc/handover.py)."""
    return getattr(_TRACING, "depth", 0) > 0


@contextlib.contextmanager
def _tracing():
    _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
    try:
        yield
    finally:
        _TRACING.depth -= 1


def _export(model: nn.Module, example_inputs: tuple):
    """The functional program, casts held as written (compiler/casts.py); taken again without held
    casts where the model writes in place through one."""
    with _tracing():
        return _export_held(model, example_inputs)


def _export_held(model: nn.Module, example_inputs: tuple):
    for hold in (True, False):
        with held_casts() if hold else contextlib.nullcontext(), _traceable_torch_modules():
            exported = inline_regions(torch.export.export(model, example_inputs, strict=False))
        if not hold or not writes_through_held_casts(exported.graph_module):
            break
    # regions first: functionalizing retraces the program, which would drop a no_grad region's meaning
    return functionalize(exported)


def trace(model: nn.Module, example_inputs: tuple, *, wrapper_source: str = "",
          moe_blocks: list[MoEBlock] = ()) -> Traced:
    """Trace ``model(*example_inputs)`` into an ATen-level GraphModule with global shapes.

    Each of ``moe_blocks`` (``usc.compiler.moe.find_blocks``) is traced as one ``usc::moe`` node.

    >>> from usc.testing.models import TinyLlama, token_batch
    >>> traced = trace(TinyLlama(), token_batch(128, 2, 8))
    >>> [s.name for s in traced.state][:1]
    ['embed_tokens.weight']
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    check_call = getattr(model, "check_call", None)  # usc's wrapper: a batch forward cannot take is named so
    if check_call is not None:
        check_call(example_inputs)
    example_inputs = distinct_inputs(_to_device(example_inputs, _model_device(model)))
    if not trace_memo.enabled():
        return _trace(model, example_inputs, wrapper_source, moe_blocks)[0]
    key = trace_memo.key(model, example_inputs, (wrapper_source, tuple(moe_blocks)))
    hit = trace_memo.lookup(key)
    if hit is not None:
        traced, printed, caught = hit
        if printed:
            sys.stderr.write(printed)
        trace_memo.replay_warnings(caught)
        return trace_memo.fresh(traced)
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning is recorded (and replayed through the filters)
            traced, printed = _trace(model, example_inputs, wrapper_source, moe_blocks)
    finally:
        trace_memo.replay_warnings(caught)
    trace_memo.store(key, trace_memo.fresh(traced), printed, list(caught))
    return traced


def _trace(model: nn.Module, example_inputs: tuple, wrapper_source: str,
           moe_blocks) -> tuple[Traced, str]:
    """The trace, and what the model printed while traced."""
    error = None
    with _quiet_torch_logs(), _held_output() as held, patched(model, list(moe_blocks)):
        try:
            with _host_state_kept(model), _gradient_customisations() as (applied, hooks):
                exported = _export(model, example_inputs)
            _refuse_lost_gradients(model, applied, hooks)
        except Exception as exc:  # noqa: BLE001 - every tracer failure becomes one clear error
            # usc's own errors raised while tracing (no loss in the output, a write that reads what it
            # writes) already say what to fix: wrapped, they would carry the tracer's hint instead
            error = exc if isinstance(exc, CompileError) else _trace_error(exc, model)  # formatting can print: held
    if error is not None:
        raise error from error.__cause__
    printed = held.replay()
    user = [s.arg.name for s in exported.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    outputs = user_output_specs(exported)
    written = [o.target for o in outputs if "PARAMETER_MUTATION" in str(o.kind)]
    if written:  # nn.Embedding(max_norm=...) renormalises its rows in place, for one
        raise TraceError(f"{type(model).__name__}.forward writes the parameter(s) {', '.join(written)} in place "
                         "(e.g. nn.Embedding(max_norm=...) renormalising its rows); usc does not replay in-place "
                         "writes to parameters: drop max_norm, or update the weight under torch.no_grad() "
                         "between steps")
    if len(outputs) != 1 or str(outputs[0].kind) not in ("OutputKind.USER_OUTPUT", "USER_OUTPUT"):
        kinds = ", ".join(str(o.kind) for o in outputs)
        raise TraceError(f"{type(model).__name__}.forward must return one scalar loss (got outputs: {kinds}); "
                         "pass loss_fn= to compile, or return the loss from forward")
    release_casts(exported.graph_module)
    gm = masked_writes_as_where(explicit_writes(exported))
    _refuse_data_dependent_shapes(gm, model)
    if wrapper_source:
        _attribute_wrapper_frames(gm, wrapper_source)
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    state = _without_unread_aliases(gm, _state_inputs(exported, model))
    return Traced(gm, state, user, types, type(model).__name__, dict(exported.constants)), printed


def _without_unread_aliases(gm: fx.GraphModule, state: list[StateInput]) -> list[StateInput]:
    """export lifts a tied weight under each of its names and the graph reads one of them; the others
    are the same parameter, not state of their own: kept, each rank would hold a second copy, never
    trained, that checkpoints would write under its name. They are dropped (the one read keeps every
    name in ``aliases``)."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    read = {s.aliases for s in state if placeholders[s.placeholder].users}
    unread = [s for s in state if not placeholders[s.placeholder].users and s.aliases in read]
    for s in unread:
        gm.graph.erase_node(placeholders[s.placeholder])
    if unread:
        gm.recompile()
    return [s for s in state if s not in unread]


def _refuse_data_dependent_shapes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Shapes that depend on tensor values (torch.where / nonzero / boolean masks) cannot be
    planned: name the first module that makes one. An MoE block's routing loop is the usual case."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        values = value if isinstance(value, (tuple, list)) else [value]
        if any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape) for v in values):
            where = module_path(node) or "<root>"
            src = user_source(node)
            raise TraceError(
                f"usc could not trace {type(model).__name__}: module '{where}'{f' ({src})' if src else ''} makes a "
                f"tensor whose shape depends on tensor values ({node.target})\n  fix: if '{where}' is (inside) a "
                "mixture-of-experts block usc did not recognise, mark the block with a plan rule "
                "'path.to.block: expert'; otherwise keep shapes static (masks instead of boolean indexing)")


def is_meta_model(model: nn.Module) -> bool:
    return _model_device(model).type == "meta"


__all__ = ["Traced", "StateInput", "trace", "module_path", "user_source", "is_meta_model"]
