"""A generated loader's options and the environment it reads: a value of the wrong kind is one
LaunchError (the serving call or process set up wrongly, a CheckpointError too for old callers)
naming the option or variable, the value found and what is expected, raised before any payload
byte is read; never a raw Python exception."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from partc.errors import CheckpointError, LaunchError
from partc.runtime.rank_env import environment_integer

from support import Recorder, compile_and_import, hf

LLAMA = hf("llama")
_VARIABLES = ("PARTC_READ_THREADS", "PARTC_LOCAL_RANKS", "LOCAL_WORLD_SIZE", "RANK",
              "WORLD_SIZE")


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return compile_and_import("llama", LLAMA / "config.json",
                              tmp_path_factory.mktemp("options") / "build", tp=2, pp=2)[1]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("variable", ["PARTC_READ_THREADS", "PARTC_LOCAL_RANKS",
                                      "LOCAL_WORLD_SIZE"])
@pytest.mark.parametrize("value", ["\u00b2", "\u00b3", "\u0663", "1_0", "zero", "0", "-2",
                                   "2.0"])
def test_a_thread_or_rank_count_in_the_environment_must_be_ascii_digits_of_a_positive_number(
        package: Any, monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    assert not (value.isascii() and value.isdigit() and int(value) > 0)
    monkeypatch.setenv(variable, value)
    recorder = Recorder()
    with pytest.raises(CheckpointError) as caught:
        package.load(LLAMA, rank=0, reader=recorder)
    assert str(caught.value) == (f"environment {variable}={value!r} must be a positive integer "
                                 "in ASCII digits (e.g. 4); unset it for the default")
    assert recorder.runs == []


@pytest.mark.parametrize(("variable", "value"), [("PARTC_READ_THREADS", " 3 "),
                                                 ("PARTC_LOCAL_RANKS", "2"),
                                                 ("LOCAL_WORLD_SIZE", "")])
def test_a_count_in_ascii_digits_or_a_blank_one_is_accepted(
        package: Any, monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    assert package.load(LLAMA, rank=0).tensors


@pytest.mark.parametrize(("environment", "message"), [
    ({"RANK": "\u0663"}, "environment RANK='\u0663' is not an integer in ASCII digits (e.g. 3)"),
    ({"RANK": "1_0", "WORLD_SIZE": "12"},
     "environment RANK='1_0' is not an integer in ASCII digits (e.g. 3)"),
    ({"RANK": "+1"}, "environment RANK='+1' is not an integer in ASCII digits (e.g. 3)"),
    ({"RANK": "1", "WORLD_SIZE": "\u0668"},
     "environment WORLD_SIZE='\u0668' is not an integer in ASCII digits (e.g. 3)"),
    ({"RANK": "-1"}, "environment RANK='-1' must not be negative"),
])
def test_a_rank_in_the_environment_must_be_ascii_digits(
        package: Any, monkeypatch: pytest.MonkeyPatch, environment: dict[str, str],
        message: str) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CheckpointError) as caught:
        package.load(LLAMA)
    assert str(caught.value) == message


def test_environment_integers_read_only_ascii_digits() -> None:
    assert environment_integer("RANK", " 12\n") == 12
    for raw in ("\u0663", "1_0", "\uff13", "\u00b2", "", "0x1"):
        with pytest.raises(CheckpointError, match="is not an integer in ASCII digits"):
            environment_integer("RANK", raw)


@pytest.mark.parametrize(("options", "message"), [
    ({"workers": "2"}, "workers must be a positive integer, found '2'"),
    ({"workers": 0}, "workers must be a positive integer, found 0"),
    ({"workers": -1}, "workers must be a positive integer, found -1"),
    ({"workers": True}, "workers must be a positive integer, found True"),
    ({"workers": 2.0}, "workers must be a positive integer, found 2.0"),
    ({"local_ranks": 0}, "local_ranks must be a positive integer, found 0"),
    ({"local_ranks": "4"}, "local_ranks must be a positive integer, found '4'"),
    ({"reader": 5}, "reader must be None or an object with a record(path, offset, length) "
                    "method (partc.runtime.ReadRecorder), found 5"),
    ({"reader": print}, "reader must be None or an object with a record(path, offset, "
                        "length) method (partc.runtime.ReadRecorder), found "
                        "<built-in function print>"),
    ({"verify_fingerprint": "no"}, "verify_fingerprint must be True or False, found 'no'"),
    ({"verify_fingerprint": None}, "verify_fingerprint must be True or False, found None"),
    ({"progress": 5}, "progress must be None (a bar on a terminal only), True or False, "
                      "found 5"),
])
def test_an_option_of_the_wrong_kind_is_refused_naming_it_and_the_value(
        package: Any, options: dict[str, Any], message: str) -> None:
    recorder = Recorder()
    with pytest.raises(LaunchError) as caught:
        package.load(LLAMA, rank=0, **{"reader": recorder, **options})
    assert str(caught.value) == message
    assert (caught.value.stage, caught.value.doc) == ("launch", "using#the-build-folder-and-load")
    assert recorder.runs == [], "refused before any payload read"


@pytest.mark.parametrize(("checkpoint", "found"), [
    (os.fsencode(str(LLAMA)), "bytes"),
    (5, "int"),
    (None, "NoneType"),
])
def test_a_checkpoint_that_is_no_path_is_refused(package: Any, checkpoint: object,
                                                 found: str) -> None:
    with pytest.raises(LaunchError) as caught:
        package.load(checkpoint, rank=0)
    text = str(caught.value)
    assert text.startswith("checkpoint must be a folder or file path (a str or an os.PathLike "
                           f"giving one) or an opened Checkpoint, found {found} ")
    assert text.endswith("; decode a bytes path with os.fsdecode()") == (found == "bytes")


def test_a_path_like_checkpoint_is_accepted(package: Any) -> None:
    assert package.load(Path(LLAMA), rank=0).tensors.keys() == package.load(
        str(LLAMA), rank=0).tensors.keys()


def test_load_options_turn_the_keywords_strings_into_enums():
    from partc.runtime import Framework, LoadOptions, Verify, ZeroCopy

    assert LoadOptions.from_keywords() == LoadOptions()
    options = LoadOptions.from_keywords(framework="torch", verify="digest", zero_copy="private",
                                        dtype="float32", workers=2)
    assert (options.framework, options.verify, options.zero_copy) == (
        Framework.TORCH, Verify.DIGEST, ZeroCopy.PRIVATE)
    assert options.dtype == np.dtype(np.float32) and options.workers == 2
    assert LoadOptions.from_keywords(zero_copy=True).zero_copy is ZeroCopy.SHARED
    assert LoadOptions.from_keywords(device="cpu").framework is Framework.TORCH
    assert LoadOptions().host_numpy and not LoadOptions.from_keywords(device="cpu").host_numpy


def test_load_options_are_frozen_keyword_only_and_checked_when_built():
    import dataclasses

    from partc.runtime import Framework, LoadOptions, ZeroCopy

    with pytest.raises(dataclasses.FrozenInstanceError):
        LoadOptions().workers = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        LoadOptions(True)  # type: ignore[misc]
    with pytest.raises(LaunchError, match=r"^framework must be a Framework, found 'torch'$"):
        LoadOptions(framework="torch")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match=r"^workers must be a positive integer, found 0$"):
        LoadOptions(workers=0)
    with pytest.raises(LaunchError, match=r"zero_copy=True returns read-only views"):
        LoadOptions(framework=Framework.TORCH, zero_copy=ZeroCopy.SHARED)


def test_load_options_have_a_field_for_every_keyword_option_of_load_rank():
    import dataclasses
    import inspect

    from partc.runtime import LoadOptions, load_rank

    keywords = [p.name for p in inspect.signature(load_rank).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == [f.name for f in dataclasses.fields(LoadOptions)]
    assert keywords == list(inspect.signature(LoadOptions.from_keywords).parameters)


@pytest.mark.parametrize("options", [{"framework": "jax"}, {"verify": "sha1"},
                                     {"zero_copy": "yes"}, {"dtype": "int8"},
                                     {"dtype": object()}, {"workres": 2}])
def test_a_wrong_load_call_is_a_launch_error_that_except_checkpoint_error_still_catches(
        package: Any, options: dict[str, Any]) -> None:
    with pytest.raises(LaunchError) as caught:
        package.load(LLAMA, rank=0, **options)
    assert isinstance(caught.value, CheckpointError), "the documented promise to old callers"
    assert caught.value.to_json()["stage"] == "launch"


_HUGE = "9" * 5000


@pytest.mark.parametrize("variable", ["PARTC_READ_THREADS", "PARTC_LOCAL_RANKS",
                                      "LOCAL_WORLD_SIZE"])
@pytest.mark.parametrize("value", [_HUGE, "0" * 4000 + "1" * 400])
def test_a_count_of_thousands_of_digits_in_the_environment_is_a_launch_error(
        package: Any, monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    recorder = Recorder()
    with pytest.raises(LaunchError) as caught:
        package.load(LLAMA, rank=0, reader=recorder)
    assert str(caught.value) == (f"environment {variable} holds a {len(value.lstrip('0'))}-digit "
                                 "number; a rank or count has at most 18 digits (e.g. 3)")
    assert recorder.runs == []


@pytest.mark.parametrize(("environment", "variable"), [
    ({"RANK": _HUGE}, "RANK"),
    ({"RANK": "1", "WORLD_SIZE": _HUGE}, "WORLD_SIZE"),
    ({"RANK": "0" * 4400 + "1" * 19, "WORLD_SIZE": "4"}, "RANK"),
    ({"LOCAL_RANK": _HUGE, "RANK": "0", "WORLD_SIZE": "4"}, "LOCAL_RANK"),
])
def test_a_rank_of_thousands_of_digits_in_the_environment_is_a_launch_error(
        package: Any, monkeypatch: pytest.MonkeyPatch, environment: dict[str, str],
        variable: str) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    digits = len(environment[variable].lstrip("0"))
    expected = (f"environment {variable} holds a {digits}-digit number; a rank or count has at "
                "most 18 digits (e.g. 3)")
    with pytest.raises(LaunchError) as caught:
        package.load(LLAMA, framework="torch") if variable == "LOCAL_RANK" else package.load(LLAMA)
    assert str(caught.value) == expected


@pytest.mark.parametrize("variable", ["RANK", "WORLD_SIZE"])
def test_the_topology_refuses_a_launcher_variable_of_thousands_of_digits(
        monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    from partc.runtime.mesh import build_topology
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv(variable, _HUGE)
    with pytest.raises(LaunchError, match=f"^environment {variable} holds a 5000-digit number"):
        build_topology(2, 2)


def test_a_long_value_is_cut_in_the_message() -> None:
    with pytest.raises(LaunchError) as caught:
        environment_integer("RANK", "x" * 5000)
    assert str(caught.value) == (f"environment RANK={'x' * 64!r}... (4936 more characters) is "
                                 "not an integer in ASCII digits (e.g. 3)")
