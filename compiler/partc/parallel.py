"""The `parallel` vocabulary: semantic parameter sharding and rank-local tensor layouts.

A `ParameterGroupSpec` is one atomic logical parameter (an attention block, a feed-forward
block, an embedding) with every physical checkpoint tensor that belongs to it. Realizing a group
for a tensor-parallel size gives each rank a `LocalTensorLayout` per member.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from partc.errors import ParallelPlanError, ParallelPlanErrorKind

# ---------------------------------------------------------------- dtypes

DTYPE_BITS: dict[str, int] = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8,
}
"""Bits per stored element of every safetensors dtype partc knows."""

TORCH_DTYPE_NAMES: dict[str, str] = {
    "float32": "F32", "float": "F32", "float16": "F16", "half": "F16", "bfloat16": "BF16",
    "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
"""`torch_dtype` / `dtype` spellings of config.json mapped to safetensors dtypes."""


def tensor_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of `dtype` and `shape` occupies in a checkpoint."""
    return math.prod(shape) * DTYPE_BITS[dtype] // 8


def balanced_contiguous_range(items: int, parts: int, index: int) -> tuple[int, int]:
    """The half-open range part `index` gets when `items` are split over `parts` in order.

    Part i gets `items // parts + (1 if i < items % parts else 0)` items.
    """
    base, extra = divmod(items, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


# ---------------------------------------------------------------- roles and rules


class ParameterRole(enum.Enum):
    """The semantic role of a parameter group."""

    REPLICATED = "replicated"
    COLUMN_PROJECTION = "column_projection"
    ROW_PROJECTION = "row_projection"
    VOCABULARY = "vocabulary"
    ATTENTION_HEADS = "attention_heads"
    FEED_FORWARD_INTERMEDIATE = "feed_forward_intermediate"
    EXPERT_INTERMEDIATE = "expert_intermediate"
    CHANNELS = "channels"
    SEGMENTED = "segmented"


class ProjectionSharding(enum.Enum):
    """How one affine projection is split: not at all, by output or by input features."""

    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"


class ShardingPolicy(enum.Enum):
    """What to do with a shard that is illegal for the topology."""

    REQUIRE = "require"
    REPLICATE_UNSUPPORTED = "replicate_unsupported"


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


def _invalid_tensor(message: str, *, group: str = "", target: str = "") -> ParallelPlanError:
    return ParallelPlanError(ParallelPlanErrorKind.INVALID_TENSOR, message, group=group,
                             target=target, tensor=target or None)


def _invalid_group(message: str, *, group: str) -> ParallelPlanError:
    return ParallelPlanError(ParallelPlanErrorKind.INVALID_GROUP, message, group=group)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberSharding:
    """The rank-local selection rule of one physical tensor."""

    kind: MemberShardingKind
    """Which rule."""
    axis: int | None = None
    """The split axis (None for Replicated)."""
    segments: tuple[int, ...] = ()
    """Fused segment widths along the axis (segment kinds only)."""

    def __post_init__(self) -> None:
        if self.kind is MemberShardingKind.REPLICATED:
            if self.axis is not None or self.segments:
                raise _invalid_tensor("a replicated sharding takes no axis and no segments")
            return
        if self.axis is None or self.axis < 0:
            raise _invalid_tensor(f"{self.kind.value} sharding needs an axis >= 0, found {self.axis}")
        if self.kind in _SEGMENT_KINDS:
            if not self.segments or any(s <= 0 for s in self.segments):
                raise _invalid_tensor(
                    f"{self.kind.value} sharding needs positive segment widths, found "
                    f"{list(self.segments)}")
        elif self.segments:
            raise _invalid_tensor(f"{self.kind.value} sharding takes no segments")

    @classmethod
    def replicated(cls) -> MemberSharding:
        """Every rank holds the whole tensor."""
        return cls(kind=MemberShardingKind.REPLICATED)

    @classmethod
    def equal(cls, axis: int) -> MemberSharding:
        """Equal contiguous shards along `axis`; the size must divide."""
        return cls(kind=MemberShardingKind.EQUAL, axis=axis)

    @classmethod
    def balanced(cls, axis: int) -> MemberSharding:
        """Balanced, possibly uneven, contiguous ranges along `axis`."""
        return cls(kind=MemberShardingKind.BALANCED, axis=axis)

    @classmethod
    def partitioned(cls, axis: int) -> MemberSharding:
        """The group's logical partition mapped onto `axis`."""
        return cls(kind=MemberShardingKind.PARTITIONED, axis=axis)

    @classmethod
    def partitioned_segments(cls, axis: int, segments: Iterable[int]) -> MemberSharding:
        """The group's logical range mapped into each fused segment along `axis`."""
        return cls(kind=MemberShardingKind.PARTITIONED_SEGMENTS, axis=axis,
                   segments=tuple(segments))

    @classmethod
    def segmented(cls, axis: int, segments: Iterable[int]) -> MemberSharding:
        """Each fused segment along `axis` split over the ranks on its own."""
        return cls(kind=MemberShardingKind.SEGMENTED, axis=axis, segments=tuple(segments))

    @property
    def is_partitioned(self) -> bool:
        """Whether this rule consumes the group's logical partition."""
        return self.kind in _PARTITIONED_KINDS

    def describe(self) -> str:
        """A short spelling for messages, e.g. `partitioned(axis 0)`."""
        if self.kind is MemberShardingKind.REPLICATED:
            return "replicated"
        if self.segments:
            return f"{self.kind.value}(axis {self.axis}, segments {list(self.segments)})"
        return f"{self.kind.value}(axis {self.axis})"


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

    def __post_init__(self) -> None:
        if not self.target:
            raise _invalid_tensor("a member needs a non-empty target name")
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape):
            raise _invalid_tensor(f"`{self.target}` has shape {list(self.shape)}; every dimension "
                                  "must be a non-negative integer", target=self.target)
        if self.dtype not in DTYPE_BITS:
            raise _invalid_tensor(f"`{self.target}` has unknown dtype {self.dtype!r}; expected one "
                                  f"of {', '.join(sorted(DTYPE_BITS))}", target=self.target)
        axis = self.sharding.axis
        if axis is not None and axis >= len(self.shape):
            raise _invalid_tensor(
                f"`{self.target}` is {self.sharding.describe()} but has only {len(self.shape)} "
                f"dimension(s) (shape {list(self.shape)})", target=self.target)
        if self.sharding.segments and axis is not None:
            total = sum(self.sharding.segments)
            if total != self.shape[axis]:
                raise _invalid_tensor(
                    f"`{self.target}`: segments {list(self.sharding.segments)} sum to {total} but "
                    f"axis {axis} has {self.shape[axis]} elements; segments must be contiguous, "
                    "ordered and cover the fused width", target=self.target)

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

    def __post_init__(self) -> None:
        if not self.name:
            raise _invalid_group("a parameter group needs a non-empty name", group=self.name)
        if not self.members:
            raise _invalid_group(f"group `{self.name}` has no members; it needs at least one",
                                 group=self.name)
        seen: set[str] = set()
        for member in self.members:
            if member.target in seen:
                raise _invalid_group(
                    f"group `{self.name}` lists target `{member.target}` twice", group=self.name)
            seen.add(member.target)
        partitioned = [m for m in self.members if m.sharding.is_partitioned]
        if partitioned and self.units is None:
            raise _invalid_group(
                f"group `{self.name}` has partitioned member `{partitioned[0].target}` but declares "
                "no partition units; add `units`", group=self.name)
        if not partitioned and self.units is not None:
            raise _invalid_group(
                f"group `{self.name}` declares {self.units} partition units but no member is "
                "partitioned; drop `units` or partition a member", group=self.name)
        if self.units is not None and self.units < 1:
            raise _invalid_group(f"group `{self.name}` has {self.units} partition units; at least "
                                 "1 is required", group=self.name)
        for member in partitioned:
            self._check_unit_widths(member)

    def _check_unit_widths(self, member: ParameterMemberSpec) -> None:
        units = self.units or 1
        assert member.sharding.axis is not None
        widths = member.sharding.segments or (member.shape[member.sharding.axis],)
        for width in widths:
            if width % units:
                what = "segment" if member.sharding.segments else f"axis {member.sharding.axis}"
                raise _invalid_tensor(
                    f"group `{self.name}`: {what} of `{member.target}` has {width} elements, not "
                    f"divisible by the group's {units} partition units"
                    f"{f' ({self.units_label})' if self.units_label else ''}",
                    group=self.name, target=member.target)

    @property
    def targets(self) -> tuple[str, ...]:
        """Checkpoint targets of every member."""
        return tuple(m.target for m in self.members)


# ---------------------------------------------------------------- builders


def _params_members(module: str, params: Mapping[str, Sequence[int]], dtype: str,
                    rule: object) -> tuple[ParameterMemberSpec, ...]:
    members = []
    for param, shape in params.items():
        sharding = rule(tuple(shape)) if callable(rule) else rule
        assert isinstance(sharding, MemberSharding)
        members.append(ParameterMemberSpec(target=f"{module}.{param}" if module else param,
                                           shape=tuple(shape), sharding=sharding, dtype=dtype))
    return tuple(members)


def module_parameter_group(name: str, role: ParameterRole, module: str,
                           params: Mapping[str, Sequence[int]], sharding: MemberSharding, *,
                           dtype: str = "F32") -> ParameterGroupSpec:
    """Every parameter of `module`, all under one sharding rule."""
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


def _projection_rule(sharding: ProjectionSharding, partitioned: bool
                     ) -> object:
    def rule(shape: tuple[int, ...]) -> MemberSharding:
        if sharding is ProjectionSharding.COLUMN and len(shape) >= 1:
            return MemberSharding.partitioned(0) if partitioned else MemberSharding.equal(0)
        if sharding is ProjectionSharding.ROW and len(shape) >= 2:
            return MemberSharding.partitioned(1) if partitioned else MemberSharding.equal(1)
        return MemberSharding.replicated()
    return rule


def projection_parameter_group(name: str, role: ParameterRole, module: str,
                               sharding: ProjectionSharding, params: Mapping[str, Sequence[int]],
                               *, dtype: str = "F32") -> ParameterGroupSpec:
    """One affine projection and its companions.

    Column splits axis 0 of every non-scalar member; Row splits axis 1 of members with two or
    more dimensions and replicates the bias.
    """
    return ParameterGroupSpec(name=name, role=role, members=_params_members(
        module, params, dtype, _projection_rule(sharding, partitioned=False)))


def _reduced_units(units: int, members: Iterable[ParameterMemberSpec]) -> int:
    result = units
    for member in members:
        if member.sharding.is_partitioned and member.sharding.axis is not None:
            for width in member.sharding.segments or (member.shape[member.sharding.axis],):
                result = math.gcd(result, width)
    return result


def partitioned_projection_group(
    name: str, role: ParameterRole,
    projections: Sequence[tuple[str, ProjectionSharding, Mapping[str, Sequence[int]]]],
    units: int, *, dtype: str = "F32", units_label: str = "",
) -> ParameterGroupSpec:
    """Several projections consuming one shared logical partition of `units` units.

    The units are reduced by gcd with every partitioned dimension so each unit spans whole
    elements of every member.
    """
    members: list[ParameterMemberSpec] = []
    for module, sharding, params in projections:
        members.extend(_params_members(module, params, dtype, _projection_rule(sharding, True)))
    reduced = _reduced_units(units, members)
    label = units_label if reduced == units else f"gcd({units_label or units}, ...) = {reduced}"
    return ParameterGroupSpec(name=name, role=role, members=tuple(members),
                              units=reduced if any(m.sharding.is_partitioned for m in members)
                              else None, units_label=label)


def segmented_projection_group(
    name: str, role: ParameterRole, *, fused_module: str, segments: Sequence[int],
    fused_params: Mapping[str, Sequence[int]], output_module: str,
    output_params: Mapping[str, Sequence[int]], units: int, dtype: str = "F32",
    units_label: str = "",
) -> ParameterGroupSpec:
    """A component-major fused column projection (`qkv_proj`, `gate_up_proj`) and its row output.

    Every fused member is PartitionedSegments on axis 0 (the same logical range taken inside each
    segment); the output weight is Partitioned on axis 1 and its bias replicated.
    """
    segments = tuple(segments)
    if not segments or any(s <= 0 for s in segments):
        raise _invalid_group(f"group `{name}`: segments must be positive, found {list(segments)}",
                             group=name)
    members = list(_params_members(
        fused_module, fused_params, dtype,
        lambda shape: MemberSharding.partitioned_segments(0, segments) if len(shape) >= 1
        else MemberSharding.replicated()))
    members.extend(_params_members(output_module, output_params, dtype,
                                   _projection_rule(ProjectionSharding.ROW, True)))
    reduced = _reduced_units(units, members)
    return ParameterGroupSpec(name=name, role=role, members=tuple(members), units=reduced,
                              units_label=units_label)


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


# ---------------------------------------------------------------- placements and layouts


class PlacementKind(enum.Enum):
    """The kinds of tensor placement."""

    REPLICATED = "replicated"
    LOCAL = "local"
    OMIT = "omit"
    RANK = "rank"
    PIPELINE_STAGE = "pipeline_stage"
    SHARD = "shard"
    RANGE = "range"
    INDICES = "indices"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorPlacement:
    """Where a tensor (or which part of it) lives on a rank."""

    kind: PlacementKind
    """Which placement."""
    axis: int | None = None
    """Split axis for Shard, Range and Indices."""
    index: int | None = None
    """Shard index (Shard)."""
    parts: int | None = None
    """Number of equal shards (Shard)."""
    start: int | None = None
    """First element on the axis (Range)."""
    end: int | None = None
    """One past the last element on the axis (Range)."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Element ranges on the axis, in order (Indices), stored compactly."""
    rank: int | None = None
    """The one rank holding the tensor (Rank)."""
    stage: int | None = None
    """The pipeline stage holding the tensor (PipelineStage)."""

    def __post_init__(self) -> None:
        kind = self.kind
        if kind is PlacementKind.SHARD:
            ok = (self.axis is not None and self.parts is not None and self.index is not None
                  and 0 <= self.index < self.parts)
        elif kind is PlacementKind.RANGE:
            ok = (self.axis is not None and self.start is not None and self.end is not None
                  and 0 <= self.start < self.end)
        elif kind is PlacementKind.INDICES:
            ok = self.axis is not None and bool(self.ranges) and all(
                0 <= a < b for a, b in self.ranges)
        elif kind is PlacementKind.RANK:
            ok = self.rank is not None and self.rank >= 0
        elif kind is PlacementKind.PIPELINE_STAGE:
            ok = self.stage is not None and self.stage >= 0
        else:
            ok = True
        if not ok:
            raise _invalid_tensor(f"malformed {kind.value} placement: {self}")

    def selection(self, global_shape: Sequence[int]) -> tuple[int | None, tuple[tuple[int, int], ...]]:
        """The global element ranges this placement selects: (axis, ranges), axis None = whole."""
        if self.kind is PlacementKind.SHARD:
            assert self.axis is not None and self.parts is not None and self.index is not None
            width = global_shape[self.axis] // self.parts
            return self.axis, ((self.index * width, (self.index + 1) * width),)
        if self.kind is PlacementKind.RANGE:
            assert self.start is not None and self.end is not None
            return self.axis, ((self.start, self.end),)
        if self.kind is PlacementKind.INDICES:
            return self.axis, self.ranges
        return None, ()

    def to_json(self) -> dict[str, object]:
        """The placement as a JSON object with only its meaningful fields."""
        out: dict[str, object] = {"kind": self.kind.value}
        for name in ("axis", "index", "parts", "start", "end", "rank", "stage"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.ranges:
            out["ranges"] = [list(r) for r in self.ranges]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> TensorPlacement:
        """Rebuild (and re-validate) a placement from `to_json` output."""
        kwargs = {k: v for k, v in data.items() if k not in ("kind", "ranges")}
        ranges = tuple((int(a), int(b)) for a, b in data.get("ranges", ()))  # type: ignore[attr-defined]
        return cls(kind=PlacementKind(data["kind"]), ranges=ranges, **kwargs)  # type: ignore[arg-type]


REPLICATED = TensorPlacement(kind=PlacementKind.REPLICATED)
"""The whole tensor on every tensor-parallel rank of its stage."""
LOCAL = TensorPlacement(kind=PlacementKind.LOCAL)
"""The whole tensor on the one rank of its stage (tensor-parallel size 1)."""
OMIT = TensorPlacement(kind=PlacementKind.OMIT)
"""Not on this rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalTensorLayout:
    """How one physical tensor appears on one rank."""

    target: str
    """Checkpoint tensor name."""
    logical_name: str
    """Name of the parameter group the tensor belongs to."""
    role: ParameterRole
    """The group's semantic role."""
    dtype: str
    """Safetensors dtype."""
    global_shape: tuple[int, ...]
    """Shape in the checkpoint."""
    local_shape: tuple[int, ...]
    """Shape on this rank."""
    placement: TensorPlacement
    """Which part of the tensor this rank holds."""
    logical_units: int | None = None
    """The group's partition units, when partitioned."""
    logical_range: tuple[int, int] | None = None
    """This rank's half-open range of the group's units, when partitioned."""
    fell_back_to_replication: bool = False
    """True when the policy replicated a group that could not be sharded."""

    def __post_init__(self) -> None:
        if len(self.local_shape) != len(self.global_shape):
            raise _invalid_tensor(f"`{self.target}`: local shape {list(self.local_shape)} and "
                                  f"global shape {list(self.global_shape)} differ in rank",
                                  target=self.target)
        axis, ranges = self.placement.selection(self.global_shape)
        expected = list(self.global_shape)
        if axis is not None:
            if any(b > self.global_shape[axis] for _, b in ranges):
                raise _invalid_tensor(f"`{self.target}`: placement {self.placement.to_json()} "
                                      f"exceeds axis {axis} of {list(self.global_shape)}",
                                      target=self.target)
            expected[axis] = sum(b - a for a, b in ranges)
        if tuple(expected) != self.local_shape:
            raise _invalid_tensor(f"`{self.target}`: local shape {list(self.local_shape)} does not "
                                  f"match placement {self.placement.to_json()} (expected "
                                  f"{expected})", target=self.target)

    @property
    def local_bytes(self) -> int:
        """Bytes this rank holds of the tensor."""
        return tensor_bytes(self.dtype, self.local_shape)

    @property
    def selection(self) -> tuple[int | None, tuple[tuple[int, int], ...]]:
        """(axis, ranges) of the global tensor this rank reads; axis None = the whole tensor."""
        return self.placement.selection(self.global_shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalModelLayout:
    """All of one rank's tensor layouts, sorted by target."""

    tensors: tuple[LocalTensorLayout, ...]
    """Layouts in target order."""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        targets = [t.target for t in self.tensors]
        if targets != sorted(targets):
            object.__setattr__(self, "tensors", tuple(sorted(self.tensors, key=lambda t: t.target)))
            targets = sorted(targets)
        for before, after in zip(targets, targets[1:], strict=False):
            if before == after:
                raise _invalid_tensor(f"layout lists `{before}` twice", target=before)
        self._index.update({t: i for i, t in enumerate(targets)})

    def __getitem__(self, target: str) -> LocalTensorLayout:
        return self.tensors[self._index[target]]

    def __contains__(self, target: object) -> bool:
        return target in self._index

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def targets(self) -> tuple[str, ...]:
        """Targets in order."""
        return tuple(t.target for t in self.tensors)

    @property
    def local_bytes(self) -> int:
        """Bytes of every local tensor."""
        return sum(t.local_bytes for t in self.tensors)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelModelInfo:
    """Topology and parameter accounting of one rank."""

    model_type: str
    """The HF model type."""
    tensor_parallel_size: int
    """T."""
    pipeline_parallel_size: int
    """S."""
    rank: int
    """Global rank g = stage * T + tensor_parallel_rank."""
    tensor_parallel_rank: int
    """Rank within the stage."""
    pipeline_stage: int
    """Stage index."""
    owned_tensors: int
    """How many checkpoint tensors this rank holds (whole or in part)."""
    local_parameter_bytes: int
    """Bytes this rank loads."""
    global_parameter_bytes: int
    """Bytes of the whole checkpoint."""
    pinned_parameter_bytes: int
    """Bytes this rank holds whole (replicated or unsplit)."""
    maximum_device_parameter_bytes: int
    """Largest `local_parameter_bytes` over all ranks of the topology."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise _invalid_group("topology sizes must be positive", group="")
        if self.rank != self.pipeline_stage * self.tensor_parallel_size + self.tensor_parallel_rank:
            raise _invalid_group(f"rank {self.rank} is not stage {self.pipeline_stage} * "
                                 f"{self.tensor_parallel_size} + {self.tensor_parallel_rank}",
                                 group="")


# ---------------------------------------------------------------- realization


def _local_shape(shape: tuple[int, ...], axis: int | None,
                 ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    if axis is None:
        return shape
    out = list(shape)
    out[axis] = sum(b - a for a, b in ranges)
    return tuple(out)


def _merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if a == b:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return tuple(merged)


def _placement_for(member: ParameterMemberSpec, tp: int, rank: int,
                   unit_range: tuple[int, int] | None, units: int | None) -> TensorPlacement:
    """The placement of `member` on tensor-parallel rank `rank` (legality already checked)."""
    rule = member.sharding
    kind = rule.kind
    if kind is MemberShardingKind.REPLICATED:
        return LOCAL if tp == 1 else REPLICATED
    assert rule.axis is not None
    dim = member.shape[rule.axis]
    if tp == 1:
        return LOCAL
    if kind is MemberShardingKind.EQUAL:
        return TensorPlacement(kind=PlacementKind.SHARD, axis=rule.axis, index=rank, parts=tp)
    if kind is MemberShardingKind.BALANCED:
        start, end = balanced_contiguous_range(dim, tp, rank)
        return TensorPlacement(kind=PlacementKind.RANGE, axis=rule.axis, start=start, end=end)
    if kind is MemberShardingKind.PARTITIONED:
        assert unit_range is not None and units is not None
        width = dim // units
        return TensorPlacement(kind=PlacementKind.RANGE, axis=rule.axis,
                               start=unit_range[0] * width, end=unit_range[1] * width)
    ranges: list[tuple[int, int]] = []
    offset = 0
    for segment in rule.segments:
        if kind is MemberShardingKind.PARTITIONED_SEGMENTS:
            assert unit_range is not None and units is not None
            width = segment // units
            ranges.append((offset + unit_range[0] * width, offset + unit_range[1] * width))
        else:
            width = segment // tp
            ranges.append((offset + rank * width, offset + (rank + 1) * width))
        offset += segment
    return TensorPlacement(kind=PlacementKind.INDICES, axis=rule.axis, ranges=_merge_ranges(ranges))


def group_sharding_problems(group: ParameterGroupSpec, tp: int) -> list[str]:
    """Why `group` cannot be sharded over `tp` ranks (empty when it can)."""
    problems: list[str] = []
    if tp == 1:
        return problems
    units = group.units
    label = f" ({group.units_label})" if group.units_label else ""
    if units is not None and units < tp:
        problems.append(
            f"group `{group.name}` (role {group.role.value}) has {units} partition units{label} "
            f"but tensor_parallel_size is {tp}: every rank needs at least one unit")
    for member in group.members:
        rule = member.sharding
        if rule.axis is None:
            continue
        dim = member.shape[rule.axis]
        if rule.kind is MemberShardingKind.EQUAL and dim % tp:
            problems.append(f"`{member.target}`: axis {rule.axis} has {dim} elements, not "
                            f"divisible by tensor_parallel_size {tp} (equal shards)")
        elif rule.kind is MemberShardingKind.BALANCED and dim < tp:
            problems.append(f"`{member.target}`: axis {rule.axis} has {dim} elements, fewer than "
                            f"tensor_parallel_size {tp} (balanced ranges)")
        elif rule.kind is MemberShardingKind.SEGMENTED:
            for segment in rule.segments:
                if segment % tp:
                    problems.append(f"`{member.target}`: segment of {segment} elements is not "
                                    f"divisible by tensor_parallel_size {tp}")
    return problems


def realize_group(group: ParameterGroupSpec, tensor_parallel_size: int,
                  policy: ShardingPolicy = ShardingPolicy.REQUIRE
                  ) -> tuple[tuple[LocalTensorLayout, ...], ...]:
    """Each tensor-parallel rank's layouts of `group`'s members (outer index: rank).

    An illegal shard raises ParallelPlanError under Require; under ReplicateUnsupported the
    whole group is replicated and every layout records `fell_back_to_replication`.
    """
    tp = tensor_parallel_size
    effective = group.policy or policy
    problems = group_sharding_problems(group, tp)
    fallback = False
    if problems:
        if effective is ShardingPolicy.REQUIRE:
            raise ParallelPlanError(
                ParallelPlanErrorKind.INVALID_GROUP,
                "; ".join(problems) + ". Use a tensor-parallel size the group allows, or set "
                f"`policy: replicate_unsupported` on group `{group.name}` (CLI: --policy "
                "replicate-unsupported) to replicate it",
                group=group.name)
        fallback = True
    result = []
    for rank in range(tp):
        unit_range = None
        if group.units is not None and not fallback:
            unit_range = balanced_contiguous_range(group.units, tp, rank)
        layouts = []
        for member in group.members:
            if fallback:
                placement = REPLICATED
            else:
                placement = _placement_for(member, tp, rank, unit_range, group.units)
            axis, ranges = placement.selection(member.shape)
            layouts.append(LocalTensorLayout(
                target=member.target, logical_name=group.name, role=group.role,
                dtype=member.dtype, global_shape=member.shape,
                local_shape=_local_shape(member.shape, axis, ranges), placement=placement,
                logical_units=None if fallback else group.units,
                logical_range=unit_range, fell_back_to_replication=fallback))
        result.append(tuple(layouts))
    return tuple(result)


def with_policy(group: ParameterGroupSpec, policy: ShardingPolicy | None) -> ParameterGroupSpec:
    """A copy of `group` with its per-group policy set."""
    return replace(group, policy=policy)
