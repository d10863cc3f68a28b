"""Python literals for generated modules, spelled as `ruff format` (line length 100) spells them.

Every value from a family, a config or a checkpoint reaches generated code through
`python_literal` (an escaped, ASCII-only literal) or `lines_literal` (a quote- and
backslash-free text block, else escaped strings); `formatted_literal` lays a literal out over
lines the way the formatter does, so a generated package passes `ruff format --check` without
partc ever running a formatter (an upgrade of one would change the bytes).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from partc.errors import EmitError

if TYPE_CHECKING:
    from collections.abc import Sequence

LINE_LENGTH = 100
"""The line length generated modules are laid out for (ruff's and the project's)."""

_INDENT = 4

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string(value: str) -> str:
    """A printable-ASCII string literal in the formatter's quotes: double, unless the text holds
    more double quotes than single ones."""
    if value.isascii() and value.isprintable() and not any(c in value for c in "\\'\""):
        return '"' + value + '"'  # plain printable ASCII (most strings): as is
    quote = "'" if value.count('"') > value.count("'") else '"'
    body = "".join(
        _ESCAPES.get(c) or ("\\" + c if c == quote else c if " " <= c <= "~"
                            else ascii(c)[1:-1]) for c in value)
    return quote + body + quote


def python_literal(value: Any) -> str:
    """Deterministic Python source for plain data: None, bool, int, str, tuple, list, dict."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise EmitError(f"cannot emit non-finite float {value!r}")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, tuple | list):
        items = ", ".join(python_literal(v) for v in value)
        return f"({items},)" if len(value) == 1 else f"({items})"
    if isinstance(value, dict):
        items = ", ".join(f"{python_literal(k)}: {python_literal(v)}"
                          for k, v in sorted(value.items()))
        return "{" + items + "}"
    raise EmitError(f"cannot emit a value of type {type(value).__name__}")


def _laid_out(value: Any, indent: int, head: str, tail: str) -> str:
    """`head` + the literal + `tail` starting at column `indent`: on one line when it fits,
    else the outermost brackets opened with one item per line (each laid out the same way)
    and a trailing comma, as the formatter splits a collection."""
    flat = python_literal(value)
    if (indent + len(head) + len(flat) + len(tail) <= LINE_LENGTH
            or not isinstance(value, tuple | list | dict) or not value):
        return head + flat + tail
    inner = indent + _INDENT
    pad = " " * inner
    if isinstance(value, dict):
        lines = [head + "{"] + [pad + _laid_out(v, inner, python_literal(k) + ": ", ",")
                                for k, v in sorted(value.items())]
        return "\n".join([*lines, " " * indent + "}" + tail])
    lines = [head + "("] + [pad + _laid_out(v, inner, "", ",") for v in value]
    return "\n".join([*lines, " " * indent + ")" + tail])


def formatted_literal(value: Any, head: str = "", indent: int = 0, tail: str = "") -> str:
    """The literal of `value` laid out as the formatter would after `head` (e.g. `NAME = `,
    not included in the result) at column `indent`, followed by `tail` (not included either).

    A scalar too long for its line is parenthesized on a line of its own when that fits, as
    the formatter does for the right-hand side of an assignment.
    """
    laid_out = _laid_out(value, indent, head, tail)
    text = laid_out[len(head):len(laid_out) - len(tail)]
    if "\n" not in text and indent + len(head) + len(text) + len(tail) > LINE_LENGTH \
            and not isinstance(value, tuple | list | dict) \
            and indent + _INDENT + len(text) <= LINE_LENGTH and head.endswith("= "):
        return "(\n" + " " * (indent + _INDENT) + text + "\n" + " " * indent + ")"
    return text


def laid_out_row(value: Any, key: Any = None) -> tuple[str, str]:
    """(flat literal, the line(s) the formatter gives it as an item of a split top-level
    collection: indented, with a trailing comma) of a tuple item, or with `key` of a dict
    entry (`key: value`); `collection_literal` joins them."""
    head = "" if key is None else python_literal(key) + ": "
    return head + python_literal(value), " " * _INDENT + _laid_out(value, _INDENT, head, ",")


def collection_literal(rows: Sequence[tuple[str, str]], head: str, brackets: str = "()") -> str:
    """A tuple (or with brackets "{}" a dict) of `laid_out_row` items after `head`: on one line
    when it fits, else one item per line. The same text `formatted_literal` gives for the
    collection, from items laid out once (a stage's ranks share most rows)."""
    if not rows:
        return brackets
    comma = "," if len(rows) == 1 and brackets == "()" else ""
    flat = brackets[0] + ", ".join(f for f, _ in rows) + comma + brackets[1]
    if len(head) + len(flat) <= LINE_LENGTH:
        return flat
    return brackets[0] + "\n" + "\n".join(r for _, r in rows) + "\n" + brackets[1]


_PLAIN_TEXT = re.compile(r"[ !#-\[\]-~\n]*")
"""Printable ASCII and line breaks, without quotes or backslashes: safe in a triple-quoted
literal exactly as written."""


def lines_literal(lines: Sequence[str], head: str = "") -> str:
    """A literal holding `lines` for a GROUPS or TARGETS table (after `head`, e.g. `NAME = `).

    Readable triple-quoted text, one line per item, when every item is plain printable ASCII
    without quotes, backslashes or line breaks (real checkpoints); otherwise a tuple of escaped
    strings. `partc.runtime` reads both.
    """
    text = "".join(line + "\n" for line in lines)
    if _PLAIN_TEXT.fullmatch(text) and text.count("\n") == len(lines):
        return '"""\\\n' + text + '"""'
    return formatted_literal(tuple(lines), head)
