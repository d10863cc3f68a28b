"""inspect, explain and report on a real build's plan.json tampered with: values that follow the
schema's types but cannot be true (negative or 2^62 dimensions, reversed or out-of-shape ranges, a
placement axis past the tensor's rank, T = 0, a stage of 99, S = 10^9, a 5000-digit integer) and
values that break the schema (NaN or string sizes, unknown dtypes, roles or keys, empty lists and
names): one error located at its line, exit 1, before anything is displayed, never a
traceback."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.plan.topology import Topology

from support import hf

Edit = Callable[[dict[str, Any]], object]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tampered") / "b"
    compile_family(None, hf("llama") / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(out=out))
    return out


def _tampered(built: Path, tmp_path: Path, edit: Edit) -> Path:
    copy = tmp_path / "b"
    shutil.copytree(built, copy)
    plan = json.loads((copy / "plan.json").read_text())
    edit(plan)
    (copy / "plan.json").write_text(json.dumps(plan, indent=1))
    return copy


def _set(path: tuple[Any, ...], value: object) -> Edit:
    """An edit setting the value at `path` of the plan document."""
    def edit(plan: dict[str, Any]) -> None:
        node: Any = plan
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


CASES: dict[str, tuple[Edit, str, str]] = {
    "negative-dimension": (_set(("tensors", 0, "shape", 0), -5), "/tensors/0/shape/0",
                           "dimension 0 of the shape is -5"),
    "2^62-dimension": (_set(("tensors", 0, "shape", 0), 2 ** 62), "/tensors/0/shape/0",
                       f"dimension 0 of the shape is {2 ** 62}"),
    "too-many-elements": (_set(("tensors", 0, "shape"), [2 ** 30, 2 ** 30]), "/tensors/0/shape",
                          "elements, more than"),
    "reversed-range": (_set(("tensors", 0, "placements", 0), ["range", 0, 66, 0]),
                       "/tensors/0/placements/0", "the range [66, 0) is not inside the 131"),
    "range-past-shape": (_set(("tensors", 0, "placements", 1), ["range", 0, 66, 999]),
                         "/tensors/0/placements/1", "the range [66, 999) is not inside the 131"),
    "axis-7": (_set(("tensors", 0, "placements", 0), ["range", 7, 0, 66]),
               "/tensors/0/placements/0", "placement on axis 7 of a tensor of rank 2"),
    "shard-index": (_set(("tensors", 0, "placements", 0), ["shard", 0, 3, 2]),
                    "/tensors/0/placements/0", "shard 3 of 2 part(s)"),
    "T=0": (_set(("topology", "tensor_parallel_size"), 0), "/topology/tensor_parallel_size",
            "`tensor_parallel_size` is 0, expected 1 to"),
    "stage-99": (_set(("tensors", 0, "stages"), [99]), "/tensors/0/stages/0",
                 "stage 99 is outside the topology's 2 pipeline stage(s)"),
    "group-stage-99": (_set(("groups", 0, "stages"), [99]), "/groups/0/stages/0",
                       "stage 99 is outside"),
    "reversed-units": (_set(("ranks", 0, "partition", "groups", 0, "unit_range"), [2, 0]),
                       "/ranks/0/partition/groups/0/unit_range",
                       "the range [2, 0) is not inside the 3 units"),
    "logical-range": (_set(("groups", 2, "logical_ranges", 1), [1, 7]),
                      "/groups/2/logical_ranges/1", "[1, 7) is not inside the 2 logical units"),
    "negative-bytes": (_set(("ranks", 1, "info", "local_parameter_bytes"), -1),
                       "/ranks/1/info/local_parameter_bytes", "is -1, expected >= 0"),
    # values of the wrong type or outside the schema's enums, minimums and patterns: the plan is
    # read through its schema on every read (issue 39), not only when the view trips
    "NaN-dimension": (_set(("tensors", 0, "shape", 0), math.nan), "/tensors/0/shape/0",
                      "nan is not of type 'integer'"),
    "infinite-dimension": (_set(("tensors", 0, "shape", 0), math.inf), "/tensors/0/shape/0",
                           "inf is not of type 'integer'"),
    "float-dimension": (_set(("tensors", 0, "shape", 0), 131.0), "/tensors/0",
                        "expected an integer, found 131.0"),
    "string-dimension": (_set(("tensors", 0, "shape", 0), "131"), "/tensors/0/shape/0",
                         "'131' is not of type 'integer'"),
    "string-T": (_set(("topology", "tensor_parallel_size"), "2"),
                 "/topology/tensor_parallel_size", "'2' is not of type 'integer'"),
    "boolean-T": (_set(("topology", "tensor_parallel_size"), True),
                  "/topology/tensor_parallel_size", "True is not of type 'integer'"),
    "S=-1": (_set(("topology", "pipeline_parallel_size"), -1), "/topology/pipeline_parallel_size",
             "`pipeline_parallel_size` is -1, expected 1 to"),
    "negative-stage": (_set(("tensors", 0, "stages"), [-1]), "/tensors/0/stages/0",
                       "stage -1 is outside"),
    "2^62-stage": (_set(("tensors", 0, "stages"), [2 ** 62]), "/tensors/0/stages/0",
                   f"stage {2 ** 62} is outside"),
    "no-stages": (_set(("tensors", 0, "stages"), []), "/tensors/0/stages",
                  "[] should be non-empty"),
    "no-placements": (_set(("tensors", 0, "placements"), []), "/tensors/0/placements",
                      "[] should be non-empty"),
    "negative-range-start": (_set(("tensors", 0, "placements", 0), ["range", 0, -1, 66]),
                             "/tensors/0/placements/0/2", "-1 is less than the minimum of 0"),
    "unknown-placement": (_set(("tensors", 0, "placements", 0), ["teleport", 0]),
                          "/tensors/0/placements/0/0", "'teleport' is not one of"),
    "short-placement": (_set(("tensors", 0, "placements", 0), ["range", 0, 66]),
                        "/tensors/0/placements", "a `range` placement takes 3 fields"),
    "unknown-dtype": (_set(("tensors", 0, "dtype"), "F99"), "/tensors/0/dtype",
                      "'F99' is not one of ['F64', 'F32'"),
    "escape-dtype": (_set(("tensors", 0, "dtype"), "\x1b[31mF32"), "/tensors/0/dtype",
                     "'\\x1b[31mF32' is not one of"),
    "unknown-role": (_set(("groups", 0, "role"), "teleporter"), "/groups/0/role",
                     "'teleporter' is not one of"),
    "kv-replicas-0": (_set(("tensors", 0, "kv_replicas"), 0), "/tensors/0/kv_replicas",
                      "0 is less than the minimum of 1"),
    "kv-replicas-2^62": (_set(("tensors", 0, "kv_replicas"), 2 ** 62), "/tensors/0/kv_replicas",
                         f"`kv_replicas` is {2 ** 62}, expected at most 65536"),
    "unlisted-group": (_set(("tensors", 0, "group"), "nowhere"), "/tensors/0/group",
                       "tensor `lm_head.weight` belongs to group `nowhere`, which the plan's "
                       "groups do not list"),
    "renamed-group": (_set(("groups", 0, "name"), "renamed"), "/tensors/1/group",
                      "belongs to group `embedding`, which the plan's groups do not list"),
    "logical-units-0": (_set(("groups", 0, "logical_units"), 0), "/groups/0/logical_units",
                        "0 is less than the minimum of 1"),
    "units-past-graph": (_set(("ranks", 0, "partition", "groups", 0, "unit_range"), [0, 2 ** 62]),
                         "/ranks/0/partition/groups/0/unit_range",
                         f"the range [0, {2 ** 62}) is not inside the 3 units of execution group "
                         "`decoder`"),
    "plan-hash": (_set(("plan_hash",), "not a hash"), "/plan_hash",
                  "'not a hash' does not match '^[0-9a-f]{64}$'"),
    "activation-dtype": (_set(("topology", "activation_dtype"), "float8"),
                         "/topology/activation_dtype", "'float8' is not one of"),
    "static-role-place": (_set(("static_roles", 0, "stage"), "middle"), "/static_roles/0/stage",
                          "'middle' is not valid under any of the given schemas"),
    "negative-state-units": (_set(("ranks", 0, "partition", "state", "units"), -1),
                             "/ranks/0/partition/state/units", "-1 is less than the minimum of 0"),
    "float-bytes": (_set(("ranks", 0, "info", "local_parameter_bytes"), 1.5),
                    "/ranks/0/info/local_parameter_bytes", "1.5 is not of type 'integer'"),
    "rank-stage-99": (_set(("ranks", 0, "pipeline_stage"), 99), "/ranks/0",
                      "rank entry 0 says rank 0, stage 99"),
    "unknown-key": (_set(("payload",), "\x1b]0;owned\x07"), "",
                    "Additional properties are not allowed ('payload' was unexpected)"),
    "empty-name": (_set(("tensors", 0, "target"), ""), "/tensors/0/target",
                   "'' should be non-empty"),
}


@pytest.mark.parametrize("command", ["inspect", "explain", "report"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_tampered_plan_is_one_located_error(built: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              command: str, case: str) -> None:
    edit, pointer, message = CASES[case]
    copy = _tampered(built, tmp_path, edit)
    page = tmp_path / "r.html"
    extra = {"inspect": [], "explain": ["lm_head.weight"], "report": ["--out", str(page)]}
    status = main([command, str(copy), *extra[command], "--format", "json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert status == 1 and not report["ok"], report
    (error,) = report["errors"]
    assert error["pointer"] == pointer and message in error["message"], error
    assert "it was edited, or not written by partc" in error["message"], error
    assert error["file"] == str(copy / "plan.json"), error
    assert error["line"] > (1 if pointer else 0) and error["column"] > 0, error
    assert "Traceback" not in captured.err
    assert not page.exists()


def test_a_billion_stages_are_refused_before_anything_per_rank_is_built(
        built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """S = 10^9 in an 11 KB plan is refused from the topology alone: the rank arithmetic (the
    ParallelShape) and the per-rank entries are never built (they sent inspect to 7.8 GB)."""
    import partc.plan.plan_decode as plan_decode

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("built a per-rank value of a plan of 10^9 stages")

    monkeypatch.setattr(plan_decode, "ParallelShape", never)
    monkeypatch.setattr(plan_decode, "_rank", never)
    copy = _tampered(built, tmp_path, _set(("topology", "pipeline_parallel_size"), 10 ** 9))
    status = main(["inspect", str(copy), "--format", "json"])
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert status == 1 and error["pointer"] == "/topology/pipeline_parallel_size", error
    assert "`pipeline_parallel_size` is 1000000000, expected 1 to 65536" in error["message"]


def test_a_5000_digit_integer_is_a_read_error_not_a_crash(
        built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "b"
    shutil.copytree(built, copy)
    text = (copy / "plan.json").read_text()
    assert text.count('"tensor_parallel_size":2') == 1
    (copy / "plan.json").write_text(text.replace('"tensor_parallel_size":2',
                                                 '"tensor_parallel_size":' + "9" * 5000))
    status = main(["inspect", str(copy), "--format", "json"])
    captured = capsys.readouterr()
    (error,) = json.loads(captured.out)["errors"]
    assert status == 1 and error["file"] == str(copy / "plan.json"), error
    column = text.index('"tensor_parallel_size":2') + len('"tensor_parallel_size":') + 1
    assert (error["line"], error["column"]) == (1, column), error
    assert "an integer of 5000 digits, more than the 4300" in error["message"], error
    assert "Traceback" not in captured.err


def test_the_untampered_plan_still_reads(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["inspect"], ["explain", "lm_head.weight"]):
        assert main([command[0], str(built), *command[1:], "--format", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"]
