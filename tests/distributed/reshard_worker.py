"""Run under torchrun: weights moved in memory from one build's ranks to another's, then served.

argv[1] is a JSON file listing runs ({"name", "source", "destination" (build folders),
"source_package", "destination_package", "transfer" (a TransferPlan's JSON file),
"checkpoint", "tp", "pp" (the destination's sizes), "serve" (false: an expert-parallel
destination the executor does not run, its tensors checked only)}). For each run every process
loads its rank of the source build from the checkpoint, hands the weights over with
`partc.runtime.weight_transfer.reshard_weights` (process r plays source rank r and destination
rank r, or the destination rank whose process "destination_processes" names it, if given;
messages of "chunk_bytes" if given),
checks them against the destination build's own `load()` of its rank, and runs its destination
stage with the reference torch executor; it writes `<name>-rank-<g>.json` (the names
received, whether every tensor is bit-identical to the destination's load, the bytes
`reshard_weights` says it sent to, received from each process and copied locally) and
`<name>-rank-<g>.npz` (logits on output ranks) to PARTC_TEST_REPORTS.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from partc.runtime import weight_transfer
from partc.runtime.mesh import BuildTopology
from partc.runtime.weight_transfer import reshard_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for torch_executor

from support.distributed import joined_process_group  # noqa: E402
from torch_executor import TensorParallel, run_stage  # noqa: E402


def package(build: str, name: str) -> object:
    """The generated package of a build folder."""
    sys.path.insert(0, build)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(build)


def serve(destination: Any, me: int, moved: dict[str, torch.Tensor], run: dict[str, Any]
          ) -> np.ndarray | None:
    """Run this process's destination stage on the moved tensors; its logits (None: not an
    output rank)."""
    topology = BuildTopology(tensor_parallel_size=run["tp"], pipeline_parallel_size=run["pp"])
    groups = topology.process_groups()
    module = destination.rank_module(me)
    state = SimpleNamespace(tensors={n: t.numpy() for n, t in moved.items()},
                            layout=module.layout())
    checkpoint = Path(run["checkpoint"])
    config = json.loads((checkpoint / "config.json").read_text())
    with np.load(checkpoint / "reference.npz") as npz:
        input_ids = torch.from_numpy(npz["input_ids"].astype(np.int64))
    result = run_stage(config, module, state, TensorParallel(groups.tensor_parallel, run["tp"]),
                       topology.previous_stage_peer(me), topology.next_stage_peer(me), input_ids)
    return None if result.logits is None else result.logits.numpy()


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    reports = Path(os.environ["PARTC_TEST_REPORTS"])
    me = dist.get_rank()
    for run in runs:
        source = package(run["source"], run["source_package"])
        destination = package(run["destination"], run["destination_package"])
        checkpoint = run["checkpoint"]
        transfer = json.loads(Path(run["transfer"]).read_text())
        mine = source.load(checkpoint, rank=me).tensors  # type: ignore[attr-defined]
        weight_transfer.CHUNK_BYTES = run.get("chunk_bytes", 16 * 2 ** 20)
        placed = run.get("destination_processes")  # default: destination rank r on process r
        result = reshard_weights(transfer, mine, destination_processes=placed)
        moved = result.tensors
        rank = me if placed is None else placed.index(me) if me in placed else None
        own = {} if rank is None else destination.load(  # type: ignore[attr-defined]
            checkpoint, rank=rank).tensors
        same = sorted(moved) == sorted(own) and all(
            np.array_equal(moved[n].numpy().view(np.uint8),
                           np.ascontiguousarray(own[n]).view(np.uint8)) for n in own)
        arrays = {}
        if run["serve"]:  # not an expert-parallel destination: its tensors are checked only
            logits = serve(destination, me, moved, run)
            if logits is not None:
                arrays["logits"] = logits
        np.savez(reports / f"{run['name']}-rank-{me}.npz", **arrays)
        (reports / f"{run['name']}-rank-{me}.json").write_text(json.dumps({
            "rank": me, "destination_rank": rank, "names": sorted(moved), "identical": same,
            "sent": [[a, b, n] for (a, b), n in sorted(result.sent.items())],
            "received": [[a, b, n] for (a, b), n in sorted(result.received.items())],
            "copied": result.copied}))
        dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    with joined_process_group():
        main()
