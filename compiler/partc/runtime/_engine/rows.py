"""Whole rows of a column gather read through the page cache by one vectored read per 1024
buffers: each piece of a row lands straight in the destination, each gap between two pieces
(the other ranks' columns) in a small buffer of the reader thread's that is overwritten again
and again. The kernel copies every byte of the rows once, and nothing maps the file, so a
file truncated meanwhile gives a short read, a CheckpointError, never a SIGBUS.

Against reading the rows into a bounce buffer and copying the columns out with numpy
(`spans.span_gather`), the columns are written once instead of twice and no Python runs per
block of rows (measured warm, one thread, rank 0's column slices of the 777.6 MiB checkpoint
of benchmarks/load.py: see docs/performance.md, "Warm loads").
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.runtime._engine.gather import libc_function
from partc.runtime._engine.memory import populate
from partc.runtime._engine.runs import IOV_MAX, fill
from partc.runtime.headers import abort

if TYPE_CHECKING:
    from partc.runtime._engine.gather import Gather
    from partc.runtime._engine.selection import ReadRecorder

_LOCAL = threading.local()
"""Each reader thread's gap buffer."""
_GAP_BYTES = 64 << 10
"""The least a gap buffer holds (one per reader thread, grown for a wider gap)."""


def _gap_buffer(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """This thread's gap buffer, at least `nbytes` long (its contents are never read)."""
    have = getattr(_LOCAL, "gaps", None)
    if have is None or len(have) < nbytes:
        have = _LOCAL.gaps = np.empty(max(nbytes, _GAP_BYTES), dtype=np.uint8)
    return have


_TEMPLATES: dict[tuple[Any, ...], tuple[np.ndarray[Any, Any], int, np.ndarray[Any, Any]]] = {}
"""`row_vectors` of each structure of job (rows, pieces, row and local widths), addresses
relative to its first destination byte and gaps at address 0; its first piece's offset; and
the running total of its buffers' lengths."""
_TEMPLATES_KEPT = 256
"""Structures kept at most (a rank has a few; the cache is emptied past this)."""


def row_vectors(job: Gather, gap_address: int
                ) -> tuple[np.ndarray[Any, Any], int, np.ndarray[Any, Any]]:
    """The buffers of `job`'s rows in file order, as (address, length) rows of uint64: a row's
    pieces, each followed by the gap to the next piece (into `gap_address`), the last piece's
    gap running to the next row's first piece; the file offset of the first piece; and the
    running total of the buffers' lengths (int64).

    The pieces must be in column order (`spans.plan_spans` merges only such jobs). The
    vectors of a structure of job are worked out once (`_TEMPLATES`) and offset per job:
    working them out per job was ~80 us of numpy a job, ~10% of the calling thread's part
    of a warm T=8 load."""
    first, last = job.rows
    local = job.out.shape[1]
    key = (last - first, job.pieces, job.row_bytes, local)
    found = _TEMPLATES.get(key)
    if found is None:
        if len(_TEMPLATES) >= _TEMPLATES_KEPT:
            _TEMPLATES.clear()
        found = _TEMPLATES[key] = _template(job.pieces, last - first, job.row_bytes, local)
    template, start, ends = found
    vectors = template.copy()
    base = job.out.__array_interface__["data"][0] + first * local
    vectors[0::2, 0] += np.uint64(base)
    vectors[1::2, 0] = np.uint64(gap_address)
    return vectors, job.base + first * job.row_bytes + start, ends


def _template(pieces: tuple[tuple[int, int, int], ...], rows: int, row_bytes: int,
              local: int) -> tuple[np.ndarray[Any, Any], int, np.ndarray[Any, Any]]:
    """`row_vectors` of `rows` rows at destination address 0 with gaps at address 0."""
    src = np.array([s for s, _, _ in pieces], np.int64)
    dst = np.array([d for _, d, _ in pieces], np.int64)
    width = np.array([w for _, _, w in pieces], np.int64)
    gaps = np.empty(len(src), np.int64)
    gaps[:-1] = src[1:] - (src[:-1] + width[:-1])
    gaps[-1] = row_bytes - (src[-1] + width[-1]) + src[0]
    at = np.arange(rows, dtype=np.int64)[:, None] * local
    vectors = np.zeros((rows, len(src), 2, 2), np.uint64)
    vectors[:, :, 0, 0] = (at + dst).astype(np.uint64)
    vectors[:, :, 0, 1] = width.astype(np.uint64)
    vectors[:, :, 1, 1] = gaps.astype(np.uint64)
    vectors.flags.writeable = False
    flat = vectors.reshape(-1, 2)[:-1]
    ends = np.cumsum(flat[:, 1].astype(np.int64))
    ends.flags.writeable = False
    return flat, int(src[0]), ends


def vector_gather(job: Gather, recorder: ReadRecorder | None) -> bool:
    """Run a job whose rows are read whole (`merge` True) through the page cache: one preadv
    of up to `IOV_MAX` buffers at a time; False where libc's preadv is not at hand (the
    caller uses the bounce buffer). Each call's destination is faulted in just before it
    (`memory.FAULT_STEP`: a call's pieces are at most 1024 short rows)."""
    read = libc_function("preadv")
    if read is None or not job.pieces:
        return False
    widest = max(job.row_bytes, 1)
    gaps = _gap_buffer(widest)
    vectors, offset, ends = row_vectors(job, gaps.__array_interface__["data"][0])
    count, step = len(vectors), IOV_MAX - 1 if IOV_MAX > 1 else 1
    i = 0
    while i < count:
        j = min(count, i + step)
        if j < count and j % 2 == 0:
            j -= 1  # end a call on a piece: the gap after it is skipped, not read
        before = int(ends[i - 1]) if i else 0
        at = offset + before
        want = int(ends[j - 1]) - before
        chunk = vectors[i:j]
        low = int(chunk[i % 2, 0])  # the call's first piece (it starts on a gap when i is odd)
        last = j - 1 - (j - 1) % 2  # and its last
        populate(low, 0, int(vectors[last, 0] + vectors[last, 1]) - low)
        got = read(job.fd, chunk.__array_interface__["data"][0], j - i, at)
        if got != want:
            if got < 0:
                error = os.strerror(ctypes.get_errno())
                abort(job.path, f"cannot read tensor data: {error}", job.name)
            _refill(job, chunk, at, recorder)  # a short read: again, looping (or refusing)
        elif recorder is not None:
            recorder.record(job.path, at, want)
        i = j + 1  # past the gap after the call's last piece
    return True


def _refill(job: Gather, chunk: np.ndarray[Any, Any], at: int,
            recorder: ReadRecorder | None) -> None:
    """Read one call's buffers again with `runs.fill`, which loops over short reads and names
    a truncated file."""
    bufs = [memoryview((ctypes.c_ubyte * int(n)).from_address(int(address))).cast("B")
            for address, n in chunk.tolist()]
    fill(job.fd, job.path, job.name, bufs, at, recorder)
