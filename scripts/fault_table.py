"""Try every known fault against partc and tabulate what happens; writes docs/faults.md.

Each fault builds its inputs in a scratch folder (a broken family, config, checkpoint, output
path or topology), runs the `partc` command line in-process (and, for checkpoint faults, the
generated loader's `load()` as well) and records the exit status, the kind of error and its
first message. A fault "passes" when partc reports a PartcError (exit 1, or 2 for a bad
command line), prints no traceback and leaves the previous build byte-for-byte intact.

    python scripts/fault_table.py            # rewrite docs/faults.md
    python scripts/fault_table.py --check    # exit 1 if docs/faults.md is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "faults.md"
CASES = ROOT / "tests" / "cases"
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama"


# ---------------------------------------------------------------- safetensors surgery


def read_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    """The header (as a dict) and the data region of a .safetensors file."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def write_safetensors(path: Path, header: dict[str, Any] | bytes, data: bytes, *,
                      declared_length: int | None = None) -> None:
    """Write a .safetensors file from a header (dict or raw bytes) and a data region."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if declared_length is None else declared_length
    path.write_bytes(struct.pack("<Q", length) + raw + data)


def copy_checkpoint(scratch: Path, name: str = "ckpt", sharded: bool = False) -> Path:
    """A private copy of the tiny Llama checkpoint (single file or the 4-shard index)."""
    folder = scratch / name
    source = FIXTURE / "sharded" if sharded else FIXTURE
    folder.mkdir()
    for item in source.iterdir():
        if item.suffix in (".safetensors", ".json") and item.name != "manifest.json":
            shutil.copy(item, folder / item.name)
    return folder


def _edit_header(folder: Path, edit: Callable[[dict[str, Any]], None],
                 file: str = "model.safetensors") -> None:
    header, data = read_safetensors(folder / file)
    edit(header)
    write_safetensors(folder / file, header, data)


# ---------------------------------------------------------------- faults


@dataclass(frozen=True)
class Fault:
    """One mistake or broken input and how to provoke it."""

    area: str
    """family, family_file, config, topology, output, checkpoint, plan, placement, init."""
    name: str
    """Short identifier."""
    what: str
    """What is wrong, in words."""
    setup: Callable[[Path], list[str]]
    """Builds the inputs in a scratch folder; returns the `partc` arguments."""
    load: Callable[[Path, list[str]], Any] | None = None
    """For checkpoint faults: loads the faulty checkpoint with a generated loader."""


def _family_case(case: Path) -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        family = next(p for p in sorted(case.iterdir()) if p.stem == "family")
        shutil.copy(family, scratch / family.name)
        args = ["check", family.name]
        if (case / "config.json").is_file():
            shutil.copy(case / "config.json", scratch / "config.json")
            args += ["--config", "config.json"]
        return args
    return setup


def _config(text: str | bytes | None = None, edit: Callable[[dict[str, Any]], Any] | None = None,
            family: str = "llama") -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        target = scratch / "config.json"
        if edit is not None:
            data = json.loads((FIXTURE / "config.json").read_text())
            edit(data)
            target.write_text(json.dumps(data, indent=1))
        elif isinstance(text, bytes):
            target.write_bytes(text)
        elif text is not None:
            target.write_text(text)
        args = ["compile"] + ([family] if family else [])
        return args + ["--config", "config.json", "--out", "build"]
    return setup


def _config_folder(scratch: Path) -> list[str]:
    (scratch / "config.json").mkdir()
    return ["compile", "llama", "--config", "config.json", "--out", "build"]


def _too_large(scratch: Path) -> list[str]:
    with open(scratch / "config.json", "w") as handle:
        handle.write('{"model_type": "llama", "padding": "')
        handle.write("x" * (17 * 1024 * 1024))
        handle.write('"}')
    return ["compile", "llama", "--config", "config.json", "--out", "build"]


def _family_file(content: bytes | None, name: str = "family.yaml"
                 ) -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        if content is not None:
            (scratch / name).write_bytes(content)
        return ["check", name]
    return setup


def _fifo(name: str) -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        os.mkfifo(scratch / name)
        if name.endswith(".json"):
            return ["compile", "llama", "--config", name, "--out", "build"]
        return ["check", name]
    return setup


def _sparse(name: str, size: int) -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        with open(scratch / name, "wb") as handle:
            handle.truncate(size)
        return ["check", name]
    return setup


def _family_folder(scratch: Path) -> list[str]:
    (scratch / "family.yaml").mkdir()
    return ["check", "family.yaml"]


def _topology(*flags: str) -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        shutil.copy(FIXTURE / "config.json", scratch / "config.json")
        return ["compile", "llama", "--config", "config.json", "--out", "build", *flags]
    return setup


def _output(make: Callable[[Path], str]) -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        shutil.copy(FIXTURE / "config.json", scratch / "config.json")
        return ["compile", "llama", "--config", "config.json", "--out", make(scratch)]
    return setup


def _file_at(scratch: Path) -> str:
    (scratch / "afile").write_text("not a folder")
    return "afile"


def _under_file(scratch: Path) -> str:
    (scratch / "afile").write_text("not a folder")
    return "afile/build"


def _notes_folder(scratch: Path) -> str:
    (scratch / "notes").mkdir()
    (scratch / "notes" / "todo.txt").write_text("the user's own notes")
    return "notes"


def _link_to_folder(scratch: Path) -> str:
    (scratch / "real").mkdir()
    (scratch / "link").symlink_to("real")
    return "link"


def _into_checkpoint(scratch: Path) -> list[str]:
    copy_checkpoint(scratch, "ckpt")
    return ["compile", "llama", "--config", "ckpt/config.json", "--checkpoint", "ckpt", "--out",
            "ckpt"]


def _checkpoint(make: Callable[[Path], Path]) -> Callable[[Path], list[str]]:
    def setup(scratch: Path) -> list[str]:
        shutil.copy(FIXTURE / "config.json", scratch / "config.json")
        path = make(scratch)
        return ["check", "llama", "--config", "config.json", "--checkpoint",
                str(path.relative_to(scratch)), "--tp", "2"]
    return setup


def _load_with_good_build(scratch: Path, args: list[str]) -> Any:
    _, package = _good_build(scratch.parent)
    return package.load(args[args.index("--checkpoint") + 1], rank=0)


def _fingerprinted_build(scratch: Path) -> list[str]:
    from partc.api import CompileOptions, compile_family

    shutil.copy(FIXTURE / "config.json", scratch / "config.json")
    copy_checkpoint(scratch, "ckpt")
    _extra_tensor(copy_checkpoint(scratch, "other"))
    compile_family("llama", "config.json", None,
                   CompileOptions(checkpoint="ckpt", out="fingerprinted"))
    return ["compile", "llama", "--config", "config.json", "--checkpoint", "other", "--out",
            "fingerprinted"]


def _fresh_import(folder: Path, name: str) -> Any:
    """Import the generated package `name` from `folder`, never a same-named one imported
    earlier in this process (another build of the same family and topology)."""
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def _load_other_checkpoint(scratch: Path, args: list[str]) -> Any:
    name = package_name_of(scratch / "fingerprinted")
    return _fresh_import(scratch / "fingerprinted", name).load("other", rank=0)


def package_name_of(build: Path) -> str:
    """The generated package folder of a build."""
    return next(p.name for p in sorted(build.iterdir()) if p.is_dir())


def _single(edit: Callable[[Path], None]) -> Callable[[Path], Path]:
    def make(scratch: Path) -> Path:
        folder = copy_checkpoint(scratch)
        edit(folder)
        return folder
    return make


def _sharded(edit: Callable[[Path], None]) -> Callable[[Path], Path]:
    def make(scratch: Path) -> Path:
        folder = copy_checkpoint(scratch, sharded=True)
        edit(folder)
        return folder
    return make


def _truncate(keep: int) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[:keep])
    return edit


def _cut_payload(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _header_bytes(raw: bytes, declared: int | None = None) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        _, data = read_safetensors(folder / "model.safetensors")
        write_safetensors(folder / "model.safetensors", raw, data, declared_length=declared)
    return edit


def _long_header(folder: Path) -> None:
    _, data = read_safetensors(folder / "model.safetensors")
    write_safetensors(folder / "model.safetensors", b"{}", data,
                      declared_length=len(data) + 1000)


def _entry(name: str, **changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        _edit_header(folder, lambda h: h[name].update(changes))
    return edit


def _norm_as_f16(folder: Path) -> None:
    header, data = read_safetensors(folder / "model.safetensors")
    begin, _ = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"].update(dtype="F16", data_offsets=[begin, begin + 128])
    write_safetensors(folder / "model.safetensors", header, data[:begin + 128])


def _overlap(folder: Path) -> None:
    def edit(header: dict[str, Any]) -> None:
        first = header["model.norm.weight"]["data_offsets"][0]
        header["model.layers.2.post_attention_layernorm.weight"]["data_offsets"] = [first,
                                                                                  first + 256]
    _edit_header(folder, edit)


def _rename(old: str, new: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        _edit_header(folder, lambda h: h.__setitem__(new, h.pop(old)))
    return edit


def _extra_tensor(folder: Path) -> None:
    header, data = read_safetensors(folder / "model.safetensors")
    header["extra.bias"] = {"dtype": "F32", "shape": [4], "data_offsets": [len(data),
                                                                           len(data) + 16]}
    write_safetensors(folder / "model.safetensors", header, data + bytes(16))


def _metadata_not_strings(folder: Path) -> None:
    _edit_header(folder, lambda h: h.__setitem__("__metadata__", {"format": 1}))


def _index(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        path = folder / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        edit(index)
        path.write_text(json.dumps(index, indent=1))
    return apply


def _missing_shard(folder: Path) -> None:
    (folder / "model-00003-of-00004.safetensors").unlink()


def _tensor_in_two_shards(folder: Path) -> None:
    one, two = folder / "model-00001-of-00004.safetensors", \
        folder / "model-00004-of-00004.safetensors"
    h1, d1 = read_safetensors(one)
    h4, d4 = read_safetensors(two)
    name = "model.embed_tokens.weight"
    begin, end = h1[name]["data_offsets"]
    h4[name] = {**h1[name], "data_offsets": [len(d4), len(d4) + end - begin]}
    write_safetensors(two, h4, d4 + d1[begin:end])


def _shard_escapes(folder: Path) -> None:
    _index(lambda i: i["weight_map"].__setitem__("lm_head.weight", "../outside.safetensors"))(
        folder)


def _declared_length(delta: int) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        path.write_bytes(struct.pack("<Q", size + delta) + raw[8:])
    return edit


def _append(data: bytes, file: str = "model.safetensors") -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        with open(folder / file, "ab") as handle:
            handle.write(data)
    return edit


def _gap(folder: Path) -> None:
    header, data = read_safetensors(folder / "model.safetensors")
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [begin + 4, end + 4]
    write_safetensors(folder / "model.safetensors", header, data[:begin] + bytes(4) + data[begin:])


def _padded_with_nul(folder: Path) -> None:
    header, data = read_safetensors(folder / "model.safetensors")
    write_safetensors(folder / "model.safetensors", json.dumps(header).encode() + b"\0" * 5, data)


def _nan_in_header(folder: Path) -> None:
    header, data = read_safetensors(folder / "model.safetensors")
    text = json.dumps(header).replace('"format": "pt"', '"format": NaN')
    write_safetensors(folder / "model.safetensors", text.encode(), data)


def _huge_index(folder: Path) -> None:
    from partc.runtime.checkpoint import MAX_INDEX_BYTES

    os.truncate(folder / "model.safetensors.index.json", MAX_INDEX_BYTES + 1)  # sparse


def _checkpoint_fifo(scratch: Path) -> Path:
    os.mkfifo(scratch / "model.safetensors")
    return scratch / "model.safetensors"


def _link_out(folder: Path) -> None:
    os.replace(folder / "model.safetensors", folder.parent / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to("../elsewhere.safetensors")


def _empty_folder(scratch: Path) -> Path:
    folder = scratch / "ckpt"
    folder.mkdir()
    return folder


def _no_such_path(scratch: Path) -> Path:
    return scratch / "missing"


def _faults() -> Iterator[Fault]:
    for case in sorted(CASES.iterdir()) if CASES.is_dir() else []:
        if (case / "expected.txt").is_file() and (case / "expected.txt").read_text().strip():
            what = (case / "README").read_text().strip() if (case / "README").is_file() \
                else case.name.replace("_", " ")
            yield Fault("family", case.name, what, _family_case(case))
    files: list[tuple[str, str, Callable[[Path], list[str]]]] = [
        ("missing_file", "the family file does not exist", _family_file(None)),
        ("is_a_folder", "the family file is a folder", _family_folder),
        ("not_utf8", "the family file is Latin-1", _family_file(b"family: caf\xe9\n")),
        ("nul_character", "a NUL byte in the text", _family_file(b"family: x\x00\n")),
        ("too_large", "over the 1 MiB limit",
         _family_file(b"description: " + b"x" * (1024 * 1024) + b"\n")),
        ("unknown_suffix", "family.json", _family_file(b"{}", "family.json")),
        ("unknown_builtin", "`partc check nosuchmodel`", lambda scratch: ["check", "nosuchmodel"]),
        ("yaml_1_1_directive", "a `%YAML 1.1` directive",
         _family_file(b"%YAML 1.1\n---\nfamily: x\n")),
        ("is_a_fifo", "the family file is a FIFO (must not block)", _fifo("family.yaml")),
        ("oversized_sparse", "a 2 GiB sparse family file (refused before reading)",
         _sparse("family.yaml", 2**31)),
        ("toml_number_too_long", "a 5000-digit integer in TOML",
         _family_file(b"family = " + b"9" * 5000 + b"\n", "family.toml")),
    ]
    for name, what, setup in files:
        yield Fault("family_file", name, what, setup)
    base = json.loads((FIXTURE / "config.json").read_text())
    configs: list[tuple[str, str, Callable[[Path], list[str]]]] = [
        ("missing_file", "config.json does not exist", _config(None)),
        ("is_a_folder", "config.json is a folder", _config_folder),
        ("not_utf8", "config.json is Latin-1", _config(b'{"model_type": "llama\xe9"}')),
        ("malformed_json", "a trailing comma", _config('{"model_type": "llama",}')),
        ("nan_literal", "NaN is not JSON", _config('{"model_type": "llama", "x": NaN}')),
        ("duplicate_key", "hidden_size twice",
         _config(json.dumps(base, indent=1)[:-2] + ',\n "hidden_size": 32\n}')),
        ("not_an_object", "a JSON array", _config("[1, 2, 3]")),
        ("empty_file", "zero bytes", _config("")),
        ("number_too_long", "a 5000-digit integer",
         _config('{"model_type": "llama", "x": ' + "9" * 5000 + "}")),
        ("too_large", "over the 16 MiB limit", _too_large),
        ("is_a_fifo", "config.json is a FIFO (must not block)", _fifo("config.json")),
        ("dtype_a_number", "dtype: 32", _config(edit=lambda c: c.update(dtype=32))),
        ("size_2_62", "hidden_size = 2**62", _config(edit=lambda c: c.update(hidden_size=2**62))),
        ("tensor_bytes_overflow", "vocab_size and hidden_size 2**31-1: 2**64 bytes",
         _config(edit=lambda c: c.update(vocab_size=2**31 - 1, hidden_size=2**31 - 1,
                                         num_attention_heads=1, num_key_value_heads=1))),
        ("more_kv_heads_than_heads", "num_key_value_heads 8 > num_attention_heads 4",
         _config(edit=lambda c: c.update(num_key_value_heads=8))),
        ("heads_not_divisible", "4 heads over 3 KV heads",
         _config(edit=lambda c: c.update(num_key_value_heads=3))),
        ("quantization_not_an_object", "quantization_config is a string",
         _config(edit=lambda c: c.update(quantization_config="fp8"))),
        ("deep_nesting", "arrays nested 100 deep",
         _config('{"model_type": "llama", "x": ' + "[" * 100 + "]" * 100 + "}")),
        ("wrong_type", "num_hidden_layers is a string",
         _config(edit=lambda c: c.update(num_hidden_layers="3"))),
        ("bool_for_int", "hidden_size is true", _config(edit=lambda c: c.update(hidden_size=True))),
        ("missing_field", "no vocab_size", _config(edit=lambda c: c.pop("vocab_size"))),
        ("unknown_model_type", "model_type nope, no family given",
         _config(edit=lambda c: c.update(model_type="nope"), family="")),
        ("model_type_mismatch", "a qwen2 config for the llama family",
         _config(edit=lambda c: c.update(model_type="qwen2"))),
        ("huge_integer", "hidden_size = 2**70", _config(edit=lambda c: c.update(
            hidden_size=2**70))),
        ("negative_size", "vocab_size = -1", _config(edit=lambda c: c.update(vocab_size=-1))),
        ("zero_heads", "num_attention_heads = 0 and no head_dim",
         _config(edit=lambda c: [c.update(num_attention_heads=0), c.pop("head_dim")])),
        ("unknown_dtype", "dtype: float128", _config(edit=lambda c: c.update(dtype="float128"))),
    ]
    for name, what, setup in configs:
        yield Fault("config", name, what, setup)
    topologies = [
        ("tp_not_dividing_heads", "--tp 3 with 4 query and 2 KV heads",
         _topology("--tp", "3")),
        ("more_stages_than_layers", "--pp 5 with 3 layers", _topology("--pp", "5")),
        ("stage_units_not_summing", "--pp 2 --pp-layers 1,1 with 3 layers",
         _topology("--pp", "2", "--pp-layers", "1,1")),
        ("zero_tp", "--tp 0", _topology("--tp", "0")),
        ("bad_activation_dtype", "--activation-dtype int8",
         _topology("--activation-dtype", "int8")),
    ]
    for name, what, setup in topologies:
        yield Fault("topology", name, what, setup)
    yield Fault("output", "out_is_a_file", "--out names an existing file", _output(_file_at))
    yield Fault("output", "out_under_a_file", "--out is inside a file",
                _output(_under_file))
    yield Fault("output", "out_is_a_notes_folder", "--out is a folder of the user's files",
                _output(_notes_folder))
    yield Fault("output", "out_is_the_working_directory", "--out .", _output(lambda _: "."))
    yield Fault("output", "out_is_a_symlink", "--out is a symbolic link to a folder",
                _output(_link_to_folder))
    yield Fault("output", "out_is_the_checkpoint", "--out is the checkpoint folder (which holds "
                "the config)", _into_checkpoint)
    checkpoints: list[tuple[str, str, Callable[[Path], Path]]] = [
        ("no_such_path", "the checkpoint path does not exist", _no_such_path),
        ("empty_folder", "a folder with no safetensors", _empty_folder),
        ("shorter_than_8_bytes", "a 5-byte file", _single(_truncate(5))),
        ("truncated_header", "cut inside the JSON header", _single(_truncate(1000))),
        ("truncated_payload", "the last 1000 payload bytes cut", _single(_cut_payload)),
        ("header_length_beyond_file", "declared header length past the end",
         _single(_long_header)),
        ("huge_header_length", "declared header length of 200 MiB",
         _single(_header_bytes(b"{}", 200 * 1024 * 1024))),
        ("malformed_header_json", "header is not JSON", _single(_header_bytes(b"{not json"))),
        ("header_not_an_object", "header is a JSON array", _single(_header_bytes(b"[1, 2]"))),
        ("header_not_utf8", "header bytes are not UTF-8",
         _single(_header_bytes(b'{"\xff": 1}'))),
        ("duplicate_header_key", "a tensor named twice in the header",
         _single(_header_bytes(b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},'
                               b' "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}'))),
        ("tensor_name_with_escape_sequence", "a tensor named with a terminal escape sequence",
         _single(_header_bytes(b'{"a\\u001b[2Jb": {"dtype": "F32", "shape": [], '
                               b'"data_offsets": [0, 4]}}'))),
        ("tensor_name_with_line_break", "a tensor named with a line break in it",
         _single(_header_bytes(b'{"a\\nerror: b": {"dtype": "F32", "shape": [], '
                               b'"data_offsets": [0, 4]}}'))),
        ("index_name_with_escape_sequence", "the index names a tensor with an escape sequence",
         _sharded(_index(lambda i: i["weight_map"].__setitem__(
             "lm_head\x1b[31m.weight", "model-00001-of-00004.safetensors")))),
        ("overlapping_offsets", "two tensors share bytes", _single(_overlap)),
        ("offsets_out_of_file", "data_offsets past the data region",
         _single(_entry("model.norm.weight", data_offsets=[10**9, 10**9 + 256]))),
        ("byte_size_mismatch", "shape [64] but offsets span 128 bytes",
         _single(_entry("model.norm.weight", shape=[32]))),
        ("unknown_dtype", "dtype F128", _single(_entry("model.norm.weight", dtype="F128"))),
        ("negative_dimension", "shape [-64]", _single(_entry("model.norm.weight", shape=[-64]))),
        ("metadata_not_strings", "__metadata__ holds a number", _single(_metadata_not_strings)),
        ("number_too_long_in_header", "a 5000-digit dimension",
         _single(_header_bytes(b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000
                               + b'], "data_offsets": [0, 4]}}'))),
        ("dimension_beyond_u64", "a dimension of 2**70",
         _single(_entry("model.norm.weight", shape=[2**70]))),
        ("missing_shard_file", "a shard named by the index is gone", _sharded(_missing_shard)),
        ("tensor_in_two_shards", "embed_tokens in shards 1 and 4",
         _sharded(_tensor_in_two_shards)),
        ("index_names_wrong_shard", "the index maps lm_head to shard 1", _sharded(_index(
            lambda i: i["weight_map"].__setitem__("lm_head.weight",
                                                  "model-00001-of-00004.safetensors")))),
        ("index_shard_escapes_folder", "a shard named ../outside.safetensors",
         _sharded(_shard_escapes)),
        ("index_without_weight_map", "index lacks weight_map",
         _sharded(_index(lambda i: i.pop("weight_map")))),
        ("header_length_one_short", "declared header length 1 short (the JSON still parses)",
         _single(_declared_length(-1))),
        ("header_length_one_long", "declared header length 1 long",
         _single(_declared_length(1))),
        ("trailing_bytes", "8 bytes after the last tensor", _single(_append(bytes(8)))),
        ("gap_between_tensors", "4 unused bytes before model.norm.weight", _single(_gap)),
        ("header_padded_with_nul", "header padded with NUL bytes instead of spaces",
         _single(_padded_with_nul)),
        ("nan_in_header", "NaN in __metadata__", _single(_nan_in_header)),
        ("shard_trailing_bytes", "a byte after the last tensor of shard 2", _sharded(
            _append(b"\0", "model-00002-of-00004.safetensors"))),
        ("index_too_large", "index over the 64 MiB limit (sparse)", _sharded(_huge_index)),
        ("index_nan", "NaN in the index", _sharded(lambda folder: (
            folder / "model.safetensors.index.json").write_text(
                '{"metadata": {"total_size": NaN}, "weight_map": {}}'))),
        ("checkpoint_is_a_fifo", "a named pipe given as the checkpoint", _checkpoint_fifo),
        ("checkpoint_is_config_json", "config.json given as the checkpoint",
         lambda scratch: scratch / "config.json"),
        ("link_out_of_folder", "model.safetensors links to ../elsewhere.safetensors",
         _single(_link_out)),
        ("wrong_dtype", "norm stored as F16", _single(_norm_as_f16)),
        ("wrong_shape", "norm stored as [8, 8]", _single(_entry("model.norm.weight",
                                                                 shape=[8, 8]))),
        ("missing_tensor", "model.norm.weight renamed away",
         _single(_rename("model.norm.weight", "model.norm.weights"))),
        ("unexpected_tensor", "an extra tensor nobody owns", _single(_extra_tensor)),
    ]
    for name, what, make in checkpoints:
        yield Fault("checkpoint", name, what, _checkpoint(make), _load_with_good_build)
    yield Fault("checkpoint", "fingerprint_mismatch", "build compiled against one checkpoint, "
                "loaded with another whose header differs", _fingerprinted_build,
                _load_other_checkpoint)
    from hostile_faults import hostile_faults

    for area, name, what, setup in hostile_faults():
        yield Fault(area, name, what, setup)


# ---------------------------------------------------------------- running


@dataclass(frozen=True)
class Outcome:
    """What partc did with one fault."""

    fault: Fault
    exit_status: int
    kind: str
    message: str
    traceback: bool
    build_intact: bool | None
    loader: str | None


def _run_cli(args: list[str]) -> tuple[int, str, str]:
    from partc.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as exit_:
            status = int(exit_.code or 0)
    return status, out.getvalue(), err.getvalue()


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _first_error(text: str) -> tuple[str, str]:
    """(kind, first error line) from a JSON report; falls back to the stderr text."""
    try:
        report = json.loads(text)
        first = report["errors"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return "", ""
    from partc.errors import error_line

    where = first["file"] or ""
    if first["line"]:
        where += f":{first['line']}:{first['column']}"
    return first["kind"], error_line(where, first["message"], tensor=first.get("tensor"),
                                     pointer=first["pointer"])


def _scrub(scratch: Path, kind: str, message: str) -> tuple[str, str]:
    """The message with the scratch folder's absolute path (as given or resolved) removed."""
    for prefix in sorted({str(scratch), os.path.realpath(scratch)}, key=len, reverse=True):
        message = message.replace(prefix + os.sep, "").replace(prefix, ".")
    return kind, message


_GOOD_BUILD: dict[str, Any] = {}


def _good_build(work: Path) -> tuple[Path, Any]:
    """A clean TP=2 build of the tiny Llama, compiled once, and its imported package."""
    if "package" not in _GOOD_BUILD:
        from partc.api import CompileOptions, compile_family
        from partc.emit.render import package_name
        from partc.plan.topology import Topology

        out = work / "good-build"
        result = compile_family("llama", FIXTURE / "config.json", Topology(tensor_parallel_size=2),
                                CompileOptions(out=out))
        _GOOD_BUILD["package"] = _fresh_import(out, package_name(result.plan))
        _GOOD_BUILD["out"] = out
    return _GOOD_BUILD["out"], _GOOD_BUILD["package"]


def run_fault(fault: Fault, work: Path) -> Outcome:
    """Provoke one fault in a fresh scratch folder under `work` and record the outcome."""
    from partc.errors import PartcError

    scratch = work / f"{fault.area}-{fault.name}"
    scratch.mkdir()
    previous = os.getcwd()
    os.chdir(scratch)
    try:
        args = fault.setup(scratch)
        before = None
        if args[0] == "compile":
            build = scratch / args[args.index("--out") + 1]
            if build.name == "build" and not build.exists() and build.parent.is_dir():
                from partc.api import CompileOptions, compile_family

                compile_family("llama", FIXTURE / "config.json", None, CompileOptions(out=build))
            before = _tree(build) if build.is_dir() else None
        status, out, err = _run_cli([*args, "--format", "json"])
        kind, message = _scrub(scratch, *_first_error(out))
        if not kind and status == 2:  # argparse refused the command line
            kind, message = "usage", err.strip().splitlines()[-1]
        traceback = "Traceback" in err
        intact = None if before is None else _tree(build) == before
        loader = None
        if fault.load is not None:
            try:
                fault.load(scratch, args)
                loader = "loaded (not detected)"  # every checkpoint fault: a load refuses it
            except PartcError as error:
                shown = PartcError.__str__(error)  # a PartcErrors: its best error's line
                loader = _scrub(scratch, type(error).__name__, shown)[1]
                loader = f"{type(error).__name__}: {loader}"
            except Exception as error:  # a bug, recorded as such
                loader = f"BUG {type(error).__name__}: {error}"
    finally:
        os.chdir(previous)
    return Outcome(fault=fault, exit_status=status, kind=kind, message=message,
                   traceback=traceback, build_intact=intact, loader=loader)


def run_all() -> list[Outcome]:
    """Every fault's outcome, in table order."""
    with tempfile.TemporaryDirectory(prefix="partc-faults-") as scratch:
        _GOOD_BUILD.clear()
        try:
            return [run_fault(fault, Path(scratch)) for fault in _faults()]
        finally:
            _GOOD_BUILD.clear()


def _cell(text: str) -> str:
    # `] [` escaped: Markdown would read `[32] [at /pointer]` as a reference link
    return (text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
            .replace("`", "'").replace("] [", "] \\["))


def passed(outcome: Outcome) -> bool:
    """Whether partc handled the fault as it must: a PartcError, no traceback, build intact."""
    loader_ok = (outcome.loader is None or not outcome.loader.startswith(("BUG", "loaded")))
    return (outcome.exit_status in (1, 2) and not outcome.traceback
            and outcome.build_intact is not False and outcome.kind not in ("", "internal")
            and loader_ok)


def _limits() -> list[str]:
    """The bounds partc enforces on its inputs, read from the code (so they cannot drift)."""
    from hostile_faults import hostile_limits

    from partc.bind import binder as bind
    from partc.bind import meanings as hfconfig
    from partc.cli import parser as cli_parser
    from partc.family import expr, expr_values
    from partc.front import load
    from partc.runtime import checkpoint, headers

    rows = [
        ("family file size", f"{load.MAX_DOCUMENT_BYTES} bytes", "load.MAX_DOCUMENT_BYTES"),
        ("config.json size", f"{load.MAX_CONFIG_BYTES} bytes", "load.MAX_CONFIG_BYTES"),
        ("values in a document (aliases expanded)", str(load.MAX_NODES), "load.MAX_NODES"),
        ("characters once aliases are expanded", str(load.MAX_EXPANDED_CHARACTERS),
         "load.MAX_EXPANDED_CHARACTERS"),
        ("nesting depth (YAML, TOML, JSON)", str(load.MAX_DEPTH), "load.MAX_DEPTH"),
        ("integer size in TOML and JSON", f"{load.MAX_INTEGER_BITS} bits",
         "load.MAX_INTEGER_BITS"),
        ("expression or template length", f"{expr.MAX_TEXT_LENGTH} characters",
         "expr.MAX_TEXT_LENGTH"),
        ("expression nesting", str(expr_values.MAX_DEPTH), "expr_values.MAX_DEPTH"),
        ("expression integers", "magnitude below 2**63", "expr_values.INT_BOUND"),
        ("bytes of one tensor", f"{bind.MAX_TENSOR_BYTES} bytes", "bind.MAX_TENSOR_BYTES"),
        ("a size field of config.json (hidden_size, vocab_size, heads, experts, ...)",
         str(hfconfig.MAX_CONFIG_DIMENSION), "hfconfig.MAX_CONFIG_DIMENSION"),
        ("units of one execution group, iterations of one `for`", str(bind.MAX_UNITS),
         "bind.MAX_UNITS"),
        ("parameter-group instances of a family", str(bind.MAX_GROUP_INSTANCES),
         "bind.MAX_GROUP_INSTANCES"),
        ("--tp, --pp", str(cli_parser.MAX_PARALLEL_SIZE), "parser.MAX_PARALLEL_SIZE"),
        ("--tp x --pp", str(cli_parser.MAX_WORLD_SIZE), "parser.MAX_WORLD_SIZE"),
        ("safetensors JSON header", f"{headers.MAX_HEADER_SIZE} bytes",
         "headers.MAX_HEADER_SIZE"),
        ("model.safetensors.index.json size", f"{checkpoint.MAX_INDEX_BYTES} bytes",
         "checkpoint.MAX_INDEX_BYTES"),
    ]
    modules = {m.__name__.rsplit(".", 1)[-1]: m.__name__ for m in (
        cli_parser, bind, hfconfig, expr, expr_values, load, checkpoint, headers)}
    modules.update(bind=bind.__name__, hfconfig=hfconfig.__name__)
    spelled = [(what, value, f"{modules[name.split('.')[0]]}.{name.split('.', 1)[1]}")
               for what, value, name in rows] + hostile_limits()
    return ["## Limits", "", "| input | at most | constant |", "|---|---|---|",
            *(f"| {what} | {value} | `{name}` |" for what, value, name in spelled), "",
            "## Faults", ""]


def _stages() -> list[str]:
    """The error classes, one per stage, as `partc.errors.STAGES` lists them."""
    from partc.errors import STAGES

    summaries = {stage: " ".join((cls.__doc__ or "").split("\n\n")[0].split())
                 for stage, cls in STAGES.items()}
    rows = [f"| `{stage}` | `{cls.__name__}` | {_cell(summaries[stage])} |"
            for stage, cls in STAGES.items()]
    return ["## Errors by stage", "",
            "Every error is a `PartcError` of one class per stage; the stage is a constant of the "
            "class (the `stage` field of `--format json`), and every other class derives from "
            "the class of its stage (`ParallelPlanError` and `ArchitecturePartitionError` are "
            "`LayoutError`s, `ExpressionError` a `SemanticError`). A faulty launch under torchrun "
            "(RANK, WORLD_SIZE, LOCAL_RANK, a device, mesh or process group) is a `LaunchError`, "
            "and so is a `load()` call that asks wrongly (a keyword option of the wrong type or "
            "value or one it does not have, a checkpoint argument that is no path); "
            "it derives from `CheckpointError`, which such faults raised before, so "
            "`except CheckpointError` still catches them and `except LaunchError` catches them "
            "alone. A boundary payload refused while a model runs is a `BoundaryPayloadError` "
            "(an `ExecutorError`, no longer an `ArchitectureBoundaryError`, which is kept for "
            "malformed boundary schemas).", "",
            "| stage | class | what it reports |", "|---|---|---|", *rows, ""]


def render(outcomes: list[Outcome]) -> str:
    """The markdown table of docs/faults.md."""
    lines = [
        "# Faults partc was tried against",
        "",
        "Generated by `python scripts/fault_table.py`; `tests/test_faults.py` fails when this "
        "file is out of date. Every fault runs the `partc` command line (`check`, or `compile` "
        "over a previous build that must survive byte for byte); checkpoint faults also go "
        "through a generated loader's `load()` (TP=2, rank 0). The message is the first error "
        "of the JSON report as the command line prints it, and the `load()` column the "
        "loader's error as `str()` shows it (the tensor is named where the message does not "
        "quote it); paths are relative to the scratch folder of the fault. The "
        "known mistakes of family files are the case table, `tests/cases/<name>/`.",
        "",
        "Checkpoint inputs are held to the safetensors library's rules or stricter (see "
        "`tests/test_header_strictness.py`, which runs every damaged header through both). "
        "Symbolic links are followed only into the checkpoint folder or the `blobs/` folder of "
        "its Hugging Face cache repository, and a file that changes while it is read is "
        "reported, never read as garbage (`tests/test_reader_faults.py`).",
        "",
        *_stages(),
        *_limits(),
        f"{sum(passed(o) for o in outcomes)} of {len(outcomes)} faults handled: a PartcError "
        "with a located message, no traceback, the previous build intact.",
        "",
        "| area | fault | what is wrong | exit | error | first message | build intact | "
        "generated `load()` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        intact = {None: "-", True: "yes", False: "**NO**"}[o.build_intact]
        lines.append(
            f"| {o.fault.area} | {o.fault.name} | {_cell(o.fault.what)} | {o.exit_status} | "
            f"{o.kind or '-'} | {_cell(o.message)} | {intact} | "
            f"{_cell(o.loader) if o.loader else '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Regenerate docs/faults.md, or check it is up to date with --check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    text = render(run_all())
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is out of date: run python scripts/fault_table.py")
            return 1
        print(f"{DOC.relative_to(ROOT)} is up to date")
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
