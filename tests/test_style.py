"""House style that tools can check: ruff (one-line docstrings, D1) and mypy --strict."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT


def test_ruff_finds_nothing_in_the_package_and_the_tests():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "compiler",
                           "tests", "benchmarks", "scripts"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_finds_nothing_in_the_package():
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "compiler/partc"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("Success: no issues found")
