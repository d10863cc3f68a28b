"""A load (or `partc shard`) refused because the plan and the checkpoint hold different tensors
says which tensors are missing from which side, and, only for a build compiled from the config
alone (plan.json `checkpoint_fingerprint` null), to compile with --checkpoint. The case of the
issue: full-size DeepSeek-V3, whose checkpoint stores an MTP layer (`model.layers.61.*`) that a
config-only plan lacks (its header as a sparse safetensors file: the check reads no payload)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.errors import CheckpointError, PartcErrors
from partc.plan.topology import Topology

from support import FULLSIZE, checkpoint_tensors, compile_and_import, fullsize_checkpoint, hf

LLAMA = hf("llama")
HINT = "this build was compiled without --checkpoint, so its plan has only the tensors the " \
       "config implies: compile with --checkpoint "
EXTRA = "model.layers.0.self_attn.q_norm.weight"  # a Qwen3 tensor no Llama plan knows


def _write(folder: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A checkpoint folder of `tensors`, written by safetensors itself, with Llama's config."""
    folder.mkdir()
    shutil.copy(LLAMA / "config.json", folder / "config.json")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "np"})
    return folder


def _refusal(package: Any, checkpoint: Path, rank: int) -> str:
    """Every error message of rank `rank`'s refused load."""
    with pytest.raises((CheckpointError, PartcErrors)) as caught:
        package.load(checkpoint, rank=rank)
    return str(caught.value)


@pytest.fixture(scope="module")
def llama_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """The 3-layer Llama compiled from its config alone at TP=2 x PP=2 and against its
    checkpoint at TP=2 x PP=1 (packages of distinct names: a load imports its rank modules by
    name): {"config": (plan, package), "checkpoint": (plan, package)}."""
    folder = tmp_path_factory.mktemp("mismatch")
    builds = {"config": compile_and_import("llama", LLAMA / "config.json", folder / "a", tp=2,
                                           pp=2),
              "checkpoint": compile_and_import("llama", LLAMA / "config.json", folder / "b",
                                               tp=2, checkpoint=LLAMA)}
    assert builds["config"][0].checkpoint_fingerprint is None
    assert builds["checkpoint"][0].checkpoint_fingerprint is not None
    return builds


def test_full_size_deepseek_v3_mtp_layer_is_named_with_the_advice_to_compile_with_checkpoint(
        tmp_path: Path) -> None:
    config = FULLSIZE / "DeepSeek-V3" / "config.json"
    assert json.loads(config.read_text())["num_nextn_predict_layers"] == 1
    header = json.loads((FULLSIZE / "DeepSeek-V3" / "safetensors_header.json").read_text())
    mtp = sorted(n for n in header if n.startswith("model.layers.61."))
    plan, package = compile_and_import(None, config, tmp_path / "build", pp=4)
    checkpoint = fullsize_checkpoint("DeepSeek-V3", tmp_path)
    message = _refusal(package, checkpoint, 0)
    assert (f"every tensor of rank 0 matches, but {checkpoint} holds {len(mtp)} tensors the plan "
            f"does not know, all under `model.layers.61.` (`{mtp[0]}`, `{mtp[1]}`, `{mtp[2]}` "
            f"and {len(mtp) - 3} more)") in message
    assert HINT + f"{checkpoint} to plan for the tensors this checkpoint holds" in message
    assert len(mtp) == 1564 and "lacks" not in message  # one side only: the plan's are there


def test_config_only_build_names_a_checkpoint_tensor_no_rank_loads_and_says_to_recompile(
        llama_builds: dict[str, tuple[Any, Any]], tmp_path: Path) -> None:
    plan, package = llama_builds["config"]
    tensors = checkpoint_tensors(LLAMA)
    tensors[EXTRA] = np.ones(16, np.float32)
    folder = _write(tmp_path / "extra", tensors)
    for rank in range(4):
        message = _refusal(package, folder, rank)
        assert (f"every tensor of rank {rank} matches, but {folder / 'model.safetensors'} holds "
                f"1 tensor the plan does not know (`{EXTRA}`)") in message
        assert HINT + str(folder) in message


def test_config_only_build_names_a_plan_tensor_only_other_ranks_load_and_says_to_recompile(
        llama_builds: dict[str, tuple[Any, Any]], tmp_path: Path) -> None:
    plan, package = llama_builds["config"]
    name = "model.layers.2.self_attn.k_proj.weight"  # stage 1's: ranks 2 and 3
    tensors = checkpoint_tensors(LLAMA)
    del tensors[name]
    folder = _write(tmp_path / "missing", tensors)
    message = _refusal(package, folder, 0)
    assert (f"every tensor of rank 0 matches, but {folder / 'model.safetensors'} lacks 1 tensor "
            f"of the plan that other ranks load (`{name}`)") in message
    assert HINT + str(folder) in message


def test_a_rank_missing_its_own_tensor_also_names_what_the_checkpoint_holds_instead(
        llama_builds: dict[str, tuple[Any, Any]], tmp_path: Path) -> None:
    tensors = checkpoint_tensors(LLAMA)
    name = "model.layers.0.self_attn.k_proj.weight"  # stage 0's: ranks 0 and 1
    del tensors[name]
    tensors[EXTRA] = np.ones(16, np.float32)
    folder = _write(tmp_path / "both", tensors)
    said = (f"tensor `{name}` of the plan is not in the checkpoint; the checkpoint holds 1 "
            f"tensor the plan does not know (`{EXTRA}`)")
    config_only = _refusal(llama_builds["config"][1], folder, 0)
    assert said + "; " + HINT + str(folder) in config_only
    against_checkpoint = _refusal(llama_builds["checkpoint"][1], folder, 0)
    assert said in against_checkpoint
    assert "compiled without --checkpoint" not in against_checkpoint


def test_a_build_compiled_against_a_checkpoint_names_the_difference_without_the_advice(
        llama_builds: dict[str, tuple[Any, Any]], tmp_path: Path) -> None:
    plan, package = llama_builds["checkpoint"]
    tensors = checkpoint_tensors(LLAMA)
    tensors[EXTRA] = np.ones(16, np.float32)
    folder = _write(tmp_path / "extra", tensors)
    message = _refusal(package, folder, 0)
    assert f"holds 1 tensor the plan does not know (`{EXTRA}`)" in message
    assert "compiled without --checkpoint" not in message


def test_partc_shard_of_a_config_only_build_says_to_compile_with_checkpoint(
        llama_builds: dict[str, tuple[Any, Any]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    tensors = checkpoint_tensors(LLAMA)
    tensors[EXTRA] = np.ones(16, np.float32)
    folder = _write(tmp_path / "extra", tensors)
    build = tmp_path / "build"
    compile_family("llama", LLAMA / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=build))
    code = main(["shard", str(build), "--checkpoint", str(folder), "--out",
                 str(tmp_path / "shards")])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert f"`{EXTRA}`" in err and HINT + str(folder) in err
    del tensors["model.norm.weight"]
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "np"})
    code = main(["shard", str(build), "--checkpoint", str(folder), "--out",
                 str(tmp_path / "shards")])
    err = capsys.readouterr().err
    assert code != 0
    assert ("tensor `model.norm.weight` of the plan is not in the checkpoint; the checkpoint "
            f"also holds 1 tensor the plan does not know (`{EXTRA}`); " + HINT) in err
