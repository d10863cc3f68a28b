"""Rank-local tensor layouts: stored dtypes, parameter roles, placements, `LocalTensorLayout`,
`LocalModelLayout` and `ParallelModelInfo` (the `parallel` vocabulary's output half; realizing a
group into them lives in `partc.parallel`, which re-exports every name here).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TypeVar

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
    """Bytes a tensor of `dtype` and `shape` occupies in a checkpoint (packed dtypes included)."""
    return math.prod(shape) * DTYPE_BITS[dtype] // 8


# ---------------------------------------------------------------- errors


def _invalid_tensor(message: str, *, group: str = "", target: str = "") -> ParallelPlanError:
    return ParallelPlanError(ParallelPlanErrorKind.INVALID_TENSOR, message, group=group,
                             target=target, tensor=target or None)


def _invalid_group(message: str, *, group: str, target: str = "") -> ParallelPlanError:
    return ParallelPlanError(ParallelPlanErrorKind.INVALID_GROUP, message, group=group,
                             target=target, tensor=target or None)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_T = TypeVar("_T")


def unchecked_replace(instance: _T, **changes: object) -> _T:
    """`dataclasses.replace` without `__post_init__`, for an instance already validated whose
    changed fields (names) take no part in validation: large models copy ~10^5 of them."""
    kind = type(instance)
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(f.name for f in fields(kind))  # type: ignore[arg-type]
    copy: _T = object.__new__(kind)
    for name in names:
        object.__setattr__(copy, name, changes[name] if name in changes
                           else getattr(instance, name))
    return copy


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
"""Field names of each dataclass `unchecked_replace` has copied."""


# ---------------------------------------------------------------- roles


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


Selection = tuple[int | None, tuple[tuple[int, int], ...]]
"""(axis, ranges) of a global tensor: the ranges along `axis`, concatenated; axis None = whole."""


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
    """Element ranges on the axis, ascending, disjoint and non-adjacent (Indices)."""
    rank: int | None = None
    """The one rank holding the tensor (Rank)."""
    stage: int | None = None
    """The pipeline stage holding the tensor (PipelineStage)."""

    def __post_init__(self) -> None:
        kind = self.kind
        used = {"axis", "index", "parts", "start", "end", "rank", "stage"}
        needed = {PlacementKind.SHARD: {"axis", "index", "parts"},
                  PlacementKind.RANGE: {"axis", "start", "end"}, PlacementKind.INDICES: {"axis"},
                  PlacementKind.RANK: {"rank"}, PlacementKind.PIPELINE_STAGE: {"stage"}
                  }.get(kind, set())
        ok = all(_is_count(getattr(self, n)) and getattr(self, n) >= 0 for n in needed)
        ok = ok and all(getattr(self, n) is None for n in used - needed)
        if kind is PlacementKind.SHARD and ok:
            ok = self.index is not None and self.parts is not None and self.index < self.parts
        elif kind is PlacementKind.RANGE and ok:
            ok = self.start is not None and self.end is not None and self.start < self.end
        elif kind is PlacementKind.INDICES:
            bounds = [b for r in self.ranges for b in r]
            ok = ok and bool(self.ranges) and all(_is_count(b) for b in bounds) and all(
                0 <= a < b for a, b in self.ranges) and all(
                before[1] < after[0] for before, after in zip(self.ranges, self.ranges[1:],
                                                               strict=False))
        if kind is not PlacementKind.INDICES and self.ranges:
            ok = False
        if not ok:
            raise _invalid_tensor(f"malformed {kind.value} placement: {self.to_json()}")

    def selection(self, global_shape: Sequence[int]) -> Selection:
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

    def to_compact(self) -> tuple[object, ...]:
        """A short tuple form for generated tables: the kind, then its fields in order."""
        kind = self.kind
        if kind is PlacementKind.SHARD:
            return (kind.value, self.axis, self.index, self.parts)
        if kind is PlacementKind.RANGE:
            return (kind.value, self.axis, self.start, self.end)
        if kind is PlacementKind.INDICES:
            return (kind.value, self.axis, self.ranges)
        if kind is PlacementKind.RANK:
            return (kind.value, self.rank)
        if kind is PlacementKind.PIPELINE_STAGE:
            return (kind.value, self.stage)
        return (kind.value,)

    @classmethod
    def from_compact(cls, data: Sequence[object]) -> TensorPlacement:
        """Rebuild (and re-validate) a placement from `to_compact` output."""
        kind = PlacementKind(data[0])
        names = {PlacementKind.SHARD: ("axis", "index", "parts"),
                 PlacementKind.RANGE: ("axis", "start", "end"),
                 PlacementKind.INDICES: ("axis", "ranges"), PlacementKind.RANK: ("rank",),
                 PlacementKind.PIPELINE_STAGE: ("stage",)}.get(kind, ())
        if len(data) != len(names) + 1:
            raise _invalid_tensor(f"malformed {kind.value} placement {list(data)}")
        values = dict(zip(names, data[1:], strict=True))
        if "ranges" in values:
            values["ranges"] = tuple((int(a), int(b)) for a, b in values["ranges"])  # type: ignore[attr-defined]
        return cls(kind=kind, **values)  # type: ignore[arg-type]

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
    """The group's partition units, when partitioned (T query slots under KV replication)."""
    logical_range: tuple[int, int] | None = None
    """This rank's half-open range of the group's units, when partitioned."""
    fell_back_to_replication: bool = False
    """True when the policy replicated a group that could not be sharded."""
    kv_replicas: int = 1
    """How many ranks hold this same slice because KV heads are repeated (1: not repeated)."""

    def __post_init__(self) -> None:
        target = self.target
        if self.dtype not in DTYPE_BITS:
            raise _invalid_tensor(f"`{target}` has unknown dtype {self.dtype!r}", target=target)
        if len(self.local_shape) != len(self.global_shape):
            raise _invalid_tensor(f"`{target}`: local shape {list(self.local_shape)} and "
                                  f"global shape {list(self.global_shape)} differ in rank",
                                  target=target)
        placement = self.placement
        axis, ranges = placement.selection(self.global_shape)
        expected = list(self.global_shape)
        if axis is not None:
            dim = self.global_shape[axis] if axis < len(self.global_shape) else -1
            if dim < 0 or any(b > dim for _, b in ranges) or (
                    placement.kind is PlacementKind.SHARD and dim % (placement.parts or 1)):
                raise _invalid_tensor(f"`{target}`: placement {placement.to_json()} does not fit "
                                      f"global shape {list(self.global_shape)}", target=target)
            expected[axis] = sum(b - a for a, b in ranges)
        if tuple(expected) != self.local_shape:
            raise _invalid_tensor(f"`{target}`: local shape {list(self.local_shape)} does not "
                                  f"match placement {placement.to_json()} (expected "
                                  f"{expected})", target=target)
        if (self.logical_units is None) != (self.logical_range is None) or (
                self.logical_units is not None and self.logical_range is not None and not
                0 <= self.logical_range[0] < self.logical_range[1] <= self.logical_units):
            raise _invalid_tensor(f"`{target}`: logical range {self.logical_range} does not fit "
                                  f"{self.logical_units} logical units", target=target)
        if not _is_count(self.kv_replicas) or self.kv_replicas < 1:
            raise _invalid_tensor(f"`{target}`: kv_replicas must be >= 1, found "
                                  f"{self.kv_replicas}", target=target)

    @property
    def local_bytes(self) -> int:
        """Bytes this rank holds of the tensor."""
        return tensor_bytes(self.dtype, self.local_shape)

    def renamed(self, target: str, logical_name: str) -> LocalTensorLayout:
        """This validated layout under other names (names take no part in validation, so the
        copy is not re-validated)."""
        if self.target == target and self.logical_name == logical_name:
            return self
        return unchecked_replace(self, target=target, logical_name=logical_name)

    @property
    def is_whole(self) -> bool:
        """Whether this rank holds the whole tensor (replicated or unsplit)."""
        return self.placement.kind in (PlacementKind.REPLICATED, PlacementKind.LOCAL,
                                       PlacementKind.RANK, PlacementKind.PIPELINE_STAGE)

    @property
    def selection(self) -> Selection:
        """(axis, ranges) of the global tensor this rank reads; axis None = the whole tensor."""
        return self.placement.selection(self.global_shape)


def _sum_by_dtype(items: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    totals: dict[str, int] = {}
    for dtype, nbytes in items:
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return tuple(sorted(totals.items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalModelLayout:
    """All of one rank's tensor layouts, sorted by target."""

    tensors: tuple[LocalTensorLayout, ...]
    """Layouts in target order (sorted on construction)."""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _totals: list[int] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.tensors, key=lambda t: t.target))
        object.__setattr__(self, "tensors", ordered)
        for before, after in zip(ordered, ordered[1:], strict=False):
            if before.target == after.target:
                raise _invalid_tensor(f"layout lists `{before.target}` twice (groups "
                                      f"`{before.logical_name}` and `{after.logical_name}`)",
                                      target=before.target)
        self._index.update({t.target: i for i, t in enumerate(ordered)})
        sizes = [t.local_bytes for t in ordered]
        self._totals[:] = [sum(sizes), sum(n for t, n in zip(ordered, sizes, strict=True)
                                           if t.is_whole)]

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
        return self._totals[0]

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the tensors this rank holds whole."""
        return self._totals[1]

    @property
    def bytes_by_dtype(self) -> tuple[tuple[str, int], ...]:
        """Local bytes per stored dtype, sorted by dtype."""
        return _sum_by_dtype((t.dtype, t.local_bytes) for t in self.tensors)


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
    local_bytes_by_dtype: tuple[tuple[str, int], ...] = ()
    """`local_parameter_bytes` split by stored dtype, sorted (empty when not computed)."""

    def __post_init__(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise _invalid_group(f"topology sizes must be positive, found tensor_parallel_size "
                                 f"{tp} and pipeline_parallel_size {pp}", group="")
        if not (0 <= self.tensor_parallel_rank < tp and 0 <= self.pipeline_stage < pp):
            raise _invalid_group(f"tensor_parallel_rank {self.tensor_parallel_rank} / stage "
                                 f"{self.pipeline_stage} outside a {tp} x {pp} topology", group="")
        if self.rank != self.pipeline_stage * tp + self.tensor_parallel_rank:
            raise _invalid_group(f"rank {self.rank} is not stage {self.pipeline_stage} * "
                                 f"{tp} + {self.tensor_parallel_rank}", group="")
        if not (0 <= self.pinned_parameter_bytes <= self.local_parameter_bytes
                <= self.maximum_device_parameter_bytes) or self.owned_tensors < 0:
            raise _invalid_group(
                f"rank {self.rank}: byte accounting must satisfy 0 <= pinned "
                f"({self.pinned_parameter_bytes}) <= local ({self.local_parameter_bytes}) <= "
                f"maximum ({self.maximum_device_parameter_bytes})", group="")
        if self.local_bytes_by_dtype and (
                sum(n for _, n in self.local_bytes_by_dtype) != self.local_parameter_bytes):
            raise _invalid_group(f"rank {self.rank}: bytes by dtype {self.local_bytes_by_dtype} "
                                 f"do not add up to {self.local_parameter_bytes}", group="")

    @classmethod
    def from_layouts(cls, *, model_type: str, tensor_parallel_size: int,
                     pipeline_parallel_size: int, rank: int,
                     layouts: Sequence[LocalModelLayout],
                     global_parameter_bytes: int,
                     maximum_device_parameter_bytes: int | None = None) -> ParallelModelInfo:
        """The accounting of `rank`, given every rank's layout (index = global rank)."""
        layout = layouts[rank]
        maximum = (max(x.local_bytes for x in layouts) if maximum_device_parameter_bytes is None
                   else maximum_device_parameter_bytes)
        return cls(model_type=model_type, tensor_parallel_size=tensor_parallel_size,
                   pipeline_parallel_size=pipeline_parallel_size, rank=rank,
                   tensor_parallel_rank=rank % tensor_parallel_size,
                   pipeline_stage=rank // tensor_parallel_size, owned_tensors=len(layout),
                   local_parameter_bytes=layout.local_bytes,
                   global_parameter_bytes=global_parameter_bytes,
                   pinned_parameter_bytes=layout.pinned_bytes,
                   maximum_device_parameter_bytes=maximum,
                   local_bytes_by_dtype=layout.bytes_by_dtype)
