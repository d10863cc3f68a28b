"""Dequantization of the quantized checkpoint formats in ``tests/fixtures/quantized``.

* block FP8 (DeepSeek-V3, Qwen3-FP8): ``X.weight`` F8_E4M3 times ``X.weight_scale_inv`` per
  ``weight_block_size`` block, ceil grid with partial edge blocks (DeepSeek ``weight_dequant``);
* MLX affine (mlx-lm): ``X.weight`` U32-packed codes, ``w = scales * q + biases`` per group;
* MXFP4 (gpt-oss): ``X_blocks`` e2m1 nibbles and ``X_scales`` E8M0, output-major ``[E, out, in]``
  transposed to HF's ``[E, in, out]`` and stored as ``X``.

Every other tensor is upcast to float32 under its own name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

F32 = np.float32
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=F32)


def dequantize_fp8_block(
    q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]
) -> np.ndarray:
    """``W[i, j] = q[i, j] * scale_inv[i // bo, j // bi]``; partial edge blocks allowed."""
    rows, cols = q.shape
    scale = np.asarray(scale_inv, dtype=F32)
    if scale.shape != (-(-rows // block[0]), -(-cols // block[1])):
        raise ValueError(f"scale grid {scale.shape} does not fit {q.shape} with block {block}")
    expanded = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return (q.astype(F32) * expanded).astype(F32)


def dequantize_mlx_affine(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, bits: int
) -> np.ndarray:
    """Unpack a little-endian bit stream of ``bits``-bit codes, then ``scales * q + biases``."""
    out_dim = packed.shape[0]
    stream = np.unpackbits(
        np.ascontiguousarray(packed.astype("<u4")).view(np.uint8), axis=-1, bitorder="little"
    )
    in_dim = stream.shape[-1] // bits
    codes = stream[:, : in_dim * bits].reshape(out_dim, in_dim, bits).astype(np.uint32)
    q = (codes << np.arange(bits, dtype=np.uint32)).sum(axis=-1).astype(F32)
    group = np.arange(in_dim) // group_size
    return (np.asarray(scales, F32)[:, group] * q + np.asarray(biases, F32)[:, group]).astype(F32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Blocks ``[..., out, G, 16]`` (u8) and E8M0 scales ``[..., out, G]`` -> ``[..., in, out]``."""
    low, high = blocks & 0x0F, blocks >> 4
    codes = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    values = FP4_VALUES[codes] * np.ldexp(F32(1.0), scales.astype(np.int32) - 127)[..., None]
    weight = values.reshape(*blocks.shape[:-2], -1).astype(F32)  # [..., out, in]
    return np.ascontiguousarray(np.swapaxes(weight, -1, -2))


def dequantize(
    config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Float32 tensors under HF checkpoint names, with every quantized tensor decoded."""
    qconfig = dict(config.get("quantization_config") or {})
    mlx = dict(config.get("quantization") or {})
    if not mlx and "group_size" in qconfig and "bits" in qconfig and "quant_method" not in qconfig:
        mlx = qconfig
    block = tuple(qconfig.get("weight_block_size") or (128, 128))
    out: dict[str, np.ndarray] = {}
    consumed: set[str] = set()
    for name, value in tensors.items():
        if f"{name}_scale_inv" in tensors:  # block FP8
            out[name] = dequantize_fp8_block(value, tensors[f"{name}_scale_inv"], block)
            consumed.add(f"{name}_scale_inv")
        elif name.endswith(".weight") and f"{name[:-7]}.scales" in tensors and mlx:
            base = name[:-7]
            out[name] = dequantize_mlx_affine(
                value,
                tensors[f"{base}.scales"],
                tensors[f"{base}.biases"],
                int(mlx["group_size"]),
                int(mlx["bits"]),
            )
            consumed |= {f"{base}.scales", f"{base}.biases"}
        elif name.endswith("_blocks") and f"{name[:-7]}_scales" in tensors:  # MXFP4
            base = name[:-7]
            out[base] = dequantize_mxfp4(value, tensors[f"{base}_scales"])
            consumed.add(f"{base}_scales")
        else:
            out[name] = np.asarray(value, dtype=F32)
    return {name: value for name, value in out.items() if name not in consumed}
