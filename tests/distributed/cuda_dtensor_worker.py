"""Run under torchrun with CUDA: every rank on cuda:0 (argv: build, checkpoint, package, the
process group backend: NCCL for one rank, gloo carrying CUDA tensors through the host for
several, since NCCL needs one GPU per rank). Loads this process's rank of a build onto the
GPU, turns its tensors into DTensors on the package's own CUDA DeviceMesh and checks that
full_tensor() of each equals the checkpoint tensor."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from safetensors.numpy import load_file

from partc.runtime.dtensor import to_dtensors


def main() -> None:
    build, checkpoint, package, backend = sys.argv[1:5]
    torch.cuda.set_device(0)  # before the mesh: DeviceMesh would pick cuda:LOCAL_RANK
    dist.init_process_group(backend)
    try:
        sys.path.insert(0, build)
        loaders = __import__(package)
        state = loaders.load(checkpoint, device="cuda:0")  # the rank from torchrun's RANK
        mesh = loaders.device_mesh("cuda")
        dtensors = to_dtensors(state, mesh)
        reference = load_file(f"{checkpoint}/model.safetensors")
        checked, sharded, devices = 0, 0, set()
        for target, dtensor in dtensors.items():
            devices.add(str(dtensor.to_local().device))
            full = dtensor.full_tensor()
            assert full.device.type == "cuda", target
            assert np.array_equal(full.cpu().numpy(), reference[target]), target
            checked += 1
            sharded += int(any(p.is_shard() for p in dtensor.placements))
        report = {"rank": dist.get_rank(), "checked": checked, "sharded": sharded,
                  "names": sorted(dtensors), "device": ",".join(sorted(devices)),
                  "mesh_device": mesh.device_type}
        folder = os.environ["PARTC_TEST_REPORTS"]
        with open(os.path.join(folder, f"rank-{os.environ['RANK']}.json"), "w") as handle:
            handle.write(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
