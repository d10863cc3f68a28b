"""What every read of a plan.json checks once its typed view is built.

The whole plan schema (enums, minimums, patterns, unknown keys; where jsonschema is installed:
a runtime-only install reads with the bounds below), over the tensor and group tables cut to
one entry per distinct form (`_schema_problem`): validating every entry of DeepSeek-V3's 34 MB
8 x 4 plan takes ~53 s, the cut tables ~0.4 s of a ~4 s read.

What the schema types but does not bound, before anything is shown: T, S, E and X in
[1, 65536] before anything is built per rank (S = 10^9 in an 11 KB plan), dimensions in
[0, 2^40] and at most 2^50 elements, stages inside the pipeline, placement axes inside the
tensor's rank and ranges inside its shape, unit ranges inside their group's units, logical
ranges in order, byte counts non-negative, `kv_replicas` at most 65536, every tensor's group
listed (a tenth of a 19k-tensor plan's read time).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from partc.errors import LoadError
from partc.plan.plan_errors import _located
from partc.plan.plan_records import PlanFile, PlanGroup, PlanTensor

MAX_PARALLEL_SIZE = 1 << 16
"""The largest T, S, E or X a plan may state (checked before anything is built per rank)."""

MAX_DIMENSION = 1 << 40
"""The largest size of one tensor dimension a plan may state."""

MAX_ELEMENTS = 1 << 50
"""The most elements one tensor (or one runtime state tensor) of a plan may have."""


class _Insane(Exception):
    """A plan value that follows the schema's types but cannot be true (`pointer`, `message`)."""

    def __init__(self, pointer: str, message: str) -> None:
        super().__init__(message)
        self.pointer, self.message = pointer, message


def _insane(file: Path, exc: _Insane) -> LoadError:
    """The LoadError for an impossible plan value, located at its line when it can be."""
    return _located(file, exc.pointer, f"the plan states an impossible value: {exc.message}")


def _distinct(entries: Sequence[Any], forms: Sequence[Hashable]
              ) -> tuple[list[Any], list[int]]:
    """One entry per distinct form (the first), and the index in `entries` of each."""
    first: dict[Hashable, int] = {}
    for index, form in enumerate(forms):
        first.setdefault(form, index)
    rows = sorted(first.values())
    return [entries[row] for row in rows], rows


def _tensor_form(entry: Mapping[str, Any], tensor: PlanTensor) -> Hashable:
    """All the plan schema sees of a tensor entry but its names' text: its keys and typed
    values (a typed value stands for exactly one JSON value), whether its names are empty."""
    return (tuple(entry), bool(tensor.target), bool(tensor.group), tensor.dtype, tensor.shape,
            tensor.stages, tensor.placements, tensor.kv_replicas, tensor.needs_tp_reduction,
            tensor.needs_tp_output_reduction)


def _group_form(entry: Mapping[str, Any], group: PlanGroup) -> Hashable:
    """All the plan schema sees of a group entry but its names' text (see `_tensor_form`); of
    its owner the schema reads only `kind`."""
    return (tuple(entry), bool(group.name), group.role, group.owner.to_json().get("kind"),
            group.stages, group.logical_units, group.logical_ranges,
            group.fell_back_to_replication, group.fallback_reason is None,
            bool(group.fallback_reason))


def _schema_problem(document: Mapping[str, Any], view: PlanFile) -> tuple[str, str] | None:
    """The plan schema's most relevant violation in `document` (pointer, message), or None.

    Every read checks the whole schema, but over the tensor and group tables cut to one entry
    per distinct form (`_tensor_form`, `_group_form`: a few hundred of a 90,000-tensor plan):
    the names' text is free (a non-empty string, which the form records), and validating every
    entry of DeepSeek-V3's 34 MB 8 x 4 plan takes ~50 s against ~3 s for the whole read.

    A runtime-only install (README "Serving images") has no jsonschema: there the check is
    skipped, and the typed view, built field by field, and `_check_sane`'s bounds are what
    hold (`tests/test_cli_first_day.py` runs inspect without the compiler's libraries).
    """
    try:
        from partc.front.schema import first_data_error
    except ModuleNotFoundError as missing:
        if missing.name != "jsonschema":
            raise
        return None

    raw_tensors = list(document.get("tensors", []))
    tensors, tensor_rows = _distinct(raw_tensors, [
        _tensor_form(e, t) for e, t in zip(raw_tensors, view.tensors, strict=True)])
    raw_groups = list(document["groups"])
    groups, group_rows = _distinct(raw_groups, [
        _group_form(e, g) for e, g in zip(raw_groups, view.groups, strict=True)])
    problem = first_data_error("plan.schema.json",
                               {**document, "tensors": tensors, "groups": groups})
    if problem is None:
        return None
    pointer, message = problem
    for table, rows in (("tensors", tensor_rows), ("groups", group_rows)):
        head = f"/{table}/"
        if pointer.startswith(head):
            index, _, rest = pointer[len(head):].partition("/")
            pointer = f"{head}{rows[int(index)]}" + (f"/{rest}" if rest else "")
    return pointer, message


def _check_topology_sizes(topology: object) -> None:
    """T, S, E and X are integers in [1, MAX_PARALLEL_SIZE] (those that are integers: the
    view reports the others), before any per-rank or per-stage value is built."""
    if not isinstance(topology, dict):
        return
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                "expert_tensor_parallel_size"):
        value = topology.get(key)
        if type(value) is int and not 1 <= value <= MAX_PARALLEL_SIZE:
            raise _Insane(f"/topology/{key}",
                          f"`{key}` is {value}, expected 1 to {MAX_PARALLEL_SIZE}")


def _check_shape(pointer: str, shape: tuple[int, ...]) -> None:
    """Every dimension in [0, MAX_DIMENSION] and at most MAX_ELEMENTS elements."""
    for axis, size in enumerate(shape):
        if not 0 <= size <= MAX_DIMENSION:
            raise _Insane(f"{pointer}/{axis}", f"dimension {axis} of the shape is {size}, "
                          f"expected 0 to {MAX_DIMENSION}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise _Insane(pointer, f"the shape {list(shape)} has {math.prod(shape)} elements, "
                      f"more than {MAX_ELEMENTS}")


def _check_stages(pointer: str, stages: tuple[int, ...], pipeline: int) -> None:
    """Every stage in [0, S)."""
    for index, stage in enumerate(stages):
        if not 0 <= stage < pipeline:
            raise _Insane(f"{pointer}/{index}", f"stage {stage} is outside the topology's "
                          f"{pipeline} pipeline stage(s) (0 to {pipeline - 1})")


def _check_range(pointer: str, start: int, end: int, size: int, what: str) -> None:
    """0 <= start <= end <= size."""
    if not 0 <= start <= end <= size:
        raise _Insane(pointer, f"the range [{start}, {end}) is not inside the {size} {what}")


def _check_placement(pointer: str, placement: tuple[Any, ...], shape: tuple[int, ...],
                     plan: PlanFile) -> None:
    """A placement's axis inside the tensor's rank, its ranges inside that axis, its shard
    index inside its parts, its rank or stage inside the topology."""
    kind = placement[0]
    if kind in ("shard", "range", "indices"):
        axis = placement[1]
        if axis >= len(shape):
            raise _Insane(pointer, f"a `{kind}` placement on axis {axis} of a tensor of rank "
                          f"{len(shape)} (shape {list(shape)})")
        if kind == "shard" and not placement[2] < placement[3]:
            raise _Insane(pointer, f"shard {placement[2]} of {placement[3]} part(s)")
        if kind == "range":
            _check_range(pointer, placement[2], placement[3], shape[axis],
                         f"elements of axis {axis}")
        if kind == "indices":
            for start, end in placement[2]:
                _check_range(pointer, start, end, shape[axis], f"elements of axis {axis}")
    elif kind == "rank" and placement[1] >= plan.shape.build_world_size:
        raise _Insane(pointer, f"rank {placement[1]} of a build of "
                      f"{plan.shape.build_world_size} rank(s)")
    elif kind == "pipeline_stage":
        _check_stages(pointer, placement[1:], plan.shape.pipeline_parallel_size)


def _check_sane(plan: PlanFile) -> None:
    """The values the schema types but does not bound: shapes bounded and non-negative,
    stages inside the pipeline, placements inside their tensors, ranges in order and inside
    their sizes, byte counts non-negative, the stage imbalance finite."""
    stages = plan.shape.pipeline_parallel_size
    names = {group.name for group in plan.groups}
    for index, tensor in enumerate(plan.tensors):
        at = f"/tensors/{index}"
        if tensor.group not in names:
            raise _Insane(f"{at}/group", f"tensor `{tensor.target}` belongs to group "
                          f"`{tensor.group}`, which the plan's groups do not list")
        if tensor.kv_replicas > MAX_PARALLEL_SIZE:
            raise _Insane(f"{at}/kv_replicas", f"`kv_replicas` is {tensor.kv_replicas}, "
                          f"expected at most {MAX_PARALLEL_SIZE}")
        _check_shape(f"{at}/shape", tensor.shape)
        _check_stages(f"{at}/stages", tensor.stages, stages)
        for row, placement in enumerate(tensor.placements):
            _check_placement(f"{at}/placements/{row}", placement, tensor.shape, plan)
    unit_counts = {graph.group: len(graph.unit_paths) for graph in plan.graph}
    for index, rank in enumerate(plan.ranks):
        at = f"/ranks/{index}"
        for name in ("owned_tensors", "local_parameter_bytes", "global_parameter_bytes",
                     "pinned_parameter_bytes", "maximum_device_parameter_bytes",
                     "local_state_bytes", "local_state_bytes_per_token"):
            if getattr(rank.info, name) < 0:
                raise _Insane(f"{at}/info/{name}",
                              f"`{name}` is {getattr(rank.info, name)}, expected >= 0")
        for dtype, size in rank.info.local_bytes_by_dtype:
            if size < 0:
                raise _Insane(f"{at}/info/local_bytes_by_dtype/{dtype}",
                              f"{size} bytes of {dtype}, expected >= 0")
        for row, units in enumerate(rank.units):
            _check_range(f"{at}/partition/groups/{row}/unit_range", units.start, units.end,
                         unit_counts.get(units.group, MAX_DIMENSION),
                         f"units of execution group `{units.group}`")
        for row, state in enumerate(rank.state):
            _check_shape(f"{at}/partition/state/tensors/{row}/shape", state.shape)
            _check_shape(f"{at}/partition/state/tensors/{row}/local_shape", state.local_shape)
    for index, group in enumerate(plan.groups):
        at = f"/groups/{index}"
        _check_stages(f"{at}/stages", group.stages, stages)
        if group.logical_units is not None and group.logical_units < 0:
            raise _Insane(f"{at}/logical_units",
                          f"`logical_units` is {group.logical_units}, expected >= 0")
        for row, (start, end) in enumerate(group.logical_ranges or ()):
            _check_range(f"{at}/logical_ranges/{row}", start, end, group.logical_units or 0,
                         "logical units")
    for index, cut in enumerate(plan.cuts or ()):
        if not 0 <= cut.after_stage < stages - 1:
            raise _Insane(f"/cuts/{index}/after_stage", f"a cut after stage {cut.after_stage} "
                          f"of {stages} pipeline stage(s)")
    if plan.pipeline is not None:
        if not math.isfinite(plan.pipeline.imbalance) or plan.pipeline.imbalance < 0:
            raise _Insane("/pipeline/imbalance",
                          f"the stage imbalance is {plan.pipeline.imbalance}, expected a finite "
                          "number >= 0")
        for row, size in enumerate(plan.pipeline.stage_bytes):
            if size < 0:
                raise _Insane(f"/pipeline/stage_bytes/{row}", f"{size} bytes, expected >= 0")
