"""Sharded execution of what the generated loaders load reproduces Hugging Face's own numerics.

Each tiny fixture is compiled with its built-in family for every topology of the issue and
loaded on every rank through the generated package. The numpy reference executor (tests/executor)
then runs each pipeline stage on its tensor-parallel ranks, using only each rank's loaded arrays
and the selection its `LocalTensorLayout` declares, with simulated all-reduce / all-gather and
pipeline hand-offs. Logits must match HF's `reference.npz` and the tensor crossing each pipeline
cut must match HF's `layer_outputs` at that layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from partc.parallel.placements import PlacementKind

from executor import RankShard, Selection, dequantize, forward_pipeline
from executor.model import SUPPORTED
from executor.variants import SUPPORTED as VARIANTS
from support import HF_MODELS, QUANTIZED, compile_and_load, hf

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4
# The fixtures of the model types the numpy executor implements (`executor.model.SUPPORTED`
# and the table-described families of `executor.variants`).
FIXTURES = [name for name in HF_MODELS
            if json.loads((hf(name) / "config.json").read_text())["model_type"]
            in SUPPORTED | VARIANTS]
TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 3)]
# More ranks than the tiny models' 2 KV heads: attention (and block-misaligned groups) fall back
# to replication under ReplicateUnsupported; the rest stays sharded (DeepSeek's 4 MLA heads too).
WIDE_TOPOLOGIES = [(4, 1), (4, 2)]


def layer_count(config: dict) -> int:
    """Decoder layers of an HF config (GPT-2 lineage spells it `n_layer`, DBRX `n_layers`)."""
    return int(config.get("num_hidden_layers", config.get("n_layer", config.get("n_layers", 0))))


def config_of(name: str) -> dict:
    return json.loads((hf(name) / "config.json").read_text())


CASES = [(name, topology) for name in FIXTURES for topology in TOPOLOGIES + WIDE_TOPOLOGIES
         if topology[1] < 3 or layer_count(config_of(name)) >= 3]
# CodeGen's 16 heads over 8 ranks: 2 heads of one of its 4 mp_num groups per rank (T > mp_num)
CASES += [("codegen", (8, 1)), ("codegen", (8, 2))]
CASE_IDS = [f"{name}-tp{t}-pp{s}" for name, (t, s) in CASES]


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def rank_shard(state) -> RankShard:
    """An executor rank from one generated rank's loaded arrays and layout selections."""
    selections = {}
    for target in state.tensors:
        axis, ranges = state.layout[target].selection
        selections[target] = None if axis is None else Selection(axis=axis, ranges=ranges)
    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in state.tensors.items()}
    return RankShard(tensors=tensors, selections=selections)


def stage_layers(plan, stage: int) -> range:
    """The decoder layers the plan gives pipeline stage `stage`."""
    tp = plan.topology.tensor_parallel_size
    groups = {g.group: g.unit_range for g in plan.ranks[stage * tp].partition.groups}
    start, end = groups.get("decoder", (0, 0))
    if "decoder" not in groups:  # a stage past the decoder (e.g. only MTP units)
        last = stage_layers(plan, stage - 1).stop
        return range(last, last)
    return range(start, end)


@pytest.fixture(scope="module")
def runs(builds):
    """Every (fixture, T, S): compiled, loaded on every rank, executed through the pipeline."""
    cache = {}

    def get(name, tp, pp):
        key = (name, tp, pp)
        if key not in cache:
            plan, states = builds(name, tp, pp)
            stages = [[rank_shard(s) for s in states[p * tp:(p + 1) * tp]] for p in range(pp)]
            layers = [stage_layers(plan, p) for p in range(pp)]
            with np.load(hf(name) / "reference.npz") as npz:
                reference = {k: npz[k] for k in npz.files}
            result = forward_pipeline(config_of(name), stages, layers, reference["input_ids"])
            cache[key] = (plan, states, layers, result, reference)
        return cache[key]

    return get


@pytest.mark.parametrize(("name", "topology"), CASES, ids=CASE_IDS)
def test_sharded_execution_reproduces_hf_logits(runs, name, topology):
    plan, states, layers, result, reference = runs(name, *topology)
    assert result.logits.shape == reference["logits"].shape
    assert rel_err(result.logits, reference["logits"]) < TOLERANCE


@pytest.mark.parametrize(("name", "topology"), [c for c in CASES if c[1][1] > 1],
                         ids=[i for c, i in zip(CASES, CASE_IDS, strict=True) if c[1][1] > 1])
def test_the_tensor_crossing_each_pipeline_cut_matches_hf_layer_outputs(runs, name, topology):
    plan, states, layers, result, reference = runs(name, *topology)
    assert len(result.sent) == topology[1] - 1
    for cut, sent in enumerate(result.sent):
        last_layer = layers[cut].stop - 1
        expected = reference["layer_outputs"][last_layer]
        assert sent.shape == expected.shape
        assert rel_err(sent, expected) < TOLERANCE, (cut, last_layer)


GQA_FIXTURES = ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "qwen2_moe", "gemma2",
                "gpt_oss"]


@pytest.mark.parametrize("name", GQA_FIXTURES)
def test_the_built_in_family_reproduces_hf_logits_on_four_ranks_by_kv_replication(tmp_path, name):
    """The built-in family (`kv_replication: true`) splits 4 q heads over 4 ranks, each rank
    holding a copy of the KV head its q heads use; fused qkv (phi3) and per-head sinks
    (gpt-oss) too."""
    for pp in (1, 2):
        plan, states = compile_and_load(None, hf(name) / "config.json", tmp_path / f"b{pp}",
                                        hf(name), tp=4, pp=pp)
        assert any(t.kv_replicas == 2 for t in states[0].layout.tensors)
        assert not any(t.fell_back_to_replication for s in states for t in s.layout.tensors)
        q = [s.layout["model.layers.0.self_attn.o_proj.weight"].selection for s in states[:4]]
        assert len(set(q)) == 4  # every rank its own q head
        stages = [[rank_shard(s) for s in states[p * 4:(p + 1) * 4]] for p in range(pp)]
        layers = [stage_layers(plan, p) for p in range(pp)]
        with np.load(hf(name) / "reference.npz") as npz:
            reference = {k: npz[k] for k in npz.files}
        result = forward_pipeline(config_of(name), stages, layers, reference["input_ids"])
        assert rel_err(result.logits, reference["logits"]) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURES)
def test_every_stage_runs_the_layers_its_partition_owns_and_nothing_else(runs, name):
    plan, states, layers, result, reference = runs(name, 2, 2)
    n = layer_count(config_of(name))
    assert [r.start for r in layers] == [0, layers[0].stop] and layers[-1].stop == n
    for stage, layer_range in enumerate(layers):
        loaded = set(states[2 * stage].tensors) | set(states[2 * stage + 1].tensors)
        paths = plan.graph[0].unit_paths  # `model.layers.7`, `transformer.h.7`, ...
        for layer in range(n):
            has_layer = any(t.startswith(f"{paths[layer]}.") for t in loaded)
            assert has_layer == (layer in layer_range), (stage, layer)


@pytest.mark.parametrize("name", FIXTURES)
def test_the_uneven_vocabulary_of_131_is_split_66_and_65_and_still_exact(runs, name):
    plan, states, layers, result, reference = runs(name, 2, 1)
    config = config_of(name)
    assert config["vocab_size"] == 131
    # the vocabulary tensors: the embedding and (untied) output head, whatever their names
    vocabulary = {t.target for t in states[0].layout.tensors
                  if t.logical_name in ("embedding", "lm_head") and len(t.global_shape) == 2}
    assert len(vocabulary) == (1 if config.get("tie_word_embeddings") else 2)
    for target in vocabulary:
        placements = [s.layout[target].placement for s in states]
        assert [p.kind for p in placements] == [PlacementKind.RANGE, PlacementKind.RANGE]
        assert [(p.start, p.end) for p in placements] == [(0, 66), (66, 131)]
    assert rel_err(result.logits, reference["logits"]) < TOLERANCE


# ---------------------------------------------------------------- quantized checkpoints

QUANTIZED_FIXTURES = ["qwen3_fp8", "deepseek_v3_fp8", "llama_mlx4", "gpt_oss_mxfp4"]
QUANTIZED_CASES = [(name, topology) for name in QUANTIZED_FIXTURES
                   for topology in TOPOLOGIES + WIDE_TOPOLOGIES
                   if topology[1] < 3 or layer_count(json.loads(
                       (QUANTIZED / name / "config.json").read_text())) >= 3]
QUANTIZED_IDS = [f"{name}-tp{t}-pp{s}" for name, (t, s) in QUANTIZED_CASES]


def _scaled(ranges, factor):
    return tuple((a * factor, b * factor) for a, b in ranges)


def dequantized_rank_shard(config: dict, state) -> RankShard:
    """A rank's loaded (quantized) slices decoded locally, with their dense selections.

    Every slice a linear format produces is block-aligned, so each rank decodes its own blocks
    alone; the dense selection follows from the stored tensor's selection: FP8 keeps it, MLX's
    packed input axis widens by 32 / bits, MXFP4's output-major blocks [..., out, G, 16] map to
    the dense [..., in, out] (out -> last axis, G -> input axis x 32).
    """
    stored = dict(state.tensors)
    dense = dequantize(config, stored)
    selections = {}
    for name, array in dense.items():
        if name in stored:
            axis, ranges = state.layout[name].selection
            if axis is not None:
                factor = array.shape[axis] // stored[name].shape[axis]
                ranges = _scaled(ranges, factor)
        else:
            blocks = f"{name}_blocks"
            axis, ranges = state.layout[blocks].selection
            nd = len(state.layout[blocks].global_shape)
            if axis == nd - 3:
                axis = nd - 2
            elif axis == nd - 2:
                axis, ranges = nd - 3, _scaled(ranges, 32)
        selections[name] = None if axis is None else Selection(axis=axis, ranges=ranges)
    return RankShard(tensors=dense, selections=selections)


@pytest.fixture(scope="module")
def quantized_runs(builds):
    cache = {}

    def get(name, tp, pp):
        key = (name, tp, pp)
        if key not in cache:
            folder = QUANTIZED / name
            config = json.loads((folder / "config.json").read_text())
            plan, states = builds(name, tp, pp)
            stages = [[dequantized_rank_shard(config, s) for s in states[p * tp:(p + 1) * tp]]
                      for p in range(pp)]
            layers = [stage_layers(plan, p) for p in range(pp)]
            with np.load(folder / "reference_dequant.npz") as npz:
                reference = {k: npz[k] for k in npz.files}
            result = forward_pipeline(config, stages, layers, reference["input_ids"])
            cache[key] = (plan, states, layers, result, reference)
        return cache[key]

    return get


@pytest.mark.parametrize(("name", "topology"), QUANTIZED_CASES, ids=QUANTIZED_IDS)
def test_dequantized_sharded_execution_reproduces_hf_dequantized_logits(
        quantized_runs, name, topology):
    plan, states, layers, result, reference = quantized_runs(name, *topology)
    assert rel_err(result.logits, reference["logits"]) < TOLERANCE
    for cut, sent in enumerate(result.sent):
        expected = reference["layer_outputs"][layers[cut].stop - 1]
        assert rel_err(sent, expected) < TOLERANCE, cut


@pytest.mark.parametrize("name", QUANTIZED_FIXTURES)
def test_quantized_ranks_load_the_stored_encoding_not_a_dense_copy(quantized_runs, name):
    plan, states, layers, result, reference = quantized_runs(name, 2, 1)
    dtypes = {str(a.dtype) for s in states for a in s.tensors.values()}
    expected = {"qwen3_fp8": "float8_e4m3fn", "deepseek_v3_fp8": "float8_e4m3fn",
                "llama_mlx4": "uint32", "gpt_oss_mxfp4": "uint8"}[name]
    assert expected in dtypes
