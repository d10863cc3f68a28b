"""Stage 5: realize a bound architecture for a topology (TP x PP) as a frozen, canonical plan IR.

Global rank g = stage * T + tensor_parallel_rank (TP innermost). Every parameter group is
realized once for T (`parallel.realize_group`); each pipeline stage keeps the groups its
partition owns (`partition.realize_partition`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partc import __version__
from partc.boundary import PipelineActivationDtype as PipelineActivationDtype
from partc.boundary import PipelineWireContract
from partc.errors import LayoutError, PartcError
from partc.parallel import (
    LocalModelLayout,
    LocalTensorLayout,
    ParallelModelInfo,
    ShardingPolicy,
    realize_group,
)
from partc.partition import ArchitecturePartition, OwnerKind, realize_partition

if TYPE_CHECKING:
    from partc.bind import BoundArchitecture


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A parallel topology and the options that shape its realization."""

    tensor_parallel_size: int
    """T: ranks per stage."""
    pipeline_parallel_size: int
    """S: pipeline stages."""
    stage_units: tuple[int, ...] | None = None
    """Explicit units per stage (None: balanced)."""
    policy: ShardingPolicy | None = None
    """Sharding policy override (None: the family's, else Require)."""
    activation_dtype: PipelineActivationDtype = PipelineActivationDtype.BFLOAT16
    """Dtype of activations on the pipeline wire."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise LayoutError(f"tensor_parallel_size must be >= 1, found "
                              f"{self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise LayoutError(f"pipeline_parallel_size must be >= 1, found "
                              f"{self.pipeline_parallel_size}")

    @property
    def world_size(self) -> int:
        """T * S."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "stage_units": list(self.stage_units) if self.stage_units else None,
            "policy": self.policy.value if self.policy else None,
            "activation_dtype": self.activation_dtype.value,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """Everything one rank needs: its partition, its tensor layouts and its accounting."""

    rank: int
    """Global rank."""
    tensor_parallel_rank: int
    """Rank within the stage."""
    pipeline_stage: int
    """Stage."""
    partition: ArchitecturePartition
    """The stage's architecture partition."""
    layout: LocalModelLayout
    """This rank's tensors."""
    info: ParallelModelInfo
    """Topology and byte accounting."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalTensor:
    """One checkpoint tensor in the global view: where it lives."""

    target: str
    """Checkpoint name."""
    dtype: str
    """Safetensors dtype."""
    shape: tuple[int, ...]
    """Global shape."""
    group: str
    """Owning parameter group."""
    owner: dict[str, object]
    """The group's owner (JSON form)."""
    stages: tuple[int, ...]
    """Pipeline stages that load it (Omit on every other)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The frozen plan IR of one (family, config, topology)."""

    family: str
    """Family name."""
    model_type: str
    """HF model type."""
    topology: Topology
    """The topology realized."""
    sources: tuple[tuple[str, str], ...]
    """Input names and their sha256, sorted."""
    config_values: tuple[tuple[str, Any], ...]
    """Bound config values."""
    graph: tuple[tuple[str, tuple[str, ...], bool, tuple[str, ...]], ...]
    """Execution groups: (name, unit paths, carries state, dependencies), canonical order."""
    static_roles: tuple[tuple[str, str], ...]
    """Static roles and sides."""
    boundary: dict[str, object]
    """Boundary wire schema (JSON form)."""
    tensors: tuple[GlobalTensor, ...]
    """Global tensor table, sorted by target."""
    ranks: tuple[RankPlan, ...]
    """Per-rank plans, by global rank."""
    checkpoint_fingerprint: str | None = None
    """sha256 over the checkpoint header's (name, dtype, shape) when one was given."""

    @property
    def global_parameter_bytes(self) -> int:
        """Bytes of every tensor of the checkpoint."""
        from partc.parallel import tensor_bytes

        return sum(tensor_bytes(t.dtype, t.shape) for t in self.tensors)

    def to_json(self) -> dict[str, object]:
        """The canonical JSON document (validates against `schemas/plan.schema.json`)."""
        body = self._body()
        body["plan_hash"] = plan_hash(body)
        return body

    def _body(self) -> dict[str, Any]:
        return {
            "partc_version": __version__,
            "family": self.family,
            "model_type": self.model_type,
            "topology": self.topology.to_json(),
            "sources": [{"name": n, "sha256": h} for n, h in self.sources],
            "checkpoint_fingerprint": self.checkpoint_fingerprint,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.config_values},
            "graph": [{"group": n, "unit_paths": list(p), "state": s, "after": list(a)}
                      for n, p, s, a in self.graph],
            "static_roles": [{"role": n, "stage": s} for n, s in self.static_roles],
            "boundary": self.boundary,
            "groups": self._groups_json(),
            "tensors": self._tensors_json(),
            "ranks": [_rank_json(r) for r in self.ranks],
        }

    def _stage_ranks(self) -> dict[int, list[RankPlan]]:
        by_stage: dict[int, list[RankPlan]] = {}
        for rank in self.ranks:
            by_stage.setdefault(rank.pipeline_stage, []).append(rank)
        return by_stage

    def _groups_json(self) -> list[dict[str, object]]:
        """Each parameter group: owner, logical units and every TP rank's logical range."""
        first = {t.group: t for t in reversed(self.tensors)}
        by_stage = self._stage_ranks()
        out = []
        for name in sorted(first):
            tensor = first[name]
            ranks = by_stage[tensor.stages[0]]
            layouts = [r.layout[tensor.target] for r in ranks]
            out.append({
                "name": name, "role": layouts[0].role.value, "owner": tensor.owner,
                "stages": list(tensor.stages), "logical_units": layouts[0].logical_units,
                "logical_ranges": None if layouts[0].logical_range is None else
                [list(x.logical_range or ()) for x in layouts],
                "fell_back_to_replication": layouts[0].fell_back_to_replication})
        return out

    def _tensors_json(self) -> list[dict[str, object]]:
        """Each checkpoint tensor: dtype, shape, group, stages and its placement on each TP rank."""
        by_stage = self._stage_ranks()
        out = []
        for tensor in self.tensors:
            layouts = [r.layout[tensor.target] for r in by_stage[tensor.stages[0]]]
            out.append({"target": tensor.target, "dtype": tensor.dtype,
                        "shape": list(tensor.shape), "group": tensor.group,
                        "stages": list(tensor.stages), "kv_replicas": layouts[0].kv_replicas,
                        "placements": [list(_compact_json(x.placement.to_compact()))
                                       for x in layouts]})
        return out


def _compact_json(value: tuple[object, ...]) -> list[object]:
    return [[list(r) for r in v] if isinstance(v, tuple) else v for v in value]


def _rank_json(r: RankPlan) -> dict[str, object]:
    info = r.info
    return {
        "rank": r.rank, "tensor_parallel_rank": r.tensor_parallel_rank,
        "pipeline_stage": r.pipeline_stage, "partition": r.partition.to_json(),
        "info": {"owned_tensors": info.owned_tensors,
                 "local_parameter_bytes": info.local_parameter_bytes,
                 "global_parameter_bytes": info.global_parameter_bytes,
                 "pinned_parameter_bytes": info.pinned_parameter_bytes,
                 "maximum_device_parameter_bytes": info.maximum_device_parameter_bytes,
                 "local_bytes_by_dtype": dict(info.local_bytes_by_dtype)},
    }


def canonical_json(data: object) -> str:
    """Deterministic JSON text: sorted keys, compact separators, ASCII only, trailing newline."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"


def plan_hash(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a plan body (without its own hash)."""
    clean = {k: v for k, v in body.items() if k != "plan_hash"}
    return hashlib.sha256(canonical_json(clean).encode()).hexdigest()


def realize_plan(bound: BoundArchitecture, topology: Topology, *,
                 sources: tuple[tuple[str, str], ...] = (),
                 checkpoint_fingerprint: str | None = None,
                 group_location: Any = None) -> Plan:
    """The plan of `bound` for `topology`; raises LayoutError (located when possible)."""
    tp, pp = topology.tensor_parallel_size, topology.pipeline_parallel_size
    policy = topology.policy or bound.policy or ShardingPolicy.REQUIRE
    description = bound.description
    realized: dict[str, tuple[tuple[LocalTensorLayout, ...], ...]] = {}
    for owned in description.groups:
        try:
            realized[owned.group.name] = realize_group(
                owned.group, tp, policy, policy_overrides_group=topology.policy is not None)
        except PartcError as error:
            if group_location is not None:
                group_location(error, owned.group.name)
            raise
    wire = PipelineWireContract(schema=bound.boundary, activation_dtype=topology.activation_dtype)
    partitions = [realize_partition(description, s, pp, topology.stage_units, boundary=wire)
                  for s in range(pp)]
    ranks = []
    tensors_by_stage: dict[str, list[int]] = {}
    for stage, partition in enumerate(partitions):
        local_targets = set(partition.parameter_targets)
        local_groups = [owned.group for owned in description.groups
                        if owned.group.members[0].target in local_targets]
        for group in local_groups:
            for member in group.members:
                tensors_by_stage.setdefault(member.target, []).append(stage)
        for tp_rank in range(tp):
            layouts = [layout for group in local_groups
                       for layout in realized[group.name][tp_rank]]
            ranks.append((stage, tp_rank, partition, LocalModelLayout(tensors=tuple(layouts))))
    global_bytes = sum(m.nbytes for g in description.groups for m in g.group.members)
    layouts = [layout for _, _, _, layout in ranks]
    maximum = max(layout.local_bytes for layout in layouts)
    rank_plans = []
    for rank, (stage, tp_rank, partition, layout) in enumerate(ranks):
        info = ParallelModelInfo.from_layouts(
            model_type=bound.model_type, tensor_parallel_size=tp, pipeline_parallel_size=pp,
            rank=rank, layouts=layouts, global_parameter_bytes=global_bytes,
            maximum_device_parameter_bytes=maximum)
        rank_plans.append(RankPlan(rank=rank, tensor_parallel_rank=tp_rank,
                                   pipeline_stage=stage, partition=partition, layout=layout,
                                   info=info))
    table = []
    for owned in description.groups:
        owner = owned.owner.to_json()
        for member in owned.group.members:
            table.append(GlobalTensor(target=member.target, dtype=member.dtype, shape=member.shape,
                                      group=owned.group.name, owner=owner,
                                      stages=tuple(tensors_by_stage.get(member.target, ()))))
    unowned = [t.target for t in table if not t.stages]
    if unowned:
        raise LayoutError(f"tensor `{unowned[0]}` is loaded by no pipeline stage (its owner is "
                          "a static role no stage holds)", tensor=unowned[0])
    graph = description.graph
    return Plan(
        family=bound.family, model_type=bound.model_type, topology=topology, sources=sources,
        config_values=bound.config_values,
        graph=tuple((g.name, g.unit_paths, g.carries_state, g.dependencies)
                    for g in graph.canonical_order()),
        static_roles=tuple((r.name, r.side.value) for r in description.static_roles),
        boundary=bound.boundary.to_json(), tensors=tuple(sorted(table, key=lambda t: t.target)),
        ranks=tuple(rank_plans), checkpoint_fingerprint=checkpoint_fingerprint)


def static_owner_kinds() -> tuple[OwnerKind, ...]:
    """Owner kinds that are not execution units."""
    return (OwnerKind.STATIC_ROLE, OwnerKind.STATIC_ANY_OF)
