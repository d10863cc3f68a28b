"""`partc check` blames the line of the mistake: a transposed weight shape, a projection's
`column` on a `module:` group, a per-head member split on an axis that does not count its heads.

Each case is a built-in family with one edit (the mistakes of a user trial, on the built-ins
that have the same structure), checked against the built-in's own tiny fixture config; the
error's line is the edited line and its message names what was expected and what was found.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partc.api import check_family, load_family
from partc.bind.consistency import counts_heads
from partc.errors import PartcError
from partc.family.expr import parse

from support import edited_family, hf


def only_error(family: Path, fixture: str) -> PartcError:
    """The one error `partc check FAMILY --config <fixture>/config.json` gives."""
    errors = check_family(family, hf(fixture) / "config.json")
    assert len(errors) == 1, [str(e) for e in errors]
    return errors[0]


def line_of(path: Path, text: str) -> int:
    """The 1-based line of the one line of `path` holding `text`."""
    lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


# ---------------------------------------------------------------- a transposed weight shape

NEOX_FC = "params: {weight: [intermediate_size, hidden_size], bias: [intermediate_size]}"
NEOX_PROJ = "params: {weight: [hidden_size, intermediate_size], bias: [hidden_size]}"


def test_a_column_weight_written_transposed_is_refused_at_its_shape_not_at_its_bias(tmp_path):
    """GPT-NeoX's `dense_h_to_4h` [intermediate, hidden] written [hidden, intermediate] beside
    its bias [intermediate]: the weight's line, both shapes, and the transposition named (the
    error was at the bias, then at `sharding:` with the advice to change the sharding)."""
    family = edited_family(tmp_path, "gpt_neox", NEOX_FC,
                           "params: {weight: [hidden_size, intermediate_size], "
                           "bias: [intermediate_size]}")
    error = only_error(family, "gpt_neox")
    assert error.location is not None
    assert error.location.line == line_of(
        family, "weight: [hidden_size, intermediate_size], bias: [intermediate_size]")
    assert error.pointer.endswith("/projections/0/params/weight")
    assert error.message.startswith(
        "the weight of column projection `gpt_neox.layers.0.mlp.dense_h_to_4h` is declared "
        "[64, 128] (`[hidden_size, intermediate_size]`): its output axis 0 has 64 elements, "
        "but its bias 128")
    assert ("expected [128, 64] (`[intermediate_size, hidden_size]`), nn.Linear's `[out, in]`, "
            "found [64, 128], the expected shape transposed") in error.message


def test_a_row_weight_written_transposed_is_refused_at_its_shape(tmp_path):
    """`dense_4h_to_h` [hidden, intermediate] written [intermediate, hidden] beside its bias
    [hidden] (a row bias is the output's length too)."""
    family = edited_family(tmp_path, "gpt_neox", NEOX_PROJ,
                           "params: {weight: [intermediate_size, hidden_size], "
                           "bias: [hidden_size]}")
    error = only_error(family, "gpt_neox")
    assert error.location is not None
    assert error.location.line == line_of(
        family, "weight: [intermediate_size, hidden_size], bias: [hidden_size]")
    assert "row projection `gpt_neox.layers.0.mlp.dense_4h_to_h`" in error.message
    assert "expected [64, 128] (`[hidden_size, intermediate_size]`)" in error.message
    assert "found [128, 64], the expected shape transposed" in error.message


def test_a_bias_of_another_length_is_still_refused_at_the_bias(tmp_path):
    """A bias matching neither axis of its weight is the bias's own mistake."""
    family = edited_family(tmp_path, "gpt_neox", NEOX_FC,
                           "params: {weight: [intermediate_size, hidden_size], "
                           "bias: [intermediate_size + 1]}")
    error = only_error(family, "gpt_neox")
    assert error.pointer.endswith("/projections/0/params/bias")
    assert "expected [128], found [129]" in error.message


# ---------------------------------------------------------------- `column` on a module: group

LM_HEAD = "    module: lm_head\n    sharding: {balanced: 0}\n"


@pytest.mark.parametrize("rule", ["column", "row"])
def test_a_projection_sharding_on_a_vocabulary_head_module_says_what_the_module_form_takes(
        tmp_path, rule):
    """Llama's `lm_head` (a `module:` group) given a projection's `column` / `row`: the schema
    error lists the module form's rules, the vocabulary head's `{balanced: 0}`, and where
    `column` and `row` belong."""
    family = edited_family(tmp_path, "llama", LM_HEAD,
                           f"    module: lm_head\n    sharding: {rule}\n")
    error = only_error(family, "llama")
    assert error.location is not None
    assert error.location.line == line_of(family, "module: lm_head") + 1  # its sharding
    assert error.message.startswith(f'expected "replicated" or a mapping, found "{rule}"; ')
    assert ("a `module:` group's `sharding` is `replicated` or one rule along an axis A: "
            "`{equal: A}`, `{balanced: A}`, `{partitioned: A}`") in error.message
    assert ("`column` and `row` split the projections of a `projections:` group: a vocabulary "
            "head's rows are split with `{balanced: 0}`") in error.message


def test_a_member_given_column_is_told_the_member_rules(tmp_path):
    """Qwen3's replicated `q_norm` member given `column`: the rules of a member, no head."""
    family = edited_family(
        tmp_path, "qwen3",
        '"model.layers.{unit}.self_attn.q_norm.weight", shape: [head_dim], sharding: replicated',
        '"model.layers.{unit}.self_attn.q_norm.weight", shape: [head_dim], sharding: column')
    error = only_error(family, "qwen3")
    assert error.location is not None
    assert error.location.line == line_of(family, "q_norm.weight\", shape: [head_dim], "
                                          "sharding: column")
    assert "a member's `sharding` is `replicated` or one rule along an axis A" in error.message
    assert "split the projections of a `projections:` group" in error.message
    assert "vocabulary" not in error.message


def test_a_member_rule_on_a_projection_says_what_a_projection_takes(tmp_path):
    family = edited_family(tmp_path, "gpt_neox", "dense_h_to_4h\"\n        sharding: column",
                           "dense_h_to_4h\"\n        sharding: {partitioned: 0}")
    error = only_error(family, "gpt_neox")
    assert error.location is not None
    assert error.location.line == line_of(family, "sharding: {partitioned: 0}")
    assert error.message.startswith(
        'expected one of "replicated", "column", "row", "per_head", found {"partitioned": 0}; a '
        "projection's `sharding` is `column` (its output features), `row` (its input "
        "features) or `replicated`")


# ---------------------------------------------------------------- a per-head member's axis

O_PROJ = '      - module: "model.layers.{unit}.self_attn.o_proj"\n'


def with_q_norm(folder: Path, orientation: str = "", shape: str = "[num_attention_heads, "
                "head_dim]") -> Path:
    """Llama with a per-head `q_norm` [heads, head_dim] split with the q heads (Cohere's)."""
    q_norm = ('      - module: "model.layers.{unit}.self_attn.q_norm"\n'
              "        sharding: column\n"
              "        linear: false\n"
              "        heads: num_attention_heads\n"
              + (f"        orientation: {orientation}\n" if orientation else "")
              + f"        params: {{weight: {shape}}}\n")
    return edited_family(folder, "llama", O_PROJ, q_norm + O_PROJ)


def test_a_per_head_norm_split_with_its_heads_passes(tmp_path):
    assert check_family(with_q_norm(tmp_path), hf("llama") / "config.json") == []


def test_a_per_head_norm_split_on_head_dim_is_refused_at_its_orientation(tmp_path):
    """`orientation: in_out` moves the column split of q_norm [4, 16] to axis 1 (head_dim):
    every shape is legal and `partc verify` alone saw it; check refuses it at the line."""
    family = with_q_norm(tmp_path, "in_out")
    error = only_error(family, "llama")
    assert error.location is not None
    assert error.location.line == line_of(family, "orientation: in_out")
    assert error.pointer.endswith("/projections/3/orientation")
    assert error.message == (
        "`model.layers.0.self_attn.q_norm.weight` [4, 16] is split on axis 1 (`head_dim`, 16), "
        "which does not count the 4 heads (`num_attention_heads`) that projection "
        "`model.layers.0.self_attn.q_norm` states: every rank would hold a part of each head "
        "instead of whole heads; expected the split on axis 0 (`num_attention_heads`, 4), "
        "which counts them, found axis 1; drop `orientation: in_out`: the default `out_in` "
        "splits axis 0 of a column projection's weight")


def test_a_per_head_norm_written_transposed_is_refused_at_its_sharding(tmp_path):
    family = with_q_norm(tmp_path, shape="[head_dim, num_attention_heads]")
    error = only_error(family, "llama")
    assert error.location is not None
    assert error.location.line == line_of(family, "self_attn.q_norm\"") + 1  # sharding
    assert error.pointer.endswith("/projections/3/sharding")
    assert "is split on axis 0 (`head_dim`, 16)" in error.message
    assert "expected the split on axis 1 (`num_attention_heads`, 4)" in error.message
    assert "is the shape written transposed" in error.message


def test_a_dimension_counts_heads_through_products_sums_and_defaults_but_not_divisions():
    """`head_dim`'s default `hidden_size // num_attention_heads` divides by the heads: the
    axis it sizes does not count them, whatever the config gives."""
    family, _ = load_family("llama", builtin=True)
    heads = parse("num_attention_heads")
    for text, counted in [("num_attention_heads", True),
                          ("num_attention_heads * head_dim", True),
                          ("2 * num_attention_heads * head_dim + num_attention_heads", True),
                          ("num_key_value_heads", True),  # its default: num_attention_heads
                          ("head_dim", False), ("hidden_size", False),
                          ("num_attention_heads * head_dim // num_attention_heads", False),
                          ("num_attention_heads % 3", False),
                          ("num_attention_heads + hidden_size", False)]:
        assert counts_heads(parse(text), heads, family) is counted, text

