"""Stage 6: render a plan into a generated loader package (`partc.output` writes it).

Templates only arrange precomputed strings; every value from a family, a config or a
checkpoint reaches the generated code through `python_literal` (an escaped Python literal) or
`lines_literal` (a quote- and backslash-free text block, else escaped strings). Rendered modules
are parsed and their statement kinds checked before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import jinja2

from partc import __version__
from partc.emit.check import check_generated
from partc.errors import EmitError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from partc.plan.ir import Plan
    from partc.plan.ranks import GroupKind, RankPlan


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
        loader=jinja2.PackageLoader("partc.emit", "templates"),
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
    return (f"partc_{family}_tp{topology.tensor_parallel_size}_pp"
            f"{topology.pipeline_parallel_size}" + _expert_suffix(plan))


def _expert_suffix(plan: Plan) -> str:
    """`_ep{E}` (and `_etp{X}` when X > 1) under expert parallelism, else ''."""
    experts = plan.expert_parallel
    if experts is None:
        return ""
    etp = experts.expert_tensor_parallel_size
    return f"_ep{experts.expert_parallel_size}" + (f"_etp{etp}" if etp > 1 else "")


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
    owner_rows: tuple[str, ...]
    """OWNERS rows."""
    groups_text: str
    """GROUPS literal."""
    targets_text: str
    """TARGETS literal."""
    targets: tuple[str, ...]
    """The targets, in TARGETS order."""


def _stage_tables(rank: RankPlan, owner_rows: dict[object, str] | None = None) -> _StageTables:
    """The tables a stage's ranks share; `owner_rows` memoizes owner literals across stages
    (an expert-parallel build renders one set per stage and EP rank)."""
    kinds: dict[int, int] = {}
    owners: dict[str, int] = {}
    group_lines: list[str] = []
    targets: list[str] = []
    memo: dict[object, str] = {} if owner_rows is None else owner_rows
    for group in rank.groups:
        kind = kinds.setdefault(group.kind, len(kinds))
        owner_row = memo.get(group.owner)
        if owner_row is None:
            owner_row = memo[group.owner] = python_literal(group.owner.to_json())
        owner = owners.setdefault(owner_row, len(owners))
        group_lines.append(f"{kind} {owner} {group.name}")
        targets.extend(group.targets)
    return _StageTables(kinds=tuple(kinds), owner_rows=tuple(owners),
                        groups_text=lines_literal(group_lines),
                        targets_text=lines_literal(targets), targets=tuple(targets))


def _kind_row(kind: GroupKind, rank: RankPlan) -> str:
    """A KINDS row: the kind's realization on one rank (its TP rank's row, or under expert
    parallelism its ETP or stage-local row)."""
    layouts = kind.layouts[kind.row(rank.tensor_parallel_rank, rank.coordinates)]
    first = layouts[0]
    return python_literal((
        first.role.value, first.logical_units, first.logical_range,
        first.fell_back_to_replication,
        tuple((x.dtype, x.global_shape, x.placement.to_compact(), x.kv_replicas)
              + ((True,) if x.needs_tp_reduction else ())  # a fifth field only when set
              for x in layouts)))


def _render_rank(plan: Plan, plan_json: dict[str, Any], rank: RankPlan, header: _Header,
                 tables: _StageTables, path: str, expert_owners: str = "") -> str:
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
        "plan_tensors_literal": python_literal(plan.tensor_names_check),
        "chunk_mismatches_literal": python_literal(plan.chunk_mismatches(rank.pipeline_stage)),
        "kind_rows": [_kind_row(plan.kinds[k], rank) for k in tables.kinds],
        "owner_rows": tables.owner_rows,
        "groups_text": tables.groups_text,
        "targets_text": tables.targets_text,
        "digests_text": digests,
        "partition_literal": python_literal({**rank_json["partition"],
                                             "graph": plan_json["graph"]}),
        "state_range_literal": python_literal(rank.partition.state.global_range),
        "info_literal": python_literal(rank_json["info"]),
        "boundary_literal": python_literal(plan_json["boundary"]),
        "activation_dtype_literal": python_literal(plan_json["topology"]["activation_dtype"]),
        "cuts": bool(plan.cuts),
        "receive_boundary_literal": python_literal(_cut_schema(plan_json, rank.pipeline_stage - 1)),
        "send_boundary_literal": python_literal(_cut_schema(plan_json, rank.pipeline_stage)),
        "experts": _expert_view(plan, rank, expert_owners),
    }
    template = _environment().get_template("rank_module.py.jinja2")
    # The module is checked with its two line tables left empty: they are `lines_literal`
    # output (a quote- and backslash-free text block or python_literal), which cannot end
    # early, and at ~10^4 names they would dominate the parse.
    check_generated(template.render(header=header, rank={
        **view, "groups_text": lines_literal(()), "targets_text": lines_literal(()),
        "digests_text": None if digests is None else lines_literal(()),
        "experts": _expert_view(plan, rank, "()")}),
        path)
    return template.render(header=header, rank=view)


def _cut_schema(plan_json: dict[str, Any], stage: int) -> Any:
    """The JSON schema of the cut after `stage` (None when there is no such cut)."""
    for cut in plan_json.get("cuts", ()):
        if cut["after_stage"] == stage:
            return cut["boundary"]
    return None


def _expert_owners(plan: Plan) -> str:
    """The literal of every global expert's (EP rank, local slot) holders ('' without expert
    parallelism): the same on every rank, so spelled once."""
    experts = plan.expert_parallel
    return "" if experts is None else python_literal(experts.placement.owners())


def _expert_view(plan: Plan, rank: RankPlan, owners: str) -> dict[str, Any] | None:
    """The EXPERTS table of a rank under expert parallelism (None without it): sizes, this
    rank's coordinates, each global expert's (EP rank, local slot) holders (`owners`, the
    literal `_expert_owners` spells) and this rank's local slot -> global expert id."""
    experts, c = plan.expert_parallel, rank.coordinates
    if experts is None or c is None:
        return None
    placement = experts.placement
    table = {
        "expert_parallel_size": experts.expert_parallel_size,
        "expert_tensor_parallel_size": experts.expert_tensor_parallel_size,
        "ranks_per_stage": experts.ranks_per_stage,
        "local_rank": c.local_rank, "dense_replica": c.dense_replica,
        "expert_parallel_rank": c.expert_parallel_rank,
        "expert_tensor_parallel_rank": c.expert_tensor_parallel_rank,
        "owners": _OWNERS,
        "local_experts": placement.slots[c.expert_parallel_rank]}
    literal = python_literal(table).replace(python_literal(_OWNERS), owners, 1)
    return {"literal": literal, "ep": experts.expert_parallel_size,
            "etp": experts.expert_tensor_parallel_size, "ep_rank": c.expert_parallel_rank,
            "local": len(placement.slots[c.expert_parallel_rank])}


_OWNERS = "\x00owners"
"""A stand-in for the owners literal inside a rank's EXPERTS table (its escaped spelling cannot
occur in any other value of the table, which holds only integers)."""


def _comment_safe(text: str) -> str:
    """Text safe inside a generated `#` comment: printable ASCII only (no line breaks of any
    kind, so a file name cannot end the comment and start code), every other character written
    as Python writes it in a string literal (`\\xe9`, `\\r`, `\\u2028`), so the name is
    still legible and tells two names apart; a backslash is doubled."""
    return "".join(c if " " <= c <= "~" and c != "\\" else ascii(c)[1:-1] for c in text)


def _docstring_safe(text: str) -> str:
    """Text safe inside a generated docstring: printable ASCII without quotes or backslashes."""
    return "".join(c if c.isalnum() or c in "-_.+ " else "?" for c in text)


def render_package(plan: Plan, *, progress: Callable[[int, int], None] | None = None
                   ) -> dict[str, str]:
    """Every file of the generated build, by relative path: plan.json and the loader package.

    `progress(done, total)` is called as the rank modules are rendered.
    """
    plan_json, plan_text = plan.document
    sources = ", ".join(f"{_comment_safe(n)} (sha256 {h[:16]})" for n, h in plan.sources
                        ) or "(no sources)"
    header = _Header(version=__version__, sources=sources,
                     plan_hash=plan_json["plan_hash"])
    package = package_name(plan)
    world = plan.topology.world_size
    files = {"plan.json": plan_text}
    modules = []
    stages: dict[tuple[int, int], _StageTables] = {}  # by (stage, EP rank): same groups
    owner_rows: dict[object, str] = {}
    expert_owners = _expert_owners(plan)
    for done, rank in enumerate(plan.ranks):
        if progress is not None:
            progress(done, world)
        module = rank_module_name(rank.rank, world)
        modules.append(module)
        key = (rank.pipeline_stage, 0 if rank.coordinates is None
               else rank.coordinates.expert_parallel_rank)
        tables = stages.get(key)
        if tables is None:
            tables = stages[key] = _stage_tables(rank, owner_rows)
        path = f"{package}/{module}.py"
        files[path] = _render_rank(plan, plan_json, rank, header, tables, path, expert_owners)
    if progress is not None:
        progress(world, world)
    view = {"family": _docstring_safe(plan.family), "tp": plan.topology.tensor_parallel_size,
            "pp": plan.topology.pipeline_parallel_size, "world_size": world,
            "ep": None if plan.expert_parallel is None
            else plan.expert_parallel.expert_parallel_size,
            "etp": None if plan.expert_parallel is None
            else plan.expert_parallel.expert_tensor_parallel_size,
            "plan_hash_literal": python_literal(plan_json["plan_hash"]),
            "rank_modules": [python_literal(m) for m in modules]}
    files[f"{package}/__init__.py"] = _environment().get_template(
        "package_init.py.jinja2").render(header=header, package=view)
    check_generated(files[f"{package}/__init__.py"], f"{package}/__init__.py")
    return files
