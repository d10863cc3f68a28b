"""House style that tools can check: ruff (including one-line docstrings, D1) over the code."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT


def test_ruff_finds_nothing_in_the_package_and_the_tests():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "compiler",
                           "tests", "benchmarks", "scripts"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
