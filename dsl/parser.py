"""Plan text -> :class:`Plan`.

Three steps: lark parses ``plan.lark`` (LALR, contextual lexer) into a tree; :class:`_Syntax` turns the
tree into positioned syntax records; :class:`_PlanBuilder` checks every name and value against the
tables in ``options.py`` and builds the frozen Plan, raising PlanError at the offending token. For any
text, :func:`parse_plan` returns a Plan or raises PlanError; anything else is a bug in the reader.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedInput

from .errors import PlanError, Problem, closest
from .options import ACTIONS, AXES, AXIS_SIZE, OPTIONS, setting_names, whole_number
from .plan import Action, Plan, Rule, check_action, check_glob
from .syntax_errors import syntax_error


@dataclass(frozen=True)
class _Setting:
    """``name=value`` as written (an axis or an option)."""

    name: Token
    value: Token


@dataclass(frozen=True)
class _Flag:
    """A bare word as written (only ``auto``)."""

    name: Token


@dataclass(frozen=True)
class _Action:
    """``name`` or ``name(arg)`` as written."""

    name: Token
    arg: Token | None


@dataclass(frozen=True)
class _Rule:
    """``glob: action, ...`` as written."""

    glob: Token
    actions: tuple[_Action, ...]


class _Syntax(Transformer):
    """Tree -> syntax records; one method per grammar rule (the names in plan.lark)."""

    def start(self, items: list) -> list:
        return items

    def setting(self, children: list) -> _Setting:
        return _Setting(*children)

    def rule(self, children: list) -> _Rule:
        return _Rule(children[0], tuple(children[1:]))

    def action(self, children: list) -> _Action:
        return _Action(*children)

    def flag(self, children: list) -> _Flag:
        return _Flag(*children)


@functools.cache
def _parser() -> Lark:
    grammar = (Path(__file__).parent / "plan.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", lexer="contextual", maybe_placeholders=True)


def parse_plan(text: str) -> Plan:
    """Read plan text; raise :class:`PlanError` (with line, column and a hint) if it is not valid.

    Any str gives a Plan or a PlanError. A non-str argument is a programming error and raises
    TypeError; any other exception is a bug in usc's reader and propagates as itself (a PlanError
    would blame the plan's text for it).

    >>> plan = parse_plan("dp=2 tp=4; sp=on\\nlayers.*.mlp.down_proj: rowwise  # Megatron row")
    >>> plan.mesh_shape, plan.get("sp"), plan.rules[0].actions
    ((2, 4), True, (Action(name='rowwise', arg=None),))
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_plan expects the plan text as str, got {type(text).__name__}")
    return _parse(text)


@functools.cache
def _one_line_patterns() -> tuple[re.Pattern, re.Pattern]:
    """(one item, a whole line) of ``name=value`` items separated by single spaces: what
    ``PlanPoint.text`` writes, the planner's hundreds of texts per search. The value is the
    grammar's own VALUE terminal; the name a plain identifier (a subset of its HEAD). Every such
    text is in the grammar, one HEAD and one VALUE token per item, so ``_parse`` makes those tokens
    itself instead of running lark."""
    item = rf"([A-Za-z_][A-Za-z0-9_]*)=({_parser().get_terminal('VALUE').pattern.value})"
    return re.compile(item), re.compile(rf"{item}(?: {item})*")


def _simple_settings(text: str) -> list[_Setting] | None:
    """The settings of a one-line ``name=value ...`` text, as lark would tokenize them; else None."""
    item, line = _one_line_patterns()
    if not line.fullmatch(text):
        return None
    settings = []
    for match in item.finditer(text):
        if match.group(1) == "auto":  # the AUTO flag's keyword: lark reads it as a flag, then fails
            return None
        settings.append(_Setting(_token("HEAD", match, 1), _token("VALUE", match, 2)))
    return settings


def _token(kind: str, match: re.Match, group: int) -> Token:
    start, end = match.span(group)
    return Token(kind, match.group(group), start, 1, start + 1, 1, end + 1, end)


def _parse(text: str) -> Plan:
    simple = _simple_settings(text)
    if simple is None:
        return _parse_with_lark(text)
    builder = _PlanBuilder(text)
    for setting in simple:
        builder.add_setting(setting)
    return builder.plan()


def _parse_with_lark(text: str) -> Plan:
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as err:
        raise syntax_error(err, text) from None
    builder = _PlanBuilder(text)
    for item in _Syntax().transform(tree):
        if isinstance(item, _Rule):
            builder.add_rule(item)
        elif isinstance(item, _Flag):
            builder.add_flag(item)
        else:
            builder.add_setting(item)
    return builder.plan()


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a ``.usc`` plan file; PlanErrors name the file. OSError if it cannot be read.

    >>> import tempfile; f = tempfile.NamedTemporaryFile("w", suffix=".usc", delete=False)
    >>> _ = f.write("dp=2\\n"); f.close()
    >>> load_plan(f.name).world_size
    2
    """
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # tolerate the BOM some editors write
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise PlanError("the file is not UTF-8 text", line=line, column=column, filename=str(path)) from None
    try:
        return replace(parse_plan(text), filename=str(path))
    except PlanError as err:
        raise err.with_filename(str(path)) from None


class _PlanBuilder:
    """Collects checked axes, options and rules, remembering where each was written."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.axes: list[tuple[str, int]] = []
        self.options: list[tuple[str, Any]] = []
        self.rules: list[Rule] = []
        self.positions: dict[str, tuple[int, int]] = {}
        self.auto = False

    @contextmanager
    def _at(self, token: Token) -> Iterator[None]:
        """Report a :class:`Problem` raised inside as a PlanError underlining ``token``."""
        try:
            yield
        except Problem as problem:
            raise PlanError.from_problem(
                problem, text=self.text, line=token.line, column=token.column, width=len(token.value)
            ) from None

    def add_setting(self, setting: _Setting) -> None:
        """``dp=2`` -> an axis, ``zero=1`` -> an option; anything else is an unknown name."""
        name = setting.name.value
        with self._at(setting.name):
            self._check_new(name)
            kind = AXIS_SIZE if name in AXES else _option_kind(name)
        with self._at(setting.value):
            value = kind.parse(name, setting.value.value)
        (self.axes if name in AXES else self.options).append((name, value))
        self.positions[name] = (setting.name.line, setting.name.column)

    def add_flag(self, flag: _Flag) -> None:
        """``auto`` (the only bare word the grammar reads)."""
        with self._at(flag.name):
            self._check_new(flag.name.value)
        self.auto = True
        self.positions[flag.name.value] = (flag.name.line, flag.name.column)

    def _check_new(self, name: str) -> None:
        if name in self.positions:
            line, column = self.positions[name]
            what = "axis" if name in AXES else "option" if name in OPTIONS else "item"
            raise Problem(
                f"{what} '{name}' is set twice", f"first set at line {line}, column {column}; keep one"
            )

    def add_rule(self, rule: _Rule) -> None:
        """``glob: action, ...`` with a valid glob and distinct valid actions."""
        with self._at(rule.glob):
            check_glob(rule.glob.value)
        actions: list[Action] = []
        for syntax in rule.actions:
            action = self._action(syntax)
            if action.name in [a.name for a in actions]:
                with self._at(syntax.name):
                    raise Problem(
                        f"action '{action.name}' appears twice in one rule", "list each action once"
                    )
            actions.append(action)
        self.rules.append(Rule(rule.glob.value, tuple(actions), line=rule.glob.line, column=rule.glob.column))

    def _action(self, syntax: _Action) -> Action:
        """``rowwise`` / ``stage(2)``; the argument is checked where it was written."""
        name, arg = syntax.name, syntax.arg
        with self._at(name):
            if name.value not in ACTIONS:
                check_action(name.value, None)  # raises "unknown action" with a suggestion
        with self._at(arg or name):
            if arg is None or ACTIONS[name.value].arg is None:
                check_action(name.value, None if arg is None else arg.value)
                return Action(name.value)
            number = whole_number(arg.value)
            if number is None:
                raise Problem(
                    f"expected a whole number in '{name.value}(...)', got '{arg.value}'",
                    "write e.g. stage(0)",
                )
            check_action(name.value, number)
        return Action(name.value, number)

    def plan(self) -> Plan:
        return Plan(
            axes=tuple(self.axes),
            options=tuple(self.options),
            rules=tuple(self.rules),
            positions=self.positions,
            source=self.text,
            auto=self.auto,
        )


def _option_kind(name: str):
    """The value kind of option ``name``; an unknown name gets the nearest axis or option."""
    if name in OPTIONS:
        return OPTIONS[name].kind
    near = closest(name, setting_names())
    what = "axis" if near in AXES else "option"
    if near:
        raise Problem(f"unknown {what} '{name}'", f"did you mean '{near}'?")
    if any(c in name for c in ".*?["):
        raise Problem(f"unknown option '{name}'", "a rule is written 'glob: action' with ':' instead of '='")
    raise Problem(
        f"unknown option '{name}'",
        f"axes are {', '.join(AXES)}; options are {', '.join(OPTIONS)}",
    )
