"""`partc init --prove` of a quantized checkpoint (block-FP8 DeepSeek-V3 and Qwen3, MXFP4
gpt-oss, MLX 4-bit Llama): the scaffold declares the dense weights and the checkpoint's
`linear_formats:` entry, so the format's packed weights and companions (`weight_scale_inv`,
`_blocks`/`_scales`, `scales`/`biases`) follow their weights. As written, it checks against the
real quantized checkpoint at exactly the T <= 4 its built-in family (architectures/<family>.yaml,
planned from that file) checks at, verifies against transformers' modeling code in the stored
format, and its ranks read the built-in's elements at each of those T; no line is marked CHECK
for the format (the ones left are those of the dense twin's scaffold, tests/fixtures/hf)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from partc.api import check_family, plan_family
from partc.cli.commands import verify_failures
from partc.plan.topology import Topology
from partc.scaffold.family_text import scaffold
from partc.scaffold.prove import prove, read_share
from partc.verify.run import verify_family

from support import HF, QUANTIZED, ROOT

FIXTURES = {"deepseek_v3_fp8": ("deepseek_v3", "block_fp8", [1, 2]),
            "gpt_oss_mxfp4": ("gpt_oss", "mxfp4", [1, 2]),
            "llama_mlx4": ("llama", "mlx_affine", [1, 2]),
            "qwen3_fp8": ("qwen3", "block_fp8", [1, 2, 4])}
"""Per quantized fixture: its built-in family (and dense twin), the linear format it stores and
the T <= 4 that family checks at there (T = 3 splits none of their 2 KV heads). gpt-oss stops
at 2: MXFP4 cuts `down_proj` on its input axis (96 intermediate channels) in whole 32-element
blocks, so its expert group has 3 units; Llama at 2: one 16-wide head of `o_proj`'s input per
rank would cut its 32-wide MLX groups; DeepSeek-V3 at 2: its 4 attention heads align to 2 units
of whole [16, 16] FP8 blocks (the built-in family's own refusals)."""


def _legal(family: Path, checkpoint: Path) -> list[int]:
    return [tp for tp in (1, 2, 3, 4) if not check_family(
        family, checkpoint / "config.json", checkpoint,
        topology=Topology(tensor_parallel_size=tp))]


@pytest.fixture(scope="module")
def proven(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """Each fixture's scaffold as `partc init --prove` writes it, and its CHECK lines."""
    folder = tmp_path_factory.mktemp("quantized")
    out = {}
    for name in FIXTURES:
        result = prove(QUANTIZED / name, QUANTIZED / name / "config.json", verify_failures)
        path = folder / f"{name}.yaml"
        path.write_text(result.text, encoding="utf-8")
        out[name] = (path, result.undecided)
    return out


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_quantized_scaffold_checks_verifies_and_splits_as_the_builtin_family(
        name: str, proven: dict[str, tuple[Path, tuple[str, ...]]], tmp_path: Path) -> None:
    family, undecided = proven[name]
    checkpoint = QUANTIZED / name
    builtin_name, fmt, sizes = FIXTURES[name]
    builtin = ROOT / "architectures" / f"{builtin_name}.yaml"
    assert _legal(builtin, checkpoint) == sizes
    assert _legal(family, checkpoint) == sizes
    for tp in sizes[1:]:
        shares = [read_share(plan_family(f, checkpoint / "config.json",
                                         Topology(tensor_parallel_size=tp),
                                         checkpoint=checkpoint)) for f in (family, builtin)]
        assert shares[0] == shares[1], (tp, shares)
    dense = scaffold(HF / builtin_name, HF / builtin_name / "config.json").undecided
    assert len(undecided) <= len(dense), undecided
    document: dict[str, Any] = yaml.safe_load(family.read_text(encoding="utf-8"))
    assert [e["format"] for e in document.get("linear_formats", [])] == [fmt]
    config = checkpoint / "config.json"  # deepseek_v3_fp8's MTP layer included
    report = verify_family(family, config, tensor_parallel_sizes=sizes[1:],
                           pipeline_parallel_size=1)
    assert [c.message for c in report.checks if not c.ok] == []
    assert any(fmt in note for note in report.notes), report.notes  # in the stored format


def test_a_stored_weight_whose_companions_do_not_fit_is_left_as_the_header_has_it() -> None:
    """An F8 weight whose `weight_scale_inv` is not its [16, 16] block grid stays F8 (the
    scaffold marks its shape as any other it cannot explain), the others become dense and the
    format applies to them by name, leaving the dense router out."""
    from partc.scaffold.dense_twin import dense_header

    header = {"a.q_proj.weight": ("F8_E4M3", [64, 32]),
              "a.q_proj.weight_scale_inv": ("F32", [4, 2]),
              "a.o_proj.weight": ("F8_E4M3", [32, 64]),
              "a.o_proj.weight_scale_inv": ("F32", [2, 2]),
              "a.router.weight": ("BF16", [4, 32])}
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    dense, quantized = dense_header(header, config, "BF16")
    assert dense == {"a.q_proj.weight": ("BF16", [64, 32]),
                     "a.o_proj.weight": ("F8_E4M3", [32, 64]),
                     "a.o_proj.weight_scale_inv": ("F32", [2, 2]),
                     "a.router.weight": ("BF16", [4, 32])}
    assert quantized is not None and quantized.entry["applies_to"] == ["*.q_proj"]
    assert dense_header(header, {}, "BF16") == (header, None)
    plain = {"a.q_proj.weight": ("BF16", [64, 32])}  # the config says FP8, the header does not
    assert dense_header(plain, config, "BF16") == (plain, None)
    packed = {"a.q_proj.weight": ("U32", [64, 4]), "a.q_proj.scales": ("BF16", [64, 1]),
              "a.q_proj.biases": ("BF16", [64, 1])}
    assert dense_header(packed, {"quantization": {"bits": 4, "group_size": 32}}, "BF16")[0] == {
        "a.q_proj.weight": ("BF16", [64, 32])}
    assert dense_header(packed, {"quantization": {"bits": 5, "group_size": 32}}, "BF16") == (
        packed, None)  # no MLX width: left as stored (and marked as packed)
