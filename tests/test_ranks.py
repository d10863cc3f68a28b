"""Rank discovery under a launcher: RANK and WORLD_SIZE, with data-parallel replicas."""

from __future__ import annotations

import pytest

from partc.errors import LaunchError
from partc.runtime.rank_env import launch_position, rank_from_environment

from support import HF, compile_and_import


def _env(monkeypatch, rank, world):
    monkeypatch.setenv("RANK", str(rank))
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", str(world))


@pytest.mark.parametrize(("rank", "world", "expected"), [
    (0, 4, (0, 0, 1)), (3, 4, (3, 0, 1)),               # one replica of a 4-rank build
    (4, 8, (0, 1, 2)), (7, 8, (3, 1, 2)),               # two data-parallel replicas
    (9, 12, (1, 2, 3)), (2, None, (2, 0, 1)),           # three replicas; no WORLD_SIZE
])
def test_a_job_of_d_replicas_gives_each_process_its_build_rank_and_replica(
        monkeypatch, rank, world, expected):
    _env(monkeypatch, rank, world)
    position = launch_position(4)
    assert (position.rank, position.data_parallel_rank, position.data_parallel_size) == expected
    assert position.global_rank == rank
    assert position.global_rank == position.data_parallel_rank * 4 + position.rank
    assert rank_from_environment(4) == expected[0]


@pytest.mark.parametrize(("rank", "world", "message"), [
    ("1", "6", "WORLD_SIZE=6 is not a multiple of this build's 4 ranks; run 4 x D "
               "processes for D data-parallel replicas"),
    ("8", "8", "RANK=8 is outside WORLD_SIZE=8"),
    ("x", "4", "environment RANK='x' is not an integer"),
    ("1", "-4", "environment WORLD_SIZE='-4' must not be negative"),
    ("1", "0", "environment WORLD_SIZE='0' must be a positive count of processes (at least "
               "this build's 4); unset it for one replica"),
])
def test_a_world_size_that_is_no_multiple_of_the_build_is_refused(monkeypatch, rank, world,
                                                                 message):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(LaunchError) as caught:
        launch_position(4)
    assert message in str(caught.value)


def test_a_rank_beyond_the_build_without_world_size_names_the_builds_ranks(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LaunchError) as caught:
        launch_position(4)
    assert str(caught.value) == ("RANK=5 is outside this build's ranks 0..3 (WORLD_SIZE is not "
                                 "set: one replica)")


def test_a_malformed_local_rank_is_refused_on_a_machine_without_a_gpu(monkeypatch):
    import torch

    from partc.runtime.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(LaunchError, match=r"environment LOCAL_RANK='x' is not an integer"):
        resolve_device(None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device(None) == torch.device("cpu")


def test_without_rank_the_message_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(LaunchError, match="pass rank= or run under torchrun"):
        launch_position(4)


def test_a_data_parallel_process_loads_the_rank_module_of_its_build_rank(tmp_path, monkeypatch):
    fixture = HF / "llama"
    _, package = compile_and_import(None, fixture / "config.json", tmp_path / "build", tp=2,
                                    pp=1)
    _env(monkeypatch, 3, 4)  # replica 1, build rank 1
    from_env = package.load(fixture)
    explicit = package.load(fixture, rank=1)
    assert from_env.info == explicit.info
    assert list(from_env.tensors) == list(explicit.tensors)
