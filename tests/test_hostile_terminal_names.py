"""Names a tampered plan.json or checkpoint header holds, printed to a terminal by inspect,
explain, report, origins, check and shard: an ESC, a NUL, a CR or a newline is shown escaped
(`\\x1b`, `\\n`), so a file cannot recolor the terminal or print a forged `error:` line, and
the files read are left as they were (trees hashed before and after)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import unicodedata
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.plan.topology import Topology

from support import hf

HOSTILE = "x\x1b[31m\x00\r\nerror: forged\x9b2J\x7f"
"""A name with every kind of control character a terminal acts on."""
SHOWN = r"x\x1b[31m\x00\r\nerror: forged\x9b2J\x7f"
"""How it must be printed."""
LLAMA = hf("llama")

Edit = Callable[[dict[str, Any]], object]


def _rename_group(plan: dict[str, Any]) -> None:
    """The embedding group renamed everywhere the plan names it (a consistent plan)."""
    for group in plan["groups"]:
        if group["name"] == "embedding":
            group["name"] = f"embedding{HOSTILE}"
    for tensor in plan["tensors"]:
        if tensor["group"] == "embedding":
            tensor["group"] = f"embedding{HOSTILE}"


def _rename_tensor(plan: dict[str, Any]) -> None:
    plan["tensors"][0]["target"] = f"lm_head{HOSTILE}.weight"


def _set(*path: Any) -> Edit:
    """An edit setting the plan's value at `path[:-1]` to `path[-1]`."""
    def edit(plan: dict[str, Any]) -> None:
        node: Any = plan
        for key in path[:-2]:
            node = node[key]
        node[path[-2]] = path[-1]
    return edit


def _dtype_key(plan: dict[str, Any]) -> None:
    plan["ranks"][0]["info"]["local_bytes_by_dtype"][HOSTILE] = 0


PLAN_CASES: dict[str, tuple[Edit, list[str]]] = {
    "family-inspect": (_set("family", HOSTILE), ["inspect"]),
    "model-type-inspect": (_set("model_type", HOSTILE), ["inspect"]),
    "rank-group-inspect": (_set("ranks", 0, "partition", "groups", 0, "group", HOSTILE),
                           ["inspect"]),
    "rank-role-inspect": (_set("ranks", 0, "partition", "ownership", "static_roles", 0, HOSTILE),
                          ["inspect"]),
    "dtype-key-inspect": (_dtype_key, ["inspect"]),
    "tensor-inspect-target": (_rename_tensor, ["inspect", "--target", "lm_head*"]),
    "tensor-explain": (_rename_tensor, ["explain", "lm_head*"]),
    "group-explain": (_rename_group, ["explain", "model.embed_tokens.weight"]),
    "source-origins-explain": (_set("sources", 0, "name", HOSTILE), ["explain", "lm_head.weight"]),
    "source-origins-rank": (_set("sources", 0, "name", HOSTILE), ["inspect", "--rank", "0"]),
    "unknown-tensor-shard": (_rename_tensor, ["shard", "{build}", "--checkpoint", str(LLAMA),
                                                    "--out", "{out}"]),
    "group-report": (_rename_group, ["report", "{build}", "--out", "{out}"]),
}


def _tree(folder: Path) -> str:
    """sha256 over the names and bytes of every file below `folder`."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _run(args: list[str]) -> tuple[int, str]:
    """Exit status and everything printed (stdout then stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(args)
    return status, out.getvalue() + err.getvalue()


def _assert_escaped(printed: str) -> None:
    controls = {ch for line in printed.splitlines() for ch in line
                if ch != "\t" and unicodedata.category(ch) == "Cc"}
    assert not controls and "\r" not in printed, (sorted(controls), printed)
    assert not [line for line in printed.splitlines() if line.startswith("error: forged")], printed


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("names") / "b"
    compile_family(None, LLAMA / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(out=out))
    return out


@pytest.mark.parametrize("case", list(PLAN_CASES), ids=list(PLAN_CASES))
def test_a_name_of_a_tampered_plan_is_printed_escaped(built: Path, tmp_path: Path,
                                                      case: str) -> None:
    edit, command = PLAN_CASES[case]
    copy = tmp_path / "b"
    shutil.copytree(built, copy)
    plan = json.loads((copy / "plan.json").read_text())
    edit(plan)
    (copy / "plan.json").write_text(json.dumps(plan, indent=1))
    before, checkpoint = _tree(copy), _tree(LLAMA)
    args = [a.format(build=copy, out=tmp_path / "o") for a in command]
    if "{build}" not in command:
        args.insert(1, str(copy))
    status, printed = _run(args)
    assert status in (0, 1) and "Traceback" not in printed, printed
    assert SHOWN in printed or case == "group-report", printed
    _assert_escaped(printed)
    assert (_tree(copy), _tree(LLAMA)) == (before, checkpoint)


@pytest.mark.parametrize("command", [["inspect", "{ckpt}"],
                                     ["check", "--checkpoint", "{ckpt}", "--config",
                                      str(LLAMA / "config.json")]], ids=["inspect", "check"])
def test_a_tensor_name_of_a_checkpoint_header_is_refused_escaped(tmp_path: Path,
                                                                 command: list[str]) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({f"model.layers.0{HOSTILE}.weight": np.zeros((2, 3), np.float32)},
              str(folder / "model.safetensors"))
    before = _tree(folder)
    status, printed = _run([a.format(ckpt=folder / "model.safetensors") for a in command])
    assert status == 1 and "holds the non-printable character" in printed, printed
    assert SHOWN.replace("\\", "\\\\") in printed or SHOWN in printed, printed
    _assert_escaped(printed)
    assert _tree(folder) == before
