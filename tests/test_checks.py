"""Static consistency checks of attention and projection groups, each a located error.

The known-mistakes cases (tests/cases/<name>/, run by tests/test_faults.py too) are asserted
here by name with the rule each states, expected vs found; the group-level bias default is
checked against Llama's per-projection biases, which it must reproduce exactly.
"""

from __future__ import annotations

import json

import pytest

from partc.api import bind, check_family, compile_family
from partc.errors import PartcError
from partc.plan.topology import Topology

from support import ROOT, check_case, hf

CASES = ROOT / "tests" / "cases"
LLAMA = ROOT / "architectures" / "llama.yaml"


def case(name: str) -> list[str]:
    """`file:line:col: message [at pointer]` of every error `partc check` gives for a case."""
    return [str(e) for e in sorted(check_case(CASES / name), key=PartcError.sort_key)]


def test_split_attention_without_heads_is_refused_at_each_projection():
    """The reported example: `units: hidden_size`, no `heads:`; at T=3 the 64 columns would
    split 22/21/21 and cut 16-wide heads. Each split projection is named where it is written."""
    errors = case("attention_heads_split_without_heads")
    assert [e.split(": ", 1)[0] for e in errors] == [
        "family.yaml:12:9", "family.yaml:14:9", "family.yaml:16:9", "family.yaml:18:9"]
    assert errors[0].startswith(
        "family.yaml:12:9: this `attention_heads` group splits "
        "`model.layers.{unit}.self_attn.q_proj` (column) over `units: hidden_size` but it "
        "states no `heads:`; expected its head count")
    assert "(row)" in errors[3] and "found none, so a partition unit could cut a head" in errors[3]


def test_the_same_split_with_heads_stated_keeps_whole_heads_at_three_ranks(tmp_path):
    """With `heads:` the units shrink to gcd(hidden_size, heads) = 2 KV heads, so T=3 is refused
    under Require instead of cutting heads."""
    text = (CASES / "attention_heads_split_without_heads" / "family.yaml").read_text()
    fixed = tmp_path / "family.yaml"
    fixed.write_text(text.replace(
        'q_proj", sharding: column,', 'q_proj", sharding: column, heads: num_attention_heads,')
        .replace('k_proj", sharding: column,', 'k_proj", sharding: column, heads: 2,')
        .replace('v_proj", sharding: column,', 'v_proj", sharding: column, heads: 2,')
        .replace('o_proj", sharding: row,', 'o_proj", sharding: row, heads: 4,'))
    assert check_family(fixed, hf("llama") / "config.json") == []
    with pytest.raises(PartcError) as info:
        compile_family(fixed, hf("llama") / "config.json", Topology(tensor_parallel_size=3))
    assert "2 partition units" in info.value.message and "3" in info.value.message


def test_a_partition_unit_that_cuts_a_head_is_refused_with_both_counts():
    assert case("partition_unit_cuts_a_head") == [
        "family.yaml:6:5: group `layers.0.attention`: `model.layers.0.self_attn.q_proj.weight` "
        "has 4 heads, not a multiple of the group's 64 partition units (hidden_size), so a unit "
        "boundary would cut a head [at /parameters/2]"]


def test_a_column_bias_shorter_than_its_weight_rows_is_refused():
    assert case("column_bias_length_differs_from_weight") == [
        "family.yaml:16:17 (tensor model.layers.0.self_attn.q_proj.bias): the bias of column "
        "projection `model.layers.0.self_attn.q_proj` "
        "must have the length of its weight's output axis (axis 0 of [64, 64]), so the same "
        "unit ranges cut both: expected [64], found [32] "
        "[at /parameters/2/projections/0/params/bias]"]


def test_output_heads_must_equal_query_heads():
    assert case("output_heads_disagree_with_query_heads") == [
        "family.yaml:18:17: on every rank the local output and query head counts must agree: "
        "output projection `model.layers.0.self_attn.o_proj` states 2 heads; expected 4 (the "
        "query heads of `model.layers.0.self_attn.q_proj`), found 2 "
        "[at /parameters/2/projections/3/heads]"]


def test_kv_heads_must_divide_query_heads():
    assert case("kv_heads_do_not_divide_query_heads") == [
        "family.yaml:16:17: on every rank the local query and key/value head counts must "
        "agree: `model.layers.0.self_attn.k_proj` states 3 heads, which does not divide the 4 "
        "query heads of `model.layers.0.self_attn.q_proj`; expected a divisor of 4, found 3 "
        "[at /parameters/2/projections/1/heads]"]


def test_every_builtin_attention_group_passes_the_checks():
    for family in sorted((ROOT / "architectures").glob("*.yaml")):
        assert check_family(family) == [], family.name


GROUP_BIAS = """family: llama_group_bias
extends: {base}
model_types: [llama]
parameters:
  - name: "layers.{{unit}}.attention"
    role: attention_heads
    owner: {{unit: decoder}}
    units: num_key_value_heads
    bias: attention_bias
    projections:
      - {{module: "model.layers.{{unit}}.self_attn.q_proj", sharding: column,
         heads: num_attention_heads,
         params: {{weight: [num_attention_heads * head_dim, hidden_size]}}}}
      - {{module: "model.layers.{{unit}}.self_attn.k_proj", sharding: column,
         heads: num_key_value_heads,
         params: {{weight: [num_key_value_heads * head_dim, hidden_size]}}}}
      - {{module: "model.layers.{{unit}}.self_attn.v_proj", sharding: column,
         heads: num_key_value_heads,
         params: {{weight: [num_key_value_heads * head_dim, hidden_size]}}}}
      - {{module: "model.layers.{{unit}}.self_attn.o_proj", sharding: row,
         heads: num_attention_heads,
         params: {{weight: [hidden_size, num_attention_heads * head_dim]{own}}}}}
"""


@pytest.mark.parametrize("attention_bias", [True, False])
def test_a_group_level_bias_default_gives_every_projection_llamas_bias(tmp_path,
                                                                       attention_bias):
    config = json.loads((hf("llama") / "config.json").read_text())
    config["attention_bias"] = attention_bias
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = tmp_path / "family.yaml"
    family.write_text(GROUP_BIAS.format(base=LLAMA, own=""))
    ours, _, _ = bind(family, tmp_path / "config.json")
    llama, _, _ = bind(LLAMA, tmp_path / "config.json")

    def attention(bound):
        group = next(g.group for g in bound.description.groups
                     if g.group.name == "layers.1.attention")
        return [(m.target, m.shape, m.sharding, m.dtype) for m in group.members]

    assert attention(ours) == attention(llama)
    biases = [t for t, *_ in attention(ours) if t.endswith(".bias")]
    assert len(biases) == (4 if attention_bias else 0)


def test_a_projection_that_declares_its_own_bias_keeps_it(tmp_path):
    config = json.loads((hf("llama") / "config.json").read_text())
    config["attention_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = tmp_path / "family.yaml"
    family.write_text(GROUP_BIAS.format(base=LLAMA, own=", bias: {shape: [hidden_size], "
                                        "when: false}"))
    bound, _, _ = bind(family, tmp_path / "config.json")
    group = next(g.group for g in bound.description.groups if g.group.name == "layers.0.attention")
    targets = [m.target for m in group.members if m.target.endswith(".bias")]
    assert targets == [f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]


def test_a_group_bias_condition_with_a_typo_is_located_once():
    errors = case("group_bias_default_unknown_name")
    assert len(errors) == 1
    assert errors[0].startswith("family.yaml:10:11: `when` uses unknown name `mlp_biass`; did "
                                "you mean `mlp_bias`?")
    assert errors[0].endswith("[at /parameters/4/bias]")


@pytest.mark.parametrize("name", ["derived_values_in_a_cycle", "derived_value_unknown_name",
                                  "derived_value_shadows_a_config_field",
                                  "omit_glob_matches_a_parameter", "float_used_as_a_shape",
                                  "extends_removes_an_unknown_group"])
def test_each_new_construct_mistake_is_one_located_error(name):
    errors = case(name)
    assert len(errors) == 1 and errors[0].startswith("family.yaml:")
    assert errors == (CASES / name / "expected.txt").read_text().splitlines()


def test_a_float_used_as_a_shape_names_the_value_and_the_rounding_functions():
    assert case("float_used_as_a_shape") == [
        "family.yaml:15:23: a shape dimension `rotary_dim` must be an integer, found the float "
        "6.4; round it explicitly with floor(), ceil() or round() "
        "[at /parameters/7/params/weight/0]"]


def test_derived_cycles_name_the_cycle():
    assert case("derived_values_in_a_cycle") == [
        "family.yaml:5:6: derived values depend on each other in a cycle: `a` -> `b` -> `c` -> "
        "`a` [at /derived/a]"]



def test_a_declared_tensor_the_checkpoint_lacks_is_located_at_its_group_with_a_suggestion(
        tmp_path):
    family = tmp_path / "typo.yaml"
    text = (ROOT / "architectures" / "llama.yaml").read_text()
    family.write_text(text.replace("self_attn.q_proj", "self_attn.qproj"))
    errors = check_family(family, hf("llama") / "config.json", hf("llama"))
    declared = [e for e in errors if "the family declares tensor" in e.message]
    assert len(declared) == 3  # one per layer of the tiny Llama
    group_line = 1 + family.read_text().splitlines().index('  - name: "layers.{unit}.attention"')
    for layer, error in enumerate(sorted(declared, key=lambda e: e.tensor or "")):
        assert error.location is not None
        assert (error.location.file, error.location.line) == (str(family), group_line)
        assert error.message == (
            f"the family declares tensor `model.layers.{layer}.self_attn.qproj.weight`, which "
            f"the checkpoint does not have (group `layers.{layer}.attention`); did you mean "
            f"`model.layers.{layer}.self_attn.q_proj.weight`?")
    unowned = [e for e in errors if "is owned by no parameter group" in e.message]
    assert {e.tensor for e in unowned} == {f"model.layers.{i}.self_attn.q_proj.weight"
                                           for i in range(3)}


def test_a_row_projection_s_bias_declared_split_in_a_group_of_its_own_is_refused():
    """Each rank's slice of the bias sums to the whole, so verify's sums hold; but every rank
    adds its share before the all-reduce, so check refuses it (a row bias is whole)."""
    assert case("row_bias_split_in_its_own_group") == [
        "family.yaml:25:9: `transformer.h.{unit}.mlp.c_proj.bias` is {partitioned: 0} but "
        "`transformer.h.{unit}.mlp.c_proj` is a row projection (group `layers.{unit}.mlp` "
        "splits it by rows); expected the bias whole (`sharding: replicated`): each rank's "
        "partial output sum is added once after the all-reduce, and the bias with it "
        "[at /parameters/8/members/0]"]


def test_per_head_norms_kept_whole_beside_split_attention_heads_are_refused():
    """Cohere's q_norm [heads, head_dim] and k_norm [kv_heads, head_dim] as `partc init` writes
    them: replicated groups of their own, while the attention group splits those heads."""
    errors = case("per_head_norms_kept_whole")
    assert [e.split(": ", 1)[0] for e in errors] == ["family.yaml:85:23", "family.yaml:92:23"]
    assert errors[1] == (
        "family.yaml:92:23: `model.layers.{unit}.self_attn.q_norm.weight` is kept whole but its "
        "axis 0 is `num_attention_heads`, the heads group `layers.{unit}.attention` splits "
        "(`model.layers.{unit}.self_attn.q_proj` states `heads: num_attention_heads`); expected "
        "it split with those heads on that axis, in that group (a `column` projection stating "
        "the same `heads:`): a rank computing some of the heads holds only their values "
        "[at /parameters/5/params/weight/0]")
