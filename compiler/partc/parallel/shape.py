"""The rank arithmetic of a build: T x S ranks (N = E x X per stage under expert parallelism),
replicated D times over a job.

Global rank `g = d·N·S + p·N + r` (tensor-parallel innermost, DESIGN.md §3), with stage-local
rank r = (dense replica)·T + t, EP rank r div X and ETP rank r mod X (docs/expert_parallel.md).
`ParallelShape` is the one home of that formula: the plan's `Topology`, the runtime's
`BuildTopology`, `partc shard` and `partc inspect` all count ranks through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from partc.errors import ExpertParallelError, LayoutError, plural


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeProblem:
    """A rule of the rank arithmetic that some sizes, a rank or coordinates break: its message,
    worded once here, raised by the plan as a LayoutError and by a launch as a LaunchError."""

    message: str
    """The rule and the values found."""
    experts: bool = False
    """Whether the rule is about expert parallelism (E, X): the plan raises an
    ExpertParallelError, whose guide is docs/expert_parallel.md."""

    def plan_error(self) -> LayoutError:
        """The error the plan stage raises for it."""
        return (ExpertParallelError if self.experts else LayoutError)(self.message)


def size_problem(name: str, value: object) -> str | None:
    """The message for a parallel size `name` that is not a positive integer (None: it is)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name} must be a positive integer, found {value!r}"
    return None


def shape_problem(*, tensor_parallel_size: object, pipeline_parallel_size: object,
                  expert_parallel_size: object = None, expert_tensor_parallel_size: object = 1,
                  data_parallel_size: object = 1) -> ShapeProblem | None:
    """The first rule these sizes break (None: they make a `ParallelShape`): each size a
    positive integer, X only with E, and N = E x X a multiple of T (docs/expert_parallel.md)."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size),
                        ("data_parallel_size", data_parallel_size)):
        problem = size_problem(name, value)
        if problem is not None:
            return ShapeProblem(message=problem)
    for name, value in (("expert_parallel_size", expert_parallel_size),
                        ("expert_tensor_parallel_size", expert_tensor_parallel_size)):
        problem = None if value is None else size_problem(name, value)
        if problem is not None:
            return ShapeProblem(message=problem, experts=True)
    if expert_parallel_size is None:
        if expert_tensor_parallel_size != 1:
            return ShapeProblem(
                message=f"expert_tensor_parallel_size {expert_tensor_parallel_size} (--etp) "
                "needs expert parallelism: give expert_parallel_size (--ep)", experts=True)
        return None
    assert isinstance(expert_parallel_size, int) and isinstance(expert_tensor_parallel_size, int)
    assert isinstance(tensor_parallel_size, int)
    n = expert_parallel_size * expert_tensor_parallel_size
    if n % tensor_parallel_size:
        return ShapeProblem(
            message=f"a stage has N = expert_parallel_size {expert_parallel_size} x "
            f"expert_tensor_parallel_size {expert_tensor_parallel_size} = {plural(n, 'rank')}, "
            f"not a multiple of tensor_parallel_size {tensor_parallel_size}: the dense parts "
            "(split over T ranks) are repeated N / T times; choose T dividing "
            f"{n}", experts=True)
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoordinates:
    """One rank's place in the job: its replica, stage and rank within the stage, and what that
    stage-local rank is in each group of the stage (the one coordinates type of plan, runtime,
    shard and inspect; a plan's ranks are those of replica 0)."""

    data_parallel_rank: int
    """Which replica of the build (d)."""
    pipeline_stage: int
    """Which pipeline stage (p)."""
    stage_rank: int
    """r: the rank within its stage (0 <= r < N; t without expert parallelism)."""
    tensor_parallel_rank: int
    """Which rank of the stage's tensor-parallel group (t = r mod T)."""
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
        problem = shape_problem(tensor_parallel_size=self.tensor_parallel_size,
                                pipeline_parallel_size=self.pipeline_parallel_size,
                                expert_parallel_size=self.expert_parallel_size,
                                expert_tensor_parallel_size=self.expert_tensor_parallel_size,
                                data_parallel_size=self.data_parallel_size)
        if problem is not None:
            raise problem.plan_error()

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
            raise LayoutError(f"pipeline stage {pipeline_stage} is outside the stages 0.."
                              f"{self.pipeline_parallel_size - 1} of {self.factors}")
        first = pipeline_stage * self.ranks_per_stage
        return range(first, first + self.ranks_per_stage)

    def coordinates(self, global_rank: int) -> RankCoordinates:
        """The coordinates of a global rank (0 <= rank < world_size)."""
        problem = self.rank_problem(global_rank)
        if problem is not None:
            raise LayoutError(problem)
        replica, build_rank = divmod(global_rank, self.build_world_size)
        stage, local = divmod(build_rank, self.ranks_per_stage)
        if self.expert_parallel_size is None:
            return RankCoordinates(data_parallel_rank=replica, pipeline_stage=stage,
                                   stage_rank=local, tensor_parallel_rank=local)
        x = self.expert_tensor_parallel_size
        return RankCoordinates(data_parallel_rank=replica, pipeline_stage=stage,
                               stage_rank=local,
                               tensor_parallel_rank=local % self.tensor_parallel_size,
                               dense_replica=local // self.tensor_parallel_size,
                               expert_parallel_rank=local // x,
                               expert_tensor_parallel_rank=local % x)

    def rank(self, coordinates: RankCoordinates) -> int:
        """The global rank at `coordinates` (d, p, dense replica, t; the EP and ETP ranks
        must agree with them)."""
        problem = self.coordinates_problem(coordinates)
        if problem is not None:
            raise LayoutError(problem)
        return self._rank(coordinates)

    def _rank(self, c: RankCoordinates) -> int:
        return (c.data_parallel_rank * self.build_world_size
                + c.pipeline_stage * self.ranks_per_stage
                + c.dense_replica * self.tensor_parallel_size + c.tensor_parallel_rank)

    def rank_problem(self, global_rank: object) -> str | None:
        """The message for a global rank outside 0..world_size-1 (None: it is inside)."""
        if isinstance(global_rank, bool) or not isinstance(global_rank, int) or not (
                0 <= global_rank < self.world_size):
            return (f"rank {global_rank!r} is outside the ranks 0..{self.world_size - 1} of "
                    f"{self.factors}")
        return None

    def coordinates_problem(self, coordinates: RankCoordinates) -> str | None:
        """The message for coordinates outside these sizes, or whose stage rank, EP and ETP
        ranks disagree with their dense replica and TP rank (None: they name one rank)."""
        c = coordinates
        if not (0 <= c.data_parallel_rank < self.data_parallel_size
                and 0 <= c.pipeline_stage < self.pipeline_parallel_size
                and 0 <= c.stage_rank < self.ranks_per_stage
                and 0 <= c.tensor_parallel_rank < self.tensor_parallel_size
                and 0 <= c.dense_replica < self.dense_replicas):
            return (f"coordinates {c} are outside {self.factors}"
                    + (f" ({plural(self.dense_replicas, 'dense replica')})"
                       if self.dense_replicas > 1 else ""))
        rank = self._rank(c)
        if self.coordinates(rank) != c:
            return f"coordinates {c} are inconsistent: rank {rank} is {self.coordinates(rank)}"
        return None

    def world_problem(self, world: int) -> str | None:
        """The message for a job of `world` processes that is not this shape's world size
        (None: it is), with the data-parallel size that fits it when one does."""
        if world == self.world_size:
            return None
        replica = self.build_world_size
        fix = (f"; data_parallel_size={world // replica} fits this world (the default: D is "
               "WORLD_SIZE over a replica's ranks)" if world % replica == 0 else
               f", and {world} is no multiple of a replica's {replica} ranks")
        return (f"the torch world has {world} processes; this topology needs {self.world_size} "
                f"(D={self.data_parallel_size} x S={self.pipeline_parallel_size} x "
                f"{self.ranks_per_stage} ranks a stage){fix}")

    @property
    def factors(self) -> str:
        """The sizes as messages name them (`D=1 x S=2 x T=2`, with ` x E=.. x X=..`)."""
        text = (f"D={self.data_parallel_size} x S={self.pipeline_parallel_size} x "
                f"T={self.tensor_parallel_size}")
        if self.expert_parallel_size is not None:
            text += f" x E={self.expert_parallel_size} x X={self.expert_tensor_parallel_size}"
        return text
