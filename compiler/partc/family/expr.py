"""partc's safe expression language: the formulas and name templates of family files.

User text is tokenized and parsed by hand into a small tree that is interpreted with strict
types and hard bounds; it never reaches `eval`, `exec` or `compile`. Every failure, at parse or
at evaluation time, is an `ExpressionError` carrying the 0-based offset of the culprit.
"""

from __future__ import annotations

import difflib
import functools
import math
import operator
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, NoReturn, TypeAlias, TypeGuard

from partc.errors import ExpressionError
from partc.family.numbers import ROUNDING, exact, fraction_text

Value: TypeAlias = int | bool | str | None | Fraction | tuple["Value", ...]
"""A value of the language: integer, bool, string, null, float (an exact rational, only from
config values: `partc.family.numbers`), or a tuple (a list) of values."""

MAX_TEXT_LENGTH = 1000
"""Longest expression or template text accepted, in characters."""
MAX_DEPTH = 64
"""Deepest nesting of parentheses, brackets, calls and operators accepted."""
INT_BOUND = 2**63
"""Every integer, literal or intermediate, must satisfy |v| < INT_BOUND."""
MAX_STRING_LENGTH = 1000
"""Longest string an expression or a template may produce."""
MAX_TUPLE_LENGTH = 1000
"""Most elements in a list literal (and arguments in a call)."""

_COND, _OR, _AND, _NOT, _CMP, _SUM, _TERM = range(1, 8)
_INFIX_LEVELS = {
    "if": _COND, "or": _OR, "and": _AND,
    "==": _CMP, "!=": _CMP, "<": _CMP, "<=": _CMP, ">": _CMP, ">=": _CMP, "in": _CMP,
    "+": _SUM, "-": _SUM, "*": _TERM, "//": _TERM, "%": _TERM,
}
_KEYWORD_VALUES: dict[str, Value] = {
    "true": True, "True": True, "false": False, "False": False, "null": None, "None": None,
}
_KEYWORDS = frozenset({"and", "or", "not", "if", "else", "in", *_KEYWORD_VALUES})
_IDENT_START = frozenset(string.ascii_letters + "_")
_DIGITS = frozenset(string.digits)
_IDENT_CHARS = _IDENT_START | _DIGITS
_OPS = frozenset({"+", "-", "*", "//", "%", "==", "!=", "<", "<=", ">", ">=", "(", ")", "[", "]",
                  ","})
_BAD_OPS = {
    "/": "`/` is not supported: use `//` for integer (floor) division",
    "**": "`**` (power) is not supported",
    "=": "`=` is not an operator: use `==` to compare",
    "!": "`!` is not an operator: use `not`",
    "&&": "`&&` is not an operator: use `and`",
    "&": "`&` is not an operator: use `and`",
    "||": "`||` is not an operator: use `or`",
    "|": "`|` is not an operator: use `or`",
    ".": "attribute access with `.` is not supported",
    ":": "`:` is not supported (no slices, no format specifications)",
}
_TWO_CHAR_OPS = frozenset(op for op in (*_OPS, *_BAD_OPS) if len(op) == 2)
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "t": "\t"}
_EXPONENT = re.compile(r"[0-9]+[eE][+-]?[0-9]+")
_ARITH: dict[str, Callable[[Any, Any], Any]] = {  # ints, and Fractions for + - *
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
    "%": operator.mod,
}
_ORDER: dict[str, Callable[[Any, Any], Any]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


def _fail(text: str, message: str, offset: int) -> NoReturn:
    raise ExpressionError(message, expression=text, offset=offset)


def _too_deep() -> str:
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


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, Fraction):
        return "float"
    return "str" if isinstance(value, str) else "list"


def _describe(value: Value) -> str:
    return "null" if value is None else f"{_kind(value)} ({_clip(format_value(value))})"


def _is_int(value: Value) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Value) -> TypeGuard[int | Fraction]:
    return _is_int(value) or isinstance(value, Fraction)


def _unknown(kind: str, name: str, known: Sequence[str]) -> str:
    message = f"unknown {kind} `{name}`"
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        message += f"; did you mean `{close[0]}`?"
    names = sorted(known)
    if not names:
        return message + " (no names are defined here)"
    more = f", ... ({len(names) - 10} more)" if len(names) > 10 else ""
    return message + f" (known: {', '.join(names[:10])}{more})"


class _BadValue(Exception):
    """A host value that the language cannot represent."""


def _coerce(value: object, what: str, depth: int = 0, floats: bool = True) -> Value:
    """Return a host value as a Value (lists become tuples), or raise _BadValue."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -INT_BOUND < value < INT_BOUND:
            raise _BadValue(f"integer overflow: {what} = {format_value(value)} exceeds 2**63")
        return int(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float | Fraction) and floats:
        if isinstance(value, float) and not math.isfinite(value):
            raise _BadValue(f"{what} is {value!r}; expressions handle only finite floats")
        rational = exact(value)
        if not -INT_BOUND < rational < INT_BOUND:
            raise _BadValue(f"float overflow: {what} = {fraction_text(rational)} exceeds 2**63")
        return rational
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise _BadValue(f"{what} nests lists deeper than {MAX_DEPTH} levels")
        return tuple(_coerce(item, what, depth + 1, floats) for item in value)
    raise _BadValue(f"{what} is a {type(value).__name__} ({_clip(repr(value))}); expressions "
                    "handle only integers, floats, bools, strings, null and lists")


@dataclass(frozen=True, slots=True)
class _Context:
    text: str
    env: Mapping[str, Value]

    def fail(self, message: str, offset: int) -> NoReturn:
        _fail(self.text, message, offset)

    def src(self, node: _Node) -> str:
        return self.text[node.start:node.end]


@dataclass(frozen=True, slots=True)
class _Node:
    """A syntax-tree node; `kind` says which of the other fields are used (see `_eval`)."""

    kind: str  # literal name list neg not arith compare bool cond index call
    start: int
    end: int
    depth: int = 0
    value: Value = None  # the value of a literal
    name: str = ""  # the name read, the function called, or `and`/`or` for a bool chain
    children: tuple[_Node, ...] = ()
    ops: tuple[tuple[str, int], ...] = ()  # operator (and its offset) before children[i + 1]


def _eval(node: _Node, ctx: _Context) -> Value:
    kind, kids = node.kind, node.children
    if kind == "literal":
        return node.value
    if kind == "name":
        if node.name not in ctx.env:
            ctx.fail(_unknown("name", node.name, [str(key) for key in ctx.env]), node.start)
        try:
            return _coerce(ctx.env[node.name], f"`{node.name}`")
        except _BadValue as bad:
            raise ExpressionError(str(bad), expression=ctx.text, offset=node.start) from None
    if kind == "list":
        return tuple(_eval(kid, ctx) for kid in kids)
    if kind == "arith":
        return _arith(node, ctx)
    if kind in ("compare", "bool"):
        return _compare_chain(node, ctx) if kind == "compare" else _bool_chain(node, ctx)
    if kind == "neg":
        value = _eval(kids[0], ctx)
        if not _is_number(value):
            ctx.fail(f"unary `-` needs an integer, found {_describe(value)}", node.start)
        return -value
    if kind == "not":
        value = _eval(kids[0], ctx)
        if not isinstance(value, bool):
            ctx.fail(f"`not` needs a bool, found {_describe(value)}", node.start)
        return not value
    if kind == "cond":
        body, cond, orelse = kids
        test = _eval(cond, ctx)
        if not isinstance(test, bool):
            hint = ctx.src(cond)
            ctx.fail(f"the condition of `if` must be a bool, found {_describe(test)} for "
                     f"`{hint}`; compare explicitly, e.g. `{hint} != null`", cond.start)
        return _eval(body if test else orelse, ctx)
    if kind == "index":
        return _index(node, ctx)
    return _call(node, ctx, [_eval(kid, ctx) for kid in kids])


def _arith(node: _Node, ctx: _Context) -> Value:
    acc = _eval(node.children[0], ctx)
    for (op, offset), kid in zip(node.ops, node.children[1:], strict=True):
        rhs = _eval(kid, ctx)
        if not (_is_number(acc) and _is_number(rhs)) or (
                op in ("//", "%") and not (_is_int(acc) and _is_int(rhs))):
            floated = isinstance(acc, Fraction) or isinstance(rhs, Fraction)
            needs = "integers (floor a float first)" if floated else "integers"
            ctx.fail(f"`{op}` needs {needs}, found {_describe(acc)} and {_describe(rhs)}", offset)
        source = ctx.text[node.start:kid.end]
        if op in ("//", "%") and rhs == 0:
            kind = "division" if op == "//" else "modulo"
            where = "" if kid.kind == "literal" else f" where {ctx.src(kid)} = 0"
            ctx.fail(f"{kind} by zero: `{source}`{where}", offset)
        acc = _ARITH[op](acc, rhs)
        if not -INT_BOUND < acc < INT_BOUND:
            ctx.fail(f"integer overflow: `{source}` = {format_value(acc)} exceeds 2**63", offset)
    return acc


def _bool_chain(node: _Node, ctx: _Context) -> Value:
    decisive = node.name == "or"
    for kid in node.children:
        value = _eval(kid, ctx)
        if not isinstance(value, bool):
            ctx.fail(f"`{node.name}` needs bools, found {_describe(value)} for `{ctx.src(kid)}`",
                     kid.start)
        if value is decisive:
            return value
    return not decisive


def _equal(a: Value, b: Value) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def _compare_chain(node: _Node, ctx: _Context) -> Value:
    left = _eval(node.children[0], ctx)
    for (op, offset), kid in zip(node.ops, node.children[1:], strict=True):
        right = _eval(kid, ctx)
        if not _compare(ctx, op, offset, left, right):
            return False
        left = right
    return True


def _compare(ctx: _Context, op: str, offset: int, a: Value, b: Value) -> bool:
    if op in ("==", "!="):
        if (a is not None and b is not None and _kind(a) != _kind(b)
            and not (_is_number(a) and _is_number(b))):
            ctx.fail(f"`{op}` compares values of the same type, found {_describe(a)} and "
                     f"{_describe(b)}", offset)
        return _equal(a, b) == (op == "==")
    if op in ("in", "not in"):
        if isinstance(b, str):
            if not isinstance(a, str):
                ctx.fail(f"`{op}` with a string on the right needs a string on the left, "
                         f"found {_describe(a)}", offset)
            found = a in b
        elif isinstance(b, tuple):
            found = any(_equal(a, item) for item in b)
        else:
            ctx.fail(f"`{op}` needs a list or a string on the right, found {_describe(b)}",
                     offset)
        return found == (op == "in")
    if (_is_number(a) and _is_number(b)) or (isinstance(a, str) and isinstance(b, str)):
        return bool(_ORDER[op](a, b))
    ctx.fail(f"`{op}` needs two integers or two strings, found {_describe(a)} and "
             f"{_describe(b)}", offset)


def _index(node: _Node, ctx: _Context) -> Value:
    (target_node, index_node), bracket = node.children, node.ops[0][1]
    target, index = _eval(target_node, ctx), _eval(index_node, ctx)
    if not isinstance(target, (tuple, str)):
        ctx.fail(f"indexing needs a list or a string, found {_describe(target)} for "
                 f"`{ctx.src(target_node)}`", bracket)
    if not _is_int(index):
        ctx.fail(f"an index must be an integer, found {_describe(index)}", index_node.start)
    if not -len(target) <= index < len(target):
        ctx.fail(f"index {index} is out of range for `{ctx.src(target_node)}` of length "
                 f"{len(target)}", bracket)
    return target[index]


def _need_int(ctx: _Context, call: _Node, value: Value, arg: _Node) -> int:
    if not _is_int(value):
        ctx.fail(f"`{call.name}` needs integers, found {_describe(value)} for `{ctx.src(arg)}`",
                 arg.start)
    return value


def _call(node: _Node, ctx: _Context, values: list[Value]) -> Value:
    func, args, first = node.name, node.children, values[0]
    if func in ("min", "max", "gcd"):
        if len(values) == 1 and isinstance(first, tuple):
            if not first:
                ctx.fail(f"`{func}` of an empty list `{ctx.src(args[0])}`", args[0].start)
            ints = [_need_int(ctx, node, item, args[0]) for item in first]
        else:
            ints = [_need_int(ctx, node, v, arg) for v, arg in zip(values, args, strict=True)]
        return min(ints) if func == "min" else max(ints) if func == "max" else math.gcd(*ints)
    if func == "len":
        if not isinstance(first, (tuple, str)):
            ctx.fail(f"`len` needs a list or a string, found {_describe(first)} for "
                     f"`{ctx.src(args[0])}`", args[0].start)
        return len(first)
    if func in ROUNDING:
        if not _is_number(first):
            ctx.fail(f"`{func}` needs a number, found {_describe(first)} for "
                     f"`{ctx.src(args[0])}`", args[0].start)
        return ROUNDING[func](first)
    a = _need_int(ctx, node, first, args[0])
    if func == "abs":
        return abs(a)
    b = _need_int(ctx, node, values[1], args[1])
    if b <= 0:
        ctx.fail(f"`ceil_div` needs a positive divisor, found {b} for `{ctx.src(args[1])}`",
                 args[1].start)
    return -(-a // b)


_FUNCTIONS: dict[str, tuple[int, int | None]] = {  # name: (fewest, most) arguments
    "min": (1, None), "max": (1, None), "gcd": (1, None), "ceil_div": (2, 2), "len": (1, 1),
    "abs": (1, 1), "floor": (1, 1), "ceil": (1, 1), "round": (1, 1),
}


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "int", "str", "name", "kw", "op" or "eof"
    text: str
    start: int
    end: int
    value: Value = None


def _token_desc(tok: _Token) -> str:
    if tok.kind == "eof":
        return "the end of the expression"
    if tok.kind == "name":
        return f"name `{tok.text}`"
    if tok.kind in ("int", "str"):
        return f"{'integer' if tok.kind == 'int' else 'string'} {_clip(tok.text)}"
    return f"`{tok.text}`"


def _number(text: str, start: int) -> _Token:
    end = start
    while end < len(text):
        char = text[end]
        signed = char in "+-" and text[end - 1] in "eE" and text[end + 1:end + 2] in _DIGITS
        if char in _IDENT_CHARS or char == "." or signed:
            end += 1
        else:
            break
    word = text[start:end]
    if all(char in _DIGITS for char in word):
        if len(word) > 1 and word[0] == "0":
            _fail(text, f"leading zeros are not allowed in `{word}`: write `{int(word)}`", start)
        value = int(word)
        if value >= INT_BOUND:
            _fail(text, f"integer overflow: `{word}` exceeds 2**63", start)
        return _Token("int", word, start, end, value)
    radix = {"0x": "hexadecimal", "0o": "octal", "0b": "binary"}.get(word[:2].lower())
    if radix:
        _fail(text, f"{radix} literal `{word}` is not supported: write a decimal integer", start)
    if "." in word:
        _fail(text, f"floating-point literal `{word}` is not supported: only integers", start)
    if all(char in _DIGITS or char == "_" for char in word):
        _fail(text, f"digit separators are not allowed in `{word}`: write "
              f"`{word.replace('_', '')}`", start)
    if _EXPONENT.fullmatch(word):
        _fail(text, f"exponent literal `{word}` is not supported: write the integer in full",
              start)
    _fail(text, f"invalid number `{word}`", start)


def _string(text: str, start: int) -> _Token:
    quote, pos, chars = text[start], start + 1, list[str]()
    while pos < len(text) and text[pos] != "\n":
        char = text[pos]
        if char == quote:
            return _Token("str", text[start:pos + 1], start, pos + 1, "".join(chars))
        if char == "\\":
            escape = text[pos + 1:pos + 2]
            if escape == "":
                break
            if escape not in _ESCAPES:
                _fail(text, f"unsupported escape `\\{escape}` in a string "
                      "(allowed: \\\\ \\' \\\" \\n \\t)", pos)
            chars.append(_ESCAPES[escape])
            pos += 2
        else:
            chars.append(char)
            pos += 1
    _fail(text, f"unterminated string: missing closing `{quote}`", start)


def _tokenize(text: str) -> tuple[list[_Token], ExpressionError | None]:
    """The tokens, ending at `eof` or at an `error` token whose error is raised when reached."""
    tokens: list[_Token] = []
    pos = 0
    try:
        while pos < len(text):
            char = text[pos]
            if char in " \t\r\n":
                pos += 1
            elif char in _IDENT_START:
                end = pos
                while end < len(text) and text[end] in _IDENT_CHARS:
                    end += 1
                word = text[pos:end]
                tokens.append(_Token("kw" if word in _KEYWORDS else "name", word, pos, end))
                pos = end
            elif char in _DIGITS or (char == "." and text[pos + 1:pos + 2] in _DIGITS):
                tokens.append(_number(text, pos))
                pos = tokens[-1].end
            elif char in "'\"":
                tokens.append(_string(text, pos))
                pos = tokens[-1].end
            else:
                op = text[pos:pos + 2] if text[pos:pos + 2] in _TWO_CHAR_OPS else char
                if op in _BAD_OPS:
                    _fail(text, _BAD_OPS[op], pos)
                if op not in _OPS:
                    _fail(text, f"unexpected character {op!r}", pos)
                tokens.append(_Token("op", op, pos, pos + len(op)))
                pos += len(op)
    except ExpressionError as error:
        tokens.append(_Token("error", "", error.offset, error.offset))
        return tokens, error
    tokens.append(_Token("eof", "", len(text), len(text)))
    return tokens, None


class _Parser:
    """A Pratt parser whose recursion is bounded by MAX_DEPTH; same-level operators chain flat."""

    def __init__(self, text: str, tokens: list[_Token], lex_error: ExpressionError | None) -> None:
        self.text, self.tokens, self.pos, self.level = text, tokens, 0, -1
        self.lex_error = lex_error
        self.names: set[str] = set()

    def fail(self, message: str, offset: int) -> NoReturn:
        _fail(self.text, message, offset)

    def peek(self, ahead: int = 0) -> _Token:
        tok = self.tokens[min(self.pos + ahead, len(self.tokens) - 1)]
        if tok.kind == "error" and self.lex_error is not None:
            raise self.lex_error
        return tok

    def advance(self) -> _Token:
        tok = self.peek()
        self.pos = min(self.pos + 1, len(self.tokens) - 1)
        return tok

    def at(self, text: str) -> bool:
        tok = self.peek()
        return tok.kind in ("op", "kw") and tok.text == text

    def expect(self, text: str, context: str) -> _Token:
        if not self.at(text):
            tok = self.peek()
            self.fail(f"expected `{text}` {context}, found {_token_desc(tok)}", tok.start)
        return self.advance()

    def make(self, kind: str, start: int, end: int, children: Sequence[_Node], name: str = "",
             ops: Sequence[tuple[str, int]] = ()) -> _Node:
        depth = 1 + max((child.depth for child in children), default=0)
        if depth > MAX_DEPTH:  # blame the last operator or bracket that added the level
            self.fail(_too_deep(), ops[-1][1] if ops else start)
        return _Node(kind, start, end, depth, None, name, tuple(children), tuple(ops))

    def infix(self) -> tuple[str, int, int] | None:
        tok = self.peek()
        if tok.kind == "kw" and tok.text == "not":
            after = self.peek(1)
            return ("not in", _CMP, 2) if after.kind == "kw" and after.text == "in" else None
        if tok.kind in ("op", "kw") and tok.text in _INFIX_LEVELS:
            return tok.text, _INFIX_LEVELS[tok.text], 1
        return None

    def expr(self, min_level: int) -> _Node:
        self.level += 1
        if self.level > MAX_DEPTH:
            self.fail(_too_deep(), self.tokens[self.pos - 1].start)  # the opener
        children = [self.prefix(min_level)]  # operands of a run of same-level operators
        ops: list[tuple[str, int]] = []
        chain = 0
        while (found := self.infix()) is not None and found[1] > min_level:
            op, level, count = found
            if ops and level != chain:
                children, ops = [self.chain(chain, children, ops)], []
            offset = self.peek().start
            self.pos += count
            if op == "if":
                cond = self.expr(_COND)
                self.expect("else", f"after the condition of the `if` at offset {offset}")
                orelse = self.expr(0)
                body = children[0]
                children = [self.make("cond", body.start, orelse.end, (body, cond, orelse))]
            else:
                chain = level
                ops.append((op, offset))
                children.append(self.expr(level))
        self.level -= 1
        return self.chain(chain, children, ops) if ops else children[0]

    def chain(self, level: int, children: list[_Node], ops: list[tuple[str, int]]) -> _Node:
        kind = "bool" if level in (_OR, _AND) else "compare" if level == _CMP else "arith"
        name = ops[0][0] if kind == "bool" else ""
        return self.make(kind, children[0].start, children[-1].end, children, name, ops)

    def prefix(self, min_level: int) -> _Node:
        tok = self.advance()
        node: _Node
        if tok.kind in ("int", "str"):
            node = _Node("literal", tok.start, tok.end, value=tok.value)
        elif tok.kind == "kw" and tok.text in _KEYWORD_VALUES:
            node = _Node("literal", tok.start, tok.end, value=_KEYWORD_VALUES[tok.text])
        elif tok.kind == "kw" and tok.text == "not":
            if min_level >= _CMP:
                self.fail("`not` cannot appear here without parentheses: write `(not ...)`",
                          tok.start)
            operand = self.expr(_NOT)
            return self.make("not", tok.start, operand.end, [operand])
        elif tok.kind == "op" and tok.text == "-":
            operand = self.expr(_TERM)
            return self.make("neg", tok.start, operand.end, [operand])
        elif tok.kind == "op" and tok.text == "(":
            inner = self.expr(0)
            if self.at(","):
                self.fail("tuples in parentheses are not supported: write a list `[a, b]`",
                          self.peek().start)
            close = self.expect(")", f"to close the `(` at offset {tok.start}")
            node = replace(inner, start=tok.start, end=close.end)
        elif tok.kind == "op" and tok.text == "[":
            items, close = self.sequence("]", tok)
            node = self.make("list", tok.start, close.end, items)
        elif tok.kind == "name":
            node = self.name_or_call(tok)
        else:
            self.fail(f"expected a value, found {_token_desc(tok)}", tok.start)
        while self.at("["):
            bracket = self.advance()
            index = self.expr(0)
            close = self.expect("]", f"to close the `[` at offset {bracket.start}")
            ops = [("[", bracket.start)]
            node = self.make("index", node.start, close.end, (node, index), ops=ops)
        return node

    def sequence(self, close: str, opener: _Token) -> tuple[list[_Node], _Token]:
        items: list[_Node] = []
        while not self.at(close):
            if len(items) >= MAX_TUPLE_LENGTH:
                self.fail(f"more than {MAX_TUPLE_LENGTH} elements in the `{opener.text}` at "
                          f"offset {opener.start}", self.peek().start)
            items.append(self.expr(0))
            if self.at(","):
                self.advance()
            elif not self.at(close):
                tok = self.peek()
                self.fail(f"expected `,` or `{close}` in the `{opener.text}` at offset "
                          f"{opener.start}, found {_token_desc(tok)}", tok.start)
        return items, self.advance()

    def name_or_call(self, tok: _Token) -> _Node:
        if not self.at("("):
            self.names.add(tok.text)
            return _Node("name", tok.start, tok.end, name=tok.text)
        if tok.text not in _FUNCTIONS:
            self.fail(_unknown("function", tok.text, list(_FUNCTIONS)), tok.start)
        args, close = self.sequence(")", self.advance())
        low, high = _FUNCTIONS[tok.text]
        if len(args) < low or (high is not None and len(args) > high):
            want = f"{low} argument{'s' * (low > 1)}" if low == high else f"at least {low}"
            self.fail(f"`{tok.text}` takes {want}, found {len(args)}", tok.start)
        return self.make("call", tok.start, close.end, args, tok.text)


@dataclass(frozen=True, slots=True)
class Expression:
    """A parsed expression: its source text, the free names it reads, and its evaluator."""

    text: str
    """The source text (the canonical spelling for constants)."""
    names: frozenset[str]
    """Every name the expression may read, including in branches not taken."""
    _root: _Node = field(repr=False, compare=False)

    @property
    def is_constant(self) -> bool:
        """True when the expression reads no names."""
        return not self.names

    def evaluate(self, env: Mapping[str, Value]) -> Value:
        """Evaluate with names bound by `env` (lists in `env` are accepted as tuples)."""
        value = _eval(self._root, _Context(self.text, env))
        if isinstance(value, str) and len(value) > MAX_STRING_LENGTH:
            _fail(self.text, f"string result is {len(value)} characters long; the limit is "
                  f"{MAX_STRING_LENGTH}", self._root.start)
        return value

    def evaluate_int(self, env: Mapping[str, Value]) -> int:
        """Evaluate and require an integer (bool is not one)."""
        value = self.evaluate(env)
        if isinstance(value, Fraction):
            _fail(self.text, f"expected an integer, found float {fraction_text(value)}; "
                  "round it explicitly with floor(), ceil() or round()", self._root.start)
        if not _is_int(value):
            _fail(self.text, f"expected an integer, found {_describe(value)}", self._root.start)
        return value

    def evaluate_bool(self, env: Mapping[str, Value]) -> bool:
        """Evaluate and require a bool."""
        value = self.evaluate(env)
        if not isinstance(value, bool):
            _fail(self.text, f"expected a bool, found {_describe(value)}", self._root.start)
        return value


def parse(text: str) -> Expression:
    """Parse expression text; raise ExpressionError at the offset of the offending token."""
    if not isinstance(text, str):
        _fail(_clip(repr(text)), f"expected expression text, found {type(text).__name__}", 0)
    return _parse(text)


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> Expression:
    if len(text) > MAX_TEXT_LENGTH:
        _fail(text, f"expression is {len(text)} characters long; the limit is "
              f"{MAX_TEXT_LENGTH}", MAX_TEXT_LENGTH)
    tokens, lex_error = _tokenize(text)
    if tokens[0].kind == "eof":
        _fail(text, "empty expression", 0)
    parser = _Parser(text, tokens, lex_error)
    root = parser.expr(0)
    tok = parser.peek()
    if tok.kind != "eof":
        if tok.kind == "op" and tok.text == ")":
            _fail(text, "unmatched `)`", tok.start)
        _fail(text, f"unexpected {_token_desc(tok)} after a complete expression", tok.start)
    return Expression(text, frozenset(parser.names), root)


def constant(value: Value) -> Expression:
    """An Expression that always yields `value`; its text is the canonical spelling."""
    try:
        checked = _coerce(value, "the constant", floats=False)  # no float literals
    except _BadValue as bad:
        raise ExpressionError(str(bad), expression=_clip(repr(value)), offset=0) from None
    text = format_value(checked)
    if isinstance(checked, str) and len(checked) > MAX_STRING_LENGTH:
        _fail(_clip(text), f"string constant is {len(checked)} characters long; the limit is "
              f"{MAX_STRING_LENGTH}", 0)
    return Expression(text, frozenset(), _Node("literal", 0, len(text), value=checked))


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
                _fail(self.text, f"template field `{{{part.expression.text}}}` must be an integer "
                      f"or a string, found {_describe(value)}", part.offset)
            out.append(str(value))
        result = "".join(out)
        if len(result) > MAX_STRING_LENGTH:
            _fail(self.text, f"rendered template is {len(result)} characters long; the limit is "
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
            _fail(text, "`{` inside a template field: fields cannot nest", pos)
        if char in "'\"":
            end = pos + 1
            while end < len(text) and text[end] != char:
                end += 2 if text[end] == "\\" else 1
            if end >= len(text):
                _fail(text, f"unterminated string in the template field at offset {start}", pos)
            pos = end
        pos += 1
    _fail(text, "unclosed `{` in template: close the field with `}` or write `{{` for a "
          "literal brace", start)


def parse_template(text: str) -> Template:
    """Parse a template; raise ExpressionError for unbalanced braces or a bad field."""
    if not isinstance(text, str):
        _fail(_clip(repr(text)), f"expected template text, found {type(text).__name__}", 0)
    return _parse_template(text)


@functools.lru_cache(maxsize=4096)
def _parse_template(text: str) -> Template:
    if len(text) > MAX_TEXT_LENGTH:
        _fail(text, f"template is {len(text)} characters long; the limit is {MAX_TEXT_LENGTH}",
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
            _fail(text, "single `}` in template: write `}}` for a literal brace", pos)
        elif char == "{":
            end = _field_end(text, pos)
            if not text[pos + 1:end].strip():
                _fail(text, "empty template field `{}`: write `{{}}` for literal braces", pos)
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
