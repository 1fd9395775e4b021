"""Friendly messages for lark's syntax errors.

Lark reports "unexpected token X, expected one of {A, B}" plus the parser state. We turn the expected
set (which says where in an item the parser was) and the tokens just read (lark's value stack) into the
message a person needs: ``dp=`` -> "expected a whole number after 'dp='", ``stage(1`` -> "missing ')'".
The table :data:`_BY_EXPECTED` maps each parser situation to the function writing its message.
"""

from __future__ import annotations

from collections.abc import Callable

from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from .errors import PlanError
from .options import ACTIONS, AXES, OPTIONS

_PUNCTUATION = {"EQUAL": "=", "COLON": ":", "COMMA": ",", "LPAR": "(", "RPAR": ")", "SEMICOLON": ";"}
_HEAD_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.*?[]!-")
_ACTION_LIST = ", ".join("stage(N)" if name == "stage" else name for name in ACTIONS)
_RULE_FORM = "a rule lists actions after ':', separated by ',' (lm_head: vocab, recompute)"
_ITEM_FORMS = "write name=value for an axis or option, glob: action for a rule"

# What a message builder gets: the unexpected token and the tokens read just before it (latest last).
Builder = Callable[[Token, list], tuple[str, str | None]]


def syntax_error(err: UnexpectedInput, text: str) -> PlanError:
    """The PlanError for a lark parse failure, placed at the offending text."""
    if isinstance(err, UnexpectedCharacters):
        char = text[err.pos_in_stream] if 0 <= err.pos_in_stream < len(text) else "?"
        return PlanError(
            f"unexpected character {char!r}", text=text, line=err.line, column=err.column, width=1
        )
    if not isinstance(err, UnexpectedToken):
        return PlanError(
            f"cannot read the plan: {err}", text=text, line=_int(err.line), column=_int(err.column)
        )
    token, before = err.token, _tokens_before(err)
    line, column, width = _place(token)
    if token.type not in _PUNCTUATION and token.type != "$END" and token.value[:1] not in _HEAD_CHARS:
        return PlanError(
            f"unexpected character {token.value[0]!r}", text=text, line=line, column=column, width=1
        )
    builder = _BY_EXPECTED.get(frozenset(err.expected), _unexpected_item)
    message, hint = builder(token, before)
    return PlanError(message, text=text, line=line, column=column, width=width, hint=hint)


def _tokens_before(err: UnexpectedToken) -> list:
    """The values lark had shifted when it stopped (Tokens, or subtrees already reduced)."""
    parser = getattr(err, "interactive_parser", None)
    return list(parser.parser_state.value_stack) if parser is not None else []


def _place(token: Token) -> tuple[int, int, int]:
    """(line, column, width) to underline; the end of input sits just after the last token."""
    if token.type == "$END":
        if token.end_line is None:
            return _int(token.line), _int(token.column), 1
        return token.end_line, token.end_column, 1
    return _int(token.line), _int(token.column), max(1, len(token.value))


def _int(value: object) -> int:
    return value if isinstance(value, int) and value >= 1 else 1


def _shown(token: Token) -> str:
    return "the end of the plan" if token.type == "$END" else f"'{token.value}'"


def _last(before: list, back: int = 1) -> str:
    """The text of the token ``back`` places before the error ('' when it is not a token)."""
    value = before[-back] if len(before) >= back else None
    return value.value if isinstance(value, Token) else ""


def _after_equal(token: Token, before: list) -> tuple[str, str | None]:
    """``dp=`` / ``schedule=;`` / ``stage(`` : the value is missing."""
    if _last(before) == "(":
        action = _last(before, 2)
        return f"expected a stage number after '{action}(', found {_shown(token)}", f"write e.g. {action}(0)"
    return missing_value(_last(before, 2), token)


def missing_value(name: str, token: Token) -> tuple[str, str | None]:
    """Message for ``name=`` with no value: axes want a whole number, options their own domain."""
    if name in AXES:
        return f"expected a whole number after '{name}=', found {_shown(token)}", f"write e.g. {name}=2"
    if name in OPTIONS:
        spec = OPTIONS[name]
        return f"expected a value after '{name}=', found {_shown(token)}", f"{name} is {spec.kind.describe()}"
    return f"expected a value after '{name}=', found {_shown(token)}", None


def _after_head(token: Token, before: list) -> tuple[str, str | None]:
    """``tp 2`` / ``colwise rowwise``: a word that is neither ``name=value`` nor ``glob: ...``."""
    head = _last(before)
    message = f"expected '=' or ':' after '{head}', found {_shown(token)}"
    if head in ACTIONS:
        return (
            message,
            f"'{head}' is an action: {_RULE_FORM}",
        )
    if head in AXES or head in OPTIONS:
        return message, f"write {head}=<value>"
    return message, _ITEM_FORMS


def _after_colon(token: Token, before: list) -> tuple[str, str | None]:
    """``lm_head:`` / ``lm_head: vocab,`` with no action after it."""
    return f"expected an action after '{_last(before)}', found {_shown(token)}", f"actions are {_ACTION_LIST}"


def _after_argument(token: Token, before: list) -> tuple[str, str | None]:
    """``stage(1`` : the ')' is missing."""
    action, arg = _last(before, 3), _last(before)
    return f"missing ')' after '{action}({arg}'", f"write {action}({arg})"


def _unexpected_item(token: Token, before: list) -> tuple[str, str | None]:
    """Between items: a stray ')', a ',' between settings, or a value that is followed by '='."""
    if token.type == "EQUAL" and _last(before, 2) == "=":
        message, _ = missing_value(_last(before, 3), token)
        return (
            message,
            f"'{_last(before)}=' starts a new setting; the value of '{_last(before, 3)}=' is missing",
        )
    if token.type == "RPAR":
        return "unbalanced ')'", "remove it, or write stage(N)"
    if token.type == "COMMA":
        return "unexpected ','", "separate settings and rules with spaces, ';' or new lines"
    if token.type == "LPAR":
        return "unexpected '('", "only the action stage takes an argument: 'layers.[0-3]: stage(0)'"
    return f"unexpected {_shown(token)}", _ITEM_FORMS


_BY_EXPECTED: dict[frozenset, Builder] = {
    frozenset({"VALUE"}): _after_equal,
    frozenset({"EQUAL", "COLON"}): _after_head,
    frozenset({"NAME"}): _after_colon,
    frozenset({"RPAR"}): _after_argument,
}
