"""Two messages a user trial found short.

`partc shard` refusing a checkpoint that is not the one its build was compiled against names
what differs (the plan's tensors it lacks, the ones it holds that the plan does not know,
those of another dtype or shape, expected against found), as a generated loader's `load()`
does and in its words, exits 1 without a traceback and writes nothing; `partc inspect
--target` gives a projection's tensor the line of its own `module:` entry, not its group's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from partc.api import CompileOptions, compile_family
from partc.cli.main import main
from partc.errors import CheckpointError
from partc.inspect.origins import group_origins
from partc.plan.plan_file import read_plan
from partc.plan.topology import Topology

from support import checkpoint_tensors, fixture_folder, hf, import_build

ROOT = Path(__file__).resolve().parents[1]
LLAMA = hf("llama")
LOAD_ADVICE = "; recompile against this checkpoint or pass verify_fingerprint=False"
SHARD_ADVICE = "; recompile against this checkpoint or pass --no-verify-fingerprint"


@pytest.fixture(scope="module")
def llama_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-layer Llama at TP=2, compiled against its checkpoint (so it has a fingerprint)."""
    out = tmp_path_factory.mktemp("messages") / "build"
    plan = compile_family("llama", LLAMA / "config.json", Topology(tensor_parallel_size=2),
                          CompileOptions(checkpoint=LLAMA, out=out)).plan
    assert plan.checkpoint_fingerprint is not None
    return out


def _edited(folder: Path, source: Path = LLAMA, *, drop: str | None = None,
            put: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the checkpoint `source` (its config and its tensors, written by safetensors
    into `folder`) without tensor `drop` and with the tensors of `put` added or replaced."""
    tensors = checkpoint_tensors(source)
    if drop is not None:
        del tensors[drop]
    tensors.update(put or {})
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "np"})
    return folder


def _shard(build: Path, checkpoint: Path, out: Path, capsys: pytest.CaptureFixture[str],
           *options: str) -> tuple[int, str, str]:
    """`partc shard BUILD --checkpoint CHECKPOINT --out OUT`: (status, stdout, stderr)."""
    status = main(["shard", str(build), "--checkpoint", str(checkpoint), "--out", str(out),
                   "-q", *options])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _refused(status: int, err: str, out: Path) -> None:
    """A refusal: exit 1, partc's own error lines (no traceback), nothing written to `out`."""
    assert status == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert not out.exists() or list(out.iterdir()) == []
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------- partc shard


def test_shard_names_the_missing_the_extra_and_the_changed_tensor_and_writes_nothing(
        llama_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = "model.layers.2.self_attn.k_proj.weight"
    extra = "model.layers.0.self_attn.q_norm.weight"  # a Qwen3 tensor the Llama plan lacks
    changed = "model.norm.weight"
    norm = checkpoint_tensors(LLAMA)[changed]
    checkpoint = _edited(tmp_path / "edited", drop=missing, put={
        extra: np.ones(16, np.float32), changed: norm.astype(np.float16)})
    out = tmp_path / "out"
    out.mkdir()  # an empty folder: left empty
    status, _, err = _shard(llama_build, checkpoint, out, capsys)
    _refused(status, err, out)
    assert (f"error: {checkpoint}: tensor `{missing}` of the plan is not in the checkpoint; the "
            f"checkpoint also holds 1 tensor the plan does not know (`{extra}`)\n") in err
    assert (f"error: {checkpoint / 'model.safetensors'}: tensor `{changed}` is F16 [64] in the "
            "checkpoint; the plan expects F32 [64]\n") in err
    assert "partc: 2 error(s)" in err


def test_shard_of_another_models_checkpoint_counts_the_tensors_the_plan_does_not_know(
        llama_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = json.loads((llama_build / "plan.json").read_text())
    known = {t["target"] for t in plan["tensors"]}
    unknown = sorted(set(checkpoint_tensors(hf("gpt2"))) - known)
    assert len(unknown) > 3
    out = tmp_path / "out"
    status, report, _ = _shard(llama_build, hf("gpt2"), out, capsys, "--format", "json")
    assert status == 1 and not out.exists()
    errors = json.loads(report)["errors"]
    assert {e["tensor"] for e in errors} == known  # one error a plan tensor, as before
    shown = ", ".join(f"`{n}`" for n in unknown[:3])
    assert errors[0]["message"].endswith(
        f"; the checkpoint also holds {len(unknown)} tensors the plan does not know ({shown} "
        f"and {len(unknown) - 3} more)")
    assert all("does not know" not in e["message"] for e in errors[1:])  # said once


def test_shard_explains_a_fingerprint_mismatch_as_load_does(
        llama_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = "model.layers.0.self_attn.q_norm.weight"
    checkpoint = _edited(tmp_path / "extra", put={extra: np.ones(16, np.float32)})
    out = tmp_path / "out"
    status, _, err = _shard(llama_build, checkpoint, out, capsys)
    _refused(status, err, out)
    clause = f"{checkpoint / 'model.safetensors'} holds 1 tensor the plan does not know (`{extra}`)"
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: {checkpoint}: checkpoint header fingerprint ")
    assert line.endswith(f": {clause}{SHARD_ADVICE}"), line
    package = import_build(llama_build)  # a generated loader says it in the same words
    with pytest.raises(CheckpointError) as caught:
        package.load(checkpoint, rank=0)
    assert caught.value.message.endswith(f", but {clause}{LOAD_ADVICE}")
    # the advice is true: the plan's tensors all match, so the checkpoint shards when told to
    status, _, err = _shard(llama_build, checkpoint, out, capsys, "--no-verify-fingerprint")
    assert status == 0, err


def test_shard_says_a_difference_only_among_omitted_tensors_is_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GPT-2's family omits the attention-mask buffers: the plan records only their globs
    buffer = "transformer.h.0.attn.bias"
    compiled = _edited(tmp_path / "compiled", hf("gpt2"),
                       put={buffer: np.ones((1, 1, 4, 4), np.float32)})
    compile_family("gpt2", compiled / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(checkpoint=compiled, out=tmp_path / "build"))
    other = _edited(tmp_path / "other", hf("gpt2"), put={buffer: np.ones((1, 1, 8, 8), np.float32)})
    out = tmp_path / "out"
    status, _, err = _shard(tmp_path / "build", other, out, capsys)
    _refused(status, err, out)
    assert (f"{other / 'model.safetensors'} holds every tensor of the plan, in its dtype and "
            "shape, and no other: what differs is among the tensors the family omits "
            "(`transformer.h.*.attn.bias`, `transformer.h.*.attn.masked_bias`), which no rank "
            f"loads{SHARD_ADVICE}") in err


# ---------------------------------------------------------------- partc inspect


def _line_of(family: str, text: str) -> str:
    """`architectures/<family>.yaml:N`, N the one line of the file holding `text`."""
    lines = (ROOT / "architectures" / f"{family}.yaml").read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if text in line]
    return f"architectures/{family}.yaml:{number}"


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    """The tensor rows `partc inspect ... --format json` prints."""
    assert main(["inspect", *args, "--format", "json"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)["tensors"]
    assert rows
    return rows


@pytest.mark.parametrize("projection", ["q_proj", "o_proj"])
def test_inspect_target_gives_a_projection_the_line_of_its_own_module_entry(
        llama_build: Path, capsys: pytest.CaptureFixture[str], projection: str) -> None:
    target = f"model.layers.1.self_attn.{projection}.weight"
    own = _line_of("llama", f'- module: "model.layers.{{unit}}.self_attn.{projection}"')
    rows = _inspect(capsys, str(llama_build), "--target", target)
    assert [(r["target"], r["origin"]) for r in rows] == [(target, own)] * 2
    assert main(["inspect", str(llama_build), "--target", target]) == 0
    text = capsys.readouterr().out
    assert text.count(own) == 2 and _line_of("llama", 'name: "layers.{unit}.attention"') not in text


def test_each_projection_of_a_group_gets_its_own_line_and_a_one_module_group_its_declaration(
        llama_build: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _inspect(capsys, str(llama_build), "--group", "layers.0.*")
    found = {r["target"]: r["origin"] for r in rows}
    for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert found[f"model.layers.0.{module}.weight"] == _line_of(
            "llama", f'- module: "model.layers.{{unit}}.{module}"')
    assert len({found[t] for t in found if "self_attn" in t}) == 4
    # a group of one module (`module:` beside its name) is one entry: its declaration's line
    assert found["model.layers.0.input_layernorm.weight"] == _line_of(
        "llama", '- name: "layers.{unit}.input_layernorm"')


def test_explain_keeps_the_groups_line_as_the_groups_beside_the_tensors_own(
        llama_build: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = "model.layers.1.self_attn.o_proj.weight"
    own = _line_of("llama", '- module: "model.layers.{unit}.self_attn.o_proj"')
    group = _line_of("llama", '- name: "layers.{unit}.attention"')
    assert main(["explain", str(llama_build), target, "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["origin"] == group and found["tensors"][0]["origin"] == own
    assert f"declared at {own} (its group `layers.1.attention` at {group})" in found["why"]
    assert main(["explain", str(llama_build), "layers.1.attention", "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["origin"] == group and f"declared at {group}" in found["why"]
    assert {t["target"].split(".")[-2]: t["origin"] for t in found["tensors"]}["q_proj"] == (
        _line_of("llama", '- module: "model.layers.{unit}.self_attn.q_proj"'))


def test_a_member_and_the_companions_a_linear_format_adds_to_it_get_the_members_line(
        tmp_path: Path) -> None:
    """gpt-oss's experts are a `members:` group; MXFP4 stores `down_proj` as `down_proj_blocks`
    and `down_proj_scales`, while `down_proj_bias` is a member of its own."""
    folder = fixture_folder("gpt_oss_mxfp4")
    compile_family(None, folder / "config.json", None, CompileOptions(out=tmp_path / "build"))
    lines = group_origins(read_plan(tmp_path / "build" / "plan.json")).lines
    group = "layers.0.experts"
    member = _line_of("gpt_oss", 'target: "model.layers.{unit}.mlp.experts.down_proj"')
    for name in ("down_proj_blocks", "down_proj_scales"):
        assert lines.tensor(f"model.layers.0.mlp.experts.{name}", group) == member
    assert lines.tensor("model.layers.0.mlp.experts.down_proj_bias", group) == _line_of(
        "gpt_oss", 'target: "model.layers.{unit}.mlp.experts.down_proj_bias"')
    assert lines[group] == _line_of("gpt_oss", '- name: "layers.{unit}.experts"')
