"""Golden generated packages: fresh compiles match them byte for byte, they pass `ruff format
--check`, and each rank module's READS comment table says what `load` really returns.

The READS lines are checked against an independent oracle: the safetensors library's own
`get_slice` of the fixture checkpoint, narrowed and concatenated as the line says.
`python tests/regenerate_cases.py --golden` rewrites tests/golden/ after an intended change.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from regenerate_cases import GOLDEN, GOLDEN_BUILDS, compile_golden
from safetensors import safe_open

from support import ROOT, hf, import_build

REGENERATE = "python tests/regenerate_cases.py --golden"

_READ = re.compile(r"# (?P<target>\S+) +(?P<read>whole|narrow\(.*?\)|cat\(.*\)) -> "
                   r"\[(?P<shape>[\d, ]*)\] (?P<dtype>\w+)(?P<notes>(  .*)?)")
"""A READS line: `# <target>  <read> -> [<local shape>] <dtype>[  <notes>]`."""

_NARROW = re.compile(r"narrow\((\d+), (\d+), (\d+)\)")


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _package(build: Path) -> Path:
    return next(p for p in build.iterdir() if p.is_dir() and p.name != "__pycache__")


def _reads(module: Path) -> list[re.Match[str]]:
    """The READS lines of a rank module, in order."""
    return [m for line in module.read_text(encoding="utf-8").splitlines()
            if (m := _READ.fullmatch(line))]


def _oracle(checkpoint: Path, target: str, read: str) -> np.ndarray:
    """What a READS `read` selects of `target`, by the safetensors library alone."""
    with safe_open(str(checkpoint), "np") as handle:
        if read == "whole":
            return handle.get_tensor(target)
        tensor = handle.get_slice(target)
        rank = len(tensor.get_shape())
        pieces = []
        for axis, start, length in (map(int, m.groups()) for m in _NARROW.finditer(read)):
            index = [slice(None)] * rank
            index[axis] = slice(start, start + length)
            pieces.append((axis, tensor[tuple(index)]))
    assert len({axis for axis, _ in pieces}) == 1, read
    return np.concatenate([piece for _, piece in pieces], axis=pieces[0][0])


@pytest.mark.parametrize("name", sorted(GOLDEN_BUILDS))
def test_a_fresh_compile_matches_its_golden_build_byte_for_byte(name, tmp_path):
    compile_golden(name, tmp_path / "build")
    fresh, golden = _tree(tmp_path / "build"), _tree(GOLDEN / name)
    assert sorted(fresh) == sorted(golden), f"files differ; run `{REGENERATE} {name}`"
    for path in golden:
        assert fresh[path] == golden[path], f"{name}/{path} differs; run `{REGENERATE} {name}`"


def test_golden_and_freshly_compiled_packages_pass_ruff_format_check(tmp_path):
    for name in ("mixtral_tp2_ep2", "phi3_tp2"):  # an EP package __init__ and a plain one
        compile_golden(name, tmp_path / name)
    for folder, options in ((GOLDEN, []), (tmp_path, ["--line-length", "100"])):
        proc = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", "--diff",
                               *options, str(folder)], capture_output=True, text=True,
                              cwd=ROOT, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "already formatted" in proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(GOLDEN_BUILDS))
def test_each_reads_line_says_what_load_returns_by_the_safetensors_library(
        name, tmp_path):
    fixture = hf(GOLDEN_BUILDS[name][0])
    checkpoint = fixture / "model.safetensors"
    compile_golden(name, tmp_path / name)  # the golden build's bytes (test above)
    # fresh: another test of this process may have imported a package of the same name
    package = import_build(tmp_path / name)
    modules = sorted(_package(tmp_path / name).glob("rank_*.py"))
    reads_by_rank = {}
    for rank, module in enumerate(modules):
        reads = _reads(module)
        assert reads, f"{module.name} has no READS table"
        state = package.load(str(fixture), rank=rank)
        rank_module = importlib.import_module(f"{package.__name__}.{module.stem}")
        assert Path(rank_module.__file__) == module  # this build's module, not a stale one
        targets = rank_module.TARGETS
        targets = targets.splitlines() if isinstance(targets, str) else list(targets)
        assert [m["target"] for m in reads] == targets, module.name  # in TARGETS order
        assert sorted(targets) == sorted(state.tensors), module.name
        for m in reads:
            target, loaded = m["target"], state.tensors[m["target"]]
            expected = _oracle(checkpoint, target, m["read"])
            assert loaded.shape == expected.shape == tuple(
                int(n) for n in m["shape"].split(", ") if n), (module.name, target)
            assert np.array_equal(loaded, expected), (module.name, target, m["read"])
            with safe_open(str(checkpoint), "np") as handle:
                assert handle.get_slice(target).get_dtype() == m["dtype"], target
            expert = re.search(r"  expert (\d+)", m["notes"])
            if expert:  # the expert id the module names is the one in the checkpoint name
                assert f".experts.{expert[1]}." in target, (module.name, target)
        reads_by_rank[rank] = {(m["target"], m["read"]): m["notes"] for m in reads}
    for rank, reads in reads_by_rank.items():  # `kv xN`: N ranks read the same slice
        for key, notes in reads.items():
            kv = re.search(r"kv x(\d+)", notes)
            holders = sum(key in other for other in reads_by_rank.values())
            if kv:
                assert holders == int(kv[1]), (rank, key)


def test_the_golden_builds_cover_each_kind_of_read():
    lines = [m for name in GOLDEN_BUILDS for module in _package(GOLDEN / name).glob("rank_*.py")
             for m in _reads(module)]
    reads = " ".join(m["read"] + m["notes"] for m in lines)
    for shown in ("whole", "narrow(0, ", "narrow(1, ", "cat(narrow(", "kv x2", "  expert "):
        assert shown in reads, shown
