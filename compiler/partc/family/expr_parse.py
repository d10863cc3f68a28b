"""The parser of partc's expression language: tokens, the syntax tree and a bounded Pratt parser.

User text is tokenized and parsed by hand into a small tree of `Node`s (evaluated by
`partc.family.expr_eval`); it never reaches `eval`, `exec` or `compile`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

from partc.errors import ExpressionError
from partc.family.expr_values import (
    INT_BOUND,
    MAX_DEPTH,
    Value,
    clip,
    fail,
    too_deep,
    unknown_message,
)

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


@dataclass(frozen=True, slots=True)
class Node:
    """A syntax-tree node; `kind` says which of the other fields are used (see `expr_eval`)."""

    kind: str  # literal name list neg not arith compare bool cond index call
    start: int
    end: int
    depth: int = 0
    value: Value = None  # the value of a literal
    name: str = ""  # the name read, the function called, or `and`/`or` for a bool chain
    children: tuple[Node, ...] = ()
    ops: tuple[tuple[str, int], ...] = ()  # operator (and its offset) before children[i + 1]


FUNCTIONS: dict[str, tuple[int, int | None]] = {  # name: (fewest, most) arguments
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


def _token_description(tok: _Token) -> str:
    if tok.kind == "eof":
        return "the end of the expression"
    if tok.kind == "name":
        return f"name `{tok.text}`"
    if tok.kind in ("int", "str"):
        return f"{'integer' if tok.kind == 'int' else 'string'} {clip(tok.text)}"
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
            fail(text, f"leading zeros are not allowed in `{word}`: write `{int(word)}`", start)
        value = int(word)
        if value >= INT_BOUND:
            fail(text, f"integer overflow: `{word}` exceeds 2**63", start)
        return _Token("int", word, start, end, value)
    radix = {"0x": "hexadecimal", "0o": "octal", "0b": "binary"}.get(word[:2].lower())
    if radix:
        fail(text, f"{radix} literal `{word}` is not supported: write a decimal integer", start)
    if "." in word:
        fail(text, f"floating-point literal `{word}` is not supported: only integers", start)
    if all(char in _DIGITS or char == "_" for char in word):
        fail(text, f"digit separators are not allowed in `{word}`: write "
              f"`{word.replace('_', '')}`", start)
    if _EXPONENT.fullmatch(word):
        fail(text, f"exponent literal `{word}` is not supported: write the integer in full",
              start)
    fail(text, f"invalid number `{word}`", start)


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
                fail(text, f"unsupported escape `\\{escape}` in a string "
                      "(allowed: \\\\ \\' \\\" \\n \\t)", pos)
            chars.append(_ESCAPES[escape])
            pos += 2
        else:
            chars.append(char)
            pos += 1
    fail(text, f"unterminated string: missing closing `{quote}`", start)


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
                    fail(text, _BAD_OPS[op], pos)
                if op not in _OPS:
                    fail(text, f"unexpected character {op!r}", pos)
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
        fail(self.text, message, offset)

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
            self.fail(f"expected `{text}` {context}, found {_token_description(tok)}", tok.start)
        return self.advance()

    def make(self, kind: str, start: int, end: int, children: Sequence[Node], name: str = "",
             ops: Sequence[tuple[str, int]] = ()) -> Node:
        depth = 1 + max((child.depth for child in children), default=0)
        if depth > MAX_DEPTH:  # blame the last operator or bracket that added the level
            self.fail(too_deep(), ops[-1][1] if ops else start)
        return Node(kind, start, end, depth, None, name, tuple(children), tuple(ops))

    def infix(self) -> tuple[str, int, int] | None:
        tok = self.peek()
        if tok.kind == "kw" and tok.text == "not":
            after = self.peek(1)
            return ("not in", _CMP, 2) if after.kind == "kw" and after.text == "in" else None
        if tok.kind in ("op", "kw") and tok.text in _INFIX_LEVELS:
            return tok.text, _INFIX_LEVELS[tok.text], 1
        return None

    def expr(self, min_level: int) -> Node:
        self.level += 1
        if self.level > MAX_DEPTH:
            self.fail(too_deep(), self.tokens[self.pos - 1].start)  # the opener
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

    def chain(self, level: int, children: list[Node], ops: list[tuple[str, int]]) -> Node:
        kind = "bool" if level in (_OR, _AND) else "compare" if level == _CMP else "arith"
        name = ops[0][0] if kind == "bool" else ""
        return self.make(kind, children[0].start, children[-1].end, children, name, ops)

    def prefix(self, min_level: int) -> Node:
        tok = self.advance()
        node: Node
        if tok.kind in ("int", "str"):
            node = Node("literal", tok.start, tok.end, value=tok.value)
        elif tok.kind == "kw" and tok.text in _KEYWORD_VALUES:
            node = Node("literal", tok.start, tok.end, value=_KEYWORD_VALUES[tok.text])
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
            self.fail(f"expected a value, found {_token_description(tok)}", tok.start)
        while self.at("["):
            bracket = self.advance()
            index = self.expr(0)
            close = self.expect("]", f"to close the `[` at offset {bracket.start}")
            ops = [("[", bracket.start)]
            node = self.make("index", node.start, close.end, (node, index), ops=ops)
        return node

    def sequence(self, close: str, opener: _Token) -> tuple[list[Node], _Token]:
        items: list[Node] = []
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
                          f"{opener.start}, found {_token_description(tok)}", tok.start)
        return items, self.advance()

    def name_or_call(self, tok: _Token) -> Node:
        if not self.at("("):
            self.names.add(tok.text)
            return Node("name", tok.start, tok.end, name=tok.text)
        if tok.text not in FUNCTIONS:
            self.fail(unknown_message("function", tok.text, list(FUNCTIONS)), tok.start)
        args, close = self.sequence(")", self.advance())
        low, high = FUNCTIONS[tok.text]
        if len(args) < low or (high is not None and len(args) > high):
            want = f"{low} argument{'s' * (low > 1)}" if low == high else f"at least {low}"
            self.fail(f"`{tok.text}` takes {want}, found {len(args)}", tok.start)
        return self.make("call", tok.start, close.end, args, tok.text)


def parse_tree(text: str) -> tuple[Node, frozenset[str]]:
    """The syntax tree of expression text and the names it reads; ExpressionError otherwise."""
    tokens, lex_error = _tokenize(text)
    if tokens[0].kind == "eof":
        fail(text, "empty expression", 0)
    parser = _Parser(text, tokens, lex_error)
    root = parser.expr(0)
    tok = parser.peek()
    if tok.kind != "eof":
        if tok.kind == "op" and tok.text == ")":
            fail(text, "unmatched `)`", tok.start)
        fail(text, f"unexpected {_token_description(tok)} after a complete expression", tok.start)
    return root, frozenset(parser.names)
