"""Rank-local tensor layouts: parameter roles, `LocalTensorLayout`, `LocalModelLayout` and
`ParallelModelInfo` (the `parallel` vocabulary's output half; realizing a group into them lives
in `partc.plan.tensor_split`). The placements they hold, and the stored dtypes, are defined in
`partc.parallel.placements`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from partc.errors import ParallelPlanError, ParallelPlanErrorKind, SourceLocation
from partc.parallel.placements import (
    DTYPE_BITS,
    Selection,
    TensorPlacement,
    _invalid_tensor,
    is_count,
    local_shape,
    placement_from_json,
    tensor_bytes,
    unchecked_replace,
)

# ---------------------------------------------------------------- roles


class ParameterRole(enum.Enum):
    """The semantic role of a parameter group."""

    REPLICATED = "replicated"
    COLUMN_PROJECTION = "column_projection"
    ROW_PROJECTION = "row_projection"
    VOCABULARY = "vocabulary"
    ATTENTION_HEADS = "attention_heads"
    FEED_FORWARD_INTERMEDIATE = "feed_forward_intermediate"
    EXPERT_INTERMEDIATE = "expert_intermediate"
    CHANNELS = "channels"
    SEGMENTED = "segmented"



def invalid_group(message: str, *, group: str, target: str = "",
                   location: SourceLocation | None = None, pointer: str = "",
                   doc: str | None = None) -> ParallelPlanError:
    """The error of a group whose realization breaks a rule (INVALID_GROUP)."""
    return ParallelPlanError(ParallelPlanErrorKind.INVALID_GROUP, message, group=group,
                             target=target, tensor=target or None, location=location,
                             pointer=pointer, doc=doc)



@dataclass(frozen=True, slots=True, kw_only=True)
class LocalTensorLayout:
    """How one physical tensor appears on one rank."""

    target: str
    """Checkpoint tensor name."""
    logical_name: str
    """Name of the parameter group the tensor belongs to."""
    role: ParameterRole
    """The group's semantic role."""
    dtype: str
    """Safetensors dtype."""
    global_shape: tuple[int, ...]
    """Shape in the checkpoint."""
    local_shape: tuple[int, ...]
    """Shape on this rank."""
    placement: TensorPlacement
    """Which part of the tensor this rank holds."""
    logical_units: int | None = None
    """The group's partition units, when partitioned (T query slots under KV replication)."""
    logical_range: tuple[int, int] | None = None
    """This rank's half-open range of the group's units, when partitioned."""
    fell_back_to_replication: bool = False
    """True when the policy replicated a group that could not be sharded."""
    fallback_reason: str = ""
    """Why the group could not be sharded, when it fell back (the compile error it would have
    been under `require`); '' otherwise, and in layouts decoded from generated tables."""
    kv_replicas: int = 1
    """How many ranks hold this same slice because KV heads are repeated (1: not repeated)."""
    needs_tp_reduction: bool = False
    """A norm split with its projection whose statistic spans every rank's piece: the engine
    must all-reduce the statistic (sum of squares) over the tensor-parallel group."""
    needs_tp_output_reduction: bool = False
    """A row-split projection whose partial output the engine all-reduces over the
    tensor-parallel group inside its module, before the work that follows it there."""

    def __post_init__(self) -> None:
        target = self.target
        if self.dtype not in DTYPE_BITS:
            raise _invalid_tensor(f"`{target}` has unknown dtype {self.dtype!r}", target=target)
        if len(self.local_shape) != len(self.global_shape):
            raise _invalid_tensor(f"`{target}`: local shape {list(self.local_shape)} and "
                                  f"global shape {list(self.global_shape)} differ in rank",
                                  target=target)
        placement = self.placement
        if not placement.fits(self.global_shape):
            raise _invalid_tensor(f"`{target}`: placement {placement.to_json()} does not fit "
                                  f"global shape {list(self.global_shape)}", target=target)
        expected = local_shape(self.global_shape, placement.selection(self.global_shape))
        if expected != self.local_shape:
            raise _invalid_tensor(f"`{target}`: local shape {list(self.local_shape)} does not "
                                  f"match placement {placement.to_json()} (expected "
                                  f"{list(expected)})", target=target)
        if (self.logical_units is None) != (self.logical_range is None) or (
                self.logical_units is not None and self.logical_range is not None and not
                0 <= self.logical_range[0] < self.logical_range[1] <= self.logical_units):
            raise _invalid_tensor(f"`{target}`: logical range {self.logical_range} does not fit "
                                  f"{self.logical_units} logical units", target=target)
        if not is_count(self.kv_replicas) or self.kv_replicas < 1:
            raise _invalid_tensor(f"`{target}`: kv_replicas must be >= 1, found "
                                  f"{self.kv_replicas}", target=target)

    @property
    def local_bytes(self) -> int:
        """Bytes this rank holds of the tensor."""
        return tensor_bytes(self.dtype, self.local_shape)

    def renamed(self, target: str, logical_name: str) -> LocalTensorLayout:
        """This validated layout under other names (names take no part in validation, so the
        copy is not re-validated)."""
        if self.target == target and self.logical_name == logical_name:
            return self
        return unchecked_replace(self, target=target, logical_name=logical_name)

    @property
    def is_whole(self) -> bool:
        """Whether this rank holds the whole tensor (replicated or unsplit)."""
        return self.placement.holds_whole

    @property
    def selection(self) -> Selection:
        """(axis, ranges) of the global tensor this rank reads; axis None = the whole tensor."""
        return self.placement.selection(self.global_shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalStateLayout:
    """One runtime state tensor of one unit (per sequence) as one rank allocates it."""

    name: str
    """State name (declared under `state:`)."""
    group: str
    """Execution group of the unit carrying it."""
    unit: int
    """Group-local unit index."""
    dtype: str
    """Safetensors dtype."""
    global_shape: tuple[int, ...]
    """The whole state tensor's shape."""
    local_shape: tuple[int, ...]
    """The part this rank allocates."""
    placement: TensorPlacement
    """Which part of the whole tensor this rank holds (replicated, a range or ranges)."""
    follows: str = ""
    """The parameter group whose logical range the split follows ('' when replicated)."""
    per_token: bool = False
    """One such tensor per token of the sequence (a KV cache entry), not one per sequence."""

    def __post_init__(self) -> None:
        label = f"state `{self.name}` of `{self.group}` unit {self.unit}"
        if self.dtype not in DTYPE_BITS or not is_count(self.unit):
            raise _invalid_tensor(f"{label}: unknown dtype {self.dtype!r} or bad unit")
        if not self.placement.fits(self.global_shape) or local_shape(
                self.global_shape, self.placement.selection(self.global_shape)
                ) != self.local_shape:
            raise _invalid_tensor(f"{label}: local shape {list(self.local_shape)} does not "
                                  f"match placement {self.placement.to_json()} of "
                                  f"{list(self.global_shape)}")

    @property
    def local_bytes(self) -> int:
        """Bytes this rank allocates for it (per sequence, or per token when `per_token`)."""
        return tensor_bytes(self.dtype, self.local_shape)

    def to_json(self) -> dict[str, object]:
        """JSON form (a plan's `partition.state.tensors` entry)."""
        return {"name": self.name, "group": self.group, "unit": self.unit, "dtype": self.dtype,
                "shape": list(self.global_shape), "local_shape": list(self.local_shape),
                "placement": self.placement.to_json(), "follows": self.follows,
                "per": "token" if self.per_token else "sequence",
                "local_bytes": self.local_bytes}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LocalStateLayout:
        """The layout from `to_json`, re-validated."""
        return cls(name=data["name"], group=data["group"], unit=data["unit"],
                   dtype=data["dtype"], global_shape=tuple(data["shape"]),
                   local_shape=tuple(data["local_shape"]),
                   placement=placement_from_json(data["placement"]), follows=data["follows"],
                   per_token=data.get("per") == "token")


def _sum_by_dtype(items: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    totals: dict[str, int] = {}
    for dtype, nbytes in items:
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return tuple(sorted(totals.items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalModelLayout:
    """All of one rank's tensor layouts, sorted by target.

    Construction sorts `tensors` and derives the target index and the byte totals once; the
    derived fields are not constructor arguments and take no part in equality.
    """

    tensors: tuple[LocalTensorLayout, ...]
    """Layouts in target order (sorted on construction)."""
    index: Mapping[str, int] = field(init=False, compare=False, repr=False)
    """Position of each target in `tensors` (derived on construction; read-only)."""
    local_bytes: int = field(init=False, compare=False, repr=False)
    """Bytes of every local tensor (derived on construction)."""
    pinned_bytes: int = field(init=False, compare=False, repr=False)
    """Bytes of the tensors this rank holds whole (derived on construction)."""

    def __post_init__(self) -> None:
        # The one place a frozen layout's fields are set after `__init__`: the normalized
        # order and the values derived from it, before the value is handed out.
        ordered = tuple(sorted(self.tensors, key=lambda t: t.target))
        for before, after in zip(ordered, ordered[1:], strict=False):
            if before.target == after.target:
                raise _invalid_tensor(f"layout lists `{before.target}` twice (groups "
                                      f"`{before.logical_name}` and `{after.logical_name}`)",
                                      target=before.target)
        sizes = [t.local_bytes for t in ordered]
        object.__setattr__(self, "tensors", ordered)
        object.__setattr__(self, "index", MappingProxyType(
            {t.target: i for i, t in enumerate(ordered)}))
        object.__setattr__(self, "local_bytes", sum(sizes))
        object.__setattr__(self, "pinned_bytes", sum(
            n for t, n in zip(ordered, sizes, strict=True) if t.placement.holds_whole))

    def __getitem__(self, target: str) -> LocalTensorLayout:
        return self.tensors[self.index[target]]

    def __contains__(self, target: object) -> bool:
        return target in self.index

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def targets(self) -> tuple[str, ...]:
        """Targets in order."""
        return tuple(t.target for t in self.tensors)

    @property
    def bytes_by_dtype(self) -> tuple[tuple[str, int], ...]:
        """Local bytes per stored dtype, sorted by dtype."""
        return _sum_by_dtype((t.dtype, t.local_bytes) for t in self.tensors)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelModelInfo:
    """Topology and parameter accounting of one rank."""

    model_type: str
    """The HF model type."""
    tensor_parallel_size: int
    """T."""
    pipeline_parallel_size: int
    """S."""
    rank: int
    """Global rank g = stage * T + tensor_parallel_rank."""
    tensor_parallel_rank: int
    """Rank within the stage."""
    pipeline_stage: int
    """Stage index."""
    owned_tensors: int
    """How many checkpoint tensors this rank holds (whole or in part)."""
    local_parameter_bytes: int
    """Bytes this rank loads."""
    global_parameter_bytes: int
    """Bytes of the whole checkpoint."""
    pinned_parameter_bytes: int
    """Bytes this rank holds whole (replicated or unsplit)."""
    maximum_device_parameter_bytes: int
    """Largest `local_parameter_bytes` over all ranks of the topology."""
    local_bytes_by_dtype: tuple[tuple[str, int], ...] = ()
    """`local_parameter_bytes` split by stored dtype, sorted (empty when not computed)."""
    ranks_per_stage: int = 0
    """N: ranks of a stage under expert parallelism (E * X); 0 without it (a stage has T)."""
    dense_replica: int = 0
    """Which copy of the stage's dense parts this rank holds (stage-local rank div T)."""
    expert_parallel_size: int = 1
    """E: expert-parallel ranks of a stage (1 without expert parallelism)."""
    expert_tensor_parallel_size: int = 1
    """X: ranks splitting each expert."""
    expert_parallel_rank: int = 0
    """This rank's EP rank (stage-local rank div X): which experts it holds."""
    expert_tensor_parallel_rank: int = 0
    """This rank's place in its ETP group (stage-local rank mod X)."""
    local_experts: int = 0
    """Routed experts this rank holds (its local slots; 0 without expert parallelism)."""
    expert_parameter_bytes: int = 0
    """Bytes of routed-expert tensors this rank loads (0 without expert parallelism)."""
    local_state_bytes: int = 0
    """Bytes of the declared per-sequence runtime state (conv, SSM states) this rank allocates
    per sequence, every unit of its stage (0 when the family declares none)."""
    local_state_bytes_per_token: int = 0
    """Bytes of the declared per-token runtime state (KV cache entries) this rank allocates per
    token of a sequence, every unit of its stage (0 when the family declares none)."""

    def __post_init__(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise invalid_group(f"topology sizes must be positive, found tensor_parallel_size "
                                 f"{tp} and pipeline_parallel_size {pp}", group="")
        if not (0 <= self.tensor_parallel_rank < tp and 0 <= self.pipeline_stage < pp):
            raise invalid_group(f"tensor_parallel_rank {self.tensor_parallel_rank} / stage "
                                 f"{self.pipeline_stage} outside a {tp} x {pp} topology", group="")
        if self.ranks_per_stage:
            self._check_expert_coordinates()
        elif self.rank != self.pipeline_stage * tp + self.tensor_parallel_rank:
            raise invalid_group(f"rank {self.rank} is not stage {self.pipeline_stage} * "
                                 f"{tp} + {self.tensor_parallel_rank}", group="")
        if not (0 <= self.pinned_parameter_bytes <= self.local_parameter_bytes
                <= self.maximum_device_parameter_bytes) or self.owned_tensors < 0:
            raise invalid_group(
                f"rank {self.rank}: byte accounting must satisfy 0 <= pinned "
                f"({self.pinned_parameter_bytes}) <= local ({self.local_parameter_bytes}) <= "
                f"maximum ({self.maximum_device_parameter_bytes})", group="")
        if self.local_bytes_by_dtype and (
                sum(n for _, n in self.local_bytes_by_dtype) != self.local_parameter_bytes):
            raise invalid_group(f"rank {self.rank}: bytes by dtype {self.local_bytes_by_dtype} "
                                 f"do not add up to {self.local_parameter_bytes}", group="")

    def _check_expert_coordinates(self) -> None:
        n, t, x = (self.ranks_per_stage, self.tensor_parallel_size,
                   self.expert_tensor_parallel_size)
        local = self.dense_replica * t + self.tensor_parallel_rank
        if not (n == self.expert_parallel_size * x and n % t == 0 and 0 <= local < n
                and self.rank == self.pipeline_stage * n + local
                and self.expert_parallel_rank == local // x
                and self.expert_tensor_parallel_rank == local % x
                and 0 <= self.expert_parameter_bytes <= self.local_parameter_bytes):
            raise invalid_group(
                f"rank {self.rank}: inconsistent expert-parallel coordinates (N={n} ranks per "
                f"stage = E {self.expert_parallel_size} x X {x}, T={t}, dense replica "
                f"{self.dense_replica}, tensor-parallel rank {self.tensor_parallel_rank}, EP "
                f"rank {self.expert_parallel_rank}, ETP rank "
                f"{self.expert_tensor_parallel_rank}); the layout is build rank = stage * N + r "
                "with r = replica * T + tp, ep = r div X, etp = r mod X", group="")

    def expert_json(self) -> dict[str, int]:
        """The expert-parallel fields, as a plan's rank `info` records them."""
        return {"ranks_per_stage": self.ranks_per_stage, "dense_replica": self.dense_replica,
                "expert_parallel_size": self.expert_parallel_size,
                "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
                "expert_parallel_rank": self.expert_parallel_rank,
                "expert_tensor_parallel_rank": self.expert_tensor_parallel_rank,
                "local_experts": self.local_experts,
                "expert_parameter_bytes": self.expert_parameter_bytes}

    @classmethod
    def from_layouts(cls, *, model_type: str, tensor_parallel_size: int,
                     pipeline_parallel_size: int, rank: int,
                     layouts: Sequence[LocalModelLayout],
                     global_parameter_bytes: int,
                     maximum_device_parameter_bytes: int | None = None) -> ParallelModelInfo:
        """The accounting of `rank`, given every rank's layout (index = global rank)."""
        layout = layouts[rank]
        maximum = (max(x.local_bytes for x in layouts) if maximum_device_parameter_bytes is None
                   else maximum_device_parameter_bytes)
        return cls(model_type=model_type, tensor_parallel_size=tensor_parallel_size,
                   pipeline_parallel_size=pipeline_parallel_size, rank=rank,
                   tensor_parallel_rank=rank % tensor_parallel_size,
                   pipeline_stage=rank // tensor_parallel_size, owned_tensors=len(layout),
                   local_parameter_bytes=layout.local_bytes,
                   global_parameter_bytes=global_parameter_bytes,
                   pinned_parameter_bytes=layout.pinned_bytes,
                   maximum_device_parameter_bytes=maximum,
                   local_bytes_by_dtype=layout.bytes_by_dtype)
