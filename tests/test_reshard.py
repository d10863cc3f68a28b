"""`partc reshard` and `partc merge`: a shard set rewritten for another build equals `partc shard`
of that build byte for byte, and merging any shard set gives back the original checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.errors import CheckpointError, LayoutError, LoadError
from partc.plan.topology import Topology
from partc.reshard import merge_shards, reshard_shards
from partc.shard import shard_checkpoint

from support import fixture_folder, hf, policy_for

DENSE_TRIP = [(2, 2, None), (4, 1, None), (1, 1, None), (2, 2, None)]
"""tp2 x pp2 -> tp4 x pp1 (KV heads replicated over 4 ranks) -> tp1 x pp1 -> back."""
EXPERT_TRIP = [(1, 1, 4), (2, 1, 2), (1, 1, 1), (1, 1, 4)]
"""EP=4 -> EP=2 x TP=2 -> EP=1 -> back (T, S, E)."""
SPLIT_EXPERT_TRIP = [(2, 1, (2, 2)), (1, 2, (4, 1)), (2, 1, (2, 2))]
"""EP=2 x ETP=2 (each expert split over 2 ranks) -> EP=4 over 2 stages -> back (T, S, (E, X))."""
FAMILIES = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "deepseek_v3",
            "gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe", "llava", "qwen2_vl", "bamba", "bloom",
            "codegen", "dbrx", "deepseek_v2", "deepseek_v2_qlora", "falcon", "gpt2", "gpt_neox",
            "granite", "jamba", "mamba", "olmo2", "phi", "qwen3_next", "stablelm", "stablelm_qk"]
"""Every built-in family with a tiny fixture (the shared fixture set's and tests/fixtures')."""
EXPERT_FAMILIES = ["deepseek_v3", "gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe", "dbrx",
                   "deepseek_v2", "deepseek_v2_qlora", "jamba", "qwen3_next"]
"""Those of them with routed experts."""

Experts = "int | tuple[int, int] | None"
Key = tuple[str, int, int, Experts]
Sets = Callable[[str, int, int, Experts], tuple[Path, Path]]


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Sets:
    """(build, `partc shard` set from the original) of each (fixture, T, S, E), made once."""
    made: dict[Key, tuple[Path, Path]] = {}

    def get(name: str, tp: int, pp: int, ep: int | tuple[int, int] | None
            ) -> tuple[Path, Path]:
        key = (name, tp, pp, ep)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{name}_{tp}_{pp}_{ep}")
            folder = fixture_folder(name)
            e, x = (ep, 1) if not isinstance(ep, tuple) else ep
            sizes = {} if e is None else {"expert_parallel_size": e,
                                          "expert_tensor_parallel_size": x}
            compile_family(None, folder / "config.json",
                           Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp, **sizes),
                           CompileOptions(out=root / "build", checkpoint=folder,
                                          policy=policy_for(name, tp)))
            shard_checkpoint(root / "build", folder, root / "shards")
            made[key] = (root / "build", root / "shards")
        return made[key]

    return get


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a folder, by name."""
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in sorted(os.listdir(folder))}


def round_trip(sets: Sets, tmp_path: Path, name: str,
               trip: list[tuple[int, int, int | tuple[int, int] | None]]) -> None:
    """Reshard along `trip`, each set equal to `partc shard`'s; the last one merged gives the
    original checkpoint back."""
    original = fixture_folder(name) / "model.safetensors"
    build, previous = sets(name, *trip[0])
    for step, sizes in enumerate(trip[1:]):
        target, direct = sets(name, *sizes)
        out = tmp_path / f"step{step}"
        reshard_shards(build, previous, target, out)
        assert digests(out) == digests(direct), f"{name} {trip[step]} -> {sizes}"
        build, previous = target, out
    merge_shards(previous, build, tmp_path / "merged")
    assert sorted(os.listdir(tmp_path / "merged")) == [".partc-build.json", "model.safetensors"]
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == original.read_bytes()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_dense_round_trip_reshards_as_partc_shard_does_and_merges_to_the_original(
        sets: Sets, tmp_path: Path, name: str) -> None:
    round_trip(sets, tmp_path, name, DENSE_TRIP)


@pytest.mark.parametrize("name", EXPERT_FAMILIES)
def test_an_expert_parallel_round_trip_reshards_as_partc_shard_does(
        sets: Sets, tmp_path: Path, name: str) -> None:
    round_trip(sets, tmp_path, name, EXPERT_TRIP)


@pytest.mark.parametrize("name", ["qwen3_fp8", "deepseek_v3_fp8", "gpt_oss_mxfp4", "llama_mlx4"])
def test_a_quantized_checkpoint_reshards_and_merges_back_byte_for_byte(
        sets: Sets, tmp_path: Path, name: str) -> None:
    # packed weights and scales move as stored bytes; MLX's header (sorted entry keys, no
    # padding) is written back as MLX wrote it
    round_trip(sets, tmp_path, name, [(2, 1, None), (1, 1, None)])


def test_experts_split_over_expert_tensor_parallel_ranks_reshard_as_partc_shard_does(
        sets: Sets, tmp_path: Path) -> None:
    round_trip(sets, tmp_path, "qwen3_moe", SPLIT_EXPERT_TRIP)


@pytest.mark.parametrize(("name", "source", "destination"), [
    ("llama", (2, 2, None), (4, 1, None)), ("qwen3_moe", (1, 1, 4), (2, 1, 2))])
def test_a_reshard_reads_each_destination_byte_once_from_the_source_files(
        sets: Sets, tmp_path: Path, name: str, source: tuple[Any, ...],
        destination: tuple[Any, ...]) -> None:
    from partc.plan.plan_file import read_plan
    from partc.plan.transfer import plan_transfer

    from support import Recorder

    build, shards = sets(name, *source)
    target, _ = sets(name, *destination)
    recorder = Recorder()
    reshard_shards(build, shards, target, tmp_path / "out", recorder=recorder)
    files = {str(shards / f) for f in os.listdir(shards) if f.endswith(".safetensors")}
    assert {path for path, _, _ in recorder.runs} <= files
    wanted = sum(os.path.getsize(tmp_path / "out" / f) - 8 - int.from_bytes(
        (tmp_path / "out" / f).read_bytes()[:8], "little")
        for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
    assert sum(length for _, _, length in recorder.runs) == wanted
    plan = plan_transfer(read_plan(build / "plan.json"), read_plan(target / "plan.json"))
    assert plan.total_bytes == wanted


def test_a_sharded_checkpoint_merges_back_into_its_files_and_index(tmp_path: Path) -> None:
    folder = hf("llama")
    compile_family(None, folder / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=tmp_path / "build", checkpoint=folder))
    shard_checkpoint(tmp_path / "build", folder / "sharded", tmp_path / "shards")
    merge_shards(tmp_path / "shards", tmp_path / "build", tmp_path / "merged")
    originals = sorted(p.name for p in (folder / "sharded").iterdir()
                       if p.name.startswith("model"))
    assert sorted(os.listdir(tmp_path / "merged")) == sorted([".partc-build.json", *originals])
    for name in originals:
        if name.endswith(".safetensors"):
            assert (tmp_path / "merged" / name).read_bytes() == (
                folder / "sharded" / name).read_bytes(), name
    index = "model.safetensors.index.json"
    assert json.loads((tmp_path / "merged" / index).read_text()) == json.loads(
        (folder / "sharded" / index).read_text())


def test_resharding_from_the_original_checkpoint_is_partc_shard(
        sets: Sets, tmp_path: Path) -> None:
    build, shards = sets("llama", 2, 2, None)
    target, direct = sets("llama", 4, 1, None)
    reshard_shards(build, hf("llama"), target, tmp_path / "out")
    assert digests(tmp_path / "out") == digests(direct)


def test_a_shard_set_given_with_another_build_is_refused_naming_both_plans(
        sets: Sets, tmp_path: Path) -> None:
    _, shards = sets("llama", 2, 2, None)
    other, _ = sets("llama", 4, 1, None)
    with pytest.raises(LoadError, match=r"was cut for plan [0-9a-f]{16}; the build .* is plan "):
        reshard_shards(other, shards, other, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_resharding_into_another_family_is_refused(sets: Sets, tmp_path: Path) -> None:
    build, shards = sets("llama", 2, 2, None)
    other, _ = sets("mistral", 2, 2, None)
    with pytest.raises(LayoutError, match=r"the destination is family `llama` \(model type "
                                          r"'mistral'\), the source `llama` \(model type "
                                          r"'llama'\); a transfer needs builds of one family"):
        reshard_shards(build, shards, other, tmp_path / "out")


def test_the_cli_reshards_and_merges_and_reports_a_wrong_set_in_one_line(
        sets: Sets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build, shards = sets("llama", 2, 2, None)
    target, direct = sets("llama", 4, 1, None)
    out = tmp_path / "out"
    assert main(["reshard", "--from", str(build), "--shards", str(shards), "--to", str(target),
                 "--out", str(out), "--quiet"]) == 0
    assert digests(out) == digests(direct)
    assert main(["merge", str(out), "--build", str(target), "--out", str(tmp_path / "m"),
                 "--quiet"]) == 0
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (
        hf("llama") / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["merge", str(out), "--build", str(build), "--out", str(tmp_path / "x")]) != 0
    err = capsys.readouterr().err
    assert "was cut for plan" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_a_tensor_file_of_another_shape_in_the_source_set_is_refused(
        sets: Sets, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    build, shards = sets("llama", 2, 2, None)
    target, _ = sets("llama", 1, 1, None)
    copy = tmp_path / "shards"
    copy.mkdir()
    for name in os.listdir(shards):
        (copy / name).write_bytes((shards / name).read_bytes())
    first = json.loads((shards / "partc-shards.json").read_text())["ranks"][0]["file"]
    tensors: dict[str, Any] = load_file(str(copy / first))
    name = "model.embed_tokens.weight"
    tensors[name] = tensors[name][:5]
    save_file(tensors, str(copy / first))
    with pytest.raises(CheckpointError, match=r"tensor `model.embed_tokens.weight` is \[5, 64\]"):
        reshard_shards(build, copy, target, tmp_path / "out")
