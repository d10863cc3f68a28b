"""Hostile names: strings from a family, a config or a checkpoint reach generated code only as
escaped literals, the generated modules compile, pass the shape check and load correctly."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from regenerate_cases import toml_spelling
from safetensors.numpy import save_file

from partc.api import CompileOptions, check_family, compile_family
from partc.emit.check import check_generated
from partc.errors import EmitError
from partc.plan.topology import Topology

from support import ROOT, import_build

HOSTILE = [
    "quote'single", 'quote"double', "back\\slash", "new\nline", "carriage\rreturn",
    "{braces}", "__import__('os').system('echo pwned')", "ünïcødé ☃ 𝔘", '""" triple', "\t\x0b\x0c",
    "#comment", "'); import os; ('",
]
IN_CHECKPOINTS = [name for name in HOSTILE if name.isprintable()]
"""The hostile names a checkpoint may carry: partc refuses a checkpoint tensor name that is not
printable (tests/test_reader_faults.py), so the builds loaded here use these; the generated code
of a family declaring every one of HOSTILE is checked without a checkpoint."""
MODEL_TYPE = "x'\"\\\n{}ü"
PREFIX = "p'\"\\\r\n{}__import__('os')ü"
PRINTABLE_PREFIX = "p'\"\\ {}__import__('os')ü"


def _template(text: str) -> str:
    """A template that renders to `text` literally (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def _block(printable: bool) -> str:
    return "blk.{unit}.new line\\back'q\"" if printable else "blk.{unit}.new\nline\\back'q\""


def hostile_family(printable: bool = True) -> dict:
    """The hostile family; `printable`: only tensor names a checkpoint may carry."""
    names = IN_CHECKPOINTS if printable else HOSTILE
    members = [{"target": "{prefix}.weight", "shape": [8, "hidden"], "sharding": {"equal": 0}}]
    members += [{"target": _template(f"static.{i}.{name}"), "shape": ["hidden"],
                 "sharding": "replicated"} for i, name in enumerate(names)]
    return {
        "family": "hostile",
        "model_types": [MODEL_TYPE],
        "config": {"hidden": "int", "prefix": "str"},
        "graph": [{"group": "decoder", "units": 2, "path": "lay'ers\"\\{unit}\n",
                   "state": True}],
        "static": {"embedding": {"stage": "first"}},
        "parameters": [
            {"name": _template("emb'\"\\ ünï {} \n"), "role": "vocabulary",
             "owner": {"static": "embedding"}, "members": members},
            {"name": 'block.{unit}."""\r', "role": "channels", "owner": {"unit": "decoder"},
             "members": [
                 {"target": _block(printable), "shape": ["hidden"], "sharding": "replicated"},
                 {"target": "blk.{unit}.{{braces}}.☃", "shape": ["hidden", 2],
                  "sharding": {"equal": 0}},
             ]},
        ],
        "boundary": {"identity": "id\"); __import__('os') #\n",
                     "primary": {"role": "hidden", "shape": ["batch", "sequence", "hidden"],
                                 "dtype": "activation"}},
    }


def hostile_targets(printable: bool = True) -> list[str]:
    prefix, names = (PRINTABLE_PREFIX, IN_CHECKPOINTS) if printable else (PREFIX, HOSTILE)
    return ([f"{prefix}.weight"] + [f"static.{i}.{name}" for i, name in enumerate(names)]
            + [_block(printable).replace("{unit}", str(u)) for u in range(2)]
            + [f"blk.{u}.{{braces}}.☃" for u in range(2)])


def write_inputs(folder, spelling: str, printable: bool = True) -> tuple:
    """The family, its config and (for printable names) a checkpoint of its tensors."""
    data = hostile_family(printable)
    if spelling == "yaml":
        family = folder / "hostile.yaml"
        family.write_text(json.dumps(data, indent=1, ensure_ascii=False))  # JSON is YAML 1.2
    else:
        family = folder / "hostile.toml"
        family.write_text(toml_spelling(data))
    config = folder / "config.json"
    config.write_text(json.dumps({"model_type": MODEL_TYPE, "hidden": 4,
                                  "prefix": PRINTABLE_PREFIX if printable else PREFIX,
                                  "dtype": "float32"}))
    tensors: dict[str, np.ndarray] = {}
    if not printable:
        return family, config, None, tensors
    for index, target in enumerate(hostile_targets()):
        shape = ((8, 4) if target.endswith(".weight")
                 else (4, 2) if target.startswith("blk.") and "braces" in target else (4,))
        tensors[target] = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
                           + 100 * index)
    checkpoint = folder / "ckpt"
    checkpoint.mkdir()
    save_file(tensors, str(checkpoint / "model.safetensors"))
    return family, config, checkpoint, tensors


@pytest.fixture(params=["yaml", "toml"])
def hostile_build(request, tmp_path):
    family, config, checkpoint, tensors = write_inputs(tmp_path, request.param)
    assert check_family(family, config, checkpoint) == []
    result = compile_family(family, config,
                            Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                            CompileOptions(checkpoint=checkpoint, out=tmp_path / "build"))
    return result, checkpoint, tensors


def test_hostile_names_compile_and_every_rank_loads_exactly_its_slices(hostile_build):
    result, checkpoint, tensors = hostile_build
    package = import_build(result.out, result.plan)
    seen: dict[str, list[np.ndarray]] = {}
    for rank in range(4):
        state = package.load(checkpoint, rank=rank)
        for name, array in state.tensors.items():
            seen.setdefault(name, []).append(array)
    assert sorted(seen) == sorted(tensors)
    for name, pieces in seen.items():
        full = tensors[name]
        if name.endswith(".weight") or name.startswith("blk.") and "braces" in name:  # split
            assert len(pieces) == 2
            np.testing.assert_array_equal(np.concatenate(pieces), full)
        else:
            for piece in pieces:
                np.testing.assert_array_equal(piece, full)


def test_hostile_strings_appear_only_as_literals_in_generated_modules(hostile_build):
    result, _, _ = hostile_build
    _only_literals(result.files, hostile_targets())


@pytest.mark.parametrize("spelling", ["yaml", "toml"])
def test_names_no_checkpoint_may_carry_still_appear_only_as_literals(tmp_path, spelling):
    """Line breaks, carriage returns and other controls in a family's tensor names (which no
    checkpoint partc reads may carry) are still written only as escaped literals."""
    family, config, _, _ = write_inputs(tmp_path, spelling, printable=False)
    assert check_family(family, config) == []
    result = compile_family(family, config,
                            Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                            CompileOptions(out=tmp_path / "build"))
    targets = hostile_targets(printable=False)
    assert any(not t.isprintable() for t in targets)
    _only_literals(result.files, targets)


_READS_LINE = re.compile(r"# \S.* (whole|narrow\(.*\)|cat\(.*\)) -> \[[\d, ]*\] \w+( .*)?")
"""A line of a rank module's READS comment table: `# <target>  <read> -> [shape] dtype`."""


def _only_literals(files: dict[str, str], targets: list[str]) -> None:
    """Every generated module is ASCII, calls only `_runtime`, and holds every target, the
    boundary identity and the model type as string constants."""
    modules = {p: t for p, t in files.items() if p.endswith(".py")}
    constants: set[str] = set()
    for path, source in modules.items():
        assert source.isascii(), path
        tree = ast.parse(source)
        constants |= {n.value for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assigned = {t.id for s in tree.body if isinstance(s, ast.Assign) for t in s.targets}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                assert ast.unparse(node.func).startswith("_runtime."), (path, ast.unparse(node))
            elif isinstance(node, ast.Attribute):
                assert isinstance(node.value, ast.Name) and node.value.id == "_runtime"
            elif isinstance(node, ast.Name):
                params = {a.arg for f in tree.body if isinstance(f, ast.FunctionDef)
                          for a in [*f.args.args, *filter(None, [f.args.kwarg])]}
                assert node.id in assigned | params | {"_runtime", "__name__"}, node.id
            assert not isinstance(node, ast.JoinedStr | ast.Lambda | ast.Subscript | ast.BinOp)
        assert source.splitlines() == source.split("\n")[:-1], "only \\n ends a line"
        for line in source.splitlines():
            if line.startswith("#"):  # the header, or a READS line naming a (hostile) target
                assert "import" not in line or line.startswith("# Generated by partc") or (
                    _READS_LINE.fullmatch(line))
    for target in targets:
        assert target in constants, target
    assert "id\"); __import__('os') #\n" in constants
    assert MODEL_TYPE in constants


def test_a_hostile_family_file_name_cannot_break_out_of_the_header_comment(tmp_path):
    family, config, _, _ = write_inputs(tmp_path, "yaml")
    sneaky = tmp_path / "fam\rimport os\r#.yaml"
    family.rename(sneaky)
    files = compile_family(sneaky, config).files
    for path, source in files.items():
        if path.endswith(".py"):
            first = source.split("\n")[0]
            assert "\r" not in first and first.startswith("# Generated by partc")
            assert "fam\\rimport os\\r#.yaml" in first  # escaped as in a string literal


@pytest.mark.parametrize(("name", "spelt"), [
    ("fam\u00e9.yaml", "fam\\xe9.yaml"), ("fam\u00e8.yaml", "fam\\xe8.yaml"),
    ("f\\am.yaml", "f\\\\am.yaml"), ("fam\u2028x.yaml", "fam\\u2028x.yaml"),
])
def test_a_family_file_name_outside_printable_ascii_is_escaped_in_the_header_not_lost(
        tmp_path, name, spelt):
    family, config, _, _ = write_inputs(tmp_path, "yaml")
    family = family.rename(tmp_path / name)
    files = compile_family(family, config).files
    for path, source in files.items():
        if path.endswith(".py"):
            first = source.split("\n")[0]
            assert first.isascii() and "from config.json (sha256 " in first, first
            assert f", {spelt} (sha256 " in first, first  # two such names stay apart
            ast.parse(source)


def test_hostile_names_where_identifiers_are_required_are_refused_by_the_schema(tmp_path):
    data = hostile_family()
    data["static"] = {"emb'\"\\\n": {"stage": "first"}}
    data["boundary"]["primary"]["role"] = "__import__('os')"
    family = tmp_path / "bad.yaml"
    family.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    messages = [e.message for e in check_family(family)]
    assert messages == [
        'key "emb\'\\"\\\\\\n" is not allowed: expected an identifier (letters, digits and `_`, '
        "not starting with a digit)",
        'expected an identifier (letters, digits and `_`, not starting with a digit), found '
        "\"__import__('os')\"",
    ]


def test_the_cli_reports_a_hostile_family_without_a_traceback(tmp_path):
    family, config, checkpoint, _ = write_inputs(tmp_path, "yaml")
    done = subprocess.run([sys.executable, "-m", "partc.cli", "check", str(family), "--config",
                           str(config), "--checkpoint", str(checkpoint), "--tp", "2", "--pp",
                           "2", "--format", "json"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["ok"], report["errors"]) == (True, [])
    assert len(report["stages"]) == 2  # a check with a topology carries the stage summary


# ---------------------------------------------------------------- the generated-code check

GOOD = '''"""doc"""
from __future__ import annotations
from partc import runtime as _runtime
A = ("x", -1, 2.5, None, True, {"k": [1]})
_TABLE = _runtime.RankTable(a=A)
def load(checkpoint, rank=None, **options):
    """doc"""
    return _runtime.load_rank(_TABLE, checkpoint, rank, **options)
'''


def test_the_shape_check_accepts_what_the_templates_emit():
    check_generated(GOOD, "m.py")


@pytest.mark.parametrize(("change", "message"), [
    (("from partc import runtime as _runtime", "import os"),
     "generated module m.py has an unexpected import `import os` at line 3"),
    (("from partc import runtime as _runtime", "import importlib"),
     "generated module m.py has an unexpected import `import importlib` at line 3"),
    (('A = ("x"', 'A = (__import__("os")'),
     "generated module m.py has a non-literal value for `A` at line 4"),
    (('A = ("x"', 'A = ("x" + "y"'),
     "generated module m.py has a non-literal value for `A` at line 4"),
    (('A = ("x"', 'A = (f"{1}"'),
     "generated module m.py has a non-literal value for `A` at line 4"),
    (("_TABLE = _runtime.RankTable(a=A)", "_TABLE = _runtime.load_rank(a=A)"),
     "generated module m.py has an import-time call of `_runtime.load_rank` at line 5"),
    (("_TABLE = _runtime.RankTable(a=A)", "_TABLE = _runtime.RankTable(a=print)"),
     "generated module m.py has an unexpected argument to _runtime.RankTable at line 5"),
    (('    """doc"""\n    return', '    """doc"""\n    import os\n    return'),
     "generated module m.py has a body other than `return _runtime.<function>(...)` in `load` "
     "at line 6"),
    (("return _runtime.load_rank(", "return open("),
     "generated module m.py has a return of something other than a `_runtime` call in `load` at "
     "line 8"),
    (("_runtime.load_rank(_TABLE,", "_runtime.load_rank(_TABLE.x,"),
     "generated module m.py has an unexpected argument in `load` at line 8"),
    (("_runtime.load_rank(_TABLE,", "_runtime.load_rank(os,"),
     "generated module m.py has an unexpected argument in `load` at line 8"),
    (("def load(checkpoint, rank=None,", "def load(checkpoint, rank=print(),"),
     "generated module m.py has a non-literal default in `load` at line 6"),
    (("def load(", "@staticmethod\ndef load("),
     "generated module m.py has an unexpected signature for `load` at line 7"),
    (("_TABLE = ", 'print("hi")\n_TABLE = '),
     "generated module m.py has an expression statement at line 5"),
    (("_TABLE = ", "for i in range(3):\n    pass\n_TABLE = "),
     "generated module m.py has an unexpected For statement at line 5"),
    (("_TABLE = ", "class A:\n    pass\n_TABLE = "),
     "generated module m.py has an unexpected ClassDef statement at line 5"),
    (("A = (", "A = B = ("),
     "generated module m.py has an assignment to something other than one name at line 4"),
])
def test_the_shape_check_refuses_anything_the_templates_never_emit(change, message):
    old, new = change
    assert old in GOOD
    with pytest.raises(EmitError) as caught:
        check_generated(GOOD.replace(old, new, 1), "m.py")
    assert caught.value.message == message
