"""`partc init` writes the vision-language boundaries as the built-in families declare them
(issue 38, `partc init --prove`): LLaVA's tower hands over `[images, positions, width]` from
the last layer its projector reads (`vision_feature_layer`), its projector the decoder's
width; Qwen2-VL's tower `[patches, embed_dim]` with the image grid, its merger (an execution
group after the tower) `[image_tokens, hidden_size]`. The scaffolds check, compile and verify
against transformers at S = 2 as written. SigLIP's position embedding (Gemma-3) has
`(image_size // patch_size)^2` rows, not `image_size`.

Shapes are compared with the built-in family bound to the same config and with values read
from transformers' own modules (`CLIPVisionEmbeddings.num_positions`, the Qwen2-VL merger's
output width); the scaffolds are written once per module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from partc.api import bind, check_family
from partc.cli.main import main
from partc.partition.boundary import BoundaryWireSchema
from partc.plan.topology import Topology
from partc.verify.run import verify_family

from support import hf

FIXTURES = ("llava", "qwen2_vl")


@pytest.fixture(scope="module")
def scaffolds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The family `partc init` writes for each vision-language fixture, unedited."""
    root = tmp_path_factory.mktemp("vl_init")
    out = {}
    for name in FIXTURES:
        out[name] = root / f"{name}.yaml"
        assert main(["init", "--checkpoint", str(hf(name)), "--out", str(out[name])]) == 0
    return out


def _spelled(schema: BoundaryWireSchema) -> list[tuple[str, list[str | int], str]]:
    """A bound boundary's tensors: (role, shape, dtype), the primary first."""
    return [(t.role, [d.spell() for d in t.shape], t.dtype.value)
            for t in (schema.primary, *schema.auxiliary)]


def _expected(name: str) -> list[tuple[list[str | int], list[str]]]:
    """Each vision-side group's primary shape and auxiliary roles, from the config and
    transformers' modules (not from partc)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf(name))
    vision, text = config.vision_config, config.text_config
    ids_mask = ["input_ids", "image_mask"]
    if name == "llava":
        from transformers.models.clip.modeling_clip import CLIPVisionEmbeddings

        positions = CLIPVisionEmbeddings(vision).num_positions  # patches + the class token
        assert positions == (vision.image_size // vision.patch_size) ** 2 + 1
        return [(["images", positions, vision.hidden_size], ids_mask),
                (["image_tokens", text.hidden_size], ids_mask)]
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchMerger

    merger = PatchMerger(dim=vision.hidden_size, context_dim=vision.embed_dim,
                         spatial_merge_size=vision.spatial_merge_size)
    grid = ["image_grid_thw", *ids_mask]
    return [(["patches", vision.embed_dim], grid),
            (["image_tokens", merger.mlp[-1].out_features], grid)]


@pytest.mark.parametrize("name", FIXTURES)
def test_the_scaffold_declares_the_built_in_familys_vision_boundaries_and_units(
        name: str, scaffolds: dict[str, Path]) -> None:
    """Bound to the fixture's config, the scaffold's vision and projector/merger boundaries
    are the built-in's (same roles, shapes and dtypes; shapes transformers' own), with no
    CHECK mark, and its vision units are the built-in's: LLaVA's last layer, which
    `vision_feature_layer: -2` leaves unread, is no unit."""
    config = hf(name) / "config.json"
    ours, _, _ = bind(scaffolds[name], config)
    builtin, _, _ = bind(None, config)
    mine, theirs = dict(ours.group_boundaries), dict(builtin.group_boundaries)
    assert len(mine) == len(theirs) == 2
    for (role_shapes, schema), (_, reference), (primary, auxiliary) in zip(
            ((_spelled(s), s) for s in mine.values()), theirs.items(), _expected(name),
            strict=True):
        assert role_shapes == _spelled(reference)
        assert role_shapes[0][1] == primary and [r for r, _, _ in role_shapes[1:]] == auxiliary
        assert schema.primary.dtype.value == "activation"
    paths = {g.name: g.unit_paths for g in ours.description.graph.groups}
    reference = {g.name: g.unit_paths for g in builtin.description.graph.groups}
    assert sorted(map(len, paths.values())) == sorted(map(len, reference.values()))
    for group, units in paths.items():  # the same units, named by the scaffold's groups
        assert units in reference.values(), group
    lines = scaffolds[name].read_text().splitlines()
    assert not any("CHECK" in line for line in lines if "primary:" in line)


@pytest.mark.parametrize("name", FIXTURES)
def test_the_scaffold_checks_and_verifies_at_s2_as_written(
        name: str, scaffolds: dict[str, Path]) -> None:
    """`partc check` passes at every T <= 4 the built-in passes at, and verify against
    transformers holds at T = 1, 2, 4 and S = 2, every cut's boundary checked by shape and value
    (before, the cut after the tower declared a placeholder the value did not fit)."""
    config = hf(name) / "config.json"
    for tp in (1, 2, 4):
        assert check_family(scaffolds[name], config, hf(name),
                            topology=Topology(tensor_parallel_size=tp)) == []
    report = verify_family(scaffolds[name], config, tensor_parallel_sizes=[1, 2, 4],
                           pipeline_parallel_size=2)
    assert report.ok, report.first_failure
    cuts = [c for c in report.checks if c.kind == "cut"]
    assert cuts and all(c.ok for c in cuts)


def test_the_llava_scaffold_keeps_the_unread_layer_in_a_static_role(
        scaffolds: dict[str, Path]) -> None:
    """The layers after `vision_feature_layer` are declared once, over `for:`, owned by the
    static role `vision_unused` placed with the last vision unit; the units count is derived
    from the config field, so another `vision_feature_layer` moves it."""
    data = yaml.safe_load(scaffolds["llava"].read_text())
    assert data["graph"][0]["units"] == "vision_used"
    assert data["config"]["vision_feature_layer"] == {"type": "int", "default": -2}
    assert data["static"]["vision_unused"] == {"stage": {"with": "vision", "unit": "last"}}
    unused = [g for g in data["parameters"] if g["name"].startswith("vision_unused.")]
    assert {g["owner"]["static"] for g in unused} == {"vision_unused"}
    assert all(g["for"] == {"layer": "vision_num_hidden_layers - vision_used"} for g in unused)
    config = json.loads((hf("llava") / "config.json").read_text())
    edited = scaffolds["llava"].parent / "llava_last.json"
    edited.write_text(json.dumps({**config, "vision_feature_layer": -1}))
    bound, _, _ = bind(scaffolds["llava"], edited)
    vision = next(g for g in bound.description.graph.groups if g.name == "vision")
    assert len(vision.unit_paths) == config["vision_config"]["num_hidden_layers"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Gemma-3 written by transformers: a SigLIP tower of 16-pixel images in 4-pixel
    patches (16 positions, equal to its image_size by chance) and a pooling projector."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "vocab_size": 131, "sliding_window": 16, "max_position_embeddings": 128},
        mm_tokens_per_image=4, image_token_index=130, boi_token_index=128, eoi_token_index=129)
    model = Gemma3ForConditionalGeneration(config)
    assert model.model.vision_tower.embeddings.num_positions == 16 == 4 ** 2
    folder = tmp_path_factory.mktemp("gemma3") / "model"
    model.save_pretrained(folder)
    return folder


def test_a_siglip_position_embedding_has_the_patch_count_rows(
        gemma3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma-3's SigLIP tower gets `[vision_positions, vision_hidden_size]`, `vision_positions`
    derived as (image_size // patch_size)^2, the rows transformers' module has (16, not
    image_size: with another image size the scaffold's shape follows the patch count)."""
    family = tmp_path / "gemma3.yaml"
    assert main(["init", "--checkpoint", str(gemma3), "--out", str(family)]) == 0
    capsys.readouterr()
    data = yaml.safe_load(family.read_text())
    group = next(g for g in data["parameters"]
                 if g.get("module", "").endswith("embeddings.position_embedding"))
    assert group["params"] == {"weight": ["vision_positions", "vision_hidden_size"]}
    assert data["derived"]["vision_positions"] == (
        "(vision_image_size // vision_patch_size) * (vision_image_size // vision_patch_size)")
    assert not any("CHECK" in line for line in family.read_text().splitlines()
                   if "vision_positions, vision_hidden_size" in line)
    saved = json.loads((gemma3 / "config.json").read_text())
    saved["vision_config"]["image_size"] = 32  # 64 positions: the shape follows the config
    (tmp_path / "other.json").write_text(json.dumps(saved))
    bound, _, _ = bind(family, tmp_path / "other.json")
    values = dict(bound.config_values)
    assert values["vision_positions"] == (32 // 4) ** 2 != values["vision_image_size"]


def test_prove_verifies_a_boundary_no_rule_derives_and_writes_its_proof(
        gemma3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma-3's pooling projector is no two-linear projector: its boundary is a placeholder
    marked CHECK; `--prove` verifies it at T = 1 with a stage per unit (every cut crossed)
    and writes the proof in place of the mark."""
    family = tmp_path / "proven.yaml"
    assert main(["init", "--checkpoint", str(gemma3), "--out", str(family), "--prove"]) == 0
    err = capsys.readouterr().err
    assert "prove: boundary gemma3.projector: [image_tokens, hidden_size] verified at T=1 x S=" \
        in err
    line = next(line for line in family.read_text().splitlines()
                if "role: image_features" in line)
    assert line.endswith("shape: [image_tokens, hidden_size], dtype: activation}  # partc init "
                         "--prove: verified against transformers at T=1 x S=3 (a stage per "
                         "unit: every cut crossed)")  # a vision, projector and decoder unit


def test_prove_tries_the_next_width_and_marks_what_no_width_explains(gemma3: Path) -> None:
    """A cut check naming the boundary's group moves it to its next width (the decoder's,
    then the tower's); when every width is refused the first is kept, marked CHECK with the
    finding. (A stand-in verifier refuses by the shape written.)"""
    from partc.scaffold.family_text import scaffold
    from partc.scaffold.prove import prove_boundaries

    first = scaffold(gemma3, gemma3 / "config.json")
    assert [(b.group, b.candidates) for b in first.boundaries] == [
        ("projector", (("image_tokens", "hidden_size"), ("image_tokens", "vision_hidden_size")))]
    tried: list[str] = []

    def refusing(refused: set[str]) -> Callable[[Path, Path, int], list[tuple[str, str]]]:
        def verify(family: Path, config: Path, stages: int) -> list[tuple[str, str]]:
            shape = re.search(r"role: image_features, shape: (\[[^]]*\])",
                              family.read_text()).group(1)
            tried.append(shape)
            return [("projector", f"the cut declares {shape}, wrong")] if shape in refused \
                else []
        return verify

    second = prove_boundaries(first, gemma3 / "config.json",
                              refusing({"[image_tokens, hidden_size]"}))
    assert tried == ["[image_tokens, hidden_size]", "[image_tokens, vision_hidden_size]"]
    assert "shape: [image_tokens, vision_hidden_size], dtype: activation}  # partc init " \
        "--prove: verified" in second.text
    assert len(second.undecided) == len(first.undecided) - 1
    tried.clear()
    none = prove_boundaries(first, gemma3 / "config.json", refusing(
        {"[image_tokens, hidden_size]", "[image_tokens, vision_hidden_size]"}))
    assert tried == ["[image_tokens, hidden_size]", "[image_tokens, vision_hidden_size]"]
    assert ("shape: [image_tokens, hidden_size], dtype: activation}  # partc init: CHECK: every "
            "width refused by verify; with the first, the cut declares [image_tokens, "
            "hidden_size], wrong") in none.text
    assert len(none.undecided) == len(first.undecided)
