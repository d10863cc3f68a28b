"""The built-in family library against real checkpoints: ownership, round trip, bytes, HF plans.

Every tiny HF fixture is compiled with its built-in family (found from its `model_type`) for
each topology of the issue, loaded on every rank through the generated package, and checked
against the checkpoint itself. The full-size inventories are checked through `partc check` on a
real safetensors file whose data region is sparse.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from partc.api import CompileOptions, bind, check_family, checkpoint_errors, compile_family
from partc.cli.main import main
from partc.errors import ParallelPlanError
from partc.library import builtin_families
from partc.parallel.specs import ShardingPolicy
from partc.plan.topology import Topology
from partc.runtime.checkpoint import open_checkpoint

from executor import load_safetensors
from support import (
    FALLS_BACK_OVER_FOUR,
    FULLSIZE,
    checkpoint_tensors,
    compile_and_load,
    fixture_folder,
    fullsize_checkpoint,
    hf,
    policy_for,
    reassemble,
    write_sparse_safetensors,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "families"

# Tiny fixture -> the family (file) its model_type must resolve to.
FIXTURE_FAMILIES = {
    "llama": "llama",
    "llama_tied": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "phi3": "phi3",
    "qwen2_moe": "qwen2_moe",
    "gemma2": "gemma2",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v2_qlora": "deepseek_v2",
    "gpt_oss": "gpt_oss",
    "granite": "granite",
    "stablelm": "stablelm",
    "phi": "phi",
    "gpt_neox": "gpt_neox",
    "falcon": "falcon",
    "bloom": "bloom",
    "gpt2": "gpt2",
    "olmo2": "olmo2",
}
# Quantized fixture -> its family: the same family file, selected linear format.
QUANTIZED_FAMILIES = {
    "qwen3_fp8": "qwen3",
    "deepseek_v3_fp8": "deepseek_v3",
    "llama_mlx4": "llama",
    "gpt_oss_mxfp4": "gpt_oss",
}
TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 3)]
# More ranks than the tiny models' 2 KV heads (or than their block-aligned units).
WIDE_TOPOLOGIES = [(4, 1), (4, 2)]
# (fixture, T) pairs that are illegal under Require and run under ReplicateUnsupported (why:
# support.policy_for). Listed here on their own, so that the test below checks that table.
NEEDS_REPLICATION_FALLBACK = {(name, 4) for name in [*FIXTURE_FAMILIES, *QUANTIZED_FAMILIES]
                              if name in FALLS_BACK_OVER_FOUR}


def config_of(name: str) -> dict:
    return json.loads((fixture_folder(name) / "config.json").read_text())


def layers_of(name: str) -> int:
    config = config_of(name)
    return int(config.get("num_hidden_layers", config.get("n_layer")))


CASES = [(name, topology) for name in [*FIXTURE_FAMILIES, *QUANTIZED_FAMILIES]
         for topology in TOPOLOGIES + WIDE_TOPOLOGIES
         if topology[1] < 3 or layers_of(name) >= 3]
CASE_IDS = [f"{name}-tp{t}-pp{s}" for name, (t, s) in CASES]


@pytest.fixture(scope="module")
def checkpoints():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_safetensors(fixture_folder(name) / "model.safetensors")
        return cache[name]

    return get


def payload_bytes(path: Path) -> int:
    """Size of a safetensors file's data region (after the 8-byte length and the header)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - length


def take(array: np.ndarray, axis: int | None, ranges) -> np.ndarray:
    """The part of a global array a selection names (ranges concatenated along `axis`)."""
    if axis is None:
        return array
    return np.concatenate([np.take(array, range(a, b), axis=axis) for a, b in ranges], axis=axis)


def raw(array: np.ndarray) -> np.ndarray:
    """The bytes of an array as unsigned integers (exact comparison of bf16 / fp8 / u32)."""
    return np.ascontiguousarray(array).view(f"u{array.dtype.itemsize}")


# ---------------------------------------------------------------- model types and the CLI


def test_every_hf_model_type_resolves_to_its_family_file():
    families = builtin_families()
    for name, family in FIXTURE_FAMILIES.items():
        assert families[config_of(name)["model_type"]] == f"{family}.yaml", name


def test_partc_families_lists_every_model_type(capsys):
    assert main(["families"]) == 0
    listed = dict(line.split() for line in capsys.readouterr().out.splitlines())
    for name, family in FIXTURE_FAMILIES.items():
        assert listed[config_of(name)["model_type"]] == f"architectures/{family}.yaml"


def test_partc_compile_takes_a_model_type_as_the_family(tmp_path, capsys):
    out = tmp_path / "build"
    code = main(["compile", "qwen2", "--config", str(hf("qwen2") / "config.json"), "--tp", "2",
                 "--pp", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert (out / "plan.json").is_file() or any(out.rglob("plan.json"))
    assert "compiled qwen2 (qwen2) for TP=2 x PP=2" in capsys.readouterr().out


def test_every_fixture_shards_legally_under_require_except_the_listed_fallbacks(builds):
    for name in [*FIXTURE_FAMILIES, *QUANTIZED_FAMILIES]:
        for tp in (2, 4):
            if (name, tp) in NEEDS_REPLICATION_FALLBACK:
                with pytest.raises(ParallelPlanError, match="cannot be sharded"):
                    compile_family(None, fixture_folder(name) / "config.json",
                                   Topology(tensor_parallel_size=tp))
            else:  # the builds compile under Require
                plan, states = builds(name, tp, 1)
                assert plan.topology.policy is ShardingPolicy.REQUIRE
                assert not any(t.fell_back_to_replication for s in states
                               for t in s.layout.tensors), (name, tp)


# ---------------------------------------------------------------- ownership and round trip


@pytest.mark.parametrize(("name", "topology"), CASES, ids=CASE_IDS)
def test_check_family_passes_on_the_fixture_checkpoint(name, topology):
    tp, pp = topology
    folder = fixture_folder(name)
    errors = check_family(None, folder / "config.json", folder / "model.safetensors",
                          topology=Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                            policy=policy_for(name, tp)))
    assert [str(e) for e in errors] == []


@pytest.mark.parametrize(("name", "topology"), CASES, ids=CASE_IDS)
def test_tp_slices_of_every_stage_reassemble_every_checkpoint_tensor_exactly(
        builds, checkpoints, name, topology):
    """Every rank's slice is exactly the checkpoint's bytes at its selection; the slices of a
    stage cover every element once (T times when replicated, `kv_replicas` times for repeated KV
    heads); every checkpoint tensor is loaded by some stage."""
    tp, pp = topology
    plan, states = builds(name, tp, pp)
    full = checkpoints(name)
    loaded_by_some_stage = set()
    for stage in range(pp):
        ranks = states[stage * tp:(stage + 1) * tp]
        targets = set().union(*(state.tensors for state in ranks))
        for target in sorted(targets):
            holders = [state for state in ranks if target in state.tensors]
            assert len(holders) == tp, f"{target}: only {len(holders)} of {tp} ranks of stage"
            expected = raw(full[target])
            pieces = []
            for state in holders:
                axis, ranges = state.layout[target].selection
                local = raw(state.tensors[target])
                np.testing.assert_array_equal(local, take(expected, axis, ranges), err_msg=target)
                pieces.append((local, axis, ranges))
            array, count = reassemble(pieces, expected.shape, expected.dtype)
            np.testing.assert_array_equal(array, expected, err_msg=target)
            # kv_replicas from the plan: the generated tables do not carry it (yet)
            layout = plan.ranks[stage * tp].layout[target]
            if all(axis is None for _, axis, _ in pieces):
                assert (count == tp).all(), target
            else:
                assert np.isin(count, (1, layout.kv_replicas)).all(), target
        loaded_by_some_stage |= targets
    assert loaded_by_some_stage == set(full)


@pytest.mark.parametrize(("name", "topology"), CASES, ids=CASE_IDS)
def test_global_parameter_bytes_equal_the_checkpoint_payload(builds, name, topology):
    tp, pp = topology
    plan, states = builds(name, tp, pp)
    payload = payload_bytes(fixture_folder(name) / "model.safetensors")
    assert plan.global_parameter_bytes == payload
    for state in states:
        assert state.info.global_parameter_bytes == payload
    assert sum(s.info.local_parameter_bytes for s in states) >= payload


def test_replicate_unsupported_falls_back_per_group_and_records_it(builds):
    plan, states = builds("gpt_oss_mxfp4", 4, 1)
    layout = states[0].layout
    target = "model.layers.0.mlp.experts.down_proj_blocks"  # 3 MXFP4 block units
    assert layout[target].fell_back_to_replication
    assert layout[target].selection == (None, ())
    # 2 KV heads over 4 ranks: KV replication (on in the built-in family), not a fallback
    for target in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.sinks"):
        assert not layout[target].fell_back_to_replication, target
    assert layout["model.layers.0.self_attn.k_proj.weight"].kv_replicas == 2
    assert not layout["model.embed_tokens.weight"].fell_back_to_replication
    assert layout["model.embed_tokens.weight"].selection == (0, ((0, 33),))


@pytest.mark.parametrize("name", ["llama", "phi3", "gpt_oss", "qwen3_fp8"])
def test_the_built_in_family_repeats_kv_heads_over_four_ranks_and_every_kv_copy_is_exact(
        tmp_path, checkpoints, name):
    family = {**FIXTURE_FAMILIES, **QUANTIZED_FAMILIES}[name]
    plan, states = compile_and_load(family, fixture_folder(name) / "config.json", tmp_path / "b",
                                    fixture_folder(name), tp=4)
    full = checkpoints(name)
    attention = [t for t in full if ".self_attn." in t and not t.endswith("norm.weight")]
    repeated = 0
    for target in attention:
        layouts = [r.layout[target] for r in plan.ranks]
        pieces = []
        for state in states:
            axis, ranges = state.layout[target].selection
            local = raw(state.tensors[target])
            np.testing.assert_array_equal(local, take(raw(full[target]), axis, ranges))
            pieces.append((local, axis, ranges))
        array, count = reassemble(pieces, full[target].shape, raw(full[target]).dtype)
        np.testing.assert_array_equal(array, raw(full[target]), err_msg=target)
        assert np.isin(count, (1, layouts[0].kv_replicas)).all() or (count == 4).all(), target
        repeated += layouts[0].kv_replicas > 1
    assert repeated > 0
    assert not any(t.fell_back_to_replication for s in states for t in s.layout.tensors)


# ---------------------------------------------------------------- check lists every discrepancy


def test_check_lists_every_ownership_name_dtype_and_shape_discrepancy_at_once(tmp_path):
    tensors = dict(checkpoint_tensors(hf("qwen2")))
    del tensors["model.layers.1.self_attn.q_proj.bias"]                       # missing
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)  # unowned
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float16)  # dtype
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:130]               # shape
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    errors = check_family(None, hf("qwen2") / "config.json", path)
    messages = sorted(str(e) for e in errors)
    assert len(messages) == 4, messages
    joined = "\n".join(messages)
    assert "model.layers.1.self_attn.q_proj.bias" in joined
    assert "model.layers.0.mlp.extra.weight" in joined
    assert "`model.norm.weight` is F16 in the checkpoint; the family declares F32" in joined
    assert ("`lm_head.weight` has shape [130, 64] in the checkpoint; the family declares "
            "[131, 64]") in joined


# ---------------------------------------------------------------- full-size inventories


FULLSIZE_FAMILIES = {
    "Llama-3.1-8B": "llama",
    "Llama-3.1-70B": "llama",
    "Qwen2.5-72B": "qwen2",
    "Mixtral-8x7B-v0.1": "mixtral",
    "Qwen3-30B-A3B": "qwen3_moe",
    "DeepSeek-V3": "deepseek_v3",
    "DeepSeek-V2-Lite": "deepseek_v2",
}




@pytest.fixture(scope="module")
def fullsize_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fullsize")
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = fullsize_checkpoint(model, folder)
        return cache[model]

    yield get
    for path in cache.values():  # sparse, but do not leave 100s of GB of apparent size behind
        path.unlink()


@pytest.fixture(scope="module")
def deepseek_v3_full(fullsize_checkpoints):
    """DeepSeek-V3 (91,991 tensors) bound once against its full-size checkpoint header."""
    opened = open_checkpoint(fullsize_checkpoints("DeepSeek-V3"))
    bound, _, _ = bind(None, FULLSIZE / "DeepSeek-V3" / "config.json", opened)
    return bound, checkpoint_errors(bound, opened)


@pytest.mark.parametrize("model", sorted(set(FULLSIZE_FAMILIES) - {"DeepSeek-V3"}))
def test_partc_check_passes_on_the_full_size_checkpoint(fullsize_checkpoints, model, capsys):
    path = fullsize_checkpoints(model)
    code = main(["check", FULLSIZE_FAMILIES[model], "--config",
                 str(FULLSIZE / model / "config.json"), "--checkpoint", str(path)])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "ok: family, config binding, checkpoint checked" in capsys.readouterr().out


def test_full_size_deepseek_v3_block_fp8_checkpoint_with_its_mtp_layer_passes_check(
        deepseek_v3_full):
    """What `partc check deepseek_v3 --config ... --checkpoint ...` runs (bind with the
    checkpoint, then ownership, names, dtypes and shapes), sharing one bind with the MTP test."""
    bound, errors = deepseek_v3_full
    assert [str(e) for e in errors[:5]] == []
    scales = [t for t in bound.description.targets if t.endswith("weight_scale_inv")]
    assert len(scales) == 45_808
    groups = {owned.group.name: owned.group for owned in bound.description.groups}
    # 128 heads of 192 q_b rows on 128-row blocks: whole blocks need pairs of heads
    assert groups["model.layers.5.attention.heads"].units == 64
    assert groups["model.layers.5.experts.3"].units == 2048 // 128


def deepseek_v3_without_q_lora(folder: Path) -> tuple[Path, Path]:
    """DeepSeek-V3's full-size config and header as a config with `"q_lora_rank": null` has
    them (as HF's DeepseekV3Attention builds it): per layer `q_proj` [128 * 192, 7168] (FP8,
    with its [192, 56] block scales) instead of q_a_proj / q_a_layernorm / q_b_proj."""
    config = json.loads((FULLSIZE / "DeepSeek-V3" / "config.json").read_text())
    config["q_lora_rank"] = None
    header = json.loads((FULLSIZE / "DeepSeek-V3" / "safetensors_header.json").read_text())
    rows = config["num_attention_heads"] * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    entries = {k: v for k, v in header.items() if k != "__metadata__"
               and not re.search(r"\.self_attn\.q_(a_proj|a_layernorm|b_proj)\.", k)}
    for name in [k for k in header if k.endswith(".self_attn.q_b_proj.weight")]:
        stem = name.removesuffix("q_b_proj.weight")
        entries[stem + "q_proj.weight"] = {"dtype": "F8_E4M3", "shape": [rows, 7168]}
        entries[stem + "q_proj.weight_scale_inv"] = {"dtype": "F32",
                                                     "shape": [rows // 128, 7168 // 128]}
    offset, rebuilt = 0, {"__metadata__": header["__metadata__"]}
    for name in sorted(entries):
        size = math.prod(entries[name]["shape"]) * {"F32": 4, "BF16": 2, "F8_E4M3": 1}[
            entries[name]["dtype"]]
        rebuilt[name] = {**entries[name], "data_offsets": [offset, offset + size]}
        offset += size
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder / "config.json", write_sparse_safetensors(folder / "model.safetensors", rebuilt)


def test_full_size_deepseek_v3_config_with_null_q_lora_rank_checks_and_compiles(tmp_path):
    config, checkpoint = deepseek_v3_without_q_lora(tmp_path)
    assert main(["check", "--config", str(config), "--checkpoint", str(checkpoint)]) == 0
    result = compile_family(None, config, Topology(tensor_parallel_size=8,
                                                   pipeline_parallel_size=2),
                            CompileOptions(checkpoint=checkpoint, out=tmp_path / "build"))
    targets = {layout.target for rank in result.plan.ranks for layout in rank.layout.tensors}
    assert "model.layers.3.self_attn.q_proj.weight" in targets
    assert not any(".q_a_proj." in t or ".q_b_proj." in t for t in targets)
    q_proj = next(layout for layout in result.plan.ranks[1].layout.tensors
                  if layout.target == "model.layers.3.self_attn.q_proj.weight")
    assert q_proj.selection == (0, ((3072, 6144),))  # 16 of the 128 heads of 192 rows


def test_full_size_deepseek_v2_lite_without_q_lora_compiles_at_t8_and_three_stages(
        fullsize_checkpoints, tmp_path):
    checkpoint = fullsize_checkpoints("DeepSeek-V2-Lite")
    config = FULLSIZE / "DeepSeek-V2-Lite" / "config.json"
    assert json.loads(config.read_text())["q_lora_rank"] is None
    result = compile_family(None, config, Topology(tensor_parallel_size=8,
                                                   pipeline_parallel_size=3),
                            CompileOptions(checkpoint=checkpoint, out=tmp_path / "build"))
    plan = result.plan
    assert plan.family == "deepseek_v2"
    q_proj = next(layout for layout in plan.ranks[3].layout.tensors
                  if layout.target == "model.layers.0.self_attn.q_proj.weight")
    assert q_proj.selection == (0, ((1152, 1536),))  # heads 6-7 of 16, 192 rows each
    expert = next(layout for layout in plan.ranks[3].layout.tensors
                  if layout.target == "model.layers.1.mlp.experts.63.down_proj.weight")
    assert expert.selection == (1, ((528, 704),))  # 1408 channels over 8 ranks


def test_full_size_sparse_file_is_a_valid_safetensors_file_of_the_summary_size(
        fullsize_checkpoints):
    path = fullsize_checkpoints("Llama-3.1-8B")
    assert payload_bytes(path) == 16_060_522_496
    assert len(open_checkpoint(path).names) == 291


# ---------------------------------------------------------------- DeepSeek MTP


def test_deepseek_mtp_group_takes_units_only_when_the_checkpoint_holds_the_mtp_layer(
        deepseek_v3_full):
    bound, _ = deepseek_v3_full
    mtp = bound.description.graph.group("mtp")
    assert mtp.unit_paths == ("model.layers.61",)
    owned = set(bound.description.targets)
    for glue in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "shared_head.norm.weight", "shared_head.head.weight",
                 "mlp.experts.255.down_proj.weight", "mlp.gate.e_score_correction_bias",
                 "self_attn.kv_b_proj.weight_scale_inv"):
        assert f"model.layers.61.{glue}" in owned, glue
    tiny = hf("deepseek_v3") / "config.json"
    assert config_of("deepseek_v3")["num_nextn_predict_layers"] == 1  # HF keeps the field...
    opened = open_checkpoint(hf("deepseek_v3") / "model.safetensors")
    with_checkpoint, _, _ = bind(None, tiny, opened)
    assert with_checkpoint.description.graph.group("mtp").units == 0  # ...but not the layer
    without, _, _ = bind(None, tiny)
    assert without.description.graph.group("mtp").units == 0


def tiny_deepseek_with_mtp(folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The tiny DeepSeek checkpoint plus an MTP layer `model.layers.3` laid out as released."""
    tensors = dict(checkpoint_tensors(hf("deepseek_v3")))
    rng = np.random.default_rng(0)
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name] + 1
    glue = {"embed_tokens.weight": (131, 64), "enorm.weight": (64,), "hnorm.weight": (64,),
            "eh_proj.weight": (64, 128), "shared_head.norm.weight": (64,),
            "shared_head.head.weight": (131, 64)}
    for leaf, shape in glue.items():
        tensors[f"model.layers.3.{leaf}"] = rng.standard_normal(shape).astype(np.float32)
    path = folder / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_deepseek_mtp_layer_is_its_own_execution_group_on_the_last_stage(tmp_path):
    path, tensors = tiny_deepseek_with_mtp(tmp_path)
    config = hf("deepseek_v3") / "config.json"
    assert check_family(None, config, path, topology=Topology(
        tensor_parallel_size=2, pipeline_parallel_size=2)) == []
    result = compile_family(None, config,
                            Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                            CompileOptions(checkpoint=path, out=tmp_path / "build"))
    plan = result.plan
    assert [g.name for g in plan.graph] == ["decoder", "mtp"]
    assert {g.name: g.unit_paths for g in plan.graph}["mtp"] == ("model.layers.3",)
    last = plan.ranks[-1].partition
    assert [(g.group, g.unit_range) for g in last.groups] == [("decoder", (2, 3)), ("mtp", (0, 1))]
    assert plan.ranks[0].partition.state.global_range == (0, 2)
    assert last.state.global_range == (2, 4)
    _, states = compile_and_load(None, config, tmp_path / "build2", tmp_path, tp=2, pp=2,
                                 checkpoint=path)
    for target, expected in tensors.items():
        stages = [s for s in range(2) if target in states[2 * s].tensors]
        assert stages, target
        for stage in stages:
            ranks = states[2 * stage:2 * stage + 2]
            pieces = [(r.tensors[target], *r.layout[target].selection) for r in ranks]
            array, _ = reassemble(pieces, expected.shape, expected.dtype)
            np.testing.assert_array_equal(array, expected, err_msg=target)
    mtp_targets = {t for t in tensors if t.startswith("model.layers.3.")}
    assert mtp_targets <= set(states[2].tensors) | set(states[3].tensors)
    assert not mtp_targets & set(states[0].tensors)
    head = states[3].layout["model.layers.3.shared_head.head.weight"]
    assert head.selection == (0, ((66, 131),))
    assert states[3].layout["model.layers.3.eh_proj.weight"].selection == (None, ())


def test_a_zero_unit_execution_group_owns_nothing_and_takes_no_pipeline_stage(builds):
    plan, states = builds("deepseek_v3", 2, 3)
    assert {g.name: g.unit_paths for g in plan.graph}["mtp"] == ()
    ranges = [[(g.group, g.unit_range) for g in r.partition.groups] for r in plan.ranks[::2]]
    assert ranges == [[("decoder", (0, 1))], [("decoder", (1, 2))], [("decoder", (2, 3))]]


def test_deepseek_dense_first_layers_and_moe_layers_follow_first_k_dense_replace(builds):
    plan, states = builds("deepseek_v3", 1, 1)
    names = set(states[0].tensors)
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in names)
    for layer in (1, 2):
        assert f"model.layers.{layer}.mlp.experts.7.up_proj.weight" in names
        assert f"model.layers.{layer}.mlp.gate.e_score_correction_bias" in names
        assert f"model.layers.{layer}.mlp.shared_experts.down_proj.weight" in names
        assert f"model.layers.{layer}.mlp.gate_proj.weight" not in names


# ---------------------------------------------------------------- HF's tensor-parallel plan

# Strategies of HF's `tp_plan` that shard a weight, as (weight axis, bias axis; None =
# replicated). HF's shard of rank r is the contiguous chunk [r*c, min((r+1)*c, n)) with
# c = ceil(n / T) (transformers `get_tensor_shard`).
HF_STRATEGIES = {
    "colwise": (0, 0),
    "colwise_gather_output": (0, 0),
    "packed_colwise": (0, 0),
    "embedding_rowwise": (0, None),
    "rowwise": (1, None),
    "rowwise_split_input": (1, None),
    "replicated_with_grad_allreduce": (None, None),
    # MLA's kv_a_proj_with_mqa (DeepSeek-V2): transformers 5.24 names it but has no sharding
    # class of that name, so the weight stays whole on every rank, as partc replicates it
    "mla_kv_a_proj": (None, None),
}
# Strategies that act on a module (hooks, dispatch) and own no weight directly.
HF_MODULE_STRATEGIES = {"moe_tp_experts", "ep_dispatch_experts", "grouped_gemm"}
# Plan entries for modules the tiny fixture does not have (its MoE models have no dense layer).
ABSENT_FROM_FIXTURE = {
    name: {f"model.layers.*.mlp.{p}_proj" for p in ("gate", "up", "down")}
    for name in ("qwen2_moe", "qwen3_moe")
} | {"gpt_neox": {"lm_head"}}  # GPT-NeoX stores its head as `embed_out` (HF renames on load)
ABSENT_FROM_FIXTURE |= {  # DeepSeek-V2 has q_proj without q-LoRA, q_b_proj with it
    "deepseek_v2": {"model.layers.*.self_attn.q_b_proj"},
    "deepseek_v2_qlora": {"model.layers.*.self_attn.q_proj"},
}
# Every plan entry where partc deliberately slices differently from HF, with the reason's key
# phrase; each must be explained in docs/families/<family>.md.
DELIBERATE_DIFFERENCES = {
    "phi3": {
        "model.layers.*.self_attn.qkv_proj": "per segment",
        "model.layers.*.mlp.gate_up_proj": "per segment",
    },
}


def _conversions(manifest: dict) -> tuple[list[tuple[str, str]], list[tuple[list[str], str]]]:
    """(renamings on-disk -> in-memory, converters [on-disk sources] -> in-memory target)."""
    renamings, converters = [], []
    for text in manifest["checkpoint_conversion_mapping (load direction; save_pretrained "
                         "applies the reverse)"]:
        sources = re.findall(r"'([^']*)'", text.split("target_patterns")[0])
        targets = re.findall(r"'([^']*)'", text.split("target_patterns")[1])
        if text.startswith("WeightRenaming"):
            renamings.extend(zip(sources, targets, strict=True))
        else:
            converters.append((sources, targets[0]))
    return renamings, converters


def _pattern(text: str) -> re.Pattern:
    return re.compile("^" + re.escape(text).replace(r"\*", r"\d+") + "$")


def hf_plan_tensors(key: str, manifest: dict, names: list[str]) -> list[tuple[str, str]]:
    """On-disk tensors an HF plan key (in-memory naming) covers, as (name, 'weight'|'bias')."""
    renamings, converters = _conversions(manifest)

    def on_disk(text: str) -> str:
        for source, target in renamings:
            text = text.replace(target, source)
        return text

    for sources, target in converters:
        if key.endswith(target):
            found = []
            for source in sources:
                pattern = _pattern(on_disk(key[: -len(target)] + source))
                found += [(n, "weight") for n in names if pattern.match(n)]
            return found
    found = []
    for param in ("weight", "bias"):
        for candidate in {key, on_disk(key)}:
            pattern = _pattern(f"{candidate}.{param}")
            found += [(n, param) for n in names if pattern.match(n)]
    tied = manifest["tied_weights_keys (class attr)"] or {}
    if not found and manifest["tie_word_embeddings"] and f"{key}.weight" in tied:
        found = [(tied[f"{key}.weight"], "weight")]
    return sorted(set(found))


def hf_chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    chunk = math.ceil(size / parts)
    return index * chunk, min((index + 1) * chunk, size)


def compare_with_hf_plan(name: str, plan) -> dict[str, str]:
    """Every HF tp_plan entry whose slicing partc does not reproduce, with what differs."""
    manifest = json.loads((hf(name) / "manifest.json").read_text())
    tp = plan.topology.tensor_parallel_size
    layouts: dict[str, list] = {}
    for rank in plan.ranks:
        for layout in rank.layout.tensors:
            layouts.setdefault(layout.target, [None] * tp)[rank.tensor_parallel_rank] = layout
    names = sorted(layouts)
    differences = {}
    for key, strategy in manifest["plans"]["model_instance.tp_plan"].items():
        found = hf_plan_tensors(key, manifest, names)
        if strategy in HF_MODULE_STRATEGIES:
            assert not [n for n, _ in found if n.rsplit(".", 1)[0] == key], (name, key)
            continue
        assert strategy in HF_STRATEGIES, (name, key, strategy)
        if not found:
            differences[key] = "matches no tensor of this checkpoint"
            continue
        weight_axis, bias_axis = HF_STRATEGIES[strategy]
        for target, param in found:
            axis = weight_axis if param == "weight" else bias_axis
            for rank, layout in enumerate(layouts[target]):
                got = layout.selection
                if axis is None:
                    want = (None, ())
                else:
                    want = (axis, (hf_chunk(layout.global_shape[axis], tp, rank),))
                if got != want:
                    differences[key] = f"{target} rank {rank}: partc {got}, HF {want}"
    return differences


@pytest.mark.parametrize("name", sorted(FIXTURE_FAMILIES))
def test_hf_tensor_parallel_plan_agrees_with_the_family_wherever_hf_has_one(builds, name):
    plan, _ = builds(name, 2, 1)
    differences = compare_with_hf_plan(name, plan)
    absent = {k for k, v in differences.items() if v == "matches no tensor of this checkpoint"}
    assert absent == ABSENT_FROM_FIXTURE.get(name, set())
    assert set(differences) - absent == set(DELIBERATE_DIFFERENCES.get(name, {})), differences


def test_hf_plan_comparison_catches_a_projection_split_on_the_wrong_axis(tmp_path):
    text = (ROOT / "architectures" / "llama.yaml").read_text()
    down = """      - module: "model.layers.{unit}.mlp.down_proj"
        sharding: row"""
    assert down in text
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace(down, down.replace("row", "column")).replace(
        "weight: [hidden_size, intermediate_size]", "weight: [intermediate_size, hidden_size]"))
    plan = compile_family(wrong, hf("llama") / "config.json", Topology(tensor_parallel_size=2)).plan
    assert set(compare_with_hf_plan("llama", plan)) == {"model.layers.*.mlp.down_proj"}


@pytest.mark.parametrize("name", sorted(FIXTURE_FAMILIES))
def test_every_deliberate_difference_from_hf_is_documented_with_its_reason(name):
    family = FIXTURE_FAMILIES[name]
    doc = (DOCS / f"{family}.md").read_text()
    assert "HF tensor-parallel plan" in doc
    for key, reason in DELIBERATE_DIFFERENCES.get(name, {}).items():
        assert f"`{key}`" in doc, key
        assert reason in doc, reason


# ---------------------------------------------------------------- YAML only


def test_the_library_is_yaml_only_and_every_file_validates():
    files = sorted((ROOT / "architectures").glob("*"))
    data_files = [f for f in files if f.suffix in (".yaml", ".yml", ".toml")]
    assert {f.stem for f in data_files} >= set(FIXTURE_FAMILIES.values())
    assert all(f.suffix in (".yaml", ".yml", ".toml") or f.name in ("__init__.py", "__pycache__")
               for f in files)
    for f in data_files:
        assert check_family(f) == [], f.name
