"""`partc calibrate`: measure the storage holding a checkpoint for the read planner, or show
the models already measured (`partc.runtime.read_planner`)."""

from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path
from typing import Any

from partc.cli.parser import EXIT_OK
from partc.errors import CheckpointError, MachineError, SourceLocation


def calibrated_file(path: str) -> str:
    """The file a calibration reads: `path` itself, or the largest `*.safetensors` file in the
    folder `path` (the most bytes to measure bandwidth over); a CheckpointError naming `path`
    when there is none."""
    target = Path(path)
    if target.is_dir():
        files = sorted(target.glob("*.safetensors"), key=lambda p: (-p.stat().st_size, p.name))
        if not files:
            raise CheckpointError("no *.safetensors file in this folder to calibrate with; "
                                  "expected a checkpoint folder or one of its files",
                                  location=SourceLocation(path))
        return str(files[0])
    if not target.is_file():
        raise CheckpointError("no such file or folder; expected a checkpoint folder or one of "
                              "its .safetensors files", location=SourceLocation(path))
    return str(target)


def run_calibrate(args: argparse.Namespace) -> int:
    """`partc calibrate`: measure (or `--show`) and report the storage models."""
    from partc.runtime import read_planner

    if args.show or args.path is None:
        return _show(args.format)
    path = calibrated_file(args.path)
    try:
        model = read_planner.calibrate(path)
    except ValueError as exc:  # smaller than the calibration needs
        raise CheckpointError(str(exc).removeprefix(f"{path}: "),
                              location=SourceLocation(path)) from None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # O_DIRECT refused: nothing this file system can measure
            raise CheckpointError(
                "this file system refuses O_DIRECT reads, which calibration and cold loads "
                "alone use; loads from it read through the page cache and need no "
                "calibration", location=SourceLocation(path)) from None
        raise MachineError(f"cannot read the file to calibrate with: {exc.strerror or exc}",
                           location=SourceLocation(path)) from None
    device = os.stat(path).st_dev
    try:
        warm: tuple[Any, Any] | None = read_planner.calibrate_warm(path)
        refused = ""
    except ValueError as exc:  # process_vm_writev refused: warm rows are always read whole
        warm, refused = None, str(exc).removeprefix(f"{path}: ")
    if args.format == "json":
        print(json.dumps({"device": device, "path": path, "latency_s": model.latency,
                          "bandwidth_bytes_per_s": model.bandwidth,
                          "page_cache": None if warm is None else _warm_json(*warm),
                          "cache": read_planner.cache_file()}, indent=1))
        return EXIT_OK
    print(f"storage of {path} (device {device}): {model.latency * 1e6:.1f} us a request "
          f"(4 KiB, 8 in flight), {model.bandwidth / 1e9:.2f} GB/s (1 MiB requests)")
    if warm is None:
        print(f"page cache: not measured ({refused})")
    else:
        print(f"page cache (this machine): {_describe_warm(*warm)}")
    print(f"cached in {read_planner.cache_file()}: cold loads of files on this device plan "
          f"with it (uncalibrated devices: {_describe(read_planner.COLD)}), warm column "
          f"gathers on this machine with the page cache's")
    return EXIT_OK


def _describe_warm(rows: object, pieces: object) -> str:
    """The two warm gather models in words."""
    from partc.runtime.read_planner import StorageModel

    assert isinstance(rows, StorageModel) and isinstance(pieces, StorageModel)
    return (f"rows whole {rows.latency * 1e6:.3f} us a buffer, {rows.bandwidth / 1e9:.2f} GB/s; "
            f"pieces by themselves {pieces.latency * 1e6:.3f} us a piece, "
            f"{pieces.bandwidth / 1e9:.2f} GB/s")


def _warm_json(rows: Any, pieces: Any) -> dict[str, Any]:
    """The two warm gather models as JSON."""
    return {"rows": {"latency_s": rows.latency, "bandwidth_bytes_per_s": rows.bandwidth},
            "pieces": {"latency_s": pieces.latency, "bandwidth_bytes_per_s": pieces.bandwidth}}


def _describe(model: object) -> str:
    """A storage model in words."""
    from partc.runtime.read_planner import StorageModel

    assert isinstance(model, StorageModel)
    return f"{model.latency * 1e6:.1f} us a request, {model.bandwidth / 1e9:.2f} GB/s"


def _show(fmt: str) -> int:
    """Print every cached calibration (and the defaults)."""
    from partc.runtime import read_planner

    cached = read_planner.cached_models()
    warm = read_planner.cached_warm()
    default_warm = (read_planner.WARM_ROWS, read_planner.WARM_PIECES)
    if fmt == "json":
        print(json.dumps({"cache": read_planner.cache_file(),
                          "default": {"latency_s": read_planner.COLD.latency,
                                      "bandwidth_bytes_per_s": read_planner.COLD.bandwidth},
                          "devices": {str(d): {"path": p, "latency_s": m.latency,
                                               "bandwidth_bytes_per_s": m.bandwidth}
                                      for d, (p, m) in sorted(cached.items())},
                          "page_cache_default": _warm_json(*default_warm),
                          "page_cache": None if warm is None else {
                              "path": warm[0], **_warm_json(*warm[1:])}}, indent=1))
        return EXIT_OK
    print(f"cache: {read_planner.cache_file()}")
    print(f"default (uncalibrated devices): {_describe(read_planner.COLD)}")
    if warm is None:
        print(f"page cache: not measured; the defaults: {_describe_warm(*default_warm)}")
    else:
        print(f"page cache: {_describe_warm(*warm[1:])} (measured on {warm[0]})")
    if not cached:
        print("no device calibrated (partc calibrate CHECKPOINT measures the one holding it)")
    for device, (path, model) in sorted(cached.items()):
        print(f"device {device}: {_describe(model)} (measured on {path})")
    return EXIT_OK
