"""A build's plan.json read back: one typed, frozen view that inspect, explain, report, verify and
shard read instead of walking the JSON document.

`read_plan` reads the file once, builds the view, and turns anything the view trips over into
one LoadError located in the plan file: a value of the wrong type is explained by the plan
schema (`front.schema.plan_faults`: file, line and JSON pointer), and a plan that follows the
schema but disagrees with itself (its ranks against its topology) names the pointer and the
values. The schema is consulted only when the view cannot be built: a plan partc wrote follows
it by construction, and validating a full-size plan (tens of MB) costs seconds, so a sound plan
is read without jsonschema (a runtime-only install inspects it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from partc.errors import LayoutError, LoadError, SourceLocation
from partc.front.load import MAX_PLAN_BYTES, read_bytes
from partc.parallel.placements import tensor_bytes
from partc.parallel.shape import ParallelShape

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
    topology_json: Mapping[str, Any]
    """The `topology` object as written (read-only), for outputs that echo it."""
    tensors: tuple[PlanTensor, ...]
    """The global tensor table, in the plan's order."""
    ranks: tuple[PlanRank, ...]
    """Every rank, by build rank."""
    graph: tuple[GraphGroup, ...]
    """The execution groups, canonical order."""
    static_roles: tuple[StaticRolePlace, ...]
    """The static roles and their places, declaration order."""
    omit: tuple[str, ...]
    """Checkpoint tensors no rank loads (`omit`)."""
    checkpoint_fingerprint: str | None
    """sha256 over the checkpoint header the plan was compiled against (None: none given)."""
    checkpoint_header_digest: str | None
    """sha256 of that checkpoint's stored header bytes."""
    document: Mapping[str, Any]
    """The whole parsed document, for the parts not typed here (groups, boundary, cuts,
    pipeline, expert_parallel); treat it as read-only."""

    def tensor_bytes_total(self) -> int:
        """Bytes of every tensor of the global table."""
        return sum(tensor_bytes(t.dtype, t.shape) for t in self.tensors)


def read_plan(path: str | Path, *, label: str | None = None, hint: str = "") -> PlanFile:
    """Read, check and type a plan.json; one LoadError located in the file when it cannot be
    read as a plan. `label` names the file in read errors (default `a plan from <path>`),
    `hint` is added to them."""
    file = Path(path)
    where = SourceLocation(str(file))
    label = f"a plan from {file}" if label is None else label
    tail = f"; {hint}" if hint else ""
    try:  # a regular file only, checked before it is opened: a FIFO would block the read
        document = json.loads(read_bytes(file, label, MAX_PLAN_BYTES).decode())
    except LoadError as exc:
        raise LoadError(f"{exc.message}{tail}", location=where) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoadError(f"cannot read {label}: {exc}{tail}", location=where) from None
    missing = [key for key in PLAN_KEYS if not isinstance(document, dict) or key not in document]
    if missing:
        raise LoadError(f"{file} is not a partc plan: it lacks {', '.join(missing)}",
                        location=where)
    try:
        return _plan_file(file, document)
    except (TypeError, KeyError, ValueError, IndexError, AttributeError):
        from partc.front.schema import plan_faults

        with plan_faults(file, document):
            raise
        raise  # pragma: no cover - plan_faults re-raises


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
    if not isinstance(values, list):
        raise TypeError(f"expected an array, found {values!r}")
    return tuple(_int(v) for v in values)


def _optional_str(value: object) -> str | None:
    return None if value is None else _str(value)


def _tensor(entry: Mapping[str, Any]) -> PlanTensor:
    placements = entry["placements"]
    if not isinstance(placements, list) or not all(isinstance(p, list) and p
                                                   for p in placements):
        raise TypeError(f"expected an array of placements, found {placements!r}")
    return PlanTensor(target=_str(entry["target"]), dtype=_str(entry["dtype"]),
                      shape=_ints(entry["shape"]), group=_str(entry["group"]),
                      stages=_ints(entry["stages"]),
                      placements=tuple(tuple(p) for p in placements),
                      kv_replicas=_int(entry.get("kv_replicas", 1)),
                      needs_tp_reduction=bool(entry.get("needs_tp_reduction", False)),
                      needs_tp_output_reduction=bool(entry.get("needs_tp_output_reduction",
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
                      expert_tensor_parallel_rank=None if etp is None else _int(etp)),
        units=tuple(units),
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


def _plan_file(file: Path, document: dict[str, Any]) -> PlanFile:
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
    return PlanFile(
        path=file, plan_hash=_str(document["plan_hash"]), family=_str(document["family"]),
        model_type=_optional_str(document.get("model_type")), shape=shape,
        topology_json=MappingProxyType(topology),
        tensors=tuple(_tensor(t) for t in _list(document["tensors"])), ranks=ranks,
        graph=tuple(GraphGroup(group=_str(g["group"]),
                               unit_paths=tuple(_str(p) for p in g["unit_paths"]))
                    for g in _list(document.get("graph", []))),
        static_roles=tuple(_role(r) for r in _list(document.get("static_roles", []))),
        omit=tuple(_str(t) for t in _list(document.get("omit", []))),
        checkpoint_fingerprint=_optional_str(document.get("checkpoint_fingerprint")),
        checkpoint_header_digest=_optional_str(document.get("checkpoint_header_digest")),
        document=MappingProxyType(document))


def _list(value: object) -> Sequence[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected an array, found {value!r}")
    return value


def _check_ranks(file: Path, shape: ParallelShape, ranks: tuple[PlanRank, ...]) -> None:
    """The plan's ranks are the topology's, in order, each at its coordinates (and, under
    expert parallelism, its recorded dense replica, EP and ETP rank)."""
    def fault(message: str, pointer: str) -> LoadError:
        return LoadError(f"the plan disagrees with itself: {message}; it was edited, or not "
                         "written by partc: compile the build again",
                         location=SourceLocation(str(file)), pointer=pointer)

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
