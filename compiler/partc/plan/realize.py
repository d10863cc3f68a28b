"""Stage 5: realize a bound architecture for a topology (TP x PP) as a frozen, canonical plan IR.

Global rank g = stage * T + tensor_parallel_rank (TP innermost). Every parameter group is
realized once for T (`plan.tensor_split`); each pipeline stage keeps the groups its
partition owns (`plan.pipeline_cut`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from partc.errors import LayoutError
from partc.parallel.layout import LocalTensorLayout
from partc.parallel.specs import ShardingPolicy
from partc.partition.boundary import (
    BoundaryWireSchema,
    PipelineActivationDtype,
    PipelineWireContract,
)
from partc.partition.ownership import ExecutionUnit, GroupParallelMode
from partc.plan.expert_placement import (
    expert_parallel_plan,
    expert_parallel_ranks,
    stacked_template,
)
from partc.plan.ir import PipelineSummary, Plan
from partc.plan.pipeline_cut import realize_partition
from partc.plan.ranks import GroupKind, GroupSite, KindIndex, PlannedGroup, dense_ranks
from partc.plan.stage_balance import choose_stages, spell_layout
from partc.plan.state_split import with_state
from partc.plan.tensor_split import realize_group_template
from partc.plan.topology import Topology

if TYPE_CHECKING:
    from partc.bind.binder import BoundArchitecture
    from partc.partition.ownership import ArchitectureParameterDescription, ExecutionGraph



_ACTIVATION_DTYPES = {"F32": PipelineActivationDtype.FLOAT32,
                      "F16": PipelineActivationDtype.FLOAT16,
                      "BF16": PipelineActivationDtype.BFLOAT16}
"""Checkpoint float dtypes that are also pipeline activation dtypes."""


def model_activation_dtype(bound: BoundArchitecture) -> PipelineActivationDtype:
    """The model's own activation dtype: the most common of F32/F16/BF16 among its tensors'
    elements (an FP8 or packed checkpoint's companions decide it), bfloat16 when there is none."""
    counts: dict[str, int] = {}
    for owned in bound.description.groups:
        for member in owned.group.members:
            if member.dtype in _ACTIVATION_DTYPES:
                counts[member.dtype] = counts.get(member.dtype, 0) + math.prod(member.shape)
    if not counts:
        return PipelineActivationDtype.BFLOAT16
    return _ACTIVATION_DTYPES[max(sorted(counts), key=lambda d: counts[d])]


def realize_plan(bound: BoundArchitecture, topology: Topology, *,
                 sources: tuple[tuple[str, str], ...] = (),
                 checkpoint_fingerprint: str | None = None,
                 checkpoint_header_digest: str | None = None,
                 group_location: GroupSite | None = None,
                 omitted: tuple[str, ...] = (),
                 omit: tuple[str, ...] = (),
                 progress: Callable[[int, int], None] | None = None) -> Plan:
    """The plan of `bound` for `topology`; raises LayoutError (created located at the group's
    declaration when `group_location` knows it).

    Each group structure is realized once (`realize_group_template`); groups keep an index to
    their kind, so a rank's tensor layouts are only built when asked for. `progress(done,
    total)` is called as the groups are realized. Under expert parallelism the routed-expert
    groups are realized for the ETP size (per-expert) or per stage-local rank (stacked), and
    each rank keeps only its own experts.
    """
    activation = topology.activation_dtype or model_activation_dtype(bound)
    topology = replace(topology, activation_dtype=activation)  # the plan records it resolved
    tp, pp = topology.tensor_parallel_size, topology.pipeline_parallel_size
    policy = topology.policy or bound.policy or ShardingPolicy.REQUIRE
    description = bound.description
    graph = description.graph
    modes = _group_modes(bound, topology)
    replicated = {g for g, m in modes if m.replicated}
    if replicated:
        description = _replicate_groups(description, replicated)
    expert_plan = expert_parallel_plan(bound, topology, group_location)
    expert_roles = dict(bound.experts) if expert_plan is not None else {}
    kinds: list[GroupKind] = []
    kind_index: dict[tuple[int, KindIndex], int] = {}  # (id of a shared template, index) -> kind
    group_kinds: dict[str, int] = {}
    realized: dict[object, tuple[tuple[LocalTensorLayout, ...], ...]] = {}
    for done, owned in enumerate(description.groups):
        if progress is not None:
            progress(done, len(description.groups))
        site = None if group_location is None else group_location(owned.group.name)
        location, pointer = (None, "") if site is None else site
        role = expert_roles.get(owned.group.name)
        by = KindIndex.TENSOR
        if role is None or expert_plan is None:
            template = realize_group_template(owned.group, tp, policy,
                                              policy_overrides_group=topology.policy is not None,
                                              cache=realized, location=location,
                                              pointer=pointer, split=topology.split)
        elif role.expert is not None:
            by = KindIndex.EXPERT_TENSOR
            template = realize_group_template(owned.group, expert_plan.expert_tensor_parallel_size,
                                              policy,
                                              policy_overrides_group=topology.policy is not None,
                                              cache=realized, location=location,
                                              pointer=pointer, split=topology.split)
        else:
            by = KindIndex.LOCAL
            template = stacked_template(owned.group, role, expert_plan, realized)
        index = kind_index.get((id(template), by))
        if index is None:
            index = kind_index[(id(template), by)] = len(kinds)
            kinds.append(GroupKind(layouts=template, index=by))
        group_kinds[owned.group.name] = index
    if progress is not None:
        progress(len(description.groups), len(description.groups))
    wire = PipelineWireContract(schema=bound.boundary, activation_dtype=activation)
    multi = sum(1 for g in graph.groups if g.units) > 1
    summary: PipelineSummary | None = None
    cuts: tuple[tuple[int, str, BoundaryWireSchema], ...] = ()
    if multi or topology.stage_layout is not None or topology.group_modes:
        unit_bytes = _unit_bytes(description, kinds, group_kinds)
        choice = _located_layout(lambda: choose_stages(
            graph, pp, unit_bytes=unit_bytes, weights=dict(bound.group_weights),
            explicit=topology.stage_units, layout=topology.stage_layout,
            whole=[g for g, m in modes if m.one_stage], by_bytes=multi))
        ranges = choice.ranges
        contracts = _cut_contracts(bound, graph, ranges, activation)
        cuts = tuple((s, g, c.schema) for s, (g, c) in enumerate(contracts)) if (
            bound.group_boundaries) else ()
        partitions = [realize_partition(
            description, s, pp, boundary=wire, stage_ranges=ranges,
            receive_boundary=contracts[s - 1][1] if cuts and s else None,
            send_boundary=contracts[s][1] if cuts and s < pp - 1 else None)
            for s in range(pp)]
    else:
        partitions = [realize_partition(description, s, pp, topology.stage_units, boundary=wire)
                      for s in range(pp)]
    group_stages: dict[str, list[int]] = {}
    for stage, partition in enumerate(partitions):
        for binding in partition.parameter_bindings:
            group_stages.setdefault(binding.group, []).append(stage)
    groups = tuple(PlannedGroup(name=owned.group.name, owner=owned.owner,
                                targets=owned.group.targets, kind=group_kinds[owned.group.name],
                                stages=tuple(group_stages.get(owned.group.name, ())))
                   for owned in description.groups)
    unowned = next((g for g in groups if not g.stages), None)
    if unowned is not None:
        raise LayoutError(f"tensor `{unowned.targets[0]}` is loaded by no pipeline stage (its "
                          "owner is a static role no stage holds)", tensor=unowned.targets[0])
    by_name = {g.name: g for g in groups}
    stage_groups = [tuple(by_name[b.group] for b in partition.parameter_bindings)
                    for partition in partitions]
    global_bytes = sum(m.nbytes for g in description.groups for m in g.group.members)
    if expert_plan is not None:
        ranks = expert_parallel_ranks(bound, expert_plan, expert_roles, partitions,
                                       stage_groups, kinds, global_bytes)
    else:
        ranks = dense_ranks(bound, tp, pp, partitions, stage_groups, kinds, global_bytes)
    ranks = with_state(ranks, bound.states, activation)
    if multi or topology.stage_layout is not None or topology.group_modes:
        summary = PipelineSummary(
            balance=choice.balance,
            layout=spell_layout(graph, ranges, description.static_roles),
            stage_bytes=tuple(max(r.info.local_parameter_bytes for r in ranks
                                  if r.pipeline_stage == s) for s in range(pp)),
            group_modes=tuple((g.name, dict(modes)[g.name]) for g in graph.canonical_order()))
    return Plan(
        family=bound.family, model_type=bound.model_type, topology=topology, sources=sources,
        config_values=bound.config_values,
        graph=graph.canonical_order(), static_roles=description.static_roles,
        boundary=bound.boundary,
        groups=groups, kinds=tuple(kinds), ranks=tuple(ranks),
        checkpoint_fingerprint=checkpoint_fingerprint,
        checkpoint_header_digest=checkpoint_header_digest, omitted=omitted, omit=omit,
        pipeline=summary, cuts=cuts, expert_parallel=expert_plan)


def _located_layout(choose: Callable[[], Any]) -> Any:
    """A stage choice; its partition error as the LayoutError the CLI reports."""
    from partc.errors import ArchitecturePartitionError

    try:
        return choose()
    except ArchitecturePartitionError as error:
        raise LayoutError(error.message, doc="boundaries#units-and-stages") from None


def _group_modes(bound: BoundArchitecture, topology: Topology
                 ) -> tuple[tuple[str, GroupParallelMode], ...]:
    """Every execution group's parallel mode: `--group-mode`, else the family's, else split."""
    names = [g.name for g in bound.description.graph.canonical_order()]
    chosen = dict(bound.group_modes)
    for group, mode in topology.group_modes:
        if group not in names:
            raise LayoutError(f"--group-mode names unknown execution group `{group}`; known: "
                              f"{', '.join(names)}",
                              doc="boundaries#one-boundary-or-one-per-execution-group")
        chosen[group] = mode
    return tuple((g, chosen.get(g, GroupParallelMode.SPLIT)) for g in names)


def _replicate_groups(description: ArchitectureParameterDescription, groups: set[str]
                      ) -> ArchitectureParameterDescription:
    """The description with every parameter group owned by a unit of `groups`, or by a static
    role placed with one of them, whole on every tensor-parallel rank."""
    from partc.parallel.specs import ReplicatedSharding
    from partc.partition.ownership import OwnedParameterGroupSpec

    roles = {r.name for r in description.static_roles if r.group in groups}
    whole = ReplicatedSharding()
    owned = []
    for item in description.groups:
        owner = item.owner
        if (isinstance(owner, ExecutionUnit) and owner.group in groups) or (
                owner.static_roles and set(owner.static_roles) <= roles):
            spec = replace(item.group, units=None, members=tuple(
                replace(m, sharding=whole, heads=()) for m in item.group.members))
            owned.append(OwnedParameterGroupSpec(group=spec, owner=owner))
        else:
            owned.append(item)
    return replace(description, groups=tuple(owned))


def _unit_bytes(description: ArchitectureParameterDescription, kinds: list[GroupKind],
                group_kinds: dict[str, int]) -> list[int]:
    """Parameter bytes (tensor-parallel rank 0) of each canonical unit, with each static
    role's bytes counted on the unit it sits with (the first or last of the model or of its
    group)."""
    graph = description.graph
    layout = graph.unit_layout()
    index = {(u.group, u.unit): i for i, u in enumerate(layout)}
    costs = [0] * len(layout)
    if not costs:
        return costs
    anchors: dict[str, int] = {}
    for role in description.static_roles:
        if role.group is None:
            anchors[role.name] = 0 if role.side.value == "first" else len(layout) - 1
        else:
            start, end = graph.group_range(role.group)
            unit = start if role.side.value == "first" or start == end else end - 1
            anchors[role.name] = min(unit, len(layout) - 1)
    for item in description.groups:
        nbytes = kinds[group_kinds[item.group.name]].accounting(0)[0]
        owner = item.owner
        if isinstance(owner, ExecutionUnit):
            costs[index[(owner.group, owner.unit)]] += nbytes
        else:
            for name in sorted(set(owner.static_roles)):
                costs[anchors[name]] += nbytes
    return costs


def _cut_contracts(bound: BoundArchitecture, graph: ExecutionGraph, ranges: Any,
                   activation: PipelineActivationDtype
                   ) -> list[tuple[str, PipelineWireContract]]:
    """Per cut (after stage s), the group of the unit before it and what crosses it: that
    group's declared boundary, else the family's."""
    layout = graph.unit_layout()
    schemas = dict(bound.group_boundaries)
    out = []
    for _, end in ranges[:-1]:
        group = layout[end - 1].group
        out.append((group, PipelineWireContract(schema=schemas.get(group, bound.boundary),
                                                activation_dtype=activation)))
    return out
