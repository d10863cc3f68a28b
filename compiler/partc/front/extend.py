"""`extends:`: one family document written over a base family document.

The rule (also in the schema's description of `extends`):

- `config` and `derived`: the child's entries are added, or replace the base's of the same name;
- `parameters`: a child entry replaces the base's group of the same `name` in place, a new name
  is appended, and `remove: [names]` drops base groups (an unknown name is an error; a child
  group of a removed name is then a new group, appended). A child entry with `patch: true`
  changes only the keys it gives of the base's group of its `name` (each key replaced whole;
  `null` deletes the key), keeping the rest;
- `omit`: the child's globs are added after the base's;
- every other key (`family`, `model_types`, `graph`, `static`, `boundary`, `policy`,
  `linear_formats`, ...) is the child's when it has one, else the base's.

The merged document keeps every node's source position, so an error about something the base
declared points into the base file, and one about the child's into the child file.

`extended_document` resolves the chain: it reads each base through `FamilySources` (the family
library's readers, given by the caller, since the library lies above this stage), checks the
depth, cycles and the `extends:` value, and merges from the deepest base up.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.front.load import RawDocument, load_document
from partc.front.positions import join_pointer

MAX_EXTENDS_DEPTH = 8
"""Longest chain of `extends:` accepted (a family extending a family extending ...)."""



@dataclass(frozen=True, slots=True, kw_only=True)
class FamilySources:
    """How `extends:` reads a base family: the family library's functions."""

    read: Callable[[str, bool], tuple[str, str]]
    """(spec, whether it names a built-in family) -> (display name, text); raises LoadError."""
    is_file: Callable[[str], bool]
    """Whether a spec names a family file rather than a built-in family."""
    builtin_names: Callable[[], Iterable[str]]
    """The built-in families' model types (for a "did you mean" hint)."""
    builtin_prefix: str
    """How built-in family files are named (a relative file is resolved against a family file's
    folder, never a built-in's)."""


_MERGED_BY_NAME = ("config", "derived")
_CHILD_ONLY = ("extends", "remove")


class _Merged:
    """The merged data and positions being assembled."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.locations: dict[str, SourceLocation] = {}
        self.notes: dict[str, str] = {}
        self.verbatim: dict[str, int] = {}

    def copy(self, source: RawDocument, src: str, dst: str) -> None:
        """Copy the positions, notes and columns of `source`'s subtree at `src` to `dst`."""
        tables: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
            (source.locations, self.locations), (source.notes, self.notes),
            (source.verbatim, self.verbatim))
        for table, target in tables:
            for pointer, value in table.items():
                if pointer == src or pointer.startswith(src + "/"):
                    target[dst + pointer[len(src):]] = value


def _group_name(entry: Any) -> Any:
    return entry.get("name") if isinstance(entry, dict) else None


def _is_patch(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get("patch") is True


def _patched(merged: _Merged, base: RawDocument, i: int, child: RawDocument, j: int,
             dst: str) -> dict[str, Any]:
    """Base group `i` with the keys child entry `j` (`patch: true`) gives: each replaced
    whole, or deleted when the child gives null; each key keeps its own file's positions."""
    group: dict[str, Any] = dict(base.data["parameters"][i])
    patch = child.data["parameters"][j]
    merged.copy(base, join_pointer("/parameters", i), dst)
    for key, value in patch.items():
        if key == "patch":
            continue
        for table in (merged.locations, merged.notes, merged.verbatim):
            prefix = join_pointer(dst, key)
            for pointer in [p for p in table if p == prefix or p.startswith(prefix + "/")]:
                del table[pointer]
        if value is None:
            group.pop(key, None)
            continue
        group[key] = value
        merged.copy(child, join_pointer(join_pointer("/parameters", j), key),
                    join_pointer(dst, key))
    return group


def _listed(document: RawDocument, key: str, what: str) -> list[Any]:
    """`document`'s `key` (a list of `what`; [] when absent), or a LoadError at the key: the
    merge walks it, so a scalar or a mapping cannot wait for the schema pass."""
    value = document.data.get(key, [])
    if not isinstance(value, list):
        found = {dict: "a mapping", str: "a string", bool: "a boolean", int: "an integer",
                 float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
        raise LoadError(f"`{key}` of a family in an `extends:` chain must be a list of {what}, "
                        f"found {found}", location=document.locate(join_pointer("", key)),
                        pointer=join_pointer("", key))
    return value


def _parameters(merged: _Merged, base: RawDocument, child: RawDocument) -> None:
    """Base groups, replaced by name or removed, then the child's new groups."""
    base_groups = _listed(base, "parameters", "parameter groups")
    child_groups = _listed(child, "parameters", "parameter groups")
    removed = _listed(child, "remove", "parameter group names")
    names = [_group_name(g) for g in base_groups]
    for i, name in enumerate(removed):
        if name not in names:
            raise LoadError(f"`remove` names parameter group {name!r}, which base family "
                            f"`{base.data.get('family')}` does not declare; its groups: "
                            f"{', '.join(str(n) for n in names)}",
                            location=child.locate(join_pointer("/remove", i)),
                            pointer=join_pointer("/remove", i))
    replacing = {_group_name(g): j for j, g in enumerate(child_groups)
                 if _group_name(g) in names and _group_name(g) not in removed}
    for j, group in enumerate(child_groups):
        if _is_patch(group) and _group_name(group) not in replacing:
            pointer = join_pointer("/parameters", j)
            why = ("which `remove` drops" if _group_name(group) in names else
                   f"which base family `{base.data.get('family')}` does not declare")
            raise LoadError(f"parameter group {_group_name(group)!r} has `patch: true`, so it "
                            f"changes a base group, but it names one {why}; base groups: "
                            f"{', '.join(str(n) for n in names if n not in removed)}",
                            location=child.locate(pointer), pointer=pointer)
    out: list[Any] = []
    for i, (group, name) in enumerate(zip(base_groups, names, strict=True)):
        if name in removed:
            continue
        dst = join_pointer("/parameters", len(out))
        if name in replacing and _is_patch(child_groups[replacing[name]]):
            out.append(_patched(merged, base, i, child, replacing[name], dst))
        elif name in replacing:
            j = replacing[name]
            out.append(child_groups[j])
            merged.copy(child, join_pointer("/parameters", j), dst)
        else:
            out.append(group)
            merged.copy(base, join_pointer("/parameters", i), dst)
    for j, group in enumerate(child_groups):
        if _group_name(group) not in replacing:
            merged.copy(child, join_pointer("/parameters", j),
                        join_pointer("/parameters", len(out)))
            out.append(group)
    merged.data["parameters"] = out
    merged.locations["/parameters"] = (child if "parameters" in child.data
                                                 else base).locate("/parameters")


def merge_documents(base: RawDocument, child: RawDocument) -> RawDocument:
    """The child document written over its base (see the module docstring for the rule)."""
    if not isinstance(base.data, dict) or not isinstance(child.data, dict):
        return child
    merged = _Merged()
    keys = [k for k in base.data if k not in _CHILD_ONLY] + [
        k for k in child.data if k not in base.data and k not in _CHILD_ONLY]
    for key in keys:
        pointer = join_pointer("", key)
        in_child = key in child.data
        if key == "parameters":
            _parameters(merged, base, child)
        elif key in _MERGED_BY_NAME and in_child and isinstance(child.data[key], dict) \
                and isinstance(base.data.get(key), dict):
            merged.data[key] = {**base.data[key], **child.data[key]}
            for name in base.data[key]:
                if name not in child.data[key]:
                    merged.copy(base, join_pointer(pointer, name), join_pointer(pointer, name))
            for name in child.data[key]:
                merged.copy(child, join_pointer(pointer, name), join_pointer(pointer, name))
            merged.locations[pointer] = child.locate(pointer)
        elif key == "omit" and in_child and isinstance(child.data[key], list) \
                and isinstance(base.data.get(key), list):
            merged.data[key] = [*base.data[key], *child.data[key]]
            merged.copy(base, pointer, pointer)
            offset = len(base.data[key])
            for j in range(len(child.data[key])):
                merged.copy(child, join_pointer(pointer, j), join_pointer(pointer, offset + j))
        else:
            source = child if in_child else base
            merged.data[key] = source.data[key]
            merged.copy(source, pointer, pointer)
    merged.locations[""] = child.locate("")
    return RawDocument(file=child.file, format=child.format, data=merged.data,
                       locations=merged.locations, notes=merged.notes, verbatim=merged.verbatim)


def extended_document(document: RawDocument, sources: FamilySources,
                      chain: tuple[str, ...] | None = None) -> tuple[RawDocument, list[str]]:
    """`document` written over the family it `extends` (recursively), and the base texts,
    nearest base first; `chain`: the labels read so far (default: the document's own)."""
    chain = (document.file,) if chain is None else chain
    data = document.data
    if not isinstance(data, dict) or "extends" not in data:
        if isinstance(data, dict) and "remove" in data:
            raise LoadError("`remove` drops parameter groups of a base family, so it needs "
                            "`extends`", location=document.locate("/remove"),
                            pointer="/remove")
        groups = data.get("parameters") if isinstance(data, dict) else None
        for j, group in enumerate(groups if isinstance(groups, list) else []):
            if _is_patch(group):
                pointer = join_pointer("/parameters", j)
                raise LoadError(f"parameter group {_group_name(group)!r} has `patch: true`, "
                                "which changes a group of a base family, so it needs `extends`",
                                location=document.locate(pointer), pointer=pointer)
        return document, []
    spec = data["extends"]
    if not isinstance(spec, str) or not spec:
        raise LoadError(f"`extends` names a built-in family or a family file, found {spec!r}",
                        location=document.locate("/extends"),
                        pointer="/extends")
    if len(chain) > MAX_EXTENDS_DEPTH:
        raise LoadError(f"`extends` chains more than {MAX_EXTENDS_DEPTH} families: "
                        f"{' -> '.join(chain)}", location=document.locate("/extends"),
                        pointer="/extends")
    is_file = sources.is_file(spec)
    if is_file and not Path(spec).is_absolute() and not document.file.startswith(
            sources.builtin_prefix):
        spec = str(Path(document.file).parent / spec)
    try:
        base_label, base_text = sources.read(spec, not is_file)
    except LoadError as error:  # an unknown built-in, a missing file: said at the `extends`
        if error.location is not None and error.location.line:
            raise  # located inside the base file already
        close = difflib.get_close_matches(spec, sorted(sources.builtin_names()), n=1)
        hint = f"; did you mean `{close[0]}`?" if close and not is_file else ""
        raise LoadError(f"`extends: {spec}`: {error.message}{hint}",
                        location=document.locate("/extends"), pointer="/extends") from None
    if base_label in chain:
        raise LoadError(f"`extends` makes a cycle: {' -> '.join((*chain, base_label))}",
                        location=document.locate("/extends"),
                        pointer="/extends")
    loaded = load_document(base_label, text=base_text)
    if not isinstance(loaded.data, dict):
        kind = "a list" if isinstance(loaded.data, list) else "a scalar"
        raise LoadError(f"`extends: {spec}`: base family {base_label} is {kind}, expected a "
                        "family document (a mapping with `family`, `parameters`, ...)",
                        location=document.locate("/extends"), pointer="/extends")
    base, texts = extended_document(loaded, sources, (*chain, base_label))
    return merge_documents(base, document), [base_text, *texts]
