"""Interrupted removals, long output names and missing parents: a write killed while it removed
the old build, or a sweep killed while it removed what such a write left, leaves a folder the
next write still recognises as partc's and removes; folders partc cannot prove it wrote are
never touched; an output name up to the file-name limit gets a scratch name that fits; missing
parents of `--out` are created, and removed again when the write fails."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from partc import output
from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.errors import MachineError
from partc.output import MARKER, sweep_abandoned, write_atomically
from partc.plan.topology import Topology

from support import hf

LLAMA = hf("llama")
CONFIG = str(LLAMA / "config.json")


class Killed(BaseException):
    """Stands for SIGKILL: raised by a removal step, it unwinds past every `except Exception`."""


class Listing:
    """A folder's entries in a chosen order, as a file system might list them."""

    def __init__(self, entries: Any, order: str) -> None:
        with entries:
            self.entries = sorted(entries, key=lambda e: e.name, reverse=order == "reversed")

    def __enter__(self) -> Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.entries)

    def close(self) -> None:
        """Nothing to close: the entries were read."""


ORDERS = ["by name", "reversed"]
"""Orders in which the folders are listed: the marker (`.partc-build.json`) first or last."""


@contextmanager
def killed_after(steps: int, order: str) -> Iterator[list[int]]:
    """Let `steps` unlink/rmdir calls on hidden scratch paths run, then raise Killed at the
    next one (other paths are not counted; calls relative to a folder descriptor, as
    shutil.rmtree makes them, are), every folder listed in `order`. Yields the count of calls
    that ran."""
    done = [0]
    real: dict[str, Callable[..., Any]] = {"unlink": os.unlink, "rmdir": os.rmdir,
                                           "scandir": os.scandir}

    def counted(name: str) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dir_fd") is not None or any(
                    part.startswith(".") and (".partc-" in part or ".old-" in part)
                    for part in Path(os.fsdecode(path)).parts):
                if done[0] == steps:
                    raise Killed(path)
                done[0] += 1
            return real[name](path, *args, **kwargs)
        return call

    os.unlink, os.rmdir = counted("unlink"), counted("rmdir")  # type: ignore[assignment]
    os.scandir = lambda *args: Listing(real["scandir"](*args), order)  # type: ignore[assignment]
    try:
        yield done
    finally:
        os.unlink, os.rmdir = real["unlink"], real["rmdir"]  # type: ignore[assignment]
        os.scandir = real["scandir"]  # type: ignore[assignment]


def _scratch(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def scene(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding a previous build `prev` (TP=2) and a notes folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("my notes")
    compile_family("llama", CONFIG, Topology(tensor_parallel_size=2), CompileOptions(out="prev"))
    return tmp_path


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("swap", ["exchange", "two renames"])
def test_a_kill_at_any_step_of_removing_the_old_build_is_cleaned_up_by_the_next_compile(
        scene: Path, swap: str, order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if swap == "two renames":
        monkeypatch.setattr(output, "_renameat2", lambda: None)
    interrupted = 0
    for steps in range(200):
        with killed_after(steps, order) as done:
            try:
                compile_family("llama", CONFIG,
                               Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                               CompileOptions(out="prev"))
            except Killed:
                pass
            else:
                break
        assert done[0] == steps
        interrupted += 1
        # A build is in place (the new one, but for the fallback's first step, the removal of
        # the empty backup name before the renames); what is left beside it is partc's,
        # provably:
        before_swap = swap == "two renames" and steps == 0
        package = "partc_llama_tp2_pp1" if before_swap else "partc_llama_tp2_pp2"
        assert (scene / "prev" / package).is_dir()
        assert _scratch(scene)
        for left in _scratch(scene):
            leftover = scene / left
            assert (leftover / MARKER).is_file() or not any(leftover.iterdir()), \
                sorted(leftover.rglob("*"))
        # The process that left it is gone (here: deemed gone); the next compile removes it.
        with monkeypatch.context() as dead:
            dead.setattr(output, "_alive", lambda pid: False)
            compile_family("llama", CONFIG, Topology(tensor_parallel_size=2),
                           CompileOptions(out="prev"))
        assert _scratch(scene) == [], steps
        assert sorted(p.name for p in scene.iterdir()) == ["notes", "prev"]
        assert (scene / "prev" / "partc_llama_tp2_pp1").is_dir()
        assert (scene / "notes" / "a.txt").read_text() == "my notes"
    else:
        pytest.fail("the removal never completed")
    assert interrupted >= 6  # marker, plan, rank modules, package folder, ...: every step


def _partc_folder(at: Path) -> Path:
    """A partc folder with nested files, an empty file and Python's bytecode cache."""
    write_atomically(at, {"plan.json": "{}", "pkg/__init__.py": "", "pkg/rank0.py": "x = 0\n",
                          "pkg/sub/deep.txt": "deep"}, kind="build")
    (at / "pkg" / "__pycache__").mkdir()
    (at / "pkg" / "__pycache__" / "rank0.cpython-312.pyc").write_bytes(
        importlib.util.MAGIC_NUMBER + bytes(12))  # what Python writes: magic, flags, stamp
    return at


@pytest.mark.parametrize("order", ORDERS)
def test_a_sweep_killed_at_any_step_of_its_removal_is_finished_by_the_next_one(
        tmp_path: Path, order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "build"
    monkeypatch.setattr(output, "_alive", lambda pid: False)
    template = _partc_folder(tmp_path / "template")
    for steps in range(100):
        abandoned = tmp_path / (output._scratch_prefix(out, "partc") + "abcdefgh")
        shutil.copytree(template, abandoned)
        with killed_after(steps, order) as done:
            try:
                sweep_abandoned(out)
            except Killed:
                pass
            else:
                break
        assert done[0] == steps
        assert (abandoned / MARKER).is_file() or not any(abandoned.iterdir())
        sweep_abandoned(out)
        assert not abandoned.exists(), steps
    else:
        pytest.fail("the sweep never completed")
    assert steps == 10  # 4 files, the bytecode file, 3 folders; then the marker, the folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["template"]


def test_a_scratch_folder_killed_while_its_marker_was_written_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "build"
    monkeypatch.setattr(output, "_alive", lambda pid: False)
    torn = tmp_path / (output._scratch_prefix(out, "partc") + "torn0000")
    torn.mkdir()
    (torn / MARKER).write_text('{"files": ["pl')
    sweep_abandoned(out)
    assert not torn.exists()


FOREIGN: dict[str, Callable[[Path], None]] = {
    "a file of the user's": lambda f: (f / "mine.txt").write_text("mine"),
    "a marker and a file it does not list": lambda f: (
        (f / MARKER).write_text(json.dumps({"files": ["plan.json"], "kind": "build",
                                            "partc_version": "0"})),
        (f / "plan.json").write_text("{}"), (f / "mine.txt").write_text("mine")),
    "no marker, only an empty folder": lambda f: (f / "partc_llama_tp1_pp1").mkdir(),
    "an unreadable marker and another file": lambda f: (
        (f / MARKER).write_text("{"), (f / "mine.txt").write_text("mine")),
    "a marker listing a file that is a link": lambda f: (
        (f / MARKER).write_text(json.dumps({"files": ["plan.json"], "kind": "build",
                                            "partc_version": "0"})),
        (f / "plan.json").symlink_to(f.parent / "notes" / "a.txt")),
    "a bytecode cache holding another file": lambda f: (
        (f / MARKER).write_text(json.dumps({"files": [], "kind": "build",
                                            "partc_version": "0"})),
        (f / "__pycache__").mkdir(), (f / "__pycache__" / "notes.txt").write_text("mine")),
}


@pytest.mark.parametrize("holding", sorted(FOREIGN))
def test_a_folder_named_like_an_abandoned_scratch_folder_is_never_touched_unless_partc_wrote_it(
        scene: Path, holding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    look_alike = scene / (output._scratch_prefix(scene / "prev", "partc") + "mine1234")
    look_alike.mkdir()
    FOREIGN[holding](look_alike)
    before = sorted((str(p.relative_to(look_alike)), p.is_dir(), p.is_symlink())
                    for p in look_alike.rglob("*"))
    link = scene / (output._scratch_prefix(scene / "prev", "old") + "link1234")
    link.symlink_to(scene / "prev")  # a link named like a backup: never followed
    monkeypatch.setattr(output, "_alive", lambda pid: False)
    compile_family("llama", CONFIG, Topology(pipeline_parallel_size=2), CompileOptions(out="prev"))
    compile_family("llama", CONFIG, None, CompileOptions(out="prev"))
    after = sorted((str(p.relative_to(look_alike)), p.is_dir(), p.is_symlink())
                   for p in look_alike.rglob("*"))
    assert after == before
    assert link.is_symlink() and (scene / "prev" / MARKER).is_file()
    assert (scene / "notes" / "a.txt").read_text() == "my notes"
    assert _scratch(scene) == sorted([look_alike.name, link.name])


LONG = "b" * 250


@pytest.mark.parametrize("name", [LONG, "é" * 127])  # 250 and 254 bytes
def test_an_output_name_as_long_as_a_file_name_may_be_is_compiled_and_sharded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        name: str) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "--checkpoint", str(LLAMA), "--out", name, "-q"]) == 0
    assert main(["compile", "--checkpoint", str(LLAMA), "--tp", "2", "--out", name, "-q"]) == 0
    assert (tmp_path / name / "partc_llama_tp2_pp1").is_dir()
    shards = name[:-1] + "s"
    assert main(["shard", name, "--checkpoint", str(LLAMA), "--out", shards, "-q"]) == 0
    assert main(["shard", name, "--checkpoint", str(LLAMA), "--out", shards, "-q"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, shards])
    assert "File name too long" not in capsys.readouterr().err


def test_a_long_output_name_gets_one_scratch_prefix_whatever_the_pid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / LONG
    prefixes = []
    for pid in (7, 4194304, 2**31 - 1):
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        prefix = output._scratch_prefix(out, "partc")
        assert len(os.fsencode(prefix)) + len("abcdefgh-new") <= 255
        prefixes.append(prefix.rsplit("-", 2)[0])
    assert len(set(prefixes)) == 1
    assert prefixes[0].startswith(".bbbb") and "~" in prefixes[0]
    # Two long names sharing their start keep different prefixes.
    other = output._scratch_prefix(tmp_path / ("b" * 249 + "c"), "partc").rsplit("-", 2)[0]
    assert other != prefixes[0]
    # A dead process's folder under a long name is found and removed by the sweep.
    monkeypatch.setattr(os, "getpid", lambda: 2**31 - 1)
    abandoned = tmp_path / (output._scratch_prefix(out, "partc") + "abcdefgh")
    _partc_folder(abandoned)
    monkeypatch.setattr(os, "getpid", lambda: 12)
    monkeypatch.setattr(output, "_alive", lambda pid: False)
    sweep_abandoned(out)
    assert not abandoned.exists()


def test_short_names_keep_their_scratch_prefix() -> None:
    assert output.fitting_name("build", 40) == "build"
    assert output.fitting_name("b" * 215, 40) == "b" * 215
    cut = output.fitting_name("b" * 216, 40)
    assert len(cut) == 215 and cut.startswith("b" * 198 + "~")


def test_a_report_and_a_scaffold_under_a_name_as_long_as_a_file_name_may_be_are_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "--checkpoint", str(LLAMA), "--out", "build", "-q"]) == 0
    report, family = "r" * 245 + ".html", "f" * 245 + ".yaml"
    assert main(["report", "build", "--out", report]) == 0
    assert main(["report", "build", "--out", report]) == 0  # replaces its own report
    assert main(["init", "--checkpoint", str(LLAMA), "--out", family]) == 0
    assert (tmp_path / report).read_text().startswith("<!-- partc report -->")
    assert (tmp_path / family).read_text().startswith("# yaml-language-server")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["build", report, family])
    assert "File name too long" not in capsys.readouterr().err


def test_missing_parents_of_the_output_are_created_for_a_build_and_a_shard_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "--checkpoint", str(LLAMA), "--out", "runs/a/build", "-q"]) == 0
    assert (tmp_path / "runs" / "a" / "build" / MARKER).is_file()
    assert main(["shard", "runs/a/build", "--checkpoint", str(LLAMA), "--out", "x/y/shards",
                 "-q"]) == 0
    assert (tmp_path / "x" / "y" / "shards" / MARKER).is_file()
    assert sorted(p.name for p in (tmp_path / "runs" / "a").iterdir()) == ["build"]


def test_a_write_that_fails_removes_the_parents_it_created_and_only_those(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("mine")

    def full(path: Path, content: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output, "_write_file", full)
    with pytest.raises(MachineError, match="cannot write the build to runs/a/b/build: No space "
                                           "left on device"):
        compile_family("llama", CONFIG, None, CompileOptions(out="runs/a/b/build"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["notes.txt"]


def test_a_refused_compile_creates_no_parent_and_a_file_on_the_way_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["compile", "--checkpoint", str(hf("qwen2")), "--config", CONFIG, "--out",
                 "new/parent/build", "-q"]) == 1  # the checkpoint is not llama's
    assert "error:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file.txt").write_text("mine")
    assert main(["compile", "--config", CONFIG, "--out", "file.txt/a/build", "-q"]) == 1
    err = capsys.readouterr().err
    assert "cannot create the output folder file.txt/a/build: file.txt exists and is not a " \
           "folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]
