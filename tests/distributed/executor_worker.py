"""Run under torchrun: serve several builds in one launch with the reference torch executor.

argv[1] is a JSON file listing runs ({"name", "build", "package", "checkpoint", "tp", "pp",
"dp"}), every one of this job's world size. For each run every process creates the build's
process groups from partc's BuildTopology, loads only its own rank through the generated
package's `load()`, runs its pipeline stage (TP collectives over its TP group, boundary tensors
sent to and received from its stage peers) and writes what it computed to PARTC_TEST_REPORTS:
`<name>-rank-<g>.json` (loaded tensor names, stage layers, coordinates) and `<name>-rank-<g>.npz`
(logits on output ranks, the tensor sent on at a cut).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from partc.runtime.mesh import BuildTopology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for torch_executor

from support.distributed import joined_process_group  # noqa: E402
from torch_executor import serve  # noqa: E402


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    reports = Path(os.environ["PARTC_TEST_REPORTS"])
    me = dist.get_rank()
    for run in runs:
        topology = BuildTopology(tensor_parallel_size=run["tp"], pipeline_parallel_size=run["pp"],
                                 data_parallel_size=run["dp"])
        groups = topology.process_groups()
        sys.path.insert(0, run["build"])
        package = importlib.import_module(run["package"])
        checkpoint = Path(run["checkpoint"])
        config = json.loads((checkpoint / "config.json").read_text())
        with np.load(checkpoint / "reference.npz") as npz:
            input_ids = torch.from_numpy(npz["input_ids"].astype(np.int64))
        state, result = serve(package, str(checkpoint), topology, groups, config, input_ids)
        coordinates = topology.coordinates(me)
        arrays = {}
        if result.logits is not None:
            arrays["logits"] = result.logits.numpy()
        if result.sent is not None:
            arrays["sent"] = result.sent.to(torch.float32).numpy()
        np.savez(reports / f"{run['name']}-rank-{me}.npz", **arrays)
        (reports / f"{run['name']}-rank-{me}.json").write_text(json.dumps({
            "rank": me, "build_rank": topology.build_rank(me),
            "dp": coordinates.data_parallel_rank, "stage": coordinates.pipeline_stage,
            "tp": coordinates.tensor_parallel_rank, "names": sorted(state.tensors),
            "layers": [result.layers.start, result.layers.stop],
            "received": None if result.received is None else list(result.received.shape)}))
        dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    with joined_process_group():
        main()
