"""Semantic checks of a family declaration, each yielding located errors.

The checks are small functions in two tables, as jsonschema's validators are: `FAMILY_CHECKS`
over the whole declaration and `GROUP_CHECKS` over one parameter group. Each yields every
error it finds, created with its location; `iter_semantic_errors` runs them in table order.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, is_dataclass
from dataclasses import fields as dataclass_fields
from typing import TypeGuard

from partc.errors import PartcError, SemanticError
from partc.family.declaration import (
    EXPERT_VARIABLE,
    HEAD_VARIABLE,
    UNIT_VARIABLE,
    UNIT_VARIABLES,
    FamilyDecl,
    GroupDecl,
    GroupForm,
    ModuleDecl,
    OwnerKind,
    ParamDecl,
    ReplicatedShardingDecl,
    ShardingDecl,
    SplitShardingDecl,
)
from partc.family.expr import Expression, Template
from partc.family.expr_parse import Node, parse_tree
from partc.front.positions import join_pointer
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import (
    FusedLayout,
    LinearWeightLayout,
    ProjectionSharding,
)


@dataclass(frozen=True, slots=True)
class _Declared:
    """A config field or derived value that no expression uses."""

    name: str
    """The declared name."""
    kind: str
    """`config field` or `derived value`, for messages."""
    section: str
    """`config` or `derived`: where it is declared."""
    pointer: str
    """Where it is declared."""


@dataclass(frozen=True, slots=True)
class _Use:
    """An expression using a name that a declaration used nowhere may be the misspelling of."""

    pointer: str
    """Where the expression is."""
    what: str
    """What the expression is, as its errors say (`a shape`, `units`, ...)."""
    unknown: tuple[str, ...]
    """Every name it uses that is not in its scope, sorted."""
    error: Callable[[str], PartcError]
    """Its error about one of `unknown`."""


class _Misspellings:
    """Names used but declared nowhere that are close to a declaration used nowhere, and every
    use of them the checks meet, so that a misspelt declaration is reported once, there."""

    def __init__(self, family: FamilyDecl) -> None:
        self._family = family
        self._suspects: dict[str, _Declared] | None = None
        self.uses: list[_Use] = []
        """Every expression met using one of `suspects`, in check order."""

    def suspects(self) -> dict[str, _Declared]:
        """Each undeclared name whose closest declared name (difflib) is used nowhere: the
        name as used -> that declaration (worked out on the first unknown name met)."""
        if self._suspects is None:
            self._suspects = _suspects(self._family)
        return self._suspects


def _used_names(value: object) -> Iterator[str]:
    """Every name an expression or template anywhere inside a declaration reads."""
    if isinstance(value, (Expression, Template)):
        yield from value.names
    elif isinstance(value, tuple):
        for item in value:
            yield from _used_names(item)
    elif is_dataclass(value) and not isinstance(value, type):
        for f in dataclass_fields(value):
            if f.name != "document":
                yield from _used_names(getattr(value, f.name))


def _suspects(family: FamilyDecl) -> dict[str, _Declared]:
    """`_Misspellings.suspects` of `family`."""
    used = set(_used_names(family))
    declared = family.value_names
    variables = {*UNIT_VARIABLES, HEAD_VARIABLE, *family.dimensions, "batch", "sequence",
                 *(var for g in family.groups for var, _ in g.loops)}
    document = family.document
    unused = {name: _Declared(name, kind, pointer.split("/")[1], pointer)
              for name, kind, pointer in (
                  *((f.name, "config field", f.pointer) for f in family.config),
                  *((d.name, "derived value", d.pointer) for d in family.derived))
              # a base family's declaration is spelt right: the base used it
              if name not in used and document.locate(pointer).file == document.file}
    suspects = {}
    for name in sorted(used - declared - variables):
        close = difflib.get_close_matches(name, sorted(declared), n=1)
        if close and close[0] in unused:
            suspects[name] = unused[close[0]]
    return suspects


@dataclass(frozen=True, slots=True)
class _Known:
    """What a family declares, which its expressions and owners may name."""

    family: FamilyDecl
    config: frozenset[str]
    """Config field names."""
    graph: tuple[str, ...]
    """Execution group names, in declaration order (repeats included)."""
    statics: frozenset[str]
    """Static role names."""
    misspellings: _Misspellings
    """Uses of names a declaration used nowhere may be the misspelling of (filled by checks)."""

    def error(self, message: str, pointer: str) -> SemanticError:
        """A semantic error located at `pointer` of the family document."""
        return SemanticError(message, location=self.family.document.locate(pointer),
                             pointer=pointer)

    def names(self, expr: Expression | Template | None, scope: Iterable[str], pointer: str,
              what: str) -> Iterator[PartcError]:
        """An error for the first unknown name `expr` uses (none when every name is known)."""
        if expr is None:
            return
        known = set(scope)
        unknown = sorted(n for n in expr.names if n not in known)
        if unknown:
            yield from self.out_of_scope(unknown, pointer, what,
                                         functools.partial(_name_error, self, scope=known,
                                                           pointer=pointer, what=what))

    def out_of_scope(self, unknown: list[str], pointer: str, what: str,
                     error: Callable[[str], PartcError]) -> Iterator[PartcError]:
        """`error` about the first of `unknown` (the names out of scope of the expression
        `what` at `pointer`), or, when one may be a misspelt declaration's, that use recorded
        for `_misspelt_declarations` to report."""
        if any(name in self.misspellings.suspects() for name in unknown):
            self.misspellings.uses.append(_Use(pointer, what, tuple(unknown), error))
        else:
            yield error(unknown[0])


def _close_hint(name: str, candidates: Iterable[str]) -> str:
    """`; did you mean ...?` naming the candidate closest to `name` ('' when none is close)."""
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _name_error(known: _Known, name: str, scope: set[str], pointer: str,
                what: str) -> SemanticError:
    note = known.family.document.note(pointer)
    if note:  # `no`, `off`: YAML 1.1 booleans partc reads as strings
        return known.error(f"{what} uses unknown name `{name}`; {note}", pointer)
    hint = _close_hint(name, scope)
    fields = sorted(scope & known.config)
    local = sorted(scope - known.config)  # `unit`, `expert`, `path`: variables of this place
    here = f"; here also {', '.join(f'`{v}`' for v in local)}" if local else ""
    return known.error(
        f"{what} uses unknown name `{name}`{hint or '.'} Known names: config fields "
        f"({', '.join(fields) or 'none'}){here}; declare it under `config`", pointer)


def _misspelt_declarations(known: _Known) -> Iterator[PartcError]:
    """A declaration used nowhere beside a name close to it, declared nowhere and used at
    least twice (spelt alike each time, so the declaration is the odd one out): one error, at
    the declaration, in place of one per use. Every other recorded use gets its own error (a
    name used once beside a declaration used nowhere is as likely the typo: it keeps its
    `did you mean` the declaration)."""
    uses = known.misspellings.uses
    if not uses:
        return
    suspects = known.misspellings.suspects()
    where: dict[str, dict[tuple[str, str], str]] = {}  # a default bias repeats its `when`
    for use in uses:
        for name in use.unknown:
            if name in suspects:
                where.setdefault(name, {})[use.pointer, use.what] = use.pointer
    explained: dict[str, _Declared] = {}
    for name in sorted(where, key=lambda n: (-len(where[n]), n)):
        declared = suspects[name]
        if len(where[name]) < 2 or declared in explained.values():
            continue
        explained[name] = declared
        document = known.family.document
        places = sorted({(loc.file, loc.line, loc.column)
                         for loc in map(document.locate, where[name].values())})
        shown = ", ".join(f"{file}:{line}:{column}" for file, line, column in places[:3])
        more = f" and {len(places) - 3} more" if len(places) > 3 else ""
        yield SemanticError(
            f"{declared.kind} `{declared.name}` is declared but used nowhere, while "
            f"`{name}` is used {len(where[name])} times but not declared ({shown}{more}); "
            f"expected the declaration spelt as its uses: rename `{declared.name}` to "
            f"`{name}` under `{declared.section}`",
            location=document.locate_key(declared.pointer), pointer=declared.pointer)
    for use in uses:
        left = [name for name in use.unknown if name not in explained]
        if left:
            yield use.error(left[0])


# ---------------------------------------------------------------- the family


def _config_names(known: _Known) -> Iterator[PartcError]:
    """Defaults read other config fields; probes read fields that probe nothing."""
    probes = {f.name for f in known.family.config if f.present is not None}
    fields = frozenset(f.name for f in known.family.config)
    for f in known.family.config:
        yield from known.names(f.default, fields - {f.name},
                               join_pointer(f.pointer, "default"), f"the default of `{f.name}`")
        yield from known.names(f.present, fields - probes,
                               join_pointer(f.pointer, "present"), f"the probe of `{f.name}`")


def _derived_values(known: _Known) -> Iterator[PartcError]:
    """Derived values: new names, reading known names, with no cycle among them."""
    fields = {f.name for f in known.family.config}
    derived = {d.name: d for d in known.family.derived}
    for d in known.family.derived:
        if d.name in fields:
            yield known.error(f"derived value `{d.name}` has the name of a config field; "
                              "give it a name of its own", d.pointer)
        yield from known.names(d.expression, known.config - {d.name}, d.pointer,
                               f"derived value `{d.name}`")
    state: dict[str, int] = {}  # 1: being visited, 2: done

    def visit(name: str, path: tuple[str, ...]) -> Iterator[PartcError]:
        state[name] = 1
        for used in sorted(derived[name].expression.names & derived.keys()):
            if state.get(used) == 1:
                cycle = " -> ".join(f"`{n}`" for n in (*path[path.index(used):], used))
                yield known.error(f"derived values depend on each other in a cycle: {cycle}",
                                  derived[used].pointer)
            elif used not in state:
                yield from visit(used, (*path, used))
        state[name] = 2

    for name in derived:
        if name not in state:
            yield from visit(name, (name,))


def _omit_globs(known: _Known) -> Iterator[PartcError]:
    """`omit` globs are unique and not empty."""
    seen: set[str] = set()
    for i, glob in enumerate(known.family.omit):
        if glob in seen:
            yield known.error(f"`omit` lists glob {glob!r} twice", join_pointer("/omit", i))
        seen.add(glob)


def _graph_groups(known: _Known) -> Iterator[PartcError]:
    """Execution groups: unique names, known dependencies, known names in units and paths."""
    graph = known.family.graph
    for i, g in enumerate(graph):
        if g.name in known.graph[:i]:
            first = graph[known.graph.index(g.name)]
            yield known.error(f"execution group `{g.name}` is declared twice (first at "
                              f"{known.family.document.locate(first.pointer)}); group names "
                              "must be unique", g.pointer)
        for dep in g.after:
            if dep not in known.graph:
                yield known.error(f"execution group `{g.name}` comes after unknown group "
                                  f"`{dep}`; known: {', '.join(known.graph)}", g.pointer)
        yield from known.names(g.units, known.config, join_pointer(g.pointer, "units"),
                               "`units`")
        yield from known.names(g.path, known.config | {UNIT_VARIABLE},
                               join_pointer(g.pointer, "path"), "the unit path")


def _parameter_groups(known: _Known) -> Iterator[PartcError]:
    """Every check of `GROUP_CHECKS` on every parameter group."""
    for group in known.family.groups:
        for check in GROUP_CHECKS:
            yield from check(known, group)


def _row_projections(known: _Known) -> dict[str, tuple[str, frozenset[str]]]:
    """Every projection the family splits by rows (input features): its module template ->
    (how, for messages; the groups declaring its weight as a member)."""
    rows: dict[str, tuple[str, frozenset[str]]] = {}
    for group in known.family.groups:
        name = group.name.text
        for projection in group.projections:
            if projection.sharding is ProjectionSharding.ROW:
                rows.setdefault(projection.module.text,
                                (f"group `{name}` splits it by rows", frozenset()))
        for weight in group.members:
            rule = weight.sharding
            if (not weight.name.text.endswith(".weight") or len(weight.shape) != 2
                    or weight.layout is None or not _split(rule)):
                continue
            in_axis = 0 if weight.layout is LinearWeightLayout.IN_OUT else 1
            if rule.axis == in_axis:
                module = weight.name.text.removesuffix(".weight")
                how, groups = rows.get(module, (f"group `{name}` splits `{weight.name.text}` "
                                                f"on its input axis {in_axis}", frozenset()))
                rows[module] = (how, groups | {name})
    return rows


def _row_biases_whole(known: _Known) -> Iterator[PartcError]:
    """A row projection's bias is never split, in whatever group it is declared: each rank
    computes a partial sum of the output features, the ranks' sums are added once and the
    bias with them, so the bias is whole (or kept by one rank). A bias declared split in a
    group of its own (`members:` beside a module-form row projection) adds a share of it per
    rank: the sum is right, the local computation is not. (A bias beside its member-form
    weight in one group is `_biases_follow_weights`'.)"""
    rows = _row_projections(known)
    for group in known.family.groups:
        for bias in group.members:
            module = bias.name.text.removesuffix(".bias")
            if (not bias.name.text.endswith(".bias") or len(bias.shape) != 1
                    or not _split(bias.sharding) or module not in rows):
                continue
            how, groups = rows[module]
            if group.name.text in groups:
                continue
            yield known.error(
                f"`{bias.name.text}` is {_rule_text(bias.sharding)} but `{module}` is a row "
                f"projection ({how}); expected the bias whole (`sharding: replicated`): each "
                "rank's partial output sum is added once after the all-reduce, and the bias "
                "with it", bias.pointer)


def _parent(path: str) -> str:
    """The module holding a module path or a tensor's module (the path less its last part)."""
    return path.rsplit(".", 1)[0]


def _split_heads(known: _Known) -> dict[str, list[tuple[str, str, str]]]:
    """The head counts each partitioned attention group splits, by the module its projections
    sit in (`model.layers.{unit}.self_attn`): (count as written, group, projection)."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    for group in known.family.groups:
        if group.role is not ParameterRole.ATTENTION_HEADS or group.units is None:
            continue
        stated = [(p.module.text, _parent(p.module.text), h) for p in group.projections
                  for h in p.heads]
        stated += [(m.name.text, _parent(_parent(m.name.text)), h) for m in group.members
                   for h in m.heads]
        for what, parent, heads in stated:
            found.setdefault(parent, []).append((heads.text.replace(" ", ""),
                                                 group.name.text, what))
    return found


def _per_head_tensors_split(known: _Known) -> Iterator[PartcError]:
    """A tensor with an axis of per-head values (Cohere's `q_norm` [heads, head_dim]) beside
    the projections of an attention group that splits those heads is split with them: kept
    whole in a group of its own, a rank computing 2 of 4 heads would get the 4 heads' weights.
    Found by its module (in the module the attention projections sit in) and an axis written
    as a head count a projection there states (`heads:`)."""
    heads = _split_heads(known)
    for group in known.family.groups:
        if group.role is ParameterRole.ATTENTION_HEADS and group.units is not None:
            continue
        params: list[tuple[str, ParamDecl]] = []
        if group.module is not None and not _split(group.module_sharding):
            params += [(f"{group.module.module.text}.{p.name.text}", p)
                       for p in group.module.params]
        params += [(m.name.text, m) for m in group.members if not _split(m.sharding)]
        for target, param in params:
            if len(param.shape) < 2:
                continue
            for axis, dim in enumerate(param.shape):
                match = next((h for h in heads.get(_parent(_parent(target)), ())
                              if h[0] == dim.text.replace(" ", "")), None)
                if match is None:
                    continue
                count, owner, projection = match
                yield known.error(
                    f"`{target}` is kept whole but its axis {axis} is `{dim.text}`, the heads "
                    f"group `{owner}` splits (`{projection}` states `heads: {count}`); expected "
                    "it split with those heads on that axis, in that group (a `column` "
                    "projection stating the same `heads:`): a rank computing some of the heads "
                    "holds only their values",
                    param.dimension_pointer(axis))
                break


def _boundary_names(known: _Known) -> Iterator[PartcError]:
    """Fixed boundary dimensions read config fields only; a name that is not one must be a
    declared per-request dimension."""
    tensors = [*known.family.boundary, *(t for g in known.family.graph for t in g.boundary)]
    declared = known.family.dimensions
    names = sorted({"batch", "sequence", *declared, *known.config})
    for tensor in tensors:
        for i, dim in enumerate(tensor.shape):
            if not isinstance(dim, Expression):
                continue
            unknown = sorted(n for n in dim.names if n not in known.config)
            if unknown:
                pointer = join_pointer(join_pointer(tensor.pointer, "shape"), i)
                yield from known.out_of_scope(unknown, pointer, "a boundary dimension",
                                              functools.partial(_boundary_name_error, known,
                                                                names=names, pointer=pointer))
    for name in declared:
        if name in known.config:
            yield known.error(f"per-request dimension `{name}` has the name of a config "
                              "value; give it a name of its own",
                              join_pointer("/dimensions", name))


def _boundary_name_error(known: _Known, name: str, names: list[str],
                         pointer: str) -> SemanticError:
    hint = _close_hint(name, names)
    return known.error(
        f"a boundary dimension uses unknown name `{name}`{hint or '.'} Expected `batch`, "
        "`sequence`, a per-request dimension declared under `dimensions` ("
        f"{', '.join(f'`{d}`' for d in known.family.dimensions) or 'none declared'}) or an "
        "expression over config fields", pointer)


def _static_placements(known: _Known) -> Iterator[PartcError]:
    """A static role placed `with:` a group names a declared execution group; group weights
    read config fields only."""
    for role, group in known.family.static_with:
        if group not in known.graph:
            yield known.error(f"static role `{role}` sits with unknown execution group "
                              f"`{group}`; known: {', '.join(known.graph)}",
                              join_pointer(join_pointer("/static", role), "stage"))
    for g in known.family.graph:
        yield from known.names(g.weight, known.config, join_pointer(g.pointer, "weight"),
                               "a group weight")


def _format_names(known: _Known) -> Iterator[PartcError]:
    """Linear format conditions and options read config fields only."""
    for fmt in known.family.linear_formats:
        yield from known.names(fmt.when, known.config, join_pointer(fmt.pointer, "when"),
                               "a linear format condition")
        for key, value in fmt.options:
            pointer = join_pointer(fmt.pointer, key)
            items = enumerate(value) if isinstance(value, tuple) else [(None, value)]
            for i, item in items:
                if isinstance(item, Expression):
                    yield from known.names(item, known.config, pointer if i is None
                                           else join_pointer(pointer, i),
                                           f"linear format option `{key}`")


def _state_tensors(known: _Known) -> Iterator[PartcError]:
    """`state:` entries: unique names per execution group, a declared group, a split axis the
    shape has, and known names (config fields and the unit's) in every expression."""
    seen: set[tuple[str, str]] = set()
    scope = known.config | frozenset(UNIT_VARIABLES)
    for state in known.family.state:
        if state.group not in known.graph:
            yield known.error(f"state `{state.name}` names unknown execution group "
                              f"`{state.group}`; declared: {', '.join(known.graph)}",
                              join_pointer(state.pointer, "group"))
        if (state.group, state.name) in seen:
            yield known.error(f"state `{state.name}` of execution group `{state.group}` is "
                              "declared twice; state names must be unique per group",
                              join_pointer(state.pointer, "name"))
        seen.add((state.group, state.name))
        split_pointer = join_pointer(state.pointer, "split")
        if state.split is not None and state.split.axis >= len(state.shape):
            yield known.error(f"state `{state.name}` is split on axis {state.split.axis}, but "
                              f"its shape has {len(state.shape)} axes",
                              join_pointer(split_pointer, "axis"))
        yield from known.names(state.when, scope, join_pointer(state.pointer, "when"), "`when`")
        yield from known.names(state.dtype, scope, join_pointer(state.pointer, "dtype"),
                               "`dtype`")
        for i, dim in enumerate(state.shape):
            yield from known.names(dim, scope, join_pointer(join_pointer(
                state.pointer, "shape"), i), "a shape")
        if state.split is not None:
            yield from known.names(state.split.parameters, scope,
                                   join_pointer(split_pointer, "parameters"), "a group name")
            for seg in state.split.segments:
                yield from known.names(seg, scope, join_pointer(split_pointer, "segments"),
                                       "a segment width")
            for count in state.split.heads:
                yield from known.names(count, scope, join_pointer(split_pointer, "heads"),
                                       "a head count")


FamilyCheck = Callable[[_Known], Iterator[PartcError]]
"""A check of a whole family declaration."""

FAMILY_CHECKS: tuple[FamilyCheck, ...] = (_config_names, _derived_values, _omit_globs,
                                          _graph_groups, _parameter_groups, _row_biases_whole,
                                          _per_head_tensors_split, _boundary_names,
                                          _static_placements, _state_tensors,
                                          _format_names, _misspelt_declarations)
"""Every check of a family, in the order their errors are yielded (`_misspelt_declarations`
last: it reports the uses the others recorded)."""


# ---------------------------------------------------------------- one parameter group


def _is_unit_owned(group: GroupDecl) -> bool:
    return any(o.kind is OwnerKind.UNIT for o in group.owners)


def _scope(known: _Known, group: GroupDecl) -> frozenset[str]:
    """Names a group's loop counts may read: config fields (and the unit's, if unit-owned)."""
    return known.config | frozenset(UNIT_VARIABLES) if _is_unit_owned(group) else known.config


def _loop_scope(known: _Known, group: GroupDecl) -> frozenset[str]:
    """Names the rest of a group may read: `_scope` and its loop variables."""
    return _scope(known, group) | {var for var, _ in group.loops}


def _owners_known(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """Owners name declared execution groups (each once) and declared static roles."""
    declared = set(known.graph)
    for owner in group.owners:
        if owner.kind is OwnerKind.UNIT:
            for name in owner.groups or (owner.group,):
                if name not in declared:
                    yield known.error(f"owner names unknown execution group `{name}`; declared: "
                                      f"{', '.join(sorted(declared))}", owner.pointer)
            if len(set(owner.groups)) != len(owner.groups):
                yield known.error(f"owner lists an execution group twice: "
                                  f"{', '.join(owner.groups)}", owner.pointer)
        for role in owner.roles:
            if role not in known.statics:
                yield known.error(
                    f"owner names undeclared static role `{role}`; declared under `static`: "
                    f"{', '.join(sorted(known.statics)) or '(none)'}", owner.pointer)


def _owners_agree(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A group is unit-owned (by one `unit` owner) or statically owned, not both."""
    units = sum(o.kind is OwnerKind.UNIT for o in group.owners)
    if units and units < len(group.owners):
        yield known.error("a group is either unit-owned or statically owned, not both",
                          group.pointer)
    if units > 1:
        yield known.error("a unit-owned group has one `unit` owner (list several execution "
                          "groups in it, e.g. `unit: [decoder, mtp]`)", group.pointer)


def _loops_shadow_nothing(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """Loop variables are new names."""
    for var, _ in group.loops:
        if var in known.config or var in UNIT_VARIABLES:
            yield known.error(f"loop variable `{var}` shadows a config field or one of "
                              f"{', '.join(f'`{v}`' for v in UNIT_VARIABLES)}", group.pointer)


def _group_names(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """Owner conditions, loop counts, the name, `when` and `units` read names in scope."""
    for owner in group.owners:
        yield from known.names(owner.when, known.config, join_pointer(owner.pointer, "when"),
                               "an owner condition")
    scope, inner = _scope(known, group), _loop_scope(known, group)
    for var, count in group.loops:
        yield from known.names(count, scope,
                               join_pointer(join_pointer(group.pointer, "for"), var),
                               f"the count of `{var}`")
    yield from known.names(group.name, inner, join_pointer(group.pointer, "name"),
                           "the group name")
    yield from known.names(group.when, inner, join_pointer(group.pointer, "when"), "`when`")
    yield from known.names(group.units, inner, join_pointer(group.pointer, "units"), "`units`")
    yield from known.names(group.expert_count, inner, join_pointer(join_pointer(
        group.pointer, "experts"), "count"), "`experts: {count: ...}`")


def _modules(group: GroupDecl) -> list[ModuleDecl]:
    return list(group.projections) + ([group.module] if group.module else [])


def _module_names(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """Module paths, conditions, segment widths and head counts read names in scope."""
    scope = _loop_scope(known, group)
    for module in _modules(group):
        yield from known.names(module.module, scope | {HEAD_VARIABLE} if module.per_head
                               else scope, join_pointer(module.pointer, "module"),
                               "the module path")
        yield from known.names(module.when, scope, join_pointer(module.pointer, "when"),
                               "`when`")
        for seg in module.segments:
            yield from known.names(seg, scope, module.pointer, "a segment width")
        for heads in module.heads:
            yield from known.names(heads, scope, join_pointer(module.pointer, "heads"),
                                   "`heads`")
        yield from known.names(module.groups, scope, join_pointer(module.pointer, "groups"),
                               "`groups`")


def _param_names(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """Members' and parameters' names, conditions, dtypes, shapes, heads and segments."""
    scope = _loop_scope(known, group)
    params: list[ParamDecl] = list(group.members)
    for module in _modules(group):
        params.extend(module.params)
    # A group's default bias is written nowhere (no `shape_pointer`) and reuses its weight's
    # row expression: a name wrong there is reported once, at the weight's line. Dimensions
    # that are written are each checked (equal texts share one parsed Expression).
    checked: set[int] = set()
    for param in params:
        yield from known.names(param.name, scope, param.pointer, "a target")
        yield from known.names(param.when, scope, param.pointer, "`when`")
        yield from known.names(param.dtype, scope, param.pointer, "`dtype`")
        for index, dim in enumerate(param.shape):
            if not param.shape_pointer and id(dim) in checked:
                continue
            checked.add(id(dim))
            yield from known.names(dim, scope, param.dimension_pointer(index), "a shape")
        for heads in param.heads:
            yield from known.names(heads, scope, param.pointer, "`heads`")
        for seg in param.sharding.segments if _split(param.sharding) else ():
            yield from known.names(seg, scope, param.pointer, "a segment width")


def _partitions_a_member(group: GroupDecl) -> bool:
    return (any(p.sharding is not None and p.sharding.partitions for p in group.members)
            or (group.module_sharding is not None and group.module_sharding.partitions))


def _units_where_partitioned(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A group that partitions declares `units`; one that declares `units` partitions."""
    partitions = _partitions_a_member(group)
    has_partition = (group.form is GroupForm.FUSED
                     or group.form is GroupForm.PROJECTIONS and group.units or partitions)
    if has_partition and group.units is None:
        yield known.error("this group partitions a member but declares no `units`",
                          group.pointer)
    if (group.units is not None and group.form in (GroupForm.MEMBERS, GroupForm.MODULE)
            and not partitions):
        yield known.error(
            f"this group declares `units: {group.units_text}` but no member is partitioned; "
            "drop `units`, or shard a member with `partitioned` or `partitioned_segments`",
            join_pointer(group.pointer, "units"))


def _experts_declared_once(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A group is one routed expert (`for: {expert: ...}`) or stacks them (`experts:`), not
    both."""
    if group.expert_axis is not None and group.expert_loop:
        yield known.error(
            "a group declares `experts: {axis: ...}` (every routed expert stacked in its "
            "tensors) and also loops `for: {expert: ...}` (one expert per group); use one",
            join_pointer(group.pointer, "experts"))


def _counts_experts_in_order(node: Node) -> bool:
    """Whether an expert index reads `expert` as the global expert id: the loop variable
    itself, or it plus (or minus) an offset that does not read it (so on-disk experts keep
    the loop's order, the order of the router's columns)."""
    if node.kind == "name":
        return node.name == EXPERT_VARIABLE
    if node.kind != "arith" or any(op not in ("+", "-") for op, _ in node.ops):
        return False
    reading = [i for i, child in enumerate(node.children)
               if EXPERT_VARIABLE in _tree_names(child)]
    if len(reading) != 1:
        return False
    index = reading[0]
    child = node.children[index]
    positive = index == 0 or node.ops[index - 1][0] == "+"
    return positive and child.kind == "name" and child.name == EXPERT_VARIABLE


def _tree_names(node: Node) -> frozenset[str]:
    """Every name a syntax tree reads."""
    if node.kind == "name":
        return frozenset((node.name,))
    names: frozenset[str] = frozenset()
    for child in node.children:
        names |= _tree_names(child)
    return names


def _misnumbered_field(template: Template) -> str | None:
    """The first field of `template` that reads `expert` other than in the loop's order."""
    for field in template.fields:
        if EXPERT_VARIABLE in field.expression.names:
            root, _ = parse_tree(field.expression.text)
            if not _counts_experts_in_order(root):
                return field.expression.text
    return None


def _experts_numbered_by_loop(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A per-expert group's tensor names number experts with the loop variable `expert` (plus
    an offset at most): its value is the global expert id, the router's column, which expert
    parallelism places."""
    if not group.expert_loop:
        return
    templates: list[tuple[Template, str, str]] = []
    for module in _modules(group):
        templates.append((module.module, join_pointer(module.pointer, "module"),
                          "the module path"))
        templates.extend((param.name, param.pointer, "the parameter name")
                         for param in module.params)
    templates.extend((member.name, member.pointer, "the target") for member in group.members)
    templates.append((group.name, join_pointer(group.pointer, "name"), "the group name"))
    found = [(template, pointer, what, text) for template, pointer, what in templates
             if (text := _misnumbered_field(template)) is not None]
    if not found:
        return
    template, pointer, what, text = found[0]
    others = (f" ({len(found) - 1} more template{'s' * (len(found) > 2)} of this group "
              "number them the same way)" if len(found) > 1 else "")
    yield known.error(
        f"{what} `{template.text}` numbers the experts with `{{{text}}}`; expected "
        f"`{{{EXPERT_VARIABLE}}}` (or `{{{EXPERT_VARIABLE} + OFFSET}}`, an offset that does not "
        f"read `{EXPERT_VARIABLE}`): the loop value is the global expert id (the router's "
        f"column), and the checkpoint's experts must follow it in order{others}", pointer)


def _split_modules(group: GroupDecl) -> list[ModuleDecl]:
    """The projections of a partitioned group that split an axis (column or row)."""
    if group.units is None or group.form not in (GroupForm.PROJECTIONS, GroupForm.FUSED):
        return []
    return [m for m in group.projections
            if m.sharding is not None and m.sharding.value in ("column", "row")]


def _attention_heads_stated(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """An `attention_heads` group whose members are split states `heads:` on each of them, so
    no partition unit can cut a head (without it, `units: hidden_size` at T=3 splits the
    columns 22/21/21 and cuts 16-wide heads)."""
    if group.role is not ParameterRole.ATTENTION_HEADS:
        return
    for module in _split_modules(group):
        if not module.heads and module.segments and \
                module.layout is FusedLayout.COMPONENT_MAJOR:
            yield known.error(_fused_without_heads(group, module), module.pointer)
        elif not module.heads:
            yield known.error(
                f"this `attention_heads` group splits `{module.module.text}` "
                f"({module.sharding.value if module.sharding else ''}) over `units: "
                f"{group.units_text}` but it states no `heads:`; expected its head count "
                "(e.g. `heads: num_attention_heads`), found none, so a partition unit could "
                "cut a head", module.pointer)
    for member in group.members:
        if member.sharding is not None and member.sharding.partitions and not member.heads:
            yield known.error(
                f"this `attention_heads` group partitions `{member.name.text}` but it states "
                "no `heads:`; expected its head count, found none, so a partition unit could "
                "cut a head", member.pointer)


def _fused_without_heads(group: GroupDecl, module: ModuleDecl) -> str:
    """The message of a split fused projection of the default layout without `heads:`: one
    head count per segment, and which layout its rows may be, for a single count such as
    `heads: num_attention_heads` can pass a few T by luck on rows grouped per KV head."""
    sharding = module.sharding.value if module.sharding else ""
    return (f"this `attention_heads` group splits the fused `{module.module.text}` ({sharding})"
            f" over `units: {group.units_text}` but it states no `heads:`; expected one head "
            f"count per segment ({len(module.segments)} segments), and the layout of its rows: "
            "the default `[all q | all k | all v]`, `layout: per_head` for `[q k v]` per head, "
            "or `layout: grouped_per_kv` with `heads: [num_attention_heads, KV heads, KV "
            "heads]` for the query heads, k and v of each KV head together (Falcon's new "
            "decoder), docs/layouts.md; found none, so a partition unit could cut a head")


def _per_head_modules(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A `sharding: per_head` projection states its head count, names each module by `{head}`
    and sits in an `attention_heads` group with `units:`, whose partition says which ranks
    hold which heads."""
    for module in group.projections:
        if not module.per_head:
            continue
        if not module.heads:
            yield known.error("a `sharding: per_head` projection is one module per head; "
                              "expected its head count (e.g. `heads: num_attention_heads`), "
                              "found none", module.pointer)
        if HEAD_VARIABLE not in module.module.names:
            yield known.error(f"a `sharding: per_head` projection names each head's module by "
                              f"`{{{HEAD_VARIABLE}}}`; expected it in the module path, found "
                              f"`{module.module.text}`", join_pointer(module.pointer, "module"))
        if group.role is not ParameterRole.ATTENTION_HEADS or group.units is None:
            yield known.error("a `sharding: per_head` projection follows the heads of its "
                              "group's partition; expected an `attention_heads` group with "
                              f"`units:`, found role {group.role.value}"
                              + ("" if group.units is not None else " without `units:`"),
                              module.pointer)


def _split(rule: ShardingDecl | None) -> TypeGuard[SplitShardingDecl]:
    """Whether a member rule splits its tensor (None: not stated, replicated)."""
    return rule is not None and not isinstance(rule, ReplicatedShardingDecl)


def _replicated_splits_nothing(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A `replicated` group is whole on every rank of its stages: none of its members is
    split (a split norm in one adds up exactly in verify's sum of masked ranks, so only this
    rule sees it)."""
    if group.role is not ParameterRole.REPLICATED:
        return
    fix = ("expected `sharding: replicated`, or a role that says what the split divides "
           "(`channels`, `feed_forward_intermediate`, `attention_heads`, ...)")
    for member in group.members:
        if _split(member.sharding):
            assert member.sharding is not None
            yield known.error(f"this `replicated` group splits `{member.name.text}` "
                              f"({member.sharding.kind.value}); {fix}", member.pointer)
    if _split(group.module_sharding):
        assert group.module_sharding is not None
        yield known.error(f"this `replicated` group splits its module's parameters "
                          f"({group.module_sharding.kind.value}); {fix}",
                          join_pointer(group.pointer, "sharding"))
    for module in group.projections:
        if module.sharding in (ProjectionSharding.COLUMN, ProjectionSharding.ROW):
            assert module.sharding is not None
            yield known.error(f"this `replicated` group splits `{module.module.text}` "
                              f"({module.sharding.value}); {fix}", module.pointer)


def _vocabulary_splits_rows(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A `vocabulary` group splits the vocabulary: a head by its output features (`column`),
    an embedding's rows (axis 0); a row split, or another axis, splits the hidden features."""
    if group.role is not ParameterRole.VOCABULARY:
        return
    for module in group.projections:
        if module.sharding is ProjectionSharding.ROW:
            yield known.error(
                f"this `vocabulary` group splits `{module.module.text}` by its input features "
                "(`row`); expected `column` (a head's vocabulary rows) or `replicated`",
                module.pointer)
    rules = [(m.sharding, m.pointer, f"`{m.name.text}`", len(m.shape)) for m in group.members]
    if group.module_sharding is not None and group.module is not None:
        rules.append((group.module_sharding, join_pointer(group.pointer, "sharding"),
                      "its module's parameters", max((len(q.shape) for q in group.module.params),
                                                     default=0)))
    for rule, pointer, what, ndim in rules:  # an axis past the shape is the binder's error
        if _split(rule) and rule.axis != 0 and rule.axis < ndim:
            yield known.error(
                f"this `vocabulary` group splits {what} on axis {rule.axis}; expected axis 0, "
                "the vocabulary rows of an embedding or head (another axis splits the hidden "
                "features)", pointer)


def _stated_heads_are_split(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """In a partitioned `attention_heads` group a projection that states `heads:` is split:
    heads are what the units divide, and one kept whole would give each rank all of its heads
    beside a share of the others' (every key head against a share of the value heads)."""
    if group.role is not ParameterRole.ATTENTION_HEADS or group.units is None:
        return
    for module in group.projections:
        if module.heads and module.sharding is ProjectionSharding.REPLICATED:
            yield known.error(
                f"this `attention_heads` group keeps `{module.module.text}` whole although it "
                f"states `heads:`; expected it split (`column` or `row`) like the group's other "
                f"head projections over `units: {group.units_text}`, or no `heads:` for a "
                "projection every rank needs whole", module.pointer)
    for member in group.members:
        if member.heads and not _split(member.sharding):
            yield known.error(
                f"this `attention_heads` group keeps `{member.name.text}` whole although it "
                f"states `heads:`; expected it partitioned over `units: {group.units_text}`, or "
                "no `heads:` for a tensor every rank needs whole", member.pointer)


def _split_axes(module: ModuleDecl | None, param: ParamDecl,
                rule: ShardingDecl | None) -> set[int]:
    """The axes of `param` its group's declaration splits."""
    if module is not None and module.sharding is not None:
        if module.sharding is ProjectionSharding.REPLICATED:
            return set()
        ndim = len(param.shape)
        if ndim == 1:  # a bias: split with the output features, whole after a row's sum
            return {0} if module.sharding is ProjectionSharding.COLUMN else set()
        out_axis, in_axis = module.orientation.axes(ndim)
        return {out_axis if module.sharding is ProjectionSharding.COLUMN else in_axis}
    return {rule.axis} if _split(rule) else set()


def _units_axes_split(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """A matrix kept whole in a partitioned group must not have an axis written exactly as one
    the group divides: its `units`, or the split axis of another of its members. It would hold
    every unit on every rank while the others hold a share (a `c_proj` kept whole beside a
    split `c_fc`; a `k_proj` kept whole beside a split `v_proj` of the same size, which gives a
    rank every key head against its share of the value heads). A matrix that splits some axis,
    and a vector (a row projection's bias is whole), are left to the other rules: the same
    expression may also size an axis that is not divided."""
    if group.units is None:
        return
    params: list[tuple[ModuleDecl | None, ParamDecl, ShardingDecl | None]] = [
        (None, m, m.sharding) for m in group.members]
    for projection in group.projections:
        params.extend((projection, p, None) for p in projection.params)
    if group.module is not None:
        params.extend((None, p, group.module_sharding) for p in group.module.params)

    def spelt(module: ModuleDecl | None, param: ParamDecl) -> str:
        return f"{module.module.text}.{param.name.text}" if module is not None else \
            param.name.text

    divided = {group.units.text.replace(" ", ""): f"`{group.units_text}`, the units this group "
                                                  "divides over its ranks"}
    for module, param, rule in params:
        if len(param.shape) < 2:
            continue
        for axis in sorted(_split_axes(module, param, rule)):
            if axis < len(param.shape):
                divided.setdefault(param.shape[axis].text.replace(" ", ""),
                                   f"`{param.shape[axis].text}`, the axis `{spelt(module, param)}` "
                                   "splits")
    for module, param, rule in params:
        if len(param.shape) < 2 or _split_axes(module, param, rule):
            continue
        for axis, dim in enumerate(param.shape):
            why = divided.get(dim.text.replace(" ", ""))
            if why is not None:
                yield known.error(
                    f"`{spelt(module, param)}` is kept whole but its axis {axis} is {why}; "
                    "expected that axis split like the group's other members, or the tensor in "
                    "a group of its own", param.dimension_pointer(axis))
                break


def _biases_follow_weights(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """In member form a bias `<m>.bias` beside a 2-D `<m>.weight` is split as the weight's
    output axis is: on axis 0 in the same way when the weight splits its output features,
    whole when the weight is whole or splits its input features (a row-parallel bias is added
    once, after the ranks' sum). The output axis is the one sized as the bias (for a square
    weight: axis 0, or 1 for `format: linear_transposed`)."""
    weights = {m.name.text.removesuffix("weight"): m for m in group.members
               if m.name.text.endswith(".weight") and len(m.shape) == 2}
    for bias in group.members:
        weight = weights.get(bias.name.text.removesuffix("bias"))
        if not bias.name.text.endswith(".bias") or len(bias.shape) != 1 or weight is None:
            continue
        size = bias.shape[0].text.replace(" ", "")
        fits = [a for a in (0, 1) if weight.shape[a].text.replace(" ", "") == size]
        if not fits:
            continue
        out_axis = fits[0] if len(fits) == 1 else (
            1 if weight.layout is LinearWeightLayout.IN_OUT else 0)
        rule, want = bias.sharding, weight.sharding
        if _split(want) and want.axis == out_axis:
            same = (_split(rule) and rule.axis == 0
                    and rule.kind is want.kind
                    and [e.text for e in rule.segments] == [e.text for e in want.segments])
            if not same:
                yield known.error(
                    f"`{bias.name.text}` is {_rule_text(rule)} but `{weight.name.text}` splits "
                    f"its output features ({_rule_text(want)}); expected the bias split the "
                    f"same way on axis 0 ({want.kind.value}), so each rank adds its own "
                    "outputs' bias", bias.pointer)
        elif _split(rule):
            how = ("splits its input features" if _split(want) else "is whole")
            yield known.error(
                f"`{bias.name.text}` is {_rule_text(rule)} but `{weight.name.text}` {how}; "
                "expected the bias whole (`sharding: replicated`): the ranks' partial sums are "
                "added once, and the bias with them", bias.pointer)


def _rule_text(rule: ShardingDecl | None) -> str:
    """A member rule as written, for messages."""
    if not _split(rule):
        return "replicated"
    return f"{{{rule.kind.value}: {rule.axis}}}"


GroupCheck = Callable[[_Known, GroupDecl], Iterator[PartcError]]
"""A check of one parameter group."""

def _groups_with_grouped_layout(known: _Known, group: GroupDecl) -> Iterator[PartcError]:
    """`groups:` belongs to the `grouped` fused layout, and that layout needs it."""
    for module in group.projections:
        grouped = module.layout is FusedLayout.GROUPED
        if grouped and module.groups is None:
            yield known.error("layout `grouped` needs `groups:`, the group count of the fused "
                              "rows (CodeGen: `mp_num`)", join_pointer(module.pointer, "layout"))
        elif module.groups is not None and not grouped:
            yield known.error(f"`groups:` is the group count of layout `grouped`, but this "
                              f"fused projection has layout `{module.layout.value}`",
                              join_pointer(module.pointer, "groups"))


GROUP_CHECKS: tuple[GroupCheck, ...] = (
    _owners_known, _owners_agree, _loops_shadow_nothing, _group_names, _module_names,
    _param_names, _units_where_partitioned, _attention_heads_stated, _per_head_modules,
    _experts_declared_once, _experts_numbered_by_loop, _replicated_splits_nothing,
    _vocabulary_splits_rows,
    _stated_heads_are_split, _units_axes_split, _biases_follow_weights,
    _groups_with_grouped_layout)
"""Every check of a parameter group, in the order their errors are yielded."""


def iter_semantic_errors(family: FamilyDecl) -> Iterator[PartcError]:
    """Yield every inconsistency of a family that can be found without a config."""
    known = _Known(family=family, config=family.value_names,
                   graph=tuple(g.name for g in family.graph),
                   statics=frozenset(name for name, _ in family.static_roles),
                   misspellings=_Misspellings(family))
    seen: set[tuple[str, str]] = set()  # a group's default bias is checked once, not per use
    for check in FAMILY_CHECKS:
        for error in check(known):
            if (error.message, error.pointer) not in seen:
                seen.add((error.message, error.pointer))
                yield error
