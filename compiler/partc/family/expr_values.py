"""Values of partc's expression language: the value type, its bounds, its spelling, host values
converted into it, and the error raised at an offset (shared by the parser and the evaluator)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import NoReturn, TypeAlias, TypeGuard

from partc.errors import ExpressionError
from partc.family.numbers import exact, fraction_text

Value: TypeAlias = int | bool | str | None | Fraction | tuple["Value", ...]
"""A value of the language: integer, bool, string, null, float (an exact rational, only from
config values: `partc.family.numbers`), or a tuple (a list) of values."""

MAX_DEPTH = 64
"""Deepest nesting of parentheses, brackets, calls and operators accepted."""
INT_BOUND = 2**63
"""Every integer, literal or intermediate, must satisfy |v| < INT_BOUND."""
MAX_LIST_LENGTH = 65536
"""Most elements a list built by repetition (`[w] * n`) or concatenation (`a + b`) may hold,
so that a hostile family cannot exhaust memory with a short expression."""


def fail(text: str, message: str, offset: int) -> NoReturn:
    """Raise an ExpressionError about `text` at 0-based `offset`."""
    raise ExpressionError(message, expression=text, offset=offset)


def too_deep() -> str:
    """The message of an expression nested beyond MAX_DEPTH."""
    return f"expression nests deeper than {MAX_DEPTH} levels"


def format_value(value: object) -> str:
    """The canonical spelling of a value: `true`, `null`, `'x'`, `[1, 2]` (repr for others)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 256 else f"<{value.bit_length()}-bit integer>"
    if isinstance(value, Fraction):
        return fraction_text(value)
    if isinstance(value, str):
        body = value.replace("\\", "\\\\").replace("'", "\\'")
        return "'" + body.replace("\n", "\\n").replace("\t", "\\t") + "'"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    return repr(value)


def clip(text: str, limit: int = 60) -> str:
    """`text` cut to at most `limit` characters (with `...`) for a message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind_name(value: Value) -> str:
    """The language's name of a value's type: null, bool, int, float, str or list."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, Fraction):
        return "float"
    return "str" if isinstance(value, str) else "list"


def describe(value: Value) -> str:
    """A value as messages show it: its type and (clipped) spelling."""
    return "null" if value is None else f"{kind_name(value)} ({clip(format_value(value))})"


def is_int(value: Value) -> TypeGuard[int]:
    """True for an integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Value) -> TypeGuard[int | Fraction]:
    """True for an integer (not a bool) or a float (an exact rational)."""
    return is_int(value) or isinstance(value, Fraction)


def unknown_message(kind: str, name: str, known: Sequence[str]) -> str:
    """`unknown <kind> `name``, with the closest known name and the first known names."""
    message = f"unknown {kind} `{name}`"
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        message += f"; did you mean `{close[0]}`?"
    names = sorted(known)
    if not names:
        return message + " (no names are defined here)"
    more = f", ... ({len(names) - 10} more)" if len(names) > 10 else ""
    return message + f" (known: {', '.join(names[:10])}{more})"


class BadValue(Exception):
    """A host value that the language cannot represent."""


def coerce(value: object, what: str, depth: int = 0, floats: bool = True) -> Value:
    """Return a host value as a Value (lists become tuples), or raise BadValue."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -INT_BOUND < value < INT_BOUND:
            raise BadValue(f"integer overflow: {what} = {format_value(value)} exceeds 2**63")
        return int(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float | Fraction) and floats:
        if isinstance(value, float) and not math.isfinite(value):
            raise BadValue(f"{what} is {value!r}; expressions handle only finite floats")
        rational = exact(value)
        if not -INT_BOUND < rational < INT_BOUND:
            raise BadValue(f"float overflow: {what} = {fraction_text(rational)} exceeds 2**63")
        return rational
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise BadValue(f"{what} nests lists deeper than {MAX_DEPTH} levels")
        return tuple(coerce(item, what, depth + 1, floats) for item in value)
    raise BadValue(f"{what} is a {type(value).__name__} ({clip(repr(value))}); expressions "
                    "handle only integers, floats, bools, strings, null and lists")

