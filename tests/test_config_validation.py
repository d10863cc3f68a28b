"""Config values that contradict what their Hugging Face field means are refused at the field.

Each bad config is a copy of a real fixture config with one field changed. The expected
location is found in the written text by a plain search for the key (an oracle independent of
partc's JSON position scanner); the message text is spelled out in full.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from partc.api import check_family
from partc.cli.main import main

from support import FIXTURES, HF, QUANTIZED

DTYPES = "bfloat16, float, float16, float32, float64, float8_e4m3fn, float8_e5m2, half"
SIZE = "a positive integer of at most 2147483647"


def located(text: str, key: str) -> str:
    """`config.json:LINE:COL` of the value of top-level `key`, found by searching the text."""
    needle = f'\n  "{key}": '
    offset = text.index(needle) + len(needle)
    line = text.count("\n", 0, offset) + 1
    column = offset - text.rfind("\n", 0, offset)
    return f"config.json:{line}:{column}"


def write_config(folder: Path, fixture: Path, changes: dict[str, Any]) -> str:
    """A copy of `fixture` (a config.json) with `changes` applied; returns its text."""
    data = json.loads(fixture.read_text())
    data.update(changes)
    text = json.dumps(data, indent=2)
    (folder / "config.json").write_text(text)
    return text


BAD_CONFIGS = [
    ("dtype_a_number", HF / "llama", {"dtype": 32}, "dtype",
     f"config field `dtype` must be one of {DTYPES}, found 32"),
    ("torch_dtype_a_number", HF / "llama", {"torch_dtype": 32}, "torch_dtype",
     f"config field `torch_dtype` must be one of {DTYPES}, found 32"),
    ("hidden_size_2_62", HF / "llama", {"hidden_size": 2**62}, "hidden_size",
     f"config field `hidden_size` must be {SIZE}, found 4611686018427387904"),
    ("negative_vocab", HF / "llama", {"vocab_size": -1}, "vocab_size",
     f"config field `vocab_size` must be {SIZE}, found -1"),
    ("zero_layers", HF / "llama", {"num_hidden_layers": 0}, "num_hidden_layers",
     f"config field `num_hidden_layers` must be {SIZE}, found 0"),
    ("zero_intermediate", HF / "llama", {"intermediate_size": 0}, "intermediate_size",
     f"config field `intermediate_size` must be {SIZE}, found 0"),
    ("more_kv_heads_than_heads", HF / "llama", {"num_key_value_heads": 8}, "num_key_value_heads",
     "`num_key_value_heads` (8) must be at most `num_attention_heads` (4): each KV head serves "
     "one or more query heads"),
    ("heads_not_divisible_by_kv_heads", HF / "llama", {"num_key_value_heads": 3},
     "num_key_value_heads",
     "`num_attention_heads` (4) must be divisible by `num_key_value_heads` (3): each KV head "
     "serves the same number of query heads"),
    ("quantization_a_string", HF / "llama", {"quantization": "4bit"}, "quantization",
     'config field `quantization` must be a JSON object, found the string "4bit"'),
    ("quantization_config_an_array", QUANTIZED / "qwen3_fp8", {"quantization_config": [1]},
     "quantization_config", "config field `quantization_config` must be a JSON object, found "
     "an array [1]"),
    ("zero_routed_experts", HF / "deepseek_v3", {"n_routed_experts": 0}, "n_routed_experts",
     f"config field `n_routed_experts` must be {SIZE}, found 0"),
    ("zero_num_experts", HF / "qwen2_moe", {"num_experts": 0}, "num_experts",
     f"config field `num_experts` must be {SIZE}, found 0"),
    ("zero_local_experts", HF / "mixtral", {"num_local_experts": 0}, "num_local_experts",
     f"config field `num_local_experts` must be {SIZE}, found 0"),
    ("more_experts_per_token_than_experts", HF / "mixtral", {"num_experts_per_tok": 5},
     "num_experts_per_tok", "`num_experts_per_tok` (5) must be at most the number of experts, "
     "`num_local_experts` (4)"),
    ("negative_shared_experts", HF / "deepseek_v3", {"n_shared_experts": -1}, "n_shared_experts",
     "config field `n_shared_experts` must be an integer from 0 to 2147483647, found -1"),
]


@pytest.mark.parametrize(("name", "fixture", "changes", "key", "message"), BAD_CONFIGS,
                         ids=[case[0] for case in BAD_CONFIGS])
def test_a_config_field_against_its_meaning_is_refused_at_its_line_through_the_api(
        tmp_path, monkeypatch, name, fixture, changes, key, message):
    text = write_config(tmp_path, fixture / "config.json", changes)
    monkeypatch.chdir(tmp_path)
    errors = check_family(None, "config.json")
    assert [str(e) for e in errors] == [f"{located(text, key)}: {message} [at /{key}]"]


@pytest.mark.parametrize(("name", "fixture", "changes", "key", "message"), BAD_CONFIGS,
                         ids=[case[0] for case in BAD_CONFIGS])
def test_a_config_field_against_its_meaning_fails_the_command_line_with_exit_1(
        tmp_path, monkeypatch, name, fixture, changes, key, message):
    text = write_config(tmp_path, fixture / "config.json", changes)
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["compile", "--config", "config.json", "--out", "build"])
    assert status == 1
    where = located(text, key)
    line, column = (int(n) for n in where.rsplit(":", 2)[1:])
    source = text.splitlines()[line - 1]
    lines = err.getvalue().splitlines()
    assert lines[0] == f"error: {where}: {message} [at /{key}]"
    assert lines[-1] == "partc: 1 error(s)"
    # the context line, then a caret under the field's column
    assert lines[1].strip() == source.strip()
    caret = lines[2]
    assert caret.strip() == "^"
    assert len(lines[1]) - len(lines[1].lstrip()) - (len(source) - len(source.lstrip())) == (
        len(caret) - 1) - (column - 1)
    assert not (tmp_path / "build").exists()


def test_a_tensor_whose_byte_count_overflows_is_refused_at_its_declaration(tmp_path,
                                                                           monkeypatch):
    write_config(tmp_path, HF / "llama" / "config.json",
                 {"vocab_size": 2**31 - 1, "hidden_size": 2**31 - 1, "num_attention_heads": 1,
                  "num_key_value_heads": 1, "head_dim": 1})
    monkeypatch.chdir(tmp_path)
    errors = check_family(None, "config.json")
    # 4 bytes per F32 element: (2**31 - 1)**2 * 4 is beyond 2**63, let alone the 1 TiB limit
    assert [str(e) for e in errors] == [
        "architectures/llama.yaml:34:5: tensor `model.embed_tokens.weight` of shape "
        f"[2147483647, 2147483647] (F32) holds {(2**31 - 1) ** 2 * 4} bytes; partc accepts at "
        "most 1099511627776 bytes per tensor (check the sizes in config.json) "
        "[at /parameters/0]"]
    assert errors[0].tensor == "model.embed_tokens.weight"


def test_a_wrong_field_the_family_does_not_read_is_left_alone(tmp_path, monkeypatch):
    # llama reads no expert count: a config's stray `num_experts: 0` is not its concern
    write_config(tmp_path, HF / "llama" / "config.json", {"num_experts": 0})
    monkeypatch.chdir(tmp_path)
    assert check_family(None, "config.json") == []


def test_several_meaning_errors_are_all_reported(tmp_path, monkeypatch):
    text = write_config(tmp_path, HF / "llama" / "config.json", {"vocab_size": 0, "dtype": 1})
    monkeypatch.chdir(tmp_path)
    assert [str(e) for e in check_family(None, "config.json")] == [
        f"{located(text, 'dtype')}: config field `dtype` must be one of {DTYPES}, found 1 "
        "[at /dtype]",
        f"{located(text, 'vocab_size')}: config field `vocab_size` must be {SIZE}, found 0 "
        "[at /vocab_size]"]


FIXTURE_CONFIGS = sorted(FIXTURES.glob("hf/*/config.json")) + sorted(
    FIXTURES.glob("quantized/*/config.json")) + sorted(FIXTURES.glob("fullsize/*/config.json"))


@pytest.mark.parametrize("config", FIXTURE_CONFIGS,
                         ids=[str(p.parent.relative_to(FIXTURES)) for p in FIXTURE_CONFIGS])
def test_every_fixture_config_is_accepted(config):
    assert check_family(None, config) == []
