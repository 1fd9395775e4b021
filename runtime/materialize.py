"""Models built on the ``meta`` device, materialised per rank: each rank makes real only the state it holds.

A model too large for one device is built without memory (``with torch.device("meta"): model = ...``)
and compiled; a rank then asks for each state tensor it holds (its tp slices, its pipeline stages, its
ZeRO slices) and cuts its share from it. :class:`MetaState` is that source of full tensors: reading one
materialises the module(s) that own it on the rank's device, runs their initialiser, and keeps them only
until another module is read -- so a rank's peak is its share plus one module, never the whole model.
(FSDP2 does the same with ``to_empty()`` + ``reset_parameters()`` on its shards; here the initialiser runs
on whole modules and the rank slices, so any initialiser gives exactly the one-device values.)

Which initialiser runs on a module (``INITIALISERS``, first match wins):
- the ``init=`` function given to ``usc.compile`` (``init(module)``, as ``model.apply(init)`` calls it);
- the nearest enclosing module's ``_init_weights(module)`` (Hugging Face's ``PreTrainedModel``);
- the module's own ``reset_parameters()`` (torch's built-in modules) or ``_reset_parameters()``.

Reproducible across plans: module ``path`` is initialised with torch's generators seeded to
``module_seed(seed, path)`` (the first 8 bytes of sha256 of "seed:path"), whatever else ran before,
so every rank of every plan -- and one device running the same loop over ``model.named_modules()``
(:func:`materialize`) -- gets the same values. A tensor shared by several modules (tied weights) is
initialised by each of them in ``named_modules()`` order, the last one winning, as ``model.apply``
would leave it. Tensors that are already real (buffers built on the CPU, as accelerate's
``init_empty_weights`` leaves them) are taken as they are.

Nothing is left silently uninitialised: floating-point tensors start as NaN and others must be written
(their version counter moves or the module holds a new tensor), else :class:`InitError` names the tensor
and the module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Callable

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


class InitError(ValueError):
    """A tensor of a model built on the meta device could not be initialised (no initialiser, or the
    initialiser left it unset)."""


def module_seed(seed: int, path: str) -> int:
    """The seed torch's generators get while module ``path`` is initialised (63 bits)."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def has_meta_tensors(model: nn.Module) -> bool:
    return any(is_meta(t) for t in list(model.parameters()) + list(model.buffers()))


# ------------------------------------------------------------------------------------- initialisers
def _hugging_face(root: nn.Module, path: str, module: nn.Module) -> Callable[[], None] | None:
    """The nearest enclosing module with ``_init_weights`` (a Hugging Face PreTrainedModel) runs it."""
    parts = path.split(".") if path else []
    owners = [root] + [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
    owner = next((m for m in reversed(owners) if callable(getattr(m, "_init_weights", None))), None)
    return (lambda: owner._init_weights(module)) if owner is not None else None


def _own_method(name: str):
    def find(root: nn.Module, path: str, module: nn.Module) -> Callable[[], None] | None:
        method = getattr(module, name, None)
        return method if callable(method) else None
    return find


# (what the error names, finder): the first finder that returns a callable initialises the module
INITIALISERS = (
    ("the enclosing model's _init_weights (Hugging Face)", _hugging_face),
    ("reset_parameters()", _own_method("reset_parameters")),
    ("_reset_parameters()", _own_method("_reset_parameters")),
)


def initialiser(root: nn.Module, path: str, module: nn.Module, init: InitFn | None) -> tuple[str, Callable]:
    """(description, zero-argument call) initialising ``module``'s own tensors."""
    if init is not None:
        return "init=", lambda: init(module)
    for what, find in INITIALISERS:
        call = find(root, path, module)
        if call is not None:
            return what, call
    own = ", ".join(_own_names(module)) or "(none)"
    raise InitError(f"module '{path or '<root>'}' ({type(module).__name__}) holds meta tensors ({own}) and has no "
                    "initialiser: give it reset_parameters(), pass init=fn to usc.compile (called as model.apply "
                    "calls it), or load a checkpoint (init='path')")


# ------------------------------------------------------------------------------------- the state
def _own_names(module: nn.Module) -> list[str]:
    return [n for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]


def _own_tensor(module: nn.Module, name: str) -> torch.Tensor:
    return module._parameters[name] if name in module._parameters else module._buffers[name]


def _set_own(module: nn.Module, name: str, value: torch.Tensor) -> None:
    (module._parameters if name in module._parameters else module._buffers)[name] = value


def _empty_like(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor of meta's shape and dtype; NaN where it can hold one (so 'never written' shows)."""
    real = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    if real.is_floating_point() or real.is_complex():
        real.fill_(float("nan"))
    if isinstance(meta, nn.Parameter):
        return nn.Parameter(real, requires_grad=meta.requires_grad)
    return real


class _Groups:
    """Modules that must be initialised together: those sharing a meta tensor (tied weights), in
    ``named_modules()`` order, found once per model."""

    def __init__(self, root: nn.Module) -> None:
        self.paths = {id(m): p for p, m in root.named_modules()}
        self.order = {p: i for i, p in enumerate(self.paths.values())}
        owners: dict[int, list[str]] = {}
        for path, module in root.named_modules():
            for name in _own_names(module):
                if is_meta(_own_tensor(module, name)):
                    owners.setdefault(id(_own_tensor(module, name)), []).append(path)
        self.of_tensor = self._closures(owners, root)

    def _closures(self, owners: dict[int, list[str]], root: nn.Module) -> dict[int, tuple[str, ...]]:
        """Every meta tensor -> all modules reachable through shared tensors, in module order."""
        out: dict[int, tuple[str, ...]] = {}
        for key in owners:
            if key in out:
                continue
            paths, tensors, todo = set(), set(), [key]
            while todo:
                t = todo.pop()
                if t in tensors:
                    continue
                tensors.add(t)
                for path in owners[t]:
                    paths.add(path)
                    module = root.get_submodule(path)
                    todo += [id(_own_tensor(module, n)) for n in _own_names(module)
                             if is_meta(_own_tensor(module, n))]
            group = tuple(sorted(paths, key=self.order.__getitem__))
            out.update({t: group for t in tensors})
        return out


class MetaState(Mapping):
    """Full state tensors by name (``state``: the model's meta and real tensors), made real on ``device``
    module by module when read. ``init``: a function ``init(module)``, None (the model's own
    initialisers) or ``"empty"`` (uninitialised memory of no full size: a checkpoint load fills it)."""

    def __init__(self, root: nn.Module, state: Mapping[str, torch.Tensor], *, device: torch.device | str,
                 seed: int, init: InitFn | str | None = None) -> None:
        self.root, self.state, self.device, self.seed, self.init = root, state, torch.device(device), seed, init
        self.groups = _Groups(root)
        self._cache: dict[int, torch.Tensor] = {}  # the last group's real tensors, by id of the meta tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.state[name]
        if not is_meta(tensor):
            return tensor
        if self.init == "empty":
            return _unallocated(tensor, self.device)
        if id(tensor) not in self._cache:
            group = self.groups.of_tensor.get(id(tensor))
            if group is None:
                raise InitError(f"'{name}' is on the meta device but no module holds it (a tensor kept as a plain "
                                "attribute and captured by forward): register it as a buffer, or build it on a "
                                "real device")
            self._cache = {}  # drop the previous module before making the next
            self._cache = self._materialise(group)
        return self._cache[id(tensor)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def _materialise(self, group: tuple[str, ...]) -> dict[int, torch.Tensor]:
        """Make the group's meta tensors real, run each module's initialiser under its seed, and
        put the meta tensors back (the user's model is left as it was)."""
        modules = [(path, self.root.get_submodule(path)) for path in group]
        saved = [(m, n, _own_tensor(m, n)) for _, m in modules for n in _own_names(m)]
        real = {id(t): _empty_like(t, self.device) for _, _, t in saved if is_meta(t)}
        # the group's real tensors are taken as they are: the initialiser writes copies, then dropped
        stand_ins = {**{id(t): _copy(t) for _, _, t in saved if not is_meta(t)}, **real}
        versions = {key: t._version for key, t in real.items()}
        try:
            for module, name, t in saved:
                _set_own(module, name, stand_ins[id(t)])
            for path, module in modules:
                self._initialise(path, module)
            out = {id(t): _own_tensor(m, n) for m, n, t in saved if id(t) in real}  # an init may assign anew
        finally:
            for module, name, t in saved:
                _set_own(module, name, t)
        _check_written(out, real, versions, saved, self.groups.paths)
        return {key: t.detach().to(self.device).requires_grad_(real[key].requires_grad) for key, t in out.items()}

    def _initialise(self, path: str, module: nn.Module) -> None:
        _, call = initialiser(self.root, path, module, None if self.init == "empty" else self.init)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, path))
            call()


def _check_written(out: dict, real: dict, versions: dict, saved: list, paths: dict) -> None:
    for module, name, t in saved:
        key = id(t)
        if key not in real:
            continue
        value = out[key]
        if value.is_floating_point() or value.is_complex():
            unset = bool(torch.isnan(value).any())
        else:
            unset = value is real[key] and value._version == versions[key]
        if unset:
            path = paths[id(module)]
            raise InitError(f"the initialiser of module '{path or '<root>'}' ({type(module).__name__}) left "
                            f"'{name}' unset on the meta-built model: initialise it there (or in init=fn), "
                            "build it on a real device, or load a checkpoint (init='path')")


def _copy(t: torch.Tensor) -> torch.Tensor:
    copy = t.detach().clone()
    return nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copy


def _unallocated(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of meta's shape backed by one element: slicing and cloning it allocates only the slice."""
    one = torch.empty((), dtype=meta.dtype, device=device).expand(meta.shape)
    return one.requires_grad_(meta.requires_grad) if meta.requires_grad else one


def materialize(model: nn.Module, *, init: InitFn | None = None, seed: int, device: torch.device | str = "cpu"
                ) -> nn.Module:
    """Make a meta-built ``model`` real in place on ``device`` with the values every rank of every plan
    gets from the same ``init`` and ``seed``: the one-device twin of a compiled meta model.

    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    >>> materialize(model, seed=0)[0].weight.device.type
    'cpu'
    """
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    source = MetaState(model, state, device=device, seed=seed, init=init)
    real = {name: source[name] for name in state}
    made: dict[int, torch.Tensor] = {}  # one Parameter per real tensor: tied weights stay tied
    for path, module in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        for name in _own_names(module):
            value = real[prefix + name]
            if isinstance(_own_tensor(module, name), nn.Parameter):
                value = made.setdefault(id(value), nn.Parameter(value, requires_grad=value.requires_grad))
            _set_own(module, name, value)
    return model
