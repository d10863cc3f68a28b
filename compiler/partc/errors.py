"""Every error partc reports: one root class, one subclass per stage, each carrying its location."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class SourceLocation:
    """A position in a user's file: 1-based line and column (0 when unknown)."""

    file: str
    """Path of the file as the user named it."""
    line: int = 0
    """1-based line, 0 when the position is unknown."""
    column: int = 0
    """1-based column, 0 when the position is unknown."""

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.column}"


class PartcError(Exception):
    """Root of every error partc raises on bad input, shown as `file:line:col: msg [at ptr]`."""

    stage = "partc"

    def __init__(
        self,
        message: str,
        *,
        location: SourceLocation | None = None,
        pointer: str = "",
        tensor: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        """What is wrong: the rule, the value expected and the value found."""
        self.location = location
        """Where in the user's file the problem is, when known."""
        self.pointer = pointer
        """RFC 6901 JSON pointer of the offending node inside the document ('' for the root)."""
        self.tensor = tensor
        """The checkpoint tensor concerned, when the problem is about one."""

    def sort_key(self) -> tuple[str, int, int, str, str]:
        """Order in which errors are reported: file, line, column, pointer, message."""
        loc = self.location or SourceLocation("")
        return (loc.file, loc.line, loc.column, self.pointer, self.message)

    def __str__(self) -> str:
        parts = []
        if self.location is not None:
            parts.append(f"{self.location}: ")
        parts.append(self.message)
        if self.pointer:
            parts.append(f" [at {self.pointer}]")
        return "".join(parts)

    def to_json(self) -> dict[str, object]:
        """A machine-readable form of the error for editors and CI."""
        loc = self.location
        return {
            "stage": self.stage,
            "kind": type(self).__name__,
            "file": loc.file if loc else None,
            "line": loc.line if loc and loc.line > 0 else None,
            "column": loc.column if loc and loc.line > 0 else None,
            "pointer": self.pointer,
            "tensor": self.tensor,
            "message": self.message,
        }


class LoadError(PartcError):
    """A family file (YAML or TOML) or a config.json that cannot be read or parsed."""

    stage = "load"


class SchemaError(PartcError):
    """A document that violates the JSON Schema of the authoring format."""

    stage = "schema"

    def __init__(self, message: str, *, schema_path: str = "", **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.schema_path = schema_path
        """JSON pointer into the schema of the keyword that failed."""


class ExpressionError(PartcError):
    """An expression of the safe language that does not parse or cannot be evaluated."""

    stage = "family"

    def __init__(self, message: str, *, expression: str = "", offset: int = 0, **kwargs: object):
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.expression = expression
        """The expression text."""
        self.offset = offset
        """0-based character offset of the problem inside the expression text."""


class SemanticError(PartcError):
    """A schema-valid family that is inconsistent, or that cannot bind to a model config."""

    stage = "family"


class LayoutError(PartcError):
    """A bound family that cannot be realized for the requested topology."""

    stage = "plan"


class EmitError(PartcError):
    """Generated code that fails its own checks, or an output folder that cannot be written."""

    stage = "emit"


class CheckpointError(PartcError):
    """A safetensors checkpoint that is malformed or does not match the plan."""

    stage = "runtime"


class ParallelPlanErrorKind(enum.Enum):
    """Which kind of object a parallel-plan error is about."""

    INVALID_GROUP = "InvalidGroup"
    INVALID_TENSOR = "InvalidTensor"


class ParallelPlanError(LayoutError):
    """A parameter group or tensor whose sharding is illegal for the topology."""

    def __init__(
        self,
        kind: ParallelPlanErrorKind,
        message: str,
        *,
        group: str = "",
        target: str = "",
        **kwargs: object,
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.kind = kind
        """InvalidGroup or InvalidTensor."""
        self.group = group
        """Logical name of the parameter group concerned."""
        self.target = target
        """Checkpoint target concerned ('' when the whole group is at fault)."""


def best_error(errors: list[PartcError]) -> PartcError:
    """The error the API raises when several were found: the earliest in file order.

    Ranking: errors with a location before those without, then by (file, line, column, pointer).
    """
    located = [e for e in errors if e.location is not None and e.location.line > 0]
    pool = located or errors
    return sorted(pool, key=PartcError.sort_key)[0]


class PartcErrors(PartcError):
    """Several errors found in one pass; `errors` holds them sorted, `str` shows the best one."""

    def __init__(self, errors: list[PartcError]) -> None:
        ordered = sorted(errors, key=PartcError.sort_key)
        best = best_error(ordered)
        super().__init__(best.message, location=best.location, pointer=best.pointer,
                         tensor=best.tensor)
        self.errors = ordered
        """Every error found, sorted by location."""
        self.stage = best.stage

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)
