"""The built-in jamba family (issue 35) against transformers' JambaForCausalLM.

The fixture `hf/jamba` (tests/fixtures/gen/gen_jamba.py) has the four layer kinds (mamba +
dense, attention + experts, mamba + dense, mamba + experts); its `reference.npz` holds the state
HF's cache keeps per layer: conv / SSM state on Mamba layers, keys / values on attention ones.
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

JAMBA = hf("jamba")
KINDS = ["mamba", "attention", "mamba", "mamba"]  # HF's layers_block_type for the fixture


def test_the_fixture_has_the_layer_kinds_the_family_selects_by_period_and_offset():
    manifest = json.loads((JAMBA / "manifest.json").read_text())
    assert manifest["layers_block_type"] == KINDS
    assert manifest["layers_num_experts"] == [1, 4, 1, 4]


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_declared_state_is_the_hf_cache_on_its_channels_or_kv_heads(tmp_path, tp, pp):
    """Per layer of its stage, each rank declares the state HF's cache holds for that layer's
    kind (keys / values on attention, conv / SSM on Mamba), of HF's whole shape, restricted to
    the channels (or KV heads) of the parameters the rank loaded."""
    ref = reference(JAMBA)
    plan, states = compile_and_load(None, JAMBA / "config.json", tmp_path,
                                    JAMBA / "model.safetensors", tp=tp, pp=pp)
    assert plan.family == "jamba"
    seen = set()
    for loaded in states:
        declared = partition_state(loaded.table)
        layout = loaded.layout
        for x in declared.tensors:
            seen.add((x.unit, x.name))
            kind = KINDS[x.unit]
            prefix = f"model.layers.{x.unit}"
            if kind == "attention":
                assert x.name in ("key", "value")
                cache = ref[f"{x.name}_{x.unit}"]  # [batch, K, sequence, d]
                whole = (cache.shape[1], cache.shape[3])
                proj = layout[f"{prefix}.self_attn.{x.name[0]}_proj.weight"]
                rows = indices(proj.selection, proj.global_shape[0])
                held = sorted({r // cache.shape[3] for r in rows})  # the KV heads it loaded
                local = cache[:, held][:, :, 0]
            else:
                assert x.name in ("conv", "ssm")
                cache = ref[f"{x.name}_state_{x.unit}"]  # [batch, I, K or N]
                whole = cache.shape[1:]
                conv = layout[f"{prefix}.mamba.conv1d.weight"]
                held = indices(conv.selection, conv.global_shape[0])  # its channels
                local = cache[:, held]
            assert x.global_shape == whole
            assert indices(x.placement.selection(x.global_shape), whole[0]) == held
            assert x.local_shape == local.shape[1:]
        assert loaded.info.local_state_bytes == declared.local_bytes > 0
        assert loaded.info.local_state_bytes_per_token == declared.local_bytes_per_token
        assert all(x.per_token == (x.name in ("key", "value")) for x in declared.tensors)
    assert seen == {(u, n) for u, kind in enumerate(KINDS)
                    for n in (("key", "value") if kind == "attention" else ("conv", "ssm"))}


def test_at_t4_two_ranks_share_each_kv_head_and_each_rank_a_quarter_of_the_channels(tmp_path):
    plan, states = compile_and_load(None, JAMBA / "config.json", tmp_path,
                                    JAMBA / "model.safetensors", tp=4)
    shapes = [{(x.unit, x.name): (x.local_shape, x.placement.selection(x.global_shape))
               for x in partition_state(s.table).tensors} for s in states]
    assert [s[1, "key"] for s in shapes] == [((1, 8), (0, ((h, h + 1),))) for h in (0, 0, 1, 1)]
    assert [s[3, "ssm"] for s in shapes] == [((32, 16), (0, ((32 * t, 32 * t + 32),)))
                                             for t in range(4)]
    # per sequence: conv + SSM of the 3 Mamba layers; per token: one KV head's key and value
    assert all(s.info.local_state_bytes == 4 * 3 * 32 * (4 + 16) for s in states)
    assert all(s.info.local_state_bytes_per_token == 4 * 2 * 8 for s in states)
    assert all(partition_state(s.table).unit_bytes() == (
        ("decoder", 0, 2560, 0), ("decoder", 1, 0, 64), ("decoder", 2, 2560, 0),
        ("decoder", 3, 2560, 0)) for s in states)


def test_verify_passes_the_jamba_split_at_every_legal_t_up_to_8_and_a_pipeline_split():
    report = verify_family(None, JAMBA / "config.json")
    assert report.ok, report.first_failure
    checked = sorted({(c.tp, c.pp) for c in report.checks})
    assert checked == [(1, 1), (1, 2), (2, 1), (4, 1), (8, 1)]


def test_the_executor_reproduces_hf_jamba_logits_and_every_layer_kind():
    whole_model_run("jamba", 4)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_ranks_of_the_built_in_jamba_family_reproduce_hf_logits_and_mamba_state(
        tmp_path, tp, pp):
    """partc's rank shards, run by the numpy executor (attention heads, Mamba channels and
    expert channels split; x_proj summed inside the mixer; KV heads repeated at T=4), give HF's
    logits, and each rank's conv / SSM state is HF's cache on its channels."""
    plan, states, result, ref = run_ranks("jamba", tmp_path, tp, pp)
    layers = [stage_layers(plan, p) for p in range(pp)]
    assert rel_err(result.logits, ref["logits"]) < TOLERANCE
    if pp == 2:
        assert rel_err(result.sent[0], ref["layer_outputs"][layers[0].stop - 1]) < TOLERANCE
    for p, layers_of_stage in enumerate(layers):
        for offset, layer in enumerate(layers_of_stage):
            ran = result.stages[p].states[offset]
            if KINDS[layer] != "mamba":
                assert ran == []
                continue
            assert len(ran) == tp
            for t, state in enumerate(ran):
                declared = {x.name: x for x in partition_state(states[p * tp + t].table).tensors
                            if x.unit == layer}
                for name, produced in (("conv", state.conv_state), ("ssm", state.ssm_state)):
                    cache = ref[f"{name}_state_{layer}"]
                    assert declared[name].local_shape == produced.shape[1:]
                    assert_hf_cache_on(produced, cache, state.channels)

