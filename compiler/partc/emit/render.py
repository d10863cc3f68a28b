"""Stage 6: render a plan into a generated loader package (`partc.output` writes it).

Templates only arrange precomputed strings; every value from a family, a config or a
checkpoint reaches the generated code through `partc.emit.literal` (escaped Python literals
laid out as `ruff format` lays them out, or quote- and backslash-free text blocks). Rendered
modules are parsed and their statement kinds checked before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import jinja2

from partc import __version__
from partc.emit.check import check_generated
from partc.emit.literal import (
    collection_literal,
    formatted_literal,
    laid_out_row,
    lines_literal,
)

if TYPE_CHECKING:
    from partc.parallel.layout import LocalTensorLayout
    from partc.plan.ir import Plan
    from partc.plan.ranks import GroupKind, RankPlan


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


@dataclass(frozen=True, slots=True)
class _StageTables:
    """The parts of a rank module every rank of one pipeline stage shares."""

    kinds: tuple[int, ...]
    """Plan kind index of each local KINDS row."""
    owners_text: str
    """OWNERS literal."""
    groups_text: str
    """GROUPS literal."""
    targets_text: str
    """TARGETS literal."""
    targets: tuple[str, ...]
    """The targets, in TARGETS order."""
    read_names: tuple[str, ...]
    """The targets as the READS comment table spells them: comment-safe, padded to a column."""


_READ_NAME_WIDTH = 64
"""The widest target column of a READS table (longer names push their line's read right)."""


def _stage_tables(rank: RankPlan, owner_rows: dict[object, tuple[str, str]] | None = None
                  ) -> _StageTables:
    """The tables a stage's ranks share; `owner_rows` memoizes owner rows across stages (an
    expert-parallel build renders one set per stage and EP rank)."""
    kinds: dict[int, int] = {}
    owners: dict[tuple[str, str], int] = {}
    group_lines: list[str] = []
    targets: list[str] = []
    memo: dict[object, tuple[str, str]] = {} if owner_rows is None else owner_rows
    for group in rank.groups:
        kind = kinds.setdefault(group.kind, len(kinds))
        owner_row = memo.get(group.owner)
        if owner_row is None:
            owner_row = memo[group.owner] = laid_out_row(group.owner.to_json())
        owner = owners.setdefault(owner_row, len(owners))
        group_lines.append(f"{kind} {owner} {group.name}")
        targets.extend(group.targets)
    names = [_comment_safe(target) for target in targets]
    width = min(_READ_NAME_WIDTH, max(map(len, names), default=0))
    return _StageTables(kinds=tuple(kinds), owners_text=collection_literal(tuple(owners),
                                                                            "OWNERS = "),
                        groups_text=lines_literal(group_lines, "GROUPS = "),
                        targets_text=lines_literal(targets, "TARGETS = "),
                        targets=tuple(targets),
                        read_names=tuple(name.ljust(width) for name in names))


def _kind_row(kind: GroupKind, rank: RankPlan) -> tuple[str, str]:
    """A KINDS row (`laid_out_row`): the kind's realization on one rank (its TP rank's row, or
    under expert parallelism its ETP or stage-local row)."""
    layouts = kind.layouts[kind.row(rank.tensor_parallel_rank, rank.coordinates)]
    first = layouts[0]
    return laid_out_row((
        first.role.value, first.logical_units, first.logical_range,
        first.fell_back_to_replication,
        tuple((x.dtype, x.global_shape, x.placement.to_compact(), x.kv_replicas)
              + ((True,) if x.needs_tp_reduction else ())  # a fifth field only when set
              + (("output",) if x.needs_tp_output_reduction else ())
              for x in layouts)))


_NOT_HELD = "-"
"""The DIGESTS entry of a TARGETS name the rank does not hold (a per-head tensor of another
rank's head): no sha256 matches it."""


def _member_read(layout: LocalTensorLayout) -> str:
    """What a rank reads of one checkpoint tensor, in a weight loader's terms: `narrow(axis,
    start, length)` (several joined by `cat` along that axis) or `whole`, then `->` the local
    shape and the dtype, then notes (KV replicas, a TP-reduced norm, a replication fallback)."""
    if layout.placement.kind.value == "omit":
        return "not on this rank (another rank's head)"
    axis, ranges = layout.selection
    if axis is None:
        read = "whole"
    else:
        narrows = [f"narrow({axis}, {start}, {end - start})" for start, end in ranges]
        read = narrows[0] if len(narrows) == 1 else "cat(" + ", ".join(narrows) + ")"
    shape = ", ".join(str(n) for n in layout.local_shape)
    notes = "".join((f"  kv x{layout.kv_replicas}" if layout.kv_replicas > 1 else "",
                     "  tp all-reduce" if layout.needs_tp_reduction else "",
                     "  tp all-reduce output" if layout.needs_tp_output_reduction else "",
                     "  fallback" if layout.fell_back_to_replication else ""))
    return f"{read} -> [{shape}] {layout.dtype}{notes}"


def _id_runs(ids: tuple[int, ...]) -> str:
    """Expert ids as runs: `0-3, 8, 10-11` (in the given order, consecutive ids joined)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] + 1 == i:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _reads_text(plan: Plan, rank: RankPlan, tables: _StageTables) -> str:
    """The READS comment table: one `# <target>  <read>` line per target, in TARGETS order
    (`_member_read`, plus `expert E` / `experts E-F` for routed-expert groups)."""
    experts, c = plan.expert_parallel, rank.coordinates
    expert_ids = {} if experts is None else dict(experts.expert_groups)
    local = "" if experts is None or c is None else \
        "  experts " + _id_runs(experts.placement.slots[c.expert_parallel_rank])
    reads: dict[int, tuple[str, ...]] = {}
    lines: list[str] = []
    names = iter(tables.read_names)
    for group in rank.groups:
        kind_reads = reads.get(group.kind)
        if kind_reads is None:
            kind = plan.kinds[group.kind]
            layouts = kind.layouts[kind.row(rank.tensor_parallel_rank, rank.coordinates)]
            kind_reads = reads[group.kind] = tuple(_member_read(x) for x in layouts)
        note = ""
        if group.name in expert_ids:
            expert = expert_ids[group.name]
            note = local if expert is None else f"  expert {expert}"
        lines.extend(f"# {next(names)}  {read}{note}" for read in kind_reads)
    return "\n".join(lines)


def _render_rank(plan: Plan, plan_json: dict[str, Any], rank: RankPlan, header: _Header,
                 tables: _StageTables, path: str,
                 expert_owners: tuple[str, str] | None = None) -> str:
    rank_json = plan_json["ranks"][rank.rank]
    digests = None
    if plan.payload_digests is not None:  # only with --digests: otherwise no DIGESTS table
        table = dict(plan.payload_digests[rank.rank])
        digests = lines_literal([table.get(target, _NOT_HELD) for target in tables.targets],
                                "DIGESTS = ")
    stage = rank.pipeline_stage
    view = {
        "rank": rank.rank, "tp_rank": rank.tensor_parallel_rank, "stage": stage,
        "tp": plan.topology.tensor_parallel_size, "pp": plan.topology.pipeline_parallel_size,
        "family": _docstring_safe(plan.family),
        "plan_hash_literal": formatted_literal(plan_json["plan_hash"], "PLAN_HASH = "),
        "family_literal": formatted_literal(plan.family, "FAMILY = "),
        "model_type_literal": formatted_literal(plan.model_type, "MODEL_TYPE = "),
        "fingerprint_literal": formatted_literal(plan.checkpoint_fingerprint,
                                                 "CHECKPOINT_FINGERPRINT = "),
        "header_digest_literal": formatted_literal(plan.checkpoint_header_digest,
                                                   "CHECKPOINT_HEADER_DIGEST = "),
        "plan_tensors_literal": formatted_literal(plan.tensor_names_check, "PLAN_TENSORS = "),
        "chunk_mismatches_literal": formatted_literal(plan.chunk_mismatches(stage),
                                                      "CHUNK_MISMATCHES = "),
        "reads_text": _reads_text(plan, rank, tables),
        "output_reduction": any(x.needs_tp_output_reduction for k in tables.kinds
                                for x in plan.kinds[k].layouts[plan.kinds[k].row(
                                    rank.tensor_parallel_rank, rank.coordinates)]),
        "kinds_literal": collection_literal(
            [_kind_row(plan.kinds[k], rank) for k in tables.kinds], "KINDS = "),
        "owners_text": tables.owners_text,
        "groups_text": tables.groups_text,
        "targets_text": tables.targets_text,
        "digests_text": digests,
        "partition_literal": formatted_literal({**rank_json["partition"],
                                                "graph": plan_json["graph"]}, "PARTITION = "),
        "state_range_literal": formatted_literal(rank.partition.state.global_range,
                                                 "STATE_RANGE = "),
        "info_literal": formatted_literal(rank_json["info"], "INFO = "),
        "boundary_literal": formatted_literal(plan_json["boundary"], "BOUNDARY = "),
        "activation_dtype_literal": formatted_literal(plan_json["topology"]["activation_dtype"],
                                                      "ACTIVATION_DTYPE = "),
        "cuts": bool(plan.cuts),
        "receive_boundary_literal": formatted_literal(_cut_schema(plan_json, stage - 1),
                                                      "RECEIVE_BOUNDARY = "),
        "send_boundary_literal": formatted_literal(_cut_schema(plan_json, stage),
                                                   "SEND_BOUNDARY = "),
        "experts": _expert_view(plan, rank, expert_owners),
    }
    template = _environment().get_template("rank_module.py.jinja2")
    # The module is checked with its line tables and READS left empty: they are
    # `lines_literal` output (a quote- and backslash-free text block or escaped strings), which
    # cannot end early, and comments of comment-safe names; at ~10^4 names they would dominate
    # the parse.
    check_generated(template.render(header=header, rank={
        **view, "groups_text": lines_literal(()), "targets_text": lines_literal(()),
        "digests_text": None if digests is None else lines_literal(()), "reads_text": "#",
        "experts": _expert_view(plan, rank, None)}),
        path)
    return template.render(header=header, rank=view)


def _cut_schema(plan_json: dict[str, Any], stage: int) -> Any:
    """The JSON schema of the cut after `stage` (None when there is no such cut)."""
    for cut in plan_json.get("cuts", ()):
        if cut["after_stage"] == stage:
            return cut["boundary"]
    return None


def _expert_owners(plan: Plan) -> tuple[str, str] | None:
    """The EXPERTS `owners` entry (`laid_out_row`) of every global expert's (EP rank, local
    slot) holders (None without expert parallelism): the same on every rank, so spelled once."""
    experts = plan.expert_parallel
    return None if experts is None else laid_out_row(experts.placement.owners(), "owners")


def _expert_view(plan: Plan, rank: RankPlan, owners: tuple[str, str] | None
                 ) -> dict[str, Any] | None:
    """The EXPERTS table of a rank under expert parallelism (None without it): sizes, this
    rank's coordinates, each global expert's (EP rank, local slot) holders (`owners`, the
    entry `_expert_owners` spells; None: an empty stand-in, for the check) and this rank's local
    slot -> global expert id."""
    experts, c = plan.expert_parallel, rank.coordinates
    if experts is None or c is None:
        return None
    placement = experts.placement
    table = {
        "expert_parallel_size": experts.expert_parallel_size,
        "expert_tensor_parallel_size": experts.expert_tensor_parallel_size,
        "ranks_per_stage": experts.ranks_per_stage,
        "local_rank": c.stage_rank, "dense_replica": c.dense_replica,
        "expert_parallel_rank": c.expert_parallel_rank,
        "expert_tensor_parallel_rank": c.expert_tensor_parallel_rank,
        "local_experts": placement.slots[c.expert_parallel_rank]}
    rows = [laid_out_row(value, key) for key, value in table.items()]
    rows.append(laid_out_row((), "owners") if owners is None else owners)
    rows.sort(key=lambda row: row[0].split(":", 1)[0])  # by key, as python_literal sorts
    return {"literal": collection_literal(rows, "EXPERTS = ", "{}"),
            "ep": experts.expert_parallel_size,
            "etp": experts.expert_tensor_parallel_size, "ep_rank": c.expert_parallel_rank,
            "local": len(placement.slots[c.expert_parallel_rank])}


def _comment_safe(text: str) -> str:
    """Text safe inside a generated `#` comment: printable ASCII only (no line breaks of any
    kind, so a file name cannot end the comment and start code), every other character written
    as Python writes it in a string literal (`\\xe9`, `\\r`, `\\u2028`), so the name is
    still legible and tells two names apart; a backslash is doubled."""
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text  # printable ASCII: as is (checked first: ~10^5 names a large build)
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
    owner_rows: dict[object, tuple[str, str]] = {}
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
            "plan_hash_literal": formatted_literal(plan_json["plan_hash"], "PLAN_HASH = "),
            "rank_modules_literal": formatted_literal(tuple(modules), "RANK_MODULES = ")}
    files[f"{package}/__init__.py"] = _environment().get_template(
        "package_init.py.jinja2").render(header=header, package=view)
    check_generated(files[f"{package}/__init__.py"], f"{package}/__init__.py")
    return files
