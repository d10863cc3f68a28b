"""Run under torchrun: load this process's rank of a build, turn its tensors into DTensors on a
(pp, tp) DeviceMesh and check that full_tensor() of each equals the checkpoint tensor."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.numpy import load_file

from partc.runtime.dtensor import to_dtensors
from partc.runtime.mesh import BuildTopology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.distributed import joined_process_group  # noqa: E402


def _report(line: str) -> None:
    """One JSON report per process, in its own file (stdout lines of processes interleave)."""
    folder = os.environ["PARTC_TEST_REPORTS"]
    with open(os.path.join(folder, f"rank-{os.environ['RANK']}.json"), "w") as handle:
        handle.write(line)


def main() -> None:
    build, checkpoint, package, tp, pp = sys.argv[1:6]
    sys.path.insert(0, build)
    loaders = __import__(package)
    state = loaders.load(checkpoint)  # the rank from torchrun's RANK
    assert loaders.topology() == BuildTopology(tensor_parallel_size=int(tp),
                                               pipeline_parallel_size=int(pp))
    mesh = loaders.device_mesh("cpu")  # the package's own (dp, pp, tp) mesh
    dtensors = to_dtensors(state, mesh)
    reference = load_file(f"{checkpoint}/model.safetensors")
    checked, sharded = 0, 0
    for target, dtensor in dtensors.items():
        full = dtensor.full_tensor()
        assert np.array_equal(full.numpy(), reference[target]), target
        assert tuple(dtensor.to_local().shape) == tuple(state.tensors[target].shape), target
        checked += 1
        sharded += int(dtensor.placements[0].is_shard())
    _report(json.dumps({"rank": dist.get_rank(), "checked": checked, "sharded": sharded,
                      "names": sorted(dtensors)}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    with joined_process_group():
        main()
