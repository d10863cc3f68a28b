"""The README's tour runs as written, from a folder laid out like the clone, and does what its
comments say: the tiny Llama's 2 KV heads on 4 ranks, each KV head repeated on two of them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.numpy import load_file

from support import HF, ROOT


def _tour_lines() -> list[str]:
    """The shell lines of the README's "A tour" block, less the venv activation."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## A tour\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "the README's tour has no sh block"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert lines[0] == ". .venv/bin/activate"
    return lines[1:]


@pytest.fixture(scope="module")
def tour(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each tour line's run, by its command, in a folder holding the clone's tiny Llama."""
    where = tmp_path_factory.mktemp("clone")
    shutil.copytree(HF / "llama", where / "tests" / "fixtures" / "hf" / "llama")
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    runs = {}
    for line in _tour_lines():
        done = subprocess.run(["bash", "-c", line], cwd=where, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        runs[line.split()[1] if line.startswith("partc") else line.split()[0]] = done
    return {"where": where, **runs}


def test_every_line_of_the_readme_tour_succeeds_and_writes_what_it_says(tour):
    where = tour["where"]
    assert (where / "build" / "plan.json").is_file()
    package = where / "build" / "partc_llama_tp4_pp1"
    assert sorted(p.name for p in package.glob("rank_*.py")) == [f"rank_0{r}.py" for r in range(4)]
    assert (where / "report.html").read_text(encoding="utf-8").lstrip().startswith("<!")
    assert (where / "my_family.yaml").is_file()


def test_the_tour_loads_one_query_head_per_rank_of_the_four(tour):
    # 4 query heads of head_dim 16 over 4 ranks: 16 rows of the hidden size 64 each
    assert tour["python"].stdout.strip() == "(16, 64)"


def test_the_tour_explains_each_kv_head_held_by_two_ranks(tour):
    out = tour["explain"].stdout
    tensors = load_file(str(HF / "llama" / "model.safetensors"))
    full = tensors["model.layers.0.self_attn.k_proj.weight"]
    heads, head_dim, ranks = 2, 16, 4
    assert full.shape == (heads * head_dim, 64)
    placed = {int(rank): (int(start), int(stop)) for rank, start, stop in re.findall(
        r"^\s*(\d+)\s+0\s+\d+\s+.*k_proj\.weight\s+rows (\d+):(\d+)", out, re.M)}
    # vLLM's rule: rank t holds KV head t*K // T, so ranks 0, 1 hold head 0 and ranks 2, 3 head 1
    assert placed == {t: ((t * heads // ranks) * head_dim, (t * heads // ranks + 1) * head_dim)
                      for t in range(ranks)}, out


def test_the_tour_verifies_the_split_against_transformers_at_every_asked_size(tour):
    out = tour["verify"].stdout
    for size in (1, 2, 4):
        checks = re.search(rf"^T={size} x S=1: (\d+)/(\d+) checks hold$", out, re.M)
        assert checks and checks.group(1) == checks.group(2) != "0", out[-2000:]
    assert "every check holds" in out.splitlines()[-1]
