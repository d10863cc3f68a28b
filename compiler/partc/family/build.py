"""Building a symbolic family declaration from a schema-valid document."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from partc.errors import ExpressionError, PartcError, SemanticError
from partc.family.checks import iter_semantic_errors
from partc.family.declaration import (
    AXIS_SHARDING_DECLS,
    SEGMENTS_SHARDING_DECLS,
    BoundaryTensorDecl,
    ConfigFieldDecl,
    ConfigType,
    DerivedDecl,
    FamilyDecl,
    GraphGroupDecl,
    GroupDecl,
    GroupForm,
    LinearFormatDecl,
    ModuleDecl,
    OwnerDecl,
    OwnerKind,
    ParamDecl,
    PrefixDecl,
    ReplicatedShardingDecl,
    ShardingDecl,
    StateDecl,
    StateSplitDecl,
)
from partc.family.expr import Expression, Template, constant, parse, parse_template
from partc.front.load import RawDocument
from partc.front.positions import join_pointer
from partc.parallel.formats import GGUF_BLOCK_TYPES
from partc.parallel.layout import ParameterRole
from partc.parallel.placements import DTYPE_BITS, TORCH_DTYPE_NAMES
from partc.parallel.specs import (
    FusedLayout,
    LinearWeightLayout,
    MemberShardingKind,
    ProjectionSharding,
    ShardingPolicy,
)
from partc.partition.boundary import BoundaryTensorDimensionKind, BoundaryTensorDtype
from partc.partition.ownership import GroupParallelMode, StageSide

_LINEAR_LAYOUTS = {"linear": LinearWeightLayout.OUT_IN,
                   "linear_transposed": LinearWeightLayout.IN_OUT}
"""A member's `format:` as a linear weight layout (`dense`, or none: not a linear weight)."""


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
        self.errors.append(exc.located(self.document.locate_offset(pointer, exc.offset),
                                       pointer))

    def template(self, value: str, pointer: str) -> Template | None:
        try:
            return parse_template(value)
        except ExpressionError as exc:
            self.located(exc, pointer)
            return None


def _segment_entries(value: Any, pointer: str) -> list[tuple[Any, str]]:
    """(expression, pointer) of each `segments:` entry: a list of them, or one expression
    that evaluates to the whole list (`"[ffn_hidden_size] * moe_num_experts"`)."""
    if isinstance(value, list):
        return [(seg, join_pointer(pointer, i)) for i, seg in enumerate(value)]
    return [(value, pointer)]


def _sharding(builder: _Builder, value: Any, pointer: str) -> ShardingDecl:
    """A member rule as declared: `replicated` (or none), `{kind: AXIS}`, or
    `{kind: {axis: AXIS, segments: [...] or an expression}}` (the schema has checked which
    kind takes which)."""
    if value in (None, "replicated"):
        return ReplicatedShardingDecl()
    (kind, arg), = value.items()
    if isinstance(arg, dict):
        segments = []
        for seg, seg_pointer in _segment_entries(arg["segments"], join_pointer(
                join_pointer(pointer, kind), "segments")):
            parsed = builder.expression(seg, seg_pointer)
            if parsed is not None:
                segments.append(parsed)
        return SEGMENTS_SHARDING_DECLS[MemberShardingKind(kind)](axis=int(arg["axis"]),
                                                                 segments=tuple(segments))
    return AXIS_SHARDING_DECLS[MemberShardingKind(kind)](axis=int(arg))


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
        for seg, seg_pointer in _segment_entries(data[segments_key],
                                                 join_pointer(pointer, segments_key)):
            parsed = builder.expression(seg, seg_pointer)
            if parsed is not None:
                segments.append(parsed)
    when = (builder.expression(data["when"], join_pointer(pointer, "when"))
            if "when" in data else None)
    heads = _heads(builder, data.get("heads"), join_pointer(pointer, "heads"))
    groups = (builder.expression(data["groups"], join_pointer(pointer, "groups"))
              if "groups" in data else None)
    if module is None:
        return None
    return ModuleDecl(module=module, params=params, sharding=sharding, segments=tuple(segments),
                      when=when, linear=bool(data.get("linear", True)), pointer=pointer,
                      heads=heads, layout=FusedLayout(data.get("layout", "component_major")),
                      groups=groups,
                      orientation=LinearWeightLayout(data.get("orientation", "out_in")),
                      tp_reduction=data.get("reduction") == "tensor_parallel",
                      tp_output_reduction=data.get("reduction") == "output")


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
            out.append(OwnerDecl(kind=OwnerKind.STATIC, roles=(choice["static"],), group=None,
                                 when=when, pointer=ptr))
        elif "any_of" in choice:
            out.append(OwnerDecl(kind=OwnerKind.ANY_OF, roles=tuple(choice["any_of"]), group=None,
                                 when=when, pointer=ptr))
        else:
            groups = choice["unit"] if isinstance(choice["unit"], list) else [choice["unit"]]
            out.append(OwnerDecl(kind=OwnerKind.UNIT, roles=(), group=groups[0], when=when,
                                 pointer=ptr, groups=tuple(groups)))
    return tuple(out)


def _member(builder: _Builder, member: dict[str, Any], ptr: str) -> ParamDecl | None:
    """One entry of a members-form group (None when its target does not parse)."""
    target = builder.template(member["target"], join_pointer(ptr, "target"))
    shape = tuple(e for j, d in enumerate(member["shape"])
                  if (e := builder.expression(d, join_pointer(join_pointer(ptr, "shape"), j)))
                  is not None)
    sharding = _sharding(builder, member.get("sharding"), join_pointer(ptr, "sharding"))
    when = (builder.expression(member["when"], join_pointer(ptr, "when"))
            if "when" in member else None)
    dtype = (_dtype_expression(builder, member["dtype"], join_pointer(ptr, "dtype"))
             if "dtype" in member else None)
    if member.get("reduction") == "output" and (sharding is None or not sharding.partitions):
        builder.error("`reduction: output` marks a member whose module's partial output is "
                      "all-reduced over the TP group inside the enclosing module, so it must "
                      "be split by the group's units (`partitioned` or `partitioned_segments`), "
                      f"found {json.dumps(member.get('sharding', 'replicated'))}",
                      join_pointer(ptr, "reduction"))
    if member.get("reduction") == "tensor_parallel" and (
            sharding is None or not sharding.partitions):
        builder.error("`reduction: tensor_parallel` marks a norm weight whose statistic spans "
                      "every rank's channels, so it must be split by the group's units "
                      "(`partitioned`), found "
                      f"{json.dumps(member.get('sharding', 'replicated'))}",
                      join_pointer(ptr, "reduction"))
    if target is None:
        return None
    return ParamDecl(name=target, shape=shape, when=when, dtype=dtype, sharding=sharding,
                     pointer=ptr, layout=_LINEAR_LAYOUTS.get(member.get("format", "")),
                     shape_pointer=join_pointer(ptr, "shape")
                     if len(shape) == len(member["shape"]) else "",
                     heads=_heads(builder, member.get("heads"), join_pointer(ptr, "heads")),
                     tp_reduction=member.get("reduction") == "tensor_parallel",
                     tp_output_reduction=member.get("reduction") == "output")


def _members_form(builder: _Builder, data: dict[str, Any], pointer: str) -> dict[str, Any]:
    """`members:` a list of members, each with its own target, shape and sharding."""
    members = (_member(builder, member, join_pointer(join_pointer(pointer, "members"), i))
               for i, member in enumerate(data["members"]))
    return {"members": tuple(m for m in members if m is not None)}


def _module_form(builder: _Builder, data: dict[str, Any], pointer: str) -> dict[str, Any]:
    """`module:` and `params:` under one `sharding:` rule."""
    module = _module(builder, {"module": data["module"], "params": data["params"]}, pointer,
                     None, None)
    sharding = _sharding(builder, data.get("sharding"), join_pointer(pointer, "sharding"))
    return {"module": module, "module_sharding": sharding}


def _projection(builder: _Builder, data: dict[str, Any], pointer: str) -> ModuleDecl | None:
    """One entry of `projections:`; `sharding: per_head` is a module per head (no projection
    sharding of its own)."""
    if data["sharding"] == "per_head":
        module = _module(builder, data, pointer, None, None)
        return None if module is None else replace(module, per_head=True)
    return _module(builder, data, pointer, ProjectionSharding(data["sharding"]), None)


def _projections_form(builder: _Builder, data: dict[str, Any], pointer: str
                      ) -> dict[str, Any]:
    """`projections:` column- or row-parallel modules."""
    decls = (_projection(builder, proj, join_pointer(join_pointer(pointer, "projections"), i))
             for i, proj in enumerate(data["projections"]))
    for i, proj in enumerate(data["projections"]):
        need = {"tensor_parallel": "column", "output": "row"}.get(proj.get("reduction", ""))
        if need is not None and proj["sharding"] != need:
            builder.error(f"`reduction: {proj['reduction']}` marks "
                          + ("a norm over a column-split projection's width, so its sharding "
                             "must be column" if need == "column" else
                             "a row projection whose partial output is all-reduced over the TP "
                             "group inside its module, so its sharding must be row")
                          + f", found {proj['sharding']}"
                          + ("; a row projection whose output is summed inside its module "
                             "(Mamba's x_proj) is `reduction: output`"
                             if proj["sharding"] == "row" else ""),
                          join_pointer(join_pointer(join_pointer(pointer, "projections"), i),
                                       "reduction"))
        if proj.get("reduction") and "units" not in data:
            builder.error("a projection with `reduction: tensor_parallel` must share the "
                          "group's partition (`units:`) with the projections around it, so no "
                          "rank's piece cuts a head or a channel", join_pointer(join_pointer(
                              join_pointer(pointer, "projections"), i), "reduction"))
    projections = tuple(d for d in decls if d is not None)
    if "bias" in data:
        projections = _default_biases(builder, data["bias"], join_pointer(pointer, "bias"),
                                      projections)
    return {"projections": projections}


def _default_biases(builder: _Builder, condition: Any, pointer: str,
                    projections: tuple[ModuleDecl, ...]) -> tuple[ModuleDecl, ...]:
    """A group's `bias: <condition>`: every projection (column, row or replicated) that
    declares no `bias` of its own gets `bias: {shape: [the weight's rows], when: <condition>}`
    (a projection kept whole keeps its bias whole; one switched to `replicated` does not lose
    it)."""
    when = builder.expression(condition, pointer)
    out = []
    for module in projections:
        names = {p.name.text for p in module.params}
        weight = next((p for p in module.params if p.name.text == "weight"), None)
        if (when is None or "bias" in names or weight is None or not weight.shape
                or module.sharding is None):
            out.append(module)
            continue
        rows = weight.shape[1] if module.orientation is LinearWeightLayout.IN_OUT else (
            weight.shape[0])  # the output features: axis 1 of a Conv1D `[in, out]` weight
        bias = ParamDecl(name=parse_template("bias"), shape=(rows,), when=when,
                         dtype=None, sharding=None, pointer=pointer)
        out.append(replace(module, params=(*module.params, bias)))
    return tuple(out)


def _fused_form(builder: _Builder, data: dict[str, Any], pointer: str) -> dict[str, Any]:
    """`fused:` a column projection of segments, and its row-parallel `output:` module."""
    fused = _module(builder, data["fused"], join_pointer(pointer, "fused"),
                    ProjectionSharding.COLUMN, "segments")
    if "output" not in data:
        builder.error("a fused projection group needs its row-parallel `output` module",
                      pointer)
        return {}
    output = _module(builder, data["output"], join_pointer(pointer, "output"),
                     ProjectionSharding.ROW, None)
    return {"projections": (fused, output)} if fused is not None and output is not None else {}


_FORMS: dict[GroupForm, Callable[[_Builder, dict[str, Any], str], dict[str, Any]]] = {
    GroupForm.MEMBERS: _members_form,
    GroupForm.MODULE: _module_form,
    GroupForm.PROJECTIONS: _projections_form,
    GroupForm.FUSED: _fused_form,
}
"""Per group form, the `GroupDecl` fields its key declares (the schema allows one key)."""


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
    form = next((f for f in _FORMS if f.value in data), GroupForm.FUSED)
    fields: dict[str, Any] = {"members": (), "module": None, "module_sharding": None,
                              "projections": ()}
    fields.update(_FORMS[form](builder, data, pointer))
    if name is None:
        return None
    return GroupDecl(
        name=name, role=ParameterRole(data["role"]), owners=owners, when=when, loops=tuple(loops),
        units=units, units_text=str(data.get("units", "")),
        policy=ShardingPolicy(data["policy"]) if "policy" in data else None,
        kv_replication=bool(data.get("kv_replication", False)), form=form, pointer=pointer,
        expert_axis=data["experts"]["axis"] if "experts" in data else None,
        expert_count=builder.expression(data["experts"]["count"], join_pointer(
            join_pointer(pointer, "experts"), "count"))
        if "count" in data.get("experts", {}) else None, **fields)


def _default(builder: _Builder, spec: dict[str, Any], pointer: str
             ) -> tuple[Expression | None, tuple[bool, Any]]:
    """A config field's default: an expression, or (for a float) the literal value itself."""
    if "default" not in spec:
        return None, (False, None)
    raw = spec["default"]
    if isinstance(raw, float):
        return None, (True, raw)  # floats never enter expressions; kept as the value
    if raw is None:
        return constant(None), (False, None)
    if isinstance(raw, list):
        return builder.constant(tuple(raw), pointer), (False, None)
    if isinstance(raw, str) and ConfigType(spec["type"]) in (ConfigType.STR,
                                                             ConfigType.STR_LIST):
        return builder.constant(raw, pointer), (False, None)
    return builder.expression(raw, pointer), (False, None)


def _config_field(builder: _Builder, name: str, spec: str | dict[str, Any]) -> ConfigFieldDecl:
    """One `config` entry: a bare type, or a mapping with type, default, `from` and probe."""
    ptr = join_pointer("/config", name)
    if isinstance(spec, str):
        return ConfigFieldDecl(name=name, type=ConfigType(spec), default=None, sources=(name,),
                               pointer=ptr)
    default, literal = _default(builder, spec, join_pointer(ptr, "default"))
    sources = spec.get("from", name)
    present = None
    if "present" in spec:
        present = builder.template(spec["present"], join_pointer(ptr, "present"))
        if ConfigType(spec["type"]) is not ConfigType.BOOL:
            builder.error(f"config field `{name}` probes the checkpoint with `present`, so "
                          f"its type must be bool, found {spec['type']}", ptr)
        if spec.get("nullable", False):
            builder.error(f"config field `{name}` probes the checkpoint with `present`, so it "
                          "is true or false, never null; remove `nullable`", ptr)
    return ConfigFieldDecl(
        name=name, type=ConfigType(spec["type"]), default=default,
        sources=(sources,) if isinstance(sources, str) else tuple(sources), pointer=ptr,
        present=present, literal_default=literal, nullable=bool(spec.get("nullable", False)))


def _graph_group(builder: _Builder, i: int, group: dict[str, Any],
                 dimensions: tuple[str, ...]) -> GraphGroupDecl:
    """One execution group of `graph`."""
    ptr = join_pointer("/graph", i)
    units = builder.expression(group["units"], join_pointer(ptr, "units"))
    path = builder.template(group["path"], join_pointer(ptr, "path"))
    weight = (builder.expression(group["weight"], join_pointer(ptr, "weight"))
              if "weight" in group else None)
    boundary = group.get("boundary")
    # a group whose units or path failed to parse is still declared (its error is already
    # recorded), so owners naming it do not report it as unknown
    return GraphGroupDecl(name=group["group"], units=units or constant(0),
                          path=path or parse_template(""),
                          carries_state=bool(group.get("state", False)),
                          after=tuple(group.get("after", ())), pointer=ptr,
                          boundary_identity=boundary["identity"] if boundary else "",
                          boundary=_boundary(builder, boundary, join_pointer(ptr, "boundary"),
                                             dimensions) if boundary else (),
                          weight=weight,
                          parallel=GroupParallelMode(group["parallel"])
                          if "parallel" in group else None)


def _boundary(builder: _Builder, data: dict[str, Any], pointer: str = "/boundary",
              dimensions: tuple[str, ...] = ()) -> tuple[BoundaryTensorDecl, ...]:
    """The primary then the auxiliary boundary tensors (a dimension named under `dimensions`
    is a per-request one)."""
    tensors = [(join_pointer(pointer, "primary"), data["primary"])] + [
        (join_pointer(join_pointer(pointer, "auxiliary"), i), t) for i, t in enumerate(
            data.get("auxiliary", []))]
    out = []
    for ptr, tensor in tensors:
        shape: list[BoundaryTensorDimensionKind | Expression | str] = []
        for j, dim in enumerate(tensor["shape"]):
            if dim in ("batch", "sequence"):
                shape.append(BoundaryTensorDimensionKind(dim))
            elif isinstance(dim, str) and dim in dimensions:
                shape.append(dim)
            elif (parsed := builder.expression(dim, join_pointer(join_pointer(ptr, "shape"), j))):
                shape.append(parsed)
        out.append(BoundaryTensorDecl(role=tensor["role"], shape=tuple(shape),
                                      dtype=BoundaryTensorDtype(tensor["dtype"]), pointer=ptr))
    return tuple(out)


def _option_value(builder: _Builder, key: str, value: Any, pointer: str) -> Any:
    """A linear format option: names kept as written, numbers and lists parsed."""
    option = _FORMAT_OPTIONS.get(key)
    if option is not None and (converted := option(builder, value, pointer)) is not _GENERIC:
        return converted
    if isinstance(value, list):
        return tuple(builder.expression(v, join_pointer(pointer, j)) for j, v in enumerate(value))
    return builder.expression(value, pointer)


_GENERIC = object()
"""What a `_FORMAT_OPTIONS` entry returns to leave a value to the generic parse."""


def _as_written(builder: _Builder, value: Any, pointer: str) -> Any:
    return tuple(value) if isinstance(value, list) else value


_FORMAT_OPTIONS: dict[str, Callable[[_Builder, Any, str], Any]] = {
    "applies_to": _as_written,
    "except": _as_written,
    "scale_suffix": _as_written,
    "scale_dtype": lambda builder, value, pointer: (
        _dtype_expression(builder, value, pointer) if isinstance(value, str) else _GENERIC),
    "gguf_type": lambda builder, value, pointer: (
        constant(value) if value in GGUF_BLOCK_TYPES else _GENERIC),
}
"""Linear format options that are not parsed as plain expressions, by key."""


def _linear_format(builder: _Builder, i: int, fmt: dict[str, Any]) -> LinearFormatDecl:
    """One entry of `linear_formats`."""
    ptr = join_pointer("/linear_formats", i)
    options = tuple((key, _option_value(builder, key, value, join_pointer(ptr, key)))
                    for key, value in fmt.items() if key not in ("format", "when"))
    when = builder.expression(fmt["when"], join_pointer(ptr, "when")) if "when" in fmt else None
    return LinearFormatDecl(format=fmt["format"], when=when, options=options, pointer=ptr)


def _static_side(stage: str | dict[str, str]) -> StageSide:
    """A static role's `stage`: `first`/`last`, or the `unit` of `{with: <group>, unit: ...}`."""
    if isinstance(stage, dict):
        return StageSide(stage.get("unit", "first"))
    return StageSide(stage)


def _prefix(builder: _Builder, name: str, spec: dict[str, Any]) -> PrefixDecl:
    """One `prefixes` entry: its candidates and the value without a checkpoint."""
    ptr = join_pointer("/prefixes", name)
    candidates = tuple(spec["candidates"])
    default = spec.get("default", candidates[0])
    if default not in candidates:
        builder.error(f"prefix `{name}` defaults to {default!r}, which is not one of its "
                      f"candidates {list(candidates)}", join_pointer(ptr, "default"))
    return PrefixDecl(name=name, candidates=candidates, default=default, pointer=ptr)


def _state(builder: _Builder, i: int, spec: dict[str, Any]) -> StateDecl | None:
    """A `state:` entry: its shape and `when` parsed, `dtype` (`activation` or omitted: None)
    and `split` (`replicated`: None) as declared."""
    pointer = join_pointer("/state", i)
    shape_pointer = join_pointer(pointer, "shape")
    shape = tuple(builder.expression(d, join_pointer(shape_pointer, k))
                  for k, d in enumerate(spec["shape"]))
    when = (builder.expression(spec["when"], join_pointer(pointer, "when"))
            if "when" in spec else None)
    dtype = spec.get("dtype", "activation")
    dtype_expr = (None if dtype == "activation"
                  else _dtype_expression(builder, dtype, join_pointer(pointer, "dtype")))
    split = None
    if spec["split"] != "replicated":
        split_pointer = join_pointer(pointer, "split")
        follows = builder.template(spec["split"]["parameters"],
                                   join_pointer(split_pointer, "parameters"))
        segments = tuple(builder.expression(seg, seg_pointer) for seg, seg_pointer in
                         _segment_entries(spec["split"].get("segments", []),
                                          join_pointer(split_pointer, "segments")))
        if follows is None or any(s is None for s in segments):
            return None
        split = StateSplitDecl(parameters=follows, axis=int(spec["split"]["axis"]),
                               segments=tuple(s for s in segments if s is not None),
                               heads=_heads(builder, spec["split"].get("heads"),
                                            join_pointer(split_pointer, "heads")))
    if any(d is None for d in shape) or ("when" in spec and when is None) or (
            dtype != "activation" and dtype_expr is None):
        return None
    return StateDecl(name=spec["name"], group=spec["group"], when=when,
                     shape=tuple(d for d in shape if d is not None), dtype=dtype_expr,
                     split=split, pointer=pointer, per_token=spec.get("per") == "token")


def build_family(document: RawDocument) -> tuple[FamilyDecl | None, list[PartcError]]:
    """Build the symbolic family of a schema-valid document, with every semantic error found."""
    builder = _Builder(document)
    data = document.data
    config = tuple(_config_field(builder, name, spec) for name, spec in data["config"].items())
    derived = tuple(DerivedDecl(name=name, expression=parsed,
                                pointer=join_pointer("/derived", name))
                    for name, value in data.get("derived", {}).items()
                    if (parsed := builder.expression(value, join_pointer("/derived", name)))
                    is not None)
    dimensions = tuple(data.get("dimensions", {}))
    graph = tuple(_graph_group(builder, i, group, dimensions)
                  for i, group in enumerate(data["graph"]))
    statics = tuple((name, _static_side(spec["stage"]))
                    for name, spec in data.get("static", {}).items())
    static_with = tuple((name, spec["stage"]["with"])
                        for name, spec in data.get("static", {}).items()
                        if isinstance(spec["stage"], dict))
    groups = tuple(decl for i, group in enumerate(data["parameters"])
                   if (decl := _group(builder, group, join_pointer("/parameters", i)))
                   is not None)
    boundary = _boundary(builder, data["boundary"], dimensions=dimensions)
    formats = tuple(_linear_format(builder, i, fmt)
                    for i, fmt in enumerate(data.get("linear_formats", [])))
    family = FamilyDecl(
        name=data["family"], model_types=tuple(data["model_types"]), config=config,
        graph=graph, static_roles=statics, groups=groups,
        boundary_identity=data["boundary"]["identity"], boundary=boundary,
        linear_formats=formats,
        policy=ShardingPolicy(data["policy"]) if "policy" in data else None, document=document,
        derived=derived, omit=tuple(data.get("omit", ())),
        prefixes=tuple(_prefix(builder, name, spec)
                       for name, spec in data.get("prefixes", {}).items()),
        dimensions=dimensions, static_with=static_with,
        state=tuple(state for i, spec in enumerate(data.get("state", []))
                    if (state := _state(builder, i, spec)) is not None))
    builder.errors.extend(iter_semantic_errors(family))
    if builder.errors:
        return None, builder.errors
    return family, []
