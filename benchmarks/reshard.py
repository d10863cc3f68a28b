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

Then the same move in memory (`--in-memory`, default TP=2 -> PP=2): `torchrun` with one CPU
process per rank (gloo), each loading its source rank from the checkpoint with the build's
`load()` and handing it over with `partc.runtime.weight_transfer.reshard_weights`; each reports
the bytes it sent and copied as the function measured them, its destination rank's share (its
plan's local parameter bytes), and its peak resident memory during the call above what it held
before (VmHWM reset through /proc/self/clear_refs, its source tensors already loaded).

    python benchmarks/reshard.py [--dir FOLDER] [--trip 2x2,4x1,1x1] [--in-memory 2x1,1x2]
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


def worker(spec: dict[str, Any]) -> None:
    """One torchrun process of the in-memory move: load, reshard, report as JSON."""
    import importlib

    import torch.distributed as dist

    from partc.runtime.weight_transfer import reshard_weights

    dist.init_process_group("gloo")
    me = dist.get_rank()
    sys.path.insert(0, spec["source"])
    tensors = importlib.import_module(spec["source_package"]).load(spec["checkpoint"],
                                                                   rank=me).tensors
    transfer = json.loads(Path(spec["transfer"]).read_text())
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    before = resident()
    start = time.perf_counter()
    moved = reshard_weights(transfer, tensors)
    seconds = time.perf_counter() - start
    peak = high_water()
    Path(spec["reports"], f"rank-{me}.json").write_text(json.dumps({
        "sent": sum(moved.sent.values()), "copied": moved.copied,
        "received": sum(moved.received.values()),
        "held": sum(t.numel() * t.element_size() for t in moved.tensors.values()),
        "peak_over_start": peak - before, "seconds": seconds}))
    dist.barrier()
    dist.destroy_process_group()


def in_memory(root: Path, checkpoint: Path, built: tuple[Path, str], destination: Path
              ) -> None:
    """Move the ranks of build `built` (folder, package) to `destination`'s in memory under
    torchrun; print the figures."""
    from partc.plan.ir import canonical_json
    from partc.plan.plan_file import read_plan
    from partc.plan.transfer import plan_transfer

    source, package = built
    plans = read_plan(source / "plan.json"), read_plan(destination / "plan.json")
    transfer = plan_transfer(*plans)
    (root / "transfer.json").write_text(canonical_json(transfer.to_json()))
    reports = root / "in-memory"
    reports.mkdir(exist_ok=True)
    spec = {"source": str(source), "source_package": package,
            "checkpoint": str(checkpoint), "transfer": str(root / "transfer.json"),
            "reports": str(reports)}
    world = plans[0].shape.build_world_size
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                    "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", __file__, "--worker",
                    json.dumps(spec)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    found = [json.loads((reports / f"rank-{g}.json").read_text()) for g in range(world)]
    minimum = sum(r.info.local_parameter_bytes for r in plans[1].ranks)
    moved = sum(f["sent"] + f["copied"] for f in found)
    mib = 2 ** 20
    print(f"in memory, {world} processes, {source.name} -> {destination.name}: bytes sent "
          f"{sum(f['sent'] for f in found) / mib:.1f} MiB + copied "
          f"{sum(f['copied'] for f in found) / mib:.1f} MiB vs minimum {minimum / mib:.1f} MiB"
          f" ({moved / minimum:.3f}x; exactly: {moved == minimum})")
    for g, f in enumerate(found):
        share = plans[1].ranks[g].info.local_parameter_bytes
        print(f"  process {g}: sent {f['sent'] / mib:.1f} MiB, copied {f['copied'] / mib:.1f} "
              f"MiB, received {f['received'] / mib:.1f} MiB; peak RSS +"
              f"{f['peak_over_start'] / mib:.1f} MiB, one destination share {share / mib:.1f}"
              f" MiB (+{(f['peak_over_start'] - share) / mib:.1f} MiB); {f['seconds']:.2f} s")


def resident() -> int:
    """This process's resident bytes now (VmRSS)."""
    return _status("VmRSS:")


def high_water() -> int:
    """This process's peak resident bytes (VmHWM: unlike ru_maxrss, not carried over from the
    parent through fork and exec)."""
    return _status("VmHWM:")


def _status(key: str) -> int:
    """One kB line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith(key))
    return int(line.split()[1]) * 1024


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a folder."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main() -> None:
    """Write, compile, shard, then reshard along the trip and print the figures."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, help="work folder (kept; the checkpoint reused)")
    parser.add_argument("--trip", default="2x2,4x1,1x1", help="TxS topologies, in order")
    parser.add_argument("--in-memory", default="2x1,1x2",
                        help="TxS,TxS moved in memory under torchrun ('' for none)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from load import PRESETS, llama_config, write_checkpoint

    from partc.api import CompileOptions, compile_family
    from partc.emit.render import package_name
    from partc.plan.topology import Topology
    from partc.shard import shard_checkpoint

    root = args.dir or Path(tempfile.mkdtemp(prefix="partc-reshard-"))
    checkpoint = root / "checkpoint"
    if not (checkpoint / "model.safetensors").is_file():
        write_checkpoint(checkpoint, llama_config(*PRESETS["reference"]), 1)
    size = (checkpoint / "model.safetensors").stat().st_size
    print(f"checkpoint {checkpoint}: {size / 2**20:.1f} MiB")
    packages: dict[Path, str] = {}

    def build(step: str) -> Path:
        tp, pp = (int(n) for n in step.split("x"))
        out = root / f"build-{tp}x{pp}"
        made = compile_family(None, checkpoint / "config.json",
                              Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                              CompileOptions(out=out, checkpoint=checkpoint, force=True))
        packages[out] = package_name(made.plan)
        return out

    trip = [tuple(int(n) for n in step.split("x")) for step in args.trip.split(",")]
    builds = [build(step) for step in args.trip.split(",")]
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
    if args.in_memory:
        source, destination = (build(step) for step in args.in_memory.split(","))
        in_memory(root, checkpoint, (source, packages[source]), destination)


if __name__ == "__main__":
    main()
