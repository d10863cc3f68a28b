"""Linear formats: how a checkpoint physically stores the dense linear weights of a family.

A family declares its parameter groups dense (`weight [out, in]`). A quantized checkpoint stores
each linear weight as one or more packed tensors plus companions (block scales, group biases).
This module holds the formats as values (`LinearFormat`, the block tables); binding expands a
group under one (`partc.bind.linear_formats.expand_linear_format_parameter_groups`).

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
from collections.abc import Mapping
from dataclasses import dataclass

from partc.errors import SemanticError
from partc.parallel.placements import DTYPE_BITS, TORCH_DTYPE_NAMES
from partc.parallel.specs import ParameterMemberSpec


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
        if any(target_matches(p, member.target) for p in self.excluded):
            return False
        if self.applies_to:
            return any(target_matches(p, member.target) for p in self.applies_to)
        return member.linear is not None


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def target_matches(pattern: str, target: str) -> bool:
    """A glob matches the target itself or one of its module prefixes (`a.b` of `a.b.weight`)."""
    parts = target.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern)
               for i in range(len(parts), 0, -1))
