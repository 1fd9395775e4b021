"""Hypothesis strategies for plans, reusable by any test that needs a random valid plan.

Values are drawn per value *kind* (not per option name), so an option added to ``OPTIONS`` is covered
without touching this file; a new kind fails loudly in :func:`option_values`.
"""

from __future__ import annotations

from hypothesis import strategies as st
from usc.dsl import ACTIONS, AXES, OPTIONS, Action, Plan, Rule
from usc.dsl.options import ByteSize, Choice, NameOrFile, PositiveNumber, SplitPoints, Switch, WholeNumber

_LOWER = "abcdefghijklmnopqrstuvwxyz_"
identifiers = st.builds(str.__add__, st.sampled_from(_LOWER), st.text(_LOWER + "0123456789", max_size=7))
module_paths = st.lists(st.one_of(identifiers, st.integers(0, 99).map(str)), min_size=1, max_size=4).map(
    ".".join
)
_glob_parts = st.one_of(
    identifiers,
    st.integers(0, 99).map(str),
    st.sampled_from(["*", "?", "[0-3]", "[!0]", "[ab]", "[0-9]*"]),
    identifiers.map(lambda name: name + "*"),
)
globs = st.lists(_glob_parts, min_size=1, max_size=5).map(".".join)

_BY_KIND = {
    WholeNumber: lambda kind: st.integers(kind.lo, kind.hi if kind.hi is not None else kind.lo + 4096),
    PositiveNumber: lambda kind: st.floats(
        min_value=0.0, exclude_min=True, allow_nan=False, allow_infinity=False
    ),
    Choice: lambda kind: st.sampled_from(kind.words),
    NameOrFile: lambda kind: st.one_of(st.sampled_from(kind.words),
                                       identifiers.map(lambda name: name + kind.suffixes[0])),
    Switch: lambda kind: st.booleans(),
    ByteSize: lambda kind: st.integers(1, 2**50),
    SplitPoints: lambda kind: st.one_of(
        st.just("auto"), st.lists(module_paths, min_size=1, max_size=4, unique=True).map(tuple)
    ),
}


def option_values(name: str) -> st.SearchStrategy:
    """Valid values (as stored in a Plan) for option ``name``."""
    kind = OPTIONS[name].kind
    return _BY_KIND[type(kind)](kind)


def _action(name: str) -> st.SearchStrategy[Action]:
    if ACTIONS[name].arg is None:
        return st.just(Action(name))
    return st.integers(0, 31).map(lambda number: Action(name, number))


# Built once: strategies made inside a draw are re-validated on every example, which is slow.
actions = st.one_of([_action(name) for name in ACTIONS])
"""One valid action; ``stage`` gets a stage number."""
rules = st.builds(
    lambda glob, acts: Rule(glob, tuple(acts)),
    globs,
    st.lists(actions, min_size=1, max_size=3, unique_by=lambda action: action.name),
)
"""A rule with 1..3 distinct actions."""
_OPTION_VALUES = {name: option_values(name) for name in OPTIONS}
_RULE_LISTS = st.lists(rules, max_size=4)


@st.composite
def plans(draw) -> Plan:
    """A random valid Plan: some axes in random order, some options, some rules."""
    axis_names = draw(st.lists(st.sampled_from(AXES), unique=True, max_size=len(AXES)))
    axes = tuple((name, draw(st.integers(1, 64))) for name in axis_names)
    option_names = draw(st.lists(st.sampled_from(list(OPTIONS)), unique=True, max_size=6))
    options = tuple((name, draw(_OPTION_VALUES[name])) for name in option_names)
    return Plan(axes=axes, options=options, rules=tuple(draw(_RULE_LISTS)))


# Strategies are module constants: building them inside a draw costs a validation per example.
_SEPARATORS = st.sampled_from([" ", "  ", ";", " ; ", "\n", "\n\n", "\t", "\r\n", " # a comment\n", ";\n"])
_LEADERS = st.sampled_from(["", " ", "\n", "# header\n", ";"])
_EQUALS = st.sampled_from(["=", " = ", "= ", " ="])
_COMMAS = st.sampled_from([",", ", ", " , ", ",\n  "])
_COLONS = st.sampled_from([":", ": ", " : ", ":\n  "])
_PICK = st.integers(0, 2)


@st.composite
def plan_texts(draw, plan: Plan) -> str:
    """A way of writing ``plan``: items interleaved (axes and rules keep their order, options move
    freely), random separators and comments, optional spaces around '=' ':' ','."""
    axes = [_spaced_setting(draw, f"{name}={size}") for name, size in plan.axes]
    options = [_spaced_setting(draw, item) for item in str(Plan(options=plan.options)).split()]
    draw(st.randoms(use_true_random=False)).shuffle(options)
    rules = [
        draw(_COLONS).join((rule.glob, draw(_COMMAS).join(map(str, rule.actions)))) for rule in plan.rules
    ]
    queues = [queue for queue in (axes, options, rules) if queue]
    items = []
    while queues:
        queue = queues[draw(_PICK) % len(queues)]
        items.append(queue.pop(0))
        queues = [queue for queue in queues if queue]
    return draw(_LEADERS) + "".join(item + draw(_SEPARATORS) for item in items)


def _spaced_setting(draw, item: str) -> str:
    name, value = item.split("=")
    return name + draw(_EQUALS) + value
