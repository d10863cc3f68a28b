"""Stage 6: render a plan into a generated loader package and write it atomically.

Templates only arrange precomputed strings; every value from a family, a config or a
checkpoint reaches the generated code through `python_literal`, which spells it as an escaped
Python literal. Rendered modules are compiled and their statement kinds checked before anything
is written; the output folder is replaced in one rename.
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from partc import __version__
from partc.errors import EmitError
from partc.plan import canonical_json, layout_json

if TYPE_CHECKING:
    from partc.plan import Plan, RankPlan


def python_literal(value: Any) -> str:
    """Deterministic Python source for plain data: None, bool, int, str, tuple, list, dict."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise EmitError(f"cannot emit non-finite float {value!r}")
        return repr(value)
    if isinstance(value, str):
        return ascii(value)
    if isinstance(value, tuple | list):
        items = ", ".join(python_literal(v) for v in value)
        return f"({items},)" if len(value) == 1 else f"({items})"
    if isinstance(value, dict):
        items = ", ".join(f"{python_literal(k)}: {python_literal(v)}"
                          for k, v in sorted(value.items()))
        return "{" + items + "}"
    raise EmitError(f"cannot emit a value of type {type(value).__name__}")


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("partc", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@dataclass(frozen=True, slots=True)
class _Header:
    version: str
    sources: str
    plan_hash: str


def package_name(plan: Plan) -> str:
    """The generated package's import name, e.g. `partc_llama_tp2_pp2`."""
    family = "".join(c if c.isalnum() else "_" for c in plan.family.lower())
    topology = plan.topology
    return f"partc_{family}_tp{topology.tensor_parallel_size}_pp{topology.pipeline_parallel_size}"


def rank_module_name(rank: int, world_size: int) -> str:
    """Module name of one rank, zero-padded so files sort in rank order."""
    return f"rank_{rank:0{max(2, len(str(world_size - 1)))}d}"


def _tensor_row(data: dict[str, Any]) -> str:
    return python_literal((
        data["target"], data["logical_name"], data["role"], data["dtype"],
        tuple(data["global_shape"]), tuple(data["local_shape"]), data["placement"],
        data["logical_units"], tuple(data["logical_range"]) if data["logical_range"] else None,
        data["fell_back_to_replication"]))


def _render_rank(plan: Plan, plan_json: dict[str, Any], rank: RankPlan, header: _Header) -> str:
    rank_json = plan_json["ranks"][rank.rank]
    view = {
        "rank": rank.rank, "tp_rank": rank.tensor_parallel_rank, "stage": rank.pipeline_stage,
        "tp": plan.topology.tensor_parallel_size, "pp": plan.topology.pipeline_parallel_size,
        "family": _docstring_safe(plan.family),
        "plan_hash_literal": python_literal(plan_json["plan_hash"]),
        "family_literal": python_literal(plan.family),
        "model_type_literal": python_literal(plan.model_type),
        "fingerprint_literal": python_literal(plan.checkpoint_fingerprint),
        "tensor_rows": [_tensor_row(layout_json(t)) for t in rank.layout.tensors],
        "partition_literal": python_literal({**rank_json["partition"],
                                             "parameter_targets": list(
                                                 rank.partition.parameter_targets),
                                             "graph": plan_json["graph"]}),
        "info_literal": python_literal(rank_json["info"]),
        "boundary_literal": python_literal(plan.boundary),
        "activation_dtype_literal": python_literal(plan.topology.activation_dtype.value),
    }
    return _environment().get_template("rank_module.py.jinja2").render(header=header, rank=view)


def _docstring_safe(text: str) -> str:
    """Text safe inside a generated docstring: printable ASCII without quotes or backslashes."""
    return "".join(c if c.isalnum() or c in "-_.+ " else "?" for c in text)


_ALLOWED_TOP_LEVEL = (ast.Expr, ast.ImportFrom, ast.Import, ast.Assign, ast.FunctionDef)


def check_generated(source: str, name: str) -> None:
    """Compile a rendered module and check it holds only the statement kinds partc emits."""
    try:
        tree = ast.parse(source, filename=name)
        compile(tree, name, "exec")
    except SyntaxError as exc:
        raise EmitError(f"generated module {name} does not compile: {exc.msg} (line "
                        f"{exc.lineno})") from None
    for node in tree.body:
        if not isinstance(node, _ALLOWED_TOP_LEVEL):
            raise EmitError(f"generated module {name} has an unexpected "
                            f"{type(node).__name__} statement at line {node.lineno}")
        if isinstance(node, ast.Expr) and not (isinstance(node.value, ast.Constant)
                                               and isinstance(node.value.value, str)):
            raise EmitError(f"generated module {name} has an expression statement at line "
                            f"{node.lineno}")
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
            if any(m not in ("__future__", "partc", "importlib") for m in modules):
                raise EmitError(f"generated module {name} imports {modules} at line "
                                f"{node.lineno}")
        if isinstance(node, ast.Assign):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Call):
                    callee = ast.unparse(sub.func)
                    if callee != "_runtime.RankTable":
                        raise EmitError(f"generated module {name} calls {callee} at import time "
                                        f"(line {node.lineno})")


def render_package(plan: Plan) -> dict[str, str]:
    """Every file of the generated build, by relative path: plan.json and the loader package."""
    plan_json = plan.to_json()
    sources = ", ".join(f"{n} (sha256 {h[:16]})" for n, h in plan.sources) or "(no sources)"
    header = _Header(version=__version__, sources=sources.replace("\n", " "),
                     plan_hash=plan_json["plan_hash"])
    package = package_name(plan)
    world = plan.topology.world_size
    files = {"plan.json": canonical_json(plan_json)}
    modules = []
    for rank in plan.ranks:
        module = rank_module_name(rank.rank, world)
        modules.append(module)
        files[f"{package}/{module}.py"] = _render_rank(plan, plan_json, rank, header)
    view = {"family": _docstring_safe(plan.family), "tp": plan.topology.tensor_parallel_size,
            "pp": plan.topology.pipeline_parallel_size, "world_size": world,
            "plan_hash_literal": python_literal(plan_json["plan_hash"]),
            "rank_modules": [python_literal(m) for m in modules]}
    files[f"{package}/__init__.py"] = _environment().get_template(
        "package_init.py.jinja2").render(header=header, package=view)
    for path, text in files.items():
        if path.endswith(".py"):
            check_generated(text, path)
    return files


# ---------------------------------------------------------------- atomic write


@cache
def _renameat2() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    function = _renameat2()
    if function is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = function(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return bool(result == 0)


def write_atomically(out: Path, files: dict[str, str]) -> None:
    """Write `files` into a fresh folder, then replace `out` with it in one step.

    A crash at any point leaves either the previous `out` or the new one, never a mixture.
    """
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partc-", dir=parent))
    except OSError as exc:
        raise EmitError(f"cannot create the output folder {out}: {exc.strerror or exc}") from None
    try:
        for relative, text in sorted(files.items()):
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(staging, 0o755)
        if out.exists() and not out.is_dir():
            raise EmitError(f"output path {out} exists and is not a folder")
        if out.exists():
            if not _exchange(staging, out):
                backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
                backup.rmdir()
                os.rename(out, backup)
                os.rename(staging, out)
                staging = backup
            shutil.rmtree(staging, ignore_errors=True)
        else:
            os.rename(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise EmitError(f"cannot write the build to {out}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
