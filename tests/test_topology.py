"""The rank layout of a build: coordinates and groups by arithmetic, then the same groups as
real torch.distributed process groups and a DeviceMesh under torchrun (gloo, 4 processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partc.api import CompileOptions, compile_family
from partc.errors import ExpertParallelError, LaunchError, LayoutError
from partc.parallel.shape import RankCoordinates
from partc.plan.topology import Topology
from partc.runtime.mesh import BuildTopology

from support import HF

WORKER = Path(__file__).resolve().parent / "distributed" / "topology_worker.py"
LLAMA = HF / "llama"


def test_coordinates_follow_g_equals_d_ts_plus_p_t_plus_t_and_round_trip():
    topology = BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=3,
                             data_parallel_size=2)
    assert topology.world_size == 12
    for g in range(12):
        c = topology.coordinates(g)
        assert g == c.data_parallel_rank * 6 + c.pipeline_stage * 2 + c.tensor_parallel_rank
        assert topology.global_rank(c) == g
        assert topology.build_rank(g) == g % 6
    assert topology.coordinates(9) == RankCoordinates(data_parallel_rank=1, pipeline_stage=1,
                                                      stage_rank=1, tensor_parallel_rank=1)


BAD_SHAPES = [
    ({"tensor_parallel_size": 0, "pipeline_parallel_size": 1},
     "tensor_parallel_size must be a positive integer, found 0"),
    ({"tensor_parallel_size": 1, "pipeline_parallel_size": -2},
     "pipeline_parallel_size must be a positive integer, found -2"),
    ({"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel_size": 0},
     "expert_parallel_size must be a positive integer, found 0"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "expert_tensor_parallel_size": 2},
     "expert_tensor_parallel_size 2 (--etp) needs expert parallelism: give "
     "expert_parallel_size (--ep)"),
    ({"tensor_parallel_size": 4, "pipeline_parallel_size": 1, "expert_parallel_size": 3},
     "a stage has N = expert_parallel_size 3 x expert_tensor_parallel_size 1 = 3 ranks, not a "
     "multiple of tensor_parallel_size 4: the dense parts (split over T ranks) are repeated "
     "N / T times; choose T dividing 3"),
]


@pytest.mark.parametrize(("sizes", "message"), BAD_SHAPES)
def test_the_plan_and_the_launch_refuse_a_bad_shape_in_the_same_words(
        sizes: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError) as planned:
        Topology(**sizes)  # type: ignore[arg-type]
    with pytest.raises(LaunchError) as launched:
        BuildTopology(**sizes)  # type: ignore[arg-type]
    assert planned.value.message == launched.value.message == message
    if "expert" in message:
        assert isinstance(planned.value, ExpertParallelError), "its guide is expert_parallel"


def test_the_plan_and_the_launch_word_a_rank_or_coordinates_outside_the_shape_alike() -> None:
    sizes = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
             "expert_parallel_size": 2, "expert_tensor_parallel_size": 2}
    shape = Topology(**sizes).shape  # type: ignore[arg-type]
    launch = BuildTopology(**sizes)  # type: ignore[arg-type]
    outside = RankCoordinates(data_parallel_rank=0, pipeline_stage=2, stage_rank=0,
                              tensor_parallel_rank=0)
    mixed = RankCoordinates(data_parallel_rank=0, pipeline_stage=1, stage_rank=1,
                            tensor_parallel_rank=1,
                            dense_replica=0, expert_parallel_rank=1,
                            expert_tensor_parallel_rank=1)
    for call_plan, call_launch, message in [
            (lambda: shape.coordinates(8), lambda: launch.coordinates(8),
             "rank 8 is outside the ranks 0..7 of D=1 x S=2 x T=2 x E=2 x X=2"),
            (lambda: shape.rank(outside), lambda: launch.global_rank(outside),
             f"coordinates {outside} are outside D=1 x S=2 x T=2 x E=2 x X=2 "
             "(2 dense replicas)"),
            (lambda: shape.rank(mixed), lambda: launch.global_rank(mixed),
             f"coordinates {mixed} are inconsistent: rank 5 is {shape.coordinates(5)}")]:
        with pytest.raises(LayoutError) as planned:
            call_plan()
        with pytest.raises(LaunchError) as launched:
            call_launch()
        assert planned.value.message == launched.value.message == message


def test_groups_and_peers_of_a_two_by_three_by_two_job():
    topology = BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=3,
                             data_parallel_size=2)
    assert topology.tensor_parallel_group(9) == (8, 9)
    assert topology.pipeline_group(9) == (7, 9, 11)
    assert topology.data_parallel_group(9) == (3, 9)
    assert (topology.previous_stage_peer(9), topology.next_stage_peer(9)) == (7, 11)
    assert topology.previous_stage_peer(6) is None and topology.next_stage_peer(11) is None
    groups = topology.all_groups()
    # every rank is in exactly one group of each dimension
    for dimension, expected_size in (("tp", 2), ("pp", 3), ("dp", 2)):
        members = [r for group in groups[dimension] for r in group]
        assert sorted(members) == list(range(12))
        assert {len(g) for g in groups[dimension]} == {expected_size}


def test_a_rank_outside_the_job_is_refused_by_name():
    topology = BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(LaunchError,
                       match=r"^rank 4 is outside the ranks 0\.\.3 of D=1 x S=2 x T=2$"):
        topology.coordinates(4)
    with pytest.raises(LaunchError, match="tensor_parallel_size must be a positive"):
        BuildTopology(tensor_parallel_size=0, pipeline_parallel_size=1)


@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 2, 1), (2, 1, 2)])
def test_torchrun_creates_the_same_groups_and_mesh_and_the_stage_peers_exchange(tmp_path, tp, pp,
                                                                              dp):
    compile_family(None, LLAMA / "config.json",
                   Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                   CompileOptions(out=tmp_path / "b"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    reports_dir = tmp_path / "reports"
    reports_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
         "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
         str(WORKER), str(tp), str(pp), str(dp), str(tmp_path / "b"),
         f"partc_llama_tp{tp}_pp{pp}"],
        capture_output=True, text=True, timeout=240,
        env={**env, "PARTC_TEST_REPORTS": str(reports_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    reports = sorted((json.loads(p.read_text()) for p in reports_dir.glob("rank-*.json")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    topology = BuildTopology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                             data_parallel_size=dp)
    for report in reports:
        g = report["rank"]
        assert report["seen"]["tp"] == list(topology.tensor_parallel_group(g))
        assert report["seen"]["pp"] == list(topology.pipeline_group(g))
        assert report["seen"]["dp"] == list(topology.data_parallel_group(g))
        assert report["mesh"]["tp"] == list(topology.tensor_parallel_group(g))
        assert report["mesh"]["pp"] == list(topology.pipeline_group(g))
        assert report["mesh"]["dp"] == list(topology.data_parallel_group(g))
        previous = topology.previous_stage_peer(g)
        assert report["received"] == (None if previous is None else previous * 10)
        assert report["mesh_names"] == ["dp", "pp", "tp"]
        assert report["position"] == [g, 4, topology.build_rank(g),
                                      topology.coordinates(g).data_parallel_rank, dp]


_PACKAGE_FACE = """
import json, sys
sys.path.insert(0, sys.argv[1])
loaders = __import__(sys.argv[2])
from partc.errors import PartcError
out = {}
try:
    topology = loaders.topology()
    out["topology"] = [topology.tensor_parallel_size, topology.pipeline_parallel_size,
                       topology.data_parallel_size]
    p = loaders.launch_position()
    out["position"] = [p.global_rank, p.world_size, p.rank, p.data_parallel_rank,
                       p.data_parallel_size]
except PartcError as error:
    out["error"] = str(error)
out["explicit"] = loaders.topology(3).world_size
print(json.dumps(out))
"""


@pytest.mark.parametrize(("environment", "expected"), [
    ({"RANK": "7", "WORLD_SIZE": "8"}, {"topology": [2, 2, 2], "position": [7, 8, 3, 1, 2]}),
    ({"WORLD_SIZE": "12"}, {"topology": [2, 2, 3], "error": "no rank given and RANK is not set; "
                                                            "pass rank= or run under torchrun"}),
    ({}, {"topology": [2, 2, 1], "error": "no rank given and RANK is not set; pass rank= or "
                                          "run under torchrun"}),
    ({"RANK": "1", "WORLD_SIZE": "6"}, {"error": "WORLD_SIZE=6 is not a multiple of this "
                                                 "build's 4 ranks (tp 2 x pp 2); run 4 x D "
                                                 "processes for D data-parallel replicas"}),
])
def test_a_generated_package_exposes_its_topology_and_launch_position(tmp_path, environment,
                                                                      expected):
    compile_family(None, LLAMA / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", _PACKAGE_FACE, str(tmp_path / "b"),
                           "partc_llama_tp2_pp2"], capture_output=True, text=True, timeout=60,
                          env={**env, **environment})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == expected | {"explicit": 12}
