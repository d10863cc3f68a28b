"""Command-line conventions every command follows: a --checkpoint file finds the config.json
beside it as a checkpoint folder does (compile, check and init alike), and every usage error,
found by argparse or after it, ends with its command's usage and section of docs/cli.md and
exits 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from partc.cli.main import main

from support import hf

LLAMA = hf("llama")


def _checkpoint_file(tmp_path: Path) -> Path:
    folder = tmp_path / "ck"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(LLAMA / name, folder / name)
    return folder / "model.safetensors"


def test_a_checkpoint_file_finds_its_config_beside_it_for_compile_check_and_init(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _checkpoint_file(tmp_path)
    assert main(["compile", "--checkpoint", str(checkpoint), "--tp", "2", "--out",
                 str(tmp_path / "from_file"), "-q"]) == 0
    assert main(["compile", "--config", str(checkpoint.parent / "config.json"),
                 "--checkpoint", str(checkpoint), "--tp", "2", "--out",
                 str(tmp_path / "explicit"), "-q"]) == 0
    assert (tmp_path / "from_file" / "plan.json").read_bytes() == (
        tmp_path / "explicit" / "plan.json").read_bytes()
    capsys.readouterr()
    assert main(["check", "--checkpoint", str(checkpoint)]) == 0
    assert capsys.readouterr().out.startswith("ok: family, config binding, checkpoint checked")
    family = tmp_path / "family.yaml"
    assert main(["init", "--checkpoint", str(checkpoint), "--out", str(family)]) == 0
    assert "model_types: [llama]" in family.read_text()


def test_a_checkpoint_file_without_a_config_beside_it_is_a_usage_error_naming_where_it_looked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _checkpoint_file(tmp_path)
    (checkpoint.parent / "config.json").unlink()
    with pytest.raises(SystemExit) as exited:
        main(["compile", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert ("partc compile: error: compile needs --config (or a --checkpoint folder holding "
            "config.json, or a --checkpoint file with config.json beside it); there is no "
            f"{checkpoint.parent / 'config.json'}") in err
    assert not (tmp_path / "b").exists()
