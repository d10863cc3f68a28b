"""Generated loaders at the I/O level: which bytes they read, from which files, into what."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from partc.errors import CheckpointError, PartcError
from partc.runtime._engine import gather
from partc.runtime._engine import reader as checkpoint
from partc.runtime._engine.reader import CheckpointReader
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime.headers import DTYPES
from partc.runtime.progress import progress_bar

from support import (
    QUANTIZED,
    Recorder,
    assert_same_tensors,
    compile_and_import,
    hf,
    reassemble,
)

LLAMA = hf("llama")
LLAMA_SHARDED = hf("llama") / "sharded"
PHI3 = hf("phi3")


def owned_byte_masks(state: Any, source: Path) -> dict[str, np.ndarray]:
    """Per checkpoint file: how many times each byte is owned by the rank (0 or 1)."""
    ckpt = open_checkpoint(source)
    masks = {str(h.path): np.zeros(h.file_size, np.int8) for h in ckpt.files}
    for item in state.layout.tensors:
        header, entry = ckpt.tensor(item.target)
        item_size = DTYPES[entry.dtype].itemsize
        tensor = np.zeros(entry.shape + (item_size,), np.int8)
        axis, ranges = item.selection
        if axis is None:
            tensor[...] = 1
        for start, end in ranges:
            index = [slice(None)] * len(entry.shape)
            index[axis] = slice(start, end)
            tensor[tuple(index)] = 1
        begin = header.data_start + entry.begin
        masks[str(header.path)][begin:begin + entry.nbytes] += tensor.reshape(-1)
    return masks


def assert_reads_exactly_the_owned_bytes(runs: list[tuple[str, int, int]],
                                         masks: dict[str, np.ndarray]) -> None:
    seen = {path: np.zeros_like(mask) for path, mask in masks.items()}
    for path, offset, length in runs:
        assert path in masks, f"read from {path}, which holds none of the rank's tensors"
        window = masks[path][offset:offset + length]
        assert len(window) == length and window.all(), \
            f"read [{offset}, {offset + length}) of {Path(path).name} outside the owned bytes"
        seen[path][offset:offset + length] += 1
    for path, mask in masks.items():
        np.testing.assert_array_equal(seen[path], mask, err_msg=f"{path}: owned bytes read "
                                                                "other than exactly once")


@pytest.fixture(scope="module")
def llama_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    out = tmp_path_factory.mktemp("llama") / "build"
    return compile_and_import("llama", LLAMA / "config.json", out, tp=2, pp=2, checkpoint=LLAMA)


@pytest.fixture(scope="module")
def phi3_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    out = tmp_path_factory.mktemp("phi3") / "build"
    return compile_and_import("phi3", PHI3 / "config.json", out, tp=2, pp=1, checkpoint=PHI3)


def test_sharded_and_single_file_checkpoints_give_identical_tensors_through_the_loader(
        llama_build: tuple[Any, Any]) -> None:
    plan, package = llama_build
    full = load_file(str(LLAMA / "model.safetensors"))
    pieces: dict[str, list[Any]] = {}
    for rank in range(plan.topology.world_size):
        single = package.load(LLAMA, rank=rank)
        sharded = package.load(LLAMA_SHARDED, rank=rank)
        assert_same_tensors(sharded.tensors, single.tensors)
        for item in single.layout.tensors:
            axis, ranges = item.selection
            pieces.setdefault(item.target, []).append((single.tensors[item.target], axis, ranges))
    for name, parts in pieces.items():
        whole, count = reassemble(parts, full[name].shape, full[name].dtype)
        np.testing.assert_array_equal(whole, full[name], err_msg=name)
        assert count.min() >= 1, name


@pytest.mark.parametrize("source", [LLAMA, LLAMA_SHARDED], ids=["single", "index"])
@pytest.mark.parametrize("strategy", ["default", "threads", "syscalls"])
def test_a_loader_never_reads_a_byte_outside_the_elements_it_owns(
        llama_build: tuple[Any, Any], source: Path, strategy: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if strategy == "threads":  # every job on a thread, long runs cut into 96-byte pieces
        monkeypatch.setattr(checkpoint, "THREADED_BYTES", 0)
        monkeypatch.setattr(checkpoint, "JOB_BYTES", 96)
    if strategy == "syscalls":  # no gathering from mappings: one preadv per run
        monkeypatch.setattr(gather, "_GATHER_RUN", 0)
    plan, package = llama_build
    for rank in range(plan.topology.world_size):
        recorder = Recorder()
        state = package.load(source, rank=rank, reader=recorder, workers=3,
                             max_fetch_ratio=1.0)
        assert_reads_exactly_the_owned_bytes(recorder.runs, owned_byte_masks(state, source))


@pytest.mark.parametrize("strategy", ["default", "syscalls"])
def test_fused_segments_are_read_as_one_run_per_segment_and_nothing_else(
        phi3_build: tuple[Any, Any], strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if strategy == "syscalls":
        monkeypatch.setattr(gather, "_GATHER_RUN", 0)
    plan, package = phi3_build
    full = load_file(str(PHI3 / "model.safetensors"))
    for rank in range(plan.topology.world_size):
        recorder = Recorder()
        state = package.load(PHI3, rank=rank, reader=recorder, max_fetch_ratio=1.0)
        assert_reads_exactly_the_owned_bytes(recorder.runs, owned_byte_masks(state, PHI3))
        ckpt = open_checkpoint(PHI3)
        name = "model.layers.0.self_attn.qkv_proj.weight"
        header, entry = ckpt.tensor(name)
        inside = [r for r in recorder.runs
                  if header.data_start + entry.begin <= r[1] < header.data_start + entry.end]
        assert len(inside) == 3, "q, k and v segments: one contiguous run each"
        axis, ranges = state.layout[name].selection
        want = np.concatenate([full[name][a:b] for a, b in ranges], axis=axis)
        np.testing.assert_array_equal(state.tensors[name], want)


def test_the_header_is_checked_against_the_plan_before_any_payload_is_read(
        llama_build: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, package = llama_build
    tensors = load_file(str(LLAMA / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].copy()
    tensors["lm_head.weight"] = tensors["lm_head.weight"].astype(np.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    calls: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(1) or real(*a))
    with pytest.raises(PartcError) as info:
        package.load(tmp_path, rank=2, verify_fingerprint=False)
    messages = str(info.value)
    assert "`model.norm.weight` has shape [63]" in messages
    assert "`lm_head.weight` has dtype F16" in messages
    assert calls == []


def test_a_load_reads_the_selections_of_the_compiled_layout(
        llama_build: tuple[Any, Any]) -> None:
    # the loader decodes the tables' placements without building the layouts: every rank's
    # selections and byte counts are the compiler's own layout's (and `layout` decodes to it)
    from partc.runtime.tables import tensor_selections

    plan, package = llama_build
    for rank in plan.ranks:
        table = package.rank_module(rank.rank)._TABLE
        assert tensor_selections(table) == [(t.target, t.selection, t.local_bytes)
                                            for t in rank.layout.tensors]
        assert package.rank_module(rank.rank).layout() == rank.layout


def test_the_column_join_of_the_tables_equals_the_line_by_line_join(
        llama_build: tuple[Any, Any], phi3_build: tuple[Any, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the loader joins KINDS, OWNERS, GROUPS and TARGETS column by column; the line-by-line
    # loop (which names a malformed line) is the reference, on plain and fused layouts
    from partc.runtime import tables

    built = [(package, rank.rank) for plan, package in (llama_build, phi3_build)
             for rank in plan.ranks]
    fast = [tables._join_tables(package.rank_module(r)._TABLE) for package, r in built]
    assert all(tables._joined(package.rank_module(r)._TABLE, tables.table_lines(
        package.rank_module(r)._TABLE.targets), tables.table_lines(
        package.rank_module(r)._TABLE.groups)) is not None for package, r in built)
    monkeypatch.setattr(tables, "_joined", lambda *args: None)
    slow = [tables._join_tables(package.rank_module(r)._TABLE) for package, r in built]
    assert fast == slow and len(fast) > 4


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: (m[0], m[1], ("shard", 0, 0, 3), *m[3:]),
     "placement {'kind': 'shard', 'axis': 0, 'index': 0, 'parts': 3}"),
    (lambda m: (m[0], m[1], ("range", 0, 0, 10**6), *m[3:]),
     "placement {'kind': 'range', 'axis': 0, 'start': 0, 'end': 1000000}"),
    (lambda m: ("F31", *m[1:]), "dtype 'F31'"),
    (lambda m: (m[0], m[1], ("range", 0, 66, 0), *m[3:]),
     "placement ['range', 0, 66, 0]: malformed range placement"),
    (lambda m: (m[0], m[1], ("bogus", 1), *m[3:]),
     "placement ['bogus', 1]: unknown placement kind 'bogus'"),
    (lambda m: (m[0], (2 ** 62, 64), ("range", 0, 0, 67), *m[3:]),
     f"shape [{2 ** 62}, 64]"),
], ids=["shard-not-dividing", "range-past-the-end", "unknown-dtype", "reversed-range",
        "unknown-kind", "2^62-dimension"])
def test_a_malformed_table_is_refused_by_tensor_before_any_read(
        llama_build: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, change: Any,
        message: str) -> None:
    import dataclasses

    from partc.runtime.loader import load_rank

    _, package = llama_build
    table = package.rank_module(0)._TABLE
    role, units, logical, fell_back, members = table.kinds[0]
    kinds = ((role, units, logical, fell_back, (change(members[0]), *members[1:])),
             *table.kinds[1:])
    broken = dataclasses.replace(table, kinds=kinds)
    bad = change(members[0])
    first = next(row[0] for row in broken.tensor_rows() if (row[2], row[4]) == (bad[0], bad[2]))
    calls: list[int] = []
    for name in ("preadv", "pread"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, real=real: calls.append(1) or real(*a))
    with pytest.raises(CheckpointError) as info:
        load_rank(broken, LLAMA)
    assert str(info.value).startswith(f"the generated tables of rank 0 are malformed at tensor "
                                      f"`{first}`: ")
    assert message in str(info.value) and str(info.value).endswith("; regenerate the build")
    assert calls == []


def test_a_table_listing_a_target_twice_is_refused(llama_build: tuple[Any, Any]) -> None:
    import dataclasses

    from partc.runtime.loader import load_rank

    _, package = llama_build
    table = package.rank_module(0)._TABLE
    lines = table.targets.split("\n")
    broken = dataclasses.replace(table, targets="\n".join([lines[0], lines[0], *lines[2:]]))
    with pytest.raises(CheckpointError, match=f"the generated tables of rank 0 list "
                                              f"`{lines[0]}` twice; regenerate the build"):
        load_rank(broken, LLAMA, verify_fingerprint=False)


def test_a_fingerprint_mismatch_is_refused_before_reading(
        llama_build: tuple[Any, Any], tmp_path: Path) -> None:
    _, package = llama_build
    tensors = load_file(str(LLAMA / "model.safetensors"))
    tensors["extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    recorder = Recorder()
    with pytest.raises(CheckpointError, match="fingerprint"):
        package.load(tmp_path, rank=0, reader=recorder)
    assert recorder.runs == []
    assert package.load(tmp_path, rank=0, verify_fingerprint=False).tensors


def test_the_fingerprint_is_recomputed_only_when_the_header_bytes_differ(
        llama_build: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    plan, package = llama_build
    assert plan.checkpoint_header_digest == open_checkpoint(LLAMA).header_digest()
    computed: list[int] = []
    real = checkpoint.Checkpoint.fingerprint
    monkeypatch.setattr(checkpoint.Checkpoint, "fingerprint",
                        lambda self: computed.append(1) or real(self))
    direct = package.load(LLAMA, rank=0)
    assert computed == []  # byte-identical header: the digest vouches for the fingerprint
    resharded = package.load(LLAMA_SHARDED, rank=0)  # same tensors, other files and offsets
    assert computed == [1]
    assert direct.tensors.keys() == resharded.tensors.keys()


def bf16_copy(tmp_path: Path) -> Path:
    """hf/llama in bfloat16, with its config."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(LLAMA / "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
              str(tmp_path / "model.safetensors"))
    config = json.loads((LLAMA / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_bf16_loads_as_ml_dtypes_bfloat16_and_converts_to_float32_on_request(
        tmp_path: Path) -> None:
    folder = bf16_copy(tmp_path / "ckpt")
    _, package = compile_and_import("llama", folder / "config.json", tmp_path / "b", tp=2,
                                    checkpoint=folder)
    raw = package.load(folder, rank=1)
    assert {a.dtype for a in raw.tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    wide = package.load(folder, rank=1, dtype=np.float32)
    for name, array in wide.tensors.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, raw.tensors[name].astype(np.float32))
    again = package.load(folder, rank=1, dtype="bfloat16")
    assert_same_tensors(again.tensors, raw.tensors)


# dtype= on a quantized checkpoint (block FP8, MLX affine, MXFP4) is refused: widening the
# stored values without their scales gave wrong weights (tests/test_quantized_dtype.py)


def test_a_non_floating_target_dtype_or_unknown_framework_is_refused_before_reading(
        llama_build: tuple[Any, Any]) -> None:
    _, package = llama_build
    recorder = Recorder()
    with pytest.raises(CheckpointError, match="floating dtype"):
        package.load(LLAMA, rank=0, dtype=np.int32, reader=recorder)
    with pytest.raises(CheckpointError, match="framework must be"):
        package.load(LLAMA, rank=0, framework="jax", reader=recorder)
    assert recorder.runs == []


def test_a_misspelt_load_option_is_refused_by_name_with_the_option_it_resembles(
        llama_build: tuple[Any, Any]) -> None:
    _, package = llama_build
    recorder = Recorder()
    with pytest.raises(CheckpointError) as caught:
        package.load(LLAMA, rank=0, reader=recorder, zero_copi=True)
    assert "no option 'zero_copi' (did you mean 'zero_copy'?)" in str(caught.value)
    with pytest.raises(CheckpointError) as caught:
        package.rank_module(1).load(LLAMA, reader=recorder, wrkers=2, colour="red")
    assert "no options 'colour', 'wrkers' (did you mean 'workers'?)" in str(caught.value)
    assert recorder.runs == [], "refused before anything is read"
    # the options the message lists are the ones load() takes: each of them is accepted
    listed = str(caught.value).split("its options are ", 1)[1].split(", ")
    assert listed[:2] == ["rank", "verify_fingerprint"] and "zero_copy" in listed
    assert "unknown" not in listed


def test_torch_output_without_torch_installed_is_a_checkpoint_error(
        llama_build: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _, package = llama_build
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(CheckpointError, match="needs torch, which is not installed"):
        package.load(LLAMA, rank=0, framework="torch")


def test_torch_output_shares_memory_and_keeps_bf16_and_fp8(tmp_path: Path) -> None:
    import torch  # a test dependency: the `test` extra installs it
    folder = bf16_copy(tmp_path / "ckpt")
    _, package = compile_and_import("llama", folder / "config.json", tmp_path / "b", tp=2,
                                    checkpoint=folder)
    numpy_state = package.load(folder, rank=0)
    torch_state = package.load(folder, rank=0, framework="torch")
    for name, tensor in torch_state.tensors.items():
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16
        want = numpy_state.tensors[name].astype(np.float32)
        np.testing.assert_array_equal(tensor.float().numpy(), want)
    fp8 = QUANTIZED / "deepseek_v3_fp8"
    _, fp8_package = compile_and_import("deepseek_v3", fp8 / "config.json", tmp_path / "f",
                                        checkpoint=fp8)
    fp8_numpy = fp8_package.load(fp8, rank=0)
    fp8_torch = fp8_package.load(fp8, rank=0, framework="torch")
    for name, array in fp8_numpy.tensors.items():
        tensor = fp8_torch.tensors[name]
        if array.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            assert tensor.dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(tensor.float().numpy(), array.astype(np.float32))
    with pytest.raises(CheckpointError, match="without applying its block scales"):
        fp8_package.load(fp8, rank=0, framework="torch", dtype=np.float32)
    shared = torch.from_numpy(numpy_state.tensors["model.norm.weight"].view(np.uint16))
    shared[0] = 0
    assert float(numpy_state.tensors["model.norm.weight"][0]) == 0.0


def test_progress_is_silent_off_a_terminal_and_under_pytest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with progress_bar(1 << 30, "rank 0") as update:
        assert update is None
    with progress_bar(1 << 30, "rank 0", enabled=False) as update:
        assert update is None
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    with progress_bar(1 << 30, "rank 0") as update:  # stderr is captured: not a terminal
        assert update is None
    with progress_bar(1 << 30, "rank 0", enabled=True) as update:
        assert update is not None
        update(1 << 20)


def test_a_loader_reports_progress_for_every_byte_it_reads(
        llama_build: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    plan, package = llama_build
    seen: list[int] = []
    monkeypatch.setattr(checkpoint, "JOB_BYTES", 4096)
    with CheckpointReader(open_checkpoint(LLAMA), ReadOptions(progress=seen.append)) as reader:
        requests = [(t.target, TensorSelection(*t.selection)) for t in plan.ranks[0].layout.tensors]
        reader.read_many(requests)
    assert sum(seen) == plan.ranks[0].info.local_parameter_bytes
    assert len(seen) > 1


def test_a_read_error_on_a_worker_thread_is_raised_by_the_loader(
        llama_build: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, package = llama_build
    shutil.copy(LLAMA / "model.safetensors", tmp_path / "model.safetensors")
    monkeypatch.setattr(checkpoint, "THREADED_BYTES", 0)
    monkeypatch.setattr(checkpoint, "JOB_BYTES", 1024)
    monkeypatch.setattr(gather, "_GATHER_RUN", 0)
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: 0 if offset > 200_000
                        else real(fd, bufs, offset))
    with pytest.raises(CheckpointError, match="truncated file"):
        package.load(tmp_path, rank=0, workers=4)
