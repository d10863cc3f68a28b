"""Command-line conventions every command follows: a --checkpoint file finds the config.json
beside it as a checkpoint folder does (compile, check and init alike), and every usage error,
found by argparse or after it, ends with its command's usage and section of docs/cli.md and
exits 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from partc.cli.commands import error_reference
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


CONFIG = str(LLAMA / "config.json")
USAGE_ERRORS = [
    (["compile", "--config", CONFIG, "--out", "b", "--tp", "64", "--pp", "128"],
     "--tp x --pp is 8192; partc builds at most 4096 ranks"),
    (["check", "--config", CONFIG, "--tp", "64", "--pp", "128"],
     "--tp x --pp is 8192; partc builds at most 4096 ranks"),
    (["compile", "--config", CONFIG, "--out", "b", "--ep", "64", "--etp", "64", "--pp", "2"],
     "--ep x --etp x --pp is 8192; partc builds at most 4096 ranks"),
    (["check", "--config", CONFIG, "--pp", "2", "--pp-layers", "1,1,1"],
     "--pp-layers gives 3 stage sizes (1,1,1) but --pp is 2; expected one unit count per "
     "pipeline stage"),
    (["compile", "--config", CONFIG, "--out", "b", "--bogus", "--also=1"],
     "unrecognized arguments: --bogus --also=1"),
    (["inspect", str(LLAMA), "--bogus"], "unrecognized arguments: --bogus"),
    (["compile", "--config", CONFIG, "--out", "b", "--digests"],
     "--digests needs --checkpoint: the digests are of the checkpoint's slices each rank reads"),
]


@pytest.mark.parametrize(("argv", "message"), USAGE_ERRORS)
def test_a_usage_error_found_after_parsing_ends_with_its_commands_usage_and_section(
        argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    command = argv[0]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2
    assert lines[0].startswith(f"usage: partc {command} [-h]")
    assert lines[-2] == f"partc {command}: error: {message}"
    section = error_reference(f"cli#partc-{command}")
    assert section is not None and section.rsplit(":", 1)[1].isdigit()  # the section's line
    assert lines[-1] == f"    see: {section}"
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--format", "json"] if command != "inspect" else [*argv[:1], "--format",
                                                                          "json", *argv[1:]])
    report = json.loads(capsys.readouterr().out)
    assert exited.value.code == 2
    (error,) = report["errors"]
    assert (error["stage"], error["doc"], error["see"]) == ("usage", f"cli#partc-{command}",
                                                            section)
    assert error["message"] == f"partc {command}: error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_an_error_of_argparse_itself_has_the_same_shape(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["compile", "--config", CONFIG])  # --out missing
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2
    assert lines[0].startswith("usage: partc compile [-h]")
    assert lines[-2] == "partc compile: error: the following arguments are required: --out"
    assert lines[-1] == f"    see: {error_reference('cli#partc-compile')}"
