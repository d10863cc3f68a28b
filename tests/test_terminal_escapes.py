"""Names from input files printed to a terminal: an ESC, a NUL or a newline in an `extends:`
target is shown escaped in the diagnostics, so a file cannot recolor the terminal or print a
forged `error:` line."""

from __future__ import annotations

from pathlib import Path

import pytest

from partc.cli.main import main

from support import hf

LLAMA = hf("llama") / "config.json"


@pytest.mark.parametrize(("target", "shown"), [
    (r"x\e[31m\nerror: forged.yaml", r"x\x1b[31m\nerror: forged.yaml"),
    (r"x\u0000\rpwned.yaml", r"x\x00\rpwned.yaml"),
    (r"\u009b2J\u007f.yaml", r"\x9b2J\x7f.yaml"),
])
def test_control_characters_of_an_extends_target_are_escaped_on_the_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, shown: str) -> None:
    child = tmp_path / "child.yaml"
    child.write_text(f'extends: "{target}"\n')
    assert main(["check", str(child), "--config", str(LLAMA)]) == 1
    err = capsys.readouterr().err
    assert f"`extends: {tmp_path}/{shown}`" in err, err
    assert not any(ch in err for ch in "\x1b\x00\r\x9b\x7f"), err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        line for line in err.splitlines() if line.startswith(f"error: {child}:1:10:")]
