"""`partc calibrate`: the storage holding a checkpoint and this machine's warm column gathers
measured and cached for the read planner (read back by `storage_model` and `warm_models` in a
fresh process), `--show`, and bad paths refused in one located line with exit status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partc.cli.main import main
from partc.runtime import read_planner

from support import direct_supported, hf


@pytest.fixture()
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cache folder of this test's own (XDG_CACHE_HOME) and no models remembered."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(read_planner, "_MODELS", {})
    monkeypatch.setattr(read_planner, "_WARM", [])
    return tmp_path / "cache" / "partc" / "storage.json"


def test_a_checkpoint_folder_is_calibrated_cached_and_read_back_by_a_new_process(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(1 << 20))
    (folder / "model-00002-of-00002.safetensors").write_bytes(os.urandom(3 << 20))
    biggest = folder / "model-00002-of-00002.safetensors"
    status = main(["calibrate", str(folder), "--format", "json"])
    out, err = capsys.readouterr()
    if not direct_supported(biggest):  # this file system: no O_DIRECT, nothing to measure
        assert status == 1 and "refuses O_DIRECT" in err and str(biggest) in err
        assert not cache.exists()
        return
    assert status == 0, err
    report = json.loads(out)
    assert report["path"] == str(biggest), "the largest file of the folder is read"
    assert report["device"] == biggest.stat().st_dev
    assert report["latency_s"] >= 0 and report["bandwidth_bytes_per_s"] > 0
    stored = json.loads(cache.read_text())[str(biggest.stat().st_dev)]
    assert (stored["latency"], stored["bandwidth"]) == (report["latency_s"],
                                                        report["bandwidth_bytes_per_s"])
    # a new process plans cold reads of files on that device with the measured model
    code = ("import sys; from partc.runtime.read_planner import storage_model; "
            "m = storage_model(int(sys.argv[1])); print(m.latency, m.bandwidth)")
    done = subprocess.run([sys.executable, "-c", code, str(biggest.stat().st_dev)],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    latency, bandwidth = map(float, done.stdout.split())
    assert (latency, bandwidth) == (report["latency_s"], report["bandwidth_bytes_per_s"])
    # and warm column gathers on this machine with the page cache's two models
    warm = report["page_cache"]
    for way in ("rows", "pieces"):
        assert warm[way]["latency_s"] > 0 and warm[way]["bandwidth_bytes_per_s"] > 0
    kept = json.loads(cache.read_text())[read_planner.PAGE_CACHE]
    assert kept["path"] == str(biggest)
    code = ("from partc.runtime.read_planner import warm_models; "
            "print(*(x for m in warm_models() for x in (m.latency, m.bandwidth)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert list(map(float, done.stdout.split())) == [
        warm["rows"]["latency_s"], warm["rows"]["bandwidth_bytes_per_s"],
        warm["pieces"]["latency_s"], warm["pieces"]["bandwidth_bytes_per_s"]]
    assert main(["calibrate", "--show"]) == 0
    shown = capsys.readouterr().out
    assert f"device {biggest.stat().st_dev}:" in shown and str(biggest) in shown
    assert f"page cache: rows whole {warm['rows']['latency_s'] * 1e6:.3f} us" in shown


def test_show_without_a_calibration_prints_the_defaults(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--show", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["devices"] == {} and shown["cache"] == str(cache)
    assert shown["default"] == {"latency_s": read_planner.COLD.latency,
                                "bandwidth_bytes_per_s": read_planner.COLD.bandwidth}
    assert shown["page_cache"] is None
    rows, pieces = read_planner.WARM_ROWS, read_planner.WARM_PIECES
    assert shown["page_cache_default"] == {
        "rows": {"latency_s": rows.latency, "bandwidth_bytes_per_s": rows.bandwidth},
        "pieces": {"latency_s": pieces.latency, "bandwidth_bytes_per_s": pieces.bandwidth}}
    assert read_planner.warm_models() == (rows, pieces)
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "no device calibrated" in out and "page cache: not measured; the defaults" in out
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")  # a damaged cache: shown as empty, never a traceback
    assert main(["calibrate", "--show"]) == 0
    assert "no device calibrated" in capsys.readouterr().out


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p / "missing", "no such file or folder"),
    (lambda p: p, "no *.safetensors file in this folder"),
    (lambda p: hf("llama") / "model.safetensors", "calibration needs a file of at least 1 MiB"),
])
def test_bad_paths_are_refused_in_one_located_line(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object,
        message: str) -> None:
    assert callable(make)
    path = make(tmp_path)
    assert main(["calibrate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and message in err
    assert "Traceback" not in err and not cache.exists()


def test_a_damaged_page_cache_entry_leaves_the_defaults_and_the_devices(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({
        "7": {"latency": 1e-5, "bandwidth": 2e9, "path": "/x"},
        read_planner.PAGE_CACHE: {"rows": {"latency": -1, "bandwidth": 1}, "pieces": {}}}))
    assert read_planner.warm_models() == (read_planner.WARM_ROWS, read_planner.WARM_PIECES)
    assert set(read_planner.cached_models()) == {7}, "the page cache is no device"
    assert main(["calibrate", "--show"]) == 0
    out = capsys.readouterr().out
    assert "device 7:" in out and "page cache: not measured" in out


def test_the_warm_calibration_measures_both_ways_on_any_large_file(
        cache: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(3 << 20))
    rows, pieces = read_planner.calibrate_warm(str(data), repeats=1)
    assert rows.latency > 0 and rows.bandwidth > 0 and pieces.latency > 0
    assert read_planner.warm_models() == (rows, pieces), "this process plans with it at once"
    assert json.loads(cache.read_text())[read_planner.PAGE_CACHE]["path"] == str(data)
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 4096)
    with pytest.raises(ValueError, match="at least 1 MiB"):
        read_planner.calibrate_warm(str(small))
