"""Stage 4: bind a symbolic family to a model's config.json.

Config fields are read (with types and defaults), every expression is evaluated, repeated groups
are expanded over units and loop variables, and the result is a validated
`ArchitectureParameterDescription` plus the boundary wire schema.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from partc.bind.cache import GroupTemplate, StructureKey, renamed_group
from partc.bind.consistency import BoundProjection, check_projections
from partc.bind.linear_formats import linear_format_expansion, target_facts
from partc.bind.runtime_state import BoundStateTensor, bind_state
from partc.bind.values import Binder, Value, default_dtype, read_config_values, recorded
from partc.errors import PartcError, SemanticError
from partc.family.declaration import (
    EXPERT_VARIABLE,
    HEAD_VARIABLE,
    GroupForm,
    OwnerKind,
    ReplicatedShardingDecl,
)
from partc.family.expr import Expression
from partc.family.expr_values import MAX_LIST_LENGTH, format_value
from partc.front.positions import join_pointer
from partc.parallel.experts import ExpertGroup
from partc.parallel.formats import LinearFormat
from partc.parallel.placements import DTYPE_BITS, TORCH_DTYPE_NAMES
from partc.parallel.specs import (
    EqualSharding,
    MemberSharding,
    ParameterGroupSpec,
    ParameterMemberSpec,
    PartitionedSharding,
    Projection,
    ProjectionSharding,
    ReplicatedSharding,
    ShardingPolicy,
    member_sharding,
    partitioned_projection_group,
    segmented_projection_group,
)
from partc.partition.boundary import (
    UNSIZED_DIMENSIONS,
    BoundaryTensorDimension,
    BoundaryTensorDimensionKind,
    BoundaryTensorSpec,
    BoundaryWireSchema,
    FixedDimension,
    RequestDimension,
)
from partc.partition.ownership import (
    ArchitectureParameterDescription,
    ExecutionGraph,
    ExecutionGroupSpec,
    ExecutionUnit,
    GroupParallelMode,
    OwnedParameterGroupSpec,
    ParameterGroupOwner,
    StaticAnyOf,
    StaticRole,
    StaticRoleSpec,
)

if TYPE_CHECKING:
    from partc.family.declaration import (
        BoundaryTensorDecl,
        FamilyDecl,
        GroupDecl,
        ModuleDecl,
        ParamDecl,
        ShardingDecl,
    )
    from partc.front.load import RawDocument



@dataclass(frozen=True, slots=True, kw_only=True)
class BoundArchitecture:
    """A family bound to one model config: concrete groups, owners, graph and boundary."""

    family: str
    """Family name."""
    model_type: str
    """The config's `model_type`."""
    config_values: tuple[tuple[str, Value], ...]
    """Every config field's value, sorted by name."""
    description: ArchitectureParameterDescription
    """Validated ownership of every parameter group."""
    boundary: BoundaryWireSchema
    """What crosses a pipeline cut."""
    policy: ShardingPolicy | None
    """The family's default sharding policy."""
    group_pointers: tuple[tuple[str, str], ...]
    """Each logical group name and the pointer of the declaration it came from, sorted."""
    linear_format: LinearFormat | None = None
    """The linear format the config selected (None: every weight dense)."""
    omit: tuple[str, ...] = ()
    """Globs of checkpoint tensors loaded by no rank (the family's `omit`)."""
    group_boundaries: tuple[tuple[str, BoundaryWireSchema], ...] = ()
    """Execution groups that declare their own boundary: what crosses a cut after one of their
    units (every other group's cuts carry `boundary`), in canonical order."""
    group_weights: tuple[tuple[str, int], ...] = ()
    """Declared per-unit pipeline cost of each execution group that has one."""
    group_modes: tuple[tuple[str, GroupParallelMode], ...] = ()
    """Declared parallel mode of each execution group that has one."""
    experts: tuple[tuple[str, ExpertGroup], ...] = ()
    """The routed-expert groups (per-expert or stacked) by name, in binding order."""
    states: tuple[BoundStateTensor, ...] = ()
    """Declared runtime state tensors, one per carrying unit, in canonical unit order."""

    def omitted(self, names: Collection[str]) -> tuple[str, ...]:
        """The checkpoint tensor names the `omit` globs match, sorted."""
        return tuple(sorted(n for n in names
                            if any(fnmatch.fnmatchcase(n, glob) for glob in self.omit)))


MAX_UNITS = 4096
"""Most units one execution group, and most iterations one `for` variable, may have (32 times
the deepest real decoder; a Llama of this many layers compiles in a few seconds, measured by
benchmarks/limits.py)."""
MAX_GROUP_INSTANCES = 65_536
"""Most parameter-group instances a family may expand to (bounds time and memory: four times
DeepSeek-V3's 15,214)."""


# ---------------------------------------------------------------- group expansion


def _dtype(binder: Binder, param: ParamDecl, env: Mapping[str, Value], default: str) -> str:
    if param.dtype is None:
        return default
    value = binder.evaluate(param.dtype, env, param.pointer)
    if isinstance(value, str) and value in TORCH_DTYPE_NAMES:
        return TORCH_DTYPE_NAMES[value]
    if not isinstance(value, str) or value not in DTYPE_BITS:
        raise binder.fail(f"dtype must be one of {', '.join(sorted(DTYPE_BITS))} (or a torch "
                          f"name), found {format_value(value)}", param.pointer)
    return value


def _shape(binder: Binder, param: ParamDecl, env: Mapping[str, Value]) -> tuple[int, ...]:
    return tuple(binder.integer(d, env, param.dimension_pointer(i), "a shape dimension",
                                minimum=0) for i, d in enumerate(param.shape))


def _declared_segments(decl: ShardingDecl) -> tuple[Expression, ...]:
    """The segment widths a rule declares (none unless it is a segments kind)."""
    return () if isinstance(decl, ReplicatedShardingDecl) else decl.segments


def _member_sharding(binder: Binder, decl: ShardingDecl, env: Mapping[str, Value],
                     pointer: str) -> MemberSharding:
    if isinstance(decl, ReplicatedShardingDecl):
        return member_sharding(decl.kind)
    return member_sharding(decl.kind, axis=decl.axis,
                           segments=_segments(binder, decl.segments, env, pointer))


def _params(binder: Binder, module: ModuleDecl, env: Mapping[str, Value],
            dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for param in module.params:
        if binder.boolean(param.when, env, param.pointer):
            out[binder.render(param.name, env, param.pointer)] = (
                _shape(binder, param, env), _dtype(binder, param, env, dtype))
    return out


def _build_group(binder: Binder, decl: GroupDecl, env: Mapping[str, Value], name: str,
                 dtype: str) -> ParameterGroupSpec | None:
    units = (binder.integer(decl.units, env, join_pointer(decl.pointer, "units"),
                            "`units`", minimum=1) if decl.units is not None else None)
    label = decl.units_text
    if decl.form is GroupForm.MEMBERS:
        members = []
        for param in decl.members:
            if not binder.boolean(param.when, env, param.pointer):
                continue
            assert param.sharding is not None
            members.append(ParameterMemberSpec(
                target=binder.render(param.name, env, param.pointer),
                shape=_shape(binder, param, env),
                sharding=_member_sharding(binder, param.sharding, env, param.pointer),
                dtype=_dtype(binder, param, env, dtype),
                linear=param.layout,
                heads=_heads(binder, param, env),
                tp_reduction=param.tp_reduction and param.sharding.partitions,
                tp_output_reduction=param.tp_output_reduction and param.sharding.partitions))
        if not members:
            return None
        partitioned = any(m.sharding.is_partitioned for m in members)
        return ParameterGroupSpec(name=name, role=decl.role, members=tuple(members),
                                  units=units if partitioned else None, units_label=label,
                                  policy=decl.policy, kv_replication=decl.kv_replication)
    if decl.form is GroupForm.MODULE:
        assert decl.module is not None and decl.module_sharding is not None
        module = binder.render(decl.module.module, env, decl.module.pointer)
        sharding = _member_sharding(binder, decl.module_sharding, env, decl.pointer)
        members = [ParameterMemberSpec(target=f"{module}.{p}", shape=shape, sharding=sharding,
                                       dtype=pdtype)
                   for p, (shape, pdtype) in _params(binder, decl.module, env, dtype).items()]
        if not members:
            return None
        return ParameterGroupSpec(name=name, role=decl.role, members=tuple(members),
                                  units=units if sharding.is_partitioned else None,
                                  units_label=label, policy=decl.policy,
                                  kv_replication=decl.kv_replication)
    modules = [m for m in decl.projections if binder.boolean(m.when, env, m.pointer)]
    per_head = _per_head_members(binder, [m for m in modules if m.per_head], env, dtype)
    modules = [m for m in modules if not m.per_head]
    rendered = [(binder.render(m.module, env, m.pointer), m, _params(binder, m, env, dtype))
                for m in modules]
    if decl.form is GroupForm.FUSED:
        (fused_name, fused, fused_params), (out_name, _, out_params) = rendered
        segments = _segments(binder, fused.segments, env, fused.pointer)
        assert units is not None
        out_decl = rendered[1][1]
        out_heads = _heads(binder, out_decl, env)
        group = segmented_projection_group(
            name, decl.role, fused_module=fused_name, segments=segments,
            fused_params={k: v[0] for k, v in fused_params.items()}, output_module=out_name,
            output_params={k: v[0] for k, v in out_params.items()}, units=units, dtype=dtype,
            units_label=label, linear=fused.linear,
            fused_heads=_heads(binder, fused, env),
            output_heads=out_heads[0] if out_heads else None, layout=fused.layout,
            orientation=fused.orientation, output_orientation=out_decl.orientation,
            fused_groups=_fused_groups(binder, fused, env))
        if not out_decl.linear:
            group = replace(group, members=tuple(
                replace(m, linear=None) if m.target.startswith(out_name + ".") else m
                for m in group.members))
        dtypes = {f"{fused_name}.{k}": v[1] for k, v in fused_params.items()}
        dtypes.update({f"{out_name}.{k}": v[1] for k, v in out_params.items()})
    else:
        projections = [Projection(
            module=mod, sharding=m.sharding or ProjectionSharding.REPLICATED,
            params={k: v[0] for k, v in params.items()}, linear=m.linear,
            heads=next(iter(_heads(binder, m, env)), None), orientation=m.orientation,
            tp_reduction=m.tp_reduction, tp_output_reduction=m.tp_output_reduction)
            for mod, m, params in rendered]
        dtypes = {f"{mod}.{k}": v[1] for mod, _, params in rendered for k, v in params.items()}
        if units is None:
            members = []
            for projection in projections:
                group = partitioned_projection_group(name, decl.role, [projection], 1,
                                                     dtype=dtype)
                members.extend(_unpartition(m) for m in group.members)
            if not members:
                return None
            group = ParameterGroupSpec(name=name, role=decl.role, members=tuple(members),
                                       policy=decl.policy)
        else:
            group = partitioned_projection_group(name, decl.role, projections, units,
                                                 dtype=dtype, units_label=label)
            group = replace(group, members=(*group.members, *per_head))
    axes = {m.target: m.sharding.axis for m in group.members
            if not isinstance(m.sharding, ReplicatedSharding) and m.sharding.is_partitioned}
    check_projections(binder.family, decl, [BoundProjection(
        module=mod, decl=m, shapes={k: v[0] for k, v in params.items()},
        heads=_heads(binder, m, env), split_axes={k: axes[f"{mod}.{k}"] for k in params
                                                  if f"{mod}.{k}" in axes})
        for mod, m, params in rendered])  # after the group's own checks
    if units is not None and decl.form is GroupForm.PROJECTIONS:
        _check_unit_multiples(binder, group, units, label, rendered)
    members = [m if dtypes.get(m.target, dtype) == m.dtype else
               replace(m, dtype=dtypes[m.target]) for m in group.members]
    return replace(group, members=tuple(members), policy=decl.policy,
                   kv_replication=decl.kv_replication)


def _per_head_members(binder: Binder, modules: Sequence[ModuleDecl], env: Mapping[str, Value],
                      dtype: str) -> list[ParameterMemberSpec]:
    """The tensors of `sharding: per_head` projections: every parameter of one module per head
    (`{head}` bound to its index), each tagged with (index, head count)."""
    members: list[ParameterMemberSpec] = []
    for module in modules:
        count = _heads(binder, module, env)[0]
        for head in range(count):
            inner = {**env, HEAD_VARIABLE: head}
            path = binder.render(module.module, inner, module.pointer)
            members.extend(ParameterMemberSpec(
                target=f"{path}.{name}", shape=shape, sharding=ReplicatedSharding(),
                dtype=pdtype, head=(head, count))
                for name, (shape, pdtype) in _params(binder, module, inner, dtype).items())
    return members


def _check_unit_multiples(binder: Binder, group: ParameterGroupSpec, units: int, label: str,
                          rendered: Sequence[tuple[str, ModuleDecl, Any]]) -> None:
    """Every split axis of a projection group holds a whole number of elements per declared
    unit. The group's units are reduced by gcd with the split widths (so that every unit spans
    whole blocks of a block-quantized weight); a split axis that is no multiple of the units
    would narrow them silently: a `column` projection whose axis 0 is the hidden size in a group
    of intermediate channels, which compiles and splits the wrong axis. A group whose members
    state `heads:` is left alone: its units shrink to whole heads by design."""
    if group.units == units or any(m.heads for m in group.members):
        return  # a group that states heads shrinks its units to whole heads on purpose
    for member in group.members:
        rule = member.sharding
        if isinstance(rule, ReplicatedSharding) or not rule.is_partitioned or rule.segments \
                or rule.granule > 1 or not member.target.endswith(".weight"):
            continue  # block-quantized weights and their scales: the format's own checks
        width = member.shape[rule.axis]
        if not width or width % units == 0:
            continue
        module, _, param = member.target.rpartition(".")
        decl = next((m for mod, m, _ in rendered if mod == module), None)
        if decl is None:
            continue
        other = [a for a, n in enumerate(member.shape) if a != rule.axis and n % units == 0]
        hint = (f"; axis {other[0]} ({member.shape[other[0]]}) is a multiple: is the "
                f"projection's sharding the other one?" if len(member.shape) == 2 and other
                else "")
        raise binder.fail(
            f"`{member.target}` is split on axis {rule.axis}, of {width} elements, which is not "
            f"a multiple of group `{group.name}`'s {units} partition units"
            f"{f' ({label})' if label else ''}: every unit must span whole elements of each "
            f"split member; expected an axis of a multiple of {units}, found {width}{hint}",
            join_pointer(decl.pointer, "sharding"))


# ---------------------------------------------------------------- structural cache


def _group(binder: Binder, decl: GroupDecl, env: Mapping[str, Value], name: str, dtype: str,
           linear_format: LinearFormat | None) -> ParameterGroupSpec | None:
    """The group of one instance of `decl` in its stored representation: a renamed copy of an
    earlier instance with the same structure when there is one (`partc.bind.cache`)."""
    cache = binder.cache
    key = targets = None
    if cache.enabled:
        try:
            values = cache.instance_values(decl.pointer, env, lambda reads: _values(
                binder, decl, reads, dtype))
            targets, prefix = _targets(binder, decl, env, values.layout)
        except PartcError:
            targets = None  # the full build below raises the first error in its own order
        if targets is not None:
            key = StructureKey(declaration=decl.pointer, values=values.ident,
                               fused_prefix=prefix,
                               format_facts=target_facts(linear_format, targets))
            template = cache.templates.get(key)
            if template is not None:
                copy = renamed_group(template, name, targets)
                if copy is not None:
                    return copy
    group = _build_group(binder, decl, env, name, dtype)
    if group is None:
        return None
    expanded, sources = linear_format_expansion(group, linear_format)
    if key is not None and group.targets == targets:  # (a guard: always true today)
        cache.templates.setdefault(key, GroupTemplate(expanded, sources))
    return expanded


def _values(binder: Binder, decl: GroupDecl, env: Mapping[str, Value], dtype: str
            ) -> tuple[tuple[object, ...], tuple[Any, ...]]:
    """(everything `_build_group` evaluates for one instance but the module paths and member
    targets, which declarations name the members) in declaration order."""
    units = (binder.integer(decl.units, env, join_pointer(decl.pointer, "units"), "`units`",
                            minimum=1) if decl.units is not None else None)
    values: list[object] = [units]
    layout: list[Any] = []
    if decl.form is GroupForm.MEMBERS:
        for param in decl.members:
            if not binder.boolean(param.when, env, param.pointer):
                values.append(None)
                continue
            assert param.sharding is not None
            layout.append(param)
            values.append((_shape(binder, param, env),
                           _segments(binder, _declared_segments(param.sharding), env,
                                     param.pointer),
                           _dtype(binder, param, env, dtype), _heads(binder, param, env)))
    elif decl.form is GroupForm.MODULE:
        assert decl.module is not None and decl.module_sharding is not None
        params = _params(binder, decl.module, env, dtype)
        values += [_segments(binder, _declared_segments(decl.module_sharding), env, decl.pointer),
                   tuple(params.items())]
        layout.append(tuple(params))
    else:
        for m in decl.projections:
            if not binder.boolean(m.when, env, m.pointer):
                values.append(None)
                continue
            params = _params(binder, m, env, dtype)
            layout.append((m, tuple(params)))
            values.append((tuple(params.items()), _segments(binder, m.segments, env, m.pointer),
                           _heads(binder, m, env), _fused_groups(binder, m, env)))
    return tuple(values), tuple(layout)


def _targets(binder: Binder, decl: GroupDecl, env: Mapping[str, Value], layout: tuple[Any, ...]
             ) -> tuple[tuple[str, ...] | None, tuple[bool, ...]]:
    """(the dense member targets of an instance in order, or None when its module paths cannot
    be summarized; which targets the fused output's prefix starts)."""
    if decl.form is GroupForm.MEMBERS:
        return tuple(binder.render(p.name, env, p.pointer) for p in layout), ()
    if decl.form is GroupForm.MODULE:
        assert decl.module is not None
        module = binder.render(decl.module.module, env, decl.module.pointer)
        return tuple(f"{module}.{p}" for p in layout[0]), ()
    plain = [(m, params) for m, params in layout if not m.per_head]
    modules = [binder.render(m.module, env, m.pointer) for m, _ in plain]
    if not all(modules) or (decl.form is GroupForm.FUSED and len(modules) != 2):
        return None, ()  # an empty module path names members without a `.`
    targets = tuple(f"{module}.{p}" for module, (_, params) in zip(modules, plain, strict=True)
                    for p in params) + tuple(  # then the per-head modules' (`_build_group`)
        f"{binder.render(m.module, {**env, HEAD_VARIABLE: head}, m.pointer)}.{p}"
        for m, params in layout if m.per_head
        for head in range(_heads(binder, m, env)[0]) for p in params)
    if decl.form is GroupForm.FUSED:
        return targets, tuple(t.startswith(modules[1] + ".") for t in targets)
    return targets, ()


def _segments(binder: Binder, segments: tuple[Expression, ...], env: Mapping[str, Value],
              pointer: str) -> tuple[int, ...]:
    """Evaluated segment widths (as `_member_sharding` and fused projections read them): an
    entry that evaluates to a list (`[ffn_hidden_size] * moe_num_experts`) gives its widths in
    place; at most MAX_LIST_LENGTH widths in all."""
    widths: list[int] = []
    for expr in segments:
        value = binder.evaluate(expr, env, pointer)
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                raise binder.fail(f"a segment width `{expr.text}` must be a positive integer"
                                  f"{' or a list of them' if isinstance(value, tuple) else ''}, "
                                  f"found {format_value(item)}", pointer)
            widths.append(item)
        if len(widths) > MAX_LIST_LENGTH:
            raise binder.fail(f"the segments give {len(widths)} widths; partc accepts at most "
                              f"{MAX_LIST_LENGTH}", pointer)
    return tuple(widths)


def _fused_groups(binder: Binder, decl: ModuleDecl, env: Mapping[str, Value]) -> int | None:
    """The group count of a `grouped` fused layout (`groups:`), None when not declared."""
    if decl.groups is None:
        return None
    return binder.integer(decl.groups, env, join_pointer(decl.pointer, "groups"), "`groups`",
                          minimum=1)


def _heads(binder: Binder, decl: ParamDecl | ModuleDecl, env: Mapping[str, Value]
           ) -> tuple[int, ...]:
    """The evaluated `heads:` hints of a member or a projection."""
    if not decl.heads:
        return ()
    pointer = join_pointer(decl.pointer, "heads")
    return tuple(binder.integer(h, env, pointer, "`heads`", minimum=1) for h in decl.heads)


def _unpartition(member: ParameterMemberSpec) -> ParameterMemberSpec:
    """A projection member without a shared partition: Partitioned becomes Equal."""
    if isinstance(member.sharding, PartitionedSharding):
        return replace(member, sharding=EqualSharding(axis=member.sharding.axis), heads=())
    return member


def _linear_format(binder: Binder, values: Mapping[str, Value]) -> LinearFormat | None:
    """The first declared linear format whose `when` holds for the config (None: dense)."""
    family = binder.family
    for decl in family.linear_formats:
        if not binder.boolean(decl.when, values, join_pointer(decl.pointer, "when")):
            continue
        options: dict[str, object] = {}
        for key, value in decl.options:
            pointer = join_pointer(decl.pointer, key)
            if isinstance(value, Expression):
                value = binder.evaluate(value, values, pointer)
            elif isinstance(value, tuple) and any(isinstance(v, Expression) for v in value):
                value = tuple(binder.evaluate(v, values, join_pointer(pointer, i))
                              for i, v in enumerate(value))
            options[key] = value
        try:
            return LinearFormat.from_options(decl.format, options)
        except SemanticError as error:
            pointer = decl.pointer + error.pointer
            raise error.located(family.document.locate(pointer), pointer) from None
    return None


def _instances(binder: Binder, decl: GroupDecl, env: Mapping[str, Value],
               graph: ExecutionGraph) -> Iterator[tuple[dict[str, Value], int | None]]:
    unit_owner = next((o for o in decl.owners if o.kind is OwnerKind.UNIT), None)
    units: list[tuple[str, int, str] | None] = [None]
    if unit_owner is not None:
        assert unit_owner.group is not None
        units = [(name, u, path) for name in unit_owner.groups or (unit_owner.group,)
                 for u, path in enumerate(graph.group(name).unit_paths)]
    for where in units:
        local = dict(env)
        unit = None
        if where is not None:
            local["group"], unit, local["path"] = where
            local["unit"] = unit
        counts = []
        for var, count in decl.loops:
            pointer = join_pointer(join_pointer(decl.pointer, "for"), var)
            value = binder.integer(count, local, pointer, f"the count of `{var}`", minimum=0)
            if value > MAX_UNITS:
                raise binder.fail(f"the count of `{var}` is {value}; partc accepts at most "
                                  f"{MAX_UNITS} iterations", pointer)
            counts.append(range(value))
        for combo in itertools.product(*counts):
            binder.instances += 1
            if binder.instances > MAX_GROUP_INSTANCES:
                raise binder.fail(f"the family expands to more than {MAX_GROUP_INSTANCES} "
                                  "parameter-group instances; check the unit and loop counts",
                                  decl.pointer)
            instance = dict(local)
            instance.update({var: value for (var, _), value in zip(decl.loops, combo,
                                                                  strict=True)})
            yield instance, unit


def _owner(binder: Binder, decl: GroupDecl, env: Mapping[str, Value],
           unit: int | None) -> ParameterGroupOwner:
    for choice in decl.owners:
        if binder.boolean(choice.when, env, join_pointer(choice.pointer, "when")):
            if choice.kind is OwnerKind.UNIT:
                assert choice.group is not None and unit is not None
                return ExecutionUnit(group=str(env.get("group", choice.group)), unit=unit)
            if choice.kind is OwnerKind.STATIC:
                return StaticRole(role=choice.roles[0])
            return StaticAnyOf(roles=tuple(choice.roles))
    raise binder.fail("no owner choice applies: every `when` is false", decl.pointer)


def bind_family(family: FamilyDecl, config: RawDocument,
                checkpoint_names: Collection[str] | None = None, *,
                cache: bool = True,
                progress: Callable[[int, int], None] | None = None) -> BoundArchitecture:
    """Bind `family` to `config`; raises the first error found (a PartcError).

    `checkpoint_names` (the checkpoint's tensor names) answers the config fields that probe the
    checkpoint with `present`. `cache=False` turns the structural cache off (every instance
    evaluated and built in full, `partc.bind.cache`): the result is the same, only slower.
    `progress(done, total)` is called after each group declaration is bound.
    """
    model_type = config.data.get("model_type")
    if model_type not in family.model_types:
        raise SemanticError(
            f"config model_type is {model_type!r} but family `{family.name}` describes "
            f"{', '.join(repr(t) for t in family.model_types)}",
            location=config.locate("/model_type"), pointer="/model_type")
    values = read_config_values(family, config, checkpoint_names, cache=cache)
    binder = Binder(family, config, cache)
    dtype = default_dtype(config)
    groups = []
    for node in family.graph:
        count = binder.integer(node.units, values, join_pointer(node.pointer, "units"),
                               "`units`", minimum=0)
        if count > MAX_UNITS:
            raise binder.fail(f"execution group `{node.name}` has {count} units; partc accepts "
                              f"at most {MAX_UNITS} per group", join_pointer(node.pointer,
                                                                             "units"))
        paths = tuple(binder.render(node.path, {**values, "unit": u},
                                    join_pointer(node.pointer, "path")) for u in range(count))
        groups.append(_located(family, lambda n=node, p=paths: ExecutionGroupSpec(
            name=n.name, unit_paths=p, carries_state=n.carries_state, dependencies=n.after),
            join_pointer(node.pointer, "path")))
    graph = _located(family, lambda: ExecutionGraph(groups=tuple(groups)), "/graph")
    owned: list[OwnedParameterGroupSpec] = []
    pointers: dict[str, str] = {}
    experts: list[tuple[str, ExpertGroup]] = []
    linear_format = _linear_format(binder, values)
    for done, decl in enumerate(family.groups):
        if progress is not None:
            progress(done, len(family.groups))
        for env, unit in _instances(binder, decl, values, graph):
            if not binder.boolean(decl.when, env, join_pointer(decl.pointer, "when")):
                continue
            name = binder.render(decl.name, env, join_pointer(decl.pointer, "name"))
            spec = _located(family, lambda d=decl, e=env, n=name: _group(
                binder, d, e, n, dtype, linear_format), decl.pointer)
            if spec is None:
                continue
            if name in pointers:
                other = ("by another instance of this same declaration"
                         if pointers[name] == decl.pointer
                         else f"also by {family.document.locate(pointers[name])}")
                raise binder.fail(f"parameter group name `{name}` is produced twice ({other}); "
                                  "names must be unique, e.g. include `{unit}`", decl.pointer)
            pointers[name] = decl.pointer
            if decl.expert_loop or decl.expert_axis is not None:
                expert = env[EXPERT_VARIABLE] if decl.expert_loop else None
                experts.append((name, ExpertGroup(
                    expert=expert if isinstance(expert, int) else None,
                    axis=decl.expert_axis, count=_expert_count(binder, decl, env, spec))))
            owned.append(OwnedParameterGroupSpec(group=spec, owner=_owner(binder, decl, env,
                                                                         unit)))
    if progress is not None:
        progress(len(family.groups), len(family.groups))
    placed = dict(family.static_with)
    statics = tuple(StaticRoleSpec(name=n, side=s, group=placed.get(n))
                    for n, s in family.static_roles)
    description = _located(family, lambda: ArchitectureParameterDescription(
        graph=graph, static_roles=statics, groups=tuple(owned)), "/parameters")
    for spec in owned:  # every later stage computes byte counts with 64-bit integers
        for member in spec.group.members:
            _check_bytes(binder, member, pointers[spec.group.name])
    boundary = _located(family, lambda: _boundary(binder, values), "/boundary")
    order = [g.name for g in graph.canonical_order()]
    nodes = sorted((n for n in family.graph if n.boundary),
                   key=lambda n: order.index(n.name))
    group_boundaries = tuple((n.name, _located(family, lambda n=n: _boundary(
        binder, values, n.boundary, n.boundary_identity), join_pointer(n.pointer, "boundary")))
        for n in nodes)
    weights = tuple((n.name, binder.integer(n.weight, values, join_pointer(n.pointer, "weight"),
                                            "a group weight", minimum=1))
                    for n in family.graph if n.weight is not None)
    _check_omit(binder, description.targets)
    return BoundArchitecture(
        family=family.name, model_type=str(model_type),
        config_values=tuple(sorted((k, recorded(v)) for k, v in values.items())),
        description=description, boundary=boundary,
        policy=family.policy, group_pointers=tuple(sorted(pointers.items())),
        linear_format=linear_format, omit=family.omit, group_boundaries=group_boundaries,
        group_weights=weights, group_modes=tuple((n.name, n.parallel) for n in family.graph
                                                 if n.parallel is not None),
        experts=tuple(experts), states=bind_state(binder, values, graph, description))


def _expert_count(binder: Binder, decl: GroupDecl, env: Mapping[str, Value],
                  group: ParameterGroupSpec) -> int | None:
    """`experts: {count: ...}` of a stacked group, checked against its members: the count
    divides the expert axis of every member, and a member split along that axis cuts the
    same rows inside every expert block, never a range of whole experts."""
    if decl.expert_count is None or decl.expert_axis is None:
        return None
    axis = decl.expert_axis
    pointer = join_pointer(join_pointer(decl.pointer, "experts"), "count")
    count = binder.integer(decl.expert_count, env, pointer, "`experts: {count: ...}`",
                           minimum=1)
    for member in group.members:
        if axis >= len(member.shape):
            raise binder.fail(f"`{member.target}` has shape {list(member.shape)}, without the "
                              f"expert axis {axis}", pointer, tensor=member.target)
        length = member.shape[axis]
        if length % count:
            raise binder.fail(
                f"`experts: {{count: {decl.expert_count.text}}}` ({count}) does not divide axis "
                f"{axis} of `{member.target}` ({length} rows); every expert must be a block of "
                "the same whole number of rows", pointer, tensor=member.target)
        rows = length // count
        rule = member.sharding
        if rows == 1 or count == 1 or isinstance(rule, ReplicatedSharding) or rule.axis != axis:
            continue
        inside = False
        if rule.segments and rule.groups == 1:
            bounds = set(itertools.accumulate(rule.segments))
            inside = all(k * rows in bounds for k in range(1, count))
        if not inside:
            raise binder.fail(
                f"`{member.target}` is {rule.describe()} along the expert axis {axis}, which "
                f"holds {count} experts of {rows} rows: its cuts would give a tensor-parallel "
                "rank a range of whole experts instead of the same rows inside every expert; "
                f"split each expert on its own, e.g. `partitioned_segments: {{axis: {axis}, "
                f"segments: \"[{rows}] * {count}\"}}`",
                _sharding_pointer(binder, decl, env, member.target), tensor=member.target)
    return count


def _sharding_pointer(binder: Binder, decl: GroupDecl, env: Mapping[str, Value],
                      target: str) -> str:
    """Where the sharding of the member `target` of one instance of `decl` is declared: the
    member's own `sharding` (members form), the group's (module form), its projection's
    (projections and fused forms); the group's `experts` entry when none matches."""
    if decl.form is GroupForm.MEMBERS:
        for param in decl.members:
            if binder.boolean(param.when, env, param.pointer) and \
                    binder.render(param.name, env, param.pointer) == target:
                return join_pointer(param.pointer, "sharding")
    elif decl.form is GroupForm.MODULE:
        return join_pointer(decl.pointer, "sharding")
    else:
        for module in decl.projections:
            if target.startswith(binder.render(module.module, env, module.pointer) + "."):
                return join_pointer(module.pointer, "sharding")
    return join_pointer(decl.pointer, "experts")


def _check_omit(binder: Binder, targets: tuple[str, ...]) -> None:
    """An `omit` glob matches no declared parameter: omitted tensors are not parameters."""
    for i, glob in enumerate(binder.family.omit):
        hits = [t for t in targets if fnmatch.fnmatchcase(t, glob)]
        if hits:
            raise binder.fail(f"`omit` glob {glob!r} matches declared parameter `{hits[0]}`"
                              + (f" (and {len(hits) - 1} more)" if len(hits) > 1 else "")
                              + "; expected it to match only checkpoint tensors that are not "
                              "parameters (buffers such as `inv_freq`)", join_pointer("/omit", i),
                              tensor=hits[0])


MAX_TENSOR_BYTES = 2**40
"""Largest byte count of one tensor (1 TiB; DeepSeek-V3's largest is 1.85 GB)."""


def _check_bytes(binder: Binder, member: ParameterMemberSpec, pointer: str) -> None:
    """Refuse a tensor whose byte count is beyond MAX_TENSOR_BYTES (and so beyond 2**63)."""
    elements = 1
    for dim in member.shape:
        elements *= dim
    size = -(-elements * DTYPE_BITS[member.dtype] // 8)
    if size > MAX_TENSOR_BYTES:
        raise binder.fail(f"tensor `{member.target}` of shape {list(member.shape)} "
                          f"({member.dtype}) holds {size} bytes; partc accepts at most "
                          f"{MAX_TENSOR_BYTES} bytes per tensor (check the sizes in "
                          f"{binder.config.file})", pointer, tensor=member.target)


def _located(family: FamilyDecl, build: Any, pointer: str) -> Any:
    try:
        return build()
    except PartcError as error:
        raise family.locate_error(error, pointer) from None


def _boundary(binder: Binder, values: Mapping[str, Value],
              tensors: tuple[BoundaryTensorDecl, ...] | None = None,
              identity: str | None = None) -> BoundaryWireSchema:
    specs = []
    for tensor in binder.family.boundary if tensors is None else tensors:
        dims: list[BoundaryTensorDimension] = []
        for dim in tensor.shape:
            if isinstance(dim, BoundaryTensorDimensionKind):
                dims.append(UNSIZED_DIMENSIONS[dim]())
            elif isinstance(dim, str):
                dims.append(RequestDimension(name=dim))
            else:
                dims.append(FixedDimension(
                    size=binder.integer(dim, values, tensor.pointer, "a boundary dimension",
                                        minimum=1)))
        specs.append(BoundaryTensorSpec(role=tensor.role, shape=tuple(dims),
                                        dtype=tensor.dtype))
    return BoundaryWireSchema(identity=identity or binder.family.boundary_identity,
                              primary=specs[0], auxiliary=tuple(specs[1:]))
