"""An opened checkpoint: one safetensors file or a sharded folder with its index."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from types import MappingProxyType
from typing import Any, cast

from partc.errors import CheckpointError, SourceLocation
from partc.runtime.files import (
    checked_member,
    file_kind,
    join,
    open_regular,
    parent,
    present,
    read_exactly,
    sha256,
    spelled,
    stat_or_none,
)
from partc.runtime.headers import (
    FileHeader,
    TensorEntry,
    TensorTable,
    abort,
    check_name,
    json_kind,
    load_json_object,
    paused_gc,
    read_header,
    unique_object,
)

MAX_INDEX_BYTES = 64 * 1024 * 1024
"""Largest model.safetensors.index.json partc agrees to read (64 MiB; DeepSeek-V3's is 8.9 MB)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A validated checkpoint: one .safetensors file, or the shards of an HF index."""

    path: str
    """The file or directory the checkpoint was opened from, a `str` (not a `Path`: the
    runtime never imports pathlib), spelled as `str(Path(...))` would spell it."""
    index_path: str | None
    """The model.safetensors.index.json used (a `str`, like `path`), or None for a single
    file."""
    files: tuple[FileHeader, ...]
    """The headers of every file, in shard-name order."""
    names: tuple[str, ...]
    """Every tensor name, sorted."""
    owners: Mapping[str, int]
    """Tensor name -> index into `files` of the file holding it."""

    def __contains__(self, name: object) -> bool:
        return name in self.owners

    def tensor(self, name: str) -> tuple[FileHeader, TensorEntry]:
        """The file holding tensor `name` and its entry; CheckpointError when absent."""
        index = 0 if len(self.files) == 1 and name in self.files[0].tensors else (
            self.owners.get(name))
        if index is None:
            close = _suggest(name, self.names)
            hint = f"; did you mean {close!r}?" if close else ""
            abort(self.index_path or self.path, f"tensor {name!r} not in checkpoint{hint}", name)
        header = self.files[index]
        return header, header.tensors[name]

    def signature(self, name: str) -> tuple[FileHeader, str, list[int]] | None:
        """(file, dtype, shape) of tensor `name`, or None: the cheap lookup of header checks."""
        files = self.files
        if len(files) == 1:  # a single file answers without `owners` (a Python Mapping)
            header = files[0]
        else:
            index = self.owners.get(name)
            if index is None:
                return None
            header = files[index]
        found = header.tensors.signature(name)
        return None if found is None else (header, found[0], found[1])

    def header_entries(self, names: list[str]
                       ) -> tuple[list[int], list[dict[str, Any]]] | None:
        """The index into `files` and the validated header entry ({dtype, shape,
        data_offsets}) of each of `names`, in their order; None when one is not in the
        checkpoint. A read looks up every tensor at once here, in C-level maps: the
        `tensor` lookup, a TensorEntry built through three Python calls a name, cost a
        165-tensor load ~0.5 ms (issue 18)."""
        files = self.files
        if len(files) == 1:
            entries = files[0].tensors.header_entries(names)
            if None in entries:
                return None
            return [0] * len(names), cast("list[dict[str, Any]]", entries)
        where = list(map(self.owners.get, names))
        if None in where:
            return None
        indices = cast("list[int]", where)
        tables = [header.tensors for header in files]
        found = [tables[index].header_entries([name])[0] for index, name in zip(
            indices, names, strict=True)]
        return indices, cast("list[dict[str, Any]]", found)  # each name is in its file

    def header_digest(self) -> str:
        """sha256 over the stored header bytes of every file, in file order: equal only for
        byte-identical headers (cheap; `fingerprint` is the layout-independent identity)."""
        if len(self.files) == 1:
            return self.files[0].digest
        return sha256(" ".join(f.digest for f in self.files).encode()).hexdigest()

    def fingerprint_error(self, expected: str, header_digest: str | None, *, override: str,
                          explain: Callable[[], str] | None = None) -> CheckpointError | None:
        """The error when this checkpoint's fingerprint is not `expected` (None when it is).

        When `header_digest` (of the checkpoint `expected` was taken from) equals this one's,
        the headers are byte-identical and the fingerprint is not recomputed. `override` names
        how to skip the check. `explain`, called only once the fingerprints differ, says what
        differs (its text follows the two fingerprints; '' says nothing more).
        """
        if header_digest is not None and header_digest == self.header_digest():
            return None
        found = self.fingerprint()
        if found == expected:
            return None
        detail = explain() if explain is not None else ""
        return CheckpointError(
            f"checkpoint header fingerprint {found[:16]} does not match the plan's "
            f"{expected[:16]}{detail}; recompile against this checkpoint or pass {override}",
            location=SourceLocation(str(self.path)))

    def fingerprint(self) -> str:
        """sha256 over every tensor of every file in name order: the JSON arrays of names and
        dtypes, then each shape's length and the dimensions as little-endian u64 (what a plan
        compiled against this checkpoint depends on)."""
        with paused_gc():
            return self._fingerprint()

    def _fingerprint(self) -> str:
        from array import array  # here: a load whose header digest matches never needs it

        names: list[str] = []
        dtypes: list[str] = []
        shapes: list[list[int]] = []
        for header in self.files:
            n, d, s = header.tensors.columns()
            names += n
            dtypes += d
            shapes += s
        if len(self.files) > 1:
            order = sorted(range(len(names)), key=names.__getitem__)
            names = [names[i] for i in order]
            dtypes = [dtypes[i] for i in order]
            shapes = [shapes[i] for i in order]
        digest = sha256(json.dumps(names).encode())
        digest.update(json.dumps(dtypes).encode())
        lengths = array("Q", map(len, shapes))
        dims = array("Q", chain.from_iterable(shapes))
        if sys.byteorder != "little":
            lengths.byteswap()
            dims.byteswap()
        digest.update(lengths.tobytes())
        digest.update(dims.tobytes())
        return digest.hexdigest()


def _suggest(name: str, names: tuple[str, ...]) -> str | None:
    """The tensor name closest to `name`; big checkpoints only consider one-component edits."""
    pool: Iterable[str] = names
    if len(names) > 2000:
        parts = name.split(".")
        pool = [n for n in names if abs(len(n) - len(name)) <= 12
                and len(q := n.split(".")) == len(parts)
                and sum(a != b for a, b in zip(q, parts, strict=True)) <= 1]
    import difflib  # only for the suggestion of an error

    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.75)
    return close[0] if close else None


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a checkpoint directory (model.safetensors or its index), index file or .safetensors.

    A folder holding both model.safetensors and model.safetensors.index.json is read from
    model.safetensors, the index ignored: transformers' `from_pretrained` (5.x) resolves a
    folder so, and partc loads the bytes it loads (name the index file to read the shards).
    Every file is checked before it is opened: it must be a regular file, and a symbolic link
    must resolve inside the checkpoint folder or its Hugging Face cache `blobs/` folder.
    """
    p = spelled(path)
    st = stat_or_none(p, "checkpoint path")
    if st is None:
        abort(p, "no such checkpoint file or directory")
    if stat.S_ISDIR(st.st_mode):
        index, single = join(p, "model.safetensors.index.json"), join(p, "model.safetensors")
        if present(single, "checkpoint file"):
            return _open_single(p, checked_member(p, single, "checkpoint file"))
        if present(index, "checkpoint index"):
            return _open_index(p, checked_member(p, index, "index"))
        abort(p, "checkpoint directory holds neither model.safetensors "
                 "nor model.safetensors.index.json" + _shard_set_hint(p))
    if not stat.S_ISREG(st.st_mode):
        abort(p, "checkpoint path is not a regular file or folder (found "
                 f"{file_kind(st.st_mode)}); expected a .safetensors file, an index or a folder")
    member = checked_member(parent(p), p, "checkpoint file")
    if os.path.basename(p).endswith(".index.json"):
        return _open_index(p, member)
    return _open_single(p, member)


def _shard_set_hint(folder: str) -> str:
    """What a folder without a checkpoint looks like when it is a `partc shard` set that lost
    its manifest: partc's folder marker beside .safetensors files ('' otherwise)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return ""
    files = [n for n in names if n.endswith(".safetensors")]
    if ".partc-build.json" not in names or not files:
        return ""
    return (f"; it holds partc's folder marker (.partc-build.json) and {len(files)} "
            ".safetensors file(s), as a `partc shard` set does, but not the set's manifest "
            "(partc-shards.json), which each rank's load reads its file from: write the set "
            "again with `partc shard`")


def _open_single(origin: str, file: str) -> Checkpoint:
    """A checkpoint made of one .safetensors file."""
    header = read_header(file)
    return Checkpoint(path=origin, index_path=None, files=(header,), names=tuple(header.tensors),
                      owners=_OneFile(header.tensors))


class _OneFile(Mapping[str, int]):
    """`Checkpoint.owners` of a single file: every tensor of `table` is in file 0 (no copy of
    a ~10^5-name index)."""

    __slots__ = ("_table",)

    def __init__(self, table: TensorTable) -> None:
        self._table = table

    def __getitem__(self, name: str) -> int:
        if name not in self._table:
            raise KeyError(name)
        return 0

    def get(self, name: str, default: int | None = None) -> int | None:  # type: ignore[override]
        """0 when tensor `name` is in the file, else `default` (Mapping.get would go through
        `__getitem__` and a KeyError)."""
        return 0 if name in self._table else default

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


def _open_index(origin: str, index: str) -> Checkpoint:
    """A checkpoint described by an HF model.safetensors.index.json."""
    fd, st = open_regular(index, "checkpoint index")
    try:
        if st.st_size > MAX_INDEX_BYTES:
            abort(index, f"index of {st.st_size} bytes exceeds the {MAX_INDEX_BYTES}-byte limit "
                         "(partc.runtime.checkpoint.MAX_INDEX_BYTES); refusing to read it")
        raw = read_exactly(fd, index, 0, st.st_size, "index")
    except MemoryError:
        abort(index, f"ran out of memory reading the index ({st.st_size} bytes)")
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        abort(index, f"index is not valid UTF-8: {exc.reason} at byte {exc.start}")
    except MemoryError:
        abort(index, f"ran out of memory reading the index ({st.st_size} bytes)")
    del raw
    top = load_json_object(index, text, "index")
    if "metadata" in top and not isinstance(top["metadata"], tuple):
        abort(index, f"index metadata must be an object (found {json_kind(top['metadata'])})")
    if not isinstance(top.get("weight_map"), tuple):
        abort(index, "index must have a weight_map object (found "
                     f"{json_kind(top.get('weight_map'))})")
    weight_map = unique_object(index, top["weight_map"], "the weight_map")
    for name, shard in weight_map.items():
        check_name(index, name, "tensor name")
        if type(shard) is not str:
            abort(index, f"weight_map[{name!r}] must be a shard file name (found "
                         f"{json_kind(shard)})", name)
        if (shard in ("", ".", "..") or "/" in shard or "\\" in shard or "\0" in shard
                or os.path.isabs(shard)):
            abort(index, f"shard filename {shard!r} for tensor {name!r} is not a plain file name "
                         "inside the checkpoint directory", name)
    folder = parent(index)
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not present(join(folder, shard), "shard file"):
            abort(index, f"missing shard file {shard} named by the index")
    files = tuple(read_header(checked_member(folder, join(folder, shard), "shard file"))
                  for shard in shards)
    owners: dict[str, int] = {}
    for i, header in enumerate(files):
        for name in header.tensors:
            first = owners.setdefault(name, i)
            if first != i:
                abort(header.path, f"tensor {name!r} is in two shards: {shards[first]} and "
                                   f"{shards[i]}; expected exactly one", name)
    for name, shard in weight_map.items():
        found = owners.get(name)
        if found is None or shards[found] != shard:
            where = f"it is in {shards[found]}" if found is not None else "no shard holds it"
            abort(index, f"tensor {name!r} mapped to {shard} by the index is not in that shard's "
                         f"header ({where})", name)
    for name, i in owners.items():
        if name not in weight_map:
            abort(files[i].path, f"tensor {name!r} in shard {shards[i]} is not in the index's "
                                 "weight_map", name)
    return Checkpoint(path=origin, index_path=index, files=files, names=tuple(sorted(owners)),
                      owners=MappingProxyType(owners))
