"""A build compiled against a checkpoint, loaded with another whose header fingerprint differs:
every rank's refusal says what differs (the plan's tensors the checkpoint lacks, the ones it
holds that the plan does not know, those of another dtype or shape, expected against found),
naming the checkpoint file; a checkpoint of the same tensors still loads its exact slices."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from partc.errors import CheckpointError, PartcErrors
from partc.runtime import loader

from support import assert_same_tensors, checkpoint_tensors, compile_and_import, hf

LLAMA = hf("llama")
PREFIX = "checkpoint header fingerprint "
SUFFIX = "; recompile against this checkpoint or pass verify_fingerprint=False"


@pytest.fixture(scope="module")
def llama_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The 3-layer Llama at TP=2 x PP=2, compiled against its checkpoint: (plan, package)."""
    out = tmp_path_factory.mktemp("fingerprint") / "build"
    plan, package = compile_and_import("llama", LLAMA / "config.json", out, tp=2, pp=2,
                                       checkpoint=LLAMA)
    assert plan.checkpoint_fingerprint is not None
    return plan, package


def _write(folder: Path, tensors: dict[str, np.ndarray], source: Path = LLAMA) -> Path:
    """A checkpoint folder of `tensors`, written by safetensors, with the source's config."""
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "np"})
    return folder


def _owners(plan: Any, target: str) -> set[int]:
    """The ranks whose layout holds `target`."""
    return {rank.rank for rank in plan.ranks
            if target in {t.target for t in rank.layout.tensors}}


def _refusal(package: Any, checkpoint: Path, rank: int) -> str:
    """The message of rank `rank`'s refused load (every error's, for several)."""
    with pytest.raises((CheckpointError, PartcErrors)) as caught:
        package.load(checkpoint, rank=rank)
    return str(caught.value)


def _fingerprint_refusal(package: Any, checkpoint: Path, rank: int) -> str:
    """The message of a load refused by the fingerprint alone (a CheckpointError, as before)."""
    with pytest.raises(CheckpointError) as caught:
        package.load(checkpoint, rank=rank)
    message = caught.value.message
    assert message.startswith(PREFIX) and message.endswith(SUFFIX), message
    return message


def test_a_missing_tensor_is_named_by_every_ranks_load(llama_build: tuple[Any, Any],
                                                       tmp_path: Path) -> None:
    plan, package = llama_build
    name = "model.layers.2.self_attn.k_proj.weight"
    tensors = checkpoint_tensors(LLAMA)
    del tensors[name]
    folder = _write(tmp_path / "missing", tensors)
    owners = _owners(plan, name)
    others = [rank.rank for rank in plan.ranks if rank.rank not in owners]
    assert owners and others, "the case needs ranks that do not load the tensor"
    for rank in owners:  # the owning ranks' own check, as before
        assert f"tensor `{name}` of the plan is not in the checkpoint" in _refusal(
            package, folder, rank)
    for rank in others:
        message = _fingerprint_refusal(package, folder, rank)
        assert (f"every tensor of rank {rank} matches, but {folder / 'model.safetensors'} "
                f"lacks 1 tensor of the plan that other ranks load (`{name}`)") in message


def test_an_extra_tensor_is_named_by_every_ranks_load(llama_build: tuple[Any, Any],
                                                      tmp_path: Path) -> None:
    plan, package = llama_build
    name = "model.layers.0.self_attn.q_norm.weight"  # a Qwen3 tensor the Llama plan lacks
    tensors = checkpoint_tensors(LLAMA)
    tensors[name] = np.ones(16, np.float32)
    folder = _write(tmp_path / "extra", tensors)
    for rank in plan.ranks:
        message = _fingerprint_refusal(package, folder, rank.rank)
        assert (f"{folder / 'model.safetensors'} holds 1 tensor the plan does not know "
                f"(`{name}`)") in message


@pytest.mark.parametrize(("name", "change", "found", "expected"), [
    ("model.embed_tokens.weight", lambda a: a.astype(np.float16), "F16 [131, 64]",
     "F32 [131, 64]"),
    ("model.norm.weight", lambda a: a[:32].copy(), "F32 [32]", "F32 [64]"),
    ("model.layers.1.mlp.down_proj.weight", lambda a: a.T.astype(np.float16).copy(),
     "F16 [128, 64]", "F32 [64, 128]"),
], ids=["dtype", "shape", "both"])
def test_a_tensor_of_another_dtype_or_shape_is_named_with_expected_and_found(
        llama_build: tuple[Any, Any], tmp_path: Path, name: str, change: Any, found: str,
        expected: str) -> None:
    plan, package = llama_build
    tensors = checkpoint_tensors(LLAMA)
    tensors[name] = change(tensors[name])
    folder = _write(tmp_path / "changed", tensors)
    owners = _owners(plan, name)
    others = [rank.rank for rank in plan.ranks if rank.rank not in owners]
    assert owners and others
    for rank in owners:
        assert f"tensor `{name}`" in _refusal(package, folder, rank)
    for rank in others:
        message = _fingerprint_refusal(package, folder, rank)
        assert (f"{folder / 'model.safetensors'} holds 1 tensor in another dtype or shape "
                f"(`{name}` is {found} where the plan expects {expected})") in message


def test_many_differences_are_counted_the_first_few_named_with_partc_check_advised(
        llama_build: tuple[Any, Any], tmp_path: Path) -> None:
    _, package = llama_build
    tensors = checkpoint_tensors(LLAMA)
    gone = sorted(n for n in tensors if n.startswith("model.layers.2."))
    for name in gone:
        del tensors[name]
    tensors["extra.b"] = tensors["extra.a"] = np.zeros(2, np.float32)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float16)
    folder = _write(tmp_path / "many", tensors)
    message = _fingerprint_refusal(package, folder, 0)  # rank 0: stage 0, layers 0-1
    shown = ", ".join(f"`{n}`" for n in gone[:3])
    assert (f"lacks {len(gone)} tensors of the plan that other ranks load ({shown} and "
            f"{len(gone) - 3} more), holds 2 tensors the plan does not know (`extra.a`, "
            "`extra.b`) and holds 1 tensor in another dtype or shape (`model.norm.weight` is "
            "F16 [64] where the plan expects F32 [64]); `partc check FAMILY --config CONFIG "
            "--checkpoint CHECKPOINT` names them all" + SUFFIX) in message


def test_a_sharded_checkpoint_names_its_index_and_the_shard_of_each_tensor(
        llama_build: tuple[Any, Any], tmp_path: Path) -> None:
    plan, package = llama_build
    tensors = checkpoint_tensors(LLAMA)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float16)
    tensors["aaa.extra"] = np.zeros(2, np.float32)
    names = sorted(tensors)
    folder = tmp_path / "sharded"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate((names[:15], names[15:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    rank = min(r.rank for r in plan.ranks if r.rank not in _owners(plan, "model.norm.weight"))
    message = _fingerprint_refusal(package, folder, rank)
    assert (f"{folder / 'model.safetensors.index.json'} holds 1 tensor the plan does not know "
            "(`aaa.extra` in model-00001-of-00002.safetensors) and holds 1 tensor in another "
            "dtype or shape (`model.norm.weight` in model-00002-of-00002.safetensors is F16 "
            "[64] where the plan expects F32 [64])") in message


def test_a_difference_only_among_omitted_tensors_is_said_to_be_there(tmp_path: Path) -> None:
    # GPT-2's family omits the attention-mask buffers: the plan records no dtype or shape
    # of them, only that no rank loads them
    tensors = checkpoint_tensors(hf("gpt2"))
    tensors["transformer.h.0.attn.bias"] = np.ones((1, 1, 4, 4), np.float32)
    compiled = _write(tmp_path / "compiled", tensors, hf("gpt2"))
    _, package = compile_and_import("gpt2", compiled / "config.json", tmp_path / "build", tp=2,
                                    checkpoint=compiled)
    tensors["transformer.h.0.attn.bias"] = np.ones((1, 1, 8, 8), np.float32)
    other = _write(tmp_path / "other", tensors, hf("gpt2"))
    message = _fingerprint_refusal(package, other, 1)
    assert ("holds every tensor of the plan, in its dtype and shape, and no other: what "
            "differs is among the tensors the family omits (`transformer.h.*.attn.bias`, "
            "`transformer.h.*.attn.masked_bias`), which no rank loads") in message
    assert package.load(other, rank=1, verify_fingerprint=False).tensors


def test_an_unchanged_checkpoint_loads_its_slices_without_explaining_anything(
        llama_build: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, package = llama_build
    whole = load_file(str(LLAMA / "model.safetensors"))
    folder = _write(tmp_path / "copy", dict(whole))  # other header bytes, same fingerprint
    assert (folder / "model.safetensors").read_bytes() != (LLAMA / "model.safetensors"
                                                          ).read_bytes()

    def never(*_: Any) -> str:
        raise AssertionError("the difference is computed only once the fingerprints differ")

    monkeypatch.setattr(loader, "_fingerprint_difference", never)
    for rank in plan.ranks:
        state = package.load(folder, rank=rank.rank)
        want = {}
        for item in rank.layout.tensors:
            array = whole[item.target]
            axis, ranges = item.placement.selection(tuple(array.shape))
            if axis is not None:
                array = np.concatenate([np.take(array, range(lo, hi), axis=axis)
                                        for lo, hi in ranges], axis=axis)
            want[item.target] = array
        assert_same_tensors(state.tensors, {name: want[name] for name in state.tensors})
        assert set(state.tensors) == set(want)


def test_a_table_outside_its_build_package_still_says_how_many_tensors_differ(
        llama_build: tuple[Any, Any], tmp_path: Path) -> None:
    # a RankTable no imported module defines: the other ranks' tensors cannot be named, the
    # counts still are, and the load fails as before (a CheckpointError)
    import dataclasses

    from partc.runtime import load_rank

    _, package = llama_build
    tensors = checkpoint_tensors(LLAMA)
    tensors["extra.a"] = np.zeros(2, np.float32)
    folder = _write(tmp_path / "extra", tensors)
    table = dataclasses.replace(package.rank_module(0)._TABLE)
    with pytest.raises(CheckpointError) as caught:
        load_rank(table, folder)
    assert (f"every tensor of rank 0 matches, but {folder / 'model.safetensors'} holds 31 "
            "tensors where the plan has 30") in caught.value.message
    assert caught.value.message.startswith(PREFIX) and caught.value.message.endswith(SUFFIX)
