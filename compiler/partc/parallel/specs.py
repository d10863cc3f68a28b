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
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from partc.parallel.layout import ParameterRole, invalid_group
from partc.parallel.placements import DTYPE_BITS, _invalid_tensor, is_count, tensor_bytes


def balanced_contiguous_range(items: int, parts: int, index: int) -> tuple[int, int]:
    """The half-open range part `index` gets when `items` are split over `parts` in order.

    Part i gets `items // parts + (1 if i < items % parts else 0)` items.
    """
    base, extra = divmod(items, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class TensorSplit(enum.Enum):
    """How a split that does not divide evenly gives out its remainder."""

    BALANCED = "balanced"
    """The first `n mod T` ranks get one more (DESIGN.md §3; the default)."""
    CHUNK = "chunk"
    """torch.chunk's rule, which DTensor's `Shard` and transformers' tensor parallelism follow:
    every rank gets `ceil(n / T)` in order, the last ones what is left (`chunk_range`)."""


def chunk_range(items: int, parts: int, index: int) -> tuple[int, int]:
    """The half-open range torch.chunk gives part `index` of `items` over `parts` (empty when
    the chunks run out first: torch.chunk then returns fewer than `parts` chunks)."""
    width = -(-items // parts)
    return min(index * width, items), min((index + 1) * width, items)


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


class FusedLayout(enum.Enum):
    """The row order of a fused projection's segments (docs/layouts.md has a picture of each)."""

    COMPONENT_MAJOR = "component_major"
    """`[c0 | c1 | ...]`: each segment one contiguous block (Phi-3 `qkv_proj`)."""
    PER_HEAD = "per_head"
    """`[h0: c0 c1 ... | h1: ...]`: every head holds its slice of each segment (GPT-NeoX, BLOOM)."""
    GROUPED_PER_KV = "grouped_per_kv"
    """`[g0: q.. k v | g1: ...]`: per KV group its query heads, its k and its v (Falcon)."""
    GROUPED = "grouped"
    """`[g0: c0 c1 ... | g1: ...]` over a group count of its own (`groups:`), the components in
    their stored order inside each group (CodeGen `qkv_proj`: `mp_num` groups of `[q v k]`)."""


class MemberShardingKind(enum.Enum):
    """The kinds of rank-local selection rule of one physical tensor."""

    REPLICATED = "replicated"
    EQUAL = "equal"
    BALANCED = "balanced"
    PARTITIONED = "partitioned"
    PARTITIONED_SEGMENTS = "partitioned_segments"
    SEGMENTED = "segmented"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicatedSharding:
    """Every rank holds the whole tensor."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.REPLICATED
    is_partitioned: ClassVar[bool] = False
    """Whether this rule consumes the group's logical partition."""

    def describe(self) -> str:
        """A short spelling for messages."""
        return "replicated"


@dataclass(frozen=True, slots=True, kw_only=True)
class _AxisSharding:
    """What the contiguous-range variants share: an axis and a granule, no segments."""

    kind: ClassVar[MemberShardingKind]
    segments: ClassVar[tuple[int, ...]] = ()
    groups: ClassVar[int] = 1
    axis: int
    """The split axis."""
    granule: int = 1
    """Cuts fall only on multiples of this many elements (a packed or block-quantized axis)."""

    def __post_init__(self) -> None:
        _check_split(self)

    def describe(self) -> str:
        """A short spelling for messages, e.g. `equal(axis 0)`."""
        return _describe(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class EqualSharding(_AxisSharding):
    """Equal contiguous shards along `axis`; the size must divide."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.EQUAL
    is_partitioned: ClassVar[bool] = False


@dataclass(frozen=True, slots=True, kw_only=True)
class BalancedSharding(_AxisSharding):
    """Balanced, possibly uneven, contiguous ranges along `axis`."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.BALANCED
    is_partitioned: ClassVar[bool] = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionedSharding(_AxisSharding):
    """The group's logical partition mapped onto `axis`."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.PARTITIONED
    is_partitioned: ClassVar[bool] = True


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionedSegmentsSharding:
    """The group's logical range mapped into each fused segment along `axis`.

    With `groups > 1` the segments are interleaved: the axis holds `groups` blocks, each with
    `segment / groups` elements of every segment in order.
    """

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.PARTITIONED_SEGMENTS
    is_partitioned: ClassVar[bool] = True
    axis: int
    """The split axis."""
    segments: tuple[int, ...]
    """Fused segment widths along the axis."""
    granule: int = 1
    """Cuts fall only on multiples of this many elements."""
    groups: int = 1
    """The axis interleaves this many equal blocks, each holding `1/groups` of every segment in
    order (1: component-major; the head count: per head; the KV head count: per KV group)."""

    def __post_init__(self) -> None:
        _check_split(self)

    def describe(self) -> str:
        """A short spelling for messages, e.g. `partitioned_segments(axis 0, segments [4, 4])`."""
        return _describe(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentedSharding:
    """Each fused segment along `axis` split over the ranks on its own."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.SEGMENTED
    is_partitioned: ClassVar[bool] = False
    groups: ClassVar[int] = 1
    axis: int
    """The split axis."""
    segments: tuple[int, ...]
    """Fused segment widths along the axis."""
    granule: int = 1
    """Cuts fall only on multiples of this many elements."""

    def __post_init__(self) -> None:
        _check_split(self)

    def describe(self) -> str:
        """A short spelling for messages, e.g. `segmented(axis 0, segments [8, 8])`."""
        return _describe(self)


SplitSharding = (EqualSharding | BalancedSharding | PartitionedSharding
                 | PartitionedSegmentsSharding | SegmentedSharding)
"""A rule that splits an axis."""
MemberSharding = ReplicatedSharding | SplitSharding
"""The rank-local selection rule of one physical tensor: one class per kind."""

SHARDING_CLASSES: Mapping[MemberShardingKind, type[MemberSharding]] = {
    cls.kind: cls for cls in (ReplicatedSharding, EqualSharding, BalancedSharding,
                              PartitionedSharding, PartitionedSegmentsSharding, SegmentedSharding)}
"""The rule class of each kind (how a declaration's `{kind: ...}` is read)."""


def member_sharding(kind: MemberShardingKind, *, axis: int | None = None,
                    segments: Iterable[int] = ()) -> MemberSharding:
    """The rule of `kind` on `axis` (none when replicated) over fused `segments` (segment kinds)."""
    cls = SHARDING_CLASSES[kind]
    given: dict[str, Any] = {} if axis is None else {"axis": axis}
    if segments := tuple(segments):
        given["segments"] = segments
    names = {f.name for f in fields(cls)}
    extra = [n for n in given if n not in names]
    if extra:
        raise _invalid_tensor(f"{kind.value} sharding takes no {' or '.join(extra)}")
    missing = [n for n in ("axis", "segments") if n in names and n not in given]
    if missing:
        raise _invalid_tensor(f"{kind.value} sharding needs {' and '.join(missing)}")
    return cls(**given)


def _check_split(rule: _AxisSharding | PartitionedSegmentsSharding | SegmentedSharding) -> None:
    """Refuse a non-positive granule or group count, a negative axis, bad segment widths."""
    kind = rule.kind.value
    if not is_count(rule.granule) or rule.granule < 1:
        raise _invalid_tensor(f"a sharding granule must be a positive integer, found "
                              f"{rule.granule!r}")
    if not is_count(rule.groups) or rule.groups < 1:
        raise _invalid_tensor(f"a sharding's interleaved groups must be a positive integer, "
                              f"found {rule.groups!r}")
    if not is_count(rule.axis) or rule.axis < 0:
        raise _invalid_tensor(f"{kind} sharding needs an axis >= 0, found {rule.axis}")
    if isinstance(rule, PartitionedSegmentsSharding | SegmentedSharding):
        if not rule.segments or any(not is_count(s) or s <= 0 for s in rule.segments):
            raise _invalid_tensor(f"{kind} sharding needs positive segment widths, found "
                                  f"{list(rule.segments)}")
        if any(s % (rule.granule * rule.groups) for s in rule.segments):
            raise _invalid_tensor(
                f"{kind} sharding: segments {list(rule.segments)} do not all fall on "
                f"{rule.granule}-element granule boundaries"
                + (f" in each of {rule.groups} interleaved groups" if rule.groups > 1 else ""))


def _describe(rule: _AxisSharding | PartitionedSegmentsSharding | SegmentedSharding) -> str:
    extra = f", segments {list(rule.segments)}" if rule.segments else ""
    extra += f", granule {rule.granule}" if rule.granule > 1 else ""
    extra += f", {rule.groups} interleaved groups" if rule.groups > 1 else ""
    return f"{rule.kind.value}(axis {rule.axis}{extra})"


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
    tp_reduction: bool = False
    """A norm whose statistic spans the whole split axis: an engine must all-reduce it over
    the tensor-parallel ranks (OLMo2's q_norm / k_norm)."""
    tp_output_reduction: bool = False
    """A row-split projection whose output an engine all-reduces over the tensor-parallel
    ranks inside its module, before the per-channel work that follows (Mamba's `x_proj`)."""
    head: tuple[int, int] | None = None
    """(index, count) of a per-head tensor: it belongs to head `index` of `count` heads, whole
    on the ranks holding that head and absent on the others (None: not per head)."""

    def __post_init__(self) -> None:
        target = self.target
        if not target:
            raise _invalid_tensor("a member needs a non-empty target name")
        if self.head is not None and not (
                isinstance(self.sharding, ReplicatedSharding) and not self.heads and self.shape
                and all(is_count(n) for n in self.head) and 0 <= self.head[0] < self.head[1]):
            raise _invalid_tensor(f"`{target}` is per head {list(self.head)}; a per-head tensor "
                                  "is replicated-whole, has a dimension, states no `heads` and "
                                  "has an index 0 <= index < count", target=target)
        if any(not is_count(d) or d < 0 for d in self.shape):
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
        if isinstance(rule, ReplicatedSharding):
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

    def _check_heads(self, rule: SplitSharding) -> None:
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
            if not is_count(heads) or heads < 1 or (width % heads and not self.encoding):
                raise _invalid_tensor(
                    f"`{self.target}`: {width} elements on axis {rule.axis} cannot hold {heads} "
                    "whole heads; the width must be a positive multiple of the head count",
                    target=self.target)

    @property
    def widths(self) -> tuple[int, ...]:
        """Segment widths of the split axis (the whole axis when unsegmented; () if replicated)."""
        rule = self.sharding
        if isinstance(rule, ReplicatedSharding):
            return ()
        return rule.segments or (self.shape[rule.axis],)

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
            raise invalid_group("a parameter group needs a non-empty name", group=name)
        if not self.members:
            raise invalid_group(f"group `{name}` has no members; it needs at least one",
                                 group=name)
        seen: set[str] = set()
        for member in self.members:
            if member.target in seen:
                raise invalid_group(f"group `{name}` lists target `{member.target}` twice; "
                                     "each tensor belongs to a group once", group=name,
                                     target=member.target)
            seen.add(member.target)
        partitioned = [m for m in self.members if m.sharding.is_partitioned]
        if partitioned and self.units is None:
            raise invalid_group(
                f"group `{name}` has partitioned member `{partitioned[0].target}` but declares "
                "no partition units; add `units`", group=name, target=partitioned[0].target)
        if not partitioned and self.units is not None:
            raise invalid_group(
                f"group `{name}` declares {self.units} partition units but no member is "
                "partitioned; drop `units` or partition a member", group=name)
        if self.units is not None and (not is_count(self.units) or self.units < 1):
            raise invalid_group(f"group `{name}` has {self.units} partition units; at least "
                                 "1 is required", group=name)
        for member in partitioned:
            self._check_unit_widths(member)
        if self.kv_replication:
            missing = [m.target for m in partitioned if not m.heads]
            if not partitioned or missing:
                what = f"`{missing[0]}` declares no `heads`" if missing else "no member is " \
                    "partitioned"
                raise invalid_group(
                    f"group `{name}` sets kv_replication but {what}; KV replication needs the "
                    "head count of every partitioned projection (`heads:` in YAML)",
                    group=name, target=missing[0] if missing else "")

    def _check_unit_widths(self, member: ParameterMemberSpec) -> None:
        units = self.units or 1
        rule = member.sharding
        assert not isinstance(rule, ReplicatedSharding)  # a partitioned member
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
    orientation: LinearWeightLayout = LinearWeightLayout.OUT_IN
    """How its weight stores the matrix axes (`IN_OUT`: a GPT-2 `Conv1D`)."""
    tp_reduction: bool = False
    """A norm whose statistic spans the split axis, so it needs a TP all-reduce."""
    tp_output_reduction: bool = False
    """A row projection whose output is all-reduced over the TP group inside its module."""


_Rule = Callable[[tuple[int, ...]], MemberSharding]


def _params_members(module: str, params: Mapping[str, Sequence[int]], dtype: str,
                    rule: MemberSharding | _Rule, *, linear: bool = False,
                    heads: int | None = None,
                    orientation: LinearWeightLayout = LinearWeightLayout.OUT_IN,
                    tp_reduction: bool = False,
                    tp_output_reduction: bool = False) -> tuple[ParameterMemberSpec, ...]:
    members = []
    for param, shape in params.items():
        shape = tuple(shape)
        sharding = rule(shape) if callable(rule) else rule
        members.append(ParameterMemberSpec(
            target=f"{module}.{param}" if module else param, shape=shape, sharding=sharding,
            dtype=dtype, linear=orientation if linear and param == "weight"
            and len(shape) >= 2 else None,
            heads=(heads,) * len(sharding.segments or (1,))
            if heads is not None and not isinstance(sharding, ReplicatedSharding)
            and sharding.is_partitioned else (),
            tp_reduction=tp_reduction and sharding.is_partitioned,
            tp_output_reduction=tp_output_reduction and sharding.is_partitioned))
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
                                                      PartitionedSharding(axis=axis)))


def _projection_rule(sharding: ProjectionSharding, partitioned: bool,
                     orientation: LinearWeightLayout = LinearWeightLayout.OUT_IN) -> _Rule:
    """Column splits the output axis (axis 0, or the last of an `in_out` weight), row the input
    axis (1, or the one before last of an `in_out` weight) of members with 2+ dimensions."""
    transposed = orientation is LinearWeightLayout.IN_OUT

    def rule(shape: tuple[int, ...]) -> MemberSharding:
        if sharding is ProjectionSharding.COLUMN and len(shape) >= 1:
            axis = len(shape) - 1 if transposed and len(shape) >= 2 else 0
            return PartitionedSharding(axis=axis) if partitioned else EqualSharding(axis=axis)
        if sharding is ProjectionSharding.ROW and len(shape) >= 2:
            axis = len(shape) - 2 if transposed else 1
            return PartitionedSharding(axis=axis) if partitioned else EqualSharding(axis=axis)
        return ReplicatedSharding()
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
        rule = member.sharding
        if not isinstance(rule, ReplicatedSharding) and rule.is_partitioned:
            for width in member.widths:
                result = math.gcd(result, width // rule.granule)
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
                                       _projection_rule(proj.sharding, True, proj.orientation),
                                       linear=proj.linear, heads=proj.heads,
                                       orientation=proj.orientation,
                                       tp_reduction=proj.tp_reduction,
                                       tp_output_reduction=proj.tp_output_reduction))
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


def _grouped(name: str, segments: tuple[int, ...], heads: tuple[int, ...], groups: int | None
             ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(global widths, heads, groups) of a `grouped` fused layout: `groups` blocks, each
    holding every segment's per-group width in order, and a whole number of each segment's
    heads when heads are given."""
    if groups is None or not is_count(groups) or groups < 1:
        raise invalid_group(f"group `{name}`: a grouped fused projection needs `groups:`, a "
                             f"positive group count, found {groups}", group=name)
    if heads and len(heads) != len(segments):
        heads = (heads[0],) * len(segments) if len(heads) == 1 else heads
    return _in_groups(name, segments, heads, groups, "grouped segment of {seg} rows per group",
                      "groups")


def _in_groups(name: str, segments: tuple[int, ...], heads: tuple[int, ...], groups: int,
               segment: str, blocks: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(global widths, heads, groups) of segments repeated in `groups` blocks, each segment's
    heads spread over the blocks in whole numbers; `segment` and `blocks` word the refusal."""
    for seg, count in zip(segments, heads, strict=True):
        if count % groups or seg % (count // groups):
            raise invalid_group(
                f"group `{name}`: {segment.format(seg=seg)} with {count} heads does not hold a "
                f"whole number of heads in each of the {groups} {blocks} (heads "
                f"{list(heads)}, segments per group {list(segments)})", group=name)
    return tuple(s * groups for s in segments), heads, groups


def _interleaved(name: str, layout: FusedLayout, segments: tuple[int, ...],
                 heads: tuple[int, ...], groups: int | None = None
                 ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(global segment widths, heads per segment, interleaved groups) of a fused layout.

    Component-major segments are the global widths. Per-head and grouped segments are the
    widths inside one block (one head, one KV group): per head, `heads` is the one head count
    (every segment has that many heads); grouped per KV, `heads` gives each segment's count and
    the group count is the smallest (the KV heads), dividing every other.
    """
    if layout is FusedLayout.COMPONENT_MAJOR:
        return segments, heads, 1
    if layout is FusedLayout.GROUPED:
        return _grouped(name, segments, heads, groups)
    if not heads:
        raise invalid_group(f"group `{name}`: a {layout.value} fused projection needs `heads:` "
                             "(the head count of each segment) to know its row order",
                             group=name)
    if layout is FusedLayout.PER_HEAD:
        if len(set(heads)) != 1:
            raise invalid_group(
                f"group `{name}`: a per_head fused projection interleaves whole heads, so every "
                f"segment has the same head count, found heads {list(heads)}", group=name)
        groups = heads[0]
        return tuple(s * groups for s in segments), (groups,) * len(segments), groups
    if len(heads) != len(segments):
        raise invalid_group(f"group `{name}`: {len(heads)} head counts {list(heads)} for "
                             f"{len(segments)} segments; a grouped_per_kv fused projection "
                             "gives one per segment", group=name)
    return _in_groups(name, segments, heads, min(heads), "grouped_per_kv segment of {seg} rows",
                      "KV groups")


def segmented_projection_group(
    name: str, role: ParameterRole, *, fused_module: str, segments: Sequence[int],
    fused_params: Mapping[str, Sequence[int]], output_module: str,
    output_params: Mapping[str, Sequence[int]], units: int, dtype: str = "F32",
    units_label: str = "", fused_heads: Sequence[int] = (), output_heads: int | None = None,
    linear: bool = True, kv_replication: bool = False, policy: ShardingPolicy | None = None,
    layout: FusedLayout = FusedLayout.COMPONENT_MAJOR,
    orientation: LinearWeightLayout = LinearWeightLayout.OUT_IN,
    output_orientation: LinearWeightLayout = LinearWeightLayout.OUT_IN,
    fused_groups: int | None = None,
) -> ParameterGroupSpec:
    """A fused column projection (`qkv_proj`, `gate_up_proj`) and its row output.

    Every fused member is PartitionedSegments on its output axis (axis 0; the last axis of an
    `in_out` weight): the same logical range taken inside each segment, the segments stored
    component-major or interleaved per head or per KV group (`layout`); a companion with fewer
    rows, e.g. a block scale, gets the segments scaled down. The output weight is Partitioned on
    its input axis (it consumes the local hidden partition) and its bias replicated. Segments
    must be positive and cover the fused width in order.
    """
    segments = tuple(segments)
    if not segments or any(not is_count(s) or s <= 0 for s in segments):
        raise invalid_group(f"group `{name}`: segments must be positive widths, found "
                             f"{list(segments)}", group=name)
    if fused_heads and len(fused_heads) != len(segments) and layout is not FusedLayout.PER_HEAD \
            and not (layout is FusedLayout.GROUPED and len(fused_heads) == 1):
        raise invalid_group(f"group `{name}`: {len(fused_heads)} head counts "
                             f"{list(fused_heads)} for {len(segments)} segments; give one per "
                             "segment", group=name)
    segments, heads, groups = _interleaved(name, layout, segments, tuple(fused_heads),
                                           fused_groups)
    members: list[ParameterMemberSpec] = []
    for param, shape in fused_params.items():
        shape = tuple(shape)
        target = f"{fused_module}.{param}"
        if not shape:
            members.append(ParameterMemberSpec(target=target, shape=shape, dtype=dtype,
                                               sharding=ReplicatedSharding()))
            continue
        axis = (len(shape) - 1 if orientation is LinearWeightLayout.IN_OUT and len(shape) >= 2
                else 0)
        members.append(ParameterMemberSpec(
            target=target, shape=shape, dtype=dtype,
            sharding=PartitionedSegmentsSharding(
                axis=axis, segments=segments if param in ("weight", "bias")
                else _companion_segments(name, target, segments, shape[axis]), groups=groups),
            linear=orientation if linear and param == "weight" and len(shape) >= 2
            else None, heads=heads))
    members.extend(_params_members(output_module, output_params, dtype,
                                   _projection_rule(ProjectionSharding.ROW, True,
                                                    output_orientation), linear=linear,
                                   heads=output_heads, orientation=output_orientation))
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
        raise invalid_group(
            f"group `{name}`: semantic units ({semantic_units}), elements per unit "
            f"({elements_per_unit}) and alignment ({alignment}) must all be positive", group=name)
    per_chunk = alignment // math.gcd(alignment, elements_per_unit)
    if semantic_units % per_chunk:
        raise invalid_group(
            f"group `{name}`: {semantic_units} units of {elements_per_unit} elements cannot be cut "
            f"on {alignment}-element boundaries; a legal cut needs whole groups of {per_chunk} "
            f"units, which {semantic_units} is not a multiple of", group=name)
    return semantic_units // per_chunk


def with_policy(group: ParameterGroupSpec, policy: ShardingPolicy | None) -> ParameterGroupSpec:
    """A copy of `group` with its per-group policy set."""
    return replace(group, policy=policy)


# ---------------------------------------------------------------- realization


