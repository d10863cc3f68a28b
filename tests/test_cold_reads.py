"""Cold column gathers: rows not in the page cache are read with O_DIRECT, as the read planner
says (whole rows in large requests by default; one sector-aligned read per run under a byte cap
of 1.0), and a load capped at 1.0 reads exactly the byte runs of the rank's share on every
path."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.runtime._engine import gather, runs, spans, workers
from partc.runtime._engine.reader import CheckpointReader
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime.headers import DTYPES

from support import (
    ColumnQuarter,
    Recorder,
    assert_same_tensors,
    compile_and_import,
    direct_supported,
    hf,
)

LLAMA = hf("llama")


def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(offset, length) of every preadv on an O_DIRECT descriptor from now on."""
    seen: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", preadv)
    return seen


def fadvise_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(offset, length, advice) of every posix_fadvise from now on (the advice still given)."""
    seen: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        seen.append((offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return seen


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    """The llama fixture copied (a file of this test's own)."""
    folder = tmp_path / "llama"
    shutil.copytree(LLAMA, folder, ignore=shutil.ignore_patterns("sharded"))
    return folder


def sectors_of(runs: list[tuple[int, int]]) -> list[int]:
    """The 512-byte sectors (their numbers, with repeats) that reading each (offset, length)
    as one sector-aligned request fetches."""
    return sorted(s for o, n in runs for s in range(o // 512, -(-(o + n) // 512)))


def test_a_cold_column_slice_reads_the_sectors_of_its_runs_and_nothing_else(
        monkeypatch: pytest.MonkeyPatch, copy: Path) -> None:
    # capped at 1.0: the planner reads through only gaps that cost no sector (this fixture's
    # 128-byte runs share sectors with their neighbours), so storage sends each sector of the
    # runs once and nothing else
    path = copy / "model.safetensors"
    direct = direct_supported(path)  # a file system that refuses it reads through the cache
    monkeypatch.setattr(gather, "_resident", lambda address, start, end: 0.0)
    seen = direct_reads(monkeypatch)
    read = ColumnQuarter(path, workers=1, max_fetch_ratio=1.0)
    assert gather.gatherable(read.entry, read.selection)
    want_runs = read.runs()
    wanted = sorted(set(sectors_of(want_runs)))
    fetched = sectors_of([(o, n) for _, o, n in read.recorder.runs])
    assert sorted(set(fetched)) == wanted and len(fetched) == len(set(fetched)), \
        "the runs' sectors, each once, and no other"
    owned = {b for o, n in want_runs for b in range(o, o + n)}
    assert owned <= {b for _, o, n in read.recorder.runs for b in range(o, o + n)}
    if direct:
        assert sectors_of(seen) == wanted, "aligned reads fetching each sector once"
    else:
        assert seen == [], "a refused O_DIRECT falls back to reads through the page cache"
    read.assert_equal_to_safetensors()


def test_warm_rows_are_not_read_with_o_direct(monkeypatch: pytest.MonkeyPatch,
                                              copy: Path) -> None:
    path = copy / "model.safetensors"
    path.read_bytes()  # in the page cache
    monkeypatch.setattr(gather, "_resident", lambda address, start, end: 1.0)
    seen = direct_reads(monkeypatch)
    ckpt = open_checkpoint(path)
    name = "model.layers.0.mlp.down_proj.weight"
    cols = ckpt.tensor(name)[1].shape[1]
    with CheckpointReader(ckpt) as r:
        got = r.read_many([(name, TensorSelection(axis=1, ranges=((0, cols // 2),)))])[name]
    assert seen == []
    np.testing.assert_array_equal(got.view(np.uint8),
                                  load_file(str(path))[name][:, :cols // 2].view(np.uint8))


def test_a_cold_column_slice_reads_whole_rows_in_large_aligned_requests_by_default(
        monkeypatch: pytest.MonkeyPatch, copy: Path) -> None:
    # the storage model says a request costs more than the gaps between a row's runs: the rows
    # are read whole, in sector-aligned O_DIRECT requests of up to the bounce buffer's size (on a
    # file system refusing O_DIRECT, the same spans through the page cache)
    path = copy / "model.safetensors"
    direct = direct_supported(path)
    monkeypatch.setattr(gather, "_resident", lambda address, start, end: 0.0)
    monkeypatch.setattr(spans, "BOUNCE_BYTES", 4096)  # several requests on the tiny fixture
    seen = direct_reads(monkeypatch)
    read = ColumnQuarter(path, workers=1)
    read.assert_equal_to_safetensors()
    base, rows, cols, item, recorder = read.base, read.rows, read.cols, read.item, read.recorder
    first, last = base + cols // 4 * item, base + ((rows - 1) * cols + cols // 2) * item
    spans_read = sorted((o, o + n) for _, o, n in recorder.runs)
    assert spans_read[0][0] == first and spans_read[-1][1] == last
    assert all(a[1] <= b[0] for a, b in zip(spans_read, spans_read[1:], strict=False)), \
        "each byte once"
    assert len(spans_read) < rows, "fewer requests than rows"
    if not direct:
        assert seen == [], "a refused O_DIRECT falls back to reads through the page cache"
        return
    assert len(seen) == len(spans_read), "one O_DIRECT request per span"
    assert all(o % 512 == 0 and n % 512 == 0 for o, n in seen), "sector-aligned"
    assert all(any(o <= a and b <= o + n for o, n in seen) for a, b in spans_read)


@pytest.mark.parametrize("path", ["warm", "cold", "preadv"])
def test_a_rank_reads_exactly_the_byte_runs_of_its_share_on_every_path(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, copy: Path, path: str) -> None:
    module = compile_and_import("llama", copy / "config.json", tmp_path / "build", tp=2, pp=1,
                                checkpoint=copy)[1]
    monkeypatch.setattr(gather, "_resident",
                        lambda address, start, end: 0.0 if path == "cold" else 1.0)
    monkeypatch.setattr(gather, "_USE_VM_COPY", path != "preadv")
    ckpt = open_checkpoint(copy)
    full = load_file(str(copy / "model.safetensors"))
    for rank in range(2):
        recorder = Recorder()
        state = module.load(copy, rank=rank, reader=recorder, max_fetch_ratio=1.0)
        expected: set[tuple[str, int, int]] = set()
        for item in state.layout.tensors:
            header, entry = ckpt.tensor(item.target)
            axis, ranges = item.selection
            sel = TensorSelection(axis=axis, ranges=ranges)
            src, _, length = runs.byte_runs(entry, sel)
            base = header.data_start + entry.begin
            item_bytes = DTYPES[entry.dtype].itemsize
            if gather.gatherable(entry, sel):  # gathers record one run per row and range
                outer = int(np.prod(entry.shape[:axis]))
                inner = int(np.prod(entry.shape[axis + 1:])) * item_bytes
                row = entry.shape[axis] * inner
                expected |= {(str(header.path), base + r * row + a * inner, (b - a) * inner)
                             for r in range(outer) for a, b in ranges if b > a}
            else:
                expected |= {(str(header.path), base + int(s), int(n))
                             for s, n in zip(src, length, strict=True)}
            want = full[item.target]
            if axis is not None:
                want = np.concatenate([np.take(want, np.arange(a, b), axis=axis)
                                       for a, b in ranges], axis=axis)
            np.testing.assert_array_equal(state.tensors[item.target].view(np.uint8),
                                          want.view(np.uint8))
        covered: dict[str, set[int]] = {}
        for file, offset, length in recorder.runs:
            covered.setdefault(file, set()).update(range(offset, offset + length))
        owned: dict[str, set[int]] = {}
        for file, offset, length in expected:
            owned.setdefault(file, set()).update(range(offset, offset + length))
        assert sum(n for _, _, n in recorder.runs) == sum(len(v) for v in covered.values()), \
            "no byte read twice"
        if path != "cold":
            assert covered == owned, f"rank {rank} read exactly its share ({path})"
            continue
        # O_DIRECT fetches sectors: gaps that cost no sector are read through, nothing else
        assert all(owned[f] <= covered[f] for f in owned) and covered.keys() == owned.keys()
        assert all({b // 512 for b in covered[f]} == {b // 512 for b in owned[f]}
                   for f in owned), f"rank {rank} read the sectors of its share only"


def test_cold_loads_match_warm_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     copy: Path) -> None:
    module = compile_and_import("llama", copy / "config.json", tmp_path / "build", tp=2, pp=1,
                                checkpoint=copy)[1]
    warm = module.load(copy, rank=1)
    monkeypatch.setattr(gather, "_resident", lambda address, start, end: 0.0)
    assert_same_tensors(module.load(copy, rank=1).tensors, warm.tensors)


def test_cold_loads_take_the_node_share_of_the_direct_threads_unless_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PARTC_READ_THREADS", "PARTC_LOCAL_RANKS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(workers, "usable_cores", lambda: 2)
    ckpt = open_checkpoint(LLAMA)
    assert CheckpointReader(ckpt)._cold_workers == gather.DIRECT_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert CheckpointReader(ckpt)._cold_workers == gather.DIRECT_THREADS // 4
    assert CheckpointReader(ckpt, ReadOptions(workers=1))._cold_workers == 1, "workers= is honoured"
    monkeypatch.setenv("PARTC_READ_THREADS", "3")
    assert CheckpointReader(ckpt)._cold_workers == 3, "PARTC_READ_THREADS is honoured"


def test_ranks_loading_together_read_cold_rows_through_the_page_cache(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, copy: Path) -> None:
    # the ranks of a node share the pages (and sectors) of their column runs: O_DIRECT would
    # fetch every shared sector once per rank, the page cache once for the node; each cold job
    # first asks for its whole rows (the node's other ranks read the rest of them)
    module = compile_and_import("llama", copy / "config.json", tmp_path / "build", tp=2, pp=1,
                                checkpoint=copy)[1]
    warm = module.load(copy, rank=1)
    monkeypatch.setattr(gather, "_resident", lambda address, start, end: 0.0)
    advice = fadvise_calls(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    seen = direct_reads(monkeypatch)
    recorder = Recorder()
    together = module.load(copy, rank=1, reader=recorder)
    assert seen == [], "no O_DIRECT read when the node's ranks load together"
    assert_same_tensors(together.tensors, warm.tensors)
    ckpt = open_checkpoint(copy)
    spans = []  # the rows of every gathered (column-sliced) tensor of rank 1
    for item in together.layout.tensors:
        header, entry = ckpt.tensor(item.target)
        axis, ranges = item.selection
        if axis is not None and gather.gatherable(entry, TensorSelection(axis=axis,
                                                                          ranges=ranges)):
            base = header.data_start + entry.begin
            spans.append((base, base + entry.nbytes))
    assert spans, "the llama fixture's rank 1 has column slices"
    wanted = [(o, o + n) for o, n, how in advice if how == os.POSIX_FADV_WILLNEED]
    rows = sorted(w for w in wanted if any(a <= w[0] and w[1] <= b for a, b in spans))
    assert rows, "whole rows of gathered tensors asked for"
    assert sum(e - o for o, e in rows) == sum(b - a for a, b in spans), \
        "every row of every gathered tensor, once"
    read = {b for _, o, n in recorder.runs for b in range(o, o + n)}
    assert all(set(range(o, e)) <= read for o, e in wanted if (o, e) not in rows), \
        "the other advice asks for the rank's own row-slice runs ahead of their reads"
    alone = Recorder()
    advice.clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    module.load(copy, rank=1, reader=alone)
    assert sorted(recorder.runs) == sorted(alone.runs), "the same byte runs either way"
    if direct_supported(copy / "model.safetensors"):
        assert seen, "a rank alone reads its cold column runs with O_DIRECT"
        asked = [(o, o + n) for o, n, how in advice if how == os.POSIX_FADV_WILLNEED]
        assert asked, "a rank alone asks for its cold row slices ahead of their reads"
        assert all(set(range(o, e)) <= read for o, e in asked) and not any(
            a <= o and e <= b for o, e in asked for a, b in spans), \
            "a rank alone asks for its own row-slice runs only: its column runs are O_DIRECT"


def test_page_cache_residency_is_measured_from_the_kernel(tmp_path: Path) -> None:
    # a real file, half evicted: the sampled mincore answer follows the page cache
    path = tmp_path / "data.bin"
    page = os.sysconf("SC_PAGE_SIZE")
    size = 4096 * page
    path.write_bytes(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        ckpt_header = type("Header", (), {"path": path, "file_size": size})()
        source = gather.GatherFile(ckpt_header, fd, "data")  # type: ignore[arg-type]
        if gather.libc_function("mincore") is None:
            assert source.resident(0, size) == 1.0, "unknown residency counts as cached"
            return
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        evicted = source.resident(0, size)
        os.pread(fd, size, 0)
        cached = source.resident(0, size)
        os.posix_fadvise(fd, size // 2, 0, os.POSIX_FADV_DONTNEED)
        half = source.resident(0, size)
        small = source.resident(0, 3 * page)  # fewer pages than one window
        source.close()
    finally:
        os.close(fd)
    assert cached == 1.0
    assert evicted < 0.2, "an evicted file reads as cold"
    assert 0.3 <= half <= 0.7, f"half the file cached reads as about half ({half})"
    assert small == 1.0


def test_residency_asks_the_two_end_windows_first_and_the_rest_only_when_they_differ(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "data.bin"
    page = os.sysconf("SC_PAGE_SIZE")
    size = 4096 * page
    path.write_bytes(np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    real = gather.libc_function("mincore")
    if real is None:
        os.close(fd)
        pytest.fail("mincore is missing on this Linux machine")
    asked: list[int] = []
    try:
        os.fsync(fd)
        source = gather.GatherFile(type("Header", (), {"path": path, "file_size": size})(),
                                   fd, "data")  # type: ignore[arg-type]

        def counted(address: int, length: int, vector: int) -> int:
            asked.append(length)
            return real(address, length, vector)

        monkeypatch.setitem(gather._LIBC, "mincore", counted)
        answers = {}
        for state, evict in (("cached", None), ("evicted", (0, 0)),
                             ("last half evicted", (size // 2, 0)),
                             ("middle evicted", (size // 4, size // 2))):
            os.pread(fd, size, 0)
            if evict is not None:
                os.posix_fadvise(fd, *evict, os.POSIX_FADV_DONTNEED)
            asked.clear()
            answers[state] = (source.resident(0, size), len(asked))
        source.close()
    finally:
        os.close(fd)
    if answers["evicted"][0] == 1.0:
        pytest.fail("this file system kept the file cached after POSIX_FADV_DONTNEED")
    windows = gather._PROBE_WINDOWS
    assert answers["cached"] == (1.0, 2), "both ends cached: two calls, cached"
    assert answers["evicted"] == (0.0, 2), "both ends evicted: two calls, cold"
    assert answers["last half evicted"][1] == windows
    assert 0.3 <= answers["last half evicted"][0] <= 0.7, "ends differ: every window asked"
    assert answers["middle evicted"] == (1.0, 2), "both ends cached: read as cached (sampled)"


def test_reading_a_header_does_not_read_ahead_into_the_tensor_data(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # a cold rank that opens a checkpoint must not fetch the readahead window (MiBs of other
    # ranks' tensors) behind the header
    from safetensors.numpy import save_file

    from partc.runtime.headers import read_header

    path = tmp_path / "model.safetensors"
    save_file({"w": np.zeros((4096, 1024), dtype=np.float32)}, str(path))  # 16 MiB of data
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        probe = gather.GatherFile(read_header(path), fd, "w")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        evicted = probe.resident(0, size)
        advised = fadvise_calls(monkeypatch)
        header = read_header(path)
        after = probe.resident(4 << 20, size)  # past the header's own pages
        probe.close()
    finally:
        os.close(fd)
    assert header.tensors["w"].shape == (4096, 1024)
    assert [a for _, _, a in advised] == [os.POSIX_FADV_RANDOM], "one advice, before any read"
    if evicted < 0.2:  # this file system evicts on request: the data stayed on storage
        assert after < 0.2, f"{after:.0%} of the data behind the header was read ahead"
