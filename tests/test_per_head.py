"""One tensor per head (`sharding: per_head`, StableLM's `q_layernorm.norms.{h}`): each rank
loads the per-head tensors of its own heads and no other's, and every consumer (accounting,
plan, shard sets, inspect, explain, digests, DTensors) sees the same.

The oracle is the safetensors library (the fixture written by transformers) and HF's head to
rank mapping (query heads split in contiguous blocks over the TP ranks, KV head `q // group`,
each KV head repeated on the ranks of its query heads when T exceeds the KV heads).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from partc.api import CompileOptions, check_family, compile_family
from partc.plan.topology import Topology

from support import ROOT, compile_and_load, edited_family, hf

FIXTURE = hf("stablelm_qk")
CONFIG = json.loads((FIXTURE / "config.json").read_text())
NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight")


def hf_heads(tp: int, rank: int) -> tuple[set[int], set[int]]:
    """(query heads, KV heads) of TP rank `rank` in HF's own grouping."""
    heads, kv = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    per_rank = heads // tp
    queries = set(range(rank * per_rank, (rank + 1) * per_rank))
    return queries, {q // (heads // kv) for q in queries}


def expected_norms(tp: int, rank: int) -> set[str]:
    queries, kvs = hf_heads(tp, rank)
    with safe_open(FIXTURE / "model.safetensors", "np") as f:
        names = [n for n in f.keys() if NORM.fullmatch(n)]  # noqa: SIM118
    return {n for n in names if int(NORM.fullmatch(n)[3]) in  # type: ignore[index]
            (queries if NORM.fullmatch(n)[2] == "q" else kvs)}  # type: ignore[index]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_loads_exactly_the_per_head_norms_of_its_heads(tmp_path, tp):
    _, states = compile_and_load(None, FIXTURE / "config.json", tmp_path / "b", FIXTURE, tp=tp)
    stored = load_file(FIXTURE / "model.safetensors")
    everything = {n for n in stored if NORM.fullmatch(n)}
    assert len(everything) == 2 * (4 + 2)
    for rank, state in enumerate(states):
        loaded = {n for n in state.tensors if NORM.fullmatch(n)}
        assert loaded == expected_norms(tp, rank), rank
        for name in loaded:
            assert (state.tensors[name] == stored[name]).all()
        # the rank's accounting counts what it holds, no more
        assert state.info.owned_tensors == len(state.tensors) == len(state.layout)
        assert state.info.local_parameter_bytes == sum(a.nbytes for a in state.tensors.values())
        omitted = set(state.table.omitted_targets())
        assert omitted == everything - loaded
    # every per-head tensor is held somewhere; each query head's norm on exactly one rank
    held = [n for s in states for n in s.tensors if NORM.fullmatch(n)]
    assert set(held) == everything
    assert all(held.count(n) == 1 for n in everything if ".q_layernorm." in n)


def test_the_plan_places_a_per_head_tensor_whole_on_its_heads_ranks_and_omit_elsewhere(tmp_path):
    compile_family(None, FIXTURE / "config.json", Topology(tensor_parallel_size=4),
                   CompileOptions(out=tmp_path / "b"))
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    tensors = {t["target"]: t for t in plan["tensors"]}
    q2 = tensors["model.layers.0.self_attn.q_layernorm.norms.2.weight"]
    assert q2["placements"] == [["omit"], ["omit"], ["replicated"], ["omit"]]
    k1 = tensors["model.layers.0.self_attn.k_layernorm.norms.1.weight"]
    assert k1["placements"] == [["omit"], ["omit"], ["replicated"], ["replicated"]]
    assert k1["kv_replicas"] == 2
    module = (tmp_path / "b" / "partc_stablelm_tp4_pp1" / "rank_00.py").read_text()
    assert ("# model.layers.0.self_attn.q_layernorm.norms.2.weight  not on this rank (another "
            "rank's head)") in module


def test_a_shard_set_gives_each_rank_file_only_its_heads_norms_and_digests_verify(tmp_path):
    from support import import_build

    compile_family(None, FIXTURE / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=tmp_path / "b", checkpoint=FIXTURE, digests=True))
    done = subprocess.run([sys.executable, "-m", "partc", "shard", str(tmp_path / "b"),
                           "--checkpoint", str(FIXTURE), "--out", str(tmp_path / "s")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    package = import_build(tmp_path / "b")
    for rank in range(2):
        with safe_open(tmp_path / "s" / f"rank-{rank:02d}-of-02.safetensors", "np") as f:
            names = {n for n in f.keys() if NORM.fullmatch(n)}  # noqa: SIM118
        assert names == expected_norms(2, rank)
        for source in (FIXTURE, tmp_path / "s"):
            state = package.load(source, rank=rank, verify="digest")
            assert {n for n in state.tensors if NORM.fullmatch(n)} == expected_norms(2, rank)


def test_explain_and_inspect_list_only_the_ranks_holding_a_per_head_tensor(tmp_path):
    compile_family(None, FIXTURE / "config.json", Topology(tensor_parallel_size=4),
                   CompileOptions(out=tmp_path / "b"))
    done = subprocess.run([sys.executable, "-m", "partc", "explain", str(tmp_path / "b"),
                           "model.layers.0.self_attn.k_layernorm.norms.1.weight", "--format",
                           "json"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    explained = json.loads(done.stdout)
    assert [r["rank"] for r in explained["ranks"]] == [2, 3]  # KV head 1's ranks
    assert ("per head: `model.layers.0.self_attn.k_layernorm.norms.1.weight` belongs to one "
            "head; TP ranks 2, 3 hold that head and load it whole, the others do not load it "
            "(`sharding: per_head`)") in explained["why"]
    done = subprocess.run([sys.executable, "-m", "partc", "explain", str(tmp_path / "b"),
                           "layers.0.attention"], capture_output=True, text=True, cwd=ROOT)
    assert re.search(r"\n +0 +0 +0 +0:1 +model\.layers\.0\.self_attn\.q_layernorm\.norms\.1"
                     r"\.weight +not held +-\n", done.stdout), done.stdout
    done = subprocess.run([sys.executable, "-m", "partc", "inspect", str(tmp_path / "b"),
                           "--rank", "0", "--format", "json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    listed = {r["target"] for r in json.loads(done.stdout)["tensors"]}
    assert {n for n in listed if NORM.fullmatch(n)} == expected_norms(4, 0)
    assert len(listed) == json.loads((tmp_path / "b" / "plan.json").read_text())[
        "ranks"][0]["info"]["owned_tensors"]


PER_HEAD_Q = '''      - module: "model.layers.{unit}.self_attn.q_layernorm.norms.{head}"
        sharding: per_head              # one LayerNorm per query head, on its head's ranks
        heads: num_attention_heads
'''


@pytest.mark.parametrize(("old", "new", "tp", "message"), [
    (PER_HEAD_Q, PER_HEAD_Q.replace("        heads: num_attention_heads\n", ""), 2,
     "a `sharding: per_head` projection is one module per head; expected its head count (e.g. "
     "`heads: num_attention_heads`), found none"),
    (PER_HEAD_Q, PER_HEAD_Q.replace("norms.{head}", "norms.0"), 2,
     "a `sharding: per_head` projection names each head's module by `{head}`; expected it in "
     "the module path, found `model.layers.{unit}.self_attn.q_layernorm.norms.0`"),
    (PER_HEAD_Q, PER_HEAD_Q.replace("heads: num_attention_heads", "heads: 3"), 2,
     "`model.layers.0.self_attn.q_layernorm.norms.0.weight` is one of 3 per-head tensors, which "
     "the group's 2 partition units cannot divide into whole heads"),
    (PER_HEAD_Q, PER_HEAD_Q.replace("heads: num_attention_heads", "heads: 3"), 4,
     "`model.layers.0.self_attn.q_layernorm.norms.0.weight` is one of 3 per-head tensors and 3 "
     "heads neither split over nor repeat evenly on tensor_parallel_size 4"),
])
def test_a_per_head_declaration_that_cannot_follow_the_heads_is_refused(tmp_path, old, new, tp,
                                                                        message):
    family = edited_family(tmp_path, "stablelm", old, new)
    errors = check_family(family, FIXTURE / "config.json",
                          topology=Topology(tensor_parallel_size=tp))
    assert any(message in str(e) for e in errors), [str(e) for e in errors]
    located = next(e for e in errors if message in str(e))
    assert str(located).startswith(str(family)), str(located)
