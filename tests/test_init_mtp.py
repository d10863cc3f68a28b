"""`partc init` on DeepSeek-V3: its multi-token-prediction layer written as
architectures/deepseek_v3.yaml declares it (an `mtp` execution group after the decoder, planned
when the checkpoint holds `model.layers.{num_hidden_layers}.eh_proj.weight`), so that the
scaffold checks at T = 1, 2, 4, verifies against transformers at every T <= 4 with S = 2 (verify
seeds the MTP layer the config's `num_nextn_predict_layers` declares) and splits every tensor as
the built-in family does. Two checkpoints: the tiny fixture as transformers saves it (no MTP
layer) and the same with an MTP layer under DeepSeek's released names (layer 3 holding a MoE
decoder layer's tensors, `embed_tokens`, `enorm`, `hnorm`, `eh_proj` and `shared_head`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from partc.api import check_family, plan_family
from partc.plan.topology import Topology
from partc.scaffold.family_text import scaffold
from partc.scaffold.prove import read_share
from partc.verify.run import verify_family

from support import ROOT, hf

FIXTURE = hf("deepseek_v3")
CONFIG = FIXTURE / "config.json"
BUILTIN = yaml.safe_load((ROOT / "architectures" / "deepseek_v3.yaml").read_text())
"""The built-in family, read as data (what the scaffold is compared with)."""


def _released(folder: Path) -> Path:
    """The fixture with an MTP layer as DeepSeek releases it: `model.layers.3` holding the
    last (MoE) decoder layer's tensors and the MTP glue, every shape from config.json."""
    from safetensors.numpy import load_file, save_file

    config = json.loads(CONFIG.read_text())
    hidden, vocab, base = config["hidden_size"], config["vocab_size"], \
        config["num_hidden_layers"]
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    last = f"model.layers.{base - 1}."
    mtp = f"model.layers.{base}."
    generator = np.random.default_rng(3)
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last):]] = tensors[name].copy()
    for name, shape in {"embed_tokens.weight": (vocab, hidden), "enorm.weight": (hidden,),
                        "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
                        "shared_head.norm.weight": (hidden,),
                        "shared_head.head.weight": (vocab, hidden)}.items():
        tensors[mtp + name] = generator.standard_normal(shape).astype(np.float32)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copy(CONFIG, folder / "config.json")
    return folder


@pytest.fixture(scope="module")
def scaffolds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Any]]:
    """Per checkpoint (`saved`: as transformers saves it, `released`: with its MTP layer):
    the checkpoint, its scaffold's file and the scaffold."""
    folder = tmp_path_factory.mktemp("mtp")
    out = {}
    for name, checkpoint in (("saved", FIXTURE), ("released", _released(folder / "released"))):
        written = scaffold(checkpoint, CONFIG)
        family = folder / f"{name}.yaml"
        family.write_text(written.text)
        out[name] = (checkpoint, family, written)
    return out


@pytest.mark.parametrize("name", ["saved", "released"])
def test_the_mtp_group_and_its_fields_are_declared_as_the_builtin_declares_them(
        scaffolds: dict[str, tuple[Path, Path, Any]], name: str) -> None:
    """Only the saved checkpoint's MTP layer (which it does not hold) is marked CHECK; the
    released one's layer 3 is no decoder layer (no `num_hidden_layers` note, no `when:` of
    the decoder's groups names it)."""
    _, family, written = scaffolds[name]
    document = yaml.safe_load(family.read_text())
    graph = {entry["group"]: entry for entry in document["graph"]}
    builtin = {entry["group"]: entry for entry in BUILTIN["graph"]}
    assert list(graph) == ["decoder", "mtp"]
    assert {k: graph["mtp"][k] for k in ("units", "path", "after", "state")} == \
        {k: builtin["mtp"][k] for k in ("units", "path", "after", "state")}
    for field in ("num_nextn_predict_layers", "mtp_in_checkpoint"):
        assert document["config"][field] == BUILTIN["config"][field]
    marked = [line for line in family.read_text().splitlines()
              if "CHECK" in line and "num_nextn_predict_layers = 1 MTP layer(s)" in line]
    assert [line.split(":")[0].strip() for line in marked] == \
        (["mtp_in_checkpoint"] if name == "saved" else [])
    assert "the checkpoint has" not in family.read_text()
    conditions = {g.get("when") for g in document["parameters"] if "when" in g}
    assert conditions == {"unit == 0", "unit >= 1"}
    assert len(written.undecided) == 6 + (name == "saved")


@pytest.mark.parametrize("name", ["saved", "released"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_scaffold_checks_with_and_without_the_mtp_layer_in_the_checkpoint(
        scaffolds: dict[str, tuple[Path, Path, Any]], name: str, tp: int) -> None:
    """Its plan has the built-in's execution groups and units (the `mtp` group's unit paths
    none without the layer); every tensor of the released checkpoint's layer 3 is owned by
    an `mtp` group."""
    checkpoint, family, _ = scaffolds[name]
    topology = Topology(tensor_parallel_size=tp)
    assert check_family(family, CONFIG, checkpoint, topology=topology) == []
    mine, builtin = (plan_family(f, CONFIG, topology, checkpoint=checkpoint)
                     for f in (family, None))
    assert [(g.name, g.unit_paths) for g in mine.graph] == \
        [(g.name, g.unit_paths) for g in builtin.graph]
    assert [g.name for g in mine.graph] == ["decoder", "mtp"]
    layer = {t.group.split(".", 1)[0] for t in mine.tensors
             if t.target.startswith("model.layers.3.")}
    assert layer == ({"mtp"} if name == "released" else set())


def _placements(plan: Any) -> dict[tuple[int, int, str], object]:
    """Every rank's part of every tensor: (stage, rank, target) -> its placement."""
    return {(rank.pipeline_stage, rank.rank, t.target): t.placement.to_json()
            for rank in plan.ranks
            for t in rank.layout.tensors}


def test_every_tensor_is_split_as_the_builtin_splits_it_at_every_t_up_to_4(
        scaffolds: dict[str, tuple[Path, Path, Any]]) -> None:
    """With and without the MTP layer in the checkpoint, and with S = 2, where each rank's
    stage is the built-in's too; hence the share of the checkpoint's elements the T ranks read
    is the built-in's."""
    for name, (checkpoint, family, _) in sorted(scaffolds.items()):
        for tp, pp in ((tp, pp) for tp in (1, 2, 3, 4) for pp in (1, 2)):
            topology = Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp)
            mine, builtin = (plan_family(f, CONFIG, topology, checkpoint=checkpoint)
                             for f in (family, None))
            assert _placements(mine) == _placements(builtin)
            assert read_share(mine) == read_share(builtin)
            assert any(t.target == "model.layers.3.eh_proj.weight" for t in mine.tensors) == \
                (name == "released")


def test_the_scaffold_verifies_with_its_mtp_layer_at_every_t_up_to_4_with_s_2(
        scaffolds: dict[str, tuple[Path, Path, Any]]) -> None:
    """Each T x 2 build checked as one (verify's reference checkpoint holds the MTP layer the
    config declares, so the layer's modules are checked on its stage too)."""
    _, family, _ = scaffolds["saved"]
    report = verify_family(family, CONFIG, tensor_parallel_sizes=(1, 2, 3, 4),
                           pipeline_parallel_size=2, combined=True)
    assert [c for c in report.checks if not c.ok] == []
    glue = {"eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head.head",
            "shared_head.norm", "self_attn", "mlp"}
    for tp in (1, 2, 3, 4):
        checked = {c.module for c in report.checks if c.tp == tp and c.pp == 2}
        assert {f"model.layers.3.{m}" for m in glue} <= checked


def test_a_config_declaring_a_huge_mtp_count_reads_only_the_headers_layers(
        tmp_path: Path) -> None:
    """`num_nextn_predict_layers` = 10**12 over the saved fixture: the scaffold is written at
    once, the MTP layer (which the checkpoint does not hold) marked; check refuses the field as
    it refuses it under the built-in family."""
    config = json.loads(CONFIG.read_text())
    config["num_nextn_predict_layers"] = 10**12
    folder = tmp_path / "ck"
    folder.mkdir()
    shutil.copy(FIXTURE / "model.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    family = tmp_path / "f.yaml"
    family.write_text(scaffold(folder, folder / "config.json").text)
    assert f"num_nextn_predict_layers = {10**12} MTP layer(s)" in family.read_text()
    refused = [check_family(f, folder / "config.json", folder) for f in (family, None)]
    assert [[e.message for e in errors] for errors in refused] == [[
        f"config field `num_nextn_predict_layers` must be an integer from 0 to 2147483647, "
        f"found {10**12}"]] * 2
