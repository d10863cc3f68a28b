"""The records of a plan.json read back: one typed, frozen `PlanFile` and its parts (tensors,
ranks, groups and their owners, the boundary and cuts, the expert-parallel layout, the
pipeline choice, sources), built only by `plan_file.read_plan` (through `plan_decode`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.parallel.placements import tensor_bytes
from partc.parallel.shape import ParallelShape
from partc.partition.boundary import BoundaryWireSchema
from partc.partition.ownership import ParameterGroupOwner


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
