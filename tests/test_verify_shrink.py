"""`partc verify` checks every topology the real config compiles at, and says which it skips.

The oracle for "compiles" is `partc check` (check_family with a topology) on the real config
and on the shrunk reference config: whatever the real model compiles at, the reference model
verify builds must compile at too.
"""

from __future__ import annotations

import json
import math

import pytest

from partc.api import check_family
from partc.cli.main import main
from partc.plan.topology import Topology
from partc.verify.shrink import reference_config

from support import FULLSIZE, hf


def _topology(tp: int, pp: int = 1) -> Topology:
    return Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp)


@pytest.fixture
def no_reference_model(monkeypatch):
    """Fail the test if verify gets as far as building a reference model."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("verify built a reference model from a bad input")
    monkeypatch.setattr("partc.verify.run.build_reference", refuse)


@pytest.mark.parametrize("name", ["Llama-3.1-70B", "Qwen2.5-72B", "Mixtral-8x7B-v0.1",
                                  "Qwen3-30B-A3B"])
def test_a_shrunk_reference_compiles_at_every_t_and_s_the_real_config_compiles_at(
        tmp_path, name):
    real = FULLSIZE / name / "config.json"
    sizes = [tp for tp in range(1, 9) if check_family(None, real, topology=_topology(tp)) == []]
    assert sizes[:4] == [1, 2, 3, 4]  # every one of these GQA models compiles up to T=4 at least
    assert check_family(None, real, topology=_topology(1, 4)) == []
    small, notes = reference_config(json.loads(real.read_text()), tensor_parallel_size=max(
        sizes), pipeline_parallel_size=4)
    assert small["num_hidden_layers"] == 4 and any(n.startswith("shrunk") for n in notes)
    reference = tmp_path / "config.json"
    reference.write_text(json.dumps(small))
    for tp in sizes:
        assert check_family(None, reference, topology=_topology(tp)) == [], (tp, notes)
    assert check_family(None, reference, topology=_topology(1, 4)) == []


def test_verify_checks_t_4_and_8_of_a_real_gqa_model(capsys):
    status = main(["verify", "--config", str(FULLSIZE / "Llama-3.1-70B" / "config.json"),
                   "--tp", "4,8", "--pp", "1", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["ok"] is True, report
    assert {(c["tp"], c["pp"]) for c in report["checks"]} == {(4, 1), (8, 1)}
    assert any(c["tp"] == 8 and c["module"] == "model.layers.0.self_attn"
               for c in report["checks"])
    # all 8 KV heads kept (one per rank at T=8), 8 query heads per KV head as in the real model
    heads = next(n for n in report["notes"] if n.startswith("shrunk attention heads"))
    assert heads.endswith(": hidden_size 8192 -> 1024") and "num_key_value_heads" not in heads


def test_verify_lists_every_size_the_config_does_not_compile_at(capsys):
    config = hf("llama") / "config.json"  # 4 heads, 2 KV heads: T = 1, 2, and 4 repeating them
    status = main(["verify", "--config", str(config), "--pp", "1"])
    out = capsys.readouterr().out
    assert status == 0
    # one line per reason: a T the KV heads do not divide (3, 5, 7), and a T the 4 query
    # heads do not fill (6, 8); the first one's error shown
    skipped = [line for line in out.splitlines() if line.startswith("skipped T=")]
    assert [line.split(":", 1)[0] for line in skipped] == ["skipped T=3, 5, 7 x S=1",
                                                           "skipped T=6, 8 x S=1"]
    assert skipped[0].startswith(
        "skipped T=3, 5, 7 x S=1: the config does not compile at T=3 x S=1: "
        "architectures/llama.yaml:50:5: group `layers.0.attention` cannot be sharded over "
        "tensor_parallel_size 3: it has 2 partition units (num_key_value_heads), fewer than 3 "
        "ranks, so KV replication applies and ")
    assert "not divisible by tensor_parallel_size 3" in skipped[0]
    assert "not divisible by tensor_parallel_size 6" in skipped[1]
    assert out.splitlines()[-1] == (
        "verified llama (llama) at T=1 x S=1, T=2 x S=1, T=4 x S=1: every check holds; not "
        "checked: " + ", ".join(f"T={tp} x S=1" for tp in (3, 5, 6, 7, 8))
        + " (skipped, see above)")


def _errors(capsys, *argv: str) -> tuple[int, list[str]]:
    status = main(list(argv))
    err = capsys.readouterr().err
    return status, [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize(("given", "check"), [
    (["--tp", "1,3", "--pp", "1"], ["--tp", "3"]),
    (["--tp", "1", "--pp", "5"], ["--pp", "5"]),
])
def test_a_size_given_that_the_config_does_not_compile_at_is_checks_error(
        capsys, no_reference_model, given, check):
    config = str(hf("llama") / "config.json")
    status, errors = _errors(capsys, "verify", "--config", config, *given)
    assert status == 1 and len(errors) == 1, errors
    assert (status, errors) == _errors(capsys, "check", "--config", config, *check)


def test_the_default_pipeline_split_is_skipped_with_checks_reason_for_a_one_layer_model(
        tmp_path, capsys):
    config = json.loads((hf("llama") / "config.json").read_text())
    config["num_hidden_layers"] = 1
    path = tmp_path / "one_layer.json"
    path.write_text(json.dumps(config))
    status = main(["verify", "--config", str(path), "--tp", "1", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["ok"] is True
    assert report["skipped"] == [{"tp": 1, "pp": 2, "reason": (
        "the config does not compile at T=1 x S=2: pipeline_parallel_size 2 exceeds the 1 "
        "execution units of the model; every stage needs at least one unit (use --pp 1 or "
        "fewer)")}]



def _scaled(name: str, top: dict[str, object],
            sections: dict[str, dict[str, object]] | None = None) -> dict[str, object]:
    """A tiny fixture's config with full-size sizes written over it."""
    config = json.loads((hf(name) / "config.json").read_text())
    config.update(top)
    for section, fields in (sections or {}).items():
        config[section] = {**config[section], **fields}
    return config


def _reference_elements(monkeypatch) -> list[int]:
    """The number of elements of every reference checkpoint verify writes (by safetensors)."""
    from safetensors import safe_open

    from partc.verify import run

    counted: list[int] = []
    build = run.build_reference

    def counting(config, folder, *args, **kwargs):
        build(config, folder, *args, **kwargs)
        with safe_open(str(folder / "model.safetensors"), "np") as handle:
            counted.append(sum(math.prod(handle.get_slice(n).get_shape())
                               for n in handle.keys()))  # noqa: SIM118
    monkeypatch.setattr(run, "build_reference", counting)
    return counted


@pytest.mark.parametrize(("name", "top", "sections", "shrunk"), [
    # CodeGen-350M's sizes: GPT-2's spelling (n_embd, n_head, n_layer), ~350M parameters
    ("codegen", {"n_embd": 1024, "n_head": 16, "n_layer": 20, "n_inner": 4096,
                 "rotary_dim": 32, "vocab_size": 51200, "n_positions": 2048, "n_ctx": 2048},
     None, ["n_embd 1024 -> ", "n_layer 20 -> 2", "n_inner 4096 -> 128", "rotary_dim 32 -> ",
            "vocab_size 51200 -> 131"]),
    # DBRX's sizes: d_model, n_heads, n_layers and the sections' kv_n_heads, experts, widths
    ("dbrx", {"d_model": 6144, "n_heads": 48, "n_layers": 40, "num_key_value_heads": 8,
              "vocab_size": 100352, "max_seq_len": 32768},
     {"attn_config": {"kv_n_heads": 8}, "ffn_config": {
         "ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4, "hidden_size": 6144}},
     ["d_model 6144 -> ", "n_layers 40 -> 2", "ffn_config.moe_num_experts 16 -> 8",
      "ffn_config.ffn_hidden_size 10752 -> 32", "max_seq_len 32768 -> 128"]),
])
def test_a_config_spelling_its_sizes_as_its_own_class_does_is_shrunk(
        tmp_path, monkeypatch, capsys, name, top, sections, shrunk):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_scaled(name, top, sections)))
    counted = _reference_elements(monkeypatch)
    status = main(["verify", "--config", str(config), "--tp", "2", "--pp", "2",
                   "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["ok"] is True, report
    notes = " ".join(report["notes"])
    assert all(part in notes for part in shrunk), report["notes"]
    assert len(counted) == 1 and counted[0] < 2_000_000, counted  # full size: 10^8 and more


@pytest.mark.parametrize("name", ["DeepSeek-V2-Lite", "DeepSeek-V3"])
def test_a_deepseek_config_with_null_q_lora_rank_verifies_with_the_built_in_family(
        name, tmp_path):
    # `"q_lora_rank": null` (DeepSeek-V2-Lite as released; DeepSeek-V3's config written that
    # way): the built-in family takes q_proj, as transformers does, and verify proves it
    from partc.verify.run import verify_family

    config = json.loads((FULLSIZE / name / "config.json").read_text())
    config["q_lora_rank"] = None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = verify_family(None, path, tensor_parallel_sizes=[1, 2], pipeline_parallel_size=2)
    assert report.ok, report.first_failure
    assert {c.tp for c in report.checks} == {1, 2} and any(c.pp == 2 for c in report.checks)
    assert any(c.module.endswith("self_attn") for c in report.checks)


# ---------------------------------------------------------------- the family's own spellings

_MADE_UP = {"model_type": "made_up", "width": 4096, "heads": 32, "kv": 8, "head_width": 128,
            "depth": 40, "vocab_size": 50000, "adapter": {"rank": 5000}}
"""A config no transformers class describes: only a family says what its keys mean."""
_MADE_UP_FAMILY = {"hidden_size": ("width",), "num_attention_heads": ("heads",),
                   "num_key_value_heads": ("kv",), "head_dim": ("head_width",),
                   "num_hidden_layers": ("n_layer", "depth"),
                   "vocab_size": ("vocab_size",), "adapter_rank": ("adapter.rank",)}
"""Its family's `int` fields (as `family_sizes` gives them): usual names read from other keys
(the second source of `num_hidden_layers` is the one present), and a field of its own."""


def test_the_sizes_a_family_reads_under_usual_names_are_shrunk_in_the_configs_spelling():
    out, notes = reference_config(_MADE_UP, tensor_parallel_size=2, sizes=_MADE_UP_FAMILY)
    # 2 KV heads (one per rank at T=2) of 4 query heads each, as in the config, 16 wide
    assert {k: out[k] for k in ("width", "heads", "kv", "head_width", "depth",
                                "vocab_size")} == {
        "width": 128, "heads": 8, "kv": 2, "head_width": 16, "depth": 2, "vocab_size": 131}
    assert notes[:2] == [
        "shrunk attention heads (query heads per KV head kept, a KV head per rank): "
        "head_width 128 -> 16, width 4096 -> 128, heads 32 -> 8, kv 8 -> 2",
        "shrunk layers (first dense layers and sparse steps kept, a layer per stage): "
        "depth 40 -> 2"]
    # a size no rule knows is kept, and said to be
    assert out["adapter"] == {"rank": 5000}
    assert notes[-1] == ("kept at full size (no shrink rule rewrites them): `adapter.rank` "
                         "5000 (`adapter_rank`)")
    # without the family the keys mean nothing: only the vocabulary is shrunk
    plain, _ = reference_config(_MADE_UP)
    assert (plain["width"], plain["depth"], plain["vocab_size"]) == (4096, 40, 131)


def test_a_tiny_config_with_one_huge_size_the_family_reads_is_shrunk():
    tiny = {**_MADE_UP, "width": 64, "heads": 4, "kv": 2, "head_width": 16, "depth": 2,
            "vocab_size": 131, "adapter": {"rank": 8}}
    assert reference_config(tiny, sizes=_MADE_UP_FAMILY) == ({**tiny, "dtype": "float32"}, [])
    huge = {**tiny, "head_width": 2**20}  # beyond LARGE's head_dim: the config is shrunk
    out, notes = reference_config(huge, sizes=_MADE_UP_FAMILY)
    assert out == {**tiny, "dtype": "float32"}
    assert notes == ["shrunk attention heads (query heads per KV head kept, a KV head per "
                     "rank): head_width 1048576 -> 16"]
