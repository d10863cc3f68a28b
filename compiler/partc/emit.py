"""Stage 6: render a plan into a generated loader package (`partc.output` writes it).

Templates only arrange precomputed strings; every value from a family, a config or a
checkpoint reaches the generated code through `python_literal` (an escaped Python literal) or
`lines_literal` (a quote- and backslash-free text block, else escaped strings). Rendered modules
are parsed and their statement kinds checked before anything is written.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import jinja2

from partc import __version__
from partc.errors import EmitError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from partc.plan import GroupKind, Plan, RankPlan


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


_PLAIN_TEXT = re.compile(r"[ !#-\[\]-~\n]*")
"""Printable ASCII and line breaks, without quotes or backslashes: safe in a triple-quoted
literal exactly as written."""


def lines_literal(lines: Sequence[str]) -> str:
    """A literal holding `lines` for a GROUPS or TARGETS table.

    Readable triple-quoted text, one line per item, when every item is plain printable ASCII
    without quotes, backslashes or line breaks (real checkpoints); otherwise a tuple of escaped
    strings. `partc.runtime` reads both.
    """
    text = "".join(line + "\n" for line in lines)
    if _PLAIN_TEXT.fullmatch(text) and text.count("\n") == len(lines):
        return '"""\\\n' + text + '"""'
    return python_literal(tuple(lines))


@dataclass(frozen=True, slots=True)
class _StageTables:
    """The parts of a rank module every rank of one pipeline stage shares."""

    kinds: tuple[int, ...]
    """Plan kind index of each local KINDS row."""
    owner_rows: list[str]
    """OWNERS rows."""
    groups_text: str
    """GROUPS literal."""
    targets_text: str
    """TARGETS literal."""
    targets: tuple[str, ...]
    """The targets, in TARGETS order."""


def _stage_tables(rank: RankPlan) -> _StageTables:
    kinds: dict[int, int] = {}
    owners: dict[str, int] = {}
    group_lines: list[str] = []
    targets: list[str] = []
    for group in rank.groups:
        kind = kinds.setdefault(group.kind, len(kinds))
        owner_row = python_literal(group.owner.to_json())
        owner = owners.setdefault(owner_row, len(owners))
        group_lines.append(f"{kind} {owner} {group.name}")
        targets.extend(group.targets)
    return _StageTables(kinds=tuple(kinds), owner_rows=list(owners),
                        groups_text=lines_literal(group_lines),
                        targets_text=lines_literal(targets), targets=tuple(targets))


def _kind_row(kind: GroupKind, tp_rank: int) -> str:
    """A KINDS row: the kind's realization on one tensor-parallel rank."""
    layouts = kind.layouts[tp_rank]
    first = layouts[0]
    return python_literal((
        first.role.value, first.logical_units, first.logical_range,
        first.fell_back_to_replication,
        tuple((x.dtype, x.global_shape, x.placement.to_compact(), x.kv_replicas)
              for x in layouts)))


def _render_rank(plan: Plan, plan_json: dict[str, Any], rank: RankPlan, header: _Header,
                 tables: _StageTables, path: str) -> str:
    rank_json = plan_json["ranks"][rank.rank]
    digests = None
    if plan.payload_digests is not None:  # only with --digests: otherwise no DIGESTS table
        table = dict(plan.payload_digests[rank.rank])
        digests = lines_literal([table[target] for target in tables.targets])
    view = {
        "rank": rank.rank, "tp_rank": rank.tensor_parallel_rank, "stage": rank.pipeline_stage,
        "tp": plan.topology.tensor_parallel_size, "pp": plan.topology.pipeline_parallel_size,
        "family": _docstring_safe(plan.family),
        "plan_hash_literal": python_literal(plan_json["plan_hash"]),
        "family_literal": python_literal(plan.family),
        "model_type_literal": python_literal(plan.model_type),
        "fingerprint_literal": python_literal(plan.checkpoint_fingerprint),
        "header_digest_literal": python_literal(plan.checkpoint_header_digest),
        "kind_rows": [_kind_row(plan.kinds[k], rank.tensor_parallel_rank) for k in tables.kinds],
        "owner_rows": tables.owner_rows,
        "groups_text": tables.groups_text,
        "targets_text": tables.targets_text,
        "digests_text": digests,
        "partition_literal": python_literal({**rank_json["partition"],
                                             "graph": plan_json["graph"]}),
        "state_range_literal": python_literal(rank.partition.state.global_range),
        "info_literal": python_literal(rank_json["info"]),
        "boundary_literal": python_literal(plan.boundary),
        "activation_dtype_literal": python_literal(plan.topology.activation_dtype.value),
    }
    template = _environment().get_template("rank_module.py.jinja2")
    # The module is checked with its two line tables left empty: they are `lines_literal`
    # output (a quote- and backslash-free text block or python_literal), which cannot end
    # early, and at ~10^4 names they would dominate the parse.
    check_generated(template.render(header=header, rank={
        **view, "groups_text": lines_literal(()), "targets_text": lines_literal(()),
        "digests_text": None if digests is None else lines_literal(())}),
        path)
    return template.render(header=header, rank=view)


def _comment_safe(text: str) -> str:
    """Text safe inside a generated `#` comment: printable ASCII only (no line breaks of any
    kind, so a file name cannot end the comment and start code)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def _docstring_safe(text: str) -> str:
    """Text safe inside a generated docstring: printable ASCII without quotes or backslashes."""
    return "".join(c if c.isalnum() or c in "-_.+ " else "?" for c in text)


_ALLOWED_IMPORTS = {
    "from __future__ import annotations",
    "from partc import runtime as _runtime",
}
_TABLE_CALL = "_runtime.RankTable"


class _GeneratedCodeChecker:
    """Walks a rendered module and refuses anything but the shapes partc's templates emit.

    Allowed: a docstring; `from __future__ import annotations` and `from partc import runtime
    as _runtime`; `NAME = <literal>` (constants, tuples, lists, dicts, negative numbers) or
    `NAME = _runtime.RankTable(field=NAME, ...)`; and functions whose body is a docstring and
    `return _runtime.<function>(...)` with plain names and literals as arguments. Every name
    read must be a parameter, an earlier module constant, `_runtime` or `__name__`. So a string
    from a family, config or checkpoint can only ever appear as a literal.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.constants: set[str] = set()

    def fail(self, node: ast.AST, what: str) -> EmitError:
        line = getattr(node, "lineno", 0)
        return EmitError(f"generated module {self.name} has {what} at line {line}")

    def module(self, tree: ast.Module) -> None:
        for index, node in enumerate(tree.body):
            if isinstance(node, ast.Expr):
                if index != 0 or not _is_docstring(node):
                    raise self.fail(node, "an expression statement")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                if ast.unparse(node) not in _ALLOWED_IMPORTS:
                    raise self.fail(node, f"an unexpected import `{ast.unparse(node)}`")
            elif isinstance(node, ast.Assign):
                self.assignment(node)
            elif isinstance(node, ast.FunctionDef):
                self.function(node)
            else:
                raise self.fail(node, f"an unexpected {type(node).__name__} statement")

    def assignment(self, node: ast.Assign) -> None:
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            raise self.fail(node, "an assignment to something other than one name")
        value = node.value
        if isinstance(value, ast.Call):
            if ast.unparse(value.func) != _TABLE_CALL or value.args:
                raise self.fail(node, f"an import-time call of `{ast.unparse(value.func)}`")
            for keyword in value.keywords:
                if keyword.arg is None or not self.is_name(keyword.value, self.constants):
                    raise self.fail(node, f"an unexpected argument to {_TABLE_CALL}")
        elif not _is_literal(value):
            raise self.fail(node, f"a non-literal value for `{node.targets[0].id}`")
        self.constants.add(node.targets[0].id)

    def function(self, node: ast.FunctionDef) -> None:
        arguments = node.args
        if node.decorator_list or node.returns is not None or arguments.vararg \
                or arguments.posonlyargs or arguments.kwonlyargs:
            raise self.fail(node, f"an unexpected signature for `{node.name}`")
        if not all(_is_literal(default) for default in arguments.defaults):
            raise self.fail(node, f"a non-literal default in `{node.name}`")
        params = {a.arg for a in arguments.args if a.annotation is None}
        if len(params) != len(arguments.args):
            raise self.fail(node, f"an annotated parameter in `{node.name}`")
        if arguments.kwarg is not None:
            params.add(arguments.kwarg.arg)
        body = node.body[1:] if node.body and _is_docstring(node.body[0]) else node.body
        if len(body) != 1 or not isinstance(body[0], ast.Return):
            raise self.fail(node, f"a body other than `return _runtime.<function>(...)` in "
                            f"`{node.name}`")
        call = body[0].value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "_runtime"):
            raise self.fail(body[0], f"a return of something other than a `_runtime` call in "
                            f"`{node.name}`")
        names = params | self.constants | {"__name__"}
        for arg in call.args:
            if not (self.is_name(arg, names) or _is_literal(arg)):
                raise self.fail(arg, f"an unexpected argument in `{node.name}`")
        for keyword in call.keywords:
            if keyword.arg is None and not (arguments.kwarg is not None and isinstance(
                    keyword.value, ast.Name) and keyword.value.id == arguments.kwarg.arg):
                raise self.fail(keyword, f"an unexpected `**` argument in `{node.name}`")
            if not (self.is_name(keyword.value, names) or _is_literal(keyword.value)):
                raise self.fail(keyword, f"an unexpected argument in `{node.name}`")

    @staticmethod
    def is_name(node: ast.AST, names: set[str]) -> bool:
        return isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _is_literal(node: ast.AST) -> bool:
    """Whether `node` is a literal python_literal can emit (no names, calls or operators)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str | int | float | bool | type(None))
    if isinstance(node, ast.UnaryOp):
        return (isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
                and isinstance(node.operand.value, int | float)
                and not isinstance(node.operand.value, bool))
    if isinstance(node, ast.Tuple | ast.List):
        return all(_is_literal(item) for item in node.elts)
    if isinstance(node, ast.Dict):
        return all(key is not None and _is_literal(key) for key in node.keys) and all(
            _is_literal(value) for value in node.values)
    return False


def check_generated(source: str, name: str) -> None:
    """Parse a rendered module and check it holds only the statement shapes partc emits (the
    checker admits nothing a successful parse could still fail to compile)."""
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError as exc:
        raise EmitError(f"generated module {name} does not compile: {exc.msg} (line "
                        f"{exc.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise EmitError(f"generated module {name} cannot be parsed: {exc}") from None
    _GeneratedCodeChecker(name).module(tree)


def render_package(plan: Plan) -> dict[str, str]:
    """Every file of the generated build, by relative path: plan.json and the loader package."""
    plan_json, plan_text = plan.document()
    sources = ", ".join(f"{_comment_safe(n)} (sha256 {h[:16]})" for n, h in plan.sources
                        ) or "(no sources)"
    header = _Header(version=__version__, sources=sources,
                     plan_hash=plan_json["plan_hash"])
    package = package_name(plan)
    world = plan.topology.world_size
    files = {"plan.json": plan_text}
    modules = []
    stages: dict[int, _StageTables] = {}
    for rank in plan.ranks:
        module = rank_module_name(rank.rank, world)
        modules.append(module)
        tables = stages.get(rank.pipeline_stage)
        if tables is None:
            tables = stages[rank.pipeline_stage] = _stage_tables(rank)
        path = f"{package}/{module}.py"
        files[path] = _render_rank(plan, plan_json, rank, header, tables, path)
    view = {"family": _docstring_safe(plan.family), "tp": plan.topology.tensor_parallel_size,
            "pp": plan.topology.pipeline_parallel_size, "world_size": world,
            "plan_hash_literal": python_literal(plan_json["plan_hash"]),
            "rank_modules": [python_literal(m) for m in modules]}
    files[f"{package}/__init__.py"] = _environment().get_template(
        "package_init.py.jinja2").render(header=header, package=view)
    check_generated(files[f"{package}/__init__.py"], f"{package}/__init__.py")
    return files
