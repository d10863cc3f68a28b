"""The bottom of the reading engine: what a read asks for (`TensorSelection`), how it is read
(`ReadOptions`) and who is told of it (`ReadRecorder`); every other module of the engine builds
on these."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from partc.parallel.placements import local_shape
from partc.runtime.headers import BIT_DTYPES, DTYPES
from partc.runtime.options import ZeroCopy


class ReadRecorder(Protocol):
    """Instrumentation told of every byte run actually read from a file.

    A large read calls it from several reader threads, in no particular order.
    """

    def record(self, path: str, offset: int, length: int) -> None:
        """Note that `length` bytes were read from `path` at absolute `offset`."""


@dataclass(frozen=True, slots=True)
class TensorSelection:
    """The part of a tensor a rank owns: global slices along `axis`, concatenated in order."""

    axis: int | None = None
    """Axis the ranges cut, or None for the whole tensor."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Half-open global ranges [start, end) along `axis`, concatenated in this order."""

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the selected part of a tensor of global `shape` (assumes valid ranges)."""
        return local_shape(shape, (self.axis, self.ranges))


WHOLE = TensorSelection()
"""The selection of an entire tensor."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadOptions:
    """How one read of a checkpoint is made, stated once by its caller (the loader, the digests,
    `partc shard`, the device path, tests) and handed to `CheckpointReader` and `read_tensors`."""

    recorder: ReadRecorder | None = None
    """Told of every byte run read, when set."""
    workers: int | None = None
    """The most reader threads (at least 1), or None: sized from the machine and
    `local_ranks` (`PARTC_READ_THREADS` overrides that default)."""
    local_ranks: int | None = None
    """Ranks loading on this node at once, or None: from the environment (`node_ranks`)."""
    zero_copy: ZeroCopy = ZeroCopy.OFF
    """Whether a selection that is one contiguous byte run comes back as a view of the mapped
    file instead of a copy: SHARED, a read-only view of a shared mapping (a column slice too,
    strided); PRIVATE, a writable view of a copy-on-write mapping (column slices are copied,
    so every array is C-contiguous)."""
    bits: bool = False
    """Read bf16 and fp8 as unsigned integers of their size (a torch load views them as its
    own dtypes and never imports ml_dtypes), else as ml_dtypes' types."""
    progress: Callable[[int], None] | None = None
    """Called in the reading thread with the bytes of every finished job, when set."""
    max_gap: int = 0
    """Runs this close (bytes) are read as one span (gaps included) and gathered; 0: exact."""
    mapped: bool = True
    """Whether finely cut selections are gathered from read-only mappings."""
    max_fetch_ratio: float | None = None
    """The most bytes read from the files over the share's, or None: `PARTC_MAX_FETCH_RATIO`,
    else no cap (the read planner's least modelled time; see `partc.runtime.read_planner`)."""

    @property
    def dtypes(self) -> Mapping[str, np.dtype[Any]]:
        """Safetensors dtype -> the numpy dtype of the arrays read (`bits`: BIT_DTYPES)."""
        return BIT_DTYPES if self.bits else DTYPES


READ = ReadOptions()
"""The default read: exact runs, copies, threads sized from the machine, told to no one."""
