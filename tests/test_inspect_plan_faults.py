"""inspect, report and shard on a plan.json edited by hand so that they trip over it: one located
error (file, line, pointer) from the plan schema, exit 1, never a crash. A plan partc wrote is
not schema-checked again (a full-size plan takes seconds to validate)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.plan.topology import Topology

from support import hf


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "b"
    compile_family(None, hf("llama") / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(out=out))
    return out


def _edited(built: Path, tmp_path: Path, edit: object) -> Path:
    copy = tmp_path / "b"
    shutil.copytree(built, copy)
    plan = json.loads((copy / "plan.json").read_text())
    edit(plan)  # type: ignore[operator]
    (copy / "plan.json").write_text(json.dumps(plan, indent=1))
    return copy


SHAPE = (lambda p: p["tensors"][0].__setitem__("shape", "big"), "/tensors/0/shape",
         "'big' is not of type 'array'")
PLACEMENTS = (lambda p: p["tensors"][2].__setitem__("placements", 5), "/tensors/2/placements",
              "5 is not of type 'array'")


@pytest.mark.parametrize(("command", "options", "case"), [
    ("inspect", [], SHAPE),                     # the summary's byte totals
    ("report", ["--out", "r.html"], SHAPE),     # the page's bars
    ("inspect", ["--rank", "0"], PLACEMENTS),   # the tensor table
], ids=["inspect", "report", "inspect-rank"])
def test_an_edited_plan_is_a_located_schema_error(built: Path, tmp_path: Path, capsys: object,
                                                  command: str, options: list[str],
                                                  case: tuple[object, str, str]) -> None:
    edit, pointer, message = case
    copy = _edited(built, tmp_path, edit)
    options = [str(tmp_path / o) if o.endswith(".html") else o for o in options]
    status = main([command, str(copy), *options, "--format", "json"])
    report = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert status == 1 and not report["ok"], report
    (error,) = report["errors"]
    assert error["pointer"] == pointer and message in error["message"], error
    assert "it was edited, or not written by partc" in error["message"]
    text = (copy / "plan.json").read_text().splitlines()
    assert error["file"] == str(copy / "plan.json") and error["line"] > 1
    assert pointer.rsplit("/", 1)[1] in text[error["line"] - 1], text[error["line"] - 1]
    assert not (tmp_path / "r.html").exists()


def test_the_unedited_plan_still_inspects(built: Path, capsys: object) -> None:
    assert main(["inspect", str(built), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]  # type: ignore[attr-defined]


def test_shard_of_an_edited_plan_is_a_located_schema_error_and_writes_nothing(
        built: Path, tmp_path: Path, capsys: object) -> None:
    copy = _edited(built, tmp_path, lambda p: p["tensors"][1].pop("shape"))
    out = tmp_path / "shards"
    status = main(["shard", str(copy), "--checkpoint", str(hf("llama")), "--out", str(out),
                   "--format", "json"])
    report = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert status == 1 and not report["ok"], report
    (error,) = report["errors"]
    assert error["pointer"] == "/tensors/1", error
    assert "'shape' is a required property" in error["message"], error
    assert "it was edited, or not written by partc" in error["message"]
    assert error["file"] == str(copy / "plan.json") and error["line"] > 1
    assert not out.exists()


def _first_range(plan: dict) -> int:
    return next(i for i, t in enumerate(plan["tensors"]) if t["placements"][0][0] == "range")


@pytest.mark.parametrize(("edit", "pointer", "message"), [
    (lambda p: p["tensors"][_first_range(p)]["placements"].__setitem__(0, ["range", 0]),
     lambda p: f"/tensors/{_first_range(p)}/placements",
     "a `range` placement takes 3 fields (integers), found ['range', 0]"),
    (lambda p: p["boundary"]["primary"].__setitem__("dtype", "int64"), lambda p: "/boundary",
     "the primary boundary tensor `hidden` of `llama.hidden` must have dtype activation, "
     "found int64"),
    (lambda p: p["groups"][0]["owner"].__setitem__("kind", "somebody"), lambda p: "/groups/0",
     "unknown owner kind 'somebody'"),
], ids=["placement-fields", "boundary-rule", "owner-kind"])
@pytest.mark.parametrize("command", ["inspect", "explain", "report"])
def test_a_plan_the_schema_allows_but_the_vocabulary_refuses_is_one_located_error(
        built: Path, tmp_path: Path, capsys: object, command: str, edit: object,
        pointer: object, message: str) -> None:
    copy = _edited(built, tmp_path, edit)
    plan = json.loads((copy / "plan.json").read_text())
    extra = {"inspect": ["--rank", "0"], "explain": ["lm_head.weight"],
             "report": ["--out", str(tmp_path / "r.html")]}[command]
    status = main([command, str(copy), *extra, "--format", "json"])
    report = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert status == 1 and not report["ok"], report
    (error,) = report["errors"]
    assert error["pointer"] == pointer(plan), error  # type: ignore[operator]
    assert message in error["message"] and error["file"] == str(copy / "plan.json"), error
    assert "it was edited, or not written by partc" in error["message"]
    assert not (tmp_path / "r.html").exists()
