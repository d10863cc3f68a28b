"""`--split chunk`: uneven splits follow torch.chunk (DTensor's Shard, transformers' TP), recorded
in the plan, so that to_dtensors accepts them; where torch.chunk cannot be a partc split, a located
compile error or the to_dtensors refusal. The default output is unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.numpy import load_file, save_file

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.errors import LaunchError, PartcError
from partc.parallel.specs import ShardingPolicy
from partc.plan.topology import Topology
from partc.runtime.dtensor import dtensor_specs

from support import HF, ROOT, edited_family, import_build

LLAMA = HF / "llama"
DISTRIBUTED = Path(__file__).resolve().parent / "distributed"
VOCABULARY = ("model.embed_tokens.weight", "lm_head.weight")


def _chunk(tmp_path: Path, tp: int, config: Path = LLAMA / "config.json", name: str = "b",
           family: Path | None = None, **options):
    return compile_family(family, config, Topology(tensor_parallel_size=tp),
                          CompileOptions(split="chunk", policy=ShardingPolicy.REPLICATE_UNSUPPORTED,
                                         out=tmp_path / name, **options))


def _config(tmp_path: Path, **changes) -> Path:
    config = json.loads((LLAMA / "config.json").read_text()) | changes
    path = tmp_path / "config" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def test_vocabulary_ranges_at_t8_are_torch_chunks_and_recorded_in_the_plan(tmp_path):
    result = _chunk(tmp_path, 8)
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["topology"]["split"] == "chunk"
    jsonschema.validate(plan, json.loads((ROOT / "schemas" / "plan.schema.json").read_text()))
    pieces = torch.arange(131).chunk(8)  # the oracle: torch.chunk itself
    assert len(pieces) == 8
    for rank in result.plan.ranks:
        for target in VOCABULARY:
            axis, ranges = rank.layout[target].selection
            assert axis == 0 and len(ranges) == 1
            assert list(range(*ranges[0])) == pieces[rank.tensor_parallel_rank].tolist()
    # the same build without --split keeps partc's balanced ranges (rank 7: 115:131)
    balanced = compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=8),
                              CompileOptions(policy=ShardingPolicy.REPLICATE_UNSUPPORTED))
    assert balanced.plan.ranks[7].layout["lm_head.weight"].selection == (0, ((115, 131),))
    assert "split" not in balanced.plan.to_json()["topology"]


def test_default_and_explicit_balanced_builds_are_byte_identical(tmp_path):
    default = compile_family(None, LLAMA / "config.json",
                             Topology(tensor_parallel_size=2, pipeline_parallel_size=2))
    explicit = compile_family(None, LLAMA / "config.json",
                              Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                              CompileOptions(split="balanced"))
    assert default.files == explicit.files
    chunk = compile_family(None, LLAMA / "config.json",
                           Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                           CompileOptions(split="chunk"))
    # 131 over 2 is the same under both rules, but the plan records the rule: a new hash
    assert chunk.plan.plan_hash != default.plan.plan_hash
    assert [r.layout for r in chunk.plan.ranks] == [r.layout for r in default.plan.ranks]


def test_every_rank_of_a_t8_chunk_build_is_dtensor_and_rebuilds_the_checkpoint(tmp_path):
    _chunk(tmp_path, 8)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, str(DISTRIBUTED / "fake_mesh_worker.py"), str(tmp_path / "b"),
         str(LLAMA), "partc_llama_tp8_pp1", "8"],
        capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert len(report["tensors"]) == len(load_file(str(LLAMA / "model.safetensors")))
    # DTensor's own idea of rank 7's rows is torch.chunk's 119:131
    assert report["sharded"]["lm_head.weight"][7] == [119, 12]


def test_a_balanced_t8_build_is_still_refused_by_to_dtensors(tmp_path):
    compile_family(None, LLAMA / "config.json", Topology(tensor_parallel_size=8),
                   CompileOptions(policy=ShardingPolicy.REPLICATE_UNSUPPORTED, out=tmp_path / "b"))
    layout = import_build(tmp_path / "b").load(LLAMA, rank=7).layout
    with pytest.raises(LaunchError, match=r"would hold 119:131 there; compile with "
                                              r"`--split chunk`"):
        dtensor_specs(layout, 8, 7)


def test_a_rank_torch_chunk_leaves_empty_is_a_located_compile_error(tmp_path):
    # 16 heads of 4 split evenly over 16 ranks; vocabulary 131 over 16: chunks of 9 run out
    # after 15 ranks (torch.arange(131).chunk(16) has 15 pieces)
    config = _config(tmp_path, num_attention_heads=16, num_key_value_heads=16, head_dim=4)
    assert len(torch.arange(131).chunk(16)) == 15
    with pytest.raises(PartcError) as caught:
        compile_family(None, config, Topology(tensor_parallel_size=16),
                       CompileOptions(split="chunk"))
    message = str(caught.value)
    assert "torch.chunk cuts 131 into 15 chunks of at most 9 over 16 ranks, leaving TP rank 15 " \
        "empty" in message
    assert caught.value.location is not None and caught.value.location.line > 0
    assert "llama.yaml" in caught.value.location.file
    # balanced ranges give every rank a part: the same compile succeeds without --split chunk
    compile_family(None, config, Topology(tensor_parallel_size=16))


def test_check_takes_split_chunk_and_refuses_what_its_compile_refuses(tmp_path, capsys):
    config = _config(tmp_path, num_attention_heads=16, num_key_value_heads=16, head_dim=4)
    assert main(["check", "--config", str(config), "--tp", "16"]) == 0
    capsys.readouterr()
    assert main(["check", "--config", str(config), "--tp", "16", "--split", "chunk"]) == 1
    assert "leaving TP rank 15 empty" in capsys.readouterr().err
    assert main(["check", "--config", str(LLAMA / "config.json"), "--tp", "2", "--pp", "2",
                 "--activation-dtype", "float16", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


def test_partition_units_torch_chunk_leaves_empty_are_refused(tmp_path):
    # intermediate 130 over 16 ranks: chunks of 9 fill 15 ranks
    config = _config(tmp_path, num_attention_heads=16, num_key_value_heads=16, head_dim=4,
                     vocab_size=144, intermediate_size=130)
    with pytest.raises(PartcError, match=r"it has 130 partition units.*torch.chunk cuts 130 into "
                                         r"15 chunks of at most 9 over 16 ranks, leaving TP rank "
                                         r"15 empty"):
        compile_family(None, config, Topology(tensor_parallel_size=16),
                       CompileOptions(split="chunk"))


def test_head_aligned_units_keep_the_refusal_at_to_dtensors_time(tmp_path):
    # 7 heads of 8 over 4 ranks: torch.chunk of the heads gives rank 1 heads 2:4 (rows 16:32);
    # DTensor's Shard(0) of the 56 rows would hold 14:28, which cuts a head
    config = _config(tmp_path, hidden_size=56, num_attention_heads=7, num_key_value_heads=7,
                     head_dim=8)
    result = _chunk(tmp_path, 4, config)
    layout = result.plan.ranks[1].layout
    q = layout["model.layers.0.self_attn.q_proj.weight"]
    assert q.logical_range == (2, 4) and q.selection == (0, ((16, 32),))
    with pytest.raises(LaunchError, match=r"self_attn\.[qkv]_proj\.weight`: partc split "
                                              r"axis 0 of 56 so that TP rank 1 holds 16:32, but "
                                              r"DTensor's Shard\(0\) \(torch.chunk\) would "
                                              r"hold 14:28"):
        dtensor_specs(layout, 4, 1)


def test_explain_names_the_chunk_rule(tmp_path, capsys):
    config = _config(tmp_path, hidden_size=56, num_attention_heads=7, num_key_value_heads=7,
                     head_dim=8)
    _chunk(tmp_path, 4, config)
    assert main(["explain", str(tmp_path / "b"), "model.layers.0.self_attn.q_proj.weight"]) == 0
    assert "7 units do not divide evenly by TP=4: torch.chunk ranges (--split chunk) of 2, 2, " \
        "2, 1 units" in capsys.readouterr().out


def test_cli_split_chunk_and_a_bad_split_value(tmp_path, capsys):
    code = main(["compile", "--config", str(LLAMA / "config.json"), "--tp", "8", "--policy",
                 "replicate-unsupported", "--split", "chunk", "--out", str(tmp_path / "b")])
    assert code == 0
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["topology"]["split"] == "chunk"
    with pytest.raises(SystemExit) as caught:
        main(["compile", "--config", str(LLAMA / "config.json"), "--split", "even", "--out",
              str(tmp_path / "c")])
    assert caught.value.code == 2
    assert "invalid choice: 'even'" in capsys.readouterr().err
    with pytest.raises(PartcError, match=r"split must be one of balanced, chunk, found 'even'"):
        compile_family(None, LLAMA / "config.json", None, CompileOptions(split="even"))


def _vocab_130_checkpoint(tmp_path: Path) -> Path:
    """The tiny Llama cut to a 130-row vocabulary: 130 over 4 is 33,33,32,32 balanced but
    33,33,33,31 under torch.chunk."""
    folder = tmp_path / "llama130"
    folder.mkdir()
    tensors = load_file(str(LLAMA / "model.safetensors"))
    for name in VOCABULARY:
        tensors[name] = tensors[name][:130].copy()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((LLAMA / "config.json").read_text()) | {"vocab_size": 130}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_under_torchrun_full_tensor_of_a_chunk_build_is_the_checkpoint_tensor(tmp_path):
    checkpoint = _vocab_130_checkpoint(tmp_path)
    # KV replication off (a DTensor cannot repeat KV heads): attention falls back to replication
    family = edited_family(tmp_path, "llama", "kv_replication: true", "kv_replication: false")
    result = _chunk(tmp_path, 4, checkpoint / "config.json", family=family)
    assert result.plan.ranks[3].layout["lm_head.weight"].selection == (0, ((99, 130),))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    reports = tmp_path / "reports"
    reports.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
         str(DISTRIBUTED / "dtensor_worker.py"), str(tmp_path / "b"), str(checkpoint),
         "partc_llama_tp4_pp1", "4", "1"],
        capture_output=True, text=True, timeout=240, env={**env, "PARTC_TEST_REPORTS":
                                                          str(reports)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(p.read_text()) for p in sorted(reports.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in found) == [0, 1, 2, 3]
    assert all(r["checked"] == len(r["names"]) and r["sharded"] > 0 for r in found)
