"""Destination memory of reads: large arrays in their own anonymous mappings, faulted in by the
reader thread that fills them."""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

_MAPPED_ARRAY_BYTES = 1 << 20
"""Arrays at least this large get their own anonymous mapping (see `empty_array`)."""


def empty_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A new writable array; a large one gets its own private anonymous mapping, not faulted in.

    Every destination page is first touched by the load itself, so the reader thread that fills
    a job faults its pages in first, in one call (`populate`), instead of one trap per 4 KiB
    page (measured ~10% of a load) or all of them serially here before any read starts
    (MAP_POPULATE: measured 54-59% of a load). numpy's own large arrays ask for transparent huge
    pages, which measured ~1.6x slower to fault in here than 4 KiB pages.
    """
    count = math.prod(shape)
    if count * dtype.itemsize < _MAPPED_ARRAY_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


FAULT_STEP = 1 << 20
"""The most destination bytes faulted in (`populate`) ahead of the read that fills them. The
kernel zeroes each fresh page as it faults it in; read right after, the zeroed lines are still
in the core's cache (1 MiB of L2 a core here) and the copy writes over them there, where a
whole job's destination faulted in first (16 MiB) has gone back to memory and is fetched again
(measured, one thread, 96 MiB of warm checkpoint rows: 41-45 ms in 1 MiB steps, 48-53 ms all
faulted in first, 46-52 ms in 8 MiB steps; docs/performance.md, "Warm loads")."""
_MADV_POPULATE_WRITE = 23
"""Linux's madvise(MADV_POPULATE_WRITE) (5.14+): fault a writable range in, in one call."""
_PAGE = mmap.PAGESIZE
_MADVISE: list[Callable[[int, int, int], int] | None] = []
"""libc's madvise once looked up (None: unavailable or refused); empty before."""


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, looked up once (Linux only); None where there is none."""
    if not _MADVISE:
        found: Callable[[int, int, int], int] | None = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                function = ctypes.CDLL(None, use_errno=True).madvise
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                found = function
            except (OSError, AttributeError, ImportError):
                found = None
        _MADVISE.append(found)
    return _MADVISE[0]


def populate(address: int, start: int, end: int) -> None:
    """Fault in the destination bytes [start, end) of the array at `address`, in this thread.

    Best effort: where the call is missing or refused, the copy faults the pages in itself.
    ctypes releases the GIL, so reader threads fault their own jobs in parallel.
    """
    advise = _madvise() if end - start >= _PAGE else None
    if advise is None:
        return
    first = (address + start) // _PAGE * _PAGE
    last = -(-(address + end) // _PAGE) * _PAGE
    if advise(first, last - first, _MADV_POPULATE_WRITE) != 0:
        _MADVISE[:] = [None]  # an older kernel (EINVAL): let the copies fault
