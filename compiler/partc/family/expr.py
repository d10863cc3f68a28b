"""partc's safe expression language: the formulas and name templates of family files.

User text is tokenized and parsed by hand into a small tree (`expr_parse`) that is interpreted
with strict types and hard bounds (`expr_eval`, over the values of `expr_values`); it never
reaches `eval`, `exec` or `compile`. Every failure, at parse or at evaluation time, is an
`ExpressionError` carrying the 0-based offset of the culprit. This module is the face the rest
of partc uses: `Expression`, `Template` and their parsers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from partc.errors import ExpressionError
from partc.family.expr_eval import evaluate_tree
from partc.family.expr_parse import Node, parse_tree
from partc.family.expr_values import (
    INT_BOUND,
    BadValue,
    Value,
    clip,
    coerce,
    describe,
    fail,
    format_value,
    is_int,
)
from partc.family.numbers import fraction_text

MAX_TEXT_LENGTH = 1000
"""Longest expression or template text accepted, in characters."""
MAX_STRING_LENGTH = 1000
"""Longest string an expression or a template may produce."""


@dataclass(frozen=True, slots=True)
class Expression:
    """A parsed expression: its source text, the free names it reads, and its evaluator."""

    text: str
    """The source text (the canonical spelling for constants)."""
    names: frozenset[str]
    """Every name the expression may read, including in branches not taken."""
    _root: Node = field(repr=False, compare=False)

    @property
    def is_constant(self) -> bool:
        """True when the expression reads no names."""
        return not self.names

    def evaluate(self, env: Mapping[str, Value]) -> Value:
        """Evaluate with names bound by `env` (lists in `env` are accepted as tuples)."""
        value = evaluate_tree(self._root, self.text, env)
        if isinstance(value, str) and len(value) > MAX_STRING_LENGTH:
            fail(self.text, f"string result is {len(value)} characters long; the limit is "
                  f"{MAX_STRING_LENGTH}", self._root.start)
        return value

    def evaluate_int(self, env: Mapping[str, Value]) -> int:
        """Evaluate and require an integer (bool is not one)."""
        value = self.evaluate(env)
        if isinstance(value, Fraction):
            fail(self.text, f"expected an integer, found float {fraction_text(value)}; "
                  "round it explicitly with floor(), ceil() or round()", self._root.start)
        if not is_int(value):
            fail(self.text, f"expected an integer, found {describe(value)}", self._root.start)
        return value

    def evaluate_bool(self, env: Mapping[str, Value]) -> bool:
        """Evaluate and require a bool."""
        value = self.evaluate(env)
        if not isinstance(value, bool):
            fail(self.text, f"expected a bool, found {describe(value)}", self._root.start)
        return value


def parse(text: str) -> Expression:
    """Parse expression text; raise ExpressionError at the offset of the offending token."""
    if not isinstance(text, str):
        fail(clip(repr(text)), f"expected expression text, found {type(text).__name__}", 0)
    return _parse(text)


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> Expression:
    if len(text) > MAX_TEXT_LENGTH:
        fail(text, f"expression is {len(text)} characters long; the limit is "
              f"{MAX_TEXT_LENGTH}", MAX_TEXT_LENGTH)
    root, names = parse_tree(text)
    return Expression(text, names, root)


def constant(value: Value) -> Expression:
    """An Expression that always yields `value`; its text is the canonical spelling."""
    try:
        checked = coerce(value, "the constant", floats=False)  # no float literals
    except BadValue as bad:
        raise ExpressionError(str(bad), expression=clip(repr(value)), offset=0) from None
    text = format_value(checked)
    if isinstance(checked, str) and len(checked) > MAX_STRING_LENGTH:
        fail(clip(text), f"string constant is {len(checked)} characters long; the limit is "
              f"{MAX_STRING_LENGTH}", 0)
    return Expression(text, frozenset(), Node("literal", 0, len(text), value=checked))


@dataclass(frozen=True, slots=True)
class TemplateField:
    """One `{expr}` field of a template and the offset of its text in the template."""

    expression: Expression
    """The parsed field text."""
    offset: int
    """0-based offset of the field text (just after `{`) in the template text."""


@dataclass(frozen=True, slots=True)
class Template:
    """A string with `{expr}` fields and `{{` / `}}` escapes, e.g. `model.layers.{unit}.mlp`."""

    text: str
    """The template source text."""
    parts: tuple[str | TemplateField, ...]
    """Literal text (escapes resolved) and fields, in order."""
    names: frozenset[str]
    """Every name the fields may read."""

    @property
    def is_constant(self) -> bool:
        """True when the template has no fields."""
        return all(isinstance(part, str) for part in self.parts)

    @property
    def fields(self) -> tuple[TemplateField, ...]:
        """The fields, in order."""
        return tuple(part for part in self.parts if isinstance(part, TemplateField))

    def render(self, env: Mapping[str, Value]) -> str:
        """Substitute every field; each must evaluate to an integer or a string."""
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            root = part.expression._root
            if root.kind == "name" and root.name in env:  # `{name}` of a plain str or int:
                value = env[root.name]  # what `evaluate` would give, without its overhead
                if type(value) is str and len(value) <= MAX_STRING_LENGTH or (
                        type(value) is int and -INT_BOUND < value < INT_BOUND):
                    out.append(str(value))
                    continue
            try:
                value = part.expression.evaluate(env)
            except ExpressionError as error:
                offset = part.offset + error.offset
                raise ExpressionError(error.message, expression=self.text, offset=offset) from None
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                fail(self.text, f"template field `{{{part.expression.text}}}` must be an integer "
                      f"or a string, found {describe(value)}", part.offset)
            out.append(str(value))
        result = "".join(out)
        if len(result) > MAX_STRING_LENGTH:
            fail(self.text, f"rendered template is {len(result)} characters long; the limit is "
                  f"{MAX_STRING_LENGTH}", 0)
        return result


def _field_end(text: str, start: int) -> int:
    """Offset of the `}` closing the field opened at `start`, skipping quoted strings."""
    pos = start + 1
    while pos < len(text):
        char = text[pos]
        if char == "}":
            return pos
        if char == "{":
            fail(text, "`{` inside a template field: fields cannot nest", pos)
        if char in "'\"":
            end = pos + 1
            while end < len(text) and text[end] != char:
                end += 2 if text[end] == "\\" else 1
            if end >= len(text):
                fail(text, f"unterminated string in the template field at offset {start}", pos)
            pos = end
        pos += 1
    fail(text, "unclosed `{` in template: close the field with `}` or write `{{` for a "
          "literal brace", start)


def parse_template(text: str) -> Template:
    """Parse a template; raise ExpressionError for unbalanced braces or a bad field."""
    if not isinstance(text, str):
        fail(clip(repr(text)), f"expected template text, found {type(text).__name__}", 0)
    return _parse_template(text)


@functools.lru_cache(maxsize=4096)
def _parse_template(text: str) -> Template:
    if len(text) > MAX_TEXT_LENGTH:
        fail(text, f"template is {len(text)} characters long; the limit is {MAX_TEXT_LENGTH}",
              MAX_TEXT_LENGTH)
    parts: list[str | TemplateField] = []
    literal: list[str] = []
    pos = 0
    while pos < len(text):
        char, pair = text[pos], text[pos:pos + 2]
        if pair in ("{{", "}}"):
            literal.append(char)
            pos += 2
        elif char == "}":
            fail(text, "single `}` in template: write `}}` for a literal brace", pos)
        elif char == "{":
            end = _field_end(text, pos)
            if not text[pos + 1:end].strip():
                fail(text, "empty template field `{}`: write `{{}}` for literal braces", pos)
            try:
                expression = parse(text[pos + 1:end])
            except ExpressionError as error:
                offset = pos + 1 + error.offset
                raise ExpressionError(error.message, expression=text, offset=offset) from None
            if literal:
                parts.append("".join(literal))
                literal = []
            parts.append(TemplateField(expression, pos + 1))
            pos = end + 1
        else:
            literal.append(char)
            pos += 1
    if literal:
        parts.append("".join(literal))
    names: set[str] = set()
    for part in parts:
        if isinstance(part, TemplateField):
            names |= part.expression.names
    return Template(text, tuple(parts), frozenset(names))
