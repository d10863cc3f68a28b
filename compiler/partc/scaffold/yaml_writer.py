"""The scaffold's family document written as YAML by PyYAML, then its comments placed.

PyYAML writes no comments, so the text is written in two passes: `yaml.dump` writes the data
(`Flow` collections in flow style, `Quoted` strings double-quoted, everything else as PyYAML
chooses, quoted where a plain scalar would read as something else, no line wrapping, no
aliases, ASCII only: other characters escaped in double quotes); then the text is composed back
(`yaml.compose`), which gives each mapping key and sequence item the line it starts on, and the
comments (`Comments`) are placed by the node they belong to: a mark (`# partc init: CHECK:
why`) at the end of a node's line, a note on a line of its own after or before it, at its
indentation; each comment is made one ASCII line first (`one_line`), whatever names it quotes.
A blank line goes before every top-level section after the head (`family`, `description`,
`model_types`) and every item of `parameters`, for the eye.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from partc.front.load import reads_otherwise


class Flow(dict[str, Any]):
    """A mapping written in flow style: `{static: output}`."""


class FlowList(list[Any]):
    """A sequence written in flow style: `[num_attention_heads, head_dim]`."""


class Quoted(str):
    """A string written double-quoted: a name with `{unit}` in it, a `when:` condition."""

    __slots__ = ()


Container = dict[str, Any] | list[Any]
"""A mapping or sequence of the document, holding the node a comment belongs to."""


@dataclass(slots=True)
class Comments:
    """The comments of a document, each by the node it belongs to: (container, key)."""

    marks: list[tuple[Container, str | int, str]] = field(default_factory=list)
    """Text appended to a node's line (`# partc init: CHECK: why`)."""
    notes: list[tuple[Container, str | int, str, bool]] = field(default_factory=list)
    """A comment line after (or, when the flag says so, before) a node's line."""

    def mark(self, container: Container, key: str | int, text: str) -> None:
        """Append `text` to the line of `container[key]`."""
        self.marks.append((container, key, text))

    def note(self, container: Container, key: str | int, text: str, *,
             before: bool = False) -> None:
        """A line `text` after (or before) the line of `container[key]`."""
        self.notes.append((container, key, text, before))


def one_line(comment: str) -> str:
    """A comment as one line of ASCII: every other character (a newline, a control or
    non-ASCII character of a tensor's or folder's name) written as its Python escape, so no
    text read from a checkpoint ends the comment and starts YAML of its own."""
    return "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in comment)


_UNSPACED = frozenset({"family", "description", "model_types"})
"""The top-level keys written without a blank line before them (the document's head)."""


class _Dumper(yaml.SafeDumper):
    """SafeDumper with flow and quoted values, no aliases, sequence items indented under
    their key (`parameters:` then `  - name: ...`)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)


def _flow_mapping(dumper: yaml.SafeDumper, data: Flow) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


def _flow_sequence(dumper: yaml.SafeDumper, data: FlowList) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


def _quoted(dumper: yaml.SafeDumper, data: Quoted) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(data), style='"')


def _string(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    """A string plain where PyYAML and partc's reader agree it reads back as itself, else
    double-quoted (PyYAML writes `1e3` plain, which partc reads as a float)."""
    style = '"' if reads_otherwise(data) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _string)
_Dumper.add_representer(Flow, _flow_mapping)
_Dumper.add_representer(FlowList, _flow_sequence)
_Dumper.add_representer(Quoted, _quoted)


def _lines_of(data: Any, node: yaml.Node, found: dict[tuple[int, str | int], tuple[int, int]]
              ) -> None:
    """(line, column) of every key and item of `data`, by (id of its container, key)."""
    if isinstance(data, dict) and isinstance(node, yaml.MappingNode):
        for (key, value), (key_node, value_node) in zip(data.items(), node.value, strict=True):
            found[id(data), key] = (key_node.start_mark.line, key_node.start_mark.column)
            _lines_of(value, value_node, found)
    elif isinstance(data, list) and isinstance(node, yaml.SequenceNode):
        for index, (value, value_node) in enumerate(zip(data, node.value, strict=True)):
            found[id(data), index] = (value_node.start_mark.line, value_node.start_mark.column)
            _lines_of(value, value_node, found)


def write_yaml(document: dict[str, Any], comments: Comments, header: list[str]) -> str:
    """The document as YAML text: `header` (comment lines) first, then the data, its comments
    placed by node (see the module docstring)."""
    text = yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=1 << 30, allow_unicode=False)
    found: dict[tuple[int, str | int], tuple[int, int]] = {}
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    assert root is not None
    _lines_of(document, root, found)
    lines = text.splitlines()
    for container, key, mark in comments.marks:
        line, _ = found[id(container), key]
        lines[line] += "  " + one_line(mark)
    after: dict[int, list[str]] = {}
    before: dict[int, list[str]] = {}
    for container, key, note, ahead in comments.notes:
        line, column = found[id(container), key]
        (before if ahead else after).setdefault(line, []).append(" " * column + one_line(note))
    parameters = document.get("parameters", [])
    spaced = {found[id(document), key][0] for key in document if key not in _UNSPACED} | {
        found[id(parameters), i][0] for i in range(len(parameters))}
    out = [one_line(line) for line in header]
    for number, written in enumerate(lines):
        if number in spaced:
            out.append("")
        out += [*before.get(number, []), written, *after.get(number, [])]
    return "\n".join(out) + "\n"
