"""`load(checkpoint, zero_copy="private")`: writable copy-on-write views of the checkpoint file.

Checked against independent oracles: the safetensors library's tensors (values), the file's
bytes before and after writing to every view (writes never reach the file), and the process's
own /proc/self/maps (a tensor is zero-copy when its memory lies in a mapping of the file).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from partc.errors import CheckpointError

from support import compile_and_import, file_mappings, hf

LLAMA = hf("llama")


@pytest.fixture(scope="module")
def private_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the llama fixture: the tests write to views of it."""
    folder = tmp_path_factory.mktemp("private") / "llama"
    shutil.copytree(LLAMA, folder)
    return folder


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """llama and phi3 (fused projections: several ranges, copied) compiled for T=2."""
    out = tmp_path_factory.mktemp("private-builds")
    return {family: compile_and_import(family, hf(family) / "config.json", out / family, tp=2,
                                       pp=1, checkpoint=hf(family))[1]
            for family in ("llama", "phi3")}


def one_run(shape: tuple[int, ...], axis: int | None, ranges: tuple[tuple[int, int], ...]
            ) -> bool:
    """Whether a selection is one contiguous byte run of its tensor (computed from the shape)."""
    if axis is None:
        return True
    return math.prod(shape[:axis]) == 1 and len([r for r in ranges if r[1] > r[0]]) == 1


def mapped_base(array: np.ndarray) -> object:
    """The object at the bottom of an array's base chain."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def safetensors_slice(full: dict[str, np.ndarray], target: str, axis: int | None,
                      ranges: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The safetensors library's tensor, cut by numpy to a rank's ranges."""
    if axis is None:
        return full[target]
    rows = np.concatenate([np.arange(a, b) for a, b in ranges if b > a] or [np.arange(0)])
    return np.take(full[target], rows, axis=axis)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_private_views_are_writable_contiguous_and_equal_the_safetensors_slices(
        builds: dict[str, Any], family: str) -> None:
    full = load_file(str(hf(family) / "model.safetensors"))
    kinds = {"view": 0, "copy": 0}
    for rank in range(2):
        state = builds[family].load(hf(family), rank=rank, zero_copy="private")
        for item in state.layout.tensors:
            array = state.tensors[item.target]
            axis, ranges = item.selection
            want = safetensors_slice(full, item.target, axis, ranges)
            np.testing.assert_array_equal(array, want, err_msg=item.target)
            assert array.flags.writeable and array.flags.c_contiguous, item.target
            mapped = isinstance(mapped_base(array), mmap.mmap)
            # one byte run: a view of the mapping; columns and fused segments: copies
            assert mapped == one_run(full[item.target].shape, axis, ranges), item.target
            kinds["view" if mapped else "copy"] += 1
    assert kinds["view"] and kinds["copy"], kinds


def test_writes_to_private_views_change_the_view_but_never_the_file(
        builds: dict[str, Any], private_copy: Path) -> None:
    path = private_copy / "model.safetensors"
    before = digest(path)
    original = load_file(str(path))
    state = builds["llama"].load(private_copy, rank=0, zero_copy="private")
    name = "model.layers.0.self_attn.q_proj.weight"  # rows 0:32 of 64: one run, a view
    view = state.tensors[name]
    assert isinstance(mapped_base(view), mmap.mmap)
    for array in state.tensors.values():
        array[...] = 7.0  # every tensor, views and copies: each write lands in a private page
    assert float(view[0, 0]) == 7.0 and bool(np.all(view == 7.0))
    assert digest(path) == before
    reread = load_file(str(path))
    for key, value in original.items():
        np.testing.assert_array_equal(reread[key], value, err_msg=key)
    # a second private load sees the file, not the first load's writes
    again = builds["llama"].load(private_copy, rank=0, zero_copy="private")
    np.testing.assert_array_equal(again.tensors[name], original[name][0:32])


def test_torch_tensors_share_the_private_mapping_and_warn_nothing(
        builds: dict[str, Any], private_copy: Path) -> None:
    path = private_copy / "model.safetensors"
    before = digest(path)
    full = load_file(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only numpy array
        state = builds["llama"].load(private_copy, rank=1, framework="torch",
                                     zero_copy="private")
    regions = file_mappings(path)
    assert regions and all(perms.startswith("rw") and perms[3] == "p"
                           for _, _, perms in regions), regions  # writable, private
    shared = 0
    for item in state.layout.tensors:
        tensor = state.tensors[item.target]
        assert isinstance(tensor, torch.Tensor) and tensor.is_contiguous(), item.target
        start = tensor.data_ptr()
        inside = any(a <= start and start + tensor.nbytes <= b for a, b, _ in regions)
        axis, ranges = item.selection
        assert inside == one_run(full[item.target].shape, axis, ranges), item.target
        shared += inside
    assert shared
    norm = state.tensors["model.norm.weight"]  # whole tensor: a view of the file
    norm.mul_(0)  # written through torch: private pages, the file keeps its bytes
    assert float(norm.abs().sum()) == 0.0
    assert digest(path) == before
    np.testing.assert_array_equal(load_file(str(path))["model.norm.weight"],
                                  full["model.norm.weight"])


def test_private_views_outlive_the_load_and_the_file_replaced_by_rename(
        builds: dict[str, Any], tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    shutil.copytree(LLAMA, folder)
    state = builds["llama"].load(folder, rank=0, zero_copy="private")
    name = "model.embed_tokens.weight"
    want = load_file(str(LLAMA / "model.safetensors"))[name][0:66]
    replacement = folder / "replacement.safetensors"
    replacement.write_bytes(b"\0" * 64)
    replacement.replace(folder / "model.safetensors")  # the old inode stays mapped
    np.testing.assert_array_equal(state.tensors[name], want)


@pytest.mark.parametrize(("value", "message"), [
    ("shared", r"zero_copy must be False, True or 'private', found 'shared'"),
    (1, r"zero_copy must be False, True or 'private', found 1"),
    (None, r"zero_copy must be False, True or 'private', found None"),
])
def test_unknown_zero_copy_values_are_refused_by_name(
        builds: dict[str, Any], value: object, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        builds["llama"].load(LLAMA, rank=0, zero_copy=value)


def test_read_only_views_point_torch_users_to_private(builds: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match=r"zero_copy=True returns read-only views .* "
                                              r"torch tensors cannot be; load with "
                                              r"zero_copy='private'"):
        builds["llama"].load(LLAMA, rank=0, zero_copy=True, framework="torch")


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_private_column_slices_are_copied_in_process_with_exact_reads(
        builds: dict[str, Any], family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """zero_copy="private" copies the pieces of a column slice out of the mapping with numpy
    (its views already risk SIGBUS); the default mode copies them through the kernel. Both
    equal the safetensors slices, and the reader hook sees the same exact byte runs."""
    from partc.runtime._engine import gather

    asked: list[str] = []
    lookup = gather.libc_function

    def recording(name: str) -> Any:
        asked.append(name)
        return lookup(name)

    monkeypatch.setattr(gather, "libc_function", recording)
    monkeypatch.setattr(gather, "_USE_DIRECT", False)  # warm or not, the page-cache paths
    full = load_file(str(hf(family) / "model.safetensors"))

    class Runs:
        def __init__(self) -> None:
            self.runs: list[tuple[str, int, int]] = []

        def record(self, path: str, offset: int, length: int) -> None:
            self.runs.append((path, offset, length))

    seen, copied = {}, {}
    for mode in ("private", False):
        asked.clear()
        hook = Runs()
        state = builds[family].load(hf(family), rank=1, zero_copy=mode, reader=hook,
                                    max_fetch_ratio=1.0)  # every piece by itself
        gathered = [item.target for item in state.layout.tensors
                    if item.selection[0] not in (None, 0)]
        assert gathered, family  # column slices (o_proj, down_proj) are there to copy
        for item in state.layout.tensors:
            axis, ranges = item.selection
            np.testing.assert_array_equal(state.tensors[item.target],
                                          safetensors_slice(full, item.target, axis, ranges),
                                          err_msg=f"{mode}: {item.target}")
        assert ("process_vm_writev" in asked) == (mode is False), (mode, asked)
        seen[mode] = hook.runs
        copied[mode] = sum(array.nbytes for array in state.tensors.values()
                           if not isinstance(mapped_base(array), mmap.mmap))
    # the private mode reads exactly the bytes it copies (its views are not read), and every
    # byte it reads is one the default mode reads too
    assert sum(length for _, _, length in seen["private"]) == copied["private"] > 0
    default = merged(seen[False])
    for path, offset, length in seen["private"]:
        assert any(p == path and a <= offset and offset + length <= b
                   for p, a, b in default), (path, offset, length)


def merged(runs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Byte runs (path, offset, length) as disjoint (path, start, end) intervals."""
    out: list[tuple[str, int, int]] = []
    for path, offset, length in sorted(runs):
        if out and out[-1][0] == path and offset <= out[-1][2]:
            out[-1] = (path, out[-1][1], max(out[-1][2], offset + length))
        else:
            out.append((path, offset, offset + length))
    return out
