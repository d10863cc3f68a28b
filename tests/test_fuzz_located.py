"""Hypothesis over the surfaces issue 39 hardened: family documents (with `extends:` chains),
expert placement files and a build's plan.json, built from hostile values (control characters,
5000-digit and negative integers, NaN, YAML tags and aliases, over-long and escaping paths).
Every example ends in success or in located errors: each a PartcError naming a file, and on the
command line exit 1 or 2 with every `error:` line naming a file; never a traceback, exit 70 or
a hang.

The budget is PARTC_FUZZ_LOCATED_EXAMPLES (total examples, default 240 for CI, about 12 s);
`python scripts/hostile_table.py` runs more and prints the outcome table. PARTC_FUZZ_RANDOM=1
draws fresh random examples instead of the derandomized CI sequence.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partc.api import CompileOptions, bind, check_family, compile_family, with_expert_placement
from partc.cli.main import main
from partc.errors import PartcError
from partc.plan.realize import realize_plan
from partc.plan.topology import Topology

from support import hf
from support.families import MINI, MINI_CONFIG

BUDGET = int(os.environ.get("PARTC_FUZZ_LOCATED_EXAMPLES", "240"))
SHARES = {"family": 0.3, "placement": 0.35, "cli": 0.15, "plan": 0.2}
OUTCOMES: dict[str, Counter[str]] = {target: Counter() for target in SHARES}
"""How each target's examples ended (`ok`, or the error class), for scripts/hostile_table.py."""
QWEN = hf("qwen3_moe") / "config.json"
EXPERTS, EP = 8, 2


def fuzz_settings(target: str) -> settings:
    """Derandomized (unless PARTC_FUZZ_RANDOM), no deadline, the target's share of BUDGET."""
    return settings(max_examples=max(5, int(BUDGET * SHARES[target])), deadline=None,
                    database=None, derandomize=not os.environ.get("PARTC_FUZZ_RANDOM"),
                    suppress_health_check=list(HealthCheck), print_blob=True)


HOSTILE_TEXT = ["\x1b[31m", "\x00", "\n", "\r\nerror: forged", "\x9b2J", "\x7f", "{unit", "}",
                ": ", " #", '"', "\\", "\ufeff", "\u202e", "x" * 300, "é", "𝟘"]
HOSTILE_SCALARS: list[object] = [
    -1, 0, 2 ** 62, -(2 ** 62), 10 ** 30, float("nan"), float("inf"), 1e308, True, None, "",
    [], {}, [[[]]], "1e3", "null", "02"]

hostile_strings = st.lists(st.sampled_from(HOSTILE_TEXT) | st.text(max_size=4),
                           min_size=1, max_size=4).map("".join)
hostile_values = st.sampled_from(HOSTILE_SCALARS) | hostile_strings | st.integers()


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a parsed document, the root included."""
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*path, index))
    return found


def _replaced(document: Any, path: tuple[Any, ...], value: object) -> Any:
    """`document` with the node at `path` replaced by `value` (the root: `value` itself); as
    it is when an earlier replacement took the path away."""
    if not path:
        return value
    head, *rest = path
    if isinstance(document, dict) and head in document:
        copy: Any = dict(document)
    elif isinstance(document, list) and isinstance(head, int) and head < len(document):
        copy = list(document)
    else:
        return document
    copy[head] = _replaced(copy[head], tuple(rest), value)
    return copy


MINI_TREE = yaml.safe_load(MINI)
MINI_PATHS = _paths(MINI_TREE)
EXTENDS_TARGETS = ["base.yaml", "./base.yaml", "missing.yaml", "child.yaml", "/etc/passwd",
                   "../" * 40 + "etc/hostname", "x" * 300 + ".yaml", "/proc/self/environ",
                   "base.yaml\x1b[31m\nerror: forged", "llama", "no-such-family", ""]
RAW_SNIPPETS = ["!!python/object/apply:os.system ['true']", "&a [*a]", "*undefined",
                "? [a, b]\n: c", "<<: *a", "%YAML 1.1\n---", "\t", "'" * 3, "9" * 5000,
                "{" * 200, "- " * 200, "!!binary AAAA"]


@st.composite
def family_files(draw: st.DrawFn) -> tuple[str, str | None]:
    """A child family text and, sometimes, a base it may extend: the mini family with nodes
    replaced by hostile values, an `extends:` target, or a raw hostile line spliced in."""
    child = MINI_TREE
    for _ in range(draw(st.integers(0, 3))):
        child = _replaced(child, draw(st.sampled_from(MINI_PATHS)), draw(hostile_values))
    base = None
    if isinstance(child, dict) and draw(st.booleans()):
        target = draw(st.sampled_from(EXTENDS_TARGETS) | hostile_strings)
        child = {"extends": target} | ({} if draw(st.booleans()) else
                                       {k: v for k, v in child.items() if k != "family"})
        base = draw(st.sampled_from([MINI, "[1, 2]", "7", "extends: child.yaml\n", ""]))
    text = yaml.safe_dump(child, allow_unicode=draw(st.booleans()))
    if draw(st.booleans()):
        lines = text.split("\n")
        at = draw(st.integers(0, len(lines)))
        lines.insert(at, draw(st.sampled_from(RAW_SNIPPETS)))
        text = "\n".join(lines)
    return text, base


@st.composite
def placement_texts(draw: st.DrawFn) -> str:
    """A placement file: `{"ranks": ...}` with hostile ids or rank lists, any JSON value, or
    JSON text with a hostile splice."""
    ids = st.integers(-3, EXPERTS + 2) | st.sampled_from([2 ** 62, -(2 ** 62), 10 ** 30, 1.5,
                                                          float("nan"), True, None, "3", []])
    ranks = st.lists(st.lists(ids, max_size=EXPERTS + 2), max_size=EP + 2)
    order = draw(st.permutations(range(EXPERTS)))
    cut = draw(st.sampled_from([EXPERTS // 2] * 3 + [1, EXPERTS - 1]))  # equal slots: valid
    placed: list[list[Any]] = [sorted(order[:cut]), sorted(order[cut:])]  # ascending
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        placed[draw(st.integers(0, EP - 1))].append(draw(ids))
    kind = draw(st.sampled_from(["placed", "placed", "ranks", "extra key", "any"]))
    document = {"placed": st.just({"ranks": placed}),
                "ranks": st.builds(lambda r: {"ranks": r}, ranks),
                "extra key": st.builds(lambda r, k, v: {"ranks": r, k: v}, ranks,
                                       hostile_strings, hostile_values),
                "any": st.recursive(hostile_values, lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(hostile_strings, inner, max_size=3),
                                    max_leaves=6)}[kind]
    text = json.dumps(draw(document))
    if draw(st.sampled_from([False, False, True])):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["9" * 5000, "\x00", "\ufeff", "NaN", "-",
                                                 ",", "]]", "\"\x1b\""])) + text[at:]
    return text


WORK = Path(tempfile.mkdtemp(prefix="partc-fuzz-located-"))
"""Where the examples' files are written (removed at exit)."""
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


@contextmanager
def files(**texts: str | None) -> Iterator[Path]:
    """A fresh folder holding each text as `<name>.yaml` / `.json` (None: no file), removed
    after the example."""
    folder = Path(tempfile.mkdtemp(dir=WORK))
    try:
        for name, text in texts.items():
            if text is not None:
                (folder / name.replace("_", ".")).write_bytes(
                    text.encode("utf-8", "surrogatepass"))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def qwen() -> Any:
    """The tiny Qwen3-MoE bound (8 experts), shared by every placement example."""
    bound, _, _ = bind(None, QWEN)
    return bound


def _names_a_file(where: str) -> bool:
    """`where` (a location, or what follows `error: `) starts with a file: one the example
    gave or an `extends:` target (absolute paths here), or a built-in family."""
    return where.startswith(("architectures/", "/"))


def _located(errors: list[PartcError]) -> str:
    """The outcome of errors that must each name a file the example gave; fails it otherwise."""
    assert errors
    for error in errors:
        assert error.location is not None and _names_a_file(error.location.file), (
            error.location, error)
    return type(errors[0]).__name__


_COLLAPSED = re.compile(r"error: \d+ errors like this one \(first shown\): |error: ")


def _cli(args: list[str]) -> str:
    """Run the command line; exit 0, or 1/2 with every `error:` line naming a file."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as exc:  # argparse
            status = exc.code if isinstance(exc.code, int) else 2
    printed = err.getvalue()
    assert status in (0, 1, 2) and "Traceback" not in printed, (status, printed)
    if status == 1:
        errors = [_COLLAPSED.sub("", line, count=1) for line in printed.splitlines()
                  if line.startswith("error:")]
        assert errors and all(_names_a_file(line) for line in errors), printed
    return "ok" if status == 0 else f"exit {status}"


@fuzz_settings("family")
@given(family_files())
def test_a_hostile_family_document_is_checked_or_refused_with_located_errors(
        example: tuple[str, str | None]) -> None:
    text, base = example
    with files(child_yaml=text, base_yaml=base,
               config_json=json.dumps(MINI_CONFIG)) as folder:
        errors = check_family(folder / "child.yaml", folder / "config.json")
        OUTCOMES["family"]["ok" if not errors else _located(errors)] += 1


@fuzz_settings("placement")
@given(placement_texts())
def test_a_hostile_placement_file_is_used_or_refused_at_its_file(text: str) -> None:
    with files(placement_json=text) as folder:
        path = folder / "placement.json"
        try:
            topology = with_expert_placement(Topology(expert_parallel_size=EP), qwen(), path)
            realize_plan(qwen(), topology)
        except PartcError as exc:
            errors = list(getattr(exc, "errors", ())) or [exc]
            OUTCOMES["placement"][_located(errors)] += 1
        else:
            OUTCOMES["placement"]["ok"] += 1


@fuzz_settings("cli")
@given(family_files(), placement_texts())
def test_the_cli_exits_0_1_or_2_with_each_error_line_naming_a_file(
        family: tuple[str, str | None], placement: str) -> None:
    text, base = family
    with files(child_yaml=text, base_yaml=base, placement_json=placement,
               config_json=json.dumps(MINI_CONFIG)) as folder:
        OUTCOMES["cli"][_cli(["check", str(folder / "child.yaml"), "--config",
                              str(folder / "config.json")])] += 1
        OUTCOMES["cli"][_cli(["check", "--config", str(QWEN), "--ep", str(EP),
                              "--expert-placement", str(folder / "placement.json")])] += 1



@functools.cache
def llama_plan() -> tuple[Any, list[tuple[Any, ...]]]:
    """A tiny Llama TP 2 x PP 2 build's plan document and every path into it."""
    out = WORK / "llama-build"
    compile_family(None, hf("llama") / "config.json",
                   Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                   CompileOptions(out=out))
    document = json.loads((out / "plan.json").read_text())
    return document, _paths(document)


@st.composite
def plan_texts(draw: st.DrawFn) -> str:
    """The tiny build's plan.json with one to three nodes replaced by hostile values, written
    as JSON (NaN and Infinity included)."""
    document, paths = llama_plan()
    for _ in range(draw(st.integers(1, 3))):
        document = _replaced(document, draw(st.sampled_from(paths)), draw(hostile_values))
    return json.dumps(document)


@fuzz_settings("plan")
@given(plan_texts(), st.sampled_from([["inspect"], ["explain", "lm_head.weight"],
                                      ["inspect", "--rank", "1"]]))
def test_a_tampered_plan_is_shown_or_refused_with_located_errors(text: str,
                                                                 command: list[str]) -> None:
    with files(plan_json=text) as folder:
        OUTCOMES["plan"][_cli([command[0], str(folder / "plan.json"), *command[1:]])] += 1
