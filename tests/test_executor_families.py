"""The numpy executor reproduces HF for the families added in issues 11 and 35, whole and sharded.

Fixtures are real HF checkpoints (``tests/fixtures/hf/<name>``, or ``hf_pending/<name>`` until
they move). Rank shards are cut by the executor's own numpy plan (``executor.cut``), independent
of partc; the expected slices below are read off each fixture's ``manifest.json`` layout notes.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import executor.fixtures
from executor import (
    RankShard,
    Selection,
    ShardingError,
    cut_shards,
    fixture_folder,
    forward,
    forward_pipeline,
    forward_tensor_parallel,
    load_fixture,
)

FAMILIES = ["gpt2", "gpt_neox", "falcon", "bloom", "olmo2", "granite", "stablelm", "phi",
            "codegen", "dbrx"]
TOLERANCE = 1e-4


@functools.cache
def fixture(name: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    return load_fixture(name)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def assert_streams(result: Any, ref: dict[str, np.ndarray]) -> None:
    """Logits, every layer input / output and HF's hidden_states (last: post final norm)."""
    assert result.logits is not None and result.logits.dtype == np.float32
    assert rel_err(result.logits, ref["logits"]) < TOLERANCE
    assert len(result.layer_outputs) == len(ref["layer_outputs"])
    for layer, (ins, outs) in enumerate(
        zip(result.layer_inputs, result.layer_outputs, strict=True)
    ):
        assert rel_err(ins, ref["layer_inputs"][layer]) < TOLERANCE
        assert rel_err(outs, ref["layer_outputs"][layer]) < TOLERANCE
    hidden_states = np.stack([*result.layer_inputs, result.normed])
    assert rel_err(hidden_states, ref["hidden_states"]) < TOLERANCE


# --------------------------------------------------------------------------- whole / TP / PP


@pytest.mark.parametrize("family", FAMILIES)
def test_full_weight_forward_reproduces_hf_logits_layers_and_hidden_states(family: str) -> None:
    config, tensors, ref = fixture(family)
    assert_streams(forward(config, tensors, ref["input_ids"]), ref)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_rank_shards_reproduce_hf(family: str, tp: int) -> None:
    config, tensors, ref = fixture(family)
    ranks = cut_shards(config, tensors, tp)
    if tp > 1:  # really sliced: no rank holds a full embedding or a full first projection
        embed = next(n for n in tensors if n.endswith(("wte.weight", "embed_in.weight",
                                                       "word_embeddings.weight",
                                                       "embed_tokens.weight")))
        assert all(r.tensors[embed].shape[0] < tensors[embed].shape[0] for r in ranks)
    assert_streams(forward_tensor_parallel(config, ranks, ref["input_ids"]), ref)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_two_stage_pipeline_reproduces_hf_and_sends_the_layer_output(family: str, tp: int) -> None:
    config, tensors, ref = fixture(family)
    layers = [range(0, 1), range(1, 2)]
    stages = [cut_shards(config, tensors, tp, layers=rng) for rng in layers]
    first, last = set(stages[0][0].tensors), set(stages[1][0].tensors)
    assert not any(re.search(r"\.(h|layers|blocks)\.1\.", n) for n in first)
    assert not any(re.search(r"\.(h|layers|blocks)\.0\.", n) for n in last)
    assert not any(re.search(r"final|ln_f|norm_f|model\.norm|lm_head|embed_out", n) for n in first)
    result = forward_pipeline(config, stages, layers, ref["input_ids"])
    assert rel_err(result.logits, ref["logits"]) < TOLERANCE
    assert rel_err(result.sent[0], ref["layer_outputs"][0]) < TOLERANCE
    assert rel_err(result.stages[1].layer_outputs[0], ref["layer_outputs"][1]) < TOLERANCE


# --------------------------------------------------------------------------- the cuts


def selections(family: str, tp: int, name: str) -> list[Selection | None]:
    config, tensors, _ = fixture(family)
    return [rank.selections[name] for rank in cut_shards(config, tensors, tp)]


def test_gpt2_conv1d_cuts_out_axis_1_in_three_blocks_and_c_proj_on_axis_0() -> None:
    p = "transformer.h.0."
    assert selections("gpt2", 2, p + "attn.c_attn.weight")[1] == Selection(
        1, ((32, 64), (96, 128), (160, 192))
    )
    assert selections("gpt2", 2, p + "attn.c_attn.bias")[1] == Selection(
        0, ((32, 64), (96, 128), (160, 192))
    )
    assert selections("gpt2", 2, p + "attn.c_proj.weight")[1] == Selection(0, ((32, 64),))
    assert selections("gpt2", 2, p + "mlp.c_fc.weight")[0] == Selection(1, ((0, 64),))
    assert selections("gpt2", 2, p + "mlp.c_proj.weight")[0] == Selection(0, ((0, 64),))


@pytest.mark.parametrize("family,name", [
    ("gpt_neox", "gpt_neox.layers.0.attention.query_key_value.weight"),
    ("bloom", "transformer.h.0.self_attention.query_key_value.weight"),
])
def test_per_head_interleaved_qkv_is_cut_in_whole_48_row_blocks(family: str, name: str) -> None:
    assert selections(family, 4, name) == [Selection(0, ((48 * h, 48 * h + 48),)) for h in range(4)]


def test_falcon_grouped_qkv_is_cut_in_whole_groups_or_query_rows_plus_the_group_kv() -> None:
    name = "transformer.h.0.self_attention.query_key_value.weight"
    assert selections("falcon", 2, name) == [Selection(0, ((0, 64),)), Selection(0, ((64, 128),))]
    assert selections("falcon", 4, name) == [
        Selection(0, ((0, 16), (32, 64))),  # q0 + k0 v0
        Selection(0, ((16, 64),)),  # q1 + k0 v0
        Selection(0, ((64, 80), (96, 128))),  # q2 + k1 v1
        Selection(0, ((80, 128),)),  # q3 + k1 v1
    ]


def test_olmo2_norm_weights_follow_the_projection_rows_under_kv_replication() -> None:
    p = "model.layers.0.self_attn."
    assert selections("olmo2", 4, p + "q_norm.weight")[3] == Selection(0, ((48, 64),))
    assert selections("olmo2", 4, p + "k_norm.weight") == [
        Selection(0, ((0, 16),)), Selection(0, ((0, 16),)),
        Selection(0, ((16, 32),)), Selection(0, ((16, 32),)),
    ]


def test_codegen_qkv_is_cut_by_heads_inside_each_mp_num_group_of_q_v_k() -> None:
    name = "transformer.h.0.attn.qkv_proj.weight"  # 4 groups of [q_g | v_g | k_g], 32 rows each
    assert selections("codegen", 8, name)[1] == Selection(0, ((16, 32), (48, 64), (80, 96)))
    assert selections("codegen", 2, name) == [Selection(0, ((0, 192),)),
                                              Selection(0, ((192, 384),))]


def test_dbrx_fused_experts_are_cut_by_the_same_channels_of_every_expert_block() -> None:
    blocks = Selection(0, ((16, 32), (48, 64), (80, 96), (112, 128)))  # 4 experts of 32 rows
    for part in ("w1", "v1", "w2"):
        assert selections("dbrx", 2, f"transformer.blocks.0.ffn.experts.mlp.{part}")[1] == blocks


def test_bloom_alibi_follows_global_head_ids_whatever_the_rank_order() -> None:
    config, tensors, ref = fixture("bloom")
    ranks = cut_shards(config, tensors, 4)[::-1]
    result = forward_tensor_parallel(config, ranks, ref["input_ids"])
    assert result.logits is not None
    assert rel_err(result.logits, ref["logits"]) < TOLERANCE


# --------------------------------------------------------------------------- strictness


def with_selection(rank: RankShard, name: str, full: np.ndarray, sel: Selection) -> RankShard:
    tensors, sels = dict(rank.tensors), dict(rank.selections)
    tensors[name] = np.concatenate([np.take(full, np.arange(a, b), axis=sel.axis)
                                    for a, b in sel.ranges], axis=sel.axis)
    sels[name] = sel
    return RankShard(tensors, sels)


def test_a_shard_splitting_an_interleaved_head_block_is_refused() -> None:
    config, tensors, ref = fixture("bloom")
    ranks = cut_shards(config, tensors, 2)
    for leaf in ("weight", "bias"):  # rank 0: head 0 and half of head 1 (q and half of k)
        name = f"transformer.h.0.self_attention.query_key_value.{leaf}"
        ranks[0] = with_selection(ranks[0], name, tensors[name], Selection(0, ((0, 72),)))
        ranks[1] = with_selection(ranks[1], name, tensors[name], Selection(0, ((72, 192),)))
    with pytest.raises(ShardingError, match="splits a head|not whole heads"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_falcon_query_rows_without_their_group_kv_are_refused() -> None:
    config, tensors, ref = fixture("falcon")
    ranks = cut_shards(config, tensors, 4)
    for leaf in ("weight", "bias"):  # rank 2 keeps query head 2 but takes group 0's k / v
        name = f"transformer.h.0.self_attention.query_key_value.{leaf}"
        sel = Selection(0, ((32, 64), (64, 80)))
        ranks[2] = with_selection(ranks[2], name, tensors[name], sel)
    with pytest.raises(ShardingError, match="kv heads of the local q heads"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_a_conv1d_row_weight_cut_like_a_linear_one_is_refused() -> None:
    config, tensors, ref = fixture("gpt2")
    name = "transformer.h.0.attn.c_proj.weight"  # square: only the selection axis tells
    ranks = cut_shards(config, tensors, 2)
    for i, rng in enumerate(((0, 32), (32, 64))):
        ranks[i] = with_selection(ranks[i], name, tensors[name], Selection(1, (rng,)))
    with pytest.raises(ShardingError, match="row-parallel Conv1D weight sliced on axis 1"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_olmo2_norm_statistic_needs_every_head_once() -> None:
    config, tensors, ref = fixture("olmo2")
    ranks = cut_shards(config, tensors, 2)
    for name in list(ranks[1].tensors):  # rank 1 holds rank 0's heads 0-1 in layer 0
        if name.startswith("model.layers.0.self_attn."):
            ranks[1].tensors[name] = ranks[0].tensors[name]
            ranks[1].selections[name] = ranks[0].selections[name]
    with pytest.raises(ShardingError, match="q_norm.weight sum of squares: slices do not"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_replicated_kv_ranks_that_disagree_are_refused() -> None:
    config, tensors, ref = fixture("olmo2")
    ranks = cut_shards(config, tensors, 4)
    name = "model.layers.0.self_attn.k_proj.weight"
    ranks[1].tensors[name] = ranks[1].tensors[name] + np.float32(0.5)  # kv head 0 replica
    with pytest.raises(ShardingError, match="k_norm.weight sum of squares: ranks holding"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_a_dbrx_w2_cut_as_whole_experts_while_w1_splits_channels_is_refused() -> None:
    config, tensors, ref = fixture("dbrx")
    ranks = cut_shards(config, tensors, 2)
    name = "transformer.blocks.0.ffn.experts.mlp.w2"
    for i, rng in enumerate(((0, 64), (64, 128))):  # experts 0-1, 2-3: every channel of them
        ranks[i] = with_selection(ranks[i], name, tensors[name], Selection(0, (rng,)))
    with pytest.raises(ShardingError, match="mlp.w2 expert 0: 32 channels, w1 16"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


def test_codegen_qkv_cut_as_if_component_major_is_refused() -> None:
    config, tensors, ref = fixture("codegen")
    ranks = cut_shards(config, tensors, 2)
    name = "transformer.h.0.attn.qkv_proj.weight"  # rank i: half of each 128-row third
    for i in range(2):
        sel = Selection(0, tuple((128 * c + 64 * i, 128 * c + 64 * i + 64) for c in range(3)))
        ranks[i] = with_selection(ranks[i], name, tensors[name], sel)
    with pytest.raises(ShardingError, match="kv heads of the local q heads|v heads"):
        forward_tensor_parallel(config, ranks, ref["input_ids"])


@pytest.mark.parametrize("family,key,value", [
    ("gpt_neox", "use_parallel_residual", False),
    ("falcon", "alibi", True),
    ("falcon", "num_ln_in_parallel_attn", 1),
])
def test_config_switches_the_executor_does_not_model_are_refused(
    family: str, key: str, value: Any
) -> None:
    config, tensors, ref = fixture(family)
    with pytest.raises(NotImplementedError, match=key):
        forward({**config, key: value}, tensors, ref["input_ids"])


# --------------------------------------------------------------------------- fixture folders


def test_fixtures_are_found_in_hf_first_then_hf_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor.fixtures, "FIXTURES", tmp_path)
    (tmp_path / "hf_pending" / "x").mkdir(parents=True)
    assert fixture_folder("x") == tmp_path / "hf_pending" / "x"
    (tmp_path / "hf" / "x").mkdir(parents=True)
    assert fixture_folder("x") == tmp_path / "hf" / "x"
    with pytest.raises(FileNotFoundError, match="no fixture 'y'"):
        fixture_folder("y")
