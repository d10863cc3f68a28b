"""Consistency checks of a projection group's bound values, each a located error.

They run once per group structure, on the concrete shapes, head counts and split axes binding
computed, before the check that every split axis holds whole units: what they refuse would
otherwise surface later as a less direct message, at another line, or not at all (a bias sliced
by ranges its length does not fit, a head cut across its channels).

- a column or row projection's `bias` has the length of its `weight`'s output axis (axis 0, or
  1 for an `orientation: in_out` weight), so the unit ranges that cut the weight cut the bias
  too (a row bias is the output's, added once); a 2-D weight whose *other* axis has the bias's
  length is the mistake itself, written transposed, and is refused at its shape;
- in an `attention_heads` group, every rank's local query, key/value and output head counts
  agree: each key/value head count divides the query head count (the most heads of a column
  projection), and every row (output) projection has the query head count. With a shared
  partition of units dividing every count, a rank holding u of U units then holds
  q*u/U query heads, kv*u/U key/value heads (one repeated head under KV replication) and
  q*u/U output heads;
- a split member of a projection stating `heads:` (in a `projections:` group) that has an axis
  of the heads themselves is split on an axis that counts those heads: an axis counts them when
  its dimension is symbolically a multiple of the `heads:` expression's names (a product with a
  factor reading one, through the config defaults and derived values it reads; `head_dim`'s
  default `hidden_size // num_attention_heads` divides by them, so it does not count them); the
  heads axis is another axis that counts them and holds exactly the bound head count. A
  per-head norm `[num_attention_heads, head_dim]` split on axis 1 would give each rank a slice
  of every head, which every shape check accepts. A dimension written without the heads' names
  (a square `[hidden_size, hidden_size]`) counts nothing, so such a weight is never refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from partc.errors import PartcError, SemanticError
from partc.family.declaration import FamilyDecl, GroupDecl, GroupForm, ModuleDecl, ParamDecl
from partc.family.expr import Expression
from partc.family.expr_parse import Node, parse_tree
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
    split_axes: Mapping[str, int] = field(default_factory=dict)
    """The axis the built group partitions, of each parameter it partitions, by name."""


def _error(document: RawDocument, message: str, pointer: str, tensor: str) -> SemanticError:
    return SemanticError(message, location=document.locate(pointer), pointer=pointer,
                         tensor=tensor)


def _param(decl: ModuleDecl, name: str) -> ParamDecl | None:
    """The declaration of parameter `name` of a module (None: a templated name)."""
    return next((p for p in decl.params if p.name.is_constant and p.name.text == name), None)


def _bias_pointer(decl: ModuleDecl) -> str:
    bias = _param(decl, "bias")
    return decl.pointer if bias is None else bias.pointer


def _shape_text(param: ParamDecl | None, order: Sequence[int]) -> str:
    """` (`[a, b]`)`: a parameter's declared dimensions in `order` ('' when unknown)."""
    if param is None or len(param.shape) != len(order):
        return ""
    return " (`[" + ", ".join(param.shape[i].text for i in order) + "]`)"


def _bias_length(family: FamilyDecl, group: GroupDecl,
                 projections: Sequence[BoundProjection]) -> Iterator[PartcError]:
    """A column or row projection's bias is as long as its weight's output axis; a 2-D weight
    whose input axis has the bias's length is written transposed."""
    document = family.document
    for p in projections:
        weight, bias = p.shapes.get("weight"), p.shapes.get("bias")
        kind = p.decl.sharding
        if kind not in (ProjectionSharding.COLUMN, ProjectionSharding.ROW) or not weight \
                or bias is None or kind is ProjectionSharding.ROW and len(weight) < 2:
            continue
        # the output axis: 0 of an nn.Linear `[out, in]` weight, 1 of a Conv1D `[in, out]` one
        axis = 1 if p.decl.orientation is LinearWeightLayout.IN_OUT and len(weight) > 1 else 0
        if bias == (weight[axis],):
            continue
        declared = _param(p.decl, "weight")
        if len(weight) == 2 and bias == (weight[1 - axis],) and declared is not None:
            order = "`[in, out]` (`orientation: in_out`)" if axis else "nn.Linear's `[out, in]`"
            other = ("drop `orientation: in_out` for an nn.Linear `[out, in]` weight" if axis
                     else "say `orientation: in_out` for a Conv1D `[in, out]` weight")
            yield _error(document, f"the weight of {kind.value} projection `{p.module}` is "
                         f"declared {list(weight)}{_shape_text(declared, (0, 1))}: its output "
                         f"axis {axis} has {weight[axis]} elements, but its bias {bias[0]}, the "
                         f"length of its other axis; expected {list(weight[::-1])}"
                         f"{_shape_text(declared, (1, 0))}, {order}, found {list(weight)}, the "
                         f"expected shape transposed: swap its dimensions, or {other}",
                         declared.shape_pointer or declared.pointer, f"{p.module}.weight")
        elif kind is ProjectionSharding.COLUMN:
            yield _error(document, f"the bias of column projection `{p.module}` must have the "
                         f"length of its weight's output axis (axis {axis} of {list(weight)}), so "
                         f"the same unit ranges cut both: expected [{weight[axis]}], found "
                         f"{list(bias)}", _bias_pointer(p.decl), f"{p.module}.bias")
        else:
            yield _error(document, f"the bias of row projection `{p.module}` must have the "
                         f"length of its weight's output axis (axis {axis} of {list(weight)}), "
                         f"the features every rank adds it to once the partial outputs are "
                         f"summed: expected [{weight[axis]}], found {list(bias)}",
                         _bias_pointer(p.decl), f"{p.module}.bias")


def _head_counts(family: FamilyDecl, group: GroupDecl,
                 projections: Sequence[BoundProjection]) -> Iterator[PartcError]:
    """Query, key/value and output head counts agree on every rank."""
    document = family.document
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


@functools.lru_cache(maxsize=1024)
def _tree(text: str) -> Node | None:
    """The syntax tree of an expression's text (None: text that does not parse)."""
    try:
        return parse_tree(text)[0]
    except PartcError:
        return None


def _counts(node: Node | None, heads: frozenset[str], definitions: Mapping[str, Expression],
            seen: frozenset[str] = frozenset()) -> bool:
    """Whether an expression counts the names `heads`: is a multiple of them, as a product with
    a factor that reads one, a sum of such terms, or a name whose default or derived value is
    one (`head_dim`'s default `hidden_size // num_attention_heads` divides by them: it does not
    count them)."""
    if node is None:
        return False
    kind, children = node.kind, node.children
    if kind == "name":
        definition = definitions.get(node.name)
        return node.name in heads or (definition is not None and node.name not in seen and _counts(
            _tree(definition.text), heads, definitions, seen | {node.name}))
    if kind == "neg" or kind == "call" and node.name in ("abs", "floor", "ceil", "round"):
        return _counts(children[0], heads, definitions, seen)
    if kind == "cond":  # either branch may be taken
        return _counts(children[0], heads, definitions, seen) and _counts(
            children[2], heads, definitions, seen)
    if kind == "call" and node.name in ("min", "max"):
        return all(_counts(c, heads, definitions, seen) for c in children)
    if kind == "call" and node.name == "ceil_div":
        return _counts(children[0], heads, definitions, seen) and not _counts(
            children[1], heads, definitions, seen)
    if kind != "arith":
        return False
    if node.ops[0][0] in ("+", "-"):
        return all(_counts(c, heads, definitions, seen) for c in children)
    found = _counts(children[0], heads, definitions, seen)
    for (op, _), child in zip(node.ops, children[1:], strict=True):
        counted = _counts(child, heads, definitions, seen)
        found = (found or counted) if op == "*" else found and op == "//" and not counted
    return found


def counts_heads(dimension: Expression, heads: Expression, family: FamilyDecl) -> bool:
    """Whether a declared dimension counts the heads of a `heads:` expression (is symbolically
    a multiple of them, through the config defaults and derived values it reads)."""
    definitions = {f.name: f.default for f in family.config if f.default is not None}
    definitions.update({d.name: d.expression for d in family.derived})
    return bool(heads.names) and _counts(_tree(dimension.text), heads.names, definitions)


def _split_axis(sharding: ProjectionSharding, orientation: LinearWeightLayout,
                ndim: int) -> int:
    """The axis of a weight of `ndim` >= 2 axes a column or row projection splits."""
    transposed = orientation is LinearWeightLayout.IN_OUT
    if sharding is ProjectionSharding.COLUMN:
        return ndim - 1 if transposed else 0
    return ndim - 2 if transposed else 1


def _heads_axis(family: FamilyDecl, group: GroupDecl,
                projections: Sequence[BoundProjection]) -> Iterator[PartcError]:
    """A member of a projection that states its heads is split on the axis counting them."""
    document = family.document
    if group.form is not GroupForm.PROJECTIONS:
        return  # a fused projection's segments: its layout's own checks (and its output: verify)
    for p in projections:
        if len(p.heads) != 1 or len(p.decl.heads) != 1 or p.decl.sharding not in (
                ProjectionSharding.COLUMN, ProjectionSharding.ROW):
            continue
        heads, stated = p.heads[0], p.decl.heads[0]
        for name, axis in p.split_axes.items():
            shape, param = p.shapes.get(name, ()), _param(p.decl, name)
            if len(shape) < 2 or param is None or len(param.shape) != len(shape) \
                    or counts_heads(param.shape[axis], stated, family):
                continue
            # the heads axis itself (`[heads, head_dim]`); a split beside an axis of heads times
            # their width (a square `o_proj` given `column`) is left to `partc verify`
            axes = [b for b, size in enumerate(shape) if b != axis and size == heads
                    and counts_heads(param.shape[b], stated, family)]
            if not axes:
                continue
            best = axes[0]
            yield _error(document, _heads_axis_message(
                document, p, name, shape, param, axis, best, heads, stated),
                _heads_axis_pointer(document, p.decl), f"{p.module}.{name}")


def _heads_axis_pointer(document: RawDocument, decl: ModuleDecl) -> str:
    """Where the split axis was chosen: the projection's `orientation:` when it states one,
    else its `sharding:`."""
    orientation = join_pointer(decl.pointer, "orientation")
    return orientation if orientation in document.locations else join_pointer(
        decl.pointer, "sharding")


def _heads_axis_message(document: RawDocument, p: BoundProjection, name: str,
                        shape: tuple[int, ...], param: ParamDecl, axis: int, best: int,
                        heads: int, stated: Expression) -> str:
    assert p.decl.sharding is not None
    kind, orientation = p.decl.sharding, p.decl.orientation
    message = (f"`{p.module}.{name}` {list(shape)} is split on axis {axis} "
               f"(`{param.shape[axis].text}`, {shape[axis]}), which does not count the "
               f"{heads} heads (`{stated.text}`) that projection `{p.module}` states: every rank "
               f"would hold a part of each head instead of whole heads; expected the split on "
               f"axis {best} (`{param.shape[best].text}`, {shape[best]}), which counts them, "
               f"found axis {axis}")
    other = (LinearWeightLayout.OUT_IN if orientation is LinearWeightLayout.IN_OUT
             else LinearWeightLayout.IN_OUT)
    reoriented = _split_axis(kind, other, len(shape)) == best
    if join_pointer(p.decl.pointer, "orientation") in document.locations:
        if not reoriented:
            return message
        if other is LinearWeightLayout.OUT_IN:
            return message + (f"; drop `orientation: in_out`: the default `out_in` splits axis "
                              f"{best} of a {kind.value} projection's weight")
        return message + (f"; `orientation: in_out` splits axis {best} of a {kind.value} "
                          f"projection's weight")
    swapped = (ProjectionSharding.ROW if kind is ProjectionSharding.COLUMN
               else ProjectionSharding.COLUMN)
    fixes = []
    if p.decl.linear and _split_axis(swapped, orientation, len(shape)) == best:
        fixes.append(f"the projection's sharding `{swapped.value}`")
    if len(shape) == 2:
        fixes.append("the shape written transposed")
    if p.decl.linear and reoriented and other is LinearWeightLayout.IN_OUT:
        fixes.append("`orientation: in_out` missing (a Conv1D `[in, out]` weight)")
    if not fixes:
        return message
    return message + "; is " + (fixes[0] if len(fixes) == 1 else
                                ", ".join(fixes[:-1]) + " or " + fixes[-1]) + "?"


ProjectionCheck = Callable[[FamilyDecl, GroupDecl, Sequence[BoundProjection]],
                           Iterator[PartcError]]
"""A check of one bound projection group."""

PROJECTION_CHECKS: tuple[ProjectionCheck, ...] = (_bias_length, _head_counts, _heads_axis)
"""Every check of a bound projection group, in the order their errors are yielded."""


def check_projections(family: FamilyDecl, group: GroupDecl,
                      projections: Sequence[BoundProjection]) -> None:
    """Raise the first error of `PROJECTION_CHECKS` on one bound projection group."""
    for check in PROJECTION_CHECKS:
        for error in check(family, group, projections):
            raise error
