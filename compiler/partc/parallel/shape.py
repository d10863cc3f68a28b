"""The rank arithmetic of a build: T x S ranks (N = E x X per stage under expert parallelism),
replicated D times over a job.

Global rank `g = d·N·S + p·N + r` (tensor-parallel innermost, DESIGN.md §3), with stage-local
rank r = (dense replica)·T + t, EP rank r div X and ETP rank r mod X (docs/expert_parallel.md).
`ParallelShape` is the one home of that formula: the plan's `Topology`, the runtime's
`BuildTopology`, `partc shard` and `partc inspect` all count ranks through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from partc.errors import LayoutError


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoordinates:
    """One process's place in the job."""

    data_parallel_rank: int
    """Which replica of the build (d)."""
    pipeline_stage: int
    """Which pipeline stage (p)."""
    tensor_parallel_rank: int
    """Which rank of the stage's tensor-parallel group (t)."""
    dense_replica: int = 0
    """Which copy of the stage's dense parts (expert-parallel builds; r div T)."""
    expert_parallel_rank: int = 0
    """The EP rank, which selects the experts held (expert-parallel builds; r div X)."""
    expert_tensor_parallel_rank: int = 0
    """The rank within the ETP group splitting each expert (expert-parallel builds; r mod X)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelShape:
    """The sizes of a build's parallel dimensions, and the arithmetic between ranks and
    coordinates (checked: positive sizes, X only with E, N = E x X a multiple of T)."""

    tensor_parallel_size: int
    """T: ranks splitting the dense parts of a stage."""
    pipeline_parallel_size: int
    """S: pipeline stages."""
    expert_parallel_size: int | None = None
    """E: expert-parallel ranks per stage (None: no expert parallelism)."""
    expert_tensor_parallel_size: int = 1
    """X: ranks splitting each expert; a stage has N = E x X ranks."""
    data_parallel_size: int = 1
    """D: replicas of the build in a job."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "expert_tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, found {value!r}")
        ep = self.expert_parallel_size
        if ep is None:
            if self.expert_tensor_parallel_size != 1:
                raise LayoutError("expert_tensor_parallel_size needs expert_parallel_size")
            return
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise LayoutError(f"expert_parallel_size must be a positive integer, found {ep!r}")
        n = self.ranks_per_stage
        if n % self.tensor_parallel_size:
            raise LayoutError(f"N = E {ep} x X {self.expert_tensor_parallel_size} = {n} "
                              f"rank{'' if n == 1 else 's'} per stage is not a multiple of "
                              f"T={self.tensor_parallel_size}")

    @property
    def ranks_per_stage(self) -> int:
        """N: E x X under expert parallelism, else T."""
        if self.expert_parallel_size is None:
            return self.tensor_parallel_size
        return self.expert_parallel_size * self.expert_tensor_parallel_size

    @property
    def dense_replicas(self) -> int:
        """N / T: copies of a stage's dense parts (1 without expert parallelism)."""
        return self.ranks_per_stage // self.tensor_parallel_size

    @property
    def build_world_size(self) -> int:
        """Ranks of one replica of the build (N x S): its rank modules."""
        return self.ranks_per_stage * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Processes in the job (D x N x S)."""
        return self.build_world_size * self.data_parallel_size

    def stage_ranks(self, pipeline_stage: int) -> range:
        """The build ranks of one pipeline stage, in order."""
        if not 0 <= pipeline_stage < self.pipeline_parallel_size:
            raise LayoutError(f"pipeline stage {pipeline_stage} is outside 0.."
                              f"{self.pipeline_parallel_size - 1}")
        first = pipeline_stage * self.ranks_per_stage
        return range(first, first + self.ranks_per_stage)

    def coordinates(self, global_rank: int) -> RankCoordinates:
        """The coordinates of a global rank (0 <= rank < world_size)."""
        if isinstance(global_rank, bool) or not isinstance(global_rank, int) or not (
                0 <= global_rank < self.world_size):
            raise LayoutError(f"rank {global_rank!r} is outside 0..{self.world_size - 1}")
        replica, build_rank = divmod(global_rank, self.build_world_size)
        stage, local = divmod(build_rank, self.ranks_per_stage)
        if self.expert_parallel_size is None:
            return RankCoordinates(data_parallel_rank=replica, pipeline_stage=stage,
                                   tensor_parallel_rank=local)
        x = self.expert_tensor_parallel_size
        return RankCoordinates(data_parallel_rank=replica, pipeline_stage=stage,
                               tensor_parallel_rank=local % self.tensor_parallel_size,
                               dense_replica=local // self.tensor_parallel_size,
                               expert_parallel_rank=local // x,
                               expert_tensor_parallel_rank=local % x)

    def rank(self, coordinates: RankCoordinates) -> int:
        """The global rank at `coordinates` (d, p, dense replica, t; the EP and ETP ranks
        must agree with them)."""
        c = coordinates
        if not (0 <= c.data_parallel_rank < self.data_parallel_size
                and 0 <= c.pipeline_stage < self.pipeline_parallel_size
                and 0 <= c.tensor_parallel_rank < self.tensor_parallel_size
                and 0 <= c.dense_replica < self.dense_replicas):
            raise LayoutError(f"coordinates {c} are outside {self.factors}")
        rank = (c.data_parallel_rank * self.build_world_size
                + c.pipeline_stage * self.ranks_per_stage
                + c.dense_replica * self.tensor_parallel_size + c.tensor_parallel_rank)
        if self.coordinates(rank) != c:
            raise LayoutError(f"coordinates {c} are inconsistent: rank {rank} is "
                              f"{self.coordinates(rank)}")
        return rank

    @property
    def factors(self) -> str:
        """The sizes as messages name them (`D=1 x S=2 x T=2`, with ` x E=.. x X=..`)."""
        text = (f"D={self.data_parallel_size} x S={self.pipeline_parallel_size} x "
                f"T={self.tensor_parallel_size}")
        if self.expert_parallel_size is not None:
            text += f" x E={self.expert_parallel_size} x X={self.expert_tensor_parallel_size}"
        return text
