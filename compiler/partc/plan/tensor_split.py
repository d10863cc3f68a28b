"""Realization of one parameter group for a tensor-parallel size: placements, KV replicas."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

from partc.errors import SourceLocation
from partc.parallel.layout import LocalTensorLayout, ParameterRole, invalid_group
from partc.parallel.placements import (
    LOCAL,
    OMIT,
    REPLICATED,
    Indices,
    Range,
    Shard,
    TensorPlacement,
    local_shape,
)
from partc.parallel.shape import size_problem
from partc.parallel.specs import (
    BalancedSharding,
    EqualSharding,
    ParameterGroupSpec,
    ParameterMemberSpec,
    PartitionedSharding,
    ReplicatedSharding,
    SegmentedSharding,
    ShardingPolicy,
    TensorSplit,
    balanced_contiguous_range,
    chunk_range,
)


def _split_range(items: int, parts: int, index: int, split: TensorSplit) -> tuple[int, int]:
    if split is TensorSplit.CHUNK:
        return chunk_range(items, parts, index)
    return balanced_contiguous_range(items, parts, index)


def _empty_chunks(items: int, parts: int) -> list[int]:
    """The parts torch.chunk leaves empty when it splits `items` over `parts`."""
    return [i for i in range(parts) if chunk_range(items, parts, i)[0] >= items]


def _chunk_problem(what: str, items: int, tp: int) -> str:
    """Why torch.chunk's split of `items` over `tp` ranks cannot be a partc split."""
    width = -(-items // tp)
    empty = _empty_chunks(items, tp)
    return (f"{what}: with --split chunk, torch.chunk cuts {items} into {-(-items // width)} "
            f"chunks of at most {width} over {tp} ranks, leaving TP rank"
            f"{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} empty, and every rank "
            "of a partc build holds a part; use --split balanced, or a tensor_parallel_size "
            "torch.chunk fills")


def _merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if a == b:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return tuple(merged)


def _head_range(width: int, heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Rank's range of a `heads`-head axis under KV replication: split, or one repeated head."""
    if heads % tp == 0:
        return rank * width // tp, (rank + 1) * width // tp
    head = rank * heads // tp
    return head * width // heads, (head + 1) * width // heads


def _placement_for(member: ParameterMemberSpec, tp: int, rank: int,
                   unit_range: tuple[int, int] | None, units: int | None,
                   kv: bool, split: TensorSplit = TensorSplit.BALANCED) -> TensorPlacement:
    """The placement of `member` on tensor-parallel rank `rank` (legality already checked)."""
    rule = member.sharding
    if tp == 1:
        return LOCAL
    if member.head is not None:  # whole on the ranks holding its head, absent elsewhere
        index, count = member.head
        if kv:
            a, b = _head_range(count, count, tp, rank)
        else:
            assert unit_range is not None and units is not None
            a, b = unit_range[0] * count // units, unit_range[1] * count // units
        return REPLICATED if a <= index < b else OMIT
    match rule:
        case ReplicatedSharding():
            return REPLICATED
        case EqualSharding():
            return Shard(axis=rule.axis, index=rank, parts=tp)
        case BalancedSharding():
            dim = member.shape[rule.axis]
            start, end = _split_range(-(-dim // rule.granule), tp, rank, split)
            return Range(axis=rule.axis, start=start * rule.granule,
                         end=min(end * rule.granule, dim))
    ranges: list[tuple[int, int]] = []
    offset = 0
    for i, width in enumerate(member.widths):
        if isinstance(rule, SegmentedSharding):
            a, b = rank * width // tp, (rank + 1) * width // tp
        elif kv:
            a, b = _head_range(width, member.heads[i], tp, rank)
        else:
            assert unit_range is not None and units is not None
            a, b = unit_range[0] * width // units, unit_range[1] * width // units
        if rule.groups == 1:
            ranges.append((offset + a, offset + b))
        else:
            ranges.extend(_interleaved_rows(member.widths, rule.groups, i, offset, a, b))
        offset += width
    if isinstance(rule, PartitionedSharding):
        return Range(axis=rule.axis, start=ranges[0][0], end=ranges[0][1])
    return Indices(axis=rule.axis, ranges=_merge_ranges(sorted(ranges)))


def _interleaved_rows(widths: tuple[int, ...], groups: int, segment: int, offset: int,
                      start: int, end: int) -> list[tuple[int, int]]:
    """The stored rows of rows `[start, end)` of segment `segment` (in its own numbering) when
    the axis interleaves `groups` blocks, each holding `width / groups` rows of every segment.

    Block `g` starts at `g * sum(widths) / groups`; inside it segment `i` starts after the
    block's rows of the segments before it (`offset / groups`).
    """
    block = sum(widths) // groups
    width = widths[segment] // groups
    inner = offset // groups
    out = []
    for g in range(start // width, -(-end // width)):
        lo, hi = max(start, g * width), min(end, (g + 1) * width)
        if lo < hi:
            base = g * block + inner - g * width
            out.append((base + lo, base + hi))
    return out


def _kv_replicas(member: ParameterMemberSpec, tp: int) -> int:
    heads = member.heads if member.head is None else (member.head[1],)
    return max((tp // h for h in heads if h < tp and tp % h == 0), default=1)


def _per_head_problems(group: ParameterGroupSpec, tp: int, kv: bool) -> list[tuple[str, str]]:
    """Why the per-head tensors of `group` cannot follow its heads over `tp` ranks: each
    rank's share of the partition units must be whole heads of every per-head count (under KV
    replication: a count `tp` divides, or one dividing `tp`)."""
    problems: list[tuple[str, str]] = []
    units = group.units
    for member in group.members:
        if member.head is None or member.head[0]:
            continue  # one message per per-head module, at its head 0
        count, target = member.head[1], member.target
        if kv and count % tp and tp % count:
            problems.append((target, f"`{target}` is one of {count} per-head tensors and "
                                     f"{count} heads neither split over nor repeat evenly on "
                                     f"tensor_parallel_size {tp}"))
        elif not kv and units is not None and count % units:
            problems.append((target, f"`{target}` is one of {count} per-head tensors, which the "
                                     f"group's {units} partition units cannot divide into whole "
                                     "heads"))
    return problems


def _kv_problems(group: ParameterGroupSpec, tp: int) -> list[tuple[str, str]]:
    """Why KV replication cannot realize `group` over `tp` ranks (docs/kv_replication.md).

    Members (or segments) with the group's largest head count hold query-side heads and are
    split; those with fewer heads hold KV heads and are repeated when they cannot be split.
    """
    query = max(h for m in group.members for h in m.heads)
    problems: list[tuple[str, str]] = []
    counts = False
    for member in group.members:
        rule = member.sharding
        if isinstance(rule, ReplicatedSharding) or not rule.is_partitioned:
            continue
        target, granule = member.target, rule.granule
        whole = f"whole {granule}-element blocks" if granule > 1 else "whole elements"
        for width, heads in zip(member.widths, member.heads, strict=True):
            if heads % tp == 0:
                if width % (tp * granule):
                    problems.append((target, f"`{target}`: splitting its {heads} heads over "
                                             f"{tp} ranks cuts its {width} elements into pieces "
                                             f"that are not {whole}"))
            elif heads == query:
                counts = True
                problems.append((target, f"`{target}` has {heads} query heads, not divisible by "
                                         f"tensor_parallel_size {tp}"))
            elif tp % heads:
                counts = True
                problems.append((target, f"`{target}` has {heads} KV heads and "
                                         f"tensor_parallel_size {tp} is not a multiple of {heads}"))
            elif width % (heads * granule):
                problems.append((target, f"`{target}`: one of its {heads} KV heads spans "
                                         f"{width}/{heads} elements, not {whole}, so it cannot "
                                         "be repeated"))
            elif member.tp_reduction:
                problems.append((target, f"`{target}` needs a tensor-parallel reduction of its "
                                         f"statistic, and repeating its {heads} KV heads over "
                                         f"{tp} ranks would count each of them {tp // heads} "
                                         "times in it"))
    if counts:
        problems.append(("", "KV replication (vLLM's rule) needs tensor_parallel_size to divide "
                             "the query head count and to be a multiple of the KV head count"))
    return problems


def _problems(group: ParameterGroupSpec, tp: int, split: TensorSplit = TensorSplit.BALANCED
              ) -> tuple[list[tuple[str, str]], bool]:
    """(target, message) for every reason `group` cannot be sharded over `tp`; and KV mode."""
    problems: list[tuple[str, str]] = []
    if tp == 1:
        return problems, False
    for member in group.members:
        rule, target = member.sharding, member.target
        if isinstance(rule, ReplicatedSharding):
            continue
        dim, g = member.shape[rule.axis], rule.granule
        unit = f"{g}-element blocks" if g > 1 else "elements"
        if isinstance(rule, EqualSharding) and dim % (tp * g):
            problems.append((target, f"`{target}`: axis {rule.axis} has {dim} elements, not "
                                     f"divisible into {tp} equal shards of whole {unit}"))
        elif isinstance(rule, BalancedSharding) and -(-dim // g) < tp:
            problems.append((target, f"`{target}`: axis {rule.axis} has {-(-dim // g)} {unit}, "
                                     f"fewer than tensor_parallel_size {tp} (balanced ranges)"))
        elif isinstance(rule, BalancedSharding) and split is TensorSplit.CHUNK and \
                _empty_chunks(-(-dim // g), tp):
            problems.append((target, _chunk_problem(f"`{target}`: axis {rule.axis} has "
                                                    f"{-(-dim // g)} {unit}", -(-dim // g), tp)))
        elif isinstance(rule, SegmentedSharding) and any(
                segment % (tp * g) for segment in rule.segments):
            problems.append((target, f"`{target}`: segments {list(rule.segments)} are not each "
                                     f"divisible into {tp} shards of whole {unit}"))
    units = group.units
    if units is not None and units >= tp:
        problems.extend(_per_head_problems(group, tp, kv=False))
    if units is not None and units >= tp and split is TensorSplit.CHUNK and \
            _empty_chunks(units, tp):
        label = f" ({group.units_label})" if group.units_label else ""
        problems.append(("", _chunk_problem(f"it has {units} partition units{label}", units,
                                            tp)))
    if units is None or units >= tp:
        return problems, False
    label = f" ({group.units_label})" if group.units_label else ""
    if group.kv_replication:
        kv = _kv_problems(group, tp) + _per_head_problems(group, tp, kv=True)
        if not kv:
            return problems, True
        problems.append((kv[0][0], f"it has {units} partition units{label}, fewer than "
                                   f"{tp} ranks, so KV replication applies and {kv[0][1]}"))
        problems.extend(kv[1:])
        return problems, False
    hint = ""
    if group.role is ParameterRole.ATTENTION_HEADS:
        split_members = [m for m in group.members if m.sharding.is_partitioned]
        kv = (_kv_problems(group, tp) if split_members and all(m.heads for m in split_members)
              else [])
        fused = [m.target for m in group.members  # fused rows declared component-major
                 if not isinstance(m.sharding, ReplicatedSharding)
                 and len(m.sharding.segments) > 1 and m.sharding.groups == 1]
        grouped = (f"; but `{fused[0]}` fuses its q, k and v rows, and repeating KV heads is "
                   "only right if they are component-major: rows grouped per KV head (each "
                   "group's queries, then its key and value, as Falcon's new decoder stores "
                   "them) need `layout: grouped_per_kv` with `heads:` per segment instead, see "
                   "`partc docs layouts`; `partc verify` at this size tells the two apart"
                   ) if fused else ""
        hint = (" (or set `kv_replication: true` with `heads:` on its projections to repeat KV "
                f"heads, see `partc docs kv_replication`{grouped})") if not kv else (
                f" (repeating KV heads cannot help here: {kv[0][1]})")
    problems.append(("", f"it (role {group.role.value}) has {units} partition units{label} but "
                         f"tensor_parallel_size is {tp}: every rank needs at least one unit; use a "
                         f"tensor_parallel_size of at most {units}{hint}"))
    return problems, False


def group_sharding_problems(group: ParameterGroupSpec, tp: int,
                            split: TensorSplit = TensorSplit.BALANCED) -> list[str]:
    """Why `group` cannot be sharded over `tp` ranks (empty when it can)."""
    return [message for _, message in _problems(group, tp, split)[0]]


def realize_group(group: ParameterGroupSpec, tensor_parallel_size: int,
                  policy: ShardingPolicy = ShardingPolicy.REQUIRE, *,
                  policy_overrides_group: bool = False,
                  split: TensorSplit = TensorSplit.BALANCED
                  ) -> tuple[tuple[LocalTensorLayout, ...], ...]:
    """Each tensor-parallel rank's layouts of `group`'s members (outer index: rank).

    An illegal shard raises ParallelPlanError under Require (the group's own policy wins over
    `policy`); under ReplicateUnsupported the whole group is replicated and every layout records
    `fell_back_to_replication`. With `kv_replication` and fewer units than ranks, query heads are
    split over all ranks and each KV head repeated (docs/kv_replication.md).
    `policy_overrides_group` makes `policy` win over the group's own (a command-line choice).
    `split` is how uneven splits (balanced members, partition units) give out the remainder.
    """
    template = realize_group_template(group, tensor_parallel_size, policy,
                                      policy_overrides_group=policy_overrides_group,
                                      split=split)
    return tuple(tuple(layout.renamed(member.target, group.name)
                       for layout, member in zip(rank_layouts, group.members, strict=True))
                 for rank_layouts in template)


def realize_group_template(group: ParameterGroupSpec, tensor_parallel_size: int,
                           policy: ShardingPolicy = ShardingPolicy.REQUIRE, *,
                           policy_overrides_group: bool = False,
                           cache: dict[object, tuple[tuple[LocalTensorLayout, ...], ...]]
                           | None = None, location: SourceLocation | None = None,
                           pointer: str = "", split: TensorSplit = TensorSplit.BALANCED
                           ) -> tuple[tuple[LocalTensorLayout, ...], ...]:
    """`realize_group` up to names: the one realization every group of `group`'s structure
    shares (the same object for all of them), named after the first such group realized.

    Groups differ structurally when any member's dtype, shape or sharding, or the group's role,
    units, KV replication or effective policy differ; names take no part in realization.
    `cache` holds the realizations by structure (default: one kept by this module); a plan
    passes its own, so that what it shares never depends on earlier plans. `location` and
    `pointer` name where the group is declared; the errors raised carry them.
    """
    tp = tensor_parallel_size
    if (problem := size_problem("tensor_parallel_size", tp)) is not None:
        raise invalid_group(problem, group=group.name, location=location, pointer=pointer)
    effective = policy if policy_overrides_group else (group.policy or policy)
    key = (tp, effective, group.role, group.units, group.kv_replication,
           tuple(_member_structure(m) for m in group.members), split)
    realized = _REALIZED if cache is None else cache
    template = realized.get(key)
    if template is None:
        template = _realize_uncached(group, tp, effective, location, pointer, split)
        if cache is None and len(_REALIZED) > 4096:
            _REALIZED.clear()
        realized[key] = template
    return template


_REALIZED: dict[object, tuple[tuple[LocalTensorLayout, ...], ...]] = {}
"""Realizations by group structure: groups that differ only in names share one."""


_MEMBER_FIELDS = tuple(f.name for f in fields(ParameterMemberSpec) if f.name != "target")


def _member_structure(member: ParameterMemberSpec) -> tuple[object, ...]:
    return tuple(getattr(member, name) for name in _MEMBER_FIELDS)


def _realize_uncached(group: ParameterGroupSpec, tp: int, effective: ShardingPolicy,
                      location: SourceLocation | None = None, pointer: str = "",
                      split: TensorSplit = TensorSplit.BALANCED
                      ) -> tuple[tuple[LocalTensorLayout, ...], ...]:
    problems, kv = _problems(group, tp, split)
    if problems and effective is ShardingPolicy.REQUIRE:
        targets = {t for t, _ in problems}
        raise invalid_group(
            f"group `{group.name}` cannot be sharded over tensor_parallel_size {tp}: "
            + "; ".join(m for _, m in problems) + ". Use a tensor-parallel size the group "
            f"allows, or set `policy: replicate_unsupported` on group `{group.name}` (CLI: "
            "--policy replicate-unsupported) to replicate it", group=group.name,
            target=targets.pop() if len(targets) == 1 else "", location=location,
            pointer=pointer, doc="kv_replication#the-rule-vllms" if group.kv_replication else None)
    fallback = bool(problems)
    reason = "; ".join(m for _, m in problems)
    result = []
    for rank in range(tp):
        units: int | None = None
        unit_range: tuple[int, int] | None = None
        if group.units is not None and not fallback:
            units, unit_range = group.units, _split_range(group.units, tp, rank, split)
            if kv:
                units, unit_range = tp, (rank, rank + 1)
        layouts = []
        for member in group.members:
            placement = REPLICATED if fallback else _placement_for(
                member, tp, rank, unit_range, group.units, kv, split)
            local = local_shape(member.shape, placement.selection(member.shape))
            layouts.append(LocalTensorLayout(
                target=member.target, logical_name=group.name, role=group.role,
                dtype=member.dtype, global_shape=member.shape, local_shape=local,
                placement=placement, logical_units=units, logical_range=unit_range,
                fell_back_to_replication=fallback, fallback_reason=reason,
                kv_replicas=_kv_replicas(member, tp) if kv else 1,
                needs_tp_reduction=member.tp_reduction and not placement.holds_whole,
                needs_tp_output_reduction=member.tp_output_reduction
                and not placement.holds_whole))
        result.append(tuple(layouts))
    return tuple(result)
