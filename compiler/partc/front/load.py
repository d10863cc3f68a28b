"""Stage 1: read a family file (YAML or TOML) or a config.json into data with source positions.

The YAML front end builds values straight from the parser's event stream (libyaml when present),
so it keeps the line and column of every node and enforces its bounds as it goes: duplicate and
non-string keys, explicit tags and merge keys are refused; alias expansion, nesting depth and
document size are bounded before anything large is built (a billion-laughs document fails on its
first oversized alias). Plain scalars resolve with strict YAML 1.2 core rules: `no`, `0o10`,
`010`, `1_000` and `.inf` stay strings, and a note recording what YAML 1.1 would have read is kept
so later stages can explain the surprise. TOML goes through `tomllib`; since it keeps no
positions, a small scanner of the (already valid) text recovers them.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partc.errors import LoadError, SourceLocation
from partc.front.positions import (
    TextPositions,
    join_pointer,
    json_locations,
    scan_toml,
)

if TYPE_CHECKING:
    import yaml

MAX_DOCUMENT_BYTES = 1024 * 1024
"""Largest family file (YAML or TOML) partc reads."""
MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""Largest config.json partc reads."""
MAX_PLAN_BYTES = 1 << 30
"""Largest plan.json inspect and shard read (DeepSeek-V3 at 8 x 8 is ~60 MB)."""
MAX_NODES = 100_000
"""Most values one document may hold, each alias counted at the full size of what it repeats."""
MAX_EXPANDED_CHARACTERS = 4 * MAX_DOCUMENT_BYTES
"""Most characters of scalar text one document may hold once aliases are expanded."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and sequences (arrays and tables in TOML and JSON)."""
MAX_INTEGER_DIGITS = 64
"""Longest integer literal a YAML plain scalar may spell (longer ones stay strings)."""
MAX_INTEGER_BITS = 256
"""Largest integer a TOML or JSON document may hold (no meaningful size needs more; larger ones
could not even be printed in a message)."""

_NULLS = frozenset({"", "~", "null", "Null", "NULL"})
_TRUES = frozenset({"true", "True", "TRUE"})
_FALSES = frozenset({"false", "False", "FALSE"})
_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)\Z")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?\Z")
_YAML11_TRUES = frozenset({"y", "Y", "yes", "Yes", "YES", "on", "On", "ON"})
_YAML11_FALSES = frozenset({"n", "N", "no", "No", "NO", "off", "Off", "OFF"})
_YAML11_INTS = (
    (re.compile(r"[-+]?0o[0-7]+\Z"), 8, "0o", "octal"),
    (re.compile(r"[-+]?0x[0-9a-fA-F]+\Z"), 16, "0x", "hexadecimal"),
    (re.compile(r"[-+]?0b[01]+\Z"), 2, "0b", "binary"),
)
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]+\Z")
_UNDERSCORED = re.compile(r"[-+]?[0-9][0-9_]*_[0-9_]*\Z")
_SEXAGESIMAL = re.compile(r"[-+]?[1-9][0-9_]*(:[0-5]?[0-9])+\Z")
_SPECIAL_FLOATS = re.compile(r"[-+]?\.(inf|Inf|INF|nan|NaN|NAN)\Z")
_SCALAR_TAGS = frozenset({"!", "tag:yaml.org,2002:str"})
_COLLECTION_TAGS = frozenset({"!", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"})


@dataclass(frozen=True, slots=True)
class RawDocument:
    """A parsed document: plain data plus the source position of every node, keyed by pointer."""

    file: str
    """The path as the user gave it."""
    format: str
    """'yaml', 'toml' or 'json'."""
    data: Any
    """Plain data: dicts, lists, str, int, float, bool, None."""
    locations: dict[str, SourceLocation] = field(default_factory=dict)
    """Position of each node, keyed by its JSON pointer."""
    notes: dict[str, str] = field(default_factory=dict)
    """For plain YAML scalars another reader would take differently (`no`, `0o10`, `1e3`): the
    explanation to add to any error about the node, keyed by its JSON pointer."""
    verbatim: dict[str, int] = field(default_factory=dict)
    """For strings written on one line exactly as read (no escapes): the 1-based column of their
    first character, so an error at a character offset inside them can be located exactly."""
    keys: dict[str, SourceLocation] = field(default_factory=dict)
    """Position of the key of each mapping entry, keyed by the entry's pointer (YAML files; an
    error about the key itself, such as an unexpected one, points there, not at its value)."""

    def locate(self, pointer: str) -> SourceLocation:
        """The position of the node at `pointer`, or of its nearest located ancestor."""
        probe = pointer
        while True:
            found = self.locations.get(probe)
            if found is not None:
                return found
            if not probe:
                return SourceLocation(self.file, 1, 1)
            probe = probe.rsplit("/", 1)[0]

    def locate_key(self, pointer: str) -> SourceLocation:
        """The position of the key of the entry at `pointer` (else of the node, as `locate`)."""
        found = self.keys.get(pointer)
        return found if found is not None else self.locate(pointer)

    def locate_offset(self, pointer: str, offset: int) -> SourceLocation:
        """The position of character `offset` of the string at `pointer` (else of the node)."""
        found = self.locate(pointer)
        start = self.verbatim.get(pointer)
        if start is None or offset < 0:
            return found
        return SourceLocation(found.file, found.line, start + offset)

    def note(self, pointer: str) -> str:
        """The note about the scalar at `pointer` ('' when there is none)."""
        return self.notes.get(pointer, "")


def read_text(path: str | Path, label: str, limit: int = MAX_DOCUMENT_BYTES) -> str:
    """The UTF-8 text of a file of at most `limit` bytes; LoadError naming `label` otherwise."""
    return decode_text(read_bytes(path, label, limit), str(path), label)


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


SHOWN_PATH_CHARACTERS = 120
"""The most characters of a path a message prints whole; a longer one is cut in the middle."""


def shown_path(path: str | Path) -> str:
    """`path` as a message prints it: whole, or cut in the middle with its length said when it
    is longer than SHOWN_PATH_CHARACTERS (a 5000-byte path would bury the message)."""
    text = str(path)
    if len(text) <= SHOWN_PATH_CHARACTERS:
        return text
    return f"{text[:60]}...{text[-40:]} ({len(text)} characters)"


def long_path_error(path: str | Path, label: str) -> LoadError:
    """The LoadError for a path the operating system refuses as too long (ENAMETOOLONG), naming
    it (cut) and saying which limit it passes."""
    text = os.fsencode(str(path))
    longest = max((len(part) for part in text.split(b"/")), default=0)
    limit = (f"a {longest}-byte name; a name has at most 255 bytes" if longest > 255
             else f"{len(text)} bytes; a path has at most 4096")
    return LoadError(f"cannot use {label}: the path is too long for the operating system "
                     f"({limit})", location=SourceLocation(shown_path(path)))


def read_bytes(path: str | Path, label: str, limit: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; LoadError naming `label` otherwise.

    The file type and size are checked before anything is read, so a FIFO, a device or a huge
    file is refused without blocking or reading it; every OSError and a MemoryError become a
    LoadError at the path.
    """
    path = Path(path)
    where = SourceLocation(shown_path(path))
    if "\0" in str(path):
        raise LoadError(f"cannot read {label}: the path contains a NUL character",
                        location=SourceLocation(repr(str(path))))

    def refuse(mode: int) -> LoadError:
        expected = "a file" if stat.S_ISDIR(mode) else "a regular file"
        return LoadError(f"cannot read {label}: {path} is {_file_kind(mode)}, expected {expected}",
                         location=where)

    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise refuse(info.st_mode)
        if info.st_size > limit:
            raise LoadError(f"{label} is larger than the limit of {limit} bytes",
                            location=where)
        # O_NONBLOCK: should the path turn into a FIFO after the check, opening it does not wait
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                             | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(descriptor, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise refuse(mode)
            raw = handle.read(limit + 1)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise long_path_error(path, label) from None
        raise LoadError(f"cannot read {label}: {exc.strerror or exc}", location=where) from None
    except MemoryError:
        raise LoadError(f"cannot read {label}: out of memory", location=where) from None
    if len(raw) > limit:
        raise LoadError(f"{label} is larger than the limit of {limit} bytes", location=where)
    return raw


def _safetensors_header_bytes(raw: bytes) -> int:
    """The header length a safetensors file starts with, when `raw` begins as one does (an
    8-byte little-endian length, then a JSON object that fits the file); 0 otherwise."""
    if len(raw) < 10 or raw[8:9] != b"{":
        return 0
    size = int.from_bytes(raw[:8], "little")
    return size if 2 <= size <= len(raw) - 8 else 0


def decode_text(raw: bytes, file: str, label: str) -> str:
    """Decode UTF-8 bytes (a BOM is dropped); LoadError at the first undecodable byte.

    A safetensors file (a checkpoint named where a text file was expected) is refused as what
    it is, with no line shown: its first bytes are a binary length, not text.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        header = _safetensors_header_bytes(raw)
        if header:
            hint = " (a checkpoint goes to --checkpoint)" if label == "config.json" else ""
            raise LoadError(f"{label} expected, found a safetensors checkpoint (a {header}-byte "
                            f"header, then tensor data), not text{hint}",
                            location=SourceLocation(file)) from None
        line = raw[: exc.start].count(b"\n") + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise LoadError(f"{label} is not UTF-8: byte {raw[exc.start]:#04x} at offset {exc.start}",
                        location=SourceLocation(file, line, column)) from None
    return text[1:] if text.startswith("\ufeff") else text


def load_document(path: str | Path, *, text: str | None = None) -> RawDocument:
    """Read a family file; the format follows the suffix (.yaml/.yml or .toml)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise LoadError(
            f"unknown family file type {suffix or '(no suffix)'!r}: expected .yaml, .yml or .toml",
            location=SourceLocation(str(path)))
    if text is None:
        text = read_text(path, "family file")
    elif len(text) > MAX_DOCUMENT_BYTES or len(text.encode("utf-8", "replace")) \
            > MAX_DOCUMENT_BYTES:
        raise LoadError(f"family file is larger than the limit of {MAX_DOCUMENT_BYTES} bytes",
                        location=SourceLocation(str(path)))
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise LoadError("family file contains a NUL character; expected text",
                        location=SourceLocation(str(path), line, 1))
    try:
        if suffix == ".toml":
            return _load_toml(str(path), text)
        return _load_yaml(str(path), text)
    except MemoryError:
        raise LoadError("family file: out of memory while parsing it",
                        location=SourceLocation(str(path))) from None


# ---------------------------------------------------------------- YAML


def _tag_name(tag: str) -> str:
    return "!!" + tag[len("tag:yaml.org,2002:"):] if tag.startswith("tag:yaml.org,2002:") else tag


def _plain_scalar(value: str) -> tuple[Any, str]:
    """A plain scalar's value under strict YAML 1.2 core rules, and a note if it may surprise."""
    if value in _NULLS:
        return None, ""
    if value in _TRUES:
        return True, ""
    if value in _FALSES:
        return False, ""
    if _INT.match(value):
        if len(value) > MAX_INTEGER_DIGITS:
            return value, (f"an integer literal of {len(value)} digits is beyond any size partc "
                           "accepts")  # kept a string: int() of it could be slow or refused
        return int(value), ""
    if _FLOAT.match(value) and not _LEADING_ZERO.match(value):
        number = float(value)
        if number.is_integer() and abs(number) < 2**63:
            return number, (f"`{value}` is the float {number!r} in YAML; write the integer "
                            f"{int(number)}")
        return number, f"`{_clip(value)}` is a float in YAML"
    if len(value) > MAX_INTEGER_DIGITS:
        return value, ""  # too long to be a number anyone meant; no conversions attempted
    return value, _yaml11_note(value)


def reads_otherwise(value: str) -> bool:
    """Whether `value` written as a plain YAML scalar is not read back as that string (by partc,
    YAML 1.2) or is one another reader takes otherwise (`1e3`, `no`, `0o10`): write it quoted."""
    read, note = _plain_scalar(value)
    return not isinstance(read, str) or read != value or bool(note)


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _yaml11_note(value: str) -> str:
    """What YAML 1.1 readers would make of a plain scalar partc keeps as a string ('' if same)."""
    def kept(reading: str, write: str) -> str:
        return (f"YAML 1.1 would read `{value}` as {reading}; partc reads YAML 1.2 and keeps it "
                f"the string {value!r} (write {write})")

    if value in _YAML11_TRUES:
        return kept("true", "true, or quote it")
    if value in _YAML11_FALSES:
        return kept("false", "false, or quote it")
    sign = -1 if value.startswith("-") else 1
    digits = value.lstrip("+-")
    for pattern, base, prefix, name in _YAML11_INTS:
        if pattern.match(value):
            number = sign * int(digits[len(prefix):], base)
            return kept(f"the {name} integer {number}", str(number))
    if _LEADING_ZERO.match(value) and all(c in "01234567" for c in digits):
        octal, decimal = sign * int(digits, 8), sign * int(digits, 10)
        return kept(f"the octal integer {octal} (YAML 1.2 parsers read {decimal})",
                    f"{octal} or {decimal}")
    if _LEADING_ZERO.match(value):
        return kept("a number with leading zeros", str(sign * int(digits)))
    if _UNDERSCORED.match(value):
        return kept(f"the integer {sign * int(digits.replace('_', ''))}",
                    str(sign * int(digits.replace("_", ""))))
    if _SEXAGESIMAL.match(value):
        number = 0
        for part in digits.replace("_", "").split(":"):
            number = number * 60 + int(part)
        return kept(f"the base-60 integer {sign * number}", str(sign * number))
    if _SPECIAL_FLOATS.match(value):
        return f"`{value}` is a string here (YAML would read it as a non-finite float)"
    return ""


@dataclass(slots=True)
class _Frame:
    """A mapping or sequence being built."""

    value: Any
    pointer: str
    anchor: str | None
    key: str | None = None
    key_lines: dict[str, int] = field(default_factory=dict)
    size: int = 1
    characters: int = 0
    height: int = 1


@dataclass(frozen=True, slots=True)
class _Anchored:
    value: Any
    size: int
    characters: int
    height: int


class _YamlBuilder:
    """Builds plain data from YAML events, recording positions and enforcing bounds."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.locations: dict[str, SourceLocation] = {}
        self.keys: dict[str, SourceLocation] = {}
        self.notes: dict[str, str] = {}
        self.verbatim: dict[str, int] = {}
        self.anchors: dict[str, _Anchored] = {}
        self.open_anchors: set[str] = set()
        self.stack: list[_Frame] = []
        self.count = 0
        self.characters = 0
        self.root: Any = None
        self.documents = 0

    def loc(self, mark: Any) -> SourceLocation:
        return SourceLocation(self.file, mark.line + 1, mark.column + 1)

    def fail(self, mark: Any, message: str, pointer: str = "") -> LoadError:
        return LoadError(message, location=self.loc(mark), pointer=pointer)

    def feed(self, event: yaml.Event) -> None:
        if isinstance(event, yaml.DocumentStartEvent):
            self.documents += 1
            if self.documents > 1:
                raise self.fail(event.start_mark, "expected a single YAML document, found a "
                                "second one (`---`); put everything in one document")
            version = getattr(event, "version", None)
            if version is not None and tuple(version) != (1, 2):
                raise self.fail(event.start_mark, f"partc reads YAML 1.2 only, found a "
                                f"`%YAML {'.'.join(map(str, version))}` directive; write "
                                "`%YAML 1.2` or no directive")
            return
        if isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
            self._close(event)
            return
        if not isinstance(event, yaml.ScalarEvent | yaml.AliasEvent | yaml.CollectionStartEvent):
            return
        top = self.stack[-1] if self.stack else None
        if isinstance(top, _Frame) and isinstance(top.value, dict) and top.key is None:
            self._key(top, event)
            return
        pointer = self._slot(top)
        if isinstance(event, yaml.AliasEvent):
            self._alias(event, pointer)
        elif isinstance(event, yaml.ScalarEvent):
            self._scalar(event, pointer)
        else:
            self._open(event, pointer)

    def _slot(self, top: _Frame | None) -> str:
        if top is None:
            return ""
        if isinstance(top.value, dict):
            assert top.key is not None
            return join_pointer(top.pointer, top.key)
        return join_pointer(top.pointer, len(top.value))

    def _place(self, value: Any, size: int, characters: int, height: int) -> None:
        if not self.stack:
            self.root = value
            return
        top = self.stack[-1]
        if isinstance(top.value, dict):
            assert top.key is not None
            top.value[top.key] = value
            top.key = None
        else:
            top.value.append(value)
        top.size += size
        top.characters += characters
        top.height = max(top.height, height + 1)

    def _account(self, mark: Any, pointer: str, size: int, characters: int) -> None:
        self.count += size
        self.characters += characters
        if self.count > MAX_NODES:
            raise self.fail(mark, f"document holds more than {MAX_NODES} values once aliases are "
                            "expanded (an alias bomb?); the limit keeps memory bounded", pointer)
        if self.characters > MAX_EXPANDED_CHARACTERS:
            raise self.fail(mark, f"document holds more than {MAX_EXPANDED_CHARACTERS} characters "
                            "of text once aliases are expanded (an alias bomb?)", pointer)

    def _key(self, top: _Frame, event: yaml.Event) -> None:
        mark: Any = event.start_mark
        if isinstance(event, yaml.AliasEvent):
            raise self.fail(mark, f"an alias (*{event.anchor}) cannot be a mapping key; keys must "
                            "be plain strings", top.pointer)
        if isinstance(event, yaml.CollectionStartEvent):
            kind = "sequence" if isinstance(event, yaml.SequenceStartEvent) else "mapping"
            raise self.fail(mark, f"mapping keys must be strings, found a {kind}", top.pointer)
        assert isinstance(event, yaml.ScalarEvent)
        self._check_scalar_tag(event, top.pointer)
        plain = not event.style and event.tag is None
        if plain and event.value == "<<":
            raise self.fail(mark, "YAML merge keys (<<) are not allowed; repeat the keys you need",
                            top.pointer)
        key, _ = _plain_scalar(event.value) if plain else (event.value, "")
        if not isinstance(key, str):
            shown = "null" if key is None else f"{type(key).__name__} {event.value!r}"
            raise self.fail(mark, f"mapping keys must be strings, found {shown} (quote it)",
                            top.pointer)
        if key in top.value:
            raise self.fail(mark, f"duplicate key {key!r} (first defined at line "
                            f"{top.key_lines[key]})", join_pointer(top.pointer, key))
        top.key_lines[key] = mark.line + 1
        self.keys[join_pointer(top.pointer, key)] = self.loc(mark)
        top.key = key
        self._account(mark, top.pointer, 0, len(key))

    def _check_scalar_tag(self, event: yaml.ScalarEvent, pointer: str) -> None:
        if event.tag is not None and event.tag not in _SCALAR_TAGS:
            raise self.fail(event.start_mark, "explicit YAML tags are not allowed, found "
                            f"{_tag_name(event.tag)!r}; write plain values", pointer)

    def _scalar(self, event: yaml.ScalarEvent, pointer: str) -> None:
        self._check_scalar_tag(event, pointer)
        if not event.style and event.tag is None:
            value, note = _plain_scalar(event.value)
            if note:
                self.notes[pointer] = note
        else:
            value = event.value
        start: Any = event.start_mark
        end: Any = event.end_mark
        quotes = 2 if event.style in ("'", '"') else 0 if not event.style else -1
        if quotes >= 0 and start.line == end.line and end.column - start.column == len(
                event.value) + quotes and isinstance(value, str):
            self.verbatim[pointer] = start.column + 1 + quotes // 2
        self.locations[pointer] = self.loc(event.start_mark)
        characters = len(event.value)
        self._account(event.start_mark, pointer, 1, characters)
        if event.anchor is not None:
            self.anchors[event.anchor] = _Anchored(value, 1, characters, 0)
        self._place(value, 1, characters, 0)

    def _alias(self, event: yaml.AliasEvent, pointer: str) -> None:
        mark, name = event.start_mark, str(event.anchor)
        if name in self.open_anchors:
            raise self.fail(mark, f"alias *{name} refers to its own anchor (a recursive alias)",
                            pointer)
        anchored = self.anchors.get(name)
        if anchored is None:
            raise self.fail(mark, f"alias *{name} names no anchor defined before it", pointer)
        if len(self.stack) + anchored.height > MAX_DEPTH:
            raise self.fail(mark, f"alias *{name} nests deeper than {MAX_DEPTH} levels", pointer)
        self._account(mark, pointer, anchored.size, anchored.characters)
        self.locations[pointer] = self.loc(mark)
        self._place(anchored.value, anchored.size, anchored.characters, anchored.height)

    def _open(self, event: yaml.CollectionStartEvent, pointer: str) -> None:
        mark = event.start_mark
        if event.tag is not None and event.tag not in _COLLECTION_TAGS:
            raise self.fail(mark, f"explicit YAML tags are not allowed, found "
                            f"{_tag_name(event.tag)!r}; write plain values", pointer)
        if len(self.stack) >= MAX_DEPTH:
            raise self.fail(mark, f"nesting deeper than {MAX_DEPTH} levels", pointer)
        self._account(mark, pointer, 1, 0)
        self.locations[pointer] = self.loc(mark)
        value: Any = {} if isinstance(event, yaml.MappingStartEvent) else []
        if event.anchor is not None:
            self.open_anchors.add(event.anchor)
        self.stack.append(_Frame(value=value, pointer=pointer, anchor=event.anchor))

    def _close(self, event: yaml.Event) -> None:
        frame = self.stack.pop()
        if frame.anchor is not None:
            self.open_anchors.discard(frame.anchor)
            self.anchors[frame.anchor] = _Anchored(frame.value, frame.size, frame.characters,
                                                   frame.height)
        self._place(frame.value, frame.size, frame.characters, frame.height)


def _yaml_events(text: str, fast: bool) -> Iterator[yaml.Event]:
    loader_class = yaml.CSafeLoader if fast and yaml.__with_libyaml__ else yaml.SafeLoader
    loader = loader_class(text)
    try:
        while loader.check_event():
            event: Any = loader.get_event()
            yield event
    finally:
        loader.dispose()


def _yaml_syntax_error(file: str, exc: yaml.YAMLError) -> LoadError:
    if not isinstance(exc, yaml.MarkedYAMLError):
        return LoadError(f"malformed YAML: {exc}", location=SourceLocation(file, 1, 1))
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    problem = exc.problem or "malformed YAML"
    if "\\t" in problem or "'\\t'" in problem or (mark is not None and _is_tab(mark)):
        problem += "; YAML indentation must use spaces, not tabs"
    context = f" ({exc.context})" if exc.context else ""
    return LoadError(f"malformed YAML: {problem}{context}",
                     location=SourceLocation(file, line, col))


def _is_tab(mark: Any) -> bool:
    buffer = getattr(mark, "buffer", None)
    index = getattr(mark, "pointer", None)
    return isinstance(buffer, str) and isinstance(index, int) and buffer[index:index + 1] == "\t"


def _load_yaml(file: str, text: str) -> RawDocument:
    global yaml  # imported at the first YAML document: a runtime-only install (numpy and
    import yaml  # ml_dtypes, no pyyaml) reads plan.json and checkpoints through this module

    builder = _YamlBuilder(file)
    try:
        for event in _yaml_events(text, fast=True):
            builder.feed(event)
    except yaml.YAMLError as fast_error:
        # Report the first problem as the pure-Python parser and the builder see it, so messages
        # do not depend on whether libyaml is installed; libyaml's own words are the fallback.
        builder = _YamlBuilder(file)
        try:
            for event in _yaml_events(text, fast=False):
                builder.feed(event)
        except yaml.YAMLError as exc:
            raise _yaml_syntax_error(file, exc) from None
        raise _yaml_syntax_error(file, fast_error) from None
    if builder.documents == 0 or builder.root is None:
        raise LoadError("empty document: expected a mapping with `family`, `config`, ...",
                        location=SourceLocation(file, 1, 1))
    return RawDocument(file=file, format="yaml", data=builder.root, locations=builder.locations,
                       notes=builder.notes, verbatim=builder.verbatim, keys=builder.keys)


# ---------------------------------------------------------------- TOML

_TOML_ERROR_POS = re.compile(r"\s*\(at line (\d+), column (\d+)\)|\s*\(at end of document\)")


def _load_toml(file: str, text: str) -> RawDocument:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        found = _TOML_ERROR_POS.search(message)
        if found and found.group(1):
            line, col = int(found.group(1)), int(found.group(2))
        else:
            line = text.count("\n") + 1
            col = len(text) - (text.rfind("\n") + 1) + 1
        message, col = _toml_message(_TOML_ERROR_POS.sub("", message).strip(), text, line, col)
        raise LoadError(f"malformed TOML: {message}",
                        location=SourceLocation(file, line, col)) from None
    except RecursionError:
        raise LoadError(f"malformed TOML: nesting deeper than {MAX_DEPTH} levels",
                        location=SourceLocation(file, 1, 1)) from None
    except ValueError:  # an integer too long for int(): tomllib lets Python's ValueError out
        raise LoadError("malformed TOML: a number is too long (Python reads at most "
                        f"{_MAX_INT_DIGITS} digits)",
                        location=_long_number(file, text)) from None
    locations, verbatim = scan_toml(file, text)
    document = RawDocument(file=file, format="toml", data=data, locations=locations,
                           verbatim=verbatim)
    _check_values(document, data, "", 0, [0], MAX_NODES)
    return document


_TOML_KEY_AT = re.compile(r"\s*((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')"
                          r"(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*=")


def _toml_message(message: str, text: str, line: int, column: int) -> tuple[str, int]:
    """A clearer wording (and column) for the tomllib errors authors meet most."""
    lines = text.split("\n")
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    indent = len(source) - len(source.lstrip()) + 1
    if message == "Cannot overwrite a value":
        key = _TOML_KEY_AT.match(source)
        if key:
            return (f"duplicate key `{key.group(1)}`: it is already defined in this table; "
                    "expected every key once", indent)
        return "a key or table is defined twice; expected every key once", indent
    declared = re.fullmatch(r"Cannot declare \((.*)\) twice", message)
    if declared:
        name = ".".join(part.strip().strip("'\"") for part in declared.group(1).split(",")
                        if part.strip())
        return f"table [{name}] is declared twice; expected every table once", indent
    if message in ("Unclosed array", "Unclosed inline table"):
        closer = "]" if message == "Unclosed array" else "}"
        return (f"{message.lower()}: expected `,` or `{closer}` before this point", column)
    if message.startswith("Illegal character '\\n'"):
        return "unterminated string: missing its closing quote before the end of the line", \
            column
    return message, column


def _check_values(document: RawDocument, value: Any, pointer: str, depth: int,
                  count: list[int], limit: int) -> None:
    """Refuse over-deep or over-large data, integers too large to mean anything (str() of them
    may even fail), and values partc has no use for (TOML dates and times)."""
    count[0] += 1
    if count[0] > limit or depth > MAX_DEPTH:
        message = (f"nesting deeper than {MAX_DEPTH} levels" if depth > MAX_DEPTH
                   else f"document holds more than {limit} values")
        raise LoadError(message, location=document.locate(pointer), pointer=pointer)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_values(document, item, join_pointer(pointer, key), depth + 1, count, limit)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_values(document, item, join_pointer(pointer, index), depth + 1, count, limit)
    elif isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise LoadError(f"integer of {value.bit_length()} bits is too large: expected at most "
                        f"{MAX_INTEGER_BITS} bits", location=document.locate(pointer),
                        pointer=pointer)
    elif not isinstance(value, str | int | float | bool | None):
        raise LoadError(f"TOML {type(value).__name__} values are not allowed: expected a string, "
                        "a number, a boolean, an array or a table",
                        location=document.locate(pointer), pointer=pointer)


def load_json(path: str | Path, label: str = "config") -> RawDocument:
    """Read a JSON file (a model's config.json), rejecting duplicate keys, with value positions."""
    path = Path(path)
    text = read_text(path, label, MAX_CONFIG_BYTES)
    return parse_json(str(path), text, label)


def parse_json(file: str, text: str, label: str = "config") -> RawDocument:
    """Parse JSON text that must be an object, rejecting duplicate keys, with value positions."""
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result and not duplicates:
                duplicates.append(key)
            result[key] = value
        return result

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_constant=_reject_constant)
    except MemoryError:
        raise LoadError(f"{label}: out of memory while parsing it",
                        location=SourceLocation(file)) from None
    except json.JSONDecodeError as exc:
        raise LoadError(f"malformed JSON in {label}: {exc.msg}",
                        location=SourceLocation(file, exc.lineno, exc.colno)) from None
    except RecursionError:
        raise LoadError(f"{label} nests deeper than Python can parse",
                        location=SourceLocation(file, 1, 1)) from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            raise LoadError(f"malformed JSON in {label}: a number is too long (Python reads at "
                            f"most {_MAX_INT_DIGITS} digits)",
                            location=_long_number(file, text)) from None
        raise LoadError(f"malformed JSON in {label}: {exc}",
                        location=SourceLocation(file, 1, 1)) from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(
            type(data), "a number")
        raise LoadError(f"{label} must be a JSON object, found {kind}",
                        location=SourceLocation(file, 1, 1))
    locations = json_locations(file, text)
    locations.setdefault("", SourceLocation(file, 1, 1))
    document = RawDocument(file=file, format="json", data=data, locations=locations)
    if duplicates:
        raise LoadError(f"duplicate key {duplicates[0]!r} in {label}; expected every key once",
                        location=_duplicate_location(file, text, duplicates[0]))
    _check_values(document, data, "", 0, [0], 10 * MAX_NODES)
    return document


_MAX_INT_DIGITS = 4300  # CPython's default int_max_str_digits
_LONG_NUMBER = re.compile(r"[0-9a-fA-F_]{" + str(_MAX_INT_DIGITS // 2) + ",}")


def _long_number(file: str, text: str) -> SourceLocation:
    """Where the first very long run of digits of a text starts (1:1 if none)."""
    found = _LONG_NUMBER.search(text)
    return TextPositions(file, text).at(found.start()) if found else SourceLocation(file, 1, 1)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _duplicate_location(file: str, text: str, key: str) -> SourceLocation:
    """The second occurrence of `"key":` in the text (best effort)."""
    pattern = re.compile(r'"' + re.escape(json.dumps(key)[1:-1]) + r'"\s*:')
    found = list(pattern.finditer(text))
    if len(found) < 2:
        return SourceLocation(file, 1, 1)
    return TextPositions(file, text).at(found[1].start())
