"""Doc links in errors: every guide an error points to ships in the wheel, and the command line
prints `see: PATH[:LINE]` of the installed guide under the errors that have one."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from partc import errors
from partc.cli.commands import doc_reference, doc_sections, docs_folder, heading_anchor
from partc.cli.main import main

from support import ROOT, hf

BUILD_WHEEL = ("from setuptools import build_meta; import sys; "
               "print(build_meta.build_wheel(sys.argv[1]))")
WHEEL_INPUTS = ["pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "compiler", "schemas",
                "architectures", "docs"]


def _source_topics() -> dict[str, list[str]]:
    """Every doc topic written in partc's source: `doc_topic = "..."` class attributes and
    `doc="..."` arguments (both branches of a conditional), with where each is written."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "compiler" / "partc").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            values: list[ast.expr] = []
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "doc_topic" for t in node.targets):
                values.append(node.value)
            elif isinstance(node, ast.keyword) and node.arg == "doc":
                values.append(node.value)
            for value in values:
                options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
                for option in options:
                    if isinstance(option, ast.Constant) and isinstance(option.value, str):
                        where = f"{path.relative_to(ROOT)}:{option.lineno}"
                        found.setdefault(option.value, []).append(where)
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this tree, built by setuptools from a copy (the tree is left as it is)."""
    tree = tmp_path_factory.mktemp("tree")
    for name in WHEEL_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, tree / name)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-c", BUILD_WHEEL, str(out)], cwd=tree,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel unpacked as pip would install it (a site folder holding `partc/`)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def test_the_source_names_doc_topics_and_every_error_class_default_is_among_them():
    topics = _source_topics()
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.PartcError)]
    defaults = {c.doc_topic for c in classes if c.doc_topic is not None}
    assert defaults <= set(topics)
    # the rules the guides explain: KV replication, policy, boundaries, formats, output, faults
    pages = {t.partition("#")[0] for t in topics}
    assert {"kv_replication", "policy", "boundaries", "linear_formats", "output", "authoring",
            "faults"} <= pages


def test_every_topic_an_error_refers_to_is_a_page_and_section_of_the_installed_wheel(
        wheel, installed):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for topic, where in sorted(_source_topics().items()):
        page, _, section = topic.partition("#")
        member = f"partc/docs/{page}.md"
        if member not in names:
            missing.append(f"{topic} ({', '.join(where)}): {member} is not in the wheel")
        elif section and section not in doc_sections(installed / member):
            missing.append(f"{topic} ({', '.join(where)}): no such heading in {member}")
    assert missing == []


def test_the_anchor_check_can_fail_on_a_page_without_that_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```sh\n# not a heading\n```\n\n## 3. Two words (vLLM's)\n")
    assert doc_sections(page) == {"title": 1, "3-two-words-vllms": 7}
    assert heading_anchor("## `fused: {layout: ...}`: row order") == "fused-layout--row-order"


def test_an_installed_wheel_prints_a_see_line_into_its_own_docs(installed, tmp_path):
    """The CLI run from the unpacked wheel (not the repository) points into the wheel."""
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}
    script = ("import sys, partc; print(partc.__file__, file=sys.stderr); "
              "from partc.cli.main import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, "check", "--config",
                           str(hf("olmo2") / "config.json"), "--tp", "3"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    first, *rest = done.stderr.splitlines()
    assert Path(first).is_relative_to(installed)  # the wheel's partc, not the repository's
    see = [line.strip().removeprefix("see: ") for line in rest if line.strip().startswith("see:")]
    assert see == [str(installed / "partc" / "docs" / "policy.md")]
    assert Path(see[0]).read_text().startswith("# Sharding policy")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _see_lines(err: str) -> list[str]:
    return [line.strip().removeprefix("see: ") for line in err.splitlines()
            if line.strip().startswith("see: ")]


def test_a_group_the_topology_cannot_split_points_to_the_policy_guide(capsys):
    # OLMo-2: no KV replication (Llama's would point to its rule instead)
    status, _, err = _run(["check", "--config", str(hf("olmo2") / "config.json"), "--tp", "3"],
                          capsys)
    assert status == 1
    assert "cannot be sharded over tensor_parallel_size 3" in err
    assert _see_lines(err) == [str(docs_folder() / "policy.md")]
    assert "## `require` and `replicate_unsupported`" in (docs_folder() / "policy.md").read_text()


def test_a_kv_replication_group_points_to_the_rule_section_and_json_carries_it(capsys):
    argv = ["check", str(ROOT / "tests" / "cases" / "qwen3" / "family.yaml"), "--config",
            str(hf("qwen3") / "config.json"), "--tp", "3"]
    status, _, err = _run(argv, capsys)
    assert status == 1 and "so KV replication applies" in err
    path = docs_folder() / "kv_replication.md"
    line = path.read_text().split("\n").index("## The rule (vLLM's)") + 1
    assert _see_lines(err) == [f"{path}:{line}"]
    status, out, _ = _run([*argv, "--format", "json"], capsys)
    (error,) = json.loads(out)["errors"]
    assert status == 1 and error["kind"] == "ParallelPlanError"
    assert error["doc"] == "kv_replication#the-rule-vllms"
    assert error["see"] == f"{path}:{line}"


def test_an_output_folder_partc_did_not_write_points_to_the_output_guide(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    status, _, err = _run(["compile", "--config", str(hf("llama") / "config.json"), "--out",
                           str(out)], capsys)
    assert status == 1 and "was not written by partc" in err
    assert _see_lines(err) == [str(docs_folder() / "output.md")]
    assert (out / "mine.txt").read_text() == "keep"


def test_a_bad_expression_points_to_the_expression_language_section(tmp_path, capsys):
    family = tmp_path / "family.yaml"
    text = (ROOT / "architectures" / "llama.yaml").read_text()
    assert "hidden_size // num_attention_heads" in text
    family.write_text(text.replace("hidden_size // num_attention_heads",
                                   "hidden_size / num_attention_heads", 1))
    status, _, err = _run(["check", str(family)], capsys)
    assert status == 1 and "use `//` for integer (floor) division" in err
    path = docs_folder() / "authoring.md"
    line = path.read_text().split("\n").index("## 2. Header, config fields, graph") + 1
    assert _see_lines(err) == [f"{path}:{line}"]
    assert "safe language" in path.read_text().split("\n## 3.")[0]


def test_an_error_without_a_guide_prints_no_see_line_and_json_says_null(tmp_path, capsys):
    status, out, _ = _run(["check", str(tmp_path / "absent.yaml"), "--format", "json"], capsys)
    (error,) = json.loads(out)["errors"]
    assert status == 1 and error["kind"] == "LoadError"
    assert error["doc"] is None and error["see"] is None


def test_docs_names_a_section_by_path_and_line_and_lists_every_topic(capsys):
    status, out, _ = _run(["docs", "policy#require-and-replicate_unsupported", "--path"],
                          capsys)
    path, line = out.strip().rsplit(":", 1)
    assert status == 0
    assert Path(path).read_text().split("\n")[int(line) - 1] == (
        "## `require` and `replicate_unsupported`")
    status, _, err = _run(["docs", "policy#nope"], capsys)
    assert status == 1 and "no section 'nope'" in err and "require-and-replicate_unsupported" in err
    status, out, _ = _run(["docs", "--list"], capsys)
    assert status == 0
    listed = out.split()
    assert {"policy", "output", "boundaries", "kv_replication#the-rule-vllms"} <= set(listed)
    assert doc_reference("boundaries").endswith("boundaries.md")
    notes = sorted(p.stem for p in (ROOT / "docs" / "families").glob("*.md"))
    assert notes and {f"families/{n}" for n in notes} <= set(listed)  # the family notes too
    status, out, _ = _run(["docs", "families/llama", "--path"], capsys)
    assert status == 0 and Path(out.strip()).read_text().startswith("# ")
    assert Path(out.strip()).name == "llama.md" and Path(out.strip()).parent.name == "families"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_readme_and_the_guides_leads_to_a_file_and_heading():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in doc_sections(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_a_json_usage_error_points_to_the_command_line_guide(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--format", "json", "--tp", "0", "--out", "x", "--config", "c.json"])
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert exit_.value.code == 2 and error["kind"] == "usage"
    assert error["doc"] == "cli#partc-compile"
    path, line = error["see"].rsplit(":", 1)
    assert path == str(docs_folder() / "cli.md")
    heading = (docs_folder() / "cli.md").read_text().splitlines()[int(line) - 1]
    assert heading.startswith("#") and "partc compile" in heading


def test_a_text_usage_error_ends_with_the_commands_section_of_the_guide(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["shard", "build-folder"])  # --checkpoint and --out missing
    err = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert err[-2] == "partc shard: error: the following arguments are required: " \
        "--checkpoint, --out"
    assert err[-1].startswith("    see: " + str(docs_folder() / "cli.md") + ":")
    line = int(err[-1].rsplit(":", 1)[1])
    heading = (docs_folder() / "cli.md").read_text().splitlines()[line - 1]
    assert heading.startswith("#") and "partc shard" in heading
    with pytest.raises(SystemExit):
        main([])  # no command: the guide itself
    assert capsys.readouterr().err.splitlines()[-1] == "    see: " + str(docs_folder() / "cli.md")


def _heading_line(page: str, heading: str) -> int:
    return (docs_folder() / f"{page}.md").read_text().splitlines().index(heading) + 1


@pytest.mark.parametrize(("argv", "page", "heading"), [
    # a stage layout the model cannot take: how units become stages
    (["--pp", "4"], "boundaries", "## Units and stages"),
    (["--pp", "2", "--pp-layers", "1,1"], "boundaries", "## Units and stages"),
    # expert parallelism asked of a dense family, or a bad expert topology: the EP guide
    (["--ep", "2"], "expert_parallel", "## The rank layout"),
    (["--etp", "2"], "expert_parallel", "## The rank layout"),
])
def test_a_topology_error_points_to_the_guide_section_that_explains_it(capsys, argv, page,
                                                                       heading):
    status, _, err = _run(["check", "--config", str(hf("llama") / "config.json"), *argv], capsys)
    assert status == 1, err
    assert _see_lines(err) == [f"{docs_folder() / page}.md:{_heading_line(page, heading)}"], err


def test_a_tensor_no_group_owns_points_to_the_parameter_groups_section(capsys, tmp_path):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "llama"
    shutil.copytree(hf("llama"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    status, _, err = _run(["check", "--config", str(folder / "config.json"), "--checkpoint",
                           str(folder)], capsys)
    assert status == 1 and "`model.extra.weight` is owned by no parameter group" in err, err
    line = _heading_line("authoring", "## 3. Parameter groups")
    assert _see_lines(err) == [f"{docs_folder() / 'authoring'}.md:{line}"], err


def test_authoring_s_extends_and_toml_examples_are_real(tmp_path, capsys):
    """The guide's `extends:` example checks and binds to a tied Llama config, and its TOML
    block is a verbatim excerpt of llama.yaml as TOML (tests/regenerate_cases.py's spelling,
    which compiles to the YAML's plan in tests/test_families.py)."""
    import yaml
    from regenerate_cases import toml_spelling

    text = (ROOT / "docs" / "authoring.md").read_text()
    blocks = re.findall(r"```(yaml|toml)\n(.*?)```", text, re.S)
    children = [b for lang, b in blocks if lang == "yaml" and "extends: llama" in b]
    assert len(children) == 2  # §7's cohere-like family and §9's patch
    for i, child in enumerate(children):
        family = tmp_path / f"child_{i}.yaml"
        family.write_text(child)
        status, _, err = _run(["check", str(family), "--config",
                               str(hf("llama_tied") / "config.json")], capsys)
        assert status == 0, err
    (toml,) = [b for lang, b in blocks if lang == "toml"]
    whole = toml_spelling(yaml.safe_load((ROOT / "architectures" / "llama.yaml").read_text()))
    lines = toml.strip("\n").split("\n")
    assert lines[0] in whole and "\n".join(lines[1:]) in whole
