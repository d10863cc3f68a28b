"""Hypothesis fuzzing: generated and mutated family documents (YAML and TOML), configs and
safetensors headers go through check, compile and load; only PartcError may escape, and a failed
compile leaves the previous build byte for byte.

The budget is PARTC_FUZZ_EXAMPLES (total examples over all targets, default 2000 for CI);
`python benchmarks/fuzz.py` runs 12,000 and prints the outcome counts. PARTC_FUZZ_RANDOM=1
draws fresh random examples instead of the derandomized CI sequence.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import io
import json
import os
import re
import shutil
import struct
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from regenerate_cases import toml_spelling

from partc.api import CompileOptions, bind, check_family, checkpoint_errors, compile_family
from partc.cli.main import main as cli_main
from partc.errors import PartcError
from partc.output import MARKER
from partc.plan.topology import Topology
from partc.runtime.checkpoint import open_checkpoint

from support import ROOT, import_build
from support.families import MINI, MINI_CONFIG, MINI_TOML

BUDGET = int(os.environ.get("PARTC_FUZZ_EXAMPLES", "2000"))
SHARES = {"yaml_text": 0.2, "yaml_tree": 0.15, "toml": 0.15, "config": 0.15,
          "header": 0.2, "cli": 0.15}
OUTCOMES: dict[str, Counter[str]] = {target: Counter() for target in SHARES}
LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"


def fuzz_settings(target: str) -> settings:
    return settings(max_examples=max(10, int(BUDGET * SHARES[target])), deadline=None,
                    database=None, derandomize=not os.environ.get("PARTC_FUZZ_RANDOM"),
                    suppress_health_check=list(HealthCheck), print_blob=True)


# ---------------------------------------------------------------- seeds and mutations

SEEDS_YAML = [MINI, (ROOT / "architectures" / "llama.yaml").read_text()]
SEEDS_YAML += [p.read_text() for p in sorted((ROOT / "tests" / "cases").glob("*/family.yaml"))
               if len(p.read_bytes()) < 4000][:12]
SEEDS_TOML = [MINI_TOML, (ROOT / "tests" / "cases" / "llama_toml_twin" / "family.toml")
              .read_text()]
TOKENS = [
    "{", "}", "[", "]", ":", ": ", "- ", ",", "\n", "\t", "  ", "#", "'", '"', "&a ", "*a",
    "!!python/object:os.system ", "!!str ", "<<: ", "? ", "|", ">", "---\n", "...", "%YAML 1.1\n",
    "no", "yes", "off", "0o10", "0x1F", "010", "1_000", "1:20", ".inf", "1e3", "~", "null", "-1",
    "0", "99999999999999999999", "2**63", "[]", "{}", "''", "hidden_size // 0", "x % 0",
    "not ", " and ", " if ", " else ", "(", ")", "{unit}", "{{", "}}", "__import__('os')",
    "ünï☃", "\\", "\\u0000", "=", "[[parameters]]\n", "[parameters.params]\n", '"""', "'''",
    "inf", "nan", "1979-05-27", "true", "false", "replicated", "column", "row", "partitioned",
    "units", "owner", "static", "unit", "members", "shape", "sharding", "segments",
    "9" * 5000, "0x" + "f" * 4000, "1_" + "0" * 4500, "0" + "7" * 4400, "1" * 400 + ".5",
    "&a [*a]", "*undefined", "!!binary aGk=", "\ufeff", "\r", "\x85", "\u2028",
]
REPLACEMENTS = [
    "0", "1", "2", "3", "-1", "7", "64", "0o10", "no", "1e3", "true", "false", "null", "~", "x",
    "hidden_size", "hidden_size // 0", "hidden_size * 2", "vocab_size - 1", "num_layers + 1",
    "min(hidden_size, 3)", "ceil_div(vocab_size, 3)", "gcd(hidden_size, 6)", "unit", "{unit}",
    "model.x.{unit}", "decoder", "embedding", "replicated", "column", "row", "vocabulary",
    "channels", "first", "last", "batch", "sequence", "activation", "int32", "{balanced: 1}",
    "{equal: 0}", "{partitioned: 0}", "[]", "[hidden_size]", "[0, hidden_size]", '"a"',
    "not tie_word_embeddings", "attention_bias", "num_key_value_heads", "intermediate_size",
    "num_attention_heads // 2", "head_dim * 3", "[1, 2]", "{static: output}",
    "{any_of: [embedding, output]}", "{unit: decoder}", "9" * 5000, "0x" + "f" * 4000,
    "1" * 100, '"' + "{unit}" * 300 + '"', "[" + ", ".join(["hidden_size"] * 200) + "]",
]
_VALUE = re.compile(r"(?<=: )[^\s,{}\[\]#][^,{}\[\]#\n]*|(?<=[\[,] )[^\s,{}\[\]]+"
                                  r"|(?<== )[^\n#]+")
WORDS = ["hidden_size", "vocab_size", "num_layers", "decoder", "embedding", "mini", "llama",
         "when", "role", "module", "params", "weight", "bias", "params", "balanced", "equal"]


@st.composite
def mutated_text(draw: st.DrawFn, seeds: list[str]) -> str:
    """A seed with one to five random edits: tokens inserted, spans cut or swapped, lines
    duplicated, removed or re-indented, words replaced."""
    text = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 3))):
        lines = text.split("\n")
        kind = draw(st.integers(0, 12))
        at = draw(st.integers(0, len(text)))
        if kind >= 8:  # keep the syntax, change one value: reaches the later stages
            spots = list(_VALUE.finditer(text))
            if spots:
                spot = spots[draw(st.integers(0, len(spots) - 1))]
                text = text[:spot.start()] + draw(st.sampled_from(REPLACEMENTS)) + \
                    text[spot.end():]
        elif kind == 0:
            text = text[:at] + draw(st.sampled_from(TOKENS)) + text[at:]
        elif kind == 1:
            text = text[:at] + text[at + draw(st.integers(1, 40)):]
        elif kind == 2:
            token = draw(st.sampled_from(TOKENS + WORDS))
            text = text[:at] + token + text[at + draw(st.integers(1, 12)):]
        elif kind == 3 and lines:
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i])
            text = "\n".join(lines)
        elif kind == 4 and len(lines) > 1:
            del lines[draw(st.integers(0, len(lines) - 1))]
            text = "\n".join(lines)
        elif kind == 5 and lines:
            i = draw(st.integers(0, len(lines) - 1))
            lines[i] = draw(st.sampled_from(["", " ", "  ", "\t", "   "])) + lines[i].lstrip(
                " " if draw(st.booleans()) else "")
            text = "\n".join(lines)
        elif kind == 6 and len(lines) > 2:
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
        else:
            text = text[:at] + draw(st.text(max_size=12)) + text[at:]
    return text


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(TOKENS + WORDS),
    st.text(max_size=20),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(WORDS + TOKENS), inner,
                                                 max_size=4)), max_leaves=12)


@functools.cache
def _parsed(text: str) -> Any:
    return yaml.load(text, Loader=yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*path, index))
    return found


@st.composite
def mutated_tree(draw: st.DrawFn, seeds: list[str]) -> Any:
    """A seed's data with one to four nodes replaced, deleted, duplicated or renamed."""
    data = copy.deepcopy(draw(st.sampled_from([_parsed(seeds[0])] * 3 + [_parsed(seeds[1])])))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(data)
        path = draw(st.sampled_from(paths))
        if not path:
            continue
        parent = data
        for token in path[:-1]:
            parent = parent[token]
        last = path[-1]
        kind = draw(st.integers(0, 5))
        if kind >= 4:  # a value of the same kind: stays schema-valid more often
            old = parent[last]
            parent[last] = draw(st.integers(-2, 70) if isinstance(old, int)
                                else st.sampled_from(REPLACEMENTS))
        elif kind == 0:
            parent[last] = draw(values)
        elif kind == 1:
            del parent[last]
        elif kind == 2 and isinstance(parent, list):
            parent.insert(last, parent[last])
        elif kind == 3 and isinstance(parent, dict):
            parent[draw(st.sampled_from(WORDS + TOKENS))] = parent.pop(last)
        else:
            parent[last] = draw(st.sampled_from(TOKENS + WORDS))
    return data


# ---------------------------------------------------------------- the pipeline under test

_WORK: dict[str, Path] = {}


def workdir() -> Path:
    """A scratch folder shared by all examples of this process (built once)."""
    if "root" not in _WORK:
        root = Path(tempfile.mkdtemp(prefix="partc-fuzz-"))
        atexit.register(shutil.rmtree, root, True)
        (root / "config.json").write_text(json.dumps(MINI_CONFIG))
        shutil.copy(LLAMA / "config.json", root / "llama.json")
        _WORK["root"] = root
    return _WORK["root"]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def outcome_of(run: Callable[[], object]) -> str:
    """'ok', or the class of the PartcError raised (or of the first error returned, for the
    calls that return every error); any other exception fails the test with its traceback."""
    try:
        found = run()
    except PartcError as error:
        return type(error).__name__
    except Exception:  # the very thing the fuzzer hunts
        pytest.fail("an exception other than PartcError escaped:\n" + traceback.format_exc())
    if isinstance(found, list) and found:
        assert all(isinstance(error, PartcError) for error in found)
        return type(sorted(found, key=PartcError.sort_key)[0]).__name__
    return "ok"


def compile_keeping_the_previous_build(family: Path, config: Path, tp: int, pp: int) -> str:
    """Compile over a previous build: success writes exactly the rendered files, failure
    leaves the previous build byte for byte and no staging folder behind."""
    out = workdir() / "build"
    if not out.exists():
        compile_family(mini_family(), workdir() / "config.json", None, CompileOptions(out=out))
    before = _tree(out)
    result: list[Any] = []
    with mock.patch.object(os, "fsync", lambda fd: None):  # durability is test_faults' job
        outcome = outcome_of(lambda: result.append(compile_family(
            family, config, Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
            CompileOptions(out=out))) or None)
    after = _tree(out)
    if outcome == "ok":
        marker = json.loads(after.pop(MARKER))
        assert marker["kind"] == "build" and marker["files"] == sorted(result[0].files)
        assert after == {k: v.encode() for k, v in result[0].files.items()}
    else:
        assert after == before, "a failed compile changed the previous build"
    assert sorted(p.name for p in workdir().iterdir() if p.name.startswith(".build")) == []
    return outcome


def mini_family() -> Path:
    path = workdir() / "mini.yaml"
    if not path.exists():
        path.write_text(MINI)
    return path


def run_family(text: str, suffix: str, target: str, tp: int, pp: int) -> None:
    family = workdir() / f"family{suffix}"
    family.write_bytes(text.encode("utf-8", "surrogatepass"))
    config = workdir() / ("llama.json" if "family: llama" in text or 'family = "llama"' in text
                          else "config.json")
    outcome = outcome_of(lambda: check_family(family))
    if outcome == "ok":
        outcome = compile_keeping_the_previous_build(family, config, tp, pp)
    OUTCOMES[target][outcome] += 1


# ---------------------------------------------------------------- the fuzz tests


@fuzz_settings("yaml_text")
@given(mutated_text(SEEDS_YAML), st.integers(1, 2), st.integers(1, 2))
def test_mutated_yaml_families_give_partc_errors_or_whole_builds(text, tp, pp):
    run_family(text, ".yaml", "yaml_text", tp, pp)


@fuzz_settings("yaml_tree")
@given(mutated_tree(SEEDS_YAML), st.sampled_from([".yaml", ".toml"]), st.integers(1, 2))
def test_structurally_mutated_families_in_yaml_and_toml_give_partc_errors_or_builds(
        data, suffix, tp):
    if suffix == ".toml":
        try:
            text = toml_spelling(data) if isinstance(data, dict) else ""
        except (TypeError, ValueError):
            suffix, text = ".yaml", ""
    if suffix == ".yaml" or not text:
        suffix = ".yaml"
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    run_family(text, suffix, "yaml_tree", tp, 1)


@fuzz_settings("toml")
@given(mutated_text(SEEDS_TOML), st.integers(1, 2))
def test_mutated_toml_families_give_partc_errors_or_whole_builds(text, pp):
    run_family(text, ".toml", "toml", 1, pp)


@st.composite
def mutated_config(draw: st.DrawFn) -> str:
    data = dict(MINI_CONFIG)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(data) + WORDS))
        if draw(st.booleans()):
            data[key] = draw(values)
        else:
            data.pop(key, None)
    text = json.dumps(data, indent=1)
    if draw(st.integers(0, 4)) == 0:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["{", "}", ",", '"', "NaN", "[", "\\"])) + \
            text[at:]
    return text


@fuzz_settings("config")
@given(mutated_config(), st.integers(1, 2))
def test_mutated_configs_give_partc_errors_or_whole_builds(text, tp):
    config = workdir() / "mutated.json"
    config.write_text(text)
    outcome = compile_keeping_the_previous_build(mini_family(), config, tp, 1)
    OUTCOMES["config"][outcome] += 1


# ---------------------------------------------------------------- safetensors headers

_HEADER: dict[str, Any] = {}


def llama_checkpoint() -> tuple[dict[str, Any], bytes, Any]:
    """The tiny Llama header, its data region and a TP=2 build's imported package."""
    if not _HEADER:
        _HEADER["bound"] = bind("llama", LLAMA / "config.json")[0]
        raw = (LLAMA / "model.safetensors").read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        _HEADER["header"] = json.loads(raw[8:8 + size])
        _HEADER["data"] = raw[8 + size:]
        out = workdir() / "llama-build"
        result = compile_family("llama", LLAMA / "config.json", Topology(tensor_parallel_size=2),
                                CompileOptions(out=out))
        _HEADER["package"] = import_build(out, result.plan)
    return _HEADER["header"], _HEADER["data"], _HEADER["package"]


DTYPES = ["F32", "F16", "BF16", "I8", "U8", "F64", "BOOL", "F8_E4M3", "F128", "", 3, None]


@st.composite
def mutated_checkpoint(draw: st.DrawFn) -> bytes:
    header, data, _ = llama_checkpoint()
    header = json.loads(json.dumps(header))
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        entry = header.get(name)
        kind = draw(st.integers(0, 7))
        if not isinstance(entry, dict):
            continue
        if kind == 0:
            entry["dtype"] = draw(st.sampled_from(DTYPES))
        elif kind == 1:
            entry["shape"] = draw(st.lists(st.integers(-3, 200), max_size=3) | values)
        elif kind == 2:
            begin = draw(st.integers(-10, len(data) + 10))
            entry["data_offsets"] = [begin, begin + draw(st.integers(-10, 40000))]
        elif kind == 3:
            del header[name]
        elif kind == 4:
            header[draw(st.sampled_from(names + WORDS))] = dict(entry)
        elif kind == 5:
            header["__metadata__"] = draw(values)
        elif kind == 6:
            header[name] = draw(values)
        else:
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(
                values)
    raw = json.dumps(header).encode()
    length = len(raw)
    blob = struct.pack("<Q", length) + raw + data
    tweak = draw(st.integers(0, 6))
    if tweak == 0:
        blob = struct.pack("<Q", length + draw(st.integers(-50, 2**20))) + blob[8:]
    elif tweak == 1:
        blob = blob[:draw(st.integers(0, len(blob)))]
    elif tweak == 2:
        at = draw(st.integers(8, 8 + length))
        blob = blob[:at] + draw(st.binary(min_size=1, max_size=4)) + blob[at + 1:]
    elif tweak == 3:  # a number too long for int(), or not finite
        digits = draw(st.sampled_from(["9" * 5000, "1e400", "-0", "1.5", "-1", str(2**70)]))
        raw = re.sub(r"\d+", digits, raw.decode(), count=1).encode()
        blob = struct.pack("<Q", len(raw)) + raw + data
    return blob


@fuzz_settings("header")
@given(mutated_checkpoint(), st.integers(0, 1))
def test_mutated_safetensors_headers_are_caught_by_check_and_by_load(blob, rank):
    folder = workdir() / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(blob)
    _, _, package = llama_checkpoint()
    if rank:  # the whole `partc check --checkpoint` path
        checked = outcome_of(lambda: check_family("llama", LLAMA / "config.json", folder))
    else:  # its checkpoint part, against the already bound family (faster)
        checked = outcome_of(lambda: checkpoint_errors(_HEADER["bound"], open_checkpoint(folder)))
    state: list[Any] = []
    loaded = outcome_of(lambda: state.append(package.load(folder, rank=rank)))
    if loaded == "ok":
        layout = state[0].layout
        for item in layout.tensors:
            assert state[0].tensors[item.target].shape == tuple(item.local_shape)
    OUTCOMES["header"][f"check {checked} / load {loaded}"] += 1


# ---------------------------------------------------------------- the command line


@fuzz_settings("cli")
@given(st.one_of(mutated_text(SEEDS_YAML), mutated_text(SEEDS_TOML)),
       st.sampled_from(["check", "compile"]), st.sampled_from(["text", "json"]))
def test_the_cli_exits_0_or_1_and_never_prints_a_traceback(text, command, fmt):
    suffix = ".toml" if text.lstrip().startswith(("family =", "# TOML")) else ".yaml"
    family = workdir() / f"cli{suffix}"
    family.write_bytes(text.encode("utf-8", "surrogatepass"))
    args = [command, str(family), "--format", fmt]
    if command == "compile":
        args += ["--config", str(workdir() / "config.json"), "--out", str(workdir() / "cli-out")]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli_main(args)
    assert status in (0, 1), err.getvalue()
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue()
    if fmt == "json":
        report = json.loads(out.getvalue())
        assert report["ok"] is (status == 0)
        for error in report["errors"]:
            assert error["message"] and error["kind"] != "internal"
    OUTCOMES["cli"][f"exit {status}"] += 1
