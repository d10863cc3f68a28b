"""Where in the family each group of a build was declared (`file:line`).

The plan does not record the family's source positions, so they are computed here: the family
named in plan.json's sources is loaded again (the built-in one, or the file given with
`--family`), checked against the sha256 the plan recorded, and bound to a config rebuilt from
the plan's bound config values; each group's declaration pointer is then located in the family
document, and so is the entry of each tensor within its group's declaration (its projection's
`module:` or its member), found by matching the tensor's name against the entries' templates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partc.api import family_document
from partc.bind.binder import bind_family
from partc.errors import PartcError
from partc.family.build import build_family
from partc.front.load import parse_json
from partc.front.schema import validate_document
from partc.library import read_family_source

if TYPE_CHECKING:
    from partc.family.declaration import GroupDecl
    from partc.family.expr import Template
    from partc.plan.plan_records import PlanFile

BUILTIN_SUFFIX = " (built-in)"
"""How plan.json's sources name a built-in family."""


class FamilyLines(Mapping[str, str]):
    """Group name -> `file:line` of the family entry that declared it, and the line of each
    tensor's own entry in that declaration (`tensor`)."""

    __slots__ = ("_groups", "_tensors")

    def __init__(self, groups: Mapping[str, str] | None = None,
                 tensors: Mapping[str, str] | None = None) -> None:
        self._groups = dict(groups or {})
        self._tensors = dict(tensors or {})

    def __getitem__(self, group: str) -> str:
        return self._groups[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def tensor(self, target: str, group: str) -> str | None:
        """The line of the entry declaring tensor `target` of `group` (a projection's `module:`,
        a member), else of the group's declaration; None when neither is known."""
        return self._tensors.get(target) or self._groups.get(group)


@dataclass(frozen=True, slots=True, kw_only=True)
class Origins:
    """Each group's declaration `file:line` (empty when unknown) and a note on how it was found."""

    lines: FamilyLines
    """Group name -> `file:line` of the family entry that declared it (and each tensor's)."""
    note: str
    """How the family was found, or why the lines are unknown."""


def _unknown(note: str) -> Origins:
    """The origins of a build whose family lines cannot be found, and why."""
    return Origins(lines=FamilyLines(), note=note)


def _family_source(plan: PlanFile) -> tuple[str, str | None]:
    """(label, sha256) of the family among a plan's sources."""
    for source in plan.sources:
        if source.name != "config.json" and not source.name.endswith(".json"):
            return source.name, source.sha256
    return "", None


def _config_document(decl: Any, plan: PlanFile) -> str:
    """A config.json text that binds the family to the plan's recorded values."""
    values = dict(plan.config)
    doc: dict[str, Any] = {"model_type": plan.model_type}
    for field in decl.config:
        if field.name not in values or field.present is not None:
            continue
        node = doc
        *parents, leaf = field.sources[0].split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = values[field.name]
    return json.dumps(doc)


def _found_beside(label: str, recorded: str | None, folders: list[Path]) -> Path | None:
    """The family file plan.json names (`label`, its file name), in the first of `folders`
    holding a file of that name whose sha256 (with the families it extends) is the one the
    plan recorded; None when none does."""
    if not recorded or not label or Path(label).name != label:
        return None
    for folder in folders:
        candidate = folder / label  # Path() / label: the working directory, as given
        if not candidate.is_file():
            continue
        try:
            name, text = read_family_source(candidate)
            if family_document(name, text)[1] == recorded:
                return candidate
        except PartcError:
            continue
    return None


def group_origins(plan: PlanFile, family: str | Path | None = None, *,
                  near: Path | None = None) -> Origins:
    """Each group's declaration line and each tensor's entry line in it, by re-loading and
    re-binding the plan's family: the built-in one, the file given, or else the file plan.json
    names found in the working directory or in `near` (the folder holding the build) with the
    sha256 the plan records."""
    label, recorded = _family_source(plan)
    if family is None and not label.endswith(BUILTIN_SUFFIX):
        folders = [Path()] + ([near] if near is not None else [])
        family = _found_beside(label, recorded, folders)
        if family is None:
            return _unknown(f"family file `{label}` is not built in and no file "
                            "of that name and sha256 is in the working directory "
                            "or beside the build: pass --family FILE to see the "
                            "line of each split")
    spec: str | Path = family if family is not None else str(plan.model_type)
    try:
        name, text = read_family_source(spec, builtin=family is None)
        document, digest = family_document(name, text)  # with the families it extends
        if recorded and digest != recorded:
            return _unknown(f"{name} changed since this build was compiled (its "
                            "sha256 differs from plan.json's): lines not shown")
        if validate_document(document):
            return _unknown(f"{name} does not validate: lines not shown")
        decl, errors = build_family(document)
        if errors or decl is None:
            return _unknown(f"{name} does not build: lines not shown")
        config = parse_json("config.json", _config_document(decl, plan), "config.json")
        bound = bind_family(decl, config, frozenset(t.target for t in plan.tensors))
    except PartcError as error:
        return _unknown(f"cannot re-bind the family: {error}")
    groups, tensors = {}, {}
    for group, pointer in bound.group_pointers:
        where = document.locate(pointer)
        groups[group] = f"{where.file}:{where.line}"
    declarations = {g.pointer: g for g in decl.groups}
    pointers = dict(bound.group_pointers)
    entries: dict[str, _Entries] = {}
    for t in plan.tensors:
        pointer = pointers.get(t.group, "")
        if pointer not in declarations:
            continue
        if pointer not in entries:
            entries[pointer] = _entries(declarations[pointer])
        entry = _entry_pointer(entries[pointer], t.target)
        if entry is not None:
            where = document.locate(entry)
            tensors[t.target] = f"{where.file}:{where.line}"
    return Origins(lines=FamilyLines(groups, tensors),
                   note=f"lines of {name}, re-bound to the plan's config values")


_Patterns = tuple[tuple[re.Pattern[str], str], ...]
"""(name pattern, pointer of the entry declaring the names it matches) pairs."""
_Entries = tuple[_Patterns, _Patterns]
"""A group declaration's entries: the names each declares, then each projection's companions
(see `_entries`)."""


def _pattern(template: Template) -> str:
    """A regular expression of the names `template` renders to (each field: any text)."""
    return "".join(re.escape(part) if isinstance(part, str) else ".+?"
                   for part in template.parts)


def _entries(group: GroupDecl) -> _Entries:
    """The patterns of the names each entry of `group` declares: a projection's (or fused
    projection's, or output's) module and parameter, a member's target; then of the
    companions a linear format adds to them: a suffix of the name (`weight_scale_inv`,
    `down_proj_blocks`) or, beside a projection's parameters, one more (`scales`). A
    module-form group is one entry: none here."""
    declared = [(f"{_pattern(m.module)}\\.{_pattern(p.name)}", m.pointer)
                for m in group.projections for p in m.params]
    declared += [(_pattern(p.name), p.pointer) for p in group.members]
    companions = [(f"{name}_[^.]+", pointer) for name, pointer in declared]
    companions += [(f"{_pattern(m.module)}\\.[^.]+", m.pointer) for m in group.projections]
    return (tuple((re.compile(name), pointer) for name, pointer in declared),
            tuple((re.compile(name), pointer) for name, pointer in companions))


def _entry_pointer(entries: _Entries, target: str) -> str | None:
    """The pointer of the one entry whose declared names match `target` (else of the one
    projection it is a companion of); None when none, or more than one, does (the group's own
    line then stands)."""
    for patterns in entries:
        found = {pointer for pattern, pointer in patterns if pattern.fullmatch(target)}
        if found:
            return found.pop() if len(found) == 1 else None
    return None
