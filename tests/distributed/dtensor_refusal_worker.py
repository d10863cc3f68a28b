"""One process in torch's in-process `fake` process group, standing in for global rank RANK of a
WORLD_SIZE-process job (no collective moves data). Runs the uses of `to_dtensors` and
`device_mesh` named by argv, in turn, and prints for each `<case> refused: <message>` or
`<case> accepted`."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from partc.errors import PartcError
from partc.runtime.dtensor import to_dtensors


def attempt(loaders: object, checkpoint: str, case: str) -> None:
    load, mesh = loaders.load, loaders.device_mesh  # type: ignore[attr-defined]
    if case in ("own-rank", "expert-parallel"):  # this process's own rank, the package's mesh
        to_dtensors(load(checkpoint), mesh("cpu"))
    elif case == "dp-dimension":  # a 1-D mesh of T ranks that is not the TP dimension
        to_dtensors(load(checkpoint), mesh("cpu")["dp"])
    elif case == "other-rank":
        to_dtensors(load(checkpoint, rank=0), mesh("cpu"))
    elif case == "other-stage":  # TP rank 0 of stage 1 on a process of stage 0
        to_dtensors(load(checkpoint, rank=2), mesh("cpu"))
    elif case == "swapped-mesh":  # the dimensions named the other way round: (tp, pp)
        from torch.distributed.device_mesh import init_device_mesh

        to_dtensors(load(checkpoint), init_device_mesh("cpu", (2, 2),
                                                        mesh_dim_names=("tp", "pp")))
    elif case == "tensors-dict":
        to_dtensors(dict(load(checkpoint).tensors), mesh("cpu"))
    elif case == "no-mesh":
        to_dtensors(load(checkpoint), None)
    elif case == "read-only":
        to_dtensors(load(checkpoint, zero_copy=True), mesh("cpu"))
    elif case == "wrong-world":  # D=1 asked for in a job with more processes
        mesh("cpu", 1)
    elif case.startswith("device="):
        mesh(case.split("=", 1)[1])
    else:
        raise SystemExit(f"unknown case {case}")


def main() -> None:
    build, checkpoint, package, *cases = sys.argv[1:]
    sys.path.insert(0, build)
    loaders = __import__(package)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    for case in cases:
        try:
            attempt(loaders, checkpoint, case)
        except PartcError as error:
            print(f"{case} refused: {error}".replace("\n", " "))
        else:
            print(f"{case} accepted")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
