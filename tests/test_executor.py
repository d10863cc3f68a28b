"""The numpy reference executor reproduces HF's forward, whole, tensor-parallel and pipelined.

Rank shards are built here by slicing the full fixture tensors with balanced splits (part ``i`` of
``n`` over ``k`` gets ``n // k + (1 if i < n % k else 0)``, in order), independently of partc.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from executor import (
    RankShard,
    Selection,
    ShardingError,
    dequantize,
    forward,
    forward_pipeline,
    forward_tensor_parallel,
    load_fixture,
)
from support import EXECUTOR_MODELS

# The executor's own families; the table-described ones (tests/executor/variants.py) have their
# own file, tests/test_executor_families.py, and every family runs from partc's loaded shards in
# tests/test_numerics.py.
FAMILIES = EXECUTOR_MODELS
QUANTIZED_SOURCES = {
    "qwen3_fp8": "qwen3",
    "deepseek_v3_fp8": "deepseek_v3",
    "llama_mlx4": "llama",
    "gpt_oss_mxfp4": "gpt_oss",
}
QUANTIZED = list(QUANTIZED_SOURCES)
TOLERANCE = 1e-4
EMBED, LM_HEAD, FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


@functools.cache
def fixture(name: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    config, tensors, reference = load_fixture(name)
    return config, dequantize(config, tensors), reference


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def assert_matches(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert rel_err(actual, expected) < TOLERANCE


# --------------------------------------------------------------------------- shard planning


def balanced(n: int, k: int) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for i in range(k):
        size = n // k + (1 if i < n % k else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def heads_of(config: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(heads, kv heads, q/k head dim, v head dim, kv_b rows per head)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if config["model_type"] in ("deepseek_v2", "deepseek_v3"):
        qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        v = config["v_head_dim"]
        return heads, kv_heads, qk, v, config["qk_nope_head_dim"] + v
    hd = config.get("head_dim") or config["hidden_size"] // heads
    return heads, kv_heads, hd, hd, hd


def attention_selection(
    leaf: str, config: dict[str, Any], q_heads: tuple[int, int]
) -> Selection | None:
    heads, kv_heads, qk, v, kv_b = heads_of(config)
    q0, q1 = q_heads
    group = heads // kv_heads
    k0, k1 = q0 // group, (q1 - 1) // group + 1
    nq, nkv = heads * qk, kv_heads * qk
    by_leaf = {
        "q_proj.weight": (0, [(q0 * qk, q1 * qk)]),
        "q_proj.bias": (0, [(q0 * qk, q1 * qk)]),
        "k_proj.weight": (0, [(k0 * qk, k1 * qk)]),
        "k_proj.bias": (0, [(k0 * qk, k1 * qk)]),
        "v_proj.weight": (0, [(k0 * qk, k1 * qk)]),
        "v_proj.bias": (0, [(k0 * qk, k1 * qk)]),
        "qkv_proj.weight": (
            0,
            [
                (q0 * qk, q1 * qk),
                (nq + k0 * qk, nq + k1 * qk),
                (nq + nkv + k0 * qk, nq + nkv + k1 * qk),
            ],
        ),
        "o_proj.weight": (1, [(q0 * v, q1 * v)]),
        "sinks": (0, [(q0, q1)]),
        "q_b_proj.weight": (0, [(q0 * qk, q1 * qk)]),
        "kv_b_proj.weight": (0, [(q0 * kv_b, q1 * kv_b)]),
    }
    if leaf not in by_leaf:
        return None  # norms, o_proj.bias, MLA down-projections: replicated
    axis, ranges = by_leaf[leaf]
    return Selection(axis, tuple(ranges))


def tensor_selection(
    name: str, shape: tuple[int, ...], config: dict[str, Any], tp: int, rank: int, attention: str
) -> Selection | None:
    """Megatron-style plan: vocab-parallel embedding/head, heads, intermediate dimension."""
    if name in (EMBED, LM_HEAD):
        return Selection(0, (balanced(shape[0], tp)[rank],))
    if ".self_attn." in name:
        if attention == "replicated":
            return None
        q_heads = balanced(config["num_attention_heads"], tp)[rank]
        return attention_selection(name.split(".self_attn.")[1], config, q_heads)
    if name.endswith("mlp.gate_up_proj.weight"):  # fused [gate | up]: one range per half
        half = shape[0] // 2
        a, b = balanced(half, tp)[rank]
        return Selection(0, ((a, b), (half + a, half + b)))
    if name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight")):
        return Selection(0, (balanced(shape[0], tp)[rank],))
    if name.endswith(("down_proj.weight", ".w2.weight", "experts.down_proj")):
        return Selection(1, (balanced(shape[1], tp)[rank],))
    if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):  # interleaved
        a, b = balanced(shape[-1] // 2, tp)[rank]
        return Selection(len(shape) - 1, ((2 * a, 2 * b),))
    return None


def holds_head(name: str, config: dict[str, Any], tp: int, rank: int, attention: str) -> bool:
    """Whether the rank holds `name`: StableLM's per-head `{q,k}_layernorm.norms.{h}` only on
    the ranks of head h (every rank when attention is replicated), the rest everywhere."""
    found = re.search(r"\.([qk])_layernorm\.norms\.(\d+)\.weight$", name)
    if found is None or attention == "replicated":
        return True
    heads, kv_heads = heads_of(config)[:2]
    q0, q1 = balanced(heads, tp)[rank]
    group = heads // kv_heads
    a, b = (q0, q1) if found.group(1) == "q" else (q0 // group, (q1 - 1) // group + 1)
    return a <= int(found.group(2)) < b


def take(full: np.ndarray, sel: Selection | None) -> np.ndarray:
    if sel is None:
        return full
    pieces = [np.take(full, np.arange(a, b), axis=sel.axis) for a, b in sel.ranges]
    return np.ascontiguousarray(np.concatenate(pieces, axis=sel.axis))


def plan_shards(
    config: dict[str, Any],
    tensors: dict[str, np.ndarray],
    tp: int,
    *,
    attention: str = "heads",
    keep: Callable[[str], bool] = lambda name: True,
) -> list[RankShard]:
    ranks = []
    for rank in range(tp):
        sels = {
            name: tensor_selection(name, full.shape, config, tp, rank, attention)
            for name, full in tensors.items()
            if keep(name) and holds_head(name, config, tp, rank, attention)
        }
        ranks.append(RankShard({n: take(tensors[n], s) for n, s in sels.items()}, sels))
    return ranks


def stage_filter(config: dict[str, Any], layers: range) -> Callable[[str], bool]:
    first, last = layers.start == 0, layers.stop == config["num_hidden_layers"]
    tied = config.get("tie_word_embeddings", False)

    def keep(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in layers
        if name == EMBED:
            return first or (last and tied)
        return last  # final norm, lm_head

    return keep


# --------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("family", FAMILIES)
def test_full_weight_forward_reproduces_hf_logits_and_layer_streams(family: str) -> None:
    config, tensors, ref = fixture(family)
    result = forward(config, tensors, ref["input_ids"])
    assert result.logits is not None
    assert result.logits.dtype == np.float32
    assert_matches(result.logits, ref["logits"])
    assert len(result.layer_outputs) == len(ref["layer_outputs"])
    for layer, (ins, outs) in enumerate(
        zip(result.layer_inputs, result.layer_outputs, strict=True)
    ):
        assert_matches(ins, ref["layer_inputs"][layer])
        assert_matches(outs, ref["layer_outputs"][layer])


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantized_checkpoint_reproduces_hf_dequantized_logits(name: str) -> None:
    config, tensors, ref = fixture(name)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert not any(n.endswith(("_scale_inv", ".scales", ".biases", "_blocks")) for n in tensors)
    result = forward(config, tensors, ref["input_ids"])
    assert result.logits is not None
    assert_matches(result.logits, ref["logits"])
    for layer, outs in enumerate(result.layer_outputs):
        assert_matches(outs, ref["layer_outputs"][layer])


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantized_tensors_keep_the_float_checkpoint_names_and_shapes(name: str) -> None:
    _, tensors, _ = fixture(name)
    _, originals, _ = fixture(QUANTIZED_SOURCES[name])
    assert {n: t.shape for n, t in tensors.items()} == {n: t.shape for n, t in originals.items()}
    worst = max(float(np.max(np.abs(tensors[n] - originals[n]))) for n in tensors)
    assert worst < 0.05  # quantization error only, no misplaced blocks or nibbles


# --------------------------------------------------------------------------- tensor parallel

TP_CASES = [
    (1, "heads"),
    (2, "heads"),  # two kv-head groups, vocab 66 + 65
    (3, "heads"),  # uneven heads 2+1+1, kv head 1 replicated on ranks 1 and 2
    (4, "heads"),  # one q head per rank, each kv head on two ranks
    (3, "replicated"),  # attention whole on every rank (T > kv heads), MLP and vocab sliced
]


@pytest.mark.parametrize("tp,attention", TP_CASES, ids=[f"T{t}-{a}" for t, a in TP_CASES])
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_ranks_reproduce_hf_logits(family: str, tp: int, attention: str) -> None:
    config, tensors, ref = fixture(family)
    ranks = plan_shards(config, tensors, tp, attention=attention)
    result = forward_tensor_parallel(config, ranks, ref["input_ids"])
    assert result.logits is not None
    assert_matches(result.logits, ref["logits"])
    for layer, outs in enumerate(result.layer_outputs):
        assert_matches(outs, ref["layer_outputs"][layer])


def test_shards_never_hold_full_sliced_weights() -> None:
    config, tensors, _ = fixture("phi3")
    ranks = plan_shards(config, tensors, 2)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert ranks[0].tensors[qkv].shape == (64, 64)
    assert ranks[1].selections[qkv] == Selection(0, ((32, 64), (80, 96), (112, 128)))
    assert ranks[1].tensors[EMBED].shape == (65, 64)


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "deepseek_v3"])
def test_ranks_holding_everything_compute_replicated_work_once(family: str) -> None:
    config, tensors, ref = fixture(family)
    ranks = [RankShard(dict(tensors), {name: None for name in tensors}) for _ in range(3)]
    result = forward_tensor_parallel(config, ranks, ref["input_ids"])
    assert result.logits is not None
    assert_matches(result.logits, ref["logits"])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_expert_parallel_ranks_holding_whole_experts_reproduce_hf_logits(family: str) -> None:
    config, tensors, ref = fixture(family)
    tp = 2
    ranks = plan_shards(config, tensors, tp)
    for r, rank in enumerate(ranks):
        for name in list(rank.tensors):
            if ".experts." in name:
                expert = int(name.split(".experts.")[1].split(".")[0])
                if expert % tp != r:
                    del rank.tensors[name], rank.selections[name]
                else:
                    rank.tensors[name], rank.selections[name] = tensors[name], None
    result = forward_tensor_parallel(config, ranks, ref["input_ids"])
    assert result.logits is not None
    assert_matches(result.logits, ref["logits"])


def test_a_rank_missing_the_kv_head_of_its_query_heads_is_rejected() -> None:
    config, tensors, ref = fixture("llama")
    ranks = plan_shards(config, tensors, 2)
    for kv in ("k_proj", "v_proj"):  # rank 1 gets kv head 0, but its q heads 2, 3 need head 1
        name = f"model.layers.0.self_attn.{kv}.weight"
        ranks[1].tensors[name], ranks[1].selections[name] = (
            ranks[0].tensors[name],
            ranks[0].selections[name],
        )
    with pytest.raises(ShardingError, match="kv heads"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_overlapping_or_missing_slices_are_rejected() -> None:
    config, tensors, ref = fixture("llama")
    ranks = plan_shards(config, tensors, 2)
    ranks[1].tensors[EMBED] = tensors[EMBED][64:]
    ranks[1].selections[EMBED] = Selection(0, ((64, 131),))  # row 64 on both ranks
    with pytest.raises(ShardingError, match="partition"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])
    ranks = plan_shards(config, tensors, 2)
    down = "model.layers.1.mlp.down_proj.weight"
    ranks[1].tensors[down] = tensors[down][:, 65:]
    ranks[1].selections[down] = Selection(1, ((65, 128),))  # intermediate column 64 unheld
    with pytest.raises(ShardingError):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_replicated_copies_that_differ_between_ranks_are_rejected() -> None:
    config, tensors, ref = fixture("llama")
    ranks = plan_shards(config, tensors, 2)
    norm = "model.layers.2.input_layernorm.weight"
    ranks[1].tensors[norm] = ranks[1].tensors[norm] + 1e-3
    with pytest.raises(ShardingError, match="differ"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_selection_that_does_not_match_the_local_shape_is_rejected() -> None:
    config, tensors, ref = fixture("llama")
    ranks = plan_shards(config, tensors, 2)
    ranks[0].selections[LM_HEAD] = Selection(0, ((0, 60),))
    with pytest.raises(ShardingError, match="hold 60 rows"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


# --------------------------------------------------------------------------- pipeline


def run_pipeline(
    family: str,
    cuts: list[int],
    tp: int,
    transfer: Callable[[np.ndarray], np.ndarray] = lambda h: h,
) -> Any:
    config, tensors, ref = fixture(family)
    bounds = [0, *cuts, config["num_hidden_layers"]]
    stage_layers = [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    stages = [
        plan_shards(config, tensors, tp, keep=stage_filter(config, layers))
        for layers in stage_layers
    ]
    return forward_pipeline(config, stages, stage_layers, ref["input_ids"], transfer), ref


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stage_pipeline_reproduces_logits_and_sends_the_layer_output(family: str) -> None:
    config, _, _ = fixture(family)
    cut = config["num_hidden_layers"] // 2
    result, ref = run_pipeline(family, [cut], tp=2)
    assert_matches(result.logits, ref["logits"])
    assert len(result.sent) == 1
    assert_matches(result.sent[0], ref["layer_outputs"][cut - 1])


@pytest.mark.parametrize("family", ["llama", "llama_tied", "deepseek_v3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_three_stage_pipeline_reproduces_logits_and_every_cut(family: str, tp: int) -> None:
    config, _, _ = fixture(family)
    cuts = [1, 2] if config["num_hidden_layers"] == 3 else [1, 3]
    result, ref = run_pipeline(family, cuts, tp=tp)
    assert_matches(result.logits, ref["logits"])
    for cut, hidden in zip(cuts, result.sent, strict=True):
        assert_matches(hidden, ref["layer_outputs"][cut - 1])
    assert [s.layers for s in result.stages] == [
        range(0, cuts[0]),
        range(*cuts),
        range(cuts[1], config["num_hidden_layers"]),
    ]


def test_pipeline_applies_transfer_at_every_cut() -> None:
    calls: list[np.ndarray] = []

    def bf16_round_trip(hidden: np.ndarray) -> np.ndarray:
        calls.append(hidden)
        return hidden.astype(ml_dtypes.bfloat16).astype(np.float32)

    result, ref = run_pipeline("llama_tied", [1, 2, 3], tp=2, transfer=bf16_round_trip)
    assert len(calls) == 3 and len(result.received) == 3
    for sent, received in zip(result.sent, result.received, strict=True):
        np.testing.assert_array_equal(received, sent.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert 0 < rel_err(result.logits, ref["logits"]) < 1e-2


def test_stage_without_hidden_in_must_start_at_layer_zero() -> None:
    config, tensors, ref = fixture("llama")
    with pytest.raises(ValueError, match="hidden_in"):
        forward_tensor_parallel(
            config, plan_shards(config, tensors, 1), ref["input_ids"], layers=range(1, 3)
        )
    middle = forward_tensor_parallel(
        config,
        plan_shards(config, tensors, 2, keep=stage_filter(config, range(1, 2))),
        ref["input_ids"],
        layers=range(1, 2),
        hidden_in=ref["layer_inputs"][1],
    )
    assert middle.logits is None
    assert_matches(middle.hidden, ref["layer_outputs"][1])
