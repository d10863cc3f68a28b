"""The boundary half of the `partition` vocabulary: what crosses a pipeline cut.

A family declares a `BoundaryWireSchema`: a primary activation plus ordered auxiliary tensors
(a residual stream, per-layer inputs, ...), each with a role, a symbolic shape and a dtype. The
compile-time `PipelineWireContract` pairs it with the activation dtype, and `resolve` gives the
concrete shapes of one invocation. Encoding and decoding payloads under a contract is the
runtime's (`partc.runtime.boundary_codec`), since only a serving process does it.

The vocabulary is importable without numpy: arrays are only touched when a schema is resolved.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from partc.errors import ArchitectureBoundaryError, ArchitectureBoundaryErrorKind

if TYPE_CHECKING:
    import numpy as np


def _schema_error(message: str, *, boundary: str = "",
                  role: str | None = None) -> ArchitectureBoundaryError:
    return ArchitectureBoundaryError(ArchitectureBoundaryErrorKind.INVALID_SCHEMA, message,
                                     boundary=boundary, role=role)


# ---------------------------------------------------------------- dtypes


class PipelineActivationDtype(enum.Enum):
    """The dtype activations cross a pipeline cut in (chosen at compile time)."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class BoundaryTensorDtype(enum.Enum):
    """The element type of a boundary tensor."""

    ACTIVATION = "activation"
    UINT32 = "uint32"
    INT32 = "int32"
    INT64 = "int64"
    BOOL = "bool"

    def element_dtype(self, activation_dtype: PipelineActivationDtype) -> str:
        """The concrete numpy dtype name: the activation dtype, or the declared integer or bool."""
        return str(activation_dtype.value if self is BoundaryTensorDtype.ACTIVATION else self.value)


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype called `name` (`bfloat16` through ml_dtypes)."""
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bfloat16
    return np.dtype(name)


# ---------------------------------------------------------------- symbolic schema


class BoundaryTensorDimensionKind(enum.Enum):
    """The kinds of boundary tensor dimension."""

    BATCH = "batch"
    SEQUENCE = "sequence"
    FIXED = "fixed"
    REQUEST = "request"
    """A per-request extent the family declares (`image_tokens`, `patches`): read from the
    payload's tensors, like batch and sequence."""


_BUILTIN_DIMENSIONS = frozenset({"batch", "sequence"})
"""Dimension spellings that are not per-request names."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchDimension:
    """The invocation batch size."""

    kind: ClassVar[BoundaryTensorDimensionKind] = BoundaryTensorDimensionKind.BATCH

    def spell(self) -> str:
        """`batch`."""
        return self.kind.value


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceDimension:
    """The invocation sequence length."""

    kind: ClassVar[BoundaryTensorDimensionKind] = BoundaryTensorDimensionKind.SEQUENCE

    def spell(self) -> str:
        """`sequence`."""
        return self.kind.value


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedDimension:
    """A positive architecture-defined extent."""

    kind: ClassVar[BoundaryTensorDimensionKind] = BoundaryTensorDimensionKind.FIXED
    size: int
    """The size (> 0)."""

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size <= 0:
            raise _schema_error(f"a fixed boundary dimension must be positive, found {self.size}")

    def spell(self) -> int:
        """The size."""
        return self.size


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestDimension:
    """A per-request extent called `name`, read from the payload's tensors."""

    kind: ClassVar[BoundaryTensorDimensionKind] = BoundaryTensorDimensionKind.REQUEST
    name: str
    """The per-request dimension's name (not batch or sequence)."""

    def __post_init__(self) -> None:
        if not self.name or self.name in _BUILTIN_DIMENSIONS:
            raise _schema_error(f"a per-request boundary dimension needs a name other than batch "
                                f"and sequence, found {self.name!r}")

    def spell(self) -> str:
        """The name."""
        return self.name


BoundaryTensorDimension = BatchDimension | SequenceDimension | FixedDimension | RequestDimension
"""One dimension of a boundary tensor: batch, sequence, a fixed size or a per-request name."""

UNSIZED_DIMENSIONS: Mapping[BoundaryTensorDimensionKind,
                            type[BatchDimension] | type[SequenceDimension]] = {
    BatchDimension.kind: BatchDimension, SequenceDimension.kind: SequenceDimension}
"""The dimension classes a bare kind names (`batch`, `sequence` in JSON and declarations)."""


def boundary_dimension(data: str | int) -> BoundaryTensorDimension:
    """The dimension spelled `batch`, `sequence`, as a size or as a per-request name."""
    if isinstance(data, int):
        return FixedDimension(size=data)
    if data in _BUILTIN_DIMENSIONS:
        return UNSIZED_DIMENSIONS[BoundaryTensorDimensionKind(data)]()
    return RequestDimension(name=data)


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryTensorSpec:
    """One tensor crossing a pipeline cut: its role, symbolic shape and dtype."""

    role: str
    """Unique role, e.g. `hidden`."""
    shape: tuple[BoundaryTensorDimension, ...]
    """Symbolic shape."""
    dtype: BoundaryTensorDtype
    """Element type."""

    def __post_init__(self) -> None:
        if not self.role or not self.role.strip():
            raise _schema_error("a boundary tensor needs a non-empty role")
        if not self.shape:
            raise _schema_error(f"boundary tensor `{self.role}` needs a non-empty shape",
                                role=self.role)

    @classmethod
    def primary_activation(cls, hidden_size: int, role: str = "hidden") -> BoundaryTensorSpec:
        """The standard [batch, sequence, hidden_size] activation."""
        return cls(role=role, shape=(BatchDimension(), SequenceDimension(),
                                     FixedDimension(size=hidden_size)),
                   dtype=BoundaryTensorDtype.ACTIVATION)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BoundaryTensorSpec:
        """The spec from its JSON form."""
        return cls(role=data["role"],
                   shape=tuple(boundary_dimension(d) for d in data["shape"]),
                   dtype=BoundaryTensorDtype(data["dtype"]))

    @property
    def has_sequence(self) -> bool:
        """Whether a dimension is the sequence."""
        return any(isinstance(d, SequenceDimension) for d in self.shape)

    @property
    def request_dimensions(self) -> tuple[str, ...]:
        """Names of its per-request dimensions, in axis order."""
        return tuple(d.name for d in self.shape if isinstance(d, RequestDimension))

    def resolve(self, batch: int, sequence: int, activation_dtype: PipelineActivationDtype,
                dimensions: Mapping[str, int] | None = None) -> ResolvedBoundaryTensorSpec:
        """The concrete spec for one invocation's batch, sequence and per-request sizes."""
        named = dimensions or {}
        shape = tuple(_size(d, batch, sequence, named) for d in self.shape)
        name = self.dtype.element_dtype(activation_dtype)
        return ResolvedBoundaryTensorSpec(role=self.role, shape=shape, dtype=self.dtype,
                                          numpy_dtype=numpy_dtype(name))

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        return {"role": self.role, "shape": [d.spell() for d in self.shape],
                "dtype": self.dtype.value}


def _size(dim: BoundaryTensorDimension, batch: int, sequence: int,
          named: Mapping[str, int]) -> int:
    """The concrete extent of `dim` for one invocation."""
    match dim:
        case BatchDimension():
            return batch
        case SequenceDimension():
            return sequence
        case FixedDimension():
            return dim.size
        case RequestDimension():
            return named[dim.name]


def _check_roles(identity: str, roles: Sequence[str]) -> None:
    seen: set[str] = set()
    for role in roles:
        if role in seen:
            raise _schema_error(f"boundary `{identity}` uses role `{role}` twice; roles must be "
                                "unique", boundary=identity, role=role)
        seen.add(role)


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryWireSchema:
    """What crosses a pipeline cut: a primary activation and ordered auxiliary tensors."""

    identity: str
    """Schema identity, e.g. `llama.hidden`."""
    primary: BoundaryTensorSpec
    """The primary activation (dtype Activation)."""
    auxiliary: tuple[BoundaryTensorSpec, ...] = ()
    """Further tensors, in wire order."""

    def __post_init__(self) -> None:
        if not self.identity or not self.identity.strip():
            raise _schema_error("a boundary schema needs a non-empty identity")
        if self.primary.dtype is not BoundaryTensorDtype.ACTIVATION:
            raise _schema_error(f"the primary boundary tensor `{self.primary.role}` of "
                                f"`{self.identity}` must have dtype activation, found "
                                f"{self.primary.dtype.value}", boundary=self.identity,
                                role=self.primary.role)
        _check_roles(self.identity, self.roles)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BoundaryWireSchema:
        """The schema from its JSON form."""
        return cls(identity=data["identity"], primary=BoundaryTensorSpec.from_json(data["primary"]),
                   auxiliary=tuple(BoundaryTensorSpec.from_json(a) for a in data["auxiliary"]))

    @property
    def tensors(self) -> tuple[BoundaryTensorSpec, ...]:
        """Primary then auxiliary specs, in wire order."""
        return (self.primary, *self.auxiliary)

    @property
    def roles(self) -> tuple[str, ...]:
        """Roles in wire order."""
        return tuple(t.role for t in self.tensors)

    @property
    def request_dimensions(self) -> tuple[str, ...]:
        """Names of every per-request dimension its tensors use, in first-use order."""
        names: list[str] = []
        for tensor in self.tensors:
            names.extend(n for n in tensor.request_dimensions if n not in names)
        return tuple(names)

    def resolve(self, batch: int, sequence: int, *,
                activation_dtype: PipelineActivationDtype,
                dimensions: Mapping[str, int] | None = None) -> ResolvedBoundaryWireSchema:
        """Concrete shapes and dtypes for one invocation's batch, sequence length and
        per-request dimension sizes (`dimensions`, by name; every one the schema uses)."""
        return self.resolve_each(batch, [sequence] * len(self.tensors),
                                 activation_dtype=activation_dtype, dimensions=dimensions)

    def _check_dimensions(self, dimensions: Mapping[str, int] | None) -> None:
        """Every per-request dimension the schema uses is given, positive, and no other."""
        given = dict(dimensions or {})
        needed = self.request_dimensions
        unknown = sorted(set(given) - set(needed))
        missing = [n for n in needed if n not in given]
        bad = [(n, v) for n, v in given.items() if n in needed and (
            not isinstance(v, int) or isinstance(v, bool) or v < 1)]
        if unknown or missing or bad:
            detail = "; ".join(
                ([f"unknown dimension(s) {', '.join(f'`{n}`' for n in unknown)}"] if unknown
                 else []) + ([f"no size for {', '.join(f'`{n}`' for n in missing)}"] if missing
                             else [])
                + [f"`{n}` must be a positive integer, found {v!r}" for n, v in bad])
            raise ArchitectureBoundaryError(
                ArchitectureBoundaryErrorKind.INVALID_GEOMETRY,
                f"boundary `{self.identity}` per-request dimensions are "
                f"{', '.join(needed) or '(none)'}: {detail}", boundary=self.identity)

    def resolve_each(self, batch: int, sequences: Sequence[int] | Mapping[str, int], *,
                     activation_dtype: PipelineActivationDtype,
                     dimensions: Mapping[str, int] | None = None) -> ResolvedBoundaryWireSchema:
        """Concrete shapes with one sequence length per tensor.

        `sequences` is in wire order (one per tensor) or keyed by role; a mapping may leave out
        roles whose shape has no sequence dimension.
        """
        self._check_dimensions(dimensions)
        lengths = self._sequence_lengths(sequences)
        bad = [(r, s) for r, s in zip(self.roles, lengths, strict=True) if not _positive(s)]
        if not _positive(batch) or bad:
            found = f"batch {batch!r}" + "".join(f", sequence {s!r} for `{r}`" for r, s in bad)
            kind = "" if all(isinstance(v, int) and not isinstance(v, bool)
                             for v in (batch, *lengths)) else " (integers)"
            raise ArchitectureBoundaryError(
                ArchitectureBoundaryErrorKind.INVALID_GEOMETRY,
                f"boundary `{self.identity}` needs a positive batch and sequence length{kind}; "
                f"found {found}", boundary=self.identity, role=bad[0][0] if bad else None)
        resolved = [t.resolve(batch, s, activation_dtype, dimensions)
                    for t, s in zip(self.tensors, lengths, strict=True)]
        return ResolvedBoundaryWireSchema(identity=self.identity, primary=resolved[0],
                                          auxiliary=tuple(resolved[1:]),
                                          activation_dtype=activation_dtype)

    def _sequence_lengths(self, sequences: Sequence[int] | Mapping[str, int]) -> list[int]:
        roles = self.roles
        if isinstance(sequences, Mapping):
            unknown = sorted(set(sequences) - set(roles))
            missing = [t.role for t in self.tensors if t.has_sequence and t.role not in sequences]
            if unknown or missing:
                detail = "; ".join(
                    ([f"unknown role(s) {', '.join(f'`{r}`' for r in unknown)}"] if unknown else [])
                    + ([f"no length for {', '.join(f'`{r}`' for r in missing)}"] if missing
                       else []))
                raise ArchitectureBoundaryError(
                    ArchitectureBoundaryErrorKind.INVALID_GEOMETRY,
                    f"boundary `{self.identity}` sequence lengths must be keyed by its roles "
                    f"({', '.join(roles)}): {detail}", boundary=self.identity,
                    role=(unknown or missing)[0])
            return [sequences.get(r, 1) for r in roles]
        if len(sequences) != len(roles):
            raise ArchitectureBoundaryError(
                ArchitectureBoundaryErrorKind.INVALID_GEOMETRY,
                f"boundary `{self.identity}` carries {len(roles)} tensors ({', '.join(roles)}) "
                f"but {len(sequences)} sequence lengths were given", boundary=self.identity)
        return list(sequences)

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        return {"identity": self.identity, "primary": self.primary.to_json(),
                "auxiliary": [a.to_json() for a in self.auxiliary]}


# ---------------------------------------------------------------- resolved schema


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedBoundaryTensorSpec:
    """One boundary tensor once batch and sequence are known: concrete shape and numpy dtype."""

    role: str
    """Unique role."""
    shape: tuple[int, ...]
    """Concrete shape."""
    dtype: BoundaryTensorDtype
    """Declared element type."""
    numpy_dtype: np.dtype[Any]
    """The concrete numpy dtype (the activation dtype for Activation tensors)."""

    def __post_init__(self) -> None:
        if not self.role or not self.role.strip():
            raise _schema_error("a resolved boundary tensor needs a non-empty role")
        if not self.shape or any(d < 1 for d in self.shape):
            raise _schema_error(f"resolved boundary tensor `{self.role}` needs a non-empty "
                                f"shape of positive sizes, found {list(self.shape)}",
                                role=self.role)

    @property
    def nbytes(self) -> int:
        """Bytes of one tensor of this spec."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.numpy_dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedBoundaryWireSchema:
    """A boundary wire schema for one invocation: every tensor's shape and dtype concrete."""

    identity: str
    """Schema identity."""
    primary: ResolvedBoundaryTensorSpec
    """The primary activation."""
    auxiliary: tuple[ResolvedBoundaryTensorSpec, ...]
    """Further tensors, in wire order."""
    activation_dtype: PipelineActivationDtype
    """The dtype Activation tensors were resolved to."""

    def __post_init__(self) -> None:
        if self.primary.dtype is not BoundaryTensorDtype.ACTIVATION:
            raise _schema_error(f"the primary boundary tensor `{self.primary.role}` of "
                                f"`{self.identity}` must have dtype activation",
                                boundary=self.identity, role=self.primary.role)
        _check_roles(self.identity, self.roles)

    @property
    def tensors(self) -> tuple[ResolvedBoundaryTensorSpec, ...]:
        """Primary then auxiliary specs, in wire order."""
        return (self.primary, *self.auxiliary)

    @property
    def roles(self) -> tuple[str, ...]:
        """Roles in wire order."""
        return tuple(t.role for t in self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of one whole payload."""
        return sum(t.nbytes for t in self.tensors)


# ---------------------------------------------------------------- contract


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineWireContract:
    """What every stage of one pipeline agrees on: the boundary schema and the activation dtype."""

    schema: BoundaryWireSchema
    """The family's boundary schema."""
    activation_dtype: PipelineActivationDtype
    """The dtype of Activation tensors on the wire (`--activation-dtype`)."""

    def resolve(self, batch: int, sequence: int, dimensions: Mapping[str, int] | None = None
                ) -> ResolvedBoundaryWireSchema:
        """The schema for one invocation's batch, sequence length and per-request sizes."""
        return self.schema.resolve(batch, sequence, activation_dtype=self.activation_dtype,
                                   dimensions=dimensions)

    def resolve_each(self, batch: int, sequences: Sequence[int] | Mapping[str, int],
                     dimensions: Mapping[str, int] | None = None) -> ResolvedBoundaryWireSchema:
        """The schema with one sequence length per tensor (wire order, or keyed by role)."""
        return self.schema.resolve_each(batch, sequences, activation_dtype=self.activation_dtype,
                                        dimensions=dimensions)

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        return {"schema": self.schema.to_json(), "activation_dtype": self.activation_dtype.value}


def _positive(value: object) -> bool:
    """Whether `value` is an integer of at least 1 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ---------------------------------------------------------------- plain hidden-state boundary


@dataclass(frozen=True, slots=True, kw_only=True)
class NoAuxiliaryBoundarySchema:
    """A plain hidden-state boundary: one [batch, sequence, hidden_size] activation alone."""

    hidden_size: int
    """Width of the hidden state."""
    identity: str = "hidden"
    """Schema identity."""
    role: str = "hidden"
    """Role of the hidden state."""

    def __post_init__(self) -> None:
        if self.hidden_size < 1:
            raise _schema_error(f"a hidden-state boundary needs hidden_size >= 1, found "
                                f"{self.hidden_size}", boundary=self.identity)

    def wire_schema(self) -> BoundaryWireSchema:
        """The boundary wire schema."""
        return BoundaryWireSchema(identity=self.identity, primary=BoundaryTensorSpec.
                                  primary_activation(self.hidden_size, self.role))

    def contract(self, activation_dtype: PipelineActivationDtype) -> PipelineWireContract:
        """The wire contract of this schema under `activation_dtype`."""
        return PipelineWireContract(schema=self.wire_schema(), activation_dtype=activation_dtype)


