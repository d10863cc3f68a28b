"""Pre-sharded export: cut a checkpoint into one safetensors file per rank of a build.

`partc shard BUILD --checkpoint DIR --out OUT` checks the checkpoint header against the build's
plan (names, dtypes, shapes, fingerprint) before reading any payload, then streams each rank's
slices into `rank-<r>-of-<n>.safetensors` and writes a manifest tying the files to the plan
hash, with the sha256 of every tensor written (for `load(..., verify="digest")`); a build
compiled with `--digests` has every slice checked against its digests first. The folder is
written through `output.write_atomically`, so a failed export leaves the previous one
untouched, and only an empty folder or an earlier shard set is ever replaced. At most one batch
of one rank's tensors is in memory at a time. A generated loader given the folder reads its own
rank file sequentially.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from partc.emit.render import rank_module_name
from partc.errors import CheckpointError, LoadError, PartcError, SourceLocation, raise_if_any
from partc.output import check_output, write_atomically
from partc.parallel.shape import size_problem
from partc.plan.ir import canonical_json
from partc.plan.plan_file import read_plan
from partc.plan.plan_records import PlanFile
from partc.runtime import ReadOptions, TensorSelection, read_tensors
from partc.runtime.checkpoint import Checkpoint, open_checkpoint
from partc.runtime.digests import byte_batches, compiled_digests, tensor_digest
from partc.runtime.headers import DTYPES, FileHeader
from partc.runtime.loader import (
    header_fingerprint,
    plan_difference,
    recompile_hint,
    renamed_errors,
    renamed_prefix,
    unknown_clause,
    unknown_names,
)
from partc.runtime.manifest import SHARD_FORMAT, SHARD_MANIFEST
from partc.runtime.progress import progress_bar

if TYPE_CHECKING:
    from partc.runtime.progress import ProgressCallback

__all__ = ["RankSlice", "ShardResult", "rank_file_name", "rank_slices", "read_build_plan",
           "safetensors_header", "shard_checkpoint", "write_rank_file",
           "write_shard_set"]



@dataclass(frozen=True, slots=True)
class ShardResult:
    """What `shard_checkpoint` wrote."""

    out: Path
    """The pre-sharded folder."""
    plan_hash: str
    """Hash of the plan the files were cut for."""
    files: tuple[str, ...]
    """Rank file names, in rank order."""
    nbytes: int
    """Tensor bytes written over every rank."""


@dataclass(frozen=True, slots=True)
class RankSlice:
    """One tensor of one rank: where it comes from and what it becomes."""

    target: str
    dtype: str
    local_shape: tuple[int, ...]
    selection: TensorSelection
    digest: str | None = None
    """The sha256 the build records for the slice (compiled with `--digests`), else None."""

    @property
    def nbytes(self) -> int:
        """Bytes of the local slice."""
        return math.prod(self.local_shape) * DTYPES[self.dtype].itemsize


def rank_file_name(rank: int, world_size: int) -> str:
    """File name of one rank's tensors, zero-padded so files sort in rank order."""
    width = max(2, len(str(world_size)))
    return f"rank-{rank:0{width}d}-of-{world_size:0{width}d}.safetensors"


def shard_checkpoint(build: str | os.PathLike[str], checkpoint: str | os.PathLike[str],
                     out: str | os.PathLike[str], *, verify_fingerprint: bool = True,
                     workers: int | None = None, progress: bool | None = None,
                     force: bool = False, report: ProgressCallback | None = None
                     ) -> ShardResult:
    """Write one safetensors file per rank of `build` plus a manifest into `out`, atomically.

    `force` is `partc.output.write_atomically`'s (write through a link, replace a build).
    `progress` draws one byte bar over the whole set (None: on a terminal only); `report`
    instead hears of the bytes written per rank file (step `write <file>`, unit `B`).
    """
    if workers is not None and (problem := size_problem("workers", workers)) is not None:
        raise CheckpointError(problem)
    plan = read_build_plan(Path(build))
    ranks = rank_slices(Path(build), plan)
    opened = open_checkpoint(Path(checkpoint))
    errors: list[PartcError] = list(_check_header(plan, opened, verify_fingerprint))
    raise_if_any(errors)
    inputs = [("checkpoint", checkpoint), ("build", build)]
    check_output(out, kind="shard", inputs=inputs, force=force)

    def read(batch: list[RankSlice]) -> dict[str, np.ndarray[Any, Any]]:
        """One batch of a rank's slices, read from the checkpoint."""
        return read_tensors(opened, [(s.target, s.selection) for s in batch],
                            ReadOptions(workers=workers))

    return write_shard_set(out, plan, ranks, header_fingerprint(opened),
                           lambda rank: read, partial(_digest_mismatch, opened),
                           source_layout=source_layout(opened), inputs=inputs, force=force,
                           progress=progress, report=report)


def source_layout(checkpoint: Checkpoint) -> dict[str, Any]:
    """How the original checkpoint lays its tensors out, for `partc merge` to write it back:
    the index's `metadata` (None for a single file) and each file's name, `__metadata__`, tensor
    names in data order and how its header is spelled (`_header_spelling`)."""
    index: Any = None
    if checkpoint.index_path is not None:
        index = json.loads(Path(checkpoint.index_path).read_bytes()).get("metadata")
    files = []
    for header in checkpoint.files:
        order = sorted(header.tensors, key=lambda name: header.tensors[name].begin)
        files.append({"file": os.path.basename(header.path), "metadata": dict(header.metadata),
                      "tensors": order, **_header_spelling(header, order)})
    return {"files": files, "index_metadata": index}


def _header_spelling(header: FileHeader, order: list[str]) -> dict[str, Any]:
    """How a (validated) header is written, beyond its values: its stored size (the padding),
    the key order of a tensor's entry, and its top-level key order when it is not
    `__metadata__` then the tensors in data order (the safetensors library's)."""
    with open(header.path, "rb") as handle:
        handle.seek(8)
        document = json.loads(handle.read(header.header_size))
    keys = list(document)
    first: Any = next((document[k] for k in keys if k != "__metadata__"), {})
    default = (["__metadata__"] if "__metadata__" in document else []) + order
    return {"header_size": header.header_size, "entry_keys": list(first),
            **({} if keys == default else {"header_keys": keys})}


RankReader = Callable[[list["RankSlice"]], "dict[str, np.ndarray[Any, Any]]"]
"""Reads one batch of one rank's slices: target -> the rank-local array."""


def write_shard_set(out: str | os.PathLike[str], plan: PlanFile, ranks: list[list[RankSlice]],
                    source_fingerprint: str | None, reader: Callable[[int], RankReader],
                    mismatch: Callable[[RankSlice, str], CheckpointError], *,
                    source_layout: Mapping[str, Any] | None,
                    inputs: list[tuple[str, str | os.PathLike[str]]], force: bool = False,
                    progress: bool | None = None, report: ProgressCallback | None = None
                    ) -> ShardResult:
    """Write one safetensors file per rank of `plan` and the manifest into `out`, atomically:
    each rank's slices (`rank_slices`) read a batch at a time by `reader(rank)`, each checked
    against the digest the build records (`mismatch` makes the error), as `partc shard` and
    `partc reshard` both write a set. `source_layout` is the original checkpoint's file layout
    (`source_layout`), recorded for `partc merge`."""
    world = len(ranks)
    plan_hash = plan.plan_hash
    names = [rank_file_name(r, world) for r in range(world)]
    total = sum(s.nbytes for slices in ranks for s in slices)
    files: dict[str, str | Callable[[BinaryIO], None]] = {}
    digests: list[dict[str, str]] = [{} for _ in range(world)]
    with progress_bar(total, "shard", False if report is not None else progress) as update:
        for rank, (name, slices) in enumerate(zip(names, ranks, strict=True)):
            metadata = {"format": "pt", "partc_plan_hash": plan_hash, "partc_rank": str(rank),
                        "partc_world_size": str(world)}
            tick = update if report is None else _file_bytes(report, name, slices)
            files[name] = partial(write_rank_file, reader(rank), mismatch, slices,
                                  safetensors_header(slices, metadata), tick, digests[rank])
        manifest: dict[str, Any] = {
            "format": SHARD_FORMAT, "version": 1, "plan_hash": plan_hash,
            "family": plan.family, "model_type": plan.model_type,
            "topology": dict(plan.topology_json), "source_fingerprint": source_fingerprint,
            "ranks": [{"rank": r, "file": names[r], "bytes": sum(s.nbytes for s in ranks[r]),
                       "tensors": [s.target for s in ranks[r]], "digests": digests[r]}
                      for r in range(world)],
        }
        if source_layout is not None:
            manifest["source_layout"] = source_layout

        def write_manifest(handle: BinaryIO) -> None:
            """The manifest, once every rank file (and so every digest) is written."""
            handle.write(canonical_json(manifest).encode())

        files[SHARD_MANIFEST] = write_manifest  # after the rank files: written in order
        write_atomically(Path(out), files, kind="shard", inputs=inputs, force=force)
    return ShardResult(out=Path(out), plan_hash=plan_hash, files=tuple(names), nbytes=total)


def _file_bytes(report: ProgressCallback, name: str, slices: list[RankSlice]
                ) -> Callable[[int], None]:
    """A byte counter for one rank file that reports `write <name>` done of its bytes."""
    total = sum(s.nbytes for s in slices)
    done = 0

    def update(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        report(f"write {name}", done, total, unit="B")
    return update


def read_build_plan(build: Path) -> PlanFile:
    """The plan.json of a build folder, read back typed."""
    path = build / "plan.json"
    if not os.path.lexists(path):
        raise LoadError(f"no plan.json in {path.parent}; expected a folder written by "
                        "`partc compile`", location=SourceLocation(str(path)))
    return read_plan(path, label="the build's plan.json")


def rank_slices(build: Path, plan: PlanFile) -> list[list[RankSlice]]:
    """Each rank's tensors and selections, from the build's generated rank modules.

    Slices are sorted widest item first, then by name, so every tensor of a rank file is
    aligned, as the safetensors library lays files out.
    """
    world = plan.shape.build_world_size  # N x S: N = E x X under --ep
    packages = [p for p in sorted(build.iterdir()) if (p / "__init__.py").is_file()]
    if len(packages) != 1:
        raise LoadError(f"expected one generated package in {build}, found "
                        f"{[p.name for p in packages]}", location=SourceLocation(str(build)))
    ranks = []
    for rank in range(world):
        path = packages[0] / f"{rank_module_name(rank, world)}.py"
        spec = importlib.util.spec_from_file_location(
            f"_partc_shard_{plan.plan_hash[:16]}_{rank}", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise LoadError(f"the build has no module for rank {rank} ({path.name})",
                            location=SourceLocation(str(path)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if module.PLAN_HASH != plan.plan_hash:
            raise LoadError(f"{path.name} was generated for plan {module.PLAN_HASH[:16]}, "
                            f"plan.json is {plan.plan_hash[:16]}",
                            location=SourceLocation(str(path)))
        recorded = compiled_digests(rank, module.TARGETS, getattr(module, "DIGESTS", None))
        slices = [RankSlice(target=item.target, dtype=item.dtype, local_shape=item.local_shape,
                         selection=TensorSelection(*item.selection),
                         digest=None if recorded is None else recorded.get(item.target, ""))
                  for item in module.layout().tensors]
        slices.sort(key=lambda s: (-DTYPES[s.dtype].itemsize, s.target))
        ranks.append(slices)
    return ranks


def _check_header(plan: PlanFile, checkpoint: Checkpoint, verify_fingerprint: bool
                  ) -> list[CheckpointError]:
    """Every mismatch between the plan's global tensor table and the checkpoint header: the
    tensors missing or of another dtype or shape (the first error also naming the tensors the
    checkpoint holds that the plan does not know), else a fingerprint that differs, explained
    as `load()` explains it (its advice, `--no-verify-fingerprint`, can only help when every
    tensor matches), else, for a plan compiled without a checkpoint, the tensors no rank
    loads."""
    signatures = {item.target: (item.dtype, item.shape) for item in plan.tensors}
    omit = list(plan.omit)
    extra = unknown_names(checkpoint, signatures, omit)
    rename = renamed_prefix([t for t in signatures if t not in checkpoint], checkpoint,
                            signatures)
    if rename is not None:  # said by the hint, not again in the note
        held = {rename.held(t) for t in rename.targets}
        extra = [n for n in extra if n not in held]
    note = (f"; the checkpoint also {unknown_clause(checkpoint, extra)}" if extra else ""
            ) + recompile_hint(plan.checkpoint_fingerprint, checkpoint.path)
    errors: list[CheckpointError] = []
    renamed_said, noted = False, False
    for target, (dtype, shape) in signatures.items():
        if rename is not None and target in rename.targets:
            if not renamed_said:  # at the first of them, once
                errors.extend(renamed_errors(rename, checkpoint))
                renamed_said = True
            continue
        if target not in checkpoint:
            message = f"tensor `{target}` of the plan is not in the checkpoint"
            where = checkpoint.path
        else:
            header, entry = checkpoint.tensor(target)
            if entry.dtype == dtype and tuple(entry.shape) == shape:
                continue
            message = (f"tensor `{target}` is {entry.dtype} {list(entry.shape)} in the "
                       f"checkpoint; the plan expects {dtype} {list(shape)}")
            where = header.path
        errors.append(CheckpointError(message + (note if not noted else ""),
                                      location=SourceLocation(str(where)), tensor=target))
        noted = True
    if errors or not verify_fingerprint:
        return errors
    expected = plan.checkpoint_fingerprint
    if expected is not None:
        mismatch = checkpoint.fingerprint_error(
            expected, plan.checkpoint_header_digest,
            override="--no-verify-fingerprint",
            explain=lambda: plan_difference(checkpoint, signatures, omit, matched=""))
        return [] if mismatch is None else [mismatch]
    if extra:
        return [CheckpointError(
            f"the checkpoint holds {len(extra)} tensor(s) no rank of the plan loads: "
            f"{', '.join(f'`{n}`' for n in extra[:3])}{' ...' if len(extra) > 3 else ''}; "
            "another model's checkpoint?"
            f"{recompile_hint(None, checkpoint.path)} (--no-verify-fingerprint shards it "
            "anyway)",
            location=SourceLocation(str(checkpoint.path)), tensor=extra[0])]
    return []


def safetensors_header(slices: list[RankSlice], metadata: dict[str, str], *,
                       spelling: Mapping[str, Any] | None = None) -> bytes:
    """The 8-byte length and JSON header of a file holding `slices` back to back, as the
    safetensors library writes it (8-byte aligned), or as `spelling` records an original's
    (`source_layout`: its key orders and stored size)."""
    entries: dict[str, Any] = {}
    offset = 0
    order = ("dtype", "shape", "data_offsets") if spelling is None else spelling["entry_keys"]
    for s in slices:
        entry = {"dtype": s.dtype, "shape": list(s.local_shape),
                 "data_offsets": [offset, offset + s.nbytes]}
        entries[s.target] = {key: entry[key] for key in order}
        offset += s.nbytes
    if metadata:
        entries["__metadata__"] = metadata
    keys = (["__metadata__"] if metadata else []) + [s.target for s in slices]
    if spelling is not None:
        keys = spelling.get("header_keys", keys)
    text = json.dumps({key: entries[key] for key in keys}, separators=(",", ":")).encode()
    size = len(text) + (-len(text) % 8) if spelling is None else max(spelling["header_size"],
                                                                      len(text))
    text += b" " * (size - len(text))  # the library's: the data region starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def write_rank_file(read: RankReader,
                    mismatch: Callable[[RankSlice, str], CheckpointError] | None,
                    slices: list[RankSlice], header: bytes,
                    update: Callable[[int], None] | None, digests: dict[str, str],
                    handle: BinaryIO) -> None:
    """Stream `header`, then one rank's slices into `handle`, reading one batch of tensors at a
    time, and record the digest of each into `digests`; a slice whose digest is not the one the
    build records (`--digests`) is refused before it is written, with `mismatch`'s error (the
    output is then discarded; None: the slices record no digest)."""
    handle.write(header)
    if update is not None:
        update(0)  # the file is begun, even when it holds no bytes
    for batch in byte_batches(slices, lambda s: s.nbytes):
        arrays = read(batch)
        for s in batch:
            array = arrays.pop(s.target)
            if array.shape != s.local_shape:
                raise CheckpointError(f"tensor `{s.target}` read as {list(array.shape)}, the "
                                      f"plan expects {list(s.local_shape)}", tensor=s.target)
            digest = tensor_digest(array)
            if s.digest is not None and digest != s.digest:
                assert mismatch is not None, "a slice with a digest needs its mismatch error"
                assert mismatch is not None, "a slice with a digest needs its error"
                raise mismatch(s, digest)
            if array.size:
                handle.write(array.reshape(-1).view("u1").data)
            if update is not None:
                update(s.nbytes)  # bytes written, so a file's count ends at its size
            digests[s.target] = digest
            del array


def _digest_mismatch(checkpoint: Checkpoint, s: RankSlice, found: str) -> CheckpointError:
    """The error for a slice whose payload is not the one the build was compiled against."""
    header, _ = checkpoint.tensor(s.target)
    expected = s.digest or "none (the build's DIGESTS table lacks it)"
    return CheckpointError(
        f"tensor `{s.target}` does not match its digest in the build's plan: expected sha256 "
        f"{expected}, found {found} (the payload bytes differ from the checkpoint the build was "
        "compiled against with --digests); no shard set is written. Shard the checkpoint the "
        "build was compiled against, or compile the build without --digests to cut other "
        "weights", location=SourceLocation(str(header.path)), tensor=s.target)


