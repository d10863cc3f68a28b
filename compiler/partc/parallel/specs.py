"""The `parallel` vocabulary: semantic parameter sharding and rank-local tensor layouts.

A `ParameterGroupSpec` is one atomic logical parameter (an attention block, a feed-forward
block, an embedding) with every physical checkpoint tensor that belongs to it. Realizing a group
for a tensor-parallel size gives each rank a `LocalTensorLayout` per member (DESIGN.md §3).
The layout half of the vocabulary is defined in `partc.layout` and re-exported here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from partc.parallel.layout import (
    DTYPE_BITS,
    ParameterRole,
    _invalid_group,
    _invalid_tensor,
    _is_count,
    tensor_bytes,
)


def balanced_contiguous_range(items: int, parts: int, index: int) -> tuple[int, int]:
    """The half-open range part `index` gets when `items` are split over `parts` in order.

    Part i gets `items // parts + (1 if i < items % parts else 0)` items.
    """
    base, extra = divmod(items, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


# ---------------------------------------------------------------- roles and rules


class ProjectionSharding(enum.Enum):
    """How one affine projection is split: not at all, by output or by input features."""

    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"


class ShardingPolicy(enum.Enum):
    """What to do with a shard that is illegal for the topology."""

    REQUIRE = "require"
    REPLICATE_UNSUPPORTED = "replicate_unsupported"


class LinearWeightLayout(enum.Enum):
    """How a dense linear weight stores its matrix axes (always its last two)."""

    OUT_IN = "out_in"
    """`[..., out_features, in_features]`, as `torch.nn.Linear` stores it."""
    IN_OUT = "in_out"
    """`[..., in_features, out_features]`, as gpt-oss stores its stacked experts."""

    def axes(self, ndim: int) -> tuple[int, int]:
        """(output axis, input axis) of a weight with `ndim` dimensions."""
        return (ndim - 2, ndim - 1) if self is LinearWeightLayout.OUT_IN else (ndim - 1, ndim - 2)


class MemberShardingKind(enum.Enum):
    """The kinds of rank-local selection rule of one physical tensor."""

    REPLICATED = "replicated"
    EQUAL = "equal"
    BALANCED = "balanced"
    PARTITIONED = "partitioned"
    PARTITIONED_SEGMENTS = "partitioned_segments"
    SEGMENTED = "segmented"


_SEGMENT_KINDS = (MemberShardingKind.PARTITIONED_SEGMENTS, MemberShardingKind.SEGMENTED)
_PARTITIONED_KINDS = (MemberShardingKind.PARTITIONED, MemberShardingKind.PARTITIONED_SEGMENTS)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberSharding:
    """The rank-local selection rule of one physical tensor."""

    kind: MemberShardingKind
    """Which rule."""
    axis: int | None = None
    """The split axis (None for Replicated)."""
    segments: tuple[int, ...] = ()
    """Fused segment widths along the axis (segment kinds only)."""
    granule: int = 1
    """Cuts fall only on multiples of this many elements (a packed or block-quantized axis)."""

    def __post_init__(self) -> None:
        if not _is_count(self.granule) or self.granule < 1:
            raise _invalid_tensor(f"a sharding granule must be a positive integer, found "
                                  f"{self.granule!r}")
        if self.kind is MemberShardingKind.REPLICATED:
            if self.axis is not None or self.segments or self.granule != 1:
                raise _invalid_tensor("a replicated sharding takes no axis, segments or granule")
            return
        if not _is_count(self.axis) or self.axis is None or self.axis < 0:
            raise _invalid_tensor(f"{self.kind.value} sharding needs an axis >= 0, found "
                                  f"{self.axis}")
        if self.kind in _SEGMENT_KINDS:
            if not self.segments or any(not _is_count(s) or s <= 0 for s in self.segments):
                raise _invalid_tensor(
                    f"{self.kind.value} sharding needs positive segment widths, found "
                    f"{list(self.segments)}")
            if any(s % self.granule for s in self.segments):
                raise _invalid_tensor(
                    f"{self.kind.value} sharding: segments {list(self.segments)} do not all fall "
                    f"on {self.granule}-element granule boundaries")
        elif self.segments:
            raise _invalid_tensor(f"{self.kind.value} sharding takes no segments")

    @classmethod
    def replicated(cls) -> MemberSharding:
        """Every rank holds the whole tensor."""
        return cls(kind=MemberShardingKind.REPLICATED)

    @classmethod
    def equal(cls, axis: int, *, granule: int = 1) -> MemberSharding:
        """Equal contiguous shards along `axis`; the size must divide."""
        return cls(kind=MemberShardingKind.EQUAL, axis=axis, granule=granule)

    @classmethod
    def balanced(cls, axis: int, *, granule: int = 1) -> MemberSharding:
        """Balanced, possibly uneven, contiguous ranges along `axis`."""
        return cls(kind=MemberShardingKind.BALANCED, axis=axis, granule=granule)

    @classmethod
    def partitioned(cls, axis: int, *, granule: int = 1) -> MemberSharding:
        """The group's logical partition mapped onto `axis`."""
        return cls(kind=MemberShardingKind.PARTITIONED, axis=axis, granule=granule)

    @classmethod
    def partitioned_segments(cls, axis: int, segments: Iterable[int], *,
                             granule: int = 1) -> MemberSharding:
        """The group's logical range mapped into each fused segment along `axis`."""
        return cls(kind=MemberShardingKind.PARTITIONED_SEGMENTS, axis=axis,
                   segments=tuple(segments), granule=granule)

    @classmethod
    def segmented(cls, axis: int, segments: Iterable[int], *, granule: int = 1) -> MemberSharding:
        """Each fused segment along `axis` split over the ranks on its own."""
        return cls(kind=MemberShardingKind.SEGMENTED, axis=axis, segments=tuple(segments),
                   granule=granule)

    @property
    def is_partitioned(self) -> bool:
        """Whether this rule consumes the group's logical partition."""
        return self.kind in _PARTITIONED_KINDS

    def describe(self) -> str:
        """A short spelling for messages, e.g. `partitioned(axis 0)`."""
        if self.kind is MemberShardingKind.REPLICATED:
            return "replicated"
        extra = f", segments {list(self.segments)}" if self.segments else ""
        extra += f", granule {self.granule}" if self.granule > 1 else ""
        return f"{self.kind.value}(axis {self.axis}{extra})"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParameterMemberSpec:
    """One physical checkpoint tensor of a parameter group."""

    target: str
    """Checkpoint tensor name."""
    shape: tuple[int, ...]
    """Global shape."""
    sharding: MemberSharding
    """Rank-local selection rule."""
    dtype: str = "F32"
    """Safetensors dtype of the stored tensor."""
    linear: LinearWeightLayout | None = None
    """Set when the tensor is a dense linear weight a linear format may encode."""
    heads: tuple[int, ...] = ()
    """Attention heads along the partitioned axis (one count per segment); empty if unknown."""
    encoding: str = ""
    """The linear-format part this tensor stores, e.g. `block_fp8.scale` ('' when dense)."""

    def __post_init__(self) -> None:
        target = self.target
        if not target:
            raise _invalid_tensor("a member needs a non-empty target name")
        if any(not _is_count(d) or d < 0 for d in self.shape):
            raise _invalid_tensor(f"`{target}` has shape {list(self.shape)}; every dimension "
                                  "must be a non-negative integer", target=target)
        if self.dtype not in DTYPE_BITS:
            raise _invalid_tensor(f"`{target}` has unknown dtype {self.dtype!r}; expected one "
                                  f"of {', '.join(sorted(DTYPE_BITS))}", target=target)
        if self.linear is not None and len(self.shape) < 2:
            raise _invalid_tensor(f"`{target}` is marked as a linear weight but has shape "
                                  f"{list(self.shape)}; a linear weight has at least 2 dimensions",
                                  target=target)
        rule = self.sharding
        if rule.axis is None:
            if self.heads:
                raise _invalid_tensor(f"`{target}` declares heads {list(self.heads)} but is "
                                      "replicated; `heads` only applies to partitioned members",
                                      target=target)
            return
        if rule.axis >= len(self.shape):
            raise _invalid_tensor(
                f"`{target}` is {rule.describe()} but has only {len(self.shape)} dimension(s) "
                f"(shape {list(self.shape)})", target=target)
        dim = self.shape[rule.axis]
        if rule.segments and sum(rule.segments) != dim:
            raise _invalid_tensor(
                f"`{target}`: segments {list(rule.segments)} sum to {sum(rule.segments)} but "
                f"axis {rule.axis} has {dim} elements; segments must be contiguous, ordered and "
                "cover the fused width", target=target)
        if rule.is_partitioned and dim % rule.granule:
            raise _invalid_tensor(
                f"`{target}` is {rule.describe()} but axis {rule.axis} has {dim} elements, not a "
                f"whole number of {rule.granule}-element blocks; a partitioned axis must be "
                "block-aligned", target=target)
        self._check_heads(rule)

    def _check_heads(self, rule: MemberSharding) -> None:
        if not self.heads:
            return
        if not rule.is_partitioned:
            raise _invalid_tensor(f"`{self.target}` declares heads {list(self.heads)} but is "
                                  f"{rule.describe()}; `heads` only applies to partitioned "
                                  "members", target=self.target)
        widths = self.widths
        if len(self.heads) != len(widths):
            raise _invalid_tensor(
                f"`{self.target}` declares {len(self.heads)} head count(s) {list(self.heads)} "
                f"for {len(widths)} segment(s); give one count per segment", target=self.target)
        for width, heads in zip(widths, self.heads, strict=True):
            # an encoded companion (a block scale) may hold fractional heads; KV replication
            # checks its cuts when it happens
            if not _is_count(heads) or heads < 1 or (width % heads and not self.encoding):
                raise _invalid_tensor(
                    f"`{self.target}`: {width} elements on axis {rule.axis} cannot hold {heads} "
                    "whole heads; the width must be a positive multiple of the head count",
                    target=self.target)

    @property
    def widths(self) -> tuple[int, ...]:
        """Segment widths of the split axis (the whole axis when unsegmented; () if replicated)."""
        if self.sharding.axis is None:
            return ()
        return self.sharding.segments or (self.shape[self.sharding.axis],)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return tensor_bytes(self.dtype, self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParameterGroupSpec:
    """One atomic logical parameter with all its physical companions."""

    name: str
    """Logical name, e.g. `layers.3.attention`."""
    role: ParameterRole
    """Semantic role."""
    members: tuple[ParameterMemberSpec, ...]
    """Physical tensors, in declaration order."""
    units: int | None = None
    """Logical partition units; present iff some member is partitioned."""
    units_label: str = ""
    """What the units count, for messages (e.g. `num_key_value_heads`)."""
    policy: ShardingPolicy | None = None
    """Per-group sharding policy (None: the topology's policy)."""
    kv_replication: bool = False
    """Allow more ranks than units by repeating KV heads (see docs/kv_replication.md)."""

    def __post_init__(self) -> None:
        name = self.name
        if not name:
            raise _invalid_group("a parameter group needs a non-empty name", group=name)
        if not self.members:
            raise _invalid_group(f"group `{name}` has no members; it needs at least one",
                                 group=name)
        seen: set[str] = set()
        for member in self.members:
            if member.target in seen:
                raise _invalid_group(f"group `{name}` lists target `{member.target}` twice; "
                                     "each tensor belongs to a group once", group=name,
                                     target=member.target)
            seen.add(member.target)
        partitioned = [m for m in self.members if m.sharding.is_partitioned]
        if partitioned and self.units is None:
            raise _invalid_group(
                f"group `{name}` has partitioned member `{partitioned[0].target}` but declares "
                "no partition units; add `units`", group=name, target=partitioned[0].target)
        if not partitioned and self.units is not None:
            raise _invalid_group(
                f"group `{name}` declares {self.units} partition units but no member is "
                "partitioned; drop `units` or partition a member", group=name)
        if self.units is not None and (not _is_count(self.units) or self.units < 1):
            raise _invalid_group(f"group `{name}` has {self.units} partition units; at least "
                                 "1 is required", group=name)
        for member in partitioned:
            self._check_unit_widths(member)
        if self.kv_replication:
            missing = [m.target for m in partitioned if not m.heads]
            if not partitioned or missing:
                what = f"`{missing[0]}` declares no `heads`" if missing else "no member is " \
                    "partitioned"
                raise _invalid_group(
                    f"group `{name}` sets kv_replication but {what}; KV replication needs the "
                    "head count of every partitioned projection (`heads:` in YAML)",
                    group=name, target=missing[0] if missing else "")

    def _check_unit_widths(self, member: ParameterMemberSpec) -> None:
        units = self.units or 1
        rule = member.sharding
        label = f" ({self.units_label})" if self.units_label else ""
        for width in member.widths:
            if width % (units * rule.granule):
                what = "a segment" if rule.segments else f"axis {rule.axis}"
                blocks = f" of {rule.granule}-element blocks" if rule.granule > 1 else ""
                raise _invalid_tensor(
                    f"group `{self.name}`: {what} of `{member.target}` has {width} elements, "
                    f"which cannot be cut into the group's {units} partition units{label}"
                    f"{blocks}; use a unit count dividing {width // rule.granule}",
                    group=self.name, target=member.target)
        for heads in member.heads:
            if heads % units:
                raise _invalid_tensor(
                    f"group `{self.name}`: `{member.target}` has {heads} heads, not a multiple "
                    f"of the group's {units} partition units{label}, so a unit boundary would "
                    "cut a head", group=self.name, target=member.target)

    @property
    def targets(self) -> tuple[str, ...]:
        """Checkpoint targets of every member."""
        return tuple(m.target for m in self.members)


# ---------------------------------------------------------------- builders


@dataclass(frozen=True, slots=True, kw_only=True)
class Projection:
    """One affine projection of a projection group: its module, split and parameters."""

    module: str
    """Module path; members are `{module}.{param}`."""
    sharding: ProjectionSharding
    """Column, row or replicated."""
    params: Mapping[str, Sequence[int]]
    """Parameter shapes by name (`weight`, `bias`, encoding companions)."""
    heads: int | None = None
    """Attention heads along its split axis, when known."""
    linear: bool = True
    """Whether its `weight` is a linear weight a linear format may encode."""


_Rule = Callable[[tuple[int, ...]], MemberSharding]


def _params_members(module: str, params: Mapping[str, Sequence[int]], dtype: str,
                    rule: MemberSharding | _Rule, *, linear: bool = False,
                    heads: int | None = None) -> tuple[ParameterMemberSpec, ...]:
    members = []
    for param, shape in params.items():
        shape = tuple(shape)
        sharding = rule(shape) if callable(rule) else rule
        members.append(ParameterMemberSpec(
            target=f"{module}.{param}" if module else param, shape=shape, sharding=sharding,
            dtype=dtype, linear=LinearWeightLayout.OUT_IN if linear and param == "weight"
            and len(shape) >= 2 else None,
            heads=(heads,) * len(sharding.segments or (1,))
            if heads is not None and sharding.is_partitioned else ()))
    return tuple(members)


def module_parameter_group(name: str, role: ParameterRole, module: str,
                           params: Mapping[str, Sequence[int]], sharding: MemberSharding, *,
                           dtype: str = "F32") -> ParameterGroupSpec:
    """Every parameter of `module`, all under one (non-partitioned) sharding rule."""
    return ParameterGroupSpec(name=name, role=role,
                              members=_params_members(module, params, dtype, sharding))


def partitioned_module_parameter_group(name: str, role: ParameterRole, module: str,
                                       params: Mapping[str, Sequence[int]], axis: int, units: int,
                                       *, dtype: str = "F32", units_label: str = ""
                                       ) -> ParameterGroupSpec:
    """Every parameter of `module` partitioned on `axis`, sharing one logical partition."""
    return ParameterGroupSpec(name=name, role=role, units=units, units_label=units_label,
                              members=_params_members(module, params, dtype,
                                                      MemberSharding.partitioned(axis)))


def _projection_rule(sharding: ProjectionSharding, partitioned: bool) -> _Rule:
    def rule(shape: tuple[int, ...]) -> MemberSharding:
        if sharding is ProjectionSharding.COLUMN and len(shape) >= 1:
            return MemberSharding.partitioned(0) if partitioned else MemberSharding.equal(0)
        if sharding is ProjectionSharding.ROW and len(shape) >= 2:
            return MemberSharding.partitioned(1) if partitioned else MemberSharding.equal(1)
        return MemberSharding.replicated()
    return rule


def projection_parameter_group(name: str, role: ParameterRole, module: str,
                               sharding: ProjectionSharding, params: Mapping[str, Sequence[int]],
                               *, dtype: str = "F32", linear: bool = True) -> ParameterGroupSpec:
    """One affine projection and its companions.

    Column splits axis 0 of every non-scalar member; Row splits axis 1 of members with two or
    more dimensions and replicates the bias. The `weight` is marked linear unless `linear=False`.
    """
    return ParameterGroupSpec(name=name, role=role, members=_params_members(
        module, params, dtype, _projection_rule(sharding, partitioned=False), linear=linear))


def reduced_partition_units(units: int, members: Iterable[ParameterMemberSpec]) -> int:
    """`units` reduced by gcd with every partitioned width (in granules) and head count."""
    result = units
    for member in members:
        if member.sharding.is_partitioned:
            for width in member.widths:
                result = math.gcd(result, width // member.sharding.granule)
            for heads in member.heads:
                result = math.gcd(result, heads)
    return result


def _reduced_label(label: str, units: int, reduced: int) -> str:
    return label if reduced == units else f"gcd({label or units}, ...) = {reduced}"


def _as_projection(item: Projection | tuple[str, ProjectionSharding, Mapping[str, Sequence[int]]]
                   ) -> Projection:
    if isinstance(item, Projection):
        return item
    module, sharding, params = item
    return Projection(module=module, sharding=sharding, params=params)


def partitioned_projection_group(
    name: str, role: ParameterRole,
    projections: Sequence[Projection | tuple[str, ProjectionSharding,
                                             Mapping[str, Sequence[int]]]],
    units: int, *, dtype: str = "F32", units_label: str = "", kv_replication: bool = False,
    policy: ShardingPolicy | None = None,
) -> ParameterGroupSpec:
    """Several projections consuming one shared logical partition of `units` units.

    The units are reduced by gcd with every partitioned dimension (and head count) so each unit
    spans whole elements of every member.
    """
    members: list[ParameterMemberSpec] = []
    for item in projections:
        proj = _as_projection(item)
        members.extend(_params_members(proj.module, proj.params, dtype,
                                       _projection_rule(proj.sharding, True),
                                       linear=proj.linear, heads=proj.heads))
    partitioned = any(m.sharding.is_partitioned for m in members)
    reduced = reduced_partition_units(units, members)
    return ParameterGroupSpec(name=name, role=role, members=tuple(members),
                              units=reduced if partitioned else None,
                              units_label=_reduced_label(units_label, units, reduced),
                              kv_replication=kv_replication, policy=policy)


def _companion_segments(group: str, target: str, segments: tuple[int, ...],
                        width: int) -> tuple[int, ...]:
    """The fused segments as seen by a companion whose axis 0 has `width` elements."""
    total = sum(segments)
    if width == total:
        return segments
    if width and total % width == 0 and all(s % (total // width) == 0 for s in segments):
        return tuple(s // (total // width) for s in segments)
    raise _invalid_tensor(
        f"group `{group}`: fused companion `{target}` has {width} rows, which cannot carry the "
        f"segments {list(segments)} ({total} rows) at a whole divisor; every companion of the "
        "fused weight must hold the same segments, scaled by its block size", group=group,
        target=target)


def segmented_projection_group(
    name: str, role: ParameterRole, *, fused_module: str, segments: Sequence[int],
    fused_params: Mapping[str, Sequence[int]], output_module: str,
    output_params: Mapping[str, Sequence[int]], units: int, dtype: str = "F32",
    units_label: str = "", fused_heads: Sequence[int] = (), output_heads: int | None = None,
    linear: bool = True, kv_replication: bool = False, policy: ShardingPolicy | None = None,
) -> ParameterGroupSpec:
    """A component-major fused column projection (`qkv_proj`, `gate_up_proj`) and its row output.

    Every fused member is PartitionedSegments on axis 0 (the same logical range taken inside each
    segment; a companion with fewer rows, e.g. a block scale, gets the segments scaled down);
    the output weight is Partitioned on axis 1 (it consumes the local hidden partition) and its
    bias replicated. Segments must be positive and cover the fused width in order.
    """
    segments = tuple(segments)
    if not segments or any(not _is_count(s) or s <= 0 for s in segments):
        raise _invalid_group(f"group `{name}`: segments must be positive widths, found "
                             f"{list(segments)}", group=name)
    if fused_heads and len(fused_heads) != len(segments):
        raise _invalid_group(f"group `{name}`: {len(fused_heads)} head counts "
                             f"{list(fused_heads)} for {len(segments)} segments; give one per "
                             "segment", group=name)
    members: list[ParameterMemberSpec] = []
    for param, shape in fused_params.items():
        shape = tuple(shape)
        target = f"{fused_module}.{param}"
        if not shape:
            members.append(ParameterMemberSpec(target=target, shape=shape, dtype=dtype,
                                               sharding=MemberSharding.replicated()))
            continue
        members.append(ParameterMemberSpec(
            target=target, shape=shape, dtype=dtype,
            sharding=MemberSharding.partitioned_segments(
                0, segments if param in ("weight", "bias")
                else _companion_segments(name, target, segments, shape[0])),
            linear=LinearWeightLayout.OUT_IN if linear and param == "weight" and len(shape) >= 2
            else None, heads=tuple(fused_heads)))
    members.extend(_params_members(output_module, output_params, dtype,
                                   _projection_rule(ProjectionSharding.ROW, True), linear=linear,
                                   heads=output_heads))
    reduced = reduced_partition_units(units, members)
    return ParameterGroupSpec(name=name, role=role, members=tuple(members), units=reduced,
                              units_label=_reduced_label(units_label, units, reduced),
                              kv_replication=kv_replication, policy=policy)


def aligned_partition_units(name: str, semantic_units: int, elements_per_unit: int,
                            alignment: int) -> int:
    """The finest logical-unit count whose every partition boundary is `alignment`-aligned.

    Units group whole semantic units (heads, channels); each group must span a multiple of
    `alignment` elements.
    """
    if semantic_units < 1 or elements_per_unit < 1 or alignment < 1:
        raise _invalid_group(
            f"group `{name}`: semantic units ({semantic_units}), elements per unit "
            f"({elements_per_unit}) and alignment ({alignment}) must all be positive", group=name)
    per_chunk = alignment // math.gcd(alignment, elements_per_unit)
    if semantic_units % per_chunk:
        raise _invalid_group(
            f"group `{name}`: {semantic_units} units of {elements_per_unit} elements cannot be cut "
            f"on {alignment}-element boundaries; a legal cut needs whole groups of {per_chunk} "
            f"units, which {semantic_units} is not a multiple of", group=name)
    return semantic_units // per_chunk


def with_policy(group: ParameterGroupSpec, policy: ShardingPolicy | None) -> ParameterGroupSpec:
    """A copy of `group` with its per-group policy set."""
    return replace(group, policy=policy)


# ---------------------------------------------------------------- realization


