"""Read safetensors checkpoints: only the byte runs of the requested slices, straight into
preallocated arrays. Opened checkpoints come from `partc.runtime.checkpoint`; the runs and the
jobs that read them from `partc.runtime._engine.runs`; column slices are gathered by
`partc.runtime._engine.gather`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import numpy as np

from partc.runtime._engine.gather import (
    DIRECT_THREADS,
    Gather,
    GatherFile,
    column_gathers,
    gatherable,
    plan_gathers,
    run_gather,
)
from partc.runtime._engine.memory import FAULT_STEP, empty_array, populate
from partc.runtime._engine.runs import (
    IOV_MAX,
    JOB_BYTES,
    THREADED_BYTES,
    Ints,
    Job,
    ReadPlan,
    address_of,
    byte_runs,
    byte_view,
    check_selection,
    fill,
    one_run,
)
from partc.runtime._engine.selection import READ, WHOLE, ReadOptions, TensorSelection
from partc.runtime._engine.spans import ask_ahead, cold_runs, plan_spans, run_spans
from partc.runtime._engine.workers import environment_count, node_ranks, shared_cores
from partc.runtime.checkpoint import Checkpoint
from partc.runtime.files import FileStamp, no_readahead
from partc.runtime.headers import ITEMSIZE, FileHeader, TensorEntry, abort
from partc.runtime.options import ZeroCopy

_USE_ADVICE = hasattr(os, "posix_fadvise")
"""Whether cold plain jobs are asked of storage ahead of their reads (`spans.ask_ahead`)."""
_SPAN_LIMIT = 8 << 20
"""Most bytes one coalesced span (`max_gap`) reads."""


def _job_start(job: Job | Gather) -> tuple[int, int]:
    """Sort key of a job: its file, then its first byte."""
    if isinstance(job, Gather):
        return job.file, job.span()[0]
    return job.file, int(job.src[0])


class CheckpointReader:
    """Reads selected tensor elements straight into fresh arrays; opens each file once."""

    def __init__(self, checkpoint: Checkpoint, options: ReadOptions = READ) -> None:
        self.checkpoint = checkpoint
        """The checkpoint read from."""
        self.options = options
        """How every read of this reader is made (its recorder, threads, views, dtypes)."""
        self.recorder = options.recorder
        """Told of every byte run read, when set."""
        self.max_gap = options.max_gap
        """Runs this close (bytes) are read as one span (gaps included) and gathered; 0: exact."""
        workers = options.workers
        # `default_workers` and the cold count, each environment variable read once (os.environ
        # costs ~2 us a read: eight of them were ~0.04 ms of a zero-copy load, issue 18)
        ranks = self.node_ranks = node_ranks(options.local_ranks)
        """Ranks loading on this node at once (see `node_ranks`)."""
        forced = None if workers is not None else environment_count("PARTC_READ_THREADS")
        self.workers = (max(1, workers) if workers is not None else forced if forced is not None
                        else shared_cores(ranks))
        """Threads `read_many` may use for a large read."""
        self._cold_workers = self.workers if workers is not None or forced is not None else max(
            self.workers, DIRECT_THREADS // ranks)
        """Threads of a read with cold gathers (waiting on storage, not on cores): the node's
        share of `DIRECT_THREADS` unless the thread count was given."""
        self.mapped = options.mapped
        """Whether `read_many` gathers finely cut selections from read-only mappings."""
        self.zero_copy = options.zero_copy
        """Whether `read_many` returns one-run selections as views of the mapped file (see
        `ReadOptions.zero_copy` and `_view_of`)."""
        self.dtypes = options.dtypes
        """Safetensors dtype -> the numpy dtype of the arrays read (see `ReadOptions.bits`)."""
        from partc.runtime.options import fetch_cap
        from partc.runtime.read_planner import environment_cap

        cap = options.max_fetch_ratio
        self.max_fetch_ratio = fetch_cap(cap) if cap is not None else environment_cap()
        """The most bytes read over the share's (see `ReadOptions.max_fetch_ratio`)."""
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}

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
                abort(header.path, f"cannot open checkpoint file: {exc.strerror or exc}")
            self._fds[header.path] = fd  # closed by close() even when a check below fails
            no_readahead(fd)
            try:
                st = os.fstat(fd)
            except OSError as exc:
                abort(header.path, f"cannot examine checkpoint file: {exc.strerror or exc}")
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
                abort(header.path, "checkpoint file disappeared while being read (deleted or "
                                   "renamed); expected it to stay in place until the load ends")
            except OSError as exc:
                abort(header.path, f"cannot examine checkpoint file: {exc.strerror or exc}")
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                abort(header.path, "checkpoint file was replaced while being read: the path now "
                                   "names another file; expected it unchanged until the load ends")
            _check_stamp(header, st, "while being read")

    def read(self, name: str, selection: TensorSelection = WHOLE) -> np.ndarray[Any, Any]:
        """The selected part of tensor `name` as a new C-contiguous array."""
        if self.max_gap <= 0:
            return self.read_many([(name, selection)])[name]
        header, entry = self.checkpoint.tensor(name)
        check_selection(header, entry, selection)
        out = empty_array(selection.local_shape(entry.shape), self.dtypes[entry.dtype])
        src, dst, length = byte_runs(entry, selection)
        if len(src):
            fd, base = self._fd(header), header.data_start + entry.begin
            flat = out.reshape(-1).view(np.uint8)
            self._read_coalesced(fd, header.path, entry.name, flat, base, src, dst, length)
            self._check_unchanged([self.checkpoint.owners[name]])
        return out

    def read_many(self, requests: Iterable[tuple[str, TensorSelection]]
                  ) -> dict[str, np.ndarray[Any, Any]]:
        """Several selections read in (file, offset) order; the dict follows request order.

        The runs of every tensor are merged per file, so file-contiguous runs of neighbouring
        tensors share one preadv; a large read is spread over `workers` threads (preadv releases
        the GIL). The options' `progress` is called in this thread with the bytes of every
        finished job.
        """
        progress = self.options.progress
        todo = list(requests)
        names = [name for name, _ in todo]
        found = self.checkpoint.header_entries(names)
        if found is None or len(set(names)) != len(names):
            self._refuse_names(todo)
        if self.max_gap > 0:
            ckpt = self.checkpoint
            order = sorted(range(len(todo)), key=lambda i: (
                ckpt.owners[todo[i][0]], ckpt.tensor(todo[i][0])[1].begin))
            got = {i: self.read(*todo[i]) for i in order}
            return {todo[i][0]: got[i] for i in range(len(todo))}
        assert found is not None
        out: dict[str, np.ndarray[Any, Any]] = {}
        plan = ReadPlan()
        gathers: list[Gather] = []
        files = self.checkpoint.files
        # A rank's tensors come in a few structures (the same dtype, shape and selection in
        # every layer): each is checked and worked out once (`_shape`), keyed by the header's
        # dtype and shape, the axis and the ranges object itself (a generated load shares one
        # per distinct selection; alive in `todo`, so its id is not reused); a tensor then
        # costs two dict lookups and its array (issue 18: the per-tensor checks and
        # TensorEntry lookups were ~1 ms of a 165-tensor load). An axis other than None or
        # an int (a bool equals 1, a list is unhashable) is checked tensor by tensor.
        shapes: dict[tuple[Any, ...], _Shape] = {}
        known, ndarray = shapes.get, np.ndarray
        starts = [header.data_start for header in files]
        buffers: list[memoryview | None] = [None] * len(files)  # mapped on a first view
        for (name, selection), file, raw in zip(todo, *found, strict=True):
            axis = selection.axis
            if axis is None or type(axis) is int:
                key = (id(selection.ranges), axis, raw["dtype"], *raw["shape"])
                shape = known(key)
                if shape is None:
                    header = files[file]
                    shape = shapes[key] = self._shape(header, header.tensors[name], selection)
            else:
                shape = self._shape(files[file], files[file].tensors[name], selection)
            view, offset, strides, local, dtype, gather, runs = shape
            begin = starts[file] + raw["data_offsets"][0]
            if view:
                buffer = buffers[file]
                if buffer is None:
                    buffer = buffers[file] = self._map(files[file], name)
                out[name] = ndarray(local, dtype, buffer, begin + offset, strides)
                continue
            header = files[file]
            array = empty_array(local, dtype)
            out[name] = array
            if gather:
                gathers.extend(column_gathers(file, header, header.tensors[name], selection, array))
                continue
            assert runs is not None
            src, dst, length = runs
            if len(src):
                plan.add(file, begin, name, array, src, dst, length, array.nbytes)
        jobs: list[Job | Gather] = [*plan.jobs(files, JOB_BYTES), *gathers]
        for job in jobs:
            job.fd = self._fd(files[job.file])
        jobs.sort(key=_job_start)
        nbytes = plan.nbytes + sum(g.nbytes for g in gathers)
        sources: dict[int, GatherFile] = {}
        for job in gathers:
            if job.file not in sources:
                header = files[job.file]
                sources[job.file] = GatherFile(header, self._fds[header.path], job.name,
                                               in_process=self.zero_copy is not ZeroCopy.OFF)
        ahead = None
        try:
            cold = plan_gathers(gathers, sources, alone=self.node_ranks == 1)
            plan_spans(gathers, nbytes, self.max_fetch_ratio)
            plain = [job for job in jobs if not isinstance(job, Gather)]
            ahead = ask_ahead(cold_runs(plain, {job.fd: files[job.file].file_size
                                                for job in plain})) if _USE_ADVICE else None
            cold = cold or ahead is not None
            workers = self._cold_workers if cold else self.workers
            if len(jobs) < 2 or workers < 2 or nbytes < THREADED_BYTES:
                for job in jobs:
                    self._run_job(job)
                    if progress is not None:
                        progress(job.nbytes)
            else:
                self._run_threaded(jobs, progress, workers)
        finally:
            if ahead is not None:
                ahead.join()
            for source in sources.values():
                source.close()
        mapped = [i for i, h in enumerate(files) if h.path in self._maps]
        self._check_unchanged([*(job.file for job in jobs), *mapped])
        return out

    def _refuse_names(self, todo: list[tuple[str, TensorSelection]]) -> None:
        """Raise the error of the first request, in order, naming a tensor the checkpoint
        lacks (with the name it resembles) or one requested twice."""
        seen: set[str] = set()
        for name, _ in todo:
            header, _ = self.checkpoint.tensor(name)
            if name in seen:
                abort(header.path, f"tensor {name!r} requested twice", name)
            seen.add(name)
        raise AssertionError("_refuse_names called on requests with no fault")

    def _shape(self, header: FileHeader, entry: TensorEntry, sel: TensorSelection) -> _Shape:
        """How `read_many` returns the selection `sel` of a tensor like `entry` (its dtype and
        shape; `header` and the name only locate an error): checked, then, for a view of the
        mapped file (`zero_copy`; see `_view_of`), (1 or 2, the view's offset from the
        tensor's first byte, its strides (None: contiguous), local shape, dtype, False, None),
        else (0, 0, None, local shape, dtype, whether it is gathered, its byte runs unless
        gathered)."""
        check_selection(header, entry, sel)
        local, dtype = sel.local_shape(entry.shape), self.dtypes[entry.dtype]
        if self.zero_copy is not ZeroCopy.OFF:
            view = _view_of(entry, sel, private=self.zero_copy is ZeroCopy.PRIVATE)
            if view is not None:
                return (view[0], view[1], view[2], local, dtype, False, None)
        gather = self.mapped and gatherable(entry, sel)
        return (0, 0, None, local, dtype, gather, None if gather else byte_runs(entry, sel))

    def _map(self, header: FileHeader, name: str) -> memoryview:
        """The mapping of `header`'s file the views of `zero_copy` are made from (mapped on
        first use, as `zero_copy` says; `name`: the tensor a failure names), as a memoryview:
        numpy makes an array of a buffer without holding it, and the memoryview's hold keeps
        the mapping from being closed while any view lives."""
        mapping = self._maps.get(header.path)  # mapped by an earlier read_many
        if mapping is not None:
            return memoryview(mapping)
        fd = self._fd(header)
        private = self.zero_copy is ZeroCopy.PRIVATE
        try:
            mapping = mmap.mmap(fd, header.file_size, access=mmap.ACCESS_COPY if private
                                else mmap.ACCESS_READ)
        except ValueError:  # Python's mmap checks the size first: the file shrank
            abort(header.path, f"file changed since its header was read: it is shorter "
                               f"than {header.file_size} bytes (truncated file?)", name)
        except OSError as exc:
            abort(header.path, f"cannot map checkpoint file: {exc.strerror or exc}", name)
        self._maps[header.path] = mapping
        return memoryview(mapping)

    def _run_threaded(self, jobs: list[Job | Gather], progress: Callable[[int], None] | None,
                      workers: int) -> None:
        """Run jobs on `workers` threads, the calling thread one of them, each taking the next
        job in order; the first error is re-raised once every thread has stopped.

        The calling thread reads too and waits for the others only at the end, and `progress`
        is called in it, between its own jobs, with the bytes of every job finished so far.
        A calling thread that slept until each job finished woke once per job and took a core
        from a reader every time: measured warm, T=8 rank of benchmarks/load.py, ~300 context
        switches a load against safetensors' ~5 (see docs/performance.md, "Warm loads").
        Plain threads and a list: concurrent.futures costs ~12 ms to import, a tenth of a small
        rank's load, and queue ~0.8 ms, 2% of a warm T=8 one.
        """
        import threading

        todo = iter(jobs)
        lock = threading.Lock()
        finished: list[int] = []  # bytes of the other threads' jobs (list.append is atomic)
        told = 0  # how many of them progress was told of
        errors: list[BaseException] = []
        failed = threading.Event()

        def take() -> Job | Gather | None:
            with lock:
                return None if failed.is_set() else next(todo, None)

        def work() -> None:
            while (job := take()) is not None:
                try:
                    self._run_job(job)
                except BaseException as error:  # re-raised in the calling thread
                    errors.append(error)
                    failed.set()
                    return
                if progress is not None:
                    finished.append(job.nbytes)

        def report() -> None:
            nonlocal told
            assert progress is not None
            while told < len(finished):
                told += 1
                progress(finished[told - 1])

        threads = [threading.Thread(target=work, name=f"partc-read-{i}", daemon=True)
                   for i in range(min(workers, len(jobs)) - 1)]
        for thread in threads:
            thread.start()
        try:
            while (job := take()) is not None:
                self._run_job(job)
                if progress is not None:
                    progress(job.nbytes)
                    report()
        except BaseException:
            failed.set()
            raise
        finally:
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]
        if progress is not None:
            report()

    def _run_job(self, job: Job | Gather) -> None:
        """Read one job's runs (sorted by file offset): one preadv per file-contiguous batch
        of at most `FAULT_STEP` bytes (a longer run in steps of it), each batch's destination
        faulted in just before its read (`memory.FAULT_STEP`)."""
        if isinstance(job, Gather):
            if job.merge is not None:  # the read planner coalesced it
                run_spans(job, self.recorder)
            else:
                run_gather(job, self.recorder)
            return
        path, names, arrays = job.path, job.names, job.arrays
        src, dst, length, owner = (a.tolist() for a in (job.src, job.dst, job.length, job.owner))
        views = {k: byte_view(arrays[k]) for k in set(owner)}  # in the reader thread, not
        # the planner's: ~20% of the calling thread's planning of a warm T=8 rank
        where = {k: address_of(arrays[k]) for k in views}
        fd, recorder, preadv, step = job.fd, self.recorder, os.preadv, FAULT_STEP
        i, count = 0, len(src)
        try:
            while i < count:
                j, end = i + 1, src[i] + length[i]
                while (j < count and j - i < IOV_MAX and src[j] == end
                       and end + length[j] - src[i] <= step):
                    end, j = end + length[j], j + 1
                if j == i + 1:  # one run (column slices: each straight into its array)
                    o, d, n, at = owner[i], dst[i], length[i], src[i]
                    for done in range(0, n, step):
                        k = min(step, n - done)
                        populate(where[o], d + done, d + done + k)
                        bufs = [views[o][d + done:d + done + k]]
                        got = preadv(fd, bufs, at + done)
                        if recorder is not None and got > 0:
                            recorder.record(path, at + done, got)
                        if got != k:
                            fill(fd, path, names[o], bufs, at + done, recorder, got)
                else:
                    for k in range(i, j):
                        populate(where[owner[k]], dst[k], dst[k] + length[k])
                    bufs = [views[owner[k]][dst[k]:dst[k] + length[k]] for k in range(i, j)]
                    fill(fd, path, names[owner[i]], bufs, src[i], recorder)
                i = j
        except OSError as exc:
            abort(path, f"cannot read tensor data: {exc.strerror or exc}", names[owner[i]])

    def _read_coalesced(self, fd: int, path: str, name: str, flat: np.ndarray[Any, Any],
                        base: int, src: Ints, dst: Ints, length: Ints) -> None:
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
                fill(fd, path, name, [out[int(dst[i]):int(dst[i] + length[i])]],
                     base + first, self.recorder)
                continue
            span = np.empty(int(last[j - 1]) + 1 - first, dtype=np.uint8)
            fill(fd, path, name, [span.data], base + first, self.recorder)
            rel, d, n = src[i:j] - first, dst[i:j], length[i:j]
            size, step = int(n[0]), int(rel[1] - rel[0])
            if (np.all(n == size) and np.all(np.diff(d) == size)
                    and np.all(np.diff(rel) == step)):  # evenly strided: one numpy copy
                pieces = np.lib.stride_tricks.as_strided(span, (j - i, size), (step, 1))
                flat[int(d[0]):int(d[0]) + (j - i) * size].reshape(j - i, size)[...] = pieces
            else:
                for r, dd, nn in zip(rel.tolist(), d.tolist(), n.tolist(), strict=True):
                    flat[dd:dd + nn] = span[r:r + nn]


_Shape = tuple[int, int, "tuple[int, ...] | None", tuple[int, ...], "np.dtype[Any]", bool,
               "tuple[Ints, Ints, Ints] | None"]
"""How `read_many` returns one structure of tensor (see `CheckpointReader._shape`)."""


def _view_of(entry: TensorEntry, sel: TensorSelection, *, private: bool
             ) -> tuple[int, int, tuple[int, ...] | None] | None:
    """How the (checked) selection is a view of the mapped file: (1, its offset from the
    tensor's first byte, None) for one byte run, a contiguous view; (2, its offset, the
    tensor's strides) for one range along an inner axis (a column slice), a strided view;
    None for several ranges that are not one run (those are copied).

    `zero_copy=True` maps the file shared and read-only, so the views are read-only.
    `zero_copy="private"` (`private`) maps it copy-on-write (MAP_PRIVATE): the views are
    writable, a write lands in a private page of this process and never in the file, and
    pages not written stay the page cache's; column slices are copied there instead (torch
    wants contiguous parameters). Nothing is read here: pages come in when the view is
    first touched. Unlike the copying path, a view can raise SIGBUS on first touch if the
    file is truncated after the load.
    """
    runs, start = one_run(entry, sel)
    if runs == 1:
        return 1, start, None
    kept = [r for r in sel.ranges if r[1] > r[0]]
    if private or runs == 0 or len(kept) != 1 or sel.axis is None:
        return None  # several runs: copied (a column slice too, when private)
    strides, step = [], ITEMSIZE[entry.dtype]
    for dim in reversed(entry.shape):
        strides.append(step)
        step *= dim
    strides.reverse()
    return 2, kept[0][0] * strides[sel.axis], tuple(strides)


def _check_stamp(header: FileHeader, st: os.stat_result, when: str) -> None:
    """Refuse a file whose stat no longer matches the one taken when its header was read."""
    stamp, now = header.stamp, FileStamp.of(st)
    if stamp is not None and (stamp.device, stamp.inode) != (now.device, now.inode):
        abort(header.path, f"checkpoint file was replaced {when}: the path names another file "
                           f"(inode {now.inode}, expected {stamp.inode})")
    if now.size != header.file_size:
        abort(header.path, f"file changed {when}: size {now.size}, expected "
                           f"{header.file_size} (truncated file?)")
    if stamp is not None and now.mtime_ns != stamp.mtime_ns:
        abort(header.path, f"file changed {when}: it was modified (mtime {now.mtime_ns} ns, "
                           f"expected {stamp.mtime_ns} ns)")



def read_tensor(checkpoint: Checkpoint, name: str, selection: TensorSelection = WHOLE,
                options: ReadOptions = READ) -> np.ndarray[Any, Any]:
    """Read only the selected elements of tensor `name` into a new C-contiguous array."""
    with CheckpointReader(checkpoint, options) as r:
        return r.read(name, selection)


def read_tensors(checkpoint: Checkpoint, requests: Iterable[tuple[str, TensorSelection]],
                 options: ReadOptions = READ) -> dict[str, np.ndarray[Any, Any]]:
    """Read several selections in (file, offset) order, opening each file once, as `options`
    say (see `ReadOptions`)."""
    with CheckpointReader(checkpoint, options) as r:
        return r.read_many(requests)
