"""Runtime state declarations (`state:`) bound to a config: one tensor per carrying unit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from partc.errors import SourceLocation
from partc.family.expr_values import format_value
from partc.front.positions import join_pointer
from partc.parallel.placements import DTYPE_BITS, TORCH_DTYPE_NAMES
from partc.partition.ownership import ExecutionUnit

if TYPE_CHECKING:
    from partc.bind.values import Binder, Value
    from partc.family.declaration import StateDecl
    from partc.partition.ownership import ArchitectureParameterDescription, ExecutionGraph


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundStateTensor:
    """One declared state tensor of one unit, its shape, dtype and split evaluated."""

    name: str
    """State name."""
    group: str
    """Execution group of the unit."""
    unit: int
    """Group-local unit index."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str | None
    """Safetensors dtype (None: the build's activation dtype)."""
    follows: str | None
    """The parameter group whose logical range the split axis follows (None: replicated)."""
    axis: int
    """The split axis (0 when replicated)."""
    segments: tuple[int, ...]
    """Segment widths along `axis` (one segment, the whole axis, when none are declared)."""
    heads: tuple[int, ...] = ()
    """Head count of each segment (empty: every element its own head)."""
    location: SourceLocation
    """Where the declaration is."""
    pointer: str
    """Its JSON pointer."""
    per_token: bool = False
    """One tensor per token (a KV cache entry) rather than one per sequence."""


def _dtype(binder: Binder, decl: StateDecl, env: Mapping[str, Value]) -> str | None:
    if decl.dtype is None:
        return None
    pointer = join_pointer(decl.pointer, "dtype")
    value = binder.evaluate(decl.dtype, env, pointer)
    if isinstance(value, str) and value in TORCH_DTYPE_NAMES:
        return TORCH_DTYPE_NAMES[value]
    if not isinstance(value, str) or value not in DTYPE_BITS:
        raise binder.fail(f"state `{decl.name}`: dtype must be `activation`, one of "
                          f"{', '.join(sorted(DTYPE_BITS))} (or a torch name), found "
                          f"{format_value(value)}", pointer)
    return value


def _state_heads(binder: Binder, decl: StateDecl, env: Mapping[str, Value],
                 segments: tuple[int, ...], pointer: str) -> tuple[int, ...]:
    """The split's head counts, one per segment, each dividing its segment (empty: none)."""
    assert decl.split is not None
    if not decl.split.heads:
        return ()
    pointer = join_pointer(pointer, "heads")
    heads = tuple(binder.integer(h, env, pointer, f"state `{decl.name}`'s head count",
                                 minimum=1) for h in decl.split.heads)
    if len(heads) != len(segments):
        raise binder.fail(f"state `{decl.name}`: `heads` has {len(heads)} counts but the axis "
                          f"has {len(segments)} segments {list(segments)}; give one per "
                          "segment", pointer)
    for width, count in zip(segments, heads, strict=True):
        if width % count:
            raise binder.fail(f"state `{decl.name}`: a segment of {width} elements cannot hold "
                              f"{count} heads of whole elements", pointer)
    return heads


def _bind_one(binder: Binder, decl: StateDecl, env: Mapping[str, Value], unit: int,
              description: ArchitectureParameterDescription) -> BoundStateTensor:
    shape_pointer = join_pointer(decl.pointer, "shape")
    shape = tuple(binder.integer(d, env, join_pointer(shape_pointer, i),
                                 f"state `{decl.name}`'s dimension", minimum=1)
                  for i, d in enumerate(decl.shape))
    follows: str | None = None
    axis = 0
    segments: tuple[int, ...] = ()
    split = decl.split
    if split is not None:
        pointer = join_pointer(decl.pointer, "split")
        follows = binder.render(split.parameters, env, join_pointer(pointer, "parameters"))
        axis = split.axis
        groups = {g.group.name: g for g in description.groups}
        owner = groups[follows].owner if follows in groups else None
        here = ExecutionUnit(group=decl.group, unit=unit)
        if owner is None:
            raise binder.fail(f"state `{decl.name}` of unit {unit} follows parameter group "
                              f"`{follows}`, which this config does not declare",
                              join_pointer(pointer, "parameters"))
        if owner != here:
            raise binder.fail(f"state `{decl.name}` of `{decl.group}` unit {unit} follows "
                              f"parameter group `{follows}`, which another owner holds "
                              f"({owner.describe()}); a state follows a group of its own unit",
                              join_pointer(pointer, "parameters"))
        widths: list[int] = []
        for seg in split.segments:
            value = binder.evaluate(seg, env, join_pointer(pointer, "segments"))
            items = value if isinstance(value, tuple) else (value,)
            for item in items:
                if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                    raise binder.fail(f"state `{decl.name}`: a segment width `{seg.text}` "
                                      f"must be a positive integer, found "
                                      f"{format_value(item)}", join_pointer(pointer, "segments"))
                widths.append(item)
        segments = tuple(widths) or (shape[axis],)
        if sum(segments) != shape[axis]:
            raise binder.fail(f"state `{decl.name}`: segments {list(segments)} add up to "
                              f"{sum(segments)}, but axis {axis} of its shape {list(shape)} "
                              f"has {shape[axis]}", join_pointer(pointer, "segments"))
        heads = _state_heads(binder, decl, env, segments, pointer)
        units = groups[follows].group.units
        uneven = next((w for w, h in zip(segments, heads or segments, strict=True)
                       if units is not None and h % units), None)
        if uneven is not None and units is not None:
            what = (f"axis {axis} of its shape {list(shape)} has {uneven} elements"
                    if segments == (shape[axis],) else f"its segment of {uneven} elements "
                    f"(segments {list(segments)} on axis {axis} of {list(shape)})")
            raise binder.fail(f"state `{decl.name}` of unit {unit}: {what}, which cannot follow "
                              f"the {units} partition units of parameter group `{follows}`: "
                              "every unit must own a whole number of them (split the axis "
                              "that carries the group's units, in the segments of its order)",
                              pointer)
    return BoundStateTensor(name=decl.name, group=decl.group, unit=unit, shape=shape,
                            dtype=_dtype(binder, decl, env), follows=follows, axis=axis,
                            segments=segments, heads=heads,
                            location=binder.family.document.locate(decl.pointer),
                            pointer=decl.pointer, per_token=decl.per_token)


def bind_state(binder: Binder, values: Mapping[str, Value], graph: ExecutionGraph,
               description: ArchitectureParameterDescription
               ) -> tuple[BoundStateTensor, ...]:
    """Every declared state tensor of every unit whose `when` holds, in canonical unit order
    then declaration order."""
    out = []
    for spec in graph.canonical_order():
        decls = [d for d in binder.family.state if d.group == spec.name]
        for unit, path in enumerate(spec.unit_paths):
            env = {**values, "unit": unit, "path": path, "group": spec.name}
            for decl in decls:
                if binder.boolean(decl.when, env, join_pointer(decl.pointer, "when")):
                    out.append(_bind_one(binder, decl, env, unit, description))
    return tuple(out)
