"""Expert parallelism in the plan, the generated modules, the CLI and the runtime topology.

The rank layout (build rank = stage * N + r; tp = r mod T, dense replica = r div T, ep = r div
X, etp = r mod X), the plan's record of it, the located errors of bad topologies and placement
files, and full-size DeepSeek-V3 (FP8 + MTP, header only) at EP=64 x PP=2 and EP=8 x T=8.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from partc.api import CompileOptions, bind, check_family, checkpoint_errors, compile_family
from partc.cli.main import main
from partc.errors import CheckpointError, LaunchError, LayoutError, SchemaError, SemanticError
from partc.parallel.shape import RankCoordinates
from partc.plan.ranks import KindIndex
from partc.plan.realize import realize_plan
from partc.plan.topology import Topology
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime.mesh import BuildTopology

from support import FULLSIZE, compile_and_import, fullsize_checkpoint, hf

ROOT = Path(__file__).resolve().parent.parent
QWEN = hf("qwen3_moe") / "config.json"
MIXTRAL = hf("mixtral") / "config.json"
GPT_OSS = hf("gpt_oss") / "config.json"


def schema() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        json.loads((ROOT / "schemas" / "plan.schema.json").read_text()))


# ---------------------------------------------------------------- the plan


def test_the_plan_records_the_layout_the_placement_and_each_ranks_coordinates() -> None:
    plan = compile_family(None, QWEN,
                          Topology(tensor_parallel_size=2, pipeline_parallel_size=2,
                                   expert_parallel_size=2, expert_tensor_parallel_size=2)).plan
    body = plan.to_json()
    schema().validate(body)
    assert body["topology"]["expert_parallel_size"] == 2
    assert body["topology"]["expert_tensor_parallel_size"] == 2
    experts = body["expert_parallel"]
    assert experts["ranks_per_stage"] == 4 and experts["dense_replicas"] == 2
    assert experts["slots"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert experts["layout"].startswith("build rank = stage * N + r")
    assert experts["per_expert_groups"] == 16 and experts["stacked_groups"] == 0
    assert len(body["ranks"]) == 8
    for rank in body["ranks"]:
        r = rank["rank"] % 4
        info = rank["info"]
        assert rank["pipeline_stage"] == rank["rank"] // 4
        assert (rank["tensor_parallel_rank"], info["dense_replica"]) == (r % 2, r // 2)
        assert (info["expert_parallel_rank"], info["expert_tensor_parallel_rank"]) == (
            r // 2, r % 2)
        assert info["local_experts"] == 4
    # a per-expert tensor lists one placement per ETP rank: half the intermediate rows each
    tensor = next(t for t in body["tensors"]
                  if t["target"] == "model.layers.0.mlp.experts.5.gate_proj.weight")
    assert tensor["placements"] == [["range", 0, 0, 16], ["range", 0, 16, 32]]
    rank5 = plan.ranks[5]  # stage 1, r = 1: EP rank 0 (experts 0-3), ETP rank 1
    names = {t.target for t in rank5.layout.tensors}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names
    assert not any(".experts.4." in n for n in names) and not any(".layers.0." in n
                                                                  for n in names)
    assert rank5.layout["model.layers.1.mlp.experts.3.up_proj.weight"].selection == (
        0, ((16, 32),))


def test_without_ep_a_plan_has_no_expert_keys_and_experts_split_over_the_tp_ranks() -> None:
    plan = compile_family(None, QWEN, Topology(tensor_parallel_size=2)).plan
    body = plan.to_json()
    assert "expert_parallel" not in body
    assert set(body["topology"]) == {"tensor_parallel_size", "pipeline_parallel_size",
                                     "stage_units", "policy", "activation_dtype"}
    assert all(set(r["info"]) == {"owned_tensors", "local_parameter_bytes",
                                  "global_parameter_bytes", "pinned_parameter_bytes",
                                  "maximum_device_parameter_bytes", "local_bytes_by_dtype"}
               for r in body["ranks"])
    assert {k.index for k in plan.kinds} == {KindIndex.TENSOR}


def test_stacked_experts_are_read_as_the_rows_of_each_ranks_experts(tmp_path: Path) -> None:
    placement_dir = tmp_path
    (placement_dir / "p.json").write_text(json.dumps({"ranks": [[0, 3], [1, 2, 3]]}))
    plan = compile_family(None, GPT_OSS, Topology(expert_parallel_size=2),
                          CompileOptions(expert_placement=placement_dir / "p.json")).plan
    schema().validate(plan.to_json())
    first, second = (r.layout for r in plan.ranks)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert first[name].selection == (0, ((0, 1), (3, 4)))
    assert first[name].local_shape[0] == 2
    assert second[name].selection == (0, ((1, 4),))
    bias = "model.layers.0.mlp.experts.down_proj_bias"  # replicated under TP, rows under EP
    assert second[bias].selection == (0, ((1, 4),))
    assert plan.expert_parallel is not None and plan.expert_parallel.placement.redundant == 1
    # the router stays replicated
    assert first["model.layers.0.mlp.router.weight"].is_whole


def test_ep8_with_t8_and_ep64_with_t1_keep_the_dense_split_and_count_the_replicas() -> None:
    bound, _, _ = bind(None, QWEN, None)
    plan = realize_plan(bound, Topology(tensor_parallel_size=2, pipeline_parallel_size=1,
                                        expert_parallel_size=8))
    assert plan.topology.world_size == 8
    assert plan.expert_parallel is not None and plan.expert_parallel.ranks_per_stage == 8
    attention = "model.layers.0.self_attn.q_proj.weight"
    assert [r.layout[attention].selection for r in plan.ranks[:4]] == [
        (0, ((0, 32),)), (0, ((32, 64),))] * 2
    assert [r.info.local_experts for r in plan.ranks] == [1] * 8


# ---------------------------------------------------------------- generated modules


def test_generated_modules_expose_the_expert_map_and_the_package_its_sizes(tmp_path: Path
                                                                           ) -> None:
    (tmp_path / "p.json").write_text(json.dumps({"ranks": [[0, 1], [1, 2], [3]]}))
    plan, package = compile_and_import(None, MIXTRAL, tmp_path / "b", tp=1,
                                       expert_parallel_size=3,
                                       expert_placement=tmp_path / "p.json")
    try:
        assert package.WORLD_SIZE == 3 and package.EXPERT_PARALLEL_SIZE == 3
        assert package.__name__.endswith("_ep3")
        maps = [package.rank_module(r).expert_map() for r in range(3)]
        assert maps[1].local_experts == (1, 2)
        assert maps[0].owners[1] == ((0, 1), (1, 0))  # expert 1: EP rank 0 slot 1, rank 1 slot 0
        assert maps[2].local_slot(3) == 0 and maps[2].local_slot(0) is None
        info = package.rank_module(0).info()
        assert info.local_experts == 2 and info.expert_parameter_bytes > 0
        assert info.expert_parameter_bytes == sum(
            t.local_bytes for t in package.rank_module(0).layout().tensors
            if ".experts." in t.target)
    finally:
        for name in [m for m in sys.modules if m.startswith(package.__name__)]:
            del sys.modules[name]


def test_a_module_without_expert_parallelism_refuses_an_expert_map(tmp_path: Path) -> None:
    from partc.runtime.tables import expert_map

    plan, package = compile_and_import(None, QWEN, tmp_path / "b", tp=1)
    try:
        assert not hasattr(package.rank_module(0), "expert_map")
        with pytest.raises(CheckpointError, match="not from an expert-parallel build"):
            expert_map(package.rank_module(0)._TABLE)
    finally:
        for name in [m for m in sys.modules if m.startswith(package.__name__)]:
            del sys.modules[name]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(("options", "message"), [
    ({"tensor_parallel_size": 4, "expert_parallel_size": 2},
     r"N = expert_parallel_size 2 x expert_tensor_parallel_size 1 = 2 ranks, not a multiple "
     r"of tensor_parallel_size 4"),
    ({"expert_parallel_size": 9},
     r"expert_parallel_size 9 exceeds the model's 8 experts"),
    ({"expert_tensor_parallel_size": 2}, r"expert_tensor_parallel_size 2 \(--etp\) needs expert "
                                         r"parallelism: give expert_parallel_size \(--ep\)"),
])
def test_bad_expert_topologies_are_refused_with_the_rule_and_the_values(
        options: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        compile_family(None, QWEN, Topology(**options))


def test_ep_on_a_family_without_experts_and_etp_on_stacked_experts_are_refused() -> None:
    with pytest.raises(LayoutError, match="declares no routed experts"):
        compile_family(None, hf("llama") / "config.json", Topology(expert_parallel_size=2))
    with pytest.raises(LayoutError, match=r"stacked expert group `layers.0.experts` cannot be "
                                          r"split over expert_tensor_parallel_size 2") as caught:
        compile_family(None, GPT_OSS,
                       Topology(expert_parallel_size=2, expert_tensor_parallel_size=2))
    assert caught.value.location is not None
    assert caught.value.location.file.endswith("gpt_oss.yaml")


@pytest.mark.parametrize(("document", "pointer", "message"), [
    ({"ranks": [[0, 1, 2], [4, 5, 6, 7]]}, "/ranks", r"1 expert \(3\) is on no EP rank"),
    ({"ranks": [[0, 1, 2, 3], [4, 5, 6, 8]]}, "/ranks/1/3",
     r"EP rank 1 slot 3 names expert 8; expert ids are integers 0..7"),
    ({"ranks": [[0, 1, 3, 2], [4, 5, 6, 7]]}, "/ranks/0/3",
     r"EP rank 0 lists expert 2 after 3; a rank's experts are distinct and ascending"),
    ({"ranks": [[0, 1, 2, 3, 4, 5, 6, 7], []]}, "/ranks/1", r"EP rank 1 holds no expert"),
    ({"ranks": [[0, 1, 2, 3, 4, 5, 6, 7]]}, "/ranks",
     r"it lists 1 EP rank but expert_parallel_size is 2"),
    ({"experts": {"0": 0}}, "", r"expected an object with one key `ranks`"),
    ({"ranks": [[0, 1, 2, 3], [4, 5, 6, True]]}, "/ranks/1/3", r"names expert true"),
])
def test_a_bad_placement_file_is_a_located_error_naming_the_rank_and_the_expert(
        tmp_path: Path, document: dict[str, Any], pointer: str, message: str) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(document, indent=1))
    with pytest.raises(LayoutError, match=message) as caught:
        compile_family(None, QWEN, Topology(expert_parallel_size=2),
                       CompileOptions(expert_placement=path, out=tmp_path / "build"))
    error = caught.value
    assert str(path) in error.message and error.pointer == pointer
    assert error.location is not None and error.location.file == str(path)
    assert error.location.line > 0
    assert not (tmp_path / "build").exists()  # nothing half-written


def test_the_guides_example_placement_compiles_with_redundant_copies(tmp_path: Path) -> None:
    guide = (ROOT / "docs" / "expert_parallel.md").read_text()
    section = guide.split("## Placement", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```json\n(.*?)```", section, flags=re.S)
    path = tmp_path / "placement.json"
    path.write_text(example)
    compile_family(None, QWEN, Topology(expert_parallel_size=3),
                   CompileOptions(expert_placement=path, out=tmp_path / "build"))
    recorded = json.loads((tmp_path / "build" / "plan.json").read_text())["expert_parallel"]
    document = json.loads(example)
    assert recorded["slots"] == document["ranks"] and recorded["explicit_placement"]
    assert recorded["redundant_slots"] == 2
    # "expert 0 above has three slots": one on every EP rank
    assert sum(ids.count(0) for ids in document["ranks"]) == 3


def test_a_placement_error_points_to_the_expert_parallel_guide(tmp_path: Path,
                                                               capsys: Any) -> None:
    path = tmp_path / "placement.json"
    path.write_text('{"ranks": [[0, 1, 2], [3, 4, 5, 0], [6, 7, 0]]}')
    code = main(["check", "--config", str(QWEN), "--ep", "3", "--expert-placement", str(path),
                 "--format", "json"])
    error, second = json.loads(capsys.readouterr().out)["errors"]
    assert code != 0 and "lists expert 0 after 5" in error["message"]
    assert "lists expert 0 after 7" in second["message"]
    assert error["doc"] == "expert_parallel#placement"
    heading = (ROOT / "docs" / "expert_parallel.md").read_text().splitlines().index(
        "## Placement") + 1
    assert error["see"].endswith(f"expert_parallel.md:{heading}"), error["see"]


def test_check_reports_a_placement_error_once_with_its_position(tmp_path: Path,
                                                                  capsys: Any) -> None:
    path = tmp_path / "placement.json"
    path.write_text('{"ranks": [[0, 1], [1, 2, 9]]}')
    code = main(["check", "--config", str(MIXTRAL), "--ep", "2", "--expert-placement",
                 str(path), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert code != 0 and not report["ok"]
    (error,) = report["errors"]
    assert (error["file"], error["line"], error["column"], error["pointer"]) == (
        str(path), 1, 27, "/ranks/1/2")  # the 9
    assert "EP rank 1 slot 2 names expert 9" in error["message"]


def test_a_family_declaring_both_expert_forms_is_a_semantic_error(tmp_path: Path) -> None:
    text = (ROOT / "architectures" / "qwen3_moe.yaml").read_text()
    text = text.replace("    for: {expert: num_experts}\n",
                        "    for: {expert: num_experts}\n    experts: {axis: 0}\n")
    family = tmp_path / "both.yaml"
    family.write_text(text)
    errors = check_family(family)
    assert [type(e) for e in errors] == [SemanticError]
    assert "`experts: {axis: ...}`" in errors[0].message and "use one" in errors[0].message
    assert errors[0].location is not None and errors[0].location.line > 0
    family.write_text(text.replace("experts: {axis: 0}", "experts: {axis: -1}"))
    errors = check_family(family)
    assert errors and isinstance(errors[0], SchemaError)


# ---------------------------------------------------------------- the CLI


def test_compile_summaries_show_the_experts_of_every_rank(tmp_path: Path, capsys: Any) -> None:
    code = main(["compile", "--config", str(QWEN), "--ep", "4", "--tp", "2", "--out",
                 str(tmp_path / "b"), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    experts = report["expert_parallel"]
    assert [r["experts"] for r in experts["ranks"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r["dense_replica"] for r in experts["ranks"]] == [0, 0, 1, 1]
    assert all(r["expert_bytes"] > 0 for r in experts["ranks"])
    code = main(["compile", "--config", str(QWEN), "--ep", "4", "--tp", "2", "--out",
                 str(tmp_path / "b"), "--force"])
    text = capsys.readouterr().out
    assert code == 0 and "for TP=2 x PP=1 x EP=4 (ETP=1)" in text
    assert "EP rank   2:   2 experts 4-5 on rank 2," in text


# ---------------------------------------------------------------- the runtime topology


def test_build_topology_of_an_expert_parallel_build_gives_the_ep_etp_and_tp_groups() -> None:
    topology = BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=2,
                             data_parallel_size=2, expert_parallel_size=2,
                             expert_tensor_parallel_size=2)
    assert (topology.ranks_per_stage, topology.build_world_size, topology.world_size) == (
        4, 8, 16)
    assert topology.coordinates(14) == RankCoordinates(
        data_parallel_rank=1, pipeline_stage=1, stage_rank=2, tensor_parallel_rank=0,
        dense_replica=1,
        expert_parallel_rank=1, expert_tensor_parallel_rank=0)
    for g in range(16):
        assert topology.global_rank(topology.coordinates(g)) == g
    assert topology.tensor_parallel_group(14) == (14, 15)
    assert topology.expert_parallel_group(14) == (12, 14)
    assert topology.expert_tensor_parallel_group(13) == (12, 13)
    assert topology.pipeline_group(14) == (10, 14)
    assert (topology.previous_stage_peer(14), topology.next_stage_peer(10)) == (10, 14)
    groups = topology.all_groups()
    assert set(groups) == {"tp", "pp", "dp", "ep", "etp"}
    for dimension, size in (("tp", 2), ("pp", 2), ("dp", 2), ("ep", 2), ("etp", 2)):
        assert sorted(r for group in groups[dimension] for r in group) == list(range(16))
        assert {len(g) for g in groups[dimension]} == {size}
    with pytest.raises(LaunchError, match="not a multiple of tensor_parallel_size 4"):
        BuildTopology(tensor_parallel_size=4, pipeline_parallel_size=1, expert_parallel_size=2)
    with pytest.raises(LaunchError, match="no expert parallelism"):
        BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=1).expert_parallel_group(0)


# ---------------------------------------------------------------- full size




@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = fullsize_checkpoint("DeepSeek-V3", tmp_path_factory.mktemp("fullsize"))
    header = json.loads((FULLSIZE / "DeepSeek-V3" / "safetensors_header.json").read_text())
    opened = open_checkpoint(path)
    bound = bind(None, FULLSIZE / "DeepSeek-V3" / "config.json", opened)[0]
    assert checkpoint_errors(bound, opened) == []  # what `partc check --checkpoint` checks
    yield bound, header
    path.unlink()


@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 2, 64), (8, 1, 8)])
def test_full_size_deepseek_v3_fp8_with_mtp_plans_at_ep64_pp2_and_ep8_t8(
        deepseek_v3: Any, tp: int, pp: int, ep: int) -> None:
    bound, header = deepseek_v3
    plan = realize_plan(bound, Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        expert_parallel_size=ep))
    assert len(plan.ranks) == ep * pp
    routed = re.compile(r"\.mlp\.experts\.(\d+)\.")
    expert_bytes = 0
    for name, entry in header.items():
        if name != "__metadata__" and routed.search(name):
            begin, end = entry["data_offsets"]
            expert_bytes += end - begin
    assert any(routed.search(n) and n.endswith("weight_scale_inv") for n in header)
    assert any(n.startswith("model.layers.61.") for n in header)  # the MTP layer
    # no redundancy and X = 1: every routed-expert byte (FP8 weights and their scales) is on
    # exactly one rank
    assert sum(r.info.expert_parameter_bytes for r in plan.ranks) == expert_bytes
    per_rank = 256 // ep
    for rank in (plan.ranks[0], plan.ranks[-1]):
        experts = {int(m.group(1)) for t in rank.layout.tensors if (m := routed.search(t.target))}
        ep_rank = rank.info.expert_parallel_rank
        assert experts == set(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
    experts = plan.expert_parallel
    assert experts is not None and experts.placement.experts == 256
    assert experts.per_expert_groups == 256 * 59  # 58 MoE layers and the MTP layer


def test_a_planned_rank_and_a_launched_rank_have_the_same_coordinates() -> None:
    bound, _, _ = bind(None, MIXTRAL, None)
    plan = realize_plan(bound, Topology(tensor_parallel_size=2, pipeline_parallel_size=2,
                                        expert_parallel_size=2, expert_tensor_parallel_size=2))
    launch = BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=2,
                           expert_parallel_size=2, expert_tensor_parallel_size=2)
    assert [rank.coordinates for rank in plan.ranks] == [
        launch.coordinates(g) for g in range(launch.world_size)]
    assert [rank.coordinates.stage_rank for rank in plan.ranks if rank.coordinates] == [
        0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize(("ranks", "message"), [
    ([[-1] * 450_000, [-1] * 450_000], "expert placement file is larger than the limit of "
                                       f"{64 * 1024 + 32 * 8 * 2} bytes"),
    ([[0] * 9, [1] * 3], "EP rank 0 lists 9 ids but a rank holds at most the model's 8 "
                         "experts, each once"),
])
def test_an_oversized_placement_is_refused_before_it_is_checked_id_by_id(
        tmp_path: Path, capsys: Any, ranks: list[list[int]], message: str) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"ranks": ranks}))
    code = main(["check", "--config", str(QWEN), "--ep", "2", "--expert-placement", str(path),
                 "--format", "json"])
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert code == 1 and message in error["message"], error["message"]


def test_a_placement_breaking_many_rules_reports_the_first_twenty(tmp_path: Path,
                                                                   capsys: Any) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"ranks": [[-1] * 8] * 4}))  # 32 bad ids
    code = main(["check", "--config", str(QWEN), "--ep", "4", "--expert-placement", str(path),
                 "--format", "json"])
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert code == 1 and len(errors) == 20
    assert errors[-1]["message"].endswith("EP rank 2 slot 3 names expert -1; expert ids are "
                                          "integers 0..7 (and 12 more errors not shown; fix "
                                          "these first)"), errors[-1]["message"]
