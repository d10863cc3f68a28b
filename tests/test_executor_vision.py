"""The numpy executor reproduces HF's vision-language fixtures (llava, qwen2_vl), whole and sharded.

Oracles are the arrays HF wrote into each fixture's ``reference.npz`` at every boundary: each
vision layer's input / output, the projector input, ``image_features``, each decoder layer's
input / output, the final-norm output and the logits (and, for Qwen2-VL, HF's M-RoPE
``position_ids``, used only to check the executor's own ones). Rank shards are cut by the
executor's own numpy plan (``executor.vision_cut``), independent of partc, and, at the end, loaded
by the generated modules of the built-in llava / qwen2_vl families, with every pipeline hand-off
going through the generated encode / decode of the cut it crosses.
"""

from __future__ import annotations

import functools
import itertools
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from partc.emit.render import package_name
from partc.partition.ownership import GroupParallelMode

from executor import RankShard, Selection, ShardingError, load_fixture
from executor.vision import (
    Span,
    VisionLanguagePipelineResult,
    VisionLanguageResult,
    describe,
    forward_vision_language,
    forward_vision_language_pipeline,
    forward_vision_language_tensor_parallel,
    mrope_position_ids,
    split_units,
)
from executor.vision_cut import cut_vision_language
from support import compile_and_import, hf

MODELS = ["llava", "qwen2_vl"]
TOLERANCE = 1e-4
# The unit sequence: the vision layers that reach the projector (llava: 2 of its 3, as
# vision_feature_layer is -2; qwen2_vl: all 3), the projector, the 2 decoder layers. A cut c falls
# before unit c; every cut of S = 2 and S = 3 is run.
UNITS = {"llava": 5, "qwen2_vl": 6}
CASES = [(name, cuts) for name, n in UNITS.items()
         for cuts in [(), *itertools.combinations(range(1, n), 1),
                      *itertools.combinations(range(1, n), 2)]]
# What crosses each cut, read off the fixtures README: the vision stream up to the projector
# (llava: the output of layer 1 with CLS; the projector drops it), then image features, then the
# decoder stream; with them the request's ids, image mask (and Qwen2-VL's grid, or M-RoPE ids).
VISION, MERGED, DECODER = "vision", "projector", "decoder"
CUT_KINDS = {"llava": {1: VISION, 2: VISION, 3: MERGED, 4: DECODER},
             "qwen2_vl": {1: VISION, 2: VISION, 3: VISION, 4: MERGED, 5: DECODER}}
HANDOFF = {
    ("llava", VISION): {"vision_hidden", "input_ids", "image_mask"},
    ("llava", MERGED): {"image_features", "input_ids", "image_mask"},
    ("llava", DECODER): {"hidden"},
    ("qwen2_vl", VISION): {"vision_hidden", "input_ids", "image_mask", "image_grid_thw"},
    ("qwen2_vl", MERGED): {"image_features", "input_ids", "image_mask", "image_grid_thw"},
    ("qwen2_vl", DECODER): {"hidden", "position_ids"},
}


@functools.cache
def fixture(name: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    return load_fixture(name)


@functools.cache
def whole(name: str) -> VisionLanguageResult:
    config, tensors, ref = fixture(name)
    return forward_vision_language(config, tensors, ref)


@functools.cache
def pipeline(name: str, tp: int, cuts: tuple[int, ...],
             replicate_vision: bool = False) -> VisionLanguagePipelineResult:
    config, tensors, ref = fixture(name)
    spans = split_units(describe(config), cuts)
    stages = [cut_vision_language(config, tensors, tp, span=span,
                                  replicate_vision=replicate_vision) for span in spans]
    return forward_vision_language_pipeline(config, stages, spans, ref)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def assert_matches(actual: np.ndarray | None, expected: np.ndarray) -> None:
    assert actual is not None and actual.dtype == np.float32
    assert rel_err(actual, expected) < TOLERANCE


def assert_every_boundary(result: VisionLanguageResult, ref: dict[str, np.ndarray]) -> None:
    """Vision layers, projector input, image features, decoder layers, final norm, logits."""
    assert len(result.vision_layer_outputs) == len(ref["vision_layer_outputs"]) == 3
    for i, (ins, outs) in enumerate(
        zip(result.vision_layer_inputs, result.vision_layer_outputs, strict=True)
    ):
        assert_matches(ins, ref["vision_layer_inputs"][i])
        assert_matches(outs, ref["vision_layer_outputs"][i])
    hidden_states = np.stack([*result.vision_layer_inputs, result.vision_layer_outputs[-1]])
    assert_matches(hidden_states, ref["vision_hidden_states"])
    assert_matches(result.projector_input, ref["projector_input"])
    assert_matches(result.image_features, ref["image_features"])
    assert len(result.layer_outputs) == len(ref["layer_outputs"]) == 2
    for i, (ins, outs) in enumerate(zip(result.layer_inputs, result.layer_outputs, strict=True)):
        assert_matches(ins, ref["layer_inputs"][i])
        assert_matches(outs, ref["layer_outputs"][i])
    assert result.normed is not None
    assert_matches(np.stack([*result.layer_inputs, result.normed]), ref["hidden_states"])
    assert_matches(result.logits, ref["logits"])


# --------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("name", MODELS)
def test_full_weight_forward_reproduces_every_hf_boundary(name: str) -> None:
    assert_every_boundary(whole(name), fixture(name)[2])


@pytest.mark.parametrize("name", MODELS)
def test_image_features_fill_exactly_the_image_token_rows_of_the_decoder_input(name: str) -> None:
    config, _, ref = fixture(name)
    result = whole(name)
    image = ref["input_ids"][0] == describe(config).image_token
    assert int(image.sum()) == {"llava": 4, "qwen2_vl": 6}[name]
    assert result.image_features is not None
    np.testing.assert_array_equal(result.layer_inputs[0][0][image], result.image_features)
    assert_matches(result.layer_inputs[0][0][~image], ref["layer_inputs"][0][0][~image])


def test_qwen2_vl_mrope_position_ids_are_computed_from_ids_and_grid_and_match_hf() -> None:
    config, _, ref = fixture("qwen2_vl")
    ids, deltas = mrope_position_ids(config, ref["input_ids"], ref["image_grid_thw"])
    np.testing.assert_array_equal(ids, ref["position_ids"])
    np.testing.assert_array_equal(deltas, ref["rope_deltas"])
    assert whole("qwen2_vl").position_ids is not None
    np.testing.assert_array_equal(whole("qwen2_vl").position_ids, ref["position_ids"])
    # The text after the 2x3 image grid (which starts at 4) resumes at 4 + max(2, 3) = 7.
    assert ids[:, 0, 10].tolist() == [7, 7, 7]


def test_the_released_llava_naming_runs_the_same() -> None:
    config, tensors, ref = fixture("llava")
    released = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): value
                for name, value in tensors.items()}
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in released
    result = forward_vision_language(config, released, ref)
    np.testing.assert_array_equal(result.logits, whole("llava").logits)


# --------------------------------------------------------------------------- TP and PP


@pytest.mark.parametrize("replicate_vision", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_rank_shards_reproduce_every_hf_boundary(
    name: str, tp: int, replicate_vision: bool
) -> None:
    assert_every_boundary(pipeline(name, tp, (), replicate_vision).whole, fixture(name)[2])


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_really_hold_slices_of_the_vision_heads_projector_and_decoder(name: str) -> None:
    config, tensors, _ = fixture(name)
    ranks = cut_vision_language(config, tensors, 2)
    if name == "llava":
        attn = "vision_tower.encoder.layers.0.self_attn."
        sliced = {attn + "q_proj.weight": Selection(0, ((16, 32),)),
                  attn + "out_proj.weight": Selection(1, ((16, 32),)),
                  "vision_tower.embeddings.patch_embedding.weight": Selection(0, ((16, 32),)),
                  "multi_modal_projector.linear_1.weight": Selection(0, ((32, 64),)),
                  "multi_modal_projector.linear_2.weight": Selection(1, ((32, 64),)),
                  "language_model.model.embed_tokens.weight": Selection(0, ((66, 131),))}
    else:  # heads 2-3 of each of the q, k, v blocks (4 heads x 8 rows each)
        sliced = {"visual.blocks.0.attn.qkv.weight": Selection(0, ((16, 32), (48, 64), (80, 96))),
                  "visual.blocks.0.attn.qkv.bias": Selection(0, ((16, 32), (48, 64), (80, 96))),
                  "visual.blocks.0.attn.proj.weight": Selection(1, ((16, 32),)),
                  "visual.merger.mlp.0.weight": Selection(0, ((64, 128),)),
                  "visual.merger.mlp.2.weight": Selection(1, ((64, 128),)),
                  "model.embed_tokens.weight": Selection(0, ((66, 131),))}
    for tensor, selection in sliced.items():
        assert ranks[1].selections[tensor] == selection
        rows = np.concatenate([np.arange(a, b) for a, b in selection.ranges])
        np.testing.assert_array_equal(ranks[1].tensors[tensor],
                                      np.take(tensors[tensor], rows, axis=selection.axis))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("name", "cuts"), CASES,
                         ids=[f"{n}-cuts{'-'.join(map(str, c)) or 'none'}" for n, c in CASES])
def test_pipeline_stages_reproduce_hf_and_hand_on_exactly_what_crosses_each_cut(
    name: str, cuts: tuple[int, ...], tp: int
) -> None:
    ref = fixture(name)[2]
    result = pipeline(name, tp, cuts)
    assert_every_boundary(result.whole, ref)
    assert len(result.sent) == len(cuts)
    for cut, payload in zip(cuts, result.sent, strict=True):
        assert_payload(name, cut, payload, ref)


def assert_payload(name: str, cut: int, payload: dict[str, np.ndarray],
                   ref: dict[str, np.ndarray]) -> None:
    """The payload crossing the cut before unit ``cut`` holds HF's tensors there, and only them."""
    kind = CUT_KINDS[name][cut]
    assert set(payload) == HANDOFF[name, kind]
    if kind == VISION:
        assert_matches(payload["vision_hidden"], ref["vision_layer_outputs"][cut - 1])
    elif kind == MERGED:
        assert_matches(payload["image_features"], ref["image_features"])
    else:
        assert_matches(payload["hidden"], ref["layer_outputs"][0])
    if "image_mask" in payload:
        np.testing.assert_array_equal(payload["input_ids"], ref["input_ids"])
        np.testing.assert_array_equal(payload["image_mask"], ref["input_ids"] == 126)
        assert payload["input_ids"].dtype == np.int32 and payload["image_mask"].dtype == bool
    if "image_grid_thw" in payload:
        np.testing.assert_array_equal(payload["image_grid_thw"], ref["image_grid_thw"])
    if "position_ids" in payload:
        np.testing.assert_array_equal(payload["position_ids"], ref["position_ids"])


def test_a_stage_holds_only_the_tensors_of_its_own_units() -> None:
    config, tensors, _ = fixture("qwen2_vl")
    spans = split_units(describe(config), (2, 4))
    assert spans == [Span(vision=range(0, 2)),
                     Span(vision=range(2, 3), projector=range(0, 1)),
                     Span(decoder=range(0, 2))]
    assert len(split_units(describe(fixture("llava")[0]), ())[0].vision) == 2  # layer 2 unused
    first, middle, last = (set(cut_vision_language(config, tensors, 2, span=s)[0].tensors)
                           for s in spans)
    assert "visual.patch_embed.proj.weight" in first and "visual.blocks.1.norm1.weight" in first
    assert not any(n.startswith(("visual.blocks.2.", "visual.merger", "model.", "lm_head"))
                   for n in first)
    assert {n.split(".")[1] for n in middle} == {"blocks", "merger"}
    assert all(n.startswith(("model.", "lm_head")) for n in last)
    assert len(first) + len(middle) + len(last) == len(tensors)


def test_pipeline_applies_transfer_to_the_payload_of_every_cut() -> None:
    config, tensors, ref = fixture("llava")
    spans = split_units(describe(config), (2, 3, 4))
    stages = [cut_vision_language(config, tensors, 2, span=span) for span in spans]
    calls: list[int] = []

    def bf16_round_trip(cut: int, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(cut)
        return {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) if v.dtype == np.float32
                else v for k, v in payload.items()}

    result = forward_vision_language_pipeline(config, stages, spans, ref, bf16_round_trip)
    assert calls == [0, 1, 2]
    for cut, (sent, received) in enumerate(zip(result.sent, result.received, strict=True)):
        assert list(sent) == list(received)
        floats = [key for key in sent if sent[key].dtype == np.float32]
        assert floats == [("vision_hidden", "image_features", "hidden")[cut]]
        for key in floats:
            np.testing.assert_array_equal(
                received[key], sent[key].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert result.whole.logits is not None
    assert 0 < rel_err(result.whole.logits, ref["logits"]) < 1e-2


# --------------------------------------------------------------------------- refusals


def replace(rank: RankShard, name: str, full: np.ndarray, sel: Selection) -> None:
    rank.tensors[name] = np.concatenate(
        [np.take(full, np.arange(a, b), axis=sel.axis) for a, b in sel.ranges], axis=sel.axis)
    rank.selections[name] = sel


QKV = "visual.blocks.0.attn.qkv"


@pytest.mark.parametrize(("ranges", "message"), [
    # rank 0 loses head 1 of q, k and v: the heads no longer partition the 32 attention features
    (((0, 8), (32, 40), (64, 72)), "slices do not partition 32"),
    # rank 0 keeps q heads 0-1 but takes k / v of heads 2-3
    (((0, 16), (48, 64), (80, 96)), "k heads of the local q heads"),
    # a plain contiguous row split of the fused [q | k | v] (q of every head, k of heads 0-1)
    (((0, 48),), r"k heads of the local q heads: rank lacks global indices \[2, 3\]"),
    # half a head of q
    (((0, 12), (32, 48), (64, 80)), "not whole heads|splits a head"),
])
def test_fused_qkv_shards_that_lose_or_mismatch_a_head_are_refused(
    ranges: tuple[tuple[int, int], ...], message: str
) -> None:
    config, tensors, ref = fixture("qwen2_vl")
    ranks = cut_vision_language(config, tensors, 2)
    for leaf in ("weight", "bias"):
        replace(ranks[0], f"{QKV}.{leaf}", tensors[f"{QKV}.{leaf}"], Selection(0, ranges))
    with pytest.raises(ShardingError, match=message):
        forward_vision_language_tensor_parallel(config, ranks, ref)


def test_a_clip_rank_missing_a_value_head_is_refused() -> None:
    config, tensors, ref = fixture("llava")
    ranks = cut_vision_language(config, tensors, 2)
    name = "vision_tower.encoder.layers.1.self_attn.v_proj"
    for leaf in ("weight", "bias"):  # rank 1 holds v of head 2 only (q, k of heads 2-3)
        replace(ranks[1], f"{name}.{leaf}", tensors[f"{name}.{leaf}"], Selection(0, ((16, 24),)))
    with pytest.raises(ShardingError, match="v heads of the local q heads"):
        forward_vision_language_tensor_parallel(config, ranks, ref)


def test_projector_ranks_holding_the_same_half_are_refused() -> None:
    config, tensors, ref = fixture("llava")
    ranks = cut_vision_language(config, tensors, 2)
    first, second = "multi_modal_projector.linear_1", "multi_modal_projector.linear_2"
    for rank in ranks:  # both ranks: linear_1 rows 0-31, linear_2 columns 0-31
        for name, axis in ((f"{first}.weight", 0), (f"{first}.bias", 0), (f"{second}.weight", 1)):
            replace(rank, name, tensors[name], Selection(axis, ((0, 32),)))
    with pytest.raises(ShardingError, match="linear_2: slices do not partition 64"):
        forward_vision_language_tensor_parallel(config, ranks, ref)


def test_replicated_vision_ranks_that_disagree_are_refused() -> None:
    config, tensors, ref = fixture("qwen2_vl")
    ranks = cut_vision_language(config, tensors, 2, replicate_vision=True)
    ranks[1].tensors["visual.blocks.1.mlp.fc1.weight"] = (
        ranks[1].tensors["visual.blocks.1.mlp.fc1.weight"] + np.float32(0.25))
    with pytest.raises(ShardingError, match="visual.blocks.1.mlp.fc2: replicated ranks disagree"):
        forward_vision_language_tensor_parallel(config, ranks, ref)


def block_major_to_raster(t: int, h: int, w: int, m: int) -> np.ndarray:
    """Row indices that put block-major patch rows (the processor's order) in raster order."""
    block_major = [(bi * m + di, bj * m + dj) for _ in range(t) for bi in range(h // m)
                   for bj in range(w // m) for di in range(m) for dj in range(m)]
    return np.argsort([i * w + j for i, j in block_major], kind="stable")


def test_qwen2_vl_patch_rows_in_raster_order_change_the_image_features() -> None:
    config, tensors, ref = fixture("qwen2_vl")
    order = block_major_to_raster(*ref["image_grid_thw"][0].tolist(), m=2)
    assert sorted(order.tolist()) == list(range(24)) and order[:4].tolist() == [0, 1, 4, 5]
    raster = {**ref, "pixel_values": ref["pixel_values"][order]}
    result = forward_vision_language(config, tensors, raster)
    assert result.image_features is not None and result.logits is not None
    assert rel_err(result.image_features, ref["image_features"]) > 1e-2
    assert rel_err(result.logits, ref["logits"]) > 1e-3


def test_llava_patches_in_another_order_change_the_image_features() -> None:
    config, tensors, ref = fixture("llava")
    swapped = {**ref, "pixel_values": ref["pixel_values"].swapaxes(-1, -2)}  # column-major grid
    result = forward_vision_language(config, tensors, swapped)
    assert result.image_features is not None
    assert rel_err(result.image_features, ref["image_features"]) > 1e-2


def test_qwen2_vl_one_dimensional_positions_change_the_logits() -> None:
    config, tensors, ref = fixture("qwen2_vl")
    flat = np.broadcast_to(np.arange(16), (3, 1, 16))
    result = forward_vision_language(config, tensors, ref, position_ids=flat)
    assert result.logits is not None
    assert rel_err(result.logits, ref["logits"]) > 1e-2
    assert_matches(result.image_features, ref["image_features"])  # the vision side is untouched


def test_llava_reading_the_last_vision_layer_instead_of_the_second_last_changes_the_features(
) -> None:
    config, tensors, ref = fixture("llava")
    result = forward_vision_language({**config, "vision_feature_layer": -1}, tensors, ref)
    assert result.projector_input is not None and result.image_features is not None
    assert_matches(result.projector_input, ref["vision_layer_outputs"][2][:, 1:])
    assert rel_err(result.image_features, ref["image_features"]) > 1e-2


def test_image_token_count_must_match_the_feature_rows() -> None:
    config, tensors, ref = fixture("llava")
    ids = ref["input_ids"].copy()
    ids[0, 3] = 5  # 3 image tokens for 4 feature rows
    with pytest.raises(ValueError, match="3 image tokens in the ids; 4 image feature rows"):
        forward_vision_language(config, tensors, {**ref, "input_ids": ids})


def test_a_payload_missing_what_the_next_stage_needs_is_refused() -> None:
    config, tensors, ref = fixture("llava")
    spans = split_units(describe(config), (3,))
    stages = [cut_vision_language(config, tensors, 1, span=span) for span in spans]
    with pytest.raises(ValueError, match=r"starting at unit 3 needs \['image_features', "
                                         r"'input_ids', 'image_mask'\]; missing \['image_mask'\]"):
        forward_vision_language_pipeline(
            config, stages, spans, ref,
            lambda cut, payload: {k: v for k, v in payload.items() if k != "image_mask"})


def test_a_stage_uses_the_image_mask_and_positions_it_received() -> None:
    config, tensors, ref = fixture("qwen2_vl")
    spans = split_units(describe(config), (4, 5))
    stages = [cut_vision_language(config, tensors, 2, span=span) for span in spans]

    def damage(cut: int, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if cut == 0:  # the image rows one position later
            return {**payload, "image_mask": np.roll(payload["image_mask"], 1, axis=-1)}
        return {**payload, "position_ids": np.broadcast_to(np.arange(16, dtype=np.int32),
                                                           (3, 1, 16))}

    first = forward_vision_language_pipeline(config, stages, spans, ref,
                                             lambda c, p: damage(c, p) if c == 0 else p)
    assert first.whole.layer_inputs[0] is not None
    assert rel_err(first.whole.layer_inputs[0], ref["layer_inputs"][0]) > 1e-2
    second = forward_vision_language_pipeline(config, stages, spans, ref,
                                              lambda c, p: damage(c, p) if c == 1 else p)
    assert_matches(second.whole.layer_outputs[0], ref["layer_outputs"][0])
    assert second.whole.logits is not None
    assert rel_err(second.whole.logits, ref["logits"]) > 1e-2


@pytest.mark.parametrize(("spans", "message"), [
    ([Span(vision=range(0, 2), decoder=range(0, 2))], "not a non-empty contiguous run"),
    ([Span(vision=range(0, 1)), Span(projector=range(1), decoder=range(2))], "not consecutive"),
    ([Span(vision=range(0, 2), projector=range(1))], "cover 3 of 5 units"),
    ([Span(vision=range(0, 3))], r"range\(0, 3\) is not a part of range\(2\)"),
])
def test_stage_spans_must_be_contiguous_and_cover_every_unit(
    spans: list[Span], message: str
) -> None:
    config, tensors, ref = fixture("llava")
    stages = [[RankShard(dict(tensors), {})] for _ in spans]
    with pytest.raises(ValueError, match=message):
        forward_vision_language_pipeline(config, stages, spans, ref)


def test_split_units_gives_every_stage_a_contiguous_part() -> None:
    arch = describe(fixture("llava")[0])
    for cuts in itertools.combinations(range(1, arch.n_units), 2):
        spans = split_units(arch, cuts)
        bounds = [span.bounds(arch) for span in spans]
        assert bounds == list(itertools.pairwise([0, *cuts, arch.n_units]))


# --------------------------------------------------------------------------- through partc


ROLE = {"vision_hidden": "hidden"}
"""Executor payload key -> the families' boundary role, where they differ (docs/boundaries.md)."""
GROUP_PART = {"vision": "vision", "projector": "projector", "merger": "projector",
              "decoder": "decoder"}
"""Execution group of the built-in llava / qwen2_vl families -> the executor's part."""
TOPOLOGIES = [(tp, pp) for tp in (1, 2) for pp in (1, 2, 3)]
# Explicit stage unit counts (canonical order: vision units, projector, decoder layers) so that
# every kind of cut goes through the generated boundaries: inside the vision tower, vision ->
# projector, projector -> decoder, inside the decoder.
LAYOUTS = {"llava": [(1, 4), (2, 3), (3, 2), (4, 1), (1, 2, 2), (2, 2, 1)],
           "qwen2_vl": [(1, 5), (3, 3), (4, 2), (5, 1), (2, 2, 2), (3, 2, 1)]}
# The vision tower replicated on every TP rank (the decoder still split), or also on one stage.
MODES = [(2, 2, "replicated"), (2, 3, "replicated_one_stage")]
PARTC_CASES = [(name, tp, pp, None, None) for name in MODELS for tp, pp in TOPOLOGIES] + [
    (name, 2, len(units), units, None) for name in MODELS for units in LAYOUTS[name]] + [
    (name, tp, pp, None, mode) for name in MODELS for tp, pp, mode in MODES]


def rank_shard(state: Any) -> RankShard:
    """An executor rank from one generated rank's loaded arrays and layout selections."""
    selections: dict[str, Selection | None] = {}
    for target in state.tensors:
        axis, ranges = state.layout[target].selection
        selections[target] = None if axis is None else Selection(axis=axis, ranges=ranges)
    return RankShard({k: np.asarray(v) for k, v in state.tensors.items()}, selections)


def stage_span(plan: Any, stage: int) -> Span:
    """The executor span of the units the plan gives pipeline stage ``stage``."""
    tp = plan.topology.tensor_parallel_size
    parts: dict[str, range] = {}
    for group in plan.ranks[stage * tp].partition.groups:
        parts[GROUP_PART[group.group]] = range(*group.unit_range)
    return Span(**parts)


@pytest.fixture(scope="module")
def partc_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(fixture, T, S) -> compiled, every rank loaded through the generated modules, run."""
    cache: dict[tuple[Any, ...], Any] = {}

    def get(name: str, tp: int, pp: int, units: tuple[int, ...] | None, mode: str | None) -> Any:
        key = (name, tp, pp, units, mode)
        if key in cache:
            return cache[key]
        config, _, ref = fixture(name)
        out = tmp_path_factory.mktemp(f"{name}-tp{tp}-pp{pp}")
        modes = None if mode is None else [("vision", GroupParallelMode(mode))]
        plan, package = compile_and_import(None, hf(name) / "config.json", out, tp=tp, pp=pp,
                                           stage_units=units, group_modes=modes)
        try:
            modules = [package.rank_module(r) for r in range(tp * pp)]
            states = [module.load(hf(name)) for module in modules]
        finally:
            for module_name in [m for m in sys.modules if m.startswith(package_name(plan))]:
                del sys.modules[module_name]
        by_stage = [modules[s * tp:(s + 1) * tp] for s in range(pp)]
        encoded: list[tuple[str, ...]] = []

        def through_generated(cut: int, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            senders = {m.send_boundary().identity for m in by_stage[cut]}
            receivers = {m.receive_boundary().identity for m in by_stage[cut + 1]}
            assert len(senders) == 1 and senders == receivers, (senders, receivers)
            roles = {key: ROLE.get(key, key) for key in payload}
            values = by_stage[cut][0].send_boundary().encode_values(
                {roles[key]: value for key, value in payload.items()})
            encoded.append(tuple(v.role for v in values))
            decoded = [m.receive_boundary().decode(values) for m in by_stage[cut + 1]]
            back = {role: key for key, role in roles.items()}
            return {back[role]: tensor for role, tensor in decoded[-1].items()}

        stages = [[rank_shard(state) for state in states[s * tp:(s + 1) * tp]] for s in range(pp)]
        spans = [stage_span(plan, s) for s in range(pp)]
        result = forward_vision_language_pipeline(config, stages, spans, ref, through_generated)
        cache[key] = (stages, by_stage, spans, result, encoded)
        return cache[key]

    return get


@pytest.mark.parametrize(("name", "tp", "pp", "units", "mode"), PARTC_CASES, ids=[
    f"{n}-tp{t}-pp{p}" + ("-units" + "-".join(map(str, u)) if u else "") + (f"-{m}" if m else "")
    for n, t, p, u, m in PARTC_CASES])
def test_ranks_loaded_by_the_generated_modules_reproduce_hf_through_generated_boundaries(
    partc_runs: Any, name: str, tp: int, pp: int, units: tuple[int, ...] | None, mode: str | None
) -> None:
    stages, by_stage, spans, result, encoded = partc_runs(name, tp, pp, units, mode)
    if units is not None:
        assert [span.bounds(describe(fixture(name)[0])) for span in spans] == list(
            itertools.pairwise(itertools.accumulate(units, initial=0)))
    ref = fixture(name)[2]
    assert_every_boundary(result.whole, ref)
    assert len(result.sent) == len(encoded) == pp - 1
    if pp > 1:
        assert by_stage[0][0].receive_boundary() is None
        assert by_stage[-1][0].send_boundary() is None
    arch = describe(fixture(name)[0])
    for cut, (payload, roles) in enumerate(zip(result.sent, encoded, strict=True)):
        # the generated schema of this cut carries exactly what the executor hands on, HF's
        # tensors at that cut; what the next stage decoded is what was sent
        assert set(roles) == {ROLE.get(key, key) for key in payload}, (cut, roles)
        assert_payload(name, spans[cut].bounds(arch)[1], payload, ref)
        for key, value in payload.items():
            np.testing.assert_array_equal(result.received[cut][key], value)
    attention = {"llava": "vision_tower.encoder.layers.0.self_attn.q_proj.weight",
                 "qwen2_vl": "visual.blocks.0.attn.qkv.weight"}[name]
    held = [r.selections[attention] for r in stages[0]]
    head = {"llava": "language_model.lm_head.weight", "qwen2_vl": "lm_head.weight"}[name]
    vocab = [r.selections[head] for r in stages[-1]]
    assert vocab == ([Selection(0, ((0, 66),)), Selection(0, ((66, 131),))] if tp == 2
                     else [None])
    if mode is not None:  # the tower whole on both ranks, on one stage for *_one_stage
        assert held == [None, None]
        assert mode != "replicated_one_stage" or spans[0].vision == range(describe(
            fixture(name)[0]).n_used)
    elif tp == 2:  # the vision heads really are split: 2 of 4 heads of q (and of k, v) per rank
        rows = {"llava": [((0, 16),), ((16, 32),)],
                "qwen2_vl": [((0, 16), (32, 48), (64, 80)), ((16, 32), (48, 64), (80, 96))]}
        assert [sel.ranges if sel else None for sel in held] == rows[name]
    else:
        assert held == [None]
