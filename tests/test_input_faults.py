"""Family and config inputs that are not what they seem: lookup shadowing, YAML directives,
unreadable paths (folders, FIFOs, missing or forbidden files), memory and size limits, and the
largest unit count partc accepts."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from partc.api import CompileOptions, check_family, compile_family
from partc.bind.binder import MAX_UNITS
from partc.cli.main import main
from partc.errors import LoadError
from partc.front.load import MAX_CONFIG_BYTES, MAX_DOCUMENT_BYTES, load_document, load_json
from partc.library import family_spec_is_file, read_family_source
from partc.plan.topology import Topology

from support import HF


def run(*argv: str) -> tuple[int, str]:
    """Exit status and stderr of the command line run in-process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(list(argv))
    return status, err.getvalue()


@pytest.fixture
def shadowed(tmp_path, monkeypatch):
    """A working folder holding a `llama/` checkpoint folder and a `llama.yaml` folder."""
    (tmp_path / "llama").mkdir()
    for item in (HF / "llama").iterdir():
        if item.is_file():
            shutil.copy(item, tmp_path / "llama" / item.name)
    (tmp_path / "llama.yaml").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_folder_named_like_the_family_does_not_shadow_the_config_s_built_in(shadowed):
    assert run("check", "--config", "llama/config.json", "--checkpoint", "llama") == (
        0, "")
    assert check_family(None, "llama/config.json", "llama") == []


def test_an_explicit_built_in_name_is_not_shadowed_by_a_folder_of_that_name(shadowed):
    assert check_family("llama", "llama/config.json") == []
    assert not family_spec_is_file("llama")


def test_a_folder_given_as_a_family_file_is_refused_with_a_clear_message(shadowed):
    for spec in ("llama/", "llama.yaml", "./llama"):
        assert family_spec_is_file(spec)
        with pytest.raises(LoadError) as caught:
            read_family_source(spec)
        assert str(caught.value).startswith(
            f"{spec}: family {spec!r} is a folder; expected a family file (.yaml, .yml or .toml) "
            "or a built-in family name (bamba, bloom, codegen, dbrx, deepseek_v2, deepseek_v3, ")


def test_an_existing_file_without_a_family_suffix_is_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").write_text("family: x\n")
    assert family_spec_is_file("llama")
    with pytest.raises(LoadError) as caught:
        load_document("llama", text="family: x\n")
    assert str(caught.value) == ("llama: unknown family file type '(no suffix)': expected "
                                 ".yaml, .yml or .toml")
    status, err = run("check", "llama")
    assert status == 1 and "llama: unknown family file type '(no suffix)'" in err


def test_an_unknown_name_explains_how_a_file_is_recognised():
    with pytest.raises(LoadError) as caught:
        read_family_source("nosuchmodel")
    assert str(caught.value).startswith(
        "nosuchmodel: no built-in family for model type 'nosuchmodel' (a family file needs a "
        ".yaml, .yml or .toml suffix or a path with a `/`); built-in: bamba, bloom, codegen, dbrx, "
        "deepseek_v2, deepseek_v3, falcon, ")


@pytest.mark.parametrize("directive", ["%YAML 1.1", "%YAML 1.0"])
def test_a_yaml_directive_other_than_1_2_is_refused_at_its_line(directive):
    text = f"# a family\n{directive}\n---\nfamily: x\n"
    with pytest.raises(LoadError) as caught:
        load_document("family.yaml", text=text)
    assert str(caught.value) == (
        f"family.yaml:2:1: partc reads YAML 1.2 only, found a `{directive}` directive; write "
        "`%YAML 1.2` or no directive")


def test_a_yaml_1_2_directive_is_accepted():
    assert load_document("family.yaml", text="%YAML 1.2\n---\nfamily: x\n").data == {
        "family": "x"}


def test_a_fifo_given_as_config_or_family_is_refused_without_blocking(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo("config.json")
    os.mkfifo("family.yaml")
    with pytest.raises(LoadError) as caught:
        load_json("config.json", "config.json")
    assert str(caught.value) == ("config.json: cannot read config.json: config.json is a FIFO "
                                 "(named pipe), expected a regular file")
    status, err = run("check", "family.yaml")
    assert (status, err.splitlines()[0]) == (1, (
        "error: family.yaml: cannot read family file: family.yaml is a FIFO (named pipe), "
        "expected a regular file"))


def test_a_fifo_given_as_an_output_file_or_a_build_s_plan_is_refused_without_blocking(
        tmp_path, monkeypatch):
    """Each command in a fresh process with a time limit, so that one that blocks in open()
    fails the test instead of hanging it."""
    monkeypatch.chdir(tmp_path)
    compile_family("llama", HF / "llama" / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out="b"))
    os.mkfifo("out.html")
    os.mkfifo("out.yaml")
    os.mkdir("fb")
    os.mkfifo("fb/plan.json")
    refused = "is a FIFO; expected a new file path (partc never replaces a file it did not write)"
    plan = "fb/plan.json is a FIFO (named pipe), expected a regular file"
    cases = [
        (["report", "b", "--out", "out.html"], f"error: out.html: out.html {refused}"),
        (["init", "--checkpoint", str(HF / "llama"), "--out", "out.yaml"],
         f"error: out.yaml: out.yaml {refused}"),
        (["families", "--copy", "llama", "out.yaml"], f"error: out.yaml: out.yaml {refused}"),
        (["explain", "fb", "model.norm.weight"],
         f"error: fb/plan.json: cannot read a plan from fb/plan.json: {plan}; expected a "
         "folder written by `partc compile` (it holds plan.json)"),
        (["report", "fb", "--out", "r.html"],
         f"error: fb/plan.json: cannot read a plan from fb/plan.json: {plan}"),
        (["shard", "fb", "--checkpoint", str(HF / "llama"), "--out", "s"],
         f"error: fb/plan.json: cannot read the build's plan.json: {plan}"),
    ]
    for argv, first in cases:
        done = subprocess.run([sys.executable, "-m", "partc.cli", *argv], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1, (argv, done.stderr)
        assert done.stderr.splitlines()[0].startswith(first), (argv, done.stderr)
        assert "Traceback" not in done.stderr
    assert sorted(os.listdir(".")) == ["b", "fb", "out.html", "out.yaml"]  # nothing written


def test_a_refused_write_of_an_output_file_names_the_file_asked_for(tmp_path, monkeypatch):
    """A read-only folder refuses partc's hidden scratch file: the error names --out (the file
    the user asked for), and the exit status is the machine's (74), as for every command."""
    import errno
    import tempfile

    monkeypatch.chdir(tmp_path)
    compile_family("llama", HF / "llama" / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out="b"))

    def refuse(*_, dir=".", **__):
        raise OSError(errno.EROFS, "Read-only file system", os.path.join(dir, ".r.html.x1y2z3"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    status, err = run("report", "b", "--out", "r.html")
    assert status == 74, err
    assert "Read-only file system: r.html" in err and ".r.html.x1y2z3" not in err, err
    assert sorted(os.listdir(".")) == ["b"]


def test_a_folder_given_as_config_is_refused(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(LoadError) as caught:
        load_json(tmp_path / "config.json", "config.json")
    assert str(caught.value) == (f"{tmp_path / 'config.json'}: cannot read config.json: "
                                 f"{tmp_path / 'config.json'} is a folder, expected a file")


def test_a_missing_config_names_its_path(tmp_path):
    status, err = run("compile", "--config", str(tmp_path / "none.json"), "--out",
                      str(tmp_path / "build"))
    assert (status, err.splitlines()[0]) == (1, (
        f"error: {tmp_path / 'none.json'}: cannot read config.json: No such file or directory"))


@pytest.mark.parametrize(("error", "words"), [
    (PermissionError(13, "Permission denied"), "Permission denied"),
    (IsADirectoryError(21, "Is a directory"), "Is a directory"),
    (FileNotFoundError(2, "No such file or directory"), "No such file or directory"),
])
def test_an_os_error_while_opening_a_family_or_config_is_a_located_load_error(
        tmp_path, monkeypatch, error, words):
    # the tests run as root, who may read anything: simulate the refusal at the open
    config = tmp_path / "config.json"
    shutil.copy(HF / "llama" / "config.json", config)

    def refuse(*args, **kwargs):
        raise error
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(LoadError) as caught:
        load_json(config, "config.json")
    assert str(caught.value) == f"{config}: cannot read config.json: {words}"
    status, err = run("check", "--config", str(config))
    assert status == 1
    assert err.splitlines()[0] == f"error: {config}: cannot read config.json: {words}"
    assert "Traceback" not in err and "internal error" not in err


def test_a_memory_error_while_parsing_is_a_located_load_error(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    shutil.copy(HF / "llama" / "config.json", config)
    real_loads = json.loads

    def exhausted(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(json, "loads", exhausted)
    with pytest.raises(LoadError) as caught:
        load_json(config, "config.json")
    assert str(caught.value) == f"{config}: config.json: out of memory while parsing it"
    monkeypatch.setattr(json, "loads", real_loads)


def test_a_memory_error_while_reading_a_family_file_is_a_located_load_error(tmp_path,
                                                                            monkeypatch):
    family = tmp_path / "family.yaml"
    family.write_text("family: x\n")
    real_fdopen = os.fdopen

    class Exhausted:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def fileno(self):
            return self.handle.fileno()

        def read(self, size):
            raise MemoryError

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Exhausted(real_fdopen(fd, mode)))
    with pytest.raises(LoadError) as caught:
        load_document(family)
    assert str(caught.value) == f"{family}: cannot read family file: out of memory"


@pytest.mark.parametrize(("name", "limit", "label"), [
    ("config.json", MAX_CONFIG_BYTES, "config.json"),
    ("family.yaml", MAX_DOCUMENT_BYTES, "family file"),
])
def test_an_oversized_sparse_file_is_refused_before_it_is_read(tmp_path, monkeypatch, name,
                                                               limit, label):
    path = tmp_path / name
    with open(path, "wb") as handle:
        handle.truncate(limit + 1)  # sparse: nothing is written, and nothing may be read

    def never(*args, **kwargs):
        raise AssertionError("the file was opened")
    monkeypatch.setattr(os, "open", never)
    with pytest.raises(LoadError) as caught:
        load_json(path, label) if name.endswith(".json") else load_document(path)
    assert str(caught.value) == f"{path}: {label} is larger than the limit of {limit} bytes"


def test_a_file_at_the_size_limit_is_read(tmp_path):
    path = tmp_path / "config.json"
    body = '{"model_type": "llama", "pad": "'
    path.write_text(body + "x" * (MAX_CONFIG_BYTES - len(body) - 2) + '"}')
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert load_json(path, "config.json").data["model_type"] == "llama"


def test_the_largest_unit_count_compiles(tmp_path):
    # the documented maximum (benchmarks/limits.py times it: about 2 s from the command line)
    config = json.loads((HF / "llama" / "config.json").read_text())
    config["num_hidden_layers"] = MAX_UNITS
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = compile_family(None, tmp_path / "config.json",
                            Topology(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert [g.unit_range for r in result.plan.ranks for g in r.partition.groups] == [
        (0, MAX_UNITS // 2)] * 2 + [(MAX_UNITS // 2, MAX_UNITS)] * 2
    config["num_hidden_layers"] = MAX_UNITS + 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as caught:
        compile_family(None, tmp_path / "config.json")
    assert str(caught.value) == (
        f"architectures/llama.yaml:26:29: execution group `decoder` has {MAX_UNITS + 1} units; "
        f"partc accepts at most {MAX_UNITS} per group [at /graph/0/units]")
