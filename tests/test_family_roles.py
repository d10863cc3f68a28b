"""A group's role and its members' splits agree, statically (`partc check`, no config needed).

These are declarations whose shapes are all legal and whose masked ranks still add up to the
full module's output, so `partc verify`'s sum-of-ranks rule cannot see them: a split norm, an
embedding split on its hidden axis, a head projection kept whole beside split ones, a matrix kept
whole in a group that divides its units, a row projection's bias split. Each case edits the
built-in llama family, which itself passes every rule (as every built-in family does).
"""

from __future__ import annotations

import pytest

from partc.api import CompileOptions, check_family
from partc.plan.topology import Topology

from support import ROOT, hf

LLAMA = (ROOT / "architectures" / "llama.yaml").read_text()

MLP_START = '  - name: "layers.{unit}.mlp"'
MLP_MEMBERS = """  - name: "layers.{unit}.mlp"
    role: feed_forward_intermediate
    owner: {unit: decoder}
    units: intermediate_size
    members:
      - target: "model.layers.{unit}.mlp.gate_proj.weight"
        shape: [intermediate_size, hidden_size]
        sharding: {partitioned: 0}
      - target: "model.layers.{unit}.mlp.gate_proj.bias"
        shape: [intermediate_size]
        sharding: GATE_BIAS
      - target: "model.layers.{unit}.mlp.up_proj.weight"
        shape: [intermediate_size, hidden_size]
        sharding: {partitioned: 0}
      - target: "model.layers.{unit}.mlp.down_proj.weight"
        shape: [hidden_size, intermediate_size]
        sharding: {partitioned: 1}
      - target: "model.layers.{unit}.mlp.down_proj.bias"
        shape: [hidden_size]
        sharding: DOWN_BIAS

"""


def _members_mlp(down_bias: str, gate_bias: str = "{partitioned: 0}") -> str:
    start = LLAMA.index(MLP_START)
    end = LLAMA.index("  - name:", start + 1)
    block = MLP_MEMBERS.replace("DOWN_BIAS", down_bias).replace("GATE_BIAS", gate_bias)
    return LLAMA[:start] + block + LLAMA[end:]


# (case, the family text, the message check gives)
CASES = [
    ("a norm split in a replicated group",
     LLAMA.replace('module: "model.layers.{unit}.input_layernorm"\n    sharding: replicated',
                   'module: "model.layers.{unit}.input_layernorm"\n    sharding: {balanced: 0}'),
     "this `replicated` group splits its module's parameters (balanced); expected "
     "`sharding: replicated`, or a role that says what the split divides"),
    ("the MLP's projections in a replicated group",
     LLAMA.replace("role: feed_forward_intermediate", "role: replicated").replace(
         "    units: intermediate_size\n", ""),
     "this `replicated` group splits `model.layers.{unit}.mlp.gate_proj` (column)"),
    ("an embedding split on its hidden axis",
     LLAMA.replace("module: model.embed_tokens\n    sharding: {balanced: 0}",
                   "module: model.embed_tokens\n    sharding: {balanced: 1}"),
     "this `vocabulary` group splits its module's parameters on axis 1; expected axis 0"),
    ("attention declared a vocabulary group",
     LLAMA.replace("role: attention_heads", "role: vocabulary"),
     "this `vocabulary` group splits `model.layers.{unit}.self_attn.o_proj` by its input "
     "features (`row`); expected `column`"),
    ("k_proj kept whole beside split q and v",
     LLAMA.replace('self_attn.k_proj"\n        sharding: column',
                   'self_attn.k_proj"\n        sharding: replicated'),
     "this `attention_heads` group keeps `model.layers.{unit}.self_attn.k_proj` whole although "
     "it states `heads:`"),
    ("o_proj kept whole beside split q, k and v",
     LLAMA.replace('self_attn.o_proj"\n        sharding: row',
                   'self_attn.o_proj"\n        sharding: replicated'),
     "this `attention_heads` group keeps `model.layers.{unit}.self_attn.o_proj` whole"),
    ("k_proj kept whole, without heads:, beside a split v_proj of its size",
     LLAMA.replace('self_attn.k_proj"\n        sharding: column\n'
                   '        heads: num_key_value_heads\n',
                   'self_attn.k_proj"\n        sharding: replicated\n'),
     "`model.layers.{unit}.self_attn.k_proj.weight` is kept whole but its axis 0 is "
     "`num_key_value_heads * head_dim`, the axis `model.layers.{unit}.self_attn.v_proj.weight` "
     "splits"),
    ("o_proj kept whole, without heads:, beside a split q_proj",
     LLAMA.replace('self_attn.o_proj"\n        sharding: row\n'
                   '        heads: num_attention_heads\n',
                   'self_attn.o_proj"\n        sharding: replicated\n'),
     "`model.layers.{unit}.self_attn.o_proj.weight` is kept whole but its axis 1 is "
     "`num_attention_heads * head_dim`, the axis `model.layers.{unit}.self_attn.q_proj.weight` "
     "splits"),
    ("down_proj kept whole beside split gate and up",
     LLAMA.replace('mlp.down_proj"\n        sharding: row',
                   'mlp.down_proj"\n        sharding: replicated'),
     "`model.layers.{unit}.mlp.down_proj.weight` is kept whole but its axis 1 is "
     "`intermediate_size`, the units this group divides over its ranks"),
    ("a row projection's bias split (member form)", _members_mlp("{equal: 0}"),
     "`model.layers.{unit}.mlp.down_proj.bias` is {equal: 0} but "
     "`model.layers.{unit}.mlp.down_proj.weight` splits its input features; expected the bias "
     "whole (`sharding: replicated`)"),
    ("a column projection's bias kept whole (member form)",
     _members_mlp("replicated", gate_bias="replicated"),
     "`model.layers.{unit}.mlp.gate_proj.bias` is replicated but "
     "`model.layers.{unit}.mlp.gate_proj.weight` splits its output features ({partitioned: 0}); "
     "expected the bias split the same way on axis 0 (partitioned)"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_split_its_role_or_its_weight_contradicts_is_refused_at_its_line(tmp_path, case):
    label, text, expected = case
    assert text != LLAMA, label
    family = tmp_path / "llama.yaml"
    family.write_text(text)
    errors = check_family(family)
    assert errors, label
    assert any(expected in e.message for e in errors), [e.message for e in errors]
    located = next(e for e in errors if expected in e.message)
    assert located.location is not None and located.location.line is not None
    # the line named holds the declaration the message is about
    line = text.splitlines()[located.location.line - 1]
    assert any(word in line for word in ("sharding", "module", "bias", "target", "weight")), line


def test_the_member_form_mlp_with_its_biases_split_as_its_weights_passes(tmp_path):
    """The rules refuse the contradiction, not the form: the same MLP written as members, each
    bias split as its weight's output axis (down_proj's whole), passes."""
    family = tmp_path / "llama.yaml"
    family.write_text(_members_mlp("replicated"))
    assert check_family(family) == []


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "architectures").glob("*.yaml")))
def test_every_built_in_family_passes_the_role_and_split_rules(name):
    assert check_family(ROOT / "architectures" / f"{name}.yaml") == []


def test_a_wrong_name_in_a_weight_a_default_bias_copies_is_reported_once_at_the_weight(
        tmp_path):
    """A group's `bias: <condition>` gives each projection a bias of its weight's rows: a
    misspelt name there is the weight's, reported at its line only, not also at `bias:`."""
    text = (ROOT / "architectures" / "llava.yaml").read_text()
    old = "params: {weight: [hidden_size, vision_hidden_size]}}"
    assert text.count(old) == 1
    family = tmp_path / "llava.yaml"
    family.write_text(text.replace(old, old.replace("[hidden_size,", "[hiden_size,")))
    errors = [e for e in check_family(family) if "hiden_size" in e.message]
    assert len(errors) == 1, [str(e) for e in errors]
    line = family.read_text().splitlines()[errors[0].location.line - 1]
    assert "hiden_size" in line, line


def test_a_group_s_default_bias_follows_a_projection_kept_whole(tmp_path):
    """llava's vision MLP kept whole (a replicated group, both projections replicated) under
    its group-level `bias: true`: each projection keeps its bias, whole on every rank, as the
    checkpoint holds it (it used to be left to no group)."""
    from safetensors import safe_open

    from partc.api import compile_family

    text = (ROOT / "architectures" / "llava.yaml").read_text()
    old = """  - name: "vision.{unit}.mlp"
    role: feed_forward_intermediate
    owner: {unit: vision}
    units: vision_intermediate_size
    bias: true
    projections:
      - {module: "{path}.mlp.fc1", sharding: column,"""
    new = """  - name: "vision.{unit}.mlp"
    role: replicated
    owner: {unit: vision}
    bias: true
    projections:
      - {module: "{path}.mlp.fc1", sharding: replicated,"""
    assert text.count(old) == 1
    text = text.replace(old, new).replace(
        '      - {module: "{path}.mlp.fc2", sharding: row,',
        '      - {module: "{path}.mlp.fc2", sharding: replicated,', 1)
    family = tmp_path / "llava.yaml"
    family.write_text(text)
    checkpoint = hf("llava")
    assert check_family(family, checkpoint / "config.json", checkpoint) == []
    result = compile_family(family, checkpoint / "config.json", Topology(tensor_parallel_size=2),
                            CompileOptions(checkpoint=checkpoint))
    with safe_open(str(checkpoint / "model.safetensors"), "np") as f:
        biases = [n for n in f.keys() if ".mlp.fc1.bias" in n and "vision" in n]
        shapes = {n: f.get_slice(n).get_shape() for n in biases}
    groups = {t.target: t.logical_name for r in result.plan.ranks for t in r.layout.tensors}
    mine = [n for n in biases if groups.get(n, "").startswith("vision.")]  # the used layers
    assert mine and all(groups[n].endswith(".mlp") for n in mine)
    for rank in result.plan.ranks:
        held = {t.target: t for t in rank.layout.tensors}
        for name in mine:
            assert name in held and list(held[name].local_shape) == list(shapes[name])
