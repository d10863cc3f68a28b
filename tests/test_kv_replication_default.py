"""KV replication is on in every built-in family whose attention allows it: a tensor-parallel
size above the KV-head count compiles with the built-in family (vLLM's rule,
docs/kv_replication.md), is recorded in plan.json (`kv_replicas`) and printed by compile's
summary; the KV-replicated ranks loaded from the tiny checkpoints reproduce Hugging Face's
logits (`reference.npz`) through the numpy executor; a family turns it off with
`kv_replication: false`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from partc.api import compile_family
from partc.cli.main import main
from partc.errors import ParallelPlanError
from partc.plan.topology import Topology

from executor import RankShard, Selection, forward_pipeline
from support import FULLSIZE, ROOT, compile_and_load, edited_family, hf

GQA = ["gemma2", "gpt_oss", "llama", "llava", "mixtral", "phi", "phi3", "qwen2", "qwen2_moe",
       "qwen2_vl", "qwen3", "qwen3_moe", "stablelm"]
"""Built-in families with grouped-query attention groups partitioned by KV heads that KV
replication is valid for (granite inherits Llama's group)."""
WITHOUT = {"olmo2": "k_norm's statistic spans every KV head (a repeated head would count "
                    "T/K times in its all-reduce)",
           "deepseek_v3": "MLA: no KV heads (units are the attention heads themselves)",
           "bloom": "multi-head", "gpt2": "multi-head", "gpt_neox": "multi-head"}


def _attention_groups(family: str) -> list[dict]:
    text = (ROOT / "architectures" / f"{family}.yaml").read_text()
    return [g for g in yaml.safe_load(text).get("parameters", [])
            if g.get("role") == "attention_heads" and g.get("units") == "num_key_value_heads"]


def test_every_built_in_gqa_attention_group_sets_kv_replication_and_the_others_do_not() -> None:
    for family in GQA:
        (group,) = _attention_groups(family)
        assert group.get("kv_replication") is True, family
    for family in WITHOUT:
        text = (ROOT / "architectures" / f"{family}.yaml").read_text()
        assert "kv_replication" not in text, family


def test_the_two_kv_head_llama_compiles_at_tp4_and_the_summary_says_kv_replication(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "--config", str(hf("llama") / "config.json"), "--tp", "4",
                 "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "KV replication: 3 group(s) repeat KV heads across ranks" in out
    assert "  layers.{0..2}.attention (3 groups): each KV head on 2 ranks (2 tensors each)" in out
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    replicas = {t["target"]: t["kv_replicas"] for t in plan["tensors"]}
    assert replicas["model.layers.0.self_attn.k_proj.weight"] == 2
    assert replicas["model.layers.0.self_attn.q_proj.weight"] == 1


def test_full_size_llama_3_8b_compiles_at_tp16_with_each_of_its_8_kv_heads_on_2_ranks(
        tmp_path: Path) -> None:
    config = FULLSIZE / "Llama-3.1-8B" / "config.json"
    assert json.loads(config.read_text())["num_key_value_heads"] == 8
    plan = compile_family(None, config, Topology(tensor_parallel_size=16)).plan
    k = [rank.layout["model.layers.0.self_attn.k_proj.weight"] for rank in plan.ranks]
    q = [rank.layout["model.layers.0.self_attn.q_proj.weight"] for rank in plan.ranks]
    assert {x.kv_replicas for x in k} == {2}
    assert [x.selection for x in k] == [(0, ((t // 2 * 128, (t // 2 + 1) * 128),))
                                        for t in range(16)]  # KV head t*8//16, head_dim 128
    assert [x.selection for x in q] == [(0, ((t * 256, (t + 1) * 256),)) for t in range(16)]


def test_a_family_turns_it_off_with_kv_replication_false(tmp_path: Path) -> None:
    family = edited_family(tmp_path, "llama", "kv_replication: true", "kv_replication: false")
    with pytest.raises(ParallelPlanError, match="has 2 partition units .* but "
                                                "tensor_parallel_size is 4"):
        compile_family(family, hf("llama") / "config.json", Topology(tensor_parallel_size=4))


def _rank(state) -> RankShard:  # type: ignore[no-untyped-def]
    selections = {}
    for target in state.tensors:
        axis, ranges = state.layout[target].selection
        selections[target] = None if axis is None else Selection(axis=axis, ranges=ranges)
    return RankShard(tensors={k: np.asarray(v, np.float32) for k, v in state.tensors.items()},
                     selections=selections)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_kv_replicated_ranks_loaded_from_the_checkpoint_reproduce_hf_logits(
        tmp_path: Path, name: str) -> None:
    plan, states = compile_and_load(None, hf(name) / "config.json", tmp_path / "b", hf(name),
                                    tp=4)
    assert plan.topology.tensor_parallel_size == 4
    k = [s.layout["model.layers.0.self_attn.k_proj.weight"] for s in states]
    assert [x.kv_replicas for x in k] == [2] * 4
    assert k[0].selection == k[1].selection != k[2].selection == k[3].selection
    config = json.loads((hf(name) / "config.json").read_text())
    with np.load(hf(name) / "reference.npz") as npz:
        ids, logits = npz["input_ids"], npz["logits"]
    layers = range(config["num_hidden_layers"])
    result = forward_pipeline(config, [[_rank(s) for s in states]], [layers], ids)
    error = np.max(np.abs(result.logits - logits)) / np.max(np.abs(logits))
    assert error < 1e-4


def test_a_group_that_cannot_repeat_its_kv_heads_is_not_told_to_try(tmp_path: Path,
                                                                     capsys) -> None:
    # olmo2's k_norm sums its statistic over every KV head: repeating them would count each
    # twice at T=4, so the refusal says why instead of suggesting kv_replication
    assert main(["compile", "--config", str(hf("olmo2") / "config.json"), "--tp", "4",
                 "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "repeating KV heads cannot help here: `model.layers.0.self_attn.k_norm.weight` " \
        "needs a tensor-parallel reduction of its statistic" in err
    assert "set `kv_replication: true`" not in err
