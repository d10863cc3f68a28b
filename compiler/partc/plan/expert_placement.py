"""The expert-parallel part of a plan: its layout and placement, the model's expert count,
the stacked expert groups' rows, and the ranks of an expert-parallel stage
(docs/expert_parallel.md); the placement file read, and the stacked groups realized for an EP
rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partc.errors import ExpertParallelError, LayoutError, SourceLocation, plural, raise_if_any
from partc.parallel.experts import (
    PLACEMENT_DOC,
    ExpertGroup,
    ExpertPlacement,
    first_problems,
    placement_problems,
)
from partc.parallel.layout import LocalTensorLayout, ParallelModelInfo
from partc.parallel.placements import Indices, Range, TensorPlacement
from partc.parallel.shape import ParallelShape
from partc.parallel.specs import ParameterGroupSpec
from partc.partition.pipeline import ArchitecturePartition
from partc.plan.ranks import GroupKind, GroupSite, PlannedGroup, RankPlan, rank_accounting
from partc.plan.topology import Topology

if TYPE_CHECKING:
    from partc.bind.binder import BoundArchitecture


Locate = Callable[[str], "SourceLocation | None"]
"""Where a JSON pointer of a placement file is (None when unknown)."""


def _no_location(pointer: str) -> SourceLocation | None:
    return None


PLACEMENT_BYTES_PER_SLOT = 32
"""Bytes a placement file may spend on each slot it can hold (an id, its comma and a
pretty-printer's line and indent fit easily)."""
PLACEMENT_BASE_BYTES = 64 * 1024
"""Bytes a placement file may have beyond its slots (braces, `ranks`, comments of spacing)."""
MAX_PLACEMENT_ERRORS = 20
"""The most placement errors reported; a file breaking more rules is stopped there."""


def placement_byte_limit(experts: int, expert_parallel_size: int) -> int:
    """The largest placement file read for `experts` experts on `expert_parallel_size` EP
    ranks: a rank's ids are distinct, so a placement has at most experts x E slots; a larger
    file is refused before it is parsed."""
    return PLACEMENT_BASE_BYTES + PLACEMENT_BYTES_PER_SLOT * max(experts, 1) * max(
        expert_parallel_size, 1)


def placement_from_document(data: object, experts: int, expert_parallel_size: int, *,
                            file: str, locate: Locate = _no_location) -> ExpertPlacement:
    """An explicit placement from a placement file's JSON: `{"ranks": [[ids...], ...]}`, one
    list per EP rank. Raises LayoutError naming the file, the rank and the expert; a
    PartcErrors of every one when the file breaks several rules."""
    def fail(pointer: str, message: str) -> LayoutError:
        return ExpertParallelError(f"expert placement {file}: {message}",
                                   location=locate(pointer) or SourceLocation(file),
                                   pointer=pointer, doc=PLACEMENT_DOC)
    if not isinstance(data, Mapping) or set(data) != {"ranks"} or not isinstance(
            data["ranks"], list) or not all(isinstance(r, list) for r in data["ranks"]):
        raise fail("", "expected an object with one key `ranks`: a list of one list of "
                       "global expert ids per EP rank, e.g. {\"ranks\": [[0, 1], [2, 3]]}")
    ranks: list[list[Any]] = data["ranks"]
    crowded = [(f"/ranks/{ep}", f"EP rank {ep} lists {len(ids)} ids but a rank holds at most "
                                f"the model's {plural(experts, 'expert')}, each once")
               for ep, ids in enumerate(ranks) if len(ids) > max(experts, 1)]
    problems = crowded or placement_problems(experts, ranks)
    if ranks and len(ranks) != expert_parallel_size:
        problems.insert(0, ("/ranks", f"it lists {plural(len(ranks), 'EP rank')} but "
                                      f"expert_parallel_size is {expert_parallel_size}"))
    raise_if_any([fail(*problem)
                  for problem in first_problems(problems, MAX_PLACEMENT_ERRORS)])
    return ExpertPlacement(experts=experts, slots=tuple(tuple(r) for r in ranks),
                           explicit=True)


def expert_axis_problem(group: ParameterGroupSpec, axis: int, count: int | None = None
                        ) -> str | None:
    """Why stacked group `group` cannot be split on its expert axis `axis` (None: it can);
    `count` experts on that axis (None: one per row)."""
    if count is not None:
        return None  # the binder checked that `count` divides every member's axis
    counts = {m.shape[axis] if axis < len(m.shape) else None for m in group.members}
    if None in counts:
        short = next(m for m in group.members if axis >= len(m.shape))
        return (f"member `{short.target}` has shape {list(short.shape)}, without the expert "
                f"axis {axis}")
    if len(counts) != 1:
        return (f"its members disagree on the expert count along axis {axis}: "
                + ", ".join(f"`{m.target}` {m.shape[axis]}" for m in group.members))
    return None


def stacked_expert_layouts(group: ParameterGroupSpec, axis: int, experts: Sequence[int],
                           count: int | None = None) -> tuple[LocalTensorLayout, ...]:
    """The layouts of stacked group `group` on an EP rank holding `experts` (ascending ids):
    the rows of those experts along `axis` (each a block of `length / count` rows when the axis
    holds `count` experts), every other axis whole."""
    ranges: list[tuple[int, int]] = []
    for expert in experts:
        if ranges and ranges[-1][1] == expert:
            ranges[-1] = (ranges[-1][0], expert + 1)
        else:
            ranges.append((expert, expert + 1))
    layouts = []
    for member in group.members:
        rows = 1 if count is None else member.shape[axis] // count
        placement: TensorPlacement
        if len(ranges) == 1:
            placement = Range(axis=axis, start=ranges[0][0] * rows, end=ranges[0][1] * rows)
        else:
            placement = Indices(axis=axis, ranges=tuple((a * rows, b * rows) for a, b in ranges))
        local = list(member.shape)
        local[axis] = len(experts) * rows
        layouts.append(LocalTensorLayout(
            target=member.target, logical_name=group.name, role=group.role, dtype=member.dtype,
            global_shape=member.shape, local_shape=tuple(local), placement=placement))
    return tuple(layouts)


EXPERT_LAYOUT = ("build rank = stage * N + r; tp = r mod T, dense replica = r div T, "
                 "ep = r div X, etp = r mod X")
"""The rank layout of an expert-parallel stage of N = E * X ranks, as the plan records it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertParallelPlan:
    """The expert-parallel layout of a plan (docs/expert_parallel.md)."""

    tensor_parallel_size: int
    """T: the dense parts' TP size."""
    expert_tensor_parallel_size: int
    """X: ranks splitting each expert."""
    placement: ExpertPlacement
    """Which experts each EP rank holds, in local slot order."""
    per_expert_groups: int
    """Per-expert groups (`for: {expert: ...}`) of the model."""
    stacked_groups: int
    """Stacked expert groups (`experts: {axis: ...}`) of the model."""
    expert_groups: tuple[tuple[str, int | None], ...] = ()
    """Every routed-expert group by name: its global expert id (per-expert), or None (stacked);
    what a plan reader needs to tell which ranks hold a group's tensors."""

    @property
    def expert_parallel_size(self) -> int:
        """E."""
        return self.placement.expert_parallel_size

    @property
    def ranks_per_stage(self) -> int:
        """N = E * X."""
        return self.expert_parallel_size * self.expert_tensor_parallel_size

    def shape(self, pipeline_parallel_size: int) -> ParallelShape:
        """The sizes of a build of these stages over `pipeline_parallel_size` stages, whose
        `coordinates` place each rank (its stage-local coordinates are the same on every
        stage)."""
        return ParallelShape(tensor_parallel_size=self.tensor_parallel_size,
                             pipeline_parallel_size=pipeline_parallel_size,
                             expert_parallel_size=self.expert_parallel_size,
                             expert_tensor_parallel_size=self.expert_tensor_parallel_size)

    def to_json(self) -> dict[str, object]:
        """JSON form (the plan's `expert_parallel`)."""
        placement = self.placement
        return {"expert_parallel_size": self.expert_parallel_size,
                "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
                "ranks_per_stage": self.ranks_per_stage,
                "dense_replicas": self.ranks_per_stage // self.tensor_parallel_size,
                "layout": EXPERT_LAYOUT, "experts": placement.experts,
                "explicit_placement": placement.explicit,
                "redundant_slots": placement.redundant,
                "slots": [list(ids) for ids in placement.slots],
                "per_expert_groups": self.per_expert_groups,
                "stacked_groups": self.stacked_groups,
                "expert_groups": {name: expert for name, expert in self.expert_groups}}


def model_expert_count(bound: BoundArchitecture) -> int:
    """How many routed experts the bound model has (0: it declares none): one more than the
    largest per-expert id, or the stacked groups' expert-axis length; LayoutError when its
    expert groups disagree."""
    counts: dict[int, str] = {}
    per_expert = [role.expert for _, role in bound.experts if role.expert is not None]
    if per_expert:
        counts[max(per_expert) + 1] = "its per-expert groups"
    groups = {owned.group.name: owned.group for owned in bound.description.groups}
    for name, role in bound.experts:
        if role.axis is None:
            continue
        group = groups[name]
        problem = expert_axis_problem(group, role.axis, role.count)
        if problem is not None:
            raise ExpertParallelError(
                f"stacked expert group `{name}` (experts: {{axis: {role.axis}}}): "
                f"{problem}", tensor=group.members[0].target)
        counts.setdefault(role.count or group.members[0].shape[role.axis],
                          f"stacked group `{name}`")
    if len(counts) > 1:
        raise ExpertParallelError(
            "the routed-expert groups disagree on the expert count: "
            + ", ".join(f"{n} ({what})" for n, what in sorted(counts.items())))
    return next(iter(counts), 0)


def expert_parallel_plan(bound: BoundArchitecture, topology: Topology,
                         group_location: GroupSite | None) -> ExpertParallelPlan | None:
    """The expert-parallel plan of `bound` for `topology` (None without `--ep`); LayoutError
    when the model declares no routed experts, or they do not fit the placement or the ETP size."""
    ep = topology.expert_parallel_size
    if ep is None:
        return None
    count = model_expert_count(bound)
    if count == 0:
        raise ExpertParallelError(
            f"--ep {ep}: family `{bound.family}` declares no routed experts for this config (no "
            "group loops `for: {expert: ...}` or declares `experts: {axis: ...}`), so there is "
            "nothing to place on expert-parallel ranks")
    placement = topology.expert_placement or ExpertPlacement.balanced(count, ep)
    if placement.experts != count:
        raise ExpertParallelError(
            f"the expert placement is for {placement.experts} "
            f"expert{'' if placement.experts == 1 else 's'} but the model routes to {count}")
    stacked = [name for name, role in bound.experts if role.axis is not None]
    if stacked and topology.expert_tensor_parallel_size > 1:
        site = None if group_location is None else group_location(stacked[0])
        raise ExpertParallelError(
            f"stacked expert group `{stacked[0]}` cannot be split over "
            f"expert_tensor_parallel_size {topology.expert_tensor_parallel_size}: a rank of a "
            "stacked group holds whole experts (the rows of its experts on the expert axis); "
            "use --etp 1", location=None if site is None else site[0],
            pointer="" if site is None else site[1])
    return ExpertParallelPlan(
        tensor_parallel_size=topology.tensor_parallel_size,
        expert_tensor_parallel_size=topology.expert_tensor_parallel_size, placement=placement,
        per_expert_groups=sum(1 for _, r in bound.experts if r.expert is not None),
        stacked_groups=len(stacked),
        expert_groups=tuple((name, role.expert) for name, role in bound.experts))


def stacked_template(group: ParameterGroupSpec, role: ExpertGroup, plan: ExpertParallelPlan,
                     realized: dict[object, tuple[tuple[LocalTensorLayout, ...], ...]]
                     ) -> tuple[tuple[LocalTensorLayout, ...], ...]:
    """One row per stage-local rank: the rows of the rank's experts along the expert axis."""
    assert role.axis is not None
    key = ("stacked", role.axis, role.count, group.role,
           tuple((m.dtype, m.shape) for m in group.members), plan.placement.slots,
           plan.expert_tensor_parallel_size)
    template = realized.get(key)
    if template is None:
        per_ep = [stacked_expert_layouts(group, role.axis, ids, role.count)
                  for ids in plan.placement.slots]
        stage = plan.shape(1)
        template = realized[key] = tuple(per_ep[stage.coordinates(r).expert_parallel_rank]
                                         for r in range(plan.ranks_per_stage))
    return template


def expert_parallel_ranks(bound: BoundArchitecture, plan: ExpertParallelPlan,
                          roles: dict[str, ExpertGroup],
                          partitions: list[ArchitecturePartition],
                          stage_groups: list[tuple[PlannedGroup, ...]], kinds: list[GroupKind],
                          global_bytes: int) -> list[RankPlan]:
    """Every rank of an expert-parallel plan: stage * N + r, each with the stage's dense
    groups and its own experts."""
    n, tp = plan.ranks_per_stage, plan.tensor_parallel_size
    pp = len(partitions)
    held = [frozenset(ids) for ids in plan.placement.slots]
    rank_groups: list[list[tuple[PlannedGroup, ...]]] = []
    for groups in stage_groups:
        rank_groups.append([tuple(
            g for g in groups if (role := roles.get(g.name)) is None or role.expert is None
            or role.expert in mine) for mine in held])
    shape = plan.shape(pp)
    coordinates = [[shape.coordinates(rank) for rank in shape.stage_ranks(s)] for s in range(pp)]
    accounting = [[rank_accounting(rank_groups[s][c.expert_parallel_rank], kinds,
                                    c.tensor_parallel_rank, c) for c in coordinates[s]]
                  for s in range(pp)]
    maximum = max(a[1] for stage in accounting for a in stage)
    ranks = []
    for stage, partition in enumerate(partitions):
        for c in coordinates[stage]:
            owned_tensors, local, pinned, by_dtype, expert_bytes = accounting[stage][c.stage_rank]
            rank = shape.rank(c)
            info = ParallelModelInfo(
                model_type=bound.model_type, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                rank=rank, tensor_parallel_rank=c.tensor_parallel_rank, pipeline_stage=stage,
                owned_tensors=owned_tensors, local_parameter_bytes=local,
                global_parameter_bytes=global_bytes, pinned_parameter_bytes=pinned,
                maximum_device_parameter_bytes=maximum, local_bytes_by_dtype=by_dtype,
                ranks_per_stage=n, dense_replica=c.dense_replica,
                expert_parallel_size=plan.expert_parallel_size,
                expert_tensor_parallel_size=plan.expert_tensor_parallel_size,
                expert_parallel_rank=c.expert_parallel_rank,
                expert_tensor_parallel_rank=c.expert_tensor_parallel_rank,
                local_experts=len(plan.placement.slots[c.expert_parallel_rank]) if any(
                    g.name in roles for g in rank_groups[stage][c.expert_parallel_rank]) else 0,
                expert_parameter_bytes=expert_bytes)
            ranks.append(RankPlan(rank=rank, tensor_parallel_rank=c.tensor_parallel_rank,
                                  pipeline_stage=stage, partition=partition, info=info,
                                  groups=rank_groups[stage][c.expert_parallel_rank],
                                  kinds=tuple(kinds), coordinates=c))
    return ranks
