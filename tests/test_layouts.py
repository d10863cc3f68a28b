"""Fused row orders, `[in, out]` weights and TP-reduced norms, on the real HF fixtures.

Each rank's loaded slice is compared with the slice taken the Hugging Face way (the views the
fixtures' manifest `layout_notes` describe, done with numpy on the tensors the safetensors
library reads), never with placements computed by partc. Wrong declarations of the new
families are refused by `partc check` (message asserted) or by `partc verify` (the failing
module, group and rank asserted).
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.api import bind, check_family
from partc.errors import PartcError
from partc.parallel.specs import LinearWeightLayout
from partc.plan.topology import Topology
from partc.verify.run import verify_family

from support import ROOT, hf

ARCHITECTURES = ROOT / "architectures"


def _full(name: str) -> dict[str, np.ndarray]:
    return load_file(str(hf(name) / "model.safetensors"))


def _config(name: str) -> dict:
    return json.loads((hf(name) / "config.json").read_text())


def _notes(name: str) -> dict:
    return json.loads((hf(name) / "manifest.json").read_text())["layout_notes"]


# ---------------------------------------------------------------- per head


@pytest.mark.parametrize("name", ["gpt_neox", "bloom"])
@pytest.mark.parametrize("tp", [2, 4])
def test_per_head_fused_qkv_gives_each_rank_whole_heads_of_q_k_and_v(builds, name, tp):
    assert "per-head interleaved" in _notes(name)["fused_qkv"]
    config = _config(name)
    heads = config.get("num_attention_heads", config.get("n_head"))
    d = config["hidden_size"] // heads
    prefix = ("gpt_neox.layers.0.attention" if name == "gpt_neox"
              else "transformer.h.0.self_attention")
    full = _full(name)
    weight, bias = full[f"{prefix}.query_key_value.weight"], full[f"{prefix}.query_key_value.bias"]
    dense = full[f"{prefix}.dense.weight"]
    # HF: qkv.view(b, s, heads, 3 * head_dim): per head [q | k | v]
    per_head = weight.reshape(heads, 3, d, -1)
    _, states = builds(name, tp, 1)
    for rank, state in enumerate(states):
        own = range(rank * heads // tp, (rank + 1) * heads // tp)
        q, k, v = (np.concatenate([per_head[h, c] for h in own]) for c in range(3))
        local = state.tensors[f"{prefix}.query_key_value.weight"].reshape(len(own), 3, d, -1)
        np.testing.assert_array_equal(local[:, 0].reshape(-1, weight.shape[1]), q)
        np.testing.assert_array_equal(local[:, 1].reshape(-1, weight.shape[1]), k)
        np.testing.assert_array_equal(local[:, 2].reshape(-1, weight.shape[1]), v)
        np.testing.assert_array_equal(
            state.tensors[f"{prefix}.query_key_value.bias"],
            bias.reshape(heads, 3 * d)[own.start:own.stop].reshape(-1))
        np.testing.assert_array_equal(state.tensors[f"{prefix}.dense.weight"],
                                      dense[:, own.start * d:own.stop * d])
        # one contiguous row range: the rank's heads
        layout = state.layout[f"{prefix}.query_key_value.weight"]
        assert layout.selection == (0, ((own.start * 3 * d, own.stop * 3 * d),))


# ---------------------------------------------------------------- grouped per KV head


def _falcon_expected(tp: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank's fused weight, bias and dense columns, from HF's grouped view of the fixture."""
    config = _config("falcon")
    heads, kv = config["num_attention_heads"], config["num_kv_heads"]
    d, r = config["hidden_size"] // heads, heads // kv
    full = _full("falcon")
    prefix = "transformer.h.0.self_attention"
    # HF: view(b, s, kv, heads / kv + 2, head_dim); q = [..., :-2, :], k = [..., -2], v = [..., -1]
    grouped = full[f"{prefix}.query_key_value.weight"].reshape(kv, r + 2, d, -1)
    bias = full[f"{prefix}.query_key_value.bias"].reshape(kv, r + 2, d)
    dense = full[f"{prefix}.dense.weight"]
    if tp <= kv:  # whole KV groups
        groups = range(rank * kv // tp, (rank + 1) * kv // tp)
        rows = [grouped[g, j] for g in groups for j in range(r + 2)]
        brows = [bias[g, j] for g in groups for j in range(r + 2)]
        qheads = range(groups.start * r, groups.stop * r)
    else:  # KV replication: group t·K // T, its own query heads inside it, the group's k and v
        g = rank * kv // tp
        qheads = range(rank * heads // tp, (rank + 1) * heads // tp)
        inner = [h - g * r for h in qheads] + [r, r + 1]
        rows = [grouped[g, j] for j in inner]
        brows = [bias[g, j] for j in inner]
    return (np.concatenate(rows), np.concatenate(brows),
            dense[:, qheads.start * d:qheads.stop * d])


@pytest.mark.parametrize("tp", [2, 4])
def test_grouped_fused_qkv_gives_each_rank_its_kv_group_and_replicates_it_past_k(builds, tp):
    assert "grouped per KV head" in _notes("falcon")["fused_qkv"]
    _, states = builds("falcon", tp, 1)
    prefix = "transformer.h.0.self_attention"
    for rank, state in enumerate(states):
        weight, bias, dense = _falcon_expected(tp, rank)
        np.testing.assert_array_equal(state.tensors[f"{prefix}.query_key_value.weight"], weight)
        np.testing.assert_array_equal(state.tensors[f"{prefix}.query_key_value.bias"], bias)
        np.testing.assert_array_equal(state.tensors[f"{prefix}.dense.weight"], dense)
    layouts = [s.layout[f"{prefix}.query_key_value.weight"] for s in states]
    if tp == 4:  # the row picture of docs/layouts.md and docs/families/falcon.md
        assert [x.selection for x in layouts] == [
            (0, ((0, 16), (32, 64))), (0, ((16, 64),)), (0, ((64, 80), (96, 128))),
            (0, ((80, 128),))]
        assert {x.kv_replicas for x in layouts} == {2}
    else:
        assert [x.selection for x in layouts] == [(0, ((0, 64),)), (0, ((64, 128),))]


# ---------------------------------------------------------------- [in, out] (Conv1D)


def test_conv1d_weights_split_columns_on_axis_1_and_rows_on_axis_0(builds):
    assert "[in, out]" in _notes("gpt2")["orientation"]
    full = _full("gpt2")
    config = _config("gpt2")
    heads, hidden = config["n_head"], config["n_embd"]
    d = hidden // heads
    h = "transformer.h.0"
    c_attn, c_attn_bias = full[f"{h}.attn.c_attn.weight"], full[f"{h}.attn.c_attn.bias"]
    _, states = builds("gpt2", 2, 1)
    for rank, state in enumerate(states):
        a, b = rank * heads // 2 * d, (rank + 1) * heads // 2 * d
        # columns [0:H·d] = q, then k, then v; head h owns [h·d, h·d + d) of each block
        cols = np.r_[a:b, hidden + a:hidden + b, 2 * hidden + a:2 * hidden + b]
        np.testing.assert_array_equal(state.tensors[f"{h}.attn.c_attn.weight"], c_attn[:, cols])
        np.testing.assert_array_equal(state.tensors[f"{h}.attn.c_attn.bias"], c_attn_bias[cols])
        np.testing.assert_array_equal(state.tensors[f"{h}.attn.c_proj.weight"],
                                      full[f"{h}.attn.c_proj.weight"][a:b])
        np.testing.assert_array_equal(state.tensors[f"{h}.attn.c_proj.bias"],
                                      full[f"{h}.attn.c_proj.bias"])
        inner = config["n_inner"]
        m, n = rank * inner // 2, (rank + 1) * inner // 2
        np.testing.assert_array_equal(state.tensors[f"{h}.mlp.c_fc.weight"],
                                      full[f"{h}.mlp.c_fc.weight"][:, m:n])
        np.testing.assert_array_equal(state.tensors[f"{h}.mlp.c_fc.bias"],
                                      full[f"{h}.mlp.c_fc.bias"][m:n])
        np.testing.assert_array_equal(state.tensors[f"{h}.mlp.c_proj.weight"],
                                      full[f"{h}.mlp.c_proj.weight"][m:n])


def _linear_layouts(name: str) -> dict[str, LinearWeightLayout | None]:
    bound, _, _ = bind(None, hf(name) / "config.json")
    return {m.target: m.linear for owned in bound.description.groups
            for m in owned.group.members}


def test_conv1d_weights_are_the_transposed_linear_format():
    linear = _linear_layouts("gpt2")
    for target in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                   "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"):
        assert linear[target] is LinearWeightLayout.IN_OUT, target
    assert set(_linear_layouts("phi3").values()) == {LinearWeightLayout.OUT_IN, None}


# ---------------------------------------------------------------- norms needing a reduction


def test_spanning_qk_norms_split_with_their_heads_and_are_recorded_as_needing_a_reduction(
        builds):
    assert "WHOLE projection width" in _notes("olmo2")["qk_norm"]
    full = _full("olmo2")
    plan, states = builds("olmo2", 2, 1)
    a = "model.layers.0.self_attn"
    for rank, state in enumerate(states):
        for norm, proj, width in (("q_norm", "q_proj", 64), ("k_norm", "k_proj", 32)):
            rows = slice(rank * width // 2, (rank + 1) * width // 2)
            np.testing.assert_array_equal(state.tensors[f"{a}.{norm}.weight"],
                                          full[f"{a}.{norm}.weight"][rows])
            np.testing.assert_array_equal(state.tensors[f"{a}.{proj}.weight"],
                                          full[f"{a}.{proj}.weight"][rows])
        reduced = {t.target for t in state.layout.tensors if t.needs_tp_reduction}
        assert reduced == {f"model.layers.{i}.self_attn.{n}.weight" for i in (0, 1)
                           for n in ("q_norm", "k_norm")}
    document = json.loads(plan.document[1])
    marked = {t["target"] for t in document["tensors"] if t.get("needs_tp_reduction")}
    assert marked == reduced
    schema = json.loads((ROOT / "schemas" / "plan.schema.json").read_text())
    jsonschema.validate(document, schema)
    # a plan without such a norm has no such key (other plans stay byte-identical)
    other, _ = builds("llama", 2, 1)
    assert "needs_tp_reduction" not in other.document[1]
    # at T = 1 (whole tensors) nothing needs a reduction
    _, single = builds("olmo2", 1, 1)
    assert not any(t.needs_tp_reduction for t in single[0].layout.tensors)


# ---------------------------------------------------------------- wrong declarations


NEOX_PER_HEAD = ("      layout: per_head                  # [h0: q k v | h1: q k v | ...], "
                 "docs/layouts.md\n      segments: [head_dim, head_dim, head_dim]   "
                 "# q, k, v rows of one head\n      heads: [num_attention_heads]\n")
NEOX_COMPONENT_MAJOR = ("      segments: [num_attention_heads * head_dim, num_attention_heads * "
                        "head_dim, num_attention_heads * head_dim]\n      heads: "
                        "[num_attention_heads, num_attention_heads, num_attention_heads]\n")
FALCON_GROUPED = ("      layout: grouped_per_kv            # per KV group [q …, k, v], "
                  "docs/layouts.md\n")
FALCON_SEGMENTS = '''        - num_attention_heads // kv_groups * head_dim
        - head_dim
        - head_dim
'''
FALCON_CM_SEGMENTS = '''        - num_attention_heads * head_dim
        - kv_groups * head_dim
        - kv_groups * head_dim
'''
OLMO_Q_NORM = '''      - module: "model.layers.{unit}.self_attn.q_norm"
        sharding: column
        reduction: tensor_parallel
'''

# (case, fixture, family file, [(text, replacement)], T, refused by, expected): "check" cases
# assert the static message, "checkpoint" cases the message of a check against the fixture's
# checkpoint; "verify" cases the failing module, group and rank.
MAMBA_SEGMENTS = ("{partitioned_segments: {axis: 0, segments: [intermediate_size, "
                  "intermediate_size]}}")
MAMBA_IN_PROJ = ('      - target: "backbone.layers.{unit}.mixer.in_proj.weight"\n'
                 "        shape: [2 * intermediate_size, hidden_size]\n"
                 f"        sharding: {MAMBA_SEGMENTS}\n")
MAMBA_IN_BIAS = ('      - target: "backbone.layers.{unit}.mixer.in_proj.bias"\n'
                 "        shape: [2 * intermediate_size]\n"
                 f"        sharding: {MAMBA_SEGMENTS}\n")
MAMBA_X_PROJ = "        sharding: {partitioned: 1}\n        reduction: output\n"
NEXT_QKVZ = ('      - target: "model.layers.{unit}.linear_attn.in_proj_qkvz.weight"\n'
             "        shape: [2 * linear_key_dim + 2 * linear_value_dim, hidden_size]\n")
NEXT_CONV = ("        sharding:\n          partitioned_segments: {axis: 0, segments: "
             "[linear_key_dim, linear_key_dim, linear_value_dim]}\n"
             "        heads: [linear_num_key_heads, linear_num_key_heads, "
             "linear_num_value_heads]\n")
JAMBA_IN_PROJ = ("        sharding:\n          partitioned_segments: {axis: 0, segments: "
                 "[mamba_intermediate, mamba_intermediate]}\n        format: linear\n")
BAMBA_IN_PROJ = ("          partitioned_segments:\n            axis: 0\n            segments: "
                 "[mamba_intermediate, mamba_intermediate, mamba_group_width, "
                 "mamba_group_width, mamba_n_heads]\n        heads: [mamba_n_heads, "
                 "mamba_n_heads, mamba_n_groups, mamba_n_groups, mamba_n_heads]\n"
                 "        format: linear\n")
BAMBA_NORM = ("        sharding: {partitioned: 0}\n        heads: mamba_n_heads\n"
              "        reduction: tensor_parallel\n")
MAMBA_CONV_STATE = ('    shape: [intermediate_size, conv_kernel]\n'
                    '    split: {parameters: "layers.{unit}.mixer", axis: 0}\n')
WRONG = [
    ("gpt_neox per-head qkv declared component-major", "gpt_neox", "gpt_neox.yaml",
     [(NEOX_PER_HEAD, NEOX_COMPONENT_MAJOR)], 2, "verify",
     ("gpt_neox.layers.0.attention", "layers.0.attention", 0)),
    ("bloom per-head qkv declared component-major", "bloom", "bloom.yaml",
     [(NEOX_PER_HEAD, NEOX_COMPONENT_MAJOR)], 2, "verify",
     ("transformer.h.0.self_attention", "layers.0.attention", 0)),
    ("falcon grouped qkv declared component-major", "falcon", "falcon.yaml",
     [(FALCON_GROUPED, ""), (FALCON_SEGMENTS, FALCON_CM_SEGMENTS)], 2, "verify",
     ("transformer.h.0.self_attention", "layers.0.attention", 0)),
    ("gpt2 Conv1D c_proj (square) declared as nn.Linear", "gpt2", "gpt2.yaml",
     [('attn.c_proj"\n      orientation: in_out\n', 'attn.c_proj"\n')], 2, "verify",
     ("transformer.h.0.attn", "layers.0.attention", 0)),
    ("gpt2 Conv1D c_attn declared as nn.Linear", "gpt2", "gpt2.yaml",
     [('attn.c_attn"\n      orientation: in_out               # Conv1D: [in, out]\n',
       'attn.c_attn"\n')], 2, "check",
     "segments [64, 64, 64] sum to 192 but axis 0 has 64 elements"),
    ("olmo2 q_norm split without its reduction", "olmo2", "olmo2.yaml",
     [(OLMO_Q_NORM, OLMO_Q_NORM.replace("        reduction: tensor_parallel\n", ""))], 2,
     "verify", ("model.layers.0.self_attn", "layers.0.attention", 0)),
    ("olmo2 q_norm and k_norm declared replicated", "olmo2", "olmo2.yaml",
     [(OLMO_Q_NORM, '''      - module: "model.layers.{unit}.self_attn.q_norm"
        sharding: replicated
'''), ('''      - module: "model.layers.{unit}.self_attn.k_norm"
        sharding: column
        reduction: tensor_parallel
''', '''      - module: "model.layers.{unit}.self_attn.k_norm"
        sharding: replicated
'''), ("        heads: num_attention_heads\n        params: {weight: [num_attention_heads * "
       "head_dim]}", "        params: {weight: [num_attention_heads * head_dim]}"),
      ("        heads: num_key_value_heads\n        params: {weight: [num_key_value_heads * "
       "head_dim]}", "        params: {weight: [num_key_value_heads * head_dim]}")],
     2, "verify", ("model.layers.0.self_attn", "layers.0.attention", 0)),
    ("olmo2 k_norm cut into pieces that split a KV head", "olmo2", "olmo2.yaml",
     [("    units: num_key_value_heads          # the q heads of a KV head travel with it\n",
       "    units: 2 * num_key_value_heads\n"),
      ("        heads: num_key_value_heads\n        params: {weight: [num_key_value_heads * "
       "head_dim]}", "        params: {weight: [num_key_value_heads * head_dim]}"),
      ("      - module: \"model.layers.{unit}.self_attn.k_proj\"\n        sharding: column\n"
       "        heads: num_key_value_heads\n",
       "      - module: \"model.layers.{unit}.self_attn.k_proj\"\n        sharding: column\n"),
      ("      - module: \"model.layers.{unit}.self_attn.v_proj\"\n        sharding: column\n"
       "        heads: num_key_value_heads\n",
       "      - module: \"model.layers.{unit}.self_attn.v_proj\"\n        sharding: column\n")],
     4, "check", "splits `model.layers.{unit}.self_attn.k_proj` (column) over `units: 2 * "
     "num_key_value_heads`"),
    ("a reduction on a row projection", "olmo2", "olmo2.yaml",
     [('self_attn.o_proj"\n        sharding: row\n',
       'self_attn.o_proj"\n        sharding: row\n        reduction: tensor_parallel\n')], 2,
     "check", "so its sharding must be column, found row"),
    ("mamba in_proj [x | z] split as one contiguous block", "mamba", "mamba.yaml",
     [(MAMBA_IN_PROJ, MAMBA_IN_PROJ.replace(MAMBA_SEGMENTS, "{partitioned: 0}")),
      (MAMBA_IN_BIAS, MAMBA_IN_BIAS.replace(MAMBA_SEGMENTS, "{partitioned: 0}"))], 2, "verify",
     ("backbone.layers.0.mixer", "layers.0.mixer", 0)),
    ("mamba x_proj declared column", "mamba", "mamba.yaml",
     [(MAMBA_X_PROJ, "        sharding: {partitioned: 0}\n")], 2, "check",
     "axis 0 of `backbone.layers.0.mixer.x_proj.weight` has 36 elements, which cannot be cut "
     "into the group's 128 partition units (intermediate_size)"),
    ("mamba x_proj split by row without its in-module reduction", "mamba", "mamba.yaml",
     [(MAMBA_X_PROJ, "        sharding: {partitioned: 1}\n")], 2, "verify",
     ("backbone.layers.0.mixer", "layers.0.mixer", 0)),
    ("qwen3_next in_proj_qkvz split as contiguous [q | k | v | z] blocks, not per key-head group",
     "qwen3_next", "qwen3_next.yaml",
     [(NEXT_QKVZ + "        sharding: {partitioned: 0}\n        heads: [linear_num_key_heads]\n",
       NEXT_QKVZ + "        sharding:\n          partitioned_segments: {axis: 0, segments: "
       "[linear_key_dim, linear_key_dim, linear_value_dim, linear_value_dim]}\n")], 2,
     "verify", ("model.layers.0.linear_attn", "layers.0.linear_attn", 0)),
    ("qwen3_next conv1d split contiguously though its channels are [q | k | v]", "qwen3_next",
     "qwen3_next.yaml", [(NEXT_CONV, "        sharding: {partitioned: 0}\n")], 2, "verify",
     ("model.layers.0.linear_attn", "layers.0.linear_attn", 0)),
    # runtime state (`state:`) follows its parameter group's units
    ("mamba conv state split on its kernel axis", "mamba", "mamba.yaml",
     [(MAMBA_CONV_STATE, MAMBA_CONV_STATE.replace("axis: 0", "axis: 1"))], 2, "check",
     "state `conv` of unit 0: axis 1 of its shape [128, 4] has 4 elements, which cannot follow "
     "the 128 partition units of parameter group `layers.0.mixer`"),
    ("a conv state over [x | B | C] split as one block by the x channels", "mamba", "mamba.yaml",
     [(MAMBA_CONV_STATE, MAMBA_CONV_STATE.replace(
         "[intermediate_size, conv_kernel]", "[intermediate_size + 2 * state_size, conv_kernel]"))],
     2, "check", "state `conv` of unit 0: axis 0 of its shape [160, 4] has 160 elements, which "
     "cannot follow the 128 partition units"),
    ("a state following a group of another unit", "mamba", "mamba.yaml",
     [(MAMBA_CONV_STATE, MAMBA_CONV_STATE.replace("layers.{unit}.mixer", "layers.0.mixer"))], 2,
     "check", "state `conv` of `decoder` unit 1 follows parameter group `layers.0.mixer`, which "
     "another owner holds"),
    ("jamba mamba in_proj [x | z] split as one contiguous block", "jamba", "jamba.yaml",
     [(JAMBA_IN_PROJ, "        sharding: {partitioned: 0}\n        format: linear\n"),
      (JAMBA_IN_PROJ.replace("        format: linear\n", "        when: mamba_proj_bias\n"),
       "        sharding: {partitioned: 0}\n        when: mamba_proj_bias\n")], 2, "verify",
     ("model.layers.0.mamba", "layers.0.mamba", 0)),
    ("jamba x_proj split by row without its in-module reduction", "jamba", "jamba.yaml",
     [(MAMBA_X_PROJ, "        sharding: {partitioned: 1}\n")], 2, "verify",
     ("model.layers.0.mamba", "layers.0.mamba", 0)),
    ("jamba conv state following the attention group", "jamba", "jamba.yaml",
     [('    shape: [mamba_intermediate, mamba_d_conv]\n    split: {parameters: "layers.{unit}.'
       'mamba", axis: 0}\n', '    shape: [mamba_intermediate, mamba_d_conv]\n    split: '
       '{parameters: "layers.{unit}.attention", axis: 0}\n')], 2, "check",
     "state `conv` of unit 0 follows parameter group `layers.0.attention`, which this config "
     "does not declare"),
    # Bamba's in_proj [z | x | B | C | dt] cut in T contiguous blocks: rank 0 takes all of z
    # and half of x, none of B, C and dt
    ("bamba Mamba2 in_proj [z | x | B | C | dt] split as one contiguous block", "bamba",
     "bamba.yaml", [("        sharding:\n" + BAMBA_IN_PROJ,
                     "        sharding: {partitioned: 0}\n        heads: mamba_n_heads\n"
                     "        format: linear\n"),
                    ("        sharding:\n" + BAMBA_IN_PROJ.replace(
                        "format: linear", "when: mamba_proj_bias"),
                     "        sharding: {partitioned: 0}\n        heads: mamba_n_heads\n"
                     "        when: mamba_proj_bias\n")], 2, "verify",
     ("model.layers.0.mamba", "layers.0.mamba", 0)),
    ("bamba gated norm of one group split without its reduction", "bamba", "bamba.yaml",
     [(BAMBA_NORM, BAMBA_NORM.replace("        reduction: tensor_parallel\n", ""))], 2,
     "verify", ("model.layers.0.mamba", "layers.0.mamba", 0)),
    ("a state split with fewer head counts than segments", "bamba", "bamba.yaml",
     [("\n      heads: [mamba_n_heads, mamba_n_groups, mamba_n_groups]\n",
       "\n      heads: [mamba_n_heads, mamba_n_groups]\n")], 2, "check",
     "state `conv`: `heads` has 2 counts but the axis has 3 segments [128, 16, 16]; give one "
     "per segment"),
    ("a tensor_parallel reduction on a replicated member", "bamba", "bamba.yaml",
     [(BAMBA_NORM, "        sharding: replicated\n        reduction: tensor_parallel\n")], 2,
     "check", "`reduction: tensor_parallel` marks a norm weight whose statistic spans every "
     "rank's channels, so it must be split by the group's units (`partitioned`), found "
     "\"replicated\""),
    ("a reduction of the output on a column projection", "olmo2", "olmo2.yaml",
     [('self_attn.v_proj"\n        sharding: column\n',
       'self_attn.v_proj"\n        sharding: column\n        reduction: output\n')], 2,
     "check", "so its sharding must be row, found column"),
    ("a reduction of the output on a replicated member", "mamba", "mamba.yaml",
     [(MAMBA_X_PROJ, "        sharding: replicated\n        reduction: output\n")], 2,
     "check", "so it must be split by the group's units (`partitioned` or "
     "`partitioned_segments`), found \"replicated\""),
    ("a per_head layout whose segments have different head counts", "gpt_neox",
     "gpt_neox.yaml", [("      heads: [num_attention_heads]\n",
                        "      heads: [num_attention_heads, num_attention_heads, 2]\n")], 2,
     "check", "every segment has the same head count, found heads [4, 4, 2]"),
    ("a per_head layout without heads", "gpt_neox", "gpt_neox.yaml",
     [("      heads: [num_attention_heads]\n", "")], 2, "check",
     "expected its head count (e.g. `heads: num_attention_heads`), found none"),
    # DBRX's fused experts [E * I, H]: w2 split as one range cuts whole experts
    ("dbrx fused-expert w2 split as whole experts", "dbrx", "dbrx.yaml",
     [('        shape: [moe_num_experts * ffn_hidden_size, hidden_size]\n        sharding:\n'
       '          partitioned_segments: {axis: 0, segments: "[ffn_hidden_size] * '
       'moe_num_experts"}\n\n',
       '        shape: [moe_num_experts * ffn_hidden_size, hidden_size]\n'
       '        sharding: {partitioned: 0}\n\n')], 2, "check",
     "`transformer.blocks.0.ffn.experts.mlp.w2` is partitioned(axis 0) along the expert axis 0, "
     "which holds 4 experts of 32 rows: its cuts would give a tensor-parallel rank a range of "
     "whole experts instead of the same rows inside every expert"),
    ("dbrx fused experts split as one segment per component", "dbrx", "dbrx.yaml",
     [('"[ffn_hidden_size] * moe_num_experts"}\n      - target: "transformer.blocks.{unit}.ffn.'
       'experts.mlp.v1"', '[moe_num_experts * ffn_hidden_size]}\n      - target: '
       '"transformer.blocks.{unit}.ffn.experts.mlp.v1"')], 2, "check",
     "`transformer.blocks.0.ffn.experts.mlp.w1` is partitioned_segments(axis 0, segments [128]) "
     "along the expert axis 0"),
    # CodeGen's qkv_proj: mp_num groups of [q | v | k]
    ("codegen grouped qkv declared component-major [q | v | k]", "codegen", "codegen.yaml",
     [("      layout: grouped                   # mp_num groups of [q_g | v_g | k_g], "
       "docs/layouts.md\n      groups: mp_num\n", ""),
      ("      segments: [hidden_size // mp_num, hidden_size // mp_num, hidden_size // mp_num]",
       "      segments: [hidden_size, hidden_size, hidden_size]"),
      ("      heads: [num_attention_heads]\n",
       "      heads: [num_attention_heads, num_attention_heads, num_attention_heads]\n")], 2,
     "verify",
     ("transformer.h.0.attn", "layers.0.attention", 0)),
    # at T = 2 and 4 a rank's rows are whole mp_num groups either way: T = 8 tells them apart
    ("codegen grouped qkv declared with one group per head", "codegen", "codegen.yaml",
     [("      groups: mp_num\n", "      groups: num_attention_heads\n"),
      ("      segments: [hidden_size // mp_num, hidden_size // mp_num, hidden_size // mp_num]",
       "      segments: [head_dim, head_dim, head_dim]")], 8, "verify",
     ("transformer.h.0.attn", "layers.0.attention", 0)),
    ("codegen grouped layout without its group count", "codegen", "codegen.yaml",
     [("      groups: mp_num\n", "")], 2, "check",
     "layout `grouped` needs `groups:`, the group count of the fused rows"),
    ("a grouped layout whose query heads do not fill the KV groups", "falcon", "falcon.yaml",
     [("        - num_attention_heads\n", "        - 3\n")], 2, "check",
     "does not hold a whole number of heads in each of the 2 KV groups"),
    # StableLM's per-head q norms indexed by KV head: rank r would take q norm r (its KV head),
    # not those of its query heads; the checkpoint's norms of the other query heads tell
    ("stablelm per-head q norms indexed by KV head", "stablelm_qk", "stablelm.yaml",
     [("        sharding: per_head              # one LayerNorm per query head, on its head's "
       "ranks\n        heads: num_attention_heads\n",
       "        sharding: per_head\n        heads: num_key_value_heads\n")], 2, "checkpoint",
     "checkpoint tensor `model.layers.0.self_attn.q_layernorm.norms.2.weight` is owned by no "
     "parameter group"),
    # every tensor owned, every rank a whole norm per head, but of another rank's heads
    ("stablelm per-head q norms given to the ranks of other heads", "stablelm_qk",
     "stablelm.yaml", [('"model.layers.{unit}.self_attn.q_layernorm.norms.{head}"',
                        '"model.layers.{unit}.self_attn.q_layernorm.norms.{(head + 2) % '
                        'num_attention_heads}"')], 2, "verify",
     ("model.layers.0.self_attn", "layers.0.attention", 0)),
    ("stablelm per-head norms without a head count", "stablelm_qk", "stablelm.yaml",
     [("        sharding: per_head              # one LayerNorm per query head, on its head's "
       "ranks\n        heads: num_attention_heads\n", "        sharding: per_head\n")], 2,
     "check", "a `sharding: per_head` projection is one module per head; expected its head "
     "count (e.g. `heads: num_attention_heads`), found none"),
]


@pytest.mark.parametrize("case", WRONG, ids=[c[0] for c in WRONG])
def test_a_wrong_layout_declaration_is_refused_by_check_or_by_verify(tmp_path, case):
    _, fixture, file, edits, tp, how, expected = case
    path = tmp_path / file
    text = (ARCHITECTURES / file).read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    config = hf(fixture) / "config.json"
    topology = Topology(tensor_parallel_size=tp, pipeline_parallel_size=1)
    checkpoint = hf(fixture) if how == "checkpoint" else None
    errors = check_family(path, config, checkpoint, topology=topology)
    if how == "checkpoint":  # refused against the checkpoint, located in its file
        assert any(expected in str(e) for e in errors), [str(e) for e in errors]
        located = [e for e in errors if expected in str(e)][0]
        assert str(located).startswith(str(hf(fixture) / "model.safetensors")), str(located)
        return
    if how == "check":
        assert errors and any(expected in str(e) for e in errors), [str(e) for e in errors]
        located = [e for e in errors if expected in str(e)][0]
        assert isinstance(located, PartcError) and located.location is not None
        assert str(located).startswith(str(path)), str(located)
        return
    assert errors == [], [str(e) for e in errors]  # statically fine
    report = verify_family(path, config, tensor_parallel_sizes=[tp], pipeline_parallel_size=1)
    failure = report.first_failure
    assert not report.ok and failure is not None
    module, group, rank = expected
    assert (failure.module, failure.group, failure.rank) == (module, group, rank), failure
    assert failure.max_error > failure.tolerance
    assert re.match(rf"T={tp} x S=1: module `{re.escape(module)}` \(group `{group}`\), rank "
                    rf"{rank}: ", failure.message), failure.message


# ---------------------------------------------------------------- TOML spelling


@pytest.mark.parametrize(("family", "tp"), [("falcon", 4), ("gpt2", 2), ("olmo2", 2)])
def test_the_layout_vocabulary_reads_the_same_in_toml(tmp_path, family, tp):
    import yaml
    from regenerate_cases import toml_spelling

    from partc.api import compile_family

    data = yaml.safe_load((ARCHITECTURES / f"{family}.yaml").read_text())
    toml = tmp_path / f"{family}.toml"
    toml.write_text(toml_spelling(data))
    config = hf(family) / "config.json"
    from_toml = compile_family(toml, config, Topology(tensor_parallel_size=tp)).plan
    from_yaml = compile_family(ARCHITECTURES / f"{family}.yaml", config,
                               Topology(tensor_parallel_size=tp)).plan
    tensors = json.loads(from_yaml.document[1])["tensors"]
    # the YAML plan's placements are the ones the tests above check against HF's slices
    assert json.loads(from_toml.document[1])["tensors"] == tensors


def test_only_partitioned_segments_interleave_groups():
    from partc.errors import ParallelPlanError
    from partc.parallel.specs import EqualSharding, PartitionedSegmentsSharding

    with pytest.raises(TypeError, match="groups"):
        EqualSharding(axis=0, groups=2)  # type: ignore[call-arg]
    with pytest.raises(ParallelPlanError, match="in each of 4 interleaved groups"):
        PartitionedSegmentsSharding(axis=0, segments=(16, 16, 18), groups=4)
    assert PartitionedSegmentsSharding(axis=0, segments=(64, 64), groups=4).describe() == (
        "partitioned_segments(axis 0, segments [64, 64], 4 interleaved groups)")


def test_kv_replication_refuses_to_repeat_kv_heads_of_a_norm_needing_a_reduction(tmp_path):
    text = (ARCHITECTURES / "olmo2.yaml").read_text()
    anchor = "    units: num_key_value_heads          # the q heads of a KV head travel with it\n"
    path = tmp_path / "olmo2.yaml"
    path.write_text(text.replace(anchor, anchor + "    kv_replication: true\n"))
    errors = check_family(path, hf("olmo2") / "config.json",
                          topology=Topology(tensor_parallel_size=4, pipeline_parallel_size=1))
    assert any("`model.layers.0.self_attn.k_norm.weight` needs a tensor-parallel reduction of "
               "its statistic, and repeating its 2 KV heads over 4 ranks would count each of "
               "them 2 times in it" in str(e) for e in errors), [str(e) for e in errors]
    # over 2 ranks nothing is repeated: the same file is fine
    assert check_family(path, hf("olmo2") / "config.json", topology=Topology(
        tensor_parallel_size=2, pipeline_parallel_size=1)) == []
