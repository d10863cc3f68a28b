"""Warm column gathers read whole rows with one vectored preadv per 1024 buffers, pieces
straight into the destination, gaps into a thread's scratch buffer (`_engine.rows`): checked
against the safetensors library's slices, with the bounce-buffer path forbidden, across
IOV_MAX boundaries, short reads and a truncated file; and the planner's choice, per warm job,
between whole rows and pieces copied by themselves."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.errors import CheckpointError
from partc.runtime import read_planner
from partc.runtime._engine import gather, rows, spans
from partc.runtime._engine.reader import CheckpointReader
from partc.runtime._engine.selection import TensorSelection
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime.read_planner import StorageModel

from support import Recorder, hf

LLAMA = hf("llama")
NAME = "model.layers.1.mlp.down_proj.weight"


def no_bounce(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read warm rows whole and make the bounce-buffer and per-piece paths fail: only
    `rows.vector_gather` may run."""
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a warm whole-row gather went through another path")

    monkeypatch.setattr(spans, "warm_rows_whole", lambda *_args: True)
    monkeypatch.setattr(spans, "_read", refuse)
    monkeypatch.setattr(gather, "run_gather", refuse)
    monkeypatch.setattr("partc.runtime._engine.reader.run_gather", refuse)


def expected(tensor: np.ndarray, sel: TensorSelection) -> np.ndarray:
    """The selection cut out of the whole tensor with numpy."""
    assert sel.axis is not None
    parts = [tensor[(slice(None),) * sel.axis + (slice(a, b),)] for a, b in sel.ranges]
    return np.concatenate(parts, axis=sel.axis)


SELECTIONS = [
    ((0, 16),),                    # the first columns: the gap runs to the next row's start
    ((16, 48),),                   # inside the row
    ((8, 20), (40, 52)),           # two ranges a row (fused segments): two gaps a row
    ((0, 4), (60, 64), (90, 97)),  # three short ranges, the last gap wrapping the row
]


@pytest.mark.parametrize("iov_max", [1024, 6, 7, 2])
@pytest.mark.parametrize("ranges", SELECTIONS)
def test_warm_whole_rows_land_straight_in_the_destination(
        monkeypatch: pytest.MonkeyPatch, ranges: tuple[tuple[int, int], ...],
        iov_max: int) -> None:
    # small IOV_MAX: calls that end on either kind of buffer, and one piece a call
    monkeypatch.setattr(rows, "IOV_MAX", iov_max)
    no_bounce(monkeypatch)
    tensor = load_file(str(LLAMA / "model.safetensors"))[NAME]
    sel = TensorSelection(1, ranges)
    recorder = Recorder()
    ckpt = open_checkpoint(LLAMA)
    header, entry = ckpt.tensor(NAME)
    from partc.runtime._engine.selection import ReadOptions

    with CheckpointReader(ckpt, ReadOptions(recorder=recorder)) as reader:
        got = reader.read_many([(NAME, sel)])[NAME]
    np.testing.assert_array_equal(got.view(np.uint8), expected(tensor, sel).view(np.uint8))
    # what was read: from the first piece of the first row to the last piece of the last,
    # every byte once, in file order, in requests of at most IOV_MAX buffers
    base, row = header.data_start + entry.begin, entry.shape[1] * 4
    spans_read = [(o, o + n) for _, o, n in recorder.runs]
    assert spans_read[0][0] == base + ranges[0][0] * 4
    assert spans_read[-1][1] == base + (entry.shape[0] - 1) * row + ranges[-1][1] * 4
    assert all(a[1] <= b[0] for a, b in zip(spans_read, spans_read[1:], strict=False))
    buffers = 2 * len(ranges) * entry.shape[0] - 1
    assert len(spans_read) >= -(-buffers // iov_max)


def test_short_reads_are_read_again_until_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gather.libc_function("preadv")
    assert real is not None
    calls = {"short": 0}

    def half(fd: int, vectors: int, count: int, offset: int) -> int:
        if count > 1:  # fill only the first half of the buffers, as a short read does
            calls["short"] += 1
            return int(real(fd, vectors, count // 2, offset))
        return int(real(fd, vectors, count, offset))

    monkeypatch.setitem(gather._LIBC, "preadv", half)
    no_bounce(monkeypatch)
    tensor = load_file(str(LLAMA / "model.safetensors"))[NAME]
    sel = TensorSelection(1, ((8, 20), (40, 52)))
    with CheckpointReader(open_checkpoint(LLAMA)) as reader:
        got = reader.read_many([(NAME, sel)])[NAME]
    assert calls["short"] > 0
    np.testing.assert_array_equal(got.view(np.uint8), expected(tensor, sel).view(np.uint8))


def test_a_file_truncated_inside_the_rows_is_an_error_naming_the_tensor(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    no_bounce(monkeypatch)
    path = tmp_path / "model.safetensors"
    shutil.copy(LLAMA / "model.safetensors", path)
    ckpt = open_checkpoint(path)
    header, entry = ckpt.tensor(NAME)
    with CheckpointReader(ckpt) as reader:
        reader.read("lm_head.weight")  # opens and checks the file
        os.truncate(path, header.data_start + entry.begin + entry.nbytes // 2)
        with pytest.raises(CheckpointError, match="truncated file") as info:
            reader.read_many([(NAME, TensorSelection(1, ((0, 16),)))])
    assert info.value.tensor == NAME


def test_the_bounce_path_still_reads_what_the_vectored_one_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = load_file(str(LLAMA / "model.safetensors"))[NAME]
    sel = TensorSelection(1, ((0, 4), (60, 64), (90, 97)))
    monkeypatch.setattr(spans, "_VECTORED", False)
    monkeypatch.setattr(spans, "warm_rows_whole", lambda *_args: True)
    used = []
    real = spans._read
    monkeypatch.setattr(spans, "_read", lambda *a, **k: used.append(1) or real(*a, **k))
    with CheckpointReader(open_checkpoint(LLAMA)) as reader:
        got = reader.read_many([(NAME, sel)])[NAME]
    assert used, "the bounce buffer was used"
    np.testing.assert_array_equal(got.view(np.uint8), expected(tensor, sel).view(np.uint8))


@pytest.fixture(autouse=True)
def default_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented models, whatever this machine has cached (`partc calibrate`)."""
    monkeypatch.setattr(read_planner, "_WARM",
                        [(read_planner.WARM_ROWS, read_planner.WARM_PIECES)])


def warm_job(row_bytes: int, ranges: list[tuple[int, int]]) -> gather.Gather:
    """A warm gather job of 8 rows of `row_bytes`, its pieces the byte `ranges` of each row."""
    pieces, at = [], 0
    for a, b in ranges:
        pieces.append((a, at, b - a))
        at += b - a
    out = np.empty((8, at), np.uint8)
    return gather.Gather(file=0, path="x", name="t", out=out, base=0, row_bytes=row_bytes,
                         rows=(0, 8), pieces=tuple(pieces), nbytes=out.nbytes)


@pytest.mark.parametrize(("row_bytes", "share", "whole"), [
    (5632, 2, True), (5632, 4, None), (5632, 8, None),   # down_proj of the reference model
    (2048, 2, True), (2048, 4, None), (2048, 8, None),   # o_proj
])
def test_a_warm_job_reads_a_wide_share_of_its_rows_whole_and_a_narrow_one_by_piece(
        row_bytes: int, share: int, whole: bool | None) -> None:
    # measured (benchmarks/warm_gathers.py, one thread, ms a MiB of the rank's columns; the
    # table of docs/performance.md, "Warm loads"): down_proj whole rows 0.29 / 0.56 / 1.07 at
    # T=2 / 4 / 8, by piece 0.36 / 0.45 / 0.59; o_proj 0.43 / 0.93 / 1.76 against 0.49 / 0.79 /
    # 1.09
    job = warm_job(row_bytes, [(0, row_bytes // share)])
    assert spans._warm_way(job) is whole
    # where the rank's share is in the row does not matter, only its width and the row's
    middle = warm_job(row_bytes, [(row_bytes // 4, row_bytes // 4 + row_bytes // share)])
    assert spans._warm_way(middle) is whole


def test_the_narrower_the_share_the_likelier_pieces_by_themselves() -> None:
    # one switch from whole rows to pieces as the share narrows, for every row width
    for row_bytes in (256, 1024, 4096, 16384, 65536):
        ways = [spans._warm_way(warm_job(row_bytes, [(0, max(1, int(row_bytes / t)))]))
                for t in (1.5, 2, 3, 4, 6, 8, 16, 32)]
        switched = [w is None for w in ways]
        assert switched == sorted(switched), (row_bytes, ways)


def test_without_process_vm_writev_warm_rows_are_read_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # each piece would otherwise be a preadv call of its own
    narrow = warm_job(5632, [(0, 704)])
    assert spans._warm_way(narrow) is None
    monkeypatch.setattr(gather, "_USE_VM_COPY", False)
    assert spans._warm_way(narrow) is True
    monkeypatch.setattr(gather, "_USE_VM_COPY", True)
    monkeypatch.setitem(gather._LIBC, "process_vm_writev", None)  # refused earlier
    assert spans._warm_way(narrow) is True


def test_a_calibrated_machine_chooses_by_its_own_models(monkeypatch: pytest.MonkeyPatch) -> None:
    # a machine whose kernel copies rows fast (rep movsb) reads even an eighth's rows whole;
    # one whose pieces are cheap copies even a half's pieces by themselves
    half, eighth = warm_job(5632, [(0, 2816)]), warm_job(5632, [(0, 704)])
    fast_rows = (StorageModel(0.05e-6, 40e9), read_planner.WARM_PIECES)
    monkeypatch.setattr(read_planner, "_WARM", [fast_rows])
    assert spans._warm_way(eighth) is True and spans._warm_way(half) is True
    cheap_pieces = (read_planner.WARM_ROWS, StorageModel(0.01e-6, 40e9))
    monkeypatch.setattr(read_planner, "_WARM", [cheap_pieces])
    assert spans._warm_way(eighth) is None and spans._warm_way(half) is None


def test_ranges_out_of_column_order_are_copied_piece_by_piece() -> None:
    assert spans._warm_way(warm_job(4096, [(2048, 3072), (0, 1024)])) is None


def test_jobs_of_one_structure_share_their_buffers_and_each_lands_in_its_own_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # every layer's down_proj, cut in blocks of rows: one structure of job (worked out once),
    # offset per job by its destination, its first row and its tensor's place in the file
    no_bounce(monkeypatch)
    monkeypatch.setattr(gather, "_GATHER_BLOCK", 4096)
    rows._TEMPLATES.clear()
    tensors = load_file(str(LLAMA / "model.safetensors"))
    names = sorted(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    sel = TensorSelection(1, ((16, 48),))
    ckpt = open_checkpoint(LLAMA)
    with CheckpointReader(ckpt) as reader:
        got = reader.read_many([(name, sel) for name in names])
    assert len(names) > 1
    for name in names:
        np.testing.assert_array_equal(got[name].view(np.uint8),
                                      expected(tensors[name], sel).view(np.uint8), name)
    blocks = {key[0] for key in rows._TEMPLATES}
    assert len(rows._TEMPLATES) <= 2 and max(blocks) < ckpt.tensor(names[0])[1].shape[0], \
        "a few structures of job (full blocks and the last), each worked out once"


def test_ranges_given_as_lists_are_gathered_like_tuples(monkeypatch: pytest.MonkeyPatch) -> None:
    # the gather layout of a selection is kept by its (hashable) ranges; lists are worked out
    # each time, to the same columns
    no_bounce(monkeypatch)
    tensor = load_file(str(LLAMA / "model.safetensors"))[NAME]
    ckpt = open_checkpoint(LLAMA)
    with CheckpointReader(ckpt) as reader:
        listed = reader.read_many([(NAME, TensorSelection(1, [[8, 20], [40, 52]]))])[NAME]
    want = expected(tensor, TensorSelection(1, ((8, 20), (40, 52))))
    np.testing.assert_array_equal(listed.view(np.uint8), want.view(np.uint8))
