"""Paths the operating system refuses as too long (a 300-byte file name, a 5000-byte path):
every command reports one LoadError naming the path, cut, and the limit it passes, exit 1,
never OSError as an internal error (exit 70); the working folder is left as it was."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from partc.cli.main import main

from support import hf

LLAMA = hf("llama") / "config.json"
NAME = "a" * 300
DEEP = "b/" * 2500


def _tree(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize(("words", "shown", "limit"), [
    (["check", f"{NAME}.yaml", "--config", str(LLAMA)], f"{NAME}.yaml", "a 305-byte name"),
    (["check", f"{DEEP}x.yaml", "--config", str(LLAMA)], f"{DEEP}x.yaml", "5006 bytes"),
    (["compile", f"{NAME}.yaml", "--config", str(LLAMA), "--out", "o"], f"{NAME}.yaml",
     "a 305-byte name"),
    (["check", "llama", "--config", f"{NAME}.json"], f"{NAME}.json", "a 305-byte name"),
    (["inspect", NAME], NAME, "a 300-byte name"),
    (["inspect", f"{DEEP}x"], f"{DEEP}x", "5001 bytes"),
    (["explain", NAME, "lm_head"], NAME, "a 300-byte name"),
    (["report", NAME, "--out", "r"], NAME, "a 300-byte name"),
    (["families", "--copy", "llama", f"{NAME}.yaml"], f"{NAME}.yaml", "a 305-byte name"),
])
def test_a_path_too_long_for_the_system_is_one_located_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        words: list[str], shown: str, limit: str) -> None:
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    assert main(words) == 1
    err = capsys.readouterr().err
    cut = f"{shown[:60]}...{shown[-40:]} ({len(shown)} characters)"
    assert err.startswith(f"error: {cut}: cannot use "), err
    assert f"the path is too long for the operating system ({limit}" in err
    assert "internal error" not in err and shown not in err
    assert _tree(tmp_path) == before


def test_an_extends_target_too_long_is_blamed_on_the_extends_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {NAME}.yaml\n")
    assert main(["check", str(child), "--config", str(LLAMA)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {child}:1:10: `extends: {tmp_path}{os.sep}{NAME}.yaml`: "
                          "cannot use family file: the path is too long for the operating "
                          "system (a 305-byte name; a name has at most 255 bytes)"), err
