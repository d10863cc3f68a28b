"""The rank layout of a build under a launcher: coordinates, groups, peers, torch process groups.

A build has T·S ranks, global rank `g = p·T + t` (tensor-parallel innermost, DESIGN.md §3). A job
of D data-parallel replicas stacks D copies of that block: `g = d·T·S + p·T + t`. Everything here
is arithmetic over that one formula; `process_groups` and `device_mesh` hand it to
torch.distributed (imported only when called).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from partc.errors import CheckpointError
from partc.runtime.frameworks import import_torch
from partc.runtime.ranks import _integer, launch_position


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoordinates:
    """One process's place in the job."""

    data_parallel_rank: int
    """Which replica of the build (d)."""
    pipeline_stage: int
    """Which pipeline stage (p)."""
    tensor_parallel_rank: int
    """Which rank of the stage's tensor-parallel group (t)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessGroups:
    """The torch process groups this process belongs to, one per parallel dimension."""

    tensor_parallel: Any
    """The ranks of this process's stage and replica."""
    pipeline_parallel: Any
    """The ranks holding this process's tensor-parallel rank on every stage of its replica."""
    data_parallel: Any
    """The ranks holding this process's build rank in every replica."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildTopology:
    """T x S ranks of a build, replicated D times over a job."""

    tensor_parallel_size: int
    """T."""
    pipeline_parallel_size: int
    """S."""
    data_parallel_size: int = 1
    """D: replicas of the build in the job."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{name} must be a positive integer, found {value!r}")

    @property
    def build_world_size(self) -> int:
        """Ranks of one replica (T·S)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Processes in the job (D·T·S)."""
        return self.build_world_size * self.data_parallel_size

    def _check(self, global_rank: int) -> None:
        if isinstance(global_rank, bool) or not isinstance(global_rank, int) or not (
                0 <= global_rank < self.world_size):
            raise CheckpointError(f"rank {global_rank!r} is outside this job's ranks "
                                  f"0..{self.world_size - 1} (D={self.data_parallel_size} x "
                                  f"S={self.pipeline_parallel_size} x "
                                  f"T={self.tensor_parallel_size})")

    def coordinates(self, global_rank: int) -> RankCoordinates:
        """(d, p, t) of a global rank."""
        self._check(global_rank)
        replica, build_rank = divmod(global_rank, self.build_world_size)
        stage, tp = divmod(build_rank, self.tensor_parallel_size)
        return RankCoordinates(data_parallel_rank=replica, pipeline_stage=stage,
                               tensor_parallel_rank=tp)

    def global_rank(self, coordinates: RankCoordinates) -> int:
        """The global rank at (d, p, t)."""
        d, p, t = (coordinates.data_parallel_rank, coordinates.pipeline_stage,
                   coordinates.tensor_parallel_rank)
        if not (0 <= d < self.data_parallel_size and 0 <= p < self.pipeline_parallel_size
                and 0 <= t < self.tensor_parallel_size):
            raise CheckpointError(f"coordinates {coordinates} are outside D="
                                  f"{self.data_parallel_size} x S={self.pipeline_parallel_size} "
                                  f"x T={self.tensor_parallel_size}")
        return d * self.build_world_size + p * self.tensor_parallel_size + t

    def build_rank(self, global_rank: int) -> int:
        """The rank within the build: which generated rank module the process loads."""
        self._check(global_rank)
        return global_rank % self.build_world_size

    def tensor_parallel_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks sharing this rank's stage and replica, in TP order."""
        first = global_rank - self.coordinates(global_rank).tensor_parallel_rank
        return tuple(range(first, first + self.tensor_parallel_size))

    def pipeline_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks of this rank's TP position on every stage, in stage order."""
        c = self.coordinates(global_rank)
        base = c.data_parallel_rank * self.build_world_size + c.tensor_parallel_rank
        return tuple(base + p * self.tensor_parallel_size
                     for p in range(self.pipeline_parallel_size))

    def data_parallel_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks holding this rank's build rank in every replica."""
        build_rank = self.build_rank(global_rank)
        return tuple(d * self.build_world_size + build_rank
                     for d in range(self.data_parallel_size))

    def previous_stage_peer(self, global_rank: int) -> int | None:
        """The rank this one receives the boundary from (None on the first stage)."""
        c = self.coordinates(global_rank)
        return None if c.pipeline_stage == 0 else global_rank - self.tensor_parallel_size

    def next_stage_peer(self, global_rank: int) -> int | None:
        """The rank this one sends the boundary to (None on the last stage)."""
        c = self.coordinates(global_rank)
        last = c.pipeline_stage == self.pipeline_parallel_size - 1
        return None if last else global_rank + self.tensor_parallel_size

    def all_groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Every group of each dimension, in the order every process must create them."""
        ranks = range(self.world_size)
        return {
            "tp": tuple(sorted({self.tensor_parallel_group(r) for r in ranks})),
            "pp": tuple(sorted({self.pipeline_group(r) for r in ranks})),
            "dp": tuple(sorted({self.data_parallel_group(r) for r in ranks})),
        }

    def process_groups(self, global_rank: int | None = None) -> ProcessGroups:
        """Create the torch process groups of every dimension; return this process's.

        Collective: every process of the job calls it, in the same order (torch's
        `new_group` rule). The default process group must already be initialised, with this
        job's world size.
        """
        import_torch("process_groups()")
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CheckpointError("torch.distributed is not initialised; call "
                                  "init_process_group first (torchrun sets its environment)")
        if dist.get_world_size() != self.world_size:
            raise CheckpointError(f"the torch world has {dist.get_world_size()} processes; this "
                                  f"topology needs {self.world_size} (D x S x T)")
        me = dist.get_rank() if global_rank is None else global_rank
        mine: dict[str, Any] = {}
        for dimension, groups in self.all_groups().items():
            for ranks in groups:
                group = dist.new_group(list(ranks))
                if me in ranks:
                    mine[dimension] = group
        return ProcessGroups(tensor_parallel=mine["tp"], pipeline_parallel=mine["pp"],
                             data_parallel=mine["dp"])

    def device_mesh(self, device_type: str = "cpu") -> Any:
        """A torch `DeviceMesh` of shape (D, S, T) with dimensions named `dp`, `pp`, `tp`."""
        import_torch("device_mesh()")
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.data_parallel_size,
                                              self.pipeline_parallel_size,
                                              self.tensor_parallel_size),
                                mesh_dim_names=("dp", "pp", "tp"))


def build_topology(tensor_parallel_size: int, pipeline_parallel_size: int,
                   data_parallel_size: int | None = None) -> BuildTopology:
    """A build's BuildTopology; D defaults to the launcher's (WORLD_SIZE / T·S, else 1)."""
    if data_parallel_size is None:
        build = tensor_parallel_size * pipeline_parallel_size
        data_parallel_size = 1
        if os.environ.get("RANK") is not None:
            data_parallel_size = launch_position(build).data_parallel_size
        elif os.environ.get("WORLD_SIZE") is not None:
            world = _integer("WORLD_SIZE", os.environ["WORLD_SIZE"])
            if world == 0 or world % build:
                raise CheckpointError(
                    f"WORLD_SIZE={world} is not a multiple of this build's {build} ranks (T x "
                    f"S); run {build} x D processes for D data-parallel replicas")
            data_parallel_size = world // build
    return BuildTopology(tensor_parallel_size=tensor_parallel_size,
                         pipeline_parallel_size=pipeline_parallel_size,
                         data_parallel_size=data_parallel_size)


def build_process_groups(tensor_parallel_size: int, pipeline_parallel_size: int,
                         data_parallel_size: int | None = None) -> ProcessGroups:
    """`build_topology(...).process_groups()`: collective, every process of the job calls it."""
    return build_topology(tensor_parallel_size, pipeline_parallel_size,
                          data_parallel_size).process_groups()


def build_device_mesh(tensor_parallel_size: int, pipeline_parallel_size: int,
                      device_type: str | None = None, data_parallel_size: int | None = None
                      ) -> Any:
    """`build_topology(...).device_mesh(device_type)`; the device type defaults to 'cuda' when
    torch sees a GPU, else 'cpu' (as `load`'s device does)."""
    if device_type is None:
        torch = import_torch("device_mesh()")
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return build_topology(tensor_parallel_size, pipeline_parallel_size,
                          data_parallel_size).device_mesh(device_type)
