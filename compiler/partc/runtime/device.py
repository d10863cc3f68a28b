"""Loading a rank's tensors onto a torch device: which device, and the staging ring that feeds it.

`resolve_device` turns `load(..., device=...)` into a torch device: by default
`cuda:LOCAL_RANK` when torch sees a GPU, else the CPU. A CPU load needs no staging (the reader
fills the result's own memory). A GPU load never reads the shard into host memory whole: every
selected element goes from the checkpoint's file mapping into one of a few reused host buffers
(pinned, so the copy to the device is asynchronous), and from there into the device tensor, so
the host holds the ring, never a second copy of the shard, and faults no fresh pages per tensor.
Several reader threads fill buffers at once (one core copies out of the page cache at a fraction
of the host-to-device rate), each with two buffers of its own and its own copy stream: while one
buffer's copy is in flight the thread fills the other.

The device side is one small `Transfer` object (allocate a staging buffer, a device buffer, a
copy lane; copy, wait), so the whole staging path also runs against a stand-in device in tests.
torch is imported only inside these functions.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from partc.errors import CheckpointError, LaunchError
from partc.runtime._engine.reader import read_tensors
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime._engine.workers import default_workers
from partc.runtime.checkpoint import Checkpoint
from partc.runtime.frameworks import import_torch
from partc.runtime.options import Framework, LoadOptions, ZeroCopy
from partc.runtime.rank_env import environment_integer

DEFAULT_STAGING_BYTES = 64 << 20
"""Default size of the host staging ring: two buffers for each reader thread, 64 MiB in all."""
_SLOTS = 2
"""Buffers of each reader thread: one filled on the host while the other's copy is in flight."""
_BYTE_VIEWS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""Item size -> unsigned integer dtype: every copy moves raw bytes, whatever the dtype."""


def local_rank_from_environment() -> int | None:
    """torchrun's `LOCAL_RANK` (this process's index on its node), or None when unset."""
    raw = os.environ.get("LOCAL_RANK")
    return None if raw is None else environment_integer("LOCAL_RANK", raw)


_DEVICE_RULE = "device must be None, 'cpu', 'cuda' or 'cuda:N' (a torch.device is accepted too)"


def resolve_device(device: Any) -> Any:
    """The torch.device a load goes to, or a LaunchError saying why `device` is unusable.

    None: `cuda:LOCAL_RANK` (LOCAL_RANK unset: 0) when torch sees a CUDA device, else the CPU.
    'cuda' without an index means `cuda:LOCAL_RANK` too.
    """
    torch = import_torch("loading torch tensors (framework='torch' or device=)")
    if device is None:
        if not torch.cuda.is_available():
            local_rank_from_environment()  # a malformed LOCAL_RANK is refused on a CPU too
            return torch.device("cpu")
        device = "cuda"
    if isinstance(device, bool) or not isinstance(device, str | torch.device):
        raise LaunchError(f"{_DEVICE_RULE}, found {device!r}")
    try:
        found = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise LaunchError(f"{_DEVICE_RULE}, found {device!r}") from None
    if found.type == "cpu":
        return torch.device("cpu")
    if found.type != "cuda":
        raise LaunchError(f"partc loads to the CPU or a CUDA device; device {str(found)!r} is "
                          f"of type {found.type!r}")
    if not torch.cuda.is_available():
        raise LaunchError(f"device {str(found)!r} asked for, but torch {torch.__version__} "
                          "sees no CUDA device (torch.cuda.is_available() is False); load "
                          "with device='cpu'")
    count = torch.cuda.device_count()
    index = found.index
    if index is None:
        local = local_rank_from_environment()
        index = 0 if local is None else local
        if index >= count:
            raise LaunchError(f"LOCAL_RANK={index} names CUDA device {index}, but torch "
                              f"sees {count} CUDA device(s); pass device='cuda:N', or run "
                              f"at most {count} processes per node")
    elif index >= count:
        raise LaunchError(f"device 'cuda:{index}' asked for, but torch sees {count} CUDA "
                          f"device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def load_target(options: LoadOptions) -> Any | None:
    """The CUDA device a load stages to (None: it reads on the host), checked against the
    load's other options."""
    target = resolve_device(options.device) if options.framework is Framework.TORCH else None
    staged = target if target is not None and target.type != "cpu" else None
    zero_copy = options.zero_copy is not ZeroCopy.OFF
    if staged is not None and (zero_copy or options.reader is not None):
        option = f"zero_copy={options.zero_copy.value!r}" if zero_copy else "reader="
        raise LaunchError(f"a load to {staged} reads through the file mapping into host "
                          f"staging buffers, which {option} cannot follow; load to "
                          "device='cpu' for it")
    if options.staging_bytes is not None and staged is None:
        raise LaunchError("staging_bytes sizes the host ring of a load to a CUDA device; "
                          "this load is not one")
    if options.framework is Framework.TORCH:
        options.check_torch_views()
    return staged


class Transfer(Protocol):
    """The device side of a staged load: buffers, copy lanes and copies (CUDA, or a stand-in
    in tests)."""

    def staging(self, nbytes: int) -> Any:
        """A new host uint8 torch tensor of `nbytes` to stage copies through."""

    def destination(self, nbytes: int) -> Any:
        """A new uint8 torch tensor of `nbytes` on the device."""

    def lane(self) -> Any:
        """A new copy lane (a CUDA stream) that starts after all work queued so far on the
        device's current stream: one per reader thread, so their copies never wait on each
        other's."""

    def copy(self, destination: Any, source: Any, lane: Any) -> Any:
        """Start copying `source` (host) into `destination` (device) on `lane`; a handle to
        wait on."""

    def wait(self, handle: Any) -> None:
        """Block until the copy `handle` names has finished reading its source."""


@dataclass(slots=True)
class _CudaTransfer:
    """Pinned host buffers and asynchronous host-to-device copies, one stream per lane."""

    torch: Any
    """The torch module."""
    device: Any
    """The CUDA torch.device."""

    def staging(self, nbytes: int) -> Any:
        """A pinned (page-locked) host buffer: copies from it to the GPU are asynchronous."""
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def destination(self, nbytes: int) -> Any:
        """Uninitialised device bytes (allocated on the device's current stream)."""
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def lane(self) -> Any:
        """A new stream ordered after the current stream's queued work: the destinations were
        allocated on that stream, whose earlier kernels may still use their memory."""
        cuda = self.torch.cuda
        stream = cuda.Stream(device=self.device)
        stream.wait_stream(cuda.current_stream(self.device))
        return stream

    def copy(self, destination: Any, source: Any, lane: Any) -> Any:
        """A non-blocking copy on `lane`, and an event recorded after it."""
        cuda = self.torch.cuda
        with cuda.device(self.device), cuda.stream(lane):
            destination.copy_(source, non_blocking=True)
            event = cuda.Event()
            event.record(lane)
        return event

    def wait(self, handle: Any) -> None:
        """Wait for the copy's event."""
        handle.synchronize()


def transfer_for(device: Any) -> Transfer:
    """The Transfer for a CUDA `device` (tests replace this function with a stand-in)."""
    return _CudaTransfer(torch=import_torch("a CUDA load"), device=device)


@dataclass(slots=True)
class StagingStats:
    """What a staged load allocated and moved: the ring bounds the host memory it holds."""

    buffers: int = 0
    """Host staging buffers allocated (at most the ring's slots)."""
    buffer_bytes: list[int] = field(default_factory=list)
    """The size of each buffer allocated."""
    copies: int = 0
    """Host-to-device copies issued."""
    staged_bytes: int = 0
    """Bytes that went through the ring."""
    lanes: int = 0
    """Reader threads that filled buffers, each with its own buffers and copy lane."""

    def add(self, other: StagingStats) -> None:
        """Count `other`'s buffers and copies in this one's."""
        self.buffers += other.buffers
        self.buffer_bytes.extend(other.buffer_bytes)
        self.copies += other.copies
        self.staged_bytes += other.staged_bytes


class StagingRing:
    """A few reused host buffers, each filled while the previous one's copy is in flight."""

    def __init__(self, transfer: Transfer, total_bytes: int, slots: int = _SLOTS,
                 lane: Any = None) -> None:
        self.transfer = transfer
        """The device side."""
        self.slot_bytes = max(1, total_bytes // slots)
        """Bytes of one buffer."""
        self.stats = StagingStats()
        """What was allocated and moved."""
        self.lane = lane
        """The copy lane this ring's copies go on."""
        self._slots = slots
        self._buffers: list[Any] = []
        self._pending: list[Any] = []
        self._next = 0

    def acquire(self, nbytes: int) -> tuple[int, np.ndarray[Any, Any]]:
        """The next buffer (allocated on first use; its previous copy waited for) as numpy."""
        index = self._next
        self._next = (index + 1) % self._slots
        if index == len(self._buffers):
            self._buffers.append(self.transfer.staging(self.slot_bytes))
            self._pending.append(None)
            self.stats.buffers += 1
            self.stats.buffer_bytes.append(self.slot_bytes)
        elif self._pending[index] is not None:
            self.transfer.wait(self._pending[index])
            self._pending[index] = None
        return index, self._buffers[index].numpy()[:nbytes]

    def submit(self, index: int, destination: Any, nbytes: int) -> None:
        """Copy the first `nbytes` of buffer `index` into `destination` (a device byte range)."""
        self._pending[index] = self.transfer.copy(destination, self._buffers[index][:nbytes],
                                                  self.lane)
        self.stats.copies += 1
        self.stats.staged_bytes += nbytes

    def drain(self) -> None:
        """Wait for every copy still in flight."""
        for index, handle in enumerate(self._pending):
            if handle is not None:
                self.transfer.wait(handle)
                self._pending[index] = None


Piece = tuple[int, list[np.ndarray[Any, Any]], int]
"""(first element of the local tensor it fills, the source views to concatenate, their axis)."""


def _pieces(views: list[np.ndarray[Any, Any]], axis: int, base: int, limit: int
            ) -> Iterator[Piece]:
    """The local tensor (`views` concatenated along `axis`) cut into C-order blocks of at most
    `limit` bytes, each contiguous in the destination: runs of leading rows, and a row too
    large for one buffer cut the same way one level down."""
    shape = list(views[0].shape)
    shape[axis] = sum(v.shape[axis] for v in views)
    itemsize = views[0].itemsize
    if math.prod(shape) * itemsize <= limit or not shape:
        yield base, views, axis
        return
    row = math.prod(shape[1:])
    step = max(1, limit // max(1, row * itemsize))
    for first in range(0, shape[0], step):
        last = min(first + step, shape[0])
        if axis == 0:
            part, offset = [], 0
            for view in views:  # the views' rows overlapping [first, last)
                lo, hi = max(first, offset), min(last, offset + view.shape[0])
                if lo < hi:
                    part.append(view[lo - offset:hi - offset])
                offset += view.shape[0]
            part_axis = 0
        else:
            part, part_axis = [view[first:last] for view in views], axis
        if row * itemsize > limit:  # one row (step is 1): its own blocks, one level down
            inner = [p[0] for p in part]
            yield from _pieces(inner, max(0, part_axis - 1), base + first * row, limit)
        else:
            yield base + first * row, part, part_axis


def _source_views(whole: np.ndarray[Any, Any], selection: TensorSelection
                  ) -> tuple[list[np.ndarray[Any, Any]], int]:
    """The selected parts of a whole-tensor view (raw bytes as unsigned integers), in order."""
    raw = whole.view(_BYTE_VIEWS[whole.itemsize]) if whole.ndim else whole.reshape(1).view(
        _BYTE_VIEWS[whole.itemsize])
    if selection.axis is None:
        return [raw], 0
    axis = selection.axis
    return [raw[(slice(None),) * axis + (slice(a, b),)] for a, b in selection.ranges], axis


def _fill(out: np.ndarray[Any, Any], views: list[np.ndarray[Any, Any]], axis: int) -> None:
    if len(views) == 1:
        np.copyto(out, views[0])
    else:
        np.concatenate(views, axis=axis, out=out)


def _one_run(part: list[np.ndarray[Any, Any]]) -> bool:
    """Whether a block's source is one byte run of its file (one C-contiguous view)."""
    return len(part) == 1 and bool(part[0].flags.c_contiguous)


def _read_run(fd: int, path: str, offset: int, out: np.ndarray[Any, Any], name: str) -> None:
    """Fill `out` (a ring buffer's bytes) from `offset` of the open file: the kernel copies out
    of the page cache with no page fault of a mapping, and a file cut short meanwhile is an
    error naming the tensor, never SIGBUS."""
    view = out.data.cast("B")
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise CheckpointError(f"{path} ended at byte {offset + done} while reading "
                                  f"`{name}`, which needs {len(view) - done} bytes more there: "
                                  "was the file changed during the load?", tensor=name)
        done += count


@dataclass(slots=True)
class _Job:
    """Blocks of one local tensor that one reader thread stages in order: all of the tensor's
    blocks when its digest is taken (sha256 is updated in C order), else one block."""

    name: str
    """The tensor's name."""
    flat: Any
    """Its device bytes."""
    itemsize: int
    """Bytes of one element."""
    blocks: list[tuple[int, Piece]]
    """(bytes, piece) of each block, in the tensor's C order."""
    hashed: bool
    """Whether its sha256 is taken as its blocks pass."""
    file: int
    """Index of the checkpoint file holding the tensor."""
    origin: tuple[int, int]
    """(address of the whole tensor's mapped view, its byte offset in the file): a one-run
    block's file offset is its view's address less the first, plus the second."""


def _stage_jobs(jobs: Sequence[_Job], ring: StagingRing, next_job: Callable[[], int | None],
                progress: Callable[[int], None] | None, digests: dict[str, str] | None,
                files: Sequence[tuple[int, str]]) -> None:
    """One reader thread: take the next job until none is left, filling this thread's ring
    (`files`: each checkpoint file's descriptor and path). A block that is one byte run of its
    file is read into the buffer (pread); one of strided rows or several runs is copied out of
    the mapping."""
    while (index := next_job()) is not None:
        job = jobs[index]
        hasher = None
        if job.hashed:
            import hashlib  # OpenSSL's sha256, as partc.runtime.digests: only when verifying

            hasher = hashlib.sha256()
        for nbytes, (first, part, part_axis) in job.blocks:
            block = list(part[0].shape)
            block[part_axis] = sum(p.shape[part_axis] for p in part)
            slot, buffer = ring.acquire(nbytes)
            if _one_run(part):
                fd, path = files[job.file]
                offset = job.origin[1] + part[0].ctypes.data - job.origin[0]
                _read_run(fd, path, offset, buffer[:nbytes], job.name)
            else:
                _fill(buffer.view(part[0].dtype).reshape(block), part, part_axis)
            if hasher is not None:
                hasher.update(buffer[:nbytes].data)
            start = first * job.itemsize
            ring.submit(slot, job.flat[start:start + nbytes], nbytes)
            if progress is not None:
                progress(nbytes)
        if hasher is not None and digests is not None:
            digests[job.name] = hasher.hexdigest()


def stage_to_device(checkpoint: Checkpoint, requests: Sequence[tuple[str, TensorSelection]],
                    device: Any, *, staging_bytes: int | None = None,
                    progress: Callable[[int], None] | None = None,
                    transfer: Transfer | None = None, digests: dict[str, str] | None = None,
                    workers: int | None = None, local_ranks: int | None = None
                    ) -> tuple[dict[str, Any], StagingStats]:
    """Each request's selection as a torch tensor on `device`, staged through a host ring.

    Each block of a local tensor goes into a ring buffer and from there to its byte range of
    the device tensor: a block that is one byte run of its file (whole tensors, row ranges) is
    read into the buffer with pread, a block of strided rows (column slices) or of several
    runs (fused segments) is gathered from read-only views of the mapped file.
    Several reader threads (`workers`, by default the node's cores shared among its loading
    ranks, see `default_workers`) take blocks in file order, each filling its own two buffers
    of the ring and copying on its own lane, so the host-side copies out of the page cache run
    on several cores while earlier blocks cross to the device. Returns the tensors in request
    order and what the ring allocated and moved. With `digests`, each tensor's sha256 is taken
    on the host as its blocks pass through the ring (one thread takes all of a tensor's blocks,
    in the local tensor's C order, so the digest is that of its bytes) and stored there by
    name: `verify="digest"` checks a device load without reading anything back.
    """
    torch = import_torch("a device load")
    total = DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes
    if isinstance(total, bool) or not isinstance(total, int) or total < _SLOTS:
        raise LaunchError(f"staging_bytes must be an integer of at least {_SLOTS}, found "
                          f"{staging_bytes!r}")
    transfer = transfer_for(device) if transfer is None else transfer
    names = [name for name, _ in requests]
    wholes = read_tensors(checkpoint, [(name, TensorSelection()) for name in names],
                          ReadOptions(zero_copy=ZeroCopy.SHARED))
    shard = sum(math.prod(selection.local_shape(tuple(wholes[name].shape)))
                * wholes[name].itemsize for name, selection in requests)
    ring_bytes = min(total, max(_SLOTS, shard))  # the ring never exceeds the shard
    threads = default_workers(local_ranks) if workers is None else max(1, workers)
    threads = max(1, min(threads, ring_bytes // _SLOTS))  # every buffer at least one byte
    slot_bytes = max(1, ring_bytes // (_SLOTS * threads))
    order = sorted(range(len(requests)), key=lambda i: (
        checkpoint.owners[names[i]], checkpoint.tensor(names[i])[1].begin))
    out: dict[str, Any] = {}
    jobs: list[_Job] = []
    for i in order:  # every destination allocated first, on the current stream, in file order
        name, selection = requests[i]
        whole = wholes.pop(name)
        shape = selection.local_shape(tuple(whole.shape))
        itemsize = whole.itemsize
        flat = transfer.destination(math.prod(shape) * itemsize)
        views, axis = _source_views(whole, selection)
        blocks = []
        for first, part, part_axis in _pieces(views, axis, 0, slot_bytes):
            extent = list(part[0].shape)
            extent[part_axis] = sum(p.shape[part_axis] for p in part)
            nbytes = math.prod(extent) * itemsize
            if nbytes:
                blocks.append((nbytes, (first, part, part_axis)))
        out[name] = flat.view(torch_dtype(torch, whole.dtype, name)).view(shape)
        header, entry = checkpoint.tensor(name)
        file = checkpoint.owners[name]
        origin = (whole.ctypes.data, header.data_start + entry.begin)
        if digests is not None:
            jobs.append(_Job(name, flat, itemsize, blocks, True, file, origin))
        else:
            jobs.extend(_Job(name, flat, itemsize, [b], False, file, origin) for b in blocks)
    threads = max(1, min(threads, len(jobs)))
    rings = [StagingRing(transfer, slot_bytes * _SLOTS, lane=transfer.lane())
             for _ in range(threads)]
    files = [(os.open(header.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), header.path)
             for header in checkpoint.files]
    taken = iter(range(len(jobs)))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def next_job() -> int | None:
        with lock:
            return None if failed else next(taken, None)

    def counted(nbytes: int) -> None:
        with lock:
            assert progress is not None
            progress(nbytes)

    def run(ring: StagingRing) -> None:
        try:
            _stage_jobs(jobs, ring, next_job, counted if progress is not None else None,
                        digests, files)
        except BaseException as error:  # the others stop at their next job; re-raised below
            with lock:
                failed.append(error)

    try:
        if threads == 1:
            run(rings[0])
        else:
            pool = [threading.Thread(target=run, args=(ring,), name=f"partc-stage-{n}",
                                     daemon=True) for n, ring in enumerate(rings)]
            for thread in pool:
                thread.start()
            for thread in pool:
                thread.join()
        stats = StagingStats(lanes=threads)
        for ring in rings:
            ring.drain()
            stats.add(ring.stats)
    finally:
        for fd, _ in files:
            os.close(fd)
    if failed:
        raise failed[0]
    return {name: out[name] for name in names}, stats


def torch_dtype(torch: Any, dtype: np.dtype[Any], name: str = "") -> Any:
    """The torch dtype of a numpy (or ml_dtypes) dtype of the same name."""
    found = getattr(torch, dtype.name, None)
    if not isinstance(found, torch.dtype):
        raise LaunchError(f"torch {torch.__version__} has no dtype {dtype.name}"
                          + (f" for tensor `{name}`" if name else ""), tensor=name or None)
    return found


def convert_on_device(tensors: dict[str, Any], dtype: np.dtype[Any] | None) -> dict[str, Any]:
    """Every floating tensor converted to `dtype` where it lies, one tensor at a time (None:
    unchanged); integer and packed tensors are left alone."""
    if dtype is None:
        return tensors
    torch = import_torch("a device load")
    target = torch_dtype(torch, dtype)
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dtype != target:
            tensors[name] = tensor.to(target)
    return tensors
