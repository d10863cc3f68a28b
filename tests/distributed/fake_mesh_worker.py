"""One process standing in for every rank of a T-rank build in turn (torch's in-process `fake`
process group: no collective moves data). For each rank it loads the rank, makes its DTensors on
the package's own device_mesh(), and asks DTensor itself which rows that rank holds
(`compute_local_shape_and_global_offset`). Writing every rank's local tensor at DTensor's offset
must rebuild the checkpoint tensor exactly: what `full_tensor()` gathers, without 8 processes."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from safetensors.numpy import load_file
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from partc.runtime.dtensor import to_dtensors


def main() -> None:
    build, checkpoint, package, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    sys.path.insert(0, build)
    loaders = __import__(package)
    reference = load_file(f"{checkpoint}/model.safetensors")
    rebuilt: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    sharded: dict[str, list[list[int]]] = {}
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        mesh = loaders.device_mesh("cpu")
        state = loaders.load(checkpoint, rank=rank, framework="torch")
        for target, dtensor in to_dtensors(state, mesh).items():
            local = dtensor.to_local().numpy()
            shape, offset = compute_local_shape_and_global_offset(
                dtensor.shape, dtensor.device_mesh, dtensor.placements)
            assert tuple(shape) == local.shape, (target, rank, shape, local.shape)
            where = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            out = rebuilt.setdefault(target, np.zeros(reference[target].shape, np.float32))
            count = counts.setdefault(target, np.zeros(reference[target].shape, np.int64))
            out[where] = local
            count[where] += 1
            if dtensor.placements[0].is_shard():
                sharded.setdefault(target, []).append([int(offset[0]), int(shape[0])])
        dist.destroy_process_group()
    for target, out in rebuilt.items():
        assert np.array_equal(out, reference[target]), target
        assert counts[target].min() >= 1, target
    print(json.dumps({"tensors": sorted(rebuilt), "sharded": sharded}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
