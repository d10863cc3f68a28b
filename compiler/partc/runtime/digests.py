"""Payload digests: the sha256 of every rank-local tensor, recorded when written and checked
when loaded with `verify="digest"`.

A digest is the sha256 of the C-contiguous bytes of one rank-local tensor in its checkpoint
dtype, so the digest of a slice read from the original checkpoint equals the digest of the
same tensor in a `partc shard` rank file. `partc shard` records them in its manifest;
`partc compile --checkpoint DIR --digests` records them in the plan (key `digests`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from partc.errors import CheckpointError, PartcError, SourceLocation, raise_if_any
from partc.runtime._engine.reader import read_tensors
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime._engine.workers import default_workers
from partc.runtime.checkpoint import Checkpoint
from partc.runtime.tables import table_lines

if TYPE_CHECKING:
    from partc.parallel.layout import LocalModelLayout

__all__ = ["BATCH_BYTES", "byte_batches", "compiled_digests", "plan_digests", "tensor_digest",
           "tensor_digests", "verify_digests", "check_digests"]

BATCH_BYTES = 256 << 20
"""Slices are read (for digests, and by `partc shard`) in batches of about this many bytes."""
_Item = TypeVar("_Item")


def tensor_digest(array: np.ndarray[Any, Any]) -> str:
    """sha256 (hex) of the C-contiguous bytes of `array` in its own dtype."""
    import hashlib  # OpenSSL's sha256: fast on large buffers, releases the GIL; only when used

    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return hashlib.sha256(flat.data).hexdigest()


def tensor_digests(tensors: Mapping[str, np.ndarray[Any, Any]], workers: int | None = None
                   ) -> dict[str, str]:
    """The digest of every array, hashed on several threads (hashlib releases the GIL)."""
    names = list(tensors)
    from concurrent.futures import ThreadPoolExecutor  # ~12 ms to import: only when hashing

    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        found = pool.map(lambda name: tensor_digest(tensors[name]), names)
        return dict(zip(names, found, strict=True))


def byte_batches(items: Sequence[_Item], nbytes: Callable[[_Item], int],
                 limit: int | None = None) -> Iterator[list[_Item]]:
    """Consecutive groups of `items` of about `limit` bytes each (default `BATCH_BYTES`; a larger
    item is a batch of its own), so a pass over a rank's tensors holds one batch in memory."""
    limit = BATCH_BYTES if limit is None else limit
    batch: list[_Item] = []
    size = 0
    for item in items:
        if batch and size + nbytes(item) > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes(item)
    if batch:
        yield batch


def plan_digests(layouts: Sequence[LocalModelLayout], checkpoint: Checkpoint,
                 workers: int | None = None,
                 progress: Callable[[int, int], None] | None = None
                 ) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Per rank (`layouts` in rank order), (target, digest) of every rank-local tensor, sorted
    by target: the plan's `payload_digests`.

    Each distinct slice is read once (a tensor replicated over tensor-parallel ranks is read
    and hashed for the first of them), in batches, so memory stays about one batch.
    `progress(done, total)` is called as the ranks are done.
    """
    known: dict[tuple[str, Any], str] = {}
    ranks = []
    for done, layout in enumerate(layouts):
        if progress is not None:
            progress(done, len(layouts))
        items = layout.tensors
        missing = list({(t.target, t.selection): t for t in items
                        if (t.target, t.selection) not in known}.values())
        for batch in byte_batches(missing, lambda layout: layout.local_bytes):
            arrays = read_tensors(checkpoint, [(t.target, TensorSelection(*t.selection))
                                               for t in batch], ReadOptions(workers=workers))
            for item, digest in zip(batch, tensor_digests(arrays, workers).values(),
                                    strict=True):
                known[(item.target, item.selection)] = digest
            del arrays
        ranks.append(tuple(sorted((t.target, known[(t.target, t.selection)]) for t in items)))
    if progress is not None:
        progress(len(layouts), len(layouts))
    return tuple(ranks)


def compiled_digests(rank: int, targets: str | tuple[str, ...],
                     digests: str | tuple[str, ...] | None) -> dict[str, str] | None:
    """The digests a build compiled with `--digests` records in rank `rank`'s module (its
    DIGESTS table, in TARGETS order), by target; None for a build without them."""
    if digests is None:
        return None
    names, found = table_lines(targets), table_lines(digests)
    if len(names) != len(found):
        raise CheckpointError(f"the generated tables of rank {rank} list {len(found)} DIGESTS "
                              f"for {len(names)} TARGETS; regenerate the build")
    return dict(zip(names, found, strict=True))


def verify_digests(tensors: Mapping[str, np.ndarray[Any, Any]], expected: Mapping[str, str],
                   files: Mapping[str, str], source: str, workers: int | None = None) -> None:
    """Compare every array's digest with `expected` (from `source`); CheckpointError per
    mismatch, naming the tensor, its file, the expected and the found digest."""
    found = tensor_digests({n: a for n, a in tensors.items() if n in expected}, workers)
    check_digests(list(tensors), found, expected, files, source)


def check_digests(names: Sequence[str], found: Mapping[str, str], expected: Mapping[str, str],
                  files: Mapping[str, str], source: str) -> None:
    """Compare the digests `found` of the tensors `names` with `expected` (from `source`);
    CheckpointError per tensor without a recorded digest or whose digest differs."""
    errors: list[PartcError] = []
    for name in sorted(set(names) - set(expected)):
        errors.append(CheckpointError(f"tensor `{name}` has no digest in {source}; it cannot "
                                      "be verified", location=SourceLocation(str(files[name])),
                                      tensor=name))
    for name in names:
        if name in expected and found[name] != expected[name]:
            errors.append(CheckpointError(
                f"tensor `{name}` does not match its digest in {source}: expected sha256 "
                f"{expected[name]}, found {found[name]} (the payload bytes differ)",
                location=SourceLocation(str(files[name])), tensor=name))
    raise_if_any(sorted(errors, key=lambda e: e.tensor or ""))

