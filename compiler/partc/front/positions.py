"""Source positions for texts whose parsers keep none: JSON pointers, and scanners that map
every value of an already valid TOML or JSON text to its line and column."""

from __future__ import annotations

import bisect
import json
import re
import tomllib
from dataclasses import dataclass

from partc.errors import SourceLocation


def escape_pointer_token(token: str | int) -> str:
    """Escape one reference token of an RFC 6901 JSON pointer."""
    return str(token).replace("~", "~0").replace("/", "~1")


def join_pointer(pointer: str, token: str | int) -> str:
    """Append one token to a JSON pointer."""
    return f"{pointer}/{escape_pointer_token(token)}"


# ---------------------------------------------------------------- TOML


class TextPositions:
    """Offset -> (line, column) for one text, columns counted in characters."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def at(self, offset: int) -> SourceLocation:
        """The location of character `offset`."""
        line = bisect.bisect_right(self.starts, offset) - 1
        return SourceLocation(self.file, line + 1, offset - self.starts[line] + 1)


_TOML_TOKEN = re.compile(r'''
    (?P<space>[ \t]+)
  | (?P<newline>\r?\n)
  | (?P<comment>\#[^\n]*)
  | (?P<mlbasic>"""(?:[^"\\]|\\.|"(?!""))*"""(?:""?)?)
  | (?P<mlliteral>\'\'\'(?:[^']|'(?!''))*\'\'\'(?:''?)?)
  | (?P<basic>"(?:[^"\\\n]|\\.)*")
  | (?P<literal>'[^'\n]*')
  | (?P<punct>[\[\]{}=,.])
  | (?P<bare>[^\s\[\]{}=,.\#"']+)
''', re.VERBOSE | re.DOTALL)


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str
    text: str
    start: int


class _TomlScanner:
    """Recovers the position of every table, key and array element of a valid TOML text."""

    def __init__(self, file: str, text: str) -> None:
        self.positions = TextPositions(file, text)
        self.tokens = [_Token(m.lastgroup or "", m.group(), m.start())
                       for m in _TOML_TOKEN.finditer(text)]
        self.index = 0
        self.locations: dict[str, SourceLocation] = {"": SourceLocation(file, 1, 1)}
        self.verbatim: dict[str, int] = {}
        self.array_tables: dict[str, int] = {}

    def run(self) -> dict[str, SourceLocation]:
        """Every position found; what was found so far if the scanner meets a construct it
        does not follow (it never raises on text `tomllib` accepted)."""
        try:
            return self.scan()
        except (IndexError, ValueError, AssertionError, tomllib.TOMLDecodeError):
            return self.locations

    def peek(self) -> _Token | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def next(self) -> _Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def skip(self, newlines: bool) -> None:
        kinds = ("space", "comment", "newline") if newlines else ("space",)
        while (token := self.peek()) is not None and token.kind in kinds:
            self.index += 1

    def at(self, text: str) -> bool:
        token = self.peek()
        return token is not None and token.kind == "punct" and token.text == text

    def mark(self, pointer: str, token: _Token, *, overwrite: bool = True) -> None:
        location = self.positions.at(token.start)
        if overwrite:
            self.locations[pointer] = location
        else:
            self.locations.setdefault(pointer, location)

    def key(self) -> tuple[list[str], _Token]:
        """A dotted key: its parts and its first token."""
        self.skip(False)
        first = self.peek()
        assert first is not None
        parts = []
        while True:
            self.skip(False)
            token = self.next()
            if token.kind == "basic":
                parts.append(str(tomllib.loads(f"k = {token.text}")["k"]))
            elif token.kind == "literal":
                parts.append(token.text[1:-1])
            else:
                parts.append(token.text)
            self.skip(False)
            if not self.at("."):
                return parts, first
            self.next()

    def scan(self) -> dict[str, SourceLocation]:
        table = ""
        while True:
            self.skip(True)
            token = self.peek()
            if token is None:
                return self.locations
            if token.kind == "punct" and token.text == "[":
                table = self.header()
            else:
                self.key_value(table)

    def header(self) -> str:
        opener = self.next()
        following = self.peek()
        is_array = (following is not None and following.text == "["
                    and following.start == opener.start + 1)
        if is_array:
            self.next()
        parts, _ = self.key()
        self.next()  # ]
        if is_array:
            self.next()  # ]
        pointer = ""
        for i, part in enumerate(parts):
            pointer = join_pointer(pointer, part)
            last = i == len(parts) - 1
            if last and is_array:
                self.mark(pointer, opener, overwrite=False)
                index = self.array_tables.get(pointer, 0)
                self.array_tables[pointer] = index + 1
                pointer = join_pointer(pointer, index)
            elif pointer in self.array_tables:
                pointer = join_pointer(pointer, self.array_tables[pointer] - 1)
            if last:
                self.mark(pointer, opener)
            else:
                self.mark(pointer, opener, overwrite=False)
        return pointer

    def key_value(self, table: str) -> None:
        parts, first = self.key()
        pointer = table
        for part in parts[:-1]:
            pointer = join_pointer(pointer, part)
            self.mark(pointer, first, overwrite=False)
        self.next()  # =
        self.value(join_pointer(pointer, parts[-1]))

    def value(self, pointer: str) -> None:
        self.skip(False)
        token = self.next()
        self.mark(pointer, token)
        if token.kind == "literal" or (token.kind == "basic" and "\\" not in token.text):
            self.verbatim[pointer] = self.positions.at(token.start).column + 1
        if token.kind == "punct" and token.text == "[":
            index = 0
            while True:
                self.skip(True)
                if self.at("]"):
                    self.next()
                    return
                self.value(join_pointer(pointer, index))
                index += 1
                self.skip(True)
                if self.at(","):
                    self.next()
        elif token.kind == "punct" and token.text == "{":
            while True:
                self.skip(True)
                if self.at("}"):
                    self.next()
                    return
                parts, first = self.key()
                inner = pointer
                for part in parts[:-1]:
                    inner = join_pointer(inner, part)
                    self.mark(inner, first, overwrite=False)
                self.next()  # =
                self.value(join_pointer(inner, parts[-1]))
                self.skip(True)
                if self.at(","):
                    self.next()
        else:
            # numbers, booleans and dates may span several tokens (`3.14`, `1979-05-27 07:32`)
            while (nxt := self.peek()) is not None:
                if nxt.kind == "bare" or (nxt.kind == "punct" and nxt.text == "."):
                    self.index += 1
                elif (nxt.kind == "space" and self.index + 1 < len(self.tokens)
                      and self.tokens[self.index + 1].kind == "bare"):
                    self.index += 2
                else:
                    return


def toml_locations(file: str, text: str) -> dict[str, SourceLocation]:
    """Best-effort positions of the tables, keys and array elements of a valid TOML text.

    `tomllib` keeps no positions; this scanner re-reads the text (which `tomllib` has already
    accepted) and records where each value starts, resolving arrays of tables (`[[parameters]]`),
    sub-tables of their last element (`[parameters.params]`), dotted keys and inline tables.
    """
    return scan_toml(file, text)[0]


def scan_toml(file: str, text: str) -> tuple[dict[str, SourceLocation], dict[str, int]]:
    """`toml_locations`, and for every string value written without escapes the column just
    inside its opening quote (where an offset into the string's text starts)."""
    scanner = _TomlScanner(file, text)
    return scanner.run(), scanner.verbatim


# ---------------------------------------------------------------- JSON (config.json)

_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+', re.DOTALL)


def json_locations(file: str, text: str) -> dict[str, SourceLocation]:
    """The position of every value of a valid JSON text, keyed by JSON pointer."""
    positions = TextPositions(file, text)
    locations: dict[str, SourceLocation] = {}
    stack: list[tuple[str, int, bool]] = []  # (pointer, next index, is object)
    pending_key: str | None = None
    expecting_key = False
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in (":", ","):
            if token == "," and stack and stack[-1][2]:
                expecting_key = True
            continue
        if token in ("}", "]"):
            stack.pop()
            expecting_key = False
            continue
        if expecting_key:
            pending_key = json.loads(token)
            expecting_key = False
            continue
        if not stack:
            pointer = ""
        elif stack[-1][2]:
            pointer = join_pointer(stack[-1][0], pending_key or "")
        else:
            parent, index, _ = stack[-1]
            pointer = join_pointer(parent, index)
            stack[-1] = (parent, index + 1, False)
        locations[pointer] = positions.at(match.start())
        if token in ("{", "["):
            stack.append((pointer, 0, token == "{"))
            expecting_key = token == "{"
    return locations
