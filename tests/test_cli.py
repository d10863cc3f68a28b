"""The command line: exit codes, summaries and error reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from partc.cli.commands import docs_folder
from partc.cli.diagnostics import CONTEXT_WIDTH
from partc.cli.main import main

from support import ROOT, hf
from support.families import MINI, MINI_CONFIG, MINI_TOML

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
    lines = capsys.readouterr().out.splitlines()[2:]
    rows = [line.split() for line in lines[:lines.index("")]]  # the stage table follows
    assert len(rows) == 6
    written = json.loads((tmp_path / "b" / "plan.json").read_text())
    for rank, row in enumerate(rows):
        stage = rank // 2
        assert int(row[4]) == sum(stage in t["stages"] for t in written["tensors"])


def test_the_rank_table_keeps_its_columns_aligned_for_a_stage_of_several_groups(tmp_path,
                                                                                capsys):
    """A vision-language stage's units (`vision[0:2], projector[0:1]`) are wider than a
    decoder's: every row's tensor count ends under the header's `tensors`, and its static roles
    start under `static roles`."""
    assert main(["compile", "--checkpoint", str(hf("llava")), "--tp", "2", "--pp", "2",
                 "--out", str(tmp_path / "b")]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    header, rows = lines[0], lines[1:lines.index("")]
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert len(rows) == 4 and any("projector[0:1]" in row for row in rows)
    end, roles = header.index("tensors") + len("tensors"), header.index("static roles")
    for rank, row in enumerate(rows):
        count = sum(plan["ranks"][rank]["partition"]["stage"] in t["stages"]
                    for t in plan["tensors"])
        assert row[:end].split()[-1] == str(count) and row[end] == " ", row
        assert row[roles - 1] == " " and row[roles] != " ", row


def test_compile_without_a_family_uses_the_built_in_one_for_the_model_type(tmp_path):
    assert main(["compile", "--config", CONFIG, "--out", str(tmp_path / "b")]) == 0


def test_a_leading_tilde_names_the_home_folder_where_the_shell_left_it(tmp_path, capsys,
                                                                      monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (home / "config.json").write_bytes((hf("llama") / "config.json").read_bytes())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(["compile", "llama", "--config=~/config.json", "--out=~/b"]) == 0
    assert f"into {home / 'b'}" in capsys.readouterr().out
    assert (home / "b" / "plan.json").is_file() and list(work.iterdir()) == []


@pytest.mark.parametrize("command", [
    ["init"], ["init", "--config", CONFIG], ["compile"], ["compile", "llama", "--config", CONFIG],
    ["check", "llama"], ["check", "llama", "--config", CONFIG]])
def test_a_checkpoint_that_does_not_exist_is_named_not_the_config_its_folder_lacks(
        tmp_path, capsys, command):
    missing = tmp_path / "chekpoint"  # mistyped
    out = {"init": ["--out", str(tmp_path / "f.yaml")], "compile": ["--out", str(tmp_path / "b")],
           "check": []}[command[0]]
    assert main([*command, "--checkpoint", str(missing), *out]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == f"error: {missing}: no such checkpoint file or directory"
    assert "config.json" not in captured.err and captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_an_illegal_topology_exits_one_with_a_located_message(tmp_path, capsys):
    status = main(["compile", "llama", "--config", CONFIG, "--tp", "3", "--out",
                   str(tmp_path / "b")])  # 4 q heads over 3 ranks, even with KV replication
    err = capsys.readouterr().err
    assert status == 1
    assert "architectures/llama.yaml:" in err
    assert "num_key_value_heads" in err
    assert not (tmp_path / "b").exists()


def test_json_format_reports_errors_as_data(tmp_path, capsys):
    status = main(["check", "llama", "--config", CONFIG, "--tp", "3", "--format", "json"])
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
    assert "temporary folder, removed on exit (--out DIR keeps it)" in done.stdout
    assert done.stdout.count("loaded ") == 4
    assert "Traceback" not in done.stderr


def test_demo_out_keeps_the_build_it_names(tmp_path, capsys):
    out = tmp_path / "kept"
    assert main(["demo", "--tp", "1", "--pp", "2", "--out", str(out)]) == 0
    assert f"at TP=1 x PP=2, build in {out}" in capsys.readouterr().out
    assert json.loads((out / "plan.json").read_text())["topology"]["pipeline_parallel_size"] == 2


def test_demo_out_a_link_is_refused_naming_force_and_force_writes_into_its_target(
        tmp_path, capsys):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    assert main(["demo", "--tp", "1", "--pp", "1", "--out", str(tmp_path / "link")]) == 1
    err = capsys.readouterr().err
    assert "is a symbolic link (to target); partc does not replace a link" in err, err
    assert "--force" in err and list((tmp_path / "target").iterdir()) == []
    assert main(["demo", "--tp", "1", "--pp", "1", "--out", str(tmp_path / "link"),
                 "--force"]) == 0
    assert (tmp_path / "link").is_symlink()
    assert (tmp_path / "target" / "plan.json").is_file()


# ---------------------------------------------------------------- the caret under a located error


def caret_report(err: str, prefix: str) -> tuple[str, str]:
    """The two lines after the one error line starting with `error: <prefix>`."""
    lines = err.splitlines()
    (index,) = [i for i, line in enumerate(lines) if line.startswith(f"error: {prefix}")]
    return lines[index + 1], lines[index + 2]


def test_a_yaml_error_shows_its_source_line_and_a_caret_under_the_column(tmp_path, capsys,
                                                                         monkeypatch):
    (tmp_path / "f.yaml").write_text(MINI.replace("    role: vocabulary", "    role: vocab", 1))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "f.yaml"]) == 1
    source, caret = caret_report(capsys.readouterr().err, "f.yaml:13:11: expected one of")
    assert source == "        role: vocab"
    assert caret == "    " + " " * 10 + "^"


def test_a_toml_error_shows_its_source_line_and_a_caret_under_the_column(tmp_path, capsys,
                                                                         monkeypatch):
    text = MINI_TOML.replace('units = "hidden_size"', 'units = "hidden_size % 0 +"')
    (tmp_path / "f.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "f.toml"]) == 1
    err = capsys.readouterr().err
    line = text.splitlines().index('units = "hidden_size % 0 +"') + 1
    column = len('units = "hidden_size % 0 +') + 1  # the end of the expression, inside the string
    source, caret = caret_report(err, f"f.toml:{line}:{column}: ")
    assert source == '    units = "hidden_size % 0 +"'
    assert caret == "    " + " " * (column - 1) + "^"


def test_a_checkpoint_passed_as_the_config_is_named_as_one_with_no_binary_line(tmp_path,
                                                                              capsys):
    weights = hf("llama") / "model.safetensors"
    header = int.from_bytes(weights.read_bytes()[:8], "little")  # safetensors' own framing
    assert main(["compile", "--config", str(weights), "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: {weights}: config.json expected, found a safetensors checkpoint (a {header}-byte"
        " header, then tensor data), not text (a checkpoint goes to --checkpoint)",
        "partc: 1 error(s)"]
    assert not (tmp_path / "b").exists()


def test_a_line_with_a_byte_that_is_not_utf8_is_shown_with_a_question_mark(tmp_path, capsys,
                                                                           monkeypatch):
    (tmp_path / "f.yaml").write_bytes(b"a: 1\nb: caf\xe9\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check", "f.yaml"]) == 1
    source, caret = caret_report(capsys.readouterr().err, "f.yaml:2:7: family file is not UTF-8")
    assert source == "    b: caf?" and caret == "    " + " " * 6 + "^"


def test_a_config_error_shows_the_config_json_line_and_a_caret(tmp_path, capsys, monkeypatch):
    (tmp_path / "f.yaml").write_text(MINI)
    (tmp_path / "config.json").write_text(json.dumps({**MINI_CONFIG, "hidden_size": "8"},
                                                     indent=1))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "f.yaml", "--config", "config.json"]) == 1
    source, caret = caret_report(capsys.readouterr().err, "config.json:3:17: config field")
    assert source == '     "hidden_size": "8",'
    assert caret == "    " + " " * 16 + "^"


def test_a_built_in_family_error_shows_the_line_of_the_shipped_file(tmp_path, capsys):
    assert main(["check", "llama", "--config", CONFIG, "--tp", "3"]) == 1
    err = capsys.readouterr().err
    (first,) = [line for line in err.splitlines() if line.startswith("error: ")]
    where = first.removeprefix("error: architectures/llama.yaml:").split(": ")[0]
    line, column = (int(n) for n in where.split(":"))
    shipped = (ROOT / "architectures" / "llama.yaml").read_text().splitlines()[line - 1]
    source, caret = caret_report(err, "architectures/llama.yaml:")
    assert source == "    " + shipped and "layers.{unit}.attention" in shipped
    assert caret == "    " + " " * (column - 1) + "^"


def test_tabs_before_the_column_are_kept_so_the_caret_lines_up(tmp_path, capsys, monkeypatch):
    (tmp_path / "f.toml").write_text('family = "x"\nmodel_types = [\t"x", 3]\n')
    monkeypatch.chdir(tmp_path)
    assert main(["check", "f.toml"]) == 1
    source, caret = caret_report(capsys.readouterr().err, "f.toml:2:22: ")
    assert source == '    model_types = [\t"x", 3]'
    assert caret == "    " + " " * 15 + "\t" + " " * 5 + "^"


def test_a_long_line_is_cut_to_a_window_around_the_column(tmp_path, capsys, monkeypatch):
    long = "x" * 200
    (tmp_path / "f.yaml").write_text(MINI.replace(
        'path: "model.layers.{unit}", state: true}',
        f'path: "model.{long}.layers.{{unit}}", state: no}}  # {long}', 1))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "f.yaml"]) == 1
    source, caret = caret_report(capsys.readouterr().err, "f.yaml:8:")
    assert source.startswith("    ...x") and source.endswith("x...")
    assert len(source) == 4 + 3 + CONTEXT_WIDTH + 3
    assert source[caret.index("^"):].startswith("no}  # x")


def test_an_unreadable_source_prints_the_error_alone(tmp_path, capsys, monkeypatch):
    from partc.cli.diagnostics import report_errors
    from partc.errors import SchemaError, SourceLocation

    monkeypatch.chdir(tmp_path)
    errors = [SchemaError("gone", location=SourceLocation("deleted.yaml", 3, 2)),
              SchemaError("past the end", location=SourceLocation("short.yaml", 9, 1)),
              SchemaError("built in", location=SourceLocation("architectures/none.yaml", 1, 1))]
    (tmp_path / "short.yaml").write_text("a: 1\n")
    assert report_errors(errors, "text") == 1
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if line.startswith("    see: ")] == [
        "    see: " + str(docs_folder() / "authoring.md")] * 3  # the guide, never a source line
    assert [line for line in lines if not line.startswith("    see: ")] == [
        "error: architectures/none.yaml:1:1: built in",
        "error: deleted.yaml:3:2: gone",
        "error: short.yaml:9:1: past the end",
        "partc: 3 error(s)",
    ]


def test_the_json_report_carries_no_source_lines(tmp_path, capsys, monkeypatch):
    (tmp_path / "f.yaml").write_text(MINI.replace("    role: vocabulary", "    role: vocab", 1))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "f.yaml", "--format", "json"]) == 1
    captured = capsys.readouterr()
    (error,) = json.loads(captured.out)["errors"]
    assert (error["line"], error["column"]) == (13, 11) and captured.err == ""
    assert "role: vocab" not in json.dumps(error)


@pytest.mark.parametrize("spelled", ["２", "1_0", "+2", " 2", "2.0", "0x2"])
def test_a_size_not_in_ascii_digits_is_a_usage_error(capsys, spelled):
    """As the environment's counts (RANK, WORLD_SIZE, ...): `int()` alone would take some."""
    with pytest.raises(SystemExit) as exited:
        main(["check", "llama", "--config", str(hf("llama") / "config.json"), "--tp", spelled])
    assert exited.value.code == 2
    assert f"argument --tp: expected a positive integer, found {spelled!r}" in \
        capsys.readouterr().err


def test_a_size_in_ascii_digits_is_taken(capsys):
    assert main(["check", "llama", "--config", str(hf("llama") / "config.json"),
                 "--tp", "2", "--pp-layers", "1,2"]) == 0
