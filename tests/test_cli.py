"""The command line: exit codes, summaries and error reports."""

from __future__ import annotations

import json
import subprocess
import sys

from partc.cli import main

from support import hf

CONFIG = str(hf("llama") / "config.json")


def test_compile_writes_the_plan_and_prints_a_per_rank_summary(tmp_path, capsys):
    status = main(["compile", "llama", "--config", CONFIG, "--tp", "2", "--pp", "2", "--out",
                   str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert status == 0
    assert (tmp_path / "b" / "plan.json").is_file()
    assert "compiled llama (llama) for TP=2 x PP=2" in out
    assert "decoder[0:2]" in out and "decoder[2:3]" in out


def test_compile_in_json_reports_the_plan_hash_of_the_written_plan(tmp_path, capsys):
    status = main(["compile", "llama", "--config", CONFIG, "--tp", "2", "--out",
                   str(tmp_path / "b"), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert status == 0 and report["ok"] and report["plan_hash"] == written["plan_hash"]
    assert "plan.json" in report["files"]


def test_the_summary_counts_each_rank_s_tensors(tmp_path, capsys):
    main(["compile", "llama", "--config", CONFIG, "--tp", "2", "--pp", "3", "--out",
          str(tmp_path / "b")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    written = json.loads((tmp_path / "b" / "plan.json").read_text())
    for rank, row in enumerate(rows):
        stage = rank // 2
        assert int(row[4]) == sum(stage in t["stages"] for t in written["tensors"])


def test_compile_without_a_family_uses_the_built_in_one_for_the_model_type(tmp_path):
    assert main(["compile", "--config", CONFIG, "--out", str(tmp_path / "b")]) == 0


def test_an_illegal_topology_exits_one_with_a_located_message(tmp_path, capsys):
    status = main(["compile", "llama", "--config", CONFIG, "--tp", "4", "--out",
                   str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert status == 1
    assert "architectures/llama.yaml:" in err
    assert "num_key_value_heads" in err
    assert not (tmp_path / "b").exists()


def test_json_format_reports_errors_as_data(tmp_path, capsys):
    status = main(["check", "llama", "--config", CONFIG, "--tp", "4", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 1
    assert report["ok"] is False
    (error,) = report["errors"]
    assert error["file"] == "architectures/llama.yaml"
    assert error["line"] > 0
    assert error["pointer"].startswith("/parameters/")
    assert error["kind"] == "ParallelPlanError"


def test_check_reports_every_error_of_a_document_sorted(tmp_path, capsys):
    family = tmp_path / "bad.yaml"
    family.write_text(
        "family: bad\nmodel_types: [llama]\nconfig: {hidden_size: int}\n"
        "graph: [{group: decoder, units: num_layers, path: 'model.layers.{unit}'}]\n"
        "parameters:\n"
        "  - {name: x, role: replicated, owner: {static: nowhere}, module: m,"
        " params: {weight: [hiden_size]}}\n"
        "boundary: {identity: b, primary: {role: hidden, shape: [batch], dtype: activation}}\n")
    status = main(["check", str(family)])
    err = capsys.readouterr().err
    assert status == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 3
    assert f"{family}:4:" in lines[0] and "unknown name `num_layers`" in lines[0]
    assert f"{family}:6:" in lines[1]
    assert any("did you mean `hidden_size`" in line for line in lines)
    assert any("undeclared static role `nowhere`" in line for line in lines)


def test_check_with_checkpoint_passes_on_the_real_tiny_llama(capsys):
    status = main(["check", "llama", "--config", CONFIG, "--checkpoint", str(hf("llama")),
                   "--tp", "2", "--pp", "3"])
    assert status == 0
    assert "ok: family, config binding, checkpoint, topology checked" in capsys.readouterr().out


def test_demo_runs_from_a_subprocess_and_prints_every_rank(tmp_path):
    done = subprocess.run([sys.executable, "-m", "partc.cli", "demo"], capture_output=True,
                          text=True, cwd=tmp_path, check=True)
    assert "embedded tiny Llama (3 layers) at TP=2 x PP=2" in done.stdout
    assert done.stdout.count("loaded ") == 4
    assert "Traceback" not in done.stderr
