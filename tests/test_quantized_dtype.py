"""`load(dtype=...)` on a quantized checkpoint is refused with one clear error naming the encoded
tensor and its scale companion: widening block-FP8 values without their `weight_scale_inv`
gave wrong weights silently (the fixture's dense reference, reference_dequant.npz's source,
shows how far off), and MLX / MXFP4 packed weights cannot become floats without their scales.
Dense checkpoints still convert, and a quantized one still loads its stored encoding."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from partc.errors import CheckpointError

from support import QUANTIZED, compile_and_import, hf

CASES = [
    ("deepseek_v3_fp8", "model.layers.0.mlp.down_proj.weight", "as F8_E4M3",
     "its block scales `model.layers.0.mlp.down_proj.weight_scale_inv`"),
    ("qwen3_fp8", "model.layers.0.mlp.down_proj.weight", "as F8_E4M3",
     "its block scales `model.layers.0.mlp.down_proj.weight_scale_inv`"),
    ("llama_mlx4", "lm_head.weight", "packed as MLX affine U32",
     "its group scales and biases `lm_head.scales`, `lm_head.biases`"),
    ("gpt_oss_mxfp4", "model.layers.0.mlp.experts.down_proj_blocks", "as MXFP4 U8 blocks",
     "its scales `model.layers.0.mlp.experts.down_proj_scales`"),
]


@pytest.mark.parametrize(("name", "first", "stored", "companion"), CASES,
                         ids=[c[0] for c in CASES])
def test_dtype_on_a_quantized_checkpoint_is_refused_naming_the_tensor_and_its_scales(
        tmp_path: Path, name: str, first: str, stored: str, companion: str) -> None:
    folder = QUANTIZED / name
    _, package = compile_and_import(None, folder / "config.json", tmp_path / "b", tp=2)
    for dtype in (np.float32, "bfloat16"):
        with pytest.raises(CheckpointError) as caught:
            package.load(folder, rank=0, dtype=dtype)
        assert caught.value.tensor == first
        assert (f"would convert `{first}`, stored {stored}, without applying {companion}: wrong "
                "weights; partc does not dequantize") in caught.value.message
    state = package.load(folder, rank=0)  # the stored encoding, as before
    assert first in state.tensors


def test_the_widened_fp8_weight_is_not_the_dequantized_one(tmp_path: Path) -> None:
    """Why: the block scales of the fixture are not 1, so FP8 values widened alone differ from
    transformers' own dequantization (weight * scale_inv per 128x128 block)."""
    from safetensors.torch import load_file

    stored = load_file(str(QUANTIZED / "qwen3_fp8" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    weight = stored[name]
    assert weight.dtype == torch.float8_e4m3fn
    widened = weight.float().numpy()
    scale = stored[name + "_scale_inv"].float()
    rows, cols = weight.shape
    block = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    dequantized = (weight.float() * block[:rows, :cols]).numpy()
    assert not np.allclose(widened, dequantized)


def test_dtype_still_converts_a_dense_checkpoint(tmp_path: Path) -> None:
    _, package = compile_and_import(None, hf("llama") / "config.json", tmp_path / "b", tp=2)
    state = package.load(hf("llama"), rank=0, dtype="bfloat16")
    assert {a.dtype for a in state.tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
