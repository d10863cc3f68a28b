"""`partc verify`: every built-in family's split checked against transformers' modeling code.

The oracle is Hugging Face transformers itself (its modules run on masked checkpoints it loads
with its own on-disk conversion), never partc's numpy executor. Wrong declarations of existing
families are refused either statically (`partc check`) or semantically (verify), each with the
message (or the failing module, group and rank) asserted.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from partc.api import check_family
from partc.cli.main import main
from partc.parallel.specs import ShardingPolicy
from partc.plan.topology import Topology
from partc.verify.run import verify_family
from partc.verify.shrink import is_large, reference_config

from support import HF_MODELS, ROOT, hf

ARCHITECTURES = ROOT / "architectures"


def _family(name: str) -> str:
    config = json.loads((hf(name) / "config.json").read_text())
    return str(config["model_type"])


# (embedding, final norm, first attention) module of the families not named `model.*`
MODULES = {
    "gpt_neox": ("gpt_neox.embed_in", "gpt_neox.final_layer_norm",
                 "gpt_neox.layers.0.attention"),
    "falcon": ("transformer.word_embeddings", "transformer.ln_f",
               "transformer.h.0.self_attention"),
    "bloom": ("transformer.word_embeddings", "transformer.ln_f",
              "transformer.h.0.self_attention"),
    "gpt2": ("transformer.wte", "transformer.ln_f", "transformer.h.0.attn"),
    "phi": ("model.embed_tokens", "model.final_layernorm", "model.layers.0.self_attn"),
    "codegen": ("transformer.wte", "transformer.ln_f", "transformer.h.0.attn"),
    "dbrx": ("transformer.wte", "transformer.norm_f", "transformer.blocks.0.norm_attn_norm"),
}


@pytest.mark.parametrize("name", HF_MODELS)
def test_every_built_in_family_passes_verify_at_t_1_2_4_and_a_pipeline_split(name):
    # over 4 ranks 2 KV heads are too few: the attention group is replicated (and checked as
    # such) under replicate-unsupported; DeepSeek's MLA splits by its 4 heads
    report = verify_family(None, hf(name) / "config.json", tensor_parallel_sizes=[1, 2, 4],
                           pipeline_parallel_size=2,
                           policy=ShardingPolicy.REPLICATE_UNSUPPORTED)
    assert report.ok, report.first_failure
    assert {(c.tp, c.pp) for c in report.checks} == {(1, 1), (2, 1), (4, 1), (1, 2)}
    modules = {c.module for c in report.checks if c.tp == 4}
    embed, norm, attention = MODULES.get(name, ("model.embed_tokens", "model.norm",
                                                "model.layers.0.self_attn"))
    assert {embed, norm, attention} <= modules
    split = [c for c in report.checks if c.tp == 2 and c.module == attention]
    assert split and all(c.rank is None and c.group for c in split)  # summed over the ranks
    assert all(c.max_error <= c.tolerance for c in report.checks)


def test_codegen_verifies_at_t_8_with_two_heads_of_one_mp_num_group_per_rank():
    """Past T=4 where the heads allow (issue 35): the sweep above stops at 4; CodeGen's 16 heads
    split over 8 ranks, beyond its 4 `mp_num` groups. DBRX (4 query heads over 2 KV heads) and
    DeepSeek-V2 (4 MLA heads) have no legal T in 5..8; Mamba's sweep is in tests/test_ssm.py."""
    report = verify_family(None, hf("codegen") / "config.json", tensor_parallel_sizes=[8],
                           pipeline_parallel_size=1)
    assert report.ok, report.first_failure
    assert {(c.tp, c.pp) for c in report.checks} == {(8, 1)}
    split = [c for c in report.checks if c.module == "transformer.h.0.attn"]
    assert split and all(c.rank is None and c.group == "layers.0.attention" for c in split)
    assert all(c.max_error <= c.tolerance for c in report.checks)


def test_kv_replication_verifies_at_more_ranks_than_kv_heads(tmp_path):
    family = ARCHITECTURES / "llama.yaml"  # the built-in: `kv_replication: true`
    report = verify_family(family, hf("llama") / "config.json", tensor_parallel_sizes=[4],
                           pipeline_parallel_size=1)
    assert report.ok, report.first_failure
    attention = [c for c in report.checks if c.module == "model.layers.0.self_attn"]
    assert attention[0].group == "layers.0.attention" and attention[0].max_error > 0
    assert report.skipped == ({"tp": 1, "pp": 1, "reason": "no pipeline split asked for (S=1)",
                               "check": "pipeline"},)


# ---------------------------------------------------------------- wrong declarations

# (case, fixture, family file, text replaced, replacement, T, how it is refused, expected):
# "check" cases assert the static message; "verify" cases the failing module, group and rank.
WRONG = [
    ("phi3 qkv segments in the wrong order", "phi3", "phi3.yaml",
     "        - num_attention_heads * head_dim\n        - num_key_value_heads * head_dim\n"
     "        - num_key_value_heads * head_dim\n"
     "      heads: [num_attention_heads, num_key_value_heads, num_key_value_heads]",
     "        - num_key_value_heads * head_dim\n        - num_attention_heads * head_dim\n"
     "        - num_key_value_heads * head_dim\n"
     "      heads: [num_key_value_heads, num_attention_heads, num_key_value_heads]",
     2, "verify", ("model.layers.0.self_attn", r"layers\.0\.attention", 0)),
    # an attention_heads group that splits its projections without `heads:` is refused
    # statically now (no partition unit may cut a head), before verify would catch the cut
    ("llama attention by query heads without heads hints", "llama", "llama.yaml",
     None, None, 4, "check", "over `units: num_attention_heads` but it states no `heads:`"),
    # a split axis that is no multiple of the group's units (down_proj's axis 0 is the hidden
    # size, 64, in a group of 128 intermediate channels) is refused statically now: before,
    # the units were narrowed to their gcd with it and only verify caught the wrong axis
    ("llama down_proj declared column", "llama", "llama.yaml",
     'mlp.down_proj"\n        sharding: row', 'mlp.down_proj"\n        sharding: column',
     2, "check", "`model.layers.0.mlp.down_proj.weight` is split on axis 0, of 64 elements, "
     "which is not a multiple of group `layers.0.mlp`'s 128 partition units (intermediate_size)"),
    # a square o_proj split on its output axis has the right multiples: only verify sees it
    ("llama o_proj declared column", "llama", "llama.yaml",
     'self_attn.o_proj"\n        sharding: row', 'self_attn.o_proj"\n        sharding: column',
     2, "verify", ("model.layers.0.self_attn", r"layers\.0\.attention", 0)),
    ("gpt_oss interleaved gate_up declared as two contiguous segments", "gpt_oss",
     "gpt_oss.yaml",
     "        shape: [num_local_experts, hidden_size, 2 * intermediate_size]\n"
     "        sharding: {partitioned: 2}",
     "        shape: [num_local_experts, hidden_size, 2 * intermediate_size]\n"
     "        sharding: {partitioned_segments: {axis: 2, segments: [intermediate_size, "
     "intermediate_size]}}",
     2, "verify", ("model.layers.0.mlp", r"layers\.0\.experts", 0)),
    ("qwen3_moe expert down_proj split on its output axis", "qwen3_moe", "qwen3_moe.yaml",
     'experts.{expert}.down_proj"\n        sharding: row',
     'experts.{expert}.down_proj"\n        sharding: column',
     2, "verify", ("model.layers.0.mlp", r"layers\.0\.experts\.\d+", 0)),
    ("phi3 qkv segments that miss the v segment", "phi3", "phi3.yaml",
     "        - num_key_value_heads * head_dim\n"
     "      heads: [num_attention_heads, num_key_value_heads, num_key_value_heads]",
     "      heads: [num_attention_heads, num_key_value_heads]",
     2, "check", "segments [64, 32] sum to 96 but axis 0 has 128 elements"),
    ("llama kv_replication without heads hints", "llama", "llama.yaml",
     None, None, 4, "check", "over `units: num_key_value_heads` but it states no `heads:`"),
    # issue 35: MLA without q-LoRA (`"q_lora_rank": null`)
    ("deepseek_v2 o_proj declared column", "deepseek_v2", "deepseek_v2.yaml",
     'self_attn.o_proj"\n        sharding: row', 'self_attn.o_proj"\n        sharding: column',
     2, "verify", ("model.layers.0.self_attn", r"layers\.0\.attention\.heads", 0)),
    ("deepseek_v2 q-LoRA chosen by comparing a null rank with a number", "deepseek_v2",
     "deepseek_v2.yaml", "        when: q_lora_rank != null\n        sharding: replicated\n"
     "        params:\n", "        when: q_lora_rank > 0\n        sharding: replicated\n"
     "        params:\n", 2, "check",
     "deepseek_v2.yaml:66:9: `>` needs two integers or two strings, found null and int (0) "
     "[at /parameters/2/projections/0]"),
]


def _wrong_family(tmp_path: Path, case: tuple[object, ...]) -> Path:
    label, _, file, old, new = case[:5]
    text = (ARCHITECTURES / str(file)).read_text()
    if old is None:  # the two llama attention cases edit the attention group's lines
        start = text.index('  - name: "layers.{unit}.attention"')
        end = text.index("  - name:", start + 1)
        block = re.sub(r"\n +heads: num_\w+", "", text[start:end])
        if "query heads" in str(label):
            block = block.replace("units: num_key_value_heads", "units: num_attention_heads")
        else:  # the built-in group sets `kv_replication: true` already
            assert "kv_replication: true" in block
        assert block != text[start:end]
        text = text[:start] + block + text[end:]
    else:
        assert isinstance(old, str) and isinstance(new, str) and text.count(old) == 1, label
        text = text.replace(old, new)
    path = tmp_path / str(file)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", WRONG, ids=[c[0] for c in WRONG])
def test_a_wrong_declaration_is_refused_by_check_or_by_verify(tmp_path, case):
    _, fixture, _, _, _, tp, how, expected = case
    family = _wrong_family(tmp_path, case)
    config = hf(str(fixture)) / "config.json"
    if how == "check":
        errors = check_family(family, config, topology=Topology(
            tensor_parallel_size=int(tp), pipeline_parallel_size=1))  # type: ignore[call-overload]
        assert errors and any(str(expected) in str(e) for e in errors), errors
        return
    # statically fine: check finds nothing, only the semantic check refuses it
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=int(tp), pipeline_parallel_size=1)) == []  # type: ignore[call-overload]
    report = verify_family(family, config, tensor_parallel_sizes=[int(tp)],  # type: ignore[call-overload]
                           pipeline_parallel_size=1)
    failure = report.first_failure
    assert not report.ok and failure is not None
    module, group, rank = expected  # type: ignore[misc]
    # (an expert is exercised only when the input routes a token to it: the first failing
    # expert is the first routed one)
    assert (failure.module, failure.rank) == (module, rank) and re.fullmatch(
        group, failure.group), failure
    assert failure.max_error > failure.tolerance
    assert failure.message.startswith(f"T={tp} x S=1: module `{module}` (group "
                                      f"`{failure.group}`), rank {rank}: ")


# ---------------------------------------------------------------- command line and shrinking


def test_the_cli_reports_json_and_exits_0_when_every_check_holds(capsys):
    status = main(["verify", "--config", str(hf("qwen3") / "config.json"), "--tp", "1,2",
                   "--pp", "2", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["ok"] is True
    assert report["family"] == "qwen3" and report["model_type"] == "qwen3"
    # --pp with --tp: each T x S build checked as one (docs/verify.md)
    assert {(c["tp"], c["pp"]) for c in report["checks"]} == {(1, 2), (2, 2)}
    assert {"tp", "pp", "module", "group", "rank", "ok", "max_error", "tolerance"} <= set(
        report["checks"][0])


def test_the_cli_skips_illegal_sizes_by_default_and_names_the_first_failure(tmp_path, capsys):
    family = _wrong_family(tmp_path, WRONG[3])
    status = main(["verify", str(family), "--config", str(hf("llama") / "config.json"),
                   "--pp", "1"])
    captured = capsys.readouterr()
    assert status == 1
    # 4 q heads, 2 KV heads: T=4 is legal by KV replication; the others fail in two ways
    assert "skipped T=3, 5, 7 x S=1: " in captured.out  # KV heads not a divisor
    assert "skipped T=6, 8 x S=1: " in captured.out  # query heads not divisible
    assert "T=4 x S=1: 12/15 checks hold" in captured.out
    assert "skipped the pipeline check: no pipeline split asked for (S=1)" in captured.out
    assert "skipped T=1 x S=1" not in captured.out  # T=1 was checked, not skipped
    assert "T=1 x S=1: 15/15 checks hold" in captured.out
    assert re.search(r"error: T=2 x S=1: module `model.layers.0.self_attn` \(group "
                     r"`layers.0.attention`\), "
                     r"rank 0: .*max abs error [0-9.e-]+, tolerance [0-9.e-]+", captured.err)


def test_verify_without_transformers_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    status = main(["verify", "--config", str(hf("llama") / "config.json")])
    err = capsys.readouterr().err
    assert status == 1
    assert "partc verify needs torch and transformers (transformers is not installed): " \
           "pip install 'partc[verify]'" in err


def test_a_large_config_is_shrunk_keeping_its_structure():
    config = json.loads((ROOT / "tests" / "fixtures" / "fullsize" / "DeepSeek-V3"
                         / "config.json").read_text())
    assert is_large(config)
    small, notes = reference_config(config)
    assert small["num_attention_heads"] == 4 and small["num_key_value_heads"] == 4
    assert small["n_routed_experts"] == 8 and small["num_experts_per_tok"] == 2
    assert small["first_k_dense_replace"] == 1 and small["num_hidden_layers"] == 3
    assert "quantization_config" not in small and small["dtype"] == "float32"
    assert notes[0] == "dropped quantization_config: the reference model is dense float32"
    tiny = json.loads((hf("llama") / "config.json").read_text())
    assert not is_large(tiny) and reference_config(tiny)[0]["hidden_size"] == tiny["hidden_size"]


def test_a_vision_language_config_is_shrunk_by_its_sections_not_its_legacy_sizes():
    """PaliGemma's config.json keeps a legacy top-level `hidden_size` (2048) and `vocab_size`
    beside text_config's: the model ignores them, and rewriting them (the shrink rules read the
    top level) only broke a family reading them and printed a shrink that did not happen."""
    config = json.loads((hf("llava") / "config.json").read_text())
    legacy = {**config, "hidden_size": 2048, "vocab_size": 257152}
    assert not is_large(legacy)
    out, notes = reference_config(legacy, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert notes == []
    assert {k: out[k] for k in legacy if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in legacy.items() if k not in ("dtype", "torch_dtype")}
    # a large text_config is shrunk in its section; the legacy top-level sizes stay, and a
    # tiny tower is kept as it is
    large = {**legacy, "text_config": {**config["text_config"], "hidden_size": 4096}}
    assert is_large(large)
    out, notes = reference_config(large)
    assert out["text_config"] == {**config["text_config"], "hidden_size": 64}
    assert (out["hidden_size"], out["vocab_size"]) == (2048, 257152)
    assert out["vision_config"] == config["vision_config"]
    assert notes == ["shrunk attention heads (query heads per KV head kept, a KV head per "
                     "rank): text_config.hidden_size 4096 -> 64"]


def test_a_shrunk_deepseek_v3_verifies():
    """In its FP8 storage, at T = 8 too: the shrunk widths still hold a block per rank."""
    report = verify_family(None, ROOT / "tests" / "fixtures" / "fullsize" / "DeepSeek-V3"
                           / "config.json", tensor_parallel_sizes=[2, 8], pipeline_parallel_size=2)
    assert report.ok, report.first_failure
    assert {c.tp for c in report.checks} == {1, 2, 8}
    assert any(n.startswith("shrunk experts") for n in report.notes)
    assert any(n.startswith("the reference checkpoint is stored as block_fp8") for n in
               report.notes)


# ---------------------------------------------------------------- static roles on the wrong stage

# (case, fixture, text replaced, replacement, S, the stage the full model's run puts the module
# on, the module, the tensor): each passes check, and the family's own placement would have
# checked itself; verify takes the stage from where transformers runs the module instead
MISPLACED = [
    ("final norm declared on the first stage", "llama",
     "final_norm: {stage: last}", "final_norm: {stage: first}", 3, 2, "model.norm.weight",
     "model.norm.weight"),
    ("final norm owned by the embedding's role", "llama",
     "owner: {static: final_norm}", "owner: {static: embedding}", 2, 1, "model.norm.weight",
     "model.norm.weight"),
    ("tied embedding not also owned by the output role", "llama_tied",
     "      - {any_of: [embedding, output], when: tie_word_embeddings}\n", "", 3, 2,
     "lm_head.weight", "model.embed_tokens.weight"),
    ("embedding declared on the last stage", "llama",
     "embedding: {stage: first}", "embedding: {stage: last}", 2, 0,
     "model.embed_tokens.weight", "model.embed_tokens.weight"),
]


@pytest.mark.parametrize("case", MISPLACED, ids=[c[0] for c in MISPLACED])
def test_a_static_role_on_a_stage_that_does_not_run_it_is_refused_by_verify(tmp_path, case):
    _, fixture, old, new, stages, stage, parameter, target = case
    text = (ARCHITECTURES / "llama.yaml").read_text()
    assert text.count(old) == 1
    family = tmp_path / "llama.yaml"
    family.write_text(text.replace(old, new))
    config = hf(fixture) / "config.json"
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=1, pipeline_parallel_size=stages)) == []
    report = verify_family(family, config, tensor_parallel_sizes=[1],
                           pipeline_parallel_size=stages)
    failures = [c for c in report.checks if not c.ok]
    assert not report.ok and failures, report
    assert failures[0].message == (
        f"T=1 x S={stages}: stage {stage} executes `{parameter}`, made of `{target}`, but "
        "does not own that tensor"), failures[0].message
    # the same declaration unchanged verifies: the refusal is the placement's
    good = verify_family(ARCHITECTURES / "llama.yaml", config, tensor_parallel_sizes=[1],
                         pipeline_parallel_size=stages)
    assert good.ok, good.first_failure


# ---------------------------------------------------------------- what the cuts carry

def test_a_decoder_boundary_declared_with_the_wrong_width_is_refused_by_verify(tmp_path):
    """A plain decoder's one boundary is compared with the hidden state a stage's last layer
    really gives (not only the cuts of a vision-language graph)."""
    text = (ARCHITECTURES / "llama.yaml").read_text()
    old = "primary: {role: hidden, shape: [batch, sequence, hidden_size], dtype: activation}"
    assert text.count(old) == 1
    family = tmp_path / "llama.yaml"
    family.write_text(text.replace(old, old.replace("hidden_size]", "intermediate_size]")))
    config = json.loads((hf("llama") / "config.json").read_text())
    assert config["intermediate_size"] != config["hidden_size"]
    assert check_family(family, hf("llama") / "config.json", topology=Topology(
        tensor_parallel_size=1, pipeline_parallel_size=2)) == []
    report = verify_family(family, hf("llama") / "config.json", tensor_parallel_sizes=[1],
                           pipeline_parallel_size=2)
    failures = [c for c in report.checks if not c.ok]
    assert not report.ok and len(failures) == 1, failures
    layers = config["num_hidden_layers"]
    assert failures[0].message == (
        "T=1 x S=2: the cut after stage 0 (group `decoder`, boundary `llama.hidden`) declares "
        f"`hidden` as [batch, sequence, {config['intermediate_size']}], but module "
        f"`model.layers.{(layers + 1) // 2 - 1}` gives it as [1, 8, {config['hidden_size']}]: "
        f"axis 2 has {config['hidden_size']} elements, the boundary declares "
        f"{config['intermediate_size']}"), failures[0].message


def test_token_ids_the_embedding_needs_past_the_vision_stage_must_cross_the_cut(tmp_path):
    """llava's embedding sits where the decoder begins; without `input_ids` in the vision
    boundary, that stage could not embed the prompt: verify says which cut lacks it."""
    text = (ARCHITECTURES / "llava.yaml").read_text()
    old = "        - {role: input_ids, shape: [batch, sequence], dtype: int32}\n"
    assert text.count(old) == 2
    family = tmp_path / "llava.yaml"
    family.write_text(text.replace(old, ""))
    report = verify_family(family, hf("llava") / "config.json", tensor_parallel_sizes=[1],
                           pipeline_parallel_size=3)
    failures = [c for c in report.checks if not c.ok]
    assert not report.ok and failures, report
    assert failures[0].message.startswith(
        "T=1 x S=3: stage 1 runs `model.language_model.embed_tokens` on the model input "
        "`input_ids`, but the cut after stage 0 (boundary `llava.vision`) does not carry it: "
        "expected an auxiliary tensor `input_ids` in that boundary, found `image_mask`"), \
        failures[0].message
    good = verify_family(ARCHITECTURES / "llava.yaml", hf("llava") / "config.json",
                         tensor_parallel_sizes=[1], pipeline_parallel_size=3)
    assert good.ok, good.first_failure


def test_a_norm_kept_whole_over_a_split_projection_is_named_in_the_failure(tmp_path):
    """OLMo-2's q_norm and k_norm moved to a replicated group of their own: the attention
    group's split is then what breaks (its module runs the norms), and the failure says the
    whole norms are the cause, naming their group."""
    from transformers import Olmo2Config

    Olmo2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=131).save_pretrained(
        tmp_path / "olmo2")
    text = (ARCHITECTURES / "olmo2.yaml").read_text()
    start = text.index('      - module: "model.layers.{unit}.self_attn.q_norm"')
    end = text.index('      - module: "model.layers.{unit}.self_attn.o_proj"')
    text = text[:start] + text[end:]
    text = text.replace("      # RMSNorm over the whole q / k width: split like the projection's "
                        "output axis, its\n      # statistic all-reduced over the tensor-parallel "
                        "ranks\n", "")
    after = text.index('  - name: "layers.{unit}.post_attention_layernorm"')
    text = text[:after] + """  - name: "layers.{unit}.qk_norm"
    role: replicated
    owner: {unit: decoder}
    members:
      - target: "model.layers.{unit}.self_attn.q_norm.weight"
        shape: [num_attention_heads * head_dim]
        sharding: replicated
      - target: "model.layers.{unit}.self_attn.k_norm.weight"
        shape: [num_key_value_heads * head_dim]
        sharding: replicated

""" + text[after:]
    family = tmp_path / "olmo2.yaml"
    family.write_text(text)
    config = tmp_path / "olmo2" / "config.json"
    assert check_family(family, config, topology=Topology(
        tensor_parallel_size=2, pipeline_parallel_size=1)) == []
    report = verify_family(family, config, tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    failure = report.first_failure
    assert not report.ok and failure is not None
    assert failure.module == "model.layers.0.self_attn", failure
    assert ("the module also runs `model.layers.0.self_attn.k_norm` (group `layers.0.qk_norm`) "
            "and `model.layers.0.self_attn.q_norm` (group `layers.0.qk_norm`), kept whole "
            "although as wide as the split") in failure.message, failure.message
    good = verify_family(ARCHITECTURES / "olmo2.yaml", config, tensor_parallel_sizes=[2],
                         pipeline_parallel_size=1)
    assert good.ok, good.first_failure
