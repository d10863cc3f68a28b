"""The walking skeleton end to end on the real tiny Llamas: compile, load, reassemble."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from partc import LayoutError, LoadError, ParallelPlanError
from partc.api import CompileOptions, compile_family, plan_family
from partc.errors import ArchitecturePartitionError
from partc.front.schema import load_schema
from partc.parallel.placements import PlacementKind
from partc.parallel.specs import ShardingPolicy, balanced_contiguous_range
from partc.plan.ir import canonical_json
from partc.plan.topology import Topology

from support import (
    HF,
    QUANTIZED,
    ROOT,
    checkpoint_tensors,
    compile_and_import,
    edited_family,
    hf,
    reassemble,
)

TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 3)]
CASES = [("llama", t) for t in TOPOLOGIES] + [("llama_tied", t) for t in TOPOLOGIES + [(1, 4)]]


@pytest.mark.parametrize(("name", "topology"), CASES)
def test_tp_slices_of_every_stage_reassemble_every_checkpoint_tensor_exactly(builds, name,
                                                                              topology):
    tp, pp = topology
    plan, states = builds(name, tp, pp)
    full = checkpoint_tensors(hf(name))
    seen = set()
    for stage in range(pp):
        ranks = states[stage * tp:(stage + 1) * tp]
        targets = set(ranks[0].layout.targets)
        assert all(set(r.layout.targets) == targets for r in ranks)
        for target in targets:
            pieces = []
            for state in ranks:
                axis, ranges = state.layout[target].selection
                local = state.tensors[target]
                assert local.shape == state.layout[target].local_shape
                pieces.append((local, axis, ranges))
            whole, count = reassemble(pieces, full[target].shape, full[target].dtype)
            np.testing.assert_array_equal(whole, full[target])
            replicated = state.layout[target].placement.kind in (PlacementKind.REPLICATED,
                                                                 PlacementKind.LOCAL)
            assert (count == (tp if replicated else 1)).all(), target
            seen.add(target)
    assert seen == set(full), "every checkpoint tensor is loaded by at least one stage"


@pytest.mark.parametrize(("name", "topology"), CASES)
def test_each_stage_holds_exactly_its_layers_and_static_roles(builds, name, topology):
    tp, pp = topology
    plan, states = builds(name, tp, pp)
    layers = json.loads((hf(name) / "config.json").read_text())["num_hidden_layers"]
    tied = name == "llama_tied"
    for rank, state in enumerate(states):
        stage = rank // tp
        first, last = balanced_contiguous_range(layers, pp, stage)
        held = {int(t.split(".")[2]) for t in state.layout.targets if t.startswith("model.layers.")}
        assert held == set(range(first, last))
        targets = set(state.layout.targets)
        assert ("model.embed_tokens.weight" in targets) == (stage == 0 or (tied and
                                                                             stage == pp - 1))
        assert ("model.norm.weight" in targets) == (stage == pp - 1)
        assert ("lm_head.weight" in targets) == (stage == pp - 1 and not tied)
        partition = plan.ranks[rank].partition
        assert partition.groups[0].unit_range == (first, last)
        assert partition.state.global_range == (first, last)
        assert partition.ownership.owns_input == (stage == 0)
        assert partition.ownership.owns_output == (stage == pp - 1)


def test_vocabulary_splits_unevenly_over_two_ranks(builds):
    plan, states = builds("llama", 2, 1)
    shapes = [s.tensors["model.embed_tokens.weight"].shape for s in states]
    assert shapes == [(66, 64), (65, 64)]
    assert states[1].layout["lm_head.weight"].selection == (0, ((66, 131),))


def test_attention_query_heads_travel_with_their_kv_head(builds):
    plan, states = builds("llama", 2, 1)
    # 4 query heads, 2 KV heads, head_dim 16: rank 1 holds KV head 1 and query heads 2 and 3
    layout = states[1].layout
    assert layout["model.layers.0.self_attn.q_proj.weight"].selection == (0, ((32, 64),))
    assert layout["model.layers.0.self_attn.k_proj.weight"].selection == (0, ((16, 32),))
    assert layout["model.layers.0.self_attn.o_proj.weight"].selection == (1, ((32, 64),))
    assert layout["model.layers.0.self_attn.q_proj.weight"].logical_range == (1, 2)
    assert layout["model.layers.0.mlp.down_proj.weight"].selection == (1, ((64, 128),))


def test_sharded_checkpoint_loads_identically_to_the_single_file(tmp_path):
    plan, package = compile_and_import("llama", hf("llama") / "config.json", tmp_path / "b",
                                       tp=2, pp=2)
    for rank in range(4):
        single = package.load(hf("llama"), rank=rank)
        sharded = package.load(hf("llama") / "sharded", rank=rank)
        assert list(single.tensors) == list(sharded.tensors)
        for target, array in single.tensors.items():
            np.testing.assert_array_equal(sharded.tensors[target], array)
        assert single.layout == sharded.layout


def test_more_pipeline_stages_than_layers_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ArchitecturePartitionError) as caught:
        compile_family("llama", hf("llama") / "config.json", Topology(pipeline_parallel_size=4),
                       CompileOptions(out=tmp_path / "build"))
    assert "pipeline_parallel_size 4 exceeds the 3 execution units" in str(caught.value)
    assert "--pp 3 or fewer" in str(caught.value)
    assert not (tmp_path / "build").exists()


def test_three_ranks_over_two_kv_heads_fail_under_require_naming_group_units_and_fix(tmp_path):
    with pytest.raises(ParallelPlanError) as caught:  # KV replication needs 3 | 4 q heads
        compile_family("llama", hf("llama") / "config.json", Topology(tensor_parallel_size=3))
    message = str(caught.value)
    assert "group `layers.0.attention`" in message
    assert "2 partition units (num_key_value_heads), fewer than 3 ranks" in message
    assert "4 query heads, not divisible by tensor_parallel_size 3" in message
    assert "--policy replicate-unsupported" in message
    assert caught.value.location is not None
    assert caught.value.location.file == "architectures/llama.yaml"
    assert caught.value.location.line > 0
    assert isinstance(caught.value, LayoutError)


@pytest.mark.parametrize("spelled", ["replicate-unsupported", "replicate_unsupported"])
def test_the_policy_may_be_given_by_name_as_the_command_line_spells_it(tmp_path, spelled):
    import partc

    by_name = compile_family("llama", hf("llama") / "config.json", Topology(tensor_parallel_size=4),
                             CompileOptions(policy=spelled)).plan
    by_enum = compile_family("llama", hf("llama") / "config.json", Topology(tensor_parallel_size=4),
                             CompileOptions(policy=partc.ShardingPolicy.REPLICATE_UNSUPPORTED)).plan
    assert by_name.document[1] == by_enum.document[1]
    with pytest.raises(LoadError, match=r"policy must be one of require, replicate-unsupported "
                                        r"\(or a partc.ShardingPolicy\), found 'replicate'"):
        compile_family("llama", hf("llama") / "config.json", Topology(tensor_parallel_size=4),
                       CompileOptions(policy="replicate"))


def test_replicate_unsupported_replicates_attention_and_records_the_fallback(tmp_path):
    # the built-in Llama with its KV replication turned off: 2 KV heads cannot cover 4 ranks
    family = edited_family(tmp_path, "llama", "kv_replication: true", "kv_replication: false")
    plan, package = compile_and_import(family, hf("llama") / "config.json", tmp_path / "b",
                                       tp=4, policy=ShardingPolicy.REPLICATE_UNSUPPORTED)
    full = checkpoint_tensors(hf("llama"))
    for rank in range(4):
        state = package.load(hf("llama"), rank=rank)
        q = state.layout["model.layers.1.self_attn.q_proj.weight"]
        assert q.fell_back_to_replication
        assert q.placement.kind is PlacementKind.REPLICATED
        np.testing.assert_array_equal(state.tensors[q.target], full[q.target])
        mlp = state.layout["model.layers.1.mlp.up_proj.weight"]
        assert not mlp.fell_back_to_replication
        assert mlp.local_shape == (32, 64)


def test_plan_json_validates_against_the_plan_schema(builds, tmp_path):
    result = compile_family("llama", hf("llama_tied") / "config.json",
                            Topology(tensor_parallel_size=2, pipeline_parallel_size=2))
    document = json.loads(result.files["plan.json"])
    jsonschema.Draft202012Validator(load_schema("plan.schema.json")).validate(document)
    assert document["plan_hash"] == result.plan.to_json()["plan_hash"]
    embed = next(t for t in document["tensors"] if t["target"] == "model.embed_tokens.weight")
    assert embed["stages"] == [0, 1]
    assert embed["placements"] == [["range", 0, 0, 66], ["range", 0, 66, 131]]
    group = next(g for g in document["groups"] if g["name"] == embed["group"])
    assert group["owner"] == {"kind": "static_any_of", "roles": ["embedding", "output"]}
    attention = next(g for g in document["groups"] if g["name"] == "layers.2.attention")
    assert attention["logical_ranges"] == [[0, 1], [1, 2]] and attention["stages"] == [1]


def test_parallel_model_info_accounts_every_byte(builds):
    plan, states = builds("llama", 2, 3)
    payload = sum(a.nbytes for a in checkpoint_tensors(hf("llama")).values())
    for state in states:
        assert state.info.global_parameter_bytes == payload
        assert state.info.local_parameter_bytes == sum(a.nbytes for a in state.tensors.values())
    assert states[0].info.maximum_device_parameter_bytes == max(
        s.info.local_parameter_bytes for s in states)


def test_kv_replicas_survive_the_plan_and_the_generated_loader(tmp_path):
    family = ROOT / "tests" / "cases" / "llama" / "family.yaml"
    plan, package = compile_and_import(family, hf("llama") / "config.json", tmp_path / "b", tp=4)
    for rank in range(4):
        state = package.load(hf("llama"), rank=rank)
        k = state.layout["model.layers.0.self_attn.k_proj.weight"]
        q = state.layout["model.layers.0.self_attn.q_proj.weight"]
        assert k.kv_replicas == 2 and q.kv_replicas == 1
        assert k.selection == (0, ((16 * (rank // 2), 16 * (rank // 2 + 1)),))
        assert q.selection == (0, ((16 * rank, 16 * (rank + 1)),))
        assert state.info.local_bytes_by_dtype == (("F32", state.info.local_parameter_bytes),)
        assert plan.ranks[rank].layout[k.target] == k


@pytest.mark.parametrize("folder,family,tp,pp", [
    (HF / "llama_tied", "llama", 2, 2), (HF / "qwen3_moe", "qwen3_moe", 2, 2),
    (QUANTIZED / "deepseek_v3_fp8", "deepseek_v3", 2, 3),
    (HF / "stablelm_qk", "stablelm", 4, 1)],  # per-head norms: `omit` on other heads' ranks
    ids=["llama_tied", "qwen3_moe", "deepseek_v3_fp8", "stablelm_qk"])
def test_the_plan_text_is_the_canonical_json_and_modules_rebuild_the_plan(
        tmp_path, folder, family, tp, pp):
    """plan.json is spelled without building the tensor table (`Plan.document`), and rank
    modules are columnar tables: both must say exactly what the plan objects say."""
    plan, package = compile_and_import(family, folder / "config.json", tmp_path / "b", tp=tp,
                                       pp=pp)
    body, text = plan.document
    assert text == canonical_json(plan.to_json())
    assert body["plan_hash"] == json.loads(text)["plan_hash"]
    assert text == (tmp_path / "b" / "plan.json").read_text()
    assert len(plan.kinds) < len(plan.groups)  # groups of one structure share a kind
    for rank in plan.ranks:
        module = package.rank_module(rank.rank)
        assert module.layout() == rank.layout
        assert module.info() == rank.info
        assert module.partition() == rank.partition


def test_a_build_does_not_depend_on_what_the_process_compiled_before():
    """Group kinds are shared within one plan only: the same compile gives the same files
    before and after other compiles in the same process."""
    config = QUANTIZED / "deepseek_v3_fp8" / "config.json"
    first = compile_family("deepseek_v3", config, Topology(tensor_parallel_size=2)).files
    for name in ("qwen3_moe", "mixtral", "llama"):
        compile_family(None, HF / name / "config.json", Topology(tensor_parallel_size=2))
    assert compile_family("deepseek_v3", config, Topology(tensor_parallel_size=2)).files == first


def test_an_unshardable_group_is_reported_at_its_declaration_as_created():
    text = (ROOT / "architectures" / "llama.yaml").read_text().splitlines()
    line = next(i for i, s in enumerate(text, 1)
                if s.strip() == '- name: "layers.{unit}.attention"')
    with pytest.raises(ParallelPlanError) as caught:
        plan_family(None, hf("llama") / "config.json",
                    Topology(tensor_parallel_size=3, pipeline_parallel_size=1))
    error = caught.value
    assert (error.location.file, error.location.line, error.location.column) == (
        "architectures/llama.yaml", line, 5)
    assert error.pointer == "/parameters/2"
    assert error.message.startswith("group `layers.0.attention` cannot be sharded over "
                                    "tensor_parallel_size 3: it has 2 partition units "
                                    "(num_key_value_heads), fewer than 3 ranks, so KV "
                                    "replication applies")
    assert str(error).startswith(f"architectures/llama.yaml:{line}:5: group `layers.0.attention`")
