"""Column gathers read as planned spans: the read planner (`partc.runtime.read_planner`) decides
for every gap between a gather job's pieces whether it is read through; a job whose gaps are
all read through reads its rows whole, in large sequential requests, into a reused bounce
buffer and copies its columns out with numpy (cold and alone: O_DIRECT, sector-aligned; a node's
ranks together: the page cache, whole rows asked for first), or, warm, straight into the
destination by vectored reads (`rows.vector_gather`). Warm with no cap, a job reads its rows
whole or copies its pieces by themselves, whichever the page cache's models say is faster
(`_warm_way`). A read that comes back short is a truncated file: a CheckpointError, never a
SIGBUS (no mapping is touched).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.runtime._engine.gather import ask_rows, is_cold, vm_copy_usable
from partc.runtime._engine.memory import populate
from partc.runtime._engine.rows import vector_gather
from partc.runtime._engine.runs import fill
from partc.runtime.headers import abort
from partc.runtime.read_planner import (
    WARM,
    StorageModel,
    plan_merges,
    storage_model,
    warm_rows_whole,
)

if TYPE_CHECKING:
    from partc.runtime._engine.gather import Gather
    from partc.runtime._engine.selection import ReadRecorder

BOUNCE_BYTES = 1 << 20
"""Bytes one O_DIRECT request of a coalesced gather reads (the bounce buffer each reader thread
reuses; rows wider than this are read one at a time): 1 MiB requests, 8 in flight, measured
1.4 GB/s here, as fast as 8 MiB ones."""
CACHED_BYTES = 256 << 10
"""Bytes one read through the page cache copies into the bounce buffer: small enough to stay in
the core's cache for numpy's copy out (measured warm at T=2: 30 ms for 109 MiB of column
slices in 256 KiB reads, against 75 ms by process_vm_writev a piece)."""
DIRECT_ALIGN = 512
"""Alignment of O_DIRECT reads (the logical sector of the disks this runs on)."""
PAGE_ALIGN = 4096
"""What a read through the page cache fetches from storage: whole pages."""

_VECTORED = True
"""Whether whole rows read through the page cache go straight to their destination
(`rows.vector_gather`; tests turn it off to cover the bounce buffer)."""
_LOCAL = threading.local()
"""Each reader thread's bounce buffer."""


def _bounce(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """This thread's bounce buffer, at least `nbytes` long, page-aligned (O_DIRECT needs it)."""
    have = getattr(_LOCAL, "buffer", None)
    if have is None or len(have) < nbytes:
        size = -(-max(nbytes, BOUNCE_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE
        have = _LOCAL.buffer = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    return have


def job_runs(job: Gather) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Absolute (start, end) file offsets of every piece of `job`, row by row (file order when
    its ranges are in column order)."""
    first, last = job.rows
    rows = (job.base + np.arange(first, last, dtype=np.int64) * job.row_bytes)[:, None]
    starts = (rows + np.array([src for src, _, _ in job.pieces], np.int64)).ravel()
    ends = starts + np.tile(np.array([w for _, _, w in job.pieces], np.int64), last - first)
    return starts, ends


def plan_spans(jobs: list[Gather], share: int, cap: float | None) -> None:
    """Set every job's `merge` (see `Gather.merge`) by the read planner, one plan per file and
    way of reading (O_DIRECT, the page cache cold, the page cache warm). Under a cap the rank
    may read `(cap - 1) x share` bytes over its `share` (whose other runs are read exactly):
    each plan gets its pieces' bytes plus its pro rata part of that room."""
    groups: dict[tuple[int, str], list[Gather]] = {}
    for job in jobs:
        if job.source is not None and job.source.in_process and not job.direct:
            continue  # the zero-copy modes copy from the mapping, piece by piece
        way = "direct" if job.direct else "cold" if job.prefetch else "warm"
        groups.setdefault((job.file, way), []).append(job)
    pieces = sum(job.nbytes for members in groups.values() for job in members)
    room = 0.0 if cap is None else (cap - 1) * share
    for (_, way), members in sorted(groups.items(), key=lambda item: item[0]):
        members.sort(key=lambda job: job.span()[0])
        model: StorageModel = WARM if way == "warm" else storage_model(members[0].source.device
                                                                       if members[0].source
                                                                       else 0)
        align = DIRECT_ALIGN if way == "direct" else PAGE_ALIGN if way == "cold" else 1
        if align == 1 and cap is None:
            plans: dict[tuple[Any, ...], Any] = {}  # a layer's jobs repeat its structure
            for job in members:
                key = (job.pieces, job.row_bytes)
                if key not in plans:
                    plans[key] = _warm_way(job)
                job.merge = plans[key]
            continue
        if cap is None:  # aligned: a job whose every gap is worth reading reads its rows whole
            whole: dict[tuple[Any, ...], bool] = {}
            for job in members:
                shape = (job.pieces, job.row_bytes)
                if shape not in whole:
                    whole[shape] = all_gaps_worth(job, model)
                if whole[shape]:
                    job.merge = True
            members = [job for job in members if job.merge is not True]
            if not members:
                continue
        runs = [job_runs(job) for job in members]
        if not all(bool(np.all(s[1:] >= e[:-1])) for s, e in runs):
            continue  # ranges out of column order: read piece by piece
        starts = np.concatenate([s for s, _ in runs])
        ends = np.concatenate([e for _, e in runs])
        mine = float((ends - starts).sum())
        budget = None if cap is None else mine + room * mine / max(1, pieces)
        merged = plan_merges(starts, ends, model, align=align, budget=budget)
        at = 0
        for job, (s, _) in zip(members, runs, strict=True):
            inside = merged[at:at + len(s) - 1]
            at += len(s)
            job.merge = True if inside.all() else None if not inside.any() else inside.copy()


def all_gaps_worth(job: Gather, model: StorageModel) -> bool:
    """Whether, with no cap, `plan_merges` reads every gap of `job`'s rows through at any
    alignment: each gap's aligned weight is at most its length, so a job whose widest gap (one
    row's, the same in every row) saves time read through has nothing else to plan (working
    out every piece of a cold T=8 rank's jobs cost ~3.5 ms before its first read). False when
    the ranges are out of column order or a gap is wider (planned piece by piece)."""
    if not job.pieces:
        return False
    src = [s for s, _, _ in job.pieces]
    ends = [s + w for s, _, w in job.pieces]
    gaps = [b - a for a, b in zip(ends, src[1:], strict=False)]
    gaps.append(job.row_bytes - ends[-1] + src[0])
    return min(gaps) >= 0 and max(gaps) < model.latency * model.bandwidth


def _warm_way(job: Gather) -> bool | None:
    """`plan_spans`' choice for a job read through the page cache with no cap: True, its rows
    whole (`rows.vector_gather`), where `read_planner.warm_rows_whole` models that faster than
    copying its pieces by themselves, or where this process cannot copy them so
    (`gather.vm_copy_usable`: each piece would be a preadv call); None, its pieces by themselves
    (`gather.run_gather`), and always when the ranges are out of column order."""
    src = [s for s, _, _ in job.pieces]
    widths = [w for _, _, w in job.pieces]
    if any(b < a + w for a, w, b in zip(src, widths, src[1:], strict=False)):
        return None
    if not vm_copy_usable() or warm_rows_whole(job.row_bytes, widths):
        return True
    return None


def run_spans(job: Gather, recorder: ReadRecorder | None) -> None:
    """Run a job whose `merge` is set (`span_gather`), its whole rows first asked of storage
    when it is a node's cold job, through the page cache where O_DIRECT is refused."""
    if job.prefetch:
        ask_rows(job)
    if not span_gather(job, recorder):
        job.direct = False  # O_DIRECT refused: the same spans through the page cache
        span_gather(job, recorder)


def span_gather(job: Gather, recorder: ReadRecorder | None) -> bool:
    """Run a job whose `merge` is set: its coalesced spans read into this thread's bounce
    buffer (O_DIRECT when `job.direct`), its pieces copied out by numpy; False when the file
    system refuses the first O_DIRECT read (the caller reads through the page cache)."""
    source = job.source
    assert source is not None and job.merge is not None
    direct = job.direct
    fd, align = (source.direct_fd, DIRECT_ALIGN) if direct else (job.fd, 1)
    first, last = job.rows
    if job.merge is True and not direct and _VECTORED and vector_gather(job, recorder):
        return True
    populate(int(job.out.ctypes.data), first * job.out.shape[1], last * job.out.shape[1])
    if job.merge is True:
        step = max(1, (BOUNCE_BYTES if direct else CACHED_BYTES) // job.row_bytes)
        low = min(src for src, _, _ in job.pieces)
        high = max(src + width for src, _, width in job.pieces)
        for row in range(first, last, step):
            stop = min(last, row + step)
            begin = job.base + row * job.row_bytes
            start, end = begin + low, begin + (stop - 1 - row) * job.row_bytes + high
            buffer, at = _read(job, fd, align, start, end, recorder)
            if buffer is None:
                return False
            at -= low
            for src, dst, width in job.pieces:
                job.out[row:stop, dst:dst + width] = np.lib.stride_tricks.as_strided(
                    buffer[at + src:], (stop - row, width), (job.row_bytes, 1))
        return True
    starts, ends = job_runs(job)
    merged = np.asarray(job.merge)
    cuts = [0, *(np.flatnonzero(~merged) + 1).tolist(), len(starts)]
    count = len(job.pieces)
    for i, j in zip(cuts, cuts[1:], strict=False):
        start, end = int(starts[i]), int(ends[j - 1])
        buffer, at = _read(job, fd, align, start, end, recorder)
        if buffer is None:
            return False
        for k in range(i, j):
            row, (_, dst, width) = first + k // count, job.pieces[k % count]
            piece = at + int(starts[k]) - start
            job.out[row, dst:dst + width] = buffer[piece:piece + width]
    return True


def _read(job: Gather, fd: int, align: int, start: int, end: int,
          recorder: ReadRecorder | None) -> tuple[np.ndarray[Any, Any] | None, int]:
    """File bytes [start, end) in this thread's bounce buffer, read as one request aligned to
    `align`: (the buffer, where `start` lies in it); (None, 0) when an O_DIRECT read is
    refused at the job's first request."""
    low = start - start % align
    need = -(-end // align) * align - low
    buffer = _bounce(need)
    view = buffer.data
    if align == 1:
        fill(fd, job.path, job.name, [view[:need]], low, None)
    else:
        try:
            got = os.preadv(fd, [view[:need]], low)
        except OSError as exc:
            import errno

            if exc.errno == errno.EINVAL:
                return None, 0
            abort(job.path, f"cannot read tensor data: {exc.strerror or exc}", job.name)
        if got < end - low:
            abort(job.path, f"file changed since its header was read (truncated file?): "
                            f"tensor data at byte {low + max(got, 0)} could not be read",
                  job.name)
    if recorder is not None:
        recorder.record(job.path, start, end - start)
    return buffer, start - low


def cold_runs(jobs: list[Any], sizes: dict[int, int]) -> list[tuple[int, int, int]]:
    """(descriptor, start, length) of the file-contiguous runs of every plain job (`runs.Job`:
    row slices and whole tensors, read through the page cache) whose pages are mostly not
    cached, in the order given; `sizes`: each descriptor's file size (for the mapping mincore is
    asked of)."""
    found: list[tuple[int, int, int]] = []
    maps: dict[int, tuple[mmap.mmap, int]] = {}
    try:
        for job in jobs:
            start = int(job.src[0])
            end = int(job.src[-1] + job.length[-1])
            if job.fd not in maps:
                mapping = mmap.mmap(job.fd, sizes[job.fd], prot=mmap.PROT_READ)
                view = np.frombuffer(mapping, dtype=np.uint8)  # its address only: never read
                maps[job.fd] = (mapping, int(view.ctypes.data))
                del view
            if is_cold(maps[job.fd][1], start, end):
                src, length = job.src, job.length
                cuts = [0, *(np.flatnonzero(src[1:] != src[:-1] + length[:-1]) + 1).tolist(),
                        len(src)]
                found.extend((job.fd, int(src[i]), int(src[j - 1] + length[j - 1] - src[i]))
                             for i, j in zip(cuts, cuts[1:], strict=False))
    except (OSError, ValueError):  # no mapping (a file that shrank): no advice; reads tell
        return []
    finally:
        for mapping, _ in maps.values():
            mapping.close()
    return found


def ask_ahead(runs: list[tuple[int, int, int]]) -> threading.Thread | None:
    """Ask storage for `runs` (POSIX_FADV_WILLNEED), one after another on a thread of their
    own, so that the reader threads, which read them in the same order, find large requests
    already in flight (a cold read through the page cache with readahead off otherwise has one
    request per reader thread in flight: measured at T=1, 1.8 s where asking first took 1.2 s);
    None when there is nothing to ask for."""
    if not runs or not hasattr(os, "POSIX_FADV_WILLNEED"):
        return None

    def ask() -> None:
        for fd, start, length in runs:
            try:
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
            except OSError:  # advice only (a descriptor closed by a failed load)
                return

    thread = threading.Thread(target=ask, name="partc-ask-ahead", daemon=True)
    thread.start()
    return thread
