"""Payload digests: recorded by `partc shard` and `partc compile --digests`, checked by
`load(..., verify="digest")`, against an oracle built from the safetensors library."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.errors import CheckpointError, LoadError, PartcErrors
from partc.front.schema import load_schema
from partc.plan.topology import Topology
from partc.runtime.manifest import SHARD_MANIFEST, read_shard_manifest
from partc.shard import shard_checkpoint

from support import Recorder, compile_and_import, hf, import_build

LLAMA = hf("llama")


def oracle_digests(checkpoint: Path, plan: Any) -> list[dict[str, str]]:
    """Per rank, sha256 of each local slice cut with numpy from safetensors' own arrays."""
    arrays = load_file(str(checkpoint / "model.safetensors"))
    ranks = []
    for rank in plan.ranks:
        digests = {}
        for item in rank.layout.tensors:
            axis, ranges = item.selection
            array = arrays[item.target]
            if axis is not None:
                array = np.concatenate([np.take(array, range(a, b), axis=axis)
                                        for a, b in ranges], axis=axis)
            assert array.shape == item.local_shape
            digests[item.target] = hashlib.sha256(np.ascontiguousarray(array).tobytes()
                                                  ).hexdigest()
        ranks.append(digests)
    return ranks


def flip_byte_of(file: Path, tensor: str) -> None:
    """Flip one payload byte of `tensor` inside a safetensors file (header untouched)."""
    raw = bytearray(file.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8:8 + size])[tensor]["data_offsets"]
    raw[8 + size + (start + end) // 2] ^= 0x40
    file.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A TP=2 build of the tiny Llama (no digests) and a `partc shard` folder of it."""
    root = tmp_path_factory.mktemp("digests")
    plan = compile_family("llama", LLAMA / "config.json", Topology(tensor_parallel_size=2),
                          CompileOptions(out=root / "build")).plan
    shard_checkpoint(root / "build", LLAMA, root / "shards")
    return root, plan


@pytest.fixture
def sharded(built: tuple[Path, Any]) -> tuple[Path, Any, Any, Path]:
    """The build freshly imported (another test imports a package of the same name), and
    its shard folder."""
    root, plan = built
    return root, plan, import_build(root / "build", plan), root / "shards"


def test_shard_records_the_digest_of_every_tensor_it_wrote(sharded) -> None:
    _, plan, _, shards = sharded
    manifest = json.loads((shards / SHARD_MANIFEST).read_text())
    assert [r["digests"] for r in manifest["ranks"]] == oracle_digests(LLAMA, plan)


def test_a_presharded_folder_verifies_with_verify_digest(sharded) -> None:
    _, plan, package, shards = sharded
    for rank in plan.ranks:
        checked = package.load(shards, rank=rank.rank, verify="digest")
        plain = package.load(shards, rank=rank.rank)
        assert checked.tensors.keys() == plain.tensors.keys()
        for name, array in plain.tensors.items():
            np.testing.assert_array_equal(checked.tensors[name], array)


def test_a_flipped_payload_byte_in_a_rank_file_names_the_tensor_file_and_digests(
        sharded, tmp_path: Path) -> None:
    _, plan, package, shards = sharded
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    target = "model.layers.1.mlp.down_proj.weight"
    rank_file = copy / "rank-01-of-02.safetensors"
    flip_byte_of(rank_file, target)
    package.load(copy, rank=1)  # the header still matches: only the digest can tell
    with pytest.raises(CheckpointError) as caught:
        package.load(copy, rank=1, verify="digest")
    expected = oracle_digests(LLAMA, plan)[1][target]
    error = caught.value
    assert error.tensor == target
    assert error.location is not None and error.location.file == str(rank_file)
    assert f"tensor `{target}` does not match its digest in the shard manifest" in error.message
    assert f"expected sha256 {expected}, found " in error.message
    found = error.message.split("found ")[1].split(" ")[0]
    assert len(found) == 64 and found != expected
    package.load(copy, rank=0, verify="digest")  # rank 0's file is intact


def test_compile_with_digests_records_the_oracle_digests_in_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "build"
    assert main(["compile", "llama", "--config", str(LLAMA / "config.json"), "--tp", "2",
                 "--pp", "2", "--checkpoint", str(LLAMA), "--digests", "--out", str(out)]) == 0
    document = json.loads((out / "plan.json").read_text())
    plan = compile_family("llama", LLAMA / "config.json",
                          Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                          CompileOptions(checkpoint=LLAMA)).plan
    assert document["digests"] == oracle_digests(LLAMA, plan)
    jsonschema.Draft202012Validator(load_schema("plan.schema.json")).validate(document)
    assert document["plan_hash"] != plan.plan_hash  # the digests are part of the hash
    without = {k: v for k, v in document.items() if k not in ("digests", "plan_hash")}
    assert without == {k: v for k, v in plan.to_json().items() if k != "plan_hash"}


def test_a_plan_without_digests_has_no_digest_key_and_no_digest_table(tmp_path: Path) -> None:
    result = compile_family("llama", LLAMA / "config.json", Topology(tensor_parallel_size=2),
                            CompileOptions(checkpoint=LLAMA, out=tmp_path / "build"))
    document = json.loads((tmp_path / "build" / "plan.json").read_text())
    assert "digests" not in document and result.plan.payload_digests is None
    assert (tmp_path / "build" / "plan.json").read_text() == result.plan.document[1]
    for path, text in result.files.items():
        assert "DIGESTS" not in text and "digests=" not in text, path


def test_a_build_with_digests_verifies_the_original_checkpoint_and_catches_a_flipped_byte(
        tmp_path: Path) -> None:
    plan, package = compile_and_import("llama", LLAMA / "config.json", tmp_path / "build",
                                       tp=2, checkpoint=LLAMA, digests=True)
    for rank in plan.ranks:
        package.load(LLAMA, rank=rank.rank, verify="digest")
    copy = tmp_path / "ck"
    copy.mkdir()
    shutil.copy(LLAMA / "model.safetensors", copy / "model.safetensors")
    target = "model.embed_tokens.weight"
    flip_byte_of(copy / "model.safetensors", target)
    package.load(copy, rank=0)  # same header, same fingerprint
    with pytest.raises((CheckpointError, PartcErrors)) as caught:
        package.load(copy, rank=0, verify="digest")
    errors = caught.value.errors if isinstance(caught.value, PartcErrors) else [caught.value]
    assert [e.tensor for e in errors] == [target]
    assert errors[0].location is not None
    assert errors[0].location.file == str(copy / "model.safetensors")
    expected = dict(plan.payload_digests[0])[target]
    assert f"does not match its digest in the build's plan: expected sha256 {expected}" \
        in errors[0].message


def test_verify_digest_without_recorded_digests_is_a_clear_error(sharded, tmp_path: Path
                                                                 ) -> None:
    _, _, package, shards = sharded
    recorder = Recorder()
    package.load(LLAMA, rank=0, reader=recorder)
    assert recorder.runs, "a load reads (and the recorder hears of it)"
    recorder = Recorder()
    with pytest.raises(CheckpointError, match="verify='digest' needs recorded digests, but this "
                       "build was compiled without digests; compile with `partc compile ... "
                       "--checkpoint DIR --digests`") as caught:
        package.load(LLAMA, rank=0, verify="digest", reader=recorder)
    assert recorder.runs == [], "refused before any payload is read"
    assert caught.value.location is not None and caught.value.location.file == str(LLAMA)
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    manifest = json.loads((copy / SHARD_MANIFEST).read_text())
    for entry in manifest["ranks"]:
        del entry["digests"]
    (copy / SHARD_MANIFEST).write_text(json.dumps(manifest))
    recorder = Recorder()
    with pytest.raises(CheckpointError, match="its shard manifest records none") as caught:
        package.load(copy, rank=0, verify="digest", reader=recorder)
    assert recorder.runs == [], "refused before the rank file is read"
    assert caught.value.location is not None
    assert caught.value.location.file == str(copy / SHARD_MANIFEST)
    with pytest.raises(CheckpointError, match="verify must be None or 'digest', found 'sha1'"):
        package.load(LLAMA, rank=0, verify="sha1")


@pytest.mark.parametrize("digests", [["0" * 64], {"x": "0" * 63}, {"x": "A" * 64}, {"x": 1}])
def test_a_malformed_manifest_digest_is_refused_when_the_manifest_is_read(
        sharded, tmp_path: Path, digests: object) -> None:
    """The manifest's digests are parsed with it: a bad one fails before any tensor is read,
    naming the manifest, whether or not the load verifies digests."""
    _, _, package, shards = sharded
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    manifest = json.loads((copy / SHARD_MANIFEST).read_text())
    manifest["ranks"][1]["digests"] = digests
    (copy / SHARD_MANIFEST).write_text(json.dumps(manifest))
    parsed = read_shard_manifest(shards)
    assert parsed is not None and parsed.rank_digests(1) == manifest_before(shards)[1]
    for verify in (None, "digest"):
        with pytest.raises(CheckpointError) as caught:
            package.load(copy, rank=0, verify=verify)
        assert caught.value.message == ("the shard manifest's digests of rank 1 must map "
                                        "tensor names to 64 lowercase hex digits")
        assert caught.value.location.file == str(copy / SHARD_MANIFEST)


def manifest_before(folder: Path) -> list[dict[str, str]]:
    """The digests of every rank as the manifest file holds them (read with json)."""
    return [entry["digests"] for entry in json.loads((folder / SHARD_MANIFEST).read_text())[
        "ranks"]]


def test_digests_need_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LoadError, match="digests need a checkpoint to read"):
        compile_family("llama", LLAMA / "config.json", None, CompileOptions(digests=True))
    with pytest.raises(SystemExit) as exited:  # on the command line, a usage error
        main(["compile", "llama", "--config", str(LLAMA / "config.json"), "--digests",
              "--out", str(tmp_path / "b")])
    assert exited.value.code == 2
    assert "partc compile: error: --digests needs --checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_shard_checks_every_slice_against_the_digests_compiled_into_the_build(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A build compiled with --digests is bound to its checkpoint's bytes: `partc shard` of a
    corrupted copy is refused naming the tensor, its file and both digests (computed here
    from safetensors' own arrays), and no shard set appears; an earlier one stays as it was."""
    plan, _ = compile_and_import("llama", LLAMA / "config.json", tmp_path / "build", tp=2,
                                 checkpoint=LLAMA, digests=True)
    shard_checkpoint(tmp_path / "build", LLAMA, tmp_path / "good")
    assert manifest_before(tmp_path / "good") == oracle_digests(LLAMA, plan)
    before = {p.name: p.read_bytes() for p in (tmp_path / "good").iterdir()}
    copy = tmp_path / "ck"
    copy.mkdir()
    shutil.copy(LLAMA / "model.safetensors", copy / "model.safetensors")
    target = "model.layers.1.self_attn.o_proj.weight"
    flip_byte_of(copy / "model.safetensors", target)
    good, bad = oracle_digests(LLAMA, plan), oracle_digests(copy, plan)
    rank = next(r for r in range(2) if good[r][target] != bad[r][target])
    assert [n for n in good[rank] if good[rank][n] != bad[rank][n]] == [target]
    for out in ("fresh", "good"):
        status = main(["shard", str(tmp_path / "build"), "--checkpoint", str(copy), "--out",
                       str(tmp_path / out), "--force"])
        err = capsys.readouterr().err
        assert status == 1
        assert err.startswith(f"error: {copy / 'model.safetensors'}")
        assert (f"tensor `{target}` does not match its digest in the build's plan: expected sha256 "
                f"{good[rank][target]}, found {bad[rank][target]}") in err
    assert not (tmp_path / "fresh").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "good").iterdir()} == before
