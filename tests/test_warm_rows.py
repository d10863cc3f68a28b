"""Warm column gathers read whole rows with one vectored preadv per 1024 buffers, pieces
straight into the destination, gaps into a thread's scratch buffer (`_engine.rows`): checked
against the safetensors library's slices, with the bounce-buffer path forbidden, across
IOV_MAX boundaries, short reads and a truncated file; and the planner's one-row plan of a warm
job against the full per-piece plan."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.errors import CheckpointError
from partc.runtime._engine import gather, rows, spans
from partc.runtime._engine.reader import CheckpointReader
from partc.runtime._engine.selection import TensorSelection
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime.read_planner import WARM, StorageModel, plan_merges

from support import Recorder, hf

LLAMA = hf("llama")
NAME = "model.layers.1.mlp.down_proj.weight"


def no_bounce(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the bounce-buffer and per-piece paths fail: only `rows.vector_gather` may run."""
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a warm whole-row gather went through another path")

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
    used = []
    real = spans._read
    monkeypatch.setattr(spans, "_read", lambda *a, **k: used.append(1) or real(*a, **k))
    with CheckpointReader(open_checkpoint(LLAMA)) as reader:
        got = reader.read_many([(NAME, sel)])[NAME]
    assert used, "the bounce buffer was used"
    np.testing.assert_array_equal(got.view(np.uint8), expected(tensor, sel).view(np.uint8))


@pytest.mark.parametrize("seed", range(40))
def test_one_rows_plan_repeated_is_the_per_piece_plan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    row_bytes = int(rng.integers(64, 40000))
    cuts = np.sort(rng.choice(np.arange(1, row_bytes), size=2 * int(rng.integers(1, 4)),
                              replace=False))
    pieces, at = [], 0
    for a, b in zip(cuts[::2].tolist(), cuts[1::2].tolist(), strict=True):
        pieces.append((a, at, b - a))
        at += b - a
    out = np.empty((int(rng.integers(1, 9)), at), np.uint8)
    job = gather.Gather(file=0, path="x", name="t", out=out, base=int(rng.integers(0, 999)),
                        row_bytes=row_bytes, rows=(0, out.shape[0]), pieces=tuple(pieces),
                        nbytes=out.nbytes)
    model = StorageModel(float(rng.choice([0.2e-6, 1e-6, 3e-6])), WARM.bandwidth)
    starts, ends = spans.job_runs(job)
    full = plan_merges(starts, ends, model)
    want = True if full.all() else None if not full.any() else full
    got = spans._row_merge(job, model)
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, want)
    else:
        assert got is want


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
