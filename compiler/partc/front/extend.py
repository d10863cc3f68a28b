"""`extends:`: one family document written over a base family document.

The rule (also in the schema's description of `extends`):

- `config` and `derived`: the child's entries are added, or replace the base's of the same name;
- `parameters`: a child entry replaces the base's group of the same `name` in place, a new name
  is appended, and `remove: [names]` drops base groups (an unknown name is an error);
- `omit`: the child's globs are added after the base's;
- every other key (`family`, `model_types`, `graph`, `static`, `boundary`, `policy`,
  `linear_formats`, ...) is the child's when it has one, else the base's.

The merged document keeps every node's source position, so an error about something the base
declared points into the base file, and one about the child's into the child file.
"""

from __future__ import annotations

from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.front.load import RawDocument
from partc.front.positions import join_pointer

MAX_EXTENDS_DEPTH = 8
"""Longest chain of `extends:` accepted (a family extending a family extending ...)."""

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


def _parameters(merged: _Merged, base: RawDocument, child: RawDocument) -> None:
    """Base groups, replaced by name or removed, then the child's new groups."""
    base_groups = base.data.get("parameters", [])
    child_groups = child.data.get("parameters", [])
    removed = child.data.get("remove", [])
    names = [_group_name(g) for g in base_groups]
    for i, name in enumerate(removed if isinstance(removed, list) else []):
        if name not in names:
            raise LoadError(f"`remove` names parameter group {name!r}, which base family "
                            f"`{base.data.get('family')}` does not declare; its groups: "
                            f"{', '.join(str(n) for n in names)}",
                            location=child.locate(join_pointer("/remove", i)),
                            pointer=join_pointer("/remove", i))
    replacing = {_group_name(g): j for j, g in enumerate(child_groups)
                 if _group_name(g) in names}
    out: list[Any] = []
    for i, (group, name) in enumerate(zip(base_groups, names, strict=True)):
        if name in removed:
            continue
        dst = join_pointer("/parameters", len(out))
        if name in replacing:
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
