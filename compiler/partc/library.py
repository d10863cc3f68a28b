"""The built-in family library: lookup by model type and family files by path."""

from __future__ import annotations

import errno
import json
import os
from functools import cache
from importlib import resources
from pathlib import Path

from partc.errors import LoadError, SourceLocation
from partc.front.load import RawDocument, load_document, long_path_error, read_text

BUILTIN_PREFIX = "architectures/"
"""How built-in family files are named in messages and plan sources."""


@cache
def builtin_families() -> dict[str, str]:
    """Built-in family files by every model type they describe (file name values)."""
    found: dict[str, str] = {}
    root = resources.files("partc.architectures")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith((".yaml", ".yml", ".toml")):
            continue
        document = load_document(entry.name, text=entry.read_text(encoding="utf-8"))
        data = document.data if isinstance(document.data, dict) else {}
        for model_type in data.get("model_types", []):
            found.setdefault(str(model_type), entry.name)
        if isinstance(data.get("family"), str):
            found.setdefault(data["family"], entry.name)
    return found


FAMILY_SUFFIXES = (".yaml", ".yml", ".toml")
"""Suffixes that make a family spec a file path."""


def family_spec_is_file(spec: str | Path) -> bool:
    """Whether an explicit family spec names a file rather than a built-in family.

    The rule: a `Path`, a spec ending in .yaml/.yml/.toml, one holding a path separator, or
    the name of an existing regular file is a file; anything else (even when a folder of that
    name exists in the working directory) names a built-in family.
    """
    if isinstance(spec, Path):
        return True
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if spec.lower().endswith(FAMILY_SUFFIXES) or any(s in spec for s in separators):
        return True
    try:
        return Path(spec).is_file()
    except (OSError, ValueError):  # a name too long for the file system is no file here
        return False


def read_family_source(spec: str | Path, *, builtin: bool = False) -> tuple[str, str]:
    """(display name, text) of a family given as a file path or a built-in model type.

    With `builtin` (the family comes from a config's `model_type`) it is always the built-in
    one; otherwise `family_spec_is_file` decides.
    """
    if "\0" in str(spec):
        raise LoadError("a family path cannot contain a NUL character",
                        location=SourceLocation(repr(str(spec))))
    families = builtin_families()
    if not builtin and family_spec_is_file(spec):
        path = Path(spec)
        try:
            folder = path.is_dir()
        except OSError as exc:  # ENAMETOOLONG; any other refusal is read_text's to say
            if exc.errno == errno.ENAMETOOLONG:
                raise long_path_error(spec, "family file") from None
            folder = False
        if folder:
            raise LoadError(
                f"family {str(spec)!r} is a folder; expected a family file (.yaml, .yml or "
                f".toml) or a built-in family name ({', '.join(sorted(families))})",
                location=SourceLocation(str(spec)))
        return str(spec), read_text(path, "family file")  # bounded size, UTF-8, located errors
    name = families.get(str(spec))
    if name is None:
        raise LoadError(f"no built-in family for model type {str(spec)!r} (a family file needs "
                        f"a .yaml, .yml or .toml suffix or a path with a `/`); built-in: "
                        f"{', '.join(sorted(families))}",
                        location=SourceLocation(str(spec)))
    text = resources.files("partc.architectures").joinpath(name).read_text(encoding="utf-8")
    return BUILTIN_PREFIX + name, text


def family_for_config(config: RawDocument) -> str:
    """The built-in family name for a config's `model_type`."""
    model_type = config.data.get("model_type")
    families = builtin_families()
    if not isinstance(model_type, str):
        found = ("has no `model_type`" if "model_type" not in config.data
                 else f"gives `model_type` as {json.dumps(model_type)}, not a string")
        raise LoadError(f"config.json {found}, so no built-in family applies; expected the "
                        f"model type of a built-in family ({', '.join(sorted(families))}), or "
                        "name a family file", location=config.locate(
                            "/model_type" if "model_type" in config.data else ""),
                        pointer="/model_type")
    if model_type not in families:
        raise LoadError(f"config model_type {model_type!r} has no built-in family; known: "
                        f"{', '.join(sorted(families))}. Write one: "
                        f"{_init_command(config.file, model_type)} guesses it from the "
                        "checkpoint; then pass that file as the family argument",
                        location=config.locate("/model_type"), pointer="/model_type",
                        doc="authoring#1-look-at-the-checkpoint-and-the-config")
    return model_type


def _init_command(config_file: str, model_type: str) -> str:
    """`partc init --checkpoint DIR --out NAME.yaml` for a config of an unknown model type: DIR
    is the config's folder when it holds a checkpoint (else `CHECKPOINT`), NAME the model type
    spelled as a family name."""
    folder = Path(config_file).parent
    try:
        holds = any(p.suffix == ".safetensors" for p in folder.iterdir())
    except OSError:
        holds = False
    name = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_"
                   for c in model_type)[:64].lstrip("0123456789") or "family"
    checkpoint = str(folder) if holds else "CHECKPOINT"
    if any(c.isspace() or c in "'\"$`" for c in checkpoint):
        checkpoint = "'" + checkpoint.replace("'", "'\\''") + "'"
    return f"`partc init --checkpoint {checkpoint} --out {name}.yaml`"
