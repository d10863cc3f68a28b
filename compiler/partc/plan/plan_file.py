"""A build's plan.json read back: one typed, frozen view that inspect, explain, report, verify and
shard read instead of walking the JSON document.

`read_plan` reads the file once, builds the view, and turns anything the view trips over into
one LoadError located at its line in the plan file: a value of the wrong type is explained by
the plan schema (`front.schema.plan_faults`: file, line and JSON pointer), and a plan that follows
the schema but disagrees with itself (its ranks against its topology) names the pointer and the
values.

Every read then checks the whole plan schema (enums, minimums, patterns, unknown keys; where
jsonschema is installed: a runtime-only install reads with the bounds below), over the
tensor and group tables cut to one entry per distinct form (`_schema_problem`): validating every
entry of DeepSeek-V3's 34 MB 8 x 4 plan takes ~53 s, the cut tables ~0.4 s of a ~4 s read.

What the schema types but does not bound is checked on every read, before anything is shown:
T, S, E and X in [1, 65536] before anything is built per rank (S = 10^9 in an 11 KB plan),
dimensions in [0, 2^40] and at most 2^50 elements, stages inside the pipeline, placement axes
inside the tensor's rank and ranges inside its shape, unit ranges inside their group's units,
logical ranges in order, byte counts non-negative, `kv_replicas` at most 65536, every tensor's
group listed (a tenth of a 19k-tensor plan's read time).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from partc.errors import LayoutError, LoadError, PartcError, SourceLocation
from partc.front.load import MAX_PLAN_BYTES, read_bytes
from partc.parallel.placements import tensor_bytes
from partc.parallel.shape import ParallelShape
from partc.partition.boundary import BoundaryWireSchema
from partc.partition.ownership import ParameterGroupOwner, owner_from_json

_T = TypeVar("_T")

PLAN_KEYS = ("topology", "groups", "ranks", "tensors", "boundary", "family", "plan_hash")
"""The top-level keys a plan document must have to be read as one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTensor:
    """One checkpoint tensor of the plan's global table (`tensors` entry)."""

    target: str
    """Checkpoint name."""
    dtype: str
    """Safetensors dtype."""
    shape: tuple[int, ...]
    """Global shape."""
    group: str
    """Owning parameter group."""
    stages: tuple[int, ...]
    """Pipeline stages that load it."""
    placements: tuple[tuple[Any, ...], ...]
    """Compact placement per placement row (TP rank, or ETP / stage-local rank for experts)."""
    kv_replicas: int = 1
    """How many ranks hold each KV head (> 1: repeated across ranks)."""
    needs_tp_reduction: bool = False
    """A norm an engine all-reduces over the TP group."""
    needs_tp_output_reduction: bool = False
    """A row projection whose output an engine all-reduces over the TP group inside its
    module."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitRange:
    """The units of one execution group a rank executes: `group[start:end]`."""

    group: str
    """The execution group."""
    start: int
    """First unit."""
    end: int
    """One past the last unit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """A rank's totals (`ranks[r].info`)."""

    owned_tensors: int
    """Tensors the rank loads."""
    local_parameter_bytes: int
    """Bytes of its rank-local slices."""
    global_parameter_bytes: int
    """Bytes of the whole model."""
    pinned_parameter_bytes: int
    """Bytes of tensors pinned whole on the rank."""
    maximum_device_parameter_bytes: int
    """Its largest device footprint."""
    local_bytes_by_dtype: tuple[tuple[str, int], ...]
    """Local bytes per dtype, sorted by dtype."""
    dense_replica: int | None = None
    """Which copy of its stage's dense parts (expert-parallel builds only)."""
    expert_parallel_rank: int | None = None
    """Its EP rank (expert-parallel builds only)."""
    expert_tensor_parallel_rank: int | None = None
    """Its ETP rank (expert-parallel builds only)."""
    local_state_bytes: int = 0
    """Bytes of the runtime state it allocates per sequence (the family's `state:`; 0 when none
    is declared)."""
    local_state_bytes_per_token: int = 0
    """Bytes of the runtime state it allocates per token."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStateTensor:
    """One declared runtime state tensor of a rank's unit (`partition.state.tensors` entry)."""

    name: str
    """The state's name (`conv`, `ssm`, `key`...)."""
    group: str
    """The execution group of its unit."""
    unit: int
    """The unit (layer) it belongs to."""
    dtype: str
    """Its dtype."""
    shape: tuple[int, ...]
    """Its whole shape."""
    local_shape: tuple[int, ...]
    """This rank's part of it."""
    per: str
    """`sequence` or `token`: what one allocation of it is for."""
    local_bytes: int
    """Bytes of this rank's part."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRank:
    """One rank of the build (`ranks` entry)."""

    rank: int
    """Its build rank."""
    pipeline_stage: int
    """Its pipeline stage."""
    tensor_parallel_rank: int
    """Its rank in the stage's dense TP group."""
    info: RankInfo
    """Its totals."""
    units: tuple[UnitRange, ...]
    """The execution units it runs, per group."""
    static_roles: tuple[str, ...]
    """The static roles (embedding, output...) it owns."""
    state: tuple[PlanStateTensor, ...] = ()
    """Its units' declared runtime state tensors, in plan order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphGroup:
    """One execution group of the plan's graph (`graph` entry)."""

    group: str
    """Its name."""
    unit_paths: tuple[str, ...]
    """The checkpoint module path of each unit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticRolePlace:
    """Where a static role is placed (`static_roles` entry): the first or last stage, or with
    the first or last unit of an execution group."""

    role: str
    """The role's name."""
    stage: str | None
    """`first` or `last` (None: placed with a group's unit)."""
    with_group: str | None = None
    """The execution group it sits with."""
    unit: str | None = None
    """`first` or `last`: which unit of `with_group`."""

    def spell(self) -> str | dict[str, str]:
        """The place as plan.json writes it: `first`, `last` or `{unit, with}`."""
        if self.stage is not None:
            return self.stage
        assert self.with_group is not None and self.unit is not None
        return {"unit": self.unit, "with": self.with_group}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTopology:
    """The realization choices of the plan's `topology` beside its sizes (`PlanFile.shape`)."""

    policy: str | None
    """The sharding policy given on the command line (None: the family's)."""
    split: str | None
    """`chunk` for torch.chunk's uneven splits (None: balanced)."""
    activation_dtype: str
    """The dtype activations cross a pipeline cut in."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanGroup:
    """One parameter group of the plan (`groups` entry)."""

    name: str
    """Its name."""
    role: str
    """Its parameter role."""
    owner: ParameterGroupOwner
    """Who owns it: a static role, any of several, or an execution unit."""
    stages: tuple[int, ...]
    """The pipeline stages that load it."""
    logical_units: int | None
    """Its partition units (None: not partitioned)."""
    logical_ranges: tuple[tuple[int, int], ...] | None
    """Each TP (ETP) rank's [start, end) of the units (None: not partitioned)."""
    fell_back_to_replication: bool
    """The policy replicated it instead of sharding it."""
    fallback_reason: str | None = None
    """Why it could not be sharded (fallen-back groups only)."""

    def owner_json(self) -> dict[str, object]:
        """The owner as plan.json writes it (keys sorted)."""
        return dict(sorted(self.owner.to_json().items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCut:
    """One pipeline cut: the stage before it, the group of the unit before it, and the
    boundary that crosses it (a `cuts` entry, or the family's one boundary)."""

    after_stage: int
    """The stage before the cut."""
    group: str
    """The execution group whose unit ends that stage."""
    boundary: BoundaryWireSchema
    """What crosses the cut."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertParallelLayout:
    """An expert-parallel build's layout (`expert_parallel`, docs/expert_parallel.md)."""

    expert_parallel_size: int
    """E."""
    expert_tensor_parallel_size: int
    """X."""
    ranks_per_stage: int
    """N = E x X."""
    dense_replicas: int
    """Copies of a stage's dense parts."""
    layout: str
    """The layout in words."""
    experts: int
    """Routed experts of the model."""
    explicit_placement: bool
    """Placed by a placement file (not the balanced rule)."""
    redundant_slots: int
    """Slots beyond one per expert."""
    slots: tuple[tuple[int, ...], ...]
    """Each EP rank's global expert ids, in local slot order."""
    expert_groups: Mapping[str, int | None]
    """Routed-expert group -> its expert id (None: a stacked group); read-only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineChoice:
    """How a multi-group graph's stages were chosen (`pipeline`)."""

    balance: str
    """`bytes`, `weight`, `units` or `explicit`."""
    layout: str
    """The layout in Megatron's notation."""
    stage_bytes: tuple[int, ...]
    """Each stage's parameter bytes on its largest rank."""
    imbalance: float
    """Largest stage over the mean."""
    group_modes: tuple[tuple[str, str], ...]
    """Each execution group's parallel mode, sorted by group."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSource:
    """One input the plan was compiled from (`sources` entry)."""

    name: str
    """Its file name (a built-in family: `<name>.yaml`)."""
    sha256: str
    """Its sha256."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanFile:
    """A plan.json read back, checked and typed (built only by `read_plan`)."""

    path: Path
    """The plan.json file."""
    plan_hash: str
    """The plan's content hash."""
    family: str
    """Family name."""
    model_type: str | None
    """HF model type."""
    shape: ParallelShape
    """T, S, E, X of the build (one replica: D = 1) and its rank arithmetic."""
    topology: PlanTopology
    """The realization choices of the topology."""
    topology_json: Mapping[str, Any]
    """The `topology` object as written (read-only), for outputs that echo it whole."""
    tensors: tuple[PlanTensor, ...]
    """The global tensor table, in the plan's order."""
    ranks: tuple[PlanRank, ...]
    """Every rank, by build rank."""
    graph: tuple[GraphGroup, ...]
    """The execution groups, canonical order."""
    static_roles: tuple[StaticRolePlace, ...]
    """The static roles and their places, declaration order."""
    groups: tuple[PlanGroup, ...]
    """Every parameter group, in the plan's order."""
    boundary: BoundaryWireSchema
    """The family's boundary (what crosses a cut without a `cuts` entry)."""
    cuts: tuple[PlanCut, ...] | None
    """The cuts of a family declaring a boundary per execution group (None: it declares one
    boundary; see `pipeline_cuts`)."""
    expert_parallel: ExpertParallelLayout | None
    """The expert-parallel layout (None: no expert parallelism)."""
    pipeline: PipelineChoice | None
    """How a multi-group graph's stages were chosen (None: not recorded)."""
    sources: tuple[PlanSource, ...]
    """The files the plan was compiled from."""
    config: Mapping[str, Any]
    """The config values the family read, by field name (read-only JSON values)."""
    omit: tuple[str, ...]
    """Checkpoint tensors no rank loads (`omit`)."""
    checkpoint_fingerprint: str | None
    """sha256 over the checkpoint header the plan was compiled against (None: none given)."""
    checkpoint_header_digest: str | None
    """sha256 of that checkpoint's stored header bytes."""

    def tensor_bytes_total(self) -> int:
        """Bytes of every tensor of the global table."""
        return sum(tensor_bytes(t.dtype, t.shape) for t in self.tensors)

    def groups_by_name(self) -> dict[str, PlanGroup]:
        """Every parameter group by name."""
        return {g.name: g for g in self.groups}

    def pipeline_cuts(self) -> tuple[PlanCut, ...]:
        """Every cut of the build: `cuts` (a graph of several groups), else one after each
        stage but the last, each carrying the family's one boundary, in the group of the
        stage's last unit (a cut inside a vision tower is in `vision`, one inside a decoder
        followed by an MTP group in `decoder`; the graph's last group for a stage of none)."""
        if self.cuts is not None:
            return self.cuts
        last = self.graph[-1].group if self.graph else ""
        ends = {rank.pipeline_stage: rank.units[-1].group for rank in self.ranks if rank.units}
        return tuple(PlanCut(after_stage=stage, group=ends.get(stage, last),
                             boundary=self.boundary)
                     for stage in range(self.shape.pipeline_parallel_size - 1))


def read_plan(path: str | Path, *, label: str | None = None, hint: str = "") -> PlanFile:
    """Read, check and type a plan.json; one LoadError located in the file when it cannot be
    read as a plan. `label` names the file in read errors (default `a plan from <path>`),
    `hint` is added to them."""
    file = Path(path)
    where = SourceLocation(str(file))
    label = f"a plan from {file}" if label is None else label
    tail = f"; {hint}" if hint else ""
    text = ""
    try:  # a regular file only, checked before it is opened: a FIFO would block the read
        text = read_bytes(file, label, MAX_PLAN_BYTES).decode()
        document = json.loads(text)
    except LoadError as exc:
        raise LoadError(f"{exc.message}{tail}", location=where) from None
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: an integer of > 4300 digits
        raise _unreadable(file, label, text, exc, tail) from None
    missing = [key for key in PLAN_KEYS if not isinstance(document, dict) or key not in document]
    if missing:
        raise LoadError(f"{file} is not a partc plan: it lacks {', '.join(missing)}",
                        location=where)
    try:
        _check_topology_sizes(document["topology"])
        view = _plan_file(file, document)
    except _Insane as exc:
        raise _insane(file, exc) from None
    except _FAULTS as exc:
        raise _fault(file, document, exc, "") from None
    try:
        _check_sane(view)
    except _Insane as exc:
        raise _insane(file, exc) from None
    problem = _schema_problem(document, view)
    if problem is not None:
        raise _located(file, problem[0], f"the plan breaks its schema: {problem[1]}")
    return view


_LONG_INTEGER = re.compile(r"(?<![0-9.eE])-?[0-9]{21,}")
"""An integer of more digits than any a plan states (2^64 has 20): json refuses one of more
than 4300 digits (`sys.get_int_max_str_digits`), and this finds where it is."""


def _unreadable(file: Path, label: str, text: str, exc: Exception, tail: str) -> LoadError:
    """The LoadError for a plan.json that is not UTF-8 JSON: an over-long integer located at
    its line and column (json names neither), else json's own message and position."""
    long = _LONG_INTEGER.search(text) if isinstance(exc, ValueError) else None
    if long is not None and "digits" in str(exc):
        line = text.count("\n", 0, long.start()) + 1
        column = long.start() - (text.rfind("\n", 0, long.start()) + 1) + 1
        return LoadError(f"cannot read {label}: an integer of {len(long.group().lstrip('-'))} "
                         "digits, more than the 4300 a JSON reader converts (a plan's integers "
                         f"have at most 20){tail}",
                         location=SourceLocation(str(file), line, column))
    return LoadError(f"cannot read {label}: {exc}{tail}", location=SourceLocation(str(file)))


MAX_PARALLEL_SIZE = 1 << 16
"""The largest T, S, E or X a plan may state (checked before anything is built per rank)."""

MAX_DIMENSION = 1 << 40
"""The largest size of one tensor dimension a plan may state."""

MAX_ELEMENTS = 1 << 50
"""The most elements one tensor (or one runtime state tensor) of a plan may have."""


class _Insane(Exception):
    """A plan value that follows the schema's types but cannot be true (`pointer`, `message`)."""

    def __init__(self, pointer: str, message: str) -> None:
        super().__init__(message)
        self.pointer, self.message = pointer, message


def _insane(file: Path, exc: _Insane) -> LoadError:
    """The LoadError for an impossible plan value, located at its line when it can be."""
    return _located(file, exc.pointer, f"the plan states an impossible value: {exc.message}")


def _located(file: Path, pointer: str, message: str) -> LoadError:
    """A LoadError for what is wrong at `pointer` of the plan, located at its line when it can
    be, telling the user to compile again."""
    from partc.front.positions import json_locations

    try:
        where = json_locations(str(file), file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        where = {}
    return LoadError(f"{message}; it was edited, or not written by partc: compile the build "
                     "again", location=where.get(pointer, SourceLocation(str(file))),
                     pointer=pointer)


def _distinct(entries: Sequence[Any], forms: Sequence[Hashable]
              ) -> tuple[list[Any], list[int]]:
    """One entry per distinct form (the first), and the index in `entries` of each."""
    first: dict[Hashable, int] = {}
    for index, form in enumerate(forms):
        first.setdefault(form, index)
    rows = sorted(first.values())
    return [entries[row] for row in rows], rows


def _tensor_form(entry: Mapping[str, Any], tensor: PlanTensor) -> Hashable:
    """All the plan schema sees of a tensor entry but its names' text: its keys and typed
    values (a typed value stands for exactly one JSON value), whether its names are empty."""
    return (tuple(entry), bool(tensor.target), bool(tensor.group), tensor.dtype, tensor.shape,
            tensor.stages, tensor.placements, tensor.kv_replicas, tensor.needs_tp_reduction,
            tensor.needs_tp_output_reduction)


def _group_form(entry: Mapping[str, Any], group: PlanGroup) -> Hashable:
    """All the plan schema sees of a group entry but its names' text (see `_tensor_form`); of
    its owner the schema reads only `kind`."""
    return (tuple(entry), bool(group.name), group.role, group.owner.to_json().get("kind"),
            group.stages, group.logical_units, group.logical_ranges,
            group.fell_back_to_replication, group.fallback_reason is None,
            bool(group.fallback_reason))


def _schema_problem(document: Mapping[str, Any], view: PlanFile) -> tuple[str, str] | None:
    """The plan schema's most relevant violation in `document` (pointer, message), or None.

    Every read checks the whole schema, but over the tensor and group tables cut to one entry
    per distinct form (`_tensor_form`, `_group_form`: a few hundred of a 90,000-tensor plan):
    the names' text is free (a non-empty string, which the form records), and validating every
    entry of DeepSeek-V3's 34 MB 8 x 4 plan takes ~50 s against ~3 s for the whole read.

    A runtime-only install (README "Serving images") has no jsonschema: there the check is
    skipped, and the typed view, built field by field, and `_check_sane`'s bounds are what
    hold (`tests/test_cli_first_day.py` runs inspect without the compiler's libraries).
    """
    try:
        from partc.front.schema import first_data_error
    except ModuleNotFoundError as missing:
        if missing.name != "jsonschema":
            raise
        return None

    raw_tensors = list(document.get("tensors", []))
    tensors, tensor_rows = _distinct(raw_tensors, [
        _tensor_form(e, t) for e, t in zip(raw_tensors, view.tensors, strict=True)])
    raw_groups = list(document["groups"])
    groups, group_rows = _distinct(raw_groups, [
        _group_form(e, g) for e, g in zip(raw_groups, view.groups, strict=True)])
    problem = first_data_error("plan.schema.json",
                               {**document, "tensors": tensors, "groups": groups})
    if problem is None:
        return None
    pointer, message = problem
    for table, rows in (("tensors", tensor_rows), ("groups", group_rows)):
        head = f"/{table}/"
        if pointer.startswith(head):
            index, _, rest = pointer[len(head):].partition("/")
            pointer = f"{head}{rows[int(index)]}" + (f"/{rest}" if rest else "")
    return pointer, message


def _check_topology_sizes(topology: object) -> None:
    """T, S, E and X are integers in [1, MAX_PARALLEL_SIZE] (those that are integers: the
    view reports the others), before any per-rank or per-stage value is built."""
    if not isinstance(topology, dict):
        return
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                "expert_tensor_parallel_size"):
        value = topology.get(key)
        if type(value) is int and not 1 <= value <= MAX_PARALLEL_SIZE:
            raise _Insane(f"/topology/{key}",
                          f"`{key}` is {value}, expected 1 to {MAX_PARALLEL_SIZE}")


def _check_shape(pointer: str, shape: tuple[int, ...]) -> None:
    """Every dimension in [0, MAX_DIMENSION] and at most MAX_ELEMENTS elements."""
    for axis, size in enumerate(shape):
        if not 0 <= size <= MAX_DIMENSION:
            raise _Insane(f"{pointer}/{axis}", f"dimension {axis} of the shape is {size}, "
                          f"expected 0 to {MAX_DIMENSION}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise _Insane(pointer, f"the shape {list(shape)} has {math.prod(shape)} elements, "
                      f"more than {MAX_ELEMENTS}")


def _check_stages(pointer: str, stages: tuple[int, ...], pipeline: int) -> None:
    """Every stage in [0, S)."""
    for index, stage in enumerate(stages):
        if not 0 <= stage < pipeline:
            raise _Insane(f"{pointer}/{index}", f"stage {stage} is outside the topology's "
                          f"{pipeline} pipeline stage(s) (0 to {pipeline - 1})")


def _check_range(pointer: str, start: int, end: int, size: int, what: str) -> None:
    """0 <= start <= end <= size."""
    if not 0 <= start <= end <= size:
        raise _Insane(pointer, f"the range [{start}, {end}) is not inside the {size} {what}")


def _check_placement(pointer: str, placement: tuple[Any, ...], shape: tuple[int, ...],
                     plan: PlanFile) -> None:
    """A placement's axis inside the tensor's rank, its ranges inside that axis, its shard
    index inside its parts, its rank or stage inside the topology."""
    kind = placement[0]
    if kind in ("shard", "range", "indices"):
        axis = placement[1]
        if axis >= len(shape):
            raise _Insane(pointer, f"a `{kind}` placement on axis {axis} of a tensor of rank "
                          f"{len(shape)} (shape {list(shape)})")
        if kind == "shard" and not placement[2] < placement[3]:
            raise _Insane(pointer, f"shard {placement[2]} of {placement[3]} part(s)")
        if kind == "range":
            _check_range(pointer, placement[2], placement[3], shape[axis],
                         f"elements of axis {axis}")
        if kind == "indices":
            for start, end in placement[2]:
                _check_range(pointer, start, end, shape[axis], f"elements of axis {axis}")
    elif kind == "rank" and placement[1] >= plan.shape.build_world_size:
        raise _Insane(pointer, f"rank {placement[1]} of a build of "
                      f"{plan.shape.build_world_size} rank(s)")
    elif kind == "pipeline_stage":
        _check_stages(pointer, placement[1:], plan.shape.pipeline_parallel_size)


def _check_sane(plan: PlanFile) -> None:
    """The values the schema types but does not bound: shapes bounded and non-negative,
    stages inside the pipeline, placements inside their tensors, ranges in order and inside
    their sizes, byte counts non-negative, the stage imbalance finite."""
    stages = plan.shape.pipeline_parallel_size
    names = {group.name for group in plan.groups}
    for index, tensor in enumerate(plan.tensors):
        at = f"/tensors/{index}"
        if tensor.group not in names:
            raise _Insane(f"{at}/group", f"tensor `{tensor.target}` belongs to group "
                          f"`{tensor.group}`, which the plan's groups do not list")
        if tensor.kv_replicas > MAX_PARALLEL_SIZE:
            raise _Insane(f"{at}/kv_replicas", f"`kv_replicas` is {tensor.kv_replicas}, "
                          f"expected at most {MAX_PARALLEL_SIZE}")
        _check_shape(f"{at}/shape", tensor.shape)
        _check_stages(f"{at}/stages", tensor.stages, stages)
        for row, placement in enumerate(tensor.placements):
            _check_placement(f"{at}/placements/{row}", placement, tensor.shape, plan)
    unit_counts = {graph.group: len(graph.unit_paths) for graph in plan.graph}
    for index, rank in enumerate(plan.ranks):
        at = f"/ranks/{index}"
        for name in ("owned_tensors", "local_parameter_bytes", "global_parameter_bytes",
                     "pinned_parameter_bytes", "maximum_device_parameter_bytes",
                     "local_state_bytes", "local_state_bytes_per_token"):
            if getattr(rank.info, name) < 0:
                raise _Insane(f"{at}/info/{name}",
                              f"`{name}` is {getattr(rank.info, name)}, expected >= 0")
        for dtype, size in rank.info.local_bytes_by_dtype:
            if size < 0:
                raise _Insane(f"{at}/info/local_bytes_by_dtype/{dtype}",
                              f"{size} bytes of {dtype}, expected >= 0")
        for row, units in enumerate(rank.units):
            _check_range(f"{at}/partition/groups/{row}/unit_range", units.start, units.end,
                         unit_counts.get(units.group, MAX_DIMENSION),
                         f"units of execution group `{units.group}`")
        for row, state in enumerate(rank.state):
            _check_shape(f"{at}/partition/state/tensors/{row}/shape", state.shape)
            _check_shape(f"{at}/partition/state/tensors/{row}/local_shape", state.local_shape)
    for index, group in enumerate(plan.groups):
        at = f"/groups/{index}"
        _check_stages(f"{at}/stages", group.stages, stages)
        if group.logical_units is not None and group.logical_units < 0:
            raise _Insane(f"{at}/logical_units",
                          f"`logical_units` is {group.logical_units}, expected >= 0")
        for row, (start, end) in enumerate(group.logical_ranges or ()):
            _check_range(f"{at}/logical_ranges/{row}", start, end, group.logical_units or 0,
                         "logical units")
    for index, cut in enumerate(plan.cuts or ()):
        if not 0 <= cut.after_stage < stages - 1:
            raise _Insane(f"/cuts/{index}/after_stage", f"a cut after stage {cut.after_stage} "
                          f"of {stages} pipeline stage(s)")
    if plan.pipeline is not None:
        if not math.isfinite(plan.pipeline.imbalance) or plan.pipeline.imbalance < 0:
            raise _Insane("/pipeline/imbalance",
                          f"the stage imbalance is {plan.pipeline.imbalance}, expected a finite "
                          "number >= 0")
        for row, size in enumerate(plan.pipeline.stage_bytes):
            if size < 0:
                raise _Insane(f"/pipeline/stage_bytes/{row}", f"{size} bytes, expected >= 0")


_FAULTS = (TypeError, KeyError, ValueError, IndexError, AttributeError)
"""What building the view raises on a value of the wrong kind."""


def _fault(file: Path, document: object, exc: Exception, pointer: str) -> LoadError:
    """The LoadError for a plan the view cannot be built from: located by the plan schema
    (file, line and pointer) when the schema explains it, else at `pointer` with `exc`."""
    from partc.front.schema import plan_faults

    try:
        with plan_faults(file, document):
            raise exc
    except LoadError as located:
        return located
    except _FAULTS:  # the schema allows it
        pass
    return _located(file, pointer, f"the plan cannot be read: {exc}")


def _int(value: object) -> int:
    """`value` when it is an integer (not a bool); TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, found {value!r}")
    return value


def _str(value: object) -> str:
    """`value` when it is a string; TypeError otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"expected a string, found {value!r}")
    return value


def _ints(values: object) -> tuple[int, ...]:
    """A JSON array of integers as a tuple; TypeError otherwise."""
    if type(values) is not list:
        raise TypeError(f"expected an array, found {values!r}")
    out = tuple(values)
    for value in out:
        if type(value) is not int:  # not a bool either
            raise TypeError(f"expected an integer, found {value!r}")
    return out


def _optional_str(value: object) -> str | None:
    return None if value is None else _str(value)


PLACEMENT_FIELDS = {"replicated": 0, "local": 0, "omit": 0, "rank": 1, "pipeline_stage": 1,
                    "shard": 3, "range": 3, "indices": 2}
"""Each compact placement kind and how many fields follow it (schemas/plan.schema.json)."""


class _Arity(ValueError):
    """A compact placement with the wrong fields for its kind (the schema does not say)."""


Placements = dict[tuple[Any, ...], tuple[Any, ...]]
"""The placements already checked in one plan, by their fields (a plan repeats a few hundred
distinct placements across 10^5 tensors and their ranks)."""


def _placement(value: object, checked: Placements) -> tuple[Any, ...]:
    """A compact placement, checked once per distinct value (`checked`) for its kind, its fields
    (integers, or for `indices` ranges) and their count; TypeError (or `_Arity`) otherwise."""
    if type(value) is list:
        try:
            known = checked.get(tuple(value))
        except TypeError:  # `indices`: its ranges are lists
            known = None
        if known is not None:
            return known
    placement = _checked_placement(value)
    if placement[0] != "indices":
        checked[placement] = placement
    return placement


def _checked_placement(value: object) -> tuple[Any, ...]:
    """`_placement` without the cache."""
    if not isinstance(value, list) or not value or value[0] not in PLACEMENT_FIELDS:
        raise TypeError(f"expected a compact placement, found {value!r}")
    kind, *fields = value
    ranges = [isinstance(f, list) for f in fields]
    for field, is_ranges in zip(fields, ranges, strict=True):
        if is_ranges:
            for pair in field:
                _pair(pair)
        elif _int(field) < 0:
            raise ValueError(f"expected a non-negative integer, found {field!r}")
    if len(fields) != PLACEMENT_FIELDS[kind] or ranges != [kind == "indices" and i == 1
                                                           for i in range(len(fields))]:
        raise _Arity(f"a `{kind}` placement takes {PLACEMENT_FIELDS[kind]} fields ("
                     + ("an axis and a list of [start, end] ranges" if kind == "indices"
                        else "integers") + f"), found {value!r}")
    return tuple(tuple(_pair(r) for r in f) if isinstance(f, list) else f for f in value)


def _tensor(entry: Mapping[str, Any], checked: Placements) -> PlanTensor:
    placements = entry["placements"]
    if not isinstance(placements, list):
        raise TypeError(f"expected an array of placements, found {placements!r}")
    return PlanTensor(target=_str(entry["target"]), dtype=_str(entry["dtype"]),
                      shape=_ints(entry["shape"]), group=_str(entry["group"]),
                      stages=_ints(entry["stages"]),
                      placements=tuple(_placement(p, checked) for p in placements),
                      kv_replicas=_int(entry.get("kv_replicas", 1)),
                      needs_tp_reduction=_bool(entry.get("needs_tp_reduction", False)),
                      needs_tp_output_reduction=_bool(entry.get("needs_tp_output_reduction",
                                                                False)))


def _rank(entry: Mapping[str, Any]) -> PlanRank:
    info, partition = entry["info"], entry["partition"]
    by_dtype = info["local_bytes_by_dtype"]
    if not isinstance(by_dtype, dict):
        raise TypeError(f"expected an object, found {by_dtype!r}")
    units = []
    for owned in partition["groups"]:
        start, end = _ints(owned["unit_range"])
        units.append(UnitRange(group=_str(owned["group"]), start=start, end=end))
    ep, etp = info.get("expert_parallel_rank"), info.get("expert_tensor_parallel_rank")
    replica = info.get("dense_replica")
    return PlanRank(
        rank=_int(entry["rank"]), pipeline_stage=_int(entry["pipeline_stage"]),
        tensor_parallel_rank=_int(entry["tensor_parallel_rank"]),
        info=RankInfo(owned_tensors=_int(info["owned_tensors"]),
                      local_parameter_bytes=_int(info["local_parameter_bytes"]),
                      global_parameter_bytes=_int(info["global_parameter_bytes"]),
                      pinned_parameter_bytes=_int(info["pinned_parameter_bytes"]),
                      maximum_device_parameter_bytes=_int(info["maximum_device_parameter_bytes"]),
                      local_bytes_by_dtype=tuple(sorted((_str(d), _int(n))
                                                        for d, n in by_dtype.items())),
                      dense_replica=None if replica is None else _int(replica),
                      expert_parallel_rank=None if ep is None else _int(ep),
                      expert_tensor_parallel_rank=None if etp is None else _int(etp),
                      local_state_bytes=_int(info.get("local_state_bytes", 0)),
                      local_state_bytes_per_token=_int(info.get("local_state_bytes_per_token",
                                                                0))),
        units=tuple(units),
        state=tuple(PlanStateTensor(
            name=_str(t["name"]), group=_str(t["group"]), unit=_int(t["unit"]),
            dtype=_str(t["dtype"]), shape=_ints(t["shape"]), local_shape=_ints(t["local_shape"]),
            per=_str(t["per"]), local_bytes=_int(t["local_bytes"]))
            for t in partition["state"].get("tensors", ())),
        static_roles=tuple(_str(r) for r in partition["ownership"]["static_roles"]))


def _role(entry: Mapping[str, Any]) -> StaticRolePlace:
    place = entry["stage"]
    if isinstance(place, dict):
        return StaticRolePlace(role=_str(entry["role"]), stage=None,
                               with_group=_str(place["with"]), unit=_str(place["unit"]))
    return StaticRolePlace(role=_str(entry["role"]), stage=_str(place))


def _shape(topology: Mapping[str, Any]) -> ParallelShape:
    ep = topology.get("expert_parallel_size")
    return ParallelShape(tensor_parallel_size=_int(topology["tensor_parallel_size"]),
                         pipeline_parallel_size=_int(topology["pipeline_parallel_size"]),
                         expert_parallel_size=None if ep is None else _int(ep),
                         expert_tensor_parallel_size=_int(
                             topology.get("expert_tensor_parallel_size", 1)))


def _topology(topology: Mapping[str, Any]) -> PlanTopology:
    return PlanTopology(policy=_optional_str(topology.get("policy")),
                        split=_optional_str(topology.get("split")),
                        activation_dtype=_str(topology["activation_dtype"]))


def _group(entry: Mapping[str, Any]) -> PlanGroup:
    units, ranges = entry["logical_units"], entry["logical_ranges"]
    reason = entry.get("fallback_reason")
    owner = entry["owner"]
    if not isinstance(owner, dict):
        raise TypeError(f"expected an object, found {owner!r}")
    return PlanGroup(name=_str(entry["name"]), role=_str(entry["role"]),
                     owner=owner_from_json(owner), stages=_ints(entry["stages"]),
                     logical_units=None if units is None else _int(units),
                     logical_ranges=None if ranges is None else tuple(
                         _pair(r) for r in _list(ranges)),
                     fell_back_to_replication=_bool(entry["fell_back_to_replication"]),
                     fallback_reason=None if reason is None else _str(reason))


def _pair(value: object) -> tuple[int, int]:
    """A JSON array of two integers as a pair; TypeError otherwise."""
    start, end = _ints(value)
    return start, end


def _bool(value: object) -> bool:
    """`value` when it is a boolean; TypeError otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, found {value!r}")
    return value


def _boundary(value: object) -> BoundaryWireSchema:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, found {value!r}")
    return BoundaryWireSchema.from_json(value)


def _cut(entry: Mapping[str, Any]) -> PlanCut:
    return PlanCut(after_stage=_int(entry["after_stage"]), group=_str(entry["group"]),
                   boundary=_boundary(entry["boundary"]))


def _expert_parallel(entry: Mapping[str, Any]) -> ExpertParallelLayout:
    groups = entry["expert_groups"]
    if not isinstance(groups, dict):
        raise TypeError(f"expected an object, found {groups!r}")
    return ExpertParallelLayout(
        expert_parallel_size=_int(entry["expert_parallel_size"]),
        expert_tensor_parallel_size=_int(entry["expert_tensor_parallel_size"]),
        ranks_per_stage=_int(entry["ranks_per_stage"]),
        dense_replicas=_int(entry["dense_replicas"]), layout=_str(entry["layout"]),
        experts=_int(entry["experts"]), explicit_placement=_bool(entry["explicit_placement"]),
        redundant_slots=_int(entry["redundant_slots"]),
        slots=tuple(_ints(ids) for ids in _list(entry["slots"])),
        expert_groups=MappingProxyType({_str(name): None if expert is None else _int(expert)
                                        for name, expert in groups.items()}))


def _pipeline(entry: Mapping[str, Any]) -> PipelineChoice:
    modes, imbalance = entry["group_modes"], entry["imbalance"]
    if not isinstance(modes, dict):
        raise TypeError(f"expected an object, found {modes!r}")
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)):
        raise TypeError(f"expected a number, found {imbalance!r}")
    return PipelineChoice(balance=_str(entry["balance"]), layout=_str(entry["layout"]),
                          stage_bytes=_ints(entry["stage_bytes"]), imbalance=float(imbalance),
                          group_modes=tuple(sorted((_str(g), _str(m))
                                                   for g, m in modes.items())))


def _object(value: object) -> Mapping[str, Any]:
    """A JSON object, read-only; TypeError otherwise."""
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, found {value!r}")
    return MappingProxyType(value)


def _optional(document: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    value = document.get(key)
    return None if value is None else _object(value)


def plan_view(document: Mapping[str, Any], file: Path) -> PlanFile:
    """The typed view of a plan document already in memory (a Plan's own `document`, whose
    tensor table may be left out: `tensors` is then empty); `file` names it in errors."""
    return _plan_file(file, document)


def _plan_file(file: Path, document: Mapping[str, Any]) -> PlanFile:
    """The typed view of a parsed plan document (TypeError/KeyError/ValueError on a value of
    the wrong kind; LoadError when it disagrees with itself)."""
    topology = document["topology"]
    try:
        shape = _shape(topology)
    except LayoutError as exc:
        raise LoadError(f"the plan's topology is impossible: {exc.message}",
                        location=SourceLocation(str(file)), pointer="/topology") from None
    ranks = tuple(_rank(r) for r in _list(document["ranks"]))
    _check_ranks(file, shape, ranks)
    cuts = document.get("cuts")
    experts, pipeline = _optional(document, "expert_parallel"), _optional(document, "pipeline")
    def checked(pointer: str, make: Callable[[], _T]) -> _T:
        """`make()`, an error of the vocabulary's own checks (a boundary, an owner) located."""
        try:
            return make()
        except PartcError as exc:
            raise _located(file, pointer, "the plan breaks a rule of its vocabulary: "
                           f"{exc.message}") from None
        except _FAULTS as exc:
            raise _fault(file, document, exc, pointer) from None

    seen: Placements = {}
    tensors = tuple(_located_tensor(file, document, i, t, seen)
                    for i, t in enumerate(_list(document.get("tensors", []))))
    boundary = checked("/boundary", partial(_boundary, document["boundary"]))
    groups = tuple(checked(f"/groups/{i}", partial(_group, g))
                   for i, g in enumerate(_list(document["groups"])))
    plan_cuts = None if cuts is None else tuple(
        checked(f"/cuts/{i}", partial(_cut, c)) for i, c in enumerate(_list(cuts)))
    return PlanFile(
        path=file, plan_hash=_str(document["plan_hash"]), family=_str(document["family"]),
        model_type=_optional_str(document.get("model_type")), shape=shape,
        topology=_topology(topology), topology_json=MappingProxyType(topology),
        tensors=tensors, ranks=ranks,
        graph=tuple(GraphGroup(group=_str(g["group"]),
                               unit_paths=tuple(_str(p) for p in g["unit_paths"]))
                    for g in _list(document.get("graph", []))),
        static_roles=tuple(_role(r) for r in _list(document.get("static_roles", []))),
        groups=groups, boundary=boundary, cuts=plan_cuts,
        expert_parallel=None if experts is None else _expert_parallel(experts),
        pipeline=None if pipeline is None else _pipeline(pipeline),
        sources=tuple(PlanSource(name=_str(e["name"]), sha256=_str(e["sha256"]))
                      for e in _list(document.get("sources", []))),
        config=_object(document.get("config", {})),
        omit=tuple(_str(t) for t in _list(document.get("omit", []))),
        checkpoint_fingerprint=_optional_str(document.get("checkpoint_fingerprint")),
        checkpoint_header_digest=_optional_str(document.get("checkpoint_header_digest")))


def _located_tensor(file: Path, document: object, index: int, entry: Mapping[str, Any],
                    checked: Placements) -> PlanTensor:
    """`_tensor(entry)`, a fault a LoadError located at the tensor: a placement with the wrong
    fields for its kind (the schema does not count them) at its placements, another where the
    schema puts it, else at the tensor."""
    try:
        return _tensor(entry, checked)
    except _Arity as exc:
        raise _located(file, f"/tensors/{index}/placements",
                       f"the plan breaks its schema: {exc}") from None
    except _FAULTS as exc:
        raise _fault(file, document, exc, f"/tensors/{index}") from None


def _list(value: object) -> Sequence[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected an array, found {value!r}")
    return value


def _check_ranks(file: Path, shape: ParallelShape, ranks: tuple[PlanRank, ...]) -> None:
    """The plan's ranks are the topology's, in order, each at its coordinates (and, under
    expert parallelism, its recorded dense replica, EP and ETP rank)."""
    def fault(message: str, pointer: str) -> LoadError:
        return _located(file, pointer, f"the plan disagrees with itself: {message}")

    if len(ranks) != shape.build_world_size:
        raise fault(f"it lists {len(ranks)} ranks but its topology ({shape.factors}) has "
                    f"{shape.build_world_size}", "/ranks")
    for index, rank in enumerate(ranks):
        at = shape.coordinates(index)
        found = (rank.rank, rank.pipeline_stage, rank.tensor_parallel_rank)
        if found != (index, at.pipeline_stage, at.tensor_parallel_rank):
            raise fault(f"rank entry {index} says rank {found[0]}, stage {found[1]}, tp rank "
                        f"{found[2]}; the topology puts rank {index} on stage "
                        f"{at.pipeline_stage}, tp rank {at.tensor_parallel_rank}",
                        f"/ranks/{index}")
        if shape.expert_parallel_size is None:
            continue
        info = rank.info
        recorded = (info.dense_replica, info.expert_parallel_rank,
                    info.expert_tensor_parallel_rank)
        if recorded != (at.dense_replica, at.expert_parallel_rank,
                        at.expert_tensor_parallel_rank):
            raise fault(f"rank {index} records dense replica {recorded[0]}, EP rank "
                        f"{recorded[1]}, ETP rank {recorded[2]}; the topology gives "
                        f"{at.dense_replica}, {at.expert_parallel_rank} and "
                        f"{at.expert_tensor_parallel_rank}", f"/ranks/{index}/info")
