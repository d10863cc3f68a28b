"""Declared runtime state realized per rank: each state tensor's split follows the logical range
its parameter group has on the rank (or is replicated)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from partc.errors import LayoutError
from partc.parallel.layout import LocalStateLayout
from partc.parallel.placements import REPLICATED, Indices, Range, TensorPlacement, local_shape
from partc.partition.boundary import PipelineActivationDtype

if TYPE_CHECKING:
    from partc.bind.runtime_state import BoundStateTensor
    from partc.plan.ranks import RankPlan

_STATE_DTYPES = {PipelineActivationDtype.FLOAT32: "F32",
                 PipelineActivationDtype.FLOAT16: "F16",
                 PipelineActivationDtype.BFLOAT16: "BF16"}
"""The safetensors dtype of each activation dtype (a state declared `activation`)."""


def _logical_range(rank: RankPlan, group: str) -> tuple[int, tuple[int, int]] | None:
    """(logical units, this rank's range) of parameter group `group`; None when it is whole."""
    planned = next(g for g in rank.groups if g.name == group)
    kind = rank.kinds[planned.kind]
    for layout in kind.layouts[kind.row(rank.tensor_parallel_rank, rank.coordinates)]:
        if layout.logical_units is not None and layout.logical_range is not None:
            return layout.logical_units, layout.logical_range
    return None


def _segment_range(state: BoundStateTensor, rank: RankPlan, units: int, start: int, end: int,
                   width: int, heads: int) -> tuple[int, int]:
    """The elements [s, e) of one segment of `width` (`heads` heads) that units [start, end)
    of `units` give: the same fraction of its heads, or (KV heads repeated over more ranks
    than heads) the one head whose span holds the range; a LayoutError when neither is
    whole."""
    size = width // heads
    if heads * start % units == 0 and heads * end % units == 0:
        return heads * start // units * size, heads * end // units * size
    if units % heads == 0 and start // (units // heads) == (end - 1) // (units // heads):
        head = start // (units // heads)
        return head * size, (head + 1) * size
    raise LayoutError(
        f"state `{state.name}` of `{state.group}` unit {state.unit} cannot follow parameter "
        f"group `{state.follows}`: tensor-parallel rank {rank.tensor_parallel_rank} holds its "
        f"units [{start}, {end}) of {units}, which is not a whole range of the {width} elements "
        f"of axis {state.axis} (shape {list(state.shape)}); split the axis that carries the "
        "group's units", location=state.location, pointer=state.pointer,
        doc="authoring#runtime-state")


def _placement(state: BoundStateTensor, rank: RankPlan) -> TensorPlacement:
    """Which part of `state` the rank holds."""
    if state.follows is None:
        return REPLICATED
    logical = _logical_range(rank, state.follows)
    if logical is None:
        return REPLICATED
    units, (start, end) = logical
    ranges: list[tuple[int, int]] = []
    offset = 0
    for width, heads in zip(state.segments, state.heads or state.segments, strict=True):
        a, b = _segment_range(state, rank, units, start, end, width, heads)
        if ranges and ranges[-1][1] == offset + a:
            ranges[-1] = (ranges[-1][0], offset + b)
        else:
            ranges.append((offset + a, offset + b))
        offset += width
    if ranges == [(0, state.shape[state.axis])]:
        return REPLICATED
    if len(ranges) == 1:
        return Range(axis=state.axis, start=ranges[0][0], end=ranges[0][1])
    return Indices(axis=state.axis, ranges=tuple(ranges))


def with_state(ranks: list[RankPlan], states: tuple[BoundStateTensor, ...],
               activation: PipelineActivationDtype) -> list[RankPlan]:
    """`ranks` with the declared state tensors of their stage's units in their partition's
    `state` and their bytes in `info.local_state_bytes` (unchanged when none are declared)."""
    if not states:
        return ranks
    out = []
    for rank in ranks:
        held = {g.group: g.unit_range for g in rank.partition.groups}
        tensors = []
        for state in states:
            if state.group not in held or not (
                    held[state.group][0] <= state.unit < held[state.group][1]):
                continue
            placement = _placement(state, rank)
            tensors.append(LocalStateLayout(
                name=state.name, group=state.group, unit=state.unit,
                dtype=state.dtype or _STATE_DTYPES[activation], global_shape=state.shape,
                local_shape=local_shape(state.shape, placement.selection(state.shape)),
                placement=placement,
                follows=state.follows or "", per_token=state.per_token))
        partition = replace(rank.partition,
                            state=replace(rank.partition.state, tensors=tuple(tensors)))
        out.append(replace(rank, partition=partition, info=replace(
            rank.info, local_state_bytes=partition.state.local_bytes,
            local_state_bytes_per_token=partition.state.local_bytes_per_token)))
    return out
