"""Serving partc builds under torch.distributed: the reference torch executor (tests/torch_executor)
runs every build of one `torchrun --nproc_per_node=4` launch (CPU, gloo). Each process loads only
its own rank through the generated package, the TP layers meet in all_reduce / all_gather over
the TP group of partc's BuildTopology, and pipeline stages exchange the boundary tensors of the
rank modules. The output ranks' logits must match Hugging Face's reference.npz, and the tensor
sent at each pipeline cut HF's output of the stage's last layer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from partc.api import CompileOptions, compile_family
from partc.emit.render import package_name
from partc.errors import BoundaryPayloadError
from partc.parallel.specs import ShardingPolicy
from partc.plan.topology import Topology
from partc.runtime.mesh import BuildTopology

from support import hf, import_build
from support.distributed import torchrun
from torch_executor import TensorParallel, run_stage
from torch_executor.model import ShardingError

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed" / "executor_worker.py"
TOLERANCE = 1e-4
# name: (fixture, T, S, D) -- every run has 4 processes, so one launch serves them all; each
# is the built-in family of its fixture (llama at T=4 repeats its 2 KV heads, by default)
RUNS = {
    "llama-tp2-pp2": ("llama", 2, 2, 1),
    "llama-tp4-kv-replicated": ("llama", 4, 1, 1),
    "llama_tied-tp1-pp4": ("llama_tied", 1, 4, 1),
    "llama-tp2-dp2": ("llama", 2, 1, 2),
    "qwen3_moe-tp2-pp2": ("qwen3_moe", 2, 2, 1),
    "mixtral-tp2-pp2": ("mixtral", 2, 2, 1),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Compile every run, serve them all in one torchrun launch; (plans, reports folder)."""
    folder = tmp_path_factory.mktemp("torch-serve")
    plans, runs = {}, []
    for name, (fixture, tp, pp, dp) in RUNS.items():
        result = compile_family(None, hf(fixture) / "config.json",
                                Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                                CompileOptions(checkpoint=hf(fixture), out=folder / name))
        plans[name] = result.plan
        runs.append({"name": name, "build": str(folder / name),
                     "package": package_name(result.plan), "checkpoint": str(hf(fixture)),
                     "tp": tp, "pp": pp, "dp": dp})
    assert len({r["package"] for r in runs}) == len(runs)  # one launch imports them all
    reports = torchrun(WORKER, runs, folder)
    return plans, reports


def reports_of(reports: Path, name: str) -> list[tuple[dict, dict]]:
    """(json report, arrays) of every process of run `name`, by global rank."""
    out = []
    for g in range(4):
        report = json.loads((reports / f"{name}-rank-{g}.json").read_text())
        with np.load(reports / f"{name}-rank-{g}.npz") as npz:
            out.append((report, {k: npz[k] for k in npz.files}))
    return out


def reference(fixture: str) -> dict[str, np.ndarray]:
    with np.load(hf(fixture) / "reference.npz") as npz:
        return {k: npz[k] for k in npz.files}


@pytest.mark.parametrize("name", list(RUNS))
def test_every_output_rank_reproduces_hf_logits(served, name):
    _, reports = served
    fixture, tp, pp, dp = RUNS[name]
    want = reference(fixture)["logits"]
    outputs = [(r, a) for r, a in reports_of(reports, name) if r["stage"] == pp - 1]
    assert len(outputs) == tp * dp  # every TP rank of the last stage of every replica
    for report, arrays in outputs:
        got = arrays["logits"]
        assert got.shape == want.shape, report
        error = float(np.max(np.abs(got - want)))
        assert error < TOLERANCE, (report["rank"], error)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_process_loaded_exactly_its_own_rank_and_ran_its_stage(served, name):
    plans, reports = served
    fixture, tp, pp, dp = RUNS[name]
    plan = plans[name]
    topology = BuildTopology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                             data_parallel_size=dp)
    layers = json.loads((hf(fixture) / "config.json").read_text())["num_hidden_layers"]
    covered = []
    for report, arrays in reports_of(reports, name):
        g = report["rank"]
        build_rank = topology.build_rank(g)
        assert report["build_rank"] == build_rank
        expected = {t.target for t in plan.ranks[build_rank].layout.tensors}
        assert set(report["names"]) == expected
        assert ("logits" in arrays) == (report["stage"] == pp - 1)
        assert (report["received"] is None) == (report["stage"] == 0)
        spans = {g.group: g.unit_range for g in plan.ranks[build_rank].partition.groups}
        assert tuple(report["layers"]) == tuple(spans["decoder"])
        if report["dp"] == 0 and report["tp"] == 0:
            covered.append(tuple(report["layers"]))
    # the stages run consecutive layer ranges, together every layer once
    starts = [a for a, _ in sorted(covered)] + [layers]
    assert [b for _, b in sorted(covered)] == starts[1:] and starts[0] == 0


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r[2] > 1])
def test_the_tensor_sent_at_each_cut_is_hf_output_of_the_stage_last_layer(served, name):
    _, reports = served
    fixture = RUNS[name][0]
    want = reference(fixture)["layer_outputs"]
    for report, arrays in reports_of(reports, name):
        if "sent" in arrays:
            last = report["layers"][1] - 1
            error = float(np.max(np.abs(arrays["sent"] - want[last])))
            assert error < TOLERANCE, (report["rank"], last, error)


def test_the_kv_replicated_build_repeats_kv_heads(served):
    plans, _ = served
    layouts = [{t.target: t for t in r.layout.tensors}
               for r in plans["llama-tp4-kv-replicated"].ranks]
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [lay[k].kv_replicas for lay in layouts] == [2, 2, 2, 2]
    assert [lay[k].selection[1] for lay in layouts] == [((0, 16),), ((0, 16),), ((16, 32),),
                                                        ((16, 32),)]


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def two_stage_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("refusals") / "b"
    compile_family(None, hf("llama") / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(policy=ShardingPolicy.REQUIRE, out=out))
    return import_build(out)


def test_a_tp_rank_run_without_its_tp_peers_is_refused_by_the_executor(two_stage_llama):
    # rank 0 holds vocabulary rows 0:66 only: without the TP group's sum, the ids 100 and 130
    # are embedded by no rank
    state = two_stage_llama.load(hf("llama"), rank=0)
    config = json.loads((hf("llama") / "config.json").read_text())
    ids = torch.from_numpy(reference("llama")["input_ids"].astype(np.int64))
    with pytest.raises(ShardingError, match=r"token ids held by \[0, 1\] ranks"):
        run_stage(config, two_stage_llama.rank_module(0), state, TensorParallel(None, 1), None,
                  2, ids)


def test_a_received_boundary_of_the_wrong_dtype_is_refused_by_the_rank_module(two_stage_llama):
    boundary = two_stage_llama.rank_module(2).boundary()
    wire = boundary.resolve(1, 8)
    wrong = [torch.zeros(spec.shape, dtype=torch.float64) for spec in wire.tensors]
    with pytest.raises(BoundaryPayloadError, match="has dtype torch.float64; expected "
                                                        "float32"):
        boundary.decode_tensors(wrong)
