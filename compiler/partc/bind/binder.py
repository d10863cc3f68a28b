"""Stage 4: bind a symbolic family to a model's config.json.

Config fields are read (with types and defaults), every expression is evaluated, repeated groups
are expanded over units and loop variables, and the result is a validated
`ArchitectureParameterDescription` plus the boundary wire schema.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from partc.bind.meanings import config_errors, read_fields
from partc.errors import ExpressionError, PartcError, PartcErrors, SemanticError
from partc.family.expr import Expression, Template, format_value
from partc.front.positions import join_pointer
from partc.parallel.formats import LinearFormat, MemberSource, linear_format_expansion, target_facts
from partc.parallel.layout import DTYPE_BITS, TORCH_DTYPE_NAMES, unchecked_replace
from partc.parallel.specs import (
    LinearWeightLayout,
    MemberSharding,
    MemberShardingKind,
    ParameterGroupSpec,
    ParameterMemberSpec,
    Projection,
    ProjectionSharding,
    ShardingPolicy,
    partitioned_projection_group,
    segmented_projection_group,
)
from partc.partition.boundary import (
    BoundaryTensorDimension,
    BoundaryTensorDimensionKind,
    BoundaryTensorDtype,
    BoundaryTensorSpec,
    BoundaryWireSchema,
)
from partc.partition.ownership import (
    ArchitectureParameterDescription,
    ExecutionGraph,
    ExecutionGroupSpec,
    ExecutionUnit,
    OwnedParameterGroupSpec,
    ParameterGroupOwner,
    StaticAnyOf,
    StaticRole,
    StaticRoleSpec,
)

if TYPE_CHECKING:
    from partc.family.declaration import FamilyDecl, GroupDecl, ModuleDecl, ParamDecl, ShardingDecl
    from partc.front.load import RawDocument

Value = Any


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


MAX_UNITS = 4096
"""Most units one execution group, and most iterations one `for` variable, may have (32 times
the deepest real decoder; a Llama of this many layers compiles in a few seconds, measured by
benchmarks/limits.py)."""
MAX_GROUP_INSTANCES = 65_536
"""Most parameter-group instances a family may expand to (bounds time and memory: four times
DeepSeek-V3's 15,214)."""


class _Binder:
    def __init__(self, family: FamilyDecl, config: RawDocument) -> None:
        self.family = family
        self.config = config
        self.errors: list[PartcError] = []
        self.instances = 0
        self.values: dict[tuple[object, ...], Value] = {}
        """Successful evaluations by (expression id, `_env_key` of the names it reads)."""
        self.structures: dict[tuple[object, ...], _Template] = {}
        """Built groups by (declaration id, signature): see `_group`."""
        self.read_sets: dict[int, list[tuple[tuple[str, ...], dict[object, _Values]]]] = {}
        """Per declaration id: the names its values read, and its values by theirs."""
        self.value_idents: dict[int, dict[tuple[object, ...], int]] = {}
        """Per declaration id: a number for each distinct evaluation."""

    def fail(self, message: str, pointer: str) -> SemanticError:
        return SemanticError(message, location=self.family.document.locate(pointer),
                             pointer=pointer)

    def evaluate(self, expr: Expression, env: Mapping[str, Value], pointer: str) -> Value:
        values = _env_key(env, expr.names)
        key = None if values is None else (id(expr), values)
        if key is not None and key in self.values:
            return self.values[key]
        try:
            value = expr.evaluate(env)
        except ExpressionError as exc:
            exc.location = self.family.document.locate_offset(pointer, exc.offset)
            exc.pointer = pointer
            raise
        if key is not None:
            self.values[key] = value
        return value

    def integer(self, expr: Expression, env: Mapping[str, Value], pointer: str, what: str,
                minimum: int | None = None) -> int:
        value = self.evaluate(expr, env, pointer)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(f"{what} `{expr.text}` must be an integer, found "
                            f"{format_value(value)}", pointer)
        if minimum is not None and value < minimum:
            raise self.fail(f"{what} `{expr.text}` must be >= {minimum}, found {value}", pointer)
        return value

    def boolean(self, expr: Expression | None, env: Mapping[str, Value], pointer: str) -> bool:
        if expr is None:
            return True
        value = self.evaluate(expr, env, pointer)
        if not isinstance(value, bool):
            raise self.fail(f"condition `{expr.text}` must be true or false, found "
                            f"{format_value(value)}", pointer)
        return value

    def render(self, template: Template, env: Mapping[str, Value], pointer: str) -> str:
        try:
            return template.render(env)
        except ExpressionError as exc:
            exc.location = self.family.document.locate_offset(pointer, exc.offset)
            exc.pointer = pointer
            raise


def _env_key(env: Mapping[str, Value], names: Iterable[str]) -> tuple[object, ...] | None:
    """The type and value of each of `names` in `env`, or the name alone when unbound (None:
    one holds a value that is not plainly comparable). Evaluation reads nothing else."""
    key: list[object] = []
    for name in names:
        if name not in env:
            key.append((name,))
            continue
        value = _typed(env[name])
        if value is None:
            return None
        key.append(value)
    return tuple(key)


def _typed(value: Value) -> tuple[object, ...] | None:
    """`value` tagged with its type, so that `True` and `1` differ (None: not a plain value)."""
    kind = type(value)
    if kind is int or kind is str or kind is bool or value is None:
        return (kind, value)
    if kind is tuple:
        items = tuple(_typed(item) for item in value)
        return None if None in items else (kind, items)
    return None


# ---------------------------------------------------------------- config values


def _lookup(data: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return node is not None, node


def _check_type(kind: str, value: Any) -> Value | None:
    """The value converted to the declared type, or None when it does not fit."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "int":
        return value if is_int else None
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind == "str":
        return value if isinstance(value, str) else None
    if kind == "float":
        return value if (is_int or isinstance(value, float)) else None
    if kind == "int_list":
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            return tuple(value)
        return None
    if kind == "str_list":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        return None
    return tuple(value) if isinstance(value, list) else value


def read_config_values(family: FamilyDecl, config: RawDocument,
                       checkpoint_names: Collection[str] | None = None) -> dict[str, Value]:
    """Every declared config field's value: from config.json, else its default.

    A field with a `present` probe is true when `checkpoint_names` holds the tensor it names;
    without checkpoint names it takes its default.
    """
    meaning: list[PartcError] = list(config_errors(config, read_fields(config.data, (
        f.sources for f in family.config if f.present is None))))
    if meaning:
        raise meaning[0] if len(meaning) == 1 else PartcErrors(meaning)
    binder = _Binder(family, config)
    values: dict[str, Value] = {"model_type": config.data.get("model_type")}
    pending = []
    for field in family.config:
        if field.present is not None:
            if checkpoint_names is not None or field.default is not None:
                pending.append(field)
                continue
            raise binder.fail(f"config field `{field.name}` probes the checkpoint and has no "
                              "default; give a checkpoint or declare a default", field.pointer)
        for source in field.sources:
            present, raw = _lookup(config.data, source)
            if present:
                converted = _check_type(field.type, raw)
                if converted is None:
                    raise SemanticError(
                        f"config field `{source}` must be {field.type}, found "
                        f"{type(raw).__name__} {raw!r} (declared at "
                        f"{family.document.locate(field.pointer)})",
                        location=config.locate("/" + source.split(".")[0]), pointer="/" + source)
                values[field.name] = converted
                break
        else:
            if field.literal_default[0]:
                values[field.name] = field.literal_default[1]
                continue
            if field.default is None:
                raise SemanticError(
                    f"config.json has no `{field.sources[0]}`, which family `{family.name}` "
                    f"requires (declared as {field.type} with no default)",
                    location=config.locate(""), pointer="/" + field.sources[0].replace(".", "/"))
            pending.append(field)
    while pending:
        progressed = False
        for field in list(pending):
            if field.present is not None and checkpoint_names is not None:
                if any(n in {p.name for p in pending} for n in field.present.names):
                    continue
                target = binder.render(field.present, values,
                                       join_pointer(field.pointer, "present"))
                values[field.name] = target in checkpoint_names
                pending.remove(field)
                progressed = True
                continue
            assert field.default is not None
            if any(n in {p.name for p in pending} for n in field.default.names):
                continue
            values[field.name] = binder.evaluate(field.default, values,
                                                 join_pointer(field.pointer, "default"))
            pending.remove(field)
            progressed = True
        if not progressed:
            names = ", ".join(f"`{f.name}`" for f in pending)
            raise binder.fail(f"config defaults depend on each other in a cycle: {names}",
                              pending[0].pointer)
    return values


def _default_dtype(config: RawDocument) -> str:
    for key in ("dtype", "torch_dtype"):
        value = config.data.get(key)
        if isinstance(value, str):
            if value not in TORCH_DTYPE_NAMES:
                raise SemanticError(f"config `{key}` is {value!r}; expected one of "
                                    f"{', '.join(sorted(TORCH_DTYPE_NAMES))}",
                                    location=config.locate("/" + key), pointer="/" + key)
            return TORCH_DTYPE_NAMES[value]
    return "F32"


# ---------------------------------------------------------------- group expansion


def _dtype(binder: _Binder, param: ParamDecl, env: Mapping[str, Value], default: str) -> str:
    if param.dtype is None:
        return default
    value = binder.evaluate(param.dtype, env, param.pointer)
    if isinstance(value, str) and value in TORCH_DTYPE_NAMES:
        return TORCH_DTYPE_NAMES[value]
    if not isinstance(value, str) or value not in DTYPE_BITS:
        raise binder.fail(f"dtype must be one of {', '.join(sorted(DTYPE_BITS))} (or a torch "
                          f"name), found {format_value(value)}", param.pointer)
    return value


def _shape(binder: _Binder, param: ParamDecl, env: Mapping[str, Value]) -> tuple[int, ...]:
    return tuple(binder.integer(d, env, param.dimension_pointer(i), "a shape dimension",
                                minimum=0) for i, d in enumerate(param.shape))


def _member_sharding(binder: _Binder, decl: ShardingDecl, env: Mapping[str, Value],
                     pointer: str) -> MemberSharding:
    kind = MemberShardingKind(decl.kind)
    return MemberSharding(kind=kind, axis=decl.axis,
                          segments=_segments(binder, decl.segments, env, pointer))


def _params(binder: _Binder, module: ModuleDecl, env: Mapping[str, Value],
            dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for param in module.params:
        if binder.boolean(param.when, env, param.pointer):
            out[binder.render(param.name, env, param.pointer)] = (
                _shape(binder, param, env), _dtype(binder, param, env, dtype))
    return out


def _build_group(binder: _Binder, decl: GroupDecl, env: Mapping[str, Value], name: str,
                 dtype: str) -> ParameterGroupSpec | None:
    units = (binder.integer(decl.units, env, join_pointer(decl.pointer, "units"),
                            "`units`", minimum=1) if decl.units is not None else None)
    label = decl.units_text
    if decl.form == "members":
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
                linear=_LINEAR_LAYOUTS.get(param.layout or ""),
                heads=_heads(binder, param, env)))
        if not members:
            return None
        partitioned = any(m.sharding.is_partitioned for m in members)
        return ParameterGroupSpec(name=name, role=decl.role, members=tuple(members),
                                  units=units if partitioned else None, units_label=label,
                                  policy=decl.policy, kv_replication=decl.kv_replication)
    if decl.form == "module":
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
    rendered = [(binder.render(m.module, env, m.pointer), m, _params(binder, m, env, dtype))
                for m in modules]
    if decl.form == "fused":
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
            output_heads=out_heads[0] if out_heads else None)
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
            heads=next(iter(_heads(binder, m, env)), None)) for mod, m, params in rendered]
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
    members = [m if dtypes.get(m.target, dtype) == m.dtype else
               replace(m, dtype=dtypes[m.target]) for m in group.members]
    return replace(group, members=tuple(members), policy=decl.policy,
                   kv_replication=decl.kv_replication)


_LINEAR_LAYOUTS = {"linear": LinearWeightLayout.OUT_IN,
                   "linear_transposed": LinearWeightLayout.IN_OUT}


# ---------------------------------------------------------------- structural cache
#
# Instances of one declaration (every unit, every expert) mostly build groups that differ only
# by their names. An instance's signature is what `_build_group` evaluates besides the names
# (memoized by the values of the names that evaluation reads) plus every fact it reads of the
# names; the first instance of each signature is built and validated in full, and the others
# are renamed copies of it. An instance that fails a name check of the full build (empty or
# repeated names), or whose evaluation fails, is built in full: it raises exactly the error an
# uncached build raises.


@dataclass(frozen=True, slots=True)
class _Template:
    """A group built in full and, per member, where its target comes from."""

    group: ParameterGroupSpec
    """The group, validated."""
    sources: tuple[MemberSource, ...]
    """Per member: the dense member whose target its own is made from, and how."""


@dataclass(frozen=True, slots=True)
class _Values:
    """What an instance of a declaration evaluates besides its names."""

    ident: int
    """Equal for equal values (of one declaration)."""
    layout: tuple[Any, ...]
    """Whose names make the member targets: see `_targets`."""


def _group(binder: _Binder, decl: GroupDecl, env: Mapping[str, Value], name: str, dtype: str,
           linear_format: LinearFormat | None) -> ParameterGroupSpec | None:
    """The group of one instance of `decl` in its stored representation: a renamed copy of an
    earlier instance with the same signature when there is one."""
    try:
        values = _instance_values(binder, decl, env, dtype)
        targets, facts = _targets(binder, decl, env, values.layout)
    except PartcError:
        targets = None  # the full build below raises the first error in its own order
    key: tuple[object, ...] = ()
    if targets is not None:
        key = (id(decl), values.ident, facts, target_facts(linear_format, targets))
        template = binder.structures.get(key)
        if template is not None:
            copy = _renamed_group(template, name, targets)
            if copy is not None:
                return copy
    group = _build_group(binder, decl, env, name, dtype)
    if group is None:
        return None
    expanded, sources = linear_format_expansion(group, linear_format)
    if targets is not None and group.targets == targets:  # (a guard: always true today)
        binder.structures.setdefault(key, _Template(expanded, sources))
    return expanded


class _Reads(Mapping[str, Value]):
    """An environment that records the names looked up in it, in order."""

    def __init__(self, env: Mapping[str, Value]) -> None:
        self.env = env
        self.names: dict[str, None] = {}

    def __getitem__(self, name: str) -> Value:
        self.names[name] = None
        return self.env[name]

    def __contains__(self, name: object) -> bool:
        self.names[str(name)] = None
        return name in self.env

    def __iter__(self) -> Iterator[str]:
        self.names.update(dict.fromkeys(self.env))
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


MAX_READ_SETS = 16
"""Most distinct sets of names one declaration's values are memoized under."""


def _instance_values(binder: _Binder, decl: GroupDecl, env: Mapping[str, Value],
                     dtype: str) -> _Values:
    """`_values` of an instance, memoized by the values of the names its evaluation reads:
    evaluation is deterministic, so an instance agreeing on those reads the same and agrees."""
    tables = binder.read_sets.setdefault(id(decl), [])
    for names, table in tables:
        found = table.get(_env_key(env, names))
        if found is not None:
            return found
    reads = _Reads(env)
    evaluated, layout = _values(binder, decl, reads, dtype)
    idents = binder.value_idents.setdefault(id(decl), {})
    result = _Values(ident=idents.setdefault(evaluated, len(idents)), layout=layout)
    names = tuple(reads.names)
    key = _env_key(env, names)
    if key is None:
        return result
    same = next((table for known, table in tables if known == names), None)
    if same is None:
        if len(tables) == MAX_READ_SETS:
            return result
        same = {}
        tables.append((names, same))
    same[key] = result
    return result


def _values(binder: _Binder, decl: GroupDecl, env: Mapping[str, Value], dtype: str
            ) -> tuple[tuple[object, ...], tuple[Any, ...]]:
    """(everything `_build_group` evaluates for one instance but the module paths and member
    targets, which declarations name the members) in declaration order."""
    units = (binder.integer(decl.units, env, join_pointer(decl.pointer, "units"), "`units`",
                            minimum=1) if decl.units is not None else None)
    values: list[object] = [units]
    layout: list[Any] = []
    if decl.form == "members":
        for param in decl.members:
            if not binder.boolean(param.when, env, param.pointer):
                values.append(None)
                continue
            assert param.sharding is not None
            layout.append(param)
            values.append((_shape(binder, param, env),
                           _segments(binder, param.sharding.segments, env, param.pointer),
                           _dtype(binder, param, env, dtype), _heads(binder, param, env)))
    elif decl.form == "module":
        assert decl.module is not None and decl.module_sharding is not None
        params = _params(binder, decl.module, env, dtype)
        values += [_segments(binder, decl.module_sharding.segments, env, decl.pointer),
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
                           _heads(binder, m, env)))
    return tuple(values), tuple(layout)


def _targets(binder: _Binder, decl: GroupDecl, env: Mapping[str, Value], layout: tuple[Any, ...]
             ) -> tuple[tuple[str, ...] | None, tuple[bool, ...]]:
    """(the dense member targets of an instance in order, or None when its module paths cannot
    be summarized; which targets the fused output's prefix starts)."""
    if decl.form == "members":
        return tuple(binder.render(p.name, env, p.pointer) for p in layout), ()
    if decl.form == "module":
        assert decl.module is not None
        module = binder.render(decl.module.module, env, decl.module.pointer)
        return tuple(f"{module}.{p}" for p in layout[0]), ()
    modules = [binder.render(m.module, env, m.pointer) for m, _ in layout]
    if not all(modules) or (decl.form == "fused" and len(modules) != 2):
        return None, ()  # an empty module path names members without a `.`
    targets = tuple(f"{module}.{p}" for module, (_, params) in zip(modules, layout, strict=True)
                    for p in params)
    if decl.form == "fused":
        return targets, tuple(t.startswith(modules[1] + ".") for t in targets)
    return targets, ()


def _segments(binder: _Binder, segments: tuple[Expression, ...], env: Mapping[str, Value],
              pointer: str) -> tuple[int, ...]:
    """Evaluated segment widths (as `_member_sharding` and fused projections read them)."""
    return tuple(binder.integer(s, env, pointer, "a segment width", minimum=1) for s in segments)


def _renamed_group(template: _Template, name: str,
                   targets: tuple[str, ...]) -> ParameterGroupSpec | None:
    """`template.group` for another instance: group `name`, dense member targets `targets`.

    None when a name check of the full build would fail (an empty or repeated name).
    """
    stored = [targets[index] + suffix if not strip else targets[index][:-strip] + suffix
              for index, strip, suffix in template.sources]
    if not (name and all(targets) and all(stored) and len(set(targets)) == len(targets)
            and len(set(stored)) == len(stored)):
        return None
    group = template.group
    members = tuple(member if member.target == target else
                    unchecked_replace(member, target=target)  # checks are name-blind
                    for member, target in zip(group.members, stored, strict=True))
    return unchecked_replace(group, name=name, members=members)




def _heads(binder: _Binder, decl: ParamDecl | ModuleDecl, env: Mapping[str, Value]
           ) -> tuple[int, ...]:
    """The evaluated `heads:` hints of a member or a projection."""
    if not decl.heads:
        return ()
    pointer = join_pointer(decl.pointer, "heads")
    return tuple(binder.integer(h, env, pointer, "`heads`", minimum=1) for h in decl.heads)


def _unpartition(member: ParameterMemberSpec) -> ParameterMemberSpec:
    """A projection member without a shared partition: Partitioned becomes Equal."""
    if member.sharding.kind is MemberShardingKind.PARTITIONED:
        assert member.sharding.axis is not None
        return replace(member, sharding=MemberSharding.equal(member.sharding.axis), heads=())
    return member


def _linear_format(binder: _Binder, values: Mapping[str, Value]) -> LinearFormat | None:
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
            error.pointer = decl.pointer + error.pointer
            error.location = family.document.locate(error.pointer)
            raise
    return None


def _instances(binder: _Binder, decl: GroupDecl, env: Mapping[str, Value],
               graph: ExecutionGraph) -> Iterator[tuple[dict[str, Value], int | None]]:
    unit_owner = next((o for o in decl.owners if o.kind == "unit"), None)
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


def _owner(binder: _Binder, decl: GroupDecl, env: Mapping[str, Value],
           unit: int | None) -> ParameterGroupOwner:
    for choice in decl.owners:
        if binder.boolean(choice.when, env, join_pointer(choice.pointer, "when")):
            if choice.kind == "unit":
                assert choice.group is not None and unit is not None
                return ExecutionUnit(group=str(env.get("group", choice.group)), unit=unit)
            if choice.kind == "static":
                return StaticRole(role=choice.roles[0])
            return StaticAnyOf(roles=tuple(choice.roles))
    raise binder.fail("no owner choice applies: every `when` is false", decl.pointer)


def bind_family(family: FamilyDecl, config: RawDocument,
                checkpoint_names: Collection[str] | None = None) -> BoundArchitecture:
    """Bind `family` to `config`; raises the first error found (a PartcError).

    `checkpoint_names` (the checkpoint's tensor names) answers the config fields that probe the
    checkpoint with `present`.
    """
    model_type = config.data.get("model_type")
    if model_type not in family.model_types:
        raise SemanticError(
            f"config model_type is {model_type!r} but family `{family.name}` describes "
            f"{', '.join(repr(t) for t in family.model_types)}",
            location=config.locate("/model_type"), pointer="/model_type")
    values = read_config_values(family, config, checkpoint_names)
    binder = _Binder(family, config)
    dtype = _default_dtype(config)
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
        groups.append(ExecutionGroupSpec(name=node.name, unit_paths=paths,
                                         carries_state=node.carries_state, dependencies=node.after))
    graph = _located(family, lambda: ExecutionGraph(groups=tuple(groups)), "/graph")
    owned: list[OwnedParameterGroupSpec] = []
    pointers: dict[str, str] = {}
    linear_format = _linear_format(binder, values)
    for decl in family.groups:
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
            owned.append(OwnedParameterGroupSpec(group=spec, owner=_owner(binder, decl, env,
                                                                         unit)))
    statics = tuple(StaticRoleSpec(name=n, side=s) for n, s in family.static_roles)
    description = _located(family, lambda: ArchitectureParameterDescription(
        graph=graph, static_roles=statics, groups=tuple(owned)), "/parameters")
    for spec in owned:  # every later stage computes byte counts with 64-bit integers
        for member in spec.group.members:
            _check_bytes(binder, member, pointers[spec.group.name])
    boundary = _located(family, lambda: _boundary(binder, values), "/boundary")
    return BoundArchitecture(
        family=family.name, model_type=str(model_type),
        config_values=tuple(sorted(values.items())), description=description, boundary=boundary,
        policy=family.policy, group_pointers=tuple(sorted(pointers.items())),
        linear_format=linear_format)


MAX_TENSOR_BYTES = 2**40
"""Largest byte count of one tensor (1 TiB; DeepSeek-V3's largest is 1.85 GB)."""


def _check_bytes(binder: _Binder, member: ParameterMemberSpec, pointer: str) -> None:
    """Refuse a tensor whose byte count is beyond MAX_TENSOR_BYTES (and so beyond 2**63)."""
    elements = 1
    for dim in member.shape:
        elements *= dim
    size = -(-elements * DTYPE_BITS[member.dtype] // 8)
    if size > MAX_TENSOR_BYTES:
        error = binder.fail(f"tensor `{member.target}` of shape {list(member.shape)} "
                            f"({member.dtype}) holds {size} bytes; partc accepts at most "
                            f"{MAX_TENSOR_BYTES} bytes per tensor (check the sizes in "
                            f"{binder.config.file})", pointer)
        error.tensor = member.target
        raise error


def _located(family: FamilyDecl, build: Any, pointer: str) -> Any:
    try:
        return build()
    except PartcError as error:
        raise family.locate_error(error, pointer) from None


def _boundary(binder: _Binder, values: Mapping[str, Value]) -> BoundaryWireSchema:
    specs = []
    for tensor in binder.family.boundary:
        dims = []
        for dim in tensor.shape:
            if isinstance(dim, str):
                dims.append(BoundaryTensorDimension(kind=BoundaryTensorDimensionKind(dim)))
            else:
                dims.append(BoundaryTensorDimension(
                    kind=BoundaryTensorDimensionKind.FIXED,
                    size=binder.integer(dim, values, tensor.pointer, "a boundary dimension",
                                        minimum=1)))
        specs.append(BoundaryTensorSpec(role=tensor.role, shape=tuple(dims),
                                        dtype=BoundaryTensorDtype(tensor.dtype)))
    return BoundaryWireSchema(identity=binder.family.boundary_identity, primary=specs[0],
                              auxiliary=tuple(specs[1:]))
