"""Linear formats: dense declarations rewritten into real quantized checkpoint layouts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from partc.api import bind, checkpoint_errors, plan_family
from partc.bind.linear_formats import (
    expand_linear_format_parameter_group,
    expand_linear_format_parameter_groups,
)
from partc.errors import ParallelPlanError, PartcError, SemanticError
from partc.parallel.formats import (
    GGUF_BLOCK_TYPES,
    LinearFormat,
    LinearFormatKind,
)
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import (
    BalancedSharding,
    EqualSharding,
    LinearWeightLayout,
    ParameterGroupSpec,
    ParameterMemberSpec,
    PartitionedSharding,
    Projection,
    ProjectionSharding,
    ReplicatedSharding,
    partitioned_projection_group,
    projection_parameter_group,
    segmented_projection_group,
)
from partc.plan.tensor_split import group_sharding_problems, realize_group
from partc.plan.topology import Topology
from partc.runtime._engine.reader import read_tensor
from partc.runtime._engine.selection import TensorSelection
from partc.runtime.checkpoint import open_checkpoint

from support import QUANTIZED, ROOT, hf

CASES = ROOT / "tests" / "cases"
FP8 = LinearFormat(kind=LinearFormatKind.BLOCK_FP8, block=(16, 16))
MLX4 = LinearFormat(kind=LinearFormatKind.MLX_AFFINE, bits=4, group_size=32,
                    applies_to=("*.weight",))
MXFP4 = LinearFormat(kind=LinearFormatKind.MXFP4)


def gguf(kind: str) -> LinearFormat:
    return LinearFormat(kind=LinearFormatKind.GGUF, gguf_type=kind)


def attention(q_rows: int = 64, kv_rows: int = 32, hidden: int = 64, units: int = 2,
              dtype: str = "BF16") -> ParameterGroupSpec:
    return partitioned_projection_group("attn", ParameterRole.ATTENTION_HEADS, [
        Projection(module="q", sharding=ProjectionSharding.COLUMN,
                   params={"weight": [q_rows, hidden]}, heads=4),
        Projection(module="k", sharding=ProjectionSharding.COLUMN,
                   params={"weight": [kv_rows, hidden], "bias": [kv_rows]}, heads=2),
        Projection(module="o", sharding=ProjectionSharding.ROW,
                   params={"weight": [hidden, q_rows], "bias": [hidden]}, heads=4),
    ], units, dtype=dtype, units_label="num_key_value_heads", kv_replication=True)


def summary(group: ParameterGroupSpec) -> list[tuple[str, str, tuple[int, ...], str, str]]:
    return [(m.target, m.dtype, m.shape, m.sharding.describe(), m.encoding)
            for m in group.members]


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(("kind", "options", "message", "pointer"), [
    ("int8", {}, "unknown linear format 'int8'; expected one of dense, block_fp8, mlx_affine, "
     "mxfp4, gguf", "/format"),
    ("block_fp8", {"bits": 4}, "option `bits` does not apply to format block_fp8 (its options: "
     "`block`, `scale_dtype`, `scale_suffix`)", "/bits"),
    ("dense", {"block": (1, 1)}, "option `block` does not apply to format dense (its options: "
     "none)", "/block"),
    ("block_fp8", {"block": 128}, "block must be a list [out, in], found 128", "/block"),
    ("block_fp8", {"block": (128, 0)}, "block_fp8 needs a block of two positive integers "
     "[out, in], found [128, 0]", "/block"),
    ("block_fp8", {"scale_dtype": "F12"}, "scale_dtype must be one of BF16,", "/scale_dtype"),
    ("block_fp8", {"scale_suffix": ""}, "scale_suffix must not be empty", "/scale_suffix"),
    ("mlx_affine", {"bits": 5}, "mlx_affine bits must be one of [2, 3, 4, 6, 8], found 5",
     "/bits"),
    ("mlx_affine", {"group_size": 48}, "mlx_affine group_size must be one of [32, 64, 128], "
     "found 48", "/group_size"),
    ("mlx_affine", {"bits": "4"}, "`bits` must be a positive integer, found '4'", "/bits"),
    ("gguf", {"gguf_type": "Q3_0"}, "gguf_type must be one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, "
     "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, found 'Q3_0'", "/gguf_type"),
    ("gguf", {"gguf_type": 4}, "`gguf_type` must be a string, found 4", "/gguf_type"),
    ("mxfp4", {"except": ("",)}, "`except` must be a list of glob patterns, found ('',)",
     "/except"),
])
def test_a_bad_format_option_names_the_option_and_the_legal_values(kind, options, message,
                                                                   pointer):
    with pytest.raises(SemanticError, match=re.escape(message)) as info:
        LinearFormat.from_options(kind, options)
    assert info.value.pointer == pointer


def test_format_options_become_a_validated_format():
    fmt = LinearFormat.from_options("block_fp8", {"block": (128, 128), "scale_dtype": "bfloat16",
                                                  "except": ("lm_head",)})
    assert fmt == LinearFormat(kind=LinearFormatKind.BLOCK_FP8, block=(128, 128),
                               scale_dtype="BF16", excluded=("lm_head",))
    assert fmt.describe() == "block_fp8 [128, 128]"
    assert MLX4.describe() == "mlx_affine 4-bit, group 32"
    assert gguf("Q6_K").describe() == "gguf Q6_K" and MXFP4.describe() == "mxfp4"


# ---------------------------------------------------------------- expansion per format


def test_block_fp8_adds_a_ceil_divided_scale_to_the_same_group_and_keeps_shards_block_aligned():
    expanded = expand_linear_format_parameter_group(attention(), FP8)
    assert summary(expanded) == [
        ("q.weight", "F8_E4M3", (64, 64), "partitioned(axis 0, granule 16)", "block_fp8.weight"),
        ("q.weight_scale_inv", "F32", (4, 4), "partitioned(axis 0)", "block_fp8.scale"),
        ("k.weight", "F8_E4M3", (32, 64), "partitioned(axis 0, granule 16)", "block_fp8.weight"),
        ("k.weight_scale_inv", "F32", (2, 4), "partitioned(axis 0)", "block_fp8.scale"),
        ("k.bias", "BF16", (32,), "partitioned(axis 0)", ""),
        ("o.weight", "F8_E4M3", (64, 64), "partitioned(axis 1, granule 16)", "block_fp8.weight"),
        ("o.weight_scale_inv", "F32", (4, 4), "partitioned(axis 1)", "block_fp8.scale"),
        ("o.bias", "BF16", (64,), "replicated", ""),
    ]
    assert (expanded.units, expanded.units_label) == (2, "num_key_value_heads")
    assert expanded.kv_replication and expanded.members[1].heads == (4,)
    partial = expand_linear_format_parameter_group(projection_parameter_group(
        "kv_a", ParameterRole.REPLICATED, "kv_a", ProjectionSharding.REPLICATED,
        {"weight": [24, 64]}), FP8)
    assert [m.shape for m in partial.members] == [(24, 64), (2, 4)]


def test_block_fp8_reduces_units_by_gcd_so_every_shard_is_whole_blocks():
    mla = partitioned_projection_group("heads", ParameterRole.ATTENTION_HEADS, [
        Projection(module="q_b", sharding=ProjectionSharding.COLUMN, params={"weight": [96, 32]},
                   heads=4),
        Projection(module="o", sharding=ProjectionSharding.ROW, params={"weight": [64, 64]},
                   heads=4),
    ], 4, units_label="num_attention_heads")
    expanded = expand_linear_format_parameter_group(mla, FP8)
    assert (expanded.units, expanded.units_label) == (
        2, "num_attention_heads aligned to block_fp8 [16, 16] blocks: gcd = 2")
    ranks = realize_group(expanded, 2)
    assert [r[0].selection for r in ranks] == [(0, ((0, 48),)), (0, ((48, 96),))]
    assert [r[1].selection for r in ranks] == [(0, ((0, 3),)), (0, ((3, 6),))]
    assert group_sharding_problems(expanded, 4)[0].startswith(
        "it (role attention_heads) has 2 partition units (num_attention_heads aligned to "
        "block_fp8 [16, 16] blocks: gcd = 2) but tensor_parallel_size is 4")


def test_block_fp8_remaps_fused_segments_onto_the_scale():
    fused = segmented_projection_group(
        "attn", ParameterRole.ATTENTION_HEADS, fused_module="qkv", segments=[64, 32, 32],
        fused_params={"weight": [128, 64]}, output_module="o", output_params={"weight": [64, 64]},
        units=2)
    expanded = expand_linear_format_parameter_group(fused, FP8)
    assert summary(expanded)[:2] == [
        ("qkv.weight", "F8_E4M3", (128, 64),
         "partitioned_segments(axis 0, segments [64, 32, 32], granule 16)", "block_fp8.weight"),
        ("qkv.weight_scale_inv", "F32", (8, 4), "partitioned_segments(axis 0, segments [4, 2, 2])",
         "block_fp8.scale")]
    assert [r[1].selection for r in realize_group(expanded, 2)] == [
        (0, ((0, 2), (4, 5), (6, 7))), (0, ((2, 4), (5, 6), (7, 8)))]


def test_segment_boundaries_off_the_block_grid_are_rejected():
    fused = segmented_projection_group(
        "attn", ParameterRole.ATTENTION_HEADS, fused_module="qkv", segments=[24, 8, 8],
        fused_params={"weight": [40, 64]}, output_module="o", output_params={"weight": [64, 24]},
        units=1)
    with pytest.raises(ParallelPlanError, match=re.escape(
            "group `attn`: segment boundaries [24, 32, 40] of `qkv.weight` must fall on "
            "block_fp8 [16, 16] block boundaries (multiples of 16); 24 does not")) as info:
        expand_linear_format_parameter_group(fused, FP8)
    assert (info.value.group, info.value.target) == ("attn", "qkv.weight")


def test_a_partitioned_axis_with_a_partial_block_is_rejected():
    g = partitioned_projection_group("mlp", ParameterRole.FEED_FORWARD_INTERMEDIATE, [
        ("up", ProjectionSharding.COLUMN, {"weight": [24, 64]})], 24)
    with pytest.raises(ParallelPlanError, match=re.escape(
            "group `mlp`: `up.weight` is partitioned(axis 0) but block_fp8 [16, 16] stores axis 0 "
            "in blocks of 16 elements and 24 is not a multiple of 16; a partitioned axis must be "
            "block-aligned (replicate the tensor or leave it dense with `except:`)")):
        expand_linear_format_parameter_group(g, FP8)


def test_mlx_affine_packs_the_input_axis_into_uint32_words_with_scales_and_biases():
    expanded = expand_linear_format_parameter_group(attention(), MLX4)
    assert summary(expanded)[:3] == [
        ("q.weight", "U32", (64, 8), "partitioned(axis 0)", "mlx_affine.weight"),
        ("q.scales", "BF16", (64, 2), "partitioned(axis 0)", "mlx_affine.scales"),
        ("q.biases", "BF16", (64, 2), "partitioned(axis 0)", "mlx_affine.biases")]
    assert summary(expanded)[-4:-1] == [
        ("o.weight", "U32", (64, 8), "partitioned(axis 1, granule 4)", "mlx_affine.weight"),
        ("o.scales", "BF16", (64, 2), "partitioned(axis 1)", "mlx_affine.scales"),
        ("o.biases", "BF16", (64, 2), "partitioned(axis 1)", "mlx_affine.biases")]
    three = LinearFormat(kind=LinearFormatKind.MLX_AFFINE, bits=3, group_size=64,
                         scale_dtype="F16")
    packed = expand_linear_format_parameter_group(attention(hidden=128, q_rows=128), three)
    assert [(m.shape, m.dtype) for m in packed.members[:3]] == [
        ((128, 12), "U32"), ((128, 2), "F16"), ((128, 2), "F16")]


def test_mlx_affine_leaves_a_weight_whose_input_is_not_a_whole_group_dense_like_mlx_lm():
    g = projection_parameter_group("p", ParameterRole.REPLICATED, "p",
                                   ProjectionSharding.REPLICATED, {"weight": [8, 48]})
    assert expand_linear_format_parameter_group(g, MLX4) is g


def test_mxfp4_stores_stacked_in_out_experts_output_major_as_blocks_and_scales():
    experts = ParameterGroupSpec(name="experts", role=ParameterRole.EXPERT_INTERMEDIATE, units=96,
                                 members=(
        ParameterMemberSpec(target="gate_up_proj", shape=(4, 64, 192), dtype="BF16",
                            sharding=PartitionedSharding(axis=2),
                            linear=LinearWeightLayout.IN_OUT),
        ParameterMemberSpec(target="gate_up_proj_bias", shape=(4, 192), dtype="BF16",
                            sharding=PartitionedSharding(axis=1)),
        ParameterMemberSpec(target="down_proj", shape=(4, 96, 64), dtype="BF16",
                            sharding=PartitionedSharding(axis=1),
                            linear=LinearWeightLayout.IN_OUT)))
    expanded = expand_linear_format_parameter_group(experts, MXFP4)
    assert summary(expanded) == [
        ("gate_up_proj_blocks", "U8", (4, 192, 2, 16), "partitioned(axis 1)", "mxfp4.blocks"),
        ("gate_up_proj_scales", "U8", (4, 192, 2), "partitioned(axis 1)", "mxfp4.scales"),
        ("gate_up_proj_bias", "BF16", (4, 192), "partitioned(axis 1)", ""),
        ("down_proj_blocks", "U8", (4, 64, 3, 16), "partitioned(axis 2)", "mxfp4.blocks"),
        ("down_proj_scales", "U8", (4, 64, 3), "partitioned(axis 2)", "mxfp4.scales"),
    ]
    assert (expanded.units, expanded.units_label) == (3, "96 aligned to mxfp4 blocks: gcd = 3")


@pytest.mark.parametrize(("kind", "elements", "nbytes"), [
    ("Q4_0", 32, 18), ("Q8_0", 32, 34), ("Q4_K", 256, 144), ("Q6_K", 256, 210)])
def test_gguf_rows_become_whole_blocks_of_bytes(kind, elements, nbytes):
    assert GGUF_BLOCK_TYPES[kind] == (elements, nbytes)
    g = partitioned_projection_group("mlp", ParameterRole.FEED_FORWARD_INTERMEDIATE, [
        ("up", ProjectionSharding.COLUMN, {"weight": [1024, 512]}),
        ("down", ProjectionSharding.ROW, {"weight": [512, 1024]})], 1024)
    expanded = expand_linear_format_parameter_group(g, gguf(kind))
    assert summary(expanded) == [
        ("up.weight", "U8", (1024, 512 // elements * nbytes), "partitioned(axis 0)",
         f"gguf.{kind}"),
        ("down.weight", "U8", (512, 1024 // elements * nbytes),
         f"partitioned(axis 1, granule {nbytes})", f"gguf.{kind}")]
    assert expanded.units == 1024 // elements
    for layouts in realize_group(expanded, 4):
        (_, ((start, end),)) = layouts[1].selection
        assert start % nbytes == 0 and end % nbytes == 0  # every shard is whole blocks


def test_equal_shards_of_a_packed_axis_must_be_whole_blocks():
    g = projection_parameter_group("down", ParameterRole.ROW_PROJECTION, "down",
                                   ProjectionSharding.ROW, {"weight": [64, 64]})
    expanded = expand_linear_format_parameter_group(g, gguf("Q8_0"))
    assert expanded.members[0].sharding == EqualSharding(axis=1, granule=34)
    assert group_sharding_problems(expanded, 2) == []
    assert group_sharding_problems(expanded, 4) == [
        "`down.weight`: axis 1 has 68 elements, not divisible into 4 equal shards of whole "
        "34-element blocks"]


@pytest.mark.parametrize(("fmt", "member", "message"), [
    (gguf("Q8_0"), ParameterMemberSpec(target="w.weight", shape=(8, 48),
                                       sharding=ReplicatedSharding(),
                                       linear=LinearWeightLayout.OUT_IN),
     "group `g`: `w.weight` has 48 input features, not a multiple of the 32-element blocks of "
     "gguf Q8_0; leave it dense with `except:`"),
    (MXFP4, ParameterMemberSpec(target="w", shape=(4, 48, 8), sharding=ReplicatedSharding(),
                                linear=LinearWeightLayout.IN_OUT),
     "group `g`: `w` has 48 input features, not a multiple of the 32-element blocks of mxfp4"),
    (MLX4, ParameterMemberSpec(target="w.weight", shape=(4, 64, 8),
                               sharding=ReplicatedSharding(),
                               linear=LinearWeightLayout.IN_OUT),
     "group `g`: `w.weight` is stored [..., in, out] but mlx_affine 4-bit, group 32 encodes "
     "[..., out, in] weights only; leave it dense with `except:`"),
    (MLX4, ParameterMemberSpec(target="w.kernel", shape=(8, 64),
                               sharding=ReplicatedSharding()),
     "group `g`: mlx_affine 4-bit, group 32 stores `scales`/`biases` next to a `<module>.weight`, "
     "but `w.kernel` is not named `.weight`"),
    (FP8, ParameterMemberSpec(target="w.weight", shape=(32, 64),
                              sharding=EqualSharding(axis=0, granule=16),
                              linear=LinearWeightLayout.OUT_IN),
     "group `g`: `w.weight` is already equal(axis 0, granule 16); a linear format applies to a "
     "dense declaration only"),
])
def test_a_weight_the_format_cannot_store_is_rejected_with_the_fix(fmt, member, message):
    applies = LinearFormat(kind=fmt.kind, bits=fmt.bits, group_size=fmt.group_size,
                           gguf_type=fmt.gguf_type, block=fmt.block, applies_to=("w*",))
    g = ParameterGroupSpec(name="g", role=ParameterRole.REPLICATED, members=(member,))
    with pytest.raises(ParallelPlanError, match=re.escape(message)):
        expand_linear_format_parameter_group(g, applies)


def test_linear_weights_are_those_the_declaration_marks_refined_by_applies_to_and_except():
    group = ParameterGroupSpec(name="g", role=ParameterRole.REPLICATED, members=(
        ParameterMemberSpec(target="model.embed_tokens.weight", shape=(131, 64),
                            sharding=BalancedSharding(axis=0)),
        ParameterMemberSpec(target="model.layers.0.self_attn.q_proj.weight", shape=(64, 64),
                            sharding=ReplicatedSharding(),
                            linear=LinearWeightLayout.OUT_IN),
        ParameterMemberSpec(target="model.layers.0.mlp.gate.weight", shape=(8, 64),
                            sharding=ReplicatedSharding(),
                            linear=LinearWeightLayout.OUT_IN),
        ParameterMemberSpec(target="model.norm.weight", shape=(64,),
                            sharding=ReplicatedSharding())))
    encoded = [[m.target for m in group.members if fmt.encodes(m)] for fmt in (
        FP8,
        LinearFormat(kind=LinearFormatKind.BLOCK_FP8, excluded=("model.layers.*.mlp.gate",)),
        LinearFormat(kind=LinearFormatKind.BLOCK_FP8, applies_to=("*.weight",)),
        LinearFormat(kind=LinearFormatKind.BLOCK_FP8, applies_to=("*",),
                     excluded=("model.layers.*.self_attn",)),
        LinearFormat(kind=LinearFormatKind.DENSE, applies_to=("*",)))]
    assert encoded == [
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight"],
        ["model.layers.0.self_attn.q_proj.weight"],
        ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.layers.0.mlp.gate.weight"],
        ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"],
        []]
    assert expand_linear_format_parameter_groups([group], None) == (group,)
    assert expand_linear_format_parameter_group(group, LinearFormat(
        kind=LinearFormatKind.BLOCK_FP8, applies_to=("nothing",))) is group


# ---------------------------------------------------------------- YAML selection


def _bound(family: Path, config: Path):
    bound, _, _ = bind(family, config)
    return bound, {m.target: m for o in bound.description.groups for m in o.group.members}


def test_the_format_is_selected_from_the_config_by_the_first_true_when():
    family = CASES / "llama" / "family.yaml"
    dense, members = _bound(family, hf("llama") / "config.json")
    assert dense.linear_format is None
    assert members["lm_head.weight"].dtype == "F32"
    mlx, members = _bound(family, QUANTIZED / "llama_mlx4" / "config.json")
    assert mlx.linear_format == LinearFormat(kind=LinearFormatKind.MLX_AFFINE, bits=4,
                                             group_size=32, applies_to=("*.weight",))
    assert (members["lm_head.weight"].dtype, members["lm_head.weight"].shape) == ("U32", (131, 8))
    assert members["model.embed_tokens.scales"].shape == (131, 2)
    assert members["model.norm.weight"].dtype == "BF16"


def test_the_scale_dtype_comes_from_the_family_not_from_partc():
    _, deepseek = _bound(CASES / "deepseek_v3" / "family.yaml",
                         QUANTIZED / "deepseek_v3_fp8" / "config.json")
    _, qwen = _bound(CASES / "qwen3" / "family.yaml", QUANTIZED / "qwen3_fp8" / "config.json")
    assert deepseek["model.layers.0.self_attn.o_proj.weight_scale_inv"].dtype == "F32"
    assert qwen["model.layers.0.self_attn.o_proj.weight_scale_inv"].dtype == "BF16"
    assert deepseek["model.layers.1.mlp.gate.weight"].dtype == "BF16"  # the router stays dense


def _with_formats(tmp_path: Path, formats: str, extra_config: str = "") -> Path:
    text = (CASES / "llama" / "family.yaml").read_text()
    start = text.index("linear_formats:")
    end = text.index("parameters:")
    text = text[:start] + formats + "\n" + text[end:]
    if extra_config:
        text = text.replace("graph:\n", extra_config + "\ngraph:\n", 1)
    path = tmp_path / "family.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("formats", "message", "where"), [
    ("linear_formats:\n  - {format: block_fp8, when: \"quant_methd == 'fp8'\"}\n",
     "a linear format condition uses unknown name `quant_methd`; did you mean `quant_method`?",
     (32, 31)),
    ("linear_formats:\n  - {format: mlx_affine, when: \"mlx_bits > 0\", bits: mlx_bitz}\n",
     "linear format option `bits` uses unknown name `mlx_bitz`; did you mean `mlx_bits`?",
     (32, 54)),
    ("linear_formats:\n  - {format: block_fp8, when: \"mlx_bits > 0\", bits: mlx_bits}\n",
     "option `bits` does not apply to format block_fp8 (its options: `block`, `scale_dtype`, "
     "`scale_suffix`)", (32, 53)),
    ("linear_formats:\n  - {format: mlx_affine, when: \"mlx_bits > 0\", bits: 5}\n",
     "mlx_affine bits must be one of [2, 3, 4, 6, 8], found 5", (32, 54)),
])
def test_format_mistakes_are_reported_at_their_yaml_position(tmp_path, formats, message, where):
    family = _with_formats(tmp_path, formats)
    with pytest.raises(PartcError) as info:
        bind(family, QUANTIZED / "llama_mlx4" / "config.json")
    assert message in info.value.message
    assert (info.value.location.line, info.value.location.column) == where


def test_a_misaligned_encoded_group_is_reported_at_the_group_declaration(tmp_path):
    family = _with_formats(tmp_path, "linear_formats:\n  - {format: gguf, gguf_type: Q4_K}\n")
    with pytest.raises(ParallelPlanError) as info:
        bind(family, hf("llama") / "config.json")
    assert info.value.message == (
        "group `layers.0.attention`: `model.layers.0.self_attn.q_proj.weight` has 64 input "
        "features, not a multiple of the 256-element blocks of gguf Q4_K; leave it dense with "
        "`except:`")
    assert (info.value.location.line, info.value.pointer) == (51, "/parameters/2")


# ---------------------------------------------------------------- real quantized checkpoints

FIXTURES = {  # fixture: (case family, legal tensor-parallel sizes among 1, 2, 4)
    "deepseek_v3_fp8": ("deepseek_v3", (1, 2)),
    "qwen3_fp8": ("qwen3", (1, 2, 4)),
    "llama_mlx4": ("llama", (1, 2)),
    "gpt_oss_mxfp4": ("gpt_oss", (1, 2)),
}
FP4_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                      dtype=np.float32)


def _f32(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(np.float32)


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`W = q * weight_scale_inv[i // B0, j // B1]` (partial edge blocks included)."""
    rows, cols = weight.shape
    grid = np.repeat(np.repeat(_f32(scale), block[0], axis=0), block[1], axis=1)
    return weight.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * grid[:rows, :cols]


def dequantize_mlx(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                   group: int) -> np.ndarray:
    """`w = scales * q + biases` per group, `q` packed little-end first in uint32 words."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    codes = (weight[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = codes.reshape(*weight.shape[:-1], weight.shape[-1] * per_word).astype(np.float32)
    return (np.repeat(_f32(scales), group, axis=-1) * q + np.repeat(_f32(biases), group, axis=-1))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e2m1 nibbles (low first) times 2**(scale - 127), output-major [..., out, in]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = FP4_VALUES[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def _select(array: np.ndarray, axis: int | None, ranges) -> np.ndarray:
    if axis is None:
        return array
    return np.concatenate([np.take(array, np.arange(a, b), axis=axis) for a, b in ranges],
                          axis=axis)


def _encoded_sets(group: ParameterGroupSpec):
    """(encoding kind, {part: member}) for each dense weight the format rewrote."""
    out = []
    for m in group.members:
        if m.encoding == "block_fp8.weight":
            out.append(("fp8", {"weight": m.target, "scale": m.target + "_scale_inv"}))
        elif m.encoding == "mlx_affine.weight":
            module = m.target[: -len(".weight")]
            out.append(("mlx", {"weight": m.target, "scales": module + ".scales",
                                "biases": module + ".biases"}))
        elif m.encoding == "mxfp4.blocks":
            dense = m.target[: -len("_blocks")]
            out.append(("mxfp4", {"blocks": m.target, "scales": dense + "_scales"}))
    return out


def _dense_selection(kind: str, layout, quant: dict) -> tuple[int | None, tuple]:
    """The dense (dequantized, output-major) element ranges a stored slice covers."""
    axis, ranges = layout.selection
    if axis is None:
        return None, ()
    if kind == "mlx" and axis == len(layout.global_shape) - 1:
        per_word = 32 // quant["bits"]
        return axis, tuple((a * per_word, b * per_word) for a, b in ranges)
    if kind == "mxfp4" and axis == len(layout.global_shape) - 2:
        return axis, tuple((a * 32, b * 32) for a, b in ranges)
    return axis, ranges


@pytest.mark.parametrize(("fixture", "tp"), [(f, t) for f, (_, tps) in FIXTURES.items()
                                             for t in tps])
def test_every_ranks_local_weight_and_companions_dequantize_to_its_slice_of_the_full_tensor(
        fixture, tp):
    family, _ = FIXTURES[fixture]
    folder = QUANTIZED / fixture
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization") or config["quantization_config"]
    bound, _, _ = bind(CASES / family / "family.yaml", folder / "config.json")
    checkpoint = open_checkpoint(folder)
    assert checkpoint_errors(bound, checkpoint) == []  # the family matches the header exactly
    checked = split = 0
    for owned in bound.description.groups:
        group = owned.group
        sets = _encoded_sets(group)
        if not sets:
            continue
        ranks = realize_group(group, tp)
        for kind, parts in sets:
            full = {p: read_tensor(checkpoint, t) for p, t in parts.items()}
            if kind == "fp8":
                block = tuple(quant["weight_block_size"])
                dense = dequantize_fp8(full["weight"], full["scale"], block)
            elif kind == "mlx":
                dense = dequantize_mlx(full["weight"], full["scales"], full["biases"],
                                       quant["bits"], quant["group_size"])
            else:
                dense = dequantize_mxfp4(full["blocks"], full["scales"])
            for layouts in ranks:
                by_target = {t.target: t for t in layouts}
                local = {p: read_tensor(checkpoint, t, TensorSelection(*by_target[t].selection))
                         for p, t in parts.items()}
                for p, t in parts.items():
                    assert local[p].shape == by_target[t].local_shape
                if kind == "fp8":
                    got = dequantize_fp8(local["weight"], local["scale"], block)
                elif kind == "mlx":
                    got = dequantize_mlx(local["weight"], local["scales"], local["biases"],
                                         quant["bits"], quant["group_size"])
                else:
                    got = dequantize_mxfp4(local["blocks"], local["scales"])
                main = by_target[parts["weight" if kind != "mxfp4" else "blocks"]]
                expected = _select(dense, *_dense_selection(kind, main, quant))
                np.testing.assert_array_equal(got, expected)
                checked += 1
                split += main.selection[0] is not None
    assert checked > 0
    assert (split > 0) == (tp > 1)


@pytest.mark.parametrize(("fixture", "message"), [
    ("deepseek_v3_fp8", "group `layers.0.attention.heads` cannot be sharded over "
     "tensor_parallel_size 4: it (role attention_heads) has 2 partition units "
     "(num_attention_heads aligned to block_fp8 [16, 16] blocks: gcd = 2) but "
     "tensor_parallel_size is 4"),
    ("llama_mlx4", "group `layers.0.attention` cannot be sharded over tensor_parallel_size 4: it "
     "has 2 partition units (num_key_value_heads), fewer than 4 ranks, so KV replication applies "
     "and `model.layers.0.self_attn.o_proj.weight`: splitting its 4 heads over 4 ranks cuts its 8 "
     "elements into pieces that are not whole 4-element blocks"),
    ("gpt_oss_mxfp4", "group `layers.0.experts` cannot be sharded over tensor_parallel_size 4: it "
     "(role expert_intermediate) has 3 partition units (intermediate_size aligned to mxfp4 "
     "blocks: gcd = 3) but tensor_parallel_size is 4"),
])
def test_a_size_that_would_split_a_block_is_rejected_naming_the_group_and_block(fixture,
                                                                                message):
    family, _ = FIXTURES[fixture]
    with pytest.raises(ParallelPlanError) as info:
        plan_family(CASES / family / "family.yaml", QUANTIZED / fixture / "config.json",
                    Topology(tensor_parallel_size=4, pipeline_parallel_size=1))
    assert info.value.message.startswith(message)


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_byte_accounting_of_packed_and_fp8_checkpoints_is_exact(fixture):
    family, tps = FIXTURES[fixture]
    folder = QUANTIZED / fixture
    checkpoint = open_checkpoint(folder)
    on_disk = sum(checkpoint.tensor(n)[1].nbytes for n in checkpoint.names)
    tp = max(tps)
    plan = plan_family(CASES / family / "family.yaml", folder / "config.json",
                       Topology(tensor_parallel_size=tp, pipeline_parallel_size=1),
                       checkpoint=folder)
    assert plan.global_parameter_bytes == on_disk
    read: dict[str, int] = {}
    for rank in plan.ranks:
        arrays = {t.target: read_tensor(checkpoint, t.target, TensorSelection(*t.selection))
                  for t in rank.layout.tensors}
        assert rank.info.local_parameter_bytes == sum(a.nbytes for a in arrays.values())
        assert sum(n for _, n in rank.info.local_bytes_by_dtype or rank.layout.bytes_by_dtype) \
            == rank.info.local_parameter_bytes
        for target, array in arrays.items():
            read[target] = read.get(target, 0) + array.nbytes
    for target, nbytes in read.items():
        layouts = [r.layout[target] for r in plan.ranks]
        copies = tp if layouts[0].is_whole else max(t.kv_replicas for t in layouts)
        assert nbytes == checkpoint.tensor(target)[1].nbytes * copies, target
    assert set(read) == set(checkpoint.names)


# ---------------------------------------------------------------- GGUF, synthetic


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """ggml block_q8_0: f16 scale d, then 32 int8 codes; value = d * q."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    q = np.round(blocks / np.where(d == 0, 1, d)).astype(np.int8)
    packed = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)
    return packed.reshape(rows, cols // 32 * 34)


def dequantize_q8_0(packed: np.ndarray) -> np.ndarray:
    rows = packed.shape[0]
    blocks = packed.reshape(rows, -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    return (d * blocks[..., 2:].copy().view(np.int8).astype(np.float32)).reshape(rows, -1)


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """ggml block_q4_0: f16 d, 16 bytes; byte j = x[j] (low nibble) | x[j + 16] << 4."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 7
    q = (np.clip(np.round(blocks / np.where(d == 0, 1, d)), -8, 7) + 8).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([d.astype(np.float16).view(np.uint8), nibbles], axis=-1).reshape(
        rows, cols // 32 * 18)


def dequantize_q4_0(packed: np.ndarray) -> np.ndarray:
    rows = packed.shape[0]
    blocks = packed.reshape(rows, -1, 18)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - 8
    return (d * q).reshape(rows, -1)


@pytest.mark.parametrize(("kind", "quantize", "dequantize"), [
    ("Q8_0", quantize_q8_0, dequantize_q8_0), ("Q4_0", quantize_q4_0, dequantize_q4_0)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gguf_row_and_column_shards_dequantize_to_their_slice(kind, quantize, dequantize, tp):
    rng = np.random.default_rng(7)
    weights = {"up.weight": rng.standard_normal((128, 256)).astype(np.float32),
               "down.weight": rng.standard_normal((256, 128)).astype(np.float32)}
    g = partitioned_projection_group("mlp", ParameterRole.FEED_FORWARD_INTERMEDIATE, [
        ("up", ProjectionSharding.COLUMN, {"weight": [128, 256]}),
        ("down", ProjectionSharding.ROW, {"weight": [256, 128]})], 128)
    expanded = expand_linear_format_parameter_group(g, gguf(kind))
    assert expanded.units == 4
    packed = {t: quantize(w) for t, w in weights.items()}
    dense = {t: dequantize(p) for t, p in packed.items()}
    for layouts in realize_group(expanded, tp):
        for item in layouts:
            local = _select(packed[item.target], *item.selection)
            assert local.shape == item.local_shape
            axis, ranges = item.selection
            block = GGUF_BLOCK_TYPES[kind]
            if axis == 1:
                ranges = tuple((a // block[1] * block[0], b // block[1] * block[0])
                               for a, b in ranges)
            np.testing.assert_array_equal(dequantize(local),
                                          _select(dense[item.target], axis, ranges))


# ---------------------------------------------------------------- properties


def _dense_ranges(fmt: LinearFormat, encoding: str, dense_shape, selection):
    """(dense axis, dense ranges) a stored part's selection covers, from the format's layout."""
    axis, ranges = selection
    if axis is None:
        return None
    in_features = dense_shape[1]
    if axis == 0:
        if encoding == "block_fp8.scale":
            return 0, tuple((a * fmt.block[0], min(b * fmt.block[0], dense_shape[0]))
                            for a, b in ranges)
        return 0, ranges
    if encoding == "block_fp8.scale":
        factor = (fmt.block[1], 1)
    elif encoding == "mlx_affine.weight":
        factor = (fmt.group_size, fmt.group_size * fmt.bits // 32)
    elif encoding in ("mlx_affine.scales", "mlx_affine.biases"):
        factor = (fmt.group_size, 1)
    elif encoding.startswith("gguf."):
        factor = GGUF_BLOCK_TYPES[fmt.gguf_type]
    elif encoding.startswith("mxfp4."):
        factor = (32, 1)
    else:
        factor = (1, 1)
    return 1, tuple((a // factor[1] * factor[0], min(b // factor[1] * factor[0], in_features))
                    for a, b in ranges)


formats = st.one_of(
    st.builds(lambda b0, b1: LinearFormat(kind=LinearFormatKind.BLOCK_FP8, block=(b0, b1)),
              st.sampled_from([16, 32, 128]), st.sampled_from([16, 64, 128])),
    st.builds(lambda bits, g: LinearFormat(kind=LinearFormatKind.MLX_AFFINE, bits=bits,
                                           group_size=g),
              st.sampled_from([2, 3, 4, 6, 8]), st.sampled_from([32, 64, 128])),
    st.just(MXFP4),
    st.builds(gguf, st.sampled_from(sorted(GGUF_BLOCK_TYPES))))


@settings(max_examples=300, deadline=None)
@given(fmt=formats, hidden=st.sampled_from([256, 512, 768]),
       intermediate=st.integers(1, 24).map(lambda k: 32 * k), tp=st.integers(1, 16))
def test_every_part_of_an_encoded_weight_covers_the_same_dense_slice_on_every_rank(
        fmt, hidden, intermediate, tp):
    dense = partitioned_projection_group("mlp", ParameterRole.FEED_FORWARD_INTERMEDIATE, [
        ("up", ProjectionSharding.COLUMN, {"weight": [intermediate, hidden]}),
        ("down", ProjectionSharding.ROW, {"weight": [hidden, intermediate]})], intermediate)
    try:
        group = expand_linear_format_parameter_group(dense, fmt)
    except ParallelPlanError:
        assume(False)
    assume(not group_sharding_problems(group, tp))
    shapes = {"up": (intermediate, hidden), "down": (hidden, intermediate)}
    ranks = realize_group(group, tp)
    for module, dense_shape in shapes.items():
        covered = []
        for layouts in ranks:
            parts = [t for t, m in zip(layouts, group.members, strict=True)
                     if m.target.startswith(module)]
            spans = {_dense_ranges(fmt, m.encoding, dense_shape, t.selection)
                     for t, m in zip(layouts, group.members, strict=True)
                     if m.target.startswith(module)}
            assert len(parts) >= 1 and len(spans) == 1, spans  # all parts agree on this rank
            covered.append(spans.pop())
        if tp > 1:
            axis = covered[0][0]
            flat = [r for _, ranges in covered for r in ranges]
            assert flat[0][0] == 0 and flat[-1][1] == dense_shape[axis]
            assert all(a[1] == b[0] for a, b in zip(flat, flat[1:], strict=False))
