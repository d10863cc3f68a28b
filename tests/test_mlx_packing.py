"""MLX affine storage at every bit width mlx has (2, 3, 4, 5, 6, 8): verify's decoding of the
packed words against mlx's own `dequantize` (tests/fixtures/mlx_packing, written by mlx 0.32.4),
its packing against mlx's words, companion shapes and rank slices (3, 5 and 6 bits straddle
words: a slice is decodable only where it cuts between codes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from partc.verify.quantized_formats import (
    StorageFormat,
    decode,
    dense_selection,
    expected_companion_shape,
    mlx_pack,
    mlx_unpack,
)

ARRAYS = np.load(Path(__file__).parent / "fixtures" / "mlx_packing" / "affine.npz")
CASES = [(bits, group) for group in (32, 64) for bits in (2, 3, 4, 5, 6, 8)]


def parts(bits: int, group: int) -> dict[str, np.ndarray]:
    """mlx's stored parts of the fixture matrix."""
    key = f"b{bits}_g{group}"
    return {"weight": ARRAYS[f"q_{key}"], "scale": ARRAYS[f"scales_{key}"],
            "bias": ARRAYS[f"biases_{key}"]}


@pytest.mark.parametrize(("bits", "group"), CASES)
def test_decoding_equals_mlx_dequantize(bits: int, group: int) -> None:
    fmt = StorageFormat(kind="mlx_affine", bits=bits, group_size=group)
    stored = parts(bits, group)
    want = ARRAYS[f"dequant_b{bits}_g{group}"]
    got = decode(fmt, stored)
    assert got.shape == want.shape == ARRAYS["weight"].shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and it is a quantization of the matrix: within a step of every value (mlx moves each
    # group's range so that zero is a level: up to a whole step, not half)
    step = np.abs(np.repeat(stored["scale"], group, -1))  # mlx scales carry a sign
    assert np.all(np.abs(got - ARRAYS["weight"]) <= step + 1e-5)
    assert expected_companion_shape(fmt, stored["weight"].shape) == stored["scale"].shape


@pytest.mark.parametrize(("bits", "group"), CASES)
def test_packing_gives_mlx_words(bits: int, group: int) -> None:
    words = parts(bits, group)["weight"]
    codes = mlx_unpack(words, bits)
    assert codes.shape == (words.shape[0], words.shape[1] * 32 // bits)
    assert int(codes.max()) < 2 ** bits
    np.testing.assert_array_equal(mlx_pack(codes, bits), words)


@pytest.mark.parametrize(("bits", "group"), CASES)
def test_a_rank_decodes_its_groups_from_its_own_words(bits: int, group: int) -> None:
    fmt = StorageFormat(kind="mlx_affine", bits=bits, group_size=group)
    stored = parts(bits, group)
    words_per_group = group * bits // 32
    groups = stored["scale"].shape[1]
    want = ARRAYS[f"dequant_b{bits}_g{group}"]
    for first, last in [(0, 1), (1, groups), (groups // 2, groups)]:
        a, b = first * words_per_group, last * words_per_group
        selection = dense_selection(fmt, (1, ((a, b),)), 2)
        assert selection == (1, ((first * group, last * group),))
        mine = decode(fmt, {"weight": stored["weight"][:, a:b],
                            "scale": stored["scale"][:, first:last],
                            "bias": stored["bias"][:, first:last]})
        np.testing.assert_allclose(mine, want[:, first * group:last * group], rtol=1e-6,
                                   atol=1e-6)
    if 32 % bits:  # a slice after one word cuts a code in two: not decodable
        assert dense_selection(fmt, (1, ((0, 1),)), 2) is None
