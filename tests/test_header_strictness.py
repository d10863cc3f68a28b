"""Damaged safetensors headers: partc refuses every file the safetensors library refuses.

Each case damages a real fixture (the tiny Llama, single file or one shard of its 4-shard
index) at the byte level. The safetensors library (`safe_open` and `safetensors.numpy.
load_file`) is the oracle: its verdict is recorded per case and checked, and every file it
refuses must be refused by partc three ways (`open_checkpoint`, `partc check` against a plan,
a generated loader's `load()`) with a CheckpointError that names the file (and the tensor
where one is at fault) and states the rule. The cases the library accepts and partc refuses
are listed in STRICTER with the reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from partc.cli.main import main as cli_main
from partc.errors import CheckpointError, PartcError, PartcErrors
from partc.runtime.checkpoint import open_checkpoint

from support import compile_and_import, hf

LLAMA = hf("llama")
SHARD = "model-00002-of-00004.safetensors"
"""The shard the sharded cases damage."""
NORM = "model.norm.weight"  # F32 [64], the last tensor of the single file
EMBED = "model.embed_tokens.weight"  # F32 [131, 64]

Header = dict[str, Any]


@dataclass(frozen=True)
class Parts:
    """A safetensors file taken apart: its header (parsed, in file order) and data region."""

    header: Header
    data: bytes

    def file(self, text: bytes | None = None, *, length: int | None = None,
             data: bytes | None = None) -> bytes:
        """Reassemble: `text` (default: the header as compact JSON padded with spaces to a
        multiple of 8, at least one), declared `length` (default: the text's), `data`."""
        if text is None:
            text = compact(self.header)
            text += b" " * (8 - len(text) % 8)
        n = len(text) if length is None else length
        return struct.pack("<Q", n) + text + (self.data if data is None else data)

    def edit(self, change: Callable[[Header], None], **options: Any) -> bytes:
        """The file with its header changed by `change` (on a copy)."""
        header = json.loads(json.dumps(self.header))
        change(header)
        return Parts(header, self.data).file(**options)


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def take_apart(path: Path) -> Parts:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return Parts(json.loads(raw[8:8 + n]), raw[8 + n:])


def entries(header: Header) -> list[str]:
    """Tensor names in data order."""
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"])


def shift_from(header: Header, name: str, by: int) -> None:
    """Move `name` and every tensor after it by `by` bytes."""
    order = entries(header)
    for later in order[order.index(name):]:
        header[later]["data_offsets"] = [o + by for o in header[later]["data_offsets"]]


def with_text(parts: Parts, replace: tuple[bytes, bytes]) -> bytes:
    """The header text with one byte-level substitution, re-padded."""
    text = compact(parts.header).replace(*replace, 1)
    assert replace[1] in text
    return parts.file(text + b" " * (8 - len(text) % 8))


@dataclass(frozen=True)
class Case:
    """One damaged file: how to make it, what partc says, what the library does."""

    name: str
    make: Callable[[Parts], bytes]
    phrase: str
    """A phrase of partc's message."""
    library: str = "refuses"
    """The safetensors library's verdict: refuses or accepts."""
    tensor: str | None = None
    """The tensor partc's error must name, when one is at fault."""


def _second(header: Header) -> str:
    return entries(header)[1]


def _gap(p: Parts) -> bytes:
    h = json.loads(json.dumps(p.header))
    name = _second(h)
    begin = h[name]["data_offsets"][0]
    shift_from(h, name, 4)
    return Parts(h, p.data[:begin] + bytes(4) + p.data[begin:]).file()


def _overlap(p: Parts) -> bytes:
    def change(h: Header) -> None:
        name = _second(h)
        h[name]["data_offsets"] = [o - 4 for o in h[name]["data_offsets"]]
    return p.edit(change)


def _first_not_at_zero(p: Parts) -> bytes:
    h = json.loads(json.dumps(p.header))
    shift_from(h, entries(h)[0], 16)
    return Parts(h, bytes(16) + p.data).file()


def _reversed(p: Parts) -> bytes:
    return p.edit(lambda h: h[entries(h)[-1]].update(
        data_offsets=h[entries(h)[-1]]["data_offsets"][::-1]))


def _last(change: Callable[[dict[str, Any]], None]) -> Callable[[Parts], bytes]:
    """Damage the entry of the data region's last tensor."""
    return lambda p: p.edit(lambda h: change(h[entries(h)[-1]]))


def _swap_order(p: Parts) -> bytes:
    """Two tensors' byte ranges exchanged (both the same size): still tiles the region."""
    def change(h: Header) -> None:
        a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return p.edit(change)


def _duplicate(p: Parts) -> bytes:
    text = compact(p.header)
    name = entries(p.header)[-1]
    entry = compact({name: p.header[name]})[1:-1]
    text = text[:-1] + b"," + entry + b"}"
    return p.file(text + b" " * (8 - len(text) % 8))


def _bad_utf8(p: Parts) -> bytes:
    text = compact(p.header).replace(NORM.encode(), b"model.norm.weigh\xff", 1)
    return p.file(text + b" " * (8 - len(text) % 8))


SINGLE = [
    Case("declared_length_one_short", lambda p: p.file(length=len(p.file()) - 8 - len(p.data) - 1),
         "1 trailing byte ("),
    Case("declared_length_one_long", lambda p: p.file(length=len(p.file()) - 8 - len(p.data) + 1),
         "not valid UTF-8"),  # the first data byte joins the header
    Case("declared_length_eight_short",
         lambda p: p.file(compact(p.header) + b" " * 8,
                          length=len(compact(p.header))), "8 trailing bytes"),
    Case("declared_length_eight_long",
         lambda p: p.file(length=len(p.file()) - 8 - len(p.data) + 8), "not valid UTF-8"),
    Case("declared_length_long_into_ascii_data",
         lambda p: p.file(length=len(p.file()) - 8 - len(p.data) + 3,
                          data=b"abc" + p.data[3:]), "bytes after its JSON object"),
    Case("declared_length_huge", lambda p: p.file(length=2**63),
         "exceeds the 100000000-byte limit"),
    Case("declared_length_just_over_the_limit", lambda p: p.file(length=100_000_001),
         "exceeds the 100000000-byte limit"),
    Case("declared_length_zero", lambda p: p.file(length=0), "not valid JSON"),
    Case("empty_file", lambda p: b"", "expected at least 8"),
    Case("seven_bytes", lambda p: p.file()[:7], "expected at least 8"),
    Case("cut_inside_the_header", lambda p: p.file()[:1000], "beyond the file"),
    Case("leading_space", lambda p: p.file(b" " + compact(p.header) + b" " * 7),
         "must start with '{'", library="accepts"),
    Case("byte_order_mark", lambda p: p.file(b"\xef\xbb\xbf" + compact(p.header) + b" " * 5),
         "not valid JSON"),
    Case("not_an_object", lambda p: p.file(b"[1, 2]  "), "not a JSON object (found array)"),
    Case("padded_with_nul", lambda p: p.file(compact(p.header) + b"\0" * 4),
         "bytes after its JSON object"),
    Case("padded_with_garbage", lambda p: p.file(compact(p.header) + b"  x "),
         "bytes after its JSON object"),
    Case("padded_with_tab", lambda p: p.file(compact(p.header) + b"\t" * 4),
         "padding with spaces (0x20) only", library="accepts"),
    Case("padded_with_newline", lambda p: p.file(compact(p.header) + b"\n"),
         "padding with spaces (0x20) only", library="accepts"),
    Case("gap_between_tensors", _gap, "gap in the data region"),
    Case("overlapping_tensors", _overlap, "overlap"),
    Case("first_tensor_not_at_zero", _first_not_at_zero, "gap at the start of the data region"),
    Case("one_trailing_byte", lambda p: p.file(data=p.data + b"\0"), "1 trailing byte ("),
    Case("eight_trailing_bytes", lambda p: p.file(data=p.data + bytes(8)), "8 trailing bytes"),
    Case("payload_cut_by_one_byte", lambda p: p.file(data=p.data[:-1]),
         "data offsets beyond the file", tensor=NORM),
    Case("offsets_reversed", _reversed, "0 <= begin <= end", tensor=NORM),
    Case("offsets_swapped_between_equal_tensors", _swap_order, "", library="accepts"),
    Case("wrong_dtype_same_size", _last(lambda e: e.update(dtype="I32")), "", library="accepts"),
    Case("wrong_dtype_other_size", _last(lambda e: e.update(dtype="F16")),
         "byte-size mismatch", tensor=NORM),
    Case("unknown_dtype", _last(lambda e: e.update(dtype="F128")), "unknown dtype", tensor=NORM),
    Case("lowercase_dtype", _last(lambda e: e.update(dtype="f32")), "unknown dtype", tensor=NORM),
    Case("dtype_not_a_string", _last(lambda e: e.update(dtype=32)), "unknown dtype", tensor=NORM),
    Case("shape_size_mismatch", _last(lambda e: e.update(shape=[32])), "byte-size mismatch",
         tensor=NORM),
    Case("shape_negative", _last(lambda e: e.update(shape=[-64])), "non-negative integers",
         tensor=NORM),
    Case("shape_float", _last(lambda e: e.update(shape=[64.0])), "non-negative integers",
         tensor=NORM),
    Case("shape_overflows_u64", _last(lambda e: e.update(shape=[2**32, 2**32, 2**32])),
         "byte-size mismatch", tensor=NORM),
    Case("offset_negative", _last(lambda e: e.update(
        data_offsets=[-4, e["data_offsets"][1]])), "0 <= begin <= end", tensor=NORM),
    Case("offset_float", _last(lambda e: e.update(
        data_offsets=[float(o) for o in e["data_offsets"]])), "[begin, end] integers",
         tensor=NORM),
    Case("offset_bool", _last(lambda e: e.update(data_offsets=[True, e["data_offsets"][1]])),
         "[begin, end] integers", tensor=NORM),
    Case("offset_string", _last(lambda e: e.update(
        data_offsets=[str(o) for o in e["data_offsets"]])), "[begin, end] integers",
         tensor=NORM),
    Case("three_offsets", _last(lambda e: e.update(data_offsets=[*e["data_offsets"], 0])),
         "[begin, end] integers", tensor=NORM),
    Case("missing_shape", _last(lambda e: e.pop("shape")), "missing ['shape']", tensor=NORM),
    Case("extra_entry_field", _last(lambda e: e.update(layout="C")), "unexpected ['layout']",
         tensor=NORM, library="accepts"),
    Case("entry_not_an_object", lambda p: p.edit(lambda h: h.update({NORM: [1, 2]})),
         "must be an object", tensor=NORM),
    Case("duplicate_tensor_name", _duplicate, "duplicate key", library="accepts"),
    Case("metadata_value_not_a_string", lambda p: p.edit(
        lambda h: h.update(__metadata__={"format": 1})), "must be a string"),
    Case("metadata_null", lambda p: p.edit(lambda h: h.update(__metadata__=None)),
         "__metadata__ must be an object", library="accepts"),
    Case("metadata_nan", lambda p: with_text(p, (b'"pt"', b"NaN")), "NaN is not a JSON value"),
    Case("shape_infinity", lambda p: with_text(p, (b'"shape":[64]', b'"shape":[Infinity]')),
         "Infinity is not a JSON value"),
    Case("extra_field_negative_infinity", lambda p: with_text(
        p, (b'"dtype":"F32"', b'"x":-Infinity,"dtype":"F32"')), "-Infinity is not a JSON value"),
    Case("invalid_utf8_in_a_name", _bad_utf8, "not valid UTF-8"),
    Case("unmodified_but_repadded", lambda p: p.file(), "", library="accepts"),
]
"""Damage to the single-file fixture (case name, damage, partc's phrase, library verdict)."""

STRICTER = {
    "leading_space": "the library (0.8) skips whitespace before the object; its writer never "
                     "puts any there, and the header must start with '{' as the format says",
    "padded_with_tab": "serde_json skips any JSON whitespace after the object; safetensors "
                       "writers pad with spaces only, so anything else is a wrong length",
    "padded_with_newline": "as padded_with_tab",
    "extra_entry_field": "serde ignores unknown fields of a tensor entry; partc wants exactly "
                         "dtype, shape, data_offsets so that a misspelt field is not silent",
    "duplicate_tensor_name": "serde keeps the last of two equal keys; partc refuses the "
                             "ambiguity instead of choosing",
    "metadata_null": "the library reads a null __metadata__ as absent; partc wants an object",
}
"""Cases the library accepts and partc refuses, and why partc is stricter."""

ACCEPTED = {"offsets_swapped_between_equal_tensors", "wrong_dtype_same_size",
            "unmodified_but_repadded"}
"""Valid files whatever their meaning: both accept (the plan check may still object)."""


def library_verdict(path: Path) -> str:
    try:
        with safe_open(str(path), "numpy") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open handles are not mappings)
                f.get_tensor(key)
        load_file(str(path))
    except Exception:  # the library's errors are SafetensorError, OSError, ValueError, ...
        return "refuses"
    return "accepts"


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("strict") / "build"
    _, package = compile_and_import("llama", LLAMA / "config.json", out, tp=2)
    return package


def first_error(error: PartcError) -> PartcError:
    return error.errors[0] if isinstance(error, PartcErrors) else error


def check_cli(folder: Path) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = cli_main(["check", "llama", "--config", str(LLAMA / "config.json"),
                           "--checkpoint", str(folder), "--tp", "2", "--format", "json"])
    return status, json.loads(out.getvalue()) if out.getvalue().strip() else {}


def assert_refused(case: Case, folder: Path, damaged: Path, package: Any) -> None:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    error = info.value
    assert error.location is not None and Path(error.location.file) == damaged, error
    assert case.phrase in error.message, error.message
    if case.tensor is not None:
        assert error.tensor == case.tensor, error
    with pytest.raises(PartcError) as loaded:
        package.load(folder, rank=0)
    first = first_error(loaded.value)
    assert isinstance(first, CheckpointError) and first.message == error.message
    assert first.location is not None and Path(first.location.file) == damaged
    status, report = check_cli(folder)
    assert status == 1, report
    reported = report["errors"][0]
    assert reported["kind"] == "CheckpointError" and reported["message"] == error.message
    assert Path(reported["file"]) == damaged


def run_case(case: Case, damaged: Path, folder: Path, package: Any) -> None:
    assert library_verdict(damaged) == case.library, (
        f"{case.name}: the safetensors library now {library_verdict(damaged)} this file")
    if case.name in ACCEPTED:
        opened = open_checkpoint(folder)
        assert opened.names
        return
    assert case.library == "refuses" or case.name in STRICTER, case.name
    assert_refused(case, folder, damaged, package)


def test_the_table_holds_at_least_25_damaged_headers_with_unique_names() -> None:
    names = [c.name for c in SINGLE] + [c.name for c in SHARDED]
    assert len(names) == len(set(names)) and len(SINGLE) >= 25
    assert set(STRICTER) <= set(names) and ACCEPTED <= set(names)
    assert {c.name for c in SINGLE + SHARDED if c.library == "accepts"} == \
        set(STRICTER) | ACCEPTED


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c.name)
def test_a_damaged_single_file_is_refused_whenever_the_library_refuses_it(
        case: Case, tmp_path: Path, build: Any) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    damaged = folder / "model.safetensors"
    damaged.write_bytes(case.make(take_apart(LLAMA / "model.safetensors")))
    run_case(case, damaged, folder, build)


SHARDED = [
    Case("shard_declared_length_one_short",
         lambda p: p.file(length=len(p.file()) - 8 - len(p.data) - 1), "1 trailing byte ("),
    Case("shard_one_trailing_byte", lambda p: p.file(data=p.data + b"\0"), "1 trailing byte ("),
    Case("shard_gap_between_tensors", _gap, "gap in the data region"),
    Case("shard_overlapping_tensors", _overlap, "overlap"),
    Case("shard_padded_with_nul", lambda p: p.file(compact(p.header) + b"\0" * 4),
         "bytes after its JSON object"),
    Case("shard_metadata_nan", lambda p: with_text(p, (b'"pt"', b"NaN")),
         "NaN is not a JSON value"),
    Case("shard_payload_cut", lambda p: p.file(data=p.data[:-1]), "data offsets beyond the file"),
]
"""The same damage to one shard of the index (the library reads the shard alone)."""


@pytest.mark.parametrize("case", SHARDED, ids=lambda c: c.name)
def test_a_damaged_shard_is_refused_whenever_the_library_refuses_it(
        case: Case, tmp_path: Path, build: Any) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA / "sharded", folder)
    damaged = folder / SHARD
    damaged.write_bytes(case.make(take_apart(damaged)))
    run_case(case, damaged, folder, build)


def index_case(edit: Callable[[dict[str, Any]], Any] | None = None, text: str | None = None
               ) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        path = folder / "model.safetensors.index.json"
        if text is not None:
            path.write_text(text)
            return
        index = json.loads(path.read_text())
        assert edit is not None
        edit(index)
        path.write_text(json.dumps(index))
    return apply


INDEX_CASES = [
    ("weight_map_value_not_a_string", index_case(
        lambda i: i["weight_map"].update({NORM: 4})), "must be a shard file name"),
    ("shard_name_with_a_slash", index_case(
        lambda i: i["weight_map"].update({NORM: "sub/model.safetensors"})),
     "is not a plain file name"),
    ("shard_name_absolute", index_case(
        lambda i: i["weight_map"].update({NORM: "/etc/passwd"})), "is not a plain file name"),
    ("shard_name_dot_dot", index_case(lambda i: i["weight_map"].update({NORM: ".."})),
     "is not a plain file name"),
    ("tensor_in_no_shard", index_case(
        lambda i: i["weight_map"].update({"extra.weight": SHARD})), "not in that shard's header"),
    ("tensor_missing_from_the_index", index_case(lambda i: i["weight_map"].pop(NORM)),
     "is not in the index's weight_map"),
    ("nan_in_the_index_metadata", index_case(
        text='{"metadata": {"total_size": NaN}, "weight_map": {}}'), "NaN is not a JSON value"),
    ("duplicate_key_in_the_weight_map", index_case(
        text='{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}'), "duplicate key"),
    ("weight_map_not_an_object", index_case(text='{"weight_map": []}'),
     "must have a weight_map object"),
]


@pytest.mark.parametrize(("name", "damage", "phrase"), INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_a_damaged_index_is_refused_naming_the_index(
        name: str, damage: Callable[[Path], None], phrase: str, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(LLAMA / "sharded", folder)
    damage(folder)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    error = info.value
    assert phrase in error.message, error.message
    assert error.location is not None
    assert Path(error.location.file).parent == folder
