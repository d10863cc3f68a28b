"""Run under torchrun: create partc's process groups and device mesh through a generated build
package's own helpers (`topology()`, `process_groups()`, `device_mesh()`, `launch_position()`),
and check membership with real collectives (gloo on CPU). Writes one JSON report per process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from partc.runtime.mesh import BuildTopology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.distributed import joined_process_group  # noqa: E402


def _report(line: str) -> None:
    """One JSON report per process, in its own file (stdout lines of processes interleave)."""
    folder = os.environ["PARTC_TEST_REPORTS"]
    with open(os.path.join(folder, f"rank-{os.environ['RANK']}.json"), "w") as handle:
        handle.write(line)


def main() -> None:
    tp, pp, dp = (int(v) for v in sys.argv[1:4])
    build, package = sys.argv[4:6]
    sys.path.insert(0, build)
    loaders = __import__(package)
    me = dist.get_rank()
    topology = loaders.topology()  # D from WORLD_SIZE
    assert topology == BuildTopology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                     data_parallel_size=dp), topology
    position = loaders.launch_position()
    groups = loaders.process_groups()
    seen = {}
    for name, group in (("tp", groups.tensor_parallel), ("pp", groups.pipeline_parallel),
                        ("dp", groups.data_parallel)):
        members = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([me]), group=group)
        seen[name] = [int(m) for m in members]
    mesh = loaders.device_mesh("cpu")
    meshed = {name: sorted(int(r) for r in mesh[name].mesh.flatten().tolist())
              for name in ("dp", "pp", "tp")}
    following = topology.next_stage_peer(me)
    received = None
    if following is not None:
        dist.send(torch.tensor([me * 10]), dst=following)
    previous = topology.previous_stage_peer(me)
    if previous is not None:
        buffer = torch.zeros(1, dtype=torch.int64)
        dist.recv(buffer, src=previous)
        received = int(buffer)
    _report(json.dumps({"rank": me, "local_rank": int(os.environ["LOCAL_RANK"]), "seen": seen,
                      "mesh": meshed, "mesh_names": list(mesh.mesh_dim_names),
                      "received": received,
                      "position": [position.global_rank, position.world_size, position.rank,
                                   position.data_parallel_rank, position.data_parallel_size]}))


if __name__ == "__main__":
    with joined_process_group():
        main()
