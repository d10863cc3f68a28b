"""Print issue 39's table of hostile input: surface x cases tried x refused cleanly x succeeded x
failures, over family documents, expert placement files, plan files, checkpoint headers, `partc
init` names and launcher environment variables.

    python scripts/hostile_table.py              # 2000 Hypothesis examples per fuzzed surface
    python scripts/hostile_table.py 500 --random # another budget, fresh random examples

Refused cleanly: a PartcError located in a file (on the command line exit 1 with every `error:`
line naming a file, or for the environment a LaunchError naming the variable); succeeded: a
build, a scaffold that checks, a plan shown, a rank loaded. A failure is anything else: a
traceback, exit 70, an unlocated error, a scaffold that does not check, code run by a loader,
a file changed that the command only reads. Exit status 1 when there is any.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Row = tuple[str, Counter[str], list[str]]
"""A surface, its counts (`refused`, `ok`, `failed`) and what each failure was."""


def _run(args: list[str]) -> tuple[int, str, str]:
    """The command line's exit status, stdout and stderr."""
    from partc.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 2
    return status, out.getvalue(), err.getvalue()


def _fuzzed(module: Any, names: dict[str, str]) -> list[Row]:
    """Run each named Hypothesis test of `module` (test -> OUTCOMES target) at the budget set
    in the environment; `ok` outcomes succeeded, the others were refused cleanly."""
    rows = []
    for test, target in names.items():
        failures = []
        try:
            getattr(module, test)()
        except BaseException:  # noqa: BLE001 - the table reports it
            failures.append(f"{test}: {traceback.format_exc(limit=3)[-600:]}")
        outcomes = module.OUTCOMES[target]
        ok = sum(n for outcome, n in outcomes.items()
                 if outcome in ("ok", "check ok / load ok"))
        counts = Counter(ok=ok, refused=sum(outcomes.values()) - ok, failed=len(failures))
        rows.append((target, counts, failures))
    return rows


def _tampered_plans() -> Row:
    """Every case of tests/test_tampered_plan.py through inspect, explain and report: exit 1
    with one error at the case's pointer, located at a line of the plan."""
    import test_tampered_plan as table

    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology

    counts: Counter[str] = Counter()
    failures = []
    with tempfile.TemporaryDirectory() as work:
        built = Path(work) / "built"
        compile_family(None, ROOT / "tests/fixtures/hf/llama/config.json",
                       Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                       CompileOptions(out=built))
        cases: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
            name: (edit, pointer) for name, (edit, pointer, _) in table.CASES.items()}
        cases["S=10^9"] = (table._set(("topology", "pipeline_parallel_size"), 10 ** 9),
                           "/topology/pipeline_parallel_size")
        for name, (edit, pointer) in cases.items():
            copy = Path(work) / name
            shutil.copytree(built, copy)
            plan = json.loads((copy / "plan.json").read_text())
            edit(plan)
            (copy / "plan.json").write_text(json.dumps(plan))
            for command in (["inspect"], ["explain", "lm_head.weight"],
                            ["report", "--out", str(copy / "r.html")]):
                status, out, err = _run([command[0], str(copy), *command[1:], "--format",
                                         "json"])
                try:
                    (error,) = json.loads(out)["errors"]
                    assert status == 1 and error["pointer"] == pointer and error["line"] >= 1
                    counts["refused"] += 1
                except (AssertionError, ValueError, KeyError) as exc:
                    counts["failed"] += 1
                    failures.append(f"plan {name} {command[0]}: {exc!r} {err[-300:]}")
            shutil.rmtree(copy)
    return "plan files (tampered table)", counts, failures


def _init_names() -> Row:
    """`partc init` on the tiny Llama with one hostile name added (a module of every layer, a
    module outside them, a loose tensor): a scaffold that a safe loader reads, that partc
    checks and that PyYAML's unsafe_load reads without running anything; or exit 1 naming the
    checkpoint with nothing written."""
    import numpy as np
    import test_init_hostile as hostile
    import yaml
    from safetensors.numpy import load_file, save_file

    llama = ROOT / "tests/fixtures/hf/llama"
    names = [*hostile.WORDS, hostile.META, "x" * 900, "\u0663", "a-b", "!!python/object/apply:"
             "exec [\"open('planted', 'w')\"]", "{{unit}}", "{0}", "%", "\\", "é"]
    counts: Counter[str] = Counter()
    failures = []
    base = load_file(llama / "model.safetensors")
    with tempfile.TemporaryDirectory() as work, _chdir(Path(work)):
        for index, name in enumerate(names):
            folder = Path(work) / f"ck{index}"
            folder.mkdir()
            shutil.copy(llama / "config.json", folder / "config.json")
            tensors = dict(base)
            for layer in (0, 1, 2):
                tensors[f"model.layers.{layer}.mlp.{name}.weight"] = np.zeros(2, np.float32)
            tensors[f"side.{name}.weight"] = np.zeros(2, np.float32)
            tensors[name] = np.zeros(2, np.float32)
            save_file(tensors, folder / "model.safetensors")
            out = Path(work) / f"f{index}.yaml"
            status, _, err = _run(["init", "--checkpoint", str(folder), "--out", str(out)])
            if status == 1 and err.startswith(f"error: {folder}") and not out.exists():
                counts["refused"] += 1
                continue
            problem = "" if status == 0 else f"init exit {status}: {err[-300:]}"
            if not problem:
                text = out.read_text()
                checked, _, err = _run(["check", str(out), "--checkpoint", str(folder)])
                if checked != 0:
                    problem = f"the scaffold does not check: {err[-300:]}"
                elif yaml.unsafe_load(text) != yaml.safe_load(text):
                    problem = "unsafe_load reads other data"
                elif Path("planted").exists():
                    problem = "unsafe_load ran a tag"
            counts["failed" if problem else "ok"] += 1
            if problem:
                failures.append(f"init {name[:40]!r}: {problem}")
    return "init names", counts, failures


@contextlib.contextmanager
def _chdir(folder: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


ENVIRONMENT = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PARTC_LOCAL_RANKS",
               "PARTC_READ_THREADS"]
ENVIRONMENT_VALUES = ["9" * 5000, "9" * 19, "-1", "0", "1", "3", "\u0663", "1_0", "+1", "", " ",
                      "0x10", "1e3", "nan", "\x1b[31m", "1\n2", "00000000000000000000001"]


def _environment() -> Row:
    """The tiny Llama TP 2 build's generated `load()` with each launcher variable set to
    each hostile value (the others unset): a rank loaded, or a LaunchError naming the
    variable."""
    from partc.errors import PartcError

    from support import compile_and_import

    counts: Counter[str] = Counter()
    failures = []
    with tempfile.TemporaryDirectory() as work:
        _, package = compile_and_import(None, ROOT / "tests/fixtures/hf/llama/config.json",
                                        Path(work) / "b", tp=2)
        saved = {name: os.environ.pop(name, None) for name in ENVIRONMENT}
        try:
            for name in ENVIRONMENT:
                for value in ENVIRONMENT_VALUES:
                    os.environ[name] = value
                    if name != "RANK":
                        os.environ["RANK"] = "1"
                    try:
                        package.load(ROOT / "tests/fixtures/hf/llama")
                        counts["ok"] += 1
                    except PartcError as exc:
                        clean = name in str(exc) and str(exc).isprintable()
                        counts["refused" if clean else "failed"] += 1
                        if not clean:
                            failures.append(f"{name}={value[:20]!r}: {exc!r}")
                    except Exception as exc:  # noqa: BLE001 - the table reports it
                        counts["failed"] += 1
                        failures.append(f"{name}={value[:20]!r}: {type(exc).__name__}: {exc}")
                    finally:
                        os.environ.pop(name, None)
                        os.environ.pop("RANK", None)
        finally:
            os.environ.update({k: v for k, v in saved.items() if v is not None})
    return "environment variables", counts, failures


def main(argv: list[str] | None = None) -> int:
    """Run every surface and print the table; exit 1 when any case failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="?", type=int, default=2000,
                        help="Hypothesis examples per fuzzed surface (default 2000)")
    parser.add_argument("--random", action="store_true", help="fresh random examples")
    args = parser.parse_args(argv)
    # test_fuzz_located splits its budget 0.3 / 0.35 / 0.15 / 0.2 over family, placement, cli
    # and plan, test_fuzz gives headers 0.2 of its own
    os.environ["PARTC_FUZZ_LOCATED_EXAMPLES"] = str(args.examples * 4)
    os.environ["PARTC_FUZZ_EXAMPLES"] = str(args.examples * 5)
    if args.random:
        os.environ["PARTC_FUZZ_RANDOM"] = "1"
    sys.path.insert(0, str(ROOT / "tests"))
    import test_fuzz
    import test_fuzz_located as located

    started = time.perf_counter()
    rows: list[Row] = []
    rows += _fuzzed(located, {
        "test_a_hostile_family_document_is_checked_or_refused_with_located_errors": "family",
        "test_a_hostile_placement_file_is_used_or_refused_at_its_file": "placement",
        "test_the_cli_exits_0_1_or_2_with_each_error_line_naming_a_file": "cli",
        "test_a_tampered_plan_is_shown_or_refused_with_located_errors": "plan"})
    rows.append(_tampered_plans())
    rows += _fuzzed(test_fuzz, {
        "test_mutated_safetensors_headers_are_caught_by_check_and_by_load": "header"})
    rows.append(_init_names())
    rows.append(_environment())
    labels = {"family": "family documents (fuzzed)", "placement": "placement files (fuzzed)",
              "cli": "check CLI: family + placement (fuzzed, 2 runs each)",
              "plan": "plan files (fuzzed)", "header": "checkpoint headers (fuzzed)"}
    print(f"{'surface':<52} {'tried':>7} {'refused':>8} {'ok':>7} {'failed':>7}")
    for surface, counts, _ in rows:
        tried = counts["refused"] + counts["ok"] + counts["failed"]
        print(f"{labels.get(surface, surface):<52} {tried:>7} {counts['refused']:>8} "
              f"{counts['ok']:>7} {counts['failed']:>7}")
    failures = [failure for _, _, found in rows for failure in found]
    for failure in failures:
        print(f"FAILED {failure}")
    print(f"\n{time.perf_counter() - started:.0f} s; {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
