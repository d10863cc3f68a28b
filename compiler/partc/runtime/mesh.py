"""The rank layout of a build under a launcher: coordinates, groups, peers, torch process groups.

A build has T·S ranks, global rank `g = p·T + t` (tensor-parallel innermost, DESIGN.md §3). A job
of D data-parallel replicas stacks D copies of that block: `g = d·T·S + p·T + t`. Everything here
is arithmetic over that one formula; `process_groups` and `device_mesh` hand it to
torch.distributed (imported only when called).

An expert-parallel build (docs/expert_parallel.md) has N = E·X ranks per stage instead of T:
`g = d·N·S + p·N + r`, with stage-local rank r = (dense replica)·T + t, EP rank r div X and ETP
rank r mod X. As in Megatron, its EP group is the E ranks of the stage holding *different*
experts at the same ETP rank (stride X), its ETP group the X consecutive ranks splitting the
*same* experts, its TP group T consecutive ranks (one copy of the dense parts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from partc.errors import LaunchError
from partc.parallel.shape import ParallelShape, RankCoordinates, shape_problem
from partc.runtime.frameworks import import_torch
from partc.runtime.rank_env import (
    environment_integer,
    launch_position,
    not_a_multiple,
    world_factors,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessGroups:
    """The torch process groups this process belongs to, one per parallel dimension."""

    tensor_parallel: Any
    """The ranks of this process's stage and replica."""
    pipeline_parallel: Any
    """The ranks holding this process's tensor-parallel rank on every stage of its replica."""
    data_parallel: Any
    """The ranks holding this process's build rank in every replica."""
    expert_parallel: Any = None
    """The E ranks holding different experts at this process's ETP rank (expert-parallel
    builds only; the `ep` dimension of `device_mesh()`)."""
    expert_tensor_parallel: Any = None
    """The X ranks splitting this process's experts (expert-parallel builds only; the `etp`
    dimension of `device_mesh()`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildTopology:
    """The N x S ranks of a build (N = T, or E x X under expert parallelism), replicated D
    times over a job."""

    tensor_parallel_size: int
    """T."""
    pipeline_parallel_size: int
    """S."""
    data_parallel_size: int = 1
    """D: replicas of the build in the job."""
    expert_parallel_size: int | None = None
    """E: expert-parallel ranks per stage (None: not an expert-parallel build)."""
    expert_tensor_parallel_size: int = 1
    """X: ranks splitting each expert; a stage has N = E·X ranks."""

    def __post_init__(self) -> None:
        problem = shape_problem(tensor_parallel_size=self.tensor_parallel_size,
                                pipeline_parallel_size=self.pipeline_parallel_size,
                                expert_parallel_size=self.expert_parallel_size,
                                expert_tensor_parallel_size=self.expert_tensor_parallel_size,
                                data_parallel_size=self.data_parallel_size)
        if problem is not None:  # ParallelShape's rule, reported by a launch
            raise LaunchError(problem.message)

    @property
    def shape(self) -> ParallelShape:
        """The sizes D, S, T, E, X and their rank arithmetic."""
        return ParallelShape(tensor_parallel_size=self.tensor_parallel_size,
                             pipeline_parallel_size=self.pipeline_parallel_size,
                             expert_parallel_size=self.expert_parallel_size,
                             expert_tensor_parallel_size=self.expert_tensor_parallel_size,
                             data_parallel_size=self.data_parallel_size)

    @property
    def ranks_per_stage(self) -> int:
        """N: E·X for an expert-parallel build, else T."""
        return self.shape.ranks_per_stage

    @property
    def factors(self) -> str:
        """The factors of a replica's ranks, as messages name them (`tp 2 x pp 2`, or
        `pp 2 x ep 2 x etp 2`)."""
        return world_factors(self.tensor_parallel_size, self.pipeline_parallel_size,
                             self.expert_parallel_size, self.expert_tensor_parallel_size)

    @property
    def build_world_size(self) -> int:
        """Ranks of one replica (N·S; T·S without expert parallelism)."""
        return self.shape.build_world_size

    @property
    def world_size(self) -> int:
        """Processes in the job (D·T·S)."""
        return self.shape.world_size

    def _check(self, global_rank: int) -> None:
        problem = self.shape.rank_problem(global_rank)
        if problem is not None:
            raise LaunchError(problem)

    def coordinates(self, global_rank: int) -> RankCoordinates:
        """(d, p, t) of a global rank."""
        self._check(global_rank)
        return self.shape.coordinates(global_rank)

    def global_rank(self, coordinates: RankCoordinates) -> int:
        """The global rank at (d, p, t) (and the dense replica of an expert-parallel build,
        whose EP and ETP ranks must agree with it)."""
        problem = self.shape.coordinates_problem(coordinates)
        if problem is not None:
            raise LaunchError(problem)
        return self.shape.rank(coordinates)

    def build_rank(self, global_rank: int) -> int:
        """The rank within the build: which generated rank module the process loads."""
        self._check(global_rank)
        return global_rank % self.build_world_size

    def tensor_parallel_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks sharing this rank's stage and replica, in TP order."""
        first = global_rank - self.coordinates(global_rank).tensor_parallel_rank
        return tuple(range(first, first + self.tensor_parallel_size))

    def pipeline_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks of this rank's stage-local position on every stage, in order."""
        c = self.coordinates(global_rank)
        n = self.ranks_per_stage
        base = c.data_parallel_rank * self.build_world_size + c.stage_rank
        return tuple(base + p * n for p in range(self.pipeline_parallel_size))

    def expert_parallel_group(self, global_rank: int) -> tuple[int, ...]:
        """The E ranks of this rank's stage and replica that hold *different* experts at its
        ETP rank (its EP group, Megatron's expert-model-parallel group: stride X)."""
        self._expert_build()
        x = self.expert_tensor_parallel_size
        first = (global_rank - global_rank % self.ranks_per_stage
                 + self.coordinates(global_rank).expert_tensor_parallel_rank)
        return tuple(range(first, first + self.ranks_per_stage, x))

    def expert_tensor_parallel_group(self, global_rank: int) -> tuple[int, ...]:
        """The X consecutive ranks that split this rank's (same) experts (its ETP group)."""
        self._expert_build()
        x = self.expert_tensor_parallel_size
        first = global_rank - self.coordinates(global_rank).expert_tensor_parallel_rank
        return tuple(range(first, first + x))

    def _expert_build(self) -> None:
        if self.expert_parallel_size is None:
            raise LaunchError("this build has no expert parallelism (compiled without --ep), "
                              "so it has no EP or ETP groups")

    def data_parallel_group(self, global_rank: int) -> tuple[int, ...]:
        """The global ranks holding this rank's build rank in every replica."""
        build_rank = self.build_rank(global_rank)
        return tuple(d * self.build_world_size + build_rank
                     for d in range(self.data_parallel_size))

    def previous_stage_peer(self, global_rank: int) -> int | None:
        """The rank this one receives the boundary from (None on the first stage)."""
        c = self.coordinates(global_rank)
        return None if c.pipeline_stage == 0 else global_rank - self.ranks_per_stage

    def next_stage_peer(self, global_rank: int) -> int | None:
        """The rank this one sends the boundary to (None on the last stage)."""
        c = self.coordinates(global_rank)
        last = c.pipeline_stage == self.pipeline_parallel_size - 1
        return None if last else global_rank + self.ranks_per_stage

    def all_groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Every group of each dimension, in the order every process must create them."""
        ranks = range(self.world_size)
        groups = {
            "tp": tuple(sorted({self.tensor_parallel_group(r) for r in ranks})),
            "pp": tuple(sorted({self.pipeline_group(r) for r in ranks})),
            "dp": tuple(sorted({self.data_parallel_group(r) for r in ranks})),
        }
        if self.expert_parallel_size is not None:
            groups["ep"] = tuple(sorted({self.expert_parallel_group(r) for r in ranks}))
            groups["etp"] = tuple(sorted({self.expert_tensor_parallel_group(r) for r in ranks}))
        return groups

    def _check_world(self, world: int) -> None:
        """Refuse a job whose process count is not this topology's world size."""
        problem = self.shape.world_problem(world)
        if problem is not None:
            raise LaunchError(problem)

    def process_groups(self, global_rank: int | None = None) -> ProcessGroups:
        """Create the torch process groups of every dimension; return this process's.

        Collective: every process of the job calls it, in the same order (torch's
        `new_group` rule). The default process group must already be initialised, with this
        job's world size.
        """
        import_torch("process_groups()")
        import torch.distributed as dist

        if not dist.is_initialized():
            raise LaunchError("torch.distributed is not initialised; call "
                              "init_process_group first (torchrun sets its environment)")
        self._check_world(dist.get_world_size())
        me = dist.get_rank() if global_rank is None else global_rank
        mine: dict[str, Any] = {}
        for dimension, groups in self.all_groups().items():
            for ranks in groups:
                group = dist.new_group(list(ranks))
                if me in ranks:
                    mine[dimension] = group
        return ProcessGroups(tensor_parallel=mine["tp"], pipeline_parallel=mine["pp"],
                             data_parallel=mine["dp"], expert_parallel=mine.get("ep"),
                             expert_tensor_parallel=mine.get("etp"))

    def device_mesh(self, device_type: str = "cpu") -> Any:
        """A torch `DeviceMesh` of shape (D, S, T) with dimensions named `dp`, `pp`, `tp`; for
        an expert-parallel build (D, S, E, X) named `dp`, `pp`, `ep`, `etp` (the dense TP group
        is `tensor_parallel_group`)."""
        torch = import_torch("device_mesh()")
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        _check_device_type(torch, device_type)
        if dist.is_initialized():
            self._check_world(dist.get_world_size())
        elif os.environ.get("WORLD_SIZE") is not None:  # init_device_mesh initialises from it
            self._check_world(environment_integer("WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if self.expert_parallel_size is not None:
            return init_device_mesh(device_type, (self.data_parallel_size,
                                                  self.pipeline_parallel_size,
                                                  self.expert_parallel_size,
                                                  self.expert_tensor_parallel_size),
                                    mesh_dim_names=("dp", "pp", "ep", "etp"))
        return init_device_mesh(device_type, (self.data_parallel_size,
                                              self.pipeline_parallel_size,
                                              self.tensor_parallel_size),
                                mesh_dim_names=("dp", "pp", "tp"))


def _check_device_type(torch: Any, device_type: Any) -> None:
    """Refuse a device type torch does not know, a device (an index), or one it has none of."""
    try:
        device = torch.device(device_type) if isinstance(device_type, str) else None
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None:
        raise LaunchError(f"device_mesh(): {device_type!r} is not a torch device type; "
                          "expected 'cpu' or 'cuda'")
    if device.index is not None:
        raise LaunchError(f"device_mesh(): {device_type!r} names one device; a mesh takes a "
                          f"device type, {device.type!r} (each rank uses its own device)")
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise LaunchError(f"device_mesh({device_type!r}): torch sees no {device.type} "
                              "device here; use 'cpu'")


def build_topology(tensor_parallel_size: int, pipeline_parallel_size: int,
                   data_parallel_size: int | None = None, *,
                   expert_parallel_size: int | None = None,
                   expert_tensor_parallel_size: int = 1) -> BuildTopology:
    """A build's BuildTopology; D defaults to the launcher's (WORLD_SIZE / the build's ranks,
    else 1). The build has N x S ranks: N = T, or E x X under expert parallelism."""
    if data_parallel_size is None:
        build = BuildTopology(tensor_parallel_size=tensor_parallel_size,
                              pipeline_parallel_size=pipeline_parallel_size,
                              expert_parallel_size=expert_parallel_size,
                              expert_tensor_parallel_size=expert_tensor_parallel_size
                              ).build_world_size
        data_parallel_size = 1
        factors = world_factors(tensor_parallel_size, pipeline_parallel_size,
                                expert_parallel_size, expert_tensor_parallel_size)
        if os.environ.get("RANK") is not None:
            data_parallel_size = launch_position(build, factors).data_parallel_size
        elif os.environ.get("WORLD_SIZE") is not None:
            world = environment_integer("WORLD_SIZE", os.environ["WORLD_SIZE"])
            if world == 0 or world % build:
                raise not_a_multiple(world, build, factors)
            data_parallel_size = world // build
    return BuildTopology(tensor_parallel_size=tensor_parallel_size,
                         pipeline_parallel_size=pipeline_parallel_size,
                         data_parallel_size=data_parallel_size,
                         expert_parallel_size=expert_parallel_size,
                         expert_tensor_parallel_size=expert_tensor_parallel_size)


def build_process_groups(tensor_parallel_size: int, pipeline_parallel_size: int,
                         data_parallel_size: int | None = None, *,
                         expert_parallel_size: int | None = None,
                         expert_tensor_parallel_size: int = 1) -> ProcessGroups:
    """`build_topology(...).process_groups()`: collective, every process of the job calls it."""
    return build_topology(tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
                          expert_parallel_size=expert_parallel_size,
                          expert_tensor_parallel_size=expert_tensor_parallel_size
                          ).process_groups()


def build_device_mesh(tensor_parallel_size: int, pipeline_parallel_size: int,
                      device_type: str | None = None, data_parallel_size: int | None = None, *,
                      expert_parallel_size: int | None = None,
                      expert_tensor_parallel_size: int = 1) -> Any:
    """`build_topology(...).device_mesh(device_type)`; the device type defaults to 'cuda' when
    torch sees a GPU, else 'cpu' (as `load`'s device does)."""
    if device_type is None:
        torch = import_torch("device_mesh()")
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return build_topology(tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
                          expert_parallel_size=expert_parallel_size,
                          expert_tensor_parallel_size=expert_tensor_parallel_size
                          ).device_mesh(device_type)
