"""Reads that survive files changing underneath, and checkpoint input faults as located errors.

A checkpoint truncated, replaced or deleted while a loader reads it ends in a clean
CheckpointError naming the file (never a signal, never silently shifted bytes). Unreadable
folders, FIFOs, oversized indexes and symbolic links leading out of the checkpoint are refused
before anything is read.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.cli.main import main as cli_main
from partc.errors import CheckpointError
from partc.runtime import headers
from partc.runtime._engine import gather
from partc.runtime._engine import reader as checkpoint
from partc.runtime._engine.reader import CheckpointReader, read_tensor
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime.checkpoint import MAX_INDEX_BYTES, open_checkpoint

from support import ROOT, compile_and_import, hf

LLAMA = hf("llama")


def _bench() -> Any:
    """benchmarks/load.py, for its synthetic Llama writer."""
    spec = importlib.util.spec_from_file_location("partc_bench_load", ROOT / "benchmarks" /
                                                  "load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A ~110 MiB bf16 Llama checkpoint and its TP=2 build: (checkpoint, build, package)."""
    bench = _bench()
    root = tmp_path_factory.mktemp("synthetic")
    config = bench.llama_config(1024, 2816, 16, 8, 8000, 5)
    ckpt = root / "ckpt"
    bench.write_checkpoint(ckpt, config, 1)
    plan, package = compile_and_import("llama", ckpt / "config.json", root / "build", tp=2)
    return ckpt, root / "build", package.__name__


TRUNCATION_TRIALS = r"""
import hashlib, importlib, json, os, random, shutil, sys, threading, time
from pathlib import Path
ckpt, build, name, trials = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, build)
package = importlib.import_module(name)
from partc.runtime._engine import gather
from partc.errors import PartcError

path = ckpt / "model.safetensors"
pristine = ckpt.parent / "pristine.safetensors"
shutil.copy(path, pristine)
size = path.stat().st_size

def digests(state):
    return {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in state.tensors.items()}

want = digests(package.load(ckpt, rank=1))
took = []
for _ in range(3):  # the time of a warm load: the window the cuts aim at
    start = time.perf_counter()
    package.load(ckpt, rank=1)
    took.append(time.perf_counter() - start)
took = min(took)
rng = random.Random(16)
outcomes = []
for trial in range(trials):
    # column slices: piece by piece through process_vm_writev (capped at the share), or by
    # preadv, or as the read planner coalesces them (whole rows read into a bounce buffer)
    gather._USE_VM_COPY = trial % 3 == 0
    os.environ["PARTC_MAX_FETCH_RATIO"] = "" if trial % 3 == 2 else "1"
    cut = rng.randrange(4096, size)
    timer = threading.Timer(rng.uniform(0, took), os.truncate, (path, cut))
    timer.start()
    try:
        got = digests(package.load(ckpt, rank=1))
        outcomes.append({"ok": got == want})
    except PartcError as error:
        first = error.errors[0] if hasattr(error, "errors") else error
        outcomes.append({"kind": type(first).__name__, "message": first.message,
                         "file": first.location.file if first.location else None})
    except BaseException as error:
        outcomes.append({"kind": "BUG " + type(error).__name__, "message": str(error)})
    timer.join()
    with open(pristine, "rb") as src, open(path, "r+b") as dst:  # restore the cut tail
        dst.seek(cut)
        src.seek(cut)
        shutil.copyfileobj(src, dst, 1 << 20)
print(json.dumps({"took": took, "outcomes": outcomes}))
"""

MID_READ = ("since its header was read", "while being read", "could not be read",
            "ends before byte")
"""Phrases of the errors of a file that changed after its header was read."""
BEFORE_READ = ("data offsets beyond the file", "beyond the file of size", "trailing bytes",
               "truncated file")
"""Phrases of the errors of a file already cut when its header was read."""


def test_truncating_a_checkpoint_during_load_never_kills_the_process(
        synthetic: tuple[Path, Path, str]) -> None:
    ckpt, build, name = synthetic
    done = subprocess.run([sys.executable, "-c", TRUNCATION_TRIALS, str(ckpt), str(build), name,
                           "36"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode} (a negative one is a signal)\n" \
                                 f"{done.stderr[-3000:]}"
    outcomes = json.loads(done.stdout.splitlines()[-1])["outcomes"]
    assert len(outcomes) == 36
    mid = 0
    for outcome in outcomes:
        if "ok" in outcome:
            assert outcome["ok"], "a load that returned must return the right bytes"
            continue
        assert outcome["kind"] == "CheckpointError", outcome
        assert outcome["file"] == str(ckpt / "model.safetensors"), outcome
        assert any(p in outcome["message"] for p in MID_READ + BEFORE_READ), outcome
        mid += any(p in outcome["message"] for p in MID_READ)
    assert mid >= 1, f"no trial cut the file while it was being read: {outcomes}"


# ---------------------------------------------------------------- replaced, deleted, modified


def private_copy(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    shutil.copy(LLAMA / "model.safetensors", path)
    return path


def read_all_with(path: Path, action: Any) -> None:
    """Read every tensor (column halves: gathers and preadv runs), calling `action` once the
    first job is done."""
    ckpt = open_checkpoint(path)
    calls: list[int] = []

    def progress(nbytes: int) -> None:
        if not calls:
            action()
        calls.append(nbytes)

    requests = []
    for name in ckpt.names:
        shape = ckpt.tensor(name)[1].shape
        requests.append((name, TensorSelection(len(shape) - 1, ((0, shape[-1] // 2),))))
    with CheckpointReader(ckpt, ReadOptions(progress=progress)) as reader:
        reader.read_many(requests)


def test_a_file_replaced_while_being_read_is_named(tmp_path: Path) -> None:
    path = private_copy(tmp_path)
    other = tmp_path / "other.safetensors"
    shutil.copy(path, other)
    with pytest.raises(CheckpointError, match="was replaced while being read") as info:
        read_all_with(path, lambda: os.replace(other, path))
    assert info.value.location is not None and info.value.location.file == str(path)


def test_a_file_deleted_while_being_read_is_named(tmp_path: Path) -> None:
    path = private_copy(tmp_path)
    with pytest.raises(CheckpointError, match="disappeared while being read") as info:
        read_all_with(path, path.unlink)
    assert info.value.location is not None and info.value.location.file == str(path)


def test_a_file_rewritten_in_place_while_being_read_is_named(tmp_path: Path) -> None:
    path = private_copy(tmp_path)

    def rewrite() -> None:
        with open(path, "r+b") as handle:
            handle.seek(-4, os.SEEK_END)
            handle.write(b"\0\0\0\0")
        stamp = path.stat()
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))

    with pytest.raises(CheckpointError, match="file changed while being read: it was modified"):
        read_all_with(path, rewrite)


def test_a_file_replaced_between_its_header_and_its_payload_is_named(tmp_path: Path) -> None:
    path = private_copy(tmp_path)
    ckpt = open_checkpoint(path)
    shutil.copy(path, tmp_path / "other")
    os.replace(tmp_path / "other", path)
    with pytest.raises(CheckpointError, match="was replaced since its header was read"):
        read_tensor(ckpt, "lm_head.weight")


@pytest.mark.parametrize("how", ["process_vm_writev", "preadv", "whole rows", "cold rows"])
def test_a_gather_from_a_file_cut_after_mapping_fails_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The cut happens between the checks and the copy: only the copy itself can notice."""
    monkeypatch.setattr(gather, "_USE_VM_COPY", how == "process_vm_writev")
    if how in ("process_vm_writev", "preadv"):  # piece by piece
        monkeypatch.setenv("PARTC_MAX_FETCH_RATIO", "1")
    if how == "cold rows":  # O_DIRECT where the file system has it
        monkeypatch.setattr(gather, "_resident", lambda address, start, end: 0.0)
    path = private_copy(tmp_path)
    ckpt = open_checkpoint(path)
    name = "model.layers.2.mlp.down_proj.weight"
    header, entry = ckpt.tensor(name)
    sel = TensorSelection(1, ((0, entry.shape[1] // 2),))
    assert checkpoint.gatherable(entry, sel)
    real_mmap = checkpoint.mmap.mmap

    def map_then_cut(*args: Any, **kwargs: Any) -> Any:
        mapping = real_mmap(*args, **kwargs)
        os.truncate(path, header.data_start + entry.begin + 100)
        return mapping

    monkeypatch.setattr(checkpoint.mmap, "mmap", map_then_cut)
    real_preadv = os.preadv
    cut = [False]

    def cut_then_read(fd: int, bufs: list[Any], offset: int) -> int:
        if offset >= header.data_start + entry.begin and not cut[0]:
            cut[0] = True
            os.truncate(path, header.data_start + entry.begin + 100)
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", cut_then_read)
    with pytest.raises(CheckpointError) as info:
        read_tensor(ckpt, name, sel)
    assert "file changed since its header was read" in info.value.message
    assert info.value.tensor == name and info.value.location is not None
    assert info.value.location.file == str(path)


def test_both_gather_strategies_read_the_same_bytes_as_safetensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    full = load_file(str(LLAMA / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    sel = TensorSelection(1, ((40, 64), (0, 8)))
    want = np.concatenate([full[name][:, 40:64], full[name][:, 0:8]], axis=1)
    ckpt = open_checkpoint(LLAMA)
    assert checkpoint.gatherable(ckpt.tensor(name)[1], sel)
    for vm in (True, False):
        monkeypatch.setattr(gather, "_USE_VM_COPY", vm)
        np.testing.assert_array_equal(read_tensor(ckpt, name, sel), want)


# ---------------------------------------------------------------- input faults


def deny(monkeypatch: pytest.MonkeyPatch, under: Path, *calls: str) -> None:
    """Make os.<call> raise PermissionError for paths strictly inside `under` (tests run as
    root, which a chmod would not stop)."""
    for call in calls:
        real = getattr(os, call)

        def denied(path: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if isinstance(path, str | os.PathLike) and Path(path).is_relative_to(under) \
                    and Path(path) != under:
                raise PermissionError(13, "Permission denied", str(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, call, denied)


def run_check(checkpoint_path: Path) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = cli_main(["check", "llama", "--config", str(LLAMA / "config.json"),
                           "--checkpoint", str(checkpoint_path), "--format", "json"])
    return status, json.loads(out.getvalue())


def test_an_unreadable_checkpoint_folder_is_a_located_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA / "sharded", folder)
    deny(monkeypatch, folder, "stat", "lstat", "open")
    with pytest.raises(CheckpointError, match="cannot examine") as info:
        open_checkpoint(folder)
    assert "Permission denied" in info.value.message
    assert info.value.location is not None
    assert Path(info.value.location.file).parent == folder
    status, report = run_check(folder)
    assert status == 1 and report["errors"][0]["kind"] == "CheckpointError"
    assert "Permission denied" in report["errors"][0]["message"]


def test_an_unreadable_checkpoint_file_is_a_located_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(LLAMA / "model.safetensors", folder)
    deny(monkeypatch, folder, "open")
    with pytest.raises(CheckpointError, match="cannot open checkpoint file: Permission denied"
                       ) as info:
        open_checkpoint(folder)
    assert info.value.location is not None
    assert info.value.location.file == str(folder / "model.safetensors")


def test_a_path_under_a_file_is_no_such_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="no such checkpoint file or directory"):
        open_checkpoint(tmp_path / "afile" / "ckpt")


def test_an_index_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA / "sharded", folder)
    index = folder / "model.safetensors.index.json"
    os.truncate(index, MAX_INDEX_BYTES + 1)  # sparse: nothing of that size is written
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    assert info.value.message == (
        f"index of {MAX_INDEX_BYTES + 1} bytes exceeds the {MAX_INDEX_BYTES}-byte limit "
        "(partc.runtime.checkpoint.MAX_INDEX_BYTES); refusing to read it")
    assert info.value.location is not None and info.value.location.file == str(index)


def test_running_out_of_memory_parsing_an_index_is_a_located_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA / "sharded", folder)

    def exhausted(text: str) -> Any:
        raise MemoryError()

    monkeypatch.setattr(headers._PAIRS_DECODER, "decode", exhausted)
    with pytest.raises(CheckpointError, match="ran out of memory parsing the index") as info:
        open_checkpoint(folder)
    assert info.value.location is not None
    assert info.value.location.file == str(folder / "model.safetensors.index.json")


OUT_OF_MEMORY = r"""
import resource, sys
from partc.runtime.checkpoint import open_checkpoint
from partc.errors import CheckpointError
with open("/proc/self/status") as f:
    size = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (96 << 20), resource.RLIM_INFINITY))
try:
    open_checkpoint(sys.argv[1])
except CheckpointError as error:
    print(error.location.file, "|", error.message)
"""


def test_a_real_memory_error_on_a_large_index_is_a_located_error(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA / "sharded", folder)
    index = folder / "model.safetensors.index.json"
    with open(index, "w") as handle:  # ~40 MB of weight_map under the 64 MiB limit
        handle.write('{"weight_map": {')
        handle.write(",".join(f'"t{i}": "model-00001-of-00004.safetensors"'
                              for i in range(900_000)))
        handle.write("}}")
    assert index.stat().st_size < MAX_INDEX_BYTES
    done = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY, str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    file, message = done.stdout.strip().split(" | ", 1)
    assert file == str(index) and message.startswith("ran out of memory"), done.stdout


def test_a_fifo_given_as_checkpoint_is_not_a_regular_file_or_folder(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(fifo)
    assert info.value.message.startswith(
        "checkpoint path is not a regular file or folder (found a FIFO)")


def test_a_fifo_socket_or_device_inside_a_folder_is_refused_without_blocking(
        tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")  # opening it for reading would wait for a writer
    sock = tmp_path / "sock"
    sock.mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock / "model.safetensors"))
    try:
        for folder, kind in ((fifo, "a FIFO"), (sock, "a socket")):
            with pytest.raises(CheckpointError) as info:
                open_checkpoint(folder)
            assert info.value.message == f"checkpoint file is not a regular file (found {kind})"
            assert info.value.location is not None
            assert info.value.location.file == str(folder / "model.safetensors")
    finally:
        server.close()
    with pytest.raises(CheckpointError, match=r"found a character device"):
        open_checkpoint("/dev/null")


def test_a_folder_with_neither_file_keeps_its_message(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="holds neither model.safetensors nor "
                                              "model.safetensors.index.json"):
        open_checkpoint(tmp_path)


# ---------------------------------------------------------------- symbolic links


def hf_cache(tmp_path: Path, sharded: bool) -> Path:
    """A Hugging Face hub cache tree: snapshots/<rev>/<file> -> ../../blobs/<sha>."""
    repo = tmp_path / "hub" / "models--partc--tiny-llama"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    source = LLAMA / "sharded" if sharded else LLAMA
    for i, item in enumerate(sorted(source.glob("*.*"))):
        if item.suffix not in (".json", ".safetensors"):
            continue
        blob = blobs / f"{i:040x}"
        shutil.copy(item, blob)
        (snapshot / item.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "index"])
def test_a_hugging_face_cache_snapshot_of_links_into_blobs_loads(
        tmp_path: Path, sharded: bool) -> None:
    snapshot = hf_cache(tmp_path, sharded)
    assert (snapshot / "config.json").is_symlink()
    _, package = compile_and_import("llama", snapshot / "config.json", tmp_path / "build", tp=2)
    want = load_file(str(LLAMA / "model.safetensors"))
    state = package.load(snapshot, rank=0)
    name = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_array_equal(state.tensors[name], want[name][:want[name].shape[0] // 2])
    assert open_checkpoint(snapshot / ("model.safetensors.index.json" if sharded
                                       else "model.safetensors")).names


def test_a_link_inside_the_checkpoint_folder_is_followed(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "real").mkdir(parents=True)
    shutil.copy(LLAMA / "model.safetensors", folder / "real" / "weights.bin")
    (folder / "model.safetensors").symlink_to("real/weights.bin")
    assert open_checkpoint(folder).names == open_checkpoint(LLAMA).names


@pytest.mark.parametrize("target", ["/etc/hostname", "outside"])
def test_a_link_leading_out_of_the_checkpoint_folder_is_refused(
        tmp_path: Path, target: str) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if target == "outside":
        shutil.copy(LLAMA / "model.safetensors", tmp_path / "outside.safetensors")
        target = "../outside.safetensors"
    link = folder / "model.safetensors"
    link.symlink_to(target)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    message = info.value.message
    assert message.startswith(f"checkpoint file model.safetensors is a symbolic link to {target}")
    assert "outside" in message and str(folder) in message
    assert info.value.location is not None and info.value.location.file == str(link)


def test_a_shard_link_out_of_a_cache_snapshot_is_refused(tmp_path: Path) -> None:
    snapshot = hf_cache(tmp_path, sharded=True)
    shard = snapshot / "model-00003-of-00004.safetensors"
    stolen = tmp_path / "elsewhere.safetensors"
    shutil.copy(shard.resolve(), stolen)
    shard.unlink()
    shard.symlink_to(stolen)
    with pytest.raises(CheckpointError, match="shard file model-00003-of-00004.safetensors is a "
                                              "symbolic link to") as info:
        open_checkpoint(snapshot)
    assert "blobs" in info.value.message


def test_a_dangling_link_is_named_with_its_target(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to("gone.safetensors")
    with pytest.raises(CheckpointError, match="is a symbolic link to gone.safetensors, which "
                                              "does not exist"):
        open_checkpoint(tmp_path)


def test_a_link_into_a_sibling_folder_whose_name_extends_the_checkpoints_is_refused(
        tmp_path: Path) -> None:
    # ckpt2/ is not inside ckpt/ although its path starts with ckpt's: whole components count
    folder, sibling = tmp_path / "ckpt", tmp_path / "ckpt2"
    folder.mkdir()
    sibling.mkdir()
    shutil.copy(LLAMA / "model.safetensors", sibling / "model.safetensors")
    (folder / "model.safetensors").symlink_to("../ckpt2/model.safetensors")
    with pytest.raises(CheckpointError, match="is a symbolic link to ../ckpt2/model.safetensors "
                                              r"\(resolving to .*ckpt2/model.safetensors\), "
                                              "outside .*ckpt;"):
        open_checkpoint(folder)


IS_WITHIN = [
    ("/a/b", "/a/b", True), ("/a/b/c", "/a/b", True), ("/a/bc", "/a/b", False),
    ("/a/b", "/a/bc", False), ("/a", "/a/b", False), ("/a/b", "/", True), ("/", "/", True),
    ("/", "/a", False), ("/a/b/", "/a/b", True), ("/a/b", "/a/b/", True),
    ("/a//b/./c", "/a/b", True), ("/a/../b", "/a", True), ("/b", "/a/..", False),
    ("//a", "/", False), ("//a/b", "//a", True), ("/a", "//", False), ("///a", "/", True),
    ("a/b", "a", True), ("a", "/", False), ("/a", "a", False), ("a", "", True),
    ("/a", "", False), ("a", ".", True), (".", "a", False), ("", "", True),
    ("/blobs/x", "/blob", False), ("/hub/repo/blobs/0f", "/hub/repo/blobs", True),
]
"""(path, root, whether path is within root): prefixes that are not whole components, the
root, repeated and trailing separators, `.` and `..` components, POSIX's `//` root."""


@pytest.mark.parametrize(("path", "root", "inside"), IS_WITHIN)
def test_is_within_agrees_with_pathlibs_is_relative_to(path: str, root: str,
                                                        inside: bool) -> None:
    # the runtime does not import pathlib (issue 18): its component test against pathlib's
    from pathlib import PurePosixPath

    from partc.runtime.files import is_within

    assert PurePosixPath(path).is_relative_to(root) is inside, "the table agrees with pathlib"
    assert is_within(path, root) is inside


SPELLINGS = ["ckpt/", "./ckpt", "ckpt//model.safetensors", "a/./b/", "a/../b", "", ".", "./",
             "/", "//", "///", "//a/", "///a//b", "/a/b/..", "..", "../x/."]
"""Paths as users type them; pathlib's spelling is what errors have always named."""


@pytest.mark.parametrize("path", SPELLINGS)
def test_runtime_paths_are_spelled_as_pathlib_spells_them(path: str) -> None:
    from pathlib import PurePosixPath

    from partc.runtime.files import join, parent, spelled

    assert spelled(path) == str(PurePosixPath(path))
    assert spelled(PurePosixPath(path)) == str(PurePosixPath(path))
    assert join(spelled(path), "model.safetensors") == str(PurePosixPath(path)
                                                           / "model.safetensors")
    assert parent(spelled(path)) == str(PurePosixPath(path).parent)


@pytest.mark.parametrize("folder", ["/hub/repo/snapshots/rev", "/hub/repo/snapshots/rev/",
                                    "/snapshots/rev", "/hub/snapshots", "/hub/repo/rev", "/"])
def test_trusted_roots_are_the_folder_and_a_cache_snapshots_blobs(folder: str) -> None:
    from pathlib import Path

    from partc.runtime.files import trusted_roots

    real = Path(os.path.realpath(folder))  # pathlib's reading, the policy's first spelling
    expected = (real, real.parent.parent / "blobs") if real.parent.name == "snapshots" else (
        real,)
    assert trusted_roots(folder) == tuple(map(str, expected))


def test_a_checkpoint_path_is_named_as_pathlib_spells_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for given in (f"{missing}/", f"{tmp_path}//./nowhere", missing):
        with pytest.raises(CheckpointError, match="no such checkpoint") as info:
            open_checkpoint(given)
        assert info.value.location is not None and info.value.location.file == str(missing)
    shutil.copy(LLAMA / "model.safetensors", tmp_path)
    opened = open_checkpoint(f"{tmp_path}//")
    assert opened.path == str(tmp_path) and type(opened.path) is str
    assert opened.files[0].path == str(tmp_path / "model.safetensors")


def test_the_cli_reports_permission_denied_as_exit_1_not_an_internal_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(LLAMA / "model.safetensors", folder)
    deny(monkeypatch, folder, "open")
    status, report = run_check(folder)
    assert status == 1
    assert report["errors"][0]["message"] == "cannot open checkpoint file: Permission denied"


class Recorder:
    """Every (path, offset, length) the reader reports."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int, int]] = []

    def record(self, path: str, offset: int, length: int) -> None:
        self.runs.append((path, offset, length))


@pytest.mark.parametrize("strategy", ["process_vm_writev", "preadv", "preadv_short_reads"])
def test_gathers_record_exactly_the_selected_bytes_once(
        monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    monkeypatch.setattr(gather, "_USE_VM_COPY", strategy == "process_vm_writev")
    if strategy == "preadv_short_reads":
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: real(fd, [bufs[0][:5]], offset))
    ckpt = open_checkpoint(LLAMA)
    full = load_file(str(LLAMA / "model.safetensors"))
    requests = []
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        cols = ckpt.tensor(name)[1].shape[1]
        sel = TensorSelection(1, ((cols // 2, cols), (0, 3)))
        assert checkpoint.gatherable(ckpt.tensor(name)[1], sel)
        requests.append((name, sel))
    recorder = Recorder()
    with CheckpointReader(ckpt, ReadOptions(recorder=recorder)) as reader:
        got = reader.read_many(requests)
    want: set[int] = set()
    for name, sel in requests:
        header, entry = ckpt.tensor(name)
        cols = entry.shape[1]
        np.testing.assert_array_equal(got[name], np.concatenate(
            [full[name][:, cols // 2:], full[name][:, :3]], axis=1))
        base = header.data_start + entry.begin
        for row in range(entry.shape[0]):
            for a, b in sel.ranges:
                want.update(range(base + (row * cols + a) * 4, base + (row * cols + b) * 4))
    read = [o + k for _, o, n in recorder.runs for k in range(n)]
    assert len(read) == len(set(read)) == len(want) and set(read) == want


def test_running_out_of_memory_parsing_a_header_is_a_located_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def exhausted(text: str, *args: Any) -> Any:
        raise MemoryError()

    monkeypatch.setattr(headers.JSON_DECODER, "raw_decode", exhausted)
    monkeypatch.setattr(headers._PAIRS_DECODER, "raw_decode", exhausted)
    with pytest.raises(CheckpointError, match="ran out of memory parsing the header") as info:
        open_checkpoint(LLAMA)
    assert info.value.location is not None
    assert info.value.location.file == str(LLAMA / "model.safetensors")


@pytest.mark.parametrize("name", ["model.layers.0.x\x1b[2J\x1b[31mFAKE: compiled OK\x1b[0m",
                                  "model.layers.0.y\nerror: injected line",
                                  "model.layers.0.z\u2028w", "model.layers.0.\x7fdel",
                                  "model.layers.0.\u200bzero_width"])
def test_a_tensor_name_that_is_not_printable_is_refused_escaped(tmp_path: Path, name: str,
                                                                 capsys: Any) -> None:
    """The safetensors library writes and reads such a name; partc refuses it before any
    command prints it (it could clear the terminal or forge an `error:` line), naming it
    escaped, from compile, inspect and init alike."""
    from safetensors.numpy import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(hf("llama") / "config.json", folder / "config.json")
    tensors = load_file(str(hf("llama") / "model.safetensors"))
    tensors[name] = np.zeros(2, np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert name in load_file(str(folder / "model.safetensors"))  # the library's own view
    bad = next(c for c in name if not c.isprintable())
    for argv in (["inspect", str(folder)], ["init", "--checkpoint", str(folder)],
                 ["compile", "--checkpoint", str(folder), "--out", str(tmp_path / "b")]):
        assert cli_main(argv) == 1
        out, err = capsys.readouterr()
        assert all(c.isprintable() or c == "\n" for c in out + err), err
        assert f"tensor name {name!r} holds the non-printable character {bad!r}" in err, err
        assert name not in out + err and err.count("\n") == 3  # error, see:, count
    assert not (tmp_path / "b").exists()


def test_a_stale_single_file_beside_an_index_is_named_as_what_was_read(tmp_path: Path) -> None:
    """A folder holding both is read from model.safetensors (as transformers reads it); when that
    file lacks the plan's tensors, the error says so and how to read the shards instead."""
    from safetensors.numpy import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    tensors = load_file(str(hf("llama") / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}))
    shutil.copy(hf("qwen3") / "model.safetensors", folder / "model.safetensors")  # stale
    _, package = compile_and_import("llama", hf("llama") / "config.json", tmp_path / "b", tp=2)
    with pytest.raises(CheckpointError) as caught:
        package.load(str(folder), rank=0)
    assert ("of the plan is not in the checkpoint (read from model.safetensors: the folder also "
            "holds model.safetensors.index.json, which is ignored when both are present") \
        in str(caught.value), caught.value
    assert str(caught.value).count("read from model.safetensors") == 1
    state = package.load(str(folder / "model.safetensors.index.json"), rank=0)  # as it says
    assert sorted(state.tensors) and all(n in tensors for n in state.tensors)
