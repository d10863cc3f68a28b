"""Multi-group execution graphs on real vision-language checkpoints (issue 14).

llava (CLIP tower -> MLP projector -> Llama) and qwen2_vl (vision transformer with fused qkv ->
patch merger -> Qwen2), both real transformers checkpoints: every rank loads exactly its plan's
tensors (the safetensors library is the oracle), each pipeline cut carries the boundary of the
group before it, static roles sit with the unit they are placed with, the released naming loads
with the same family, and multi-group stages are balanced by parameter bytes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from partc.api import CompileOptions, check_family, compile_family
from partc.cli.main import main
from partc.errors import ArchitectureBoundaryError, BoundaryPayloadError
from partc.plan.topology import Topology

from support import (
    HF,
    ROOT,
    compile_and_load,
    import_build,
    reassemble,
    write_sparse_safetensors,
)
from support.families import MINI

FAMILIES = ["llava", "qwen2_vl"]
TOPOLOGIES = [(t, s) for t in (1, 2) for s in (1, 2, 3)]


def _renamer():
    spec = importlib.util.spec_from_file_location(
        "gen_renamed", ROOT / "tests" / "fixtures" / "gen" / "gen_renamed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_renamed"] = module
    spec.loader.exec_module(module)
    return module


def oracle(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, read with the safetensors library."""
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def take(array: np.ndarray, axis: int | None, ranges) -> np.ndarray:
    """The selection of a layout (`axis`, half-open ranges concatenated) cut from `array`."""
    if axis is None:
        return array
    return np.concatenate([np.take(array, range(a, b), axis=axis) for a, b in ranges], axis=axis)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    cache = {}

    def get(name, tp, pp, folder=None, **options):
        key = (name, tp, pp, str(folder), repr(sorted(options.items())))
        if key not in cache:
            source = folder or HF / name
            out = tmp_path_factory.mktemp(f"{name}-{tp}x{pp}")
            cache[key] = compile_and_load(None, source / "config.json", out / "build",
                                          source / "model.safetensors", tp=tp, pp=pp,
                                          checkpoint=source / "model.safetensors", **options)
        return cache[key]

    return get


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("tp", "pp"), TOPOLOGIES)
def test_each_rank_loads_exactly_the_tensors_its_plan_names(builds, name, tp, pp):
    folder = HF / name
    assert check_family(None, folder / "config.json", folder / "model.safetensors",
                        topology=Topology(tensor_parallel_size=tp,
                                          pipeline_parallel_size=pp)) == []
    plan, states = builds(name, tp, pp)
    full = oracle(folder)
    loaded = set()
    for stage in range(pp):
        ranks = states[stage * tp:(stage + 1) * tp]
        for rank, state in zip(plan.ranks[stage * tp:(stage + 1) * tp], ranks, strict=True):
            assert set(state.tensors) == {t.target for t in rank.layout.tensors}
        for target in sorted(ranks[0].tensors):
            pieces = []
            for state in ranks:
                axis, ranges = state.layout[target].selection
                np.testing.assert_array_equal(state.tensors[target],
                                              take(full[target], axis, ranges), err_msg=target)
                pieces.append((state.tensors[target], axis, ranges))
            array, _ = reassemble(pieces, full[target].shape, full[target].dtype)
            np.testing.assert_array_equal(array, full[target], err_msg=target)
        loaded |= set(ranks[0].tensors)
    assert loaded == set(full)


def test_fused_vision_qkv_takes_the_same_heads_from_q_k_and_v(builds):
    plan, states = builds("qwen2_vl", 2, 1)
    full = oracle(HF / "qwen2_vl")["visual.blocks.1.attn.qkv.weight"]   # [3 * 32, 32]
    rank1 = states[1].tensors["visual.blocks.1.attn.qkv.weight"]
    # 4 heads of 8 in each of q, k, v: rank 1 holds heads 2-3 of each block
    np.testing.assert_array_equal(rank1, np.concatenate([full[16:32], full[48:64], full[80:96]]))


# ---------------------------------------------------------------- boundaries per cut


def reference(name):
    return dict(np.load(HF / name / "reference.npz"))


def modules(tmp_path, name, layout, tp=1):
    out = tmp_path / "build"
    result = compile_family(None, HF / name / "config.json",
                            Topology(tensor_parallel_size=tp,
                                     pipeline_parallel_size=layout.count("|") + 1),
                            CompileOptions(stage_units=_named(layout), out=out))
    package = import_build(out, result.plan)
    return result.plan, [package.rank_module(r) for r in range(result.plan.topology.world_size)]


def _named(layout):
    from partc.plan.stage_balance import parse_stage_layout

    return parse_stage_layout(layout)


def test_the_runtime_boundary_functions_take_a_rank_module_and_answer_as_its_own(tmp_path):
    """`partc.runtime.send_boundary(module)` / `receive_boundary(module)`, per-cut (qwen2_vl)
    and one-boundary (llama) builds alike; anything else is a CheckpointError naming it."""
    from partc import runtime
    from partc.errors import CheckpointError

    _, cut = modules(tmp_path / "vl", "qwen2_vl", "vision|vision*2,merger|decoder*2")
    for module in cut:
        for name in ("send_boundary", "receive_boundary"):
            mine, theirs = getattr(runtime, name)(module), getattr(module, name)()
            assert (mine is None) == (theirs is None), (module.RANK, name)
            if mine is not None:
                assert mine.identity == theirs.identity
    _, one = modules(tmp_path / "llama", "llama", "decoder*2|decoder")
    assert runtime.receive_boundary(one[0]) is None and runtime.send_boundary(one[1]) is None
    assert runtime.send_boundary(one[0]).identity == one[0].boundary().identity
    assert runtime.receive_boundary(one[1]).identity == one[1].boundary().identity
    with pytest.raises(CheckpointError, match=r"send_boundary\(\) takes a generated rank "
                                              r"module .* found function"):
        runtime.send_boundary(one[0].boundary)


def test_a_cut_inside_the_vision_tower_carries_patches_and_the_merger_cut_image_tokens(tmp_path):
    ref = reference("qwen2_vl")
    plan, ranks = modules(tmp_path, "qwen2_vl", "vision|vision*2,merger|decoder*2")
    assert [(s, g) for s, g, _ in plan.cuts] == [(0, "vision"), (1, "merger")]
    ids = ref["input_ids"].astype(np.int32)
    grid = ref["image_grid_thw"].astype(np.int32)
    mask = ids == 126
    send = ranks[0].send_boundary()
    assert ranks[0].receive_boundary() is None and ranks[2].send_boundary() is None
    hidden = ref["vision_layer_outputs"][0]
    resolved = send.resolve(1, 16, {"patches": 24, "images": 1})
    assert [t.shape for t in resolved.tensors] == [(24, 32), (1, 3), (1, 16), (1, 16)]
    assert resolved.tensors[3].numpy_dtype == np.bool_
    payload = send.encode(hidden, image_grid_thw=grid, input_ids=ids, image_mask=mask)
    got = ranks[1].receive_boundary().decode_tensors([v.tensor for v in payload])
    np.testing.assert_array_equal(got["hidden"], hidden)
    assert got["image_mask"].dtype == np.bool_ and got["image_mask"].sum() == 6
    # the driver decodes with the cut the stage receives at
    entered = ranks[1].driver().input(boundary=payload)
    assert sorted(entered.boundary) == ["hidden", "image_grid_thw", "image_mask", "input_ids"]
    assert ranks[0].boundary().identity == "qwen2_vl.hidden"     # the family-level one
    features = ranks[1].send_boundary().encode(ref["image_features"], image_grid_thw=grid,
                                               input_ids=ids, image_mask=mask)
    assert tuple(ranks[1].SEND_BOUNDARY["primary"]["shape"]) == ("image_tokens", 64)
    decoded = ranks[2].receive_boundary().decode(features)
    np.testing.assert_array_equal(decoded["image_features"], ref["image_features"])
    assert ranks[2].RECEIVE_BOUNDARY == ranks[1].SEND_BOUNDARY


def test_a_decoder_cut_carries_batch_sequence_hidden_and_the_mrope_positions(tmp_path):
    ref = reference("qwen2_vl")
    plan, ranks = modules(tmp_path, "qwen2_vl", "vision*3,merger|decoder|decoder")
    assert [(s, g) for s, g, _ in plan.cuts] == [(0, "merger"), (1, "decoder")]
    send = ranks[1].send_boundary()
    assert send.identity == "qwen2_vl.hidden" and send.schema.roles == ("hidden", "position_ids")
    hidden = ref["layer_outputs"][0]
    positions = ref["position_ids"].astype(np.int32)
    payload = send.encode(hidden, position_ids=positions)
    assert [v.tensor.shape for v in payload] == [(1, 16, 64), (3, 1, 16)]
    np.testing.assert_array_equal(ranks[2].receive_boundary().decode(payload)["hidden"], hidden)
    # the decoder cut does not demand the vision roles
    with pytest.raises(BoundaryPayloadError, match="has no tensor role `image_grid_thw`"):
        send.encode(hidden, position_ids=positions, image_grid_thw=np.zeros((1, 3), np.int32))


def test_llava_vision_cut_carries_the_cls_and_patch_rows_of_each_image(tmp_path):
    ref = reference("llava")
    plan, ranks = modules(tmp_path, "llava", "vision|vision,projector|decoder*2", tp=2)
    send = ranks[0].send_boundary()     # TP rank 0 of stage 0
    assert send.identity == "llava.vision"
    ids = ref["input_ids"].astype(np.int32)
    payload = send.encode(ref["vision_layer_outputs"][0], input_ids=ids, image_mask=ids == 126)
    assert payload[0].tensor.shape == (1, 5, 32)
    stage1 = ranks[2]
    assert stage1.PIPELINE_STAGE == 1 and stage1.RECEIVE_BOUNDARY == ranks[0].SEND_BOUNDARY
    assert stage1.SEND_BOUNDARY["identity"] == "llava.image_features"


def test_missing_roles_dimensions_and_wrong_dtypes_are_refused(tmp_path):
    ref = reference("qwen2_vl")
    _, ranks = modules(tmp_path, "qwen2_vl", "vision|vision*2,merger|decoder*2")
    send = ranks[0].send_boundary()
    ids = ref["input_ids"].astype(np.int32)
    grid = ref["image_grid_thw"].astype(np.int32)
    hidden = ref["vision_layer_outputs"][0]
    with pytest.raises(BoundaryPayloadError, match="needs tensor `image_mask`"):
        send.encode(hidden, image_grid_thw=grid, input_ids=ids)
    with pytest.raises(BoundaryPayloadError,
                       match=r"tensor `image_mask` of `qwen2_vl.vision` has dtype int32; "
                             r"expected bool \(declared\)"):
        send.encode(hidden, image_grid_thw=grid, input_ids=ids, image_mask=ids)
    with pytest.raises(ArchitectureBoundaryError,
                       match=r"per-request dimensions are patches, images: unknown dimension\(s\)"
                             r" `frames`; no size for `images`"):
        send.resolve(1, 16, {"patches": 24, "frames": 2})
    with pytest.raises(BoundaryPayloadError,
                       match=r"`hidden` .* has shape \[23, 32\]; expected \[24, 32\] \(declared "
                             r"\[patches, 32\]\)"):
        send.encode_values({"hidden": hidden[:23], "image_grid_thw": grid, "input_ids": ids,
                            "image_mask": ids == 126},
                           resolved=send.resolve(1, 16, {"patches": 24, "images": 1}))


def test_a_boundary_dimension_that_is_not_declared_is_an_error_at_its_line(tmp_path):
    text = (ROOT / "architectures" / "qwen2_vl.yaml").read_text()
    bad = tmp_path / "qwen2_vl.yaml"
    bad.write_text(text.replace("shape: [image_tokens, hidden_size]",
                                "shape: [image_tokenz, hidden_size]"))
    errors = check_family(bad)
    assert len(errors) == 1
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if "image_tokenz" in t)
    assert errors[0].location.line == line
    # the caret is at the dimension itself, not at the tensor's mapping
    assert errors[0].location.column == bad.read_text().splitlines()[line - 1].index(
        "image_tokenz") + 1
    assert ("a boundary dimension uses unknown name `image_tokenz`; did you mean "
            "`image_tokens`? Expected `batch`, `sequence`, a per-request dimension declared "
            "under `dimensions` (`patches`, `images`, `image_tokens`)") in errors[0].message


# ---------------------------------------------------------------- static placement


def test_the_text_embedding_sits_with_the_first_decoder_unit_not_on_the_vision_stage(builds):
    plan, states = builds("llava", 1, 3)
    stage_of = {g.name: g.stages for g in plan.groups}
    first_decoder = next(r.pipeline_stage for r in plan.ranks
                         if r.partition.owns_unit("decoder", 0))
    assert first_decoder > 0
    assert stage_of["embedding"] == (first_decoder,)
    assert "language_model.model.embed_tokens.weight" in states[first_decoder].tensors
    assert "language_model.model.embed_tokens.weight" not in states[0].tensors
    roles = [r.partition.ownership.static_roles for r in plan.ranks]
    assert "embedding" in roles[first_decoder] and "embedding" not in roles[0]
    # the unused tower layer and post_layernorm load with the last vision unit
    last_vision = next(r.pipeline_stage for r in plan.ranks if r.partition.owns_unit("vision", 1))
    assert "vision_tower.encoder.layers.2.mlp.fc1.weight" in states[last_vision].tensors
    assert "vision_tower.post_layernorm.weight" in states[last_vision].tensors


def test_a_tied_embedding_loads_on_the_first_decoder_stage_and_the_last(tmp_path):
    config = json.loads((HF / "llava" / "config.json").read_text())
    config["tie_word_embeddings"] = True
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    plan = compile_family(None, path, Topology(pipeline_parallel_size=3),
                          CompileOptions(stage_units=_named("vision*2,projector|decoder|decoder"))).plan
    embedding = next(g for g in plan.groups if g.name == "embedding")
    assert embedding.stages == (1, 2)
    assert [r.partition.ownership.static_roles for r in plan.ranks] == [
        ("vision_embeddings", "vision_unused"), ("embedding",), ("final_norm", "output")]


def test_a_static_role_nothing_is_owned_by_is_never_claimed(tmp_path):
    family = tmp_path / "mini.yaml"
    family.write_text(MINI.replace("static:\n  embedding: {stage: first}",
                                   "static:\n  embedding: {stage: first}\n  output: {stage: last}"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "mini", "hidden_size": 8, "num_layers": 2,
                                  "vocab_size": 16}))
    plan = compile_family(family, config, Topology(pipeline_parallel_size=2)).plan
    assert [r.partition.ownership.static_roles for r in plan.ranks] == [("embedding",), ()]


# ---------------------------------------------------------------- both namings


@pytest.mark.parametrize("name", FAMILIES)
def test_the_other_naming_checks_and_loads_with_the_same_family(builds, tmp_path_factory, name):
    renamer = _renamer()
    folder = renamer.write_renamed(HF / name, tmp_path_factory.mktemp(f"{name}-renamed"), name)
    assert check_family(name, folder / "config.json", folder / "model.safetensors") == []
    plan, states = builds(name, 2, 2, folder=folder)
    _, original = builds(name, 2, 2)
    renamed = oracle(folder)
    rename = renamer.RENAMES[name]
    assert {t.target for t in plan.tensors} == set(renamed)
    for state, before in zip(states, original, strict=True):
        assert set(state.tensors) == {rename(t) for t in before.tensors}
        for target, array in before.tensors.items():
            np.testing.assert_array_equal(state.tensors[rename(target)], array)
    if name == "llava":
        assert any(t.startswith("vision_tower.vision_model.encoder.") for t in states[0].tensors)


# ---------------------------------------------------------------- balancing and modes

LLAVA_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
    "image_token_index": 32000, "projector_hidden_act": "gelu", "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default", "tie_word_embeddings": False, "dtype": "float16",
    "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
                    "vocab_size": 32064, "dtype": "float16"},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                      "intermediate_size": 4096, "num_attention_heads": 16,
                      "num_hidden_layers": 24, "image_size": 336, "patch_size": 14,
                      "projection_dim": 768},
}
"""llava-hf/llava-1.5-7b-hf's published shapes (CLIP ViT-L/14-336 + Vicuna-7B)."""


def llava_7b_inventory() -> dict[str, list[int]]:
    """The released checkpoint's tensor names and shapes, spelled from HF's module names."""
    names: dict[str, list[int]] = {}
    v, t = "vision_tower.vision_model.", "language_model.model."
    names[v + "embeddings.class_embedding"] = [1024]
    names[v + "embeddings.patch_embedding.weight"] = [1024, 3, 14, 14]
    names[v + "embeddings.position_embedding.weight"] = [577, 1024]
    for norm in ("pre_layrnorm", "post_layernorm"):
        names[f"{v}{norm}.weight"] = names[f"{v}{norm}.bias"] = [1024]
    for i in range(24):
        layer = f"{v}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            names[f"{layer}self_attn.{proj}.weight"] = [1024, 1024]
            names[f"{layer}self_attn.{proj}.bias"] = [1024]
        for norm in ("layer_norm1", "layer_norm2"):
            names[f"{layer}{norm}.weight"] = names[f"{layer}{norm}.bias"] = [1024]
        names[f"{layer}mlp.fc1.weight"], names[f"{layer}mlp.fc1.bias"] = [4096, 1024], [4096]
        names[f"{layer}mlp.fc2.weight"], names[f"{layer}mlp.fc2.bias"] = [1024, 4096], [1024]
    names["multi_modal_projector.linear_1.weight"] = [4096, 1024]
    names["multi_modal_projector.linear_2.weight"] = [4096, 4096]
    names["multi_modal_projector.linear_1.bias"] = names["multi_modal_projector.linear_2.bias"] = [
        4096]
    names[t + "embed_tokens.weight"] = [32064, 4096]
    for i in range(32):
        layer = f"{t}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{layer}self_attn.{proj}.weight"] = [4096, 4096]
        names[f"{layer}mlp.gate_proj.weight"] = names[f"{layer}mlp.up_proj.weight"] = [11008, 4096]
        names[f"{layer}mlp.down_proj.weight"] = [4096, 11008]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names[f"{layer}{norm}.weight"] = [4096]
    names[t + "norm.weight"] = [4096]
    names["language_model.lm_head.weight"] = [32064, 4096]
    return names


def sparse_checkpoint(folder: Path, shapes: dict[str, list[int]]) -> Path:
    """A real safetensors file (F16) of these tensors whose data region is never written."""
    header, offset = {}, 0
    for name in sorted(shapes):
        size = 2 * int(np.prod(shapes[name]))
        header[name] = {"dtype": "F16", "shape": shapes[name], "data_offsets": [offset,
                                                                              offset + size]}
        offset += size
    return write_sparse_safetensors(folder / "model.safetensors", header)


@pytest.fixture(scope="module")
def llava_7b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava-7b")
    (folder / "config.json").write_text(json.dumps(LLAVA_7B))
    path = sparse_checkpoint(folder, llava_7b_inventory())
    yield folder
    path.unlink()


def test_llava_7b_byte_balancing_is_more_even_than_unit_balancing(llava_7b):
    config, weights = llava_7b / "config.json", llava_7b / "model.safetensors"
    by_bytes = compile_family(None, config, Topology(pipeline_parallel_size=2),
                              CompileOptions(checkpoint=weights)).plan
    total = sum(g.units for g in by_bytes.graph)
    assert [(g.name, g.units) for g in by_bytes.graph] == [
        ("vision", 23), ("projector", 1), ("decoder", 32)]
    by_units = compile_family(None, config, Topology(pipeline_parallel_size=2),
                              CompileOptions(checkpoint=weights,
                                             stage_units=[total // 2, total - total // 2])).plan
    assert by_bytes.pipeline.balance == "bytes" and by_units.pipeline.balance == "explicit"
    payload = sum(2 * int(np.prod(s)) for s in llava_7b_inventory().values())
    for plan in (by_bytes, by_units):
        assert sum(plan.pipeline.stage_bytes) == payload     # TP 1: every byte on one stage
    assert by_bytes.pipeline.imbalance < by_units.pipeline.imbalance
    assert by_bytes.pipeline.imbalance < 1.05
    assert by_bytes.pipeline.layout.startswith("[vision_embeddings],vision*23,[vision_unused],"
                                               "projector,[embedding],decoder*")


def test_a_named_pp_layers_error_is_broken_down_per_group(capsys):
    folder = HF / "llava"
    code = main(["check", "llava", "--config", str(folder / "config.json"), "--pp-layers",
                 "vision*2,projector|decoder*3"])
    assert code == 1
    assert ("the stage layout gives `decoder` 3 (stage 1: 3) but it has 2 unit(s); every unit "
            "of every group must be placed once") in capsys.readouterr().err
    code = main(["check", "llava", "--config", str(folder / "config.json"), "--pp-layers", "4,2"])
    assert code == 1
    assert ("explicit stage sizes [4, 2] sum to 6, but the model has 5 execution units (vision "
            "2, projector 1, decoder 2)") in capsys.readouterr().err


def test_the_printed_layout_is_accepted_back_by_pp_layers(tmp_path, capsys):
    folder = HF / "qwen2_vl"
    plan = compile_family(None, folder / "config.json", Topology(pipeline_parallel_size=3)).plan
    again = compile_family(None, folder / "config.json", Topology(pipeline_parallel_size=3),
                           CompileOptions(stage_units=_named(plan.pipeline.layout))).plan
    assert [r.partition.canonical_range for r in again.ranks] == [
        r.partition.canonical_range for r in plan.ranks]
    assert main(["check", "qwen2_vl", "--config", str(folder / "config.json"), "--pp", "3"]) == 0
    assert f"pipeline layout (balanced by bytes): {plan.pipeline.layout}" in capsys.readouterr().out


def test_group_mode_replicated_keeps_the_vision_tower_whole_on_every_tp_rank(builds):
    from partc.partition.ownership import GroupParallelMode

    plan, states = builds("qwen2_vl", 2, 1, group_modes=[("vision",
                                                          GroupParallelMode.REPLICATED)])
    full = oracle(HF / "qwen2_vl")
    for state in states:
        qkv = state.tensors["visual.blocks.0.attn.qkv.weight"]
        np.testing.assert_array_equal(qkv, full["visual.blocks.0.attn.qkv.weight"])
        np.testing.assert_array_equal(state.tensors["visual.patch_embed.proj.weight"],
                                      full["visual.patch_embed.proj.weight"])
    assert states[0].tensors["model.layers.0.mlp.up_proj.weight"].shape == (64, 64)  # split
    assert states[0].tensors["visual.merger.mlp.0.weight"].shape == (64, 128)         # split
    assert dict(plan.pipeline.group_modes)["vision"] is GroupParallelMode.REPLICATED


def test_a_group_kept_on_one_stage_is_never_cut(tmp_path):
    text = (ROOT / "architectures" / "qwen2_vl.yaml").read_text()
    family = tmp_path / "qwen2_vl.yaml"
    family.write_text(text.replace("    path: \"{vision_root}.blocks.{unit}\"\n",
                                   "    path: \"{vision_root}.blocks.{unit}\"\n"
                                   "    parallel: one_stage\n"))
    config = HF / "qwen2_vl" / "config.json"
    plan = compile_family(family, config,
                          Topology(tensor_parallel_size=2, pipeline_parallel_size=3)).plan
    holders = {r.pipeline_stage for r in plan.ranks if "vision" in r.partition.unit_ranges}
    assert len(holders) == 1
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=2, pipeline_parallel_size=3)) == []
    errors = check_family(family, config, topology=Topology(
        tensor_parallel_size=1, pipeline_parallel_size=2, stage_layout=_named(
            "vision*2|vision,merger,decoder*2")))
    assert [e.message for e in errors] == [
        "execution group `vision` is kept on one stage (`one_stage`), but the stage sizes cut "
        "it after canonical unit 1 (its units are [0, 3))"]


# ---------------------------------------------------------------- the stage choice itself


def _brute_force(costs, stages, keep_whole=()):
    """The least largest-stage cost over every contiguous split (the oracle for the DP)."""
    from itertools import combinations

    cuts_allowed = [c for c in range(1, len(costs))
                    if all(not a < c < b for a, b in keep_whole)]
    best = None
    for cuts in combinations(cuts_allowed, stages - 1):
        bounds = [0, *cuts, len(costs)]
        value = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_byte_balancing_finds_the_least_largest_stage(seed):
    from partc.plan.pipeline_cut import cost_balanced_stage_ranges

    rng = np.random.default_rng(seed)
    costs = [int(c) for c in rng.integers(1, 1000, size=int(rng.integers(4, 11)))]
    keep = ((1, 3),) if seed % 2 else ()
    for stages in range(1, 5):
        if stages > len(costs) - (1 if keep else 0):
            continue
        ranges = cost_balanced_stage_ranges(costs, stages, keep)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
        assert all(a < b for a, b in ranges)
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:], strict=False))
        assert not any(1 < b < 3 for _, b in ranges[:-1]) or not keep
        assert max(sum(costs[a:b]) for a, b in ranges) == _brute_force(costs, stages, keep)


def test_declared_group_weights_balance_instead_of_bytes(tmp_path):
    text = (ROOT / "architectures" / "qwen2_vl.yaml").read_text()
    family = tmp_path / "qwen2_vl.yaml"
    family.write_text(text.replace("    path: \"{vision_root}.blocks.{unit}\"\n",
                                   "    path: \"{vision_root}.blocks.{unit}\"\n    weight: 5\n"))
    plan = compile_family(family, HF / "qwen2_vl" / "config.json",
                          Topology(pipeline_parallel_size=2)).plan
    # units weigh vision 5, 5, 5 | merger 1 | decoder 1, 1: the best split is 5+5 | 5+1+1+1
    assert plan.pipeline.balance == "weight"
    assert [r.partition.canonical_range for r in plan.ranks] == [(0, 2), (2, 6)]
    assert plan.pipeline.layout == (
        "[patch_embed],vision*2|vision,merger,[embedding],decoder*2,[final_norm],[output]")


def test_a_single_group_family_keeps_unit_balancing_and_no_pipeline_record():
    plan = compile_family(None, HF / "llama" / "config.json",
                          Topology(pipeline_parallel_size=2)).plan
    assert plan.pipeline is None and plan.cuts == ()
    assert "pipeline" not in plan.document[0] and "cuts" not in plan.document[0]
    assert [r.partition.canonical_range for r in plan.ranks] == [(0, 2), (2, 3)]


def test_inspect_shows_the_pipeline_layout_and_group_modes_the_compile_chose(tmp_path, capsys):
    folder = HF / "llava"
    out = tmp_path / "b"
    assert main(["compile", "--config", str(folder / "config.json"), "--tp", "2", "--pp", "3",
                 "--out", str(out), "--format", "json"]) == 0
    compiled = json.loads(capsys.readouterr().out)["pipeline"]
    assert main(["inspect", str(out), "--format", "json"]) == 0
    inspected = json.loads(capsys.readouterr().out)["pipeline"]
    assert inspected == compiled == json.loads((out / "plan.json").read_text())["pipeline"]
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"pipeline layout (balanced by bytes): {compiled['layout']}" in text
    assert compiled["group_modes"] == {"vision": "split", "projector": "split",
                                       "decoder": "split"}
    # in the graph's order, as the layout reads (plan.json keeps them sorted by name)
    assert "group modes: vision split, projector split, decoder split" in text
