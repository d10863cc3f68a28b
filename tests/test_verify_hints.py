"""Hints that do not mislead (issue 38): verify's norm hint only when the norm is the cause,
cut notes in the group the cut is in, and a fused QKV without `heads:` told about the fused
layouts rather than handed a single head count."""

from __future__ import annotations

from pathlib import Path

from partc.api import check_family
from partc.cli.main import main
from partc.plan.plan_file import read_plan
from partc.plan.topology import Topology
from partc.verify.run import verify_family

from support import edited_family, hf

NORM_HINT = "declared `reduction: tensor_parallel`"

OLMO_NORMS = {
    name: f'''      - module: "model.layers.{{unit}}.self_attn.{name}"
        sharding: column
        reduction: tensor_parallel
        linear: false
        heads: {heads}
        params: {{weight: [{heads} * head_dim]}}
''' for name, heads in (("q_norm", "num_attention_heads"), ("k_norm", "num_key_value_heads"))}
NORMS_GROUP = '''  - name: "layers.{unit}.qk_norm"
    role: replicated
    owner: {unit: decoder}
    members:
      - {target: "model.layers.{unit}.self_attn.q_norm.weight", shape: [num_attention_heads * head_dim], sharding: replicated}
      - {target: "model.layers.{unit}.self_attn.k_norm.weight", shape: [num_key_value_heads * head_dim], sharding: replicated}

'''  # noqa: E501
"""OLMo-2's q_norm / k_norm kept whole in a replicated group of their own, as `partc init`
writes a norm it cannot place."""


def _olmo_norms_whole(tmp: Path, extra: tuple[str, str] | None = None) -> Path:
    """olmo2 with its q/k norms in a replicated group of their own (and `extra` edited)."""
    family = edited_family(tmp, "olmo2", OLMO_NORMS["q_norm"], "")
    text = family.read_text().replace(OLMO_NORMS["k_norm"], "")
    text = text.replace('  - name: "layers.{unit}.attention"\n',
                        NORMS_GROUP + '  - name: "layers.{unit}.attention"\n')
    if extra is not None:
        assert text.count(extra[0]) == 1
        text = text.replace(*extra)
    family.write_text(text)
    return family


def _failure(family: Path) -> str:
    report = verify_family(family, hf("olmo2") / "config.json", tensor_parallel_sizes=[2],
                           pipeline_parallel_size=1)
    failure = report.first_failure
    assert failure is not None
    assert (failure.module, failure.group) == ("model.layers.0.self_attn", "layers.0.attention")
    return failure.message


def test_the_norm_hint_when_the_whole_norms_are_the_cause(tmp_path):
    """The norms' statistic all-reduced, the ranks add up: the norms are named."""
    message = _failure(_olmo_norms_whole(tmp_path))
    assert ("the module also runs `model.layers.0.self_attn.k_norm` (group `layers.0.qk_norm`) "
            "and `model.layers.0.self_attn.q_norm` (group `layers.0.qk_norm`), kept whole") \
        in message
    assert NORM_HINT in message


def test_no_norm_hint_when_a_projection_is_wrong_whatever_the_norms(tmp_path):
    """`o_proj` declared column (as wide as q_norm): all-reducing the norms does not make the
    ranks add up, so the failure is not blamed on them."""
    message = _failure(_olmo_norms_whole(tmp_path, (
        'self_attn.o_proj"\n        sharding: row\n',
        'self_attn.o_proj"\n        sharding: column\n')))
    assert "not separable" in message
    assert NORM_HINT not in message and "q_norm" not in message


def test_a_cut_inside_the_decoder_is_in_decoder_not_the_mtp_group_after_it(tmp_path):
    """deepseek_v3 has one boundary and a graph [decoder, mtp]: its cut is after a decoder
    layer, and the cut note says so."""
    out = tmp_path / "build"
    assert main(["compile", "--config", str(hf("deepseek_v3") / "config.json"), "--pp", "2",
                 "--out", str(out)]) == 0
    plan = read_plan(out / "plan.json")
    assert [g.group for g in plan.graph] == ["decoder", "mtp"] and plan.cuts is None
    assert [c.group for c in plan.pipeline_cuts()] == ["decoder"]


def test_a_fused_qkv_without_heads_is_told_the_fused_layouts(tmp_path):
    """Falcon's new-decoder QKV, `layout:` and `heads:` dropped: the message asks for a count
    per segment and names `layout: grouped_per_kv`, not a single `heads: num_attention_heads`
    (which passes T <= 2 by luck on rows grouped per KV head)."""
    family = edited_family(tmp_path, "falcon", "      layout: grouped_per_kv            # per "
                           "KV group [q …, k, v], docs/layouts.md\n", "")
    text = family.read_text()
    heads = ("      heads:\n        - num_attention_heads\n        - kv_groups\n"
             "        - kv_groups\n")
    assert text.count(heads) == 1
    family.write_text(text.replace(heads, ""))
    errors = check_family(family, hf("falcon") / "config.json")
    assert len(errors) == 1
    message = errors[0].message
    assert ("splits the fused `transformer.h.{unit}.self_attention.query_key_value` (column) "
            "over `units: kv_groups` but it states no `heads:`; expected one head count per "
            "segment (3 segments)") in message
    assert "`layout: grouped_per_kv` with `heads: [num_attention_heads, KV heads, KV heads]`" \
        in message
    assert "e.g. `heads: num_attention_heads`" not in message


def test_the_kv_replication_hint_on_a_fused_qkv_names_the_grouped_layout(tmp_path):
    """Falcon's new-decoder QKV declared component-major (its `layout:` dropped) and without
    KV replication, at T = 4 over 2 KV groups: the hint to repeat KV heads says it is right
    only for component-major rows and names `layout: grouped_per_kv` (repeating KV heads of
    rows grouped per KV head passes check and is wrong)."""
    family = edited_family(tmp_path, "falcon", "      layout: grouped_per_kv            # per "
                           "KV group [q …, k, v], docs/layouts.md\n", "")
    text = family.read_text()
    replication = "    kv_replication: true                # T > KV heads: vLLM's rule, " \
                  "docs/kv_replication.md\n"
    segments = ("        - num_attention_heads // kv_groups * head_dim\n        - head_dim\n"
                "        - head_dim\n")
    assert text.count(replication) == 1 and text.count(segments) == 1
    family.write_text(text.replace(replication, "").replace(segments, (
        "        - num_attention_heads * head_dim\n        - kv_groups * head_dim\n"
        "        - kv_groups * head_dim\n")))  # widths of a component-major fused QKV
    errors = check_family(family, hf("falcon") / "config.json",
                          topology=Topology(tensor_parallel_size=4))
    message = " ".join(e.message for e in errors)
    assert "set `kv_replication: true` with `heads:`" in message
    assert ("but `transformer.h.0.self_attention.query_key_value.weight` fuses its q, k and v "
            "rows, and repeating KV heads is only right if they are component-major") in message
    assert "need `layout: grouped_per_kv` with `heads:` per segment instead" in message
    # the built-in family (grouped_per_kv, KV replication) checks at T = 4
    assert check_family(None, hf("falcon") / "config.json",
                        topology=Topology(tensor_parallel_size=4)) == []
