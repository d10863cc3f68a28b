"""One rank's realization of an architecture over pipeline stages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partc.errors import ArchitecturePartitionErrorKind
from partc.parallel.layout import LocalStateLayout
from partc.parallel.shape import size_problem
from partc.partition.boundary import PipelineWireContract
from partc.partition.ownership import (
    ArchitectureParameterDescription,
    ExecutionGraph,
    OwnedParameterGroupSpec,
    ParameterGroupOwner,
    Range,
    UnitRef,
    _spell,
    owner_from_json,
    partition_error,
)


def _range(values: Sequence[int]) -> Range:
    start, end = values
    return int(start), int(end)


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
            raise partition_error(ArchitecturePartitionErrorKind.INVALID_OWNERSHIP,
                                   f"partition static roles {list(self.static_roles)} must be "
                                   "non-empty and distinct")


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionState:
    """Rank-local mutable state (KV cache) geometry and its global layer range."""

    units: int
    """State-carrying units on this stage (its local state slots)."""
    global_range: Range
    """Half-open range of this stage's units among all state-carrying units."""
    tensors: tuple[LocalStateLayout, ...] = ()
    """The declared runtime state tensors of this stage's units as this rank allocates them
    (per sequence), in canonical unit order then declaration order; empty when the family
    declares no `state:`."""

    def __post_init__(self) -> None:
        start, end = self.global_range
        if not 0 <= start <= end or end - start != self.units:
            raise partition_error(ArchitecturePartitionErrorKind.OUT_OF_BOUNDS,
                                   f"state range {_spell(self.global_range)} does not hold "
                                   f"{self.units} state units")
        keys = [(t.group, t.unit, t.name) for t in self.tensors]
        if len(set(keys)) != len(keys):
            raise partition_error(ArchitecturePartitionErrorKind.REPEATED_TARGET,
                                   "state tensors repeat a (group, unit, name)")

    @property
    def local_bytes(self) -> int:
        """Bytes of the declared per-sequence state tensors on this rank, per sequence."""
        return sum(t.local_bytes for t in self.tensors if not t.per_token)

    @property
    def local_bytes_per_token(self) -> int:
        """Bytes of the declared per-token state tensors (KV cache) on this rank, per token."""
        return sum(t.local_bytes for t in self.tensors if t.per_token)

    def unit_tensors(self, group: str, unit: int) -> tuple[LocalStateLayout, ...]:
        """The state tensors of one unit (group-local index), declaration order."""
        return tuple(t for t in self.tensors if t.group == group and t.unit == unit)

    def unit_bytes(self) -> tuple[tuple[str, int, int, int], ...]:
        """(group, unit, local bytes per sequence, local bytes per token) of each unit carrying
        declared state, in unit order."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for t in self.tensors:
            seq, tok = out.get((t.group, t.unit), (0, 0))
            out[(t.group, t.unit)] = ((seq, tok + t.local_bytes) if t.per_token
                                      else (seq + t.local_bytes, tok))
        return tuple((g, u, seq, tok) for (g, u), (seq, tok) in out.items())

    def to_json(self) -> dict[str, object]:
        """JSON form (`tensors` only when some are declared)."""
        out: dict[str, object] = {"units": self.units, "global_range": list(self.global_range)}
        if self.tensors:
            out["tensors"] = [t.to_json() for t in self.tensors]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionState:
        """The state from `to_json`, re-validated."""
        return cls(units=data["units"], global_range=_range(data["global_range"]),
                   tensors=tuple(LocalStateLayout.from_json(t)
                                 for t in data.get("tensors", ())))

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
            raise partition_error(ArchitecturePartitionErrorKind.EMPTY_RANGE,
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
        if (problem := size_problem("pipeline_parallel_size", self.stages)) is not None:
            raise partition_error(kinds.INVALID_STAGES, problem)
        if not 0 <= self.stage < self.stages:
            raise partition_error(kinds.INVALID_STAGES, f"stage {self.stage} is outside "
                                   f"pipeline stages 0..{self.stages - 1}")
        self._check_groups()
        own = self.ownership
        last = self.stages - 1
        if own.owns_input != (self.stage == 0) or own.owns_output != (self.stage == last):
            raise partition_error(
                kinds.INVALID_OWNERSHIP,
                f"stage {self.stage} of {self.stages} must own the input iff it is the first "
                f"stage and the output iff it is the last; found owns_input={own.owns_input}, "
                f"owns_output={own.owns_output}")
        if self.state.global_range[1] > self.graph.state_units:
            raise partition_error(kinds.OUT_OF_BOUNDS,
                                   f"state range {_spell(self.state.global_range)} exceeds the "
                                   f"{self.graph.state_units} state-carrying units of the graph")
        units = self.unit_ranges
        seen: dict[str, str] = {}
        for binding in self.parameter_bindings:
            if not binding.owner.is_local(units, own.static_roles):
                raise partition_error(
                    kinds.NON_LOCAL_OWNER,
                    f"stage {self.stage} binds group `{binding.group}` whose owner "
                    f"({binding.owner.describe()}) is not local to it")
            for target in binding.targets:
                if target in seen:
                    raise partition_error(
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
                raise partition_error(kinds.UNKNOWN_GROUP, f"partition names unknown group "
                                       f"`{part.group}`; known: {', '.join(order)}")
            if part.group in seen:
                raise partition_error(kinds.DUPLICATE_GROUP,
                                       f"partition lists group `{part.group}` twice")
            if seen and order.index(part.group) < order.index(seen[-1]):
                raise partition_error(kinds.NON_CANONICAL,
                                       f"partition lists group `{part.group}` after "
                                       f"`{seen[-1]}`; the canonical order is {', '.join(order)}")
            seen.append(part.group)
            available = self.graph.group(part.group).units
            if part.unit_range[1] > available:
                raise partition_error(kinds.OUT_OF_BOUNDS,
                                       f"group `{part.group}` range {_spell(part.unit_range)} "
                                       f"exceeds its {available} units")
            offset = self.graph.group_range(part.group)[0]
            covered.append((offset + part.unit_range[0], offset + part.unit_range[1]))
        start, end = self.canonical_range
        contiguous = all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
        if not covered or not contiguous or (covered[0][0], covered[-1][1]) != (start, end):
            raise partition_error(
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

    def owned_groups(self, description: ArchitectureParameterDescription
                     ) -> tuple[OwnedParameterGroupSpec, ...]:
        """The groups of `description` this partition holds, with their owners, in declaration
        order."""
        units = self.unit_ranges
        roles = self.ownership.static_roles
        return tuple(g for g in description.groups if g.owner.is_local(units, roles))

    def owned_static_roles(self, description: ArchitectureParameterDescription
                           ) -> tuple[str, ...]:
        """Static storage roles this partition holds (a shared group's first role), sorted."""
        return tuple(sorted({g.owner.static_roles[0] for g in self.owned_groups(description)
                             if g.owner.static_roles}))

    def wire_contract(self) -> PipelineWireContract:
        """The pipeline's wire contract this stage was realized with (an error without one)."""
        if self.boundary is None:
            raise partition_error(ArchitecturePartitionErrorKind.MISSING_BOUNDARY,
                                   f"stage {self.stage} was realized without a pipeline wire "
                                   "contract; pass `boundary=` to realize_partition")
        return self.boundary

    def receiving_contract(self) -> PipelineWireContract:
        """The wire contract of the cut this stage receives at (the per-group schema when the
        family declares one, else the pipeline's one boundary)."""
        if self.receive_boundary is not None:
            return self.receive_boundary
        return self.wire_contract()

    def sending_contract(self) -> PipelineWireContract:
        """The wire contract of the cut this stage sends at (the per-group schema when the
        family declares one, else the pipeline's one boundary)."""
        if self.send_boundary is not None:
            return self.send_boundary
        return self.wire_contract()

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
            "state": self.state.to_json(),
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
            state=PartitionState.from_json(data["state"]),
            parameter_bindings=tuple(PartitionParameterBinding.from_json(b)
                                     for b in data.get("parameter_bindings", ())),
            boundary=boundary)
