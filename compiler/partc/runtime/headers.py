"""Safetensors headers, validated: tensor tables, offsets tiling the data region, metadata.

No payload byte is read here (`partc.runtime._engine.reader` reads); `partc.runtime.checkpoint`
opens one file or an index of shards, `partc.runtime.manifest` a pre-sharded folder.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter, mul, ne, sub
from typing import Any, NamedTuple, NoReturn

import numpy as np

from partc.errors import CheckpointError, SourceLocation
from partc.runtime.files import (
    FileStamp,
    no_readahead,
    open_regular,
    read_exactly,
    sha256,
    spelled,
)

MAX_HEADER_SIZE = 100_000_000
"""Largest JSON header partc agrees to parse (10^8 bytes), the safetensors library's limit."""

_NUMPY_DTYPES: dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
ML_DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("bfloat16", 2), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}
"""Safetensors dtypes numpy lacks: the ml_dtypes type and its size. ml_dtypes is imported
only when one of them is first looked up (its import costs more than numpy's: a checkpoint
without bf16 or fp8 never pays it)."""


class _DtypeTable(Mapping[str, "np.dtype[Any]"]):
    """Safetensors dtype string -> numpy dtype; the ml_dtypes ones made on first lookup."""

    __slots__ = ("_found", "_names")

    def __init__(self) -> None:
        self._found: dict[str, np.dtype[Any]] = {k: np.dtype(v) for k, v in
                                                 _NUMPY_DTYPES.items()}
        self._names = sorted({*_NUMPY_DTYPES, *ML_DTYPES})

    def __getitem__(self, name: str) -> np.dtype[Any]:
        found = self._found.get(name)
        if found is None:
            if name not in ML_DTYPES:
                raise KeyError(name)
            import ml_dtypes

            kind = getattr(ml_dtypes, ML_DTYPES[name][0], None)
            if kind is None:  # an older ml_dtypes without this type
                raise KeyError(name)
            found = self._found[name] = np.dtype(kind)
        return found

    def __contains__(self, name: object) -> bool:
        return name in _NUMPY_DTYPES or name in ML_DTYPES

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


DTYPES: Mapping[str, np.dtype[Any]] = _DtypeTable()
"""Safetensors dtype string -> little-endian numpy dtype (bf16/fp8 through ml_dtypes, imported
on first use)."""

BIT_DTYPES: Mapping[str, np.dtype[Any]] = {
    **{name: np.dtype(code) for name, code in _NUMPY_DTYPES.items()},
    **{name: np.dtype(f"<u{size}" if size > 1 else "u1") for name, (_, size) in
       ML_DTYPES.items()}}
"""Safetensors dtype string -> numpy dtype holding its bits: DTYPES' own, and an unsigned
integer of the same size for the dtypes numpy lacks. A torch load reads bf16 and fp8 tensors as
these and views them as torch's dtype (`frameworks.to_torch`), never importing ml_dtypes."""

ITEMSIZE: dict[str, int] = {**{name: np.dtype(code).itemsize
                               for name, code in _NUMPY_DTYPES.items()},
                            **{name: size for name, (_, size) in ML_DTYPES.items()}}
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def abort(path: str | os.PathLike[str], message: str, tensor: str | None = None) -> NoReturn:
    """Raise a CheckpointError located at `path`."""
    raise CheckpointError(message, location=SourceLocation(str(path)), tensor=tensor)


def check_name(path: str, name: str, what: str) -> None:
    """Refuse a name holding a character that is not printable (a control character such as
    ESC or a line break, a format or separator character): every message and listing of partc
    prints tensor names, and such a name could rewrite the terminal or forge a line. safetensors
    itself accepts any string; no checkpoint transformers writes has one."""
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        abort(path, f"{what} {name!r} holds the non-printable character {bad!r} (U+{ord(bad):04X});"
                    " expected printable text, as every name transformers writes is")


def json_kind(value: object) -> str:
    """The JSON kind of a value parsed with objects as tuples of pairs."""
    kinds = {tuple: "object", list: "array", bool: "boolean", type(None): "null", int: "integer",
             float: "number", str: "string"}
    return kinds.get(type(value), type(value).__name__)


def unique_object(path: str, pairs: tuple[tuple[str, Any], ...], where: str) -> dict[str, Any]:
    """Turn a parsed JSON object into a dict, refusing duplicate keys."""
    table = dict(pairs)
    if len(table) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                abort(path, f"duplicate key {key!r} in {where}; expected every key once")
            seen.add(key)
    return table


class _NotJson(ValueError):
    """A NaN or Infinity literal: Python's json reads them, JSON (and safetensors) does not."""


def _refuse_constant(name: str) -> NoReturn:
    """`parse_constant` hook of partc's decoders: NaN, Infinity and -Infinity are not JSON."""
    raise _NotJson(f"{name} is not a JSON value")


JSON_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
"""Plain strict decoder (the fast header path)."""
_PAIRS_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, object_pairs_hook=tuple)
"""Strict decoder keeping every member of an object, duplicates included (careful paths)."""


def load_json_object(path: str, text: str, what: str, *, padding: bool = False
                     ) -> dict[str, Any]:
    """Parse JSON text that must be an object; nested objects become tuples of pairs.

    With `padding`, the text must start with '{' and may only be followed by spaces (a
    safetensors header); otherwise JSON whitespace may surround it.
    """
    try:
        if padding and text.startswith("{"):
            doc, end = _PAIRS_DECODER.raw_decode(text)
            _check_padding(path, text, end, what)
        elif padding and text.lstrip(" \t\r\n").startswith("{"):
            abort(path, f"{what} must start with '{{' (found {text[:8]!r}); expected no "
                        "leading whitespace")
        else:  # not an object at all: say what it is
            doc = _PAIRS_DECODER.decode(text)
    except _NotJson as exc:
        abort(path, f"{what} is not valid JSON: {exc}")
    except json.JSONDecodeError as exc:
        abort(path, f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    except RecursionError:
        abort(path, f"{what} is not valid JSON: nested too deeply")
    except MemoryError:
        abort(path, f"ran out of memory parsing the {what} ({len(text)} characters)")
    except ValueError:  # a number too long for int(): json lets Python's ValueError out
        abort(path, f"{what} holds a number too long to read (more than 4300 digits)")
    if not isinstance(doc, tuple):
        abort(path, f"{what} is not a JSON object (found {json_kind(doc)})")
    return unique_object(path, doc, f"the {what}")


def _check_padding(path: str, text: str, end: int, what: str) -> None:
    """Refuse anything but spaces (0x20) after the JSON object that ends at `end`."""
    rest = text[end:]
    if rest.strip(" "):
        at = len(text[:end].encode("utf-8")) + len(rest) - len(rest.lstrip(" "))
        abort(path, f"{what} has {len(rest.strip(' ').encode('utf-8'))} bytes after its JSON "
                    f"object, the first {rest.lstrip(' ')[:8]!r} at header byte {at}; expected "
                    "padding with spaces (0x20) only (a wrong header length?)")


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

    path: str
    """The file the header was read from, a `str` (not a `Path`: the runtime never imports
    pathlib), spelled as `str(Path(...))` would spell it (`partc.runtime.files.spelled`)."""
    header_size: int
    """N, the length in bytes of the JSON header."""
    data_start: int
    """Absolute offset of the data region (8 + N)."""
    file_size: int
    """Size of the file in bytes when the header was read."""
    metadata: tuple[tuple[str, str], ...]
    """The `__metadata__` pairs, in file order."""
    tensors: TensorTable
    """Tensor name -> entry, ordered by name."""
    digest: str = ""
    """sha256 of the header bytes as stored (byte-identical headers have equal digests)."""
    stamp: FileStamp | None = None
    """The file's identity when the header was read (readers refuse a file whose differs)."""


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read and validate the header of one .safetensors file without touching its payload.

    As strict as the safetensors library or stricter: the 8-byte length, at most
    MAX_HEADER_SIZE, a JSON object starting with '{' and padded with spaces only, and tensors
    whose byte ranges cover the data region exactly (no gap, no overlap, no trailing byte).
    """
    p = spelled(path)
    fd, st = open_regular(p)
    try:
        no_readahead(fd)  # a cold rank would otherwise fetch megabytes of others' tensors
        size = st.st_size
        if size < 8:
            abort(p, f"truncated file: {size} bytes, expected at least 8 for the header length")
        first = read_exactly(fd, p, 0, 8, "header length")
        n = int.from_bytes(first, "little")
        if n > MAX_HEADER_SIZE and _text_like(first):
            kind = "JSON" if first.lstrip(b" \t\r\n")[:1] in (b"{", b"[") else "text"
            abort(p, f"not a safetensors file: it begins with {first!r}, which looks like "
                     f"{kind}, where a safetensors file begins with the 8-byte little-endian "
                     f"length of its JSON header (these bytes read as {n}); expected a "
                     ".safetensors file, its folder or its model.safetensors.index.json")
        if n > MAX_HEADER_SIZE:
            abort(p, f"header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit; refusing it")
        if n > size - 8:
            abort(p, f"header length {n} beyond the file of size {size}")
        raw = read_exactly(fd, p, 8, n, "header")
    finally:
        os.close(fd)
    try:
        return _parse_header(p, raw, size, FileStamp.of(st))
    except MemoryError:
        abort(p, f"ran out of memory parsing the header ({n} bytes)")


def _text_like(data: bytes) -> bool:
    """Whether `data` is printable ASCII and whitespace only: a text file's first bytes (as a
    header length they exceed MAX_HEADER_SIZE, so no safetensors file begins so)."""
    return all(32 <= b < 127 or b in (9, 10, 13) for b in data)


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored after it).

    Building ~10^4-10^6 small containers while a large header is alive makes each collection
    walk that header; none of these containers form cycles, so pausing loses nothing.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse_header(p: str, raw: bytes, size: int, stamp: FileStamp | None = None
                  ) -> FileHeader:
    """Validate the JSON header bytes of a file of `size` bytes."""
    n = len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        abort(p, f"header is not valid UTF-8: {exc.reason} at header byte {exc.start}")
    with paused_gc():  # ~1M short-lived containers: collecting them mid-parse doubles the time
        metadata, tensors = _parse_tables(p, text, size - 8 - n)
    return FileHeader(path=p, header_size=n, data_start=8 + n, file_size=size,
                      metadata=metadata, tensors=tensors, digest=sha256(raw).hexdigest(),
                      stamp=stamp)


_Columns = tuple[tuple[tuple[str, str], ...], list[str], list[Any], list[Any], list[int],
                 "dict[str, Any] | None"]
"""Metadata pairs, then per tensor in name order: names, dtypes, shapes, and the flattened
data offsets [begin, end, begin, end, ...]; last, the parsed header object by name when it can
serve as the lookup table (entries {dtype, shape, data_offsets}, metadata removed)."""


def _parse_tables(p: str, text: str, data_size: int
                  ) -> tuple[tuple[tuple[str, str], ...], TensorTable]:
    """Parse and validate the header JSON: metadata pairs and the tensor table ordered by name."""
    columns = _fast_columns(text, data_size) or _careful_columns(p, text, data_size)
    metadata, names, dtypes, shapes, bounds, entries = columns
    if not text.isascii() or "\\" in text or "\x7f" in text:  # else every name is printable
        for name in names:
            check_name(p, name, "tensor name")
    begins, ends = bounds[0::2], bounds[1::2]
    # Most writers (the safetensors library among them, for one dtype) lay tensors out in
    # name order: tiling the data region in that order is list comparisons; any other order
    # is sorted by `_check_coverage` (numpy's first calls cost a small header ~0.15 ms).
    if not (names and begins[0] == 0 and ends[-1] == data_size and begins[1:] == ends[:-1]):
        _check_coverage(p, names, begins, ends, data_size)
    if entries is None:
        entries = {name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
                   for name, dtype, shape, begin, end in zip(names, dtypes, shapes, begins, ends,
                                                             strict=True)}
    return metadata, TensorTable(names, dtypes, shapes, entries)


class TensorTable(Mapping[str, TensorEntry]):
    """A header's tensors by name, in name order; kept as columns, entries built on access.

    A DeepSeek-V3 header lists ~92k tensors; a rank reads a few thousand of them.
    """

    __slots__ = ("_dtypes", "_entries", "_names", "_shapes")

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                 entries: dict[str, Any]) -> None:
        """`names` sorted, `dtypes` and `shapes` in their order; `entries` the validated header
        entries ({dtype, shape, data_offsets}) by name, used for lookups as they are."""
        self._names, self._dtypes, self._shapes = names, dtypes, shapes
        self._entries = entries

    def __getitem__(self, name: str) -> TensorEntry:
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        return TensorEntry(name, entry["dtype"], tuple(entry["shape"]), begin, end)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def signature(self, name: str) -> tuple[str, list[int]] | None:
        """(dtype, shape) of tensor `name` without building its entry; None when absent."""
        entry = self._entries.get(name)
        return None if entry is None else (entry["dtype"], entry["shape"])

    def header_entries(self, names: list[str]) -> list[dict[str, Any] | None]:
        """The validated header entry ({dtype, shape, data_offsets}) of each of `names`, None
        for a name not in the table: a read's lookup of every tensor in one C-level map (a
        TensorEntry a tensor, built by `__getitem__`, costs a rank's load ~1 us each)."""
        return list(map(self._entries.get, names))

    def columns(self) -> tuple[list[str], list[str], list[list[int]]]:
        """Names, dtypes and shapes of every tensor, in name order (the table's own lists)."""
        return self._names, self._dtypes, self._shapes


def _fast_columns(text: str, data_size: int) -> _Columns | None:
    """Validate a plain, well-formed header with C-level maps only; None when in any doubt.

    Duplicate keys vanish in a plain json.loads, so they are ruled out by counting: without
    backslash escapes every ':' in the text either separates one object member or sits inside a
    string, so the count matches only when no member was dropped.
    """
    if "\\" in text or not text.startswith("{"):
        return None
    try:
        table, end = JSON_DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None
    if type(table) is not dict or text[end:].strip(" "):
        return None
    has_meta = "__metadata__" in table
    meta = table.pop("__metadata__", {})
    if type(meta) is not dict or set(map(type, meta.values())) - {str}:
        return None
    names = sorted(table)
    entries = list(map(table.__getitem__, names))
    if entries and set(map(type, entries)) != {dict}:
        return None
    if entries and set(map(len, entries)) != {3}:
        return None
    colons = "".join(chain(names, meta, meta.values())).count(":")
    members = len(table) + has_meta + len(meta) + 3 * len(entries)
    if text.count(":") != members + colons:
        return None
    try:
        dtypes = list(map(itemgetter("dtype"), entries))
        shapes = list(map(itemgetter("shape"), entries))
        offsets = list(map(itemgetter("data_offsets"), entries))
    except KeyError:
        return None
    if entries and (set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}
                    or set(map(len, offsets)) != {2}):
        return None
    bounds = _bulk_valid(dtypes, shapes, offsets, data_size)
    if bounds is None:
        return None
    return tuple(meta.items()), names, dtypes, shapes, bounds, table


def _careful_columns(p: str, text: str, data_size: int) -> _Columns:
    """Validate any header entry by entry, raising the precise CheckpointError of a fault."""
    table = load_json_object(p, text, "header", padding=True)
    metadata = _parse_metadata(p, table.pop("__metadata__", ()))
    names = sorted(table)
    dtypes: list[Any] = []
    shapes: list[Any] = []
    bounds: list[int] = []
    for name in names:
        entry = _parse_entry(p, name, table[name], data_size)
        dtypes.append(entry.dtype)
        shapes.append(list(entry.shape))
        bounds += (entry.begin, entry.end)
    return metadata, names, dtypes, shapes, bounds, None


def _bulk_valid(dtypes: list[Any], shapes: list[list[Any]], offsets: list[list[Any]],
                data_size: int) -> list[int] | None:
    """Check every entry at once with C-level maps: known dtypes, sizes, offsets in range.

    Returns the offsets flattened ([begin, end, begin, end, ...]), or None on any fault.
    """
    try:
        itemsizes = list(map(ITEMSIZE.get, dtypes))
    except TypeError:  # an unhashable dtype
        return None
    if None in itemsizes:
        return None
    dims = list(chain.from_iterable(shapes))
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0):
        return None
    bounds = list(chain.from_iterable(offsets))
    if bounds and (set(map(type, bounds)) != {int} or min(bounds) < 0
                   or max(bounds) > data_size):
        return None
    sizes = map(mul, map(math.prod, shapes), itemsizes)
    spans = map(sub, bounds[1::2], bounds[0::2])
    return None if any(map(ne, sizes, spans)) else bounds


def _check_coverage(p: str, names: list[str], begins: list[int], ends: list[int],
                    data_size: int) -> None:
    """Refuse byte ranges that do not tile the data region: sorted by (begin, end), the first
    begins at 0, each begins where the previous one ends, the last ends at `data_size` (the
    safetensors library's rule: no gap, no overlap, no trailing byte)."""
    b = np.array(begins, dtype=np.int64)
    e = np.array(ends, dtype=np.int64)
    order = np.lexsort((e, b))
    b, e = b[order], e[order]
    if len(order) and b[0] != 0:
        i = int(order[0])
        abort(p, f"gap at the start of the data region: the first tensor {names[i]!r} begins at "
                 f"data byte {begins[i]}; expected 0", names[i])
    overlap = np.flatnonzero(b[1:] < e[:-1])
    if len(overlap):
        i, j = int(order[overlap[0]]), int(order[overlap[0] + 1])
        abort(p, f"tensor byte ranges overlap: {names[i]!r} spans [{begins[i]}, {ends[i]}) "
                 f"and {names[j]!r} spans [{begins[j]}, {ends[j]}); expected disjoint ranges",
              tensor=names[j])
    bad = np.flatnonzero(b[1:] != e[:-1])
    if len(bad):
        i, j = int(order[bad[0]]), int(order[bad[0] + 1])
        abort(p, f"gap in the data region: {names[j]!r} begins at data byte {begins[j]} but "
                 f"{names[i]!r} ends at {ends[i]} ({begins[j] - ends[i]} unused bytes); expected "
                 "each tensor to begin where the previous one ends", names[j])
    covered = int(e[-1]) if len(order) else 0
    if covered != data_size:
        last = f" (the last, {names[int(order[-1])]!r}, ends there)" if len(order) else ""
        abort(p, f"file not fully covered: the data region holds {data_size} bytes but the "
                 f"tensors cover {covered}{last}: {data_size - covered} trailing "
                 f"byte{'s' if data_size - covered != 1 else ''} (a wrong "
                 "header length, or bytes appended?); expected the tensors to cover it exactly")


def _parse_metadata(p: str, value: object) -> tuple[tuple[str, str], ...]:
    """Validate `__metadata__`: an object of string values."""
    if not isinstance(value, tuple):
        abort(p, f"__metadata__ must be an object of strings (found {json_kind(value)})")
    meta = unique_object(p, value, "__metadata__")
    for key, item in meta.items():
        if type(item) is not str:
            abort(p, f"__metadata__[{key!r}] must be a string (found {json_kind(item)})")
    return tuple(meta.items())


def _parse_entry(p: str, name: str, value: object, data_size: int) -> TensorEntry:
    """Validate one tensor entry of the header against the data region of `data_size` bytes."""
    if type(value) is not tuple:
        abort(p, f"tensor entry must be an object (found {json_kind(value)})", name)
    fields = unique_object(p, value, f"the entry of tensor {name!r}")
    if fields.keys() != _ENTRY_FIELDS:
        missing = sorted(_ENTRY_FIELDS - fields.keys())
        extra = sorted(fields.keys() - _ENTRY_FIELDS)
        abort(p, f"tensor entry must have exactly dtype, shape, data_offsets "
                 f"(missing {missing}, unexpected {extra})", name)
    dtype = fields["dtype"]
    itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        abort(p, f"unknown dtype {repr(dtype)[:80]}; expected one of {', '.join(DTYPES)}", name)
    shape = fields["shape"]
    if type(shape) is list and (len(shape) > 64 or any(  # u64 dims: bounds every product
            type(d) is int and not -2**64 < d < 2**64 for d in shape)):
        widest = max((abs(d).bit_length() for d in shape if type(d) is int), default=0)
        found = (f"{len(shape)} dimensions" if len(shape) > 64
                 else f"a dimension of {widest} bits")
        abort(p, f"shape must have at most 64 dimensions, each below 2**64 (found {found})",
              name)
    if type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):
        abort(p, f"shape must be a list of non-negative integers (found {repr(shape)[:80]})", name)
    offsets = fields["data_offsets"]
    if type(offsets) is list and any(type(o) is int and not -2**64 < o < 2**64 for o in offsets):
        abort(p, "data_offsets must be below 2**64 (u64 byte offsets)", name)
    if (type(offsets) is not list or len(offsets) != 2
            or type(offsets[0]) is not int or type(offsets[1]) is not int):
        abort(p, f"data_offsets must be [begin, end] integers (found {repr(offsets)[:80]})", name)
    begin, end = offsets
    if not 0 <= begin <= end:
        abort(p, f"data_offsets must satisfy 0 <= begin <= end (found [{begin}, {end}])", name)
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        abort(p, f"dtype/shape byte-size mismatch: {dtype} {repr(shape)[:80]} needs {expected} "
                 f"bytes, data_offsets [{begin}, {end}] span {end - begin}", name)
    if end > data_size:
        abort(p, f"data offsets beyond the file (truncated file?): tensor ends at data byte {end}, "
                 f"the data region holds {data_size} bytes", name)
    return TensorEntry(name, dtype, tuple(shape), begin, end)


