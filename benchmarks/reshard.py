"""Measure `partc reshard` on the synthetic bf16 Llama of ../shared/BENCHMARKS.md (777.6 MiB):
bytes read against the minimum (each destination byte read once) and peak memory against one
destination rank's share.

Writes the `reference` preset of benchmarks/load.py (hidden 1024, 29 layers) and its config,
compiles the built-in `llama` family for each topology of the trip (default tp2xpp2 -> tp4 ->
tp1), shards the first from the checkpoint with `partc shard`, then reshards along the trip,
each step in a fresh process that reports: the bytes its reads asked of the source rank files
(the loader's `ReadRecorder`), the transfer plan's minimum, the destination's largest rank
share, and the peak resident memory above what the process held before the call (VmHWM, the
pages of the files it maps included); and whether the set equals `partc shard`'s.

    python benchmarks/reshard.py [--dir FOLDER] [--trip 2x2,4x1,1x1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One reshard step, measured in this (fresh) process."""
    from partc.plan.plan_file import read_plan
    from partc.plan.transfer import plan_transfer
    from partc.reshard import reshard_shards

    source, destination = Path(spec["source"]), Path(spec["destination"])
    plan = plan_transfer(read_plan(source / "plan.json"), read_plan(destination / "plan.json"))
    share = max(sum(t.nbytes for t in r.tensors) for r in plan.ranks)
    runs: list[int] = []

    class Recorder:
        def record(self, path: str, offset: int, length: int) -> None:
            runs.append(length)

    before = high_water()
    start = time.perf_counter()
    reshard_shards(source, spec["shards"], destination, spec["out"], recorder=Recorder())
    seconds = time.perf_counter() - start
    peak = high_water()
    return {"read": sum(runs), "minimum": plan.total_bytes, "naive": plan.naive_bytes,
            "share": share, "peak_over_start": peak - before, "seconds": seconds}


def high_water() -> int:
    """This process's peak resident bytes (VmHWM: unlike ru_maxrss, not carried over from the
    parent through fork and exec)."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a folder."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main() -> None:
    """Write, compile, shard, then reshard along the trip and print the figures."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, help="work folder (kept; the checkpoint reused)")
    parser.add_argument("--trip", default="2x2,4x1,1x1", help="TxS topologies, in order")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from load import PRESETS, llama_config, write_checkpoint

    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology
    from partc.shard import shard_checkpoint

    root = args.dir or Path(tempfile.mkdtemp(prefix="partc-reshard-"))
    checkpoint = root / "checkpoint"
    if not (checkpoint / "model.safetensors").is_file():
        write_checkpoint(checkpoint, llama_config(*PRESETS["reference"]), 1)
    size = (checkpoint / "model.safetensors").stat().st_size
    print(f"checkpoint {checkpoint}: {size / 2**20:.1f} MiB")
    trip = [tuple(int(n) for n in step.split("x")) for step in args.trip.split(",")]
    builds = []
    for tp, pp in trip:
        out = root / f"build-{tp}x{pp}"
        compile_family(None, checkpoint / "config.json",
                       Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                       CompileOptions(out=out, checkpoint=checkpoint, force=True))
        builds.append(out)
    shards = root / f"shards-{trip[0][0]}x{trip[0][1]}"
    shard_checkpoint(builds[0], checkpoint, shards, force=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for step in range(1, len(trip)):
        out = root / f"resharded-{trip[step][0]}x{trip[step][1]}"
        spec = {"source": str(builds[step - 1]), "shards": str(shards),
                "destination": str(builds[step]), "out": str(out)}
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                              capture_output=True, text=True, env=env, check=True)
        found = json.loads(done.stdout.strip().splitlines()[-1])
        direct = root / f"direct-{trip[step][0]}x{trip[step][1]}"
        shard_checkpoint(builds[step], checkpoint, direct, force=True)
        same = digests(out) == digests(direct)
        mib = 2 ** 20
        print(f"{trip[step - 1][0]}x{trip[step - 1][1]} -> {trip[step][0]}x{trip[step][1]}: "
              f"read {found['read'] / mib:.1f} MiB, minimum {found['minimum'] / mib:.1f} MiB "
              f"({found['read'] / found['minimum']:.3f}x; gather-then-slice "
              f"{found['naive'] / mib:.1f} MiB); peak RSS +{found['peak_over_start'] / mib:.1f}"
              f" MiB, one destination share {found['share'] / mib:.1f} MiB (+"
              f"{(found['peak_over_start'] - found['share']) / mib:.1f} MiB); "
              f"{found['seconds']:.2f} s; equal to partc shard: {same}")
        shards = out


if __name__ == "__main__":
    main()
