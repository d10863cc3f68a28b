"""One rank's realization of an architecture over pipeline stages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partc.errors import ArchitecturePartitionErrorKind
from partc.parallel.specs import balanced_contiguous_range
from partc.partition.boundary import ArchitectureBoundary, PipelineWireContract
from partc.partition.ownership import (
    ArchitectureParameterDescription,
    ExecutionGraph,
    ParameterGroupOwner,
    Range,
    StageSide,
    StaticRoleSpec,
    UnitRef,
    _partition_error,
    _spell,
    owner_from_json,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionOwnership:
    """Whether a stage owns the model input, the model output, and which static roles."""

    owns_input: bool
    """The stage embeds token ids (first stage)."""
    owns_output: bool
    """The stage produces logits (last stage)."""
    static_roles: tuple[str, ...]
    """Static roles local to the stage, sorted."""

    def __post_init__(self) -> None:
        if any(not r or not r.strip() for r in self.static_roles) or len(
                set(self.static_roles)) != len(self.static_roles):
            raise _partition_error(ArchitecturePartitionErrorKind.INVALID_OWNERSHIP,
                                   f"partition static roles {list(self.static_roles)} must be "
                                   "non-empty and distinct")


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionState:
    """Rank-local mutable state (KV cache) geometry and its global layer range."""

    units: int
    """State-carrying units on this stage (its local state slots)."""
    global_range: Range
    """Half-open range of this stage's units among all state-carrying units."""

    def __post_init__(self) -> None:
        start, end = self.global_range
        if not 0 <= start <= end or end - start != self.units:
            raise _partition_error(ArchitecturePartitionErrorKind.OUT_OF_BOUNDS,
                                   f"state range {_spell(self.global_range)} does not hold "
                                   f"{self.units} state units")

    def covers(self, layers: Range) -> bool:
        """Whether the global state layers `layers` fall inside this stage's range."""
        return self.global_range[0] <= layers[0] and layers[1] <= self.global_range[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionGroup:
    """One owned execution group and its group-local unit range."""

    group: str
    """Execution group name."""
    unit_range: Range
    """Half-open group-local range of units on this stage."""

    def __post_init__(self) -> None:
        start, end = self.unit_range
        if not 0 <= start < end:
            raise _partition_error(ArchitecturePartitionErrorKind.EMPTY_RANGE,
                                   f"group `{self.group}` has empty or negative unit range "
                                   f"{_spell(self.unit_range)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionParameterBinding:
    """One parameter group a stage holds: its logical name, owner and checkpoint targets."""

    group: str
    """Logical parameter group name."""
    owner: ParameterGroupOwner
    """The group's owner (local to the stage)."""
    targets: tuple[str, ...]
    """Checkpoint targets of the group."""

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        return {"group": self.group, "owner": self.owner.to_json(), "targets": list(self.targets)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionParameterBinding:
        """The binding from its JSON form."""
        return cls(group=data["group"], owner=owner_from_json(data["owner"]),
                   targets=tuple(data["targets"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchitecturePartition:
    """One pipeline stage's complete, self-consistent realization of the architecture."""

    graph: ExecutionGraph
    """The whole execution graph (and so its canonical unit layout)."""
    stage: int
    """Stage index."""
    stages: int
    """Number of stages."""
    canonical_range: Range
    """Half-open range of this stage's units in the canonical unit order."""
    groups: tuple[PartitionGroup, ...]
    """Owned execution groups with their unit ranges, canonical order."""
    ownership: PartitionOwnership
    """Input/output and static-role ownership."""
    state: PartitionState
    """KV-cache geometry."""
    parameter_bindings: tuple[PartitionParameterBinding, ...] = ()
    """Parameter groups local to the stage, declaration order."""
    boundary: PipelineWireContract | None = None
    """What crosses this stage's cuts (None when not known)."""
    receive_boundary: PipelineWireContract | None = None
    """What crosses the cut this stage receives at, when the family declares a boundary per
    execution group (None: `boundary`, or no cut before the first stage)."""
    send_boundary: PipelineWireContract | None = None
    """What crosses the cut this stage sends at, when the family declares a boundary per
    execution group (None: `boundary`, or no cut after the last stage)."""

    def __post_init__(self) -> None:
        kinds = ArchitecturePartitionErrorKind
        if self.stages < 1:
            raise _partition_error(kinds.INVALID_STAGES,
                                   f"pipeline_parallel_size must be >= 1, found {self.stages}")
        if not 0 <= self.stage < self.stages:
            raise _partition_error(kinds.INVALID_STAGES, f"stage {self.stage} is outside "
                                   f"pipeline stages 0..{self.stages - 1}")
        self._check_groups()
        own = self.ownership
        last = self.stages - 1
        if own.owns_input != (self.stage == 0) or own.owns_output != (self.stage == last):
            raise _partition_error(
                kinds.INVALID_OWNERSHIP,
                f"stage {self.stage} of {self.stages} must own the input iff it is the first "
                f"stage and the output iff it is the last; found owns_input={own.owns_input}, "
                f"owns_output={own.owns_output}")
        if self.state.global_range[1] > self.graph.state_units:
            raise _partition_error(kinds.OUT_OF_BOUNDS,
                                   f"state range {_spell(self.state.global_range)} exceeds the "
                                   f"{self.graph.state_units} state-carrying units of the graph")
        units = self.unit_ranges
        seen: dict[str, str] = {}
        for binding in self.parameter_bindings:
            if not binding.owner.is_local(units, own.static_roles):
                raise _partition_error(
                    kinds.NON_LOCAL_OWNER,
                    f"stage {self.stage} binds group `{binding.group}` whose owner "
                    f"({binding.owner.describe()}) is not local to it")
            for target in binding.targets:
                if target in seen:
                    raise _partition_error(
                        kinds.REPEATED_TARGET,
                        f"stage {self.stage} binds tensor `{target}` twice: in group "
                        f"`{seen[target]}` and in group `{binding.group}`")
                seen[target] = binding.group

    def _check_groups(self) -> None:
        kinds = ArchitecturePartitionErrorKind
        order = [g.name for g in self.graph.canonical_order()]
        seen: list[str] = []
        covered: list[Range] = []
        for part in self.groups:
            if part.group not in order:
                raise _partition_error(kinds.UNKNOWN_GROUP, f"partition names unknown group "
                                       f"`{part.group}`; known: {', '.join(order)}")
            if part.group in seen:
                raise _partition_error(kinds.DUPLICATE_GROUP,
                                       f"partition lists group `{part.group}` twice")
            if seen and order.index(part.group) < order.index(seen[-1]):
                raise _partition_error(kinds.NON_CANONICAL,
                                       f"partition lists group `{part.group}` after "
                                       f"`{seen[-1]}`; the canonical order is {', '.join(order)}")
            seen.append(part.group)
            available = self.graph.group(part.group).units
            if part.unit_range[1] > available:
                raise _partition_error(kinds.OUT_OF_BOUNDS,
                                       f"group `{part.group}` range {_spell(part.unit_range)} "
                                       f"exceeds its {available} units")
            offset = self.graph.group_range(part.group)[0]
            covered.append((offset + part.unit_range[0], offset + part.unit_range[1]))
        start, end = self.canonical_range
        contiguous = all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
        if not covered or not contiguous or (covered[0][0], covered[-1][1]) != (start, end):
            raise _partition_error(
                kinds.NON_CANONICAL,
                f"stage {self.stage} declares canonical range {_spell(self.canonical_range)} but "
                f"its groups cover {', '.join(_spell(c) for c in covered) or 'no units'}; a stage "
                "holds one contiguous, non-empty run of the canonical unit order")

    @property
    def unit_ranges(self) -> dict[str, Range]:
        """Group-local unit range by owned group."""
        return {g.group: g.unit_range for g in self.groups}

    @property
    def parameter_targets(self) -> tuple[str, ...]:
        """Checkpoint targets local to the stage, sorted."""
        return tuple(sorted(t for b in self.parameter_bindings for t in b.targets))

    def owns_unit(self, group: str, unit: int) -> bool:
        """Whether the stage executes group-local `unit` of `group`."""
        return any(g.group == group and g.unit_range[0] <= unit < g.unit_range[1]
                   for g in self.groups)

    def units(self) -> tuple[UnitRef, ...]:
        """The stage's units in canonical order."""
        layout = self.graph.unit_layout()
        return layout[self.canonical_range[0]:self.canonical_range[1]]

    def architecture_boundary(self) -> ArchitectureBoundary:
        """Typed encode/decode of this stage's cuts (needs a wire contract)."""
        from partc.partition.boundary import architecture_boundary

        if self.boundary is None:
            raise _partition_error(ArchitecturePartitionErrorKind.MISSING_BOUNDARY,
                                   f"stage {self.stage} was realized without a pipeline wire "
                                   "contract; pass `boundary=` to realize_partition")
        return architecture_boundary(self.boundary)

    def receiving_boundary(self) -> ArchitectureBoundary:
        """Typed decode of the cut this stage receives at (the per-group schema when the family
        declares one, else the pipeline's one boundary)."""
        from partc.partition.boundary import architecture_boundary

        if self.receive_boundary is not None:
            return architecture_boundary(self.receive_boundary)
        return self.architecture_boundary()

    def sending_boundary(self) -> ArchitectureBoundary:
        """Typed encode of the cut this stage sends at (the per-group schema when the family
        declares one, else the pipeline's one boundary)."""
        from partc.partition.boundary import architecture_boundary

        if self.send_boundary is not None:
            return architecture_boundary(self.send_boundary)
        return self.architecture_boundary()

    def to_json(self) -> dict[str, object]:
        """JSON form (the graph, bindings and boundary are recorded once, elsewhere)."""
        return {
            "stage": self.stage,
            "stages": self.stages,
            "canonical_range": list(self.canonical_range),
            "groups": [{"group": g.group, "unit_range": list(g.unit_range)} for g in self.groups],
            "ownership": {"owns_input": self.ownership.owns_input,
                          "owns_output": self.ownership.owns_output,
                          "static_roles": list(self.ownership.static_roles)},
            "state": {"units": self.state.units, "global_range": list(self.state.global_range)},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *,
                  boundary: PipelineWireContract | None = None) -> ArchitecturePartition:
        """A partition from `to_json` plus `graph` and `parameter_bindings`, re-validated."""
        own = data["ownership"]
        return cls(
            graph=ExecutionGraph.from_json(data["graph"]), stage=data["stage"],
            stages=data["stages"], canonical_range=_range(data["canonical_range"]),
            groups=tuple(PartitionGroup(group=g["group"], unit_range=_range(g["unit_range"]))
                         for g in data["groups"]),
            ownership=PartitionOwnership(owns_input=own["owns_input"],
                                         owns_output=own["owns_output"],
                                         static_roles=tuple(own["static_roles"])),
            state=PartitionState(units=data["state"]["units"],
                                 global_range=_range(data["state"]["global_range"])),
            parameter_bindings=tuple(PartitionParameterBinding.from_json(b)
                                     for b in data.get("parameter_bindings", ())),
            boundary=boundary)


def _range(values: Sequence[int]) -> Range:
    start, end = values
    return int(start), int(end)


def pipeline_stage_ranges(total_units: int, stages: int,
                          explicit: Sequence[int] | None = None) -> tuple[Range, ...]:
    """Split `total_units` canonical units into `stages` contiguous, non-empty ranges.

    Balanced by default (DESIGN §3); `explicit` gives each stage's unit count.
    """
    kinds = ArchitecturePartitionErrorKind
    if stages < 1:
        raise _partition_error(kinds.INVALID_STAGES,
                               f"pipeline_parallel_size must be >= 1, found {stages}")
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != stages:
            raise _partition_error(kinds.INVALID_STAGES,
                                   f"{len(counts)} explicit stage sizes {counts} given for "
                                   f"pipeline_parallel_size {stages}; give one per stage")
        empty = [i for i, c in enumerate(counts) if c < 1]
        if empty:
            raise _partition_error(kinds.INVALID_STAGES,
                                   f"explicit stage sizes {counts} give stage {empty[0]} "
                                   f"{counts[empty[0]]} units; every stage needs at least one")
        if sum(counts) != total_units:
            raise _partition_error(kinds.INVALID_STAGES,
                                   f"explicit stage sizes {counts} sum to {sum(counts)}, but the "
                                   f"model has {total_units} execution units")
        ranges = []
        start = 0
        for count in counts:
            ranges.append((start, start + count))
            start += count
        return tuple(ranges)
    if total_units == 0:
        raise _partition_error(
            kinds.INVALID_STAGES,
            f"the model has no execution units to split over {stages} pipeline stage(s): "
            "expected at least one unit (check the `units` of the family's execution groups)")
    if stages > total_units:
        raise _partition_error(
            kinds.INVALID_STAGES,
            f"pipeline_parallel_size {stages} exceeds the {total_units} execution units of the "
            f"model; every stage needs at least one unit (use --pp {total_units} or fewer)")
    return tuple(balanced_contiguous_range(total_units, stages, s) for s in range(stages))


def cost_balanced_stage_ranges(costs: Sequence[int], stages: int,
                               keep_whole: Sequence[Range] = ()) -> tuple[Range, ...]:
    """Split units of the given `costs` (canonical order) into `stages` contiguous, non-empty
    ranges minimizing the largest stage cost; no cut falls strictly inside a `keep_whole`
    range. Ties go to the split whose earlier stages end first (deterministic)."""
    kinds = ArchitecturePartitionErrorKind
    total = len(costs)
    allowed = [all(not a < cut < b for a, b in keep_whole) for cut in range(total + 1)]
    possible = sum(allowed[1:total]) + 1
    if stages > possible:
        raise _partition_error(
            kinds.INVALID_STAGES,
            f"pipeline_parallel_size {stages} exceeds the {possible} stage(s) the model can be "
            f"cut into ({total} execution units, groups kept on one stage stay whole); use --pp "
            f"{possible} or fewer")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = prefix[-1] + 1
    # best[k][i]: least largest-stage cost of the first i units over k stages
    best = [[infinity] * (total + 1) for _ in range(stages + 1)]
    choice = [[0] * (total + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, total + 1):
            if not allowed[i]:
                continue
            for j in range(k - 1, i):
                if not allowed[j] or best[k - 1][j] == infinity:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    ranges: list[Range] = []
    end = total
    for k in range(stages, 0, -1):
        start = choice[k][end]
        ranges.append((start, end))
        end = start
    return tuple(reversed(ranges))


def static_roles_on_stage(roles: Sequence[StaticRoleSpec], stage: int, stages: int,
                          graph: ExecutionGraph | None = None,
                          ranges: Sequence[Range] | None = None) -> tuple[str, ...]:
    """Names of the static roles that sit on `stage`, sorted (a role placed with a group needs
    the graph and every stage's canonical range)."""
    local = []
    for role in roles:
        if role.group is not None:
            if graph is not None and ranges is not None and role.stage(graph, ranges) == stage:
                local.append(role.name)
        elif (role.side is StageSide.FIRST and stage == 0) or (
                role.side is StageSide.LAST and stage == stages - 1):
            local.append(role.name)
    return tuple(sorted(local))


def realize_partition(description: ArchitectureParameterDescription, stage: int, stages: int,
                      explicit: Sequence[int] | None = None, *,
                      boundary: PipelineWireContract | None = None,
                      stage_ranges: Sequence[Range] | None = None,
                      receive_boundary: PipelineWireContract | None = None,
                      send_boundary: PipelineWireContract | None = None
                      ) -> ArchitecturePartition:
    """The partition of pipeline stage `stage` of `stages` (balanced, `explicit` counts, or the
    canonical `stage_ranges` of every stage)."""
    graph = description.graph
    ranges = (tuple(stage_ranges) if stage_ranges is not None
              else pipeline_stage_ranges(graph.total_units, stages, explicit))
    if not 0 <= stage < stages:
        raise _partition_error(ArchitecturePartitionErrorKind.INVALID_STAGES,
                               f"stage {stage} is outside pipeline stages 0..{stages - 1}")
    start, end = ranges[stage]
    parts: list[PartitionGroup] = []
    state_start = state_end = None
    state_before = 0
    offset = 0
    for group in graph.canonical_order():
        lo, hi = max(start, offset), min(end, offset + group.units)
        if group.carries_state:
            state_before += max(0, min(start, offset + group.units) - offset)
        if lo < hi:
            parts.append(PartitionGroup(group=group.name, unit_range=(lo - offset, hi - offset)))
            if group.carries_state:
                base = graph.state_offset(group.name) - offset
                state_start = base + lo if state_start is None else state_start
                state_end = base + hi
        offset += group.units
    if state_start is None or state_end is None:
        state_start = state_end = state_before
    # a static role no parameter group is owned by holds nothing: the partition never claims it
    backed = {r for g in description.groups for r in g.owner.static_roles}
    roles = tuple(r for r in static_roles_on_stage(description.static_roles, stage, stages,
                                                   graph, ranges) if r in backed)
    units = {p.group: p.unit_range for p in parts}
    bindings = tuple(PartitionParameterBinding(group=g.group.name, owner=g.owner,
                                               targets=g.group.targets)
                     for g in description.groups if g.owner.is_local(units, roles))
    return ArchitecturePartition(
        graph=graph, stage=stage, stages=stages, canonical_range=(start, end), groups=tuple(parts),
        ownership=PartitionOwnership(owns_input=stage == 0, owns_output=stage == stages - 1,
                                     static_roles=roles),
        state=PartitionState(units=state_end - state_start, global_range=(state_start, state_end)),
        parameter_bindings=bindings, boundary=boundary, receive_boundary=receive_boundary,
        send_boundary=send_boundary)


def realize_pipeline(description: ArchitectureParameterDescription, stages: int,
                     explicit: Sequence[int] | None = None, *,
                     boundary: PipelineWireContract | None = None
                     ) -> tuple[ArchitecturePartition, ...]:
    """Every stage's partition, in stage order."""
    return tuple(realize_partition(description, s, stages, explicit, boundary=boundary)
                 for s in range(stages))
