"""Mistakes a user trial made that partc let through, each now reported where it is made.

- a per-expert family numbering its experts against the loop (`{num_experts - 1 - expert}`):
  expert parallelism would place on-disk expert 3 as expert 0, beside the router's column 0;
- `partc verify --tp 2 --pp 2` checked the pipeline cut compile makes at T=1, not the one it
  makes at T=2 (a vision-language model cuts after its tower at one, after its projector at
  the other);
- a LLaVA build compiled without `--checkpoint` (so with partc's default tensor prefixes),
  loaded from the released layout, listed every vision tensor as missing with no hint.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from partc.api import CompileOptions, check_family, compile_family
from partc.cli.main import main
from partc.errors import CheckpointError
from partc.plan.topology import Topology
from partc.verify.run import verify_family

from support import ROOT, hf, import_build

ARCHITECTURES = ROOT / "architectures"


# ---------------------------------------------------------------- experts numbered by the loop


def _renumbered(tmp_path, name: str, field: str):
    """The built-in family `name` with every `experts.{expert}` written `experts.{field}`."""
    text = (ARCHITECTURES / f"{name}.yaml").read_text()
    assert "experts.{expert}." in text
    path = tmp_path / f"{name}_renumbered.yaml"
    path.write_text(text.replace("experts.{expert}", f"experts.{{{field}}}"))
    return path, path.read_text().splitlines()


@pytest.mark.parametrize(("name", "count"), [("mixtral", "num_local_experts"),
                                             ("qwen2_moe", "num_experts")])
def test_experts_numbered_against_the_loop_are_one_error_at_the_first_tensor_name(
        tmp_path, name, count):
    field = f"{count} - 1 - {'expert'}"
    family, lines = _renumbered(tmp_path, name, field)
    config = hf(name) / "config.json"
    errors = check_family(family, config)
    assert len(errors) == 1, [str(e) for e in errors]
    error = errors[0]
    # the first module path reading the reversed index (the group name line comes before it;
    # it and the two other projections are counted, not repeated)
    want_line = next(i for i, line in enumerate(lines, 1)
                     if "module:" in line and f"experts.{{{field}}}" in line)
    assert error.location.line == want_line
    assert f"numbers the experts with `{{{field}}}`; expected `{{expert}}`" in error.message
    assert "(3 more templates of this group number them the same way)" in error.message
    # the same refusal from the command line, exit 1, no traceback
    assert main(["check", str(family), "--config", str(config), "--ep", "2"]) == 1


def test_the_loop_variable_plus_an_offset_and_every_built_in_family_are_accepted(tmp_path):
    family, _ = _renumbered(tmp_path, "mixtral", "expert + first_expert")
    text = family.read_text().replace(
        "  num_local_experts: {type: int,",
        "  first_expert: {type: int, default: 0}\n  num_local_experts: {type: int,", 1)
    family.write_text(text)
    assert check_family(family, hf("mixtral") / "config.json") == []
    reversed_family, _ = _renumbered(tmp_path, "mixtral", "first_expert + 3 - expert")
    reversed_family.write_text(reversed_family.read_text().replace(
        "  num_local_experts: {type: int,",
        "  first_expert: {type: int, default: 0}\n  num_local_experts: {type: int,", 1))
    assert [e.message.split(";")[0] for e in check_family(reversed_family)] == [
        "the module path `model.layers.{unit}.block_sparse_moe.experts.{first_expert + 3 - "
        "expert}.w1` numbers the experts with `{first_expert + 3 - expert}`"]
    for path in sorted(ARCHITECTURES.glob("*.yaml")):
        assert check_family(path) == [], path.name


# ---------------------------------------------------------------- verify's pipeline cut


def _stage_units(plan: dict) -> str:
    """plan.json's stage units spelt as --pp-layers spells them, read from its ranks."""
    stages: dict[int, str] = {}
    for rank in plan["ranks"]:
        part = rank["partition"]
        stages.setdefault(part["stage"], ",".join(
            f"{g['group']}*{g['unit_range'][1] - g['unit_range'][0]}" for g in part["groups"]))
    return "|".join(stages[s] for s in sorted(stages))


def test_verify_checks_the_pipeline_cut_compile_makes_at_the_asked_tensor_parallel_size(
        tmp_path, capsys):
    config = hf("qwen2_vl") / "config.json"
    compiled = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        compile_family(None, config, Topology(tensor_parallel_size=tp, pipeline_parallel_size=2),
                       CompileOptions(out=out))
        compiled[tp] = json.loads((out / "plan.json").read_text())
    # the case: byte balance per rank cuts elsewhere at T=2 than at T=1
    assert _stage_units(compiled[1]) != _stage_units(compiled[2])
    assert [c["group"] for c in compiled[2]["cuts"]] != [c["group"] for c in compiled[1]["cuts"]]

    report = verify_family(None, config, tensor_parallel_sizes=[2], pipeline_parallel_size=2)
    assert report.ok
    [cut] = report.pipeline_cuts
    assert cut["tensor_parallel_sizes"] == [2]
    assert cut["stage_units"] == _stage_units(compiled[2])
    assert cut["cuts"] == [{"after_stage": c["after_stage"], "group": c["group"]}
                           for c in compiled[2]["cuts"]]
    # the pipeline build verify checked is cut there (its own plan.json)
    [staged] = [p for p in report.plans if p.shape.pipeline_parallel_size == 2]
    units = {r.pipeline_stage: ",".join(f"{u.group}*{u.end - u.start}" for u in r.units)
             for r in staged.ranks}
    assert "|".join(units[s] for s in sorted(units)) == _stage_units(compiled[2])

    # both T from the command line: each T x S build is checked as one, at its own cut
    assert main(["verify", "--config", str(config), "--tp", "1,2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    for tp in (1, 2):
        assert re.search(rf"^note: the T={tp} x S=2 build cut "
                         rf"{re.escape(_stage_units(compiled[tp]))} \(after stage 0 in "
                         rf"`{compiled[tp]['cuts'][0]['group']}`\): the cut compile chooses "
                         rf"at T={tp} x S=2$", out, re.M), out


# ---------------------------------------------------------------- a checkpoint's other prefix


def _released_llava(folder):
    """The llava fixture in the released llava-hf layout (`vision_tower.vision_model.*`),
    renamed with the safetensors library; returns (folder, {name: array})."""
    folder.mkdir()
    (folder / "config.json").write_text((hf("llava") / "config.json").read_text())
    tensors = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): value
               for name, value in load_file(str(hf("llava") / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, tensors


def test_a_build_with_the_default_prefix_loaded_from_the_released_layout_names_the_prefix(
        tmp_path, capsys):
    released, tensors = _released_llava(tmp_path / "released")
    build = tmp_path / "default"
    # no checkpoint: default prefix
    compile_family(None, released / "config.json", None, CompileOptions(out=build))
    plan = json.loads((build / "plan.json").read_text())
    tower = sorted(t["target"] for t in plan["tensors"] if t["target"].startswith("vision_tower."))
    assert tower and all(
        "vision_tower.vision_model." + t[len("vision_tower."):] in tensors for t in tower)
    package = import_build(build)
    with pytest.raises(CheckpointError) as info:
        package.load(released, rank=0)
    errors = [e.message for e in info.value.errors]
    assert errors[0] == (
        f"{len(tower)} tensors of the plan are not in the checkpoint by name: the checkpoint "
        "names these tensors `vision_tower.vision_model.…` where the build expects "
        f"`vision_tower.…` (the first 3 below); compile with --checkpoint {released} so partc "
        "picks the checkpoint's prefix")
    assert errors[1:] == [
        f"tensor `{t}` of the plan is not in the checkpoint, which holds "
        f"`vision_tower.vision_model.{t[len('vision_tower.'):]}`" for t in tower[:3]]

    # `partc shard` says the same
    assert main(["shard", str(build), "--checkpoint", str(released), "--out",
                 str(tmp_path / "shards")]) == 1
    err = capsys.readouterr().err
    said = [line[len(f"error: {released}: "):] for line in err.splitlines()
            if line.startswith("error: ")]
    assert said == errors

    # the advice holds: compiled with the checkpoint, the build reads the released names
    fixed = tmp_path / "fixed"
    compile_family(None, released / "config.json", None,
                   CompileOptions(checkpoint=released, out=fixed))
    state = import_build(fixed).load(released, rank=0)
    assert sorted(state.tensors) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(state.tensors[name], value)

    # tensors missing with no other prefix in the checkpoint are each still named, as before
    folder, _ = _released_llava(tmp_path / "dropped")
    kept = {n: v for n, v in load_file(str(hf("llava") / "model.safetensors")).items()
            if not n.startswith("vision_tower.encoder.layers.0.")}
    dropped = sorted(set(load_file(str(hf("llava") / "model.safetensors"))) - set(kept))
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        import_build(build).load(folder, rank=0)
    hint = ("; this build was compiled without --checkpoint, so its plan has only the tensors "
            f"the config implies: compile with --checkpoint {folder} to plan for the tensors "
            "this checkpoint holds")  # said once, at the first
    assert [e.message for e in info.value.errors] == [
        f"tensor `{t}` of the plan is not in the checkpoint{hint if i == 0 else ''}"
        for i, t in enumerate(dropped)]
