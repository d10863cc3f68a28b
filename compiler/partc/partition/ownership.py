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
from typing import TYPE_CHECKING, Any

from partc.errors import (
    ArchitectureParameterError,
    ArchitectureParameterErrorKind,
    ArchitecturePartitionError,
    ArchitecturePartitionErrorKind,
)
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import ParameterGroupSpec

if TYPE_CHECKING:
    from partc.partition.pipeline import ArchitecturePartition

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


# ---------------------------------------------------------------- pipeline realization


