"""The manifest of a pre-sharded folder written by `partc shard`."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from partc.runtime.checkpoint import MAX_INDEX_BYTES
from partc.runtime.files import join, open_regular, parent, read_exactly, spelled, stat_or_none
from partc.runtime.headers import JSON_DECODER, abort

SHARD_MANIFEST = "partc-shards.json"
"""Name of the manifest `partc shard` writes next to the per-rank files."""


SHARD_FORMAT = "partc-shards"
"""The manifest's `format` value."""
_HEX = re.compile(r"[0-9a-f]{64}")
"""A sha256 digest as the manifest records it."""

RankDigests = tuple[tuple[str, str], ...]
"""(tensor name, sha256 hex) of one rank's file, in the manifest's order."""


@dataclass(frozen=True, slots=True)
class ShardManifest:
    """A pre-sharded checkpoint: one safetensors file per rank of one plan."""

    path: str
    """The manifest file, a `str` (not a `Path`: the runtime never imports pathlib), spelled
    as `str(Path(...))` would spell it."""
    plan_hash: str
    """Hash of the plan the files were cut for."""
    source_fingerprint: str | None
    """Header fingerprint of the checkpoint the files were cut from."""
    files: tuple[str, ...]
    """File name of each global rank, in rank order."""
    tensors: tuple[tuple[str, ...], ...]
    """Tensor names of each rank's file, in rank order."""
    digests: tuple[RankDigests | None, ...] = ()
    """Payload digests of each rank's file, in rank order (None: that entry records none, as
    a manifest of an older partc; empty: a manifest without digests at all)."""

    def rank_digests(self, rank: int) -> dict[str, str] | None:
        """The digests recorded for `rank`'s tensors by name; None when it records none."""
        found = self.digests[rank] if 0 <= rank < len(self.digests) else None
        return None if found is None else dict(found)

    def rank_file(self, rank: int) -> str:
        """The file holding `rank`'s tensors (a `str`, next to the manifest)."""
        if not 0 <= rank < len(self.files):
            abort(self.path, f"rank {rank} is outside the pre-sharded ranks "
                             f"0..{len(self.files) - 1}")
        return join(parent(self.path), self.files[rank])


def read_shard_manifest(folder: str | os.PathLike[str]) -> ShardManifest | None:
    """The manifest of a pre-sharded checkpoint folder; None when `folder` holds none."""
    path = join(spelled(folder), SHARD_MANIFEST)
    found = stat_or_none(path, "shard manifest")
    if found is None or not stat.S_ISREG(found.st_mode):
        return None
    fd, st = open_regular(path, "shard manifest")
    try:
        if st.st_size > MAX_INDEX_BYTES:
            abort(path, f"shard manifest of {st.st_size} bytes exceeds the {MAX_INDEX_BYTES}-byte "
                        "limit; refusing to read it")
        raw = read_exactly(fd, path, 0, st.st_size, "shard manifest")
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        abort(path, f"cannot read the shard manifest: {exc}")
    try:
        doc = JSON_DECODER.decode(text)
    except (ValueError, RecursionError, MemoryError) as exc:
        abort(path, f"shard manifest is not valid JSON: {exc}")
    if not isinstance(doc, dict) or doc.get("format") != SHARD_FORMAT or doc.get("version") != 1:
        abort(path, f"not a partc shard manifest: expected format {SHARD_FORMAT!r} version 1")
    ranks, plan_hash = doc.get("ranks"), doc.get("plan_hash")
    fingerprint = doc.get("source_fingerprint")
    if not isinstance(plan_hash, str) or not isinstance(ranks, list) or not (
            fingerprint is None or isinstance(fingerprint, str)):
        abort(path, "shard manifest needs a plan_hash string and a ranks list")
    files, tensors, digests = [], [], []
    for position, item in enumerate(ranks):
        file = item.get("file") if isinstance(item, dict) else None
        names = item.get("tensors") if isinstance(item, dict) else None
        if (not isinstance(item, dict) or item.get("rank") != position
                or not isinstance(file, str) or not isinstance(names, list)
                or not all(isinstance(n, str) for n in names)):
            abort(path, f"shard manifest entry {position} must be {{rank: {position}, file, "
                        "tensors}")
        if (file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file
                or os.path.isabs(file)):
            abort(path, f"rank file {file!r} is not a plain file name inside the folder")
        files.append(file)
        tensors.append(tuple(names))
        digests.append(_rank_digests(path, position, item.get("digests")))
    return ShardManifest(path=path, plan_hash=plan_hash, source_fingerprint=fingerprint,
                         files=tuple(files), tensors=tuple(tensors), digests=tuple(digests))


def _rank_digests(path: str, rank: int, value: object) -> RankDigests | None:
    """The `digests` of one manifest entry, checked: tensor names to sha256 hex digests."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and _HEX.fullmatch(v)
            for k, v in value.items()):
        abort(path, f"the shard manifest's digests of rank {rank} must map tensor names to 64 "
                    "lowercase hex digits")
    return tuple(value.items())
