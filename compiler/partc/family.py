"""Stage 3: turn a schema-valid document into a symbolic family declaration and check it.

Every expression and template is parsed here (never evaluated: that is `bind`'s job), and every
name an expression uses is checked against the config fields and the loop variables in scope,
so a typo is reported with its file and line before any config.json is read.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partc.errors import ExpressionError, PartcError, SemanticError
from partc.expr import Expression, Template, constant, parse, parse_template
from partc.formats import GGUF_BLOCK_TYPES
from partc.load import join_pointer
from partc.parallel import (
    DTYPE_BITS,
    TORCH_DTYPE_NAMES,
    ParameterRole,
    ProjectionSharding,
    ShardingPolicy,
)
from partc.partition import StageSide

if TYPE_CHECKING:
    from partc.load import RawDocument

UNIT_VARIABLE = "unit"
"""The loop variable bound to the unit index of a unit-owned group."""
UNIT_PATH_VARIABLE = "path"
"""The variable bound to the unit's path (e.g. `model.layers.7`) in a unit-owned group."""
UNIT_GROUP_VARIABLE = "group"
"""The variable bound to the execution group's name in a unit-owned group."""
UNIT_VARIABLES = (UNIT_VARIABLE, UNIT_PATH_VARIABLE, UNIT_GROUP_VARIABLE)
"""Every variable a unit-owned group sees besides the config fields."""
CONFIG_TYPES = ("int", "bool", "str", "float", "int_list", "str_list", "any")
"""Types a config field may declare."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigFieldDecl:
    """A field read from config.json: type, default and where to read it."""

    name: str
    """Name used in expressions."""
    type: str
    """One of CONFIG_TYPES."""
    default: Expression | None
    """Value when config.json lacks the field (None: the field is required)."""
    sources: tuple[str, ...]
    """Dotted paths in config.json, first present wins."""
    pointer: str
    """Where the field is declared."""
    present: Template | None = None
    """A bool field probing the checkpoint: true when it holds this tensor (None: no probe)."""
    literal_default: tuple[bool, Any] = (False, None)
    """(True, value) for a float default, which is kept as a value rather than an expression."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphGroupDecl:
    """A declared execution group."""

    name: str
    """Group name."""
    units: Expression
    """Number of units."""
    path: Template
    """Unit path template (`{unit}`)."""
    carries_state: bool
    """Whether units carry KV state."""
    after: tuple[str, ...]
    """Dependencies."""
    pointer: str
    """Where the group is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerDecl:
    """One owner choice of a parameter group; the first whose `when` holds is used."""

    kind: str
    """'static', 'any_of' or 'unit'."""
    roles: tuple[str, ...]
    """Static role(s)."""
    group: str | None
    """Execution group for 'unit' (the first, when several are listed)."""
    when: Expression | None
    """Condition, if any."""
    pointer: str
    """Where the choice is declared."""
    groups: tuple[str, ...] = ()
    """Every execution group for 'unit': the group is instantiated once per unit of each."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingDecl:
    """A symbolic member sharding rule."""

    kind: str
    """One of the MemberShardingKind values."""
    axis: int | None
    """The axis."""
    segments: tuple[Expression, ...]
    """Segment widths (segment kinds)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamDecl:
    """A parameter of a module (or a member): name or target, shape, condition, dtype."""

    name: Template
    """Parameter name (module forms) or full target template (member form)."""
    shape: tuple[Expression, ...]
    """Symbolic shape."""
    when: Expression | None
    """Condition for the parameter to exist."""
    dtype: Expression | None
    """Stored dtype override."""
    sharding: ShardingDecl | None
    """Explicit sharding (member form only)."""
    pointer: str
    """Where it is declared."""
    layout: str | None = None
    """Member form `format:`: 'linear', 'linear_transposed' or 'dense' (None: not linear)."""
    heads: tuple[Expression, ...] = ()
    """Member form `heads:`: head counts along the partitioned axis (one per segment)."""
    shape_pointer: str = ""
    """Where the shape list is declared; dimension i is at `shape_pointer/i` ('' if unknown)."""

    def dimension_pointer(self, index: int) -> str:
        """The pointer of shape dimension `index` (the parameter's pointer if unknown)."""
        return f"{self.shape_pointer}/{index}" if self.shape_pointer else self.pointer


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleDecl:
    """A module with parameters: a projection, a fused projection or a plain module."""

    module: Template
    """Module path template."""
    params: tuple[ParamDecl, ...]
    """Its parameters."""
    sharding: ProjectionSharding | None
    """Projection sharding (projections only)."""
    segments: tuple[Expression, ...]
    """Segment widths (fused projections only)."""
    when: Expression | None
    """Condition for the module to exist."""
    linear: bool
    """Whether a linear format may encode its weight."""
    pointer: str
    """Where it is declared."""
    heads: tuple[Expression, ...] = ()
    """`heads:` hint: head count of the split axis (one per segment for a fused projection)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupDecl:
    """A declared parameter group (one YAML entry, possibly repeated over units and loops)."""

    name: Template
    """Logical name template."""
    role: ParameterRole
    """Semantic role."""
    owners: tuple[OwnerDecl, ...]
    """Owner choices."""
    when: Expression | None
    """Per-instance condition."""
    loops: tuple[tuple[str, Expression], ...]
    """Repetition variables and their counts."""
    units: Expression | None
    """Partition units."""
    units_text: str
    """The units expression as written, for messages."""
    policy: ShardingPolicy | None
    """Per-group policy."""
    kv_replication: bool
    """Whether KV heads may repeat across ranks."""
    form: str
    """'members', 'module', 'projections' or 'fused'."""
    members: tuple[ParamDecl, ...]
    """Members (form 'members')."""
    module: ModuleDecl | None
    """The module (form 'module')."""
    module_sharding: ShardingDecl | None
    """Rule of every parameter (form 'module')."""
    projections: tuple[ModuleDecl, ...]
    """Projections (form 'projections'), or the fused projection and its output ('fused')."""
    pointer: str
    """Where the group is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryTensorDecl:
    """A declared boundary tensor."""

    role: str
    """Role."""
    shape: tuple[str | Expression, ...]
    """'batch', 'sequence' or an expression for a fixed size."""
    dtype: str
    """activation, uint32 or int32."""
    pointer: str
    """Where it is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearFormatDecl:
    """A declared checkpoint encoding of linear weights."""

    format: str
    """dense, block_fp8, mlx_affine, mxfp4 or gguf."""
    when: Expression | None
    """Condition selecting it."""
    options: tuple[tuple[str, Any], ...]
    """Remaining keys (block, bits, ...), expressions parsed."""
    pointer: str
    """Where it is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyDecl:
    """A checked symbolic family: what a YAML or TOML file declares."""

    name: str
    """Family name."""
    model_types: tuple[str, ...]
    """HF model types it describes."""
    config: tuple[ConfigFieldDecl, ...]
    """Config fields."""
    graph: tuple[GraphGroupDecl, ...]
    """Execution groups."""
    static_roles: tuple[tuple[str, StageSide], ...]
    """Static roles and sides."""
    groups: tuple[GroupDecl, ...]
    """Parameter groups."""
    boundary_identity: str
    """Boundary schema identity."""
    boundary: tuple[BoundaryTensorDecl, ...]
    """Primary then auxiliary boundary tensors."""
    linear_formats: tuple[LinearFormatDecl, ...]
    """Declared linear formats."""
    policy: ShardingPolicy | None
    """Family default policy."""
    document: RawDocument
    """The source document (for locations)."""

    def locate_error(self, error: PartcError, pointer: str) -> PartcError:
        """Attach this family's source location for `pointer` to `error` when it has none."""
        if error.location is None or error.location.line == 0:
            error.location = self.document.locate(pointer)
            error.pointer = error.pointer or pointer
        return error


class _Builder:
    """Collects declarations and errors while walking the document."""

    def __init__(self, document: RawDocument) -> None:
        self.document = document
        self.errors: list[PartcError] = []

    def error(self, message: str, pointer: str) -> None:
        self.errors.append(SemanticError(message, location=self.document.locate(pointer),
                                         pointer=pointer))

    def expression(self, value: Any, pointer: str) -> Expression | None:
        note = self.document.note(pointer)
        if isinstance(value, bool | int):
            return self.constant(value, pointer)
        if not isinstance(value, str):
            self.error(f"expected an integer, a boolean or an expression, found {value!r}"
                       + (f"; {note}" if note else ""), pointer)
            return None
        try:
            return parse(value)
        except ExpressionError as exc:
            if note:  # `0o10`, `1_000`, `.inf`: say what YAML 1.1 would have read
                self.error(f"expected an integer, a boolean or an expression, found {value!r}; "
                           f"{note}", pointer)
                return None
            self.located(exc, pointer)
            return None

    def constant(self, value: Any, pointer: str) -> Expression | None:
        try:
            return constant(value)
        except ExpressionError as exc:
            self.located(exc, pointer)
            return None

    def located(self, exc: ExpressionError, pointer: str) -> None:
        exc.location = self.document.locate_offset(pointer, exc.offset)
        exc.pointer = pointer
        self.errors.append(exc)

    def template(self, value: str, pointer: str) -> Template | None:
        try:
            return parse_template(value)
        except ExpressionError as exc:
            self.located(exc, pointer)
            return None


def _sharding(builder: _Builder, value: Any, pointer: str) -> ShardingDecl | None:
    if value in (None, "replicated"):
        return ShardingDecl(kind="replicated", axis=None, segments=())
    (kind, arg), = value.items()
    if isinstance(arg, dict):
        segments = []
        for i, seg in enumerate(arg["segments"]):
            parsed = builder.expression(seg, join_pointer(join_pointer(
                join_pointer(pointer, kind), "segments"), i))
            if parsed is not None:
                segments.append(parsed)
        return ShardingDecl(kind=kind, axis=int(arg["axis"]), segments=tuple(segments))
    return ShardingDecl(kind=kind, axis=int(arg), segments=())


def _params(builder: _Builder, params: dict[str, Any], pointer: str) -> tuple[ParamDecl, ...]:
    out = []
    for name, spec in params.items():
        ptr = join_pointer(pointer, name)
        shape_value = spec["shape"] if isinstance(spec, dict) else spec
        shape_ptr = join_pointer(ptr, "shape") if isinstance(spec, dict) else ptr
        shape = tuple(e for i, d in enumerate(shape_value)
                      if (e := builder.expression(d, join_pointer(shape_ptr, i))) is not None)
        when = dtype = None
        if isinstance(spec, dict):
            if "when" in spec:
                when = builder.expression(spec["when"], join_pointer(ptr, "when"))
            if "dtype" in spec:
                dtype = _dtype_expression(builder, spec["dtype"], join_pointer(ptr, "dtype"))
        template = builder.template(name, ptr)
        if template is not None:
            out.append(ParamDecl(name=template, shape=shape, when=when, dtype=dtype,
                                 sharding=None, pointer=ptr,
                                 shape_pointer=shape_ptr if len(shape) == len(shape_value)
                                 else ""))
    return tuple(out)


def _dtype_expression(builder: _Builder, value: str, pointer: str) -> Expression | None:
    """A dtype is a literal name (`BF16`, `bfloat16`) or an expression yielding one."""
    if value in DTYPE_BITS or value in TORCH_DTYPE_NAMES:
        return constant(value)
    return builder.expression(value, pointer)


def _module(builder: _Builder, data: dict[str, Any], pointer: str,
            sharding: ProjectionSharding | None, segments_key: str | None) -> ModuleDecl | None:
    module = builder.template(data["module"], join_pointer(pointer, "module"))
    params = _params(builder, data["params"], join_pointer(pointer, "params"))
    segments: list[Expression] = []
    if segments_key:
        for i, seg in enumerate(data[segments_key]):
            parsed = builder.expression(seg, join_pointer(join_pointer(pointer, segments_key), i))
            if parsed is not None:
                segments.append(parsed)
    when = (builder.expression(data["when"], join_pointer(pointer, "when"))
            if "when" in data else None)
    heads = _heads(builder, data.get("heads"), join_pointer(pointer, "heads"))
    if module is None:
        return None
    return ModuleDecl(module=module, params=params, sharding=sharding, segments=tuple(segments),
                      when=when, linear=bool(data.get("linear", True)), pointer=pointer,
                      heads=heads)


def _heads(builder: _Builder, value: Any, pointer: str) -> tuple[Expression, ...]:
    """A `heads:` hint: one expression, or a list of them (one per fused segment)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        parsed = builder.expression(item, join_pointer(pointer, i) if isinstance(value, list)
                                    else pointer)
        if parsed is not None:
            out.append(parsed)
    return tuple(out)


def _owners(builder: _Builder, value: Any, pointer: str) -> tuple[OwnerDecl, ...]:
    choices = value if isinstance(value, list) else [value]
    out = []
    for i, choice in enumerate(choices):
        ptr = join_pointer(pointer, i) if isinstance(value, list) else pointer
        when = (builder.expression(choice["when"], join_pointer(ptr, "when"))
                if "when" in choice else None)
        if "static" in choice:
            out.append(OwnerDecl(kind="static", roles=(choice["static"],), group=None, when=when,
                                 pointer=ptr))
        elif "any_of" in choice:
            out.append(OwnerDecl(kind="any_of", roles=tuple(choice["any_of"]), group=None,
                                 when=when, pointer=ptr))
        else:
            groups = choice["unit"] if isinstance(choice["unit"], list) else [choice["unit"]]
            out.append(OwnerDecl(kind="unit", roles=(), group=groups[0], when=when,
                                 pointer=ptr, groups=tuple(groups)))
    return tuple(out)


def _group(builder: _Builder, data: dict[str, Any], pointer: str) -> GroupDecl | None:
    name = builder.template(data["name"], join_pointer(pointer, "name"))
    owners = _owners(builder, data["owner"], join_pointer(pointer, "owner"))
    when = (builder.expression(data["when"], join_pointer(pointer, "when"))
            if "when" in data else None)
    loops = []
    for var, count in data.get("for", {}).items():
        parsed = builder.expression(count, join_pointer(join_pointer(pointer, "for"), var))
        if parsed is not None:
            loops.append((var, parsed))
    units = (builder.expression(data["units"], join_pointer(pointer, "units"))
             if "units" in data else None)
    members: tuple[ParamDecl, ...] = ()
    module = None
    module_sharding = None
    projections: list[ModuleDecl] = []
    if "members" in data:
        form = "members"
        out = []
        for i, member in enumerate(data["members"]):
            ptr = join_pointer(join_pointer(pointer, "members"), i)
            target = builder.template(member["target"], join_pointer(ptr, "target"))
            shape = tuple(e for j, d in enumerate(member["shape"])
                          if (e := builder.expression(d, join_pointer(join_pointer(ptr, "shape"),
                                                                      j))) is not None)
            sharding = _sharding(builder, member.get("sharding"), join_pointer(ptr, "sharding"))
            m_when = (builder.expression(member["when"], join_pointer(ptr, "when"))
                      if "when" in member else None)
            dtype = (_dtype_expression(builder, member["dtype"], join_pointer(ptr, "dtype"))
                     if "dtype" in member else None)
            if target is not None:
                out.append(ParamDecl(name=target, shape=shape, when=m_when, dtype=dtype,
                                     sharding=sharding, pointer=ptr, layout=member.get("format"),
                                     shape_pointer=join_pointer(ptr, "shape")
                                     if len(shape) == len(member["shape"]) else "",
                                     heads=_heads(builder, member.get("heads"),
                                                  join_pointer(ptr, "heads"))))
        members = tuple(out)
    elif "module" in data:
        form = "module"
        module = _module(builder, {"module": data["module"], "params": data["params"]}, pointer,
                         None, None)
        module_sharding = _sharding(builder, data.get("sharding"),
                                    join_pointer(pointer, "sharding"))
    elif "projections" in data:
        form = "projections"
        for i, proj in enumerate(data["projections"]):
            decl = _module(builder, proj, join_pointer(join_pointer(pointer, "projections"), i),
                           ProjectionSharding(proj["sharding"]), None)
            if decl is not None:
                projections.append(decl)
    else:
        form = "fused"
        fused = _module(builder, data["fused"], join_pointer(pointer, "fused"),
                        ProjectionSharding.COLUMN, "segments")
        if "output" not in data:
            builder.error("a fused projection group needs its row-parallel `output` module",
                          pointer)
        else:
            output = _module(builder, data["output"], join_pointer(pointer, "output"),
                             ProjectionSharding.ROW, None)
            if fused is not None and output is not None:
                projections = [fused, output]
    if name is None:
        return None
    return GroupDecl(
        name=name, role=ParameterRole(data["role"]), owners=owners, when=when, loops=tuple(loops),
        units=units, units_text=str(data.get("units", "")),
        policy=ShardingPolicy(data["policy"]) if "policy" in data else None,
        kv_replication=bool(data.get("kv_replication", False)), form=form, members=members,
        module=module, module_sharding=module_sharding, projections=tuple(projections),
        pointer=pointer)


def build_family(document: RawDocument) -> tuple[FamilyDecl | None, list[PartcError]]:
    """Build the symbolic family of a schema-valid document, with every semantic error found."""
    builder = _Builder(document)
    data = document.data
    config = []
    for name, spec in data["config"].items():
        ptr = join_pointer("/config", name)
        if isinstance(spec, str):
            config.append(ConfigFieldDecl(name=name, type=spec, default=None, sources=(name,),
                                          pointer=ptr))
            continue
        default = None
        literal: tuple[bool, Any] = (False, None)
        if "default" in spec:
            raw = spec["default"]
            if isinstance(raw, str) and spec["type"] in ("str", "str_list"):
                default = builder.constant(raw, join_pointer(ptr, "default"))
            elif isinstance(raw, list):
                default = builder.constant(tuple(raw), join_pointer(ptr, "default"))
            elif raw is None:
                default = constant(None)
            elif isinstance(raw, float):
                literal = (True, raw)  # floats never enter expressions; kept as the value
            else:
                default = builder.expression(raw, join_pointer(ptr, "default"))
        sources = spec.get("from", name)
        present = None
        if "present" in spec:
            present = builder.template(spec["present"], join_pointer(ptr, "present"))
            if spec["type"] != "bool":
                builder.error(f"config field `{name}` probes the checkpoint with `present`, so "
                              f"its type must be bool, found {spec['type']}", ptr)
        config.append(ConfigFieldDecl(
            name=name, type=spec["type"], default=default,
            sources=(sources,) if isinstance(sources, str) else tuple(sources), pointer=ptr,
            present=present, literal_default=literal))
    graph = []
    for i, group in enumerate(data["graph"]):
        ptr = join_pointer("/graph", i)
        units = builder.expression(group["units"], join_pointer(ptr, "units"))
        path = builder.template(group["path"], join_pointer(ptr, "path"))
        # a group whose units or path failed to parse is still declared (its error is already
        # recorded), so owners naming it do not report it as unknown
        graph.append(GraphGroupDecl(name=group["group"], units=units or constant(0),
                                    path=path or parse_template(""),
                                    carries_state=bool(group.get("state", False)),
                                    after=tuple(group.get("after", ())), pointer=ptr))
    statics = tuple((name, StageSide(spec["stage"]))
                    for name, spec in data.get("static", {}).items())
    groups = []
    for i, group in enumerate(data["parameters"]):
        decl = _group(builder, group, join_pointer("/parameters", i))
        if decl is not None:
            groups.append(decl)
    boundary = []
    bdata = data["boundary"]
    auxiliary = bdata.get("auxiliary", [])
    tensors = [("/boundary/primary", bdata["primary"])] + [
        (join_pointer("/boundary/auxiliary", i), t) for i, t in enumerate(auxiliary)]
    for ptr, tensor in tensors:
        shape: list[str | Expression] = []
        for j, dim in enumerate(tensor["shape"]):
            if dim in ("batch", "sequence"):
                shape.append(dim)
            elif (parsed := builder.expression(dim, join_pointer(join_pointer(ptr, "shape"), j))):
                shape.append(parsed)
        boundary.append(BoundaryTensorDecl(role=tensor["role"], shape=tuple(shape),
                                           dtype=tensor["dtype"], pointer=ptr))
    formats = []
    for i, fmt in enumerate(data.get("linear_formats", [])):
        ptr = join_pointer("/linear_formats", i)
        options: list[tuple[str, Any]] = []
        for key, value in fmt.items():
            if key in ("format", "when"):
                continue
            if key in ("applies_to", "except", "scale_suffix"):
                options.append((key, tuple(value) if isinstance(value, list) else value))
            elif key == "scale_dtype" and isinstance(value, str):
                options.append((key, _dtype_expression(builder, value, join_pointer(ptr, key))))
            elif key == "gguf_type" and value in GGUF_BLOCK_TYPES:
                options.append((key, constant(value)))
            elif isinstance(value, list):
                options.append((key, tuple(builder.expression(v, join_pointer(join_pointer(
                    ptr, key), j)) for j, v in enumerate(value))))
            else:
                options.append((key, builder.expression(value, join_pointer(ptr, key))))
        formats.append(LinearFormatDecl(
            format=fmt["format"],
            when=builder.expression(fmt["when"], join_pointer(ptr, "when")) if "when" in fmt
            else None, options=tuple(options), pointer=ptr))
    family = FamilyDecl(
        name=data["family"], model_types=tuple(data["model_types"]), config=tuple(config),
        graph=tuple(graph), static_roles=statics, groups=tuple(groups),
        boundary_identity=bdata["identity"], boundary=tuple(boundary),
        linear_formats=tuple(formats),
        policy=ShardingPolicy(data["policy"]) if "policy" in data else None, document=document)
    builder.errors.extend(iter_semantic_errors(family))
    if builder.errors:
        return None, builder.errors
    return family, []


# ---------------------------------------------------------------- semantic checks


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
            if not isinstance(dim, str):
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
        if owner.kind == "unit":
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
    if unit_owned and any(o.kind != "unit" for o in group.owners):
        yield SemanticError("a group is either unit-owned or statically owned, not both",
                            location=loc(group.pointer), pointer=group.pointer)
    if sum(o.kind == "unit" for o in group.owners) > 1:
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
    has_partition = (group.form in ("fused",) or group.form == "projections" and group.units
                     or any(p.sharding and p.sharding.kind.startswith("partitioned")
                            for p in group.members)
                     or (group.module_sharding is not None
                         and group.module_sharding.kind.startswith("partitioned")))
    if has_partition and group.units is None:
        yield SemanticError("this group partitions a member but declares no `units`",
                            location=loc(group.pointer), pointer=group.pointer)
    partitions = (any(p.sharding and p.sharding.kind.startswith("partitioned")
                      for p in group.members)
                  or (group.module_sharding is not None
                      and group.module_sharding.kind.startswith("partitioned")))
    if group.units is not None and group.form in ("members", "module") and not partitions:
        pointer = join_pointer(group.pointer, "units")
        yield SemanticError(
            f"this group declares `units: {group.units_text}` but no member is partitioned; "
            "drop `units`, or shard a member with `partitioned` or `partitioned_segments`",
            location=loc(pointer), pointer=pointer)
