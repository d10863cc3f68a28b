"""Choosing pipeline stages for a multi-group execution graph, and spelling the choice.

A stage layout names, per stage, how many units of each execution group it runs; it is written
the way Megatron-LM spells `--pipeline-model-parallel-layout`: stages separated by `|`, each a
comma-separated run of `group*count` items (`group` alone for one unit), static roles in
brackets where they sit, e.g. `[vision_embeddings],vision*2,[vision_unused]|projector,
[embedding],decoder*2,[final_norm],[output]`. `--pp-layers` accepts the same text (bracketed
static roles are ignored: the family places them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from partc.errors import ArchitecturePartitionErrorKind
from partc.partition.ownership import (
    ExecutionGraph,
    Range,
    StageSide,
    StaticRoleSpec,
    partition_error,
)
from partc.plan.pipeline_cut import cost_balanced_stage_ranges, pipeline_stage_ranges

StageLayout = tuple[tuple[tuple[str, int], ...], ...]
"""Per stage, its (execution group, unit count) runs in canonical order."""

_ITEM = re.compile(r"^(?P<group>[A-Za-z_][A-Za-z0-9_]*)(?:\*(?P<count>[0-9]+))?$")


def _layout_error(message: str) -> Exception:
    return partition_error(ArchitecturePartitionErrorKind.INVALID_STAGES, message)


def is_named_layout(text: str) -> bool:
    """Whether a `--pp-layers` value names groups (else it is comma-separated unit counts)."""
    return any(c.isalpha() or c in "|*[" for c in text)


def parse_stage_layout(text: str) -> StageLayout:
    """The stage layout spelled `text` (`vision*3,projector|decoder*2`); raises on bad syntax."""
    stages = []
    for index, part in enumerate(text.split("|")):
        runs: list[tuple[str, int]] = []
        for raw in part.replace("+", ",").split(","):
            item = raw.strip()
            if not item or (item.startswith("[") and item.endswith("]")):
                continue
            match = _ITEM.match(item)
            if match is None or match["count"] == "0":
                raise _layout_error(
                    f"stage {index} of stage layout {text!r} has item {item!r}; expected "
                    "`group` or `group*count` (count >= 1), stages separated by `|`")
            runs.append((match["group"], int(match["count"] or 1)))
        stages.append(tuple(runs))
    return tuple(stages)


def resolve_stage_layout(graph: ExecutionGraph, layout: StageLayout) -> tuple[Range, ...]:
    """Each stage's canonical unit range for a named layout, with every error broken down per
    execution group (unknown groups, counts that do not add up, runs out of canonical order)."""
    order = [g.name for g in graph.canonical_order()]
    units = {g.name: g.units for g in graph.groups}
    empty = [i for i, runs in enumerate(layout) if not runs]
    if empty:
        raise _layout_error(f"stage {empty[0]} of the stage layout runs no units; every stage "
                            "needs at least one")
    unknown = sorted({g for runs in layout for g, _ in runs if g not in units})
    if unknown:
        raise _layout_error(f"the stage layout names unknown execution group(s) "
                            f"{', '.join(f'`{g}`' for g in unknown)}; known: {', '.join(order)}")
    given: dict[str, list[tuple[int, int]]] = {}
    for stage, runs in enumerate(layout):
        for group, count in runs:
            given.setdefault(group, []).append((stage, count))
    wrong = []
    for group in order:
        counts = given.get(group, [])
        total = sum(c for _, c in counts)
        if total != units[group]:
            where = ", ".join(f"stage {s}: {c}" for s, c in counts) or "no stage"
            wrong.append(f"`{group}` {total} ({where}) but it has {units[group]}")
    if wrong:
        raise _layout_error("the stage layout gives " + "; ".join(wrong)
                            + " unit(s); every unit of every group must be placed once")
    sequence = [group for runs in layout for group, _ in runs]
    merged = [g for i, g in enumerate(sequence) if i == 0 or sequence[i - 1] != g]
    expected = [g for g in order if units[g] and g in merged]
    if merged != expected:
        raise _layout_error(f"the stage layout runs groups in the order {', '.join(merged)}; "
                            f"expected the canonical order {', '.join(expected)}, each group's "
                            "units in one contiguous run")
    ranges = []
    start = 0
    for runs in layout:
        count = sum(c for _, c in runs)
        ranges.append((start, start + count))
        start += count
    return tuple(ranges)


def group_breakdown(graph: ExecutionGraph) -> str:
    """`vision 3, projector 1, decoder 2`: each group's unit count, canonical order."""
    return ", ".join(f"{g.name} {g.units}" for g in graph.canonical_order())


def whole_group_ranges(graph: ExecutionGraph, groups: Sequence[str]) -> tuple[Range, ...]:
    """The canonical ranges of the groups kept on one stage."""
    return tuple(graph.group_range(g) for g in groups)


def check_whole_groups(graph: ExecutionGraph, ranges: Sequence[Range],
                       groups: Sequence[str]) -> None:
    """Refuse stage ranges that cut a group kept on one stage."""
    for group in groups:
        start, end = graph.group_range(group)
        cuts = [b for _, b in ranges[:-1] if start < b < end]
        if cuts:
            raise _layout_error(f"execution group `{group}` is kept on one stage (`one_stage`), "
                                f"but the stage sizes cut it after canonical unit {cuts[0] - 1} "
                                f"(its units are [{start}, {end}))")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageChoice:
    """The chosen stage ranges, how they were chosen and what each stage costs."""

    ranges: tuple[Range, ...]
    """Each stage's canonical unit range."""
    balance: str
    """`units` (equal unit counts), `bytes` (parameter bytes), `weight` (declared group
    weights) or `explicit` (`--pp-layers`)."""
    stage_costs: tuple[int, ...]
    """Each stage's cost under the balance's measure (unit counts for `units` and `explicit`
    are still reported in bytes when `unit_bytes` was given)."""


def choose_stages(graph: ExecutionGraph, stages: int, *, unit_bytes: Sequence[int],
                  weights: Mapping[str, int] | None = None,
                  explicit: Sequence[int] | None = None, layout: StageLayout | None = None,
                  whole: Sequence[str] = (), by_bytes: bool = True) -> StageChoice:
    """The stage ranges: a named `layout`, `explicit` counts, declared `weights`, parameter
    bytes (`by_bytes`, for multi-group graphs) or equal unit counts; `whole` groups are never
    cut."""
    total = graph.total_units
    if layout is not None:
        if len(layout) != stages:
            raise _layout_error(f"the stage layout has {len(layout)} stage(s) for "
                                f"pipeline_parallel_size {stages}; give one per stage")
        ranges, balance = resolve_stage_layout(graph, layout), "explicit"
    elif explicit is not None:
        if len(explicit) == stages and sum(explicit) != total and len(graph.groups) > 1:
            raise _layout_error(f"explicit stage sizes {list(explicit)} sum to {sum(explicit)}, "
                                f"but the model has {total} execution units "
                                f"({group_breakdown(graph)})")
        ranges, balance = pipeline_stage_ranges(total, stages, explicit), "explicit"
    elif weights:
        costs = [weights.get(g.name, 1) for g in graph.canonical_order()
                 for _ in range(g.units)]
        ranges = cost_balanced_stage_ranges(costs, stages, whole_group_ranges(graph, whole))
        balance = "weight"
    elif by_bytes:
        ranges = cost_balanced_stage_ranges(unit_bytes, stages, whole_group_ranges(graph, whole))
        balance = "bytes"
    else:
        ranges, balance = pipeline_stage_ranges(total, stages), "units"
    check_whole_groups(graph, ranges, whole)
    return StageChoice(ranges=tuple(ranges), balance=balance,
                       stage_costs=tuple(sum(unit_bytes[a:b]) for a, b in ranges))


def spell_layout(graph: ExecutionGraph, ranges: Sequence[Range],
                 static_roles: Sequence[StaticRoleSpec]) -> str:
    """The stage layout in Megatron's notation, static roles in brackets where they sit."""
    layout = graph.unit_layout()
    out = []
    for stage, (start, end) in enumerate(ranges):
        roles = [r for r in static_roles if r.stage(graph, ranges) == stage]
        items = [f"[{r.name}]" for r in roles if r.group is None and r.side is StageSide.FIRST]
        runs: list[tuple[str, int]] = []
        for unit in layout[start:end]:
            if runs and runs[-1][0] == unit.group:
                runs[-1] = (unit.group, runs[-1][1] + 1)
            else:
                runs.append((unit.group, 1))
        placed = {r.name for r in roles if r.group is None}
        for group, count in runs:
            items += [f"[{r.name}]" for r in roles
                      if r.group == group and r.side is StageSide.FIRST]
            items.append(group if count == 1 else f"{group}*{count}")
            items += [f"[{r.name}]" for r in roles
                      if r.group == group and r.side is StageSide.LAST]
            placed |= {r.name for r in roles if r.group == group}
        items += [f"[{r.name}]" for r in roles if r.name not in placed or (
            r.group is None and r.side is StageSide.LAST)]
        out.append(",".join(items))
    return "|".join(out)
