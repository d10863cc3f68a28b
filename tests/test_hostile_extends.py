"""A family in an `extends:` chain whose `parameters` or `remove` is no list (a number, null,
a boolean, a string, a mapping), in the child or in its base: one LoadError at that key of that
file, exit 1, never an internal error (exit 70, found by tests/test_fuzz_located.py) and never a
string read as a list of names or groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from partc.cli.main import main

from support.families import MINI

CASES = {  # case -> (child's second line, base text or None for the mini family, where, found)
    "parameters-integer": ("parameters: -1", None, "child.yaml:2:13", "parameter groups, found "
                           "an integer"),
    "parameters-null": ("parameters: null", None, "child.yaml:2:13", "found null"),
    "parameters-boolean": ("parameters: true", None, "child.yaml:2:13", "found a boolean"),
    "parameters-string": ("parameters: x", None, "child.yaml:2:13", "found a string"),
    "parameters-mapping": ("parameters: {a: 1}", None, "child.yaml:2:13", "found a mapping"),
    "remove-string": ("remove: embedding", None, "child.yaml:2:9",
                      "`remove` of a family in an `extends:` chain must be a list of parameter "
                      "group names, found a string"),
    "remove-integer": ("remove: -1", None, "child.yaml:2:9", "found an integer"),
    "base-parameters-integer": ("family: c", "family: b\nparameters: -1\n", "base.yaml:2:13",
                                "found an integer"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_parameters_or_remove_that_is_no_list_is_one_located_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    line, base, where, found = CASES[case]
    (tmp_path / "base.yaml").write_text(base or MINI)
    (tmp_path / "child.yaml").write_text(f"extends: base.yaml\n{line}\n")
    status = main(["check", str(tmp_path / "child.yaml")])
    err = capsys.readouterr().err
    errors = [e for e in err.splitlines() if e.startswith("error:")]
    assert status == 1 and len(errors) == 1, err
    assert errors[0].startswith(f"error: {tmp_path}/{where}: "), err
    assert "of a family in an `extends:` chain must be a list of" in errors[0], err
    assert found in errors[0], err
