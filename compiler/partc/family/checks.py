"""Semantic checks of a family declaration, each yielding located errors."""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from partc.errors import PartcError, SemanticError
from partc.family.declaration import (
    UNIT_VARIABLE,
    UNIT_VARIABLES,
    FamilyDecl,
    GroupDecl,
    GroupForm,
    OwnerKind,
)
from partc.family.expr import Expression, Template
from partc.front.positions import join_pointer


def _unknown_names(expr: Expression | Template | None, scope: set[str]) -> list[str]:
    if expr is None:
        return []
    return sorted(n for n in expr.names if n not in scope)


def _name_error(family: FamilyDecl, names: list[str], scope: set[str], pointer: str,
                what: str) -> SemanticError:
    name = names[0]
    close = difflib.get_close_matches(name, sorted(scope), n=1)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    note = family.document.note(pointer)
    if note:  # `no`, `off`: YAML 1.1 booleans partc reads as strings
        return SemanticError(f"{what} uses unknown name `{name}`; {note}",
                             location=family.document.locate(pointer), pointer=pointer)
    return SemanticError(
        f"{what} uses unknown name `{name}`{hint or '.'} Known names: config fields "
        f"({', '.join(sorted(scope)) or 'none'}); declare it under `config`",
        location=family.document.locate(pointer), pointer=pointer)


def iter_semantic_errors(family: FamilyDecl) -> Iterator[PartcError]:
    """Yield every inconsistency of a family that can be found without a config."""
    config_names = {f.name for f in family.config}
    graph_names = [g.name for g in family.graph]
    static_names = {name for name, _ in family.static_roles}

    def check(expr: Expression | Template | None, scope: set[str], pointer: str,
              what: str) -> Iterator[PartcError]:
        names = _unknown_names(expr, scope)
        if names:
            yield _name_error(family, names, scope, pointer, what)

    probes = {f.name for f in family.config if f.present is not None}
    for f in family.config:
        yield from check(f.default, config_names - {f.name}, join_pointer(f.pointer, "default"),
                         f"the default of `{f.name}`")
        yield from check(f.present, config_names - probes, join_pointer(f.pointer, "present"),
                         f"the probe of `{f.name}`")
    for i, g in enumerate(family.graph):
        if g.name in graph_names[:i]:
            first = family.graph[graph_names.index(g.name)]
            yield SemanticError(f"execution group `{g.name}` is declared twice (first at "
                                f"{family.document.locate(first.pointer)}); group names must "
                                "be unique", location=family.document.locate(g.pointer),
                                pointer=g.pointer)
        for dep in g.after:
            if dep not in graph_names:
                yield SemanticError(f"execution group `{g.name}` comes after unknown group `{dep}`;"
                                    f" known: {', '.join(graph_names)}",
                                    location=family.document.locate(g.pointer), pointer=g.pointer)
        yield from check(g.units, config_names, join_pointer(g.pointer, "units"), "`units`")
        yield from check(g.path, config_names | {UNIT_VARIABLE}, join_pointer(g.pointer, "path"),
                         "the unit path")
    for group in family.groups:
        yield from _group_errors(family, group, config_names, set(graph_names), static_names)
    for tensor in family.boundary:
        for dim in tensor.shape:
            if isinstance(dim, Expression):
                yield from check(dim, config_names, tensor.pointer, "a boundary dimension")
    for fmt in family.linear_formats:
        yield from check(fmt.when, config_names, join_pointer(fmt.pointer, "when"),
                         "a linear format condition")
        for key, value in fmt.options:
            for i, item in enumerate(value if isinstance(value, tuple) else (value,)):
                if isinstance(item, Expression):
                    pointer = join_pointer(fmt.pointer, key)
                    yield from check(item, config_names, join_pointer(pointer, i)
                                     if isinstance(value, tuple) else pointer,
                                     f"linear format option `{key}`")


def _group_errors(family: FamilyDecl, group: GroupDecl, config_names: set[str],
                  graph_names: set[str], static_names: set[str]) -> Iterator[PartcError]:
    loc = family.document.locate
    unit_owned = False
    for owner in group.owners:
        if owner.kind is OwnerKind.UNIT:
            unit_owned = True
            for name in owner.groups or (owner.group,):
                if name not in graph_names:
                    yield SemanticError(
                        f"owner names unknown execution group `{name}`; declared: "
                        f"{', '.join(sorted(graph_names))}", location=loc(owner.pointer),
                        pointer=owner.pointer)
            if len(set(owner.groups)) != len(owner.groups):
                yield SemanticError(f"owner lists an execution group twice: "
                                    f"{', '.join(owner.groups)}", location=loc(owner.pointer),
                                    pointer=owner.pointer)
        for role in owner.roles:
            if role not in static_names:
                yield SemanticError(
                    f"owner names undeclared static role `{role}`; declared under `static`: "
                    f"{', '.join(sorted(static_names)) or '(none)'}", location=loc(owner.pointer),
                    pointer=owner.pointer)
    if unit_owned and any(o.kind is not OwnerKind.UNIT for o in group.owners):
        yield SemanticError("a group is either unit-owned or statically owned, not both",
                            location=loc(group.pointer), pointer=group.pointer)
    if sum(o.kind is OwnerKind.UNIT for o in group.owners) > 1:
        yield SemanticError("a unit-owned group has one `unit` owner (list several execution "
                            "groups in it, e.g. `unit: [decoder, mtp]`)",
                            location=loc(group.pointer), pointer=group.pointer)
    scope = set(config_names)
    if unit_owned:
        scope.update(UNIT_VARIABLES)
    for var, _ in group.loops:
        if var in config_names or var in UNIT_VARIABLES:
            yield SemanticError(f"loop variable `{var}` shadows a config field or one of "
                                f"{', '.join(f'`{v}`' for v in UNIT_VARIABLES)}",
                                location=loc(group.pointer), pointer=group.pointer)
    loop_scope = scope | {var for var, _ in group.loops}

    def check(expr: Expression | Template | None, names: set[str], pointer: str,
              what: str) -> Iterator[PartcError]:
        unknown = _unknown_names(expr, names)
        if unknown:
            yield _name_error(family, unknown, names, pointer, what)

    for owner in group.owners:
        yield from check(owner.when, config_names, join_pointer(owner.pointer, "when"),
                         "an owner condition")
    for var, count in group.loops:
        yield from check(count, scope, join_pointer(join_pointer(group.pointer, "for"), var),
                         f"the count of `{var}`")
    yield from check(group.name, loop_scope, join_pointer(group.pointer, "name"), "the group name")
    yield from check(group.when, loop_scope, join_pointer(group.pointer, "when"), "`when`")
    yield from check(group.units, loop_scope, join_pointer(group.pointer, "units"), "`units`")
    modules = list(group.projections) + ([group.module] if group.module else [])
    params = list(group.members)
    for module in modules:
        yield from check(module.module, loop_scope, join_pointer(module.pointer, "module"),
                         "the module path")
        yield from check(module.when, loop_scope, join_pointer(module.pointer, "when"), "`when`")
        for seg in module.segments:
            yield from check(seg, loop_scope, module.pointer, "a segment width")
        for heads in module.heads:
            yield from check(heads, loop_scope, join_pointer(module.pointer, "heads"), "`heads`")
        params.extend(module.params)
    for param in params:
        yield from check(param.name, loop_scope, param.pointer, "a target")
        yield from check(param.when, loop_scope, param.pointer, "`when`")
        yield from check(param.dtype, loop_scope, param.pointer, "`dtype`")
        for index, dim in enumerate(param.shape):
            yield from check(dim, loop_scope, param.dimension_pointer(index), "a shape")
        for heads in param.heads:
            yield from check(heads, loop_scope, param.pointer, "`heads`")
        if param.sharding:
            for seg in param.sharding.segments:
                yield from check(seg, loop_scope, param.pointer, "a segment width")
    partitions = (any(p.sharding is not None and p.sharding.partitions for p in group.members)
                  or (group.module_sharding is not None and group.module_sharding.partitions))
    has_partition = (group.form is GroupForm.FUSED
                     or group.form is GroupForm.PROJECTIONS and group.units or partitions)
    if has_partition and group.units is None:
        yield SemanticError("this group partitions a member but declares no `units`",
                            location=loc(group.pointer), pointer=group.pointer)
    if (group.units is not None and group.form in (GroupForm.MEMBERS, GroupForm.MODULE)
            and not partitions):
        pointer = join_pointer(group.pointer, "units")
        yield SemanticError(
            f"this group declares `units: {group.units_text}` but no member is partitioned; "
            "drop `units`, or shard a member with `partitioned` or `partitioned_segments`",
            location=loc(pointer), pointer=pointer)
