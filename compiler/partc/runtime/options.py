"""`load()`'s options as one checked value: `LoadOptions`, built once by `load_rank` from its
keywords, with enums for the options that name a mode (framework, verify, zero_copy)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from partc.errors import LOAD_OPTIONS_DOC, LaunchError


class Framework(Enum):
    """What a load returns its tensors as."""

    NUMPY = "numpy"
    """numpy arrays (the default)."""
    TORCH = "torch"
    """torch tensors sharing the numpy memory, or on `device`."""


class Verify(Enum):
    """Which check of the payload a load makes after reading it."""

    NONE = None
    """None: the header is checked against the plan, the payload bytes are not hashed."""
    DIGEST = "digest"
    """The sha256 of every tensor read against the recorded digests."""


class ZeroCopy(Enum):
    """Whether a load returns views of the mapped checkpoint files instead of copies."""

    OFF = False
    """Every tensor read into new memory."""
    SHARED = True
    """One-run tensors (and strided column ranges) as read-only views of a shared mapping."""
    PRIVATE = "private"
    """One-run tensors as writable views of a copy-on-write mapping; the rest copied."""


def option_error(message: str) -> LaunchError:
    """The refusal of an argument of `load()`: a LaunchError (the serving call asked wrongly,
    a CheckpointError too for old callers) pointing to the guide of `load()`."""
    return LaunchError(message, doc=LOAD_OPTIONS_DOC)


def count_option(name: str, value: object) -> int | None:
    """Option `name`'s `value`: None or a positive integer (a bool is not one); a LaunchError
    naming the option and the value otherwise."""
    if value is None:
        return None
    from partc.parallel.shape import size_problem  # the one wording; imported when a count is given

    problem = size_problem(name, value)
    if problem is not None:
        raise option_error(problem)
    assert isinstance(value, int)
    return value


def fetch_cap(value: object, source: str = "max_fetch_ratio") -> float | None:
    """A cap on bytes read over the share: None (no cap) or a number >= 1; a LaunchError naming
    `source` and the value otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
        raise option_error(f"{source} must be None or a number >= 1 (bytes read over the "
                           f"rank's share), found {value!r:.80}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """Every keyword option of `load_rank` (and so of a generated package's `load()`), checked:
    a built value names only valid, mutually consistent options. `load_rank`'s docstring says
    what each one does."""

    verify_fingerprint: bool = True
    """Compare the checkpoint's header with the build's compiled fingerprint."""
    dtype: Any = None
    """The floating dtype every floating tensor is converted to (a numpy dtype), or None."""
    reader: Any = None
    """A `ReadRecorder` told of every byte run read, or None."""
    framework: Framework = Framework.NUMPY
    """What the tensors are returned as (TORCH whenever `device` is set)."""
    workers: int | None = None
    """The most reader threads, or None: sized from the machine and `local_ranks`."""
    progress: bool | None = None
    """Show a bar of the bytes read; None: on a terminal only."""
    verify: Verify = Verify.NONE
    """The payload check after reading."""
    zero_copy: ZeroCopy = ZeroCopy.OFF
    """Views of the mapped files instead of copies."""
    local_ranks: int | None = None
    """Ranks loading on this node at once, or None: from the environment."""
    device: Any = None
    """The torch device the tensors go to (unresolved: resolved, importing torch, by the
    device path), or None."""
    staging_bytes: int | None = None
    """The host ring size of a load to a CUDA device, or None: 64 MiB."""
    max_fetch_ratio: float | None = None
    """The most bytes read from the files over the share's (None: `PARTC_MAX_FETCH_RATIO`,
    else no cap: the read planner's least modelled time)."""

    def __post_init__(self) -> None:
        if self.reader is not None and not callable(getattr(self.reader, "record", None)):
            raise option_error("reader must be None or an object with a record(path, offset, "
                                  "length) method (partc.runtime.ReadRecorder),"
                                  f" found {self.reader!r:.80}")
        count_option("workers", self.workers)
        count_option("local_ranks", self.local_ranks)
        fetch_cap(self.max_fetch_ratio)
        if not isinstance(self.verify_fingerprint, bool):
            raise option_error(f"verify_fingerprint must be True or False, found "
                                  f"{self.verify_fingerprint!r:.80}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise option_error(f"progress must be None (a bar on a terminal only), True or "
                                  f"False, found {self.progress!r:.80}")
        for name, kind in (("framework", Framework), ("verify", Verify), ("zero_copy", ZeroCopy)):
            if not isinstance(getattr(self, name), kind):
                raise option_error(f"{name} must be a {kind.__name__}, found "
                                      f"{getattr(self, name)!r:.80}")
        if self.device is not None and self.framework is not Framework.TORCH:
            raise option_error(f"device={self.device!r} places torch tensors, but framework "
                                  f"is {self.framework.value!r}; pass framework='torch' or "
                                  "leave it out")
        if self.device is None and self.framework is Framework.TORCH:
            self.check_torch_views()  # with a device: once it is resolved (`load_target`)

    def check_torch_views(self) -> None:
        """Refuse zero_copy=True for a torch load: its views are read-only, torch tensors
        cannot be."""
        if self.zero_copy is ZeroCopy.SHARED:
            raise option_error("zero_copy=True returns read-only views of the checkpoint "
                                  "file, which torch tensors cannot be; load with "
                                  "zero_copy='private' (writable copy-on-write views), "
                                  "framework='numpy', or without zero_copy")

    @property
    def host_numpy(self) -> bool:
        """Whether this is a plain host numpy load, which needs nothing of the device path."""
        return (self.device is None and self.framework is Framework.NUMPY
                and self.staging_bytes is None)

    @classmethod
    def from_keywords(cls, *, verify_fingerprint: Any = True, dtype: Any = None,
                      reader: Any = None, framework: Any = None, workers: Any = None,
                      progress: Any = None, verify: Any = None, zero_copy: Any = False,
                      local_ranks: Any = None, device: Any = None, staging_bytes: Any = None,
                      max_fetch_ratio: Any = None) -> LoadOptions:
        """The options of `load_rank`'s keywords, spelled as `load()` takes them (strings and
        bools), each refused with a LaunchError naming it, what it must be and the value
        found."""
        from partc.runtime.frameworks import float_dtype

        if not isinstance(zero_copy, bool) and zero_copy != "private":
            raise option_error(f"zero_copy must be False, True or 'private', found "
                                  f"{zero_copy!r}")
        if framework is None:
            framework = "numpy" if device is None else "torch"
        if framework not in ("numpy", "torch"):
            raise option_error(f"framework must be 'numpy' or 'torch', found {framework!r}")
        if verify not in (None, "digest"):
            raise option_error(f"verify must be None or 'digest', found {verify!r}")
        return cls(verify_fingerprint=verify_fingerprint,
                   dtype=None if dtype is None else float_dtype(dtype), reader=reader,
                   framework=Framework(framework), workers=workers, progress=progress,
                   verify=Verify(verify), zero_copy=ZeroCopy(zero_copy),
                   local_ranks=local_ranks, device=device, staging_bytes=staging_bytes,
                   max_fetch_ratio=max_fetch_ratio)
