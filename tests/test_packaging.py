"""Packaging: the sdist carries its tests, the wheel is typed, a rank loads with the runtime only.

The sdist is built once with setuptools' own backend, unpacked, and the wheel is built from
the unpacked tree, so that the wheel test also proves the sdist is complete enough to build.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from partc.api import CompileOptions, compile_family
from partc.emit.render import package_name
from partc.plan.topology import Topology

from support import ROOT, checkpoint_tensors, hf

BUILD = "from setuptools import build_meta; import sys; print(build_meta.{}(sys.argv[1]))"
SDIST_PATHS = [
    "LICENSE", "README.md", "pyproject.toml", "MANIFEST.in", "compiler/partc/py.typed",
    "compiler/partc/emit/templates", "schemas/plan.schema.json", "architectures/llama.yaml",
    "tests/conftest.py", "tests/support/__init__.py", "tests/support/families.py",
    "tests/cases/deepseek_v3", "tests/fixtures/hf/llama/model.safetensors",
    "tests/fixtures/quantized", "tests/fixtures/fullsize", "tests/executor/__init__.py",
    "tests/regenerate_cases.py", "scripts/fault_table.py", "benchmarks/load.py",
    "docs/faults.md", "docs/families", "docs/architecture.md", "docs/reference/package.md",
    "mkdocs.yml", "constraints.txt",
]


def _backend(hook: str, out: Path, cwd: Path) -> Path:
    """Run one setuptools build_meta hook in a fresh interpreter; the built file's path."""
    done = subprocess.run([sys.executable, "-c", BUILD.format(hook), str(out)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist of this tree, built and unpacked."""
    root = tmp_path_factory.mktemp("sdist")
    sdist = _backend("build_sdist", root, ROOT)
    with tarfile.open(sdist) as archive:
        archive.extractall(root / "unpacked", filter="data")
    (tree,) = (root / "unpacked").iterdir()
    return tree


@pytest.fixture(scope="module")
def wheel(sdist_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the unpacked sdist."""
    return _backend("build_wheel", tmp_path_factory.mktemp("wheel"), sdist_tree)


def test_the_sdist_holds_everything_its_tests_need(sdist_tree):
    missing = [path for path in SDIST_PATHS if not (sdist_tree / path).exists()]
    assert missing == []
    assert not list(sdist_tree.rglob("__pycache__"))
    assert "Apache License" in (sdist_tree / "LICENSE").read_text()


def test_tests_run_and_pass_from_the_unpacked_sdist(sdist_tree):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "tests/test_architecture.py", "tests/test_plan.py"],
                          cwd=sdist_tree, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    assert f"rootdir: {sdist_tree}" in done.stdout


def test_the_wheel_ships_py_typed_the_license_and_the_package_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "partc/py.typed" in names
    assert "partc-0.1.0.dist-info/licenses/LICENSE" in names
    assert "partc/architectures/llama.yaml" in names
    assert "partc/schemas/plan.schema.json" in names
    # the guides ship (errors point to them); the API reference pages are the site's only
    assert "partc/docs/torch.md" in names
    assert not [n for n in names if n.startswith("partc/docs/reference/")]
    # every module of the source tree ships: a subpackage missing from pyproject's list would
    # install a partc that fails at its first import of it
    source = ROOT / "compiler" / "partc"
    modules = {f"partc/{p.relative_to(source).as_posix()}" for p in source.rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules - set(names) == set()
    metadata = zipfile.ZipFile(wheel).read("partc-0.1.0.dist-info/METADATA").decode()
    requires = sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines()
                      if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert [re.split(r"[<>=!~,; ]", r)[0] for r in requires] == [
        "jinja2", "jsonschema", "ml_dtypes", "numpy", "pyyaml", "shtab", "tqdm"]
    assert "License-Expression: Apache-2.0" in metadata


RANK_SCRIPT = """
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
package = __import__(sys.argv[2])
state = package.load(sys.argv[3], rank=1)
print(json.dumps({
    "tensors": sorted(state.tensors),
    "importable": [name for name in ("jinja2", "yaml", "jsonschema", "tqdm", "safetensors",
                                     "torch") if importlib.util.find_spec(name) is not None],
    "partc": sorted(m for m in sys.modules if m.startswith("partc")),
}))
"""


def test_a_rank_module_loads_in_a_venv_holding_only_numpy_ml_dtypes_and_the_wheel(
        wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for args in (["numpy>=1.26", "ml_dtypes>=0.4,<0.7"], ["--no-deps", str(wheel)]):  # README
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    result = compile_family(None, hf("llama") / "config.json", Topology(tensor_parallel_size=2),
                            CompileOptions(out=tmp_path / "build"))
    done = subprocess.run([str(python), "-c", RANK_SCRIPT, str(tmp_path / "build"),
                           package_name(result.plan), str(hf("llama"))],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # At T=2 x S=1 every rank loads every tensor (sharded or replicated): the checkpoint's.
    assert seen["tensors"] == sorted(checkpoint_tensors(hf("llama")))
    assert seen["importable"] == []
    assert "partc.runtime" in seen["partc"]
    # the compiler's commands say what this install lacks (not "a bug in partc", exit 70)
    done = subprocess.run([str(venv / "bin" / "partc"), "compile", "--config",
                           str(hf("llama") / "config.json"), "--out", str(tmp_path / "b2")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert re.search(r"partc compile needs the compiler's dependencies, and this install lacks "
                     r"(pyyaml|jsonschema|jinja2) ", done.stderr), done.stderr
    assert "internal error" not in done.stderr and not (tmp_path / "b2").exists()


def test_the_progress_bar_is_skipped_when_tqdm_is_not_installed(monkeypatch):
    from partc.runtime.progress import progress_bar

    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `from tqdm import tqdm` fail
    with progress_bar(1 << 20, "reading", enabled=True) as update:
        assert update is None


OLDEST_TORCH = "2.6.0"
"""The oldest torch the extras accept: scripts/check_oldest_deps.sh runs the torch and verify
tests with it (transformers 5 disables an older torch)."""


def _resolve(wheel: Path, out: Path, *requirements: str) -> subprocess.CompletedProcess[str]:
    """pip's resolution of `requirements` from nothing installed, as a JSON report at `out`.

    The registry this runs against does not announce PEP 658 metadata files, so a plain
    `--dry-run` downloads every wheel it considers (torch and the CUDA libraries: GBs);
    `fast-deps` reads each wheel's metadata with HTTP range requests instead, and the report's
    `download_info` says what a real install would fetch.
    """
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--use-feature=fast-deps", "--report", str(out), *requirements],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def _selected(report: Path) -> dict[str, str]:
    """Name -> version of every distribution a pip report would install."""
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def test_the_verify_extra_resolves_beside_the_oldest_supported_torch_and_the_tested_one(
        wheel, tmp_path):
    runs = {torch: _resolve(wheel, tmp_path / f"{torch}.json", f"{wheel}[verify]",
                            f"torch=={torch}")
            for torch in (OLDEST_TORCH, "2.13.0")}
    for torch, done in runs.items():
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        selected = _selected(tmp_path / f"{torch}.json")
        assert selected["partc"] == "0.1.0"
        assert selected["torch"].split("+")[0] == torch  # the user's torch, not a pinned one
        major, minor = (int(n) for n in selected["transformers"].split(".")[:2])
        assert (major, minor) >= (5, 0), selected["transformers"]
        assert "accelerate" in selected


def test_the_extras_refuse_a_torch_older_than_the_supported_one(wheel, tmp_path):
    for extra in ("torch", "verify"):
        done = _resolve(wheel, tmp_path / f"{extra}.json", f"{wheel}[{extra}]", "torch==2.5.1")
        assert done.returncode == 1, done.stdout[-3000:]
        assert "torch==2.5.1" in done.stderr and f"partc[{extra}]" in done.stderr, done.stderr
        assert "ResolutionImpossible" in done.stderr, done.stderr[-3000:]


def test_the_constraints_file_pins_every_versioned_test_requirement_ci_installs():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    assert pins["torch"] == "2.13.0" and pins["transformers"] == "5.24.0"
    for name in ("accelerate", "huggingface-hub", "playwright", "mkdocs", "mkdocstrings",
                 "mkdocstrings-python"):
        assert name in pins, name
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install --quiet -c constraints.txt '.[test]'" in ci
