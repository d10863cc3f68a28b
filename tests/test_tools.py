"""The seeing and authoring commands: inspect, explain, report, init, families, schema, docs,
and the command-line conventions (JSON usage errors, quiet broken pipes, help everywhere)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from safetensors import safe_open

from partc.cli.main import main
from partc.cli.parser import EXIT_CODES, build_parser

from support import ROOT, edited_family, hf, import_build

DEEPSEEK = hf("deepseek_v3")
LLAMA = hf("llama")
LLAMA_LIKE = ("llama", "llama_tied", "mistral", "qwen2", "qwen3")


def _run(args, capsys):
    status = main(args)
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def deepseek_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "build"
    assert main(["compile", "--checkpoint", str(DEEPSEEK), "--tp", "2", "--pp", "3",
                 "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def fallback_build(tmp_path_factory):
    """Llama at TP=4 (2 KV heads) with KV replication turned off: the policy replicates
    every attention group."""
    folder = tmp_path_factory.mktemp("l4")
    out = folder / "build"
    assert main(["compile", str(_without_kv_replication(folder)), "--config",
                 str(LLAMA / "config.json"), "--tp", "4", "--policy", "replicate-unsupported",
                 "--out", str(out)]) == 0
    return out


def _without_kv_replication(folder: Path) -> Path:
    """The built-in Llama family with `kv_replication: false` on its attention group."""
    return edited_family(folder, "llama", "kv_replication: true", "kv_replication: false")


def _loaded(build: Path, rank: int):
    """The arrays a rank really loads, through its generated module (the oracle)."""
    plan = json.loads((build / "plan.json").read_text())
    return import_build(build).load(DEEPSEEK, rank=rank).tensors, plan


def test_inspect_json_gives_stage_totals_equal_to_the_bytes_each_rank_loads(deepseek_build,
                                                                             capsys):
    status, out, _ = _run(["inspect", str(deepseek_build), "--format", "json"], capsys)
    report = json.loads(out)
    assert status == 0 and report["ok"] and report["kind"] == "build"
    per_rank = {}
    for rank in range(6):
        tensors, _ = _loaded(deepseek_build, rank)
        per_rank[rank] = sum(a.nbytes for a in tensors.values())
    assert [r["bytes"] for r in report["ranks"]] == [per_rank[r] for r in range(6)]
    assert [s["bytes"] for s in report["stages"]] == [per_rank[2 * s] + per_rank[2 * s + 1]
                                                     for s in range(3)]
    assert [s["static_roles"] for s in report["stages"]] == [["embedding"], [],
                                                             ["final_norm", "output"]]
    mean = sum(per_rank.values()) / 6
    assert report["rank_imbalance"] == round(max(per_rank.values()) / mean, 4)
    assert report["fallbacks"] == []


def test_inspect_text_prints_the_stage_and_rank_tables(deepseek_build, capsys):
    status, out, _ = _run(["inspect", str(deepseek_build)], capsys)
    assert status == 0
    assert "deepseek_v3 (deepseek_v3) at TP=2 x PP=3" in out
    assert "stage imbalance (largest / mean bytes)" in out
    assert "final_norm, output" in out and "fallbacks: none" in out


def test_inspect_rank_lists_local_shapes_equal_to_the_loaded_arrays_with_family_lines(
        deepseek_build, capsys):
    status, out, _ = _run(["inspect", str(deepseek_build), "--rank", "3", "--group",
                           "*attention*", "--format", "json"], capsys)
    rows = json.loads(out)["tensors"]
    tensors, _ = _loaded(deepseek_build, 3)
    assert status == 0 and rows
    family = (ROOT / "architectures" / "deepseek_v3.yaml").read_text().splitlines()
    for row in rows:
        assert row["local_shape"] == list(tensors[row["target"]].shape), row["target"]
        file, line = row["origin"].rsplit(":", 1)
        assert file == "architectures/deepseek_v3.yaml"
        # the line of its projection's `module:` entry, or of a one-module group's `name:`
        assert f'.{row["target"].split(".")[-2]}"' in family[int(line) - 1]
    assert {r["rank"] for r in rows} == {3}


def test_inspect_of_a_checkpoint_collapses_layer_and_expert_numbers(capsys):
    status, out, _ = _run(["inspect", str(DEEPSEEK), "--format", "json"], capsys)
    report = json.loads(out)
    with safe_open(str(DEEPSEEK / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert status == 0 and report["tensors"] == len(names)
    assert sum(e["count"] for e in report["entries"]) == len(names)
    experts = next(e for e in report["entries"]
                   if e["pattern"] == "model.layers.N.mlp.experts.M.down_proj.weight")
    expected = [n for n in names if ".mlp.experts." in n and n.endswith("down_proj.weight")]
    assert experts["count"] == len(expected)
    status, text, _ = _run(["inspect", str(DEEPSEEK)], capsys)
    assert "model.layers.N.mlp.experts.M.down_proj.weight" in text and f"x{len(expected)}" in text


def test_explain_gives_each_rank_s_range_and_the_family_line(deepseek_build, capsys):
    target = "model.layers.0.self_attn.q_b_proj.weight"
    status, out, _ = _run(["explain", str(deepseek_build), target, "--format", "json"], capsys)
    found = json.loads(out)
    assert status == 0 and found["group"] == "model.layers.0.attention.heads"
    assert [r["logical_range"] for r in found["ranks"]] == [[0, 2], [2, 4]]
    assert [r["tensors"][0]["placement"] for r in found["ranks"]] == ["rows 0:48", "rows 48:96"]
    assert any(w.startswith("declared at architectures/deepseek_v3.yaml:") for w in found["why"])
    status, text, _ = _run(["explain", str(deepseek_build), target], capsys)
    assert "why:" in text and "4 units split evenly over TP=2: 2 per rank" in text


def test_explain_of_an_unknown_name_suggests_the_closest(deepseek_build, capsys):
    status, _, err = _run(["explain", str(deepseek_build),
                           "model.layers.0.self_attn.q_b_proj.weigh"], capsys)
    assert status == 1
    assert "did you mean `model.layers.0.self_attn.q_b_proj.weight`" in err


def test_explain_suggests_the_tensor_that_ends_as_the_name_given(fallback_build, capsys):
    """A name missing its module (`self_attn`) gets the tensor of that projection, not another
    projection whose characters match more of it (`mlp.up_proj`)."""
    status, _, err = _run(["explain", str(fallback_build), "model.layers.0.q_proj.weight"],
                          capsys)
    assert status == 1
    assert "did you mean `model.layers.0.self_attn.q_proj.weight`?" in err, err


def test_compile_and_check_report_fallbacks_with_their_extra_bytes(fallback_build, tmp_path,
                                                                   capsys):
    with safe_open(str(LLAMA / "model.safetensors"), "np") as f:
        attention = sum(f.get_slice(n).get_shape()[0] * f.get_slice(n).get_shape()[1] * 4
                        for n in f.keys() if n.startswith("model.layers.0.self_attn."))
    status, out, _ = _run(["check", str(_without_kv_replication(tmp_path)), "--config",
                           str(LLAMA / "config.json"), "--tp", "4",
                           "--policy", "replicate-unsupported", "--format", "json"], capsys)
    report = json.loads(out)
    assert status == 0 and len(report["fallbacks"]) == 3
    first = report["fallbacks"][0]
    assert first["group"] == "layers.0.attention" and first["bytes"] == attention
    assert first["extra_bytes"] == 3 * attention
    status, text, _ = _run(["inspect", str(fallback_build)], capsys)
    assert "fallbacks: 3 group(s) replicated by the policy" in text


def test_compile_takes_the_config_from_the_checkpoint_folder_and_pp_from_pp_layers(
        tmp_path, capsys):
    status, out, _ = _run(["compile", "--checkpoint", str(LLAMA), "--pp-layers", "1,2", "--out",
                           str(tmp_path / "b"), "--format", "json"], capsys)
    report = json.loads(out)
    assert status == 0 and report["topology"]["pipeline_parallel_size"] == 2
    assert [s["units"] for s in report["stages"]] == ["decoder[0:1]", "decoder[1:3]"]


def _ids(runs: str) -> list[int]:
    """`0-1,4` as ids."""
    return [i for run in runs.split(",") for i in range(int(run.split("-")[0]),
                                                        int(run.split("-")[-1]) + 1)]


def _report_html(build: Path, tmp_path: Path, capsys) -> dict:
    out = tmp_path / f"{build.parent.name}.html"
    status, _, _ = _run(["report", str(build), "--out", str(out)], capsys)
    assert status == 0

    class Collect(HTMLParser):
        def __init__(self):
            super().__init__()
            self.found = {"cell": [], "segment": [], "wire": 0, "fallback_rows": 0,
                          "links": [], "tables": set(), "rows": {"ownership": [], "bytes": []}}
            self.table = self.svg = None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            css = (a.get("class") or "").split()
            if tag == "svg":
                self.svg = a.get("id")
            if tag == "g" and "row" in css:
                self.found["rows"][self.svg].append((a["data-ranks"], int(a["data-count"])))
            if tag == "rect" and "cell" in css:
                self.found["cell"].append(a)
            if tag == "rect" and "segment" in css:
                self.found["segment"].append(a)
            if tag == "table":
                self.table = a.get("id")
                self.found["tables"].add(self.table)
            if tag == "tr" and self.table == "wire":
                self.found["wire"] += 1
            if tag == "tr" and "fallback" in css:
                self.found["fallback_rows"] += 1
            self.found["links"] += [v for k, v in attrs if k in ("src", "href") and v]

    parser = Collect()
    parser.feed(out.read_text())
    return parser.found


def test_the_report_maps_every_rank_and_unit_and_the_wire_schema(deepseek_build, tmp_path,
                                                                  capsys):
    found = _report_html(deepseek_build, tmp_path, capsys)
    plan = json.loads((deepseek_build / "plan.json").read_text())
    units = sum(len(g["unit_paths"]) for g in plan["graph"]) + len(plan["static_roles"])
    # one map row per stage: its 2 TP ranks own the same units
    assert found["rows"]["ownership"] == [("0-1", 2), ("2-3", 2), ("4-5", 2)]
    assert len(found["cell"]) == 3 * units
    owned = [c for c in found["cell"] if "owned" in c["class"].split()]
    assert len(owned) == 3 * 1 + 1 + 2  # one decoder unit per stage; 1 + 2 static roles
    bars = found["rows"]["bytes"]  # one bar per set of ranks holding the same bytes
    assert sorted(r for ranks, _ in bars for r in _ids(ranks)) == list(range(6))
    assert len({float(c["y"]) for c in found["segment"]}) == len(bars) <= 6
    assert found["wire"] == 1 + 1 + len(plan["boundary"]["auxiliary"])  # header + primary
    assert found["links"] == [] and found["fallback_rows"] == 0


def test_the_report_highlights_fallbacks(fallback_build, tmp_path, capsys):
    found = _report_html(fallback_build, tmp_path, capsys)
    assert found["fallback_rows"] == 1  # 3 groups alike: one row
    assert any("fallback" in s["class"].split() for s in found["segment"])
    page = (tmp_path / f"{fallback_build.parent.name}.html").read_text()
    assert "None" not in page  # a replicated group has no logical units to print
    assert "attention_heads replicated by the policy" in page
    assert "<td>layers.0.attention … layers.2.attention (3 groups)</td>" in page


def test_inspect_and_report_titles_name_the_expert_parallel_topology(tmp_path, capsys):
    qwen = hf("qwen3_moe")
    assert main(["compile", "--config", str(qwen / "config.json"), "--tp", "1", "--ep", "3",
                 "--out", str(tmp_path / "b")]) == 0
    compiled = capsys.readouterr().out
    assert "for TP=1 x PP=1 x EP=3 (ETP=1)" in compiled
    assert main(["inspect", str(tmp_path / "b")]) == 0
    assert " at TP=1 x PP=1 x EP=3 (ETP=1), plan " in capsys.readouterr().out.splitlines()[0]
    assert main(["report", str(tmp_path / "b"), "--out", str(tmp_path / "r.html")]) == 0
    assert ("<title>partc report: qwen3_moe at TP=1 x PP=1 x EP=3 (ETP=1)</title>"
            in (tmp_path / "r.html").read_text())


def test_the_report_never_replaces_a_file_partc_did_not_write(deepseek_build, tmp_path, capsys):
    mine = tmp_path / "notes.html"
    mine.write_text("my notes")
    status, _, err = _run(["report", str(deepseek_build), "--out", str(mine)], capsys)
    assert status == 1 and "partc did not write it" in err and mine.read_text() == "my notes"


@pytest.mark.parametrize("fixture", LLAMA_LIKE)
def test_init_writes_a_family_that_checks_as_written(fixture, tmp_path, capsys):
    family = tmp_path / "family.yaml"
    status, out, _ = _run(["init", "--checkpoint", str(hf(fixture)), "--out", str(family)],
                          capsys)
    assert status == 0 and family.is_file() and "partc check" in out
    status, out, err = _run(["check", str(family), "--checkpoint", str(hf(fixture)), "--tp", "2",
                             "--pp", "2"], capsys)
    assert status == 0, err
    assert out.startswith("ok: family, config binding, checkpoint, topology checked")


def test_init_marks_what_it_could_not_decide(tmp_path, capsys):
    status, out, _ = _run(["init", "--checkpoint", str(hf("phi3")), "--format", "json"], capsys)
    report = json.loads(out)
    assert status == 0
    assert any("qkv_proj" in u for u in report["undecided"])
    assert report["text"].count("# partc init: CHECK") == len(report["undecided"]) + 1


def test_repeated_errors_collapse_into_one_line_and_the_built_in_family_is_suggested(
        tmp_path, capsys):
    text = (ROOT / "architectures" / "llama.yaml").read_text()
    start = text.index('  - name: "layers.{unit}.mlp"')
    family = tmp_path / "no_mlp.yaml"
    family.write_text(text[:start] + text[text.index("  - name: final_norm"):])
    status, _, err = _run(["check", str(family), "--checkpoint", str(LLAMA)], capsys)
    assert status == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: 9 errors like this one")
    assert "mlp" in lines[0]
    with safe_open(str(LLAMA / "model.safetensors"), "np") as f:  # the 9 unowned tensors
        unowned = sorted(n for n in f.keys() if ".mlp." in n)
    assert len(unowned) == 9 and f"`{unowned[0]}` is owned by no parameter group" in lines[0]
    assert lines[0].endswith("; the others: " + "; ".join(f"`{n}`" for n in unowned[1:]))
    assert "hint: the built-in family for this config's model_type fits" in err
    assert err.splitlines()[-1] == "partc: 9 error(s)"


def test_collapsed_typos_name_the_lines_of_the_others(tmp_path, capsys):
    text = (ROOT / "architectures" / "llama.yaml").read_text()
    family = tmp_path / "typos.yaml"
    family.write_text(text.replace("sharding: column", "sharding: colum"))
    wrong = [i + 1 for i, line in enumerate(family.read_text().splitlines())
             if "sharding: colum" in line]
    assert len(wrong) > 3  # collapsed: more than COLLAPSE_AFTER of one shape
    status, _, err = _run(["check", str(family)], capsys)
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert status == 1 and f"typos.yaml:{wrong[0]}:" in line
    assert line.endswith("; the others: " + "; ".join(f"line {n}" for n in wrong[1:]))


def test_usage_errors_are_json_under_format_json(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["inspect", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert exited.value.code == 2 and report["ok"] is False
    assert report["errors"][0]["stage"] == "usage"
    assert "path" in report["errors"][0]["message"]


def test_a_closed_pipe_ends_quietly(deepseek_build):
    process = subprocess.Popen([sys.executable, "-m", "partc.cli", "inspect", str(DEEPSEEK)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.readline()
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=60) == 0
    assert b"internal error" not in err and b"Traceback" not in err


def test_a_full_disk_is_the_machines_refusal_not_a_bug_in_partc():
    # stdout on /dev/full: every write fails with ENOSPC, as a scratch checkpoint's does on a
    # full disk (where `partc verify` used to report "internal error (a bug in partc)")
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "partc.cli", "schema"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 74, done.stderr
    assert done.stderr.splitlines() == [
        "error: partc schema: the machine refused a read or write: No space left on device; "
        "free space on that file system", "partc: 1 error(s)"]


@pytest.mark.parametrize("raised, status, stage, said", [
    ("safetensors", 74, "machine", "Error while serializing: I/O error: No space left on device "
     "(os error 28); free space on that file system, or point TMPDIR at a folder with room"),
    ("denied", 74, "machine", "Permission denied: /scratch/partc-verify-1"),
    ("einval", 70, "internal", "internal error (a bug in partc): OSError: [Errno 22]"),
    ("value", 70, "internal", "internal error (a bug in partc): ValueError: no"),
])
def test_only_the_operating_systems_refusals_are_told_apart_from_bugs(
        monkeypatch, capsys, raised, status, stage, said):
    import errno

    from safetensors import SafetensorError

    import partc.cli.main as cli

    errors = {
        "safetensors": SafetensorError("Error while serializing: I/O error: No space left on "
                                       "device (os error 28)"),
        "denied": PermissionError(errno.EACCES, "Permission denied", "/scratch/partc-verify-1"),
        "einval": OSError(errno.EINVAL, "Invalid argument"),  # partc asked for something wrong
        "value": ValueError("no"),
    }

    def command(args):
        raise errors[raised]

    monkeypatch.setitem(cli._COMMANDS, "verify", command)
    assert main(["verify", "--config", str(hf("llama") / "config.json"), "--format",
                 "json"]) == status
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert error["stage"] == stage and said in error["message"], error


def test_every_option_of_every_command_has_help_and_every_exit_code_is_documented():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.dest}" for name, sub in commands.choices.items()
               for action in sub._actions if not action.help]
    assert missing == []
    assert {code for code, _ in EXIT_CODES} == {0, 1, 2, 70, 74, 130}
    epilog = parser.format_help()
    assert all(f"{code:>3}  {meaning}" in epilog for code, meaning in EXIT_CODES)


def test_the_cli_reference_is_up_to_date():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_reference.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


def test_families_in_json_give_absolute_paths_and_copy_writes_an_editable_file(tmp_path,
                                                                              capsys):
    status, out, _ = _run(["families", "--format", "json"], capsys)
    entries = json.loads(out)["families"]
    assert status == 0 and {"llama", "deepseek_v3", "mistral"} <= {e["model_type"]
                                                                     for e in entries}
    assert all(Path(e["path"]).is_absolute() and Path(e["path"]).is_file() for e in entries)
    copy = tmp_path / "mine.yaml"
    assert main(["families", "--copy", "llama", str(copy)]) == 0
    original = (ROOT / "architectures" / "llama.yaml").read_text()
    assert copy.read_text().partition("\n")[2] == original.partition("\n")[2]
    capsys.readouterr()
    assert main(["families", "--copy", "llama", str(copy)]) == 1  # never replaced
    assert "partc did not write it" in capsys.readouterr().err


def test_schema_prints_the_family_schema_and_docs_the_installed_guides(capsys):
    status, out, _ = _run(["schema"], capsys)
    assert status == 0
    assert json.loads(out) == json.loads(
        (ROOT / "schemas" / "architecture.schema.json").read_text())
    status, out, _ = _run(["docs", "authoring", "--path"], capsys)
    assert status == 0 and Path(out.strip()).is_file()
    assert Path(out.strip()).read_text() == (ROOT / "docs" / "authoring.md").read_text()
    status, out, _ = _run(["docs", "authoring"], capsys)  # the guide itself
    assert status == 0 and out == (ROOT / "docs" / "authoring.md").read_text()
    status, _, err = _run(["docs", "nope"], capsys)
    assert status == 1 and "authoring" in err


def test_explain_says_why_a_group_fell_back_and_the_plan_records_it(fallback_build, capsys):
    kv_heads = json.loads((LLAMA / "config.json").read_text())["num_key_value_heads"]
    plan = json.loads((fallback_build / "plan.json").read_text())
    attention = next(g for g in plan["groups"] if g["name"] == "layers.0.attention")
    assert attention["fell_back_to_replication"]
    assert f"has {kv_heads} partition units (num_key_value_heads)" in attention["fallback_reason"]
    assert all("fallback_reason" not in g for g in plan["groups"]
               if not g["fell_back_to_replication"])
    status, out, _ = _run(["explain", str(fallback_build),
                           "model.layers.0.self_attn.q_proj.weight"], capsys)
    assert status == 0
    assert (f"policy fallback: the group could not be sharded over TP=4: it (role "
            f"attention_heads) has {kv_heads} partition units (num_key_value_heads) but "
            "tensor_parallel_size is 4") in out
    assert "--policy replicate-unsupported replicated it on every rank" in out


def test_explain_gives_kv_replication_as_the_reason_for_repeated_key_heads(tmp_path, capsys):
    kv_heads = json.loads((LLAMA / "config.json").read_text())["num_key_value_heads"]
    assert kv_heads < 4  # the built-in Llama repeats them (kv_replication: true)
    assert main(["compile", "llama", "--config", str(LLAMA / "config.json"), "--tp", "4",
                 "--out", str(tmp_path / "b"), "-q"]) == 0
    capsys.readouterr()
    status, out, _ = _run(["explain", str(tmp_path / "b"),
                           "model.layers.0.self_attn.k_proj.weight"], capsys)
    assert status == 0
    assert ("KV replication: `model.layers.0.self_attn.k_proj.weight` has fewer KV heads than "
            f"TP=4 ranks; each KV head is repeated on {4 // kv_heads} ranks") in out, out
    # the cuts follow the repeated heads: not blamed on block or head alignment
    assert "aligned to blocks" not in out and "differ from the unit boundaries" not in out, out


def test_explain_says_a_norm_over_a_split_projection_is_all_reduced(tmp_path, capsys):
    """OLMo-2's q_norm (plan.json `needs_tp_reduction`) is explained as all-reduced; Qwen3's
    per-head q_norm, whole on every rank, is not."""
    from transformers import Olmo2Config

    Olmo2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=131).save_pretrained(
        tmp_path / "olmo2")
    for config, out in ((tmp_path / "olmo2" / "config.json", tmp_path / "o"),
                        (hf("qwen3") / "config.json", tmp_path / "q")):
        assert main(["compile", "--config", str(config), "--tp", "2", "--out", str(out),
                     "-q"]) == 0
    capsys.readouterr()
    target = "model.layers.0.self_attn.q_norm.weight"
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert next(t for t in plan["tensors"] if t["target"] == target)["needs_tp_reduction"]
    status, out, _ = _run(["explain", str(tmp_path / "o"), target], capsys)
    assert status == 0
    assert (f"TP reduction: `{target}` is a norm over a split projection's whole output, split "
            "with it; its statistic spans every rank's piece, so an engine all-reduces the sum "
            "of squares over the TP group before scaling") in out, out
    status, out, _ = _run(["explain", str(tmp_path / "q"), target, "--format", "json"], capsys)
    assert status == 0
    found = json.loads(out)
    assert not any("TP reduction" in w for w in found["why"])
    assert [t["needs_tp_reduction"] for t in found["tensors"]] == [False]


@pytest.fixture(scope="module")
def olmo2_build(tmp_path_factory):
    """OLMo-2 at TP=2, compiled from a config transformers wrote: its q_norm and k_norm span
    the whole q/k projection output (HF's Olmo2Attention), so they are split and all-reduced."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    root = tmp_path_factory.mktemp("olmo2")
    config = Olmo2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=131)
    config.save_pretrained(root / "config")
    assert main(["compile", "--config", str(root / "config" / "config.json"), "--tp", "2",
                 "--out", str(root / "b"), "-q"]) == 0
    # the independent answer: the norms HF applies to a projection's whole output
    model = Olmo2ForCausalLM(config)
    modules = dict(model.named_modules())
    widths = {name: m.out_features for name, m in modules.items()
              if name.endswith(("q_proj", "k_proj"))}
    whole = {f"{name}.weight" for name, m in modules.items() if name.endswith(("q_norm", "k_norm"))
             and m.weight.shape[0] == widths[name[:-len("norm")] + "proj"]}
    assert len(whole) == 4
    return root / "b", whole


def test_inspect_and_report_show_the_norms_all_reduced_over_the_tp_group(olmo2_build, capsys):
    build, whole = olmo2_build
    status, out, _ = _run(["inspect", str(build)], capsys)
    assert status == 0
    lines = out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("TP reduction:")]
    assert lines[at].startswith("TP reduction: 4 norm(s) in 2 group(s) are split with a "
                                "projection's output and all-reduced over the TP group")
    assert lines[at + 1].startswith("  layers.{0..1}.attention (2 groups): ")
    assert _expanded(lines[at + 1]) == whole
    status, out, _ = _run(["inspect", str(build), "--target", "model.layers.0.*",
                           "--format", "json"], capsys)
    rows = json.loads(out)["tensors"]
    assert status == 0 and len(rows) > 8
    assert {r["target"] for r in rows if r["needs_tp_reduction"]} == {
        n for n in whole if n.startswith("model.layers.0.")}
    status, out, _ = _run(["inspect", str(build), "--target", "*q_norm*"], capsys)
    assert [line.split()[5:8] for line in out.splitlines()[1:5]] == [
        ["rows", "0:32", "(TP"], ["rows", "32:64", "(TP"], ["rows", "0:32", "(TP"],
        ["rows", "32:64", "(TP"]]
    assert _run(["report", str(build), "--out", str(build.parent / "r.html")], capsys)[0] == 0
    html = (build.parent / "r.html").read_text()
    rows_html = re.findall(r'<tr class="reduction"><td>([^<]*)</td><td>([^<]*)</td>', html)
    assert {n for _, names in rows_html for n in names.split(", ")} == whole
    assert [g for g, _ in rows_html] == ["layers.0.attention", "layers.1.attention"]


def test_a_build_without_split_norms_shows_no_tp_reduction(tmp_path, capsys):
    out = tmp_path / "q"
    status, text, _ = _run(["compile", "--config", str(hf("qwen3") / "config.json"), "--tp", "2",
                            "--out", str(out)], capsys)
    assert status == 0 and "TP reduction" not in text
    assert "TP reduction" not in _run(["inspect", str(out)], capsys)[1]
    assert _run(["report", str(out), "--out", str(tmp_path / "r.html")], capsys)[0] == 0
    assert 'id="reductions"' not in (tmp_path / "r.html").read_text()


def test_the_compile_summary_names_the_norms_to_all_reduce(olmo2_build, tmp_path, capsys):
    build, whole = olmo2_build
    status, out, _ = _run(["compile", "--config", str(build.parent / "config" / "config.json"),
                           "--tp", "2", "--out", str(tmp_path / "again")], capsys)
    assert status == 0
    lines = out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("TP reduction: 4 norm(s)")]
    assert _expanded(lines[at + 1]) == whole


def _expanded(line: str) -> set[str]:
    """The tensors of one summary line whose groups differ only in their layer number
    (`layers.{0..1}.attention (2 groups): model.layers.{}.x, ...`), one name per layer."""
    first, last = map(int, re.search(r"\{(\d+)\.\.(\d+)\}", line).groups())
    names = line.split(": ", 1)[1].split(", ")
    return {n.replace("{}", str(layer)) for n in names for layer in range(first, last + 1)}


@pytest.mark.parametrize(("option", "glob", "hint"), [
    ("--group", "model.layers.0.*", "it matches checkpoint tensor names: use --target"),
    ("--target", "layers.0.*", "it matches groups: use --group"),
    ("--group", "layers.0.atention", "did you mean 'layers.0.attention'"),
    ("--target", "nothing-like-it", "it has 25, e.g. 'lm_head.weight', "),
])
def test_a_glob_that_matches_nothing_is_an_error_with_a_hint(olmo2_build, capsys, option, glob,
                                                              hint):
    build, _ = olmo2_build
    status, out, err = _run(["inspect", str(build), option, glob], capsys)
    kind = "group" if option == "--group" else "checkpoint tensor"
    assert status == 1 and out == ""
    assert err.startswith(f"error: {build / 'plan.json'}: {option} {glob!r} matches no {kind} "
                          f"of this build; "), err
    assert hint in err.splitlines()[0]


def test_inspect_finds_a_family_file_beside_the_build_by_its_name_and_sha256(tmp_path, capsys,
                                                                            monkeypatch):
    """plan.json names a user's family file by its file name and sha256: inspect, explain and
    report find it in the working directory or beside the build without --family, and refuse
    a file of that name whose bytes changed."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    family = work / "my_llama.yaml"
    assert main(["families", "--copy", "llama", str(family)]) == 0
    assert main(["compile", str(family), "--config", str(LLAMA / "config.json"), "--tp", "2",
                 "--out", str(work / "b"), "-q"]) == 0
    capsys.readouterr()
    target = "model.layers.1.mlp.down_proj.weight"
    lines = family.read_text().splitlines()
    for where in (elsewhere, work):  # beside the build, then the working directory
        monkeypatch.chdir(where)
        status, out, _ = _run(["inspect", str(work / "b"), "--target", target, "--format",
                               "json"], capsys)
        rows = json.loads(out)["tensors"]
        assert status == 0 and len(rows) == 2
        file, line = rows[0]["origin"].rsplit(":", 1)
        assert Path(file).resolve() == family.resolve()
        assert lines[int(line) - 1].strip() == '- module: "model.layers.{unit}.mlp.down_proj"'
        status, out, _ = _run(["explain", str(work / "b"), target], capsys)
        assert status == 0 and f"declared at {rows[0]['origin']}" in out
    family.write_text(family.read_text() + "# edited after the build\n")
    status, out, _ = _run(["inspect", str(work / "b"), "--target", target, "--format", "json"],
                          capsys)
    found = json.loads(out)
    assert status == 0 and {r["origin"] for r in found["tensors"]} == {None}
    assert "no file of that name and sha256" in found["origin_note"]



def test_summary_lines_collapse_groups_that_differ_only_in_their_layer():
    from partc.inspect.text import fallback_lines

    kv = [{"group": f"layers.{n}.attention", "kv_replicas": 2, "tensors": ["k", "v"]}
          for n in (0, 1, 2, 3, 5, 7, 8)]
    kv.append({"group": "layers.4.attention", "kv_replicas": 4, "tensors": ["k", "v"]})
    kv.append({"group": "vision.attention", "kv_replicas": 2, "tensors": ["k"]})
    lines = fallback_lines([], kv)
    assert lines == [
        "KV replication: 9 group(s) repeat KV heads across ranks",
        "  layers.{0..3,5,7..8}.attention (7 groups): each KV head on 2 ranks (2 tensors each)",
        "  layers.4.attention: each KV head on 4 ranks (2 tensors)",
        "  vision.attention: each KV head on 2 ranks (1 tensor)",
    ]
    fallbacks = [{"group": f"layers.{n}.mlp", "role": "mlp", "bytes": 10, "extra_bytes": 20,
                  "stages": [n // 2]} for n in range(4)]
    assert fallback_lines(fallbacks, [])[1] == \
        "  layers.{0..3}.mlp (4 groups) (mlp): 40 B on every rank of stage(s) 0,1, +80 B"
