"""`partc verify` on the vision-language families (llava, qwen2_vl): vision tower, projector and
decoder checked against transformers' own `...ForConditionalGeneration` modeling code.

The reference model runs on a seeded image and the image tokens it needs, so the vision tower
and the projector run; the pipeline check reads each unit's and each static role's stage from
plan.json and checks every cut's declared boundary against the activation that crosses it.
Wrong declarations (a vision projection declared row instead of column, a boundary with a wrong
axis) fail with the module named. Each verify run is made once per module (fixtures).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from partc.api import check_family
from partc.cli.main import main
from partc.plan.topology import Topology
from partc.verify.results import VerifyReport
from partc.verify.run import verify_family

from support import ROOT, edited_family, hf

ARCHITECTURES = ROOT / "architectures"
FAMILIES = ("llava", "qwen2_vl")
# (vision attention, vision mlp, projector, text embedding, first decoder layer) in memory
MODULES = {
    "llava": ("model.vision_tower.encoder.layers.0.self_attn",
              "model.vision_tower.encoder.layers.0.mlp", "model.multi_modal_projector",
              "model.language_model.embed_tokens", "model.language_model.layers.0"),
    "qwen2_vl": ("model.visual.blocks.0.attn", "model.visual.blocks.0.mlp", "model.visual.merger",
                 "model.language_model.embed_tokens", "model.language_model.layers.0"),
}


@pytest.fixture(scope="module", params=FAMILIES)
def reports(request: pytest.FixtureRequest) -> tuple[str, VerifyReport, VerifyReport]:
    """One family verified at T = 1, 2 with S = 2, and at T = 1 with S = 3."""
    name = str(request.param)
    config = hf(name) / "config.json"
    two = verify_family(None, config, tensor_parallel_sizes=[1, 2], pipeline_parallel_size=2)
    three = verify_family(None, config, tensor_parallel_sizes=[2], pipeline_parallel_size=3)
    return name, two, three


def _plans(name: str, stages: int, tmp: Path, sizes: tuple[int, ...]) -> list[dict[str, object]]:
    """plan.json of a T x S build for each T of `sizes`, compiled independently of verify, each
    distinct pipeline layout once (verify checks the cut compile makes at each T)."""
    plans: dict[str, dict[str, object]] = {}
    for tp in sizes:
        out = tmp / f"{name}-{stages}-{tp}"
        assert main(["compile", "--config", str(hf(name) / "config.json"), "--tp", str(tp),
                     "--pp", str(stages), "--out", str(out)]) == 0
        plan = json.loads((out / "plan.json").read_text())
        plans.setdefault(plan["pipeline"]["layout"], plan)
    return list(plans.values())


def _cuts(name: str, stages: int, tmp: Path, sizes: tuple[int, ...]) -> list[dict[str, object]]:
    """plan.json's `cuts` of those builds, in T order."""
    return [cut for plan in _plans(name, stages, tmp, sizes) for cut in plan["cuts"]]


def test_every_module_of_the_vision_tower_projector_and_decoder_is_checked(reports):
    name, two, three = reports
    assert two.ok, two.first_failure
    assert three.ok, three.first_failure
    assert two.family == name and two.model_type == name
    assert {(c.tp, c.pp) for c in two.checks} == {(1, 1), (2, 1), (1, 2)}
    assert {(c.tp, c.pp) for c in three.checks} == {(2, 1), (1, 3)}
    modules = {c.module for c in two.checks if c.tp == 2}
    assert set(MODULES[name][:4]) <= modules
    attention, mlp, projector = MODULES[name][:3]
    for module in (attention, mlp, projector):
        split = [c for c in two.checks if c.tp == 2 and c.module == module]
        # split over the two ranks and summed (not a whole-on-every-rank module)
        assert split and split[0].rank is None and split[0].group and split[0].max_error > 0
        assert split[0].max_error <= split[0].tolerance


def test_verify_names_the_boundaries_no_cut_crossed(reports, tmp_path):
    """At S=2 both models are cut once, after the group before the decoder: the vision
    group's boundary and the decoder's own are checked by no cut, and verify says so; the
    groups it names are exactly the plan's groups that no cut of plan.json crosses."""
    name, two, three = reports
    for report, stages, sizes in ((two, 2, (1, 2)), (three, 3, (2,))):
        plans = _plans(name, stages, tmp_path, sizes)
        crossed = {c["group"] for plan in plans for c in plan["cuts"]}
        missed = [g["group"] for g in plans[0]["graph"] if g["group"] not in crossed]
        (note,) = [n for n in report.notes if "crossed no cut" in n]
        named = re.findall(r"`(\w+)`", note.split(" crossed no cut")[0])
        assert named == missed and missed, (note, missed)
        layouts = " or ".join(plan["pipeline"]["layout"] for plan in plans)
        assert f"crossed no cut at S={stages} ({layouts})" in note
    # S=2 cuts after the projector (llava, at T=1 and 2) or the merger (qwen2_vl at T=1; after
    # the vision tower at T=2): the decoder begins there
    assert re.findall(r"`(\w+)`", next(n for n in two.notes if "crossed" in n)) == {
        "llava": ["vision", "decoder"], "qwen2_vl": ["decoder"]}[name]


def test_the_inputs_carry_an_image_as_the_fixture_generator_made_it(reports):
    name = reports[0]
    # the fixture's ids and pixel shapes come from HF's processor conventions (fixtures-gen);
    # verify builds the same from the config alone (image block after the third text token)
    from partc.verify.inputs import model_inputs

    reference = np.load(hf(name) / "reference.npz")
    inputs = model_inputs(hf(name), 131, 0, {"mm_token_type_ids"} if name == "qwen2_vl"
                          else set())
    assert inputs["input_ids"].numpy().tolist() == reference["input_ids"].tolist()
    assert tuple(inputs["pixel_values"].shape) == reference["pixel_values"].shape
    if name == "qwen2_vl":
        assert inputs["image_grid_thw"].numpy().tolist() == reference["image_grid_thw"].tolist()
        assert inputs["mm_token_type_ids"].numpy().tolist() == \
            reference["mm_token_type_ids"].tolist()
    else:
        assert set(inputs) == {"input_ids", "pixel_values"}


def test_each_cut_is_checked_against_the_plans_boundary(reports, tmp_path):
    name, two, three = reports
    for report, stages, sizes in ((two, 2, (1, 2)), (three, 3, (2,))):
        cuts = _cuts(name, stages, tmp_path, sizes)
        checked = [c for c in report.checks if c.pp == stages and c.module != "logits"
                   and c.group]
        assert [(c.rank, c.group) for c in checked] == [
            (cut["after_stage"], cut["group"]) for cut in cuts]
        assert all(c.ok and c.tp == 1 for c in checked)
    # S=3 as T=2 cuts it: llava vision | projector + decoder 0 | decoder 1 (a vision cut and a
    # decoder cut); qwen2_vl vision 0 | vision 1-2 + merger | decoder (two vision-side cuts)
    assert [c.module for c in three.checks if c.pp == 3 and c.group] == {
        "llava": ["model.vision_tower.encoder.layers.1", MODULES[name][4]],
        "qwen2_vl": ["model.visual.blocks.0", "model.visual.merger"]}[name]
    logits = [c for c in three.checks if c.module == "logits"]
    assert logits[0].ok and logits[0].pp == 3


# ---------------------------------------------------------------- wrong declarations

# (case, fixture, family file, text replaced, replacement, T, S, module, group, message start)
WRONG = [
    ("qwen2_vl merger mlp.0 declared row", "qwen2_vl", "qwen2_vl.yaml",
     '      - {module: "{path}.mlp.0", sharding: column,',
     '      - {module: "{path}.mlp.0", sharding: row,',
     2, 1, "model.visual.merger", "merger.mlp",
     "T=2 x S=1: module `model.visual.merger` (group `merger.mlp`), rank 0: "),
    ("llava vision boundary without the CLS row", "llava", "llava.yaml",
     "shape: [images, vision_positions, vision_hidden_size]",
     "shape: [images, vision_positions - 1, vision_hidden_size]",
     1, 3, "model.vision_tower.encoder.layers.1", "vision",
     "T=1 x S=3: the cut after stage 0 (group `vision`, boundary `llava.vision`) declares "
     "`hidden` as [images, 4, 32], but module `model.vision_tower.encoder.layers.1` gives it "
     "as [1, 5, 32]: axis 1 has 5 elements, the boundary declares 4"),
    ("qwen2_vl image features of the vision width", "qwen2_vl", "qwen2_vl.yaml",
     "shape: [image_tokens, hidden_size]", "shape: [image_tokens, vision_embed_dim]",
     1, 2, "model.visual.merger", "merger",
     "T=1 x S=2: the cut after stage 0 (group `merger`, boundary `qwen2_vl.image_features`) "
     "declares `image_features` as [image_tokens, 32], but module `model.visual.merger` gives "
     "it as [6, 64]: axis 1 has 64 elements, the boundary declares 32"),
]


def test_a_vision_projection_split_on_an_axis_that_is_no_multiple_of_its_units_is_refused(
        tmp_path):
    # fc1 [vision_intermediate, vision_hidden] declared row splits the hidden axis (32) in a
    # group of 96 intermediate channels: refused at its line (verify caught it only, before)
    old = '{module: "{path}.mlp.fc1", sharding: column,'
    family = edited_family(tmp_path, "llava", old, old.replace("column", "row"))
    errors = check_family(family, hf("llava") / "config.json", topology=Topology(
        tensor_parallel_size=2, pipeline_parallel_size=1))
    assert len(errors) == 1, errors
    line = next(i for i, t in enumerate(family.read_text().splitlines(), 1)
                if '"{path}.mlp.fc1", sharding: row' in t)
    assert errors[0].location.line == line
    assert "encoder.layers.0.mlp.fc1.weight` is split on axis 1, of 32 elements, which is not " \
           "a multiple of group `vision.0.mlp`'s 96 partition units (vision_intermediate_size)" \
           in errors[0].message
    assert "axis 0 (96) is a multiple: is the projection's sharding the other one?" in (
        errors[0].message)


@pytest.mark.parametrize("case", WRONG, ids=[c[0] for c in WRONG])
def test_a_wrong_vision_declaration_passes_check_but_fails_verify(tmp_path, case):
    _, fixture, file, old, new, tp, pp, module, group, message = case
    text = (ARCHITECTURES / file).read_text()
    assert text.count(old) == 1
    family = tmp_path / file
    family.write_text(text.replace(old, new))
    config = hf(fixture) / "config.json"
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=tp, pipeline_parallel_size=pp)) == []
    report = verify_family(family, config, tensor_parallel_sizes=[tp], pipeline_parallel_size=pp)
    failure = report.first_failure
    assert not report.ok and failure is not None
    assert (failure.module, failure.group, failure.tp, failure.pp) == (module, group, tp, pp)
    assert failure.message.startswith(message), failure.message
    assert failure.max_error > failure.tolerance


def test_the_cli_names_the_module_of_a_wrong_boundary(tmp_path, capsys):
    _, fixture, file, old, new = WRONG[1][:5]
    family = tmp_path / file
    family.write_text((ARCHITECTURES / file).read_text().replace(old, new))
    status = main(["verify", str(family), "--config", str(hf(fixture) / "config.json"),
                   "--tp", "1", "--pp", "3"])
    err = capsys.readouterr().err
    assert status == 1
    assert re.search(r"error: T=1 x S=3: the cut after stage 0 .* module "
                     r"`model\.vision_tower\.encoder\.layers\.1` gives it as \[1, 5, 32\]", err)


def test_a_cut_after_a_module_placed_with_the_last_unit_is_checked_against_that_modules_output(
        tmp_path, capsys):
    """Qwen2-VL's merger placed with the last vision block (a static role `visual_tail`, as
    `partc init` wrote it before the merger became its own execution group): it runs on the
    vision stage after that block, so what crosses the cut is the merger's output (the
    decoder's width), not the block's (the vision width). A boundary of the block's shape fails
    verify with the merger named; the same boundary of the merger's shape passes."""
    config = json.loads((hf("qwen2_vl") / "config.json").read_text())
    vision, text = config["vision_config"]["embed_dim"], config["text_config"]["hidden_size"]
    assert vision != text
    family = tmp_path / "qv.yaml"
    assert main(["init", "--checkpoint", str(hf("qwen2_vl")), "--out", str(family)]) == 0
    capsys.readouterr()
    data = yaml.safe_load(family.read_text())
    assert [g["group"] for g in data["graph"]] == ["visual", "merger", "decoder"]
    data["graph"] = [g for g in data["graph"] if g["group"] != "merger"]
    data["graph"][-1]["after"] = ["visual"]
    data["static"]["visual_tail"] = {"stage": {"with": "visual", "unit": "last"}}
    for group in data["parameters"]:
        if group["owner"] == {"unit": "merger"}:
            group["owner"] = {"static": "visual_tail"}
    primary = data["graph"][0]["boundary"]["primary"]
    assert primary["shape"] == ["patches", "vision_embed_dim"]
    family.write_text(yaml.safe_dump(data, sort_keys=False))
    report = verify_family(family, hf("qwen2_vl") / "config.json", tensor_parallel_sizes=[1],
                           pipeline_parallel_size=2)
    failure = report.first_failure
    assert not report.ok and failure is not None
    assert (failure.module, failure.group, failure.pp) == ("model.visual.merger", "visual", 2)
    assert re.search(rf"declares `hidden` as \[patches, {vision}\], but module "
                     rf"`model\.visual\.merger` gives it as \[\d+, {text}\]: axis 1 has {text} "
                     rf"elements, the boundary declares {vision}$", failure.message), \
        failure.message
    primary["shape"] = ["image_tokens", "hidden_size"]
    family.write_text(yaml.safe_dump(data, sort_keys=False))
    fixed = verify_family(family, hf("qwen2_vl") / "config.json", tensor_parallel_sizes=[1],
                          pipeline_parallel_size=2)
    assert fixed.ok, fixed.first_failure
    cut = [c for c in fixed.checks if c.pp == 2 and c.group == "visual"]
    assert [c.module for c in cut] == ["model.visual.merger"]


def test_a_folded_boundary_mismatch_names_the_axis_of_the_folded_shape(tmp_path):
    """A per-request first axis spans HF's leading axes (one image's patches and its batch of
    one): the axis a mismatch names is counted in the folded shape, which the message shows."""
    _, fixture, file, old, _ = WRONG[1][:5]
    family = tmp_path / file
    family.write_text((ARCHITECTURES / file).read_text().replace(
        old, "shape: [image_tokens, vision_hidden_size + 1]"))
    report = verify_family(family, hf(fixture) / "config.json", tensor_parallel_sizes=[1],
                           pipeline_parallel_size=3)
    failure = report.first_failure
    assert failure is not None and failure.module == "model.vision_tower.encoder.layers.1"
    assert failure.message.endswith(
        "gives it as [1, 5, 32]: axis 1 (its first 2 axes folded into one: [5, 32]) has 32 "
        "elements, the boundary declares 33"), failure.message


POST_LAYERNORM = '''  - name: vision_unused.post_layernorm
    role: replicated
    owner: {static: vision_unused}
    module: "{vision_root}.post_layernorm"
    sharding: replicated
    params: {weight: [vision_hidden_size], bias: [vision_hidden_size]}
'''


def _llava_omitting(tmp_path: Path, glob: str, *replaced: tuple[str, str]) -> Path:
    text = (ARCHITECTURES / "llava.yaml").read_text()
    for old, new in replaced:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    family = tmp_path / "llava_omit.yaml"
    family.write_text(text.replace("\nparameters:\n", f'\nomit: ["{glob}"]\n\nparameters:\n', 1))
    return family


def test_a_module_made_of_omitted_tensors_that_reaches_nothing_verifies(tmp_path):
    """CLIP's post_layernorm runs in HF's vision tower, but LLaVA reads an earlier layer's
    hidden state: a family may omit it instead of owning it, and verify agrees (the module
    checks and the stages' checks both), because changing its output changes no logit."""
    family = _llava_omitting(tmp_path, "vision_tower*.post_layernorm.*", (POST_LAYERNORM, ""))
    config = hf("llava") / "config.json"
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=2, pipeline_parallel_size=2)) == []
    report = verify_family(family, config, tensor_parallel_sizes=[1, 2], pipeline_parallel_size=2)
    assert report.ok, report.first_failure
    checked = [c for c in report.checks if c.module == "model.vision_tower.post_layernorm"]
    assert [c.tp for c in checked] == [1, 2] and all(c.ok for c in checked)


def test_an_omitted_tensor_the_logits_depend_on_fails_verify_naming_it(tmp_path):
    """The projector's biases omitted (no rank loads them) though HF adds them: the projector's
    module check names them, and the stages' check says no stage loads them."""
    family = _llava_omitting(tmp_path, "multi_modal_projector.*.bias",
                             ("    bias: projector_bias\n", "    bias: false\n"))
    config = hf("llava") / "config.json"
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=1, pipeline_parallel_size=2)) == []
    report = verify_family(family, config, tensor_parallel_sizes=[1], pipeline_parallel_size=2)
    failed = [c for c in report.checks if not c.ok]
    assert not report.ok
    module = next(c for c in failed if c.module == "model.multi_modal_projector")
    assert module.message.startswith(
        "T=1 x S=1: module `model.multi_modal_projector`, ranks 0-0: no rank loads "
        "`multi_modal_projector.linear_1.bias`, `multi_modal_projector.linear_2.bias` (the "
        "family omits them), but the module runs them and the logits depend on it"), \
        module.message
    stages = [c for c in failed if c.pp == 2 and c.module.startswith("multi_modal_projector")]
    assert sorted(c.module for c in stages) == ["multi_modal_projector.linear_1.bias",
                                                "multi_modal_projector.linear_2.bias"]
    assert all("no stage loads that tensor (the family omits it), and the logits depend on it"
               in c.message for c in stages)
