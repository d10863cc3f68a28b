"""The expert-parallel topology under torch.distributed, and the messages of EP builds.

An expert-parallel stage has N = E x X ranks. The EP group is the E ranks holding *different*
experts at the same ETP rank, the ETP group the X ranks splitting the *same* experts (Megatron's
expert-model-parallel and expert-tensor-parallel groups); `process_groups()` and
`device_mesh()` must agree on both. The oracles are the plan's own records (each rank's EP and
ETP rank, the placement's slots, each per-expert tensor's per-ETP-rank placement), regrouped
here by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from partc.api import CompileOptions, bind, compile_family
from partc.cli.main import main
from partc.errors import ExpertParallelError, LaunchError, PartcErrors
from partc.parallel.experts import ExpertPlacement
from partc.plan.realize import realize_plan
from partc.plan.topology import Topology
from partc.runtime.mesh import BuildTopology, build_topology

from support import hf

MIXTRAL = hf("mixtral") / "config.json"
QWEN = hf("qwen3_moe") / "config.json"

_WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
loaders = __import__(sys.argv[2])
dist.init_process_group("gloo")
me = dist.get_rank()
groups = loaders.process_groups()
seen = {}
for name, group in (("tp", groups.tensor_parallel), ("pp", groups.pipeline_parallel),
                    ("dp", groups.data_parallel), ("ep", groups.expert_parallel),
                    ("etp", groups.expert_tensor_parallel)):
    members = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(members, torch.tensor([me]), group=group)
    seen[name] = sorted(int(m) for m in members)
mesh = loaders.device_mesh("cpu")
meshed = {name: sorted(int(r) for r in mesh[name].mesh.flatten().tolist())
          for name in mesh.mesh_dim_names}
with open(os.path.join(os.environ["PARTC_TEST_REPORTS"], f"rank-{me}.json"), "w") as out:
    json.dump({"rank": me, "seen": seen, "mesh": meshed,
               "names": list(mesh.mesh_dim_names)}, out)
dist.barrier()
dist.destroy_process_group()
"""


def _holdings(plan: dict[str, Any]) -> dict[int, tuple[int, tuple[int, ...], Any]]:
    """Per build rank: (stage, the global experts it holds, its piece of each of them), read
    from the plan's records alone."""
    experts = plan["expert_parallel"]
    slots = experts["slots"]
    per_expert = next(t for t in plan["tensors"] if t["group"] in experts["expert_groups"])
    held = {}
    for rank in plan["ranks"]:
        info = rank["info"]
        held[rank["rank"]] = (rank["pipeline_stage"],
                              tuple(slots[info["expert_parallel_rank"]]),
                              per_expert["placements"][info["expert_tensor_parallel_rank"]])
    return held


@pytest.mark.parametrize(("config", "tp", "ep", "etp", "dp"), [
    (MIXTRAL, 2, 2, 2, 1),
    (QWEN, 1, 1, 2, 2),
])
def test_the_ep_group_holds_different_experts_and_the_etp_group_the_same_under_torchrun(
        tmp_path: Path, config: Path, tp: int, ep: int, etp: int, dp: int) -> None:
    compile_family(None, config,
                   Topology(tensor_parallel_size=tp, expert_parallel_size=ep,
                            expert_tensor_parallel_size=etp), CompileOptions(out=tmp_path / "b"))
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    package = next(p.name for p in (tmp_path / "b").iterdir() if p.is_dir())
    reports = tmp_path / "reports"
    reports.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
         "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
         str(worker), str(tmp_path / "b"), package],
        capture_output=True, text=True, timeout=240,
        env={**env, "PARTC_TEST_REPORTS": str(reports)})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {r["rank"]: r for r in (json.loads(p.read_text()) for p in reports.glob("*.json"))}
    assert sorted(seen) == [0, 1, 2, 3]

    held = _holdings(plan)
    build = len(held)
    assert build * dp == 4
    for g, report in seen.items():
        replica, mine = divmod(g, build)
        stage, experts, piece = held[mine]
        peers = {replica * build + b: h for b, h in held.items() if h[0] == stage}
        same = sorted(h for h, (_, e, _) in peers.items() if e == experts)
        different = sorted(h for h, (_, e, p) in peers.items()
                           if p == piece and (e != experts or h == g))
        assert len(same) == etp and len(different) == ep
        assert len({json.dumps(peers[h][2]) for h in same}) == etp  # each splits them apart
        assert report["seen"]["etp"] == report["mesh"]["etp"] == same
        assert report["seen"]["ep"] == report["mesh"]["ep"] == different
        assert report["seen"]["dp"] == report["mesh"]["dp"] == [
            d * build + mine for d in range(dp)]
        dense = plan["ranks"][mine]["info"]["dense_replica"]
        assert report["seen"]["tp"] == sorted(
            replica * build + r["rank"] for r in plan["ranks"]
            if r["pipeline_stage"] == stage and r["info"]["dense_replica"] == dense)
        assert report["names"] == ["dp", "pp", "ep", "etp"]


_LAUNCH = """
import json, sys
sys.path.insert(0, sys.argv[1])
loaders = __import__(sys.argv[2])
from partc.errors import PartcError
out = []
for call in (loaders.launch_position, loaders.topology, loaders.rank_module,
             lambda: loaders.load(sys.argv[3])):
    try:
        call()
        out.append(None)
    except PartcError as error:
        out.append(str(error))
print(json.dumps(out))
"""


@pytest.mark.parametrize(("options", "factors"), [
    ({"pipeline_parallel_size": 2, "expert_parallel_size": 2}, "pp 2 x ep 2"),
    ({"expert_parallel_size": 2, "expert_tensor_parallel_size": 2}, "pp 1 x ep 2 x etp 2"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "tp 2 x pp 2"),
])
@pytest.mark.parametrize("rank", ["1", None])
def test_a_world_size_no_multiple_of_the_build_names_the_builds_real_factors(
        tmp_path: Path, options: dict[str, int], factors: str, rank: str | None) -> None:
    compile_family(None, MIXTRAL, Topology(**options), CompileOptions(out=tmp_path / "b"))
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    topology = plan["topology"]
    per_stage = (topology["tensor_parallel_size"] if topology.get("expert_parallel_size") is None
                 else topology["expert_parallel_size"]
                 * topology.get("expert_tensor_parallel_size", 1))
    ranks = per_stage * topology["pipeline_parallel_size"]
    assert ranks == len(plan["ranks"]) == 4
    package = next(p.name for p in (tmp_path / "b").iterdir() if p.is_dir())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["WORLD_SIZE"] = "6"
    if rank is not None:
        env["RANK"] = rank
    done = subprocess.run([sys.executable, "-c", _LAUNCH, str(tmp_path / "b"), package,
                           str(hf("mixtral"))], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = (f"WORLD_SIZE=6 is not a multiple of this build's {ranks} ranks ({factors}); "
                f"run {ranks} x D processes for D data-parallel replicas")
    launch, built, module, loaded = json.loads(done.stdout)
    assert built == expected
    no_rank = "no rank given and RANK is not set; pass rank= or run under torchrun"
    assert launch == module == loaded == (expected if rank is not None else no_rank)


def test_build_topology_names_the_factors_it_multiplies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "9")
    with pytest.raises(LaunchError, match=r"this build's 6 ranks "
                       r"\(pp 1 x ep 3 x etp 2\);"):
        build_topology(2, 1, expert_parallel_size=3, expert_tensor_parallel_size=2)


def test_a_placement_file_with_two_mistakes_reports_both_with_file_line_expected_and_found(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "placement.json"
    text = '{"ranks": [\n  [0, 1, 9, 3],\n  [4, 6, 5, 7]\n]}\n'
    path.write_text(text)
    lines = text.splitlines()
    bad_id = next(i for i, line in enumerate(lines, 1) if "9" in line)
    unordered = next(i for i, line in enumerate(lines, 1) if "6, 5" in line)
    with pytest.raises(PartcErrors) as caught:
        compile_family(None, QWEN, Topology(expert_parallel_size=2),
                       CompileOptions(expert_placement=path, out=tmp_path / "build"))
    errors = caught.value.errors
    found = [(e.location.line if e.location else None, e.pointer) for e in errors]
    assert found == [(bad_id, "/ranks/0/2"), (unordered, "/ranks/1/2")]
    assert all(str(path) in e.message for e in errors)
    assert "EP rank 0 slot 2 names expert 9; expert ids are integers 0..7" in errors[0].message
    assert "EP rank 1 lists expert 5 after 6; a rank's experts are distinct and ascending" in (
        errors[1].message)
    assert not (tmp_path / "build").exists()

    code = main(["compile", "--config", str(QWEN), "--ep", "2", "--expert-placement",
                 str(path), "--out", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert f"{path}:{bad_id}:" in err and f"{path}:{unordered}:" in err
    assert "partc: 2 error(s)" in err


def test_a_placement_with_a_wrong_rank_count_and_a_missing_expert_reports_both(
        tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    path.write_text('{"ranks": [\n  [0, 1, 2, 3, 4, 5, 6]\n]}\n')
    with pytest.raises(PartcErrors) as caught:
        compile_family(None, QWEN, Topology(expert_parallel_size=2),
                       CompileOptions(expert_placement=path))
    messages = [e.message for e in caught.value.errors]
    assert len(messages) == 2
    assert any("it lists 1 EP rank but expert_parallel_size is 2" in m for m in messages)
    assert any("1 expert (7) is on no EP rank; every one of the 8 experts needs at least one"
               in m for m in messages)


def test_expert_counts_of_one_are_spelled_in_the_singular() -> None:
    with pytest.raises(ExpertParallelError, match=r"exceeds the model's 1 expert: a balanced"):
        ExpertPlacement.balanced(1, 2)
    with pytest.raises(ExpertParallelError, match=r"1 expert \(1\) is on no EP rank; every one "
                                                  r"of the 2 experts needs at least one"):
        ExpertPlacement(experts=2, slots=((0,), (0,)))


def test_a_rank_outside_an_expert_parallel_job_names_the_factors_of_its_ranks() -> None:
    topology = BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=2,
                             data_parallel_size=2, expert_parallel_size=2,
                             expert_tensor_parallel_size=2)
    assert topology.world_size == 2 * 2 * 2 * 2  # T divides N = E x X: not a factor
    with pytest.raises(LaunchError, match=r"^rank 16 is outside the ranks 0\.\.15 of "
                                              r"D=2 x S=2 x T=2 x E=2 x X=2$"):
        topology.coordinates(16)


def test_one_rank_per_stage_and_a_placement_of_one_expert_are_spelled_in_the_singular(
        ) -> None:
    with pytest.raises(LaunchError, match=r"= 1 rank, not a multiple of "
                                          r"tensor_parallel_size 2"):
        BuildTopology(tensor_parallel_size=2, pipeline_parallel_size=1, expert_parallel_size=1)
    bound, _, _ = bind(None, MIXTRAL, None)
    one = ExpertPlacement(experts=1, slots=((0,),), explicit=True)
    with pytest.raises(ExpertParallelError, match=r"the expert placement is for 1 expert but "
                                                  r"the model routes to 4$"):
        realize_plan(bound, Topology(tensor_parallel_size=1, pipeline_parallel_size=1,
                                     expert_parallel_size=1, expert_placement=one))
