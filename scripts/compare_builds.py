"""Compare the generated output of two revisions byte for byte.

Compiles every built-in family's tiny fixtures (tests/fixtures/hf, tests/fixtures/quantized) at
every topology the test suite uses, once with the working tree and once with another revision
(default: HEAD), each in a fresh interpreter that imports only that revision's package, and
reports every file whose bytes differ. A refactoring that must not change the output (moving
modules, retyping the IR) runs this before it is committed:

    python scripts/compare_builds.py                 # working tree against HEAD
    python scripts/compare_builds.py --against REV   # working tree against REV
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2), (8, 1), (3, 3)]
"""(T, S) pairs: every topology the numerics and family tests compile, and an odd one."""

_COMPILE = r"""
import hashlib, json, sys, tempfile
from pathlib import Path
from partc.errors import PartcError
import inspect
from partc.api import compile_family
if "topology" in inspect.signature(compile_family).parameters:  # compile_family(F, C, T, options)
    from partc.api import CompileOptions
    from partc.plan.topology import Topology
    def build(config, tp, pp, out):
        compile_family(None, config, Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                       CompileOptions(out=out))
else:  # the keyword interface before it
    def build(config, tp, pp, out):
        compile_family(None, config, tensor_parallel_size=tp, pipeline_parallel_size=pp, out=out)
digests = {}
for fixture, tp, pp in json.loads(sys.argv[1]):
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "build"
        try:
            build(Path(fixture) / "config.json", tp, pp, out)
        except PartcError as exc:
            digests[f"{fixture} {tp}x{pp}"] = {"error": str(exc).replace(scratch, "<out>")}
            continue
        digests[f"{fixture} {tp}x{pp}"] = {
            str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
print(json.dumps(digests))
"""


def _stage(tree: Path, into: Path) -> Path:
    """Lay a source tree out as the wheel does: partc/ with its schemas and architectures."""
    package = into / "partc"
    shutil.copytree(tree / "compiler" / "partc", package)
    shutil.copytree(tree / "schemas", package / "schemas", dirs_exist_ok=True)
    shutil.copytree(tree / "architectures", package / "architectures", dirs_exist_ok=True)
    return into


def _jobs() -> list[tuple[str, int, int]]:
    fixtures = sorted(p.parent for base in ("hf", "quantized")
                      for p in (ROOT / "tests" / "fixtures" / base).glob("*/config.json"))
    return [(str(f), tp, pp) for f in fixtures for tp, pp in TOPOLOGIES]


def _digests(tree: Path, jobs: list[tuple[str, int, int]]) -> dict[str, dict[str, str]]:
    with tempfile.TemporaryDirectory() as scratch:
        staged = _stage(tree, Path(scratch))
        done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, "
                               f"{str(staged)!r}); exec({_COMPILE!r})", json.dumps(jobs)],
                              capture_output=True, text=True, cwd=scratch)
    if done.returncode != 0:
        raise SystemExit(f"compiling with {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def main() -> int:
    """Compile with both trees and report the differing files; exit 1 if any differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="revision to compare with")
    args = parser.parse_args()
    jobs = _jobs()
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "other"
        other.mkdir()
        archive = subprocess.run(["git", "archive", args.against], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(other)], input=archive, check=True)
        before = _digests(other, jobs)
    after = _digests(ROOT, jobs)
    differ = sorted(key for key in before.keys() | after.keys()
                    if before.get(key) != after.get(key))
    files = sum(len(v) for v in after.values())
    summary = hashlib.sha256(json.dumps(after, sort_keys=True).encode()).hexdigest()[:16]
    print(f"{len(jobs)} builds, {files} files compared with {args.against}: "
          f"{len(differ)} builds differ (output digest {summary})")
    for key in differ:
        old, new = before.get(key, {}), after.get(key, {})
        names = sorted(n for n in old.keys() | new.keys() if old.get(n) != new.get(n))
        print(f"  {key}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
