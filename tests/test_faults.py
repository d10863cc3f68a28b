"""The table of known mistakes and faults: each gives its one clear message, never a traceback,
never a half-written build."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from regenerate_cases import case_errors, case_folders, expected_errors, toml_spelling

from partc.api import CompileOptions, compile_family, plan_family
from partc.cli.commands import docs_folder
from partc.errors import CheckpointError
from partc.front.load import load_document
from partc.plan.ir import canonical_json
from partc.plan.topology import Topology

from support import ROOT, checkpoint_tensors, hf, import_build

sys.path.insert(0, str(ROOT / "scripts"))
import fault_table  # noqa: E402

CONFIG = hf("llama") / "config.json"


# ---------------------------------------------------------------- the case table

ERROR_CASES = [p for p in case_folders() if expected_errors(p)]


def test_the_case_table_holds_at_least_25_known_mistakes():
    assert len(ERROR_CASES) >= 25


@pytest.mark.parametrize("case", case_folders(), ids=lambda p: p.name)
def test_each_case_gives_exactly_its_expected_error_lines(case):
    assert case_errors(case) == expected_errors(case)


def _plan_without_provenance(family: str | Path, config: Path, topology: Topology) -> str:
    data = plan_family(family, config, topology).to_json()
    data.pop("sources")
    data.pop("plan_hash")
    return canonical_json(data)


def test_the_toml_twin_of_llama_yaml_compiles_to_the_same_plan():
    twin = ROOT / "tests" / "cases" / "llama_toml_twin" / "family.toml"
    topology = Topology(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert _plan_without_provenance(twin, CONFIG, topology) == _plan_without_provenance(
        ROOT / "architectures" / "llama.yaml", CONFIG, topology), (
        "the TOML twin drifted from architectures/llama.yaml: run "
        "python tests/regenerate_cases.py --toml-twin")


def _fixture_configs() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for config in sorted((ROOT / "tests" / "fixtures" / "hf").glob("*/config.json")):
        model_type = json.loads(config.read_text()).get("model_type")
        found.setdefault(model_type, config)
    return found


@pytest.mark.parametrize("family", sorted((ROOT / "architectures").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_built_in_family_spelled_in_toml_compiles_to_the_same_plan(family, tmp_path):
    data = load_document(family).data
    configs = _fixture_configs()
    config = next((configs[t] for t in data["model_types"] if t in configs), None)
    assert config is not None, f"every built-in family has a fixture; {family.name} has none"
    twin = tmp_path / f"{family.stem}.toml"
    twin.write_text(toml_spelling(data))
    assert load_document(twin).data == data
    topology = Topology(tensor_parallel_size=1, pipeline_parallel_size=1)
    assert _plan_without_provenance(twin, config, topology) == _plan_without_provenance(
        family, config, topology)


# ---------------------------------------------------------------- the fault table


@pytest.fixture(scope="module")
def outcomes() -> dict[str, fault_table.Outcome]:
    return {f"{o.fault.area}/{o.fault.name}": o for o in fault_table.run_all()}


def test_docs_faults_md_is_the_current_fault_table(outcomes):
    text = fault_table.render(list(outcomes.values()))
    assert fault_table.DOC.read_text() == text, "run python scripts/fault_table.py"


def test_every_fault_is_a_located_partc_error_without_traceback_or_damage(outcomes):
    failed = [name for name, outcome in outcomes.items() if not fault_table.passed(outcome)]
    assert failed == []
    assert len(outcomes) >= 100


@pytest.mark.parametrize(("fault", "message", "loader"), [
    ("shorter_than_8_bytes",
     "ckpt/model.safetensors: truncated file: 5 bytes, expected at least 8 for the header length",
     "CheckpointError: ckpt/model.safetensors: truncated file: 5 bytes, expected at least 8 "
     "for the header length"),
    ("truncated_payload",
     "ckpt/model.safetensors (tensor model.layers.2.self_attn.v_proj.weight): data offsets "
     "beyond the file (truncated file?): tensor ends at data byte 510976, the data region holds "
     "510232 bytes",
     "CheckpointError: ckpt/model.safetensors (tensor model.layers.2.self_attn.v_proj.weight): "
     "data offsets beyond the file (truncated file?): tensor ends at data byte 510976, the data "
     "region holds 510232 bytes"),
    ("header_length_beyond_file",
     "ckpt/model.safetensors: header length 512232 beyond the file of size 511242", None),
    ("malformed_header_json",
     "ckpt/model.safetensors: header is not valid JSON: Expecting property name enclosed in "
     "double quotes at line 1 column 2", None),
    ("overlapping_offsets",
     "ckpt/model.safetensors: tensor byte ranges overlap: "
     "'model.layers.2.post_attention_layernorm.weight' spans [510976, 511232) and "
     "'model.norm.weight' spans [510976, 511232); expected disjoint ranges", None),
    ("offsets_out_of_file",
     "ckpt/model.safetensors (tensor model.norm.weight): data offsets beyond the file "
     "(truncated file?): tensor ends at data byte 1000000256, the data region holds 511232 "
     "bytes", None),
    ("byte_size_mismatch",
     "ckpt/model.safetensors (tensor model.norm.weight): dtype/shape byte-size mismatch: F32 "
     "[32] needs 128 bytes, data_offsets [510976, 511232] span 256",
     "CheckpointError: ckpt/model.safetensors (tensor model.norm.weight): dtype/shape "
     "byte-size mismatch: F32 [32] needs 128 bytes, data_offsets [510976, 511232] span 256"),
    ("missing_shard_file",
     "ckpt/model.safetensors.index.json: missing shard file model-00003-of-00004.safetensors "
     "named by the index", None),
    ("tensor_in_two_shards",
     "ckpt/model-00004-of-00004.safetensors: tensor "
     "'model.embed_tokens.weight' is in two shards: model-00001-of-00004.safetensors and "
     "model-00004-of-00004.safetensors; expected exactly one", None),
    ("wrong_dtype",
     "ckpt/model.safetensors: tensor `model.norm.weight` is F16 in the checkpoint; the family "
     "declares F32 (group `final_norm`, declared at architectures/llama.yaml:110:5)",
     "CheckpointError: ckpt/model.safetensors: tensor `model.norm.weight` has dtype F16 in the "
     "checkpoint; the plan expects F32"),
    ("wrong_shape",
     "ckpt/model.safetensors: tensor `model.norm.weight` has shape [8, 8] in the checkpoint; "
     "the family declares [64] (group `final_norm`, declared at architectures/llama.yaml:110:5)",
     "CheckpointError: ckpt/model.safetensors: tensor `model.norm.weight` has shape [8, 8] in "
     "the checkpoint; the plan expects [64]"),
    ("missing_tensor",
     "architectures/llama.yaml:110:5: the family declares tensor `model.norm.weight`, which "
     "the checkpoint does not have (group `final_norm`); did you mean `model.norm.weights`? "
     "[at /parameters/5]",
     "CheckpointError: ckpt: tensor `model.norm.weight` of the plan is not in the checkpoint; "
     "the checkpoint holds 1 tensor the plan does not know (`model.norm.weights`); this build "
     "was compiled without --checkpoint, so its plan has only the tensors the config implies: "
     "compile with --checkpoint ckpt to plan for the tensors this checkpoint holds"),
])
def test_checkpoint_faults_are_caught_from_the_header_by_check_and_by_load(outcomes, fault,
                                                                         message, loader):
    outcome = outcomes[f"checkpoint/{fault}"]
    assert (outcome.exit_status, outcome.message) == (1, message)
    assert outcome.loader is not None and outcome.loader.startswith("CheckpointError: ")
    if loader is not None:
        assert outcome.loader == loader


# ---------------------------------------------------------------- fingerprints


def test_a_fingerprinted_build_refuses_a_different_header_unless_told_otherwise(tmp_path):
    monkey_cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        fault_table._fingerprinted_build(tmp_path)
        plan = compile_family("llama", "config.json", Topology(tensor_parallel_size=2),
                              CompileOptions(checkpoint="ckpt", out="fingerprinted")).plan
        package = import_build(tmp_path / "fingerprinted", plan)
        with pytest.raises(CheckpointError) as caught:
            package.load("other", rank=1)
        assert caught.value.message.startswith("checkpoint header fingerprint ")
        assert caught.value.message.endswith(
            "; recompile against this checkpoint or pass verify_fingerprint=False")
        state = package.load("other", rank=1, verify_fingerprint=False)
        same = package.load("ckpt", rank=1)
    finally:
        os.chdir(monkey_cwd)
    assert state.tensors.keys() == same.tensors.keys()
    for name, array in state.tensors.items():
        np.testing.assert_array_equal(array, same.tensors[name])
    full = checkpoint_tensors(hf("llama"))
    np.testing.assert_array_equal(state.tensors["model.norm.weight"], full["model.norm.weight"])


@pytest.mark.parametrize("other", ["gpt2", "qwen3", "llama_tied"])
def test_another_models_checkpoint_is_refused_by_its_tensors_not_by_the_fingerprint(
        tmp_path, capsys, other):
    """Names or shapes that differ are what is wrong (skipping the fingerprint cannot help):
    the errors are exactly the plan tensors the other checkpoint lacks or holds in another
    shape (read with safetensors), by load() and by partc shard alike."""
    from safetensors import safe_open

    from partc.cli.main import main
    from partc.errors import PartcErrors

    plan = compile_family("llama", CONFIG, Topology(tensor_parallel_size=2),
                          CompileOptions(checkpoint=hf("llama"), out=tmp_path / "build")).plan
    assert plan.checkpoint_fingerprint is not None
    package = import_build(tmp_path / "build", plan)
    with safe_open(str(hf(other) / "model.safetensors"), "numpy") as handle:
        shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    for rank in plan.ranks:
        wrong = {t.target for t in rank.layout.tensors
                 if shapes.get(t.target) != list(t.global_shape)}
        assert wrong
        with pytest.raises((CheckpointError, PartcErrors)) as caught:
            package.load(hf(other), rank=rank.rank)
        errors = caught.value.errors if isinstance(caught.value, PartcErrors) else [caught.value]
        assert {e.tensor for e in errors} == wrong
        assert "fingerprint" not in str(caught.value)
    everywhere = {t.target for rank in plan.ranks for t in rank.layout.tensors
                  if shapes.get(t.target) != list(t.global_shape)}
    assert main(["shard", str(tmp_path / "build"), "--checkpoint", str(hf(other)), "--out",
                 str(tmp_path / "shards"), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {e["tensor"] for e in report["errors"]} == everywhere
    assert not (tmp_path / "shards").exists()


def _with_extra_tensor(source: Path, folder: Path, name: str) -> Path:
    """A copy of `source` whose model.safetensors gains one tensor `name` (with safetensors)."""
    from safetensors.numpy import load_file, save_file

    folder.mkdir()
    (folder / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    tensors[name] = np.ones(16, np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("other", ["extra", "qwen3", "mistral"])
def test_a_build_compiled_without_a_checkpoint_refuses_one_of_other_tensor_names_on_every_rank(
        tmp_path, capsys, other):
    """A Qwen3 checkpoint (its q_norm/k_norm), a 2-layer Mistral, or the Llama with one extra
    tensor all match every tensor of some ranks of a 3-layer Llama build: without the plan-wide
    names check those ranks loaded them and the model ran without the tensors no rank owns."""
    from safetensors import safe_open

    from partc.cli.main import main
    from partc.errors import PartcErrors

    checkpoint = (_with_extra_tensor(hf("llama"), tmp_path / "extra",
                                     "model.layers.0.self_attn.q_norm.weight")
                  if other == "extra" else hf(other))
    plan = compile_family("llama", CONFIG,
                          Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                          CompileOptions(out=tmp_path / "build")).plan
    assert plan.checkpoint_fingerprint is None
    package = import_build(tmp_path / "build", plan)
    with safe_open(str(checkpoint / "model.safetensors"), "numpy") as handle:
        names = set(handle.keys())
    owned = {t.target for t in plan.tensors}
    assert names != owned
    matching = [rank for rank in plan.ranks  # ranks whose own tensors all match the header
                if {t.target for t in rank.layout.tensors} <= names]
    assert matching, "the case must be one a rank's own check alone lets through"
    for rank in plan.ranks:
        with pytest.raises((CheckpointError, PartcErrors)) as caught:
            package.load(checkpoint, rank=rank.rank)
        if rank in matching:
            assert "the checkpoint is not the one this build's plan describes" in str(
                caught.value)
            # each side named (not only counted), and the way to a plan of this checkpoint
            lacking, extra = sorted(owned - names), sorted(names - owned)
            message = str(caught.value)
            assert all(f"`{n}`" in message for n in (lacking[:3] + extra[:3])), message
            assert (f"lacks {len(lacking)} tensor" in message) == bool(lacking)
            assert (f"holds {len(extra)} tensor" in message) == bool(extra)
            assert "compiled without --checkpoint" in message
    state = package.load(checkpoint, rank=matching[0].rank, verify_fingerprint=False)
    assert set(state.tensors) == {t.target for t in matching[0].layout.tensors}
    assert package.load(hf("llama"), rank=matching[0].rank).tensors.keys() == state.tensors.keys()
    if other == "extra":  # partc shard names the tensor no rank loads, and writes nothing
        assert main(["shard", str(tmp_path / "build"), "--checkpoint", str(checkpoint),
                     "--out", str(tmp_path / "shards"), "--format", "json"]) == 1
        (error,) = json.loads(capsys.readouterr().out)["errors"]
        assert error["tensor"] == "model.layers.0.self_attn.q_norm.weight"
        assert "1 tensor(s) no rank of the plan loads" in error["message"]
        assert not (tmp_path / "shards").exists()


def test_the_familys_omit_globs_are_left_out_of_the_names_check(tmp_path):
    """GPT-2's `omit` globs (attention buffers older checkpoints hold): a checkpoint with such
    a tensor loads under a build compiled without it, and the plan records the globs."""
    checkpoint = _with_extra_tensor(hf("gpt2"), tmp_path / "buffers", "transformer.h.0.attn.bias")
    plan = compile_family("gpt2", hf("gpt2") / "config.json", Topology(tensor_parallel_size=2),
                          CompileOptions(out=tmp_path / "build")).plan
    assert plan.omit and json.loads((tmp_path / "build" / "plan.json").read_text())["omit"]
    package = import_build(tmp_path / "build", plan)
    full = checkpoint_tensors(hf("gpt2"))
    state = package.load(checkpoint, rank=0)
    np.testing.assert_array_equal(state.tensors["transformer.ln_f.weight"],
                                  full["transformer.ln_f.weight"])


# ---------------------------------------------------------------- killed compiles


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory) -> tuple[dict[str, bytes], dict[str, bytes]]:
    base = tmp_path_factory.mktemp("builds")
    compile_family("llama", CONFIG, Topology(tensor_parallel_size=2),
                   CompileOptions(out=base / "old"))
    compile_family("llama", CONFIG, Topology(pipeline_parallel_size=3),
                   CompileOptions(out=base / "new"))
    return _tree(base / "old"), _tree(base / "new")


KILL_AT = """
import os, signal, partc.output as output
target, when = {target!r}, {when}
count = [0]
def dying(real):
    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] == when:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return wrapper
if target == "exchange":
    output._exchange = dying(output._exchange)
elif target == "remove":  # the removal of the old build, after the swap
    output._remove_written = dying(output._remove_written)
else:
    setattr(os, target, dying(getattr(os, target)))
from partc.api import CompileOptions, compile_family
from partc.plan.topology import Topology
compile_family("llama", {config!r}, Topology(pipeline_parallel_size=3), CompileOptions(out={out!r}))
"""


@pytest.mark.parametrize(("target", "when", "expect"), [
    ("fsync", 1, "old"), ("fsync", 5, "old"), ("exchange", 1, "old"), ("remove", 1, "new"),
])
def test_a_compile_killed_at_each_step_of_the_write_leaves_a_whole_build(
        tmp_path, two_builds, target, when, expect):
    old, new = two_builds
    out = tmp_path / "build"
    compile_family("llama", CONFIG, Topology(tensor_parallel_size=2), CompileOptions(out=out))
    script = KILL_AT.format(target=target, when=when, config=str(CONFIG), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert _tree(out) == (old if expect == "old" else new)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "build"]
    assert all(name.startswith(".build.") for name in leftovers)


LOOP = """
from partc.api import CompileOptions, compile_family
from partc.plan.topology import Topology
while True:
    for options in ({{"tensor_parallel_size": 2}}, {{"pipeline_parallel_size": 3}}):
        compile_family("llama", {config!r}, Topology(**options), CompileOptions(out={out!r}))
"""


def test_compiles_killed_at_random_moments_always_leave_the_old_or_the_new_build(
        tmp_path, two_builds):
    old, new = two_builds
    out = tmp_path / "build"
    compile_family("llama", CONFIG, Topology(tensor_parallel_size=2), CompileOptions(out=out))
    chance = random.Random(7)
    seen = set()
    for _ in range(int(os.environ.get("PARTC_KILL_ROUNDS", "3"))):
        process = subprocess.Popen([sys.executable, "-c", LOOP.format(config=str(CONFIG),
                                                                      out=str(out))], cwd=ROOT)
        time.sleep(chance.uniform(0.6, 1.6))
        process.send_signal(signal.SIGKILL)
        process.wait()
        tree = _tree(out)
        assert tree in (old, new)
        seen.add("old" if tree == old else "new")
    assert seen


# ---------------------------------------------------------------- the command line


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    from partc.cli.main import main

    status = main(args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_cli_prints_every_error_of_a_document_sorted_then_a_count(tmp_path, capsys,
                                                                       monkeypatch):
    family = tmp_path / "bad.yaml"
    family.write_text((ROOT / "tests" / "cases" / "unknown_key" / "family.yaml").read_text()
                      .replace("role: vocabulary", "role: vocab")
                      .replace("model_types: [mini]", "model_types: mini"))
    monkeypatch.chdir(tmp_path)
    status, out, err = _cli(["check", "bad.yaml"], capsys)
    lines = err.splitlines()
    assert status == 1 and out == ""
    # each error line is followed by its source line, a caret (tests/test_cli.py) and the
    # guide of the schema (tests/test_doc_links.py)
    assert lines[3::4][:3] == [f"    see: {docs_folder() / 'authoring.md'}"] * 3
    lines = [line for line in lines if not line.startswith("    see: ")]
    assert [line.split(": ")[0] for line in lines[::3]] == ["error", "error", "error", "partc"]
    assert lines[0].startswith("error: bad.yaml:2:14: expected a list")
    assert lines[1:3] == ["    model_types: mini", "    " + " " * 13 + "^"]
    assert lines[3].startswith("error: bad.yaml:13:11: expected one of")
    assert lines[6].startswith("error: bad.yaml:14:5: unexpected key `shards`")
    assert lines[9] == "partc: 3 error(s)"


@pytest.mark.parametrize(("args", "kind", "where"), [
    (["check", "family.toml"], "LoadError", ("family.toml", 2, 1)),
    (["compile", "llama", "--config", "config.json", "--out", "b"], "LoadError",
     ("config.json", 1, 24)),
    (["check", "llama", "--config", str(CONFIG), "--checkpoint", "ckpt"], "CheckpointError",
     ("ckpt/model.safetensors", None, None)),
])
def test_json_reports_are_machine_readable_on_every_path(tmp_path, capsys, monkeypatch, args,
                                                         kind, where):
    (tmp_path / "family.toml").write_text('family = "x"\nfamily = "y"\n')
    (tmp_path / "config.json").write_text('{"model_type": "llama",}')
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    monkeypatch.chdir(tmp_path)
    status, out, err = _cli([*args, "--format", "json"], capsys)
    report = json.loads(out)
    assert status == 1 and err == ""
    assert report["ok"] is False
    (first, *_) = report["errors"]
    assert first["kind"] == kind
    assert (first["file"], first["line"], first["column"]) == where
    assert set(first) == {"stage", "kind", "file", "line", "column", "pointer", "tensor",
                          "message", "doc", "see"}


def test_an_exception_that_is_not_a_partc_error_is_a_one_line_internal_error(
        capsys, monkeypatch):
    import partc.api

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(partc.api, "check_family", broken)
    monkeypatch.delenv("PARTC_TRACEBACK", raising=False)
    status, out, err = _cli(["check", "llama"], capsys)
    assert status == 70
    assert err.splitlines() == [
        "partc: internal error (a bug in partc, please report it): RuntimeError: boom",
        "partc: set PARTC_TRACEBACK=1 to print the traceback"]
    status, out, _ = _cli(["check", "llama", "--format", "json"], capsys)
    assert status == 70 and json.loads(out)["errors"][0]["stage"] == "internal"


@pytest.mark.parametrize(("shape", "offsets", "message"), [
    ("[" + "9" * 5000 + "]", "[0, 4]",
     "header holds a number too long to read (more than 4300 digits)"),
    ("[" + "9" * 4000 + ", " + "9" * 4000 + "]", "[0, 4]",
     "shape must have at most 64 dimensions, each below 2**64 (found a dimension of 13288 "
     "bits)"),
    ("[1]", "[0, " + "9" * 4000 + "]", "data_offsets must be below 2**64 (u64 byte offsets)"),
])
def test_header_numbers_too_large_for_u64_are_refused_before_any_arithmetic(tmp_path, shape,
                                                                             offsets, message):
    from partc.runtime.checkpoint import open_checkpoint

    header = ('{"a": {"dtype": "F32", "shape": ' + shape + ', "data_offsets": ' + offsets
              + "}}").encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(path)
    assert caught.value.message == message


@pytest.mark.parametrize(("args", "message"), [
    (["check", "llama", "--tp", "2"], "partc check: error: --checkpoint, --tp, --pp, "
     "--pp-layers and --policy check a binding: pass --config (or a checkpoint folder holding "
     "config.json, or a checkpoint file with config.json beside it)"),
    (["check", "llama", "--tp", "5000"], "partc check: error: argument --tp: expected at most "
     "1024, found 5000"),
    (["compile", "llama", "--config", "c.json", "--out", "b", "--tp", "1000", "--pp", "1000"],
     "partc compile: error: --tp x --pp is 1000000; partc builds at most 4096 ranks"),
])
def test_command_lines_that_cannot_mean_anything_are_usage_errors(capsys, args, message):
    from partc.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-2] == message
    assert lines[-1].startswith("    see: ") and "cli.md" in lines[-1], "the command-line guide"


def test_a_checkpoint_folder_with_its_config_needs_no_config_flag(capsys):
    status, out, _ = _cli(["check", "llama", "--checkpoint", str(hf("llama")), "--tp", "2"],
                          capsys)
    assert status == 0
    assert out.splitlines()[0] == "ok: family, config binding, checkpoint, topology checked"
