"""Finely cut selections (column slices: many short runs in every row), copied by the kernel.

Warm, the rows' pages are in the page cache: process_vm_writev on this very process copies the
pieces out of a read-only mapping of the file into the destination, up to 1024 pieces a call.
The mapping is never touched from user space, so a page past the end of a file truncated
meanwhile makes the call fail (EFAULT) instead of raising SIGBUS. Cold, the pages are not in
the page cache (mincore): a rank loading alone reads every run with O_DIRECT, aligned to the
512-byte sector, so storage sends the run's sectors, not the 4 KiB pages around it (for a run
shorter than a page that is most of the page); ranks of a node loading together go through the
page cache, which fetches the pages their runs share once for all of them. Elsewhere, or when
a call is refused, each piece is one preadv.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.runtime._engine.memory import populate
from partc.runtime._engine.runs import IOV_MAX, fill
from partc.runtime.headers import ITEMSIZE, FileHeader, TensorEntry, abort

if TYPE_CHECKING:
    from partc.runtime._engine.selection import ReadRecorder, TensorSelection

_GATHER_RUN = 32 << 10
"""Selections whose runs average at most this many bytes are gathered."""
_GATHER_BLOCK = 8 << 20
"""File bytes (whole rows) of one gather job."""
_RELEASE_ALIGN = 2 << 20
"""Boundaries a gather job's source rows are released at: the 2 MiB of a page-cache folio
mapped by one page-table entry (x86-64 and 4 KiB-page arm64; a multiple of any page size)."""
_DIRECT_ALIGN = 512
"""Alignment of O_DIRECT reads: the logical sector of the disks this runs on (a file system
that wants more refuses the first read with EINVAL, and gathers then go through the cache)."""
DIRECT_THREADS = 8
"""Reader threads of a node's loads with cold gathers (shared among its loading ranks): small
direct reads wait on storage, not on a core, and a disk serves several at once (measured: 8
threads, 3.6x the reads per second of 1)."""

_COLD_FRACTION = 0.5
"""A gather job whose rows have less than this fraction of their pages in the page cache is
read with O_DIRECT (the host evicts a few idle pages of a warm file now and then: those are
faulted in singly, a page each)."""

_USE_VM_COPY = sys.platform.startswith("linux")
"""Whether warm gathers may copy through process_vm_writev (tests turn it off to cover preadv)."""
_USE_DIRECT = sys.platform.startswith("linux") and hasattr(os, "O_DIRECT")
"""Whether cold gathers may read with O_DIRECT (tests turn it off, or force it on)."""
_LIBC: dict[str, Callable[..., int] | None] = {}
"""libc functions once looked up (None: unavailable or refused)."""


class Gather:
    """A block of rows of a finely cut tensor, its pieces copied by `run_gather`.

    A plain slotted class: a load only builds and reads these records, and creating a dataclass
    costs every runtime import about a millisecond (issue 18).
    """

    __slots__ = ("base", "direct", "fd", "file", "merge", "name", "nbytes", "out", "path",
                 "pieces", "prefetch", "row_bytes", "rows", "source")

    def __init__(self, *, file: int, path: str, name: str, out: np.ndarray[Any, Any], base: int,
                 row_bytes: int, rows: tuple[int, int],
                 pieces: tuple[tuple[int, int, int], ...], nbytes: int) -> None:
        self.file, self.path, self.name, self.nbytes = file, path, name, nbytes
        self.out = out  # destination rows as uint8 [outer, local row bytes]
        self.base = base  # absolute file offset of the tensor's first byte
        self.row_bytes, self.rows = row_bytes, rows
        self.pieces = pieces  # (source column, destination column, width) in bytes, per range
        self.fd = -1
        self.source: GatherFile | None = None  # the file's mapping (and O_DIRECT descriptor),
        # set before the job runs
        self.direct = False  # the rows were not in the page cache when planned: O_DIRECT
        self.prefetch = False  # not in the page cache and the node's ranks load together: the
        # whole rows are asked of storage first (POSIX_FADV_WILLNEED), in large reads, since
        # the node's other ranks read the rest of them
        self.merge: bool | np.ndarray[Any, Any] | None = None  # the read planner's choice
        # (`spans.plan_spans`): None, every piece by itself; True, the rows whole in large
        # requests; a mask, which gaps between consecutive pieces are read through

    def span(self) -> tuple[int, int]:
        """The absolute file bytes [start, end) of the job's rows."""
        first, last = self.rows
        return self.base + first * self.row_bytes, self.base + last * self.row_bytes


def gatherable(entry: TensorEntry, sel: TensorSelection) -> bool:
    """Whether a selection is cut into so many short runs that gathering beats preadv.

    A short run costs a syscall (a few microseconds) for a few KiB; one process_vm_writev
    copies up to 1024 runs, so many short runs are gathered.
    """
    if sel.axis is None or sel.axis == 0:
        return False
    k, shape, item = sel.axis, entry.shape, ITEMSIZE[entry.dtype]
    outer = math.prod(shape[:k])
    inner = math.prod(shape[k + 1:]) * item
    ranges = [(a, b) for a, b in sel.ranges if b > a]
    local_row = sum(b - a for a, b in ranges) * inner
    return (outer > 1 and 0 < local_row < shape[k] * inner  # gaps between the rows' runs
            and local_row / len(ranges) <= _GATHER_RUN)


def column_gathers(file: int, header: FileHeader, entry: TensorEntry, sel: TensorSelection,
                   array: np.ndarray[Any, Any]) -> list[Gather]:
    """Gather jobs of a `gatherable` selection: blocks of about `_GATHER_BLOCK` file bytes."""
    key: tuple[Any, ...] = (sel.axis, sel.ranges, entry.shape, entry.dtype, _GATHER_BLOCK)
    try:
        layout = _LAYOUTS.get(key)
    except TypeError:  # ranges given as lists: worked out each time
        layout = _gather_layout(entry, sel)
    if layout is None:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _gather_layout(entry, sel)
    outer, local_row, row_bytes, pieces, step = layout
    out = array.reshape(-1).view(np.uint8).reshape(outer, local_row)
    base = header.data_start + entry.begin
    return [Gather(file=file, path=header.path, name=entry.name, out=out, base=base,
                   row_bytes=row_bytes, rows=(r, min(outer, r + step)), pieces=pieces,
                   nbytes=(min(outer, r + step) - r) * local_row)
            for r in range(0, outer, step)]


_LAYOUTS: dict[tuple[Any, ...], tuple[int, int, int, tuple[tuple[int, int, int], ...], int]] = {}
"""`_gather_layout` of each structure of tensor and selection (a rank has a few; worked out
per tensor, ~10% of the calling thread's planning of a warm T=8 rank)."""


def _gather_layout(entry: TensorEntry, sel: TensorSelection
                   ) -> tuple[int, int, int, tuple[tuple[int, int, int], ...], int]:
    """(rows, local row bytes, file row bytes, pieces, rows a job) of a gathered selection."""
    k, shape, item = sel.axis or 0, entry.shape, ITEMSIZE[entry.dtype]
    outer = math.prod(shape[:k])
    inner = math.prod(shape[k + 1:]) * item
    ranges = [(a, b) for a, b in sel.ranges if b > a]
    local_row = sum(b - a for a, b in ranges) * inner
    row_bytes = shape[k] * inner
    pieces, at = [], 0
    for a, b in ranges:
        pieces.append((a * inner, at, (b - a) * inner))
        at += (b - a) * inner
    return outer, local_row, row_bytes, tuple(pieces), max(1, _GATHER_BLOCK // row_bytes)


class GatherFile:
    """One file's means of gathering: a read-only mapping of it (whose addresses the kernel
    copies from and whose residency mincore tells) and, once a cold job needs it, an O_DIRECT
    descriptor of the same file. `name` is the first tensor gathered, named by a failure.

    `in_process`: warm pieces are copied out of the mapping by numpy in the reader thread
    instead of by the kernel (process_vm_writev). It is for the zero-copy modes only, whose
    views of the file already raise SIGBUS when it is truncated while they live: a truncation
    during the load then raises SIGBUS too, instead of a CheckpointError. numpy's copy is
    ~25% cheaper a piece (measured: 109 MiB of 1-2.8 KiB pieces, 59,392 of them, in 68-80 ms
    against 82-113 ms, destination faults included).
    """

    def __init__(self, header: FileHeader, fd: int, name: str, *,
                 in_process: bool = False) -> None:
        self.path = header.path
        """The file."""
        self.fd = fd
        """Its checked descriptor."""
        self.in_process = in_process
        """Whether warm pieces are copied by numpy (see the class docstring)."""
        try:
            self.mapping = mmap.mmap(fd, header.file_size, flags=mmap.MAP_SHARED,
                                     prot=mmap.PROT_READ)
        except ValueError:  # Python's mmap checks the size first: the file shrank
            abort(header.path, f"file changed since its header was read: it is shorter than "
                               f"{header.file_size} bytes (truncated file?)", name)
        except OSError as exc:
            abort(header.path, f"cannot map tensor data: {exc.strerror or exc}", name)
        if hasattr(mmap, "MADV_RANDOM"):
            self.mapping.madvise(mmap.MADV_RANDOM)  # a fault reads its page, not its neighbours
        self.device = os.fstat(fd).st_dev
        """The storage device holding the file (its read planner's model: `storage_model`)."""
        view = np.frombuffer(self.mapping, dtype=np.uint8)  # for its address only: never read
        self.address = int(view.ctypes.data)
        """Where the mapping starts."""
        del view
        self.direct_fd = -1
        """The O_DIRECT descriptor (-1: not opened, or refused)."""

    def resident(self, start: int, end: int) -> float:
        """The fraction of the pages of file bytes [start, end) in the page cache (1.0 when
        that cannot be told)."""
        return _resident(self.address, start, end)

    def open_direct(self) -> bool:
        """Open the O_DIRECT descriptor (once); False where the file system refuses it or the
        path now names another file."""
        if self.direct_fd >= 0:
            return True
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        mine, st = os.fstat(self.fd), os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            return False
        self.direct_fd = fd
        return True

    def release(self, start: int, end: int, *, last: bool) -> None:
        """Drop this process's mapping of the file bytes of a job's rows [start, end) (the page
        cache keeps them): a load's resident set then holds one job's rows per thread, not
        every row gathered. `last`: the job holds its tensor's last rows.

        The range released is cut at 2 MiB boundaries (`_RELEASE_ALIGN`): a file read
        sequentially into the page cache is held in 2 MiB folios, which the mapping maps one
        page-table entry each, and dropping part of one splits that entry into 512 (measured:
        releasing each job's exact range cost 14-84 ms of a T=8 load, the 2 MiB-cut ranges
        4-8 ms). A job releases from its first row's boundary to its last row's, and the
        tensor's last job to the boundary after its end, so every 2 MiB of a tensor's rows is
        released once and nothing stays mapped after it; a neighbouring job still reading a
        region released with its neighbour maps it again.
        """
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = start - start % _RELEASE_ALIGN
        stop = -(-end // _RELEASE_ALIGN) * _RELEASE_ALIGN if last else end - end % _RELEASE_ALIGN
        stop = min(stop, len(self.mapping))
        if stop > first:
            self.mapping.madvise(mmap.MADV_DONTNEED, first, stop - first)

    def close(self) -> None:
        """Unmap the file and close the O_DIRECT descriptor."""
        self.mapping.close()
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1


def plan_gathers(jobs: list[Gather], sources: dict[int, GatherFile], *,
                 alone: bool = True) -> bool:
    """Attach each job to its file's `GatherFile`, in the calling thread before any read;
    whether any job's rows are cold (fewer than `_COLD_FRACTION` of their pages cached).

    A rank loading `alone` on its node reads cold rows with O_DIRECT (its own sectors only).
    Ranks of a node loading together read them through the page cache instead: between them
    they read every byte of those rows, so each job first asks storage for its whole rows in
    large reads (the first rank to get there fetches them, the others find them cached), and
    the cache fetches each page once for the whole node rather than a sector run per rank
    (measured at T=8: 2.2x faster than O_DIRECT per rank, and 1.000x the union's bytes fetched
    instead of 1.154x).

    The reader then lets the read planner choose which jobs read their rows whole
    (`spans.plan_spans`).
    """
    cold = False
    for job in jobs:
        source = job.source = sources[job.file]
        if _USE_DIRECT and source.resident(*job.span()) < _COLD_FRACTION:
            cold = True
            if alone and source.open_direct():
                job.direct = True
            else:
                job.prefetch = not alone
    return cold


def run_gather(job: Gather, recorder: ReadRecorder | None) -> None:
    """Copy the selected columns of a block of rows: O_DIRECT when cold, the kernel's copy
    from the mapping when warm, preadv per piece otherwise. Never a SIGBUS."""
    if job.direct and _direct_gather(job, recorder):
        return
    if job.prefetch:
        ask_rows(job)
    if job.source is not None and job.source.in_process:
        _numpy_gather(job)
        if recorder is not None:
            _record_pieces(job, recorder)
        return
    copy = libc_function("process_vm_writev") if _USE_VM_COPY and job.source is not None else None
    if copy is None or not _vm_gather(job, copy):
        _pread_gather(job, recorder)  # records its own reads
        return
    if recorder is not None:
        _record_pieces(job, recorder)


def vm_copy_usable() -> bool:
    """Whether warm pieces can be copied by process_vm_writev here (Linux, and the call not
    refused earlier in this process, as a seccomp filter may refuse it)."""
    return _USE_VM_COPY and libc_function("process_vm_writev") is not None


def copy_pieces(job: Gather) -> bool:
    """Copy a warm job's pieces by themselves (process_vm_writev, as `run_gather` does warm);
    False where the call is unavailable or refused here."""
    copy = libc_function("process_vm_writev") if _USE_VM_COPY else None
    return copy is not None and _vm_gather(job, copy)


def ask_rows(job: Gather) -> None:
    """Ask storage for the job's whole rows now, in large reads (advice only)."""
    start, end = job.span()
    if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_WILLNEED"):
        try:
            os.posix_fadvise(job.fd, start, end - start, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def _record_pieces(job: Gather, recorder: ReadRecorder) -> None:
    """Tell `recorder` of every piece of `job`."""
    path = job.path
    first, last = job.rows
    for row in range(first, last):
        at = job.base + row * job.row_bytes
        for src, _, width in job.pieces:
            recorder.record(path, at + src, width)


def _vm_gather(job: Gather, copy: Callable[..., int]) -> bool:
    """`run_gather` by process_vm_writev from the file's mapping; False when the call is
    refused (the caller falls back to preadv).

    The scattered pieces are the local side (the kernel walks them with its user-copy
    routines, a page fault of the mapping included) and the contiguous destination the
    remote side: its pages are pinned once per 16, not once per piece as process_vm_readv
    with the pieces remote pinned them (measured ~15% faster on 512-byte pieces). Each call's
    destination is faulted in just before it (`memory.FAULT_STEP`).
    """
    import ctypes

    source = job.source
    assert source is not None
    first, last = job.rows
    start, end = job.span()
    iovecs = np.empty((last - first, len(job.pieces), 2), dtype=np.uint64)
    rows = np.arange(last - first, dtype=np.uint64)[:, None] * np.uint64(job.row_bytes)
    iovecs[:, :, 0] = rows + np.array([src for src, _, _ in job.pieces], np.uint64)
    iovecs[:, :, 0] += np.uint64(source.address + start)
    iovecs[:, :, 1] = np.array([width for _, _, width in job.pieces], np.uint64)
    pieces = iovecs.reshape(-1, 2)
    sizes = pieces[:, 1].astype(np.int64)
    out = job.out[first:last]
    address = int(out.ctypes.data)
    target = np.empty((1, 2), dtype=np.uint64)
    done, pid = 0, os.getpid()
    try:
        for i in range(0, len(pieces), IOV_MAX):
            chunk = pieces[i:i + IOV_MAX]
            want = int(sizes[i:i + IOV_MAX].sum())
            target[0] = (address + done, want)
            populate(address, done, done + want)  # each call's destination, just before it
            got = copy(pid, chunk.ctypes.data, len(chunk), target.ctypes.data, 1, 0)
            if got < 0:
                error = ctypes.get_errno()
                if error in (errno.EPERM, errno.ENOSYS, errno.EACCES, errno.EINVAL) and i == 0:
                    _LIBC["process_vm_writev"] = None
                    return False
            if got != want:
                at = _position_of(chunk, max(got, 0), source.address)
                abort(job.path, f"file changed since its header was read: tensor data at "
                                f"byte {at} could not be read (truncated file?)", job.name)
            done += want
    finally:
        source.release(start, end, last=last == job.out.shape[0])
    return True


def _numpy_gather(job: Gather) -> None:
    """`run_gather` by numpy from the file's mapping, in this thread (the zero-copy modes: a
    truncated file raises SIGBUS here, as it does at a view's first touch)."""
    source = job.source
    assert source is not None
    first, last = job.rows
    start, end = job.span()
    out = job.out[first:last]
    populate(int(out.ctypes.data), 0, out.nbytes)
    rows = np.frombuffer(source.mapping, dtype=np.uint8, count=end - start, offset=start)
    rows = rows.reshape(last - first, job.row_bytes)
    try:
        for src, dst, width in job.pieces:
            out[:, dst:dst + width] = rows[:, src:src + width]
    finally:
        del rows
        source.release(start, end, last=last == job.out.shape[0])


def _populate_rows(job: Gather) -> None:
    """Fault in the destination rows of `job` (in the reader thread running it)."""
    first, last = job.rows
    populate(int(job.out.ctypes.data), first * job.out.shape[1], last * job.out.shape[1])


def _row_pieces(job: Gather) -> Iterator[tuple[int, memoryview]]:
    """(absolute file offset, destination bytes) of every piece of `job`, row by row."""
    first, last = job.rows
    for row in range(first, last):
        at = job.base + row * job.row_bytes
        line = job.out[row].data
        for src, dst, width in job.pieces:
            yield at + src, line[dst:dst + width]


def _pread_gather(job: Gather, recorder: ReadRecorder | None) -> None:
    """`run_gather` with one preadv per piece, straight into the destination."""
    preadv, fd, path, name = os.preadv, job.fd, job.path, job.name
    _populate_rows(job)
    try:
        for offset, buf in _row_pieces(job):
            got = preadv(fd, [buf], offset)
            if recorder is not None and got > 0:
                recorder.record(path, offset, got)
            if got != len(buf):
                fill(fd, path, name, [buf[max(got, 0):]], offset + max(got, 0), recorder)
    except OSError as exc:
        abort(job.path, f"cannot read tensor data: {exc.strerror or exc}", job.name)


def _direct_gather(job: Gather, recorder: ReadRecorder | None) -> bool:
    """`run_gather` with one O_DIRECT read per piece: its sectors only, into a bounce buffer,
    then copied; False when the file system refuses the first read (the caller then goes
    through the page cache)."""
    source = job.source
    assert source is not None
    align, path, fd = _DIRECT_ALIGN, job.path, source.direct_fd
    widest = max(width for _, _, width in job.pieces)
    bounce = mmap.mmap(-1, -(-(widest + 2 * align) // mmap.PAGESIZE) * mmap.PAGESIZE)
    staged = memoryview(bounce)
    _populate_rows(job)
    first_read = True
    try:
        for lo, buf in _row_pieces(job):
            aligned = lo - lo % align
            need = lo + len(buf) - aligned
            sectors = -(-need // align) * align
            try:
                got = os.preadv(fd, [staged[:sectors]], aligned)
            except OSError as exc:
                if exc.errno == errno.EINVAL and first_read:
                    return False  # this file system wants other alignment: use the cache
                abort(path, f"cannot read tensor data: {exc.strerror or exc}", job.name)
            first_read = False
            if got < need:
                abort(path, f"file changed since its header was read (truncated file?): "
                            f"tensor data at byte {aligned + max(got, 0)} could not be "
                            "read", job.name)
            buf[:] = staged[lo - aligned:need]
            if recorder is not None:
                recorder.record(path, lo, len(buf))
    finally:
        staged.release()
        bounce.close()
    return True


def _position_of(pieces: np.ndarray[Any, Any], done: int, base: int) -> int:
    """Offset (from `base`) of the first byte a vectored copy of `pieces` did not do."""
    ends = np.cumsum(pieces[:, 1].astype(np.int64))
    i = int(np.searchsorted(ends, done, side="right"))
    if i >= len(pieces):
        return int(pieces[-1, 0]) + int(pieces[-1, 1]) - base
    before = int(ends[i - 1]) if i else 0
    return int(pieces[i, 0]) - base + done - before


_PROBE_WINDOWS = 4
"""Windows of pages `_resident` asks mincore about, spread evenly over the range."""
_PROBE_PAGES = 8
"""Pages in each window."""


def is_cold(address: int, start: int, end: int) -> bool:
    """Whether fewer than `_COLD_FRACTION` of the pages of file bytes [start, end), mapped at
    `address`, are in the page cache (`_resident`)."""
    return _resident(address, start, end) < _COLD_FRACTION


def _resident(address: int, start: int, end: int) -> float:
    """The fraction of the pages of the mapping at `address` covering file bytes [start, end)
    that mincore reports in the page cache; 1.0 where mincore is missing or fails (the kernel
    also answers "all" for a file this process may neither write nor owns).

    A range longer than `_PROBE_WINDOWS` x `_PROBE_PAGES` pages is sampled in that many windows
    spread evenly over it, the first and last first: when those two are wholly cached, or
    wholly not, that is the answer (a job cached at both ends and not between reads as
    cached). It only chooses between two ways of reading a job, and asking about every page
    of every gather job cost ~7% of a small rank's warm load.
    """
    probe = libc_function("mincore")
    if probe is None or end <= start:
        return 1.0
    page = mmap.PAGESIZE
    first = (address + start) // page * page
    pages = (-(-(address + end) // page) * page - first) // page
    window = min(pages, _PROBE_PAGES)
    count = min(_PROBE_WINDOWS, pages // window)
    step = (pages - window) // max(1, count - 1) if count > 1 else 0
    vector, at = _probe_vector(count * window)
    order = [0, count - 1, *range(1, count - 1)] if count > 2 else range(count)
    for done, i in enumerate(order):
        if probe(first + i * step * page, window * page, at + i * window) != 0:
            return 1.0
        if done == 1 and count > 2:  # the first and last windows agree: the rest would,
            ends: int = sum(b & 1 for b in vector[:window]) + sum(  # but for a hole between
                b & 1 for b in vector[i * window:(i + 1) * window])
            if ends in (0, 2 * window):
                return ends / (2 * window)
    cached: int = sum(b & 1 for b in vector[:count * window])
    return cached / (count * window)


_PROBES = threading.local()
"""Each thread's buffer of mincore answers and its address (`_probe_vector`)."""


def _probe_vector(size: int) -> tuple[Any, int]:
    """This thread's buffer of at least `size` mincore answers, and its address, made once a
    thread: a numpy array a call, and numpy to count its answers, were most of a probe's
    ~12-20 us (mincore itself ~2 us a window here)."""
    found = getattr(_PROBES, "vector", None)
    if found is None or len(found[0]) < size:
        import ctypes

        vector = (ctypes.c_ubyte * max(size, _PROBE_WINDOWS * _PROBE_PAGES))()
        found = _PROBES.vector = (vector, ctypes.addressof(vector))
    return found


_SIGNATURES = {"process_vm_writev": ("ssize", ["int", "void*", "ulong", "void*", "ulong",
                                               "ulong"]),
               "mincore": ("int", ["void*", "size", "void*"]),
               "preadv": ("ssize", ["int", "void*", "int", "long"])}


def libc_function(name: str) -> Callable[..., int] | None:
    """libc's `name` (see `_SIGNATURES`), looked up once; None where there is none."""
    if name not in _LIBC:
        found: Callable[..., int] | None = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                kinds = {"int": ctypes.c_int, "long": ctypes.c_long, "ssize": ctypes.c_ssize_t,
                         "size": ctypes.c_size_t,
                         "ulong": ctypes.c_ulong, "void*": ctypes.c_void_p}
                restype, argtypes = _SIGNATURES[name]
                function = getattr(ctypes.CDLL(None, use_errno=True), name)
                function.restype = kinds[restype]
                function.argtypes = [kinds[a] for a in argtypes]
                found = function
            except (OSError, AttributeError, ImportError):
                found = None
        _LIBC[name] = found
    return _LIBC[name]
