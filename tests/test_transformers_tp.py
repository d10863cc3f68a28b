"""The transformers interop recipe of docs/transformers_tp.md, run as written: its code block is
extracted from the doc, run under `torchrun --nproc_per_node=2` (gloo), builds the transformers
Llama with its tp_plan on partc's TP mesh and fills every parameter slot from the process's own
partc shard. Both ranks' logits must match Hugging Face's reference.npz."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from partc.api import CompileOptions, compile_family
from partc.emit.render import package_name
from partc.plan.topology import Topology

from support import hf

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "transformers_tp.md"
WORKER = Path(__file__).resolve().parent / "distributed" / "recipe_worker.py"
TOLERANCE = 1e-4


def recipe_block() -> str:
    """The doc's first python code block: the recipe module."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, f"{DOC} has no python code block"
    return blocks[0]


@pytest.fixture(scope="module", params=["llama", "llama_tied"])
def served(tmp_path_factory, request):
    name = request.param  # llama_tied: one embedding tensor, the lm_head tied to it
    folder = tmp_path_factory.mktemp("recipe")
    result = compile_family(None, hf(name) / "config.json", Topology(tensor_parallel_size=2),
                            CompileOptions(checkpoint=hf(name), out=folder / "build"))
    recipe = folder / "transformers_tp.py"
    recipe.write_text(recipe_block())
    reports = folder / "reports"
    reports.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(WORKER), str(recipe),
         str(folder / "build"), package_name(result.plan), str(hf(name))],
        capture_output=True, text=True, timeout=240,
        env={**env, "PARTC_TEST_REPORTS": str(reports), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    out = []
    for g in range(2):
        with np.load(reports / f"rank-{g}.npz") as npz:
            logits = npz["logits"]
        out.append((json.loads((reports / f"rank-{g}.json").read_text()), logits))
    return name, result.plan, out


def test_the_doc_recipe_reproduces_hf_logits_on_every_tp_rank(served):
    name, _, ranks = served
    with np.load(hf(name) / "reference.npz") as npz:
        want = npz["logits"]
    for report, logits in ranks:
        assert logits.shape == want.shape
        error = float(np.max(np.abs(logits - want)))
        assert error < TOLERANCE, (report["rank"], error)


def test_every_parameter_slot_holds_the_rank_shard_partc_loaded_and_none_is_left_on_meta(served):
    model, plan, ranks = served
    for report, _ in ranks:
        params = report["params"]
        layouts = {t.target: t for t in plan.ranks[report["rank"]].layout.tensors}
        assert set(params) == set(layouts)
        for name, param in params.items():
            assert not param["meta"], name
            assert tuple(param["local"]) == tuple(layouts[name].local_shape), name
            assert tuple(param["global"]) == tuple(layouts[name].global_shape), name
        # transformers' plan shards the projections and the vocabulary, partc's shards fill them
        assert params["model.embed_tokens.weight"]["dtensor"]
        vocab_rows = [66 if report["rank"] == 0 else 65, 64]
        assert params["model.embed_tokens.weight"]["local"] == vocab_rows
        # tied: the lm_head is the embedding's filled shard (no tensor of its own on disk)
        assert report["tied"] == (model == "llama_tied")
        assert ("lm_head.weight" in params) == (model != "llama_tied")
        if model != "llama_tied":
            assert params["lm_head.weight"]["local"] == vocab_rows
        assert report["training"] == [], "the recipe returns the model in inference mode"
        with safe_open(str(hf(model) / "model.safetensors"), "pt") as f:  # the stored dtypes
            stored = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
        for name, param in params.items():
            assert param["dtype"] == {"F32": "torch.float32"}[stored[name]], name
        assert params["model.layers.0.self_attn.o_proj.weight"]["local"] == [64, 32]
        assert not params["model.norm.weight"]["dtensor"]


def test_row_and_whole_shards_are_views_of_the_file_and_column_shards_contiguous_copies(served):
    _, plan, ranks = served
    for report, _ in ranks:
        layouts = {t.target: t for t in plan.ranks[report["rank"]].layout.tensors}
        for name, param in report["params"].items():
            assert param["contiguous"], name
            axis, _ = layouts[name].selection
            # zero_copy="private": whole tensors and row slices (axis 0) share the file's
            # copy-on-write mapping; column slices (o_proj, down_proj: axis 1) are copied
            assert param["mapped"] == (axis in (None, 0)), (report["rank"], name, axis)
        assert report["params"]["model.layers.0.self_attn.q_proj.weight"]["mapped"]
        assert not report["params"]["model.layers.0.mlp.down_proj.weight"]["mapped"]


def test_the_recipe_refuses_a_pipeline_build_by_its_stage_count_before_building(tmp_path):
    # a PP=2 build loads half the layers a rank: the recipe says so, not "slots not loaded"
    import importlib.util

    result = compile_family(None, hf("llama") / "config.json",
                            Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                            CompileOptions(out=tmp_path / "build"))
    (tmp_path / "transformers_tp.py").write_text(recipe_block())
    spec = importlib.util.spec_from_file_location("recipe_under_test",
                                                  tmp_path / "transformers_tp.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    sys.path.insert(0, str(tmp_path / "build"))
    try:
        loaders = importlib.import_module(package_name(result.plan))
        with pytest.raises(ValueError, match=r"compile the build with --pp 1 \(this one has 2 "
                                             r"pipeline stages\)"):
            recipe.tp_model_from_partc(loaders, hf("llama"), None)
    finally:
        sys.path.remove(str(tmp_path / "build"))


def test_the_recipe_refuses_a_model_whose_slots_are_not_the_checkpoint_tensors(tmp_path):
    # transformers stacks qwen3_moe's experts in memory (mlp.experts.gate_up_proj): the recipe
    # names the slots partc does not load instead of failing somewhere inside the fill
    result = compile_family(None, hf("qwen3_moe") / "config.json", Topology(tensor_parallel_size=2),
                            CompileOptions(checkpoint=hf("qwen3_moe"), out=tmp_path / "build"))
    recipe = tmp_path / "transformers_tp.py"
    recipe.write_text(recipe_block())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(WORKER), str(recipe),
         str(tmp_path / "build"), package_name(result.plan), str(hf("qwen3_moe"))],
        capture_output=True, text=True, timeout=240,
        env={**env, "PARTC_TEST_REPORTS": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert re.search(r"ValueError: the model has parameter slots partc's build does not load: "
                     r"\['model\.layers\.0\.mlp\.experts\.down_proj', 'model\.layers\.0\.mlp\."
                     r"experts\.gate_up_proj'", done.stderr), done.stderr[-3000:]


def test_the_recipe_on_a_one_rank_mesh_gives_hf_logits(tmp_path):
    # one GPU, one process: on a 1-rank mesh transformers marks parameters Shard(0) where partc's
    # whole tensors are Replicate(); the recipe takes a shard of one rank as the whole
    result = compile_family(None, hf("llama") / "config.json", Topology(tensor_parallel_size=1),
                            CompileOptions(checkpoint=hf("llama"), out=tmp_path / "build"))
    recipe = tmp_path / "transformers_tp.py"
    recipe.write_text(recipe_block())
    reports = tmp_path / "reports"
    reports.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(WORKER), str(recipe),
         str(tmp_path / "build"), package_name(result.plan), str(hf("llama"))],
        capture_output=True, text=True, timeout=240,
        env={**env, "PARTC_TEST_REPORTS": str(reports), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(hf("llama") / "reference.npz") as npz:
        want = npz["logits"]
    with np.load(reports / "rank-0.npz") as npz:
        assert float(np.max(np.abs(npz["logits"] - want))) < TOLERANCE
