"""`partc init`: every fixture's scaffold checks as written wherever its built-in family does,
whatever its config's spelling; `partc init --prove`: the layouts a checkpoint's shapes leave
open (a fused q/k/v's row order, a square Conv1D weight's orientation, a fused gate_up)
decided by `partc verify` against transformers' modeling code. The proven scaffold of GPT-2
(Conv1D, fused `c_attn`), Phi-3 (fused GQA `qkv_proj` and `gate_up_proj`) and Llama (KV heads
repeated at T = 4) checks and verifies at every T <= 4 its built-in family checks at, as
written, and its ranks read exactly the elements the built-in family's read (the built-in
families are verified on their own in tests/test_verify.py). What no candidate explains is
marked CHECK with verify's finding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import partc.scaffold.fused as fused
from partc.api import check_family, plan_family
from partc.cli.commands import verify_failures
from partc.cli.main import main
from partc.plan.topology import Topology
from partc.scaffold.family_text import scaffold
from partc.scaffold.prove import prove, read_share
from partc.verify.run import verify_family

from support import FULLSIZE, HF, QUANTIZED, ROOT, fullsize_checkpoint, hf

CHECK = "# partc init: CHECK:"
PROVEN = {"gpt2": {"layers.{unit}.attention": "component_major, [in, out]"},
          "phi3": {"layers.{unit}.attention": "component_major",
                   "layers.{unit}.mlp": "component_major"},
          "llama": {}}
"""The fixtures proven here and the layout each open group is proven to have."""


@pytest.fixture(scope="module")
def proven(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture's scaffold as `partc init --prove` writes it."""
    folder = tmp_path_factory.mktemp("proven")
    out = {}
    for name in PROVEN:
        path = folder / f"{name}.yaml"
        assert main(["init", "--checkpoint", str(hf(name)), "--out", str(path), "--prove",
                     "--format", "json"]) == 0
        out[name] = path
    return out


SHARED = ROOT.parent / "shared" / "fixtures" / "hf"
FIXTURES = sorted([*HF.iterdir(), *QUANTIZED.iterdir(), *(SHARED.iterdir() if SHARED.is_dir()
                                                            else ())])
"""Every tiny fixture checkpoint: tests/fixtures/{hf,quantized} and the shared ones."""


FULL = sorted(p.name for p in FULLSIZE.iterdir())
"""The full-size headers, DeepSeek-V3's with its MTP layer 61 past num_hidden_layers (an `mtp`
group of the scaffold, tests/test_init_mtp.py)."""


@pytest.mark.parametrize("folder", [
    *(f for f in FIXTURES if (f / "model.safetensors").is_file()),
    *(FULLSIZE / name for name in FULL)],
    ids=lambda f: f"{'shared/' * (SHARED in f.parents)}{f.parent.name}/{f.name}")
def test_every_fixtures_scaffold_checks_as_written_at_t_1_and_where_the_builtin_checks_at_4(
        folder: Path, tmp_path: Path) -> None:
    """Also DeepSeek-V2-Lite's full-size config, which spells head widths of its own
    (`v_head_dim`) and no `head_dim`: none is declared with a default (check took it for a
    misspelling)."""
    checkpoint = fullsize_checkpoint(folder.name, tmp_path) if folder.parent == FULLSIZE \
        else folder
    family = tmp_path / "family.yaml"
    family.write_text(scaffold(checkpoint, folder / "config.json").text)
    for tp in (1, 4):
        topology = Topology(tensor_parallel_size=tp)
        if tp == 1 or not check_family(None, folder / "config.json", checkpoint,
                                       topology=topology):
            assert check_family(family, folder / "config.json", checkpoint,
                                topology=topology) == []


def test_a_default_is_declared_over_fields_the_scaffold_declares(tmp_path: Path) -> None:
    """A per-head norm sized `[head_dim]` in a block the scaffold does not split: `head_dim`
    comes from its default, over `num_attention_heads`, which nothing else reads."""
    from safetensors.numpy import save_file

    zeros = np.zeros
    tensors = {"model.embed_tokens.weight": zeros((131, 64), np.float32),
               "model.norm.weight": zeros(64, np.float32),
               "lm_head.weight": zeros((131, 64), np.float32)}
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.q_norm.weight"] = zeros(16, np.float32)
        tensors[f"model.layers.{layer}.self_attn.mixer.weight"] = zeros((80, 64), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 131}))
    family = tmp_path / "family.yaml"
    text = scaffold(tmp_path, tmp_path / "config.json").text
    assert "  head_dim: {type: int, default: hidden_size // num_attention_heads}\n" in text
    assert "  num_attention_heads: int\n" in text
    family.write_text(text)
    assert check_family(family, tmp_path / "config.json", tmp_path) == []


def _legal(family: Path | None, name: str) -> list[int]:
    return [tp for tp in (1, 2, 3, 4) if not check_family(
        family, hf(name) / "config.json", hf(name), topology=Topology(tensor_parallel_size=tp))]


@pytest.mark.parametrize("name", sorted(PROVEN))
def test_a_proven_scaffold_checks_verifies_and_splits_as_the_builtin_family(
        name: str, proven: dict[str, Path]) -> None:
    text = proven[name].read_text()
    assert CHECK not in text
    sizes = _legal(proven[name], name)
    assert sizes == _legal(None, name)
    for group, label in PROVEN[name].items():
        block = text[text.index(f'name: "{group}"'):]
        assert f"# partc init --prove: {label}: verified against transformers at T=" + \
            ", ".join(map(str, sizes[1:])) + "\n" in block[:block.index("\n\n") + 1]
    assert 4 in sizes  # Llama's 2 KV heads over 4 ranks: kv_replication, as the built-in
    report = verify_family(proven[name], hf(name) / "config.json",
                           tensor_parallel_sizes=sizes, pipeline_parallel_size=1)
    assert [c.message for c in report.checks if not c.ok] == []
    for tp in sizes[1:]:
        shares = [read_share(plan_family(f, hf(name) / "config.json",
                                         Topology(tensor_parallel_size=tp), checkpoint=hf(name)))
                  for f in (proven[name], None)]
        assert shares[0] == shares[1], (tp, shares)
        assert shares[0] < tp - 0.5  # the layers are split, not replicated


def test_without_prove_an_open_layout_is_written_as_its_first_candidate_and_marked() -> None:
    result = scaffold(hf("gpt_neox"), hf("gpt_neox") / "config.json")
    (layout,) = result.open
    assert layout.module == "attention.query_key_value"
    assert [c.label for c in layout.candidates][:2] == ["component_major", "per_head"]
    line = next(x for x in result.text.splitlines() if "# component_major guessed" in x)
    assert f"{CHECK} the header leaves the layout of `attention.query_key_value` open " \
        "(component_major; per_head; grouped (2 groups))" in line


def test_what_no_candidate_explains_is_marked_with_verifys_finding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-NeoX's per-head q/k/v offered as component-major only: verify refuses it, and
    the scaffold keeps it marked CHECK with verify's message."""
    only = fused.attention_candidates

    def component_major_only(heads: int, kv: int, orientations: list[bool]
                             ) -> tuple[fused.Candidate, ...]:
        return only(heads, kv, orientations)[:1] + (fused.Candidate("component_major", None,
                                                                    True),)

    monkeypatch.setattr(fused, "attention_candidates", component_major_only)
    result = prove(hf("gpt_neox"), hf("gpt_neox") / "config.json", verify_failures)
    line = next(x for x in result.text.splitlines() if "# component_major written" in x)
    assert f"{CHECK} no layout partc verify accepts: every candidate refused; with the " \
        "first, T=2 x S=1: module `gpt_neox.layers.0.attention` (group " \
        "`layers.0.attention`), rank 0: the rank's part of the group is not separable" in line


SPLIT = {"gpt_oss": ("layers.{unit}.mlp.experts", "per_head"),
         "dbrx": ("layers.{unit}.ffn.experts.mlp", None),
         "deepseek_v2_qlora": ("layers.{unit}.attention.heads", None),
         "stablelm_qk": ("layers.{unit}.attention", None),
         "qwen2_vl": ("visual.{unit}.attention", "component_major"),
         "mamba": ("layers.{unit}.mixer", None)}
"""A fixture per kind of block the scaffold splits beside Llama's names, its group and the
layout --prove decides for it: gpt-oss's stacked experts (gate/up interleaved), DBRX's fused
[E * I, H] experts, DeepSeek's MLA heads, StableLM's per-head norm modules, Qwen2-VL's fused
vision qkv (and its merger's MLP, split too: the shares would differ otherwise), Mamba's
mixer."""


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_experts_mla_per_head_modules_and_vision_blocks_split_as_the_builtin_family(
        name: str, tmp_path: Path) -> None:
    """The proven scaffold checks where the built-in does, verifies against transformers at
    T = 2 and its ranks read the built-in's elements at every T it checks at."""
    group, layout = SPLIT[name]
    result = prove(hf(name), hf(name) / "config.json", verify_failures)
    block = result.text[result.text.index(f'name: "{group}"'):]
    block = block[:block.index("\n\n")]
    assert CHECK not in block
    if layout is not None:
        assert f"# partc init --prove: {layout}: verified against transformers" in block
    family = tmp_path / "family.yaml"
    family.write_text(result.text)
    sizes = _legal(family, name)
    assert sizes == _legal(None, name)
    report = verify_family(family, hf(name) / "config.json", tensor_parallel_sizes=[2],
                           pipeline_parallel_size=1)
    assert [c.message for c in report.checks if not c.ok] == []
    for tp in sizes[1:]:
        shares = [read_share(plan_family(f, hf(name) / "config.json",
                                         Topology(tensor_parallel_size=tp), checkpoint=hf(name)))
                  for f in (family, None)]
        assert shares[0] == shares[1], (tp, shares)
