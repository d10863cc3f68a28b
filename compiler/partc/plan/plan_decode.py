"""A parsed plan document decoded into its typed records (`plan_records`), field by field: a
value of the wrong kind raises TypeError, KeyError or ValueError (which `plan_file.read_plan`
locates), a plan whose ranks disagree with its topology a located LoadError."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from partc.errors import LayoutError, LoadError, PartcError, SourceLocation
from partc.parallel.shape import ParallelShape
from partc.partition.boundary import BoundaryWireSchema
from partc.partition.ownership import owner_from_json
from partc.plan.plan_errors import _FAULTS, _fault, _located
from partc.plan.plan_records import (
    ExpertParallelLayout,
    GraphGroup,
    PipelineChoice,
    PlanCut,
    PlanFile,
    PlanGroup,
    PlanRank,
    PlanSource,
    PlanStateTensor,
    PlanTensor,
    PlanTopology,
    RankInfo,
    StaticRolePlace,
    UnitRange,
)

_T = TypeVar("_T")


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
