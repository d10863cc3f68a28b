"""A rank module's literal tables, decoded into layouts, accounting and boundaries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate, chain, repeat
from operator import add, itemgetter
from typing import TYPE_CHECKING, Any

from partc.errors import CheckpointError, LayoutError
from partc.parallel.placements import (
    DTYPE_BITS,
    Selection,
    local_shape,
    placement_from_compact,
    tensor_bytes,
)
from partc.runtime.headers import paused_gc

if TYPE_CHECKING:  # imported where used: a plain load needs none of them (import cost)
    from partc.parallel.experts import ExpertMap
    from partc.parallel.layout import LocalModelLayout, ParallelModelInfo
    from partc.partition.boundary import BoundaryWireSchema, PipelineWireContract
    from partc.partition.pipeline import ArchitecturePartition, PartitionState
    from partc.runtime.boundary_codec import ArchitectureBoundary
    from partc.runtime.driver import LayeredPartitionDriver


@dataclass(frozen=True, kw_only=True)
class RankTable:
    """The literal tables of one generated rank module.

    Not slotted: the joined rows are a `functools.cached_property`, derived from the columnar
    tables on first use and then kept; the fields never change and equality sees only them.
    """

    plan_hash: str
    """Hash of the plan the module was generated from."""
    model_type: str
    """HF model type."""
    rank: int
    """Global rank."""
    tensor_parallel_rank: int
    """Rank within the stage."""
    pipeline_stage: int
    """Stage."""
    tensor_parallel_size: int
    """T."""
    pipeline_parallel_size: int
    """S."""
    checkpoint_fingerprint: str | None
    """Expected header fingerprint, when the plan was compiled against a checkpoint."""
    checkpoint_header_digest: str | None
    """sha256 of that checkpoint's stored header bytes (equal: fingerprint not recomputed)."""
    kinds: tuple[tuple[Any, ...], ...]
    """KINDS rows: role, logical units, logical range, fell back, members (dtype, global shape,
    compact placement, KV replicas)."""
    owners: tuple[Mapping[str, Any], ...]
    """OWNERS rows: JSON form of each group owner."""
    groups: str | tuple[str, ...]
    """GROUPS: one line per group, `<kind> <owner> <logical name>` (text, or a tuple of lines
    when a name is not plain ASCII)."""
    targets: str | tuple[str, ...]
    """TARGETS: one checkpoint name per line, group by group (text or a tuple, as GROUPS)."""
    partition: Mapping[str, Any]
    """The stage's partition (JSON form)."""
    info: Mapping[str, Any]
    """Byte accounting (JSON form)."""
    boundary: Mapping[str, Any]
    """Boundary wire schema (JSON form)."""
    activation_dtype: str
    """Pipeline activation dtype."""
    digests: str | tuple[str, ...] | None = None
    """DIGESTS: sha256 of each target's rank-local bytes, in TARGETS order, one per line (only
    in a build compiled with `--digests`)."""
    receive_boundary: Mapping[str, Any] | None = None
    """RECEIVE_BOUNDARY: the wire schema of the cut the stage receives at (JSON form; only in
    a build whose family declares boundaries per execution group; None on the first stage)."""
    send_boundary: Mapping[str, Any] | None = None
    """SEND_BOUNDARY: the wire schema of the cut the stage sends at (as RECEIVE_BOUNDARY; None
    on the last stage)."""
    plan_tensors: tuple[Any, ...] | None = None
    """PLAN_TENSORS: (the plan's tensor count, the sha256 of its sorted targets, the
    family's `omit` globs); None in a module generated before it was written."""
    chunk_mismatches: tuple[Any, ...] | None = None
    """CHUNK_MISMATCHES: the stage's tensors some TP rank holds otherwise than torch.chunk
    would, (target, TP rank, partc's range, torch.chunk's); None in an older module."""
    experts: Mapping[str, Any] | None = None
    """EXPERTS: the expert-parallel sizes, this rank's coordinates, each global expert's
    (EP rank, local slot) holders and this rank's local experts (only in an expert-parallel
    build)."""

    def group_rows(self) -> list[GroupRow]:
        """One row per group in binding order: (logical name, role, owner, logical units,
        logical range, fell back)."""
        return self._decoded[0]

    def tensor_rows(self) -> list[TensorRow]:
        """One row per tensor the rank holds, group by group: (target, group index, dtype,
        global shape, compact placement, KV replicas); a TARGETS entry placed `omit` here (a
        per-head tensor of another rank's head) has none."""
        return self._decoded[1]

    def output_reduced_rows(self) -> frozenset[int]:
        """Indices (into `tensor_rows()`) of the row projections whose output the TP group
        all-reduces inside their module (a KINDS member with a fifth field `"output"`)."""
        return self._decoded[3]

    def reduced_rows(self) -> frozenset[int]:
        """Indices (into `tensor_rows()`) of the tensors that need a tensor-parallel reduction
        (a KINDS member with a fifth field `True`: a norm spanning a split projection)."""
        return self._decoded[2]

    def stage_tensor_rows(self) -> list[TensorRow]:
        """`tensor_rows()` with the TARGETS this rank does not hold: one row per tensor of the
        stage's groups (what the stage's parameter bindings list)."""
        return self._joined_rows[1]

    @cached_property
    def _joined_rows(self) -> tuple[list[GroupRow], list[TensorRow], frozenset[int],
                                    frozenset[int]]:
        """The columnar tables joined into rows (on first use; a rank has up to ~10^4
        tensors), the tensors placed `omit` here included."""
        with paused_gc():
            return _join_tables(self)

    @cached_property
    def _decoded(self) -> tuple[list[GroupRow], list[TensorRow], frozenset[int],
                                frozenset[int]]:
        """`_joined_rows` without the tensors this rank does not hold."""
        return _held(self, self._joined_rows)

    def omitted_targets(self) -> tuple[str, ...]:
        """The TARGETS this rank does not hold although its stage loads them (per-head
        tensors of the heads other ranks hold, placed `omit` here), in TARGETS order."""
        return self._omitted

    @cached_property
    def _omitted(self) -> tuple[str, ...]:
        rows, everything = self.tensor_rows(), self.stage_tensor_rows()
        if len(rows) == len(everything):
            return ()
        held = {row[0] for row in rows}
        return tuple(row[0] for row in everything if row[0] not in held)


GroupRow = tuple[str, str, Mapping[str, Any], "int | None", "tuple[int, int] | None", bool]
"""(logical name, role, owner JSON, logical units, logical range, fell back to replication)."""


TensorRow = tuple[str, int, str, tuple[int, ...], tuple[Any, ...], int]
"""(target, index of its group, dtype, global shape, compact placement, KV replicas)."""


def table_lines(value: str | tuple[str, ...]) -> list[str]:
    """The items of a GROUPS or TARGETS table: lines of a text, or a tuple's strings."""
    if isinstance(value, str):
        return value.split("\n")[:-1]
    return list(value)


def _kind_row(table: RankTable, kind_text: str) -> tuple[Any, ...]:
    """The KINDS row a GROUPS line names by its index text, with tuple shapes: (role, units,
    logical range, fell back, members (dtype, shape, placement, KV replicas), the indices of
    the members needing a TP reduction, the indices of those whose output is TP-reduced inside
    their module); ValueError, IndexError or TypeError if malformed."""
    role, units, logical, fell_back, members = table.kinds[int(kind_text)]
    return (role, units, None if logical is None else tuple(logical), fell_back,
            [(dtype, tuple(shape), placement, kv_replicas)
             for dtype, shape, placement, kv_replicas, *_ in members],
            [i for i, member in enumerate(members) if member[4:] == (True,)],
            [i for i, member in enumerate(members) if member[4:] == ("output",)])


def _join_tables(table: RankTable
                 ) -> tuple[list[GroupRow], list[TensorRow], frozenset[int], frozenset[int]]:
    """Rows from KINDS, OWNERS, GROUPS and TARGETS, and the rows needing a TP reduction;
    CheckpointError if they do not fit."""
    targets, lines = table_lines(table.targets), table_lines(table.groups)
    joined = _joined(table, targets, lines)
    if joined is not None:
        return joined
    groups: list[GroupRow] = []  # the tables do not fit: find the first line that does not
    tensors: list[TensorRow] = []
    reduced: set[int] = set()
    outputs: set[int] = set()
    kinds: dict[str, tuple[Any, ...]] = {}  # KINDS index text -> row with tuple shapes
    try:
        for index, line in enumerate(lines):
            kind_text, owner_text, name = line.split(" ", 2)
            kind = kinds.get(kind_text)
            if kind is None:
                kind = kinds[kind_text] = _kind_row(table, kind_text)
            groups.append((name, kind[0], table.owners[int(owner_text)], kind[1], kind[2],
                           kind[3]))
            first = len(tensors)
            tensors += [(targets[first + i], index, *member)
                        for i, member in enumerate(kind[4])]
            reduced.update(first + i for i in kind[5])
            outputs.update(first + i for i in kind[6])
    except (ValueError, IndexError, TypeError):
        raise CheckpointError(f"the generated tables of rank {table.rank} are malformed at "
                              f"GROUPS line {len(groups) + 1}; regenerate the build") from None
    if len(tensors) != len(targets):
        raise CheckpointError(f"the generated tables of rank {table.rank} list {len(targets)} "
                              f"TARGETS for {len(tensors)} group members; regenerate the build")
    return groups, tensors, frozenset(reduced), frozenset(outputs)


def _held(table: RankTable, joined: tuple[list[GroupRow], list[TensorRow], frozenset[int],
                                          frozenset[int]]
          ) -> tuple[list[GroupRow], list[TensorRow], frozenset[int], frozenset[int]]:
    """The joined rows without the tensors placed `omit` on this rank (per-head tensors of
    heads other ranks hold), the reduction indices renumbered; unchanged when no KINDS member
    is omitted (checked on the few KINDS rows, not the ~10^4 tensors)."""
    try:
        omits = any(member[2][0] == "omit" for kind in table.kinds for member in kind[4])
    except (IndexError, TypeError, KeyError):
        return joined  # malformed KINDS: the placement decode names the fault
    if not omits:
        return joined
    groups, tensors, reduced, outputs = joined
    kept = [i for i, row in enumerate(tensors) if row[4][0] != "omit"]
    renumber = {old: new for new, old in enumerate(kept)}
    return (groups, [tensors[i] for i in kept],
            frozenset(renumber[i] for i in reduced if i in renumber),
            frozenset(renumber[i] for i in outputs if i in renumber))


def _joined(table: RankTable, targets: list[str], lines: list[str]
            ) -> tuple[list[GroupRow], list[TensorRow], frozenset[int], frozenset[int]] | None:
    """`_join_tables`' rows built column by column in C-level maps and zips, a Python step
    only per distinct KINDS row; None when anything does not fit (every line split in three,
    every KINDS row and owner found, one target a member) or fails, for the line-by-line loop
    to name the fault as it always has. That loop cost a fresh process's load ~0.06 ms at
    ~10^2 groups, a Python iteration and a comprehension a line (issue 18)."""
    try:
        parts = list(map(str.split, lines, repeat(" "), repeat(2)))
        if parts and set(map(len, parts)) != {3}:
            return None
        kind_texts, owner_texts, names = zip(*parts, strict=True) if parts else ((), (), ())
        kinds = {text: _kind_row(table, text) for text in dict.fromkeys(kind_texts)}
        owners = list(map(table.owners.__getitem__, map(int, owner_texts)))
    except Exception:  # whatever it is, the loop meets it at its line
        return None
    rows = list(map(kinds.__getitem__, kind_texts))
    counts = [len(row[4]) for row in rows]
    if sum(counts) != len(targets):
        return None
    groups: list[GroupRow] = list(zip(
        names, map(itemgetter(0), rows), owners, map(itemgetter(1), rows),
        map(itemgetter(2), rows), map(itemgetter(3), rows), strict=True))
    indices = chain.from_iterable(map(repeat, range(len(rows)), counts))
    members = chain.from_iterable(map(itemgetter(4), rows))
    tensors: list[TensorRow] = list(map(add, zip(targets, indices, strict=True), members))
    reduced: set[int] = set()
    outputs: set[int] = set()
    for first, row in zip(accumulate(counts, initial=0), rows, strict=False):  # one more first
        if row[5]:
            reduced.update(first + i for i in row[5])
        if row[6]:
            outputs.update(first + i for i in row[6])
    return groups, tensors, frozenset(reduced), frozenset(outputs)


MAX_DIMENSION = 1 << 40
"""The largest tensor dimension a rank table may state (as the plan reader's limit)."""

MAX_ELEMENTS = 1 << 50
"""The most elements one tensor of a rank table may have."""


def _bounded(shape: tuple[Any, ...]) -> bool:
    """Every dimension an integer in [0, MAX_DIMENSION], at most MAX_ELEMENTS elements."""
    product = 1
    for size in shape:
        if type(size) is not int or not 0 <= size <= MAX_DIMENSION:
            return False
        product *= size
    return product <= MAX_ELEMENTS


def tensor_selections(table: RankTable) -> list[tuple[str, Selection, int]]:
    """(target, selection, local bytes) of every tensor of the rank, sorted by target: what a
    load reads. Each distinct placement is rebuilt through its validating constructor and must
    fit its tensor; the layout classes are not built (`local_model_layout` does that, on first
    use of a loaded state's `layout`: creating them costs a plain load's import ~5 ms)."""
    decoded: dict[tuple[Any, ...], tuple[Selection, int]] = {}
    found = []
    for target, _, dtype, shape, compact, _ in table.tensor_rows():
        key = (dtype, shape, compact)
        known = decoded.get(key)
        if known is None:
            try:  # a tampered placement: a reversed range, an unknown kind, missing fields
                placement = placement_from_compact(compact)
            except (LayoutError, TypeError, ValueError, IndexError) as exc:
                raise CheckpointError(
                    f"the generated tables of rank {table.rank} are malformed at tensor "
                    f"`{target}`: placement {list(compact)!r}: {exc}; regenerate the build",
                    tensor=target) from None
            if (dtype not in DTYPE_BITS or not _bounded(shape)
                    or not placement.fits(shape)):
                raise CheckpointError(
                    f"the generated tables of rank {table.rank} are malformed at tensor "
                    f"`{target}`: dtype {dtype!r}, shape {list(shape)}, placement "
                    f"{placement.to_json()}; regenerate the build", tensor=target)
            selection = placement.selection(shape)
            known = decoded[key] = (selection, tensor_bytes(dtype, local_shape(shape, selection)))
        found.append((target, *known))
    found.sort(key=lambda item: item[0])
    for before, after in zip(found, found[1:], strict=False):
        if before[0] == after[0]:
            raise CheckpointError(f"the generated tables of rank {table.rank} list "
                                  f"`{before[0]}` twice; regenerate the build", tensor=before[0])
    return found


def local_model_layout(table: RankTable) -> LocalModelLayout:
    """The rank's LocalModelLayout, rebuilt through the validating constructors."""
    from partc.parallel.layout import LocalModelLayout, LocalTensorLayout, ParameterRole

    groups = table.group_rows()
    validated: dict[tuple[Any, ...], LocalTensorLayout] = {}  # one per distinct structure
    layouts = []
    reduced = table.reduced_rows()
    outputs = table.output_reduced_rows()
    for row, (target, index, dtype, shape, compact, kv_replicas) in enumerate(
            table.tensor_rows()):
        name, role, _, units, logical, fell_back = groups[index]
        needs_reduction = row in reduced
        needs_output = row in outputs
        key = (role, units, logical, fell_back, dtype, shape, compact, kv_replicas,
               needs_reduction, needs_output)
        first = validated.get(key)
        if first is None:
            placement = placement_from_compact(compact)
            first = validated[key] = LocalTensorLayout(
                target=target, logical_name=name, role=ParameterRole(role), dtype=dtype,
                global_shape=shape, local_shape=local_shape(shape, placement.selection(shape)),
                placement=placement, logical_units=units, logical_range=logical,
                fell_back_to_replication=fell_back, kv_replicas=kv_replicas,
                needs_tp_reduction=needs_reduction, needs_tp_output_reduction=needs_output)
        layouts.append(first.renamed(target, name))
    return LocalModelLayout(tensors=tuple(layouts))


def _parameter_bindings(table: RankTable) -> list[dict[str, Any]]:
    """The stage's parameter bindings (JSON form) from the GROUPS and TARGETS tables: every
    target of each group, those another rank holds (per head) included, as the plan's."""
    groups = table.group_rows()
    targets: list[list[str]] = [[] for _ in groups]
    for row in table.stage_tensor_rows():
        targets[row[1]].append(row[0])
    return [{"group": group[0], "owner": group[2], "targets": names}
            for group, names in zip(groups, targets, strict=True)]


def parallel_model_info(table: RankTable) -> ParallelModelInfo:
    """The rank's ParallelModelInfo."""
    from partc.parallel.layout import ParallelModelInfo

    return ParallelModelInfo(
        model_type=table.model_type, tensor_parallel_size=table.tensor_parallel_size,
        pipeline_parallel_size=table.pipeline_parallel_size, rank=table.rank,
        tensor_parallel_rank=table.tensor_parallel_rank, pipeline_stage=table.pipeline_stage,
        **{**table.info, "local_bytes_by_dtype": tuple(sorted(
            table.info.get("local_bytes_by_dtype", {}).items()))})


def expert_map(table: RankTable) -> ExpertMap:
    """The router's map of an expert-parallel build; CheckpointError without one."""
    experts = table.experts
    if experts is None:
        raise CheckpointError(f"rank {table.rank} is not from an expert-parallel build (compile "
                              "with --ep); it has no expert map")
    from partc.parallel.experts import ExpertMap

    try:
        return ExpertMap(expert_parallel_size=experts["expert_parallel_size"],
                         expert_tensor_parallel_size=experts["expert_tensor_parallel_size"],
                         expert_parallel_rank=experts["expert_parallel_rank"],
                         owners=tuple(tuple((ep, slot) for ep, slot in held)
                                      for held in experts["owners"]),
                         local_experts=tuple(experts["local_experts"]))
    except (KeyError, TypeError, ValueError, LayoutError):
        raise CheckpointError(f"the EXPERTS table of rank {table.rank} is malformed; "
                              "regenerate the build") from None


def architecture_partition(table: RankTable) -> ArchitecturePartition:
    """The stage's ArchitecturePartition (graph, bindings and wire contract included)."""
    from partc.partition.pipeline import ArchitecturePartition

    partition = ArchitecturePartition.from_json(
        {**table.partition, "parameter_bindings": _parameter_bindings(table)},
        boundary=wire_contract(table))
    if table.receive_boundary is None and table.send_boundary is None:
        return partition
    return replace(partition, receive_boundary=_contract(table, table.receive_boundary),
                   send_boundary=_contract(table, table.send_boundary))


def _contract(table: RankTable, schema: Mapping[str, Any] | None
              ) -> PipelineWireContract | None:
    """The wire contract of one cut's schema (None: no cut)."""
    from partc.partition.boundary import (
        BoundaryWireSchema,
        PipelineActivationDtype,
        PipelineWireContract,
    )

    if schema is None:
        return None
    return PipelineWireContract(schema=BoundaryWireSchema.from_json(schema),
                                activation_dtype=PipelineActivationDtype(table.activation_dtype))


def _rank_table(source: Any, what: str) -> RankTable:
    """The RankTable of a generated rank module (or the table itself); a CheckpointError
    naming what was passed otherwise."""
    table = getattr(source, "_TABLE", source)
    if not isinstance(table, RankTable):
        raise CheckpointError(f"{what}() takes a generated rank module (`package.rank_module("
                              f"r)`) or its RankTable, found {type(source).__name__}")
    return table


def receive_boundary(source: Any) -> ArchitectureBoundary | None:
    """Typed decode of the cut a stage receives at (None on the first stage); the one
    pipeline boundary in a build without per-group boundaries. `source`: a generated rank
    module or its RankTable."""
    from partc.runtime.boundary_codec import boundary_for

    table = _rank_table(source, "receive_boundary")
    if table.receive_boundary is None and table.send_boundary is None:
        return None if table.pipeline_stage == 0 else architecture_boundary(table)
    contract = _contract(table, table.receive_boundary)
    return None if contract is None else boundary_for(contract)


def send_boundary(source: Any) -> ArchitectureBoundary | None:
    """Typed encode of the cut a stage sends at (None on the last stage); the one pipeline
    boundary in a build without per-group boundaries. `source`: a generated rank module or
    its RankTable."""
    from partc.runtime.boundary_codec import boundary_for

    table = _rank_table(source, "send_boundary")
    if table.receive_boundary is None and table.send_boundary is None:
        last = table.pipeline_stage == table.pipeline_parallel_size - 1
        return None if last else architecture_boundary(table)
    contract = _contract(table, table.send_boundary)
    return None if contract is None else boundary_for(contract)


def partition_state(table: RankTable) -> PartitionState:
    """The stage's KV-state geometry and global state-layer range."""
    return architecture_partition(table).state


def wire_contract(table: RankTable) -> PipelineWireContract:
    """The pipeline wire contract: boundary schema and the compiled activation dtype."""
    from partc.partition.boundary import (
        BoundaryWireSchema,
        PipelineActivationDtype,
        PipelineWireContract,
    )

    return PipelineWireContract(schema=BoundaryWireSchema.from_json(table.boundary),
                                activation_dtype=PipelineActivationDtype(table.activation_dtype))


def architecture_boundary(table: RankTable) -> ArchitectureBoundary:
    """Typed encode/decode of the pipeline boundary under the wire contract."""
    from partc.runtime.boundary_codec import boundary_for

    return boundary_for(wire_contract(table))


def layered_partition_driver(table: RankTable, storage: Mapping[str, Any] | None = None
                             ) -> LayeredPartitionDriver:
    """The stage's LayeredPartitionDriver, checking the executor's `storage` ranges if given."""
    from partc.runtime.driver import LayeredPartitionDriver

    return LayeredPartitionDriver.for_partition(architecture_partition(table), storage)


def boundary_schema(table: RankTable) -> BoundaryWireSchema:
    """The pipeline boundary wire schema."""
    from partc.partition.boundary import BoundaryWireSchema

    return BoundaryWireSchema.from_json(table.boundary)
