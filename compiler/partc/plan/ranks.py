"""What a rank of a plan holds: group kinds (one realization shared by the groups of one
structure), planned groups, rank plans and their byte accounting."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from partc.errors import SourceLocation
from partc.parallel.layout import LocalModelLayout, LocalTensorLayout, ParallelModelInfo
from partc.parallel.placements import PlacementKind
from partc.parallel.shape import RankCoordinates
from partc.partition.ownership import ParameterGroupOwner
from partc.partition.pipeline import ArchitecturePartition

if TYPE_CHECKING:
    from partc.bind.binder import BoundArchitecture


GroupSite = Callable[[str], "tuple[SourceLocation, str] | None"]
"""Where a parameter group (by name) is declared: source location and JSON pointer, or None."""


Accounting = tuple[int, int, tuple[tuple[str, int], ...]]
"""(local bytes, pinned bytes, local bytes by dtype) of one group on one tensor-parallel rank."""


def _accounting(layouts: tuple[LocalTensorLayout, ...]) -> Accounting:
    sizes = [(x.dtype, x.local_bytes, x.placement.holds_whole) for x in layouts
             if x.placement.kind is not PlacementKind.OMIT]
    by_dtype: dict[str, int] = {}
    for dtype, nbytes, _ in sizes:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return (sum(n for _, n, _ in sizes), sum(n for _, n, whole in sizes if whole),
            tuple(sorted(by_dtype.items())))


class KindIndex(enum.Enum):
    """Which coordinate of a rank selects its row of a GroupKind's layouts."""

    TENSOR = "tensor"
    """The dense TP rank (T rows): every group without expert parallelism."""
    EXPERT_TENSOR = "expert_tensor"
    """The ETP rank (X rows): a per-expert group under expert parallelism."""
    LOCAL = "local"
    """The stage-local rank (N rows): a stacked expert group under expert parallelism."""


@dataclass(frozen=True, slots=True)
class GroupKind:
    """The realization shared by every parameter group of one structure (groups that differ
    only in names, such as the experts of a layer): per tensor-parallel rank, per member."""

    layouts: tuple[tuple[LocalTensorLayout, ...], ...]
    """Outer index: tensor-parallel rank (see `index`); inner: member. Named after the kind's
    first group."""
    index: KindIndex = KindIndex.TENSOR
    """Which rank coordinate indexes `layouts` (expert kinds under expert parallelism)."""
    rank_accounting: tuple[Accounting, ...] = field(init=False, compare=False, repr=False)
    """Per tensor-parallel rank, the accounting of one group of this kind (derived on
    construction)."""
    held: tuple[tuple[int, ...], ...] = field(init=False, compare=False, repr=False)
    """Per tensor-parallel rank, the members the rank holds: every one but those placed
    `omit` (per-head tensors of other ranks' heads); derived on construction."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_accounting",
                           tuple(_accounting(layouts) for layouts in self.layouts))
        object.__setattr__(self, "held", tuple(
            tuple(i for i, x in enumerate(layouts) if x.placement.kind is not PlacementKind.OMIT)
            for layouts in self.layouts))

    def accounting(self, tensor_parallel_rank: int) -> Accounting:
        """(local bytes, pinned bytes, local bytes by dtype) of one group of this kind on a rank."""
        return self.rank_accounting[tensor_parallel_rank]

    def row(self, tensor_parallel_rank: int, coordinates: RankCoordinates | None) -> int:
        """The row of `layouts` a rank uses: its TP rank, or under expert parallelism its ETP
        rank (per-expert kinds) or stage-local rank (stacked kinds)."""
        if coordinates is None or self.index is KindIndex.TENSOR:
            return tensor_parallel_rank
        if self.index is KindIndex.EXPERT_TENSOR:
            return coordinates.expert_tensor_parallel_rank
        return coordinates.stage_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedGroup:
    """One parameter group of the plan: its names, owner, structure and stages."""

    name: str
    """Logical name."""
    owner: ParameterGroupOwner
    """Who owns it (a static role or an execution unit)."""
    targets: tuple[str, ...]
    """Checkpoint names of its members, in member order."""
    kind: int
    """Index of its GroupKind in `Plan.kinds`."""
    stages: tuple[int, ...]
    """Pipeline stages that load it."""


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """Everything one rank needs: its partition, its parameter groups and its accounting.

    Not slotted: `layout` is a `functools.cached_property`, derived from the fields on first
    use (large models have ~10^4 tensors per rank and a compile needs none of them); the
    fields never change and equality sees only them.
    """

    rank: int
    """Global rank."""
    tensor_parallel_rank: int
    """Rank within the stage."""
    pipeline_stage: int
    """Stage."""
    partition: ArchitecturePartition
    """The stage's architecture partition."""
    info: ParallelModelInfo
    """Topology and byte accounting."""
    groups: tuple[PlannedGroup, ...] = field(repr=False)
    """The stage's parameter groups, in binding order (shared by the stage's ranks)."""
    kinds: tuple[GroupKind, ...] = field(repr=False)
    """The plan's group kinds (`PlannedGroup.kind` indexes it)."""
    coordinates: RankCoordinates | None = None
    """Under expert parallelism: the rank's coordinates (stage rank, dense replica, EP and ETP
    ranks among them; its `groups` are then the stage's dense groups and its own experts)."""

    @cached_property
    def layout(self) -> LocalModelLayout:
        """This rank's tensors (derived on first use, then kept)."""
        t, c = self.tensor_parallel_rank, self.coordinates
        return LocalModelLayout(tensors=tuple(
            layout.renamed(target, group.name)
            for group in self.groups
            for layout, target in zip(
                self.kinds[group.kind].layouts[self.kinds[group.kind].row(t, c)],
                group.targets, strict=True)
            if layout.placement.kind is not PlacementKind.OMIT))

    def to_json(self) -> dict[str, object]:
        """JSON form (the plan's `ranks` entries)."""
        info = self.info
        return {
            "rank": self.rank, "tensor_parallel_rank": self.tensor_parallel_rank,
            "pipeline_stage": self.pipeline_stage, "partition": self.partition.to_json(),
            "info": {"owned_tensors": info.owned_tensors,
                     "local_parameter_bytes": info.local_parameter_bytes,
                     "global_parameter_bytes": info.global_parameter_bytes,
                     "pinned_parameter_bytes": info.pinned_parameter_bytes,
                     "maximum_device_parameter_bytes": info.maximum_device_parameter_bytes,
                     "local_bytes_by_dtype": dict(info.local_bytes_by_dtype)}
            | ({} if self.coordinates is None else info.expert_json())
            | ({"local_state_bytes": info.local_state_bytes,
                "local_state_bytes_per_token": info.local_state_bytes_per_token}
               if self.partition.state.tensors else {}),
        }


def rank_accounting(groups: tuple[PlannedGroup, ...], kinds: list[GroupKind], tp_rank: int,
                    coordinates: RankCoordinates | None = None
                    ) -> tuple[int, int, int, tuple[tuple[str, int], ...], int]:
    """(owned tensors, local bytes, pinned bytes, bytes by dtype, expert bytes) of one rank's
    groups (expert bytes: those of expert kinds under expert parallelism)."""
    counts: dict[int, int] = {}
    for group in groups:
        counts[group.kind] = counts.get(group.kind, 0) + 1
    owned = local = pinned = experts = 0
    by_dtype: dict[str, int] = {}
    for kind, count in counts.items():
        row = kinds[kind].row(tp_rank, coordinates)
        nbytes, whole, dtypes = kinds[kind].accounting(row)
        owned += count * len(kinds[kind].held[row])
        local += count * nbytes
        pinned += count * whole
        if kinds[kind].index is not KindIndex.TENSOR:
            experts += count * nbytes
        for dtype, n in dtypes:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + count * n
    return owned, local, pinned, tuple(sorted(by_dtype.items())), experts


def dense_ranks(bound: BoundArchitecture, tp: int, pp: int, partitions: list[ArchitecturePartition],
                stage_groups: list[tuple[PlannedGroup, ...]], kinds: list[GroupKind],
                global_bytes: int) -> list[RankPlan]:
    """Every rank of a T x S plan: stage * T + tensor-parallel rank."""
    accounting = [[rank_accounting(stage_groups[s], kinds, t) for t in range(tp)]
                  for s in range(pp)]
    maximum = max(a[1] for stage in accounting for a in stage)
    ranks = []
    for stage, partition in enumerate(partitions):
        for tp_rank in range(tp):
            owned_tensors, local, pinned, by_dtype = accounting[stage][tp_rank][:4]
            info = ParallelModelInfo(
                model_type=bound.model_type, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                rank=stage * tp + tp_rank, tensor_parallel_rank=tp_rank, pipeline_stage=stage,
                owned_tensors=owned_tensors, local_parameter_bytes=local,
                global_parameter_bytes=global_bytes, pinned_parameter_bytes=pinned,
                maximum_device_parameter_bytes=maximum, local_bytes_by_dtype=by_dtype)
            ranks.append(RankPlan(rank=stage * tp + tp_rank, tensor_parallel_rank=tp_rank,
                                  pipeline_stage=stage, partition=partition, info=info,
                                  groups=stage_groups[stage], kinds=tuple(kinds)))
    return ranks
