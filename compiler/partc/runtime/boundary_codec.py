"""Pipeline boundary payloads at run time: role-tagged encode, checked decode.

`ArchitectureBoundary` is the object a rank module's `boundary()`, `receive_boundary()` and
`send_boundary()` hand a serving process: under one `PipelineWireContract` (the compile-time
vocabulary of `partc.partition.boundary`) it tags a stage's tensors with their roles for the
wire and refuses, as a `BoundaryPayloadError`, any received payload whose count, roles, shapes or
dtypes do not match. Only a serving process encodes or decodes, so this lives in the runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partc.errors import (
    ArchitectureBoundaryError,
    ArchitectureBoundaryErrorKind,
    BoundaryPayloadError,
)
from partc.partition.boundary import (
    BatchDimension,
    BoundaryTensorDimension,
    BoundaryTensorDtype,
    BoundaryWireSchema,
    FixedDimension,
    PipelineWireContract,
    RequestDimension,
    ResolvedBoundaryWireSchema,
    SequenceDimension,
)

if TYPE_CHECKING:
    import numpy as np


def _schema_error(message: str, *, boundary: str) -> ArchitectureBoundaryError:
    """A schema (not payload) mismatch: a resolved schema or contract of the wrong boundary."""
    return ArchitectureBoundaryError(ArchitectureBoundaryErrorKind.INVALID_SCHEMA, message,
                                     boundary=boundary)


def _spell_shape(shape: Iterable[BoundaryTensorDimension]) -> str:
    """A symbolic shape as the family wrote it: `[batch, sequence, 64]`."""
    return "[" + ", ".join(str(d.spell()) for d in shape) + "]"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ArchitectureBoundaryValue:
    """One tensor on the wire, coupled to its role so nobody re-assigns roles by position."""

    role: str
    """The boundary role the tensor was encoded as."""
    tensor: Any
    """The array (numpy)."""

    def __post_init__(self) -> None:
        if not self.role or not self.role.strip():
            raise BoundaryPayloadError(ArchitectureBoundaryErrorKind.WRONG_ROLE,
                                       "a boundary value needs a non-empty role")

    def __repr__(self) -> str:
        shape = list(getattr(self.tensor, "shape", ()))
        return (f"ArchitectureBoundaryValue(role={self.role!r}, shape={shape}, "
                f"dtype={getattr(self.tensor, 'dtype', type(self.tensor).__name__)})")


def validate_boundary_tensor_count(schema: BoundaryWireSchema, tensors: Sized) -> None:
    """Refuse a payload whose tensor count differs from the schema's, before any decoding."""
    if len(tensors) != len(schema.tensors):
        raise BoundaryPayloadError(
            ArchitectureBoundaryErrorKind.WRONG_COUNT,
            f"boundary `{schema.identity}` carries {len(schema.tensors)} tensor(s) "
            f"({', '.join(schema.roles)}) but {len(tensors)} were received",
            boundary=schema.identity)


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchitectureBoundary:
    """The family's typed encode/decode of one pipeline cut under a wire contract."""

    contract: PipelineWireContract
    """Schema and activation dtype."""

    @property
    def schema(self) -> BoundaryWireSchema:
        """The boundary wire schema."""
        return self.contract.schema

    @property
    def identity(self) -> str:
        """The schema identity."""
        return self.contract.schema.identity

    def resolve(self, batch: int, sequence: int, dimensions: Mapping[str, int] | None = None
                ) -> ResolvedBoundaryWireSchema:
        """The schema for one invocation's batch, sequence length and per-request sizes."""
        return self.contract.resolve(batch, sequence, dimensions)

    def resolve_each(self, batch: int, sequences: Sequence[int] | Mapping[str, int],
                     dimensions: Mapping[str, int] | None = None) -> ResolvedBoundaryWireSchema:
        """The schema with one sequence length per tensor (wire order, or keyed by role)."""
        return self.contract.resolve_each(batch, sequences, dimensions)

    def encode(self, primary: Any, /, **auxiliary: Any) -> tuple[ArchitectureBoundaryValue, ...]:
        """Tag the primary activation and every auxiliary tensor (by role) for the wire.

        Batch and sequence length are read from the tensors themselves (the first tensor in
        wire order with such a dimension fixes it) and every tensor must then match exactly.
        """
        role = self.schema.primary.role
        if role in auxiliary:
            raise self._error(ArchitectureBoundaryErrorKind.WRONG_ROLE,
                              f"`{role}` is the primary tensor of boundary `{self.identity}`; "
                              "pass it positionally, not by keyword", role)
        return self.encode_values({role: primary, **auxiliary})

    def encode_values(self, tensors: Mapping[str, Any], *,
                      resolved: ResolvedBoundaryWireSchema | None = None
                      ) -> tuple[ArchitectureBoundaryValue, ...]:
        """Tag tensors given by role, in wire order, after checking them against the schema."""
        roles = self.schema.roles
        unknown = [r for r in tensors if r not in roles]
        if unknown:
            raise self._error(ArchitectureBoundaryErrorKind.WRONG_ROLE,
                              f"boundary `{self.identity}` has no tensor role `{unknown[0]}`; its "
                              f"roles are {', '.join(roles)}", unknown[0])
        missing = [r for r in roles if r not in tensors]
        if missing:
            raise self._error(ArchitectureBoundaryErrorKind.WRONG_COUNT,
                              f"boundary `{self.identity}` needs tensor `{missing[0]}`; encode "
                              f"received {', '.join(f'`{r}`' for r in tensors) or 'nothing'} of "
                              f"{', '.join(roles)}", missing[0])
        values = tuple(ArchitectureBoundaryValue(role=r, tensor=tensors[r]) for r in roles)
        self._check(values, resolved)
        return values

    def decode(self, values: Sequence[ArchitectureBoundaryValue], *,
               resolved: ResolvedBoundaryWireSchema | None = None) -> dict[str, Any]:
        """A received payload's tensors by role, after checking count, roles, shapes, dtypes."""
        validate_boundary_tensor_count(self.schema, values)
        roles = self.schema.roles
        found = [v.role for v in values]
        for index, (expected, value) in enumerate(zip(roles, values, strict=True)):
            if value.role != expected:
                order = ("; the payload has the right roles in the wrong order"
                         if sorted(found) == sorted(roles) else "")
                raise self._error(ArchitectureBoundaryErrorKind.WRONG_ROLE,
                                  f"boundary `{self.identity}` expects `{expected}` at wire "
                                  f"position {index}, received `{value.role}` (wire order: "
                                  f"{', '.join(roles)}; received: {', '.join(found)}){order}",
                                  value.role)
        self._check(tuple(values), resolved)
        return {v.role: v.tensor for v in values}

    def decode_tensors(self, tensors: Sequence[Any], *,
                       resolved: ResolvedBoundaryWireSchema | None = None) -> dict[str, Any]:
        """Decode untagged tensors straight off the wire: counted first, then tagged by order."""
        if hasattr(tensors, "shape") and hasattr(tensors, "dtype"):  # one tensor, not a list
            raise self._error(ArchitectureBoundaryErrorKind.WRONG_COUNT,
                              f"decode_tensors takes the received tensors of `{self.identity}` "
                              f"as a list in wire order ({', '.join(self.schema.roles)}), found "
                              f"one tensor of shape {list(tensors.shape)}", None)
        validate_boundary_tensor_count(self.schema, tensors)
        values = tuple(ArchitectureBoundaryValue(role=r, tensor=t)
                       for r, t in zip(self.schema.roles, tensors, strict=True))
        return self.decode(values, resolved=resolved)

    def infer(self, values: Sequence[ArchitectureBoundaryValue]) -> ResolvedBoundaryWireSchema:
        """The resolved schema whose batch, sequence and per-request sizes the tensors
        themselves declare (the first tensor in wire order with such a dimension fixes it)."""
        batch = sequence = None
        named: dict[str, int] = {}
        for spec, value in zip(self.schema.tensors, values, strict=True):
            shape = _shape_of(value, self.identity)
            if len(shape) != len(spec.shape):
                continue
            for axis, (dim, size) in enumerate(zip(spec.shape, shape, strict=True)):
                # a resolved shape never has an empty batch, sequence or per-request axis
                if not isinstance(dim, FixedDimension) and size < 1:
                    raise self._error(
                        ArchitectureBoundaryErrorKind.WRONG_SHAPE,
                        f"boundary tensor `{value.role}` of `{self.identity}` has shape "
                        f"{list(shape)}: axis {axis} (`{dim.spell()}`) is empty; batch, "
                        "sequence and per-request dimensions are at least 1", value.role)
                match dim:
                    case BatchDimension() if batch is None:
                        batch = size
                    case SequenceDimension() if sequence is None:
                        sequence = size
                    case RequestDimension() if dim.name not in named:
                        named[dim.name] = size
        for name in self.schema.request_dimensions:
            named.setdefault(name, 1)
        return self.resolve(batch or 1, sequence or 1, named)

    def _check(self, values: tuple[ArchitectureBoundaryValue, ...],
               resolved: ResolvedBoundaryWireSchema | None) -> None:
        if resolved is None:
            resolved = self.infer(values)
        elif (resolved.identity, resolved.roles, resolved.activation_dtype) != (
                self.identity, self.schema.roles, self.contract.activation_dtype):
            raise _schema_error(f"resolved schema `{resolved.identity}` ("
                                f"{', '.join(resolved.roles)}, "
                                f"{resolved.activation_dtype.value}) does not belong to boundary "
                                f"`{self.identity}` ({', '.join(self.schema.roles)}, "
                                f"{self.contract.activation_dtype.value})", boundary=self.identity)
        for spec, symbolic, value in zip(resolved.tensors, self.schema.tensors, values,
                                         strict=True):
            shape = _shape_of(value, self.identity)
            if len(shape) != len(spec.shape):  # its sizes were not read from it: no [1, 1, ..]
                raise self._error(ArchitectureBoundaryErrorKind.WRONG_SHAPE,
                                  f"boundary tensor `{spec.role}` of `{self.identity}` has "
                                  f"{len(shape)} axes (shape {list(shape)}); expected "
                                  f"{len(spec.shape)}: {_spell_shape(symbolic.shape)}", spec.role)
            if shape != spec.shape:
                raise self._error(ArchitectureBoundaryErrorKind.WRONG_SHAPE,
                                  f"boundary tensor `{spec.role}` of `{self.identity}` has shape "
                                  f"{list(shape)}; expected {list(spec.shape)} (declared "
                                  f"{_spell_shape(symbolic.shape)})", spec.role)
            if not _same_dtype(value.tensor.dtype, spec.numpy_dtype):
                why = (f"the pipeline activation dtype {self.contract.activation_dtype.value}"
                       if spec.dtype is BoundaryTensorDtype.ACTIVATION else "declared")
                raise self._error(ArchitectureBoundaryErrorKind.WRONG_DTYPE,
                                  f"boundary tensor `{spec.role}` of `{self.identity}` has dtype "
                                  f"{value.tensor.dtype}; expected {spec.numpy_dtype} ({why})",
                                  spec.role)
            if getattr(value.tensor, "is_meta", False) is True:  # a torch tensor of no storage
                raise self._error(ArchitectureBoundaryErrorKind.NO_DATA,
                                  f"boundary tensor `{spec.role}` of `{self.identity}` is a torch "
                                  "meta tensor (a shape and dtype, no data); expected the "
                                  "stage's computed values on the CPU or a device", spec.role)

    def _error(self, kind: ArchitectureBoundaryErrorKind, message: str,
               role: str | None) -> BoundaryPayloadError:
        return BoundaryPayloadError(kind, message, boundary=self.identity, role=role)


def _same_dtype(found: Any, expected: np.dtype[Any]) -> bool:
    """Whether an array's dtype is `expected`: a numpy dtype, or a torch dtype of that name
    (`torch.bfloat16` is ml_dtypes' `bfloat16`), so torch tensors cross a cut unconverted."""
    if type(found).__module__ == "torch":
        return str(found).removeprefix("torch.") == expected.name
    try:
        return bool(found == expected)
    except TypeError:
        return False


def _shape_of(value: ArchitectureBoundaryValue, identity: str) -> tuple[int, ...]:
    shape = getattr(value.tensor, "shape", None)
    if shape is None or not hasattr(value.tensor, "dtype"):
        raise BoundaryPayloadError(
            ArchitectureBoundaryErrorKind.WRONG_SHAPE,
            f"boundary tensor `{value.role}` of `{identity}` must be an array with a shape and a "
            f"dtype, found {type(value.tensor).__name__}", boundary=identity, role=value.role)
    return tuple(int(d) for d in shape)


# ---------------------------------------------------------------- plain hidden-state boundary


@dataclass(frozen=True, slots=True, kw_only=True)
class NoAuxiliaryBoundary(ArchitectureBoundary):
    """An ArchitectureBoundary that carries the hidden state alone and rejects anything more."""

    def __post_init__(self) -> None:
        if self.schema.auxiliary:
            raise _schema_error(f"boundary `{self.identity}` carries auxiliary tensors "
                                f"({', '.join(a.role for a in self.schema.auxiliary)}); a "
                                "no-auxiliary boundary carries the primary activation alone",
                                boundary=self.identity)

    def encode_hidden(self, hidden: Any) -> tuple[ArchitectureBoundaryValue, ...]:
        """The one-value payload of a hidden state."""
        return self.encode(hidden)

    def decode_hidden(self, values: Sequence[ArchitectureBoundaryValue]) -> Any:
        """The hidden state of a one-value payload."""
        return self.decode(values)[self.schema.primary.role]


def boundary_for(contract: PipelineWireContract) -> ArchitectureBoundary:
    """The boundary of `contract`: a NoAuxiliaryBoundary when it carries the hidden state alone."""
    if contract.schema.auxiliary:
        return ArchitectureBoundary(contract=contract)
    return NoAuxiliaryBoundary(contract=contract)
