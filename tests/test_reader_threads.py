"""How a read's jobs are spread over threads: the calling thread reads too, reports progress
alone, and an error on any thread is raised once every thread has stopped."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.runtime._engine import reader as checkpoint
from partc.runtime._engine.reader import CheckpointReader
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime.checkpoint import open_checkpoint

from support import hf

LLAMA = hf("llama")


@dataclass
class FakeJob:
    number: int
    nbytes: int


def run(monkeypatch: pytest.MonkeyPatch, job_run: Any, count: int = 40,
        progress: Any = None) -> list[FakeJob]:
    """`count` fake jobs through `_run_threaded` on three threads, `job_run(job)` as each
    job's read."""
    monkeypatch.setattr(CheckpointReader, "_run_job", lambda self, job: job_run(job))
    jobs = [FakeJob(i, 1 + i) for i in range(count)]
    with CheckpointReader(open_checkpoint(LLAMA)) as reader:
        reader._run_threaded(jobs, progress, 3)  # type: ignore[arg-type]
    return jobs


def live_readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("partc-read-")]


def test_the_calling_thread_reads_and_alone_reports_every_finished_byte(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: dict[int, str] = {}
    told: list[tuple[str, int]] = []

    def job_run(job: FakeJob) -> None:
        taken[job.number] = threading.current_thread().name
        time.sleep(0.002)  # long enough for every thread to take some

    jobs = run(monkeypatch, job_run,
               progress=lambda n: told.append((threading.current_thread().name, n)))
    me = threading.current_thread().name
    assert sorted(taken) == [j.number for j in jobs], "every job read once"
    assert me in taken.values(), "the calling thread reads jobs too"
    assert set(taken.values()) <= {me, "partc-read-0", "partc-read-1"}, "three threads in all"
    assert {name for name, _ in told} == {me}, "progress is called in the calling thread only"
    assert sorted(n for _, n in told) == sorted(j.nbytes for j in jobs)
    assert not live_readers()


@pytest.mark.parametrize("failing", ["caller", "reader"])
def test_an_error_on_any_thread_is_raised_after_every_thread_stopped(
        monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    me = threading.current_thread().name
    started: list[int] = []
    lock = threading.Lock()

    def job_run(job: FakeJob) -> None:
        name = threading.current_thread().name
        with lock:
            started.append(job.number)
            first = (name == me) == (failing == "caller") and job.number >= 3
        if first:
            raise ValueError(f"job {job.number} failed on {name}")
        time.sleep(0.002)

    with pytest.raises(ValueError, match="failed on " + (me if failing == "caller"
                                                          else "partc-read-")):
        run(monkeypatch, job_run, count=200)
    assert not live_readers(), "no reader thread outlives the error"
    assert len(started) < 200, "no job is started once a job has failed"


def test_a_threaded_read_equals_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "THREADED_BYTES", 0)
    monkeypatch.setattr(checkpoint, "JOB_BYTES", 2048)
    ckpt = open_checkpoint(LLAMA)
    requests = [(n, TensorSelection(axis=0, ranges=((0, ckpt.tensor(n)[1].shape[0] // 2),)))
                for n in ckpt.names if ckpt.tensor(n)[1].shape]
    seen: list[int] = []
    with CheckpointReader(ckpt, ReadOptions(workers=3, progress=seen.append)) as reader:
        got = reader.read_many(requests)
    want = load_file(LLAMA / "model.safetensors")
    for name, selection in requests:
        expected = want[name][: selection.ranges[0][1]]
        assert np.array_equal(got[name].view(np.uint8), expected.view(np.uint8)), name
    assert sum(seen) == sum(a.nbytes for a in got.values()) and len(seen) > 3
