"""Byte runs of a rank's selections and the jobs that read them: which bytes of a tensor a
selection covers, runs merged and cut into jobs for the reader threads, how many threads a rank
uses, and the loop that fills buffers through short reads."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.runtime.headers import ITEMSIZE, FileHeader, TensorEntry, abort

if TYPE_CHECKING:
    from partc.runtime._engine.selection import ReadRecorder, TensorSelection

Ints = np.ndarray[Any, np.dtype[np.int64]]
IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))
"""Most buffers one vectored call takes."""

def _is_int(value: object) -> bool:
    """Whether `value` is a Python or numpy integer (not a bool)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_selection(header: FileHeader, entry: TensorEntry, sel: TensorSelection) -> None:
    """Refuse a selection that does not fit the tensor's shape."""
    shape = entry.shape
    if sel.axis is None:
        if sel.ranges:
            abort(header.path, f"selection of {entry.name!r} has ranges but no axis", entry.name)
        return
    if not _is_int(sel.axis) or not 0 <= sel.axis < len(shape):
        abort(header.path, f"selection axis {sel.axis!r} out of range for shape {list(shape)}",
              entry.name)
    dim = shape[sel.axis]
    for r in sel.ranges:
        if (not isinstance(r, tuple | list) or len(r) != 2 or not _is_int(r[0])
                or not _is_int(r[1]) or not 0 <= r[0] <= r[1] <= dim):
            abort(header.path, f"selection range {r!r} of {entry.name!r} must satisfy "
                               f"0 <= start <= end <= {dim} (axis {sel.axis} of {list(shape)})",
                  entry.name)


def byte_runs(entry: TensorEntry, sel: TensorSelection) -> tuple[Ints, Ints, Ints]:
    """Merged byte runs (file offset rel. to the tensor, destination offset, length), file order."""
    item = ITEMSIZE[entry.dtype]
    if sel.axis is None:
        n = 1 if entry.nbytes else 0
        return np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, entry.nbytes, np.int64)
    k, shape = sel.axis, entry.shape
    outer = math.prod(shape[:k])
    inner = math.prod(shape[k + 1:]) * item
    ranges = np.array([r for r in sel.ranges if r[1] > r[0]], dtype=np.int64).reshape(-1, 2)
    if outer == 0 or inner == 0 or len(ranges) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if outer == 1 and len(ranges) == 1:  # the common row slice: one run, no array arithmetic
        start, end = ranges[0].tolist()
        return (np.array([start * inner], np.int64), np.zeros(1, np.int64),
                np.array([(end - start) * inner], np.int64))
    piece = (ranges[:, 1] - ranges[:, 0]) * inner
    src = (np.arange(outer, dtype=np.int64)[:, None] * (shape[k] * inner)
           + ranges[:, 0][None, :] * inner).ravel()
    length = np.broadcast_to(piece, (outer, len(piece))).ravel()
    dst = np.cumsum(length) - length  # pieces are laid out back to back in destination order
    first = np.flatnonzero(np.r_[True, src[1:] != src[:-1] + length[:-1]])
    src, dst, length = src[first], dst[first], np.add.reduceat(length, first)
    if len(src) > 1 and not bool(np.all(src[1:] > src[:-1])):
        order = np.argsort(src, kind="stable")
        src, dst, length = src[order], dst[order], length[order]
    return src, dst, length


def one_run(entry: TensorEntry, sel: TensorSelection) -> tuple[int, int]:
    """(0, 0) when the selection has no byte, (1, start) when it is one byte run starting at
    `start` (relative to the tensor), (2, 0) when it is several: `byte_runs` without its arrays,
    for the questions a zero-copy view asks of every tensor (whole tensors and row slices are
    answered without numpy; rarer shapes fall back to `byte_runs`)."""
    if sel.axis is None:
        return (1, 0) if entry.nbytes else (0, 0)
    kept = [r for r in sel.ranges if r[1] > r[0]]
    if len(kept) == 1:
        k, shape = sel.axis, entry.shape
        outer = math.prod(shape[:k])
        inner = math.prod(shape[k + 1:]) * ITEMSIZE[entry.dtype]
        start, end = kept[0]
        if outer == 0 or inner == 0:
            return 0, 0
        if outer == 1:
            return 1, start * inner
        return (1, 0) if start == 0 and end == shape[k] else (2, 0)
    if not kept:
        return 0, 0
    src = byte_runs(entry, sel)[0]
    return (len(src), int(src[0])) if len(src) == 1 else (min(len(src), 2), 0)


JOB_BYTES = 16 << 20
"""Bytes of one unit of work handed to a reader thread (long runs are cut to this size)."""
THREADED_BYTES = 16 << 20
"""Reads smaller than this run in the calling thread."""


class Job:
    """A slice of one file's sorted runs: what one reader thread reads in one go.

    A plain slotted class: a load only builds and reads these records, and creating a dataclass
    costs every runtime import about a millisecond (issue 18).
    """

    __slots__ = ("arrays", "dst", "fd", "file", "length", "names", "nbytes", "owner", "path",
                 "src")

    def __init__(self, *, file: int, path: str, names: list[str],
                 arrays: list[np.ndarray[Any, Any]], src: Ints, dst: Ints, length: Ints,
                 owner: Ints, nbytes: int) -> None:
        self.file, self.path, self.names, self.arrays = file, path, names, arrays
        self.nbytes, self.fd = nbytes, -1
        self.src, self.dst, self.length, self.owner = src, dst, length, owner


def byte_view(array: np.ndarray[Any, Any]) -> memoryview:
    """The bytes of a C-contiguous array, as a writable memoryview a read can fill."""
    return array.reshape(-1).view(np.uint8).data


def address_of(array: np.ndarray[Any, Any]) -> int:
    """Where an array's first byte is."""
    return int(array.__array_interface__["data"][0])


class ReadPlan:
    """Every run of a batch of reads, gathered per file, then cut into sorted jobs.

    `add` only records a tensor's runs (shared by every tensor of one structure) and where
    they go; `jobs` offsets and labels all of a file's runs at once: numpy's per-call cost,
    paid per tensor, was ~10% of the calling thread's part of a warm load (T=8, 206 tensors).
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.arrays: list[np.ndarray[Any, Any]] = []
        self.parts: dict[int, list[tuple[int, int, Ints, Ints, Ints]]] = {}
        """Per file: (base, index in `names`, src, dst, length) of each tensor added."""
        self.nbytes = 0

    def add(self, file: int, base: int, name: str, array: np.ndarray[Any, Any], src: Ints,
            dst: Ints, length: Ints, nbytes: int | None = None) -> None:
        """Add the runs of one tensor (offsets relative to `base`) destined for `array`;
        `nbytes`: their total length, when the caller knows it."""
        self.parts.setdefault(file, []).append((base, len(self.names), src, dst, length))
        self.names.append(name)
        self.arrays.append(array)  # its bytes and address are taken by the job's reader thread
        self.nbytes += int(length.sum()) if nbytes is None else nbytes

    def jobs(self, files: tuple[FileHeader, ...], limit: int) -> list[Job]:
        """The runs of each file in offset order, long runs cut, grouped into ~`limit` jobs."""
        jobs = []
        for file in sorted(self.parts):
            parts = self.parts[file]
            counts = np.array([len(p[2]) for p in parts], dtype=np.int64)
            src = np.concatenate([p[2] for p in parts]) + np.repeat(
                np.array([p[0] for p in parts], dtype=np.int64), counts)
            dst = np.concatenate([p[3] for p in parts])
            length = np.concatenate([p[4] for p in parts])
            owner = np.repeat(np.array([p[1] for p in parts], dtype=np.int64), counts)
            if int(length.max()) > limit:
                src, dst, length, owner = _cut(src, dst, length, owner, limit)
            if len(src) > 1 and not bool(np.all(src[1:] > src[:-1])):
                order = np.argsort(src, kind="stable")
                src, dst, length, owner = src[order], dst[order], length[order], owner[order]
            ends = np.cumsum(length)
            bucket = (ends - length) // limit
            cuts = [0, *(np.flatnonzero(bucket[1:] != bucket[:-1]) + 1).tolist(), len(src)]
            for i, j in zip(cuts, cuts[1:], strict=False):
                jobs.append(Job(file=file, path=files[file].path, names=self.names,
                                arrays=self.arrays, src=src[i:j],
                                dst=dst[i:j], length=length[i:j], owner=owner[i:j],
                                nbytes=int(ends[j - 1] - ends[i] + length[i])))
        return jobs



def _cut(src: Ints, dst: Ints, length: Ints, owner: Ints, limit: int
         ) -> tuple[Ints, Ints, Ints, Ints]:
    """Split runs longer than `limit` bytes into consecutive pieces of at most `limit`."""
    pieces = (length + limit - 1) // limit
    index = np.repeat(np.arange(len(src)), pieces)
    step = (np.arange(len(index)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * limit
    return (src[index] + step, dst[index] + step, np.minimum(limit, length[index] - step),
            owner[index])


def fill(fd: int, path: str, name: str, bufs: list[memoryview], offset: int,
         recorder: ReadRecorder | None, got: int | None = None) -> None:
    """Fill `bufs` from the file at `offset`, looping over short reads (`got`: done already)."""
    bufs = list(bufs)
    while True:
        if got is None:
            try:
                got = os.preadv(fd, bufs, offset)
            except OSError as exc:
                abort(path, f"cannot read tensor data: {exc.strerror or exc}", name)
            if recorder is not None and got > 0:
                recorder.record(path, offset, got)
        if got <= 0:
            abort(path, f"file changed since its header was read (truncated file?): read "
                        f"returned no data at offset {offset}, expected "
                        f"{sum(map(len, bufs))} more bytes", name)
        offset += got
        while got and bufs:
            if got >= len(bufs[0]):
                got -= len(bufs.pop(0))
            else:
                bufs[0], got = bufs[0][got:], 0
        if not bufs:
            return
        got = None
