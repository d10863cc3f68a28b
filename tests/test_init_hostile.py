"""Hostile names through `partc init`: a checkpoint whose tensor names, folder name and
`model_type` hold YAML and template metacharacters gets a scaffold that a safe loader reads,
`partc check` accepts, and that holds the same data as the scaffold of plain names (each name's
braces doubled, as a family template writes a literal brace); names and sizes the family cannot
represent are refused with one located error naming the tensor, nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

from partc.cli.main import main

from support import hf

META = ('x: y #z "q" \\b {unit} }{ {{ true null 1e3 02 \u0663 \' '
        '!!python/object/apply:exec ["open(\'planted\', \'w\')"] &a *a ? - | > % @ `')
"""Every metacharacter the scaffold must carry in a name: `: `, ` #`, quotes, a backslash,
template braces (a field `{unit}`, unbalanced, doubled), YAML words and numbers, a leading zero,
a non-ASCII digit, a Python tag PyYAML's unsafe_load would run (it writes `planted`), anchors,
aliases and indicators; no `.` (a name's parts are split at dots)."""
PLAIN = "QQQQ"
"""The plain stand-in for META: the scaffolds of the two checkpoints differ only in it."""


def _checkpoint(folder: Path, marker: str, model_type: str) -> Path:
    """The tiny Llama checkpoint with `marker` in its decoder prefix (`model<marker>.layers.`),
    in a module of every layer, a module outside the layers and a tensor of no module, written
    by the safetensors library; its config.json with `model_type`."""
    folder.mkdir(parents=True)
    config = json.loads((hf("llama") / "config.json").read_text())
    config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {name.replace("model.", f"model{marker}.", 1): array
               for name, array in load_file(hf("llama") / "model.safetensors").items()}
    for layer in (0, 1):
        tensors[f"model{marker}.layers.{layer}.extra{marker}.weight"] = np.zeros(4, np.float32)
    tensors[f"side{marker}.weight"] = np.zeros(4, np.float32)
    tensors[f"loose{marker}"] = np.zeros(4, np.float32)
    save_file(tensors, folder / "model.safetensors")
    return folder


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(args)
    return status, capsys.readouterr().err


def _replaced(data: Any, old: str, new: str) -> Any:
    """`data` with `old` replaced by `new` in every string (keys too)."""
    if isinstance(data, dict):
        return {_replaced(k, old, new): _replaced(v, old, new) for k, v in data.items()}
    if isinstance(data, list):
        return [_replaced(v, old, new) for v in data]
    return data.replace(old, new) if isinstance(data, str) else data


def test_a_scaffold_of_hostile_names_loads_safely_checks_and_equals_the_plain_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the tag names a file relative to the test's folder, so the model type stays within
    # the family format's 128 characters wherever pytest puts tmp_path
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / "planted"
    tag = '!!python/object/apply:os.system ["touch planted"]'
    hostile = _checkpoint(tmp_path / f"ck\n{tag}\n", META, f"llama\n{tag}\n")
    plain = _checkpoint(tmp_path / "plain", PLAIN, f"llama\n{tag}\n")
    documents = []
    for checkpoint in (hostile, plain):
        out = tmp_path / f"{len(documents)}.yaml"
        status, err = _run(["init", "--checkpoint", str(checkpoint), "--out", str(out)], capsys)
        assert status == 0, err
        status, err = _run(["check", str(out), "--checkpoint", str(checkpoint)], capsys)
        assert status == 0, err
        text = out.read_text()
        assert text.isascii()
        documents.append(yaml.safe_load(text))
        assert yaml.unsafe_load(text) == documents[-1]
        assert not planted.exists()
    assert documents[0]["model_types"] == [f"llama\n{tag}\n"]
    literal = META.replace("{", "{{").replace("}", "}}")  # a template's literal braces
    assert documents[0] == _replaced(documents[1], PLAIN, literal)
    assert any(PLAIN in json.dumps(group) for group in documents[1]["parameters"])


WORDS = ["true", "null", "Null", "~", "no", "yes", "off", "y", "1e3", "02", "0o10", "0x1F",
         "1_000", "1:20", "-", "- a", "? x", "[a]", "&a", "*a", "!t", "%x", "@x", "`x", "a: b",
         "a #b", "'", '"', "{unit}", "}{"]
"""Whole names YAML (1.1 or 1.2) reads as something else, or that start YAML syntax."""
IDENTIFIER_WORDS = ["true", "null", "Null", "no", "yes", "off", "y"]
"""Those also written as a module's parameter names (keys of `params:`)."""


def test_names_that_are_yaml_words_or_syntax_are_written_quoted_and_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    shutil.copy(hf("llama") / "config.json", checkpoint / "config.json")
    tensors = load_file(hf("llama") / "model.safetensors")
    for word in WORDS:
        tensors[word] = np.zeros(2, np.float32)
        tensors[f"m.{word}.weight"] = np.zeros(2, np.float32)
        for layer in (0, 1):
            tensors[f"model.layers.{layer}.mlp.{word}.weight"] = np.zeros(2, np.float32)
    for word in IDENTIFIER_WORDS:
        tensors[f"p.{word}"] = np.zeros(2, np.float32)
    save_file(tensors, checkpoint / "model.safetensors")
    out = tmp_path / "family.yaml"
    status, err = _run(["init", "--checkpoint", str(checkpoint), "--out", str(out)], capsys)
    assert status == 0, err
    status, err = _run(["check", str(out), "--checkpoint", str(checkpoint)], capsys)
    assert status == 0, err
    data = yaml.safe_load(out.read_text())
    params = next(g["params"] for g in data["parameters"] if g.get("module") == "p")
    assert sorted(params) == sorted(IDENTIFIER_WORDS)


def _digest(folder: Path) -> str:
    """sha256 over the folder's files (names and bytes)."""
    digest = hashlib.sha256()
    for file in sorted(folder.rglob("*")):
        digest.update(str(file).encode() + (file.read_bytes() if file.is_file() else b""))
    return digest.hexdigest()


REFUSED = {  # case -> (tensor renamed or added, the error's words)
    "leading zero": (("layers.1.", "layers.01."),
                     "tensor `model.layers.01.input_layernorm.weight` of {ck} numbers a "
                     "repetition `01`; expected ASCII digits without a leading zero"),
    "arabic digit": (("layers.1.", "layers.\u0661."),
                     "tensor `model.layers.\\u0661.input_layernorm.weight` of {ck} numbers a "
                     "repetition `\\u0661`; expected ASCII digits"),
    "expert number": ("model.layers.0.mlp.experts.007.w.weight",
                      "tensor `model.layers.0.mlp.experts.007.w.weight` of {ck} numbers a "
                      "repetition `007`"),
    "long name": ("a" * 900 + "{}" * 20 + ".weight",
                  f"tensor `{'a' * 80}...` of {{ck}} has a name of 947 characters (987 as a "
                  "family template, braces doubled); partc init writes names of at most 936"),
    "too large": ([f"{n:04}{'n' * 900}.weight" for n in range(600)],
                  "the scaffold of {ck} would be "),
    "parameter name": ("m.a-b", "tensor `m.a-b` of {ck} is parameter `a-b` of module `m`; a "
                       "family names a module's parameters by identifiers"),
    "empty part": ("model..x.weight", "tensor `model..x.weight` of {ck} has an empty dotted "
                   "part"),
    "loose tensors": ([f"loose{n}" for n in range(20_000)],
                      "partc init found 20003 tensors outside the layer repetitions in {ck}; "
                      "it writes at most 1024"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_names_and_counts_a_family_cannot_hold_are_refused_naming_the_tensor(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    change, words = REFUSED[case]
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    shutil.copy(hf("llama") / "config.json", checkpoint / "config.json")
    tensors = load_file(hf("llama") / "model.safetensors")
    if isinstance(change, tuple):
        tensors = {name.replace(*change): array for name, array in tensors.items()}
    else:
        for name in [change] if isinstance(change, str) else change:
            tensors[name] = np.zeros(1, np.float32)
    save_file(tensors, checkpoint / "model.safetensors")
    before = _digest(tmp_path)
    status, err = _run(["init", "--checkpoint", str(checkpoint), "--out",
                        str(tmp_path / "ck" / "family.yaml")], capsys)
    assert status == 1, err
    assert err.startswith(f"error: {checkpoint}: "), err
    assert words.format(ck=checkpoint) in err
    assert "Traceback" not in err
    assert _digest(tmp_path) == before
