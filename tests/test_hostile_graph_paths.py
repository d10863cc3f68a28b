"""An execution group whose `path` gives every unit the same module path (no `{unit}`, or a
YAML word such as `.nan`) is refused at that `path` line of the family file: the check in the
graph's constructor was raised without a location (found by tests/test_fuzz_located.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partc.cli.main import main

from support.families import MINI, MINI_CONFIG

UNIT_PATH = 'path: "model.layers.{unit}"'


@pytest.mark.parametrize("path", ["model.layers", ".nan"])
def test_a_unit_path_every_unit_shares_is_refused_at_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], path: str) -> None:
    assert MINI.count(UNIT_PATH) == 1
    family = tmp_path / "family.yaml"
    family.write_text(MINI.replace(UNIT_PATH, f"path: {path}"))
    (tmp_path / "config.json").write_text(json.dumps(MINI_CONFIG))
    status = main(["check", str(family), "--config", str(tmp_path / "config.json"),
                   "--format", "json"])
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert status == 1 and error["pointer"] == "/graph/0/path", error
    assert (error["file"], error["line"]) == (str(family), 8), error
    assert f"repeats unit path `{path}` (unit 1)" in error["message"], error
