"""A misspelt declaration is one error at the declaration; a misspelt use, one at each use.

When every use spells a name alike and the one declaration close to it is used nowhere, the
declaration is the odd one out: partc says so there, once, with the uses counted and located,
instead of one error per use suggesting to respell the uses as the typo.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from partc.api import check_family
from partc.errors import PartcError

from support import ROOT, edited_family

LLAMA = ROOT / "architectures" / "llama.yaml"


def line_of(path: Path, text: str) -> int:
    """The 1-based line of the one line of `path` holding `text`."""
    lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def errors_of(path: Path) -> list[PartcError]:
    """Every error `partc check` gives for a family file, sorted by location."""
    return sorted(check_family(path), key=PartcError.sort_key)


def test_a_misspelt_declaration_is_one_error_at_its_line_counting_every_use(tmp_path):
    family = edited_family(tmp_path, "llama", "  intermediate_size: int",
                           "  intermediat_size: int")
    uses = LLAMA.read_text().count("intermediate_size") - 1  # the declaration aside
    assert uses == 6
    errors = errors_of(family)
    assert len(errors) == 1, [str(e) for e in errors]
    (error,) = errors
    assert error.location is not None
    assert (error.location.file, error.location.line) == (
        str(family), line_of(family, "  intermediat_size: int"))
    assert error.pointer == "/config/intermediat_size"
    first_use = line_of(family, "    units: intermediate_size")
    assert error.message.startswith(
        "config field `intermediat_size` is declared but used nowhere, while "
        f"`intermediate_size` is used {uses} times but not declared ({family}:{first_use}:")
    assert error.message.endswith(
        "and 3 more); expected the declaration spelt as its uses: rename `intermediat_size` to "
        "`intermediate_size` under `config`")
    assert "did you mean" not in error.message


def test_a_misspelt_declaration_read_by_defaults_and_the_boundary_counts_those_uses(tmp_path):
    family = edited_family(tmp_path, "llama", "  hidden_size: int", "  hiden_size: int")
    (error,) = errors_of(family)
    assert error.location is not None and error.location.line == line_of(
        family, "  hiden_size: int")
    uses = LLAMA.read_text().count("hidden_size") - 1
    default = line_of(family, "head_dim: {type: int, default: hidden_size")  # a default
    assert f"`hidden_size` is used {uses} times but not declared ({family}:{default}:" in (
        error.message)
    assert "rename `hiden_size` to `hidden_size`" in error.message


def test_a_misspelt_derived_value_is_reported_at_its_declaration(tmp_path):
    family = edited_family(tmp_path, "llama", "\nconfig:\n",
                           "\nderived:\n  kv_head: num_key_value_heads\nconfig:\n")
    text = family.read_text().replace("units: num_key_value_heads ", "units: kv_heads ")
    text = text.replace("heads: num_key_value_heads", "heads: kv_heads")
    family.write_text(text)
    uses = text.count("kv_heads")
    assert uses >= 2
    (error,) = errors_of(family)
    assert error.location is not None and error.location.line == line_of(
        family, "  kv_head: num_key_value_heads")
    assert error.message.startswith(
        f"derived value `kv_head` is declared but used nowhere, while `kv_heads` is used "
        f"{uses} times but not declared")
    assert error.message.endswith("rename `kv_head` to `kv_heads` under `derived`")


def test_a_typo_at_the_uses_of_a_used_field_is_reported_at_each_use_with_its_hint(tmp_path):
    family = edited_family(tmp_path, "llama", "          weight: [hidden_size, intermediate_size]",
                           "          weight: [hidden_size, intermediat_size]")
    family.write_text(family.read_text().replace(
        "weight: [intermediate_size, hidden_size]\n          bias: {shape: [intermediate_size], "
        "when: mlp_bias}\n      - module: \"model.layers.{unit}.mlp.up_proj\"",
        "weight: [intermediate_size, hidden_size]\n          bias: {shape: [intermediat_size], "
        "when: mlp_bias}\n      - module: \"model.layers.{unit}.mlp.up_proj\"", 1))
    errors = errors_of(family)
    lines = [line_of(family, "bias: {shape: [intermediat_size]"),
             line_of(family, "weight: [hidden_size, intermediat_size]")]
    assert [e.location.line if e.location else 0 for e in errors] == lines  # both uses
    for error in errors:
        assert error.message.startswith(
            "a shape uses unknown name `intermediat_size`; did you mean `intermediate_size`? ")


def test_check_on_the_command_line_names_the_declaration_once_without_a_traceback(tmp_path):
    family = edited_family(tmp_path, "llama", "  intermediate_size: int",
                           "  intermediat_size: int")
    done = subprocess.run([sys.executable, "-m", "partc.cli", "check", str(family)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    where = f"{family}:{line_of(family, '  intermediat_size: int')}:"
    assert errors[0].startswith(f"error: {where}")
    assert "`intermediat_size` is declared but used nowhere" in errors[0]
    assert "`intermediate_size` is used 6 times" in errors[0]
