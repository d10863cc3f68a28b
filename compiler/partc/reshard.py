"""Offline resharding: a `partc shard` set of one build rewritten for another, and merged back.

`reshard_shards` reads the shard set of build A and writes the shard set of build B, following
the transfer plan between them (`partc.plan.transfer`): each destination rank's file is made of
the pieces the plan names, each source byte read once per destination rank that needs it, one
batch of one destination rank's tensors in memory at a time. The files and manifest are the ones
`partc shard` writes for B from the original checkpoint, byte for byte (one writer,
`shard.write_shard_set`). `merge_shards` writes the ordinary Hugging Face checkpoint back from
any shard set: the original files, tensor order and `__metadata__` (recorded in the manifest by
`partc shard`), every tensor whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from partc.errors import CheckpointError, LoadError, SourceLocation
from partc.output import check_output, write_atomically
from partc.plan.ir import canonical_json
from partc.plan.plan_records import PlanFile
from partc.plan.transfer import TensorTransfer, plan_selections, plan_transfer, transfer_between
from partc.runtime import ReadOptions, ReadRecorder, TensorSelection, read_tensors
from partc.runtime.checkpoint import Checkpoint, open_checkpoint
from partc.runtime.digests import byte_batches
from partc.runtime.headers import DTYPES
from partc.runtime.manifest import SHARD_MANIFEST, ShardManifest, read_shard_manifest
from partc.shard import (
    RankSlice,
    ShardResult,
    rank_slices,
    read_build_plan,
    safetensors_header,
    shard_checkpoint,
    write_rank_file,
    write_shard_set,
)

if TYPE_CHECKING:
    from partc.runtime.progress import ProgressCallback

__all__ = ["MergeResult", "merge_shards", "reshard_shards"]


@dataclass(frozen=True, slots=True)
class MergeResult:
    """What `merge_shards` wrote."""

    out: Path
    """The checkpoint folder."""
    files: tuple[str, ...]
    """Its safetensors files, in order."""
    nbytes: int
    """Tensor bytes written."""


PIECE_BYTES = 32 << 20
"""Pieces are read from a source file in reads of about this many bytes, so that what is read
and not yet copied into the destination's arrays stays small beside them."""


class _Sources:
    """The rank files of a source shard set, opened on first use."""

    def __init__(self, manifest: ShardManifest, workers: int | None,
                 recorder: ReadRecorder | None = None) -> None:
        self.manifest = manifest
        # exact reads: a reshard reads each destination byte once and nothing else (the
        # read planner's coalescing would also read the gaps between a rank file's pieces)
        self.options = ReadOptions(workers=workers, recorder=recorder, max_fetch_ratio=1.0)
        self.opened: dict[int, Checkpoint] = {}

    def checkpoint(self, rank: int) -> Checkpoint:
        """Source rank `rank`'s file, opened (its header checked) once."""
        found = self.opened.get(rank)
        if found is None:
            found = self.opened[rank] = open_checkpoint(self.manifest.rank_file(rank))
        return found

    def read(self, tensors: list[TensorTransfer]) -> dict[str, np.ndarray[Any, Any]]:
        """Each tensor assembled from its pieces: reads of about PIECE_BYTES per source rank
        and round (a round asks each tensor once), the pieces copied into the destination
        arrays."""
        out = {t.target: np.empty(t.local_shape, DTYPES[t.dtype]) for t in tensors}
        wanted: dict[int, list[list[tuple[str, Any]]]] = {}
        for tensor in tensors:
            seen: dict[int, int] = {}
            for piece in tensor.pieces:
                rounds = wanted.setdefault(piece.source_rank, [])
                turn = seen.get(piece.source_rank, 0)
                seen[piece.source_rank] = turn + 1
                if turn == len(rounds):
                    rounds.append([])
                rounds[turn].append((tensor.target, piece))
        sizes = {t.target: DTYPES[t.dtype].itemsize for t in tensors}
        for rank in sorted(wanted):
            checkpoint = self.checkpoint(rank)
            for requests in (chunk for turn in wanted[rank] for chunk in byte_batches(
                    turn, lambda item: item[1].elements * sizes[item[0]], PIECE_BYTES)):
                selections = [(target, _selection(checkpoint, target, piece.source))
                              for target, piece in requests]
                arrays = read_tensors(checkpoint, [(t, s) for t, (s, _) in selections],
                                      self.options)
                for (target, piece), (_, (_, rest)) in zip(requests, selections, strict=True):
                    out[target][tuple(slice(a, b) for a, b in piece.destination)] = (
                        arrays.pop(target)[rest])
        return out


def _selection(checkpoint: Checkpoint, target: str, box: tuple[tuple[int, int], ...]
               ) -> tuple[TensorSelection, tuple[slice, ...]]:
    """The read of `box` of a source file's tensor (along its first cut axis) and the slice of
    what is read that is the box; a CheckpointError when the file's tensor cannot hold it."""
    header, entry = checkpoint.tensor(target)
    shape = tuple(entry.shape)
    if len(shape) != len(box) or any(b > n for (_, b), n in zip(box, shape, strict=True)):
        raise CheckpointError(f"tensor `{target}` is {list(shape)} in {header.path}; the "
                              f"transfer plan reads {[list(r) for r in box]} of it: the shard set "
                              "is not the one its manifest names", tensor=target,
                              location=SourceLocation(header.path))
    cut = [axis for axis, (a, b) in enumerate(box) if (a, b) != (0, shape[axis])]
    if not cut:
        return TensorSelection(), tuple(slice(None) for _ in box)
    first = cut[0]
    rest = tuple(slice(None) if axis == first else slice(a, b)
                 for axis, (a, b) in enumerate(box))
    return TensorSelection(first, (box[first],)), rest


def _source_set(build: Path, shards: Path) -> tuple[PlanFile, ShardManifest, dict[str, Any]]:
    """Build A's plan, its shard set's manifest (checked against the plan) and the manifest's
    JSON (for the recorded source layout)."""
    plan = read_build_plan(build)
    manifest = read_shard_manifest(shards)
    if manifest is None:
        raise LoadError(f"{shards} holds no {SHARD_MANIFEST}; expected a folder written by "
                        "`partc shard` or `partc reshard`", location=SourceLocation(str(shards)))
    if manifest.plan_hash != plan.plan_hash:
        raise LoadError(f"the shard set in {shards} was cut for plan {manifest.plan_hash[:16]}; "
                        f"the build {build} is plan {plan.plan_hash[:16]}: give the build the "
                        "set was written for", location=SourceLocation(manifest.path))
    document = json.loads(Path(manifest.path).read_bytes())
    return plan, manifest, document


def reshard_shards(source_build: str | os.PathLike[str], shards: str | os.PathLike[str],
                   destination_build: str | os.PathLike[str], out: str | os.PathLike[str], *,
                   workers: int | None = None, progress: bool | None = None,
                   force: bool = False, report: ProgressCallback | None = None,
                   recorder: ReadRecorder | None = None) -> ShardResult:
    """Write the shard set of `destination_build` into `out` from `shards`, the shard set of
    `source_build` (or, when `shards` holds no shard manifest, from the original checkpoint:
    then it is `partc shard`); `recorder` is told of every byte run read from the set."""
    if read_shard_manifest(shards) is None:
        return shard_checkpoint(destination_build, shards, out, workers=workers,
                                progress=progress, force=force, report=report)
    source, manifest, document = _source_set(Path(source_build), Path(shards))
    destination = read_build_plan(Path(destination_build))
    transfer = plan_transfer(source, destination)
    ranks = rank_slices(Path(destination_build), destination)
    _check_slices(destination, ranks)
    inputs = [("shards", shards), ("source build", source_build),
              ("destination build", destination_build)]
    check_output(out, kind="shard", inputs=inputs, force=force)
    sources = _Sources(manifest, workers, recorder)
    by_rank = [{t.target: t for t in r.tensors} for r in transfer.ranks]

    def reader(rank: int) -> Callable[[list[RankSlice]], dict[str, np.ndarray[Any, Any]]]:
        """The reads of destination rank `rank`'s batches."""
        return lambda batch: sources.read([by_rank[rank][s.target] for s in batch])

    return write_shard_set(out, destination, ranks, manifest.source_fingerprint, reader,
                           partial(_digest_mismatch, destination), inputs=inputs,
                           source_layout=document.get("source_layout"), force=force,
                           progress=progress, report=report)


def _check_slices(plan: PlanFile, ranks: list[list[RankSlice]]) -> None:
    """The build's rank modules hold what its plan.json says each rank holds."""
    for rank, (slices, wanted) in enumerate(zip(ranks, plan_selections(plan), strict=True)):
        held = {s.target: (s.selection.axis, s.selection.ranges) for s in slices}
        if held != wanted:
            odd = sorted(set(held) ^ set(wanted)) or sorted(
                t for t in held if held[t] != wanted[t])
            raise LoadError(f"the rank module of rank {rank} does not hold what plan.json "
                            f"says for `{odd[0]}`; compile the build again",
                            location=SourceLocation(str(plan.path)), tensor=odd[0])


def _digest_mismatch(plan: PlanFile, s: RankSlice, found: str) -> CheckpointError:
    """The error for a resharded slice whose bytes are not those the build was compiled for."""
    return CheckpointError(
        f"tensor `{s.target}` does not match its digest in the destination build: expected "
        f"sha256 {s.digest}, found {found} (the shard set holds other weights than the "
        "checkpoint the build was compiled against with --digests); no shard set is written",
        location=SourceLocation(str(plan.path)), tensor=s.target)


def merge_shards(shards: str | os.PathLike[str], build: str | os.PathLike[str],
                 out: str | os.PathLike[str], *, workers: int | None = None,
                 force: bool = False) -> MergeResult:
    """Write the Hugging Face checkpoint back from `shards`, the shard set of `build`: the
    original's files, tensor order and metadata when the manifest records them, else one
    model.safetensors in the safetensors library's order (widest dtype first, then name)."""
    plan, manifest, document = _source_set(Path(build), Path(shards))
    tensors = {t.target: (t.dtype, t.shape) for t in plan.tensors}
    ranks, _ = transfer_between(plan_selections(plan), [dict.fromkeys(tensors, (None, ()))],
                                tensors, where=plan.path)
    whole = {t.target: t for t in ranks[0].tensors}
    layout = document.get("source_layout") or _library_layout(plan)
    missing = [n for f in layout["files"] for n in f["tensors"] if n not in whole]
    if missing:
        raise CheckpointError(
            f"the original checkpoint holds `{missing[0]}`, which no rank of the build loads "
            f"(its `omit`); {len(missing)} tensor(s) cannot be merged back from the shard set",
            location=SourceLocation(manifest.path), tensor=missing[0])
    inputs = [("shards", shards), ("build", build)]
    check_output(out, kind="checkpoint", inputs=inputs, force=force)
    sources = _Sources(manifest, workers)
    files: dict[str, str | Callable[[BinaryIO], None]] = {}
    for entry in layout["files"]:
        slices = [RankSlice(target=n, dtype=whole[n].dtype, local_shape=whole[n].local_shape,
                            selection=TensorSelection()) for n in entry["tensors"]]
        header = safetensors_header(slices, dict(entry["metadata"]),
                                    spelling=entry if "entry_keys" in entry else None)
        files[entry["file"]] = partial(write_rank_file, lambda batch: sources.read(
            [whole[s.target] for s in batch]), None, slices, header, None, {})
    if len(layout["files"]) > 1 or layout.get("index_metadata") is not None:
        files["model.safetensors.index.json"] = _index(layout, whole)
    write_atomically(Path(out), files, kind="checkpoint", inputs=inputs, force=force)
    return MergeResult(out=Path(out), files=tuple(f["file"] for f in layout["files"]),
                       nbytes=sum(t.nbytes for t in whole.values()))


def _library_layout(plan: PlanFile) -> dict[str, Any]:
    """One model.safetensors as the safetensors library lays it out: widest dtype first, then
    by name, `{"format": "pt"}` (a shard set whose manifest records no source layout)."""
    bits = {t.target: DTYPES[t.dtype].itemsize for t in plan.tensors}
    names = sorted(bits, key=lambda n: (-bits[n], n))
    return {"files": [{"file": "model.safetensors", "metadata": {"format": "pt"},
                       "tensors": names}], "index_metadata": None}


def _index(layout: Mapping[str, Any], whole: Mapping[str, TensorTransfer]) -> str:
    """model.safetensors.index.json as transformers writes it (sorted keys, two-space indent)."""
    weight_map = {n: f["file"] for f in layout["files"] for n in f["tensors"]}
    metadata = layout.get("index_metadata")
    if metadata is None:
        metadata = {"total_size": sum(t.nbytes for t in whole.values())}
    return json.dumps({"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))},
                      indent=2, sort_keys=True) + "\n"


def transfer_json(source_build: str | os.PathLike[str],
                  destination_build: str | os.PathLike[str]) -> str:
    """The canonical JSON of the transfer plan between two builds."""
    return canonical_json(plan_transfer(read_build_plan(Path(source_build)),
                                        read_build_plan(Path(destination_build))).to_json())
