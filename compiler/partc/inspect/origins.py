"""Where in the family each group of a build was declared (`file:line`).

The plan does not record the family's source positions, so they are computed here: the family
named in plan.json's sources is loaded again (the built-in one, or the file given with
`--family`), checked against the sha256 the plan recorded, and bound to a config rebuilt from
the plan's bound config values; each group's declaration pointer is then located in the family
document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.api import family_document
from partc.bind.binder import bind_family
from partc.errors import PartcError
from partc.family.build import build_family
from partc.front.load import parse_json
from partc.front.schema import validate_document
from partc.library import read_family_source

BUILTIN_SUFFIX = " (built-in)"
"""How plan.json's sources name a built-in family."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Origins:
    """Each group's declaration `file:line` (empty when unknown) and a note on how it was found."""

    lines: dict[str, str]
    """Group name -> `file:line` of the family entry that declared it."""
    note: str
    """How the family was found, or why the lines are unknown."""


def _family_source(plan: dict[str, Any]) -> tuple[str, str | None]:
    """(label, sha256) of the family among a plan's sources."""
    for source in plan.get("sources", []):
        if source["name"] != "config.json" and not source["name"].endswith(".json"):
            return source["name"], source.get("sha256")
    return "", None


def _config_document(decl: Any, plan: dict[str, Any]) -> str:
    """A config.json text that binds the family to the plan's recorded values."""
    values = dict(plan.get("config", {}))
    doc: dict[str, Any] = {"model_type": plan.get("model_type")}
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


def group_origins(plan: dict[str, Any], family: str | Path | None = None, *,
                  near: Path | None = None) -> Origins:
    """Each group's declaration line, by re-loading and re-binding the plan's family: the
    built-in one, the file given, or else the file plan.json names found in the working
    directory or in `near` (the folder holding the build) with the sha256 the plan records."""
    label, recorded = _family_source(plan)
    if family is None and not label.endswith(BUILTIN_SUFFIX):
        folders = [Path()] + ([near] if near is not None else [])
        family = _found_beside(label, recorded, folders)
        if family is None:
            return Origins(lines={}, note=f"family file `{label}` is not built in and no file "
                                          "of that name and sha256 is in the working directory "
                                          "or beside the build: pass --family FILE to see the "
                                          "line of each split")
    spec: str | Path = family if family is not None else str(plan.get("model_type"))
    try:
        name, text = read_family_source(spec, builtin=family is None)
        document, digest = family_document(name, text)  # with the families it extends
        if recorded and digest != recorded:
            return Origins(lines={}, note=f"{name} changed since this build was compiled (its "
                                          "sha256 differs from plan.json's): lines not shown")
        if validate_document(document):
            return Origins(lines={}, note=f"{name} does not validate: lines not shown")
        decl, errors = build_family(document)
        if errors or decl is None:
            return Origins(lines={}, note=f"{name} does not build: lines not shown")
        config = parse_json("config.json", _config_document(decl, plan), "config.json")
        bound = bind_family(decl, config, frozenset(t["target"] for t in plan["tensors"]))
    except PartcError as error:
        return Origins(lines={}, note=f"cannot re-bind the family: {error}")
    lines = {}
    for group, pointer in bound.group_pointers:
        where = document.locate(pointer)
        lines[group] = f"{where.file}:{where.line}"
    return Origins(lines=lines, note=f"lines of {name}, re-bound to the plan's config values")
