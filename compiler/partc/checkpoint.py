"""Read safetensors checkpoints: validated headers, sharded indexes and rank-selective reads."""

from __future__ import annotations

import difflib
import gc
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import chain
from operator import add, eq, itemgetter, mul, ne, sub
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, NamedTuple, NoReturn, Protocol

import ml_dtypes
import numpy as np

from partc.errors import CheckpointError, SourceLocation

__all__ = [
    "DTYPES", "MAX_HEADER_SIZE", "WHOLE", "Checkpoint", "CheckpointReader", "FileHeader",
    "ReadRecorder", "TensorEntry", "TensorSelection", "open_checkpoint", "read_header",
    "read_tensor", "read_tensors",
]

MAX_HEADER_SIZE = 100 * 1024 * 1024
"""Largest JSON header partc agrees to parse (100 MiB), as the safetensors library does."""

_NAMED_DTYPES: dict[str, Any] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _NAMED_DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)

DTYPES: Mapping[str, np.dtype[Any]] = MappingProxyType(dict(sorted(_NAMED_DTYPES.items())))
"""Safetensors dtype string -> little-endian numpy dtype (bf16/fp8 through ml_dtypes)."""

_ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in DTYPES.items()}
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_SPAN_LIMIT = 8 << 20
_Ints = np.ndarray[Any, np.dtype[np.int64]]
_IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))


def _fail(path: str | os.PathLike[str], message: str, tensor: str | None = None) -> NoReturn:
    """Raise a CheckpointError located at `path`."""
    raise CheckpointError(message, location=SourceLocation(str(path)), tensor=tensor)


def _kind(value: object) -> str:
    """The JSON kind of a value parsed with objects as tuples of pairs."""
    kinds = {tuple: "object", list: "array", bool: "boolean", type(None): "null", int: "integer",
             float: "number", str: "string"}
    return kinds.get(type(value), type(value).__name__)


def _unique(path: Path, pairs: tuple[tuple[str, Any], ...], where: str) -> dict[str, Any]:
    """Turn a parsed JSON object into a dict, refusing duplicate keys."""
    table = dict(pairs)
    if len(table) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                _fail(path, f"duplicate key {key!r} in {where}; expected every key once")
            seen.add(key)
    return table


def _load_object(path: Path, text: str, what: str) -> dict[str, Any]:
    """Parse JSON text that must be an object; nested objects become tuples of pairs."""
    try:
        doc = json.loads(text, object_pairs_hook=tuple)
    except json.JSONDecodeError as exc:
        _fail(path, f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    except RecursionError:
        _fail(path, f"{what} is not valid JSON: nested too deeply")
    if not isinstance(doc, tuple):
        _fail(path, f"{what} is not a JSON object (found {_kind(doc)})")
    return _unique(path, doc, f"the {what}")


class TensorEntry(NamedTuple):
    """One tensor of a safetensors header; `begin`/`end` are relative to the data region."""

    name: str
    """Tensor name as stored in the file."""
    dtype: str
    """Safetensors dtype string, e.g. 'BF16'."""
    shape: tuple[int, ...]
    """Global shape."""
    begin: int
    """First byte, relative to the start of the data region."""
    end: int
    """One past the last byte, relative to the start of the data region."""

    @property
    def nbytes(self) -> int:
        """Size of the tensor's payload in bytes."""
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class FileHeader:
    """A validated safetensors header: where the data starts and where each tensor lies."""

    path: Path
    """The file the header was read from."""
    header_size: int
    """N, the length in bytes of the JSON header."""
    data_start: int
    """Absolute offset of the data region (8 + N)."""
    file_size: int
    """Size of the file in bytes when the header was read."""
    metadata: tuple[tuple[str, str], ...]
    """The `__metadata__` pairs, in file order."""
    tensors: Mapping[str, TensorEntry]
    """Tensor name -> entry, ordered by name."""


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read and validate the header of one .safetensors file without touching its payload."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                _fail(p, f"truncated file: {size} bytes, expected at least 8 for the header length")
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                _fail(p, f"header length {n} beyond the file of size {size}")
            if n > MAX_HEADER_SIZE:
                _fail(p, f"header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit; refusing it")
            raw = f.read(n)
    except OSError as exc:
        _fail(p, f"cannot read checkpoint file: {exc.strerror or exc}")
    if len(raw) != n:
        _fail(p, f"truncated file: header of {n} bytes but only {len(raw)} could be read")
    return _parse_header(p, raw, size)


def _parse_header(p: Path, raw: bytes, size: int) -> FileHeader:
    """Validate the JSON header bytes of a file of `size` bytes."""
    n = len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(p, f"header is not valid UTF-8: {exc.reason} at header byte {exc.start}")
    gc_enabled = gc.isenabled()
    gc.disable()  # ~1M short-lived containers: collecting them mid-parse doubles the time.
    try:
        metadata, tensors = _parse_tables(p, text, size - 8 - n)
    finally:
        if gc_enabled:
            gc.enable()
    return FileHeader(path=p, header_size=n, data_start=8 + n, file_size=size,
                      metadata=metadata, tensors=MappingProxyType(tensors))


_Columns = tuple[tuple[tuple[str, str], ...], list[str], list[Any], list[Any], list[Any]]


def _parse_tables(p: Path, text: str, data_size: int
                  ) -> tuple[tuple[tuple[str, str], ...], dict[str, TensorEntry]]:
    """Parse and validate the header JSON: metadata pairs and the tensor table ordered by name."""
    columns = _fast_columns(text, data_size) or _careful_columns(p, text, data_size)
    metadata, names, dtypes, shapes, offsets = columns
    begins = list(map(itemgetter(0), offsets))
    ends = list(map(itemgetter(1), offsets))
    new_entry = partial(tuple.__new__, TensorEntry)
    rows = zip(names, dtypes, map(tuple, shapes), begins, ends, strict=True)
    tensors: dict[str, TensorEntry] = dict(zip(names, map(new_entry, rows), strict=True))
    _check_overlaps(p, names, begins, ends)
    return metadata, tensors


def _fast_columns(text: str, data_size: int) -> _Columns | None:
    """Validate a plain, well-formed header with C-level maps only; None when in any doubt.

    Duplicate keys vanish in a plain json.loads, so they are ruled out by counting: without
    backslash escapes every ':' in the text either separates one object member or sits inside a
    string, so the count matches only when no member was dropped.
    """
    if "\\" in text:
        return None
    try:
        table = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if type(table) is not dict:
        return None
    has_meta = "__metadata__" in table
    meta = table.pop("__metadata__", {})
    if type(meta) is not dict or set(map(type, meta.values())) - {str}:
        return None
    names = sorted(table)
    entries = list(map(table.__getitem__, names))
    if entries and set(map(type, entries)) != {dict}:
        return None
    colons = "".join(chain(names, meta, meta.values())).count(":")
    members = len(table) + has_meta + len(meta) + sum(map(len, entries))
    if text.count(":") != members + colons or (entries and set(map(len, entries)) != {3}):
        return None
    try:
        fields = list(map(itemgetter("dtype", "shape", "data_offsets"), entries))
    except KeyError:
        return None
    dtypes, shapes, offsets = (list(column) for column in zip(*fields, strict=True)) if fields \
        else ([], [], [])
    if fields and (set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}
                   or set(map(len, offsets)) != {2}):
        return None
    if not _bulk_valid(dtypes, shapes, offsets, data_size):
        return None
    return tuple(meta.items()), names, dtypes, shapes, offsets


def _careful_columns(p: Path, text: str, data_size: int) -> _Columns:
    """Validate any header entry by entry, raising the precise CheckpointError of a fault."""
    table = _load_object(p, text, "header")
    metadata = _parse_metadata(p, table.pop("__metadata__", ()))
    names = sorted(table)
    dtypes: list[Any] = []
    shapes: list[Any] = []
    offsets: list[Any] = []
    for name in names:
        entry = _parse_entry(p, name, table[name], data_size)
        dtypes.append(entry.dtype)
        shapes.append(list(entry.shape))
        offsets.append([entry.begin, entry.end])
    return metadata, names, dtypes, shapes, offsets


def _bulk_valid(dtypes: list[Any], shapes: list[list[Any]], offsets: list[list[Any]],
                data_size: int) -> bool:
    """Check every entry at once with C-level maps: known dtypes, sizes, offsets in range."""
    try:
        itemsizes = list(map(_ITEMSIZE.get, dtypes))
    except TypeError:  # an unhashable dtype
        return False
    if None in itemsizes:
        return False
    dims = list(chain.from_iterable(shapes))
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0):
        return False
    bounds = list(chain.from_iterable(offsets))
    if bounds and (set(map(type, bounds)) != {int} or min(bounds) < 0
                   or max(bounds) > data_size):
        return False
    sizes = map(mul, map(math.prod, shapes), itemsizes)
    spans = map(sub, map(itemgetter(1), offsets), map(itemgetter(0), offsets))
    return not any(map(ne, sizes, spans))


def _check_overlaps(p: Path, names: list[str], begins: list[int], ends: list[int]) -> None:
    """Refuse two non-empty tensors whose byte ranges overlap."""
    b = np.array(begins, dtype=np.int64)
    e = np.array(ends, dtype=np.int64)
    keep = np.flatnonzero(e > b)
    order = keep[np.argsort(b[keep], kind="stable")]
    bad = np.flatnonzero(b[order][1:] < e[order][:-1])
    if len(bad):
        i, j = int(order[bad[0]]), int(order[bad[0] + 1])
        _fail(p, f"tensor byte ranges overlap: {names[i]!r} spans [{begins[i]}, {ends[i]}) and "
                 f"{names[j]!r} spans [{begins[j]}, {ends[j]}); expected disjoint ranges",
              tensor=names[j])


def _parse_metadata(p: Path, value: object) -> tuple[tuple[str, str], ...]:
    """Validate `__metadata__`: an object of string values."""
    if not isinstance(value, tuple):
        _fail(p, f"__metadata__ must be an object of strings (found {_kind(value)})")
    meta = _unique(p, value, "__metadata__")
    for key, item in meta.items():
        if type(item) is not str:
            _fail(p, f"__metadata__[{key!r}] must be a string (found {_kind(item)})")
    return tuple(meta.items())


def _parse_entry(p: Path, name: str, value: object, data_size: int) -> TensorEntry:
    """Validate one tensor entry of the header against the data region of `data_size` bytes."""
    if type(value) is not tuple:
        _fail(p, f"tensor entry must be an object (found {_kind(value)})", name)
    fields = _unique(p, value, f"the entry of tensor {name!r}")
    if fields.keys() != _ENTRY_FIELDS:
        missing = sorted(_ENTRY_FIELDS - fields.keys())
        extra = sorted(fields.keys() - _ENTRY_FIELDS)
        _fail(p, f"tensor entry must have exactly dtype, shape, data_offsets "
                 f"(missing {missing}, unexpected {extra})", name)
    dtype = fields["dtype"]
    itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        _fail(p, f"unknown dtype {repr(dtype)[:80]}; expected one of {', '.join(DTYPES)}", name)
    shape = fields["shape"]
    if type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):
        _fail(p, f"shape must be a list of non-negative integers (found {repr(shape)[:80]})", name)
    offsets = fields["data_offsets"]
    if (type(offsets) is not list or len(offsets) != 2
            or type(offsets[0]) is not int or type(offsets[1]) is not int):
        _fail(p, f"data_offsets must be [begin, end] integers (found {repr(offsets)[:80]})", name)
    begin, end = offsets
    if not 0 <= begin <= end:
        _fail(p, f"data_offsets must satisfy 0 <= begin <= end (found [{begin}, {end}])", name)
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        _fail(p, f"dtype/shape byte-size mismatch: {dtype} {repr(shape)[:80]} needs {expected} "
                 f"bytes, data_offsets [{begin}, {end}] span {end - begin}", name)
    if end > data_size:
        _fail(p, f"data offsets beyond the file (truncated file?): tensor ends at data byte {end}, "
                 f"the data region holds {data_size} bytes", name)
    return TensorEntry(name, dtype, tuple(shape), begin, end)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A validated checkpoint: one .safetensors file, or the shards of an HF index."""

    path: Path
    """The file or directory the checkpoint was opened from."""
    index_path: Path | None
    """The model.safetensors.index.json used, or None for a single file."""
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
        index = self.owners.get(name)
        if index is None:
            close = _suggest(name, self.names)
            hint = f"; did you mean {close!r}?" if close else ""
            _fail(self.index_path or self.path, f"tensor {name!r} not in checkpoint{hint}", name)
        header = self.files[index]
        return header, header.tensors[name]


def _suggest(name: str, names: tuple[str, ...]) -> str | None:
    """The tensor name closest to `name`; big checkpoints only consider one-component edits."""
    pool: Iterable[str] = names
    if len(names) > 2000:
        parts = name.split(".")
        pool = [n for n in names if abs(len(n) - len(name)) <= 12
                and len(q := n.split(".")) == len(parts)
                and sum(a != b for a, b in zip(q, parts, strict=True)) <= 1]
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.75)
    return close[0] if close else None


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a checkpoint directory (model.safetensors or its index), index file or .safetensors."""
    p = Path(path)
    if p.is_dir():
        index, single = p / "model.safetensors.index.json", p / "model.safetensors"
        if index.is_file():
            return _open_index(p, index)
        if single.is_file():
            return _open_single(p, single)
        _fail(p, "checkpoint directory holds neither model.safetensors "
                 "nor model.safetensors.index.json")
    if p.name.endswith(".index.json"):
        return _open_index(p, p)
    if not p.is_file():
        _fail(p, "no such checkpoint file or directory")
    return _open_single(p, p)


def _open_single(origin: Path, file: Path) -> Checkpoint:
    """A checkpoint made of one .safetensors file."""
    header = read_header(file)
    return Checkpoint(path=origin, index_path=None, files=(header,), names=tuple(header.tensors),
                      owners=MappingProxyType(dict.fromkeys(header.tensors, 0)))


def _open_index(origin: Path, index: Path) -> Checkpoint:
    """A checkpoint described by an HF model.safetensors.index.json."""
    try:
        text = index.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(index, f"cannot read index: {exc}")
    top = _load_object(index, text, "index")
    if "metadata" in top and not isinstance(top["metadata"], tuple):
        _fail(index, f"index metadata must be an object (found {_kind(top['metadata'])})")
    if not isinstance(top.get("weight_map"), tuple):
        _fail(index, f"index must have a weight_map object (found {_kind(top.get('weight_map'))})")
    weight_map = _unique(index, top["weight_map"], "the weight_map")
    for name, shard in weight_map.items():
        if type(shard) is not str:
            _fail(index, f"weight_map[{name!r}] must be a shard file name (found {_kind(shard)})",
                  name)
        if (shard in ("", ".", "..") or "/" in shard or "\\" in shard or "\0" in shard
                or Path(shard).is_absolute()):
            _fail(index, f"shard filename {shard!r} for tensor {name!r} is not a plain file name "
                         "inside the checkpoint directory", name)
    folder = index.parent
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (folder / shard).is_file():
            _fail(index, f"missing shard file {shard} named by the index")
    files = tuple(read_header(folder / shard) for shard in shards)
    owners: dict[str, int] = {}
    for i, header in enumerate(files):
        for name in header.tensors:
            first = owners.setdefault(name, i)
            if first != i:
                _fail(header.path, f"tensor {name!r} is in two shards: {shards[first]} and "
                                   f"{shards[i]}; expected exactly one", name)
    for name, shard in weight_map.items():
        found = owners.get(name)
        if found is None or shards[found] != shard:
            where = f"it is in {shards[found]}" if found is not None else "no shard holds it"
            _fail(index, f"tensor {name!r} mapped to {shard} by the index is not in that shard's "
                         f"header ({where})", name)
    for name, i in owners.items():
        if name not in weight_map:
            _fail(files[i].path, f"tensor {name!r} in shard {shards[i]} is not in the index's "
                                 "weight_map", name)
    return Checkpoint(path=origin, index_path=index, files=files, names=tuple(sorted(owners)),
                      owners=MappingProxyType(owners))


class ReadRecorder(Protocol):
    """Instrumentation told of every byte run actually read from a file."""

    def record(self, path: str, offset: int, length: int) -> None:
        """Note that `length` bytes were read from `path` at absolute `offset`."""


@dataclass(frozen=True, slots=True)
class TensorSelection:
    """The part of a tensor a rank owns: global slices along `axis`, concatenated in order."""

    axis: int | None = None
    """Axis the ranges cut, or None for the whole tensor."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Half-open global ranges [start, end) along `axis`, concatenated in this order."""

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the selected part of a tensor of global `shape` (assumes valid ranges)."""
        if self.axis is None:
            return tuple(shape)
        local = list(shape)
        local[self.axis] = sum(end - start for start, end in self.ranges)
        return tuple(local)


WHOLE = TensorSelection()
"""The selection of an entire tensor."""


def _is_int(value: object) -> bool:
    """Whether `value` is a Python or numpy integer (not a bool)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_selection(header: FileHeader, entry: TensorEntry, sel: TensorSelection) -> None:
    """Refuse a selection that does not fit the tensor's shape."""
    shape = entry.shape
    if sel.axis is None:
        if sel.ranges:
            _fail(header.path, f"selection of {entry.name!r} has ranges but no axis", entry.name)
        return
    if not _is_int(sel.axis) or not 0 <= sel.axis < len(shape):
        _fail(header.path, f"selection axis {sel.axis!r} out of range for shape {list(shape)}",
              entry.name)
    dim = shape[sel.axis]
    for r in sel.ranges:
        if (not isinstance(r, tuple | list) or len(r) != 2 or not _is_int(r[0])
                or not _is_int(r[1]) or not 0 <= r[0] <= r[1] <= dim):
            _fail(header.path, f"selection range {r!r} of {entry.name!r} must satisfy "
                               f"0 <= start <= end <= {dim} (axis {sel.axis} of {list(shape)})",
                  entry.name)


def _runs(entry: TensorEntry, sel: TensorSelection) -> tuple[_Ints, _Ints, _Ints]:
    """Merged byte runs (file offset rel. to the tensor, destination offset, length), file order."""
    item = _ITEMSIZE[entry.dtype]
    if sel.axis is None:
        n = 1 if entry.nbytes else 0
        return np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, entry.nbytes, np.int64)
    k, shape = sel.axis, entry.shape
    outer = math.prod(shape[:k])
    inner = math.prod(shape[k + 1:]) * item
    ranges = np.array([r for r in sel.ranges if r[1] > r[0]], dtype=np.int64).reshape(-1, 2)
    if outer == 0 or inner == 0 or len(ranges) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    piece = (ranges[:, 1] - ranges[:, 0]) * inner
    src = (np.arange(outer, dtype=np.int64)[:, None] * (shape[k] * inner)
           + ranges[:, 0][None, :] * inner).ravel()
    length = np.broadcast_to(piece, (outer, len(piece))).ravel()
    dst = np.cumsum(length) - length  # pieces are laid out back to back in destination order
    first = np.flatnonzero(np.r_[True, src[1:] != src[:-1] + length[:-1]])
    src, dst, length = src[first], dst[first], np.add.reduceat(length, first)
    if len(src) > 1 and not bool(np.all(src[1:] > src[:-1])):
        order = np.argsort(src, kind="stable")
        src, dst, length = src[order], dst[order], length[order]
    return src, dst, length


class CheckpointReader:
    """Reads selected tensor elements straight into fresh arrays; opens each file once."""

    def __init__(self, checkpoint: Checkpoint, *, recorder: ReadRecorder | None = None,
                 max_gap: int = 0) -> None:
        self.checkpoint = checkpoint
        """The checkpoint read from."""
        self.recorder = recorder
        """Told of every byte run read, when set."""
        self.max_gap = max_gap
        """Runs this close (bytes) are read as one span (gaps included) and gathered; 0: exact."""
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every file opened so far."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def _fd(self, header: FileHeader) -> int:
        """The descriptor of `header`'s file, opened and checked on first use."""
        fd = self._fds.get(header.path)
        if fd is None:
            try:
                fd = os.open(header.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                _fail(header.path, f"cannot open checkpoint file: {exc.strerror or exc}")
            size = os.fstat(fd).st_size
            if size != header.file_size:
                os.close(fd)
                _fail(header.path, f"file changed since its header was read: size {size}, "
                                   f"expected {header.file_size} (truncated file?)")
            self._fds[header.path] = fd
        return fd

    def read(self, name: str, selection: TensorSelection = WHOLE) -> np.ndarray[Any, Any]:
        """The selected part of tensor `name` as a new C-contiguous array."""
        header, entry = self.checkpoint.tensor(name)
        _check_selection(header, entry, selection)
        out = np.empty(selection.local_shape(entry.shape), dtype=DTYPES[entry.dtype])
        src, dst, length = _runs(entry, selection)
        if len(src):
            fd, base = self._fd(header), header.data_start + entry.begin
            flat = out.reshape(-1).view(np.uint8)
            if self.max_gap > 0 and len(src) > 1:
                self._read_coalesced(fd, str(header.path), entry.name, flat, base,
                                     src, dst, length)
            else:
                self._read_exact(fd, str(header.path), entry.name, flat.data, base,
                                 src.tolist(), dst.tolist(), length.tolist())
        return out

    def read_many(self, requests: Iterable[tuple[str, TensorSelection]]
                  ) -> dict[str, np.ndarray[Any, Any]]:
        """Several selections, read in (file, offset) order; the dict follows request order."""
        todo = list(requests)
        seen: set[str] = set()
        keyed = []
        for pos, (name, _) in enumerate(todo):
            if name in seen:
                header, _ = self.checkpoint.tensor(name)
                _fail(header.path, f"tensor {name!r} requested twice", name)
            seen.add(name)
            header, entry = self.checkpoint.tensor(name)
            keyed.append((self.checkpoint.owners[name], entry.begin, pos))
        got = {pos: self.read(*todo[pos]) for _, _, pos in sorted(keyed)}
        return {todo[pos][0]: got[pos] for pos in range(len(todo))}

    def _read_exact(self, fd: int, path: str, name: str, out: memoryview, base: int,
                    src: list[int], dst: list[int], length: list[int]) -> None:
        """Read exactly the runs (sorted by file offset) into `out`; one preadv per file span."""
        recorder, preadv = self.recorder, os.preadv
        if any(map(eq, src[1:], map(add, src, length))):  # file-contiguous runs: batch them
            i, count = 0, len(src)
            while i < count:
                j, end = i + 1, src[i] + length[i]
                while j < count and j - i < _IOV_MAX and src[j] == end:
                    end, j = end + length[j], j + 1
                bufs = [out[d:d + n] for d, n in zip(dst[i:j], length[i:j], strict=True)]
                self._fill(fd, path, name, bufs, base + src[i])
                i = j
            return
        try:  # hot path: one preadv per run, straight into the destination
            for offset, d, n in zip(src, dst, length, strict=True):
                bufs = [out[d:d + n]]
                got = preadv(fd, bufs, base + offset)
                if recorder is not None and got > 0:
                    recorder.record(path, base + offset, got)
                if got != n:
                    self._fill(fd, path, name, bufs, base + offset, got)
        except OSError as exc:
            _fail(path, f"cannot read tensor data: {exc.strerror or exc}", name)

    def _read_coalesced(self, fd: int, path: str, name: str, flat: np.ndarray[Any, Any],
                        base: int, src: _Ints, dst: _Ints, length: _Ints) -> None:
        """Read runs with gaps of at most `max_gap` bytes as one span each, then gather."""
        last = src + length - 1
        window = src // _SPAN_LIMIT
        join = ((src[1:] - last[:-1] - 1 <= self.max_gap) & (src[1:] > last[:-1])
                & (window[1:] == window[:-1]) & (last[1:] // _SPAN_LIMIT == window[1:])
                & (last[:-1] // _SPAN_LIMIT == window[:-1]))
        cuts = [0, *(np.flatnonzero(~join) + 1).tolist(), len(src)]
        out = flat.data
        for i, j in zip(cuts, cuts[1:], strict=False):
            first = int(src[i])
            if j == i + 1:
                self._fill(fd, path, name, [out[int(dst[i]):int(dst[i] + length[i])]],
                            base + first)
                continue
            span = np.empty(int(last[j - 1]) + 1 - first, dtype=np.uint8)
            self._fill(fd, path, name, [span.data], base + first)
            rel, d, n = src[i:j] - first, dst[i:j], length[i:j]
            size, step = int(n[0]), int(rel[1] - rel[0])
            if (np.all(n == size) and np.all(np.diff(d) == size)
                    and np.all(np.diff(rel) == step)):  # evenly strided: one numpy copy
                pieces = np.lib.stride_tricks.as_strided(span, (j - i, size), (step, 1))
                flat[int(d[0]):int(d[0]) + (j - i) * size].reshape(j - i, size)[...] = pieces
            else:
                for r, dd, nn in zip(rel.tolist(), d.tolist(), n.tolist(), strict=True):
                    flat[dd:dd + nn] = span[r:r + nn]

    def _fill(self, fd: int, path: str, name: str, bufs: list[memoryview], offset: int,
              got: int | None = None) -> None:
        """Fill `bufs` from the file at `offset`, looping over short reads (`got`: done already)."""
        bufs = list(bufs)
        while True:
            if got is None:
                try:
                    got = os.preadv(fd, bufs, offset)
                except OSError as exc:
                    _fail(path, f"cannot read tensor data: {exc.strerror or exc}", name)
                if self.recorder is not None and got > 0:
                    self.recorder.record(path, offset, got)
            if got <= 0:
                _fail(path, f"truncated file: read returned no data at offset {offset}, "
                            f"expected {sum(map(len, bufs))} more bytes", name)
            offset += got
            while got and bufs:
                if got >= len(bufs[0]):
                    got -= len(bufs.pop(0))
                else:
                    bufs[0], got = bufs[0][got:], 0
            if not bufs:
                return
            got = None


def read_tensor(checkpoint: Checkpoint, name: str, selection: TensorSelection = WHOLE, *,
                reader: ReadRecorder | None = None) -> np.ndarray[Any, Any]:
    """Read only the selected elements of tensor `name` into a new C-contiguous array."""
    with CheckpointReader(checkpoint, recorder=reader) as r:
        return r.read(name, selection)


def read_tensors(checkpoint: Checkpoint, requests: Iterable[tuple[str, TensorSelection]], *,
                 reader: ReadRecorder | None = None) -> dict[str, np.ndarray[Any, Any]]:
    """Read several selections in (file, offset) order, opening each file once."""
    with CheckpointReader(checkpoint, recorder=reader) as r:
        return r.read_many(requests)
