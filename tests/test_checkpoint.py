"""Tests of partc.checkpoint: header validation, sharded checkpoints, rank-selective reads."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from partc.errors import CheckpointError, LaunchError
from partc.runtime import headers
from partc.runtime._engine import gather, workers
from partc.runtime._engine import reader as checkpoint
from partc.runtime._engine.reader import CheckpointReader, read_tensor, read_tensors
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime.checkpoint import Checkpoint, open_checkpoint
from partc.runtime.headers import DTYPES, MAX_HEADER_SIZE, FileHeader, read_header

from support import FIXTURES, Recorder, bits

np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # type: ignore[attr-defined]  # for load_file

LLAMA = FIXTURES / "hf" / "llama" / "model.safetensors"
LLAMA_SHARDED = FIXTURES / "hf" / "llama" / "sharded"
FP8 = FIXTURES / "quantized" / "deepseek_v3_fp8" / "model.safetensors"
MLX4 = FIXTURES / "quantized" / "llama_mlx4"
MXFP4 = FIXTURES / "quantized" / "gpt_oss_mxfp4" / "model.safetensors"
DEEPSEEK_HEADER = FIXTURES / "fullsize" / "DeepSeek-V3" / "safetensors_header.json"


def assert_same(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(bits(got), bits(want))


def expected(full: np.ndarray[Any, Any], sel: TensorSelection) -> np.ndarray[Any, Any]:
    if sel.axis is None:
        return full
    parts = [np.take(full, np.arange(a, b), axis=sel.axis) for a, b in sel.ranges]
    if not parts:
        shape = list(full.shape)
        shape[sel.axis] = 0
        return np.empty(shape, full.dtype)
    return np.concatenate(parts, axis=sel.axis)


def selections(shape: tuple[int, ...]) -> list[TensorSelection]:
    """Whole, halves, a split out-of-order pair and adjacent ranges on every axis."""
    out = [TensorSelection()]
    for axis, dim in enumerate(shape):
        half = dim // 2
        out.append(TensorSelection(axis, ((0, half),)))
        out.append(TensorSelection(axis, ((half, dim),)))
        out.append(TensorSelection(axis, ((half, dim), (0, half))))
        out.append(TensorSelection(axis, ((0, half), (half, dim))))
        if dim >= 3:
            out.append(TensorSelection(axis, ((1, 2), (dim - 1, dim), (0, 1))))
    return out


def write_raw(path: Path, header: bytes | dict[str, Any], payload: bytes = b"",
              length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + payload)
    return path


def entry(dtype: str, shape: list[Any], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def fault(path: Path, *needles: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    err = info.value
    assert err.location is not None
    for needle in needles:
        assert needle in err.message, err.message
    return err


# --- real fixtures -------------------------------------------------------------------------


@pytest.mark.parametrize("source", [LLAMA, LLAMA_SHARDED, FP8, MLX4, MXFP4],
                         ids=["llama", "llama-sharded", "deepseek-fp8", "llama-mlx4", "gpt-mxfp4"])
def test_every_fixture_tensor_reads_whole_and_through_every_selection_like_safetensors(
        source: Path) -> None:
    ckpt = open_checkpoint(source)
    reference: dict[str, np.ndarray[Any, Any]] = {}
    for header in ckpt.files:
        reference.update(load_file(header.path))
    assert set(reference) == set(ckpt.names)
    with CheckpointReader(ckpt) as reader:
        for name in ckpt.names:
            full = reference[name]
            assert DTYPES[ckpt.tensor(name)[1].dtype] == full.dtype
            for sel in selections(full.shape):
                assert_same(reader.read(name, sel), expected(full, sel))


def test_the_fixtures_cover_fp8_bf16_f32_and_u32() -> None:
    seen = {e.dtype for path in (FP8, MLX4 / "model.safetensors")
            for e in read_header(path).tensors.values()}
    assert {"F8_E4M3", "BF16", "F32", "U32"} <= seen


def test_sharded_and_single_file_llama_give_identical_tensors() -> None:
    single, sharded = open_checkpoint(LLAMA), open_checkpoint(LLAMA_SHARDED)
    assert single.names == sharded.names
    assert len(sharded.files) == 4 and sharded.index_path is not None
    for name in single.names:
        shape = single.tensor(name)[1].shape
        for sel in selections(shape):
            assert_same(read_tensor(sharded, name, sel), read_tensor(single, name, sel))


def test_the_header_fingerprint_ignores_file_layout_and_sees_every_name_dtype_and_shape(
        tmp_path: Path) -> None:
    single, sharded = open_checkpoint(LLAMA), open_checkpoint(LLAMA_SHARDED)
    assert single.fingerprint() == sharded.fingerprint()  # same tensors, other files and offsets
    base = {"a": entry("F32", [2, 3], 0, 24), "b": entry("BF16", [4], 24, 32)}
    variants = {
        "same": base,
        "reordered offsets": {"b": entry("BF16", [4], 0, 8), "a": entry("F32", [2, 3], 8, 32)},
        "dtype": {**base, "b": entry("F16", [4], 24, 32)},
        "regrouped shape": {**base, "a": entry("F32", [3, 2], 0, 24)},
        "flattened shape": {**base, "a": entry("F32", [6], 0, 24)},
        "moved dimension": {"a": entry("F32", [2], 0, 8), "b": entry("BF16", [3, 4], 8, 32)},
        "name": {"a": entry("F32", [2, 3], 0, 24), "c": entry("BF16", [4], 24, 32)},
    }
    found = {}
    for label, header in variants.items():
        write_raw(tmp_path / f"{label}.safetensors", header, bytes(32))
        found[label] = open_checkpoint(tmp_path / f"{label}.safetensors").fingerprint()
    assert found["same"] == found["reordered offsets"]
    changed = [label for label in variants if label not in ("same", "reordered offsets")]
    assert len({found[label] for label in changed} | {found["same"]}) == len(changed) + 1


def test_open_checkpoint_accepts_a_directory_a_safetensors_file_or_an_index_file() -> None:
    by_dir = open_checkpoint(LLAMA.parent)
    assert by_dir.index_path is None and len(by_dir.files) == 1
    assert open_checkpoint(LLAMA).names == by_dir.names
    by_index = open_checkpoint(LLAMA_SHARDED / "model.safetensors.index.json")
    assert by_index.names == by_dir.names
    assert list(by_dir.names) == sorted(by_dir.names)
    assert "lm_head.weight" in by_dir and "nope" not in by_dir
    header = by_dir.files[0]
    assert list(header.tensors) == sorted(header.tensors)
    assert header.data_start == 8 + header.header_size
    assert header.file_size == LLAMA.stat().st_size
    assert dict(read_header(FP8).metadata) == {"format": "pt"}


def test_a_folder_holding_both_forms_is_read_from_model_safetensors_as_transformers_does(
        tmp_path: Path) -> None:
    """The shards and index of the tiny Llama next to a model.safetensors whose o_proj differs
    in one byte: transformers' from_pretrained and partc both read model.safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "both"
    shutil.copytree(LLAMA_SHARDED, folder)
    name = "model.layers.1.self_attn.o_proj.weight"
    arrays = load_file(str(LLAMA))
    arrays[name] = arrays[name].copy()
    arrays[name].reshape(-1).view(np.uint8)[0] ^= 0x40
    save_file(arrays, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ckpt = open_checkpoint(folder)
    assert ckpt.index_path is None
    assert [f.path for f in ckpt.files] == [str(folder / "model.safetensors")]
    ours = read_tensor(ckpt, name, TensorSelection())
    assert np.array_equal(bits(ours), bits(arrays[name]))
    assert not np.array_equal(bits(ours), bits(load_file(str(LLAMA))[name])), \
        "the shards hold the other bytes"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert np.array_equal(bits(model.state_dict()[name].numpy()), bits(ours))
    by_index = open_checkpoint(folder / "model.safetensors.index.json")  # named: the shards
    assert by_index.index_path == str(folder / "model.safetensors.index.json")
    assert np.array_equal(bits(read_tensor(by_index, name, TensorSelection())),
                          bits(load_file(str(LLAMA))[name]))
    # an mlx-lm folder's index names model.safetensors itself: the same file either way
    assert open_checkpoint(MLX4).files[0].path == str(MLX4 / "model.safetensors")


def test_an_unknown_tensor_name_is_reported_with_a_close_match() -> None:
    ckpt = open_checkpoint(LLAMA)
    with pytest.raises(CheckpointError) as info:
        ckpt.tensor("model.layers.0.mlp.down_proj.weigth")
    assert "tensor 'model.layers.0.mlp.down_proj.weigth' not in checkpoint" in info.value.message
    assert "did you mean 'model.layers.0.mlp.down_proj.weight'" in info.value.message
    assert info.value.tensor == "model.layers.0.mlp.down_proj.weigth"
    assert info.value.location is not None and info.value.location.file == str(LLAMA)


# --- byte-exact reads ----------------------------------------------------------------------


def owned_bytes(ckpt: Checkpoint, name: str, sel: TensorSelection) -> set[int]:
    """Absolute file offsets of every byte of the selected elements."""
    header, e = ckpt.tensor(name)
    item = DTYPES[e.dtype].itemsize
    index = expected(np.arange(int(np.prod(e.shape))).reshape(e.shape), sel).reshape(-1)
    starts = header.data_start + e.begin + index * item
    return {int(s) + k for s in starts for k in range(item)}


@pytest.mark.parametrize("source", [LLAMA, FP8, MLX4], ids=["f32", "fp8", "mlx4"])
def test_an_instrumented_reader_sees_exactly_the_bytes_of_the_selected_elements(
        source: Path) -> None:
    ckpt = open_checkpoint(source)
    for name in ckpt.names:
        header, e = ckpt.tensor(name)
        for sel in selections(e.shape):
            rec = Recorder()
            out = read_tensor(ckpt, name, sel, ReadOptions(recorder=rec, max_fetch_ratio=1.0))
            lo, hi = header.data_start + e.begin, header.data_start + e.end
            assert all(p == str(header.path) and lo <= o and o + n <= hi for p, o, n in rec.runs)
            assert sum(n for _, _, n in rec.runs) == out.nbytes
            got = {o + k for _, o, n in rec.runs for k in range(n)}
            assert got == owned_bytes(ckpt, name, sel)


def exact_read(recorder: Recorder) -> ReadOptions:
    """A read told of to `recorder`, capped at the share's bytes (every run by itself)."""
    return ReadOptions(recorder=recorder, max_fetch_ratio=1.0)


def test_a_column_slice_reads_one_run_per_row_and_a_row_slice_reads_one_run() -> None:
    ckpt = open_checkpoint(LLAMA)
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 128] f32
    rows, cols = ckpt.tensor(name)[1].shape
    col = Recorder()
    read_tensor(ckpt, name, TensorSelection(1, ((0, cols // 2),)), exact_read(col))
    assert len(col.runs) == rows and {n for _, _, n in col.runs} == {cols // 2 * 4}
    row = Recorder()
    read_tensor(ckpt, name, TensorSelection(0, ((0, 8), (8, 16), (16, rows))),
                exact_read(row))
    assert len(row.runs) == 1 and row.runs[0][2] == rows * cols * 4
    both = Recorder()
    read_tensor(ckpt, name, TensorSelection(1, ((cols // 2, cols), (0, cols // 2))),
                exact_read(both))
    assert len(both.runs) == 1, "file-contiguous pieces are read by one preadv"


def test_read_tensors_reads_in_file_and_offset_order_and_returns_request_order() -> None:
    ckpt = open_checkpoint(LLAMA_SHARDED)
    names = list(reversed(ckpt.names))
    requests = [(n, TensorSelection(0, ((0, 1),))) for n in names]
    rec = Recorder()
    got = read_tensors(ckpt, requests, ReadOptions(recorder=rec))
    assert list(got) == names
    paths = [str(h.path) for h in ckpt.files]
    keys = [(paths.index(p), o) for p, o, _ in rec.runs]
    assert keys == sorted(keys)
    for name in names:
        assert_same(got[name], read_tensor(ckpt, name)[0:1])


def test_requesting_a_tensor_twice_in_read_tensors_is_an_error() -> None:
    ckpt = open_checkpoint(LLAMA)
    with pytest.raises(CheckpointError, match="requested twice"):
        read_tensors(ckpt, [("lm_head.weight", TensorSelection()),
                            ("lm_head.weight", TensorSelection())])


def test_a_reader_with_max_gap_reads_one_span_and_still_returns_the_selection() -> None:
    ckpt = open_checkpoint(LLAMA)
    name = "model.layers.0.mlp.down_proj.weight"
    header, e = ckpt.tensor(name)
    for sel in selections(e.shape):
        rec = Recorder()
        with CheckpointReader(ckpt, ReadOptions(recorder=rec, max_gap=1 << 20)) as reader:
            assert_same(reader.read(name, sel), read_tensor(ckpt, name, sel))
        assert len(rec.runs) <= 2
        lo, hi = header.data_start + e.begin, header.data_start + e.end
        assert all(lo <= o and o + n <= hi for _, o, n in rec.runs)


@pytest.mark.parametrize("limit", [64, 1000, 4096])
def test_coalesced_spans_never_cross_the_span_limit(monkeypatch: pytest.MonkeyPatch,
                                                    limit: int) -> None:
    monkeypatch.setattr(checkpoint, "_SPAN_LIMIT", limit)
    ckpt = open_checkpoint(FP8)
    with CheckpointReader(ckpt, ReadOptions(max_gap=1 << 20)) as reader:
        for name in ckpt.names:
            for sel in selections(ckpt.tensor(name)[1].shape):
                assert_same(reader.read(name, sel), read_tensor(ckpt, name, sel))
    rec = Recorder()
    with CheckpointReader(ckpt, ReadOptions(recorder=rec, max_gap=1 << 20)) as reader:
        reader.read("model.embed_tokens.weight", TensorSelection(1, ((0, 8),)))
    assert all(n <= limit or n == 16 for _, _, n in rec.runs)


def test_short_reads_are_completed_by_looping(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv

    def dribble(fd: int, bufs: list[memoryview], offset: int) -> int:
        return real(fd, [bufs[0][:3]], offset)

    ckpt = open_checkpoint(LLAMA)
    name = "model.layers.0.self_attn.k_proj.weight"
    want = [read_tensor(ckpt, name, sel) for sel in selections(ckpt.tensor(name)[1].shape)]
    monkeypatch.setattr(os, "preadv", dribble)
    for sel, ref in zip(selections(ckpt.tensor(name)[1].shape), want, strict=True):
        assert_same(read_tensor(ckpt, name, sel), ref)


def test_a_read_returning_no_data_early_is_a_truncated_file(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv
    calls = []

    def stop(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real(fd, [bufs[0][:2]], offset) if len(calls) == 1 else 0

    ckpt = open_checkpoint(LLAMA)
    monkeypatch.setattr(os, "preadv", stop)
    with pytest.raises(CheckpointError) as info:
        read_tensor(ckpt, "lm_head.weight")
    assert "truncated file" in info.value.message and info.value.tensor == "lm_head.weight"


def test_a_file_truncated_after_its_header_was_read_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    shutil.copy(LLAMA, path)
    ckpt = open_checkpoint(path)
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(CheckpointError, match="file changed since its header was read"):
        read_tensor(ckpt, "lm_head.weight")


@pytest.mark.parametrize(("sel", "needle"), [
    (TensorSelection(2, ((0, 1),)), "axis 2 out of range"),
    (TensorSelection(0, ((0, 1000),)), "must satisfy 0 <= start <= end <= 131"),
    (TensorSelection(1, ((3, 2),)), "must satisfy"),
    (TensorSelection(None, ((0, 1),)), "ranges but no axis"),
])
def test_a_selection_that_does_not_fit_the_shape_is_refused(sel: TensorSelection,
                                                            needle: str) -> None:
    with pytest.raises(CheckpointError, match=needle):
        read_tensor(open_checkpoint(LLAMA), "lm_head.weight", sel)


def test_scalars_and_empty_tensors_read_as_empty_or_scalar_arrays(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray[Any, Any]] = {
        "s": np.array(3.5, np.float32), "z": np.zeros((0, 3), np.float16),
        "b": np.array([[True, False], [False, True]])}
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = open_checkpoint(tmp_path)
    assert_same(read_tensor(ckpt, "s"), tensors["s"])
    assert_same(read_tensor(ckpt, "z", TensorSelection(1, ((1, 3),))), tensors["z"][:, 1:3])
    assert_same(read_tensor(ckpt, "b", TensorSelection(1, ((1, 2), (0, 1)))),
                tensors["b"][:, ::-1])
    assert read_tensor(ckpt, "b", TensorSelection(0, ())).shape == (0, 2)


# --- header faults -------------------------------------------------------------------------


def good_header() -> dict[str, Any]:
    return {"__metadata__": {"format": "pt"}, "a": entry("F32", [2, 2], 0, 16),
            "b": entry("BF16", [4], 16, 24)}


def test_a_file_shorter_than_eight_bytes_is_truncated(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"\x01\x02")
    fault(tmp_path / "x.safetensors", "truncated file", "expected at least 8")


def test_a_header_length_beyond_the_file_is_reported(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "x.safetensors", good_header(), bytes(24), length=10_000)
    size = path.stat().st_size
    fault(path, f"header length 10000 beyond the file of size {size}")


def test_a_header_over_100_mib_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_SIZE + 1))
    os.truncate(path, MAX_HEADER_SIZE + 100)  # sparse: the length is inside the file
    fault(path, f"header length {MAX_HEADER_SIZE + 1}", "refusing")


@pytest.mark.parametrize(("text", "kind"), [
    (json.dumps({"format": "partc-shards", "version": 1}, indent=1), "JSON"),
    ('[{"rank": 0}]', "JSON"),
    ("   \n{\n}", "JSON"),
    ("model weights, see README\n", "text"),
])
def test_a_text_file_given_as_the_checkpoint_is_said_to_be_no_safetensors_file(
        tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "partc-shards.json"
    path.write_text(text + " " * 64)
    first = text.encode()[:8] if len(text) >= 8 else (text + " " * 8).encode()[:8]
    err = fault(path)
    assert str(err) == (
        f"{path}: not a safetensors file: it begins with {first!r}, which looks like {kind}, "
        "where a safetensors file begins with the 8-byte little-endian length of its JSON "
        f"header (these bytes read as {int.from_bytes(first, 'little')}); expected a "
        ".safetensors file, its folder or its model.safetensors.index.json")
    with pytest.raises(Exception, match="header too large"):  # the library refuses it too
        load_file(str(path))


def test_a_header_that_is_not_utf8_is_reported(tmp_path: Path) -> None:
    fault(write_raw(tmp_path / "x.safetensors", b'{"\xff": 1}'), "not valid UTF-8")


def test_a_header_that_is_not_json_is_reported(tmp_path: Path) -> None:
    fault(write_raw(tmp_path / "x.safetensors", b'{"a": {"dtype": '), "not valid JSON")


def test_a_header_that_is_not_an_object_is_reported(tmp_path: Path) -> None:
    fault(write_raw(tmp_path / "x.safetensors", b"[1, 2]"), "not a JSON object (found array)")


def test_a_duplicate_key_in_the_header_is_reported(tmp_path: Path) -> None:
    one = json.dumps(entry("F32", [1], 0, 4))
    raw = f'{{"a": {one}, "a": {one}}}'.encode()
    fault(write_raw(tmp_path / "x.safetensors", raw, bytes(4)), "duplicate key 'a'")
    inner = b'{"a": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    fault(write_raw(tmp_path / "y.safetensors", inner, bytes(4)), "duplicate key 'dtype'")


def test_metadata_values_must_be_strings(tmp_path: Path) -> None:
    header = good_header() | {"__metadata__": {"format": 1}}
    fault(write_raw(tmp_path / "x.safetensors", header, bytes(24)),
          "__metadata__['format'] must be a string (found integer)")


@pytest.mark.parametrize(("bad", "needle"), [
    ([1, 2], "tensor entry must be an object (found array)"),
    ({"dtype": "F32", "shape": [1]}, "missing ['data_offsets']"),
    (entry("F32", [1], 0, 4) | {"extra": 1}, "unexpected ['extra']"),
    (entry("F32", [True, 1], 0, 4), "shape must be a list of non-negative integers"),
    (entry("F32", [-1], 0, 4), "shape must be a list of non-negative integers"),
    (entry("F32", [1.0], 0, 4), "shape must be a list of non-negative integers"),
    (entry("F32", [1], 4, 0), "0 <= begin <= end"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets must be [begin, end]"),
])
def test_a_malformed_tensor_entry_is_reported(tmp_path: Path, bad: Any, needle: str) -> None:
    err = fault(write_raw(tmp_path / "x.safetensors", {"t": bad}, bytes(4)), needle)
    assert err.tensor == "t"
    assert str(err).startswith(f"{tmp_path / 'x.safetensors'} (tensor t): "), "the shown text"


def test_an_unknown_dtype_is_reported(tmp_path: Path) -> None:
    err = fault(write_raw(tmp_path / "x.safetensors", {"t": entry("F4", [2], 0, 1)}, bytes(1)),
                "unknown dtype 'F4'", "BF16")
    assert err.tensor == "t"


def test_a_dtype_shape_byte_size_mismatch_is_reported(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "x.safetensors", {"t": entry("BF16", [3, 2], 0, 8)}, bytes(12))
    err = fault(path, "dtype/shape byte-size mismatch", "needs 12 bytes", "span 8")
    assert str(err).startswith(f"{path} (tensor t): dtype/shape byte-size mismatch")


def test_a_truncated_payload_is_data_offsets_beyond_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, path)
    os.truncate(path, path.stat().st_size - 1)
    err = fault(path, "data offsets beyond the file (truncated file?)", "holds 63 bytes")
    assert err.tensor == "w"
    assert str(err).startswith(f"{path} (tensor w): data offsets beyond the file")


def test_overlapping_tensor_byte_ranges_are_reported(tmp_path: Path) -> None:
    header = {"a": entry("F32", [4], 0, 16), "b": entry("F32", [2], 8, 16)}
    fault(write_raw(tmp_path / "x.safetensors", header, bytes(16)),
          "overlap", "'a' spans [0, 16)", "'b' spans [8, 16)")


def test_fp8_e8m0_and_every_listed_dtype_are_known() -> None:
    names = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8",
             "U64", "U32", "U16", "U8", "BOOL"}
    assert names <= set(DTYPES)
    assert ("F8_E8M0" in DTYPES) == hasattr(ml_dtypes, "float8_e8m0fnu")


def test_the_full_deepseek_v3_header_parses_and_validates_quickly(tmp_path: Path) -> None:
    raw = DEEPSEEK_HEADER.read_bytes().rstrip(b"\n")  # the fixture file ends in a newline
    end = max(v["data_offsets"][1] for k, v in json.loads(raw).items() if k != "__metadata__")
    path = write_raw(tmp_path / "model.safetensors", raw)
    os.truncate(path, 8 + len(raw) + end)  # sparse: offsets in range, no payload written
    start = time.perf_counter()
    header = read_header(path)
    elapsed = time.perf_counter() - start
    assert len(header.tensors) == 91991
    assert header.tensors["lm_head.weight"].shape == (129280, 7168)
    assert elapsed < 5.0, f"parsing took {elapsed:.2f} s"


# --- index faults --------------------------------------------------------------------------


def sharded_copy(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA_SHARDED, folder)
    return folder, json.loads((folder / "model.safetensors.index.json").read_text())


def write_index(folder: Path, index: dict[str, Any]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_missing_shard_file_named_by_the_index_is_reported(tmp_path: Path) -> None:
    folder, _ = sharded_copy(tmp_path)
    (folder / "model-00003-of-00004.safetensors").unlink()
    err = fault(folder, "missing shard file model-00003-of-00004.safetensors named by the index")
    assert err.location is not None and err.location.file.endswith("index.json")


@pytest.mark.parametrize("shard", ["../x", "/etc/passwd", "sub/x.safetensors", "..", ""])
def test_a_shard_filename_outside_the_directory_is_refused(tmp_path: Path, shard: str) -> None:
    folder, index = sharded_copy(tmp_path)
    index["weight_map"]["lm_head.weight"] = shard
    write_index(folder, index)
    err = fault(folder, f"shard filename {shard!r}", "not a plain file name")
    assert err.tensor == "lm_head.weight"


def test_a_tensor_present_in_two_shards_is_reported_naming_both_files(tmp_path: Path) -> None:
    save_file({"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, tmp_path / "s1")
    save_file({"b": np.ones(2, np.float32)}, tmp_path / "s2")
    write_index(tmp_path, {"weight_map": {"a": "s1", "b": "s2"}})
    err = fault(tmp_path, "tensor 'b' is in two shards: s1 and s2")
    assert err.tensor == "b"


def test_a_weight_map_tensor_missing_from_its_shard_header_is_reported(tmp_path: Path) -> None:
    folder, index = sharded_copy(tmp_path)
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00004.safetensors"
    write_index(folder, index)
    fault(folder, "tensor 'lm_head.weight' mapped to model-00001-of-00004.safetensors",
          "it is in model-00004-of-00004.safetensors")
    index["weight_map"]["ghost"] = "model-00001-of-00004.safetensors"
    del index["weight_map"]["lm_head.weight"]
    write_index(folder, index)
    fault(folder, "tensor 'ghost' mapped to", "no shard holds it")


def test_a_shard_tensor_absent_from_the_weight_map_is_reported(tmp_path: Path) -> None:
    folder, index = sharded_copy(tmp_path)
    del index["weight_map"]["model.norm.weight"]
    write_index(folder, index)
    err = fault(folder, "tensor 'model.norm.weight' in shard", "not in the index's weight_map")
    assert err.location is not None and err.location.file.endswith(".safetensors")


@pytest.mark.parametrize(("text", "needle"), [
    ("{", "index is not valid JSON"),
    ("[]", "index is not a JSON object"),
    ('{"metadata": {}}', "weight_map object"),
    ('{"weight_map": {"a": 1}}', "must be a shard file name"),
    ('{"weight_map": {"a": "x", "a": "y"}}', "duplicate key 'a'"),
])
def test_a_malformed_index_is_reported(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(text)
    fault(tmp_path, needle)


def test_a_directory_without_a_checkpoint_or_a_missing_path_is_reported(tmp_path: Path) -> None:
    fault(tmp_path, "neither model.safetensors nor model.safetensors.index.json")
    fault(tmp_path / "nope.safetensors", "no such checkpoint file")


# --- property tests ------------------------------------------------------------------------

DTYPE_NAMES = sorted(DTYPES)


@st.composite
def tensor_cases(draw: st.DrawFn) -> tuple[np.ndarray[Any, Any], TensorSelection]:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    dtype = DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dtype.itemsize)
    if dtype == np.dtype(bool):
        raw &= 1
    full = raw.astype(np.uint8).view(dtype).reshape(shape)
    axis = draw(st.none() | st.integers(0, len(shape) - 1))
    if axis is None:
        return full, TensorSelection()
    dim = shape[axis]
    bounds = st.tuples(st.integers(0, dim), st.integers(0, dim)).map(lambda r: (min(r), max(r)))
    ranges = tuple(draw(st.lists(bounds, min_size=0, max_size=4)))
    return full, TensorSelection(axis, ranges)


@settings(max_examples=150, deadline=None)
@given(tensor_cases(), st.sampled_from([0, 1, 7, 64, 1 << 20]))
def test_random_selections_of_random_tensors_equal_numpy_slicing(
        case: tuple[np.ndarray[Any, Any], TensorSelection], max_gap: int) -> None:
    full, sel = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file({"pad": np.arange(3, dtype=np.uint8), "t": full}, path)
        ckpt = open_checkpoint(path)
        rec = Recorder()
        got = read_tensor(ckpt, "t", sel, ReadOptions(recorder=rec, max_fetch_ratio=1.0))
        assert_same(got, expected(full, sel))
        assert {o + k for _, o, n in rec.runs for k in range(n)} == owned_bytes(ckpt, "t", sel)
        with CheckpointReader(ckpt, ReadOptions(max_gap=max_gap)) as reader:
            assert_same(reader.read("t", sel), expected(full, sel))


def _valid_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.safetensors"
        save_file({"a": np.ones((2, 3), np.float32), "b": np.zeros(4, ml_dtypes.bfloat16)}, path,
                  metadata={"format": "pt"})
        return path.read_bytes()


VALID_BYTES = _valid_file_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(VALID_BYTES) - 1), st.integers(0, 255)),
                min_size=1, max_size=6),
       st.integers(0, len(VALID_BYTES)))
def test_random_header_mutations_parse_or_raise_checkpoint_error_only(
        edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(VALID_BYTES)
    n = struct.unpack("<Q", data[:8])[0]
    for pos, value in edits:
        data[pos % (8 + n)] = value  # mutate the length prefix or the JSON header
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        path.write_bytes(bytes(data[:max(cut, 8 + n)] if cut % 2 else data))
        try:
            header = read_header(path)
        except CheckpointError as err:
            assert err.location is not None and err.location.file == str(path)
            return
        for e in header.tensors.values():
            assert header.data_start + e.end <= header.file_size


def _object(pairs: list[tuple[str, str]]) -> str:
    """A JSON object from already-encoded values, duplicate keys allowed."""
    return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{v}" for k, v in pairs) + "}"


@st.composite
def odd_headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """Mostly valid headers with awkward names, odd values and the occasional duplicate key."""
    names = st.text(alphabet='ab:"\\é_', min_size=0, max_size=4)
    odd = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3),
                    st.integers(-2, 3), st.lists(st.integers(-1, 3), max_size=2))
    pairs: list[tuple[str, str]] = []
    offset = 0
    for name in draw(st.lists(names, max_size=5, unique=True)):
        dtype = draw(st.sampled_from(["F32", "BF16", "U8", "I64"])) if draw(st.integers(0, 15)) \
            else "XX"
        shape: list[Any] = draw(st.lists(st.integers(0, 3), max_size=3))
        size = int(np.prod(shape)) * (DTYPES[dtype].itemsize if dtype in DTYPES else 1)
        fields = [("dtype", json.dumps(dtype)), ("shape", json.dumps(shape)),
                  ("data_offsets", json.dumps([offset, offset + size]))]
        offset += size
        if draw(st.integers(0, 15)) == 0:  # one odd field value, or a duplicated field
            i = draw(st.integers(0, 2))
            fields[i] = (fields[i][0], json.dumps(draw(odd)))
        if draw(st.integers(0, 20)) == 0:
            fields.append(fields[draw(st.integers(0, 2))])
        pairs.append((name, _object(draw(st.permutations(fields)))))
    if draw(st.booleans()):
        meta: dict[str, Any] = draw(st.dictionaries(names, names, max_size=3))
        if meta and draw(st.integers(0, 5)) == 0:
            meta[next(iter(meta))] = draw(odd)
        pairs.append(("__metadata__", json.dumps(meta, ensure_ascii=False)))
    if pairs and draw(st.integers(0, 5)) == 0:
        pairs.append(pairs[draw(st.integers(0, len(pairs) - 1))])
    return _object(draw(st.permutations(pairs))).encode(), offset + draw(st.integers(-1, 2))


@settings(max_examples=300, deadline=None)
@given(odd_headers())
def test_the_fast_header_path_agrees_with_the_careful_one(case: tuple[bytes, int]) -> None:
    raw, payload = case
    with tempfile.TemporaryDirectory() as tmp:
        path = write_raw(Path(tmp) / "h.safetensors", raw, bytes(max(payload, 0)))
        outcomes: list[FileHeader | str] = []
        for fast in (True, False):
            with mock.patch.object(headers, "_fast_columns",
                                   headers._fast_columns if fast else lambda *_: None):
                try:
                    outcomes.append(read_header(path))
                except CheckpointError as err:
                    outcomes.append(err.message)
        assert outcomes[0] == outcomes[1]


def test_names_with_colons_quotes_and_backslashes_read_back(tmp_path: Path) -> None:
    tensors = {name: np.full(2, i, np.float32)
               for i, name in enumerate(["a:b", 'q"uote', "back\\slash", "é:"])}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"k:ey": "v:al"})
    ckpt = open_checkpoint(tmp_path)
    assert set(ckpt.names) == set(tensors)
    assert ckpt.files[0].metadata == (("k:ey", "v:al"),)
    for name, value in tensors.items():
        assert_same(read_tensor(ckpt, name), value)


def test_a_duplicate_key_is_found_even_when_colons_hide_in_names(tmp_path: Path) -> None:
    one = json.dumps(entry("F32", [1], 0, 4))
    raw = f'{{"x:y": {one}, "__metadata__": {{"a": "b", "a": "c:d"}}}}'.encode()
    fault(write_raw(tmp_path / "x.safetensors", raw, bytes(4)), "duplicate key 'a'")
    escaped = f'{{"x\\u003a": {one}, "__metadata__": {{"k": "v", "k": "w"}}}}'.encode()
    fault(write_raw(tmp_path / "y.safetensors", escaped, bytes(4)), "duplicate key 'k'")


# ---------------------------------------------------------------- the batch reading engine

STRATEGIES = ["default", "threads", "syscalls"]


def use_strategy(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    """Force the engine's threaded path (tiny jobs) or its one-preadv-per-run path."""
    if strategy == "threads":
        monkeypatch.setattr(checkpoint, "THREADED_BYTES", 0)
        monkeypatch.setattr(checkpoint, "JOB_BYTES", 40)
    if strategy == "syscalls":
        monkeypatch.setattr(gather, "_GATHER_RUN", 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(tensor_cases(), min_size=1, max_size=4))
def test_a_batch_of_random_selections_reads_like_numpy_under_every_strategy(
        monkeypatch: pytest.MonkeyPatch, strategy: str,
        cases: list[tuple[np.ndarray[Any, Any], TensorSelection]]) -> None:
    use_strategy(monkeypatch, strategy)
    tensors = {f"t{i}": full for i, (full, _) in enumerate(cases)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file({"pad": np.arange(3, dtype=np.uint8), **tensors}, path)
        ckpt = open_checkpoint(path)
        rec = Recorder()
        requests = [(f"t{i}", sel) for i, (_, sel) in reversed(list(enumerate(cases)))]
        got = read_tensors(ckpt, requests, ReadOptions(recorder=rec, workers=3,
                                                       max_fetch_ratio=1.0))
        assert list(got) == [name for name, _ in requests]
        for name, sel in requests:
            assert_same(got[name], expected(tensors[name], sel))
        owned = set().union(*(owned_bytes(ckpt, n, s) for n, s in requests))
        read = [o + k for _, o, n in rec.runs for k in range(n)]
        assert set(read) == owned, "every owned byte is read, and nothing else"
        assert len(read) == sum(a.nbytes for a in got.values()), "once per selected element"


def test_large_destinations_are_writable_mappings_and_small_ones_plain_arrays() -> None:
    big = checkpoint.empty_array((1024, 1024), np.dtype(np.float32))
    small = checkpoint.empty_array((4,), np.dtype(np.float32))
    assert big.flags.writeable and big.flags.c_contiguous and big.shape == (1024, 1024)
    assert not big.flags.owndata, "backed by its own anonymous mapping"
    big[...] = 1.5
    assert float(big.sum()) == 1.5 * 1024 * 1024
    assert small.flags.owndata


def test_a_file_truncated_while_gathering_columns_is_an_error_not_a_crash(
        tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    shutil.copy(LLAMA, path)
    ckpt = open_checkpoint(path)
    name = "model.layers.2.mlp.down_proj.weight"
    header, e = ckpt.tensor(name)
    sel = TensorSelection(1, ((0, e.shape[1] // 2),))
    assert checkpoint.gatherable(e, sel)
    with CheckpointReader(ckpt) as reader:
        reader.read("lm_head.weight")  # opens and checks the file
        os.truncate(path, header.data_start + e.end - 1)
        with pytest.raises(CheckpointError, match="file changed since its header was read") as info:
            reader.read(name, sel)
    assert info.value.tensor == name


def test_a_selection_covering_whole_rows_is_read_with_preadv_not_gathered() -> None:
    ckpt = open_checkpoint(LLAMA)
    _, e = ckpt.tensor("model.layers.0.mlp.down_proj.weight")
    cols = e.shape[1]
    assert checkpoint.gatherable(e, TensorSelection(1, ((0, cols // 2),)))
    assert not checkpoint.gatherable(e, TensorSelection(1, ((cols // 2, cols), (0, cols // 2))))
    assert not checkpoint.gatherable(e, TensorSelection(0, ((0, 8),)))
    assert not checkpoint.gatherable(e, TensorSelection())


def test_jobs_cut_long_runs_and_keep_file_order() -> None:
    ckpt = open_checkpoint(LLAMA_SHARDED)
    plan = checkpoint.ReadPlan()
    for name in reversed(ckpt.names):
        header, e = ckpt.tensor(name)
        array = np.empty(e.shape, DTYPES[e.dtype])
        src, dst, length = checkpoint.byte_runs(e, TensorSelection())
        plan.add(ckpt.owners[name], header.data_start + e.begin, name, array, src, dst, length)
    jobs = plan.jobs(ckpt.files, 1000)
    assert sum(j.nbytes for j in jobs) == plan.nbytes
    assert all(int(j.length.max()) <= 1000 for j in jobs)
    keys = [(j.file, int(s)) for j in jobs for s in j.src]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_default_workers_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTC_READ_THREADS", "3")
    assert workers.default_workers() == 3
    monkeypatch.setenv("PARTC_READ_THREADS", " ")
    assert 1 <= workers.default_workers() <= 8, "blank: the default"
    monkeypatch.setenv("PARTC_READ_THREADS", "zero")
    with pytest.raises(LaunchError, match="environment PARTC_READ_THREADS='zero' must be a "
                       "positive integer in ASCII digits"):
        workers.default_workers()


def test_one_run_answers_as_the_runs_do() -> None:
    # the zero-copy question "one byte run, and where?" agrees with the full run computation
    import itertools

    from partc.runtime._engine.runs import one_run
    from partc.runtime.headers import TensorEntry

    rng = np.random.default_rng(7)
    shapes = [(0,), (5,), (4, 6), (1, 6), (3, 1, 4), (2, 3, 0), (6, 4, 2)]
    for shape in shapes:
        nbytes = int(np.prod(shape)) * 2
        entry = TensorEntry(name="t", dtype="BF16", shape=shape, begin=0, end=nbytes)
        selections = [TensorSelection()]
        for axis, dim in enumerate(shape):
            cuts = sorted({0, dim, *rng.integers(0, dim + 1, 3).tolist()})
            pairs = [(a, b) for a, b in itertools.combinations(cuts, 2)]
            selections += [TensorSelection(axis=axis, ranges=(r,)) for r in pairs]
            selections += [TensorSelection(axis=axis, ranges=(p, q))
                           for p, q in itertools.combinations(pairs, 2)]
            selections.append(TensorSelection(axis=axis, ranges=((0, 0),)))
        for sel in selections:
            src = checkpoint.byte_runs(entry, sel)[0]
            want = (len(src), int(src[0])) if len(src) == 1 else (min(len(src), 2), 0)
            assert one_run(entry, sel) == want, (shape, sel)


def test_a_read_stated_once_as_read_options_reads_what_the_safetensors_library_reads(
        tmp_path: Path) -> None:
    import dataclasses

    from partc.runtime.options import ZeroCopy

    rng = np.random.default_rng(7)
    tensors = {"w": rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16),
               "b": rng.standard_normal((6,)).astype(np.float32)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    want = load_file(str(tmp_path / "m.safetensors"))
    ckpt = open_checkpoint(tmp_path / "m.safetensors")
    rec = Recorder()
    options = ReadOptions(recorder=rec, zero_copy=ZeroCopy.SHARED, bits=True, workers=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.workers = 2  # type: ignore[misc]
    got = read_tensors(ckpt, [("w", TensorSelection(0, ((2, 5),))), ("b", TensorSelection())],
                       options)
    assert got["w"].dtype == np.uint16 and not got["w"].flags.writeable, "bits, a shared view"
    assert np.array_equal(got["w"], want["w"][2:5].view(np.uint16))
    assert np.array_equal(got["b"], want["b"])
    assert rec.runs == [], "one-run selections are views: no byte is read, none recorded"
    copied = read_tensors(ckpt, [("w", TensorSelection())])
    assert copied["w"].dtype == ml_dtypes.bfloat16 and copied["w"].flags.writeable
