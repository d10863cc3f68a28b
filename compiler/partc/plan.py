"""Stage 5: realize a bound architecture for a topology (TP x PP) as a frozen, canonical plan IR.

Global rank g = stage * T + tensor_parallel_rank (TP innermost). Every parameter group is
realized once for T (`parallel.realize_group`); each pipeline stage keeps the groups its
partition owns (`partition.realize_partition`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from partc import __version__
from partc.errors import LayoutError, SourceLocation
from partc.parallel.experts import (
    ExpertGroup,
    ExpertPlacement,
    RankCoordinates,
    expert_axis_problem,
    stacked_expert_layouts,
    stage_ranks,
)
from partc.parallel.layout import LocalModelLayout, LocalTensorLayout, ParallelModelInfo
from partc.parallel.realize import TensorSplit, realize_group_template
from partc.parallel.specs import ParameterGroupSpec, ShardingPolicy
from partc.partition.boundary import (
    BoundaryWireSchema,
    PipelineActivationDtype,
    PipelineWireContract,
)
from partc.partition.ownership import (
    ExecutionGroupSpec,
    ExecutionUnit,
    GroupParallelMode,
    ParameterGroupOwner,
    StaticRoleSpec,
)
from partc.partition.pipeline import ArchitecturePartition, realize_partition
from partc.partition.stages import StageLayout, choose_stages, spell_layout

if TYPE_CHECKING:
    from partc.bind.binder import BoundArchitecture
    from partc.partition.ownership import ArchitectureParameterDescription, ExecutionGraph


GroupSite = Callable[[str], "tuple[SourceLocation, str] | None"]
"""Where a parameter group (by name) is declared: source location and JSON pointer, or None."""


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
    activation_dtype: PipelineActivationDtype | None = None
    """Dtype of activations on the pipeline wire (None: the model's own, `model_activation_dtype`;
    a plan always records the resolved dtype)."""
    stage_layout: StageLayout | None = None
    """Explicit units per stage and execution group (`--pp-layers vision*3|decoder*2`)."""
    group_modes: tuple[tuple[str, GroupParallelMode], ...] = ()
    """Parallel mode per execution group chosen at compile time (`--group-mode`), overriding
    the family's `parallel:`."""
    split: TensorSplit = TensorSplit.BALANCED
    """How uneven splits give out the remainder (`--split`; the JSON key `split` is present only
    for `chunk`, so balanced plans read as before)."""
    expert_parallel_size: int | None = None
    """E: expert-parallel ranks per stage (None: no expert parallelism, every expert split
    over the T ranks; docs/expert_parallel.md)."""
    expert_tensor_parallel_size: int = 1
    """X: ranks splitting each expert (Megatron's ETP); a stage has N = E * X ranks."""
    expert_placement: ExpertPlacement | None = None
    """An explicit placement (a placement file); None: balanced contiguous ranges."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise LayoutError(f"tensor_parallel_size must be >= 1, found "
                              f"{self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise LayoutError(f"pipeline_parallel_size must be >= 1, found "
                              f"{self.pipeline_parallel_size}")
        _check_expert_topology(self)

    @property
    def ranks_per_stage(self) -> int:
        """N: E * X under expert parallelism, else T."""
        return stage_ranks(self.tensor_parallel_size, self.expert_parallel_size,
                           self.expert_tensor_parallel_size)

    @property
    def world_size(self) -> int:
        """N * S (T * S without expert parallelism)."""
        return self.ranks_per_stage * self.pipeline_parallel_size

    def to_json(self) -> dict[str, object]:
        """JSON form (the expert-parallel keys only under expert parallelism)."""
        spelled: dict[str, object] = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "stage_units": list(self.stage_units) if self.stage_units else None,
            "policy": self.policy.value if self.policy else None,
            "activation_dtype": None if self.activation_dtype is None
            else self.activation_dtype.value,
        }
        spelled = spelled | ({} if self.stage_layout is None else {"stage_layout": [
            [[g, n] for g, n in runs] for runs in self.stage_layout]}) | (
            {"group_modes": {g: m.value for g, m in self.group_modes}} if self.group_modes
            else {}) | (
            {} if self.split is TensorSplit.BALANCED else {"split": self.split.value})
        if self.expert_parallel_size is not None:
            spelled["expert_parallel_size"] = self.expert_parallel_size
            spelled["expert_tensor_parallel_size"] = self.expert_tensor_parallel_size
        return spelled


def _check_expert_topology(topology: Topology) -> None:
    """E, X and the placement agree with each other and with T (docs/expert_parallel.md)."""
    ep, etp, t = (topology.expert_parallel_size, topology.expert_tensor_parallel_size,
                  topology.tensor_parallel_size)
    if ep is None:
        if etp != 1 or topology.expert_placement is not None:
            raise LayoutError("--etp and --expert-placement need expert parallelism: give "
                              "--ep (the expert-parallel size)")
        return
    if ep < 1 or etp < 1:
        raise LayoutError(f"expert_parallel_size and expert_tensor_parallel_size must be >= 1, "
                          f"found {ep} and {etp}")
    if (ep * etp) % t:
        raise LayoutError(
            f"a stage has N = expert_parallel_size {ep} x expert_tensor_parallel_size {etp} = "
            f"{ep * etp} ranks, not a multiple of tensor_parallel_size {t}: the dense parts "
            f"(split over T ranks) are repeated N / T times; choose T dividing {ep * etp}")
    placement = topology.expert_placement
    if placement is not None and placement.expert_parallel_size != ep:
        raise LayoutError(f"the expert placement lists {placement.expert_parallel_size} EP "
                          f"ranks but expert_parallel_size is {ep}")


Accounting = tuple[int, int, tuple[tuple[str, int], ...]]
"""(local bytes, pinned bytes, local bytes by dtype) of one group on one tensor-parallel rank."""


def _accounting(layouts: tuple[LocalTensorLayout, ...]) -> Accounting:
    sizes = [(x.dtype, x.local_bytes, x.placement.holds_whole) for x in layouts]
    by_dtype: dict[str, int] = {}
    for dtype, nbytes, _ in sizes:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return (sum(n for _, n, _ in sizes), sum(n for _, n, whole in sizes if whole),
            tuple(sorted(by_dtype.items())))


class KindIndex(enum.Enum):
    """Which coordinate of a rank selects its row of a GroupKind's layouts."""

    TENSOR = "tensor"
    """The dense TP rank (T rows): every group without expert parallelism."""
    EXPERT_TENSOR = "expert_tensor"
    """The ETP rank (X rows): a per-expert group under expert parallelism."""
    LOCAL = "local"
    """The stage-local rank (N rows): a stacked expert group under expert parallelism."""


@dataclass(frozen=True, slots=True)
class GroupKind:
    """The realization shared by every parameter group of one structure (groups that differ
    only in names, such as the experts of a layer): per tensor-parallel rank, per member."""

    layouts: tuple[tuple[LocalTensorLayout, ...], ...]
    """Outer index: tensor-parallel rank (see `index`); inner: member. Named after the kind's
    first group."""
    index: KindIndex = KindIndex.TENSOR
    """Which rank coordinate indexes `layouts` (expert kinds under expert parallelism)."""
    rank_accounting: tuple[Accounting, ...] = field(init=False, compare=False, repr=False)
    """Per tensor-parallel rank, the accounting of one group of this kind (derived on
    construction)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_accounting",
                           tuple(_accounting(layouts) for layouts in self.layouts))

    def accounting(self, tensor_parallel_rank: int) -> Accounting:
        """(local bytes, pinned bytes, local bytes by dtype) of one group of this kind on a rank."""
        return self.rank_accounting[tensor_parallel_rank]

    def row(self, tensor_parallel_rank: int, coordinates: RankCoordinates | None) -> int:
        """The row of `layouts` a rank uses: its TP rank, or under expert parallelism its ETP
        rank (per-expert kinds) or stage-local rank (stacked kinds)."""
        if coordinates is None or self.index is KindIndex.TENSOR:
            return tensor_parallel_rank
        if self.index is KindIndex.EXPERT_TENSOR:
            return coordinates.expert_tensor_parallel_rank
        return coordinates.local_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedGroup:
    """One parameter group of the plan: its names, owner, structure and stages."""

    name: str
    """Logical name."""
    owner: ParameterGroupOwner
    """Who owns it (a static role or an execution unit)."""
    targets: tuple[str, ...]
    """Checkpoint names of its members, in member order."""
    kind: int
    """Index of its GroupKind in `Plan.kinds`."""
    stages: tuple[int, ...]
    """Pipeline stages that load it."""


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """Everything one rank needs: its partition, its parameter groups and its accounting.

    Not slotted: `layout` is a `functools.cached_property`, derived from the fields on first
    use (large models have ~10^4 tensors per rank and a compile needs none of them); the
    fields never change and equality sees only them.
    """

    rank: int
    """Global rank."""
    tensor_parallel_rank: int
    """Rank within the stage."""
    pipeline_stage: int
    """Stage."""
    partition: ArchitecturePartition
    """The stage's architecture partition."""
    info: ParallelModelInfo
    """Topology and byte accounting."""
    groups: tuple[PlannedGroup, ...] = field(repr=False)
    """The stage's parameter groups, in binding order (shared by the stage's ranks)."""
    kinds: tuple[GroupKind, ...] = field(repr=False)
    """The plan's group kinds (`PlannedGroup.kind` indexes it)."""
    coordinates: RankCoordinates | None = None
    """Under expert parallelism: the rank's stage-local, dense-replica, EP and ETP coordinates
    (its `groups` are then the stage's dense groups and its own experts)."""

    @cached_property
    def layout(self) -> LocalModelLayout:
        """This rank's tensors (derived on first use, then kept)."""
        t, c = self.tensor_parallel_rank, self.coordinates
        return LocalModelLayout(tensors=tuple(
            layout.renamed(target, group.name)
            for group in self.groups
            for layout, target in zip(
                self.kinds[group.kind].layouts[self.kinds[group.kind].row(t, c)],
                group.targets, strict=True)))

    def to_json(self) -> dict[str, object]:
        """JSON form (the plan's `ranks` entries)."""
        info = self.info
        return {
            "rank": self.rank, "tensor_parallel_rank": self.tensor_parallel_rank,
            "pipeline_stage": self.pipeline_stage, "partition": self.partition.to_json(),
            "info": {"owned_tensors": info.owned_tensors,
                     "local_parameter_bytes": info.local_parameter_bytes,
                     "global_parameter_bytes": info.global_parameter_bytes,
                     "pinned_parameter_bytes": info.pinned_parameter_bytes,
                     "maximum_device_parameter_bytes": info.maximum_device_parameter_bytes,
                     "local_bytes_by_dtype": dict(info.local_bytes_by_dtype)}
            | ({} if self.coordinates is None else info.expert_json()),
        }


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
    owner: ParameterGroupOwner
    """The group's owner."""
    stages: tuple[int, ...]
    """Pipeline stages that load it (Omit on every other)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSummary:
    """How the stages of a multi-group graph were chosen, and what each holds."""

    balance: str
    """`bytes`, `weight`, `units` or `explicit`."""
    layout: str
    """The stage layout in Megatron's notation (`partition.stages`)."""
    stage_bytes: tuple[int, ...]
    """Parameter bytes of each stage on its largest tensor-parallel rank."""
    group_modes: tuple[tuple[str, GroupParallelMode], ...]
    """Parallel mode of every execution group, canonical order."""

    @property
    def imbalance(self) -> float:
        """Largest stage bytes over the mean stage bytes (1.0: perfectly even)."""
        mean = sum(self.stage_bytes) / len(self.stage_bytes)
        return max(self.stage_bytes) / mean if mean else 1.0

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        return {"balance": self.balance, "layout": self.layout,
                "stage_bytes": list(self.stage_bytes),
                "imbalance": round(self.imbalance, 6),
                "group_modes": {g: m.value for g, m in self.group_modes}}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The frozen plan IR of one (family, config, topology).

    Not slotted: `tensors` and `document` are `functools.cached_property` values, derived from
    the fields on first use and then kept (the tensor table has ~10^5 entries for the largest
    models); the fields never change and equality sees only them.
    """

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
    graph: tuple[ExecutionGroupSpec, ...]
    """Execution groups in canonical order."""
    static_roles: tuple[StaticRoleSpec, ...]
    """Static roles and their sides, in declaration order."""
    boundary: BoundaryWireSchema
    """What crosses a pipeline cut."""
    groups: tuple[PlannedGroup, ...]
    """Every parameter group, in declaration order."""
    kinds: tuple[GroupKind, ...]
    """Realizations shared by groups of one structure, in order of first use."""
    ranks: tuple[RankPlan, ...]
    """Per-rank plans, by global rank."""
    checkpoint_fingerprint: str | None = None
    """sha256 over the checkpoint header's (name, dtype, shape) when one was given."""
    checkpoint_header_digest: str | None = None
    """sha256 of that checkpoint's stored header bytes (lets a loader skip the fingerprint)."""
    payload_digests: tuple[tuple[tuple[str, str], ...], ...] | None = None
    """Per rank, (target, sha256 of its rank-local bytes) sorted by target; only when compiled
    with `--digests` (the JSON key `digests` is absent otherwise)."""
    omitted: tuple[str, ...] = ()
    """Checkpoint tensors the family's `omit` globs matched: loaded by no rank (the JSON key
    `omitted` is absent when there are none)."""
    pipeline: PipelineSummary | None = None
    """How a multi-group graph was cut into stages (the JSON key `pipeline` is absent for a
    single-group graph, whose stages are balanced by unit count)."""
    cuts: tuple[tuple[int, str, BoundaryWireSchema], ...] = ()
    """Per pipeline cut, when the family declares boundaries per execution group: (the stage
    before the cut, the group of the unit before it, what crosses it); JSON key `cuts`."""
    expert_parallel: ExpertParallelPlan | None = None
    """The expert-parallel layout and placement (the JSON key `expert_parallel` is absent
    without expert parallelism)."""

    @cached_property
    def tensors(self) -> tuple[GlobalTensor, ...]:
        """Global tensor table, sorted by target (derived on first use, then kept)."""
        table = [GlobalTensor(target=target, dtype=layout.dtype, shape=layout.global_shape,
                              group=group.name, owner=group.owner, stages=group.stages)
                 for group in self.groups
                 for layout, target in zip(self.kinds[group.kind].layouts[0], group.targets,
                                           strict=True)]
        return tuple(sorted(table, key=lambda t: t.target))

    @property
    def global_parameter_bytes(self) -> int:
        """Bytes of every tensor of the checkpoint."""
        from partc.parallel.layout import tensor_bytes

        return sum(tensor_bytes(t.dtype, t.shape) for t in self.tensors)

    def to_json(self) -> dict[str, object]:
        """The canonical JSON document (validates against `schemas/plan.schema.json`)."""
        body = self._body()
        body["tensors"] = self._tensors_json()
        body["plan_hash"] = plan_hash(body)
        return body

    @property
    def plan_hash(self) -> str:
        """The content hash of the plan (`plan_hash` of its JSON document)."""
        return str(self.document[0]["plan_hash"])

    @cached_property
    def document(self) -> tuple[dict[str, Any], str]:
        """`to_json()` without its `tensors` list, and the canonical text of the whole document
        (equal to `canonical_json(to_json())`), each part encoded once; derived on first use,
        then kept (treat the dict as read-only).

        The tensor table (~10^5 entries for the largest models) is spelled directly from the
        group kinds, whose shape and placement text its tensors share.
        """
        body = self._body()
        parts = {key: canonical_json(value)[:-1] for key, value in body.items()}
        parts["tensors"] = self._tensors_text()
        digest = hashlib.sha256((_object_text(parts) + "\n").encode()).hexdigest()
        body["plan_hash"] = digest
        parts["plan_hash"] = _string(digest)
        return body, _object_text(parts) + "\n"

    def _body(self) -> dict[str, Any]:
        return {
            "partc_version": __version__,
            "family": self.family,
            "model_type": self.model_type,
            "topology": self.topology.to_json(),
            "sources": [{"name": n, "sha256": h} for n, h in self.sources],
            "checkpoint_fingerprint": self.checkpoint_fingerprint,
            "checkpoint_header_digest": self.checkpoint_header_digest,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.config_values},
            "graph": [{"group": g.name, "unit_paths": list(g.unit_paths),
                       "state": g.carries_state, "after": list(g.dependencies)}
                      for g in self.graph],
            "static_roles": [{"role": r.name, "stage": r.spell()} for r in self.static_roles],
            "boundary": self.boundary.to_json(),
            "groups": self._groups_json(),
            "ranks": [r.to_json() for r in self.ranks],
        } | ({} if self.pipeline is None else {"pipeline": self.pipeline.to_json()}) | (
            {"cuts": [{"after_stage": s, "group": g, "boundary": b.to_json()}
                      for s, g, b in self.cuts]} if self.cuts else {}) | (
            {} if self.payload_digests is None else {
            "digests": [dict(rank) for rank in self.payload_digests]}) | (
            {"omitted": list(self.omitted)} if self.omitted else {}) | (
            {} if self.expert_parallel is None
            else {"expert_parallel": self.expert_parallel.to_json()})

    def _groups_json(self) -> list[dict[str, object]]:
        """Each parameter group: owner, logical units and every TP rank's logical range."""
        out: list[dict[str, object]] = []
        for group in sorted(self.groups, key=lambda g: g.name):
            layouts = [rank[0] for rank in self.kinds[group.kind].layouts]
            first = layouts[0]
            out.append({
                "name": group.name, "role": first.role.value, "owner": group.owner.to_json(),
                "stages": list(group.stages), "logical_units": first.logical_units,
                "logical_ranges": None if first.logical_range is None else
                [list(x.logical_range or ()) for x in layouts],
                "fell_back_to_replication": first.fell_back_to_replication})
        return out

    def _tensors_json(self) -> list[dict[str, object]]:
        """Each checkpoint tensor: dtype, shape, group, stages and its placement on each TP rank.

        Groups of one kind share the shape and placement lists (the text is the same).
        """
        members: dict[int, list[tuple[str, list[int], int, list[list[object]], bool]]] = {}
        out = []
        for group in self.groups:
            shared = members.get(group.kind)
            if shared is None:
                layouts = self.kinds[group.kind].layouts
                shared = members[group.kind] = [
                    (first.dtype, list(first.global_shape), first.kv_replicas,
                     [_compact_json(rank[i].placement.to_compact()) for rank in layouts],
                     any(rank[i].needs_tp_reduction for rank in layouts))
                    for i, first in enumerate(layouts[0])]
            stages = list(group.stages)
            for target, (dtype, shape, kv_replicas, placements, reduced) in zip(
                    group.targets, shared, strict=True):
                out.append({"target": target, "dtype": dtype, "shape": shape,
                            "group": group.name, "stages": stages, "kv_replicas": kv_replicas,
                            "placements": placements}
                           | ({"needs_tp_reduction": True} if reduced else {}))
        out.sort(key=lambda t: t["target"])  # type: ignore[arg-type, return-value]
        return out


    def _tensors_text(self) -> str:
        """The canonical JSON text of `_tensors_json()`, written without building it."""
        members: dict[int, list[tuple[str, str]]] = {}
        stage_texts: dict[tuple[int, ...], str] = {}
        entries = []
        for group in self.groups:
            shared = members.get(group.kind)
            if shared is None:
                layouts = self.kinds[group.kind].layouts
                shared = members[group.kind] = [
                    ('{"dtype":' + _string(first.dtype) + ',"group":',
                     f',"kv_replicas":{first.kv_replicas},'
                     + ('"needs_tp_reduction":true,' if any(
                         rank[i].needs_tp_reduction for rank in layouts) else '')
                     + '"placements":'
                     + _text([_compact_json(rank[i].placement.to_compact()) for rank in layouts])
                     + ',"shape":' + _text(list(first.global_shape)) + ',"stages":')
                    for i, first in enumerate(layouts[0])]
            middle = _string(group.name)
            tail = stage_texts.get(group.stages)
            if tail is None:
                tail = stage_texts[group.stages] = _text(list(group.stages)) + ',"target":'
            for target, (head, body) in zip(group.targets, shared, strict=True):
                entries.append((target, head + middle + body + tail + _string(target) + "}"))
        entries.sort(key=lambda entry: entry[0])
        return "[" + ",".join(text for _, text in entries) + "]"


_string: Callable[[str], str] = json.encoder.encode_basestring_ascii
"""A str as a JSON string with ASCII escapes, exactly as `canonical_json` spells it."""


def _text(value: object) -> str:
    """Canonical JSON text of a value, without the trailing newline."""
    return canonical_json(value)[:-1]


def _object_text(parts: dict[str, str]) -> str:
    """Canonical JSON text of an object whose values are already encoded."""
    return "{" + ",".join(_string(key) + ":" + parts[key] for key in sorted(parts)) + "}"


def _compact_json(value: tuple[object, ...]) -> list[object]:
    return [[list(r) for r in v] if isinstance(v, tuple) else v for v in value]


def canonical_json(data: object) -> str:
    """Deterministic JSON text: sorted keys, compact separators, ASCII only, trailing newline."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"


def plan_hash(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a plan body (without its own hash)."""
    clean = {k: v for k, v in body.items() if k != "plan_hash"}
    return hashlib.sha256(canonical_json(clean).encode()).hexdigest()


_ACTIVATION_DTYPES = {"F32": PipelineActivationDtype.FLOAT32,
                      "F16": PipelineActivationDtype.FLOAT16,
                      "BF16": PipelineActivationDtype.BFLOAT16}
"""Checkpoint float dtypes that are also pipeline activation dtypes."""


def model_activation_dtype(bound: BoundArchitecture) -> PipelineActivationDtype:
    """The model's own activation dtype: the most common of F32/F16/BF16 among its tensors'
    elements (an FP8 or packed checkpoint's companions decide it), bfloat16 when there is none."""
    counts: dict[str, int] = {}
    for owned in bound.description.groups:
        for member in owned.group.members:
            if member.dtype in _ACTIVATION_DTYPES:
                counts[member.dtype] = counts.get(member.dtype, 0) + math.prod(member.shape)
    if not counts:
        return PipelineActivationDtype.BFLOAT16
    return _ACTIVATION_DTYPES[max(sorted(counts), key=lambda d: counts[d])]


def realize_plan(bound: BoundArchitecture, topology: Topology, *,
                 sources: tuple[tuple[str, str], ...] = (),
                 checkpoint_fingerprint: str | None = None,
                 checkpoint_header_digest: str | None = None,
                 group_location: GroupSite | None = None,
                 omitted: tuple[str, ...] = (),
                 progress: Callable[[int, int], None] | None = None) -> Plan:
    """The plan of `bound` for `topology`; raises LayoutError (created located at the group's
    declaration when `group_location` knows it).

    Each group structure is realized once (`realize_group_template`); groups keep an index to
    their kind, so a rank's tensor layouts are only built when asked for. `progress(done,
    total)` is called as the groups are realized. Under expert parallelism the routed-expert
    groups are realized for the ETP size (per-expert) or per stage-local rank (stacked), and
    each rank keeps only its own experts.
    """
    activation = topology.activation_dtype or model_activation_dtype(bound)
    topology = replace(topology, activation_dtype=activation)  # the plan records it resolved
    tp, pp = topology.tensor_parallel_size, topology.pipeline_parallel_size
    policy = topology.policy or bound.policy or ShardingPolicy.REQUIRE
    description = bound.description
    graph = description.graph
    modes = _group_modes(bound, topology)
    replicated = {g for g, m in modes if m.replicated}
    if replicated:
        description = _replicate_groups(description, replicated)
    expert_plan = _expert_parallel_plan(bound, topology, group_location)
    expert_roles = dict(bound.experts) if expert_plan is not None else {}
    kinds: list[GroupKind] = []
    kind_index: dict[tuple[int, KindIndex], int] = {}  # (id of a shared template, index) -> kind
    group_kinds: dict[str, int] = {}
    realized: dict[object, tuple[tuple[LocalTensorLayout, ...], ...]] = {}
    for done, owned in enumerate(description.groups):
        if progress is not None:
            progress(done, len(description.groups))
        site = None if group_location is None else group_location(owned.group.name)
        location, pointer = (None, "") if site is None else site
        role = expert_roles.get(owned.group.name)
        by = KindIndex.TENSOR
        if role is None or expert_plan is None:
            template = realize_group_template(owned.group, tp, policy,
                                              policy_overrides_group=topology.policy is not None,
                                              cache=realized, location=location,
                                              pointer=pointer, split=topology.split)
        elif role.expert is not None:
            by = KindIndex.EXPERT_TENSOR
            template = realize_group_template(owned.group, expert_plan.expert_tensor_parallel_size,
                                              policy,
                                              policy_overrides_group=topology.policy is not None,
                                              cache=realized, location=location,
                                              pointer=pointer, split=topology.split)
        else:
            by = KindIndex.LOCAL
            template = _stacked_template(owned.group, role, expert_plan, realized)
        index = kind_index.get((id(template), by))
        if index is None:
            index = kind_index[(id(template), by)] = len(kinds)
            kinds.append(GroupKind(layouts=template, index=by))
        group_kinds[owned.group.name] = index
    if progress is not None:
        progress(len(description.groups), len(description.groups))
    wire = PipelineWireContract(schema=bound.boundary, activation_dtype=activation)
    multi = sum(1 for g in graph.groups if g.units) > 1
    summary: PipelineSummary | None = None
    cuts: tuple[tuple[int, str, BoundaryWireSchema], ...] = ()
    if multi or topology.stage_layout is not None or topology.group_modes:
        unit_bytes = _unit_bytes(description, kinds, group_kinds)
        choice = _located_layout(lambda: choose_stages(
            graph, pp, unit_bytes=unit_bytes, weights=dict(bound.group_weights),
            explicit=topology.stage_units, layout=topology.stage_layout,
            whole=[g for g, m in modes if m.one_stage], by_bytes=multi))
        ranges = choice.ranges
        contracts = _cut_contracts(bound, graph, ranges, activation)
        cuts = tuple((s, g, c.schema) for s, (g, c) in enumerate(contracts)) if (
            bound.group_boundaries) else ()
        partitions = [realize_partition(
            description, s, pp, boundary=wire, stage_ranges=ranges,
            receive_boundary=contracts[s - 1][1] if cuts and s else None,
            send_boundary=contracts[s][1] if cuts and s < pp - 1 else None)
            for s in range(pp)]
    else:
        partitions = [realize_partition(description, s, pp, topology.stage_units, boundary=wire)
                      for s in range(pp)]
    group_stages: dict[str, list[int]] = {}
    for stage, partition in enumerate(partitions):
        for binding in partition.parameter_bindings:
            group_stages.setdefault(binding.group, []).append(stage)
    groups = tuple(PlannedGroup(name=owned.group.name, owner=owned.owner,
                                targets=owned.group.targets, kind=group_kinds[owned.group.name],
                                stages=tuple(group_stages.get(owned.group.name, ())))
                   for owned in description.groups)
    unowned = next((g for g in groups if not g.stages), None)
    if unowned is not None:
        raise LayoutError(f"tensor `{unowned.targets[0]}` is loaded by no pipeline stage (its "
                          "owner is a static role no stage holds)", tensor=unowned.targets[0])
    by_name = {g.name: g for g in groups}
    stage_groups = [tuple(by_name[b.group] for b in partition.parameter_bindings)
                    for partition in partitions]
    global_bytes = sum(m.nbytes for g in description.groups for m in g.group.members)
    if expert_plan is not None:
        ranks = _expert_parallel_ranks(bound, expert_plan, expert_roles, partitions,
                                       stage_groups, kinds, global_bytes)
    else:
        ranks = _ranks(bound, tp, pp, partitions, stage_groups, kinds, global_bytes)
    if multi or topology.stage_layout is not None or topology.group_modes:
        summary = PipelineSummary(
            balance=choice.balance,
            layout=spell_layout(graph, ranges, description.static_roles),
            stage_bytes=tuple(max(r.info.local_parameter_bytes for r in ranks
                                  if r.pipeline_stage == s) for s in range(pp)),
            group_modes=tuple((g.name, dict(modes)[g.name]) for g in graph.canonical_order()))
    return Plan(
        family=bound.family, model_type=bound.model_type, topology=topology, sources=sources,
        config_values=bound.config_values,
        graph=graph.canonical_order(), static_roles=description.static_roles,
        boundary=bound.boundary,
        groups=groups, kinds=tuple(kinds), ranks=tuple(ranks),
        checkpoint_fingerprint=checkpoint_fingerprint,
        checkpoint_header_digest=checkpoint_header_digest, omitted=omitted,
        pipeline=summary, cuts=cuts, expert_parallel=expert_plan)


def _ranks(bound: BoundArchitecture, tp: int, pp: int, partitions: list[ArchitecturePartition],
           stage_groups: list[tuple[PlannedGroup, ...]], kinds: list[GroupKind],
           global_bytes: int) -> list[RankPlan]:
    """Every rank of a T x S plan: stage * T + tensor-parallel rank."""
    accounting = [[_rank_accounting(stage_groups[s], kinds, t) for t in range(tp)]
                  for s in range(pp)]
    maximum = max(a[1] for stage in accounting for a in stage)
    ranks = []
    for stage, partition in enumerate(partitions):
        for tp_rank in range(tp):
            owned_tensors, local, pinned, by_dtype = accounting[stage][tp_rank][:4]
            info = ParallelModelInfo(
                model_type=bound.model_type, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                rank=stage * tp + tp_rank, tensor_parallel_rank=tp_rank, pipeline_stage=stage,
                owned_tensors=owned_tensors, local_parameter_bytes=local,
                global_parameter_bytes=global_bytes, pinned_parameter_bytes=pinned,
                maximum_device_parameter_bytes=maximum, local_bytes_by_dtype=by_dtype)
            ranks.append(RankPlan(rank=stage * tp + tp_rank, tensor_parallel_rank=tp_rank,
                                  pipeline_stage=stage, partition=partition, info=info,
                                  groups=stage_groups[stage], kinds=tuple(kinds)))
    return ranks


def _located_layout(choose: Callable[[], Any]) -> Any:
    """A stage choice; its partition error as the LayoutError the CLI reports."""
    from partc.errors import ArchitecturePartitionError

    try:
        return choose()
    except ArchitecturePartitionError as error:
        raise LayoutError(error.message) from None


def _group_modes(bound: BoundArchitecture, topology: Topology
                 ) -> tuple[tuple[str, GroupParallelMode], ...]:
    """Every execution group's parallel mode: `--group-mode`, else the family's, else split."""
    names = [g.name for g in bound.description.graph.canonical_order()]
    chosen = dict(bound.group_modes)
    for group, mode in topology.group_modes:
        if group not in names:
            raise LayoutError(f"--group-mode names unknown execution group `{group}`; known: "
                              f"{', '.join(names)}")
        chosen[group] = mode
    return tuple((g, chosen.get(g, GroupParallelMode.SPLIT)) for g in names)


def _replicate_groups(description: ArchitectureParameterDescription, groups: set[str]
                      ) -> ArchitectureParameterDescription:
    """The description with every parameter group owned by a unit of `groups`, or by a static
    role placed with one of them, whole on every tensor-parallel rank."""
    from partc.parallel.specs import MemberSharding, MemberShardingKind
    from partc.partition.ownership import OwnedParameterGroupSpec

    roles = {r.name for r in description.static_roles if r.group in groups}
    whole = MemberSharding(kind=MemberShardingKind.REPLICATED, axis=None, segments=())
    owned = []
    for item in description.groups:
        owner = item.owner
        if (isinstance(owner, ExecutionUnit) and owner.group in groups) or (
                owner.static_roles and set(owner.static_roles) <= roles):
            spec = replace(item.group, units=None, members=tuple(
                replace(m, sharding=whole, heads=()) for m in item.group.members))
            owned.append(OwnedParameterGroupSpec(group=spec, owner=owner))
        else:
            owned.append(item)
    return replace(description, groups=tuple(owned))


def _unit_bytes(description: ArchitectureParameterDescription, kinds: list[GroupKind],
                group_kinds: dict[str, int]) -> list[int]:
    """Parameter bytes (tensor-parallel rank 0) of each canonical unit, with each static
    role's bytes counted on the unit it sits with (the first or last of the model or of its
    group)."""
    graph = description.graph
    layout = graph.unit_layout()
    index = {(u.group, u.unit): i for i, u in enumerate(layout)}
    costs = [0] * len(layout)
    if not costs:
        return costs
    anchors: dict[str, int] = {}
    for role in description.static_roles:
        if role.group is None:
            anchors[role.name] = 0 if role.side.value == "first" else len(layout) - 1
        else:
            start, end = graph.group_range(role.group)
            unit = start if role.side.value == "first" or start == end else end - 1
            anchors[role.name] = min(unit, len(layout) - 1)
    for item in description.groups:
        nbytes = kinds[group_kinds[item.group.name]].accounting(0)[0]
        owner = item.owner
        if isinstance(owner, ExecutionUnit):
            costs[index[(owner.group, owner.unit)]] += nbytes
        else:
            for name in sorted(set(owner.static_roles)):
                costs[anchors[name]] += nbytes
    return costs


def _cut_contracts(bound: BoundArchitecture, graph: ExecutionGraph, ranges: Any,
                   activation: PipelineActivationDtype
                   ) -> list[tuple[str, PipelineWireContract]]:
    """Per cut (after stage s), the group of the unit before it and what crosses it: that
    group's declared boundary, else the family's."""
    layout = graph.unit_layout()
    schemas = dict(bound.group_boundaries)
    out = []
    for _, end in ranges[:-1]:
        group = layout[end - 1].group
        out.append((group, PipelineWireContract(schema=schemas.get(group, bound.boundary),
                                                activation_dtype=activation)))
    return out


def _rank_accounting(groups: tuple[PlannedGroup, ...], kinds: list[GroupKind], tp_rank: int,
                     coordinates: RankCoordinates | None = None
                     ) -> tuple[int, int, int, tuple[tuple[str, int], ...], int]:
    """(owned tensors, local bytes, pinned bytes, bytes by dtype, expert bytes) of one rank's
    groups (expert bytes: those of expert kinds under expert parallelism)."""
    counts: dict[int, int] = {}
    for group in groups:
        counts[group.kind] = counts.get(group.kind, 0) + 1
    owned = local = pinned = experts = 0
    by_dtype: dict[str, int] = {}
    for kind, count in counts.items():
        row = kinds[kind].row(tp_rank, coordinates)
        nbytes, whole, dtypes = kinds[kind].accounting(row)
        owned += count * len(kinds[kind].layouts[row])
        local += count * nbytes
        pinned += count * whole
        if kinds[kind].index is not KindIndex.TENSOR:
            experts += count * nbytes
        for dtype, n in dtypes:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + count * n
    return owned, local, pinned, tuple(sorted(by_dtype.items())), experts


# ---------------------------------------------------------------- expert parallelism


EXPERT_LAYOUT = ("build rank = stage * N + r; tp = r mod T, dense replica = r div T, "
                 "ep = r div X, etp = r mod X")
"""The rank layout of an expert-parallel stage of N = E * X ranks, as the plan records it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertParallelPlan:
    """The expert-parallel layout of a plan (docs/expert_parallel.md)."""

    tensor_parallel_size: int
    """T: the dense parts' TP size."""
    expert_tensor_parallel_size: int
    """X: ranks splitting each expert."""
    placement: ExpertPlacement
    """Which experts each EP rank holds, in local slot order."""
    per_expert_groups: int
    """Per-expert groups (`for: {expert: ...}`) of the model."""
    stacked_groups: int
    """Stacked expert groups (`experts: {axis: ...}`) of the model."""
    expert_groups: tuple[tuple[str, int | None], ...] = ()
    """Every routed-expert group by name: its global expert id (per-expert), or None (stacked);
    what a plan reader needs to tell which ranks hold a group's tensors."""

    @property
    def expert_parallel_size(self) -> int:
        """E."""
        return self.placement.expert_parallel_size

    @property
    def ranks_per_stage(self) -> int:
        """N = E * X."""
        return self.expert_parallel_size * self.expert_tensor_parallel_size

    def coordinates(self, local_rank: int) -> RankCoordinates:
        """The coordinates of stage-local rank `local_rank`."""
        return RankCoordinates.of(local_rank, self.tensor_parallel_size,
                                  self.expert_tensor_parallel_size)

    def to_json(self) -> dict[str, object]:
        """JSON form (the plan's `expert_parallel`)."""
        placement = self.placement
        return {"expert_parallel_size": self.expert_parallel_size,
                "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
                "ranks_per_stage": self.ranks_per_stage,
                "dense_replicas": self.ranks_per_stage // self.tensor_parallel_size,
                "layout": EXPERT_LAYOUT, "experts": placement.experts,
                "explicit_placement": placement.explicit,
                "redundant_slots": placement.redundant,
                "slots": [list(ids) for ids in placement.slots],
                "per_expert_groups": self.per_expert_groups,
                "stacked_groups": self.stacked_groups,
                "expert_groups": {name: expert for name, expert in self.expert_groups}}


def model_expert_count(bound: BoundArchitecture) -> int:
    """How many routed experts the bound model has (0: it declares none): one more than the
    largest per-expert id, or the stacked groups' expert-axis length; LayoutError when its
    expert groups disagree."""
    counts: dict[int, str] = {}
    per_expert = [role.expert for _, role in bound.experts if role.expert is not None]
    if per_expert:
        counts[max(per_expert) + 1] = "its per-expert groups"
    groups = {owned.group.name: owned.group for owned in bound.description.groups}
    for name, role in bound.experts:
        if role.axis is None:
            continue
        group = groups[name]
        problem = expert_axis_problem(group, role.axis)
        if problem is not None:
            raise LayoutError(f"stacked expert group `{name}` (experts: {{axis: {role.axis}}}): "
                              f"{problem}", tensor=group.members[0].target)
        counts.setdefault(group.members[0].shape[role.axis], f"stacked group `{name}`")
    if len(counts) > 1:
        raise LayoutError("the routed-expert groups disagree on the expert count: "
                          + ", ".join(f"{n} ({what})" for n, what in sorted(counts.items())))
    return next(iter(counts), 0)


def _expert_parallel_plan(bound: BoundArchitecture, topology: Topology,
                          group_location: GroupSite | None) -> ExpertParallelPlan | None:
    ep = topology.expert_parallel_size
    if ep is None:
        return None
    count = model_expert_count(bound)
    if count == 0:
        raise LayoutError(
            f"--ep {ep}: family `{bound.family}` declares no routed experts for this config (no "
            "group loops `for: {expert: ...}` or declares `experts: {axis: ...}`), so there is "
            "nothing to place on expert-parallel ranks")
    placement = topology.expert_placement or ExpertPlacement.balanced(count, ep)
    if placement.experts != count:
        raise LayoutError(f"the expert placement is for {placement.experts} experts but the "
                          f"model routes to {count}")
    stacked = [name for name, role in bound.experts if role.axis is not None]
    if stacked and topology.expert_tensor_parallel_size > 1:
        site = None if group_location is None else group_location(stacked[0])
        raise LayoutError(
            f"stacked expert group `{stacked[0]}` cannot be split over "
            f"expert_tensor_parallel_size {topology.expert_tensor_parallel_size}: a rank of a "
            "stacked group holds whole experts (the rows of its experts on the expert axis); "
            "use --etp 1", location=None if site is None else site[0],
            pointer="" if site is None else site[1])
    return ExpertParallelPlan(
        tensor_parallel_size=topology.tensor_parallel_size,
        expert_tensor_parallel_size=topology.expert_tensor_parallel_size, placement=placement,
        per_expert_groups=sum(1 for _, r in bound.experts if r.expert is not None),
        stacked_groups=len(stacked),
        expert_groups=tuple((name, role.expert) for name, role in bound.experts))


def _stacked_template(group: ParameterGroupSpec, role: ExpertGroup, plan: ExpertParallelPlan,
                      realized: dict[object, tuple[tuple[LocalTensorLayout, ...], ...]]
                      ) -> tuple[tuple[LocalTensorLayout, ...], ...]:
    """One row per stage-local rank: the rows of the rank's experts along the expert axis."""
    assert role.axis is not None
    key = ("stacked", role.axis, group.role,
           tuple((m.dtype, m.shape) for m in group.members), plan.placement.slots,
           plan.expert_tensor_parallel_size)
    template = realized.get(key)
    if template is None:
        per_ep = [stacked_expert_layouts(group, role.axis, ids) for ids in plan.placement.slots]
        template = realized[key] = tuple(per_ep[plan.coordinates(r).expert_parallel_rank]
                                         for r in range(plan.ranks_per_stage))
    return template


def _expert_parallel_ranks(bound: BoundArchitecture, plan: ExpertParallelPlan,
                           roles: dict[str, ExpertGroup],
                           partitions: list[ArchitecturePartition],
                           stage_groups: list[tuple[PlannedGroup, ...]], kinds: list[GroupKind],
                           global_bytes: int) -> list[RankPlan]:
    """Every rank of an expert-parallel plan: stage * N + r, each with the stage's dense
    groups and its own experts."""
    n, tp = plan.ranks_per_stage, plan.tensor_parallel_size
    pp = len(partitions)
    held = [frozenset(ids) for ids in plan.placement.slots]
    rank_groups: list[list[tuple[PlannedGroup, ...]]] = []
    for groups in stage_groups:
        rank_groups.append([tuple(
            g for g in groups if (role := roles.get(g.name)) is None or role.expert is None
            or role.expert in mine) for mine in held])
    coordinates = [plan.coordinates(r) for r in range(n)]
    accounting = [[_rank_accounting(rank_groups[s][c.expert_parallel_rank], kinds,
                                    c.tensor_parallel_rank, c) for c in coordinates]
                  for s in range(pp)]
    maximum = max(a[1] for stage in accounting for a in stage)
    ranks = []
    for stage, partition in enumerate(partitions):
        for c in coordinates:
            owned_tensors, local, pinned, by_dtype, expert_bytes = accounting[stage][c.local_rank]
            rank = stage * n + c.local_rank
            info = ParallelModelInfo(
                model_type=bound.model_type, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                rank=rank, tensor_parallel_rank=c.tensor_parallel_rank, pipeline_stage=stage,
                owned_tensors=owned_tensors, local_parameter_bytes=local,
                global_parameter_bytes=global_bytes, pinned_parameter_bytes=pinned,
                maximum_device_parameter_bytes=maximum, local_bytes_by_dtype=by_dtype,
                ranks_per_stage=n, dense_replica=c.dense_replica,
                expert_parallel_size=plan.expert_parallel_size,
                expert_tensor_parallel_size=plan.expert_tensor_parallel_size,
                expert_parallel_rank=c.expert_parallel_rank,
                expert_tensor_parallel_rank=c.expert_tensor_parallel_rank,
                local_experts=len(plan.placement.slots[c.expert_parallel_rank]),
                expert_parameter_bytes=expert_bytes)
            ranks.append(RankPlan(rank=rank, tensor_parallel_rank=c.tensor_parallel_rank,
                                  pipeline_stage=stage, partition=partition, info=info,
                                  groups=rank_groups[stage][c.expert_parallel_rank],
                                  kinds=tuple(kinds), coordinates=c))
    return ranks
