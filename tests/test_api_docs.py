"""The API reference site: `mkdocs build --strict` renders docs/reference/ from the docstrings
(mkdocstrings) and the guides of docs/, warning-free; every keyword option of a build package's
`load()` is a documented parameter; a reference to an object partc lacks fails the build."""

from __future__ import annotations

import html
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from partc.runtime.loader import load_package_rank, load_rank

from support import ROOT

REFERENCE_PAGES = ("partc", "runtime", "package", "torch")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of `config` into `site`."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site of this tree, built strict from the repository's mkdocs.yml."""
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    return out


def _page(site: Path, name: str) -> str:
    return (site / "reference" / name / "index.html").read_text(encoding="utf-8")


def _text(markup: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", markup)))


def _parameters(page: str, function: str) -> dict[str, str]:
    """The rows of the "Parameters" table of `function`'s section: name -> description."""
    start = page.index(f'id="{function}"')
    section = page[start:page.index('<p><span class="doc-section-title">Returns:', start)]
    table = section[section.index('<span class="doc-section-title">Parameters:</span>'):]
    rows = re.findall(r'<tr class="doc-section-item">(.*?)</tr>', table, flags=re.S)
    found = {}
    for row in rows:
        cells = re.findall(r"<td>(.*?)</td>", row, flags=re.S)
        found[_text(cells[0]).strip()] = _text(cells[2]).strip()
    return found


def _options(function: object) -> list[str]:
    """The keyword names of a function's signature, `**kwargs` spelt as docstrings spell it."""
    names = []
    for parameter in inspect.signature(function).parameters.values():  # type: ignore[arg-type]
        star = "**" if parameter.kind is inspect.Parameter.VAR_KEYWORD else ""
        names.append(star + parameter.name)
    return names


def test_the_site_builds_strict_with_every_reference_page_and_guide(site):
    assert (site / "reference" / "index.html").is_file()
    for name in REFERENCE_PAGES:
        assert (site / "reference" / name / "index.html").is_file(), name
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert (site / guide.stem / "index.html").is_file(), guide.name


def test_every_option_of_a_packages_load_is_a_documented_parameter(site):
    page = _page(site, "package")
    documented = _parameters(page, "partc.runtime.loader.load_rank")
    assert list(documented) == _options(load_rank)
    assert len(documented) == 15  # table, checkpoint, 12 keyword options, **unknown
    for name, meaning in documented.items():
        assert len(meaning) > 20, (name, meaning)
    assert "'private'" in documented["zero_copy"] or '"private"' in documented["zero_copy"]
    assert "64 MiB" in documented["staging_bytes"]
    package = _parameters(page, "partc.runtime.loader.load_package_rank")
    assert list(package) == _options(load_package_rank)
    assert "RANK" in package["rank"]


def test_the_reference_renders_the_compiler_api_the_runtime_and_the_torch_helpers(site):
    partc = _text(_page(site, "partc"))
    for name in ("compile_family", "check_family", "CompileResult", "Plan", "RankPlan",
                 "Topology", "ShardingPolicy", "PartcError", "CheckpointError", "SourceLocation"):
        assert f"partc.{name}" in partc or f".{name}" in partc, name
    assert "tensor_parallel_size: int = 1" in partc  # compile_family's signature
    runtime = _text(_page(site, "runtime"))
    for name in ("RankState", "LocalModelLayout", "ParallelModelInfo", "LaunchPosition",
                 "package_rank_module"):
        assert name in runtime, name
    torch = _text(_page(site, "torch"))
    for name in ("BuildTopology", "process_groups", "device_mesh", "ProcessGroups",
                 "build_device_mesh", "to_dtensors", "DTensorSpec"):
        assert name in torch, name


def test_a_reference_to_an_object_partc_lacks_fails_the_strict_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("__pycache__"))
    page = docs / "reference" / "torch.md"
    page.write_text(page.read_text() + "\n::: partc.runtime.mesh.build_device_meshes\n")
    config = (ROOT / "mkdocs.yml").read_text()
    config = config.replace("docs_dir: docs", f"docs_dir: {docs}")
    config = config.replace("paths: [compiler]", f"paths: [{ROOT / 'compiler'}]")
    assert str(docs) in config and str(ROOT / "compiler") in config
    (tmp_path / "mkdocs.yml").write_text(config)
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "partc.runtime.mesh.build_device_meshes" in done.stderr, done.stderr[-3000:]
