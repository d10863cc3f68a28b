"""State-space families (issue 35): the built-in mamba and qwen3_next families against transformers.

The fixtures `hf/mamba` and `hf/qwen3_next` are tiny random MambaForCausalLM /
Qwen3NextForCausalLM models written by transformers 5.24 (tests/fixtures/gen/gen_ssm.py); their
`reference.npz` holds HF's logits and the conv / SSM (recurrent) state HF's cache holds after the
forward (for qwen3_next's full-attention layers, its keys and values). The numpy executor
(tests/executor/ssm.py, tests/executor/deltanet.py) runs the mixers on each rank's loaded arrays
with the selections its layout declares, simulating the all-reduces.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from partc.verify.run import verify_family

from support import hf
from support.state_space import (
    TOLERANCE,
    assert_hf_cache_on,
    rel_err,
    run_ranks,
    stage_layers,
    whole_model_run,
)

MAMBA = hf("mamba")
NEXT = hf("qwen3_next")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(fixture, T, S) -> (plan, loaded states, executor result, reference), each built once;
    `runs.folders[fixture, T, S]` is the build's folder."""
    cache = {}
    folders = {}

    def get(name, tp, pp):
        if (name, tp, pp) not in cache:
            out = tmp_path_factory.mktemp(f"{name}_tp{tp}_pp{pp}")
            cache[name, tp, pp] = run_ranks(name, out, tp, pp)
            folders[name, tp, pp] = out
        return cache[name, tp, pp]

    get.folders = folders
    return get


@pytest.mark.parametrize(("name", "layers", "state_layers", "second", "shapes"), [
    ("mamba", 2, [0, 1], "ssm_state", ((1, 128, 4), (1, 128, 16))),
    ("qwen3_next", 4, [0, 2], "recurrent_state", ((1, 256, 4), (1, 16, 8, 8))),
])
def test_the_executor_reproduces_hf_logits_layers_and_cache_state(
        name, layers, state_layers, second, shapes) -> None:
    """Whole weights: HF's logits and layer outputs, and on each stateful layer (qwen3_next:
    its linear-attention layers) the conv state and the SSM / recurrent state of HF's cache."""
    result, ref = whole_model_run(name, layers)
    if name == "qwen3_next":
        assert ref["state_layers"].tolist() == state_layers  # the linear-attention layers
    assert [len(states) for states in result.states] == [
        int(layer in state_layers) for layer in range(layers)]
    for index, layer in enumerate(state_layers):
        (state,) = result.states[layer]
        for key, shape in zip(("conv_state", second), shapes, strict=True):
            assert getattr(state, key).shape == ref[key][index].shape == shape
            assert rel_err(getattr(state, key), ref[key][index]) < TOLERANCE


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("name", "boundary"), [("mamba", 0), ("qwen3_next", 1)])
def test_the_ranks_of_the_built_in_family_reproduce_hf_logits(runs, name, boundary, tp, pp):
    """The ranks' pipeline gives HF's logits; at S=2 stage 0 sends HF's output of its last
    layer (`boundary`)."""
    plan, _, result, reference = runs(name, tp, pp)
    assert plan.family == name
    assert rel_err(result.logits, reference["logits"]) < TOLERANCE
    if pp == 2:
        assert rel_err(result.sent[0], reference["layer_outputs"][boundary]) < TOLERANCE


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [2, 4])
def test_the_mamba_ranks_really_split_by_channel(runs, tp, pp):
    """Each rank holds I / T channels of x and of z."""
    _, states, _, _ = runs("mamba", tp, pp)
    layout = states[0].layout["backbone.layers.0.mixer.in_proj.weight"]
    width = 128 // tp
    assert layout.selection == (0, ((0, width), (128, 128 + width)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_state_equals_hf_cache_on_the_rank_channels(runs, tp):
    _, _, result, reference = runs("mamba", tp, 1)
    for layer, ranks in enumerate(result.stages[0].states):
        channels = np.concatenate([s.channels for s in ranks])
        assert sorted(channels.tolist()) == list(range(128))
        for state in ranks:
            assert state.conv_state.shape == (1, 128 // tp, 4)
            assert_hf_cache_on(state.conv_state, reference["conv_state"][layer], state.channels)
            assert_hf_cache_on(state.ssm_state, reference["ssm_state"][layer], state.channels)


def _selected(layout, axis_length: int) -> np.ndarray:
    """The indices along a state layout's split axis that its placement selects."""
    axis, ranges = layout.placement.selection(layout.global_shape)
    if axis is None:
        return np.arange(axis_length)
    return np.concatenate([np.arange(a, b) for a, b in ranges])


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_declared_state_is_the_hf_cache_on_the_rank_channels(runs, tp, pp):
    """The rank module's PartitionState (the family's `state:` realized for the rank) names,
    per layer of its stage, the conv and SSM state HF's cache holds on the rank's channels:
    same whole shape as HF's cache, local shape and channels those of the state the rank's
    forward produced (which equals HF's cache on those channels)."""
    from partc.runtime import partition_state

    plan, states, result, reference = runs("mamba", tp, pp)
    for stage in range(pp):
        layers = stage_layers(plan, stage)
        for t in range(tp):
            loaded = states[stage * tp + t]
            declared = partition_state(loaded.table)
            assert [(x.name, x.unit) for x in declared.tensors] == [
                (name, layer) for layer in layers for name in ("conv", "ssm")]
            for x in declared.tensors:
                hf_cache = reference[f"{x.name}_state"][x.unit]  # [batch, I, K or N]
                ran = result.stages[stage].states[x.unit - layers.start][t]
                produced = ran.conv_state if x.name == "conv" else ran.ssm_state
                assert x.global_shape == hf_cache.shape[1:]
                assert x.local_shape == produced.shape[1:]
                channels = _selected(x, x.global_shape[0])
                assert channels.tolist() == ran.channels.tolist()
                assert hf_cache[:, channels].shape[1:] == x.local_shape
                assert_hf_cache_on(produced, hf_cache, channels)
                assert x.dtype == "F32" and x.local_bytes == 4 * int(np.prod(x.local_shape))
            assert loaded.info.local_state_bytes == declared.local_bytes == sum(
                4 * (128 // tp) * (4 + 16) for _ in layers)


def test_mamba_state_is_recorded_in_plan_json_and_shown_by_inspect(runs, capsys):
    from partc.cli.main import main

    runs("mamba", 2, 1)
    build = runs.folders["mamba", 2, 1]
    folder = next(build.rglob("plan.json")).parent
    plan_json = json.loads((folder / "plan.json").read_text())
    tensors = plan_json["ranks"][1]["partition"]["state"]["tensors"]
    assert [(x["name"], x["unit"], x["local_shape"], x["placement"]) for x in tensors] == [
        (name, unit, [64, width], {"kind": "range", "axis": 0, "start": 64, "end": 128})
        for unit in (0, 1) for name, width in (("conv", 4), ("ssm", 16))]
    assert plan_json["ranks"][1]["info"]["local_state_bytes"] == 2 * 4 * 64 * 20
    assert plan_json["ranks"][1]["info"]["local_state_bytes_per_token"] == 0
    assert {x["per"] for x in tensors} == {"sequence"}
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert ("   1  decoder[0:2]  conv [64, 4] of [128, 4] F32, ssm [64, 16] of [128, 16] F32"
            "     5 KiB      10 KiB") in text
    assert main(["inspect", str(folder), "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)["state"]
    assert [(r["rank"], r["bytes"], [run["units"] for run in r["runs"]]) for r in shown] == [
        (0, 10240, [[0, 2]]), (1, 10240, [[0, 2]])]


def test_x_proj_is_recorded_as_reduced_inside_the_mixer_in_plan_and_rank_tables(runs):
    plan, states, _, _ = runs("mamba", 2, 1)
    build = runs.folders["mamba", 2, 1]
    plan_json = json.loads(next(build.rglob("plan.json")).read_text())
    reduced = sorted(t["target"] for t in plan_json["tensors"]
                     if t.get("needs_tp_output_reduction"))
    assert reduced == [f"backbone.layers.{i}.mixer.x_proj.weight" for i in range(2)]
    assert not any(t.get("needs_tp_reduction") for t in plan_json["tensors"])
    for state in states:
        flagged = sorted(x.target for x in state.layout.tensors if x.needs_tp_output_reduction)
        assert flagged == reduced
    modules = sorted(p for p in build.rglob("*.py") if "tp all-reduce output" in p.read_text())
    assert len(modules) == 2  # the module of each rank
    assert all("'output'" in p.read_text() or '"output"' in p.read_text() for p in modules)


@pytest.mark.parametrize(("name", "modules"), [
    ("mamba", {"backbone.layers.0.mixer"}),
    ("qwen3_next", {"model.layers.0.linear_attn", "model.layers.1.self_attn"}),
])
def test_verify_passes_the_split_at_every_t_up_to_8_and_a_pipeline_split(name, modules):
    """`partc verify` checks each module of the family (`modules` among them) at T = 1, 2, 4, 8
    and at S = 2, and every check passes."""
    report = verify_family(None, hf(name) / "config.json", tensor_parallel_sizes=[1, 2, 4, 8],
                           pipeline_parallel_size=2)
    assert report.ok, report.first_failure
    assert {c.tp for c in report.checks} == {1, 2, 4, 8}
    assert any(c.pp == 2 for c in report.checks)
    assert modules <= {c.module for c in report.checks}


# ---------------------------------------------------------------- qwen3_next (gated DeltaNet)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [2, 4])
def test_the_qwen3_next_ranks_split_by_key_heads(runs, tp, pp):
    """8 / T key-head blocks of 48 rows of in_proj_qkvz; the conv in three blocks."""
    layout = runs("qwen3_next", tp, pp)[1][1].layout
    heads = 8 // tp
    assert layout["model.layers.0.linear_attn.in_proj_qkvz.weight"].selection == (
        0, ((heads * 48, 2 * heads * 48),))
    assert layout["model.layers.0.linear_attn.conv1d.weight"].selection == (
        0, ((heads * 8, 2 * heads * 8), (64 + heads * 8, 64 + 2 * heads * 8),
            (128 + heads * 16, 128 + 2 * heads * 16)))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_each_qwen3_next_rank_state_equals_hf_cache_on_the_rank_heads(runs, tp):
    _, _, result, reference = runs("qwen3_next", tp, 1)
    assert rel_err(result.logits, reference["logits"]) < TOLERANCE  # T = 8: one key head each
    states = result.stages[0].states
    for index, layer in enumerate(reference["state_layers"]):
        ranks = states[layer]
        assert len(ranks) == tp
        channels = np.concatenate([s.channels for s in ranks])
        heads = np.concatenate([s.value_heads for s in ranks])
        assert sorted(channels.tolist()) == list(range(256))
        assert sorted(heads.tolist()) == list(range(16))
        for state in ranks:
            assert state.conv_state.shape == (1, 256 // tp, 4)
            assert state.recurrent_state.shape == (1, 16 // tp, 8, 8)
            assert_hf_cache_on(state.conv_state, reference["conv_state"][index], state.channels)
            assert_hf_cache_on(state.recurrent_state, reference["recurrent_state"][index],
                               state.value_heads)


def _next_hf_state_on_rank(reference, result, loaded, stage: int, layers: range, t: int):
    """{(name, layer): (HF's whole shape, HF's cache on the rank's part, its indices)} for one
    rank: on a linear-attention layer the conv channels and value heads the rank's forward ran
    (the executor's selection, as in the test above), on a full-attention layer the KV heads of
    the `k_proj` rows it loaded (batch axis dropped; keys / values per token)."""
    linear = reference["state_layers"].tolist()
    attention = reference["attention_layers"].tolist()
    expected = {}
    for layer in layers:
        if layer in linear:
            index = linear.index(layer)
            ran = result.stages[stage].states[layer - layers.start][t]
            for name, held in (("conv", ran.channels), ("recurrent", ran.value_heads)):
                cache = reference[f"{name}_state"][index]  # [batch, 256, K] / [batch, Hv, dk, dv]
                expected[name, layer] = (cache.shape[1:], cache[:, held].shape[1:],
                                         held.tolist())
        else:
            index = attention.index(layer)
            proj = loaded.layout[f"model.layers.{layer}.self_attn.k_proj.weight"]
            axis, ranges = proj.selection
            rows = range(proj.global_shape[0]) if axis is None else [
                r for a, b in ranges for r in range(a, b)]
            for name in ("key", "value"):
                cache = reference[f"{name}_state"][index]  # [batch, K, sequence, d]
                held = sorted({r // cache.shape[3] for r in rows})
                expected[name, layer] = ((cache.shape[1], cache.shape[3]),
                                         cache[:, held][:, :, 0].shape[1:], held)
    return expected


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_qwen3_next_rank_declares_the_hf_cache_on_its_heads_in_plan_module_and_inspect(
        runs, tp, pp, capsys):
    """Each rank's declared state (its rank module's `state()`, plan.json and `partc inspect
    --format json`) is, per layer of its stage, HF's cache for that layer's kind: on a
    linear-attention layer the conv state on the [q | k | v] channels and the recurrent state on
    the value heads of the rank's key heads, on a full-attention layer keys and values (per
    token) on its KV heads; whole shapes HF's, local shapes HF's cache on those indices, and the
    byte totals their sum."""
    from partc.cli.main import main
    from partc.runtime import partition_state

    plan, states, result, reference = runs("qwen3_next", tp, pp)
    folder = next(runs.folders["qwen3_next", tp, pp].rglob("plan.json")).parent
    plan_json = json.loads((folder / "plan.json").read_text())
    assert main(["inspect", str(folder), "--format", "json"]) == 0
    shown = {r["rank"]: r for r in json.loads(capsys.readouterr().out)["state"]}
    assert sorted(shown) == list(range(tp * pp))
    for stage in range(pp):
        layers = stage_layers(plan, stage)
        for t in range(tp):
            rank = stage * tp + t
            loaded = states[rank]
            expected = _next_hf_state_on_rank(reference, result, loaded, stage, layers, t)
            declared = partition_state(loaded.table)
            assert {(x.name, x.unit): (x.global_shape, x.local_shape,
                                       _selected(x, x.global_shape[0]).tolist())
                    for x in declared.tensors} == expected
            in_plan = plan_json["ranks"][rank]["partition"]["state"]["tensors"]
            assert {(x["name"], x["unit"]): (tuple(x["shape"]), tuple(x["local_shape"]))
                    for x in in_plan} == {k: v[:2] for k, v in expected.items()}
            in_inspect = {(x["name"], unit): (tuple(x["shape"]), tuple(x["local_shape"]))
                          for run in shown[rank]["runs"] for unit in range(*run["units"])
                          for x in run["tensors"]}
            assert in_inspect == {k: v[:2] for k, v in expected.items()}
            per_token = {"key", "value"}
            sequence_bytes = sum(4 * int(np.prod(local)) for (name, _), (_, local, _)
                                 in expected.items() if name not in per_token)
            token_bytes = sum(4 * int(np.prod(local)) for (name, _), (_, local, _)
                              in expected.items() if name in per_token)
            assert sequence_bytes > 0 and token_bytes > 0
            info = plan_json["ranks"][rank]["info"]
            assert (loaded.info.local_state_bytes == declared.local_bytes
                    == info["local_state_bytes"] == shown[rank]["bytes"] == sequence_bytes)
            assert (loaded.info.local_state_bytes_per_token == declared.local_bytes_per_token
                    == info["local_state_bytes_per_token"] == shown[rank]["bytes_per_token"]
                    == token_bytes)
            assert all(x.per_token == (x.name in per_token) for x in declared.tensors)
            assert {x["per"] for x in in_plan if x["name"] in per_token} == {"token"}


def test_qwen3_next_state_dtypes_at_bfloat16_are_those_of_hf_cache(tmp_path):
    """Built with bfloat16 activations, the conv state and keys / values are bfloat16 and the
    recurrent state float32, the dtypes HF's cache holds when the model runs in bfloat16
    (recorded by the fixture's generator)."""
    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology

    hf_dtypes = json.loads((NEXT / "manifest.json").read_text())["cache_dtypes_bfloat16"]
    names = {"bfloat16": "BF16", "float32": "F32"}
    plan = compile_family(None, NEXT / "config.json", Topology(tensor_parallel_size=2),
                          CompileOptions(activation_dtype="bfloat16")).plan
    dtypes = {x.name: x.dtype for rank in plan.ranks for x in rank.partition.state.tensors}
    assert dtypes == {f"{k.removesuffix('_state')}": names[v] for k, v in hf_dtypes.items()}


MAMBA2 = hf("mamba").parent.parent / "mamba2_style"  # a config and a family, no weights
CONV_SEGMENTS = ("sharding: {partitioned_segments: {axis: 0, segments: [inner, n_groups * "
                 "state_size, n_groups * state_size]}}\n")


def test_a_conv_over_x_b_c_split_contiguously_is_refused_by_verify_and_its_segments_hold(
        tmp_path):
    """A Mamba2-style conv1d runs over [x | B | C], an order that is not its input projection's
    ([z | x | B | C | dt]): declared with the segments of its own order it verifies at T=2;
    split as one contiguous block (rank 0 would take x's channels of both groups and none of
    B and C) verify refuses the mixer, though `partc check` accepts both."""
    family = (MAMBA2 / "family.yaml").read_text()
    assert family.count(CONV_SEGMENTS) == 2
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(family.replace(CONV_SEGMENTS, "sharding: {partitioned: 0}\n"))
    config = MAMBA2 / "config.json"
    right = verify_family(MAMBA2 / "family.yaml", config, tensor_parallel_sizes=[2],
                          pipeline_parallel_size=1)
    assert right.ok, right.first_failure
    report = verify_family(wrong, config, tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    failure = report.first_failure
    assert not report.ok and failure is not None
    assert (failure.module, failure.group, failure.rank) == (
        "backbone.layers.0.mixer", "layers.0.mixer", 0)
    assert failure.max_error > 100 * failure.tolerance


def test_a_conv_state_over_x_b_c_follows_its_group_in_segments(tmp_path):
    from partc.api import compile_family
    from partc.plan.topology import Topology

    plan = compile_family(MAMBA2 / "family.yaml", MAMBA2 / "config.json",
                          Topology(tensor_parallel_size=2)).plan
    conv = [x for x in plan.ranks[1].partition.state.tensors if (x.name, x.unit) == ("conv", 0)]
    # [x (128) | B (2 x 16) | C (2 x 16)]: rank 1 holds group 1 of each piece
    assert conv[0].placement.selection(conv[0].global_shape) == (
        0, ((64, 128), (144, 160), (176, 192)))
    assert conv[0].local_shape == (96, 4)
