"""The package's shape: imports point only to earlier stages; heavy libraries stay put."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "compiler" / "partc"

# Each module's place in the pipeline; a module may import only modules of a lower rank.
STAGE_RANK = {
    "errors": 0,
    "expr": 1,
    "positions": 1,
    "load": 2,
    "files": 1,
    "headers": 2,
    "checkpoint": 3,
    "layout": 1,
    "schema": 3,
    "hfconfig": 3,
    "parallel": 2,
    "formats": 3,
    "boundary": 2,
    "partition": 3,
    "driver": 4,
    "family": 5,
    "bind": 6,
    "plan": 7,
    "digests": 3,
    "emit": 8,
    "output": 8,
    "runtime": 8,
    "api": 9,
    "shard": 9,
    "cli": 10,
}
# Third-party libraries and the only modules allowed to import them.
LIBRARY_OWNERS = {
    "jinja2": {"emit"},
    "yaml": {"load"},
    "jsonschema": {"schema"},
    "safetensors": set(),
    "numpy": {"headers", "checkpoint", "digests", "runtime", "boundary", "driver", "shard"},
    "ml_dtypes": {"headers", "checkpoint", "runtime", "boundary", "shard"},
    "torch": {"runtime"},
    "tqdm": {"runtime"},
}


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))
            if p.stem != "__init__"}


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "partc":
                found.update(f"partc.{alias.name}" for alias in node.names)
    return found


def test_every_module_has_a_declared_stage():
    assert set(_modules()) <= set(STAGE_RANK), "add new modules to STAGE_RANK"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_imports_only_point_to_earlier_stages(name):
    for imported in _imports(_modules()[name]):
        if not imported.startswith("partc."):
            continue
        target = imported.split(".")[1]
        if target not in STAGE_RANK:
            continue  # subpackages such as partc.templates hold data
        assert STAGE_RANK[target] < STAGE_RANK[name], f"{name} imports later stage {target}"


@pytest.mark.parametrize("library", sorted(LIBRARY_OWNERS))
def test_heavy_libraries_are_imported_only_by_their_stage(library):
    users = {name for name, tree in _modules().items()
             if any(i == library or i.startswith(library + ".") for i in _imports(tree))}
    assert users <= LIBRARY_OWNERS[library]


def test_no_module_calls_eval_or_exec():
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec"), name
