"""A base family named by `extends:` that is no family document (a scalar or a list) is
blamed on the base, at the child's `extends` line, not reported as the child's
missing keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from partc.cli.main import main

from support import hf

LLAMA = hf("llama") / "config.json"


@pytest.mark.parametrize(("text", "kind"), [("42\n", "a scalar"), ("- a\n- b\n", "a list"),
                                            ("hello\n", "a scalar")])
def test_a_base_that_is_no_mapping_is_named_at_the_extends_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, kind: str) -> None:
    (tmp_path / "base.yaml").write_text(text)
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\n")
    assert main(["check", str(child), "--config", str(LLAMA)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {child}:1:10: `extends: {tmp_path}/base.yaml`: base family "
        f"{tmp_path}/base.yaml is {kind}, expected a family document"), err
    assert "missing required key" not in err and err.endswith("partc: 1 error(s)\n")
