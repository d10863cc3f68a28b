"""The storage formats `partc verify` writes its reference checkpoint in, read from the config
as the format's own tools read it, independently of the family being verified.

Each format says which dense tensors it encodes (the modules its own implementation converts:
transformers' FP8 and MXFP4 integrations, mlx_lm's `quantize_model`), how it encodes them, how
it decodes them (transformers' own functions where they exist, mlx's documented affine formula
otherwise), and how a rank's slice of a stored tensor maps onto the dense weight. The encoders
are ours (transformers' MXFP4 encoder needs triton); any valid encoding serves, since the dense
reference is what the decoder gives back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from partc.errors import VerifyError
from partc.runtime.headers import DTYPES
from partc.verify.reference import require_libraries

FP8_MAX = 448.0
"""Largest float8 e4m3fn value."""
MXFP4_GROUP = 32
"""Elements per MXFP4 block (one E8M0 scale each)."""
SHRUNK_FP8_BLOCK = 4
"""Block size of a shrunk reference model's FP8 scales: its expert widths (32) still hold a
block per rank at T = 8, as the released models' widths do at their block size."""
SHRUNK_MLX_GROUP = 32
"""Group size of a shrunk reference model's MLX scales (mlx_lm's smallest)."""

Selection = tuple[int | None, tuple[tuple[int, int], ...]]
"""(axis, ranges) a rank reads of a tensor; axis None: the whole tensor."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageFormat:
    """A linear storage format named by a config, with its parameters."""

    kind: str
    """`block_fp8`, `mxfp4` or `mlx_affine`."""
    block: tuple[int, int] = (128, 128)
    """FP8 block (rows, columns)."""
    bits: int = 4
    """MLX bits per code."""
    group_size: int = 64
    """MLX elements per scale and bias."""
    not_converted: tuple[str, ...] | None = None
    """The config's `modules_to_not_convert` (None: transformers' default)."""

    @property
    def spelled(self) -> str:
        """The format and its parameters, in words."""
        if self.kind == "block_fp8":
            return f"block_fp8 (F8_E4M3, {list(self.block)} blocks, F32 weight_scale_inv)"
        if self.kind == "mlx_affine":
            return f"mlx_affine ({self.bits}-bit, groups of {self.group_size})"
        return "mxfp4 (U8 _blocks, E8M0 _scales)"

    def companions(self, dense: str) -> dict[str, str]:
        """The stored tensors of an encoded dense tensor, by part (`weight` first)."""
        if self.kind == "block_fp8":
            return {"weight": dense, "scale": dense + "_scale_inv"}
        if self.kind == "mxfp4":
            return {"weight": dense + "_blocks", "scale": dense + "_scales"}
        module = dense.removesuffix(".weight")
        return {"weight": dense, "scale": module + ".scales", "bias": module + ".biases"}


def storage_format(config: dict[str, Any], *, shrunk: bool) -> StorageFormat | None:
    """The storage format a config's quantization keys name (None: dense, or a format verify
    does not write): `quantization_config.quant_method` `fp8` (block FP8, transformers'
    FineGrainedFP8Config) or `mxfp4`; mlx_lm's `quantization` {bits, group_size} (affine).
    A shrunk reference model gets blocks and groups no wider than its widths allow."""
    section = config.get("quantization_config")
    method = section.get("quant_method") if isinstance(section, dict) else None
    skip = section.get("modules_to_not_convert") if isinstance(section, dict) else None
    not_converted = tuple(str(s) for s in skip) if isinstance(skip, list) else None
    if method == "fp8":
        assert isinstance(section, dict)
        block = tuple(int(b) for b in section.get("weight_block_size") or (128, 128))
        if shrunk:
            block = tuple(min(b, SHRUNK_FP8_BLOCK) for b in block)
        return StorageFormat(kind="block_fp8", block=(block[0], block[1]),
                             not_converted=not_converted)
    if method == "mxfp4":
        return StorageFormat(kind="mxfp4", not_converted=not_converted)
    mlx = config.get("quantization")
    if method is None and isinstance(mlx, dict) and mlx.get("mode", "affine") == "affine" \
            and isinstance(mlx.get("bits"), int) and mlx["bits"] > 0:
        group = int(mlx.get("group_size") or 64)
        return StorageFormat(kind="mlx_affine", bits=int(mlx["bits"]),
                             group_size=min(group, SHRUNK_MLX_GROUP) if shrunk else group)
    return None


def quantization_keys(fmt: StorageFormat, config: dict[str, Any]) -> dict[str, Any]:
    """The config's quantization keys as the reference checkpoint's config.json carries them
    (the user's, with the block or group size the reference was quantized with)."""
    out: dict[str, Any] = {}
    for key in ("quantization_config", "quantization"):
        if isinstance(config.get(key), dict):
            out[key] = dict(config[key])
    if fmt.kind == "block_fp8":
        out["quantization_config"]["weight_block_size"] = list(fmt.block)
    if fmt.kind == "mlx_affine":
        for section in out.values():
            if "group_size" in section:
                section["group_size"] = fmt.group_size
    return out


def _torch_of(array: np.ndarray) -> Any:
    """A numpy array as loaded by partc (ml_dtypes included) as a torch tensor, same bits."""
    torch, _ = require_libraries()
    name = str(array.dtype)
    if name in ("float8_e4m3fn", "bfloat16"):
        raw = torch.from_numpy(np.ascontiguousarray(array).view(
            np.uint8 if name == "float8_e4m3fn" else np.int16))
        return raw.view(getattr(torch, name))
    return torch.from_numpy(np.ascontiguousarray(array))


def numpy_of(value: Any) -> np.ndarray:
    """A torch tensor as partc's loader gives it: the same bits, FP8 and BF16 as ml_dtypes."""
    torch, _ = require_libraries()
    for dtype, raw, stored in (("float8_e4m3fn", torch.uint8, "F8_E4M3"),
                               ("bfloat16", torch.int16, "BF16")):
        if value.dtype == getattr(torch, dtype):
            return np.asarray(value.view(raw).numpy()).view(DTYPES[stored])
    return np.asarray(value.numpy())


def _transformers_function(module: str, name: str) -> Any:
    """A dequantization function of transformers, or a VerifyError naming it."""
    _, transformers = require_libraries()
    import importlib

    found = getattr(importlib.import_module(f"transformers.integrations.{module}"), name, None)
    if found is None:
        raise VerifyError(f"transformers {transformers.__version__} has no "
                          f"`transformers.integrations.{module}.{name}`, which verify "
                          "dequantizes this format with")
    return found


# ---------------------------------------------------------------- encoding


def encode(fmt: StorageFormat, dense: Any) -> dict[str, Any]:
    """The stored tensors (torch, by part) of a dense float32 tensor."""
    torch, _ = require_libraries()
    if fmt.kind == "block_fp8":  # [..., out, in], a scale per block (partial edge blocks)
        rows, cols = dense.shape[-2:]
        b0, b1 = fmt.block
        grid = (math.ceil(rows / b0), math.ceil(cols / b1))
        padded = torch.zeros((*dense.shape[:-2], grid[0] * b0, grid[1] * b1))
        padded[..., :rows, :cols] = dense.abs()
        amax = padded.unflatten(-1, (grid[1], b1)).unflatten(-3, (grid[0], b0)).amax(
            dim=(-3, -1))
        scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        wide = scale.repeat_interleave(b0, -2).repeat_interleave(b1, -1)[..., :rows, :cols]
        codes = (dense / wide).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": codes, "scale": scale}
    if fmt.kind == "mxfp4":  # [E, in, out] -> output-major [E, out, in/32, 16]
        lut = torch.tensor(_transformers_function("mxfp4", "FP4_VALUES"))
        rows = dense.transpose(-1, -2).unflatten(-1, (-1, MXFP4_GROUP))
        amax = rows.abs().amax(-1)
        exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)),
                               torch.full_like(amax, -127)).clamp(-127, 127)
        scaled = rows / torch.exp2(exponent)[..., None]
        codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return {"weight": blocks, "scale": (exponent + 127).to(torch.uint8)}
    levels = 2 ** fmt.bits - 1  # mlx affine: [out, in] in groups along `in`
    groups = dense.unflatten(-1, (-1, fmt.group_size))
    low, high = groups.amin(-1), groups.amax(-1)
    scale = torch.where(high > low, (high - low) / levels, torch.ones_like(low))
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, levels)
    words = mlx_pack(codes.flatten(-2).to(torch.uint8).numpy(), fmt.bits)
    return {"weight": torch.from_numpy(words), "scale": scale, "bias": low}


def mlx_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """mlx's packing of `bits`-bit codes along the last axis into uint32 words: one
    little-endian bit stream, code k at bits [k * bits, (k + 1) * bits) of the row (so 32 / bits
    codes a word for 2, 4 and 8 bits; 8 codes in 3 or 5 bytes for 3 and 5 bits, 4 in 3 bytes
    for 6, as mlx's kernels unpack them). The row's codes must fill whole words."""
    stream = np.unpackbits(np.ascontiguousarray(codes, dtype=np.uint8)[..., None],
                           axis=-1, count=bits, bitorder="little")
    packed = np.packbits(stream.reshape(*codes.shape[:-1], -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def mlx_unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """The codes of `mlx_pack`'s words (uint8, the last axis `32 / bits` times as long)."""
    raw = np.ascontiguousarray(np.asarray(words).astype("<u4")).view(np.uint8)
    stream = np.unpackbits(raw, axis=-1, bitorder="little")
    fields = stream.reshape(*stream.shape[:-1], -1, bits)
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint16)
    codes: np.ndarray = (fields.astype(np.uint16) * weights).sum(-1).astype(np.uint8)
    return codes


# ---------------------------------------------------------------- decoding


def expected_companion_shape(fmt: StorageFormat, weight: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the scale (and bias) must have for a stored weight (or a rank's slice)."""
    if fmt.kind == "block_fp8":
        return (*weight[:-2], math.ceil(weight[-2] / fmt.block[0]),
                math.ceil(weight[-1] / fmt.block[1]))
    if fmt.kind == "mxfp4":
        return weight[:-1]
    return (*weight[:-1], weight[-1] * 32 // (fmt.bits * fmt.group_size))


def decode(fmt: StorageFormat, parts: dict[str, np.ndarray]) -> np.ndarray:
    """The dense float32 tensor of stored parts, as the format's implementation computes it:
    transformers' `_dequantize_fp8_weight` (block FP8: its `weight_block_size`, partial edge
    blocks included), `convert_moe_packed_tensors` (MXFP4, then `[E, in, out]`), and mlx's
    affine `w = scale * q + bias` per group (codes a little-endian bit stream in uint32
    words, `mlx_unpack`)."""
    torch, _ = require_libraries()
    if fmt.kind == "block_fp8":
        dequantize = _transformers_function("finegrained_fp8", "_dequantize_fp8_weight")
        dense = dequantize(_torch_of(parts["weight"]), _torch_of(parts["scale"]),
                           list(fmt.block), torch.float32)
        return np.asarray(dense.numpy(), dtype=np.float32)
    if fmt.kind == "mxfp4":
        convert = _transformers_function("mxfp4", "convert_moe_packed_tensors")
        dense = convert(_torch_of(parts["weight"]), _torch_of(parts["scale"]),
                        dtype=torch.float32)
        return np.asarray(dense.numpy(), dtype=np.float32)
    codes = mlx_unpack(np.asarray(parts["weight"]), fmt.bits)
    scale = np.repeat(np.asarray(parts["scale"], dtype=np.float32), fmt.group_size, -1)
    bias = np.repeat(np.asarray(parts["bias"], dtype=np.float32), fmt.group_size, -1)
    return (scale * codes.astype(np.float32) + bias).astype(np.float32)


def dense_selection(fmt: StorageFormat, stored: Selection, ndim: int) -> Selection | None:
    """The dense weight's elements (of `ndim` axes) a rank's slice of the stored weight decodes
    to: FP8 keeps the axes; MLX packs `32 / bits` codes a word on the last axis (a bit stream);
    MXFP4 stores `[..., out, in/32, 16]` for a dense `[..., in, out]`. None: a slice that cuts
    a block's bytes, or a code (no rank can decode it)."""
    axis, ranges = stored
    if axis is None or fmt.kind == "block_fp8":
        return stored
    if fmt.kind == "mlx_affine":
        if axis != ndim - 1:
            return stored
        if any(a * 32 % fmt.bits or b * 32 % fmt.bits for a, b in ranges):
            return None  # a cut inside a code (3, 5 and 6 bits straddle words)
        return (axis, tuple((a * 32 // fmt.bits, b * 32 // fmt.bits) for a, b in ranges))
    if axis == ndim - 2:  # the output axis
        return (ndim - 1, ranges)
    if axis == ndim - 1:  # the blocks axis: 32 inputs each
        return (ndim - 2, tuple((a * MXFP4_GROUP, b * MXFP4_GROUP) for a, b in ranges))
    return stored if axis < ndim - 2 else None
