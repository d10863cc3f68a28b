"""plan.json read back typed (`read_plan`) agrees with the Plan that wrote it, field by field; a
corrupted plan is one located error; `ParallelShape`'s rank arithmetic against an independent
row-major enumeration of the coordinates."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from partc.api import CompileOptions, compile_family
from partc.errors import LayoutError, LoadError
from partc.parallel.shape import ParallelShape, RankCoordinates
from partc.plan.plan_file import read_plan
from partc.plan.topology import Topology

from support import hf


@pytest.mark.parametrize(("model", "options"), [
    ("llama", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    ("llava", {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}),
    ("qwen3_moe", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                   "expert_parallel_size": 2, "expert_tensor_parallel_size": 2}),
], ids=["llama-t2s2", "llava-s2", "qwen3_moe-ep2-etp2"])
def test_a_written_plan_reads_back_equal_to_the_plan_field_by_field(
        tmp_path: Path, model: str, options: dict[str, int]) -> None:
    result = compile_family(None, hf(model) / "config.json", Topology(**options),
                            CompileOptions(out=tmp_path / "b", checkpoint=hf(model)))
    plan = result.plan
    read = read_plan(tmp_path / "b" / "plan.json")
    assert read.path == tmp_path / "b" / "plan.json"
    assert (read.plan_hash, read.family, read.model_type) == (
        plan.plan_hash, plan.family, plan.model_type)
    assert read.checkpoint_fingerprint == plan.checkpoint_fingerprint is not None
    assert read.checkpoint_header_digest == plan.checkpoint_header_digest
    assert read.omit == plan.omit
    topology = plan.topology
    assert read.shape == ParallelShape(
        tensor_parallel_size=options["tensor_parallel_size"],
        pipeline_parallel_size=options["pipeline_parallel_size"],
        expert_parallel_size=options.get("expert_parallel_size"),
        expert_tensor_parallel_size=options.get("expert_tensor_parallel_size", 1))
    assert read.shape.build_world_size == topology.world_size == len(plan.ranks)
    assert dict(read.topology_json) == topology.to_json()
    assert [(t.target, t.dtype, t.shape, t.group, t.stages) for t in read.tensors] == [
        (t.target, t.dtype, t.shape, t.group, t.stages) for t in plan.tensors]
    assert [(g.group, g.unit_paths) for g in read.graph] == [
        (g.name, g.unit_paths) for g in plan.graph]
    assert [(r.role, r.stage if r.with_group is None else {"with": r.with_group,
                                                           "unit": r.unit})
            for r in read.static_roles] == [(r.name, r.spell()) for r in plan.static_roles]
    assert len(read.ranks) == len(plan.ranks)
    for got, want in zip(read.ranks, plan.ranks, strict=True):
        assert (got.rank, got.pipeline_stage, got.tensor_parallel_rank) == (
            want.rank, want.pipeline_stage, want.tensor_parallel_rank)
        info = want.info
        assert (got.info.owned_tensors, got.info.local_parameter_bytes,
                got.info.global_parameter_bytes, got.info.pinned_parameter_bytes,
                got.info.maximum_device_parameter_bytes, got.info.local_bytes_by_dtype) == (
            info.owned_tensors, info.local_parameter_bytes, info.global_parameter_bytes,
            info.pinned_parameter_bytes, info.maximum_device_parameter_bytes,
            tuple(sorted(info.local_bytes_by_dtype)))
        partition = want.partition.to_json()
        assert [(u.group, [u.start, u.end]) for u in got.units] == [
            (g["group"], list(g["unit_range"])) for g in partition["groups"]]  # type: ignore
        assert got.pipeline_stage == partition["stage"]
        if want.coordinates is None:
            assert got.info.expert_parallel_rank is None
        else:
            assert (got.info.expert_parallel_rank, got.info.expert_tensor_parallel_rank) == (
                want.coordinates.expert_parallel_rank,
                want.coordinates.expert_tensor_parallel_rank)
        at = read.shape.coordinates(got.rank)
        assert (at.pipeline_stage, at.tensor_parallel_rank) == (
            got.pipeline_stage, got.tensor_parallel_rank)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "b"
    compile_family(None, hf("llama") / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(out=out))
    return out / "plan.json"


def _corrupted(written: Path, tmp_path: Path, edit: object) -> Path:
    plan = json.loads(written.read_text())
    edit(plan)  # type: ignore[operator]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    return path


def test_a_value_of_the_wrong_type_is_one_located_schema_error(written: Path,
                                                               tmp_path: Path) -> None:
    path = _corrupted(written, tmp_path,
                      lambda p: p["tensors"][3].__setitem__("stages", "first"))
    with pytest.raises(LoadError) as caught:
        read_plan(path)
    error = caught.value
    assert error.pointer == "/tensors/3/stages"
    assert "'first' is not of type 'array'" in error.message
    assert "it was edited, or not written by partc" in error.message
    assert error.location is not None and error.location.file == str(path)
    line = path.read_text().splitlines()[error.location.line - 1]
    assert '"stages"' in line, line


def test_a_plan_whose_ranks_disagree_with_its_topology_is_one_located_error(
        written: Path, tmp_path: Path) -> None:
    path = _corrupted(written, tmp_path,
                      lambda p: p["ranks"][1].__setitem__("pipeline_stage", 1))
    with pytest.raises(LoadError) as caught:
        read_plan(path)
    assert caught.value.pointer == "/ranks/1"
    assert caught.value.message.startswith(
        "the plan disagrees with itself: rank entry 1 says rank 1, stage 1, tp rank 1; the "
        "topology puts rank 1 on stage 0, tp rank 1")
    path = _corrupted(written, tmp_path, lambda p: p["ranks"].pop())
    with pytest.raises(LoadError, match=r"it lists 3 ranks but its topology \(D=1 x S=2 x "
                                        r"T=2\) has 4") as caught:
        read_plan(path)
    assert caught.value.pointer == "/ranks"


def test_a_file_that_is_not_a_plan_is_refused_with_what_it_lacks(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text('{"family": "x"}')
    with pytest.raises(LoadError, match="is not a partc plan: it lacks topology, groups, ranks, "
                                        "tensors, boundary, plan_hash"):
        read_plan(tmp_path / "plan.json")
    (tmp_path / "plan.json").write_text("{")
    with pytest.raises(LoadError, match="cannot read a plan from .*plan.json: Expecting"):
        read_plan(tmp_path / "plan.json")


SHAPES = [(1, 1, None, 1, 1), (2, 3, None, 1, 2), (4, 2, None, 1, 1), (2, 2, 2, 2, 1),
          (2, 1, 4, 1, 2), (1, 2, 2, 3, 1), (4, 2, 4, 2, 2), (8, 1, 8, 1, 1), (2, 1, 1, 4, 3)]


@pytest.mark.parametrize(("t", "s", "e", "x", "d"), SHAPES)
def test_the_shape_s_coordinates_are_the_row_major_enumeration_of_its_dimensions(
        t: int, s: int, e: int | None, x: int, d: int) -> None:
    shape = ParallelShape(tensor_parallel_size=t, pipeline_parallel_size=s,
                          expert_parallel_size=e, expert_tensor_parallel_size=x,
                          data_parallel_size=d)
    n = t if e is None else e * x
    dense = list(itertools.product(range(d), range(s), range(n // t), range(t)))
    experts = list(itertools.product(range(e or 1), range(x)))
    assert shape.world_size == len(dense) == d * s * n
    assert shape.build_world_size == s * n and shape.ranks_per_stage == n
    for rank, (dp, stage, replica, tp) in enumerate(dense):
        ep, etp = experts[rank % n] if e is not None else (0, 0)
        want = RankCoordinates(data_parallel_rank=dp, pipeline_stage=stage,
                               stage_rank=replica * t + tp,
                               tensor_parallel_rank=tp, dense_replica=replica,
                               expert_parallel_rank=ep, expert_tensor_parallel_rank=etp)
        assert shape.coordinates(rank) == want
        assert shape.rank(want) == rank
    for stage in range(s):
        assert list(shape.stage_ranks(stage)) == [
            r for r in range(shape.build_world_size)
            if shape.coordinates(r).pipeline_stage == stage]


@pytest.mark.parametrize(("sizes", "message"), [
    ({"tensor_parallel_size": 0, "pipeline_parallel_size": 1},
     "tensor_parallel_size must be a positive integer, found 0"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "expert_tensor_parallel_size": 2},
     "expert_tensor_parallel_size 2 (--etp) needs expert parallelism: give "
     "expert_parallel_size (--ep)"),
    ({"tensor_parallel_size": 4, "pipeline_parallel_size": 1, "expert_parallel_size": 3},
     "a stage has N = expert_parallel_size 3 x expert_tensor_parallel_size 1 = 3 ranks, "
     "not a multiple of tensor_parallel_size 4: the dense parts (split over T ranks) are "
     "repeated N / T times; choose T dividing 3"),
])
def test_an_impossible_shape_is_refused_with_the_rule_and_the_values(
        sizes: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError) as caught:
        ParallelShape(**sizes)  # type: ignore[arg-type]
    assert caught.value.message == message


def test_coordinates_outside_the_shape_or_inconsistent_with_it_are_refused() -> None:
    shape = ParallelShape(tensor_parallel_size=2, pipeline_parallel_size=2,
                          expert_parallel_size=2, expert_tensor_parallel_size=2)
    with pytest.raises(LayoutError, match="rank 8 is outside the ranks 0..7 of "):
        shape.coordinates(8)
    with pytest.raises(LayoutError, match="are inconsistent: rank 5 is"):
        shape.rank(RankCoordinates(data_parallel_rank=0, pipeline_stage=1, stage_rank=1,
                                   tensor_parallel_rank=1, dense_replica=0,
                                   expert_parallel_rank=1, expert_tensor_parallel_rank=1))


def test_an_expert_parallel_rank_recording_other_expert_coordinates_is_one_located_error(
        tmp_path: Path) -> None:
    out = tmp_path / "b"
    compile_family(None, hf("qwen3_moe") / "config.json",
                   Topology(tensor_parallel_size=2, expert_parallel_size=2,
                            expert_tensor_parallel_size=2), CompileOptions(out=out))
    path = _corrupted(out / "plan.json", tmp_path,
                      lambda p: p["ranks"][1]["info"].__setitem__("expert_parallel_rank", 1))
    with pytest.raises(LoadError) as caught:
        read_plan(path)
    assert caught.value.pointer == "/ranks/1/info"
    assert caught.value.message.startswith(
        "the plan disagrees with itself: rank 1 records dense replica 0, EP rank 1, ETP rank "
        "1; the topology gives 0, 0 and 1")
