"""Load paths: zero-copy views, exact byte runs with readahead off, destinations faulted in by
the reader threads, and reader threads sized from the cores and the node's loading ranks."""

from __future__ import annotations

import math
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.errors import CheckpointError
from partc.runtime._engine import gather, rows, spans, workers
from partc.runtime._engine import reader as checkpoint
from partc.runtime._engine.reader import CheckpointReader
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime._engine.workers import default_workers
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime.options import ZeroCopy

from support import ColumnQuarter, Recorder, assert_same_tensors, compile_and_import, hf

LLAMA = hf("llama")


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The llama fixture compiled for T=2, S=1."""
    out = tmp_path_factory.mktemp("load-paths") / "build"
    return compile_and_import("llama", LLAMA / "config.json", out, tp=2, pp=1,
                              checkpoint=LLAMA)[1]


def one_run(shape: tuple[int, ...], axis: int | None, ranges: tuple[tuple[int, int], ...]
            ) -> bool:
    """Whether a selection is one contiguous byte run of its tensor (computed from the shape)."""
    if axis is None:
        return True
    kept = [r for r in ranges if r[1] > r[0]]
    return math.prod(shape[:axis]) == 1 and len(kept) == 1


def mapped_base(array: np.ndarray) -> object:
    """The object at the bottom of an array's base chain."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def view_kind(shape: tuple[int, ...], axis: int | None,
              ranges: tuple[tuple[int, int], ...]) -> str:
    """How zero-copy returns a selection, computed from the shape: "run" (one contiguous byte
    run), "strided" (one range along an inner axis) or "copy"."""
    if one_run(shape, axis, ranges):
        return "run"
    return "strided" if len([r for r in ranges if r[1] > r[0]]) == 1 else "copy"


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_zero_copy_views_are_read_only_and_equal_the_gathered_arrays(
        tmp_path: Path, family: str) -> None:
    module = compile_and_import(family, hf(family) / "config.json", tmp_path / "build", tp=2,
                                pp=1, checkpoint=hf(family))[1]
    kinds: dict[str, int] = {}
    full = load_file(str(hf(family) / "model.safetensors"))
    for rank in range(2):
        gathered = module.load(hf(family), rank=rank)
        state = module.load(hf(family), rank=rank, zero_copy=True)
        assert_same_tensors(state.tensors, gathered.tensors)
        for item in state.layout.tensors:
            array = state.tensors[item.target]
            axis, ranges = item.selection
            kind = view_kind(full[item.target].shape, axis, ranges)
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "copy":
                assert array.flags.writeable and array.flags.c_contiguous, item.target
            else:
                assert not array.flags.writeable, item.target
                assert array.flags.c_contiguous == (kind == "run") or array.size <= 1, \
                    item.target
                assert isinstance(mapped_base(array), mmap.mmap), item.target
                with pytest.raises(ValueError, match="read-only"):
                    array[(0,) * array.ndim] = 0
                if axis is not None:  # the safetensors library's tensor, sliced by numpy
                    (start, end), = [r for r in ranges if r[1] > r[0]]
                    want = np.take(full[item.target], np.arange(start, end), axis=axis)
                    np.testing.assert_array_equal(array.view(np.uint8), want.view(np.uint8))
            assert gathered.tensors[item.target].flags.writeable, item.target
            assert gathered.tensors[item.target].flags.c_contiguous, item.target
    assert kinds.get("run") and kinds.get("strided"), kinds
    if family == "phi3":
        assert kinds.get("copy"), "phi3's fused projections are cut into several ranges"


def test_zero_copy_views_outlive_the_reader_and_leave_the_file_unchanged(
        tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes((LLAMA / "model.safetensors").read_bytes())
    before = path.read_bytes()
    ckpt = open_checkpoint(path)
    name = "model.embed_tokens.weight"
    rows = ckpt.tensor(name)[1].shape[0]
    with CheckpointReader(ckpt, ReadOptions(zero_copy=ZeroCopy.SHARED)) as r:
        got = r.read_many([(name, TensorSelection(axis=0, ranges=((1, rows - 1),)))])[name]
    want = load_file(str(path))[name][1:rows - 1]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert path.read_bytes() == before


def test_zero_copy_is_refused_for_torch_and_local_ranks_must_be_positive(
        llama_tp2: Any) -> None:
    with pytest.raises(CheckpointError, match="read-only views .* torch tensors cannot be"):
        llama_tp2.load(LLAMA, rank=0, zero_copy=True, framework="torch")
    with pytest.raises(CheckpointError, match="local_ranks must be a positive integer, "
                                              "found 0"):
        llama_tp2.load(LLAMA, rank=0, local_ranks=0)


@pytest.mark.parametrize("vm_read", [True, False])
def test_column_runs_are_read_exactly_with_readahead_off(
        monkeypatch: pytest.MonkeyPatch, vm_read: bool) -> None:
    advice: list[tuple[int, int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, how: int) -> None:
        advice.append((fd, offset, length, how))
        real(fd, offset, length, how)

    monkeypatch.setattr(os, "posix_fadvise", record)
    monkeypatch.setattr(gather, "_USE_VM_COPY", vm_read)
    read = ColumnQuarter(LLAMA, max_fetch_ratio=1.0)
    want = {(str(read.path), offset, length) for offset, length in read.runs()}
    assert sorted(read.recorder.runs) == sorted(want), "one run per row: the selected columns only"
    read.assert_equal_to_safetensors()
    # one advice for the descriptor that read the header, one for the reader's
    assert [(o, n, h) for _, o, n, h in advice] == [(0, 0, os.POSIX_FADV_RANDOM)] * 2
    assert len({fd for fd, _, _, _ in advice}) <= 2


def test_destinations_are_faulted_in_by_the_reader_threads_that_fill_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int, int, int]] = []
    lock = threading.Lock()

    def populate(address: int, start: int, end: int) -> None:
        with lock:
            calls.append((threading.current_thread().name, address, start, end))

    monkeypatch.setattr(checkpoint, "populate", populate)
    monkeypatch.setattr(gather, "populate", populate)
    monkeypatch.setattr(spans, "populate", populate)  # column slices read as whole rows
    monkeypatch.setattr(rows, "populate", populate)  # those rows by vectored preadv
    monkeypatch.setattr(checkpoint, "THREADED_BYTES", 0)
    monkeypatch.setattr(checkpoint, "JOB_BYTES", 4096)
    monkeypatch.setattr(gather, "_GATHER_BLOCK", 4096)
    ckpt = open_checkpoint(LLAMA)
    requests = [(n, TensorSelection(axis=len(ckpt.tensor(n)[1].shape) - 1,
                                    ranges=((0, ckpt.tensor(n)[1].shape[-1] // 2),)))
                for n in ckpt.names if ckpt.tensor(n)[1].shape]
    with CheckpointReader(ckpt, ReadOptions(workers=3)) as r:
        got = r.read_many(requests)
    readers = {threading.current_thread().name, "partc-read-0", "partc-read-1"}
    assert calls and {name for name, *_ in calls} <= readers, "three threads, the caller one"
    covered = {id(a): np.zeros(a.nbytes, bool) for a in got.values()}
    extents = [(int(a.ctypes.data), a.nbytes, id(a)) for a in got.values() if a.nbytes]
    for _, address, start, end in calls:
        base, size, key = next(s for s in extents if s[0] <= address + start < s[0] + s[1])
        assert address + end <= base + size, "a populate stays inside its destination"
        covered[key][address - base + start:address - base + end] = True
    for name, array in got.items():
        assert covered[id(array)].all(), f"every destination byte of {name} is faulted in"


def test_each_read_follows_the_faulting_in_of_its_own_destination_in_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a run longer than FAULT_STEP is read in steps, each step's destination faulted in right
    # before its read (while the zeroed pages are still in the core's cache), and never more
    step = 3000
    monkeypatch.setattr(checkpoint, "FAULT_STEP", step)
    faults: list[tuple[int, int]] = []  # since the last read: (first address, end address)
    reads: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []  # (buffers, faults)
    real_preadv = os.preadv

    def populate(address: int, start: int, end: int) -> None:
        faults.append((address + start, address + end))

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        spans = [(int(np.frombuffer(b, np.uint8).ctypes.data), len(b)) for b in buffers]
        reads.append(([(a, a + n) for a, n in spans], faults[:]))
        faults.clear()
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(checkpoint, "populate", populate)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(checkpoint, "THREADED_BYTES", 1 << 40)  # one thread: one order
    ckpt = open_checkpoint(LLAMA)
    names = [n for n in ckpt.names if ckpt.tensor(n)[1].nbytes > 2 * step]
    with CheckpointReader(ckpt) as r:
        got = r.read_many([(n, TensorSelection()) for n in names])
    want = load_file(str(LLAMA / "model.safetensors"))
    for name in names:
        np.testing.assert_array_equal(got[name], want[name])
    assert len(reads) > len(names), "the long runs were read in several steps"
    for buffers, faulted in reads:
        assert sum(b - a for a, b in buffers) <= step
        for first, end in buffers:
            assert any(a <= first and end <= b for a, b in faulted), \
                "each destination faulted in since the read before"


def test_reader_threads_share_the_cores_among_the_node_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PARTC_READ_THREADS", "PARTC_LOCAL_RANKS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(workers, "usable_cores", lambda: 8)
    assert default_workers() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_workers() == 2
    assert default_workers(local_ranks=2) == 4, "an explicit count overrides torchrun's"
    monkeypatch.setenv("PARTC_LOCAL_RANKS", "8")
    assert default_workers() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    monkeypatch.delenv("PARTC_LOCAL_RANKS")
    assert default_workers() == 1, "at least one thread however many ranks share the node"
    monkeypatch.setenv("PARTC_READ_THREADS", "3")
    assert default_workers() == 3, "PARTC_READ_THREADS wins"


def test_a_load_under_torchrun_uses_its_share_of_the_cores(
        monkeypatch: pytest.MonkeyPatch, llama_tp2: Any) -> None:
    monkeypatch.delenv("PARTC_READ_THREADS", raising=False)
    monkeypatch.delenv("PARTC_LOCAL_RANKS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(workers, "usable_cores", lambda: 8)
    monkeypatch.setattr(checkpoint, "THREADED_BYTES", 0)
    monkeypatch.setattr(checkpoint, "JOB_BYTES", 1024)
    threads: set[str] = set()

    class Threads(Recorder):
        def record(self, path: str, offset: int, length: int) -> None:
            threads.add(threading.current_thread().name)
            super().record(path, offset, length)

    state = llama_tp2.load(LLAMA, rank=1, reader=Threads())
    assert_same_tensors(state.tensors, llama_tp2.load(LLAMA, rank=1, workers=1).tensors)
    assert threads and threads <= {threading.current_thread().name, "partc-read-0"}, threads
