"""Declarations whose every rank's slices add up to the whole, so that verify's masked sums hold,
but whose local computation is wrong: refused by the static checks `partc verify` runs first.

- a row projection's bias split in a group of its own (each rank would add its share before
  the all-reduce);
- per-head norms `[heads, head_dim]` kept whole in a replicated group while the attention heads
  are split (what `partc init` writes for Cohere: a rank computing 2 of 4 heads would get the 4
  heads' weights). The declaration the message asks for verifies against transformers'
  CohereForCausalLM.
"""

from __future__ import annotations

from partc.cli.main import main

from support import ROOT

CASES = ROOT / "tests" / "cases"


def _verify(capsys, case: str, family: str | None = None) -> tuple[int, str]:
    folder = CASES / case
    status = main(["verify", family or str(folder / "family.yaml"), "--config",
                   str(folder / "config.json"), "--tp", "1,2", "--pp", "1"])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_verify_refuses_a_row_projection_s_bias_split_in_a_group_of_its_own(capsys):
    status, out = _verify(capsys, "row_bias_split_in_its_own_group")
    assert status == 1
    assert "family.yaml:25:9: `transformer.h.{unit}.mlp.c_proj.bias` is {partitioned: 0} but " \
           "`transformer.h.{unit}.mlp.c_proj` is a row projection (group `layers.{unit}.mlp` " \
           "splits it by rows); expected the bias whole (`sharding: replicated`)" in out


def test_verify_refuses_per_head_norms_kept_whole_beside_split_heads(capsys):
    status, out = _verify(capsys, "per_head_norms_kept_whole")
    assert status == 1
    assert "family.yaml:92:23: `model.layers.{unit}.self_attn.q_norm.weight` is kept whole but " \
           "its axis 0 is `num_attention_heads`, the heads group `layers.{unit}.attention` " \
           "splits (`model.layers.{unit}.self_attn.q_proj` states `heads: " \
           "num_attention_heads`)" in out
    assert "family.yaml:85:23: `model.layers.{unit}.self_attn.k_norm.weight` is kept whole" in out


def test_per_head_norms_split_with_their_heads_as_the_message_asks_verify(tmp_path, capsys):
    text = (CASES / "per_head_norms_kept_whole" / "family.yaml").read_text()
    start = text.index('  - name: "layers.{unit}.attention.k_norm"')
    end = text.index("  - name: final_norm")
    norms = "".join(
        f'      - module: "model.layers.{{unit}}.self_attn.{p}_norm"\n'
        f"        sharding: column\n        heads: {heads}\n"
        f"        params: {{weight: [{heads}, head_dim]}}\n"
        for p, heads in (("q", "num_attention_heads"), ("k", "num_key_value_heads")))
    output = "        params: {weight: [hidden_size, num_attention_heads * head_dim]}\n"
    fixed = (text[:start] + text[end:]).replace(output, output + norms, 1)
    family = tmp_path / "family.yaml"
    family.write_text(fixed)
    status, out = _verify(capsys, "per_head_norms_kept_whole", str(family))
    assert status == 0, out
    assert "T=2 x S=1: 9/9 checks hold" in out
