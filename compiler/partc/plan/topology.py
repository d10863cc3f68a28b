"""The topology a plan is realized for: T x S (E x X per stage under expert parallelism).

Built values are checked: the sizes by `ParallelShape` (the one home of their rules, which the
runtime's `BuildTopology` shares), the placement against E.
"""

from __future__ import annotations

from dataclasses import dataclass

from partc.errors import ExpertParallelError
from partc.parallel.experts import ExpertPlacement
from partc.parallel.shape import ParallelShape
from partc.parallel.specs import ShardingPolicy, TensorSplit
from partc.partition.boundary import PipelineActivationDtype
from partc.partition.ownership import GroupParallelMode
from partc.plan.stage_balance import StageLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A parallel topology and the options that shape its realization."""

    tensor_parallel_size: int = 1
    """T: ranks per stage."""
    pipeline_parallel_size: int = 1
    """S: pipeline stages."""
    stage_units: tuple[int, ...] | None = None
    """Explicit units per stage (None: balanced)."""
    policy: ShardingPolicy | None = None
    """Sharding policy override (None: the family's, else Require)."""
    activation_dtype: PipelineActivationDtype | None = None
    """Dtype of activations on the pipeline wire (None: the model's own, `model_activation_dtype`;
    a plan always records the resolved dtype)."""
    stage_layout: StageLayout | None = None
    """Explicit units per stage and execution group (`--pp-layers vision*3|decoder*2`)."""
    group_modes: tuple[tuple[str, GroupParallelMode], ...] = ()
    """Parallel mode per execution group chosen at compile time (`--group-mode`), overriding
    the family's `parallel:`."""
    split: TensorSplit = TensorSplit.BALANCED
    """How uneven splits give out the remainder (`--split`; the JSON key `split` is present only
    for `chunk`, so balanced plans read as before)."""
    expert_parallel_size: int | None = None
    """E: expert-parallel ranks per stage (None: no expert parallelism, every expert split
    over the T ranks; docs/expert_parallel.md)."""
    expert_tensor_parallel_size: int = 1
    """X: ranks splitting each expert (Megatron's ETP); a stage has N = E * X ranks."""
    expert_placement: ExpertPlacement | None = None
    """An explicit placement (a placement file); None: balanced contiguous ranges."""

    def __post_init__(self) -> None:
        self.shape  # noqa: B018 - built to be checked: the sizes' rules are ParallelShape's
        _check_expert_placement(self)

    @property
    def shape(self) -> ParallelShape:
        """The sizes T, S, E, X of one replica, and their rank arithmetic."""
        return ParallelShape(tensor_parallel_size=self.tensor_parallel_size,
                             pipeline_parallel_size=self.pipeline_parallel_size,
                             expert_parallel_size=self.expert_parallel_size,
                             expert_tensor_parallel_size=self.expert_tensor_parallel_size)

    @property
    def ranks_per_stage(self) -> int:
        """N: E * X under expert parallelism, else T."""
        return self.shape.ranks_per_stage

    @property
    def world_size(self) -> int:
        """N * S (T * S without expert parallelism)."""
        return self.shape.build_world_size

    def to_json(self) -> dict[str, object]:
        """JSON form (the expert-parallel keys only under expert parallelism)."""
        spelled: dict[str, object] = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "stage_units": list(self.stage_units) if self.stage_units else None,
            "policy": self.policy.value if self.policy else None,
            "activation_dtype": None if self.activation_dtype is None
            else self.activation_dtype.value,
        }
        spelled = spelled | ({} if self.stage_layout is None else {"stage_layout": [
            [[g, n] for g, n in runs] for runs in self.stage_layout]}) | (
            {"group_modes": {g: m.value for g, m in self.group_modes}} if self.group_modes
            else {}) | (
            {} if self.split is TensorSplit.BALANCED else {"split": self.split.value})
        if self.expert_parallel_size is not None:
            spelled["expert_parallel_size"] = self.expert_parallel_size
            spelled["expert_tensor_parallel_size"] = self.expert_tensor_parallel_size
        return spelled


def _check_expert_placement(topology: Topology) -> None:
    """An explicit placement comes with expert parallelism, for its E ranks
    (docs/expert_parallel.md)."""
    placement, ep = topology.expert_placement, topology.expert_parallel_size
    if placement is None:
        return
    if ep is None:
        raise ExpertParallelError("--expert-placement needs expert parallelism: give "
                                  "expert_parallel_size (--ep)")
    if placement.expert_parallel_size != ep:
        raise ExpertParallelError(f"the expert placement lists {placement.expert_parallel_size} EP "
                                  f"ranks but expert_parallel_size is {ep}")
