"""The `partition` vocabulary: rank-local architecture ownership and pipeline realization.

An architecture is an execution graph of named groups (`vision` → `projector` → `decoder` →
`mtp`) whose units (`model.layers.7`) are cut, in canonical order, into contiguous pipeline
stages, plus static roles (`embedding`, `output`) that sit with the first or the last stage.
Every parameter group has exactly one owner. The boundary half of the vocabulary (what crosses
a cut) lives in `partc.boundary`; its schema types are re-exported here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partc.boundary import ArchitectureBoundary, PipelineWireContract
from partc.boundary import BoundaryTensorDimension as BoundaryTensorDimension
from partc.boundary import BoundaryTensorDimensionKind as BoundaryTensorDimensionKind
from partc.boundary import BoundaryTensorDtype as BoundaryTensorDtype
from partc.boundary import BoundaryTensorSpec as BoundaryTensorSpec
from partc.boundary import BoundaryWireSchema as BoundaryWireSchema
from partc.errors import ArchitectureParameterError as ArchitectureParameterError
from partc.errors import ArchitectureParameterErrorKind as ArchitectureParameterErrorKind
from partc.errors import ArchitecturePartitionError as ArchitecturePartitionError
from partc.errors import ArchitecturePartitionErrorKind as ArchitecturePartitionErrorKind
from partc.parallel import ParameterGroupSpec, ParameterRole, balanced_contiguous_range

Range = tuple[int, int]
"""A half-open integer range (start, end)."""


def _partition_error(kind: ArchitecturePartitionErrorKind, message: str
                     ) -> ArchitecturePartitionError:
    return ArchitecturePartitionError(kind, message)


def _graph_error(message: str) -> ArchitecturePartitionError:
    return ArchitecturePartitionError(ArchitecturePartitionErrorKind.INVALID_GRAPH, message)


def _spell(r: Range) -> str:
    return f"[{r[0]}, {r[1]})"


# ---------------------------------------------------------------- execution graph


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionGroupSpec:
    """One named execution group: a sequence of units with unique, non-empty paths."""

    name: str
    """Group name, e.g. `decoder`."""
    unit_paths: tuple[str, ...]
    """Path of each unit in order, e.g. `model.layers.0`."""
    carries_state: bool = False
    """Whether each unit carries mutable state (a KV cache)."""
    dependencies: tuple[str, ...] = ()
    """Groups whose output this group consumes."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.strip():
            raise _graph_error("an execution group needs a non-empty name")
        seen: set[str] = set()
        for index, path in enumerate(self.unit_paths):
            if not path or not path.strip():
                raise _graph_error(f"unit {index} of group `{self.name}` has an empty path")
            if path in seen:
                raise _graph_error(f"group `{self.name}` repeats unit path `{path}` (unit "
                                   f"{index}); unit paths must be unique")
            seen.add(path)
        if self.name in self.dependencies:
            raise _graph_error(f"group `{self.name}` depends on itself")

    @property
    def units(self) -> int:
        """Number of units."""
        return len(self.unit_paths)


@dataclass(frozen=True, slots=True)
class UnitRef:
    """One unit of the graph in canonical order."""

    group: str
    """The execution group."""
    unit: int
    """Group-local unit index."""
    path: str
    """Unique unit path."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionGraph:
    """Named execution groups with dependencies; the canonical order is a stable topological one."""

    groups: tuple[ExecutionGroupSpec, ...]
    """Groups in declaration order."""

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if not names:
            raise _graph_error("the execution graph needs at least one group")
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise _graph_error(f"execution group `{name}` is declared twice")
            seen.add(name)
        for group in self.groups:
            for dep in group.dependencies:
                if dep not in seen:
                    raise _graph_error(f"group `{group.name}` depends on unknown group `{dep}`; "
                                       f"known: {', '.join(names)}")
        self.canonical_order()  # rejects cycles
        paths: dict[str, str] = {}
        for group in self.groups:
            for path in group.unit_paths:
                if path in paths:
                    raise _graph_error(f"unit path `{path}` is used by both `{paths[path]}` and "
                                       f"`{group.name}`")
                paths[path] = group.name

    @classmethod
    def from_json(cls, data: Iterable[Mapping[str, Any]]) -> ExecutionGraph:
        """The graph from its plan JSON form (`group`, `unit_paths`, `state`, `after`)."""
        return cls(groups=tuple(ExecutionGroupSpec(
            name=g["group"], unit_paths=tuple(g["unit_paths"]), carries_state=bool(g["state"]),
            dependencies=tuple(g["after"])) for g in data))

    def group(self, name: str) -> ExecutionGroupSpec:
        """The group called `name` (KeyError if there is none)."""
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)

    def canonical_order(self) -> tuple[ExecutionGroupSpec, ...]:
        """Groups in dependency order, ties broken by declaration order."""
        done: list[ExecutionGroupSpec] = []
        names: set[str] = set()
        pending = list(self.groups)
        while pending:
            ready = next((g for g in pending if names.issuperset(g.dependencies)), None)
            if ready is None:
                raise _graph_error("execution groups depend on each other in a cycle: "
                                   + ", ".join(g.name for g in pending))
            done.append(ready)
            names.add(ready.name)
            pending.remove(ready)
        return tuple(done)

    def unit_layout(self) -> tuple[UnitRef, ...]:
        """Every unit in canonical order."""
        return tuple(UnitRef(g.name, i, p) for g in self.canonical_order()
                     for i, p in enumerate(g.unit_paths))

    def group_range(self, name: str) -> Range:
        """Half-open range of group `name`'s units in the canonical unit order."""
        start = 0
        for group in self.canonical_order():
            if group.name == name:
                return start, start + group.units
            start += group.units
        raise KeyError(name)

    def state_offset(self, name: str) -> int:
        """Index of group `name`'s first unit among all state-carrying units."""
        offset = 0
        for group in self.canonical_order():
            if group.name == name:
                return offset
            offset += group.units if group.carries_state else 0
        raise KeyError(name)

    @property
    def total_units(self) -> int:
        """Units of every group."""
        return sum(g.units for g in self.groups)

    @property
    def state_units(self) -> int:
        """Units of every state-carrying group."""
        return sum(g.units for g in self.groups if g.carries_state)


# ---------------------------------------------------------------- ownership


class StageSide(enum.Enum):
    """Which end of the pipeline a static role sits on."""

    FIRST = "first"
    LAST = "last"


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticRoleSpec:
    """A static role (a module outside the execution units) and its pipeline side."""

    name: str
    """Role name, e.g. `embedding`."""
    side: StageSide
    """First or last stage."""


class OwnerKind(enum.Enum):
    """The kinds of parameter-group owner."""

    STATIC_ROLE = "static_role"
    STATIC_ANY_OF = "static_any_of"
    EXECUTION_UNIT = "execution_unit"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParameterGroupOwner:
    """Who owns a parameter group: a static role, any of several, or one execution unit.

    The fields match the kind (one role; roles; group and unit); whether the roles are declared,
    distinct and non-empty and the unit exists is checked by ArchitectureParameterDescription.
    """

    kind: OwnerKind
    """Which kind of owner."""
    roles: tuple[str, ...] = ()
    """The static role(s)."""
    group: str | None = None
    """Execution group (ExecutionUnit)."""
    unit: int | None = None
    """Group-local unit index (ExecutionUnit)."""

    def __post_init__(self) -> None:
        unit_kind = self.kind is OwnerKind.EXECUTION_UNIT
        if unit_kind and (self.group is None or self.unit is None or self.roles):
            raise ArchitectureParameterError(ArchitectureParameterErrorKind.INVALID_OWNER,
                                             "an execution-unit owner needs a group and a unit "
                                             "and no static roles")
        if not unit_kind and (self.group is not None or self.unit is not None):
            raise ArchitectureParameterError(ArchitectureParameterErrorKind.INVALID_OWNER,
                                             f"a {self.kind.value} owner takes no group or unit")
        if self.kind is OwnerKind.STATIC_ROLE and len(self.roles) != 1:
            raise ArchitectureParameterError(ArchitectureParameterErrorKind.INVALID_OWNER,
                                             "a static_role owner names exactly one role, found "
                                             f"{list(self.roles)}")

    @classmethod
    def static_role(cls, role: str) -> ParameterGroupOwner:
        """Owned by one static role."""
        return cls(kind=OwnerKind.STATIC_ROLE, roles=(role,))

    @classmethod
    def static_any_of(cls, roles: Iterable[str]) -> ParameterGroupOwner:
        """A shared module: local wherever any of `roles` is local."""
        return cls(kind=OwnerKind.STATIC_ANY_OF, roles=tuple(roles))

    @classmethod
    def execution_unit(cls, group: str, unit: int) -> ParameterGroupOwner:
        """Owned by one unit of an execution group."""
        return cls(kind=OwnerKind.EXECUTION_UNIT, group=group, unit=unit)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParameterGroupOwner:
        """The owner from its JSON form."""
        kind = OwnerKind(data["kind"])
        if kind is OwnerKind.EXECUTION_UNIT:
            return cls(kind=kind, group=data["group"], unit=data["unit"])
        return cls(kind=kind, roles=tuple(data["roles"]))

    def describe(self) -> str:
        """A short spelling for messages."""
        if self.kind is OwnerKind.EXECUTION_UNIT:
            return f"unit {self.unit} of `{self.group}`"
        if self.kind is OwnerKind.STATIC_ANY_OF:
            return "any of " + ", ".join(f"`{r}`" for r in self.roles)
        return f"static role `{self.roles[0]}`"

    def is_local(self, units: Mapping[str, Range], static_roles: Iterable[str]) -> bool:
        """Whether a rank with group-local `units` ranges and `static_roles` holds this owner."""
        if self.kind is OwnerKind.EXECUTION_UNIT:
            assert self.group is not None and self.unit is not None
            start, end = units.get(self.group, (0, 0))
            return start <= self.unit < end
        return not set(self.roles).isdisjoint(static_roles)

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        if self.kind is OwnerKind.EXECUTION_UNIT:
            return {"kind": self.kind.value, "group": self.group, "unit": self.unit}
        return {"kind": self.kind.value, "roles": list(self.roles)}


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnedParameterGroupSpec:
    """A parameter group tagged with its owner."""

    group: ParameterGroupSpec
    """The group."""
    owner: ParameterGroupOwner
    """Its owner."""


def _param_error(kind: ArchitectureParameterErrorKind, message: str, *, group: str = "",
                 tensor: str | None = None) -> ArchitectureParameterError:
    return ArchitectureParameterError(kind, message, group=group, tensor=tensor)


def ownership_errors(graph: ExecutionGraph, static_roles: Sequence[StaticRoleSpec],
                     groups: Sequence[OwnedParameterGroupSpec]
                     ) -> Iterator[ArchitectureParameterError]:
    """Every error of an ownership declaration, in declaration order (yielded, not raised)."""
    kinds = ArchitectureParameterErrorKind
    role_names = [r.name for r in static_roles]
    declared: set[str] = set()
    for name in role_names:
        if not name or not name.strip():
            yield _param_error(kinds.EMPTY_STATIC_ROLE, "a declared static role has an empty "
                               "name")
        elif name in declared:
            yield _param_error(kinds.REPEATED_STATIC_ROLE,
                               f"static role `{name}` is declared twice")
        declared.add(name)
    owners: dict[str, str] = {}
    units = {g.name: g.units for g in graph.groups}
    for owned in groups:
        yield from _owner_errors(owned, units, role_names)
        for target in owned.group.targets:
            if target in owners:
                yield _param_error(
                    kinds.DUPLICATE_OWNERSHIP,
                    f"tensor `{target}` is owned twice: by group `{owners[target]}` and by "
                    f"group `{owned.group.name}`", group=owned.group.name, tensor=target)
            owners[target] = owned.group.name


def _owner_errors(owned: OwnedParameterGroupSpec, units: Mapping[str, int],
                  role_names: Sequence[str]) -> Iterator[ArchitectureParameterError]:
    kinds = ArchitectureParameterErrorKind
    owner, name = owned.owner, owned.group.name
    if owner.kind is OwnerKind.EXECUTION_UNIT:
        assert owner.group is not None and owner.unit is not None
        if owner.group not in units:
            yield _param_error(kinds.UNKNOWN_GROUP,
                               f"group `{name}` is owned by unknown execution group "
                               f"`{owner.group}`; known: {', '.join(units)}", group=name)
        elif not 0 <= owner.unit < units[owner.group]:
            have = units[owner.group]
            yield _param_error(kinds.UNIT_OUT_OF_RANGE,
                               f"group `{name}` is owned by unit {owner.unit} of "
                               f"`{owner.group}`, which has "
                               f"{f'units 0..{have - 1}' if have else 'no units'}", group=name)
        return
    if not owner.roles:
        yield _param_error(kinds.EMPTY_STATIC_ROLE,
                           f"group `{name}` is shared by an empty list of static roles; "
                           "name at least one consumer role", group=name)
    seen: set[str] = set()
    for role in owner.roles:
        if not role or not role.strip():
            yield _param_error(kinds.EMPTY_STATIC_ROLE,
                               f"group `{name}` names an empty static role", group=name)
        elif role in seen:
            yield _param_error(kinds.REPEATED_STATIC_ROLE,
                               f"group `{name}` names static role `{role}` twice in "
                               f"{list(owner.roles)}", group=name)
        elif role not in role_names:
            yield _param_error(kinds.UNKNOWN_STATIC_ROLE,
                               f"group `{name}` is owned by undeclared static role `{role}`; "
                               f"declared: {', '.join(role_names) or '(none)'}", group=name)
        seen.add(role)


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchitectureParameterDescription:
    """The complete, validated ownership declaration of an architecture.

    Construction raises the first error of `iter_errors` (declaration order); the checks
    against a checkpoint's names (missing and unexpected ownership) are `check_targets`.
    """

    graph: ExecutionGraph
    """Execution groups and units."""
    static_roles: tuple[StaticRoleSpec, ...]
    """Static roles and their sides."""
    groups: tuple[OwnedParameterGroupSpec, ...]
    """Every owned parameter group."""

    def __post_init__(self) -> None:
        for error in self.iter_errors():
            raise error

    def iter_errors(self) -> Iterator[ArchitectureParameterError]:
        """Every ownership error of the declaration itself, in declaration order."""
        return ownership_errors(self.graph, self.static_roles, self.groups)

    def check_targets(self, checkpoint_targets: Iterable[str]) -> list[ArchitectureParameterError]:
        """Missing and unexpected ownership against a checkpoint's tensor names, sorted."""
        kinds = ArchitectureParameterErrorKind
        owned = set(self.targets)
        present = set(checkpoint_targets)
        errors = [_param_error(kinds.MISSING_OWNERSHIP,
                               f"checkpoint tensor `{t}` is owned by no parameter group", tensor=t)
                  for t in sorted(present - owned)]
        errors += [_param_error(kinds.UNEXPECTED_OWNERSHIP,
                                f"the family declares tensor `{t}`, which the checkpoint does not "
                                "have", tensor=t)
                   for t in sorted(owned - present)]
        return errors

    @property
    def targets(self) -> tuple[str, ...]:
        """Every owned target, sorted."""
        return tuple(sorted(t for g in self.groups for t in g.group.targets))

    def targets_for_role(self, role: ParameterRole) -> tuple[str, ...]:
        """Targets of every group with semantic role `role`, sorted."""
        return tuple(sorted(t for g in self.groups if g.group.role is role
                            for t in g.group.targets))

    def targets_for_static_role(self, role: str) -> tuple[str, ...]:
        """Targets of groups owned by static role `role` (alone or shared), sorted."""
        return tuple(sorted(t for g in self.groups if g.owner.kind is not OwnerKind.EXECUTION_UNIT
                            and role in g.owner.roles for t in g.group.targets))

    def select_owned(self, partition: ArchitecturePartition) -> tuple[OwnedParameterGroupSpec, ...]:
        """The groups `partition` holds, with their owners, in declaration order."""
        units = partition.unit_ranges
        roles = partition.ownership.static_roles
        return tuple(g for g in self.groups if g.owner.is_local(units, roles))

    def select_static_roles(self, partition: ArchitecturePartition) -> tuple[str, ...]:
        """Static storage roles `partition` holds (a shared group's first role), sorted."""
        return tuple(sorted({g.owner.roles[0] for g in self.select_owned(partition)
                             if g.owner.kind is not OwnerKind.EXECUTION_UNIT}))


# ---------------------------------------------------------------- one stage's partition


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
        return cls(group=data["group"], owner=ParameterGroupOwner.from_json(data["owner"]),
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
        from partc.boundary import architecture_boundary

        if self.boundary is None:
            raise _partition_error(ArchitecturePartitionErrorKind.MISSING_BOUNDARY,
                                   f"stage {self.stage} was realized without a pipeline wire "
                                   "contract; pass `boundary=` to realize_partition")
        return architecture_boundary(self.boundary)

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


# ---------------------------------------------------------------- pipeline realization


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


def static_roles_on_stage(roles: Sequence[StaticRoleSpec], stage: int, stages: int
                          ) -> tuple[str, ...]:
    """Names of the static roles that sit on `stage`, sorted."""
    local = []
    for role in roles:
        if (role.side is StageSide.FIRST and stage == 0) or (
                role.side is StageSide.LAST and stage == stages - 1):
            local.append(role.name)
    return tuple(sorted(local))


def realize_partition(description: ArchitectureParameterDescription, stage: int, stages: int,
                      explicit: Sequence[int] | None = None, *,
                      boundary: PipelineWireContract | None = None) -> ArchitecturePartition:
    """The partition of pipeline stage `stage` of `stages` (balanced, or `explicit` counts)."""
    graph = description.graph
    ranges = pipeline_stage_ranges(graph.total_units, stages, explicit)
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
    roles = static_roles_on_stage(description.static_roles, stage, stages)
    units = {p.group: p.unit_range for p in parts}
    bindings = tuple(PartitionParameterBinding(group=g.group.name, owner=g.owner,
                                               targets=g.group.targets)
                     for g in description.groups if g.owner.is_local(units, roles))
    return ArchitecturePartition(
        graph=graph, stage=stage, stages=stages, canonical_range=(start, end), groups=tuple(parts),
        ownership=PartitionOwnership(owns_input=stage == 0, owns_output=stage == stages - 1,
                                     static_roles=roles),
        state=PartitionState(units=state_end - state_start, global_range=(state_start, state_end)),
        parameter_bindings=bindings, boundary=boundary)


def realize_pipeline(description: ArchitectureParameterDescription, stages: int,
                     explicit: Sequence[int] | None = None, *,
                     boundary: PipelineWireContract | None = None
                     ) -> tuple[ArchitecturePartition, ...]:
    """Every stage's partition, in stage order."""
    return tuple(realize_partition(description, s, stages, explicit, boundary=boundary)
                 for s in range(stages))
