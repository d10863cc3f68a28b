"""`partc verify --pp-layers`: the pipeline check cuts where the user asks, as compile does; a
failed check names the family line declaring its group.

A wrong boundary is caught at the cut given, and named by the module the stage runs last there
(transformers' own module, found independently of the counts); a cut the default split never
makes (inside LLaVA's vision tower) is checked when asked for; a large config keeps its layers
when shrunk, so that the counts still name them.
"""

from __future__ import annotations

import json
import re

import pytest

from partc.api import check_family
from partc.cli.main import main
from partc.errors import PartcError
from partc.plan.topology import Topology
from partc.verify.run import verify_family
from partc.verify.shrink import reference_config

from support import ROOT, edited_family, hf

ARCHITECTURES = ROOT / "architectures"
FULLSIZE = ROOT / "tests" / "fixtures" / "fullsize"


def _wrong_llama(tmp_path):
    """The llama family with a boundary one element narrower than the hidden state."""
    return edited_family(tmp_path, "llama", "shape: [batch, sequence, hidden_size]",
                         "shape: [batch, sequence, hidden_size - 1]")


@pytest.mark.parametrize(("units", "tail"), [((1, 2), "model.layers.0"),
                                             ((2, 1), "model.layers.1")])
def test_a_wrong_boundary_fails_at_the_cut_given_naming_the_last_layer_before_it(
        tmp_path, units, tail):
    family = _wrong_llama(tmp_path)
    config = hf("llama") / "config.json"
    report = verify_family(family, config, tensor_parallel_sizes=[1], stage_units=units)
    failure = report.first_failure
    assert not report.ok and failure is not None
    assert (failure.tp, failure.pp) == (1, 2)
    assert f"module `{tail}` gives it as" in failure.message, failure.message
    assert report.stage_units == ",".join(map(str, units))
    assert report.to_json()["stage_units"] == report.stage_units


def test_the_cli_cuts_at_the_counts_and_prints_them(tmp_path, capsys):
    config = str(hf("llama") / "config.json")
    assert main(["verify", "--config", config, "--tp", "1", "--pp-layers", "1,2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^T=1 x S=2 \(--pp-layers 1,2\): \d+/\d+ checks hold$", out, re.M), out
    assert main(["verify", str(_wrong_llama(tmp_path)), "--config", config, "--tp", "1",
                 "--pp-layers", "2,1"]) == 1
    err = capsys.readouterr().err
    assert "error: T=1 x S=2: the cut after stage 0" in err
    assert "module `model.layers.1` gives it as" in err


def test_counts_that_do_not_fit_the_model_are_one_error_before_any_model_is_built(capsys):
    config = str(hf("llama") / "config.json")
    assert main(["verify", "--config", config, "--tp", "1", "--pp-layers", "1,3"]) == 1
    captured = capsys.readouterr()
    assert "explicit stage sizes [1, 3] sum to 4, but the model has 3 execution units" in (
        captured.err)
    assert "Traceback" not in captured.err and "checks hold" not in captured.out
    with pytest.raises(PartcError, match="sum to 4, but the model has 3"):
        verify_family(None, config, tensor_parallel_sizes=[1], stage_units=(1, 3))
    # --pp and --pp-layers must agree, as compile's do
    with pytest.raises(SystemExit) as exited:
        main(["verify", "--config", config, "--pp", "3", "--pp-layers", "1,2"])
    assert exited.value.code == 2
    assert "--pp-layers gives 2 stage sizes (1,2) but --pp is 3" in capsys.readouterr().err


def test_a_cut_inside_the_vision_tower_checks_the_boundary_the_default_split_never_crosses(
        tmp_path):
    family = edited_family(tmp_path, "llava", "shape: [images, vision_positions, "
                           "vision_hidden_size]", "shape: [images, vision_positions - 1, "
                           "vision_hidden_size]")
    config = hf("llava") / "config.json"
    layout = (("vision", 1),), (("vision", 1), ("projector", 1), ("decoder", 2))
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=1, pipeline_parallel_size=2, stage_layout=layout)) == []
    # the default S=2 cuts after the projector: the wrong vision boundary goes unseen, and the
    # note says so
    default = verify_family(family, config, tensor_parallel_sizes=[1], pipeline_parallel_size=2)
    assert default.ok
    assert any("`vision`" in n and "crossed no cut" in n and "--pp-layers" in n
               for n in default.notes), default.notes
    cut = verify_family(family, config, tensor_parallel_sizes=[1], stage_units=layout)
    failure = cut.first_failure
    assert not cut.ok and failure is not None
    assert failure.message.startswith(
        "T=1 x S=2: the cut after stage 0 (group `vision`, boundary `llava.vision`)"), (
        failure.message)
    assert "module `model.vision_tower.encoder.layers.0` gives it as [1, 5, 32]" in (
        failure.message)
    assert cut.stage_units == "vision*1|vision*1,projector*1,decoder*2"


def test_a_large_config_keeps_its_layers_when_the_counts_name_them():
    config = json.loads((FULLSIZE / "Llama-3.1-8B" / "config.json").read_text())
    shrunk, notes = reference_config(config, pipeline_parallel_size=2)
    kept, kept_notes = reference_config(config, pipeline_parallel_size=2, keep_layers=True)
    assert shrunk["num_hidden_layers"] < 32 and kept["num_hidden_layers"] == 32
    assert kept["hidden_size"] == shrunk["hidden_size"] < config["hidden_size"]
    assert "kept all 32 layers: the pipeline check's stage units (--pp-layers) count them" in (
        kept_notes)
    assert not any(n.startswith("kept") for n in notes)
    report = verify_family(None, FULLSIZE / "Llama-3.1-8B" / "config.json",
                           tensor_parallel_sizes=[1], stage_units=(10, 22))
    assert report.ok, report.first_failure
    assert {(c.tp, c.pp) for c in report.checks} == {(1, 1), (1, 2)}
    assert any(n.startswith("kept all 32 layers") for n in report.notes)


def test_deepseek_v3_keeps_its_layers_but_not_its_multi_token_prediction_layer():
    config = json.loads((FULLSIZE / "DeepSeek-V3" / "config.json").read_text())
    kept, _ = reference_config(config, pipeline_parallel_size=2, keep_layers=True)
    assert kept["num_hidden_layers"] == config["num_hidden_layers"]
    assert kept["first_k_dense_replace"] == config["first_k_dense_replace"]
    assert kept["num_nextn_predict_layers"] == 0  # transformers builds no such layer


def test_a_failed_check_names_the_line_declaring_its_group(tmp_path, capsys):
    # a square o_proj split on its output axis: shapes and unit multiples hold, verify fails it
    old = '''      - module: "model.layers.{unit}.self_attn.o_proj"
        sharding: row'''
    family = edited_family(tmp_path, "llama", old, old.replace("row", "column"))
    line = family.read_text().splitlines().index('  - name: "layers.{unit}.attention"') + 1
    config = hf("llama") / "config.json"
    assert main(["verify", str(family), "--config", str(config), "--tp", "2", "--pp", "1",
                 "--format", "json"]) == 1
    checks = json.loads(capsys.readouterr().out)["checks"]
    failed = [c for c in checks if not c["ok"]]
    assert failed and failed[0]["group"] == "layers.0.attention"
    assert failed[0]["declared"] == f"{family}:{line}"
    assert all(c["declared"] == "" for c in checks if c["ok"])
    assert main(["verify", str(family), "--config", str(config), "--tp", "2", "--pp", "1"]) == 1
    err = capsys.readouterr().err
    assert f"    group `layers.0.attention` is declared at {family}:{line}\n" in err


def test_sizes_skipped_for_the_same_reason_are_one_line(capsys):
    # olmo2 (4 heads, 2 KV heads) cannot repeat its KV heads: at T=3, 5..8 the head counts
    # do not allow it (one line), at T=4 its k_norm's statistic would count each twice
    assert main(["verify", "--config", str(hf("olmo2") / "config.json")]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("skipped T")]
    assert [line.split(":", 1)[0] for line in skipped] == ["skipped T=3, 5, 6, 7, 8 x S=1",
                                                           "skipped T=4 x S=1"], skipped
    assert skipped[0].startswith("skipped T=3, 5, 6, 7, 8 x S=1: the config does not compile "
                                 "at T=3 x S=1: ")
    assert skipped[0].endswith("(the same error at each of these T, at its own size)")
    assert "k_norm" in skipped[1] and "(the same error" not in skipped[1]
    # the JSON report keeps one entry per size, each with its own reason
    assert main(["verify", "--config", str(hf("olmo2") / "config.json"), "--format",
                 "json"]) == 0
    entries = json.loads(capsys.readouterr().out)["skipped"]
    assert [e["tp"] for e in entries] == [3, 4, 5, 6, 7, 8]
    assert all(f"tensor_parallel_size {e['tp']}" in e["reason"] for e in entries)


def test_sizes_skipped_for_different_reasons_keep_their_own_lines():
    from partc.cli.compiling import _skipped_lines

    lines = _skipped_lines([
        {"tp": 3, "pp": 1, "reason": "at T=3: group `a` has 2 units but size is 3"},
        {"tp": 4, "pp": 1, "reason": "at T=4: group `a` has 2 units but size is 4"},
        {"tp": 5, "pp": 1, "reason": "at T=5: group `b` has 3 units but size is 5"},
        {"tp": 7, "pp": 1, "reason": "at T=7: group `b` has 3 units but size is 7"},
        {"tp": 1, "pp": 1, "reason": "no pipeline split asked for (S=1)", "check": "pipeline"}])
    # T=5 and 7 fail alike though 6 lies between them (it fails otherwise, or compiles)
    assert [what for what, _ in lines] == ["T=3, 4 x S=1", "T=5, 7 x S=1", "the pipeline check"]
    assert lines[0][1].startswith("at T=3: group `a`") and lines[1][1].startswith("at T=5")
