"""Output folder safety: partc replaces only what it wrote, refuses everything else before any
write, and keeps a build or its backup at every instant of the swap."""

from __future__ import annotations

import compileall
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from partc import __version__, output
from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.errors import EmitError
from partc.output import MARKER, sweep_abandoned, write_atomically
from partc.plan.topology import Topology

from support import ROOT, hf, import_build

LLAMA = hf("llama")


def tree_hash(folder: Path) -> str:
    """sha256 over every entry below `folder`: names, kinds, link targets and file bytes.

    `__pycache__` folders are left out: importing a build to shard it lets Python write one.
    """
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if "__pycache__" in path.relative_to(folder).parts:
            continue
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        if path.is_symlink():
            digest.update(b"L" + os.readlink(path).encode())
        elif path.is_dir():
            digest.update(b"D")
        else:
            digest.update(b"F" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _checkpoint(at: Path) -> Path:
    at.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(LLAMA / name, at / name)
    return at


@pytest.fixture
def scene(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding a checkpoint `ck`, a notes folder, a previous build `prev`
    and a previous shard set `shards`; the tests run in it."""
    _checkpoint(tmp_path / "ck")
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "a.txt").write_text("my notes")
    (notes / "sub" / "b.txt").write_text("more notes")
    monkeypatch.chdir(tmp_path)
    compile_family("llama", "ck/config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out="prev"))
    assert main(["shard", "prev", "--checkpoint", "ck", "--out", "shards"]) == 0
    return tmp_path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    status = main(argv)
    return status, capsys.readouterr().err


COMPILE = ["compile", "llama", "--config", "ck/config.json"]


def _extra_file(scene: Path) -> None:
    (scene / "prev" / "extra.txt").write_text("added by the user")


def _extra_link(scene: Path) -> None:
    (scene / "prev" / "data").symlink_to("../notes")


def _bad_marker(scene: Path) -> None:
    (scene / "prev" / MARKER).write_text("{not json")


def _many_files(scene: Path) -> None:
    for i in range(7):
        (scene / "notes" / f"f{i}.txt").write_text(str(i))


def _link(target: str) -> Callable[[Path], None]:
    def make(scene: Path) -> None:
        (scene / "link").symlink_to(target)
    return make


def _file(scene: Path) -> None:
    (scene / "afile").write_text("not a folder")


def _pycache_with_source(scene: Path) -> None:
    cache = scene / "prev" / "partc_llama_tp2_pp1" / "__pycache__"
    cache.mkdir()
    (cache / "rank_00.cpython-311.pyc").write_bytes(b"bytecode")
    (cache / "evil.py").write_text("not bytecode")


BYTECODE = importlib.util.MAGIC_NUMBER + bytes(12)
"""The start of a .pyc Python writes: its magic number, then flags, mtime and size."""


def _pycache(folder: str, name: str, content: bytes) -> Callable[[Path], None]:
    """A `__pycache__` under `folder` of the previous build holding one file."""
    def make(scene: Path) -> None:
        cache = scene / "prev" / folder / "__pycache__"
        cache.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(content)
    return make


def _chdir_below(scene: Path) -> None:
    (scene / "work").mkdir()
    os.chdir(scene / "work")


REFUSALS: list[tuple[str, Callable[[Path], None] | None, list[str], list[str]]] = [
    ("compile_out_is_the_checkpoint", None,
     [*COMPILE, "--checkpoint", "ck", "--out", "ck"],
     ["the output folder ck is the checkpoint ck", "partc replaces its output folder whole"]),
    ("compile_out_holds_the_config", None, [*COMPILE, "--out", "ck"],
     ["the output folder ck holds the config file ck/config.json"]),
    ("compile_out_holds_the_family_file",
     lambda s: shutil.copy(ROOT / "architectures" / "llama.yaml", s / "notes" / "fam.yaml"),
     ["compile", "notes/fam.yaml", "--config", "ck/config.json", "--out", "notes"],
     ["the output folder notes holds the family file notes/fam.yaml"]),
    ("shard_out_is_the_checkpoint", None, ["shard", "prev", "--checkpoint", "ck", "--out", "ck"],
     ["the output folder ck is the checkpoint ck"]),
    ("shard_out_holds_the_checkpoint_file", None,
     ["shard", "prev", "--checkpoint", "ck/model.safetensors", "--out", "ck"],
     ["the output folder ck holds the checkpoint ck/model.safetensors"]),
    ("shard_out_is_the_build", None, ["shard", "prev", "--checkpoint", "ck", "--out", "prev"],
     ["the output folder prev is the build prev"]),
    ("shard_out_is_the_build_with_force", None,
     ["shard", "prev", "--checkpoint", "ck", "--out", "prev", "--force"],
     ["the output folder prev is the build prev"]),
    ("compile_out_is_a_notes_folder", None, [*COMPILE, "--out", "notes"],
     ["the output folder notes is not empty and was not written by partc (no "
      ".partc-build.json): it holds 2 entries (a.txt, sub/)"]),
    ("compile_out_is_a_notes_folder_with_force", None, [*COMPILE, "--out", "notes", "--force"],
     ["it holds 2 entries (a.txt, sub/)"]),
    ("many_offending_names_are_cut_short", _many_files, [*COMPILE, "--out", "notes"],
     ["it holds 9 entries (a.txt, f0.txt, f1.txt, f2.txt, f3.txt, ...)"]),
    ("compile_out_is_the_working_directory", None, [*COMPILE, "--out", "."],
     ["the output folder . is the working directory", "name a new folder such as build"]),
    ("compile_out_is_the_absolute_working_directory", None, [*COMPILE, "--out", "<cwd>"],
     ["is the working directory"]),
    ("compile_out_is_an_ancestor_of_the_working_directory", _chdir_below,
     ["compile", "llama", "--config", "../ck/config.json", "--out", ".."],
     ["the output folder .. holds the working directory <scene>/work"]),
    ("compile_out_is_a_symlink", _link("prev"), [*COMPILE, "--out", "link"],
     ["the output folder link is a symbolic link (to prev); partc does not replace a link",
      "--force"]),
    ("compile_out_is_a_symlink_to_notes_with_force", _link("notes"),
     [*COMPILE, "--out", "link", "--force"],
     ["the output folder link (-> <scene>/notes) is not empty and was not written by partc"]),
    ("compile_out_is_a_dangling_symlink_with_force", _link("nowhere"),
     [*COMPILE, "--out", "link", "--force"],
     ["the output folder link is a symbolic link to nowhere, which is not an existing folder"]),
    ("compile_out_is_a_symlink_to_the_checkpoint_with_force", _link("ck"),
     [*COMPILE, "--checkpoint", "ck", "--out", "link", "--force"],
     ["the output folder link is the checkpoint ck"]),
    ("a_build_with_an_extra_user_file", _extra_file, [*COMPILE, "--out", "prev"],
     ["the output folder prev holds 1 entry (extra.txt) that partc did not write",
      "partc never deletes them"]),
    ("a_build_with_an_extra_symlink", _extra_link, [*COMPILE, "--out", "prev"],
     ["the output folder prev holds 1 entry (data) that partc did not write"]),
    ("a_build_whose_pycache_holds_a_source_file", _pycache_with_source,
     [*COMPILE, "--out", "prev"], ["holds 1 entry (partc_llama_tp2_pp1/__pycache__/)"]),
    # a __pycache__ is Python's only beside the modules partc wrote, holding their bytecode
    ("a_pyc_in_a_pycache_beside_no_module_partc_wrote",
     _pycache("", "mine.cpython-311.pyc", b"precious"), [*COMPILE, "--out", "prev"],
     ["holds 1 entry (__pycache__/) that partc did not write"]),
    ("bytecode_in_a_pycache_beside_no_module_partc_wrote",
     _pycache("", "plan.cpython-311.pyc", BYTECODE), [*COMPILE, "--out", "prev"],
     ["holds 1 entry (__pycache__/) that partc did not write"]),
    ("a_pyc_of_no_module_in_the_package_pycache",
     _pycache("partc_llama_tp2_pp1", "mine.cpython-311.pyc", BYTECODE),
     [*COMPILE, "--out", "prev"], ["holds 1 entry (partc_llama_tp2_pp1/__pycache__/)"]),
    ("a_module_named_pyc_that_is_not_bytecode",
     _pycache("partc_llama_tp2_pp1", "rank_00.cpython-311.pyc", b"precious notes"),
     [*COMPILE, "--out", "prev"], ["holds 1 entry (partc_llama_tp2_pp1/__pycache__/)"]),
    ("a_build_with_an_unreadable_marker", _bad_marker, [*COMPILE, "--out", "prev"],
     ["the output folder prev has an invalid .partc-build.json (it is not valid JSON"]),
    ("compile_out_is_a_shard_set", None, [*COMPILE, "--out", "shards"],
     ["the output folder shards holds a partc shard set, not a build", "--force"]),
    ("shard_out_is_a_build", None,
     ["shard", "prev", "--checkpoint", "ck", "--out", "prev2"],
     ["the output folder prev2 holds a partc build, not a shard set"]),
    ("compile_out_is_a_file", _file, [*COMPILE, "--out", "afile"],
     ["output path afile exists and is not a folder"]),
    ("compile_out_inside_a_notes_folder_in_the_checkpoint",
     lambda s: shutil.copytree(s / "notes", s / "ck" / "mine"),
     [*COMPILE, "--checkpoint", "ck", "--out", "ck/mine"],
     ["the output folder ck/mine is not empty and was not written by partc"]),
]


@pytest.mark.parametrize(("name", "setup", "argv", "phrases"), REFUSALS,
                         ids=[case[0] for case in REFUSALS])
def test_an_unsafe_output_is_refused_with_everything_left_byte_for_byte(
        scene: Path, capsys: pytest.CaptureFixture[str], name: str,
        setup: Callable[[Path], None] | None, argv: list[str], phrases: list[str]) -> None:
    if name == "shard_out_is_a_build":
        shutil.copytree(scene / "prev", scene / "prev2")
    if setup is not None:
        setup(scene)
    argv = [str(scene) if a == "<cwd>" else a for a in argv]
    before = tree_hash(scene)
    status, err = _run(argv, capsys)
    assert status == 1, err
    for phrase in phrases:
        assert phrase.replace("<scene>", str(scene)) in err
    assert "Traceback" not in err and "internal error" not in err
    assert tree_hash(scene) == before  # checkpoint, config, notes, builds; no scratch entry


def test_the_root_folder_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"wrote while refusing /: {args}")

    for name in ("mkdir", "makedirs", "rename", "replace", "rmdir", "unlink", "remove"):
        monkeypatch.setattr(os, name, forbidden)
    monkeypatch.setattr(shutil, "rmtree", forbidden)
    monkeypatch.setattr(output.tempfile, "mkdtemp", forbidden)
    with pytest.raises(EmitError, match="refusing to use the root folder / as the output folder"):
        compile_family("llama", LLAMA / "config.json", None, CompileOptions(out=Path("/")))
    with pytest.raises(EmitError, match="refusing to use the root folder /"):
        output.write_atomically(Path("/"), {"plan.json": "{}"}, kind="build")


def _marker(folder: Path) -> dict[str, object]:
    return json.loads((folder / MARKER).read_text())


def _files_below(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MARKER)


def test_every_build_and_shard_set_carries_a_canonical_marker_of_what_partc_wrote(
        scene: Path) -> None:
    for folder, kind in ((scene / "prev", "build"), (scene / "shards", "shard")):
        text = (folder / MARKER).read_text()
        data = json.loads(text)
        assert data == {"kind": kind, "partc_version": __version__,
                        "files": _files_below(folder)}
        assert text == json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"


def test_a_previous_build_is_replaced_whole_even_after_python_imported_it(scene: Path) -> None:
    plan = compile_family("llama", "ck/config.json", Topology(tensor_parallel_size=2)).plan
    import_build(scene / "prev", plan).load("ck", rank=0)
    # what an import writes when bytecode is cached (this suite may run with it off)
    assert compileall.compile_dir(scene / "prev", quiet=1)
    assert list((scene / "prev" / "partc_llama_tp2_pp1").glob("__pycache__/*.pyc"))
    ck = tree_hash(scene / "ck")
    assert main([*COMPILE, "--pp", "3", "--out", "prev"]) == 0
    assert _files_below(scene / "prev") == [
        "partc_llama_tp1_pp3/__init__.py", "partc_llama_tp1_pp3/rank_00.py",
        "partc_llama_tp1_pp3/rank_01.py", "partc_llama_tp1_pp3/rank_02.py", "plan.json"]
    assert _marker(scene / "prev")["files"] == _files_below(scene / "prev")
    assert tree_hash(scene / "ck") == ck
    assert sorted(p.name for p in scene.iterdir()) == ["ck", "notes", "prev", "shards"]


def test_an_empty_folder_is_filled_and_a_shard_set_replaced(
        scene: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (scene / "empty").mkdir()
    assert main([*COMPILE, "--out", "empty"]) == 0
    assert _marker(scene / "empty")["kind"] == "build"
    status, _ = _run(["shard", "prev", "--checkpoint", "ck", "--out", "shards"], capsys)
    assert status == 0 and _marker(scene / "shards")["kind"] == "shard"


def test_force_replaces_a_partc_folder_of_the_other_kind(scene: Path) -> None:
    assert main([*COMPILE, "--out", "shards", "--force"]) == 0
    assert _marker(scene / "shards")["kind"] == "build"
    assert not list((scene / "shards").glob("*.safetensors"))


def test_a_build_may_go_into_a_new_folder_inside_the_checkpoint_folder(scene: Path) -> None:
    before = {p.name: p.read_bytes() for p in (scene / "ck").iterdir()}
    assert main([*COMPILE, "--checkpoint", "ck", "--out", "ck/build"]) == 0
    assert main([*COMPILE, "--checkpoint", "ck", "--tp", "2", "--out", "ck/build"]) == 0
    after = {p.name: p.read_bytes() for p in (scene / "ck").iterdir() if p.is_file()}
    assert after == before
    assert sorted(p.name for p in (scene / "ck").iterdir()) == sorted([*before, "build"])
    assert _marker(scene / "ck" / "build")["kind"] == "build"


@pytest.mark.parametrize("target", ["empty", "prev"])
def test_force_writes_through_a_link_into_an_empty_or_partc_target_and_keeps_the_link(
        scene: Path, target: str) -> None:
    (scene / "empty").mkdir()
    (scene / "link").symlink_to(target)
    assert main([*COMPILE, "--pp", "3", "--out", "link", "--force"]) == 0
    assert (scene / "link").is_symlink() and os.readlink(scene / "link") == target
    assert (scene / target / "partc_llama_tp1_pp3" / "rank_02.py").is_file()
    assert not (scene / target / "partc_llama_tp2_pp1").exists()
    assert sorted(p.name for p in scene.iterdir()) == ["ck", "empty", "link", "notes", "prev",
                                                       "shards"]


# ---------------------------------------------------------------- without renameat2


def test_without_renameat2_a_build_is_replaced_by_two_renames(
        scene: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "_renameat2", lambda: None)
    renames: list[tuple[str, str]] = []
    real = os.rename

    def spy(a: str | Path, b: str | Path) -> None:
        renames.append((Path(a).name, Path(b).name))
        real(a, b)

    monkeypatch.setattr(os, "rename", spy)
    assert main([*COMPILE, "--pp", "3", "--out", "prev"]) == 0
    assert [(a.split(".")[2].split("-")[0] if a.startswith(".") else a,
             b.split(".")[2].split("-")[0] if b.startswith(".") else b) for a, b in renames] \
        == [("prev", "old"), ("partc", "prev")]
    assert (scene / "prev" / "partc_llama_tp1_pp3").is_dir()
    assert sorted(p.name for p in scene.iterdir()) == ["ck", "notes", "prev", "shards"]


def test_a_failed_second_rename_puts_the_previous_build_back(
        scene: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(output, "_renameat2", lambda: None)
    before = tree_hash(scene)
    real = os.rename
    calls: list[int] = []

    def failing(a: str | Path, b: str | Path) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(os, "rename", failing)
    status, err = _run([*COMPILE, "--pp", "3", "--out", "prev"], capsys)
    assert status == 74  # the machine's refusal, as for every command (docs/cli.md)
    assert "cannot write the build to prev: No space left on device" in err
    assert tree_hash(scene) == before


KILL_BETWEEN_RENAMES = """
import os, signal
import partc.output as output
output._renameat2 = lambda: None
real = os.rename
count = [0]
def dying(a, b):
    count[0] += 1
    if count[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(a, b)
os.rename = dying
from partc.api import CompileOptions, compile_family
from partc.plan.topology import Topology
compile_family("llama", "ck/config.json", Topology(pipeline_parallel_size=3),
               CompileOptions(out="prev"))
"""


def _kill_between_renames(scene: Path) -> Path:
    done = subprocess.run([sys.executable, "-c", KILL_BETWEEN_RENAMES], cwd=scene,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert not (scene / "prev").exists()  # the instant between the two renames
    backups = [p for p in scene.iterdir() if p.name.startswith(".prev.old-")]
    assert len(backups) == 1
    return backups[0]


def test_a_kill_between_the_two_renames_is_recovered_by_the_next_sweep(scene: Path) -> None:
    before = tree_hash(scene / "prev")
    backup = _kill_between_renames(scene)
    assert tree_hash(backup) == before  # the backup is the previous build, whole
    sweep_abandoned(scene / "prev")
    assert tree_hash(scene / "prev") == before
    assert sorted(p.name for p in scene.iterdir()) == ["ck", "notes", "prev", "shards"]


def test_the_next_run_after_such_a_kill_restores_then_replaces_the_build(scene: Path) -> None:
    _kill_between_renames(scene)
    assert main([*COMPILE, "--tp", "2", "--pp", "2", "--out", "prev"]) == 0
    assert (scene / "prev" / "partc_llama_tp2_pp2").is_dir()
    assert sorted(p.name for p in scene.iterdir()) == ["ck", "notes", "prev", "shards"]


def test_the_sweep_never_deletes_an_abandoned_folder_holding_user_files(scene: Path) -> None:
    backup = _kill_between_renames(scene)
    (backup / "mine.txt").write_text("written into the backup by hand")
    assert main([*COMPILE, "--out", "prev"]) == 0  # `prev` was missing: a fresh build
    assert (backup / "mine.txt").read_text() == "written into the backup by hand"
    dead = scene / ".prev.partc-otherhost-1-x"
    dead.mkdir()
    assert main([*COMPILE, "--out", "prev"]) == 0
    assert backup.is_dir() and dead.is_dir()


def test_a_read_only_parent_refuses_a_rebuild_as_the_machine_s_refusal_naming_the_output(
        scene: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A previous build in a folder that refuses the new one beside it: exit 74 (the machine's
    refusal, as report and init give), and the message says where partc writes, instead of
    claiming it could not create a folder that exists."""
    import errno
    import tempfile

    real = tempfile.mkdtemp

    def read_only(*args: object, dir: object = None, **kwargs: object) -> str:
        if dir is not None and Path(str(dir)).resolve() == scene.resolve():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    before = tree_hash(scene)
    status, err = _run([*COMPILE, "--out", "prev"], capsys)
    assert status == 74, err
    assert ("cannot write the build to prev (partc writes the new folder beside it, in "
            f"{Path.cwd().resolve()}): Read-only file system") in err, err
    assert tree_hash(scene) == before


def test_the_loser_of_a_race_for_a_new_output_folder_is_told_another_writer_won(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "build"
    real = output._write_file

    def rival_first(path: Path, content: Any) -> None:
        if not out.exists():  # another writer's folder appears after the check
            out.mkdir()
            (out / "theirs.txt").write_text("the winner's file")
        real(path, content)

    monkeypatch.setattr(output, "_write_file", rival_first)
    with pytest.raises(EmitError) as caught:
        write_atomically(out, {"a.txt": "mine"}, kind="build")
    assert str(caught.value) == (
        f"the output folder {out} was created by another writer (another partc run?) while "
        "partc wrote; that writer won, its folder was left as it is and nothing of this run "
        "was kept; run again to replace it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]  # no scratch left
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
