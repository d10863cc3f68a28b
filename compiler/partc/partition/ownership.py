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
from typing import Any, ClassVar

from partc.errors import (
    ArchitectureParameterError,
    ArchitectureParameterErrorKind,
    ArchitecturePartitionError,
    ArchitecturePartitionErrorKind,
)
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import ParameterGroupSpec

Range = tuple[int, int]
"""A half-open integer range (start, end)."""


def partition_error(kind: ArchitecturePartitionErrorKind, message: str
                    ) -> ArchitecturePartitionError:
    """An architecture-partition error of `kind`."""
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


class GroupParallelMode(enum.Enum):
    """How an execution group is parallelized (`parallel:` of a graph group, `--group-mode`)."""

    SPLIT = "split"
    """Members split over tensor-parallel ranks as declared; pipeline cuts may fall inside."""
    REPLICATED = "replicated"
    """Every member whole on every tensor-parallel rank."""
    ONE_STAGE = "one_stage"
    """Split as declared, but every unit on one pipeline stage."""
    REPLICATED_ONE_STAGE = "replicated_one_stage"
    """Both: whole on every tensor-parallel rank, and on one pipeline stage."""

    @property
    def replicated(self) -> bool:
        """Whether members are whole on every tensor-parallel rank."""
        return self in (GroupParallelMode.REPLICATED, GroupParallelMode.REPLICATED_ONE_STAGE)

    @property
    def one_stage(self) -> bool:
        """Whether the group's units stay on one pipeline stage."""
        return self in (GroupParallelMode.ONE_STAGE, GroupParallelMode.REPLICATED_ONE_STAGE)


# ---------------------------------------------------------------- ownership


class StageSide(enum.Enum):
    """Which end of the pipeline a static role sits on."""

    FIRST = "first"
    LAST = "last"


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticRoleSpec:
    """A static role (a module outside the execution units) and the stage it sits on."""

    name: str
    """Role name, e.g. `embedding`."""
    side: StageSide
    """First or last stage; with `group`, the first or last unit of that group."""
    group: str | None = None
    """The execution group whose first or last unit's stage the role sits with (None: the
    first or last pipeline stage)."""

    def spell(self) -> str | dict[str, str]:
        """The plan's `stage` of the role: `first`, `last` or `{with, unit}`."""
        if self.group is None:
            return self.side.value
        return {"with": self.group, "unit": self.side.value}

    def stage(self, graph: ExecutionGraph, ranges: Sequence[Range]) -> int:
        """The stage the role sits on, given each stage's canonical unit range."""
        if self.group is None:
            return 0 if self.side is StageSide.FIRST else len(ranges) - 1
        start, end = graph.group_range(self.group)
        if start == end:  # an empty group: with the stage where it would begin
            unit = start if start < graph.total_units else graph.total_units - 1
        else:
            unit = start if self.side is StageSide.FIRST else end - 1
        return next(i for i, (a, b) in enumerate(ranges) if a <= unit < b)


class OwnerKind(enum.Enum):
    """The kinds of parameter-group owner (the tag of the owners' JSON form)."""

    STATIC_ROLE = "static_role"
    STATIC_ANY_OF = "static_any_of"
    EXECUTION_UNIT = "execution_unit"


def _invalid_owner(message: str) -> ArchitectureParameterError:
    return ArchitectureParameterError(ArchitectureParameterErrorKind.INVALID_OWNER, message)


def _json_roles(kind: OwnerKind, data: Mapping[str, Any]) -> tuple[str, ...]:
    """The `roles` list of a static owner's JSON form (exactly the keys kind and roles)."""
    roles = data.get("roles")
    if set(data) != {"kind", "roles"} or not isinstance(roles, (list, tuple)):
        raise _invalid_owner(f"malformed {kind.value} owner {dict(data)}")
    return tuple(roles)


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticRole:
    """Owned by one static role (whether it is declared is checked by
    ArchitectureParameterDescription)."""

    kind: ClassVar[OwnerKind] = OwnerKind.STATIC_ROLE
    role: str
    """The static role."""

    def __post_init__(self) -> None:
        if not isinstance(self.role, str):
            raise _invalid_owner(f"a static_role owner names one role, found {self.role!r}")

    @property
    def static_roles(self) -> tuple[str, ...]:
        """The static roles that hold this owner: the one role."""
        return (self.role,)

    def describe(self) -> str:
        """A short spelling for messages."""
        return f"static role `{self.role}`"

    def is_local(self, units: Mapping[str, Range], static_roles: Iterable[str]) -> bool:
        """Whether a rank holding `static_roles` holds this owner."""
        return self.role in set(static_roles)

    def declaration_errors(self, name: str, units: Mapping[str, int],
                           role_names: Sequence[str]) -> Iterator[ArchitectureParameterError]:
        """Errors of this owner of group `name` against the declared units and roles."""
        return _role_errors((self.role,), name, role_names)

    def to_json(self) -> dict[str, object]:
        """JSON form: kind and a one-role list."""
        return {"kind": self.kind.value, "roles": [self.role]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StaticRole:
        """The owner from its JSON form (`roles` holds exactly one role)."""
        roles = _json_roles(cls.kind, data)
        if len(roles) != 1:
            raise _invalid_owner(f"malformed {cls.kind.value} owner {dict(data)}")
        return cls(role=roles[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticAnyOf:
    """A shared module: local wherever any of `roles` is local (whether the roles are declared,
    distinct and non-empty is checked by ArchitectureParameterDescription)."""

    kind: ClassVar[OwnerKind] = OwnerKind.STATIC_ANY_OF
    roles: tuple[str, ...]
    """The static roles, in declaration order."""

    def __post_init__(self) -> None:
        if not isinstance(self.roles, tuple) or not all(isinstance(r, str) for r in self.roles):
            raise _invalid_owner(f"a static_any_of owner names a tuple of roles, found "
                                 f"{self.roles!r}")

    @property
    def static_roles(self) -> tuple[str, ...]:
        """The static roles that hold this owner."""
        return self.roles

    def describe(self) -> str:
        """A short spelling for messages."""
        return "any of " + ", ".join(f"`{r}`" for r in self.roles)

    def is_local(self, units: Mapping[str, Range], static_roles: Iterable[str]) -> bool:
        """Whether a rank holding `static_roles` holds this owner."""
        return not set(self.roles).isdisjoint(static_roles)

    def declaration_errors(self, name: str, units: Mapping[str, int],
                           role_names: Sequence[str]) -> Iterator[ArchitectureParameterError]:
        """Errors of this owner of group `name` against the declared units and roles."""
        if not self.roles:
            yield _param_error(ArchitectureParameterErrorKind.EMPTY_STATIC_ROLE,
                               f"group `{name}` is shared by an empty list of static roles; "
                               "name at least one consumer role", group=name)
        yield from _role_errors(self.roles, name, role_names)

    def to_json(self) -> dict[str, object]:
        """JSON form: kind and roles."""
        return {"kind": self.kind.value, "roles": list(self.roles)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StaticAnyOf:
        """The owner from its JSON form."""
        return cls(roles=_json_roles(cls.kind, data))


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionUnit:
    """Owned by one unit of an execution group (whether the unit exists is checked by
    ArchitectureParameterDescription)."""

    kind: ClassVar[OwnerKind] = OwnerKind.EXECUTION_UNIT
    group: str
    """Execution group."""
    unit: int
    """Group-local unit index."""

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not isinstance(self.unit, int) or isinstance(
                self.unit, bool):
            raise _invalid_owner("an execution-unit owner needs a group name and an integer "
                                 f"unit, found {self.group!r} and {self.unit!r}")

    @property
    def static_roles(self) -> tuple[str, ...]:
        """The static roles that hold this owner: none."""
        return ()

    def describe(self) -> str:
        """A short spelling for messages."""
        return f"unit {self.unit} of `{self.group}`"

    def is_local(self, units: Mapping[str, Range], static_roles: Iterable[str]) -> bool:
        """Whether a rank with group-local `units` ranges holds this unit."""
        start, end = units.get(self.group, (0, 0))
        return start <= self.unit < end

    def declaration_errors(self, name: str, units: Mapping[str, int],
                           role_names: Sequence[str]) -> Iterator[ArchitectureParameterError]:
        """Errors of this owner of group `name` against the declared units and roles."""
        kinds = ArchitectureParameterErrorKind
        if self.group not in units:
            yield _param_error(kinds.UNKNOWN_GROUP,
                               f"group `{name}` is owned by unknown execution group "
                               f"`{self.group}`; known: {', '.join(units)}", group=name)
        elif not 0 <= self.unit < units[self.group]:
            have = units[self.group]
            yield _param_error(kinds.UNIT_OUT_OF_RANGE,
                               f"group `{name}` is owned by unit {self.unit} of "
                               f"`{self.group}`, which has "
                               f"{f'units 0..{have - 1}' if have else 'no units'}", group=name)

    def to_json(self) -> dict[str, object]:
        """JSON form: kind, group and unit."""
        return {"kind": self.kind.value, "group": self.group, "unit": self.unit}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExecutionUnit:
        """The owner from its JSON form (exactly the keys kind, group and unit)."""
        if set(data) != {"kind", "group", "unit"}:
            raise _invalid_owner(f"malformed {cls.kind.value} owner {dict(data)}")
        return cls(group=data["group"], unit=data["unit"])


ParameterGroupOwner = StaticRole | StaticAnyOf | ExecutionUnit
"""Who owns a parameter group: a static role, any of several, or one execution unit."""

OWNER_KINDS: dict[OwnerKind, type[ParameterGroupOwner]] = {
    cls.kind: cls for cls in (StaticRole, StaticAnyOf, ExecutionUnit)}
"""Each owner kind and its class (the JSON form's tag)."""


def owner_from_json(data: Mapping[str, Any]) -> ParameterGroupOwner:
    """The owner from its JSON form (re-validated)."""
    cls = next((c for k, c in OWNER_KINDS.items() if k.value == data.get("kind")), None)
    if cls is None:
        raise _invalid_owner(f"unknown owner kind {data.get('kind')!r}; known: "
                             + ", ".join(k.value for k in OWNER_KINDS))
    return cls.from_json(data)


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
    for role in static_roles:
        if role.group is not None and role.group not in units:
            yield _param_error(kinds.UNKNOWN_GROUP,
                               f"static role `{role.name}` sits with unknown execution group "
                               f"`{role.group}`; known: {', '.join(units)}")
    for owned in groups:
        yield from owned.owner.declaration_errors(owned.group.name, units, role_names)
        for target in owned.group.targets:
            if target in owners:
                yield _param_error(
                    kinds.DUPLICATE_OWNERSHIP,
                    f"tensor `{target}` is owned twice: by group `{owners[target]}` and by "
                    f"group `{owned.group.name}`", group=owned.group.name, tensor=target)
            owners[target] = owned.group.name


def _role_errors(roles: Sequence[str], name: str, role_names: Sequence[str]
                 ) -> Iterator[ArchitectureParameterError]:
    """Empty, repeated and undeclared static roles of group `name`'s owner."""
    kinds = ArchitectureParameterErrorKind
    seen: set[str] = set()
    for role in roles:
        if not role or not role.strip():
            yield _param_error(kinds.EMPTY_STATIC_ROLE,
                               f"group `{name}` names an empty static role", group=name)
        elif role in seen:
            yield _param_error(kinds.REPEATED_STATIC_ROLE,
                               f"group `{name}` names static role `{role}` twice in "
                               f"{list(roles)}", group=name)
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
        return tuple(sorted(t for g in self.groups if role in g.owner.static_roles
                            for t in g.group.targets))
