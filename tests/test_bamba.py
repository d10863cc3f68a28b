"""The built-in bamba family (issue 35) against transformers' BambaForCausalLM.

The fixture `hf/bamba` (tests/fixtures/gen/gen_bamba.py) has Mamba2 layers 0, 2, 3 and an
attention layer 1 (`attn_layer_indices: [1]`), 8 Mamba2 heads of 16 channels in one group
(vLLM repeats the group's B and C on every rank) and 8 query / 2 KV heads; its `reference.npz`
holds HF's logits and the state HF's cache keeps per layer: the conv window over [x | B | C]
and the SSM state [heads, head_dim, N] on Mamba2 layers, keys / values on the attention one.
"""

from __future__ import annotations

import json

import pytest

from partc.runtime import partition_state
from partc.verify.run import verify_family

from support import compile_and_load, hf
from support.state_space import (
    TOLERANCE,
    assert_hf_cache_on,
    indices,
    reference,
    rel_err,
    run_ranks,
    stage_layers,
    whole_model_run,
)

BAMBA = hf("bamba")
ATTENTION = {1}
INNER, N, HEADS, P = 128, 16, 8, 16  # Mamba2 channels, state size, heads, head_dim


def test_the_fixture_is_hf_bamba_with_one_attention_layer_and_one_mamba2_group():
    manifest = json.loads((BAMBA / "manifest.json").read_text())
    config = json.loads((BAMBA / "config.json").read_text())
    assert manifest["model_class"] == "BambaForCausalLM"
    assert manifest["layers_block_type"] == ["linear_attention", "full_attention",
                                             "linear_attention", "linear_attention"]
    assert (config["mamba_n_groups"], config["mamba_n_heads"], config["mamba_d_head"]) == (
        1, HEADS, P)
    assert reference(BAMBA)["conv_state_0"].shape == (1, INNER + 2 * N, 4)


def test_the_executor_reproduces_hf_bamba_logits_and_every_layer():
    whole_model_run("bamba", 4)


def test_at_t4_each_rank_takes_two_heads_and_the_whole_group_of_in_proj_as_vllm(tmp_path):
    """vLLM's MambaMixer2 at T=4 with one group: rank t holds heads [2t, 2t+2) of z, x and
    dt, and B and C whole (the one group repeated); the layout is compared with row ids
    computed here from HF's [z | x | B | C | dt] order."""
    _, states = compile_and_load(None, BAMBA / "config.json", tmp_path,
                                 BAMBA / "model.safetensors", tp=4)
    for t, loaded in enumerate(states):
        heads = range(2 * t, 2 * t + 2)
        x = [h * P + p for h in heads for p in range(P)]
        want = (x + [INNER + c for c in x] + list(range(2 * INNER, 2 * INNER + 2 * N))
                + [2 * INNER + 2 * N + h for h in heads])
        layout = loaded.layout["model.layers.0.mamba.in_proj.weight"]
        assert indices(layout.selection, layout.global_shape[0]) == want
        conv = loaded.layout["model.layers.2.mamba.conv1d.weight"]
        xbc = x + list(range(INNER, INNER + 2 * N))
        assert indices(conv.selection, conv.global_shape[0]) == xbc
        assert loaded.layout["model.layers.3.mamba.norm.weight"].needs_tp_reduction


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_ranks_of_the_built_in_bamba_family_reproduce_hf_logits_and_state(tmp_path, tp, pp):
    """partc's rank shards, run by the numpy executor (Mamba2 heads split, the one group's B
    and C repeated, the gated norm's statistic all-reduced, attention KV heads repeated at
    T=4), give HF's logits; each rank's conv and SSM state is HF's cache on its channels and
    heads, and the state partc declares for it has that shape and selection."""
    plan, states, result, ref = run_ranks("bamba", tmp_path, tp, pp)
    assert plan.family == "bamba"
    layers = [stage_layers(plan, p) for p in range(pp)]
    assert rel_err(result.logits, ref["logits"]) < TOLERANCE
    checked = 0
    for p, layers_of_stage in enumerate(layers):
        for offset, layer in enumerate(layers_of_stage):
            ran = result.stages[p].states[offset]
            if layer in ATTENTION:
                assert ran == []
                continue
            assert len(ran) == tp
            for t, state in enumerate(ran):
                declared = {x.name: x for x in partition_state(states[p * tp + t].table).tensors
                            if x.unit == layer}
                conv, ssm = ref[f"conv_state_{layer}"], ref[f"ssm_state_{layer}"]
                assert_hf_cache_on(state.conv_state, conv, state.conv_channels)
                assert_hf_cache_on(state.ssm_state, ssm, state.heads)
                for name, ids, whole in (("conv", state.conv_channels, conv),
                                         ("ssm", state.heads, ssm)):
                    x = declared[name]
                    assert x.global_shape == whole.shape[1:]
                    assert indices(x.placement.selection(x.global_shape),
                                    whole.shape[1]) == sorted(ids.tolist())
                    assert x.local_shape == (len(ids), *whole.shape[2:])
                checked += 1
    assert checked == 3 * tp


def test_each_attention_rank_declares_the_kv_heads_its_query_heads_read(tmp_path):
    _, states = compile_and_load(None, BAMBA / "config.json", tmp_path,
                                 BAMBA / "model.safetensors", tp=4)
    keys = [[(x.local_shape, x.placement.selection(x.global_shape))
             for x in partition_state(s.table).tensors if (x.unit, x.name) == (1, "key")]
            for s in states]
    assert keys == [[((1, 8), (0, ((h, h + 1),)))] for h in (0, 0, 1, 1)]
    # per sequence: conv [c, 4] + SSM [2, 16, 16] on 3 Mamba2 layers, c = 32 + 2 * 16
    assert all(s.info.local_state_bytes == 4 * 3 * (64 * 4 + 2 * P * N) for s in states)


def test_verify_passes_the_bamba_split_at_every_legal_t_up_to_8_and_a_pipeline_split():
    report = verify_family(None, BAMBA / "config.json")
    assert report.ok, report.first_failure
    checked = sorted({(c.tp, c.pp) for c in report.checks})
    assert checked == [(1, 1), (1, 2), (2, 1), (4, 1), (8, 1)]


def test_with_two_groups_the_groups_are_split_and_verify_passes_up_to_their_count(tmp_path):
    """n_groups % T == 0 (vLLM splits the groups): each rank whole groups, the gated norm local
    to them; T = 4 > 2 groups is refused (vLLM repeats B and C only for one group)."""
    from partc.api import check_family
    from partc.plan.topology import Topology

    config = json.loads((BAMBA / "config.json").read_text())
    config["mamba_n_groups"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = verify_family(None, path, tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    assert report.ok, report.first_failure
    errors = check_family(None, path, None, topology=Topology(tensor_parallel_size=4))
    assert any("group `layers.0.mamba` cannot be sharded over tensor_parallel_size 4: it (role "
               "channels) has 2 partition units (mamba_n_groups) but tensor_parallel_size is 4"
               in str(e) for e in errors), [str(e) for e in errors]


def test_the_conv_state_without_head_counts_would_cut_the_repeated_group_in_halves(tmp_path):
    """The state split's `heads: [H, G, G]` is what keeps B and C whole on every rank at T=2:
    without it each segment is cut by fraction, and rank 0 would declare half of B and C."""
    from partc.api import compile_family
    from partc.plan.topology import Topology

    from support import ROOT

    text = (ROOT / "architectures" / "bamba.yaml").read_text()
    heads = "\n      heads: [mamba_n_heads, mamba_n_groups, mamba_n_groups]\n"
    assert text.count(heads) == 1
    family = tmp_path / "bamba.yaml"
    family.write_text(text.replace(heads, "\n"))
    selections = []
    for path in (ROOT / "architectures" / "bamba.yaml", family):
        plan = compile_family(path, BAMBA / "config.json", Topology(tensor_parallel_size=2)).plan
        conv = [x for x in plan.ranks[0].partition.state.tensors if (x.name, x.unit) == ("conv", 0)]
        selections.append(conv[0].placement.selection(conv[0].global_shape))
    assert selections[0] == (0, ((0, 64), (128, 160)))  # heads 0-3 of x, B and C whole
    assert selections[1] == (0, ((0, 64), (128, 136), (144, 152)))


def test_verify_shrinks_a_bamba_9b_shaped_config_keeping_mamba2_heads_and_an_attention_layer(
        tmp_path):
    """Bamba-9B's sizes (hidden 4096, 128 Mamba2 heads of 64, state 128, attention on layers
    9, 18, 27): the shrunk reference model must still satisfy HF's `mamba_n_heads *
    mamba_d_head == mamba_expand * hidden_size` and keep an attention layer."""
    config = json.loads((BAMBA / "config.json").read_text())
    config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[9, 18, 27],
                  mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128, vocab_size=128256)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = verify_family(None, path, tensor_parallel_sizes=[4], pipeline_parallel_size=1)
    assert report.ok, report.first_failure
    assert any("mamba_d_head 64 -> 16" in n and "mamba_n_heads 128 -> " in n
               for n in report.notes), report.notes
    assert any("attn_layer_indices [9, 18, 27] -> [1]" in n for n in report.notes), report.notes
    assert {"model.layers.0.mamba", "model.layers.1.self_attn"} <= {c.module for c in report.checks}
