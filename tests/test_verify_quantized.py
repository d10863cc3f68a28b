"""Quantized families verified in their storage format (`partc.verify.quantized`).

The reference model is re-stored as the config's quantization names it, and each rank's
stored weights are decoded from its own slices with its own companions. The oracles are not
partc's: the quantized fixtures (`tests/fixtures/quantized`, written by numpy and ml_dtypes as
the releases store them, the MLX one by mlx_lm itself) for which tensors are encoded and how,
their `reference_dequant.npz` (transformers' logits on the weights decoded by the fixture
generator) for the decoding, and transformers' modeling code for the module checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from partc.cli.main import main
from partc.verify.quantized import stored_reference
from partc.verify.quantized_formats import decode, numpy_of, storage_format
from partc.verify.reference import build_reference, load_model
from partc.verify.run import verify_family
from partc.verify.session import ExpertTopology
from partc.verify.shrink import reference_config

from support import QUANTIZED, fp8_scales_family

FIXTURES = {"deepseek_v3_fp8": "block_fp8", "qwen3_fp8": "block_fp8",
            "gpt_oss_mxfp4": "mxfp4", "llama_mlx4": "mlx_affine"}
COMPANION = {"block_fp8": ("_scale_inv", ""), "mxfp4": ("_scales", ""),
             "mlx_affine": (".scales", ".weight")}
"""A stored weight's scale suffix, and what replaces it to name the weight."""


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    with safe_open(str(path), "np") as handle:
        return {k: (tuple(handle.get_slice(k).get_shape()), handle.get_slice(k).get_dtype())
                for k in handle.keys()}  # noqa: SIM118


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_reference_is_stored_as_the_release_stores_it(tmp_path: Path, name: str) -> None:
    """Which tensors are encoded, under which names, shapes and dtypes, is what the fixture
    (the real releases' layout) holds: only the dense dtype differs (the reference is
    float32, the fixture's dense tensors and Qwen's scales BF16)."""
    config = json.loads((QUANTIZED / name / "config.json").read_text())
    small, notes = reference_config(config)
    build_reference(small, tmp_path / "reference", 0)
    stored = stored_reference(config, tmp_path / "reference", tmp_path, notes)
    assert stored is not None and stored.format.kind == FIXTURES[name]
    mine = _header(stored.folder / "model.safetensors")
    fixture = _header(QUANTIZED / name / "model.safetensors")
    assert sorted(mine) == sorted(fixture)
    for tensor, (shape, dtype) in fixture.items():
        assert mine[tensor][0] == shape, tensor
        assert mine[tensor][1] == dtype or (dtype, mine[tensor][1]) == ("BF16", "F32"), tensor
    assert len(stored.encoded) == sum(t.endswith(COMPANION[FIXTURES[name]][0]) for t in fixture)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_decoding_the_fixture_gives_its_reference_logits(tmp_path: Path, name: str) -> None:
    """The decoder (transformers' own for FP8 and MXFP4, the affine formula for MLX) applied
    to the fixture's stored tensors gives the weights the fixture's logits were computed from,
    DeepSeek's partial 24-row FP8 blocks included (transformers' loader gets those wrong)."""
    from safetensors.torch import load_file, save_file

    folder = QUANTIZED / name
    config = json.loads((folder / "config.json").read_text())
    fmt = storage_format(config, shrunk=False)
    assert fmt is not None
    stored = load_file(str(folder / "model.safetensors"))
    suffix, weight_suffix = COMPANION[fmt.kind]
    dense = {k: v.float() for k, v in stored.items()}
    for scale in [k for k in stored if k.endswith(suffix)]:
        weight = scale.removesuffix(suffix) + weight_suffix
        parts = {part: numpy_of(stored[tensor]) for part, tensor in fmt.companions(weight).items()}
        dense[weight] = torch.from_numpy(decode(fmt, parts))
        for tensor in fmt.companions(weight).values():
            if tensor != weight:
                del dense[tensor]
    small = {k: v for k, v in config.items() if k not in ("quantization_config", "quantization")}
    (tmp_path / "config.json").write_text(json.dumps({**small, "dtype": "float32"}))
    save_file(dense, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    want = np.load(folder / "reference_dequant.npz")
    with torch.no_grad():
        got = load_model(tmp_path)(torch.from_numpy(want["input_ids"]), use_cache=False).logits
    scale = float(np.abs(want["logits"]).max())
    assert float(np.abs(got.numpy() - want["logits"]).max()) <= 1e-4 * scale + 1e-5


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_quantized_fixtures_verify_from_each_rank_s_own_slices(name: str) -> None:
    """At T = 2, and for the MoE fixtures at EP = 2 too (each rank's experts' companions)."""
    moe = name in ("deepseek_v3_fp8", "gpt_oss_mxfp4")
    report = verify_family(None, QUANTIZED / name / "config.json", tensor_parallel_sizes=[2],
                           pipeline_parallel_size=1,
                           experts=ExpertTopology(expert_parallel_size=2) if moe else None)
    assert report.ok, report.first_failure
    kind = FIXTURES[name]
    stored = [c for c in report.checks if c.module == f"{kind} storage"]
    assert [(c.rank, c.ep) for c in stored] == [(0, None), (1, None)] + (
        [(0, 2), (1, 2)] if moe else [])
    assert all(c.ok for c in stored)
    assert all(int(c.message.split()[0]) > 0 for c in stored)  # weights decoded on each rank
    assert any(n.startswith(f"the reference checkpoint is stored as {kind}")
               for n in report.notes)
    assert sum(c.module.startswith("model.") for c in report.checks) >= 8  # the module checks


def test_scales_declared_as_members_split_with_their_weights_verify(tmp_path: Path) -> None:
    """The control of the two refusals below: the same members, each scale split on its
    weight's axis, verify."""
    family = fp8_scales_family(tmp_path, down_scale_axis=1, gate_segments=False)
    report = verify_family(family, QUANTIZED / "qwen3_fp8" / "config.json",
                           tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    assert report.ok, report.first_failure


def test_a_scale_split_on_the_other_axis_is_refused(tmp_path: Path, capsys) -> None:
    family = fp8_scales_family(tmp_path, down_scale_axis=0, gate_segments=False)
    line = family.read_text().splitlines().index('  - name: "layers.{unit}.mlp"') + 1
    status = main(["verify", str(family), "--config",
                   str(QUANTIZED / "qwen3_fp8" / "config.json"), "--tp", "2", "--pp", "1"])
    err = capsys.readouterr().err
    assert status == 1
    assert ("error: T=2 x S=1: rank 0 loads `model.layers.0.mlp.down_proj.weight` as [64, 64] "
            "(axis 1 0:64 of [64, 128]) but `model.layers.0.mlp.down_proj.weight_scale_inv` as "
            "[2, 8] (axis 0 0:2 of [4, 8]): the [16, 16] blocks of the rank's weight slice need "
            "a [4, 4] slice of `model.layers.0.mlp.down_proj.weight_scale_inv`, split with its "
            "weight's blocks") in err
    assert f"group `layers.0.mlp` is declared at {family}:{line}" in err
    assert "Traceback" not in err


def test_a_scale_holding_other_blocks_is_refused(tmp_path: Path) -> None:
    """Shapes agree (rank 0 holds gate rows 0:32 and 64:96, and scale rows 0:4, the blocks of
    rows 0:64), values do not."""
    family = fp8_scales_family(tmp_path, down_scale_axis=1, gate_segments=True)
    report = verify_family(family, QUANTIZED / "qwen3_fp8" / "config.json",
                           tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    failure = report.first_failure
    assert failure is not None and failure.rank == 0
    assert (failure.module, failure.group) == ("model.layers.0.mlp.gate_proj.weight",
                                               "layers.0.mlp")
    assert ("rank 0 loads `model.layers.0.mlp.gate_proj.weight` as [64, 64] (axis 0 0:32, "
            "64:96 of [128, 64]), which decoded with `model.layers.0.mlp.gate_proj."
            "weight_scale_inv` as [4, 4] (axis 0 0:4 of [8, 4]) differs from the reference "
            "weight on those elements") in failure.message
    assert failure.max_error > 0.01


@pytest.mark.parametrize("bits", [3, 6])
def test_mlx_widths_that_straddle_words_verify(tmp_path: Path, bits: int) -> None:
    """mlx's 3- and 6-bit codes cross uint32 words (a bit stream: tests/test_mlx_packing.py
    checks it against mlx itself); the llama fixture's config at those widths verifies at
    T = 2 in that storage (before: an internal error)."""
    config = json.loads((QUANTIZED / "llama_mlx4" / "config.json").read_text())
    config["quantization"]["bits"] = bits
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = verify_family(None, tmp_path / "config.json", tensor_parallel_sizes=[2],
                           pipeline_parallel_size=1)
    assert report.ok, report.first_failure
    stored = [c for c in report.checks if c.module == "mlx_affine storage"]
    assert len(stored) == 2 and all(int(c.message.split()[0]) > 0 for c in stored)
    assert any(f"mlx_affine ({bits}-bit" in n for n in report.notes), report.notes
