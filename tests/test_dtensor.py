"""DTensor output: a rank's tensors as DTensors whose full_tensor() is the checkpoint tensor, or
a refusal naming the tensor wherever partc's split is not DTensor's (torch.chunk) split."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from partc.api import CompileOptions, compile_family
from partc.errors import LaunchError
from partc.parallel.specs import ShardingPolicy, chunk_range
from partc.plan.topology import Topology
from partc.runtime.dtensor import dtensor_specs

from support import HF, import_build

WORKER = Path(__file__).resolve().parent / "distributed" / "dtensor_worker.py"
LLAMA = HF / "llama"


def test_chunk_range_is_torch_chunk():
    import torch

    for size in (1, 7, 64, 131):
        for parts in (1, 2, 3, 4, 8):
            pieces = torch.arange(size).chunk(parts)
            for index in range(parts):
                a, b = chunk_range(size, parts, index)
                expected = pieces[index].tolist() if index < len(pieces) else []
                assert list(range(a, b)) == expected


def test_every_tensor_of_an_even_llama_split_maps_to_shard_or_replicate(tmp_path):
    compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    package = import_build(tmp_path / "b")
    for rank in range(2):
        specs = dtensor_specs(package.load(LLAMA, rank=rank).layout, 2, rank)
        assert specs["model.layers.0.self_attn.q_proj.weight"].shard_axis == 0
        assert specs["model.layers.0.self_attn.o_proj.weight"].shard_axis == 1
        assert specs["model.norm.weight"].shard_axis is None


def test_an_uneven_vocabulary_split_is_refused_with_both_ranges(tmp_path):
    # vocab 131 over 8: partc gives rank 7 rows 115:131, torch.chunk 119:131
    compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=8),
                   CompileOptions(policy=ShardingPolicy.REPLICATE_UNSUPPORTED, out=tmp_path / "b"))
    package = import_build(tmp_path / "b")
    layout = package.load(LLAMA, rank=7).layout
    with pytest.raises(LaunchError) as caught:
        dtensor_specs(layout, 8, 7)
    message = str(caught.value)
    assert "model.embed_tokens.weight" in message or "lm_head.weight" in message
    assert "holds 115:131" in message
    assert "would hold 119:131" in message


def test_the_plan_lists_every_tensor_some_tp_rank_holds_otherwise_than_torch_chunk(tmp_path):
    plan = compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=8),
                          CompileOptions(policy=ShardingPolicy.REPLICATE_UNSUPPORTED,
                                         out=tmp_path / "b")).plan
    expected = {}  # every rank's own range against torch.chunk's (chunk_range is torch.chunk)
    for rank in sorted(plan.ranks, key=lambda r: r.tensor_parallel_rank):
        for layout in rank.layout.tensors:
            axis, ranges = layout.selection
            if axis is None or len(ranges) != 1 or layout.target in expected:
                continue
            chunk = chunk_range(layout.global_shape[axis], 8, rank.tensor_parallel_rank)
            if tuple(ranges[0]) != chunk:
                expected[layout.target] = (rank.tensor_parallel_rank, tuple(ranges[0]), chunk)
    assert expected["lm_head.weight"] == (3, (51, 67), (51, 68))  # 131 rows: 17,17,17,16,...
    assert {t: (r, a, b) for t, r, a, b in plan.chunk_mismatches(0)} == expected
    module = import_build(tmp_path / "b").rank_module(0)  # rank 0's own rows are torch.chunk's
    assert module.CHUNK_MISMATCHES == plan.chunk_mismatches(0)


def test_an_uneven_split_is_refused_on_a_rank_whose_own_range_is_torch_chunks(tmp_path):
    """Without the stage's list, TP ranks 0-2 (rows 0:51, as torch.chunk's) built DTensors
    and went on into collectives the refusing ranks 3-7 never joined."""
    result = compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=8),
                            CompileOptions(policy=ShardingPolicy.REPLICATE_UNSUPPORTED,
                                           out=tmp_path / "b"))
    from partc.emit.render import package_name

    got = _attempts(tmp_path / "b", LLAMA, package_name(result.plan), 0, 8, ["own-rank"])
    assert got["own-rank"].startswith("refused: `"), got
    assert "so that TP rank 3 holds 51:67, but DTensor's Shard(0) (torch.chunk) would hold " \
           "51:68 there" in got["own-rank"]
    assert "every rank of the TP group refuses this state" in got["own-rank"]


def test_a_mesh_whose_tp_groups_are_not_the_builds_is_refused_by_every_process(tmp_path):
    # a (tp, pp) mesh: TP groups [0, 2] and [1, 3] instead of the build's [0, 1] and [2, 3];
    # processes 0 and 3 sit at their own TP rank and stage in it and were accepted
    compile_family(None, LLAMA / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    for rank in range(4):
        got = _attempts(tmp_path / "b", LLAMA, "partc_llama_tp2_pp2", rank, 4, ["swapped-mesh"])
        assert got["swapped-mesh"].startswith(
            "refused: to_dtensors: the mesh's tp dimension groups global ranks [0, 2]; a "
            "build's TP group is 2 consecutive ranks from a multiple of 2"), (rank, got)


def test_to_dtensors_names_what_it_takes_when_given_something_else(tmp_path):
    compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    got = _attempts(tmp_path / "b", LLAMA, "partc_llama_tp2_pp1", 0, 2,
                    ["tensors-dict", "no-mesh"])
    assert got["tensors-dict"] == ("refused: to_dtensors takes the RankState load() returned "
                                   "(its layout says how each tensor is split), found dict")
    assert got["no-mesh"] == ("refused: to_dtensors takes a torch DeviceMesh (the package's "
                              "device_mesh()), found NoneType")


def test_repeated_kv_heads_are_refused(tmp_path):
    # the built-in Llama repeats its 2 KV heads over 4 ranks (kv_replication: true)
    compile_family("llama", LLAMA / "config.json", Topology(tensor_parallel_size=4),
                   CompileOptions(out=tmp_path / "b"))
    layout = import_build(tmp_path / "b").load(LLAMA, rank=0).layout
    with pytest.raises(LaunchError, match=r"repeats KV heads over 2 ranks"):
        dtensor_specs(layout, 4, 0)


@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (2, 1)])
def test_under_torchrun_full_tensor_of_every_dtensor_is_the_checkpoint_tensor(tmp_path, tp, pp):
    result = compile_family(None, LLAMA / "config.json",
                            Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                            CompileOptions(out=tmp_path / "b"))
    package = f"partc_llama_tp{tp}_pp{pp}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    reports_dir = tmp_path / "reports"
    reports_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp * pp}",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(WORKER),
         str(tmp_path / "b"), str(LLAMA), package, str(tp), str(pp)],
        capture_output=True, text=True, timeout=240,
        env={**env, "PARTC_TEST_REPORTS": str(reports_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(reports_dir.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(tp * pp))
    owned = {r["rank"]: set(r["names"]) for r in reports}
    for rank in owned:
        expected = {layout.target for layout in result.plan.ranks[rank].layout.tensors}
        assert owned[rank] == expected
    assert all(r["sharded"] > 0 for r in reports)


@pytest.mark.parametrize("mode", ["fast", "fallback"])
def test_to_dtensors_equals_from_local_tensor_by_tensor(tmp_path, mode):
    # one spec per kind of tensor (placement, global shape, dtype) is shared by the DTensors
    # DTensor's constructor makes; where it refuses, every tensor comes from from_local
    compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, str(WORKER.parent / "dtensor_fast_worker.py"), str(tmp_path / "b"),
         str(LLAMA), "partc_llama_tp2_pp1", mode],
        capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["tensors"] == len(load_file(str(LLAMA / "model.safetensors")))
    if mode == "fast":  # exactly one spec per kind: q, k/v, o, gate/up, down, norms, vocab
        assert report["specs"] == report["kinds"] == 7, report
    else:
        assert report["specs"] == report["tensors"], report


REFUSALS = WORKER.parent / "dtensor_refusal_worker.py"


def _attempts(build: Path, checkpoint: Path, package: str, rank: int, world: int,
              cases: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, str(REFUSALS), str(build), str(checkpoint), package, *cases],
        capture_output=True, text=True, timeout=180,
        env={**env, "RANK": str(rank), "WORLD_SIZE": str(world)})
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def test_a_dtensor_of_another_rank_dimension_or_world_is_refused_never_built(tmp_path):
    # a T=2 build in a 4-process job (D=2), as global rank 1 (replica 0, TP rank 1)
    compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    got = _attempts(tmp_path / "b", LLAMA, "partc_llama_tp2_pp1", 1, 4,
                    ["own-rank", "dp-dimension", "other-rank", "read-only", "wrong-world",
                     "device=gpu", "device=cuda", "device=cuda:0"])
    assert got["own-rank"] == "accepted"
    assert re.fullmatch(r"refused: to_dtensors needs an unnamed 1-D tensor-parallel mesh or a "
                        r"mesh with a `tp` dimension; this mesh has 1 dimensions named \('dp',\)",
                        got["dp-dimension"]), got["dp-dimension"]
    assert ("refused: to_dtensors: the state is TP rank 0 of the build (global rank 0), but "
            "this process is TP rank 1 of the mesh") in got["other-rank"]
    assert "is a read-only view of the checkpoint file (zero_copy=True)" in got["read-only"]
    assert got["wrong-world"] == (
        "refused: the torch world has 4 processes; this topology needs 2 (D=1 x S=1 x 2 ranks a "
        "stage); data_parallel_size=2 fits this world (the default: D is WORLD_SIZE over a "
        "replica's ranks)")
    assert "'gpu' is not a torch device type; expected 'cpu' or 'cuda'" in got["device=gpu"]
    assert "torch sees no cuda device here" in got["device=cuda"]
    assert "'cuda:0' names one device" in got["device=cuda:0"]


def test_a_state_of_another_pipeline_stage_is_refused(tmp_path):
    compile_family(None, LLAMA / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    got = _attempts(tmp_path / "b", LLAMA, "partc_llama_tp2_pp2", 0, 4,
                    ["own-rank", "other-stage"])
    assert got["own-rank"] == "accepted"
    assert got["other-stage"] == ("refused: to_dtensors: the state is of pipeline stage 1, but "
                                  "this process is on stage 0 of the mesh")


def test_an_expert_parallel_build_is_refused_not_replicated(tmp_path):
    mixtral = HF / "mixtral"
    result = compile_family(None, mixtral / "config.json",
                            Topology(tensor_parallel_size=2, expert_parallel_size=2),
                            CompileOptions(out=tmp_path / "b"))
    from partc.emit.render import package_name

    got = _attempts(tmp_path / "b", mixtral, package_name(result.plan), 0, 2,
                    ["expert-parallel"])
    assert got["expert-parallel"].startswith(
        "refused: to_dtensors: rank 0 is of an expert-parallel build, whose experts are held by "
        "their EP ranks only"), got


def test_a_state_lacking_the_per_head_tensors_of_other_ranks_is_refused_on_every_rank(tmp_path):
    # StableLM's qk_layernorm: each rank holds its own heads' `norms.{h}` only (per_head)
    stablelm_qk = HF / "stablelm_qk"
    compile_family(None, stablelm_qk / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=tmp_path / "b"))
    for rank, other in ((0, 2), (1, 0)):
        got = _attempts(tmp_path / "b", stablelm_qk, "partc_stablelm_tp2_pp1", rank, 2,
                        ["own-rank"])
        assert got["own-rank"] == (
            f"refused: to_dtensors: rank {rank} holds the per-head tensors of its own heads "
            f"only (`sharding: per_head`), not `model.layers.0.self_attn.q_layernorm.norms."
            f"{other}.weight` and 5 more that other ranks of its tensor-parallel group hold; "
            "DTensor has no placement for a tensor some ranks of the mesh lack. Use the plain "
            "tensors (each rank its heads' tensors)"), got
