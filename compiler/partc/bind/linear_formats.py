"""Linear format expansion: a family's dense linear weights rewritten as the checkpoint stores them.

`expand_linear_format_parameter_groups` rewrites every weight a `LinearFormat`
(`partc.parallel.formats`) encodes into its stored tensors inside the *same* group, maps its
sharding onto them (segment boundaries and partitioned axes divided by the block or pack size,
with an error when a cut would split a block), and reduces the group's partition units by gcd
so every shard stays block-aligned. The formats' layouts are described in
`partc.parallel.formats` and docs/linear_formats.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from partc.errors import ParallelPlanError, ParallelPlanErrorKind
from partc.parallel.formats import (
    GGUF_BLOCK_TYPES,
    MXFP4_BLOCK_BYTES,
    MXFP4_BLOCK_ELEMENTS,
    LinearFormat,
    LinearFormatKind,
    target_matches,
)
from partc.parallel.specs import (
    LinearWeightLayout,
    MemberSharding,
    ParameterGroupSpec,
    ParameterMemberSpec,
    PartitionedSegmentsSharding,
    PartitionedSharding,
    ReplicatedSharding,
    SegmentedSharding,
    reduced_partition_units,
)


@dataclass(frozen=True, slots=True)
class _Axis:
    """One axis of a stored tensor: which dense axis it carries and at what block ratio."""

    source: int | None
    """Dense axis carried (None: a fixed inner axis of `size` elements)."""
    atom: int = 1
    """Dense elements per block along the source axis."""
    per_atom: int = 1
    """Stored elements per block."""
    size: int = 0
    """Size of a fixed axis."""

    def length(self, shape: tuple[int, ...]) -> int:
        if self.source is None:
            return self.size
        n = shape[self.source]
        return n if self.atom == self.per_atom else -(-n // self.atom) * self.per_atom

    @property
    def granule(self) -> int:
        return self.per_atom if self.atom > 1 else 1


@dataclass(frozen=True, slots=True)
class _Part:
    """One tensor a dense weight becomes: named `suffix` after its target minus `strip` chars."""

    suffix: str
    dtype: str
    axes: tuple[_Axis, ...]
    encoding: str
    strip: int = 0

    def target(self, dense: str) -> str:
        """The stored tensor's name, given the dense weight's target."""
        return dense[:len(dense) - self.strip] + self.suffix


def _misaligned(group: str, target: str, message: str) -> ParallelPlanError:
    return ParallelPlanError(ParallelPlanErrorKind.INVALID_TENSOR, message, group=group,
                             target=target, tensor=target,
                             doc="linear_formats#sharding-stays-block-aligned")


def _parts(fmt: LinearFormat, group: str, member: ParameterMemberSpec) -> list[_Part] | None:
    """The stored tensors of `member` under `fmt` (None: the format leaves it dense)."""
    target, shape = member.target, member.shape
    layout = member.linear or LinearWeightLayout.OUT_IN
    out_axis, in_axis = layout.axes(len(shape))
    lead = tuple(_Axis(i) for i in range(len(shape) - 2))
    kind = fmt.kind
    if kind is LinearFormatKind.BLOCK_FP8:
        blocks = {out_axis: fmt.block[0], in_axis: fmt.block[1]}
        weight = lead + tuple(_Axis(a, blocks[a], blocks[a]) for a in (len(shape) - 2,
                                                                         len(shape) - 1))
        scale = lead + tuple(_Axis(a, blocks[a], 1) for a in (len(shape) - 2, len(shape) - 1))
        return [_Part("", "F8_E4M3", weight, "block_fp8.weight"),
                _Part(fmt.scale_suffix or "_scale_inv", fmt.scale_dtype or "F32", scale,
                      "block_fp8.scale")]
    if layout is LinearWeightLayout.IN_OUT and kind is not LinearFormatKind.MXFP4:
        raise _misaligned(group, target, (
            f"group `{group}`: `{target}` is stored [..., in, out] but {fmt.describe()} encodes "
            "[..., out, in] weights only; leave it dense with `except:`"))
    in_features = shape[in_axis]
    if kind is LinearFormatKind.MLX_AFFINE:
        if in_features % fmt.group_size:
            return None  # mlx_lm leaves such layers unquantized
        if not target.endswith(".weight"):
            raise _misaligned(group, target, (
                f"group `{group}`: {fmt.describe()} stores `scales`/`biases` next to a "
                f"`<module>.weight`, but `{target}` is not named `.weight`"))
        words = fmt.group_size * fmt.bits // 32
        return [_Part("", "U32", lead + (_Axis(out_axis), _Axis(in_axis, fmt.group_size, words)),
                      "mlx_affine.weight")
                ] + [_Part(f".{name}", fmt.scale_dtype or member.dtype,
                           lead + (_Axis(out_axis), _Axis(in_axis, fmt.group_size, 1)),
                           f"mlx_affine.{name}", strip=len(".weight"))
                     for name in ("scales", "biases")]
    atom, nbytes = ((MXFP4_BLOCK_ELEMENTS, MXFP4_BLOCK_BYTES) if kind is LinearFormatKind.MXFP4
                    else GGUF_BLOCK_TYPES[fmt.gguf_type])
    if in_features % atom:
        raise _misaligned(group, target, (
            f"group `{group}`: `{target}` has {in_features} input features, not a multiple of "
            f"the {atom}-element blocks of {fmt.describe()}; leave it dense with `except:`"))
    if kind is LinearFormatKind.GGUF:
        return [_Part("", "U8", lead + (_Axis(out_axis), _Axis(in_axis, atom, nbytes)),
                      f"gguf.{fmt.gguf_type}")]
    return [_Part("_blocks", "U8",
                  lead + (_Axis(out_axis), _Axis(in_axis, atom, 1), _Axis(None, size=nbytes)),
                  "mxfp4.blocks"),
            _Part(fmt.scale_suffix or "_scales", "U8",
                  lead + (_Axis(out_axis), _Axis(in_axis, atom, 1)), "mxfp4.scales")]


def _stored_sharding(fmt: LinearFormat, group: str, member: ParameterMemberSpec,
                     part: _Part) -> MemberSharding:
    """`member`'s sharding carried onto the stored tensor `part`."""
    rule = member.sharding
    if isinstance(rule, ReplicatedSharding):
        return rule
    if rule.granule != 1:
        raise _misaligned(group, member.target, (
            f"group `{group}`: `{member.target}` is already {rule.describe()}; a linear format "
            "applies to a dense declaration only"))
    index = next(i for i, axis in enumerate(part.axes) if axis.source == rule.axis)
    axis = part.axes[index]
    n = member.shape[rule.axis]
    if isinstance(rule, PartitionedSharding) and n % axis.atom:
        raise _misaligned(group, member.target, (
            f"group `{group}`: `{member.target}` is {rule.describe()} but {fmt.describe()} "
            f"stores axis {rule.axis} in blocks of {axis.atom} elements and {n} is not a "
            f"multiple of {axis.atom}; a partitioned axis must be block-aligned (replicate the "
            "tensor or leave it dense with `except:`)"))
    segments = rule.segments
    if segments:
        bounds = [sum(segments[:i + 1]) for i in range(len(segments))]
        bad = [b for b in bounds if b % axis.atom]
        if bad:
            raise _misaligned(group, member.target, (
                f"group `{group}`: segment boundaries {bounds} of `{member.target}` must fall on "
                f"{fmt.describe()} block boundaries (multiples of {axis.atom}); {bad[0]} does "
                "not"))
        segments = tuple(s // axis.atom * axis.per_atom if axis.atom != axis.per_atom else s
                         for s in segments)
    match rule:
        case PartitionedSegmentsSharding():  # the stored tensor keeps no interleaving (groups 1)
            return replace(rule, axis=index, segments=segments, granule=axis.granule, groups=1)
        case SegmentedSharding():
            return replace(rule, axis=index, segments=segments, granule=axis.granule)
    return replace(rule, axis=index, granule=axis.granule)


def expand_linear_format_parameter_group(group: ParameterGroupSpec,
                                         format: LinearFormat | None) -> ParameterGroupSpec:
    """`group` with every encoded linear weight replaced by its stored tensors (same group)."""
    return linear_format_expansion(group, format)[0]


MemberSource = tuple[int, int, str]
"""Where an expanded member's target comes from: (dense member index, characters stripped from
its target, suffix appended)."""


def linear_format_expansion(group: ParameterGroupSpec, format: LinearFormat | None
                            ) -> tuple[ParameterGroupSpec, tuple[MemberSource, ...]]:
    """`expand_linear_format_parameter_group` and, per stored member, the `MemberSource` of its
    target, so a group differing only by names can be expanded by renaming."""
    if format is None or format.kind is LinearFormatKind.DENSE:
        return group, tuple((i, 0, "") for i in range(len(group.members)))
    members: list[ParameterMemberSpec] = []
    sources: list[MemberSource] = []
    changed = False
    for index, member in enumerate(group.members):
        parts = _parts(format, group.name, member) if format.encodes(member) else None
        if parts is None:
            members.append(member)
            sources.append((index, 0, ""))
            continue
        changed = True
        for part in parts:
            members.append(ParameterMemberSpec(
                target=part.target(member.target),
                shape=tuple(a.length(member.shape) for a in part.axes),
                sharding=_stored_sharding(format, group.name, member, part), dtype=part.dtype,
                heads=member.heads, encoding=part.encoding))
            sources.append((index, part.strip, part.suffix))
    if not changed:
        return group, tuple(sources)
    units, label = group.units, group.units_label
    if units is not None:
        reduced = reduced_partition_units(units, members)
        if reduced != units:
            label = (f"{label or units} aligned to {format.describe()} blocks: gcd = {reduced}")
        units = reduced
    return replace(group, members=tuple(members), units=units, units_label=label), tuple(sources)


def target_facts(format: LinearFormat | None, targets: Iterable[str]) -> tuple[object, ...]:
    """All that expanding under `format` reads of member `targets` (the patterns each matches,
    whether each is a `.weight`) besides the group's structure; () when nothing."""
    if format is None or format.kind is LinearFormatKind.DENSE:
        return ()
    patterns = format.excluded + format.applies_to
    mlx = format.kind is LinearFormatKind.MLX_AFFINE
    if not patterns and not mlx:
        return ()
    return tuple((tuple(target_matches(p, t) for p in patterns), mlx and t.endswith(".weight"))
                 for t in targets)


def expand_linear_format_parameter_groups(groups: Iterable[ParameterGroupSpec],
                                          format: LinearFormat | None
                                          ) -> tuple[ParameterGroupSpec, ...]:
    """Every group rewritten into its physical checkpoint representation under `format`."""
    return tuple(expand_linear_format_parameter_group(g, format) for g in groups)

