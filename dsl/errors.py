"""Errors of the plan language.

Every mistake in a plan surfaces as one :class:`PlanError` that names the offending text by line and
column, shows the source line with a caret under it and, where we can guess it, proposes the fix. The
lark example ``error_reporting_lalr.py`` is the model: typical mistakes get specific, friendly
messages instead of a parser-state dump.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# A source line longer than this is shown as a window around the error, so the caret stays on screen.
_MAX_SHOWN = 100


class Problem(Exception):
    """A mistake found before we know where it was written (a value checker, a dataclass).

    The parser catches it and re-raises it as a :class:`PlanError` at the offending token; code that
    builds values directly turns it into a :class:`PlanError` at line 1, column 1.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class PlanError(ValueError):
    """A plan that cannot be read or is not valid.

    Attributes:
        message: the problem in one line, without position (``"zero must be 0..3, got 4"``).
        line, column: 1-based position of the offending text; 1, 1 for whole-plan errors.
        positioned: False for a whole-plan error (no line/column given): no caret is shown.
        text: the plan source the position refers to ("" when there is none).
        hint: the proposed fix (``"did you mean 'tp'?"``) or None.
        width: how many characters the caret underline covers.
        filename: the ``.usc`` file the plan came from, or None.

    ``str(error)`` renders all of it::

        line 1, column 6: zero must be 0..3, got 4
            dp=2 zero=4
                      ^
    """

    def __init__(
        self,
        message: str,
        *,
        text: str = "",
        line: int | None = None,
        column: int | None = None,
        width: int | None = None,
        hint: str | None = None,
        filename: str | None = None,
    ) -> None:
        self.message = message
        self.text = text
        # No position: an error about the whole plan. It still reports line 1, column 1 (every PlanError
        # has a position) but shows no caret, which would wrongly single out the first word.
        self.positioned = line is not None and column is not None
        self.line = max(1, int(line)) if self.positioned else 1
        self.column = max(1, int(column)) if self.positioned else 1
        self.width = max(1, width if width is not None else _word_width(text, self.line, self.column))
        self.hint = hint
        self.filename = filename
        super().__init__(self._render())

    @classmethod
    def from_problem(
        cls,
        problem: Problem,
        *,
        text: str = "",
        line: int | None = None,
        column: int | None = None,
        width: int | None = None,
    ) -> PlanError:
        """Place a :class:`Problem` at the text that caused it."""
        return cls(problem.message, text=text, line=line, column=column, width=width, hint=problem.hint)

    def with_filename(self, filename: str) -> PlanError:
        """The same error, naming the file it was read from (used by ``load_plan``)."""
        return PlanError(self.message, filename=filename, **self._where())

    def _where(self) -> dict:
        """Everything but the message and file name, as keywords for a copy."""
        line, column = (self.line, self.column) if self.positioned else (None, None)
        return dict(text=self.text, line=line, column=column, width=self.width, hint=self.hint)

    def __reduce__(self):
        # Keyword-only __init__ breaks the default exception pickling; errors cross process boundaries
        # when a launcher validates a plan in a worker.
        return (_rebuild, (self.message, self._where(), self.filename))

    def _render(self) -> str:
        where = f"line {self.line}, column {self.column}"
        head = f"{self.filename}: {where}: {self.message}" if self.filename else f"{where}: {self.message}"
        parts = [head]
        if self.positioned:
            parts += _source_with_caret(self.text, self.line, self.column, self.width)
        if self.hint:
            parts.append(f"    hint: {self.hint}")
        return "\n".join(parts)


def _rebuild(message: str, kwargs: dict, filename: str | None) -> PlanError:
    return PlanError(message, filename=filename, **kwargs)


def source_line(text: str, line: int) -> str:
    """Line ``line`` (1-based) of ``text``, split on '\\n' only as lark counts lines; '' when absent."""
    lines = text.split("\n")
    return lines[line - 1].rstrip("\r") if 1 <= line <= len(lines) else ""


def _word_width(text: str, line: int, column: int) -> int:
    """Width of the word starting at the position: what a caret under 'tp=3' should cover."""
    rest = source_line(text, line)[column - 1 :]
    width = 0
    while width < len(rest) and not rest[width].isspace() and rest[width] not in ";#":
        width += 1
    return max(1, width)


def _source_with_caret(text: str, line: int, column: int, width: int) -> list[str]:
    """The source line and a caret line under ``column`` (two lines, or none without source)."""
    src = source_line(text, line)
    if not src.strip():
        return []
    start = max(0, min(column - 1, len(src)) - _MAX_SHOWN // 2) if len(src) > _MAX_SHOWN else 0
    shown = src[start : start + _MAX_SHOWN]
    prefix = "..." if start else ""
    suffix = "..." if start + _MAX_SHOWN < len(src) else ""
    # Keep tabs so the caret lines up under them; show other unprintables as '?' (one column each).
    shown = "".join(c if c.isprintable() or c == "\t" else "?" for c in shown)
    pad = "".join(c if c == "\t" else " " for c in shown[: column - 1 - start])
    width = max(1, min(width, len(shown) - (column - 1 - start)))
    return [f"    {prefix}{shown}{suffix}", f"    {' ' * len(prefix)}{pad}{'^' * width}"]


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The valid word nearest to ``word`` (case-insensitive), or None when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    # 0.5 rather than difflib's 0.6 so that two-letter axes are found ('dq' -> 'dp' scores 0.5).
    found = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.5)
    return lowered[found[0]] if found else None


def did_you_mean(word: str, choices: Iterable[str], *, otherwise: str | None = None) -> str | None:
    """A hint ``did you mean 'x'?`` for the nearest valid word, else ``otherwise``."""
    near = closest(word, choices)
    return f"did you mean '{near}'?" if near else otherwise
