"""`partc shard`: one safetensors file per rank, tied to the plan, loadable by the same loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from partc import shard
from partc.cli.main import main
from partc.errors import CheckpointError, LoadError, PartcError, PartcErrors
from partc.output import MARKER
from partc.runtime import digests
from partc.runtime.manifest import SHARD_MANIFEST, read_shard_manifest
from partc.shard import rank_file_name, shard_checkpoint

from support import Recorder, assert_same_tensors, compile_and_import, hf

LLAMA = hf("llama")
PHI3 = hf("phi3")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any, Path]:
    root = tmp_path_factory.mktemp("shard")
    plan, package = compile_and_import("llama", LLAMA / "config.json", root / "build", tp=2,
                                       pp=2, checkpoint=LLAMA)
    shard_checkpoint(root / "build", LLAMA, root / "sharded")
    return root, plan, package, root / "sharded"


@pytest.mark.parametrize("source", ["single", "index"])
def test_pre_sharded_loading_gives_the_same_tensors_as_direct_loading(
        llama: tuple[Path, Any, Any, Path], source: str) -> None:
    _, plan, package, sharded = llama
    direct_source = LLAMA if source == "single" else LLAMA / "sharded"
    for rank in range(plan.topology.world_size):
        direct = package.load(direct_source, rank=rank)
        pre = package.load(sharded, rank=rank)
        assert_same_tensors(pre.tensors, direct.tensors)
        assert pre.layout == direct.layout and pre.info == direct.info


def test_a_fused_family_shards_and_reloads_identically(tmp_path: Path) -> None:
    plan, package = compile_and_import("phi3", PHI3 / "config.json", tmp_path / "b", tp=2,
                                       checkpoint=PHI3)
    shard_checkpoint(tmp_path / "b", PHI3, tmp_path / "s")
    for rank in range(2):
        assert_same_tensors(package.load(tmp_path / "s", rank=rank).tensors,
             package.load(PHI3, rank=rank).tensors)


def test_a_pre_sharded_rank_reads_only_its_own_file_in_one_sequential_pass(
        llama: tuple[Path, Any, Any, Path]) -> None:
    _, plan, package, sharded = llama
    for rank in range(plan.topology.world_size):
        recorder = Recorder()
        package.load(sharded, rank=rank, reader=recorder)
        own = str(sharded / rank_file_name(rank, plan.topology.world_size))
        assert {path for path, _, _ in recorder.runs} == {own}
        with open(own, "rb") as handle:
            data_start = 8 + int.from_bytes(handle.read(8), "little")
        position = data_start
        for _, offset, length in recorder.runs:
            assert offset == position, "each read continues where the previous one ended"
            position += length
        assert position == Path(own).stat().st_size
        assert len(recorder.runs) == 1, "one preadv over every tensor of a small rank"


def test_the_manifest_ties_every_rank_file_to_the_plan_hash(
        llama: tuple[Path, Any, Any, Path]) -> None:
    _, plan, _, sharded = llama
    plan_hash = plan.to_json()["plan_hash"]
    manifest = json.loads((sharded / SHARD_MANIFEST).read_text())
    assert manifest["plan_hash"] == plan_hash
    assert [r["file"] for r in manifest["ranks"]] == [
        "rank-00-of-04.safetensors", "rank-01-of-04.safetensors",
        "rank-02-of-04.safetensors", "rank-03-of-04.safetensors"]
    assert sorted(p.name for p in sharded.iterdir()) == sorted(
        [MARKER, SHARD_MANIFEST, *(r["file"] for r in manifest["ranks"])])
    for entry, rank in zip(manifest["ranks"], plan.ranks, strict=True):
        assert sorted(entry["tensors"]) == [t.target for t in rank.layout.tensors]
        assert entry["bytes"] == rank.info.local_parameter_bytes
        with safe_open(str(sharded / entry["file"]), "numpy") as handle:
            assert handle.metadata()["partc_plan_hash"] == plan_hash
            assert handle.metadata()["partc_rank"] == str(rank.rank)
        arrays = load_file(str(sharded / entry["file"]))
        for layout in rank.layout.tensors:
            assert arrays[layout.target].shape == layout.local_shape
    parsed = read_shard_manifest(sharded)
    assert parsed is not None and parsed.plan_hash == plan_hash and len(parsed.files) == 4


def test_a_pre_sharded_folder_of_another_plan_is_refused_before_reading(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path) -> None:
    _, _, _, sharded = llama
    _, other = compile_and_import("llama", LLAMA / "config.json", tmp_path / "b", tp=2,
                                  checkpoint=LLAMA)
    recorder = Recorder()
    with pytest.raises(CheckpointError, match="cut for plan .* this loader is plan"):
        other.load(sharded, rank=0, reader=recorder)
    assert recorder.runs == []


def test_inspect_of_a_shard_set_says_what_it_is_and_what_to_inspect_instead(
        llama: tuple[Path, Any, Any, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, _, _, sharded = llama
    assert main(["inspect", str(sharded)]) == 1
    err = capsys.readouterr().err
    assert (f"{sharded} is a `partc shard` set ({SHARD_MANIFEST} and 4 rank file(s)), not a "
            "checkpoint or a build: inspect one rank's file (rank-00-of-04.safetensors)") in err
    assert main(["inspect", str(sharded / rank_file_name(0, 4))]) == 0


def test_one_rank_file_given_as_the_checkpoint_is_named_as_such_before_reading(
        llama: tuple[Path, Any, Any, Path]) -> None:
    _, plan, package, sharded = llama
    recorder = Recorder()
    with pytest.raises(CheckpointError) as caught:
        package.load(sharded / rank_file_name(2, 4), rank=2, reader=recorder)
    assert caught.value.message == (
        f"this file is rank 2's of a `partc shard` set (plan {plan.plan_hash[:16]}), not a "
        "checkpoint: pass the set's folder, whose manifest each rank's load reads its own file "
        "from")
    assert recorder.runs == []


def test_a_rank_file_that_does_not_match_the_plan_is_refused(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path) -> None:
    _, _, package, sharded = llama
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    name = rank_file_name(1, 4)
    arrays = load_file(str(copy / name))
    arrays["model.norm.weight"] = np.zeros(3, np.float32)
    arrays.pop("model.embed_tokens.weight")
    save_file(arrays, str(copy / name))
    with pytest.raises(PartcError) as info:
        package.load(copy, rank=1)
    text = str(info.value)
    assert "`model.norm.weight` in the rank file is not one of rank 1's tensors" in text
    assert "`model.embed_tokens.weight` of the plan is not in the rank file" in text
    # save_file wrote no metadata: the file no longer says which rank and plan it holds
    assert (f"{copy / name}: the rank file's header metadata has no partc_rank or "
            "partc_plan_hash; expected partc_rank '1'") in text


def test_swapped_rank_files_are_refused_naming_the_file_and_both_ranks(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path) -> None:
    _, _, package, sharded = llama
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    first, second = copy / rank_file_name(0, 4), copy / rank_file_name(1, 4)
    with safe_open(str(first), "numpy") as a, safe_open(str(second), "numpy") as b:
        assert sorted(a.keys()) == sorted(b.keys()), "the TP ranks of stage 0: the same names"
    first.rename(tmp_path / "t")
    second.rename(first)
    (tmp_path / "t").rename(second)
    for rank, holds in ((0, 1), (1, 0)):
        recorder = Recorder()
        with pytest.raises(CheckpointError) as info:
            package.load(copy, rank=rank, reader=recorder)
        assert not isinstance(info.value, PartcErrors), "the one error that explains it all"
        assert str(info.value).startswith(f"{copy / rank_file_name(rank, 4)}: ")
        assert (f"holds rank {holds}'s tensors (its metadata partc_rank is '{holds}'), but "
                f"rank {rank} was asked for") in str(info.value)
        assert recorder.runs == [], "refused before any payload is read"
    assert package.load(copy, rank=2).tensors  # the untouched ranks still load


def test_a_rank_file_cut_for_another_plan_is_refused_by_its_metadata(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path) -> None:
    _, plan, package, sharded = llama
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    name = copy / rank_file_name(1, 4)
    with safe_open(str(name), "numpy") as handle:
        metadata = handle.metadata()
    arrays = load_file(str(name))
    save_file(arrays, str(name), metadata={**metadata, "partc_plan_hash": "ab" * 32})
    with pytest.raises(CheckpointError) as info:
        package.load(copy, rank=1)
    own = plan.to_json()["plan_hash"][:16]
    assert str(info.value) == (
        f"{name}: the rank file was cut for plan abababababababab (its metadata "
        f"partc_plan_hash), this loader is plan {own}; run `partc shard` again for this build")


@pytest.mark.parametrize(("manifest", "needle"), [
    ("{", "not valid JSON"),
    ('{"format": "other", "version": 1}', "not a partc shard manifest"),
    ('{"format": "partc-shards", "version": 1, "plan_hash": "x", "ranks": [{"rank": 1}]}',
     "entry 0 must be"),
    ('{"format": "partc-shards", "version": 1, "plan_hash": "x", "ranks": '
     '[{"rank": 0, "file": "../x.safetensors", "tensors": []}]}', "not a plain file name"),
])
def test_a_malformed_manifest_is_reported(tmp_path: Path, manifest: str, needle: str) -> None:
    (tmp_path / SHARD_MANIFEST).write_text(manifest)
    with pytest.raises(CheckpointError, match=needle):
        read_shard_manifest(tmp_path)


def test_shard_checks_the_checkpoint_first_and_leaves_the_previous_output_untouched(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path) -> None:
    root, _, _, _ = llama
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(str(LLAMA / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :-1].copy()
    save_file(tensors, str(bad / "model.safetensors"))
    for verify_fingerprint in (True, False):  # the shape is what is wrong, not the fingerprint
        with pytest.raises(CheckpointError) as caught:
            shard_checkpoint(root / "build", bad, out, verify_fingerprint=verify_fingerprint)
        assert caught.value.message == ("tensor `lm_head.weight` is F32 [131, 63] in the "
                                        "checkpoint; the plan expects F32 [131, 64]")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_a_failure_while_streaming_leaves_the_previous_output_untouched(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root, _, _, _ = llama
    out = tmp_path / "out"
    shard_checkpoint(root / "build", LLAMA, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise CheckpointError("disk on fire")
        return real(*args, **kwargs)

    real = shard.read_tensors
    monkeypatch.setattr(shard, "read_tensors", failing)
    with pytest.raises(CheckpointError, match="disk on fire"):
        shard_checkpoint(root / "build", LLAMA, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_shard_streams_one_batch_of_one_rank_at_a_time(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root, plan, _, _ = llama
    monkeypatch.setattr(digests, "BATCH_BYTES", 20_000)
    batches: list[list[str]] = []
    real = shard.read_tensors

    def spy(checkpoint: Any, requests: Any, *args: Any) -> Any:
        requests = list(requests)
        batches.append([name for name, _ in requests])
        return real(checkpoint, requests, *args)

    monkeypatch.setattr(shard, "read_tensors", spy)
    shard_checkpoint(root / "build", LLAMA, tmp_path / "out")
    sizes = {t.target: t.local_bytes for r in plan.ranks for t in r.layout.tensors}
    largest = max(sizes.values())
    owners = [{t.target for t in r.layout.tensors} for r in plan.ranks]
    for batch in batches:
        assert sum(sizes[n] for n in batch) <= max(20_000, largest)
        assert any(set(batch) <= names for names in owners), "a batch never mixes ranks"
    assert len(batches) > plan.topology.world_size


def test_the_shard_command_writes_the_folder_and_reports_it(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root, plan, _, _ = llama
    status = main(["shard", str(root / "build"), "--checkpoint", str(LLAMA), "--out",
                   str(tmp_path / "s"), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["plan_hash"] == plan.to_json()["plan_hash"]
    assert report["files"] == [rank_file_name(r, 4) for r in range(4)]
    assert report["bytes"] == sum(r.info.local_parameter_bytes for r in plan.ranks)
    status = main(["shard", str(tmp_path), "--checkpoint", str(LLAMA), "--out",
                   str(tmp_path / "t")])
    assert status == 1 and "no plan.json" in capsys.readouterr().err


def test_a_build_folder_without_a_plan_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="no plan.json"):
        shard_checkpoint(tmp_path, LLAMA, tmp_path / "out")
    (tmp_path / "plan.json").write_text("[]")
    with pytest.raises(LoadError, match="not a partc plan"):
        shard_checkpoint(tmp_path, LLAMA, tmp_path / "out")


def test_a_shard_set_that_lost_its_manifest_is_named_as_one(
        llama: tuple[Path, Any, Any, Path], tmp_path: Path) -> None:
    _, _, package, sharded = llama
    copy = tmp_path / "set"
    shutil.copytree(sharded, copy)
    (copy / SHARD_MANIFEST).unlink()
    with pytest.raises(CheckpointError) as caught:
        package.load(copy, rank=0)
    files = len(list(copy.glob("*.safetensors")))
    assert (f"checkpoint directory holds neither model.safetensors nor "
            f"model.safetensors.index.json; it holds partc's folder marker (.partc-build.json) "
            f"and {files} .safetensors file(s), as a `partc shard` set does, but not the set's "
            f"manifest (partc-shards.json)") in str(caught.value), caught.value
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as plain:
        package.load(tmp_path / "empty", rank=0)
    assert "partc shard" not in str(plain.value)
