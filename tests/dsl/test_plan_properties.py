"""Property tests: printed plans parse back equal; no input makes the parser raise anything but PlanError."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from plan_strategies import identifiers, option_values, plan_texts, plans
from usc.dsl import AXES, OPTIONS, Action, Plan, PlanError, Rule, parse_plan

# Bounded so the whole dsl suite stays well under 20 s.
fast = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PLANISH = list("dptcpe=:;,()#*.?[]!-_ \n\t\r0123456789abcxyzonf|")
plan_chars = st.one_of(st.sampled_from(PLANISH), st.characters())


def parse_or_error(text: str) -> Plan | PlanError:
    """The parsed plan, or the PlanError after checking its position lies inside ``text``."""
    try:
        return parse_plan(text)
    except PlanError as err:
        lines = text.split("\n")
        assert isinstance(err.line, int) and isinstance(err.column, int)
        assert 1 <= err.line <= len(lines), (text, str(err))
        assert 1 <= err.column <= len(lines[err.line - 1]) + 1, (text, str(err))
        assert f"line {err.line}, column {err.column}" in str(err)
        return err


@fast
@given(plans())
def test_str_parses_back_to_an_equal_plan(plan):
    text = str(plan)
    assert parse_plan(text) == plan
    assert str(parse_plan(text)) == text


@fast
@given(plans())
def test_repr_evaluates_back(plan):
    assert eval(repr(plan), {"Plan": Plan}) == plan
    for rule in plan.rules:
        assert eval(repr(rule), {"Rule": Rule, "Action": Action}) == rule


@fast
@given(st.data())
def test_any_way_of_writing_a_plan_parses_to_it(data):
    plan = data.draw(plans())
    text = data.draw(plan_texts(plan))
    assert parse_plan(text) == plan, text


@fast
@given(st.text(plan_chars, max_size=80))
def test_random_text_raises_only_plan_error(text):
    result = parse_or_error(text)
    if isinstance(result, Plan):
        assert parse_plan(str(result)) == result


@st.composite
def mutated_plan_texts(draw):
    """A valid plan's text with a few characters inserted, deleted or replaced."""
    text = str(draw(plans()))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["insert", "delete", "replace"]))
        char = draw(plan_chars)
        tail = text[at + 1 :] if edit != "insert" else text[at:]
        text = text[:at] + ("" if edit == "delete" else char) + tail
    return text


@fast
@given(mutated_plan_texts())
def test_mutated_plans_raise_only_plan_error(text):
    result = parse_or_error(text)
    if isinstance(result, Plan):
        assert parse_plan(str(result)) == result


@fast
@given(st.sampled_from(list(OPTIONS)).flatmap(lambda name: st.tuples(st.just(name), option_values(name))))
def test_every_option_value_round_trips_through_text(name_value):
    name, value = name_value
    plan = Plan(options=((name, value),))
    assert parse_plan(str(plan)).get(name) == value


def test_every_option_has_a_strategy_and_a_valid_default():
    for name, spec in OPTIONS.items():
        option_values(name)  # KeyError for a value kind the strategies do not know
        if spec.default is not None:
            assert spec.kind.check(name, spec.default) == spec.default


def _outcome(parse, text: str):
    try:
        return parse(text)
    except PlanError as err:
        return ("PlanError", str(err), err.line, err.column)


_VALUEISH = st.text(st.sampled_from(list("0123456789abfnoz.|_-*%+")), min_size=1, max_size=8)
_HEADS = st.one_of(st.sampled_from([*AXES, *OPTIONS, "auto", "autox", "zer0"]), identifiers)


@st.composite
def one_line_settings(draw):
    """``name=value`` items on one line: the planner's texts, misspelt names, bad values, repeats."""
    values = st.one_of(_VALUEISH, st.sampled_from(["on", "off", "2", "auto"]))
    items = draw(st.lists(st.tuples(_HEADS, values), min_size=1, max_size=6))
    return " ".join(f"{name}={value}" for name, value in items)


@fast
@given(st.one_of(one_line_settings(), plans().map(str), plans().flatmap(plan_texts), mutated_plan_texts()))
@example("auto=2")  # lark reads the AUTO keyword, then fails at '='
@example("dp=2 auto=on")
@example("dp=2 dp=4")
@example("zero=7 mb=0")
@example("tp=2 split=layers.3|layers.7")
def test_one_line_settings_read_without_lark_give_what_lark_gives(text):
    """The reader's own path for ``name=value`` lines (the planner's hundreds of texts per search)
    builds the same plan -- positions and source included -- or the same error as the grammar."""
    from usc.dsl import parser

    assert _outcome(parser.parse_plan, text) == _outcome(parser._parse_with_lark, text)


def test_the_planners_texts_take_the_one_line_path():
    from usc.dsl import parser

    text = "dp=2 tp=4 pp=2 zero=1 mb=8 sp=on recompute=full dtype=bf16 fuse=on schedule=interleaved v=2"
    assert parser._simple_settings(text) is not None
    assert parser._simple_settings("dp=2; tp=2") is None and parser._simple_settings("auto dp=2") is None
