"""Tensor placements: stored dtypes and their sizes, the placement kinds and classes (where a
tensor, or which part of it, lives on a rank), their JSON and compact forms, and the selection
(axis, ranges) each one reads. `partc.parallel.layout` builds the per-rank layouts on them; a
generated module's load needs only this module.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

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


def is_count(value: object) -> bool:
    """Whether `value` is an int and not a bool (a count or an index)."""
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


# ---------------------------------------------------------------- placements


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

_WHOLE: Selection = (None, ())


def local_shape(global_shape: Sequence[int], selection: Selection) -> tuple[int, ...]:
    """The shape of the part of a tensor of `global_shape` that `selection` selects."""
    axis, ranges = selection
    local = list(global_shape)
    if axis is not None:
        local[axis] = sum(b - a for a, b in ranges)
    return tuple(local)


def _malformed(kind: PlacementKind, spelled: object) -> ParallelPlanError:
    return _invalid_tensor(f"malformed {kind.value} placement: {spelled}")


def _check_counts(kind: PlacementKind, spelled: dict[str, object], *names: str) -> None:
    """Raise unless every named field of a placement is a count (an int >= 0)."""
    if not all(is_count(spelled[n]) and spelled[n] >= 0 for n in names):  # type: ignore[operator]
        raise _malformed(kind, spelled)


def _axis_fits(axis: int, global_shape: Sequence[int], end: int) -> bool:
    return axis < len(global_shape) and end <= global_shape[axis]


class _Whole:
    """What the placements that split no axis share: they select the whole tensor and fit any
    shape. (A field-less mixin for the dataclasses below, not a registry or an interface.)"""

    __slots__ = ()

    def selection(self, global_shape: Sequence[int]) -> Selection:
        """No split axis: (None, ())."""
        return _WHOLE

    def fits(self, global_shape: Sequence[int]) -> bool:
        """Whether the placement can apply to a tensor of `global_shape` (always)."""
        return True


class _KindOnly(_Whole):
    """The JSON and compact forms of a placement without fields: its kind alone."""

    __slots__ = ()
    kind: ClassVar[PlacementKind]

    def to_json(self) -> dict[str, object]:
        """JSON form: the kind only."""
        return {"kind": self.kind.value}

    def to_compact(self) -> tuple[object, ...]:
        """Compact form for generated tables: the kind only."""
        return (self.kind.value,)


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicated(_KindOnly):
    """The whole tensor on every tensor-parallel rank of its stage."""

    kind: ClassVar[PlacementKind] = PlacementKind.REPLICATED
    holds_whole: ClassVar[bool] = True
    """Whether a rank with this placement holds the whole tensor."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Local(_KindOnly):
    """The whole tensor on the one rank of its stage (tensor-parallel size 1)."""

    kind: ClassVar[PlacementKind] = PlacementKind.LOCAL
    holds_whole: ClassVar[bool] = True
    """Whether a rank with this placement holds the whole tensor."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Omit(_KindOnly):
    """Not on this rank (a per-head tensor of a head the rank does not hold)."""

    kind: ClassVar[PlacementKind] = PlacementKind.OMIT
    holds_whole: ClassVar[bool] = False
    """Whether a rank with this placement holds the whole tensor."""

    def selection(self, global_shape: Sequence[int]) -> Selection:
        """Nothing: no range of axis 0 (a local shape of 0 rows, 0 bytes)."""
        return 0, ()

    def fits(self, global_shape: Sequence[int]) -> bool:
        """Whether the tensor has an axis 0 to select nothing of."""
        return len(global_shape) >= 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Rank(_Whole):
    """The whole tensor on one rank only."""

    kind: ClassVar[PlacementKind] = PlacementKind.RANK
    holds_whole: ClassVar[bool] = True
    """Whether a rank with this placement holds the whole tensor."""
    rank: int
    """The one global rank holding the tensor."""

    def __post_init__(self) -> None:
        _check_counts(self.kind, self.to_json(), "rank")

    def to_json(self) -> dict[str, object]:
        """JSON form: kind and rank."""
        return {"kind": self.kind.value, "rank": self.rank}

    def to_compact(self) -> tuple[object, ...]:
        """Compact form for generated tables: (kind, rank)."""
        return (self.kind.value, self.rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineStage(_Whole):
    """The whole tensor on the ranks of one pipeline stage."""

    kind: ClassVar[PlacementKind] = PlacementKind.PIPELINE_STAGE
    holds_whole: ClassVar[bool] = True
    """Whether a rank with this placement holds the whole tensor."""
    stage: int
    """The pipeline stage holding the tensor."""

    def __post_init__(self) -> None:
        _check_counts(self.kind, self.to_json(), "stage")

    def to_json(self) -> dict[str, object]:
        """JSON form: kind and stage."""
        return {"kind": self.kind.value, "stage": self.stage}

    def to_compact(self) -> tuple[object, ...]:
        """Compact form for generated tables: (kind, stage)."""
        return (self.kind.value, self.stage)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """Shard `index` of `parts` equal shards along `axis`."""

    kind: ClassVar[PlacementKind] = PlacementKind.SHARD
    holds_whole: ClassVar[bool] = False
    """Whether a rank with this placement holds the whole tensor."""
    axis: int
    """The split axis."""
    index: int
    """Which shard, 0 <= index < parts."""
    parts: int
    """Number of equal shards."""

    def __post_init__(self) -> None:
        spelled = self.to_json()
        _check_counts(self.kind, spelled, "axis", "index", "parts")
        if self.index >= self.parts:
            raise _malformed(self.kind, spelled)

    def selection(self, global_shape: Sequence[int]) -> Selection:
        """(axis, the shard's one range)."""
        width = global_shape[self.axis] // self.parts
        return self.axis, ((self.index * width, (self.index + 1) * width),)

    def fits(self, global_shape: Sequence[int]) -> bool:
        """Whether `axis` exists and `parts` divides it."""
        return self.axis < len(global_shape) and global_shape[self.axis] % self.parts == 0

    def to_json(self) -> dict[str, object]:
        """JSON form: kind, axis, index and parts."""
        return {"kind": self.kind.value, "axis": self.axis, "index": self.index,
                "parts": self.parts}

    def to_compact(self) -> tuple[object, ...]:
        """Compact form for generated tables: (kind, axis, index, parts)."""
        return (self.kind.value, self.axis, self.index, self.parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Range:
    """Elements [start, end) along `axis`."""

    kind: ClassVar[PlacementKind] = PlacementKind.RANGE
    holds_whole: ClassVar[bool] = False
    """Whether a rank with this placement holds the whole tensor."""
    axis: int
    """The split axis."""
    start: int
    """First element on the axis."""
    end: int
    """One past the last element on the axis (> start)."""

    def __post_init__(self) -> None:
        spelled = self.to_json()
        _check_counts(self.kind, spelled, "axis", "start", "end")
        if self.start >= self.end:
            raise _malformed(self.kind, spelled)

    def selection(self, global_shape: Sequence[int]) -> Selection:
        """(axis, the one range)."""
        return self.axis, ((self.start, self.end),)

    def fits(self, global_shape: Sequence[int]) -> bool:
        """Whether `axis` exists and holds `end` elements."""
        return _axis_fits(self.axis, global_shape, self.end)

    def to_json(self) -> dict[str, object]:
        """JSON form: kind, axis, start and end."""
        return {"kind": self.kind.value, "axis": self.axis, "start": self.start,
                "end": self.end}

    def to_compact(self) -> tuple[object, ...]:
        """Compact form for generated tables: (kind, axis, start, end)."""
        return (self.kind.value, self.axis, self.start, self.end)


@dataclass(frozen=True, slots=True, kw_only=True)
class Indices:
    """Several element ranges along `axis`, concatenated."""

    kind: ClassVar[PlacementKind] = PlacementKind.INDICES
    holds_whole: ClassVar[bool] = False
    """Whether a rank with this placement holds the whole tensor."""
    axis: int
    """The split axis."""
    ranges: tuple[tuple[int, int], ...]
    """Element ranges on the axis: non-empty, ascending, disjoint and non-adjacent."""

    def __post_init__(self) -> None:
        spelled = self.to_json()
        _check_counts(self.kind, spelled, "axis")
        ranges = self.ranges
        if not (ranges and all(is_count(b) for r in ranges for b in r)
                and all(0 <= a < b for a, b in ranges)
                and all(before[1] < after[0]
                        for before, after in zip(ranges, ranges[1:], strict=False))):
            raise _malformed(self.kind, spelled)

    def selection(self, global_shape: Sequence[int]) -> Selection:
        """(axis, the ranges)."""
        return self.axis, self.ranges

    def fits(self, global_shape: Sequence[int]) -> bool:
        """Whether `axis` exists and holds the last range."""
        return _axis_fits(self.axis, global_shape, self.ranges[-1][1])

    def to_json(self) -> dict[str, object]:
        """JSON form: kind, axis and ranges (a list of [start, end] pairs)."""
        return {"kind": self.kind.value, "axis": self.axis,
                "ranges": [list(r) for r in self.ranges]}

    def to_compact(self) -> tuple[object, ...]:
        """Compact form for generated tables: (kind, axis, ranges)."""
        return (self.kind.value, self.axis, self.ranges)


TensorPlacement = Replicated | Local | Omit | Rank | PipelineStage | Shard | Range | Indices
"""Where a tensor (or which part of it) lives on a rank: one class per kind."""

PLACEMENT_KINDS: dict[PlacementKind, type[TensorPlacement]] = {
    cls.kind: cls for cls in (Replicated, Local, Omit, Rank, PipelineStage, Shard, Range, Indices)}
"""Each placement kind and its class (the JSON and compact forms' tag)."""


def _placement_class(tag: object, spelled: object) -> type[TensorPlacement]:
    cls = next((c for k, c in PLACEMENT_KINDS.items() if k.value == tag), None)
    if cls is None:
        raise _invalid_tensor(f"unknown placement kind {tag!r} in {spelled}; known: "
                              + ", ".join(k.value for k in PLACEMENT_KINDS))
    return cls


def _field_names(cls: type[TensorPlacement]) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _build(cls: type[TensorPlacement], values: dict[str, object]) -> TensorPlacement:
    if "ranges" in values:
        try:
            values["ranges"] = tuple((a, b) for a, b in values["ranges"])  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            raise _malformed(cls.kind, values) from None
    return cls(**values)  # type: ignore[arg-type]


def placement_from_compact(data: Sequence[object]) -> TensorPlacement:
    """Rebuild (and re-validate) a placement from its `to_compact` form."""
    cls = _placement_class(data[0] if data else None, list(data))
    names = _field_names(cls)
    if len(data) != len(names) + 1:
        raise _invalid_tensor(f"malformed {cls.kind.value} placement {list(data)}")
    return _build(cls, dict(zip(names, data[1:], strict=True)))


def placement_from_json(data: Mapping[str, object]) -> TensorPlacement:
    """Rebuild (and re-validate) a placement from its `to_json` form."""
    cls = _placement_class(data.get("kind"), dict(data))
    names = _field_names(cls)
    if set(data) != {"kind", *names}:
        raise _invalid_tensor(f"malformed {cls.kind.value} placement {dict(data)}: expected "
                              f"the fields {sorted(names)}")
    return _build(cls, {n: data[n] for n in names})


REPLICATED = Replicated()
"""The whole tensor on every tensor-parallel rank of its stage."""
LOCAL = Local()
"""The whole tensor on the one rank of its stage (tensor-parallel size 1)."""
OMIT = Omit()
"""Not on this rank."""
