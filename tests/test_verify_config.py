"""`partc verify` on a bad config or family: the errors `partc check` gives, before any model.

The user's config is read by partc's front end and bound to the family exactly as `check`
binds it, so every error names the user's file and line (never the reference model's
temporary copy), and nothing is built with torch before the input is known to be good.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partc.cli.main import main

from support import ROOT, hf


def _config(tmp_path: Path, name: str, **changes: object) -> Path:
    """The llama fixture's config with fields changed (None: removed), one key per line."""
    config = json.loads((hf("llama") / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    path = tmp_path / name
    path.write_text(json.dumps(config, indent=1))
    return path


def _line_of(path: Path, key: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1)
                if line.startswith(f' "{key}":'))


@pytest.fixture
def no_reference_model(monkeypatch):
    """Fail the test if verify gets as far as building a reference model."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("verify built a reference model from a bad input")
    monkeypatch.setattr("partc.verify.run.build_reference", refuse)


def _errors(capsys, *argv: str) -> tuple[int, list[str]]:
    status = main(list(argv))
    err = capsys.readouterr().err
    return status, [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize(("case", "changes", "key", "message"), [
    ("a size given as a string", {"hidden_size": "64"}, "hidden_size",
     "config field `hidden_size` must be int, found str '64'"),
    ("KV heads that do not divide the query heads", {"num_key_value_heads": 3},
     "num_key_value_heads", "`num_attention_heads` (4) must be divisible by "
                            "`num_key_value_heads` (3)"),
    ("a required field transformers would fill in", {"vocab_size": None}, None,
     "config.json has no `vocab_size`, which family `llama` requires"),
])
def test_verify_reports_a_bad_config_as_check_does_before_building_a_model(
        tmp_path, capsys, no_reference_model, case, changes, key, message):
    config = _config(tmp_path, "c.json", **changes)
    status, errors = _errors(capsys, "verify", "--config", str(config), "--tp", "1", "--pp", "1")
    assert status == 1 and len(errors) == 1, errors
    where = f"{config}:{_line_of(config, key)}:" if key else f"{config}:1:1:"
    assert errors[0].startswith(f"error: {where}") and message in errors[0], errors
    assert (1, errors) == _errors(capsys, "check", "--config", str(config))  # the same error


def test_verify_refuses_a_config_with_a_duplicate_key(tmp_path, capsys, no_reference_model):
    config = tmp_path / "dup.json"
    config.write_text((hf("llama") / "config.json").read_text().replace(
        '"vocab_size": 131', '"vocab_size": 131,\n  "vocab_size": 131'))
    status, errors = _errors(capsys, "verify", "--config", str(config))
    assert status == 1
    assert errors == [f"error: {config}:{_line_of_any(config, 'vocab_size', 2)}:3: duplicate key "
                      "'vocab_size' in config.json; expected every key once"]


def _line_of_any(path: Path, key: str, occurrence: int) -> int:
    lines = [i for i, line in enumerate(path.read_text().splitlines(), 1)
             if line.strip().startswith(f'"{key}":')]
    return lines[occurrence - 1]


def test_verify_names_a_missing_or_malformed_config_with_its_location(
        tmp_path, capsys, no_reference_model):
    missing = tmp_path / "nope.json"
    assert _errors(capsys, "verify", "--config", str(missing)) == (1, [
        f"error: {missing}: cannot read config.json: No such file or directory"])
    broken = tmp_path / "broken.json"
    broken.write_text('{\n "model_type": "llama",\n "hidden_size": \n}\n')
    assert _errors(capsys, "verify", "--config", str(broken)) == (1, [
        f"error: {broken}:4:1: malformed JSON in config.json: Expecting value"])


def test_verify_with_the_wrong_family_names_the_users_config(tmp_path, capsys,
                                                             no_reference_model):
    config = _config(tmp_path, "llama.json")
    status = main(["verify", "qwen2", "--config", str(config), "--tp", "1"])
    captured = capsys.readouterr()
    assert status == 1 and "unit(s)" not in captured.out and "partc-verify-" not in captured.err
    assert captured.err.startswith(
        f"error: {config}:{_line_of(config, 'model_type')}:16: config model_type is 'llama' but "
        "family `qwen2` describes 'qwen2' [at /model_type]")


def test_verify_reports_a_family_schema_typo_before_building_a_model(tmp_path, capsys,
                                                                      no_reference_model):
    family = tmp_path / "typo.yaml"
    text = (ROOT / "architectures" / "llama.yaml").read_text()
    assert text.count("\n  vocab_size: int") == 1
    family.write_text(text.replace("\n  vocab_size: int", "\n  vocab_sizee: int"))
    status, errors = _errors(capsys, "verify", str(family), "--config",
                             str(hf("llama") / "config.json"), "--tp", "1", "--pp", "1")
    line = text.splitlines().index("  vocab_size: int") + 1
    assert status == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: {family}:{line}:"), errors
    assert "rename `vocab_sizee` to `vocab_size`" in errors[0], errors


def test_a_config_transformers_cannot_build_is_one_error_at_the_users_config(tmp_path, capsys):
    config = _config(tmp_path, "pad.json", pad_token_id=500)  # beyond the 131-token vocabulary
    status, errors = _errors(capsys, "verify", "--config", str(config), "--tp", "1", "--pp", "1")
    assert status == 1
    assert errors == [f"error: {config}: transformers 5.24.0 cannot build a `llama` causal LM "
                      "from the config: Padding_idx must be within num_embeddings"]
