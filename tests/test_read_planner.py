"""The read planner (`partc.runtime.read_planner`): its plans against the brute-force optimum of
the same cost model on small inputs, the byte cap, and the cached calibration."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from partc.errors import LaunchError
from partc.runtime import read_planner
from partc.runtime.read_planner import StorageModel, plan_merges, plan_time

from support import direct_supported


def brute_force(starts: np.ndarray, ends: np.ndarray, model: StorageModel, align: int,
                budget: float | None) -> tuple[float, int]:
    """The least modelled time over every subset of gaps read through whose aligned bytes fit
    the budget (or, when none fits, that fetch the least bytes), computed from the requests
    themselves, not from the planner's gap weights."""
    best: tuple[float, int] | None = None
    plans = []
    for merged in itertools.product((False, True), repeat=len(starts) - 1):
        spans, first = [], 0
        for k in range(len(starts)):
            if k == len(starts) - 1 or not merged[k]:
                spans.append((int(starts[first]), int(ends[k])))
                first = k + 1
        fetched = sum(-(-e // align) * align - s // align * align for s, e in spans)
        plans.append((model.cost(len(spans), fetched), fetched))
    least = min(f for _, f in plans)
    limit = least if budget is None else max(budget, least)
    for seconds, fetched in plans:
        if (budget is None or fetched <= limit) and (best is None or seconds < best[0]):
            best = (seconds, fetched)
    assert best is not None
    return best


@pytest.mark.parametrize("align", [1, 512, 4096])
def test_plans_are_as_fast_as_the_brute_force_optimum_within_the_cap(align: int) -> None:
    rng = np.random.default_rng(align)
    models = [StorageModel(25e-6, 1.4e9), StorageModel(1e-6, 8e9), StorageModel(1e-3, 1e8)]
    for trial in range(150):
        n = int(rng.integers(1, 9))
        gaps = rng.integers(0, 60_000, n) * (rng.random(n) < 0.8)  # some runs touch
        lengths = rng.integers(1, 9000, n)
        starts = np.cumsum(gaps + np.r_[0, lengths[:-1]]).astype(np.int64) + int(
            rng.integers(0, 4096))
        ends = starts + lengths
        model = models[trial % len(models)]
        share = int(lengths.sum())
        for cap in (None, 1.0, 1.05, 1.5, 3.0):
            budget = None if cap is None else cap * share
            merged = plan_merges(starts, ends, model, align=align, budget=budget)
            seconds, fetched = plan_time(starts, ends, merged, model, align)
            want_seconds, _ = brute_force(starts, ends, model, align, budget)
            assert seconds == pytest.approx(want_seconds, rel=1e-12, abs=1e-15), (
                trial, cap, starts.tolist(), ends.tolist())
            least = brute_force(starts, ends, StorageModel(0.0, 1.0), align, None)[1]
            if budget is not None:
                assert fetched <= max(budget, least), "the cap holds where any plan meets it"


def test_the_default_cold_model_reads_a_column_slice_whole_and_the_cap_keeps_it_exact() -> None:
    # rank 0 of T=2 on a bf16 down_proj of 2816 columns: 2816-byte runs, 2816-byte gaps
    row = 2816 * 2
    starts = np.arange(64, dtype=np.int64) * row + 1000
    ends = starts + row // 2
    assert plan_merges(starts, ends, read_planner.COLD, align=512).all()
    share = int((ends - starts).sum())
    capped = plan_merges(starts, ends, read_planner.COLD, align=512, budget=1.05 * share)
    exact = plan_time(starts, ends, np.zeros(63, bool), read_planner.COLD, 512)[1]  # sectors
    assert plan_time(starts, ends, capped, read_planner.COLD, 512)[1] <= max(1.05 * share, exact)
    assert not capped.all(), "under a 1.05 cap most rows are read as exact runs"


def test_the_cap_option_and_variable_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_planner.fetch_cap(None) is None and read_planner.fetch_cap(2) == 2.0
    for bad in (0.5, True, "2", float("nan")):
        with pytest.raises(LaunchError, match="max_fetch_ratio must be None or a number >= 1"):
            read_planner.fetch_cap(bad)
    monkeypatch.setenv(read_planner.ENVIRONMENT, " 1.05 ")
    assert read_planner.environment_cap() == 1.05
    monkeypatch.setenv(read_planner.ENVIRONMENT, "lots")
    with pytest.raises(LaunchError, match="environment PARTC_MAX_FETCH_RATIO must be"):
        read_planner.environment_cap()
    monkeypatch.setenv(read_planner.ENVIRONMENT, "")
    assert read_planner.environment_cap() is None


def test_a_calibration_is_cached_per_device_and_read_back(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(read_planner, "_MODELS", {})
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(2 << 20))
    device = data.stat().st_dev
    assert read_planner.storage_model(device) is read_planner.COLD, "no calibration: the defaults"
    monkeypatch.setattr(read_planner, "_MODELS", {})
    if not direct_supported(data):  # calibration measures O_DIRECT reads: refused, none cached
        with pytest.raises(OSError):
            read_planner.calibrate(str(data), requests=32, large=2 << 20, depth=2)
        assert not (tmp_path / "cache" / "partc" / "storage.json").exists()
        assert read_planner.storage_model(device) is read_planner.COLD
        return
    model = read_planner.calibrate(str(data), requests=32, large=2 << 20, depth=2)
    assert model.latency >= 0 and model.bandwidth > 0
    assert (tmp_path / "cache" / "partc" / "storage.json").is_file()
    monkeypatch.setattr(read_planner, "_MODELS", {})
    again = read_planner.storage_model(device)
    assert (again.latency, again.bandwidth) == (model.latency, model.bandwidth)


class _Source:
    """What `plan_spans` asks of a job's file: its device (for the storage model) and whether
    the zero-copy modes copy from its mapping."""
    device = 0
    in_process = False


def _random_jobs(rng: np.random.Generator, way: str) -> list[Any]:
    from partc.runtime._engine.gather import Gather

    jobs, base = [], 1000 + int(rng.integers(0, 4096))
    for _ in range(int(rng.integers(1, 6))):
        widths = rng.integers(1, 3000, size=int(rng.integers(1, 4)))
        gaps = rng.choice([0, 1, 200, 5000, 40_000], size=len(widths))
        pieces, at, out = [], int(rng.integers(0, 300)), 0
        for width, gap in zip(widths.tolist(), gaps.tolist(), strict=True):
            pieces.append((at, out, width))
            at, out = at + width + gap, out + width
        row_bytes = at + int(rng.integers(0, 3)) * 500
        rows = int(rng.integers(1, 9))
        for first in range(0, rows, 3):
            job = Gather(file=0, path="f", name="t", out=np.empty((rows, out), np.uint8),
                         base=base, row_bytes=row_bytes, rows=(first, min(rows, first + 3)),
                         pieces=tuple(pieces), nbytes=(min(rows, first + 3) - first) * out)
            job.source, job.direct, job.prefetch = _Source(), way == "direct", way == "cold"
            jobs.append(job)
        base += rows * row_bytes + int(rng.integers(0, 700))
    return jobs


@pytest.mark.parametrize("way", ["direct", "cold"])
@pytest.mark.parametrize("seed", range(40))
def test_a_job_read_whole_without_planning_its_pieces_is_what_the_planner_chooses(
        way: str, seed: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # uncapped, aligned: the shortcut (every gap worth reading through, whatever the
    # alignment) must give each job the merge the full per-piece plan gives it
    from partc.runtime._engine import spans

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the default storage model
    rng = np.random.default_rng(seed)
    jobs = _random_jobs(rng, way)
    twins = _random_jobs(np.random.default_rng(seed), way)
    spans.plan_spans(jobs, sum(j.nbytes for j in jobs), None)
    monkeypatch.setattr(spans, "all_gaps_worth", lambda job, model: False)
    spans.plan_spans(twins, sum(j.nbytes for j in twins), None)
    for job, twin in zip(jobs, twins, strict=True):
        if isinstance(twin.merge, np.ndarray):
            assert isinstance(job.merge, np.ndarray) and np.array_equal(job.merge, twin.merge)
        else:
            assert job.merge is twin.merge, (job.pieces, job.row_bytes, job.merge, twin.merge)
