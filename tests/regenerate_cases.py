"""Rewrite the expected.txt of every error case under tests/cases/ from what partc reports now.

A case is a folder `tests/cases/<name>/` holding `family.yaml` or `family.toml`, optionally a
`config.json` to bind it to, and `expected.txt`: the exact `file:line:col: message [at pointer]`
lines `partc check` prints for it, sorted (empty for a family that must be accepted). To add a
case, create the folder with its input files and an empty expected.txt, run

    python tests/regenerate_cases.py [NAME ...]

and review the diff. `python tests/regenerate_cases.py --toml-twin` rewrites
`cases/llama_toml_twin/family.toml`, the TOML spelling of architectures/llama.yaml. Folders
without expected.txt (golden families of other tests) are skipped.

`python tests/regenerate_cases.py --golden [NAME ...]` rewrites the golden generated builds
under tests/golden/ (plan.json, the build marker and the loader package of each build in
GOLDEN_BUILDS, compiled from the tiny fixtures without a checkpoint), which
tests/test_golden_packages.py compares fresh compiles with byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "cases"
GOLDEN = ROOT / "tests" / "golden"

GOLDEN_BUILDS: dict[str, tuple[str, int, int, int | None]] = {
    "llama_tp2_pp2": ("llama", 2, 2, None),
    "llama_tp4": ("llama", 4, 1, None),  # KV heads repeated: `kv x2`
    "mixtral_tp2_ep2": ("mixtral", 2, 1, 2),  # experts placed by EP: `expert E`
    "phi3_tp2": ("phi3", 2, 1, None),  # fused qkv: `cat(narrow(...), ...)`
    "qwen2_vl_tp2_pp2": ("qwen2_vl", 2, 2, None),  # vision tower and language model
}
"""Golden builds by folder name: (fixture under tests/fixtures/hf, TP, PP, EP or None)."""


def compile_golden(name: str, out: Path) -> None:
    """Compile golden build `name` into `out` (replaced whole), as `partc compile` would."""
    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology

    fixture, tp, pp, ep = GOLDEN_BUILDS[name]
    compile_family(None, ROOT / "tests" / "fixtures" / "hf" / fixture / "config.json",
                   Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            expert_parallel_size=ep), CompileOptions(out=out))


def write_golden(names: list[str]) -> None:
    """Rewrite the named golden builds (default: all); print what changed."""
    for name in names or sorted(GOLDEN_BUILDS):
        target = GOLDEN / name
        before = {p.relative_to(target): p.read_bytes() for p in sorted(target.rglob("*"))
                  if p.is_file()} if target.is_dir() else {}
        compile_golden(name, target)
        after = {p.relative_to(target): p.read_bytes() for p in sorted(target.rglob("*"))
                 if p.is_file()}
        if after != before:
            print(f"updated golden {name}: {len(after)} file(s)")


def case_folders() -> list[Path]:
    """Every error-case folder, by name."""
    return sorted(p for p in CASES.iterdir() if (p / "expected.txt").is_file())


def family_file(folder: Path) -> Path:
    """The case's family file (family.yaml, family.yml or family.toml)."""
    found = [p for p in folder.iterdir() if p.stem == "family"]
    if len(found) != 1:
        raise SystemExit(f"{folder}: expected exactly one family.yaml or family.toml")
    return found[0]


def case_errors(folder: Path) -> list[str]:
    """The error lines `partc check` gives for a case, run from inside its folder."""
    from partc.api import check_family
    from partc.errors import PartcError

    config = "config.json" if (folder / "config.json").is_file() else None
    previous = os.getcwd()
    os.chdir(folder)
    try:
        errors = check_family(family_file(folder).name, config)
    finally:
        os.chdir(previous)
    return [str(error) for error in sorted(errors, key=PartcError.sort_key)]


def expected_errors(folder: Path) -> list[str]:
    """The lines of a case's expected.txt."""
    return (folder / "expected.txt").read_text(encoding="utf-8").splitlines()


# ---------------------------------------------------------------- TOML spelling of a family

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")
_TABLE_KEYS = ("params", "fused", "output")
_ARRAY_TABLE_KEYS = ("projections", "members")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def toml_value(value: Any) -> str:
    """An inline TOML value: strings, integers, booleans, arrays and inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML spelling for {type(value).__name__}")


def _table(lines: list[str], header: str, data: dict[str, Any], array: bool) -> None:
    lines.append("")
    lines.append(f"[[{header}]]" if array else f"[{header}]")
    nested = []
    for key, value in data.items():
        if key in _TABLE_KEYS and isinstance(value, dict) and value:
            nested.append((key, value, False))
        elif (key in _ARRAY_TABLE_KEYS and isinstance(value, list) and value
              and all(isinstance(v, dict) for v in value)):
            nested.append((key, value, True))
        else:
            lines.append(f"{_key(key)} = {toml_value(value)}")
    for key, value, is_array in nested:
        for item in value if is_array else [value]:
            _table(lines, f"{header}.{_key(key)}", item, is_array)


def toml_spelling(data: dict[str, Any]) -> str:
    """A family document spelled in idiomatic TOML: `[[parameters]]` arrays of tables,
    `[parameters.params]` sub-tables, `[[parameters.projections]]`, inline tables elsewhere."""
    lines = ["# TOML spelling of the same family; generated by tests/regenerate_cases.py"]
    tables = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, [value], False))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((key, value, True))
        elif isinstance(value, str) and "\n" in value:
            lines.append(f'{_key(key)} = """\n{value}"""' if '"""' not in value
                         and "\\" not in value else f"{_key(key)} = {toml_value(value)}")
        else:
            lines.append(f"{_key(key)} = {toml_value(value)}")
    for key, items, is_array in tables:
        for item in items:
            if is_array:
                _table(lines, _key(key), item, True)
            else:
                lines.append("")
                lines.append(f"[{_key(key)}]")
                lines.extend(f"{_key(k)} = {toml_value(v)}" for k, v in item.items())
    return "\n".join(lines) + "\n"


def write_llama_twin() -> Path:
    """Rewrite tests/cases/llama_toml_twin/family.toml from architectures/llama.yaml."""
    from partc.front.load import load_document

    source = ROOT / "architectures" / "llama.yaml"
    data = load_document(source).data
    target = CASES / "llama_toml_twin" / "family.toml"
    target.parent.mkdir(exist_ok=True)
    target.write_text(toml_spelling(data), encoding="utf-8")
    (target.parent / "expected.txt").touch()
    return target


def main(names: list[str]) -> int:
    """Rewrite expected.txt for the named cases (default: all); print what changed."""
    if names == ["--toml-twin"]:
        print(f"wrote {write_llama_twin().relative_to(ROOT)}")
        return 0
    if names[:1] == ["--golden"]:
        write_golden(names[1:])
        return 0
    folders = [CASES / name for name in names] if names else case_folders()
    for folder in folders:
        lines = case_errors(folder)
        text = "".join(line + "\n" for line in lines)
        target = folder / "expected.txt"
        old = target.read_text(encoding="utf-8") if target.is_file() else None
        if old != text:
            target.write_text(text, encoding="utf-8")
            print(f"updated {folder.name}: {len(lines)} error(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
