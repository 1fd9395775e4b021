"""Every class of mistake gives a PlanError at the right line and column, with a caret and a hint."""

from __future__ import annotations

import pytest
from usc.dsl import PlanError, parse_plan

# (plan text, line, column, caret width, words in the message, words in the hint or None)
CASES = [
    # values of axes
    ("dp=", 1, 4, 1, "expected a whole number after 'dp='", "dp=2"),
    ("dp=two", 1, 4, 3, "expected a whole number after 'dp='", "dp=2"),
    ("tp=2.5", 1, 4, 3, "expected a whole number after 'tp='", None),
    ("tp=0", 1, 4, 1, "tp must be at least 1, got 0", None),
    ("dp=2 tp=-1", 1, 9, 2, "tp must be at least 1, got -1", None),
    ("dp=２", 1, 4, 1, "expected a whole number", None),
    ("dp=99999999999999999999999", 1, 4, 23, "too large", None),
    ("dp= tp=2", 1, 7, 1, "expected a whole number after 'dp='", "'tp=' starts a new setting"),
    # names
    ("dp=2 zer0=1", 1, 6, 4, "unknown option 'zer0'", "did you mean 'zero'?"),
    ("dq=2", 1, 1, 2, "unknown axis 'dq'", "did you mean 'dp'?"),
    ("DP=2", 1, 1, 2, "unknown axis 'DP'", "did you mean 'dp'?"),
    ("foo=1", 1, 1, 3, "unknown option 'foo'", "axes are dp, tp"),
    ("layers.*=2", 1, 1, 8, "unknown option 'layers.*'", "':' instead of '='"),
    # option values
    ("zero=4", 1, 6, 1, "zero must be 0..3, got 4", None),
    ("schedule=1f2b", 1, 10, 4, "unknown schedule '1f2b'", "did you mean '1f1b'?"),
    ("sp=yes", 1, 4, 3, "sp must be on or off", "sp=on"),
    ("bucket_mb=0", 1, 11, 1, "bucket_mb must be a number > 0", None),
    ("bucket_mb=lots", 1, 11, 4, "expected a number after 'bucket_mb='", None),
    ("split=a||b", 1, 7, 4, "is not a module path in split", None),
    ("schedule=", 1, 10, 1, "expected a value after 'schedule='", "gpipe|1f1b"),
    # repeats
    ("dp=2 dp=4", 1, 6, 2, "axis 'dp' is set twice", "line 1, column 1"),
    ("zero=1\nmb=2 zero=2", 2, 6, 4, "option 'zero' is set twice", "line 1, column 1"),
    ("a: colwise, colwise", 1, 13, 7, "action 'colwise' appears twice", None),
    # actions
    ("layers.*: colwsie", 1, 11, 7, "unknown action 'colwsie'", "did you mean 'colwise'?"),
    ("a: stage", 1, 4, 5, "'stage' needs a stage number", "stage(0)"),
    ("a: colwise(1)", 1, 12, 1, "'colwise' takes no argument", "only stage takes one"),
    ("a: stage(x)", 1, 10, 1, "expected a whole number in 'stage(...)'", None),
    ("a: stage(-1)", 1, 10, 2, "the stage number must be at least 0", None),
    ("a: stage()", 1, 10, 1, "expected a stage number after 'stage('", "stage(0)"),
    ("a:", 1, 3, 1, "expected an action after ':'", "actions are colwise"),
    ("a: vocab,", 1, 10, 1, "expected an action after ','", "actions are colwise"),
    ("a: colwise rowwise", 1, 19, 1, "expected '=' or ':' after 'rowwise'", "separated by ','"),
    # parentheses
    ("a: stage(1", 1, 11, 1, "missing ')'", "stage(1)"),
    ("a: stage(1 b: vocab", 1, 12, 1, "missing ')'", None),
    ("a: stage(1))", 1, 12, 1, "unbalanced ')'", None),
    (")", 1, 1, 1, "unbalanced ')'", None),
    ("a: (colwise)", 1, 4, 1, "expected an action after ':'", None),
    ("dp=2 (", 1, 6, 1, "unexpected '('", None),
    ("stage(1)", 1, 6, 1, "expected '=' or ':' after 'stage'", "is an action"),
    # stray characters and punctuation
    ("dp=2 @", 1, 6, 1, "unexpected character '@'", None),
    ("dp=2\n  lm_head: vocab €", 2, 18, 1, "unexpected character '€'", None),
    ("dp=2,tp=2", 1, 5, 1, "unexpected ','", "spaces, ';' or new lines"),
    ("=2", 1, 1, 1, "unexpected '='", None),
    ("dp=2 tp", 1, 8, 1, "expected '=' or ':' after 'tp'", "tp=<value>"),
    # globs
    ("layers..x: colwise", 1, 1, 9, "empty name between dots", None),
    ("layers.[0-3: colwise", 1, 1, 11, "unclosed '['", None),
    # position on a later line, after tabs and comments
    ("# header\ndp=2\n\ttp=x # c", 3, 5, 1, "expected a whole number after 'tp='", None),
]


@pytest.mark.parametrize(
    ("text", "line", "column", "width", "message", "hint"), CASES, ids=[c[0] for c in CASES]
)
def test_error_position_caret_and_hint(text, line, column, width, message, hint):
    with pytest.raises(PlanError) as info:
        parse_plan(text)
    err = info.value
    assert (err.line, err.column, err.width) == (line, column, width), str(err)
    rendered = str(err)
    assert rendered.startswith(f"line {line}, column {column}: ")
    assert message in err.message and message in rendered
    if hint is not None:
        assert hint in (err.hint or "") and f"hint: {err.hint}" in rendered
    assert err.text == text and isinstance(err, ValueError)
    assert _caret(rendered) == (column, width)


def _caret(rendered: str) -> tuple[int, int]:
    """(column, width) of the caret under the source line, tabs counted as one column."""
    lines = rendered.split("\n")
    caret = next(line for line in lines if line.strip().startswith("^"))
    source = lines[lines.index(caret) - 1]
    start = len(caret) - len(caret.lstrip(" \t"))
    assert source.startswith("    ")
    return start - 4 + 1, caret.count("^")


def test_long_lines_are_shown_as_a_window_around_the_error():
    text = "dp=2 " + "lm_head: vocab " * 40 + "zero=9 " + "a: rowwise " * 40
    with pytest.raises(PlanError) as info:
        parse_plan(text)
    source, caret = str(info.value).split("\n")[1:3]
    assert len(source) < 120 and "zero=9" in source
    assert source[caret.index("^")] == "9"


def test_crlf_files_report_the_same_positions():
    with pytest.raises(PlanError) as info:
        parse_plan("dp=2\r\ntp=x\r\n")
    assert (info.value.line, info.value.column) == (2, 4)
    assert "\r" not in str(info.value)


def test_a_bug_in_the_reader_is_not_blamed_on_the_plan_text(monkeypatch):
    """An exception inside the reader propagates as itself: a PlanError would point the user at
    their plan's line 1, column 1 for usc's own bug."""
    from usc.dsl import parser

    def broken(self, item):
        raise KeyError("a table entry the reader forgot")

    monkeypatch.setattr(parser._PlanBuilder, "add_setting", broken)
    with pytest.raises(KeyError, match="forgot"):
        parse_plan("dp=2")
