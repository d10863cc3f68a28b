"""Stage 1: read a family file (YAML or TOML) or a config.json into plain data with source positions.

The YAML front end composes PyYAML nodes and constructs values itself, so it can keep the line
and column of every node, reject duplicate keys and non-string keys, bound alias expansion,
nesting depth and document size, and resolve plain scalars with YAML 1.2 core rules (`no` stays
the string "no", `0o10` is not an integer).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from partc.errors import LoadError, SourceLocation

MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
"""Largest family or config file partc reads."""
MAX_NODES = 200_000
"""Most values one document may construct, aliases counted at every use."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and sequences."""

_INT = re.compile(r"[-+]?[0-9]+\Z")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?\Z")
_NULLS = {"", "~", "null", "Null", "NULL"}
_TRUES = {"true", "True", "TRUE"}
_FALSES = {"false", "False", "FALSE"}
_DEFAULT_TAGS = {"tag:yaml.org,2002:str", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


class _PlainLoader(yaml.SafeLoader):
    """A composer with no implicit YAML 1.1 resolvers: every untagged scalar arrives as a string."""


_PlainLoader.yaml_implicit_resolvers = {}


def escape_pointer_token(token: str | int) -> str:
    """Escape one reference token of an RFC 6901 JSON pointer."""
    return str(token).replace("~", "~0").replace("/", "~1")


def join_pointer(pointer: str, token: str | int) -> str:
    """Append one token to a JSON pointer."""
    return f"{pointer}/{escape_pointer_token(token)}"


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


def _read_text(path: Path, label: str) -> str:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise LoadError(f"cannot read {label}: {exc.strerror or exc}",
                        location=SourceLocation(str(path))) from None
    if size > MAX_DOCUMENT_BYTES:
        raise LoadError(
            f"{label} is {size} bytes; the limit is {MAX_DOCUMENT_BYTES} bytes",
            location=SourceLocation(str(path)),
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LoadError(f"cannot read {label}: {exc.strerror or exc}",
                        location=SourceLocation(str(path))) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise LoadError(f"{label} is not UTF-8: byte {raw[exc.start]:#04x} at offset {exc.start}",
                        location=SourceLocation(str(path), line, 1)) from None


def load_document(path: str | Path, *, text: str | None = None) -> RawDocument:
    """Read a family file; the format follows the suffix (.yaml/.yml or .toml)."""
    path = Path(path)
    if text is None:
        text = _read_text(path, "family file")
    elif len(text.encode("utf-8")) > MAX_DOCUMENT_BYTES:
        raise LoadError(f"family file is larger than {MAX_DOCUMENT_BYTES} bytes",
                        location=SourceLocation(str(path)))
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return _load_toml(str(path), text)
    if suffix in (".yaml", ".yml"):
        return _load_yaml(str(path), text)
    raise LoadError(
        f"unknown family file type {suffix or '(no suffix)'!r}: expected .yaml, .yml or .toml",
        location=SourceLocation(str(path)),
    )


# ---------------------------------------------------------------- YAML


class _YamlBuilder:
    """Turns composed YAML nodes into plain data, recording positions and enforcing bounds."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.locations: dict[str, SourceLocation] = {}
        self.count = 0

    def _loc(self, node: yaml.Node) -> SourceLocation:
        mark = node.start_mark
        return SourceLocation(self.file, mark.line + 1, mark.column + 1)

    def _fail(self, node: yaml.Node, message: str, pointer: str) -> LoadError:
        return LoadError(message, location=self._loc(node), pointer=pointer)

    def build(self, node: yaml.Node, pointer: str, depth: int) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise self._fail(node, f"document expands to more than {MAX_NODES} values "
                             "(recursive or exponential aliases?)", pointer)
        if depth > MAX_DEPTH:
            raise self._fail(node, f"nesting deeper than {MAX_DEPTH} levels", pointer)
        self.locations.setdefault(pointer, self._loc(node))
        if node.tag not in _DEFAULT_TAGS:
            raise self._fail(node, f"explicit YAML tags are not allowed, found {node.tag!r}",
                             pointer)
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node, pointer)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, join_pointer(pointer, i), depth + 1)
                    for i, item in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, pointer, depth)
        raise self._fail(node, f"unsupported YAML node {type(node).__name__}", pointer)

    def _scalar(self, node: yaml.ScalarNode, pointer: str) -> Any:
        value = node.value
        if node.style:
            return value  # quoted or block scalar: always a string
        if value in _NULLS:
            return None
        if value in _TRUES:
            return True
        if value in _FALSES:
            return False
        if _INT.match(value):
            return int(value)
        if _FLOAT.match(value):
            return float(value)
        return value

    def _mapping(self, node: yaml.MappingNode, pointer: str, depth: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        key_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == "<<" \
                    and not key_node.style:
                raise self._fail(key_node, "YAML merge keys (<<) are not allowed", pointer)
            if not isinstance(key_node, yaml.ScalarNode):
                raise self._fail(key_node, "mapping keys must be strings, found a "
                                 f"{'sequence' if isinstance(key_node, yaml.SequenceNode) else 'mapping'}",
                                 pointer)
            key = self._scalar(key_node, pointer)
            if not isinstance(key, str):
                raise self._fail(
                    key_node,
                    f"mapping keys must be strings, found {type(key).__name__} {key_node.value!r}"
                    " (quote it)",
                    pointer,
                )
            child = join_pointer(pointer, key)
            if key in result:
                raise self._fail(
                    key_node, f"duplicate key {key!r} (first defined at line {key_lines[key]})",
                    child)
            key_lines[key] = key_node.start_mark.line + 1
            self.locations[child] = self._loc(value_node)
            result[key] = self.build(value_node, child, depth + 1)
        return result


def _load_yaml(file: str, text: str) -> RawDocument:
    try:
        loader = _PlainLoader(text)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = exc.problem or "malformed YAML"
        context = f" ({exc.context})" if exc.context else ""
        raise LoadError(f"malformed YAML: {problem}{context}",
                        location=SourceLocation(file, line, col)) from None
    except yaml.YAMLError as exc:
        raise LoadError(f"malformed YAML: {exc}", location=SourceLocation(file, 1, 1)) from None
    except RecursionError:
        raise LoadError(f"malformed YAML: nesting deeper than {MAX_DEPTH} levels",
                        location=SourceLocation(file, 1, 1)) from None
    if node is None:
        raise LoadError("empty document: expected a mapping with `family`, `config`, ...",
                        location=SourceLocation(file, 1, 1))
    builder = _YamlBuilder(file)
    try:
        data = builder.build(node, "", 0)
    except RecursionError:
        raise LoadError(f"nesting deeper than {MAX_DEPTH} levels",
                        location=SourceLocation(file, 1, 1)) from None
    return RawDocument(file=file, format="yaml", data=data, locations=builder.locations)


# ---------------------------------------------------------------- TOML

_TOML_ERROR_POS = re.compile(r"\(at line (\d+), column (\d+)\)")
_TOML_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')"
                       r"((?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)\s*=")


def _toml_key_parts(text: str) -> list[str]:
    parts = []
    for raw in re.findall(r"[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'", text):
        parts.append(raw[1:-1] if raw[0] in "\"'" else raw)
    return parts


def _toml_locations(file: str, text: str) -> dict[str, SourceLocation]:
    """Best-effort positions of TOML tables and keys (tomllib keeps none)."""
    locations: dict[str, SourceLocation] = {"": SourceLocation(file, 1, 1)}
    array_counts: dict[str, int] = {}
    table = ""
    in_multiline = False
    for number, line in enumerate(text.splitlines(), start=1):
        if in_multiline:
            if line.count('"""') % 2 == 1 or line.count("'''") % 2 == 1:
                in_multiline = False
            continue
        header = _TOML_HEADER.match(line)
        if header and not line.lstrip().startswith("[\"") and "=" not in line.split("]")[0]:
            parts = _toml_key_parts(header.group(2))
            pointer = "".join("/" + escape_pointer_token(p) for p in parts)
            if header.group(1) == "[[":
                index = array_counts.get(pointer, 0)
                array_counts[pointer] = index + 1
                locations.setdefault(pointer, SourceLocation(file, number, 1))
                pointer = join_pointer(pointer, index)
            table = pointer
            locations[pointer] = SourceLocation(file, number, 1)
            continue
        key = _TOML_KEY.match(line)
        if key:
            parts = _toml_key_parts(key.group(1) + key.group(2))
            pointer = table + "".join("/" + escape_pointer_token(p) for p in parts)
            column = len(line) - len(line.lstrip()) + 1
            locations.setdefault(pointer, SourceLocation(file, number, column))
            if line.count('"""') % 2 == 1 or line.count("'''") % 2 == 1:
                in_multiline = True
    return locations


def _load_toml(file: str, text: str) -> RawDocument:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        found = _TOML_ERROR_POS.search(message)
        line, col = (int(found.group(1)), int(found.group(2))) if found else (1, 1)
        message = _TOML_ERROR_POS.sub("", message).strip()
        raise LoadError(f"malformed TOML: {message}",
                        location=SourceLocation(file, line, col)) from None
    except RecursionError:
        raise LoadError(f"malformed TOML: nesting deeper than {MAX_DEPTH} levels",
                        location=SourceLocation(file, 1, 1)) from None
    _check_plain(file, data, "", 0)
    return RawDocument(file=file, format="toml", data=data, locations=_toml_locations(file, text))


def _check_plain(file: str, value: Any, pointer: str, depth: int) -> None:
    """Reject TOML values partc has no use for (dates, times) and over-deep nesting."""
    if depth > MAX_DEPTH:
        raise LoadError(f"nesting deeper than {MAX_DEPTH} levels", location=SourceLocation(file),
                        pointer=pointer)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(file, item, join_pointer(pointer, key), depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_plain(file, item, join_pointer(pointer, index), depth + 1)
    elif not isinstance(value, (str, int, float, bool)):
        raise LoadError(f"TOML {type(value).__name__} values are not allowed here",
                        location=SourceLocation(file), pointer=pointer)


# ---------------------------------------------------------------- JSON (config.json)


def load_json(path: str | Path, label: str = "config") -> RawDocument:
    """Read a JSON file (a model's config.json), rejecting duplicate keys, with key positions."""
    path = Path(path)
    text = _read_text(path, label)
    file = str(path)

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result:
                raise LoadError(f"duplicate key {key!r} in {label}",
                                location=_json_key_location(file, text, key))
            result[key] = value
        return result

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise LoadError(f"malformed JSON in {label}: {exc.msg}",
                        location=SourceLocation(file, exc.lineno, exc.colno)) from None
    except RecursionError:
        raise LoadError(f"{label} nests too deeply", location=SourceLocation(file, 1, 1)) from None
    except ValueError as exc:
        raise LoadError(f"malformed JSON in {label}: {exc}",
                        location=SourceLocation(file, 1, 1)) from None
    if not isinstance(data, dict):
        raise LoadError(f"{label} must be a JSON object, found {type(data).__name__}",
                        location=SourceLocation(file, 1, 1))
    locations = {"/" + escape_pointer_token(k): _json_key_location(file, text, k) for k in data}
    locations[""] = SourceLocation(file, 1, 1)
    return RawDocument(file=file, format="json", data=data, locations=locations)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_key_location(file: str, text: str, key: str) -> SourceLocation:
    found = re.search(r'"' + re.escape(json.dumps(key)[1:-1]) + r'"\s*:', text)
    if not found:
        return SourceLocation(file, 1, 1)
    line = text.count("\n", 0, found.start()) + 1
    column = found.start() - (text.rfind("\n", 0, found.start()) + 1) + 1
    return SourceLocation(file, line, column)
