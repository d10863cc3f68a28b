"""The `partition` vocabulary: rank-local architecture ownership and pipeline realization.

An architecture is an execution graph of named groups (`decoder`, `mtp`, ...) whose units
(`model.layers.7`) are cut into contiguous pipeline stages, plus static roles (`embedding`,
`output`) that sit with the first or the last stage. Every parameter group has one owner.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from partc.errors import PartcError
from partc.parallel import ParameterGroupSpec, balanced_contiguous_range


class ArchitectureParameterErrorKind(enum.Enum):
    """What is wrong with an ownership declaration."""

    MISSING_OWNERSHIP = "missing_ownership"
    DUPLICATE_OWNERSHIP = "duplicate_ownership"
    UNEXPECTED_OWNERSHIP = "unexpected_ownership"
    UNKNOWN_GROUP = "unknown_group"
    UNIT_OUT_OF_RANGE = "unit_out_of_range"
    EMPTY_STATIC_ROLE = "empty_static_role"
    REPEATED_STATIC_ROLE = "repeated_static_role"
    UNKNOWN_STATIC_ROLE = "unknown_static_role"


class ArchitectureParameterError(PartcError):
    """An ownership declaration that does not own every checkpoint target exactly once."""

    stage = "family"

    def __init__(self, kind: ArchitectureParameterErrorKind, message: str, **kwargs: object):
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.kind = kind
        """Which rule was broken."""


class ArchitecturePartitionErrorKind(enum.Enum):
    """What is wrong with one rank's partition."""

    INVALID_GRAPH = "invalid_graph"
    UNKNOWN_GROUP = "unknown_group"
    DUPLICATE_GROUP = "duplicate_group"
    EMPTY_RANGE = "empty_range"
    OUT_OF_BOUNDS = "out_of_bounds"
    NON_LOCAL_OWNER = "non_local_owner"
    REPEATED_TARGET = "repeated_target"
    INVALID_STAGES = "invalid_stages"


class ArchitecturePartitionError(PartcError):
    """A pipeline partition that is not realizable or not self-consistent."""

    stage = "plan"

    def __init__(self, kind: ArchitecturePartitionErrorKind, message: str, **kwargs: object):
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.kind = kind
        """Which rule was broken."""


def _graph_error(message: str) -> ArchitecturePartitionError:
    return ArchitecturePartitionError(ArchitecturePartitionErrorKind.INVALID_GRAPH, message)


# ---------------------------------------------------------------- execution graph


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionGroupSpec:
    """One named execution group: a sequence of units with unique paths."""

    name: str
    """Group name, e.g. `decoder`."""
    unit_paths: tuple[str, ...]
    """Path of each unit in order, e.g. `model.layers.0`."""
    carries_state: bool = False
    """Whether each unit carries mutable state (a KV cache)."""
    dependencies: tuple[str, ...] = ()
    """Groups whose output this group consumes."""

    def __post_init__(self) -> None:
        if not self.name:
            raise _graph_error("an execution group needs a non-empty name")
        if any(not p for p in self.unit_paths):
            raise _graph_error(f"group `{self.name}` has an empty unit path")
        if len(set(self.unit_paths)) != len(self.unit_paths):
            raise _graph_error(f"group `{self.name}` repeats a unit path")

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
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise _graph_error(f"execution group `{dup}` is declared twice")
        for group in self.groups:
            for dep in group.dependencies:
                if dep not in names:
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

    def group(self, name: str) -> ExecutionGroupSpec:
        """The group called `name`."""
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)

    def canonical_order(self) -> tuple[ExecutionGroupSpec, ...]:
        """Groups in dependency order, ties broken by declaration order."""
        done: list[ExecutionGroupSpec] = []
        pending = list(self.groups)
        while pending:
            ready = next((g for g in pending
                          if all(d in {x.name for x in done} for d in g.dependencies)), None)
            if ready is None:
                raise _graph_error("execution groups depend on each other in a cycle: "
                                   + ", ".join(g.name for g in pending))
            done.append(ready)
            pending.remove(ready)
        return tuple(done)

    def unit_layout(self) -> tuple[UnitRef, ...]:
        """Every unit in canonical order."""
        return tuple(UnitRef(g.name, i, p) for g in self.canonical_order()
                     for i, p in enumerate(g.unit_paths))

    @property
    def total_units(self) -> int:
        """Units of every group."""
        return sum(g.units for g in self.groups)


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
    """Who owns a parameter group: a static role, any of several, or one execution unit."""

    kind: OwnerKind
    """Which kind of owner."""
    roles: tuple[str, ...] = ()
    """The static role(s)."""
    group: str | None = None
    """Execution group (ExecutionUnit)."""
    unit: int | None = None
    """Group-local unit index (ExecutionUnit)."""

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

    def describe(self) -> str:
        """A short spelling for messages."""
        if self.kind is OwnerKind.EXECUTION_UNIT:
            return f"unit {self.unit} of `{self.group}`"
        if self.kind is OwnerKind.STATIC_ANY_OF:
            return "any of " + ", ".join(f"`{r}`" for r in self.roles)
        return f"static role `{self.roles[0]}`"

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


def _param_error(kind: ArchitectureParameterErrorKind, message: str, *,
                 tensor: str | None = None) -> ArchitectureParameterError:
    return ArchitectureParameterError(kind, message, tensor=tensor)


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchitectureParameterDescription:
    """The complete, validated ownership declaration of an architecture."""

    graph: ExecutionGraph
    """Execution groups and units."""
    static_roles: tuple[StaticRoleSpec, ...]
    """Static roles and their sides."""
    groups: tuple[OwnedParameterGroupSpec, ...]
    """Every owned parameter group."""

    def __post_init__(self) -> None:
        errors = list(self.iter_errors())
        if errors:
            raise errors[0]

    def iter_errors(self) -> Iterable[ArchitectureParameterError]:
        """Every ownership error of the declaration itself."""
        kinds = ArchitectureParameterErrorKind
        role_names = [r.name for r in self.static_roles]
        for name in role_names:
            if not name:
                yield _param_error(kinds.EMPTY_STATIC_ROLE, "a static role has an empty name")
            elif role_names.count(name) > 1:
                yield _param_error(kinds.REPEATED_STATIC_ROLE,
                                   f"static role `{name}` is declared twice")
                break
        owners: dict[str, str] = {}
        group_names = {g.name: g.units for g in self.graph.groups}
        for owned in self.groups:
            owner = owned.owner
            if owner.kind is OwnerKind.EXECUTION_UNIT:
                if owner.group not in group_names:
                    yield _param_error(
                        kinds.UNKNOWN_GROUP,
                        f"group `{owned.group.name}` is owned by unknown execution group "
                        f"`{owner.group}`; known: {', '.join(group_names)}")
                elif owner.unit is None or not 0 <= owner.unit < group_names[owner.group]:
                    yield _param_error(
                        kinds.UNIT_OUT_OF_RANGE,
                        f"group `{owned.group.name}` is owned by unit {owner.unit} of "
                        f"`{owner.group}`, which has units 0..{group_names[owner.group] - 1}")
            else:
                if not owner.roles:
                    yield _param_error(kinds.EMPTY_STATIC_ROLE,
                                       f"group `{owned.group.name}` names no static role")
                if len(set(owner.roles)) != len(owner.roles):
                    yield _param_error(kinds.REPEATED_STATIC_ROLE,
                                       f"group `{owned.group.name}` repeats a static role in "
                                       f"{list(owner.roles)}")
                for role in owner.roles:
                    if role not in role_names:
                        yield _param_error(
                            kinds.UNKNOWN_STATIC_ROLE,
                            f"group `{owned.group.name}` is owned by undeclared static role "
                            f"`{role}`; declared: {', '.join(role_names) or '(none)'}")
            for target in owned.group.targets:
                if target in owners:
                    yield _param_error(
                        kinds.DUPLICATE_OWNERSHIP,
                        f"tensor `{target}` is owned twice: by group `{owners[target]}` and by "
                        f"group `{owned.group.name}`", tensor=target)
                owners[target] = owned.group.name

    def check_targets(self, checkpoint_targets: Iterable[str]) -> list[ArchitectureParameterError]:
        """Missing and unexpected ownership against a checkpoint's tensor names."""
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

    def targets_for_role(self, role: str) -> tuple[str, ...]:
        """Targets of groups owned by static role `role` (alone or shared), sorted."""
        return tuple(sorted(t for g in self.groups if role in g.owner.roles
                            for t in g.group.targets))

    def select_owned(self, predicate: Callable[[ParameterGroupOwner], bool]
                     ) -> tuple[OwnedParameterGroupSpec, ...]:
        """Groups whose owner satisfies `predicate`."""
        return tuple(g for g in self.groups if predicate(g.owner))

    def select_static_roles(self, roles: Iterable[str]) -> tuple[OwnedParameterGroupSpec, ...]:
        """Groups local to a rank that owns static `roles` (StaticAnyOf: any of them)."""
        local = set(roles)
        return tuple(g for g in self.groups if g.owner.kind is not OwnerKind.EXECUTION_UNIT
                     and local.intersection(g.owner.roles))


# ---------------------------------------------------------------- pipeline realization


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionOwnership:
    """Whether a stage owns the model input, the model output, and which static roles."""

    owns_input: bool
    """The stage embeds token ids (first stage)."""
    owns_output: bool
    """The stage produces logits (last stage)."""
    static_roles: tuple[str, ...]
    """Static roles local to the stage, sorted."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionState:
    """Rank-local mutable state (KV cache) geometry and its global layer range."""

    units: int
    """State-carrying units on this stage."""
    global_range: tuple[int, int]
    """Half-open range of this stage's units among all state-carrying units."""

    def __post_init__(self) -> None:
        start, end = self.global_range
        if not 0 <= start <= end or end - start != self.units:
            raise ArchitecturePartitionError(
                ArchitecturePartitionErrorKind.OUT_OF_BOUNDS,
                f"state range {list(self.global_range)} does not hold {self.units} units")


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionGroup:
    """One owned execution group and its group-local unit range."""

    group: str
    """Execution group name."""
    unit_range: tuple[int, int]
    """Half-open group-local range of units on this stage."""

    def __post_init__(self) -> None:
        start, end = self.unit_range
        if not 0 <= start < end:
            raise ArchitecturePartitionError(
                ArchitecturePartitionErrorKind.EMPTY_RANGE,
                f"group `{self.group}` has empty or negative unit range {list(self.unit_range)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchitecturePartition:
    """One pipeline stage's complete realization of the architecture."""

    stage: int
    """Stage index."""
    stages: int
    """Number of stages."""
    canonical_range: tuple[int, int]
    """Half-open range of this stage's units in the canonical unit order."""
    groups: tuple[PartitionGroup, ...]
    """Owned execution groups with their unit ranges, canonical order."""
    ownership: PartitionOwnership
    """Input/output and static-role ownership."""
    state: PartitionState
    """KV-cache geometry."""
    parameter_targets: tuple[str, ...]
    """Checkpoint targets local to the stage, sorted."""

    def validate_against(self, graph: ExecutionGraph) -> None:
        """Check the partition is consistent with `graph` (known groups, ranges in bounds)."""
        kinds = ArchitecturePartitionErrorKind
        seen: set[str] = set()
        for part in self.groups:
            try:
                spec = graph.group(part.group)
            except KeyError:
                raise ArchitecturePartitionError(
                    kinds.UNKNOWN_GROUP, f"partition names unknown group `{part.group}`") from None
            if part.group in seen:
                raise ArchitecturePartitionError(
                    kinds.DUPLICATE_GROUP, f"partition lists group `{part.group}` twice")
            seen.add(part.group)
            if part.unit_range[1] > spec.units:
                raise ArchitecturePartitionError(
                    kinds.OUT_OF_BOUNDS,
                    f"group `{part.group}` range {list(part.unit_range)} exceeds its "
                    f"{spec.units} units")
        if len(set(self.parameter_targets)) != len(self.parameter_targets):
            raise ArchitecturePartitionError(kinds.REPEATED_TARGET,
                                             "partition lists a parameter target twice")

    def to_json(self) -> dict[str, object]:
        """JSON form."""
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


def pipeline_stage_ranges(total_units: int, stages: int,
                          explicit: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
    """Split `total_units` canonical units into `stages` contiguous ranges.

    Balanced by default; `explicit` gives each stage's unit count and must sum to the total.
    """
    kinds = ArchitecturePartitionErrorKind
    if stages < 1:
        raise ArchitecturePartitionError(kinds.INVALID_STAGES,
                                         f"pipeline_parallel_size must be >= 1, found {stages}")
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != stages:
            raise ArchitecturePartitionError(
                kinds.INVALID_STAGES, f"{len(counts)} explicit stage sizes given for "
                f"pipeline_parallel_size {stages}")
        if any(c < 1 for c in counts) or sum(counts) != total_units:
            raise ArchitecturePartitionError(
                kinds.INVALID_STAGES, f"explicit stage sizes {counts} must be positive and sum "
                f"to the {total_units} units of the model (they sum to {sum(counts)})")
        ranges = []
        start = 0
        for count in counts:
            ranges.append((start, start + count))
            start += count
        return tuple(ranges)
    if stages > total_units:
        raise ArchitecturePartitionError(
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
                      explicit: Sequence[int] | None = None) -> ArchitecturePartition:
    """The partition of pipeline stage `stage` of `stages`."""
    graph = description.graph
    ranges = pipeline_stage_ranges(graph.total_units, stages, explicit)
    start, end = ranges[stage]
    parts: list[PartitionGroup] = []
    state_before = 0
    state_units = 0
    offset = 0
    for group in graph.canonical_order():
        lo, hi = max(start, offset), min(end, offset + group.units)
        if group.carries_state:
            state_before += max(0, min(start, offset + group.units) - offset)
        if lo < hi:
            parts.append(PartitionGroup(group=group.name, unit_range=(lo - offset, hi - offset)))
            if group.carries_state:
                state_units += hi - lo
        offset += group.units
    roles = static_roles_on_stage(description.static_roles, stage, stages)
    local_units = {(p.group, u) for p in parts for u in range(*p.unit_range)}
    targets: list[str] = []
    for owned in description.groups:
        owner = owned.owner
        if owner.kind is OwnerKind.EXECUTION_UNIT:
            local = (owner.group, owner.unit) in local_units
        else:
            local = bool(set(owner.roles).intersection(roles))
        if local:
            targets.extend(owned.group.targets)
    partition = ArchitecturePartition(
        stage=stage, stages=stages, canonical_range=(start, end), groups=tuple(parts),
        ownership=PartitionOwnership(owns_input=stage == 0, owns_output=stage == stages - 1,
                                     static_roles=roles),
        state=PartitionState(units=state_units,
                             global_range=(state_before, state_before + state_units)),
        parameter_targets=tuple(sorted(targets)))
    partition.validate_against(graph)
    return partition


# ---------------------------------------------------------------- boundary wire schema


class BoundaryTensorDimensionKind(enum.Enum):
    """The kinds of boundary tensor dimension."""

    BATCH = "batch"
    SEQUENCE = "sequence"
    FIXED = "fixed"


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryTensorDimension:
    """One dimension of a boundary tensor: the batch, the sequence or a fixed size."""

    kind: BoundaryTensorDimensionKind
    """Which kind."""
    size: int | None = None
    """The size (Fixed only, > 0)."""

    def __post_init__(self) -> None:
        fixed = self.kind is BoundaryTensorDimensionKind.FIXED
        if fixed and (self.size is None or self.size <= 0):
            raise _boundary_error(f"a fixed boundary dimension must be positive, found {self.size}")
        if not fixed and self.size is not None:
            raise _boundary_error(f"a {self.kind.value} dimension takes no size")

    def spell(self) -> str | int:
        """`batch`, `sequence` or the fixed size."""
        return self.size if self.size is not None else self.kind.value


class BoundaryTensorDtype(enum.Enum):
    """The element type of a boundary tensor."""

    ACTIVATION = "activation"
    UINT32 = "uint32"
    INT32 = "int32"


class ArchitectureBoundaryErrorKind(enum.Enum):
    """What is wrong with a boundary schema or payload."""

    INVALID_SCHEMA = "invalid_schema"
    WRONG_COUNT = "wrong_count"
    WRONG_ROLE = "wrong_role"
    WRONG_SHAPE = "wrong_shape"
    WRONG_DTYPE = "wrong_dtype"


class ArchitectureBoundaryError(PartcError):
    """A boundary schema that is malformed, or a payload that does not match it."""

    stage = "family"

    def __init__(self, kind: ArchitectureBoundaryErrorKind, message: str, **kwargs: object):
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.kind = kind
        """Which rule was broken."""


def _boundary_error(message: str) -> ArchitectureBoundaryError:
    return ArchitectureBoundaryError(ArchitectureBoundaryErrorKind.INVALID_SCHEMA, message)


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryTensorSpec:
    """One tensor crossing a pipeline cut: its role, symbolic shape and dtype."""

    role: str
    """Unique role, e.g. `hidden`."""
    shape: tuple[BoundaryTensorDimension, ...]
    """Symbolic shape."""
    dtype: BoundaryTensorDtype
    """Element type."""

    def __post_init__(self) -> None:
        if not self.role:
            raise _boundary_error("a boundary tensor needs a non-empty role")
        if not self.shape:
            raise _boundary_error(f"boundary tensor `{self.role}` needs a non-empty shape")


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryWireSchema:
    """What crosses a pipeline cut: a primary activation and ordered auxiliary tensors."""

    identity: str
    """Schema identity, e.g. `llama.hidden`."""
    primary: BoundaryTensorSpec
    """The primary activation (dtype Activation)."""
    auxiliary: tuple[BoundaryTensorSpec, ...] = ()
    """Further tensors, in wire order."""

    def __post_init__(self) -> None:
        if not self.identity:
            raise _boundary_error("a boundary schema needs a non-empty identity")
        if self.primary.dtype is not BoundaryTensorDtype.ACTIVATION:
            raise _boundary_error(f"the primary boundary tensor `{self.primary.role}` must have "
                                  f"dtype activation, found {self.primary.dtype.value}")
        roles = [self.primary.role] + [a.role for a in self.auxiliary]
        for role in roles:
            if roles.count(role) > 1:
                raise _boundary_error(f"boundary role `{role}` is used twice")

    @property
    def tensors(self) -> tuple[BoundaryTensorSpec, ...]:
        """Primary then auxiliary specs, in wire order."""
        return (self.primary, *self.auxiliary)

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        def spec(s: BoundaryTensorSpec) -> dict[str, object]:
            return {"role": s.role, "shape": [d.spell() for d in s.shape], "dtype": s.dtype.value}
        return {"identity": self.identity, "primary": spec(self.primary),
                "auxiliary": [spec(a) for a in self.auxiliary]}
