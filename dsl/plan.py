"""Plan values: frozen, validated dataclasses whose text form is the plan language itself.

``str(plan)`` is canonical plan text and ``parse_plan(str(plan)) == plan``; ``repr(plan)`` is
``Plan('dp=2 tp=2 ...')``, which evaluates back to an equal plan (``Plan(text)`` parses ``text``).
Positions (line, column) ride along for error messages but never take part in equality.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .errors import PlanError, Problem, did_you_mean
from .options import ACTIONS, AXES, AXIS_SIZE, OPTIONS, TP_ACTIONS

# Characters a rule glob may use: module path parts plus fnmatch's * ? [..] [!..] and ranges.
_GLOB = re.compile(r"[A-Za-z0-9_.*?\[\]!\-]+", re.ASCII)
_NO_POSITIONS: Mapping[str, tuple[int, int]] = MappingProxyType({})


def _raise_here(fn):
    """Turn a :class:`Problem` from ``__post_init__`` into a PlanError at line 1, column 1."""

    def checked(self) -> None:
        try:
            fn(self)
        except Problem as problem:
            raise PlanError.from_problem(problem) from None

    checked.__doc__ = fn.__doc__
    return checked


@dataclass(frozen=True)
class Action:
    """One thing a rule does to the modules it matches: ``rowwise``, ``stage(2)``.

    >>> str(Action("stage", 2))
    'stage(2)'
    """

    name: str
    arg: int | None = None

    @_raise_here
    def __post_init__(self) -> None:
        """Only known actions; ``stage`` needs an argument and nothing else takes one."""
        check_action(self.name, self.arg)

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}({self.arg})"


def check_action(name: str, arg: Any) -> None:
    """Raise :class:`Problem` unless ``name(arg)`` is a valid action (``arg`` None: no parentheses)."""
    if name not in ACTIONS:
        raise Problem(f"unknown action '{name}'", did_you_mean(name, ACTIONS, otherwise=_ACTION_LIST))
    kind = ACTIONS[name].arg
    if kind is None and arg is not None:
        raise Problem(
            f"'{name}' takes no argument", f"write just '{name}'; only stage takes one, e.g. stage(0)"
        )
    if kind is not None and arg is None:
        raise Problem(f"'{name}' needs a stage number", f"write e.g. {name}(0)")
    if kind is not None:
        kind.check(f"the {name} number", arg)


_ACTION_LIST = "actions are " + ", ".join("stage(N)" if a == "stage" else a for a in ACTIONS)


def check_glob(glob: Any) -> None:
    """Raise :class:`Problem` unless ``glob`` is a dotted module path pattern (``layers.*.mlp``)."""
    if not isinstance(glob, str) or not _GLOB.fullmatch(glob):
        raise Problem(f"{glob!r} is not a module path pattern", "use letters, digits, _ . * ? [..]")
    if "" in glob.split("."):
        raise Problem(f"empty name between dots in '{glob}'", "write e.g. layers.*.mlp")
    depth = 0
    for char in glob:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise Problem(f"unbalanced '[' ']' in '{glob}'", "write a character set like [0-3]")
    if depth:
        raise Problem(f"unclosed '[' in '{glob}'", "write a character set like [0-3]")


@dataclass(frozen=True)
class Rule:
    """``glob: action, action`` — apply the actions to every module whose dotted path matches.

    Matching is :func:`fnmatch.fnmatchcase` on the whole dotted path: ``*`` matches any run of
    characters *including dots* (``layers.*`` matches ``layers.0.mlp.up_proj``), ``?`` one character,
    ``[0-3]`` one character from a set. ``line``/``column`` say where it was written (0 when built in
    code) and do not take part in equality.

    >>> Rule("layers.*.mlp.down_proj", (Action("rowwise"),)).matches("layers.3.mlp.down_proj")
    True
    """

    glob: str
    actions: tuple[Action, ...]
    line: int = field(default=0, compare=False, repr=False)
    column: int = field(default=0, compare=False, repr=False)

    @_raise_here
    def __post_init__(self) -> None:
        """A valid glob and a non-empty list of distinct valid actions."""
        check_glob(self.glob)
        object.__setattr__(self, "actions", tuple(self.actions))
        if not self.actions or not all(isinstance(a, Action) for a in self.actions):
            raise Problem(f"rule '{self.glob}' needs at least one Action", "write e.g. lm_head: vocab")
        check_distinct_actions([a.name for a in self.actions])

    def matches(self, module_path: str) -> bool:
        """Whether this rule applies to the module at ``module_path`` (e.g. ``layers.0.mlp``)."""
        return fnmatch.fnmatchcase(module_path, self.glob)

    def __str__(self) -> str:
        return f"{self.glob}: {', '.join(map(str, self.actions))}"


def check_distinct_actions(names: list[str]) -> None:
    """One rule names each action once (two stage(...) would place a module twice)."""
    for i, name in enumerate(names):
        if name in names[:i]:
            raise Problem(f"action '{name}' appears twice in one rule", "list each action once")


@dataclass(frozen=True)
class Plan:
    """A parallelization plan: mesh axes, explicit options, module rules.

    ``axes`` are in the order written (outermost first); ``options`` hold only what the user wrote,
    sorted by name so that the order of writing does not change equality; ``rules`` are in written
    order. ``Plan("dp=2 tp=4")`` is a shorthand for ``parse_plan("dp=2 tp=4")``.

    >>> p = Plan("dp=2 tp=4 sp=on lm_head: vocab")
    >>> p.world_size, p.mesh_axes, p.get("sp"), p.get("zero")
    (8, ('dp', 'tp'), True, 0)
    >>> str(p)
    'dp=2 tp=4 sp=on lm_head: vocab'
    """

    axes: tuple[tuple[str, int], ...] = ()
    options: tuple[tuple[str, Any], ...] = ()
    rules: tuple[Rule, ...] = ()
    positions: Mapping[str, tuple[int, int]] = field(
        default_factory=lambda: _NO_POSITIONS, compare=False, repr=False
    )
    source: str = field(default="", compare=False, repr=False)
    filename: str | None = field(default=None, compare=False, repr=False)
    auto: bool = False  # `auto`: the planner chooses what is not written (usc.plan)
    search: Any = field(default=None, compare=False, repr=False)  # the planner's reasons, when it chose

    def __post_init__(self) -> None:
        """Parse ``Plan(text)``; otherwise check and normalize axes, options and rules."""
        if isinstance(self.axes, str):
            self._copy_parsed(self.axes)
            return
        try:
            self._normalize()
        except Problem as problem:
            raise PlanError.from_problem(problem, text=str(self.source)) from None
        except (TypeError, ValueError) as exc:  # not pairs: Plan(axes=("dp", 2)) instead of (("dp", 2),)
            raise PlanError(f"axes and options must be (name, value) pairs: {exc}") from None

    def _copy_parsed(self, text: str) -> None:
        if self.options or self.rules:
            raise TypeError("Plan(text) takes the plan text alone")
        from .parser import parse_plan  # the parser builds Plans: import it late to avoid a cycle

        parsed = parse_plan(text)
        for name in ("axes", "options", "rules", "positions", "source", "filename", "auto"):
            object.__setattr__(self, name, getattr(parsed, name))

    def _normalize(self) -> None:
        axes = tuple((name, size) for name, size in self.axes)
        written = list(self.options.items() if isinstance(self.options, Mapping) else self.options)
        for name, size in axes:
            _check_axis(name, size)
        _check_unique([name for name, _ in axes], "axis")
        _check_unique([name for name, _ in written], "option")
        options = tuple(sorted(_check_options(dict(written)), key=lambda item: item[0]))
        if not all(isinstance(rule, Rule) for rule in self.rules):
            raise Problem("rules must be Rule values")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "positions", MappingProxyType(dict(self.positions)))

    # -- reading ------------------------------------------------------------------------------------

    def size(self, axis: str) -> int:
        """Size of mesh axis ``axis``; 1 when the plan does not write it."""
        if axis not in AXES:
            raise KeyError(_unknown("axis", axis, AXES))
        return dict(self.axes).get(axis, 1)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The axes written, outermost first (an empty plan has none: a single device).

        ``ep`` is carved from the data-parallel ranks (Megatron, torchtitan): it sits just inside
        ``dp``, whose size becomes dp/ep — ``dp=4 ep=2`` is the mesh ``dp=2 ep=2`` of 4 ranks, each
        pair of neighbouring data-parallel ranks sharing one set of experts.

        >>> Plan("dp=4 tp=2 ep=2").mesh_axes, Plan("dp=4 tp=2 ep=2").mesh_shape
        (('dp', 'ep', 'tp'), (2, 2, 2))
        """
        return tuple(name for name, _ in self._mesh())

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of :attr:`mesh_axes`, in the same order."""
        return tuple(size for _, size in self._mesh())

    def _mesh(self) -> list[tuple[str, int]]:
        sizes = dict(self.axes)
        ep, dp = sizes.get("ep"), sizes.get("dp", 1)
        if ep is None or dp % ep or "dp" not in sizes:  # not carvable: the compile checks refuse it
            return list(self.axes)
        out = []
        for name, size in self.axes:
            if name == "dp":
                out += [("dp", dp // ep), ("ep", ep)]
            elif name != "ep":
                out.append((name, size))
        return out

    @property
    def world_size(self) -> int:
        """Number of ranks the plan needs: the product of the axis sizes."""
        return math.prod(self.mesh_shape)

    def get(self, name: str) -> Any:
        """The value of option ``name`` as written, else its default from :data:`OPTIONS`."""
        if name not in OPTIONS:
            raise KeyError(_unknown("option", name, OPTIONS))
        return dict(self.options).get(name, OPTIONS[name].default)

    def is_set(self, name: str) -> bool:
        """Whether the plan writes axis or option ``name`` explicitly."""
        if name not in OPTIONS and name not in AXES:
            raise KeyError(_unknown("axis or option", name, AXES + tuple(OPTIONS)))
        return name in dict(self.axes) or name in dict(self.options)

    def tp_rule(self, module_path: str) -> tuple[Rule, str] | None:
        """(rule, action) of the last rule matching ``module_path`` with a tensor-parallel action
        (:data:`TP_ACTIONS`), or None: how the plan's rules say tp splits that module's weight."""
        found = None
        for rule in self.rules:
            if rule.matches(module_path):
                for action in rule.actions:
                    if action.name in TP_ACTIONS:
                        found = (rule, action.name)
        return found

    def with_options(self, **values: Any) -> Plan:
        """A copy with options set (plan text like ``"on"`` or Python values); None removes one.

        >>> str(Plan("dp=2").with_options(zero=1, sp="on"))
        'dp=2 sp=on zero=1'
        """
        options = dict(self.options)
        for name, value in values.items():
            if name not in OPTIONS:
                raise PlanError(_unknown("option", name, OPTIONS))
            if value is None:
                options.pop(name, None)
            else:
                options[name] = value
        return replace(self, options=tuple(options.items()))

    # -- errors -------------------------------------------------------------------------------------

    def error_at(self, where: str | Rule, message: str, hint: str | None = None) -> PlanError:
        """A PlanError pointing at where axis/option ``where`` (or a Rule, or a rule's glob) was written.

        Later stages use it to reject a valid-looking plan: ``raise plan.error_at("tp", "tp=3 does not
        divide 32 heads", hint="use tp=2 or tp=4")``. Falls back to line 1, column 1 when the thing was
        not written (a default, or a plan built in code).
        """
        rule = where if isinstance(where, Rule) else next((r for r in self.rules if r.glob == where), None)
        if rule is not None and where not in self.positions:
            line, column, width = rule.line, rule.column, len(rule.glob)
        else:
            line, column = self.positions.get(where, (0, 0))
            width = None
        if line < 1 or column < 1:  # not written: a whole-plan error at line 1, column 1, no caret
            line = column = width = None
        return PlanError(
            message,
            text=self.source,
            line=line,
            column=column,
            width=width,
            hint=hint,
            filename=self.filename,
        )

    # -- text ---------------------------------------------------------------------------------------

    def __str__(self) -> str:
        axes = [f"{name}={size}" for name, size in self.axes]
        options = [f"{name}={OPTIONS[name].kind.format(value)}" for name, value in self.options]
        return " ".join(["auto"] * self.auto + axes + options + [str(rule) for rule in self.rules])

    def __repr__(self) -> str:
        return f"Plan({str(self)!r})"


def _check_axis(name: Any, size: Any) -> None:
    if name not in AXES:
        raise Problem(_unknown("axis", str(name), AXES))
    AXIS_SIZE.check(name, size)


def _check_options(options: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each option known and its value allowed; values normalized (``"on"`` -> True)."""
    checked = []
    for name, value in options.items():
        if name not in OPTIONS:
            raise Problem(_unknown("option", str(name), OPTIONS))
        checked.append((name, OPTIONS[name].kind.coerce(name, value)))
    return checked


def _check_unique(names: list[str], what: str) -> None:
    for i, name in enumerate(names):
        if name in names[:i]:
            raise Problem(f"{what} '{name}' is set twice")


def _unknown(what: str, name: str, choices: Iterable[str]) -> str:
    hint = did_you_mean(name, choices)
    return f"unknown {what} '{name}'" + (f"; {hint}" if hint else "")


def check_rules_match(plan: Plan, module_paths: Iterable[str]) -> None:
    """Raise PlanError at the first rule whose glob matches none of ``module_paths``.

    A rule that matches nothing is almost always a typo (``mlp.w2`` for ``mlp.down_proj``); the hint
    names the closest module path that exists.

    >>> check_rules_match(Plan("lm_head: vocab"), ["embed", "lm_head"])
    """
    paths = list(module_paths)
    for rule in plan.rules:
        if not any(rule.matches(path) for path in paths):
            near = difflib.get_close_matches(rule.glob, paths, n=1, cutoff=0.0)
            hint = f"closest module path: '{near[0]}'" if near else "the model has no modules"
            raise plan.error_at(rule, f"rule '{rule.glob}' matches no module of the model", hint)
