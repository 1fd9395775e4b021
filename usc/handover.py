"""The user's model once a compiled program has taken it over.

Each rank holds its own copy of the model's state (its slices, in its own dtype and device) and
trains that; the module the user passed to ``usc.compile`` keeps the tensors it was compiled with.
Called, or saved, after the program has trained past it, it would be the untrained model with no
error -- so from the program's first step or checkpoint load on, calling the model or reading its
``state_dict()`` raises ``ModelOutOfDate`` until the trained values are loaded back into it
(``model.load_state_dict(step.full_state_dict())``)."""

from __future__ import annotations

import functools
import inspect
import types
import weakref

import torch
from torch import nn

from usc.compiler.trace import in_trace
from usc.runtime.materialize import has_meta_tensors


class ModelOutOfDate(RuntimeError):
    """The model handed to ``usc.compile`` was called or saved after the compiled program trained
    past it: its own tensors are the ones it was compiled with."""


class ModelChanged(RuntimeError):
    """The model handed to ``usc.compile`` was changed after it in a way the compiled program does
    not follow (a parameter frozen or unfrozen, values loaded, an attribute forward reads set): the
    program would go on as compiled."""


def value_marks(model: nn.Module) -> dict:
    """{name: (tensor identity, version counter)} of the model's parameters and buffers: torch bumps a
    tensor's version on every in-place write (``load_state_dict`` copies in place; ``assign=True``
    replaces)."""
    marks = {name: (id(p), p._version) for name, p in model.named_parameters()}
    marks.update((name, (id(b), b._version)) for name, b in model.named_buffers())
    return marks


_MODULE_OWN = frozenset(nn.Module().__dict__) | {"training"}  # torch's bookkeeping, and the mode (followed)
_ABSENT = object()


@functools.lru_cache(maxsize=None)
def _names_read(cls: type) -> frozenset:
    """The names the methods of ``cls`` and its bases (below ``nn.Module``) use -- read off their code
    objects (``self.p``, ``getattr(self, "p")`` among them; more than the instance's: a name no
    attribute has is not looked at)."""
    names: set = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for value in vars(klass).values():
            for fn in (value.fget, value.fset) if isinstance(value, property) else (getattr(value, "__func__", value),):
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    names |= _code_names(code, strings=True)
    return frozenset(names)


def _code_names(code: types.CodeType, *, strings: bool = False) -> set:
    """The names ``code`` and the functions nested in it use (attributes, globals); ``strings``: also
    its string constants that are identifiers (``getattr(self, "p")``)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const, strings=strings)
        elif strings and isinstance(const, str) and const.isidentifier():
            names.add(const)
    return names


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _plain(value, depth: int = 0) -> bool:
    """A number, string, flag or None, or a tuple or frozenset of those (a few levels deep): values
    that cannot change in place. (A list or dict can, and does where it is bookkeeping -- the
    warnings a model has issued -- so it is not compared.)"""
    if isinstance(value, _PLAIN):
        return True
    if depth < 3 and isinstance(value, (tuple, frozenset)) and len(value) <= 4096:
        return all(_plain(v, depth + 1) for v in value)
    return False


def _mark(value):
    """What is compared to tell an attribute was set since: plain values by value, tensors (not
    parameters) by identity and version counter; None for anything else (not compared: an object's
    identity changes where its meaning does not)."""
    if value is _ABSENT:
        return ("value", None, _ABSENT)
    if isinstance(value, torch.Tensor):
        return None if isinstance(value, nn.Parameter) else ("tensor", id(value), value._version)
    if _plain(value):
        return ("value", type(value), value)
    return None


class AttributeMarks:
    """The plain attributes the model's modules read (their ``__dict__``: not parameters, buffers or
    submodules), as the trace saw them: their values are constants of the compiled program. An
    attribute a module holds itself is marked on the module (weakly: the marks keep no module alive);
    a name it reads off its class (a default every instance shares) is marked once per class, and
    the module's own dict is watched for an instance attribute set over it later."""

    def __init__(self, model: nn.Module) -> None:
        self.own: list = []  # (module ref, path, name, mark)
        self.shadowed: list = []  # (module ref, path, name): read off the class; set on the instance since?
        self.defaults: dict = {}  # (class, name) -> (path of a module of that class, mark)
        for path, module in model.named_modules():
            ref = weakref.ref(module)
            own = module.__dict__
            for name in _names_read(type(module)) - _MODULE_OWN:
                if name in own:
                    mark = _mark(own[name])
                    if mark is not None:
                        self.own.append((ref, path, name, mark))
                    continue
                if name in module._parameters or name in module._buffers or name in module._modules:
                    continue
                mark = _mark(inspect.getattr_static(type(module), name, _ABSENT))
                if mark is None or mark[2] is _ABSENT:
                    continue  # a method, a property, or a name no attribute has
                self.shadowed.append((ref, path, name, mark))
                self.defaults.setdefault((type(module), name), (path, mark))

    def changed(self) -> list:
        """[((module path, name), mark when traced, mark now)] of the attributes set since."""
        out = []
        for ref, path, name, mark in self.own:
            module = ref()
            if module is None:
                continue
            now = _moved(mark, module.__dict__.get(name, _ABSENT))
            if now is not None:
                out.append(((path, name), mark, now))
        for ref, path, name, mark in self.shadowed:
            module = ref()
            now = _moved(mark, module.__dict__[name]) if module is not None and name in module.__dict__ else None
            if now is not None:
                out.append(((path, name), mark, now))
        for (cls, name), (path, mark) in self.defaults.items():
            now = _moved(mark, inspect.getattr_static(cls, name, _ABSENT))
            if now is not None:
                out.append(((path, name), mark, now))
        return out


def _library(module: str) -> bool:
    """torch's and usc's own code: what a user's training script does not set."""
    return module.split(".")[0] in ("torch", "usc")


class PythonReads:
    """Module-level names, and a loss function's closure, that the model's and the loss's code reads,
    holding plain values or tensors (a loss weight annealed by the training script, a flag): constants
    of the trace, like the attributes above. Found by walking the code from each module's
    ``forward`` (and the loss function) through the methods and same-module functions it names, a
    few calls deep; torch's and usc's own code is not walked."""

    def __init__(self, model: "nn.Module | None", loss_fn=None) -> None:
        self.entries: list = []  # (namespace: a module's globals or a closure cell, name, label, mark)
        self._seen: set = set()
        if model is not None:
            for cls in {type(m) for m in model.modules()}:
                forward = inspect.getattr_static(cls, "forward", None)
                if forward is not None and not _library(getattr(forward, "__module__", None) or ""):
                    self._visit(forward, cls, 0)
        if loss_fn is not None:
            self._visit(getattr(loss_fn, "__func__", loss_fn), None, 0)

    def _visit(self, fn, cls: "type | None", depth: int) -> None:
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if isinstance(fn, property):
            for part in (fn.fget, fn.fset):
                self._visit(part, cls, depth)
            return
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType) or id(code) in self._seen or depth > 4:
            return
        self._seen.add(id(code))
        namespace = getattr(fn, "__globals__", {})
        module = namespace.get("__name__", "")
        if _library(module):
            return
        for name in _code_names(code):
            if cls is not None:
                method = inspect.getattr_static(cls, name, None)
                if isinstance(method, (types.FunctionType, staticmethod, classmethod, property)):
                    self._visit(method, cls, depth + 1)
            if name not in namespace or name.startswith("__"):
                continue
            value = namespace[name]
            if isinstance(value, types.FunctionType):
                self._visit(value, None, depth + 1)
                continue
            mark = _mark(value)
            if mark is not None:
                self.entries.append((namespace, name, f"{module}.{name}" if module else name, mark))
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, types.FunctionType):
                self._visit(value, None, depth + 1)
                continue
            mark = _mark(value)
            if mark is not None:
                self.entries.append((cell, name, f"{name} in {getattr(fn, '__qualname__', 'a function')}'s closure",
                                     mark))

    def changed(self) -> list:
        """[(label, mark when traced, mark now)] of the names set since."""
        out = []
        for namespace, name, label, mark in self.entries:
            if isinstance(namespace, dict):
                value = namespace.get(name, _ABSENT)
            else:
                try:
                    value = namespace.cell_contents
                except ValueError:
                    value = _ABSENT
            now = _moved(mark, value)
            if now is not None:
                out.append((label, mark, now))
        return out


def _moved(mark, value):
    """The mark of ``value`` where it is not what ``mark`` recorded, else None (also for a value that is
    not compared: an object)."""
    if value is mark[2] or (mark[0] == "value" and type(value) is mark[1] and value == mark[2]):
        return None  # the common case, without making a mark
    now = _mark(value)
    return now if now is not None and not _same(mark, now) else None


def _same(a, b) -> bool:
    if a[0] == "value" and b[0] == "value" and a[1] is float and b[1] is float and a[2] != a[2] and b[2] != b[2]:
        return True  # nan stays nan
    try:
        return a == b
    except Exception:  # noqa: BLE001 -- a value whose == raises: compared as unequal only if not identical
        return a is b


def note_given(program, state: dict) -> None:
    """The tensors ``program.full_state_dict()`` handed out: loaded into the model, they make it level."""
    program._given_ids = {id(t) for t in state.values() if isinstance(t, torch.Tensor)}


def frozen_names(model: nn.Module) -> frozenset:
    """The names of the model's parameters that do not train (``requires_grad=False``)."""
    return frozenset(name for name, p in model.named_parameters() if not p.requires_grad)


def _listed(names: list) -> str:
    return f"'{names[0]}'" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def refuse_model_changes(model: "nn.Module | None", compiled_frozen: "frozenset | None", call: str,
                         watcher: "_Watch | None" = None) -> None:
    """Raise ModelChanged when the model's frozen parameters are not the ones the program was
    compiled with (gradual unfreezing, a backbone frozen after the first epochs), when values were
    written into the model after the program read them (``model.load_state_dict(pretrained)`` after
    compile), when parameters were added or removed (adapters injected), or when a plain attribute
    its forward reads was set (``model.drop.p = 0.0``, a temperature): the program keeps running what
    it was compiled to run, from its own values. ``compiled_frozen=None``: an evaluation (what trains
    does not matter to it)."""
    if model is None:
        return
    ours = watcher is not None and watcher.model() is model
    written, added, removed = watcher.changed_values(model) if ours else ([], [], [])
    if added or removed:
        what = " and ".join(f"{len(names)} {how} ({_listed(names)})"
                            for names, how in ((added, "added"), (removed, "removed")) if names)
        raise ModelChanged(
            f"{call}: the model's parameters or buffers changed after usc.compile, {what}: the compiled "
            "program runs the modules it traced (an adapter injected since, a layer replaced, is not in it), "
            "so it would go on training without them, with no error\n"
            "  fix: change the model before compiling, or compile again now "
            "(model.load_state_dict(step.full_state_dict(), strict=False) first to keep the trained values)")
    if written:
        raise ModelChanged(
            f"{call}: the model's values were written after the compiled program read them ({len(written)} "
            f"parameter(s) or buffer(s): {_listed(written)}; a load_state_dict, an in-place write, or "
            "calling the model in training mode, which updates its buffers): the program trains its own "
            "copy, read when it was made, and would not see them\n"
            "  fix: to train from the new values, load them before compiling, or compile again now "
            "(step = usc.compile(model, ...); the optimizer's state starts afresh); to go on with the "
            "program's values, model.load_state_dict(step.full_state_dict())")
    reads = watcher.python.changed() if ours else []
    if reads:
        label, old, new = reads[0]
        raise ModelChanged(
            f"{call}: {label} was set after usc.compile ({_shown(old)} when traced, {_shown(new)} now"
            + (f"; {len(reads) - 1} more name(s) changed" if len(reads) > 1 else "") + "): the model's or the "
            "loss's code reads it, and the compiled program keeps the value it was traced with (a loss weight, "
            "a flag), so it would run as before, with no error\n"
            "  fix: set it before compiling, or compile again now (model.load_state_dict(step.full_state_dict()) "
            "first to keep the trained values; the optimizer's state starts afresh); a value that changes every "
            "step (an annealed weight) belongs in the batch, as an input tensor the loss reads")
    attributes = watcher.changed_attributes(model) if ours else []
    if attributes:
        (path, name), old, new = attributes[0]
        where = f"{path}.{name}" if path else name
        recompute = any(n == "gradient_checkpointing" for (_, n), _, _ in attributes)
        raise ModelChanged(
            f"{call}: {type(model).__name__}.{where} was set after usc.compile ({_shown(old)} when traced, "
            f"{_shown(new)} now" + (f"; {len(attributes) - 1} more attribute(s) changed" if len(attributes) > 1
                                     else "") + "): forward reads it, and the compiled program keeps the value "
            "it was traced with (a dropout rate, a temperature, a flag), so it would run as before, with no error\n"
            "  fix: set it before compiling, or compile again now (model.load_state_dict(step.full_state_dict()) "
            "first to keep the trained values; the optimizer's state starts afresh); a value that changes every "
            "step belongs in the batch (an input tensor) or the loss, not in an attribute"
            + ("; activation checkpointing is the plan's: recompute=full or recompute=selective" if recompute else ""))
    if compiled_frozen is None:
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


def _tensor_reads_no_values() -> frozenset:
    """What a parameter or buffer of a model left behind still answers: its metadata (shape, dtype,
    device, requires_grad, the gradient slot, the version counter), never its values -- counting
    parameters, ``zero_grad()``, ``requires_grad_()`` and usc's own checks keep working."""
    tensor = torch.Tensor
    out = set()
    for name in ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "names",
                 "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_mps", "is_xpu",
                 "is_nested", "grad_fn", "_version", "itemsize", "nbytes", "output_nr", "_base",
                 "_backward_hooks", "_post_accumulate_grad_hooks"):
        descriptor = getattr(tensor, name, None)
        for slot in ("__get__", "__set__") if name in ("grad", "requires_grad", "_backward_hooks") else ("__get__",):
            if hasattr(descriptor, slot):
                out.add(getattr(descriptor, slot))
    for name in ("size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous", "data_ptr",
                 "requires_grad_", "storage_offset", "is_floating_point", "is_complex", "get_device", "__len__",
                 "_is_view", "is_shared", "is_pinned", "untyped_storage", "register_hook",
                 "register_post_accumulate_grad_hook", "__hash__", "__dir__"):
        if hasattr(tensor, name):
            out.add(getattr(tensor, name))
    return frozenset(out)


_NO_VALUES = _tensor_reads_no_values()


class _LeftBehind:
    """A parameter or buffer of the model handed to ``usc.compile``, while the program has moved past
    it: any use of its values (an average of weights kept over ``model.parameters()``, a copy, an
    in-place write) raises ``ModelOutOfDate``; its metadata stays readable. The class is set on the
    model's own tensors when the program takes a step or loads a checkpoint, and put back when the
    model is level again (``model.load_state_dict(...)``) or the program is gone."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _NO_VALUES and not in_trace():  # usc's own traces make it fake: no values read
            for value in (*args, *kwargs.values()):
                watch, tensor = _watch_of(value)
                if watch is not None:
                    watch.refuse_value(tensor)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _watch_of(value) -> tuple:
    """(the watch of the first guarded tensor in ``value``, that tensor), or (None, None)."""
    if isinstance(value, (list, tuple)):  # torch's foreach ops take lists of tensors
        return next((found for found in map(_watch_of, value) if found[0] is not None), (None, None))
    ref = getattr(value, "_usc_left_behind", None) if isinstance(value, _LeftBehind) else None
    watch = ref() if ref is not None else None
    return (watch, value) if watch is not None else (None, None)


class _LeftBehindParameter(_LeftBehind, nn.Parameter):
    pass


class _LeftBehindTensor(_LeftBehind, torch.Tensor):
    pass


_LEFT_BEHIND = {nn.Parameter: _LeftBehindParameter, torch.Tensor: _LeftBehindTensor}


class _Watch:
    """Whether the watched model is behind the program that took it over: the program's state
    version (steps taken, checkpoints loaded) against the one last loaded into the model."""

    def __init__(self, model: nn.Module, program) -> None:
        self.model = weakref.ref(model)
        self.program = weakref.ref(program)
        self.synced = program.state_version
        self.marks = value_marks(model)  # the parameters as the program read them
        self.attributes = AttributeMarks(model)  # the plain attributes forward reads, as traced
        self.python = PythonReads(model, getattr(program, "_loss_fn", None))  # module-level names, the loss's closure
        self.loading_program_values = False
        self.loading_now = False
        self.guarded: list = []  # (tensor ref, its own class, its name)

    def __deepcopy__(self, memo):
        """A copy of the model (``copy.deepcopy``, ``AveragedModel``) keeps its hooks, bound to this
        watch: the watch is the program's, not copied, and it never refuses the copy (``behind``)."""
        return self

    def guard(self) -> None:
        """The program moved past the model: its tensors refuse value reads (``_LeftBehind``)."""
        model = self.model()
        self.loading_now = False
        if self.guarded or model is None or has_meta_tensors(model):
            return
        for prefix, module in model.named_modules():
            for kind in (module._parameters, module._buffers):
                for name, tensor in kind.items():
                    own = type(tensor)
                    if tensor is None or own not in _LEFT_BEHIND or getattr(tensor, "_usc_left_behind", None):
                        continue  # another tensor subclass is its own; a tensor two modules share: once
                    tensor.__class__ = _LEFT_BEHIND[own]
                    tensor._usc_left_behind = weakref.ref(self)
                    tensor._usc_name = f"{prefix}.{name}" if prefix else name
                    self.guarded.append((weakref.ref(tensor), own))

    def unguard(self) -> None:
        """The model is level (or the program gone): its tensors are plain again."""
        for ref, own in self.guarded:
            tensor = ref()
            if tensor is not None and isinstance(tensor, _LeftBehind):
                tensor.__class__ = own
                del tensor._usc_left_behind
        self.guarded = []

    def refuse_value(self, tensor) -> None:
        model = self.model()
        program = self.behind(model) if model is not None and not self.loading_now else None
        if program is None:
            if not self.loading_now:
                self.unguard()
            return
        name = type(model).__name__
        raise ModelOutOfDate(
            f"{name}'s tensor '{getattr(tensor, '_usc_name', '?')}' was used after usc's compiled program moved "
            f"past it ({program.steps_taken} step(s) taken, {program.loads_done} checkpoint(s) loaded): it holds the "
            "value the model was compiled with, not the trained one (an average of weights kept over "
            "model.parameters(), a copy of the model, a value read or written through it)\n"
            "  fix: read the trained values from the program (step.full_state_dict(): an EMA or an average "
            "over those), or model.load_state_dict(step.full_state_dict()) first, which makes the model "
            "usable again")

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
        self.loading_now = module is self.model()  # its tensors take values: not a use of the old ones

    def loaded(self, module: nn.Module, incompatible=None) -> None:
        """After it: level with the program (not behind it). Values that are not the program's are the
        user's own, which the program does not take: its next step refuses them (``changed_values``)."""
        program = self.program()
        if module is self.model() and program is not None:
            self.synced = program.state_version
            if self.loading_program_values:
                self.marks = value_marks(module)
        self.loading_program_values = self.loading_now = False
        if module is self.model():
            self.unguard()

    def changed_values(self, module: nn.Module) -> tuple[list, list, list]:
        """(the parameters and buffers written -- replaced, loaded into, changed in place -- since the
        program read them, those added since, those removed since)."""
        now = value_marks(module)
        written = sorted(name for name, mark in now.items() if self.marks.get(name, mark) != mark)
        return written, sorted(set(now) - set(self.marks)), sorted(set(self.marks) - set(now))

    def changed_attributes(self, module: nn.Module) -> list:
        """[((module path, name), mark when traced, mark now)] of the attributes set since."""
        return self.attributes.changed()


def _shown(mark) -> str:
    if mark[0] == "tensor":
        return "a tensor"
    text = "unset" if mark[2] is _ABSENT else repr(mark[2])
    return text if len(text) <= 60 else text[:57] + "..."


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
