"""One process, torch's in-process `fake` process group: rank 0 of a T=2 build turned into
DTensors by `to_dtensors`, compared tensor by tensor with `DTensor.from_local` itself (the public
constructor): same type, placements, global shape and stride, distribution spec, dtype and
local memory, none needing grad. `fallback` makes DTensor's own constructor refuse first, so
every tensor must come from `from_local`. Prints how many distinct spec objects were used."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from partc.runtime import dtensor as module
from partc.runtime.dtensor import dtensor_specs, to_dtensors


def main() -> None:
    build, checkpoint, package, mode = sys.argv[1:5]
    sys.path.insert(0, build)
    loaders = __import__(package)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = loaders.device_mesh("cpu")
    state = loaders.load(checkpoint, rank=0, framework="torch")
    if mode == "fallback":
        def refuse(*args: object, **kwargs: object) -> None:
            raise TypeError("this torch's DTensor takes other arguments")
        real = module._like
        module._like = lambda dtensor_type, first, local: real(refuse, first, local)
    made = to_dtensors(state, mesh)
    specs = dtensor_specs(state.layout, 2, 0)
    tp = mesh["tp"]
    kinds = set()
    for target, got in made.items():
        spec = specs[target]
        placement = Replicate() if spec.shard_axis is None else Shard(spec.shard_axis)
        strides = torch.empty(spec.global_shape).stride()
        want = DTensor.from_local(state.tensors[target], tp, [placement], run_check=False,
                                  shape=torch.Size(spec.global_shape), stride=strides)
        assert type(got) is type(want) is DTensor, target
        assert got.placements == want.placements, (target, got.placements, want.placements)
        assert got.shape == want.shape and got.stride() == want.stride(), target
        assert got._spec == want._spec and got.dtype == want.dtype, target
        assert got.device_mesh == want.device_mesh, target
        assert not got.requires_grad, target
        assert got.to_local().data_ptr() == state.tensors[target].data_ptr(), target
        assert torch.equal(got.to_local(), want.to_local()), target
        kinds.add((want.placements, tuple(want.shape), want.dtype))
    print(json.dumps({"tensors": len(made), "kinds": len(kinds),
                      "specs": len({id(d._spec) for d in made.values()})}))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
