"""Read safetensors checkpoints: only the byte runs of the requested slices, straight into
preallocated arrays. Opened checkpoints come from `partc.runtime.checkpoint`.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from partc.runtime.checkpoint import MAX_INDEX_BYTES, Checkpoint, open_checkpoint
from partc.runtime.files import FileStamp
from partc.runtime.headers import (
    _ITEMSIZE,
    DTYPES,
    MAX_HEADER_SIZE,
    FileHeader,
    TensorEntry,
    TensorTable,
    _fail,
    paused_gc,
    read_header,
)
from partc.runtime.manifest import SHARD_FORMAT, SHARD_MANIFEST, ShardManifest, read_shard_manifest
from partc.runtime.memory import _empty, _populate

__all__ = [
    "DTYPES", "MAX_HEADER_SIZE", "MAX_INDEX_BYTES", "SHARD_FORMAT", "SHARD_MANIFEST", "WHOLE",
    "Checkpoint", "CheckpointReader", "FileHeader", "ReadRecorder", "ShardManifest", "TensorEntry",
    "TensorSelection", "TensorTable", "default_workers", "open_checkpoint", "paused_gc",
    "read_header", "read_shard_manifest", "read_tensor", "read_tensors",
]

_SPAN_LIMIT = 8 << 20
_Ints = np.ndarray[Any, np.dtype[np.int64]]
_IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))


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
        if self.axis is None:
            return tuple(shape)
        local = list(shape)
        local[self.axis] = sum(end - start for start, end in self.ranges)
        return tuple(local)


WHOLE = TensorSelection()
"""The selection of an entire tensor."""


def _is_int(value: object) -> bool:
    """Whether `value` is a Python or numpy integer (not a bool)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_selection(header: FileHeader, entry: TensorEntry, sel: TensorSelection) -> None:
    """Refuse a selection that does not fit the tensor's shape."""
    shape = entry.shape
    if sel.axis is None:
        if sel.ranges:
            _fail(header.path, f"selection of {entry.name!r} has ranges but no axis", entry.name)
        return
    if not _is_int(sel.axis) or not 0 <= sel.axis < len(shape):
        _fail(header.path, f"selection axis {sel.axis!r} out of range for shape {list(shape)}",
              entry.name)
    dim = shape[sel.axis]
    for r in sel.ranges:
        if (not isinstance(r, tuple | list) or len(r) != 2 or not _is_int(r[0])
                or not _is_int(r[1]) or not 0 <= r[0] <= r[1] <= dim):
            _fail(header.path, f"selection range {r!r} of {entry.name!r} must satisfy "
                               f"0 <= start <= end <= {dim} (axis {sel.axis} of {list(shape)})",
                  entry.name)


def _runs(entry: TensorEntry, sel: TensorSelection) -> tuple[_Ints, _Ints, _Ints]:
    """Merged byte runs (file offset rel. to the tensor, destination offset, length), file order."""
    item = _ITEMSIZE[entry.dtype]
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


_JOB_BYTES = 16 << 20
"""Bytes of one unit of work handed to a reader thread (long runs are cut to this size)."""
_THREADED_BYTES = 16 << 20
"""Reads smaller than this run in the calling thread."""
_GATHER_RUN = 32 << 10
"""Selections whose runs average at most this many bytes are gathered from a mapping."""


def _positive(raw: str | None) -> int | None:
    """`raw` as a positive integer, or None (unset, empty, not a number, zero)."""
    raw = (raw or "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where known)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def node_ranks(local_ranks: int | None = None) -> int:
    """Ranks loading on this node at once: `local_ranks`, else `PARTC_LOCAL_RANKS`, else
    torchrun's `LOCAL_WORLD_SIZE`, else 1."""
    if local_ranks is not None:
        return max(1, int(local_ranks))
    return (_positive(os.environ.get("PARTC_LOCAL_RANKS"))
            or _positive(os.environ.get("LOCAL_WORLD_SIZE")) or 1)


def default_workers(local_ranks: int | None = None) -> int:
    """Reader threads of one rank: `PARTC_READ_THREADS`, else the node's cores shared among its
    loading ranks (`node_ranks`), at least 1 and at most 8.

    Reads from the page cache are memory copies: more threads than cores on a node only make
    the ranks take turns (measured: 2T threads on 2 cores made the slowest of T ranks 2x-4x
    slower than one rank alone).
    """
    forced = _positive(os.environ.get("PARTC_READ_THREADS"))
    if forced is not None:
        return forced
    return max(1, min(8, usable_cores() // node_ranks(local_ranks)))


@dataclass(slots=True)
class _Job:
    """A slice of one file's sorted runs: what one reader thread reads in one go."""

    file: int
    path: Path
    names: list[str]
    views: list[memoryview]
    addresses: list[int]
    src: _Ints
    dst: _Ints
    length: _Ints
    owner: _Ints
    nbytes: int
    fd: int = -1


class _ReadPlan:
    """Every run of a batch of reads, gathered per file, then cut into sorted jobs."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.views: list[memoryview] = []
        self.addresses: list[int] = []
        self.parts: dict[int, list[tuple[_Ints, _Ints, _Ints, _Ints]]] = {}
        self.nbytes = 0

    def add(self, file: int, base: int, name: str, array: np.ndarray[Any, Any], src: _Ints,
            dst: _Ints, length: _Ints) -> None:
        """Add the runs of one tensor (offsets relative to `base`) destined for `array`."""
        owner = np.full(len(src), len(self.names), dtype=np.int64)
        self.names.append(name)
        self.views.append(array.reshape(-1).view(np.uint8).data)
        self.addresses.append(int(array.ctypes.data))
        self.parts.setdefault(file, []).append((src + base, dst, length, owner))
        self.nbytes += int(length.sum())

    def jobs(self, files: tuple[FileHeader, ...], limit: int) -> list[_Job]:
        """The runs of each file in offset order, long runs cut, grouped into ~`limit` jobs."""
        jobs = []
        for file in sorted(self.parts):
            src, dst, length, owner = (np.concatenate(c) for c in zip(*self.parts[file],
                                                                      strict=True))
            if int(length.max()) > limit:
                src, dst, length, owner = _cut(src, dst, length, owner, limit)
            if len(src) > 1 and not bool(np.all(src[1:] > src[:-1])):
                order = np.argsort(src, kind="stable")
                src, dst, length, owner = src[order], dst[order], length[order], owner[order]
            ends = np.cumsum(length)
            bucket = (ends - length) // limit
            cuts = [0, *(np.flatnonzero(bucket[1:] != bucket[:-1]) + 1).tolist(), len(src)]
            for i, j in zip(cuts, cuts[1:], strict=False):
                jobs.append(_Job(file=file, path=files[file].path, names=self.names,
                                 views=self.views, addresses=self.addresses, src=src[i:j],
                                 dst=dst[i:j], length=length[i:j], owner=owner[i:j],
                                 nbytes=int(ends[j - 1] - ends[i] + length[i])))
        return jobs


def _job_start(job: _Job | _Gather) -> tuple[int, int]:
    """Sort key of a job: its file, then its first byte."""
    if isinstance(job, _Gather):
        return job.file, job.base + job.rows[0] * job.row_bytes
    return job.file, int(job.src[0])


def _cut(src: _Ints, dst: _Ints, length: _Ints, owner: _Ints, limit: int
         ) -> tuple[_Ints, _Ints, _Ints, _Ints]:
    """Split runs longer than `limit` bytes into consecutive pieces of at most `limit`."""
    pieces = (length + limit - 1) // limit
    index = np.repeat(np.arange(len(src)), pieces)
    step = (np.arange(len(index)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * limit
    return (src[index] + step, dst[index] + step, np.minimum(limit, length[index] - step),
            owner[index])


@dataclass(slots=True)
class _Gather:
    """A block of rows of a finely cut tensor: its pieces copied by the kernel (see
    `_run_gather`)."""

    file: int
    path: Path
    name: str
    out: np.ndarray[Any, Any]
    """Destination rows as uint8 [outer, local row bytes]."""
    base: int
    """Absolute file offset of the tensor's first byte."""
    row_bytes: int
    rows: tuple[int, int]
    pieces: tuple[tuple[int, int, int], ...]
    """(source column, destination column, width) in bytes, per selected range."""
    nbytes: int
    fd: int = -1


def _gatherable(entry: TensorEntry, sel: TensorSelection) -> bool:
    """Whether a selection is cut into so many short runs that gathering beats preadv.

    A short run costs a syscall (a few microseconds) for a few KiB; one process_vm_readv copies
    up to 1024 runs, so many short runs are gathered (see `_run_gather`).
    """
    if sel.axis is None or sel.axis == 0:
        return False
    k, shape, item = sel.axis, entry.shape, _ITEMSIZE[entry.dtype]
    outer = math.prod(shape[:k])
    inner = math.prod(shape[k + 1:]) * item
    ranges = [(a, b) for a, b in sel.ranges if b > a]
    local_row = sum(b - a for a, b in ranges) * inner
    return (outer > 1 and 0 < local_row < shape[k] * inner  # gaps between the rows' runs
            and local_row / len(ranges) <= _GATHER_RUN)


def _gathers(file: int, header: FileHeader, entry: TensorEntry, sel: TensorSelection,
             array: np.ndarray[Any, Any]) -> list[_Gather]:
    """Gather jobs of a `_gatherable` selection: blocks of about `_SPAN_LIMIT` file bytes."""
    k, shape, item = sel.axis or 0, entry.shape, _ITEMSIZE[entry.dtype]
    outer = math.prod(shape[:k])
    inner = math.prod(shape[k + 1:]) * item
    ranges = [(a, b) for a, b in sel.ranges if b > a]
    local_row = sum(b - a for a, b in ranges) * inner
    row_bytes = shape[k] * inner
    pieces, at = [], 0
    for a, b in ranges:
        pieces.append((a * inner, at, (b - a) * inner))
        at += (b - a) * inner
    out = array.reshape(-1).view(np.uint8).reshape(outer, local_row)
    step = max(1, _SPAN_LIMIT // row_bytes)
    base = header.data_start + entry.begin
    return [_Gather(file=file, path=header.path, name=entry.name, out=out, base=base,
                    row_bytes=row_bytes, rows=(r, min(outer, r + step)), pieces=tuple(pieces),
                    nbytes=(min(outer, r + step) - r) * local_row)
            for r in range(0, outer, step)]


class CheckpointReader:
    """Reads selected tensor elements straight into fresh arrays; opens each file once."""

    def __init__(self, checkpoint: Checkpoint, *, recorder: ReadRecorder | None = None,
                 max_gap: int = 0, workers: int | None = None, mapped: bool = True,
                 zero_copy: bool = False, local_ranks: int | None = None) -> None:
        self.checkpoint = checkpoint
        """The checkpoint read from."""
        self.recorder = recorder
        """Told of every byte run read, when set."""
        self.max_gap = max_gap
        """Runs this close (bytes) are read as one span (gaps included) and gathered; 0: exact."""
        self.workers = default_workers(local_ranks) if workers is None else max(1, workers)
        """Threads `read_many` may use for a large read."""
        self.mapped = mapped
        """Whether `read_many` gathers finely cut selections from read-only mappings."""
        self.zero_copy = zero_copy
        """Whether `read_many` returns a selection that is one contiguous byte run as a
        read-only view of the mapped file (see `_view`) instead of a copy."""
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, mmap.mmap] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every file opened so far."""
        fds, self._fds = self._fds, {}
        self._maps = {}  # views keep their mapping alive; it is unmapped with the last one
        for fd in fds.values():
            os.close(fd)

    def _fd(self, header: FileHeader) -> int:
        """The descriptor of `header`'s file, opened and checked on first use."""
        fd = self._fds.get(header.path)
        if fd is None:
            try:
                fd = os.open(header.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                _fail(header.path, f"cannot open checkpoint file: {exc.strerror or exc}")
            self._fds[header.path] = fd  # closed by close() even when a check below fails
            _no_readahead(fd)
            try:
                st = os.fstat(fd)
            except OSError as exc:
                _fail(header.path, f"cannot examine checkpoint file: {exc.strerror or exc}")
            _check_stamp(header, st, "since its header was read")
        return fd

    def _check_unchanged(self, files: Iterable[int]) -> None:
        """After reading: every file read is still the one whose header was read, unchanged.

        A file replaced (renamed over) or deleted while being read is named as such; one
        truncated, extended or rewritten in place shows in its size or modification time.
        """
        for file in sorted(set(files)):
            header = self.checkpoint.files[file]
            fd = self._fds.get(header.path)
            if fd is None:
                continue
            try:
                now = os.stat(header.path)
                st = os.fstat(fd)
            except FileNotFoundError:
                _fail(header.path, "checkpoint file disappeared while being read (deleted or "
                                   "renamed); expected it to stay in place until the load ends")
            except OSError as exc:
                _fail(header.path, f"cannot examine checkpoint file: {exc.strerror or exc}")
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                _fail(header.path, "checkpoint file was replaced while being read: the path now "
                                   "names another file; expected it unchanged until the load ends")
            _check_stamp(header, st, "while being read")

    def read(self, name: str, selection: TensorSelection = WHOLE) -> np.ndarray[Any, Any]:
        """The selected part of tensor `name` as a new C-contiguous array."""
        if self.max_gap <= 0:
            return self.read_many([(name, selection)])[name]
        header, entry = self.checkpoint.tensor(name)
        _check_selection(header, entry, selection)
        out = _empty(selection.local_shape(entry.shape), DTYPES[entry.dtype])
        src, dst, length = _runs(entry, selection)
        if len(src):
            fd, base = self._fd(header), header.data_start + entry.begin
            flat = out.reshape(-1).view(np.uint8)
            self._read_coalesced(fd, str(header.path), entry.name, flat, base, src, dst, length)
            self._check_unchanged([self.checkpoint.owners[name]])
        return out

    def read_many(self, requests: Iterable[tuple[str, TensorSelection]], *,
                  progress: Callable[[int], None] | None = None
                  ) -> dict[str, np.ndarray[Any, Any]]:
        """Several selections read in (file, offset) order; the dict follows request order.

        The runs of every tensor are merged per file, so file-contiguous runs of neighbouring
        tensors share one preadv; a large read is spread over `workers` threads (preadv releases
        the GIL). `progress` is called in this thread with the bytes of every finished job.
        """
        todo = list(requests)
        seen: set[str] = set()
        for name, _ in todo:
            header, _ = self.checkpoint.tensor(name)
            if name in seen:
                _fail(header.path, f"tensor {name!r} requested twice", name)
            seen.add(name)
        if self.max_gap > 0:
            ckpt = self.checkpoint
            order = sorted(range(len(todo)), key=lambda i: (
                ckpt.owners[todo[i][0]], ckpt.tensor(todo[i][0])[1].begin))
            got = {i: self.read(*todo[i]) for i in order}
            return {todo[i][0]: got[i] for i in range(len(todo))}
        out: dict[str, np.ndarray[Any, Any]] = {}
        plan = _ReadPlan()
        gathers: list[_Gather] = []
        for name, selection in todo:
            header, entry = self.checkpoint.tensor(name)
            _check_selection(header, entry, selection)
            file = self.checkpoint.owners[name]
            if self.zero_copy:
                view = self._view(header, entry, selection)
                if view is not None:
                    out[name] = view
                    continue
            gather = self.mapped and _gatherable(entry, selection)
            array = _empty(selection.local_shape(entry.shape), DTYPES[entry.dtype])
            out[name] = array
            if gather:
                gathers.extend(_gathers(file, header, entry, selection, array))
                continue
            src, dst, length = _runs(entry, selection)
            if len(src):
                plan.add(file, header.data_start + entry.begin, name, array, src, dst, length)
        jobs: list[_Job | _Gather] = [*plan.jobs(self.checkpoint.files, _JOB_BYTES), *gathers]
        for job in jobs:
            job.fd = self._fd(self.checkpoint.files[job.file])
        jobs.sort(key=_job_start)
        nbytes = plan.nbytes + sum(g.nbytes for g in gathers)
        if len(jobs) < 2 or self.workers < 2 or nbytes < _THREADED_BYTES:
            for job in jobs:
                self._run_job(job)
                if progress is not None:
                    progress(job.nbytes)
        else:
            self._run_threaded(jobs, progress)
        mapped = [i for i, h in enumerate(self.checkpoint.files) if h.path in self._maps]
        self._check_unchanged([*(job.file for job in jobs), *mapped])
        return out

    def _view(self, header: FileHeader, entry: TensorEntry, sel: TensorSelection
              ) -> np.ndarray[Any, Any] | None:
        """The selection as a read-only view of the mapped file, when it is one byte run.

        Nothing is read here: pages come in when the view is first touched. Unlike the copying
        path, a view can raise SIGBUS on first touch if the file is truncated after the load.
        """
        src, _, _ = _runs(entry, sel)
        if len(src) != 1:
            return None
        mapping = self._maps.get(header.path)
        if mapping is None:
            fd = self._fd(header)
            try:
                mapping = mmap.mmap(fd, header.file_size, access=mmap.ACCESS_READ)
            except ValueError:  # Python's mmap checks the size first: the file shrank
                _fail(header.path, f"file changed since its header was read: it is shorter "
                                   f"than {header.file_size} bytes (truncated file?)", entry.name)
            except OSError as exc:
                _fail(header.path, f"cannot map checkpoint file: {exc.strerror or exc}",
                      entry.name)
            self._maps[header.path] = mapping
        shape = sel.local_shape(entry.shape)
        view = np.frombuffer(mapping, dtype=DTYPES[entry.dtype], count=math.prod(shape),
                             offset=header.data_start + entry.begin + int(src[0]))
        return view.reshape(shape)

    def _run_threaded(self, jobs: list[_Job | _Gather], progress: Callable[[int], None] | None
                      ) -> None:
        """Run jobs on `workers` threads taking them in order; the first error is re-raised.

        Plain threads and a queue: concurrent.futures costs ~12 ms to import, a tenth of a
        small rank's load.
        """
        import queue
        import threading

        todo = iter(jobs)
        lock = threading.Lock()
        finished: queue.SimpleQueue[tuple[int, BaseException | None]] = queue.SimpleQueue()
        failed = threading.Event()

        def work() -> None:
            while not failed.is_set():
                with lock:
                    job = next(todo, None)
                if job is None:
                    return
                try:
                    self._run_job(job)
                except BaseException as error:  # handed to the calling thread
                    failed.set()
                    finished.put((0, error))
                    return
                finished.put((job.nbytes, None))

        threads = [threading.Thread(target=work, name=f"partc-read-{i}", daemon=True)
                   for i in range(min(self.workers, len(jobs)))]
        for thread in threads:
            thread.start()
        try:
            for _ in jobs:
                nbytes, error = finished.get()
                if error is not None:
                    raise error
                if progress is not None:
                    progress(nbytes)
        finally:
            failed.set()
            for thread in threads:
                thread.join()

    def _run_job(self, job: _Job | _Gather) -> None:
        """Read one job's runs (sorted by file offset); one preadv per file-contiguous batch."""
        if isinstance(job, _Gather):
            self._run_gather(job)
            return
        path, names, views = str(job.path), job.names, job.views
        _populate_job(job)
        src, dst, length, owner = (a.tolist() for a in (job.src, job.dst, job.length, job.owner))
        fd, recorder, preadv = job.fd, self.recorder, os.preadv
        i, count = 0, len(src)
        try:
            while i < count:
                j, end = i + 1, src[i] + length[i]
                while j < count and j - i < _IOV_MAX and src[j] == end:
                    end, j = end + length[j], j + 1
                if j == i + 1:  # hot path of column slices: one run straight into its array
                    d, n = dst[i], length[i]
                    bufs = [views[owner[i]][d:d + n]]
                    got = preadv(fd, bufs, src[i])
                    if recorder is not None and got > 0:
                        recorder.record(path, src[i], got)
                    if got != n:
                        self._fill(fd, path, names[owner[i]], bufs, src[i], got)
                else:
                    bufs = [views[owner[k]][dst[k]:dst[k] + length[k]] for k in range(i, j)]
                    self._fill(fd, path, names[owner[i]], bufs, src[i])
                i = j
        except OSError as exc:
            _fail(path, f"cannot read tensor data: {exc.strerror or exc}", names[owner[i]])

    def _run_gather(self, job: _Gather) -> None:
        """Copy the selected columns of a block of rows, by the kernel: never a SIGBUS.

        On Linux the rows are mapped read-only and process_vm_readv (on this very process)
        copies every piece; the mapping is never touched from user space, so a page past the
        end of a file truncated meanwhile makes the call fail (EFAULT) instead of raising
        SIGBUS. Elsewhere, or when that call is refused, each piece is one preadv.
        """
        copy = _vm_reader() if _USE_VM_READ else None
        if copy is None or not self._vm_gather(job, copy):
            self._pread_gather(job)  # records its own reads
            return
        recorder = self.recorder
        if recorder is not None:
            path = str(job.path)
            first, last = job.rows
            for row in range(first, last):
                at = job.base + row * job.row_bytes
                for src, _, width in job.pieces:
                    recorder.record(path, at + src, width)

    def _vm_gather(self, job: _Gather, copy: Callable[..., int]) -> bool:
        """`_run_gather` through a mapping and process_vm_readv; False when the call is refused
        (the caller falls back to preadv)."""
        import ctypes

        first, last = job.rows
        start = job.base + first * job.row_bytes
        end = job.base + last * job.row_bytes
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(job.fd, end - aligned, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ, offset=aligned)
        except ValueError:  # Python's mmap checks the size first: the file shrank
            _fail(job.path, f"file changed since its header was read: it ends before byte {end} "
                            "(truncated file?)", job.name)
        except OSError as exc:
            _fail(job.path, f"cannot map tensor data: {exc.strerror or exc}", job.name)
        if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            mapping.madvise(mmap.MADV_RANDOM)  # a fault reads its page, not its neighbours
        try:
            view = np.frombuffer(mapping, dtype=np.uint8)  # for its address only: never read
            remote_base = int(view.ctypes.data) + start - aligned
            del view
            rows = np.arange(last - first, dtype=np.uint64)[:, None] * np.uint64(job.row_bytes)
            iovecs = np.empty((len(rows), len(job.pieces), 2), dtype=np.uint64)
            iovecs[:, :, 0] = rows + np.array([src for src, _, _ in job.pieces], np.uint64)
            iovecs[:, :, 0] += np.uint64(remote_base)
            iovecs[:, :, 1] = np.array([width for _, _, width in job.pieces], np.uint64)
            remote = iovecs.reshape(-1, 2)
            sizes = remote[:, 1].astype(np.int64)
            out = job.out[first:last]
            address = int(out.ctypes.data)
            _populate(address, 0, out.nbytes)
            local = np.empty((1, 2), dtype=np.uint64)
            local_base, done = int(out.ctypes.data), 0
            pid = os.getpid()
            for i in range(0, len(remote), _IOV_MAX):
                chunk = remote[i:i + _IOV_MAX]
                want = int(sizes[i:i + _IOV_MAX].sum())
                local[0] = (local_base + done, want)
                got = copy(pid, local.ctypes.data, 1, chunk.ctypes.data, len(chunk), 0)
                if got < 0:
                    error = ctypes.get_errno()
                    if error in (errno.EPERM, errno.ENOSYS, errno.EACCES, errno.EINVAL) \
                            and i == 0:
                        _disable_vm_read()
                        return False
                if got != want:
                    at = start + _position_of(remote[i:i + _IOV_MAX], max(got, 0), remote_base)
                    _fail(job.path, f"file changed since its header was read: tensor data at "
                                    f"byte {at} could not be read (truncated file?)", job.name)
                done += want
        finally:
            mapping.close()
        return True

    def _pread_gather(self, job: _Gather) -> None:
        """`_run_gather` with one preadv per piece, straight into the destination."""
        first, last = job.rows
        preadv, fd, path, name = os.preadv, job.fd, str(job.path), job.name
        out, recorder = job.out, self.recorder
        _populate(int(out.ctypes.data), first * out.shape[1], last * out.shape[1])
        try:
            for row in range(first, last):
                at = job.base + row * job.row_bytes
                line = out[row].data
                for src, dst, width in job.pieces:
                    buf = line[dst:dst + width]
                    got = preadv(fd, [buf], at + src)
                    if recorder is not None and got > 0:
                        recorder.record(path, at + src, got)
                    if got != width:
                        self._fill(fd, path, name, [buf[max(got, 0):]], at + src + max(got, 0))
        except OSError as exc:
            _fail(job.path, f"cannot read tensor data: {exc.strerror or exc}", job.name)

    def _read_coalesced(self, fd: int, path: str, name: str, flat: np.ndarray[Any, Any],
                        base: int, src: _Ints, dst: _Ints, length: _Ints) -> None:
        """Read runs with gaps of at most `max_gap` bytes as one span each, then gather."""
        last = src + length - 1
        window = src // _SPAN_LIMIT
        join = ((src[1:] - last[:-1] - 1 <= self.max_gap) & (src[1:] > last[:-1])
                & (window[1:] == window[:-1]) & (last[1:] // _SPAN_LIMIT == window[1:])
                & (last[:-1] // _SPAN_LIMIT == window[:-1]))
        cuts = [0, *(np.flatnonzero(~join) + 1).tolist(), len(src)]
        out = flat.data
        for i, j in zip(cuts, cuts[1:], strict=False):
            first = int(src[i])
            if j == i + 1:
                self._fill(fd, path, name, [out[int(dst[i]):int(dst[i] + length[i])]],
                            base + first)
                continue
            span = np.empty(int(last[j - 1]) + 1 - first, dtype=np.uint8)
            self._fill(fd, path, name, [span.data], base + first)
            rel, d, n = src[i:j] - first, dst[i:j], length[i:j]
            size, step = int(n[0]), int(rel[1] - rel[0])
            if (np.all(n == size) and np.all(np.diff(d) == size)
                    and np.all(np.diff(rel) == step)):  # evenly strided: one numpy copy
                pieces = np.lib.stride_tricks.as_strided(span, (j - i, size), (step, 1))
                flat[int(d[0]):int(d[0]) + (j - i) * size].reshape(j - i, size)[...] = pieces
            else:
                for r, dd, nn in zip(rel.tolist(), d.tolist(), n.tolist(), strict=True):
                    flat[dd:dd + nn] = span[r:r + nn]

    def _fill(self, fd: int, path: str, name: str, bufs: list[memoryview], offset: int,
              got: int | None = None) -> None:
        """Fill `bufs` from the file at `offset`, looping over short reads (`got`: done already)."""
        bufs = list(bufs)
        while True:
            if got is None:
                try:
                    got = os.preadv(fd, bufs, offset)
                except OSError as exc:
                    _fail(path, f"cannot read tensor data: {exc.strerror or exc}", name)
                if self.recorder is not None and got > 0:
                    self.recorder.record(path, offset, got)
            if got <= 0:
                _fail(path, f"file changed since its header was read (truncated file?): read "
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


def _populate_job(job: _Job) -> None:
    """Fault in every destination range of a job (per array: from its first to its last byte)."""
    if len(job.owner) == 1:
        d = int(job.dst[0])
        _populate(job.addresses[int(job.owner[0])], d, d + int(job.length[0]))
        return
    owners = job.owner
    if bool(np.all(owners[1:] >= owners[:-1])):
        cuts = [0, *(np.flatnonzero(owners[1:] != owners[:-1]) + 1).tolist(), len(owners)]
        groups = [(int(owners[i]), job.dst[i:j], job.length[i:j])
                  for i, j in zip(cuts, cuts[1:], strict=False)]
    else:
        groups = [(int(o), job.dst[owners == o], job.length[owners == o])
                  for o in np.unique(owners).tolist()]
    for owner, dst, length in groups:
        _populate(job.addresses[owner], int(dst.min()), int((dst + length).max()))


def _no_readahead(fd: int) -> None:
    """Tell the kernel reads of `fd` are random: a cold read then fetches the pages it asks for,
    not a readahead window of the neighbouring tensors (other ranks' columns). Large reads
    still go to storage in large requests; only the speculative window is dropped."""
    if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_RANDOM"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:  # advice only (e.g. a FIFO or a file system that refuses it)
            pass


def _check_stamp(header: FileHeader, st: os.stat_result, when: str) -> None:
    """Refuse a file whose stat no longer matches the one taken when its header was read."""
    stamp, now = header.stamp, FileStamp.of(st)
    if stamp is not None and (stamp.device, stamp.inode) != (now.device, now.inode):
        _fail(header.path, f"checkpoint file was replaced {when}: the path names another file "
                           f"(inode {now.inode}, expected {stamp.inode})")
    if now.size != header.file_size:
        _fail(header.path, f"file changed {when}: size {now.size}, expected "
                           f"{header.file_size} (truncated file?)")
    if stamp is not None and now.mtime_ns != stamp.mtime_ns:
        _fail(header.path, f"file changed {when}: it was modified (mtime {now.mtime_ns} ns, "
                           f"expected {stamp.mtime_ns} ns)")


def _position_of(remote: np.ndarray[Any, Any], done: int, base: int) -> int:
    """Offset (from `base`) of the first byte a vectored copy of `remote` iovecs did not do."""
    ends = np.cumsum(remote[:, 1].astype(np.int64))
    i = int(np.searchsorted(ends, done, side="right"))
    if i >= len(remote):
        return int(remote[-1, 0]) + int(remote[-1, 1]) - base
    before = int(ends[i - 1]) if i else 0
    return int(remote[i, 0]) - base + done - before


_USE_VM_READ = sys.platform.startswith("linux")
"""Whether gathers may copy through process_vm_readv (tests turn it off to cover preadv)."""
_VM_READ: list[Callable[..., int] | None] = []
"""The process_vm_readv function once looked up (None: unavailable); empty before."""


def _vm_reader() -> Callable[..., int] | None:
    """libc's process_vm_readv, looked up once; None where there is none."""
    if not _VM_READ:
        found: Callable[..., int] | None = None
        try:
            import ctypes

            function = ctypes.CDLL(None, use_errno=True).process_vm_readv
            function.restype = ctypes.c_ssize_t
            function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                 ctypes.c_ulong, ctypes.c_ulong]
            found = function
        except (OSError, AttributeError, ImportError):
            found = None
        _VM_READ.append(found)
    return _VM_READ[0]


def _disable_vm_read() -> None:
    """Use preadv for gathers from now on (process_vm_readv was refused, e.g. by seccomp)."""
    _VM_READ[:] = [None]


def read_tensor(checkpoint: Checkpoint, name: str, selection: TensorSelection = WHOLE, *,
                reader: ReadRecorder | None = None) -> np.ndarray[Any, Any]:
    """Read only the selected elements of tensor `name` into a new C-contiguous array."""
    with CheckpointReader(checkpoint, recorder=reader) as r:
        return r.read(name, selection)


def read_tensors(checkpoint: Checkpoint, requests: Iterable[tuple[str, TensorSelection]], *,
                 reader: ReadRecorder | None = None, workers: int | None = None,
                 progress: Callable[[int], None] | None = None, zero_copy: bool = False,
                 local_ranks: int | None = None) -> dict[str, np.ndarray[Any, Any]]:
    """Read several selections in (file, offset) order, opening each file once (`zero_copy`:
    one-run selections as read-only views of the mapped file; `local_ranks`: see
    `default_workers`)."""
    with CheckpointReader(checkpoint, recorder=reader, workers=workers, zero_copy=zero_copy,
                          local_ranks=local_ranks) as r:
        return r.read_many(requests, progress=progress)
