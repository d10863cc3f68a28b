"""`partc verify --checkpoint DIR`: the family checked against the user's released checkpoint
header, not only transformers' names (issue 38).

Released-naming checkpoints are written from the fixtures with the safetensors library:
`gen_released` (deepseek_v3 with DeepSeek-V3's MTP layer `model.layers.{L}.*`, in two shards
and an index, as the release stores it) and `gen_renamed` (llava in llava-hf's released
`vision_tower.vision_model.*` naming). A family whose templates follow transformers' names
(what verify's reference model has) verifies without `--checkpoint` but is refused with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from partc.cli.main import main
from partc.verify.checkpoint_check import checkpoint_errors

from support import ROOT, hf

sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "gen"))
from gen_released import write_released  # noqa: E402
from gen_renamed import write_renamed  # noqa: E402

ARCHITECTURES = ROOT / "architectures"


def _edited(tmp: Path, name: str, old: str, new: str) -> Path:
    """A copy of the built-in family `name` with `old` replaced by `new` (once)."""
    text = (ARCHITECTURES / f"{name}.yaml").read_text(encoding="utf-8")
    assert text.count(old) == 1
    out = tmp / f"{name}.yaml"
    out.write_text(text.replace(old, new), encoding="utf-8")
    return out


def test_the_released_deepseek_v3_with_its_mtp_layer_passes_the_builtin_family(tmp_path):
    released = write_released(hf("deepseek_v3"), tmp_path / "released")
    assert (released / "model.safetensors.index.json").is_file()
    assert checkpoint_errors(None, released / "config.json", released) == []


def test_a_family_that_plans_no_mtp_layer_is_refused_at_the_mtp_tensors(tmp_path):
    """Without the `present:` probe the family plans transformers' layers only: the MTP
    layer's tensors are owned by no group, named at the shard holding them."""
    released = write_released(hf("deepseek_v3"), tmp_path / "released")
    family = _edited(tmp_path, "deepseek_v3",
                     '    present: "model.layers.{num_hidden_layers}.eh_proj.weight"\n', "")
    errors = checkpoint_errors(family, released / "config.json", released)
    messages = {(e.tensor, str(e.location)) for e in errors}
    shard = json.loads((released / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.3.eh_proj.weight"]
    assert ("model.layers.3.eh_proj.weight", str(released / shard)) in messages
    assert all("model.layers.3." in (e.tensor or "") for e in errors)
    assert any("owned by no parameter group" in e.message for e in errors)


def test_verify_refuses_a_family_with_transformers_prefix_on_the_released_llava(
        tmp_path, capsys: pytest.CaptureFixture[str]):
    """The family declares only transformers' `vision_tower.` prefix: refused before any model
    is built, with check's located errors and a line naming the checkpoint's prefix; the
    built-in family (both prefixes as candidates) verifies and loads it."""
    released = write_renamed(hf("llava"), tmp_path / "released", "llava")
    family = _edited(tmp_path, "llava", "candidates: [vision_tower.vision_model, vision_tower]",
                     "candidates: [vision_tower]")
    config = str(released / "config.json")
    assert main(["verify", str(family), "--config", config, "--checkpoint", str(released),
                 "--tp", "1", "--pp", "1"]) == 1
    err = capsys.readouterr().err
    assert (f"{released}: the checkpoint holds 55 tensor(s) of the family under "
            "`vision_tower.vision_model.…` where the family declares `vision_tower.…` "
            "(`vision_tower.embeddings.class_embedding` is "
            "`vision_tower.vision_model.embeddings.class_embedding` there)") in err
    assert (f"{family}:94:5: the family declares tensor "
            "`vision_tower.embeddings.class_embedding`, which the checkpoint does not have") in err
    assert "the built-in family for this config's model_type fits" in err
    assert main(["verify", "--config", config, "--checkpoint", str(released), "--tp", "1",
                 "--pp", "1"]) == 0
    out = capsys.readouterr().out
    assert f"note: checkpoint {released}: every tensor's name, dtype and shape" in out
    assert "verified llava (llava) at T=1 x S=1: every check holds" in out


def test_a_missing_checkpoint_is_one_error(tmp_path, capsys: pytest.CaptureFixture[str]):
    assert main(["verify", "--config", str(hf("llama") / "config.json"), "--checkpoint",
                 str(tmp_path / "nothing")]) == 1
    assert "no such checkpoint file or directory" in capsys.readouterr().err
