"""Run under torchrun with CUDA (argv: build, checkpoint, package, the process group backend,
`gather` or `local`): with NCCL each rank on its own GPU (cuda:LOCAL_RANK), with gloo every rank
on cuda:0 (NCCL needs one GPU per rank). Loads this process's rank of a build onto the GPU,
turns its tensors into DTensors on the package's own CUDA DeviceMesh and checks that
full_tensor() of each equals the checkpoint tensor (`gather`), or that each rank's local
shard is its slice of it and the DTensor's placement says so (`local`: gloo's CUDA all_gather
crashed with SIGSEGV under torch 2.11, see docs/performance.md)."""

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.distributed import joined_process_group  # noqa: E402


def main(build: str, checkpoint: str, package: str, gather: str, index: int) -> None:
    sys.path.insert(0, build)
    loaders = __import__(package)
    state = loaders.load(checkpoint, device=f"cuda:{index}")  # rank from torchrun's RANK
    mesh = loaders.device_mesh("cuda")
    dtensors = to_dtensors(state, mesh)
    reference = load_file(f"{checkpoint}/model.safetensors")
    selections = {t.target: t.selection for t in state.layout.tensors}
    checked, sharded, devices = 0, 0, set()
    for target, dtensor in dtensors.items():
        local = dtensor.to_local()
        devices.add(str(local.device))
        if gather == "gather":  # the collective: every rank's shard back in one tensor
            full = dtensor.full_tensor()
            assert full.device.type == "cuda", target
            assert np.array_equal(full.cpu().numpy(), reference[target]), target
        else:  # this rank's shard, and where the DTensor says it lies
            axis, ranges = selections[target]
            want = reference[target] if axis is None else np.concatenate(
                [np.take(reference[target], np.arange(a, b), axis=axis)
                 for a, b in ranges], axis=axis)
            assert np.array_equal(local.cpu().numpy(), want), target
            shards = [p.dim for p in dtensor.placements if p.is_shard()]
            assert shards == ([] if axis is None else [axis]), (target, shards, axis)
            assert tuple(dtensor.shape) == reference[target].shape, target
        checked += 1
        sharded += int(any(p.is_shard() for p in dtensor.placements))
    report = {"rank": dist.get_rank(), "checked": checked, "sharded": sharded,
              "names": sorted(dtensors), "device": ",".join(sorted(devices)),
              "mesh_device": mesh.device_type}
    folder = os.environ["PARTC_TEST_REPORTS"]
    with open(os.path.join(folder, f"rank-{os.environ['RANK']}.json"), "w") as handle:
        handle.write(json.dumps(report))


if __name__ == "__main__":
    torch.set_num_threads(1)
    build, checkpoint, package, backend, gather = sys.argv[1:6]
    # one GPU per rank with NCCL; every rank on cuda:0 with gloo (set before the mesh:
    # DeviceMesh would pick cuda:LOCAL_RANK)
    index = int(os.environ["LOCAL_RANK"]) if backend == "nccl" else 0
    torch.cuda.set_device(index)
    with joined_process_group(backend):
        main(build, checkpoint, package, gather, index)
