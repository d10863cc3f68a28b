"""The package's shape, read from its real import graph.

Every import of every module (top level, inside functions and under TYPE_CHECKING) is an edge.
Edges between the package's rooms may only point to earlier stages; each name is imported from
the one module that defines it; heavy libraries stay in their rooms; the runtime that generated
modules import needs nothing of the compiler.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPILER = ROOT / "compiler"
PACKAGE = COMPILER / "partc"

# Each room (a subpackage, or a top-level module of partc) and its place in the pipeline; a
# room may import only rooms of a lower rank (and itself).
STAGE_RANK = {
    "errors": 0,
    "front": 1,
    "parallel": 1,
    "partition": 2,
    "library": 2,
    "runtime": 3,
    "family": 3,
    "bind": 4,
    "plan": 5,
    "emit": 6,
    "output": 6,
    "api": 7,
    "shard": 7,
    "reshard": 8,  # over shard's writer
    "verify": 8,  # over the api (compile_family); cli reports it
    "inspect": 8,
    "scaffold": 8,
    "cli": 10,
    "__main__": 11,  # `python -m partc`: runs the cli
}
# Rooms that hold data, not code.
DATA_ROOMS = {"examples", "schemas", "architectures", "docs"}
# Third-party libraries and the only rooms allowed to import them.
LIBRARY_OWNERS = {
    "jinja2": {"emit", "inspect"},
    "yaml": {"front", "scaffold"},  # scaffold: `partc init` writes its family with PyYAML
    "jsonschema": {"front"},
    "safetensors": {"verify"},
    "numpy": {"runtime", "partition", "shard", "reshard", "api", "verify"},
    "ml_dtypes": {"runtime", "partition", "shard"},
    "torch": {"runtime", "verify"},
    # `partc verify` only: the reference implementation it checks against, and the masked
    # checkpoints it writes for transformers to load (safetensors comes with transformers)
    "transformers": {"verify"},
    "accelerate": set(),
    "tqdm": {"runtime"},
    # the command line's shell completion and its Hugging Face repo ids (partc[hub])
    "shtab": {"cli"},
    "huggingface_hub": {"cli"},
}
# Packages whose `__init__` is a public face: names listed in its `__all__` may be imported
# from it as well as from their defining module.
PUBLIC_FACES = {"partc", "partc.runtime"}
COMPILER_ONLY = ("jinja2", "yaml", "jsonschema", "safetensors", "tqdm")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(COMPILER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p))
            for p in sorted(PACKAGE.rglob("*.py"))
            if not set(p.relative_to(PACKAGE).parts) & DATA_ROOMS}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "partc"


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _eager_imports(tree: ast.Module) -> set[str]:
    """Imports that run when the module is imported: top level, outside TYPE_CHECKING."""
    found = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                        + [s for h in getattr(node, "handlers", []) for s in h.body])
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _public(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in node.targets)):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def test_every_room_has_a_declared_stage():
    rooms = {_room(m) for m in _modules()} - {"partc"}
    assert rooms <= set(STAGE_RANK), f"add new rooms to STAGE_RANK: {rooms - set(STAGE_RANK)}"


def later_stage_imports(name: str, tree: ast.Module) -> list[str]:
    """The imports of module `name` that reach a room of the same or a later rank."""
    room = _room(name)
    wrong = []
    for imported in sorted(_imports(tree)):
        if not imported.startswith("partc.") or room == "partc":
            continue  # partc/__init__ is the lazy public face; it imports on first use
        target = _room(imported)
        if target == room or target in DATA_ROOMS:
            continue
        if STAGE_RANK[target] >= STAGE_RANK[room]:
            wrong.append(f"{name} imports later stage {imported}")
    return wrong


@pytest.mark.parametrize("name", sorted(_modules()))
def test_imports_only_point_to_earlier_stages(name):
    assert not later_stage_imports(name, _modules()[name])


def _import_sites() -> list[tuple[str, str, str]]:
    """(file, module, name) of every `from partc... import name` in the repository."""
    sites = []
    for folder in ("compiler", "tests", "scripts", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".venv" in path.parts or "fixtures" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                        and (node.module == "partc" or node.module.startswith("partc."))):
                    sites.extend((str(path.relative_to(ROOT)), node.module, alias.name)
                                 for alias in node.names)
    return sites


def test_each_name_is_imported_from_the_module_that_defines_it():
    modules = _modules()
    wrong = []
    for file, module, name in _import_sites():
        if f"{module}.{name}" in modules or module not in modules:
            continue  # a submodule, or a data package
        tree = modules[module]
        if name in _defined(tree):
            continue
        if module in PUBLIC_FACES and name in _public(tree):
            continue
        wrong.append(f"{file}: from {module} import {name}")
    assert not wrong, "re-exported names (import them from their defining module):\n" + "\n".join(
        wrong)


def test_no_module_re_exports_a_name_under_its_own_name():
    shims = [f"{module}: {alias.name}" for module, tree in _modules().items()
             for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for alias in node.names if alias.asname is not None and alias.asname == alias.name]
    assert not shims


@pytest.mark.parametrize("library", sorted(LIBRARY_OWNERS))
def test_heavy_libraries_are_imported_only_by_their_rooms(library):
    users = {_room(name) for name, tree in _modules().items()
             if any(i == library or i.startswith(library + ".") for i in _imports(tree))}
    assert users <= LIBRARY_OWNERS[library]


def test_the_runtime_needs_nothing_of_the_compiler():
    """Closure of partc.runtime's imports (partc/__init__ included) holds no compiler room."""
    modules = _modules()
    seen: set[str] = set()
    todo = ["partc", "partc.runtime"]
    while todo:
        module = todo.pop()
        if module in seen or module not in modules:
            continue
        seen.add(module)
        for imported in _eager_imports(modules[module]):
            if imported.startswith("partc"):
                todo.append(imported)
                parent = imported.rsplit(".", 1)[0]
                todo.append(parent)
    rooms = {_room(m) for m in seen} - {"partc"}
    assert rooms <= {"errors", "parallel", "partition", "runtime"}, rooms
    libraries = {i.split(".")[0] for m in seen for i in _eager_imports(modules[m])}
    assert not libraries & set(COMPILER_ONLY[:3])


def test_a_generated_module_loads_with_the_compiler_libraries_blocked(tmp_path):
    """Import a build's rank module and load a checkpoint with jinja2, yaml, jsonschema and
    safetensors made unimportable (sys.modules[name] = None), in a fresh interpreter."""
    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology

    fixture = ROOT / "tests" / "fixtures" / "hf" / "llama"
    compile_family(None, fixture / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=1),
                   CompileOptions(out=tmp_path / "build"))
    script = (
        "import sys\n"
        f"for name in {COMPILER_ONLY!r}: sys.modules[name] = None\n"
        f"sys.path.insert(0, {str(tmp_path / 'build')!r})\n"
        "import partc_llama_tp2_pp1 as loaders\n"
        f"state = loaders.load({str(fixture)!r}, rank=1)\n"
        "print(len(state.tensors), sorted(m for m in sys.modules if m.startswith('partc')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    count, _, loaded = done.stdout.partition(" ")
    assert int(count) > 0
    for room in ("front", "family", "bind", "plan", "emit", "api"):
        assert f"'partc.{room}" not in loaded


def _folder(module: str) -> str:
    """The package (folder) a module lies in: itself for a package's `__init__`."""
    path = COMPILER / module.replace(".", "/")
    return module if (path / "__init__.py").exists() else module.rsplit(".", 1)[0]


def _edges(modules: dict[str, ast.Module]) -> dict[str, set[tuple[str, str | None]]]:
    """Per module, every (imported module, imported name or None) of the package: top level,
    inside functions and under TYPE_CHECKING alike."""
    found: dict[str, set[tuple[str, str | None]]] = {}
    for module, tree in modules.items():
        edges: set[tuple[str, str | None]] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add((sub, None) if sub in modules else (node.module, alias.name))
            elif isinstance(node, ast.Import):
                edges.update((alias.name, None) for alias in node.names)
        found[module] = {(m, n) for m, n in edges if m in modules}
    return found


def folder_cycles(modules: dict[str, ast.Module]) -> list[frozenset[str]]:
    """The import cycles among the modules of one folder (strongly connected sets of two or
    more modules, each edge within one folder). The lazy face `partc/__init__` imports only
    under TYPE_CHECKING (checked below), so it is not a node."""
    graph = {m: {t for t, _ in edges if t != m and _folder(t) == _folder(m) and t != "partc"}
             for m, edges in _edges(modules).items() if m != "partc"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                cycles.append(frozenset(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports_across_folders(modules: dict[str, ast.Module]) -> list[str]:
    """`from B import _name` in a module outside folder B, and any import of a private module
    (`a._b.c`) from outside the folder that holds the private part (`a`)."""
    wrong = []
    for module, edges in _edges(modules).items():
        for target, name in sorted(edges, key=str):
            if name is not None and _private(name) and _folder(target) != _folder(module):
                wrong.append(f"{module}: from {target} import {name}")
            parts = target.split(".")
            first = next((i for i, p in enumerate(parts) if _private(p)), None)
            if first is not None:
                owner = ".".join(parts[:first])
                if not (module == owner or module.startswith(owner + ".")):
                    wrong.append(f"{module}: import {target}")
    return wrong


def duplicate_module_names(modules: dict[str, ast.Module]) -> dict[str, list[str]]:
    """File stems used by more than one module (packages, `__init__` and `__main__` aside)."""
    stems: dict[str, list[str]] = {}
    for module in modules:
        stem = module.rsplit(".", 1)[-1]
        if _folder(module) != module and stem != "__main__":
            stems.setdefault(stem, []).append(module)
    return {stem: found for stem, found in stems.items() if len(found) > 1}


def test_no_import_cycle_inside_a_folder():
    assert not folder_cycles(_modules())


def test_the_lazy_public_face_imports_only_for_type_checking():
    assert not {i for i in _eager_imports(_modules()["partc"]) if i.startswith("partc")}


def test_no_private_name_or_module_is_imported_across_folders():
    wrong = private_imports_across_folders(_modules())
    assert not wrong, sorted(wrong)


def test_module_names_are_unique_in_the_package():
    assert not duplicate_module_names(_modules())


def payload_codec_sites(modules: dict[str, ast.Module]) -> list[str]:
    """Where a module outside the runtime encodes, decodes or refuses a boundary payload: a
    function named encode*/decode* in `partition/`, or a BoundaryPayloadError raised."""
    found = []
    for name, tree in sorted(modules.items()):
        if _room(name) == "runtime":
            continue
        for node in ast.walk(tree):
            if (_room(name) == "partition"
                    and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.name.startswith(("encode", "decode"))):
                found.append(f"{name}: defines {node.name}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "BoundaryPayloadError"):
                found.append(f"{name}: raises BoundaryPayloadError")
    return sorted(found)


def test_only_the_runtime_encodes_or_decodes_a_boundary_payload():
    # the wire schemas are the partition's vocabulary; a payload exists only in a serving
    # process, so its encode, decode and refusals are the runtime's (runtime/boundary_codec.py)
    assert payload_codec_sites(_modules()) == []


def _synthetic(sources: dict[str, str]) -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in sources.items()}


def test_the_cycle_check_finds_a_cycle_made_only_of_type_checking_imports():
    modules = _synthetic({
        "partc.plan.one": "from partc.plan.two import B\n",
        "partc.plan.two": "from typing import TYPE_CHECKING\n"
                          "if TYPE_CHECKING:\n    from partc.plan.one import A\n",
        "partc.bind.three": "from partc.plan.one import A\n",
    })
    assert folder_cycles(modules) == [frozenset({"partc.plan.one", "partc.plan.two"})]
    del modules["partc.plan.two"]
    assert folder_cycles(modules) == []


def test_the_private_check_finds_a_private_name_or_module_from_another_folder():
    modules = _synthetic({
        "partc.parallel.specs": "def _helper(): ...\n",
        "partc.parallel.layout": "from partc.parallel.specs import _helper\n",
        "partc.plan.split": "from partc.parallel.specs import _helper\n",
        "partc.runtime.loader": "from partc.runtime._engine.reader import read\n",
        "partc.runtime._engine.reader": "def read(): ...\n",
        "partc.shard": "from partc.runtime._engine.reader import read\n",
    })
    assert private_imports_across_folders(modules) == [
        "partc.plan.split: from partc.parallel.specs import _helper",
        "partc.shard: import partc.runtime._engine.reader"]


def test_the_name_check_finds_two_modules_of_one_stem():
    modules = _synthetic({"partc.plan.ranks": "", "partc.runtime.ranks": "", "partc.plan": ""})
    assert duplicate_module_names(modules) == {"ranks": ["partc.plan.ranks",
                                                         "partc.runtime.ranks"]}


def test_the_payload_check_finds_a_codec_outside_the_runtime():
    modules = _synthetic({
        "partc.partition.wire": "class B:\n    def encode_values(self): ...\n"
                                "def decode(): ...\ndef resolve(): ...\n",
        "partc.plan.cut": "def f():\n    raise BoundaryPayloadError(kind, 'm')\n",
        "partc.runtime.codec": "def decode(): raise BoundaryPayloadError(kind, 'm')\n",
    })
    assert payload_codec_sites(modules) == [
        "partc.partition.wire: defines decode", "partc.partition.wire: defines encode_values",
        "partc.plan.cut: raises BoundaryPayloadError"]


def test_the_rank_check_refuses_an_import_of_a_later_stage():
    tree = ast.parse("from partc.plan.realize import realize_plan\nfrom partc.errors import E\n")
    assert later_stage_imports("partc.runtime.loader", tree) == [
        "partc.runtime.loader imports later stage partc.plan.realize"]
    assert later_stage_imports("partc.api", tree) == []


def test_no_module_calls_eval_or_exec():
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec"), name


# ---------------------------------------------------------------- plan.json is read typed

PLAN_KEYS = frozenset(json.loads((ROOT / "schemas" / "plan.schema.json").read_text())[
    "properties"])
"""The top-level keys of a plan document."""
RAW_PLAN_NAMES = frozenset({"plan", "plans", "document", "body", "build", "staged"})
"""Names (variables or attributes) that held a parsed plan document before it was read typed."""
JSON_DECODERS = frozenset({"load", "loads", "parse_json"})
"""Calls that decode JSON text (json.load/json.loads, front.load.parse_json)."""
OTHER_JSON_READERS = {
    ("partc.api", "bind"): "config.json",
    ("partc.api", "with_expert_placement"): "an expert placement file",
    ("partc.cli.commands", "run_schema"): "a schema shipped with partc",
    ("partc.front.load", "load_json"): "a family or config file (the loading stage)",
    ("partc.front.load", "parse_json"): "any JSON text with positions (the loading stage)",
    ("partc.front.positions", "json_locations"): "one JSON string token",
    ("partc.front.schema", "load_schema"): "a schema shipped with partc",
    ("partc.inspect.origins", "group_origins"): "the config document it writes itself",
    ("partc.output", "read_marker"): "an output folder's marker file",
    ("partc.reshard", "_source_set"): "a shard manifest's recorded source layout",
    ("partc.runtime.read_planner", "_cached"): "the storage calibrations partc caches itself",
    ("partc.scaffold.survey", "_read_config"): "config.json",
    ("partc.shard", "_header_spelling"): "a validated safetensors header",
    ("partc.shard", "source_layout"): "a checkpoint index's metadata",
    ("partc.verify.reference", "load_config"): "config.json",
    ("partc.verify.inputs", "model_inputs"): "config.json",
}
"""Functions outside the plan stage that decode JSON, and what they decode: anything else that
decodes JSON could be reading plan.json behind `read_plan`'s back."""


def _enclosing_functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Every node with the name of the outermost function holding it ('' at module level)."""
    def visit(node: ast.AST, function: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            inner = child.name if (not function and isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef))) else function
            yield inner, child
            yield from visit(child, inner)
    yield from visit(tree, "")


def _raw_name(node: ast.AST) -> str | None:
    """The name a subscripted or `.get`-ed value goes by: a variable or an attribute."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def plan_document_uses(modules: dict[str, ast.Module]) -> list[str]:
    """Sites outside the plan stage (which reads plan.json, `read_plan`) and emit (which writes
    it) that walk a plan document: JSON decoded in a function not known to read another
    document, a plan key subscripted (or `.get`) on a name that held plan documents, or the
    echoed `topology_json` indexed."""
    found = []
    for module, tree in sorted(modules.items()):
        if _room(module) in ("plan", "emit"):
            continue
        for function, node in _enclosing_functions(tree):
            where = f"{module}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else (
                    node.func.id if isinstance(node.func, ast.Name) else "")
                decoder = called in JSON_DECODERS and (
                    called == "parse_json" or isinstance(node.func, ast.Name)
                    or _raw_name(node.func.value) == "json")  # type: ignore[attr-defined]
                if decoder and (module, function) not in OTHER_JSON_READERS:
                    found.append(f"{where}: {function or 'module'} decodes JSON")
                if called == "get" and isinstance(node.func, ast.Attribute) and node.args:
                    key, holder = node.args[0], _raw_name(node.func.value)
                    if holder == "topology_json" or (
                            holder in RAW_PLAN_NAMES and isinstance(key, ast.Constant)
                            and key.value in PLAN_KEYS):
                        found.append(f"{where}: {holder}.get({ast.unparse(key)})")
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key, holder = node.slice, _raw_name(node.value)
                if holder == "topology_json" or (
                        holder in RAW_PLAN_NAMES and isinstance(key, ast.Constant)
                        and key.value in PLAN_KEYS):
                    found.append(f"{where}: {holder}[{ast.unparse(key)}]")
    return found


def test_only_read_plan_reads_a_plan_document():
    assert plan_document_uses(_modules()) == []


def test_the_plan_document_check_finds_a_consumer_that_walks_plan_json():
    modules = _synthetic({
        "partc.inspect.bad": (
            "import json\n"
            "def ranks(path):\n"
            "    plan = json.loads(path.read_text())\n"
            "    return [r['rank'] for r in plan['ranks']] + [plan.get('groups')]\n"
            "def size(build):\n"
            "    return build.file.topology_json['tensor_parallel_size']\n"
            "def fine(build):\n"
            "    return build.file.ranks[0].rank, build.summary['ranks'], build.plan[0]\n"),
        "partc.plan.plan_file": "import json\ndef read_plan(p):\n    return json.loads(p)\n",
        "partc.api": "import json\ndef bind(p):\n    return json.loads(p)['groups']\n",
    })
    assert plan_document_uses(modules) == [
        "partc.inspect.bad:3: ranks decodes JSON",
        "partc.inspect.bad:4: plan['ranks']",
        "partc.inspect.bad:4: plan.get('groups')",
        "partc.inspect.bad:6: topology_json['tensor_parallel_size']"]


def test_a_plan_read_back_holds_no_untyped_json_beyond_its_echoes(tmp_path):
    """Every value of a PlanFile is a typed record, a tuple of them, or a scalar; JSON
    containers only where the plan is echoed whole (`topology_json`) or is free-form data
    (`config`, the config values)."""
    from partc.api import CompileOptions, compile_family
    from partc.plan.plan_file import read_plan
    from partc.plan.topology import Topology

    from support import hf

    compile_family(None, hf("qwen3_moe") / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2,
                            expert_parallel_size=2), CompileOptions(out=tmp_path / "b"))
    echoes = {"topology_json", "config"}
    untyped = []

    def walk(value: object, path: str) -> None:
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                if f.name not in echoes:
                    walk(getattr(value, f.name), f"{path}.{f.name}")
        elif isinstance(value, tuple):
            for i, item in enumerate(value[:3]):
                walk(item, f"{path}[{i}]")
        elif isinstance(value, Mapping):
            untyped.extend(f"{path}[{k!r}]" for k, v in value.items()
                           if not isinstance(v, (int, str, type(None))))
        elif isinstance(value, (list, dict, set)):
            untyped.append(path)

    walk(read_plan(tmp_path / "b" / "plan.json"), "plan")
    assert not untyped, untyped
