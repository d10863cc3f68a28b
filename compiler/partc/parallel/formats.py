"""Linear formats: how a checkpoint physically stores the dense linear weights of a family.

A family declares its parameter groups dense (`weight [out, in]`). A quantized checkpoint stores
each linear weight as one or more packed tensors plus companions (block scales, group biases).
`expand_linear_format_parameter_groups` rewrites every encoded weight into those tensors inside
the *same* group, maps its sharding onto them (segment boundaries and partitioned axes divided
by the block or pack size, with an error when a cut would split a block), and reduces the
group's partition units by gcd so every shard stays block-aligned.

Formats (see tests/fixtures/quantized/README.md for the real layouts):

- `dense`: nothing changes.
- `block_fp8` (DeepSeek-V3, Qwen3-FP8): `weight` F8_E4M3, same shape; `weight_scale_inv`
  `[ceil(out/B0), ceil(in/B1)]` in `scale_dtype` (F32 by default).
- `mlx_affine`: `weight` U32 `[out, in*bits/32]`; `scales`, `biases` `[out, in/group_size]` in
  the dense dtype. Like mlx_lm, a weight whose `in` is not a multiple of group_size stays dense.
- `mxfp4` (gpt-oss): `X_blocks` U8 `[..., out, in/32, 16]` and `X_scales` U8 `[..., out, in/32]`,
  output-major whatever the dense layout; the dense tensor itself is not stored.
- `gguf`: U8 `[..., out, in/block_elements*block_bytes]` for the block types of GGUF_BLOCK_TYPES.
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from partc.errors import ParallelPlanError, ParallelPlanErrorKind, SemanticError
from partc.parallel.placements import DTYPE_BITS, TORCH_DTYPE_NAMES
from partc.parallel.specs import (
    LinearWeightLayout,
    MemberSharding,
    MemberShardingKind,
    ParameterGroupSpec,
    ParameterMemberSpec,
    reduced_partition_units,
)


class LinearFormatKind(enum.Enum):
    """The checkpoint encodings of linear weights partc knows."""

    DENSE = "dense"
    BLOCK_FP8 = "block_fp8"
    MLX_AFFINE = "mlx_affine"
    MXFP4 = "mxfp4"
    GGUF = "gguf"


GGUF_BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q8_1": (32, 36), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
    "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292),
}
"""GGUF block types: (elements per block, bytes per block), as in ggml's `ggml_type_traits`."""

MLX_BITS = (2, 3, 4, 6, 8)
"""Bit widths of MLX affine quantization."""
MLX_GROUP_SIZES = (32, 64, 128)
"""Group sizes of MLX affine quantization."""
MXFP4_BLOCK_ELEMENTS = 32
"""Elements sharing one E8M0 scale in MXFP4 (OCP microscaling)."""
MXFP4_BLOCK_BYTES = 16
"""Bytes of one MXFP4 block (32 e2m1 nibbles)."""

FORMAT_OPTIONS: dict[LinearFormatKind, tuple[str, ...]] = {
    LinearFormatKind.DENSE: (),
    LinearFormatKind.BLOCK_FP8: ("block", "scale_dtype", "scale_suffix"),
    LinearFormatKind.MLX_AFFINE: ("bits", "group_size", "scale_dtype"),
    LinearFormatKind.MXFP4: ("scale_suffix",),
    LinearFormatKind.GGUF: ("gguf_type",),
}
"""Options each format accepts besides `applies_to` and `except`."""


def _option_error(option: str, message: str) -> SemanticError:
    return SemanticError(message, pointer="/" + option, doc="linear_formats#formats")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearFormat:
    """One checkpoint encoding of linear weights, with its parameters and target patterns."""

    kind: LinearFormatKind
    """Which encoding."""
    block: tuple[int, int] = (128, 128)
    """block_fp8: (output, input) block size."""
    scale_dtype: str | None = None
    """Dtype of the scale companions (None: F32 for block_fp8, the dense dtype for MLX)."""
    scale_suffix: str | None = None
    """Suffix naming the scale companion (None: `_scale_inv` for FP8, `_scales` for MXFP4)."""
    bits: int = 4
    """mlx_affine: bits per element."""
    group_size: int = 64
    """mlx_affine: elements per scale/bias group."""
    gguf_type: str = "Q8_0"
    """gguf: the block type."""
    applies_to: tuple[str, ...] = ()
    """Glob patterns of targets (or module prefixes) to encode; empty: every linear weight."""
    excluded: tuple[str, ...] = ()
    """Glob patterns of targets (or module prefixes) left dense (`except` in YAML)."""

    def __post_init__(self) -> None:
        kind = self.kind
        if kind is LinearFormatKind.BLOCK_FP8 and (
                len(self.block) != 2 or any(not _positive(b) for b in self.block)):
            raise _option_error("block", f"block_fp8 needs a block of two positive integers "
                                         f"[out, in], found {list(self.block)}")
        if kind is LinearFormatKind.MLX_AFFINE:
            if self.bits not in MLX_BITS or isinstance(self.bits, bool):
                raise _option_error("bits", f"mlx_affine bits must be one of "
                                            f"{list(MLX_BITS)}, found {self.bits!r}")
            if self.group_size not in MLX_GROUP_SIZES or isinstance(self.group_size, bool):
                raise _option_error("group_size", f"mlx_affine group_size must be one of "
                                                  f"{list(MLX_GROUP_SIZES)}, found "
                                                  f"{self.group_size!r}")
        if kind is LinearFormatKind.GGUF and self.gguf_type not in GGUF_BLOCK_TYPES:
            raise _option_error("gguf_type", f"gguf_type must be one of "
                                             f"{', '.join(GGUF_BLOCK_TYPES)}, found "
                                             f"{self.gguf_type!r}")
        if self.scale_dtype is not None and self.scale_dtype not in DTYPE_BITS:
            raise _option_error("scale_dtype", f"scale_dtype must be one of "
                                               f"{', '.join(sorted(DTYPE_BITS))}, found "
                                               f"{self.scale_dtype!r}")
        if self.scale_suffix is not None and not self.scale_suffix:
            raise _option_error("scale_suffix", "scale_suffix must not be empty")

    @classmethod
    def from_options(cls, kind: str, options: Mapping[str, object]) -> LinearFormat:
        """Build a format from its YAML name and evaluated options (SemanticError if wrong)."""
        try:
            fmt = LinearFormatKind(kind)
        except ValueError:
            raise _option_error("format", f"unknown linear format {kind!r}; expected one of "
                                f"{', '.join(k.value for k in LinearFormatKind)}") from None
        values: dict[str, object] = {}
        for key, value in options.items():
            if key in ("applies_to", "except"):
                if not isinstance(value, tuple | list) or not all(
                        isinstance(v, str) and v for v in value):
                    raise _option_error(key, f"`{key}` must be a list of glob patterns, found "
                                             f"{value!r}")
                values["excluded" if key == "except" else key] = tuple(value)
                continue
            if key not in FORMAT_OPTIONS[fmt]:
                allowed = ", ".join(f"`{o}`" for o in FORMAT_OPTIONS[fmt]) or "none"
                raise _option_error(key, f"option `{key}` does not apply to format "
                                         f"{fmt.value} (its options: {allowed})")
            if key == "block":
                if not isinstance(value, tuple | list):
                    raise _option_error(key, f"block must be a list [out, in], found {value!r}")
                value = tuple(value)
            elif key == "scale_dtype" and isinstance(value, str):
                value = TORCH_DTYPE_NAMES.get(value, value)
            elif key in ("bits", "group_size") and not _positive(value):
                raise _option_error(key, f"`{key}` must be a positive integer, found {value!r}")
            elif key in ("scale_suffix", "gguf_type") and not isinstance(value, str):
                raise _option_error(key, f"`{key}` must be a string, found {value!r}")
            values[key] = value
        return cls(kind=fmt, **values)  # type: ignore[arg-type]

    def describe(self) -> str:
        """A short spelling for messages, e.g. `block_fp8 [128, 128]`."""
        if self.kind is LinearFormatKind.BLOCK_FP8:
            return f"block_fp8 {list(self.block)}"
        if self.kind is LinearFormatKind.MLX_AFFINE:
            return f"mlx_affine {self.bits}-bit, group {self.group_size}"
        if self.kind is LinearFormatKind.GGUF:
            return f"gguf {self.gguf_type}"
        return str(self.kind.value)

    def encodes(self, member: ParameterMemberSpec) -> bool:
        """Whether this format stores `member` encoded (rather than dense)."""
        if self.kind is LinearFormatKind.DENSE or member.encoding or len(member.shape) < 2:
            return False
        if any(_matches(p, member.target) for p in self.excluded):
            return False
        if self.applies_to:
            return any(_matches(p, member.target) for p in self.applies_to)
        return member.linear is not None


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _matches(pattern: str, target: str) -> bool:
    """A glob matches the target itself or one of its module prefixes (`a.b` of `a.b.weight`)."""
    parts = target.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern)
               for i in range(len(parts), 0, -1))


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
    if rule.axis is None:
        return rule
    if rule.granule != 1:
        raise _misaligned(group, member.target, (
            f"group `{group}`: `{member.target}` is already {rule.describe()}; a linear format "
            "applies to a dense declaration only"))
    index = next(i for i, axis in enumerate(part.axes) if axis.source == rule.axis)
    axis = part.axes[index]
    n = member.shape[rule.axis]
    if rule.kind is MemberShardingKind.PARTITIONED and n % axis.atom:
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
    return MemberSharding(kind=rule.kind, axis=index, segments=segments, granule=axis.granule)


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
    return tuple((tuple(_matches(p, t) for p in patterns), mlx and t.endswith(".weight"))
                 for t in targets)


def expand_linear_format_parameter_groups(groups: Iterable[ParameterGroupSpec],
                                          format: LinearFormat | None
                                          ) -> tuple[ParameterGroupSpec, ...]:
    """Every group rewritten into its physical checkpoint representation under `format`."""
    return tuple(expand_linear_format_parameter_group(g, format) for g in groups)

