"""Every error partc reports: one root class, one class per stage, each carrying its location.

A stage is a class constant: `STAGES` maps each stage to the one class that introduces it, and
every other class takes the stage of the stage class it derives from.
"""

from __future__ import annotations

import enum
import errno
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Self


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


def error_line(where: str, message: str, *, tensor: str | None = None, pointer: str = ""
               ) -> str:
    """An error as the command line shows it: `where (tensor NAME): message [at pointer]`.

    The tensor is named unless the message already quotes it (as `NAME` or 'NAME'); `where`
    is the location ('' when unknown).
    """
    if tensor is not None and f"`{tensor}`" not in message and repr(tensor) not in message:
        shown = tensor if tensor.isprintable() else repr(tensor)
        where = f"{where} (tensor {shown})" if where else f"tensor {shown}"
    return (f"{where}: " if where else "") + message + (f" [at {pointer}]" if pointer else "")


def terminal_safe(text: str) -> str:
    """`text` with every control character (ESC, NUL, a newline, C1 codes, DEL) spelled as its
    escape (`\\x1b`, `\\n`): a name from a file or a tensor cannot move the cursor, recolor
    the terminal or start a forged `error:` line. A tab is kept."""
    return "".join(ch if ch == "\t" or unicodedata.category(ch) != "Cc"
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def plural(count: int, word: str, words: str | None = None) -> str:
    """`1 expert`, `4 experts`: a count and its noun in the right number (`words`: the plural
    when it is not `word` + s)."""
    return f"{count} {word if count == 1 else words or word + 's'}"


class PartcError(Exception):
    """Root of every error partc raises on bad input, shown as `file:line:col: msg [at ptr]`
    (`file (tensor NAME): msg` when it is about a tensor its message does not quote)."""

    stage: ClassVar[str] = "partc"
    """The pipeline stage that found the error (a `STAGES` key), fixed per class."""
    doc_topic: ClassVar[str | None] = None
    """The guide that explains the rule errors of this class enforce, as `page` or
    `page#section` (a heading's anchor); None when no guide does. The guides ship in the wheel
    (`partc.docs`); `partc docs TOPIC` prints where."""

    def __init__(
        self,
        message: str,
        *,
        location: SourceLocation | None = None,
        pointer: str = "",
        tensor: str | None = None,
        doc: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        """What is wrong: the rule, the value expected and the value found."""
        self._location = location
        self._pointer = pointer
        self._tensor = tensor
        self._doc = self.doc_topic if doc is None else doc

    @property
    def location(self) -> SourceLocation | None:
        """Where in the user's file the problem is, when known (fixed at construction)."""
        return self._location

    @property
    def pointer(self) -> str:
        """RFC 6901 JSON pointer of the offending node inside the document ('' for the root)."""
        return self._pointer

    @property
    def tensor(self) -> str | None:
        """The checkpoint tensor concerned, when the problem is about one."""
        return self._tensor

    @property
    def doc(self) -> str | None:
        """The guide explaining this error's rule (`page` or `page#section`), fixed at
        construction: the raise site's, else the class's `doc_topic`."""
        return self._doc

    def located(self, location: SourceLocation | None, pointer: str | None = None) -> Self:
        """A new error of this kind, with these fields and message, created at `location` (and
        `pointer` when given): how a stage that knows where a lower stage's error is (an
        expression's offset in its file, a group's declaration) reports it."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.args = self.args
        copy._location = location
        if pointer is not None:
            copy._pointer = pointer
        return copy

    def sort_key(self) -> tuple[str, int, int, str, str]:
        """Order in which errors are reported: file, line, column, pointer, message."""
        loc = self.location or SourceLocation("")
        return (loc.file, loc.line, loc.column, self.pointer, self.message)

    def __str__(self) -> str:
        return error_line("" if self.location is None else str(self.location), self.message,
                          tensor=self.tensor, pointer=self.pointer)

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
            "doc": self.doc,
        }


class LoadError(PartcError):
    """A family file (YAML or TOML) or a config.json that cannot be read or parsed."""

    stage: ClassVar[str] = "load"


class MachineError(PartcError):
    """The machine refused a read or write partc needed (a full disk, no permission, an I/O
    error): not the input's fault and not a bug in partc."""

    stage: ClassVar[str] = "machine"


MACHINE_ERRNOS = frozenset(getattr(errno, name) for name in (
    "ENOSPC", "EDQUOT", "EACCES", "EPERM", "EROFS", "EIO", "EMFILE", "ENFILE", "ENOMEM")
    if hasattr(errno, name))
"""Error numbers that mean the machine refused an operation (its disk, its permissions, its
limits), not that partc asked for something wrong: a MachineError, exit status 74."""


class SchemaError(PartcError):
    """A document that violates the JSON Schema of the authoring format."""

    stage: ClassVar[str] = "schema"
    doc_topic = "authoring"

    def __init__(self, message: str, *, schema_path: str = "",
                 location: SourceLocation | None = None, pointer: str = "",
                 tensor: str | None = None, doc: str | None = None) -> None:
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.schema_path = schema_path
        """JSON pointer into the schema of the keyword that failed."""


class SemanticError(PartcError):
    """A schema-valid family that is inconsistent, or that cannot bind to a model config."""

    stage: ClassVar[str] = "family"
    doc_topic = "authoring"


class ExpressionError(SemanticError):
    """An expression of the safe language that does not parse or cannot be evaluated."""

    doc_topic = "authoring#2-header-config-fields-graph"

    def __init__(self, message: str, *, expression: str = "", offset: int = 0,
                 location: SourceLocation | None = None, pointer: str = "",
                 tensor: str | None = None, doc: str | None = None) -> None:
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.expression = expression
        """The expression text."""
        self.offset = offset
        """0-based character offset of the problem inside the expression text."""


class LayoutError(PartcError):
    """A bound family that cannot be realized for the requested topology."""

    stage: ClassVar[str] = "plan"
    doc_topic = "policy"


class ExpertParallelError(LayoutError):
    """An expert-parallel topology or placement that cannot be realized for the model."""

    doc_topic = "expert_parallel#the-rank-layout"


class EmitError(PartcError):
    """Generated code that fails its own checks, or an output folder that cannot be written."""

    stage: ClassVar[str] = "emit"
    doc_topic = "output"


class CheckpointError(PartcError):
    """A safetensors checkpoint that is malformed or does not match the plan."""

    stage: ClassVar[str] = "runtime"
    doc_topic = "faults"


class LaunchError(CheckpointError):
    """A serving process set up wrongly for the build it loads: RANK, WORLD_SIZE, LOCAL_RANK or
    a reader-count variable, a `load()` call that asks wrongly (a keyword option of the wrong
    type or value, or one `load()` does not have, the checkpoint argument no path, the rank or
    device asked for), a device mesh or process group that is not the build's, DTensors asked
    of a state that cannot be them.

    It derives from CheckpointError, which these faults raised before they had a class of their
    own, so that `except CheckpointError` still catches them; `except LaunchError` catches
    them alone, and a CheckpointError that is not one is about the checkpoint read.
    """

    stage: ClassVar[str] = "launch"
    doc_topic = "torch"


LOAD_OPTIONS_DOC = "using#the-build-folder-and-load"
"""The guide of `load()` and its options, which a refusal of one of its arguments points to."""


class ExecutorError(PartcError):
    """A pipeline executor, or the payload it sends between stages, that disagrees with the
    rank's partition while the model runs."""

    stage: ClassVar[str] = "executor"
    doc_topic = "boundaries#what-each-ranks-partition-checks"


class VerifyError(PartcError):
    """`partc verify` could not run: a missing library, or a config transformers refuses."""

    stage: ClassVar[str] = "verify"


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
        location: SourceLocation | None = None,
        pointer: str = "",
        tensor: str | None = None,
        doc: str | None = None,
    ) -> None:
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.kind = kind
        """InvalidGroup or InvalidTensor."""
        self.group = group
        """Logical name of the parameter group concerned."""
        self.target = target
        """Checkpoint target concerned ('' when the whole group is at fault)."""


def best_error(errors: Sequence[PartcError]) -> PartcError:
    """The error the API raises when several were found: the earliest in file order.

    Ranking: errors with a location before those without, then by (file, line, column, pointer).
    """
    located = [e for e in errors if e.location is not None and e.location.line > 0]
    pool = located or list(errors)
    return sorted(pool, key=PartcError.sort_key)[0]


class PartcErrors(PartcError):
    """Several errors found in one pass; `errors` holds them sorted, `str` shows the best one.

    Several CheckpointErrors make a `CheckpointErrors`, which is a CheckpointError too, so that
    `except CheckpointError` catches a checkpoint with one problem or many. The stage and kind
    of the whole are its best error's (`to_json`); the command line reports each error.
    """

    def __new__(cls, errors: list[PartcError]) -> PartcErrors:
        """A CheckpointErrors when every error is a CheckpointError, else a PartcErrors."""
        if cls is PartcErrors and errors and all(isinstance(e, CheckpointError) for e in errors):
            cls = CheckpointErrors
        return super().__new__(cls)

    def __init__(self, errors: list[PartcError]) -> None:
        ordered = sorted(errors, key=PartcError.sort_key)
        best = best_error(ordered)
        super().__init__(best.message, location=best.location, pointer=best.pointer,
                         tensor=best.tensor, doc=best.doc)
        self.errors = ordered
        """Every error found, sorted by location."""
        self.best = best
        """The error `str` would put first under the API's ranking (see `best_error`)."""

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)

    def to_json(self) -> dict[str, object]:
        """The best error's machine-readable form (the command line reports every error)."""
        return self.best.to_json()


class CheckpointErrors(PartcErrors, CheckpointError):
    """Several CheckpointErrors found in one pass (see PartcErrors)."""

    stage: ClassVar[str] = CheckpointError.stage


def raise_if_any(errors: Sequence[PartcError]) -> None:
    """Raise what a pass found: nothing when `errors` is empty, the error itself when there is
    one, else a PartcErrors of them all (sorted by location, the best one first in `str`)."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise PartcErrors(list(errors))


STAGES: dict[str, type[PartcError]] = {
    "load": LoadError,
    "machine": MachineError,
    "schema": SchemaError,
    "family": SemanticError,
    "plan": LayoutError,
    "emit": EmitError,
    "runtime": CheckpointError,
    "launch": LaunchError,
    "executor": ExecutorError,
    "verify": VerifyError,
}
"""Each stage and the one class that introduces it, in pipeline order; every other error class
derives from one of them and has its stage (the `--format json` output's `stage` field)."""


# ---------------------------------------------------------------- vocabulary errors


class ArchitectureParameterErrorKind(enum.Enum):
    """What is wrong with an ownership declaration."""

    MISSING_OWNERSHIP = "missing_ownership"
    DUPLICATE_OWNERSHIP = "duplicate_ownership"
    UNEXPECTED_OWNERSHIP = "unexpected_ownership"
    UNKNOWN_GROUP = "unknown_group"
    UNIT_OUT_OF_RANGE = "unit_out_of_range"
    EMPTY_STATIC_ROLE = "empty_static_role"
    REPEATED_STATIC_ROLE = "repeated_static_role"
    UNKNOWN_STATIC_ROLE = "unknown_static_role"
    INVALID_OWNER = "invalid_owner"


class ArchitectureParameterError(SemanticError):
    """An ownership declaration that does not own every checkpoint target exactly once."""

    doc_topic = "authoring#3-parameter-groups"

    def __init__(self, kind: ArchitectureParameterErrorKind, message: str, *, group: str = "",
                 location: SourceLocation | None = None, pointer: str = "",
                 tensor: str | None = None, doc: str | None = None) -> None:
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.kind = kind
        """Which rule was broken."""
        self.group = group
        """The parameter group concerned ('' when none is)."""


class ArchitecturePartitionErrorKind(enum.Enum):
    """What is wrong with one rank's partition."""

    INVALID_GRAPH = "invalid_graph"
    INVALID_STAGES = "invalid_stages"
    UNKNOWN_GROUP = "unknown_group"
    DUPLICATE_GROUP = "duplicate_group"
    EMPTY_RANGE = "empty_range"
    OUT_OF_BOUNDS = "out_of_bounds"
    NON_CANONICAL = "non_canonical"
    INVALID_OWNERSHIP = "invalid_ownership"
    NON_LOCAL_OWNER = "non_local_owner"
    REPEATED_TARGET = "repeated_target"
    MISSING_BOUNDARY = "missing_boundary"


class ArchitecturePartitionError(LayoutError):
    """A pipeline partition that is not realizable or not self-consistent."""

    doc_topic = "boundaries#what-each-ranks-partition-checks"

    def __init__(self, kind: ArchitecturePartitionErrorKind, message: str, *,
                 location: SourceLocation | None = None, pointer: str = "",
                 tensor: str | None = None, doc: str | None = None) -> None:
        if doc is None and kind in (ArchitecturePartitionErrorKind.INVALID_STAGES,
                                    ArchitecturePartitionErrorKind.UNKNOWN_GROUP):
            doc = "boundaries#units-and-stages"  # the stage layout asked for
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.kind = kind
        """Which rule was broken."""


class LayeredPartitionErrorKind(enum.Enum):
    """What is wrong with a layered partition's realization or its use."""

    GROUP_NOT_OWNED = "group_not_owned"
    STORAGE_RANGE = "storage_range"
    MISSING_STATE = "missing_state"
    STATE_RANGE = "state_range"
    TOKENS_ON_NON_INPUT_OWNER = "tokens_on_non_input_owner"
    OUTPUT_ON_NON_OUTPUT_OWNER = "output_on_non_output_owner"
    INVALID_INPUT = "invalid_input"
    INVALID_OUTPUT = "invalid_output"


class LayeredPartitionError(ExecutorError):
    """A rank's unit storage, state or inputs that disagree with its canonical partition."""

    def __init__(self, kind: LayeredPartitionErrorKind, message: str, *, group: str = "",
                 location: SourceLocation | None = None, pointer: str = "",
                 tensor: str | None = None, doc: str | None = None) -> None:
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.kind = kind
        """Which rule was broken."""
        self.group = group
        """The execution group concerned ('' when none is)."""


class LayeredPartitionBeginError(ExecutorError):
    """The executor failed to begin the partition or to enter its first group."""

    def __init__(self, message: str, *, phase: str, group: str, cause: BaseException) -> None:
        super().__init__(message)
        self.phase = phase
        """`begin` or `enter_group`."""
        self.group = group
        """The first execution group of the stage."""
        self.cause = cause
        """The executor's own exception."""


class ArchitectureBoundaryErrorKind(enum.Enum):
    """What is wrong with a boundary schema or payload."""

    INVALID_SCHEMA = "invalid_schema"
    INVALID_GEOMETRY = "invalid_geometry"
    WRONG_COUNT = "wrong_count"
    WRONG_ROLE = "wrong_role"
    WRONG_SHAPE = "wrong_shape"
    WRONG_DTYPE = "wrong_dtype"
    NO_DATA = "no_data"


PAYLOAD_KINDS = frozenset(ArchitectureBoundaryErrorKind) - {
    ArchitectureBoundaryErrorKind.INVALID_SCHEMA, ArchitectureBoundaryErrorKind.INVALID_GEOMETRY}
"""Boundary problems found at run time in a payload (a BoundaryPayloadError) rather than in a
family's schema (an ArchitectureBoundaryError)."""


class ArchitectureBoundaryError(SemanticError):
    """A boundary schema that is malformed (INVALID_SCHEMA, INVALID_GEOMETRY)."""

    doc_topic = "boundaries#the-boundary"

    def __init__(self, kind: ArchitectureBoundaryErrorKind, message: str, *, boundary: str = "",
                 role: str | None = None, location: SourceLocation | None = None,
                 pointer: str = "", tensor: str | None = None, doc: str | None = None) -> None:
        if kind in PAYLOAD_KINDS:
            raise ValueError(f"{kind} is a payload problem: a BoundaryPayloadError")
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.kind = kind
        """Which rule was broken."""
        self.boundary = boundary
        """Identity of the boundary schema concerned ('' when it has none yet)."""
        self.role = role
        """The boundary tensor role concerned, when the problem is about one."""


class BoundaryPayloadError(ExecutorError):
    """A payload sent between pipeline stages that does not match its boundary schema."""

    doc_topic = "boundaries#the-boundary"

    def __init__(self, kind: ArchitectureBoundaryErrorKind, message: str, *, boundary: str = "",
                 role: str | None = None, location: SourceLocation | None = None,
                 pointer: str = "", tensor: str | None = None, doc: str | None = None) -> None:
        if kind not in PAYLOAD_KINDS:
            raise ValueError(f"{kind} is a schema problem: an ArchitectureBoundaryError")
        super().__init__(message, location=location, pointer=pointer, tensor=tensor, doc=doc)
        self.kind = kind
        """Which rule was broken."""
        self.boundary = boundary
        """Identity of the boundary schema concerned."""
        self.role = role
        """The boundary tensor role concerned, when the problem is about one."""
