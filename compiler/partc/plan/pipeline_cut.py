"""Cutting the pipeline: the canonical units of an execution graph split into stages (balanced,
explicit counts, or least largest-stage cost), and one stage's partition realized from them."""

from __future__ import annotations

from collections.abc import Sequence

from partc.errors import ArchitecturePartitionErrorKind
from partc.parallel.shape import size_problem
from partc.parallel.specs import balanced_contiguous_range
from partc.partition.boundary import PipelineWireContract
from partc.partition.ownership import (
    ArchitectureParameterDescription,
    ExecutionGraph,
    Range,
    StageSide,
    StaticRoleSpec,
    partition_error,
)
from partc.partition.pipeline import (
    ArchitecturePartition,
    PartitionGroup,
    PartitionOwnership,
    PartitionParameterBinding,
    PartitionState,
)


def pipeline_stage_ranges(total_units: int, stages: int,
                          explicit: Sequence[int] | None = None) -> tuple[Range, ...]:
    """Split `total_units` canonical units into `stages` contiguous, non-empty ranges.

    Balanced by default (DESIGN §3); `explicit` gives each stage's unit count.
    """
    kinds = ArchitecturePartitionErrorKind
    if (problem := size_problem("pipeline_parallel_size", stages)) is not None:
        raise partition_error(kinds.INVALID_STAGES, problem)
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != stages:
            raise partition_error(kinds.INVALID_STAGES,
                                   f"{len(counts)} explicit stage sizes {counts} given for "
                                   f"pipeline_parallel_size {stages}; give one per stage")
        empty = [i for i, c in enumerate(counts) if c < 1]
        if empty:
            raise partition_error(kinds.INVALID_STAGES,
                                   f"explicit stage sizes {counts} give stage {empty[0]} "
                                   f"{counts[empty[0]]} units; every stage needs at least one")
        if sum(counts) != total_units:
            raise partition_error(kinds.INVALID_STAGES,
                                   f"explicit stage sizes {counts} sum to {sum(counts)}, but the "
                                   f"model has {total_units} execution units")
        ranges = []
        start = 0
        for count in counts:
            ranges.append((start, start + count))
            start += count
        return tuple(ranges)
    if total_units == 0:
        raise partition_error(
            kinds.INVALID_STAGES,
            f"the model has no execution units to split over {stages} pipeline stage(s): "
            "expected at least one unit (check the `units` of the family's execution groups)")
    if stages > total_units:
        raise partition_error(
            kinds.INVALID_STAGES,
            f"pipeline_parallel_size {stages} exceeds the {total_units} execution units of the "
            f"model; every stage needs at least one unit (use --pp {total_units} or fewer)")
    return tuple(balanced_contiguous_range(total_units, stages, s) for s in range(stages))


def cost_balanced_stage_ranges(costs: Sequence[int], stages: int,
                               keep_whole: Sequence[Range] = ()) -> tuple[Range, ...]:
    """Split units of the given `costs` (canonical order) into `stages` contiguous, non-empty
    ranges minimizing the largest stage cost; no cut falls strictly inside a `keep_whole`
    range. Ties go to the split whose earlier stages end first (deterministic)."""
    kinds = ArchitecturePartitionErrorKind
    total = len(costs)
    allowed = [all(not a < cut < b for a, b in keep_whole) for cut in range(total + 1)]
    possible = sum(allowed[1:total]) + 1
    if stages > possible:
        raise partition_error(
            kinds.INVALID_STAGES,
            f"pipeline_parallel_size {stages} exceeds the {possible} stage(s) the model can be "
            f"cut into ({total} execution units, groups kept on one stage stay whole); use --pp "
            f"{possible} or fewer")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = prefix[-1] + 1
    # best[k][i]: least largest-stage cost of the first i units over k stages
    best = [[infinity] * (total + 1) for _ in range(stages + 1)]
    choice = [[0] * (total + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, total + 1):
            if not allowed[i]:
                continue
            for j in range(k - 1, i):
                if not allowed[j] or best[k - 1][j] == infinity:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    ranges: list[Range] = []
    end = total
    for k in range(stages, 0, -1):
        start = choice[k][end]
        ranges.append((start, end))
        end = start
    return tuple(reversed(ranges))


def static_roles_on_stage(roles: Sequence[StaticRoleSpec], stage: int, stages: int,
                          graph: ExecutionGraph | None = None,
                          ranges: Sequence[Range] | None = None) -> tuple[str, ...]:
    """Names of the static roles that sit on `stage`, sorted (a role placed with a group needs
    the graph and every stage's canonical range)."""
    local = []
    for role in roles:
        if role.group is not None:
            if graph is not None and ranges is not None and role.stage(graph, ranges) == stage:
                local.append(role.name)
        elif (role.side is StageSide.FIRST and stage == 0) or (
                role.side is StageSide.LAST and stage == stages - 1):
            local.append(role.name)
    return tuple(sorted(local))


def realize_partition(description: ArchitectureParameterDescription, stage: int, stages: int,
                      explicit: Sequence[int] | None = None, *,
                      boundary: PipelineWireContract | None = None,
                      stage_ranges: Sequence[Range] | None = None,
                      receive_boundary: PipelineWireContract | None = None,
                      send_boundary: PipelineWireContract | None = None
                      ) -> ArchitecturePartition:
    """The partition of pipeline stage `stage` of `stages` (balanced, `explicit` counts, or the
    canonical `stage_ranges` of every stage)."""
    graph = description.graph
    ranges = (tuple(stage_ranges) if stage_ranges is not None
              else pipeline_stage_ranges(graph.total_units, stages, explicit))
    if not 0 <= stage < stages:
        raise partition_error(ArchitecturePartitionErrorKind.INVALID_STAGES,
                               f"stage {stage} is outside pipeline stages 0..{stages - 1}")
    start, end = ranges[stage]
    parts: list[PartitionGroup] = []
    state_start = state_end = None
    state_before = 0
    offset = 0
    for group in graph.canonical_order():
        lo, hi = max(start, offset), min(end, offset + group.units)
        if group.carries_state:
            state_before += max(0, min(start, offset + group.units) - offset)
        if lo < hi:
            parts.append(PartitionGroup(group=group.name, unit_range=(lo - offset, hi - offset)))
            if group.carries_state:
                base = graph.state_offset(group.name) - offset
                state_start = base + lo if state_start is None else state_start
                state_end = base + hi
        offset += group.units
    if state_start is None or state_end is None:
        state_start = state_end = state_before
    # a static role no parameter group is owned by holds nothing: the partition never claims it
    backed = {r for g in description.groups for r in g.owner.static_roles}
    roles = tuple(r for r in static_roles_on_stage(description.static_roles, stage, stages,
                                                   graph, ranges) if r in backed)
    units = {p.group: p.unit_range for p in parts}
    bindings = tuple(PartitionParameterBinding(group=g.group.name, owner=g.owner,
                                               targets=g.group.targets)
                     for g in description.groups if g.owner.is_local(units, roles))
    return ArchitecturePartition(
        graph=graph, stage=stage, stages=stages, canonical_range=(start, end), groups=tuple(parts),
        ownership=PartitionOwnership(owns_input=stage == 0, owns_output=stage == stages - 1,
                                     static_roles=roles),
        state=PartitionState(units=state_end - state_start, global_range=(state_start, state_end)),
        parameter_bindings=bindings, boundary=boundary, receive_boundary=receive_boundary,
        send_boundary=send_boundary)


def realize_pipeline(description: ArchitectureParameterDescription, stages: int,
                     explicit: Sequence[int] | None = None, *,
                     boundary: PipelineWireContract | None = None
                     ) -> tuple[ArchitecturePartition, ...]:
    """Every stage's partition, in stage order."""
    return tuple(realize_partition(description, s, stages, explicit, boundary=boundary)
                 for s in range(stages))
