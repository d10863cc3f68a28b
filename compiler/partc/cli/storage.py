"""`partc calibrate`: measure the storage holding a checkpoint for the read planner, or show
the models already measured (`partc.runtime.read_planner`)."""

from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path

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
    if args.format == "json":
        print(json.dumps({"device": device, "path": path, "latency_s": model.latency,
                          "bandwidth_bytes_per_s": model.bandwidth,
                          "cache": read_planner.cache_file()}, indent=1))
        return EXIT_OK
    print(f"storage of {path} (device {device}): {model.latency * 1e6:.1f} us a request "
          f"(4 KiB, 8 in flight), {model.bandwidth / 1e9:.2f} GB/s (1 MiB requests)")
    print(f"cached in {read_planner.cache_file()}: cold loads of files on this device plan "
          f"with it (uncalibrated devices: {_describe(read_planner.COLD)})")
    return EXIT_OK


def _describe(model: object) -> str:
    """A storage model in words."""
    from partc.runtime.read_planner import StorageModel

    assert isinstance(model, StorageModel)
    return f"{model.latency * 1e6:.1f} us a request, {model.bandwidth / 1e9:.2f} GB/s"


def _show(fmt: str) -> int:
    """Print every cached calibration (and the defaults)."""
    from partc.runtime import read_planner

    cached = read_planner.cached_models()
    if fmt == "json":
        print(json.dumps({"cache": read_planner.cache_file(),
                          "default": {"latency_s": read_planner.COLD.latency,
                                      "bandwidth_bytes_per_s": read_planner.COLD.bandwidth},
                          "devices": {str(d): {"path": p, "latency_s": m.latency,
                                               "bandwidth_bytes_per_s": m.bandwidth}
                                      for d, (p, m) in sorted(cached.items())}}, indent=1))
        return EXIT_OK
    print(f"cache: {read_planner.cache_file()}")
    print(f"default (uncalibrated devices): {_describe(read_planner.COLD)}")
    if not cached:
        print("no device calibrated (partc calibrate CHECKPOINT measures the one holding it)")
    for device, (path, model) in sorted(cached.items()):
        print(f"device {device}: {_describe(model)} (measured on {path})")
    return EXIT_OK
