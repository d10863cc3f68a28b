"""How the command line reports errors: sorted, similar ones collapsed, each with its source
line and a caret, as text on stderr or one JSON document."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from partc.cli import commands
from partc.cli.parser import EXIT_ERRORS
from partc.errors import PartcError, PartcErrors, terminal_safe

BUILTIN_FILES = "architectures/"
"""How messages name a built-in family file (read from the package's resources)."""
CONTEXT_WIDTH = 100
"""Longest source line shown under an error; a longer one is cut around the column."""
_MAX_SOURCE_BYTES = 64 << 20


def _source_text(file: str) -> str | None:
    """The text of a located file: on disk, else a built-in family; None when unreadable."""
    try:
        path = Path(file)
        if path.is_file() and path.stat().st_size <= _MAX_SOURCE_BYTES:
            return path.read_bytes().decode("utf-8", "replace")
        if file.startswith(BUILTIN_FILES):
            resource = resources.files("partc.architectures").joinpath(file[len(BUILTIN_FILES):])
            return resource.read_bytes().decode("utf-8", "replace") if resource.is_file() else None
    except (OSError, ValueError):
        pass
    return None


def _caret_context(error: PartcError) -> list[str]:
    """The offending source line and a caret under its column, as lark shows them.

    Nothing when the error has no line, or its file cannot be read. Tabs before the column are
    kept so that the caret lines up; unprintable characters and bytes that are not UTF-8 are shown
    as `?`.
    """
    where = error.location
    if where is None or where.line <= 0 or not where.file:
        return []
    text = _source_text(where.file)
    if text is None:
        return []
    lines = text.split("\n")  # the loaders count lines at "\n" (and "\r\n")
    if where.line > len(lines):
        return []
    line = "".join(c if (c.isprintable() and c != "\ufffd") or c == "\t" else "?"
                   for c in lines[where.line - 1].removesuffix("\r"))
    column = min(max(where.column, 0), len(line) + 1)
    start = 0
    if len(line) > CONTEXT_WIDTH:  # a window around the column, cut marks on both sides
        start = max(0, min(column - 1 - CONTEXT_WIDTH // 2, len(line) - CONTEXT_WIDTH))
        cut = line[start:start + CONTEXT_WIDTH]
        shown = ("..." if start else "") + cut + ("..." if start + CONTEXT_WIDTH < len(line)
                                                   else "")
    else:
        shown = line
    if column <= 0:
        return [f"    {shown}"]
    pad = "".join("\t" if c == "\t" else " " for c in line[start:column - 1])
    return [f"    {shown}", f"    {'   ' if start else ''}{pad}^"]


COLLAPSE_AFTER = 3
"""Errors of one shape beyond this many are reported as one line with a count and an example."""
_VARYING = re.compile(r"`[^`]*`|\d+")


def _shape(error: PartcError) -> tuple[str, str]:
    """What makes errors "the same" for collapsing: their class and message (the rule), with
    the names in backticks and the numbers taken out."""
    return type(error).__name__, _VARYING.sub("_", error.message)


def _collapsed(errors: Sequence[PartcError]) -> list[tuple[PartcError, int]]:
    """Each error with how many errors of its shape it stands for (1: shown as it is)."""
    shapes: dict[tuple[str, str], list[PartcError]] = {}
    for error in errors:
        shapes.setdefault(_shape(error), []).append(error)
    out = []
    for error in errors:
        same = shapes[_shape(error)]
        if len(same) <= COLLAPSE_AFTER:
            out.append((error, 1))
        elif same[0] is error:
            out.append((error, len(same)))
    return out


def _group_of(errors: Sequence[PartcError], first: PartcError) -> list[PartcError]:
    """The errors of `first`'s shape, `first` first (as `_collapsed` grouped them)."""
    return [e for e in errors if _shape(e) == _shape(first)]


_NAMED = re.compile(r"`[^`]*`")
_LISTED = 12
"""The most other errors of a collapsed group named beside the one shown."""


def _others(group: Sequence[PartcError]) -> str:
    """What tells the other errors of a collapsed group from the first: their names in
    backticks where those differ, else their line; `--format json` lists every one whole."""
    first = group[0]
    labels = []
    for error in group[1:]:
        names = [n for n in _NAMED.findall(error.message) if n not in first.message]
        where = error.location
        if names:
            labels.append(", ".join(names))
        elif where is not None and where.line and where != first.location:
            labels.append(f"line {where.line}" if where.file == getattr(first.location, "file",
                                                                        None) else str(where))
    if not labels:
        return ""
    more = len(labels) - _LISTED
    return f"; the others: {'; '.join(labels[:_LISTED])}{f' and {more} more' if more > 0 else ''}"


def _error_json(error: PartcError) -> dict[str, object]:
    """An error's JSON with `see`: where its guide (`doc`) is installed, None without one."""
    return error.to_json() | {"see": commands.error_reference(error.doc)}


def report_errors(errors: Sequence[PartcError], fmt: str, hints: Sequence[str] = ()) -> int:
    """Report every error (sorted, similar ones collapsed) and the hints; returns exit 1."""
    ordered = sorted(errors, key=PartcError.sort_key)
    if fmt == "json":
        groups = [{"count": n, "example": _error_json(e)} for e, n in _collapsed(ordered)
                  if n > 1]
        print(json.dumps({"ok": False, "errors": [_error_json(e) for e in ordered],
                          "collapsed": groups, "hints": list(hints)}, indent=1))
    else:
        for error, count in _collapsed(ordered):
            if count > 1:
                print(terminal_safe(f"error: {count} errors like this one (first shown): "
                                    f"{error}{_others(_group_of(ordered, error))}"),
                      file=sys.stderr)
            else:
                print(f"error: {terminal_safe(str(error))}", file=sys.stderr)
            for line in _caret_context(error):
                print(line, file=sys.stderr)
            see = commands.error_reference(error.doc)
            if see is not None:
                print(f"    see: {see}", file=sys.stderr)
        for hint in hints:
            print(f"hint: {terminal_safe(hint)}", file=sys.stderr)
        print(f"partc: {len(ordered)} error(s)", file=sys.stderr)
    return EXIT_ERRORS


def flatten_errors(error: PartcError) -> list[PartcError]:
    """The errors an error stands for: those of a PartcErrors, else itself."""
    return list(error.errors) if isinstance(error, PartcErrors) else [error]
