"""Consistency checks of a projection group's bound values, each a located error.

They run once per group structure, on the concrete shapes and head counts binding computed,
before the group is built: what they refuse would otherwise surface later as a less direct
message, or not at all (a bias sliced by ranges its length does not fit).

- a column projection's `bias` has the length of its `weight`'s output axis (axis 0, or 1 for
  an `orientation: in_out` weight), so the unit ranges that cut the weight cut the bias too;
- in an `attention_heads` group, every rank's local query, key/value and output head counts
  agree: each key/value head count divides the query head count (the most heads of a column
  projection), and every row (output) projection has the query head count. With a shared
  partition of units dividing every count, a rank holding u of U units then holds
  q*u/U query heads, kv*u/U key/value heads (one repeated head under KV replication) and
  q*u/U output heads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from partc.errors import PartcError, SemanticError
from partc.family.declaration import GroupDecl, ModuleDecl
from partc.front.load import RawDocument
from partc.front.positions import join_pointer
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import LinearWeightLayout, ProjectionSharding


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundProjection:
    """A projection of one group instance with its bound parameters and head count."""

    module: str
    """The module path."""
    decl: ModuleDecl
    """Its declaration."""
    shapes: Mapping[str, tuple[int, ...]]
    """Each present parameter's shape, by name (`weight`, `bias`)."""
    heads: tuple[int, ...]
    """Its evaluated `heads:`, one per segment of a fused projection (empty: not stated)."""


def _error(document: RawDocument, message: str, pointer: str, tensor: str) -> SemanticError:
    return SemanticError(message, location=document.locate(pointer), pointer=pointer,
                         tensor=tensor)


def _bias_pointer(decl: ModuleDecl) -> str:
    return next((p.pointer for p in decl.params if p.name.text == "bias"), decl.pointer)


def _column_bias(document: RawDocument, group: GroupDecl,
                 projections: Sequence[BoundProjection]) -> Iterator[PartcError]:
    """A column projection's bias is as long as its weight's output axis."""
    for p in projections:
        weight, bias = p.shapes.get("weight"), p.shapes.get("bias")
        if p.decl.sharding is not ProjectionSharding.COLUMN or not weight or bias is None:
            continue
        # the output axis: 0 of an nn.Linear `[out, in]` weight, 1 of a Conv1D `[in, out]` one
        axis = 1 if p.decl.orientation is LinearWeightLayout.IN_OUT and len(weight) > 1 else 0
        if bias != (weight[axis],):
            yield _error(document, f"the bias of column projection `{p.module}` must have the "
                         f"length of its weight's output axis (axis {axis} of {list(weight)}), so "
                         f"the same unit ranges cut both: expected [{weight[axis]}], found "
                         f"{list(bias)}", _bias_pointer(p.decl), f"{p.module}.bias")


def _head_counts(document: RawDocument, group: GroupDecl,
                 projections: Sequence[BoundProjection]) -> Iterator[PartcError]:
    """Query, key/value and output head counts agree on every rank."""
    if group.role is not ParameterRole.ATTENTION_HEADS or group.units is None:
        return
    columns = [p for p in projections if p.decl.sharding is ProjectionSharding.COLUMN
               and p.heads]
    if not columns:
        return
    query = max(columns, key=lambda p: max(p.heads))
    q = max(query.heads)
    for p in columns:
        for heads in p.heads:
            if q % heads:
                yield _error(document, f"on every rank the local query and key/value head "
                             f"counts must agree: `{p.module}` states {heads} heads, which does "
                             f"not divide the {q} query heads of `{query.module}`; expected a "
                             f"divisor of {q}, found {heads}",
                             join_pointer(p.decl.pointer, "heads"), p.module)
    for p in projections:
        if p.decl.sharding is ProjectionSharding.ROW and p.heads and p.heads[0] != q:
            yield _error(document, f"on every rank the local output and query head counts "
                         f"must agree: output projection `{p.module}` states {p.heads[0]} "
                         f"heads; expected {q} (the query heads of `{query.module}`), found "
                         f"{p.heads[0]}", join_pointer(p.decl.pointer, "heads"), p.module)


ProjectionCheck = Callable[[RawDocument, GroupDecl, Sequence[BoundProjection]],
                           Iterator[PartcError]]
"""A check of one bound projection group."""

PROJECTION_CHECKS: tuple[ProjectionCheck, ...] = (_column_bias, _head_counts)
"""Every check of a bound projection group, in the order their errors are yielded."""


def check_projections(document: RawDocument, group: GroupDecl,
                      projections: Sequence[BoundProjection]) -> None:
    """Raise the first error of `PROJECTION_CHECKS` on one bound projection group."""
    for check in PROJECTION_CHECKS:
        for error in check(document, group, projections):
            raise error
