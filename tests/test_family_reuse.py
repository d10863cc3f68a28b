"""Family constructs beyond projections: `omit`, `derived`, `extends` and float config values.

Checkpoints with buffers are real: tests/fixtures/hf/{gpt2,gpt_neox}/with_buffers were
written by transformers with their causal-mask buffers and `inv_freq` kept, and the Llama ones
here are the Llama fixture plus `inv_freq` tensors computed as HF's rotary init computes them.
Every loaded tensor is compared with what the safetensors library reads.
"""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from partc.api import CompileOptions, bind, check_family, compile_family
from partc.errors import PartcError
from partc.family.expr import parse
from partc.plan.topology import Topology

from support import ROOT, compile_and_load, hf

HF = ROOT / "tests" / "fixtures" / "hf"
LLAMA = ROOT / "architectures" / "llama.yaml"


def inv_freq(config: dict) -> np.ndarray:
    """HF's default rotary init: 1 / theta ** (arange(0, dim, 2) / dim), in float32."""
    dim = config["head_dim"]
    theta = config["rope_parameters"]["rope_theta"]
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    return (1.0 / (theta ** exponents)).astype(np.float32)


@pytest.fixture
def llama_with_buffers(tmp_path: Path) -> Path:
    """The Llama fixture with one `rotary_emb.inv_freq` buffer per layer added."""
    folder = tmp_path / "llama_buffers"
    folder.mkdir()
    shutil.copy(hf("llama") / "config.json", folder / "config.json")
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(hf("llama") / "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = inv_freq(config)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_family(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


OMIT_LLAMA = """family: llama_buffers
extends: {base}
model_types: [llama]
omit: ["model.layers.*.self_attn.rotary_emb.inv_freq"]
"""


# ---------------------------------------------------------------- omit


def test_a_checkpoint_buffer_nobody_omits_is_still_an_error(llama_with_buffers):
    errors = check_family(LLAMA, llama_with_buffers / "config.json", llama_with_buffers)
    assert [e.message for e in errors] == [
        f"checkpoint tensor `model.layers.{n}.self_attn.rotary_emb.inv_freq` is owned by no "
        "parameter group" for n in range(3)]


def test_omitted_buffers_are_loaded_by_no_rank_and_recorded_in_the_plan(tmp_path,
                                                                          llama_with_buffers):
    family = write_family(tmp_path, "family.yaml", OMIT_LLAMA.format(base=LLAMA))
    assert check_family(family, llama_with_buffers / "config.json", llama_with_buffers) == []
    plan, states = compile_and_load(family, llama_with_buffers / "config.json",
                                    tmp_path / "build", llama_with_buffers, tp=2, pp=2,
                                    checkpoint=llama_with_buffers)
    document = json.loads((tmp_path / "build" / "plan.json").read_text())
    buffers = [f"model.layers.{n}.self_attn.rotary_emb.inv_freq" for n in range(3)]
    assert document["omitted"] == buffers
    want = load_file(str(llama_with_buffers / "model.safetensors"))
    loaded = set()
    for state in states:
        for target, array in state.tensors.items():
            assert not target.endswith("inv_freq")
            if state.layout[target].selection[0] is None:
                np.testing.assert_array_equal(np.asarray(array), want[target])
            loaded.add(target)
    assert loaded == set(want) - set(buffers)


def test_a_plan_without_omitted_tensors_has_no_omitted_key(tmp_path):
    compile_family(LLAMA, hf("llama") / "config.json", None,
                   CompileOptions(checkpoint=hf("llama"), out=tmp_path / "build"))
    assert "omitted" not in json.loads((tmp_path / "build" / "plan.json").read_text())


def test_an_omit_glob_matching_a_declared_parameter_is_a_located_error(tmp_path):
    family = write_family(tmp_path, "family.yaml", OMIT_LLAMA.format(base=LLAMA).replace(
        '"model.layers.*.self_attn.rotary_emb.inv_freq"', '"*.inv_freq", "model.norm.*"'))
    errors = check_family(family, hf("llama") / "config.json")
    assert [str(e) for e in errors] == [
        f"{family}:4:22: `omit` glob 'model.norm.*' matches declared parameter "
        "`model.norm.weight`; expected it to match only checkpoint tensors that are not "
        "parameters (buffers such as `inv_freq`) [at /omit/1]"]


def replicated_family(checkpoint: Path, *, family: str, layers_path: str, layers: int,
                      omit: list[str]) -> str:
    """A test-only family owning every non-omitted tensor of `checkpoint` replicated: the
    per-layer tensors as one group per unit, the rest as one static group."""
    with safe_open(str(checkpoint / "model.safetensors"), "numpy") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    prefix = layers_path.replace("{unit}", "0") + "."
    import fnmatch

    kept = {n: s for n, s in shapes.items() if not any(fnmatch.fnmatchcase(n, g) for g in omit)}
    per_layer = sorted(n[len(prefix):] for n in kept if n.startswith(prefix))
    rest = sorted(n for n in kept if not n.startswith(layers_path.split("{unit}")[0]))
    lines = [f"family: {family}", f"model_types: [{family}]",
             "config: {num_hidden_layers: {type: int, from: [n_layer, num_hidden_layers]}}",
             f"omit: {json.dumps(omit)}",
             f'graph: [{{group: decoder, units: num_hidden_layers, path: "{layers_path}"}}]',
             "static: {outside: {stage: first}}", "parameters:",
             '  - {name: "layers.{unit}", role: replicated, owner: {unit: decoder}, members: ['
             + ", ".join(f'{{target: "{layers_path}.{n}", shape: {list(kept[prefix + n])}}}'
                         for n in per_layer) + "]}",
             "  - {name: outside, role: replicated, owner: {static: outside}, members: ["
             + ", ".join(f'{{target: "{n}", shape: {list(kept[n])}}}' for n in rest) + "]}",
             "boundary: {identity: t.hidden, primary: {role: hidden, shape: [batch, sequence, 1],"
             " dtype: activation}}"]
    assert layers == sum(1 for n in kept if n.endswith("." + per_layer[0]))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("fixture", "layers_path", "buffers"), [
    ("gpt2", "transformer.h.{unit}", ["*.attn.bias", "*.attn.masked_bias"]),
    ("gpt_neox", "gpt_neox.layers.{unit}",
     ["*.attention.bias", "*.attention.masked_bias", "*.rotary_emb.inv_freq"]),
])
def test_hf_written_buffers_are_omitted_from_real_checkpoints(tmp_path, fixture, layers_path,
                                                               buffers):
    checkpoint = HF / fixture / "with_buffers"
    config = json.loads((checkpoint / "config.json").read_text())
    layers = config.get("n_layer", config.get("num_hidden_layers"))
    family = write_family(tmp_path, "family.yaml", replicated_family(
        checkpoint, family=config["model_type"], layers_path=layers_path, layers=layers,
        omit=buffers))
    plan, states = compile_and_load(family, checkpoint / "config.json", tmp_path / "build",
                                    checkpoint, tp=1, pp=2, checkpoint=checkpoint)
    want = load_file(str(checkpoint / "model.safetensors"))
    omitted = sorted(n for n in want if any(n.endswith(g[1:]) for g in buffers))
    assert len(omitted) == len(buffers) * layers
    assert json.loads((tmp_path / "build" / "plan.json").read_text())["omitted"] == omitted
    got = {t: np.asarray(a) for s in states for t, a in s.tensors.items()}
    assert set(got) == set(want) - set(omitted)
    for target, array in got.items():
        np.testing.assert_array_equal(array, want[target])
    without = write_family(tmp_path, "bare.yaml", family.read_text().replace(
        f"omit: {json.dumps(buffers)}", "omit: []"))
    messages = [e.message for e in check_family(without, checkpoint / "config.json",
                                                checkpoint)]
    assert len(messages) == len(omitted) + len(set(omitted) & set(got))  # owned by none
    assert all("is owned by no parameter group" in m for m in messages)


# ---------------------------------------------------------------- derived values


def test_derived_values_bind_in_dependency_order_and_are_recorded(tmp_path):
    family = write_family(tmp_path, "family.yaml", f"""family: llama_derived
extends: {LLAMA}
model_types: [llama]
derived:
  q_per_kv: num_attention_heads // kv_heads
  kv_heads: min(num_key_value_heads, num_attention_heads)
parameters:
  - name: "layers.{{unit}}.mlp"
    role: feed_forward_intermediate
    owner: {{unit: decoder}}
    units: intermediate_size // q_per_kv
    projections:
      - {{module: "model.layers.{{unit}}.mlp.gate_proj", sharding: column,
         params: {{weight: [intermediate_size, hidden_size]}}}}
      - {{module: "model.layers.{{unit}}.mlp.up_proj", sharding: column,
         params: {{weight: [intermediate_size, hidden_size]}}}}
      - {{module: "model.layers.{{unit}}.mlp.down_proj", sharding: row,
         params: {{weight: [hidden_size, intermediate_size]}}}}
""")
    bound, _, _ = bind(family, hf("llama") / "config.json")
    values = dict(bound.config_values)
    assert (values["kv_heads"], values["q_per_kv"]) == (2, 2)
    mlp = next(g.group for g in bound.description.groups if g.group.name == "layers.0.mlp")
    assert mlp.units == 64  # 128 // 2
    plan = compile_family(family, hf("llama") / "config.json", None,
                          CompileOptions(out=tmp_path / "build")).plan
    assert json.loads((tmp_path / "build" / "plan.json").read_text())["config"]["q_per_kv"] == 2
    assert plan.plan_hash


# ---------------------------------------------------------------- extends


def test_granite_extends_llama_and_binds_its_fixture_with_llama_tensors():
    bound, decl, sources = bind(None, hf("granite") / "config.json")
    assert decl.name == "granite" and decl.model_types == ("granite",)
    _, llama, _ = bind(LLAMA, hf("llama") / "config.json")
    assert [g.name for g in decl.groups] == [g.name for g in llama.groups]
    assert [g.pointer for g in decl.groups] == [g.pointer for g in llama.groups]
    assert {decl.document.locate(g.pointer).file for g in decl.groups} == {
        "architectures/llama.yaml"}  # every group is declared by the base file
    values = dict(bound.config_values)
    assert (values["embedding_multiplier"], values["residual_multiplier"],
            values["attention_multiplier"], values["logits_scaling"]) == (12.0, 0.22, 0.09, 8.0)
    assert check_family(None, hf("granite") / "config.json", hf("granite")) == []
    assert bound.boundary.identity == "granite.hidden"


def test_extends_replaces_groups_by_name_appends_new_ones_and_removes_listed_ones(tmp_path):
    family = write_family(tmp_path, "child.yaml", f"""family: child
extends: {LLAMA.name}
model_types: [llama]
remove: [lm_head]
parameters:
  - name: final_norm
    role: replicated
    owner: {{static: final_norm}}
    module: model.norm
    sharding: replicated
    params: {{weight: [hidden_size]}}
  - name: lm_head_again
    role: vocabulary
    owner: {{static: output}}
    when: not tie_word_embeddings
    module: lm_head
    sharding: {{balanced: 0}}
    params: {{weight: [vocab_size, hidden_size]}}
""")
    shutil.copy(LLAMA, tmp_path / LLAMA.name)  # a relative base: next to the child file
    bound, decl, _ = bind(family, hf("llama") / "config.json")
    names = [g.name.text for g in decl.groups]
    assert names == ["embedding", "layers.{unit}.input_layernorm", "layers.{unit}.attention",
                     "layers.{unit}.post_attention_layernorm", "layers.{unit}.mlp",
                     "final_norm", "lm_head_again"]
    # positions stay with the file that declared each thing
    assert decl.document.locate("/parameters/5").file == str(family)
    assert decl.document.locate("/parameters/5").line == 6
    assert decl.document.locate("/parameters/0").file == str(tmp_path / LLAMA.name)
    assert decl.document.locate("/parameters/0").line == 34  # `- name: embedding`


def test_an_error_in_the_base_points_into_the_base_file(tmp_path):
    base = write_family(tmp_path, "base.yaml", LLAMA.read_text().replace(
        "units: intermediate_size", "units: intermediate_sise"))
    child = write_family(tmp_path, "child.yaml", "family: c\nextends: base.yaml\n"
                         "model_types: [llama]\n")
    errors = check_family(child)
    assert len(errors) == 1
    assert str(errors[0]).startswith(f"{base}:92:12: `units` uses unknown name "
                                     "`intermediate_sise`; did you mean `intermediate_size`?")


def test_extends_cycles_and_unknown_bases_are_located_errors(tmp_path):
    a = write_family(tmp_path, "a.yaml", "family: a\nextends: b.yaml\nmodel_types: [x]\n")
    write_family(tmp_path, "b.yaml", "family: b\nextends: a.yaml\nmodel_types: [x]\n")
    errors = check_family(a)
    assert [e.message for e in errors] == [
        f"`extends` makes a cycle: {a} -> {tmp_path / 'b.yaml'} -> {a}"]
    assert errors[0].location is not None and errors[0].location.line == 2
    c = write_family(tmp_path, "c.yaml", "family: c\nextends: no_such_family\n"
                     "model_types: [x]\n")
    assert "no built-in family for model type 'no_such_family'" in check_family(c)[0].message
    d = write_family(tmp_path, "d.yaml", "family: d\nextends: lama\nmodel_types: [x]\n")
    (error,) = check_family(d)  # at the `extends` line, with the built-in it resembles
    assert error.location is not None and (error.location.file, error.location.line,
                                           error.location.column) == (str(d), 2, 10)
    assert error.message.startswith("`extends: lama`: no built-in family for model type 'lama'")
    assert error.message.endswith("; did you mean `llama`?")


# ---------------------------------------------------------------- floats


def test_a_float_feeds_a_shape_through_floor_with_exact_rational_arithmetic():
    env = {"head_dim": 80, "partial_rotary_factor": 0.4, "x": 2.5, "y": 3.5}
    assert parse("floor(head_dim * partial_rotary_factor)").evaluate_int(env) == 32
    # 0.1 + 0.2 is exactly 0.3 here (binary floating point would give 0.30000000000000004)
    assert parse("0 + a + b == c").evaluate({"a": 0.1, "b": 0.2, "c": 0.3}) is True
    assert parse("ceil(10 * a)").evaluate({"a": 0.3}) == 3  # float: ceil(3.0000000000000004) = 4
    assert [parse(f"round({v})").evaluate(env) for v in ("x", "y")] == [2, 4]  # half to even
    assert parse("x * 2").evaluate(env) == Fraction(5)
    with pytest.raises(PartcError) as info:
        parse("head_dim * partial_rotary_factor").evaluate_int(env)
    assert info.value.message == ("expected an integer, found float 32.0; round it explicitly "
                                  "with floor(), ceil() or round()")
    with pytest.raises(PartcError) as info:
        parse("x // 2").evaluate(env)
    assert info.value.message == ("`//` needs integers (floor a float first), found float "
                                  "(2.5) and int (2)")


def test_a_float_config_value_shapes_a_tensor_through_floor(tmp_path):
    config = json.loads((hf("llama") / "config.json").read_text())
    config["partial_rotary_factor"] = 0.45
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = write_family(tmp_path, "family.yaml", f"""family: llama_rotary
extends: {LLAMA}
model_types: [llama]
config:
  partial_rotary_factor: {{type: float, default: 1.0}}
derived:
  rotary_dim: floor(head_dim * partial_rotary_factor)
parameters:
  - name: "layers.{{unit}}.post_attention_layernorm"
    role: replicated
    owner: {{unit: decoder}}
    module: "model.layers.{{unit}}.post_attention_layernorm"
    sharding: replicated
    params: {{weight: [rotary_dim * 9]}}
""")
    bound, _, _ = bind(family, tmp_path / "config.json")
    values = dict(bound.config_values)
    assert values["rotary_dim"] == 7  # floor(16 * 9/20) = floor(7.2)
    norm = next(g.group for g in bound.description.groups
                if g.group.name == "layers.0.post_attention_layernorm")
    assert norm.members[0].shape == (63,)
    errors = check_family(family, hf("llama") / "config.json",
                          topology=Topology(tensor_parallel_size=1, pipeline_parallel_size=1))
    assert errors == []  # default 1.0: rotary_dim 16, a [144] norm (no checkpoint given)


def test_stablelm_records_its_rotary_dim_derived_from_the_float_factor(tmp_path):
    config = json.loads((hf("stablelm") / "config.json").read_text())
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    compile_family(None, hf("stablelm") / "config.json", None,
                   CompileOptions(checkpoint=hf("stablelm"), out=tmp_path / "build"))
    recorded = json.loads((tmp_path / "build" / "plan.json").read_text())["config"]
    assert (recorded["partial_rotary_factor"], recorded["rotary_dim"]) == (0.25, 4)  # 16 // 4


def test_phi_floors_its_float_rotary_factor_as_hf_truncates(tmp_path):
    bound, decl, _ = bind(None, hf("phi") / "config.json")
    assert dict(bound.config_values)["rotary_dim"] == 6  # floor(16 * 2/5), not round: 6.4
    assert "layers.{unit}.post_attention_layernorm" not in [g.name.text for g in decl.groups]
    biases = sorted(t for g in bound.description.groups if g.group.name == "layers.0.attention"
                    for t in g.group.targets if t.endswith(".bias"))
    assert biases == [f"model.layers.0.self_attn.{p}.bias" for p in ("dense", "k_proj", "q_proj",
                                                                     "v_proj")]


def test_inspect_finds_the_base_file_line_of_an_inherited_group(tmp_path):
    from partc.inspect.origins import group_origins
    from partc.plan.plan_file import read_plan

    compile_family(None, hf("granite") / "config.json", None,
                   CompileOptions(out=tmp_path / "build"))
    origins = group_origins(read_plan(tmp_path / "build" / "plan.json"))
    assert origins.lines["layers.1.attention"] == "architectures/llama.yaml:50"
    assert origins.lines["lm_head"] == "architectures/llama.yaml:117"


@pytest.mark.parametrize("fixture", ["gpt2", "gpt_neox"])
def test_the_built_in_family_loads_a_released_style_checkpoint_with_its_buffers_omitted(
        tmp_path, fixture):
    checkpoint = HF / fixture / "with_buffers"
    want = load_file(str(checkpoint / "model.safetensors"))
    plain = set(load_file(str(HF / fixture / "model.safetensors")))
    buffers = sorted(set(want) - plain)
    assert buffers  # the HF-written buffers: causal masks (and inv_freq for gpt_neox)
    plan, states = compile_and_load(None, checkpoint / "config.json", tmp_path / "build",
                                    checkpoint, tp=2, pp=2, checkpoint=checkpoint)
    assert json.loads((tmp_path / "build" / "plan.json").read_text())["omitted"] == buffers
    loaded = {t for s in states for t in s.tensors}
    assert loaded == plain  # every parameter on some rank, no buffer on any
    # the plain checkpoint (no buffers) still compiles with the same family, nothing omitted
    plan, _ = compile_and_load(None, HF / fixture / "config.json", tmp_path / "plain",
                               HF / fixture, tp=2, pp=1, checkpoint=HF / fixture)
    assert "omitted" not in json.loads((tmp_path / "plain" / "plan.json").read_text())


# ---------------------------------------------------------------- patch and remove (issue 35)


def test_a_patch_changes_one_key_of_an_inherited_group_and_keeps_the_rest(tmp_path):
    family = write_family(tmp_path, "child.yaml", """family: child
extends: llama
model_types: [llama]
parameters:
  - name: "layers.{unit}.attention"
    patch: true
    kv_replication: false
    policy: replicate_unsupported
""")
    _, decl, _ = bind(family, hf("llama") / "config.json")
    base = [g for g in bind(None, hf("llama") / "config.json")[1].groups
            if g.name.text == "layers.{unit}.attention"][0]
    (attention,) = [g for g in decl.groups if g.name.text == "layers.{unit}.attention"]
    assert (base.kv_replication, attention.kv_replication) == (True, False)
    assert attention.members == base.members  # every projection kept from llama
    assert [g.name.text for g in decl.groups] == [
        g.name.text for g in bind(None, hf("llama") / "config.json")[1].groups]
    # the patched key is located in the child, the inherited ones in llama
    assert decl.document.locate("/parameters/2/kv_replication").file == str(family)
    assert decl.document.locate("/parameters/2/kv_replication").line == 7
    assert decl.document.locate("/parameters/2/role").file.endswith("llama.yaml")
    # and it takes effect: T=4 over 2 KV heads is refused without KV replication
    errors = check_family(family, hf("llama") / "config.json",
                          topology=Topology(tensor_parallel_size=4))
    assert errors == []  # replicated under the patched policy instead


def test_a_patch_with_null_deletes_the_inherited_key(tmp_path):
    family = write_family(tmp_path, "child.yaml", """family: child
extends: llama
model_types: [llama]
parameters:
  - {name: "layers.{unit}.attention", patch: true, kv_replication: null}
""")
    errors = check_family(family, hf("llama") / "config.json",
                          topology=Topology(tensor_parallel_size=4))
    assert len(errors) == 1
    assert "cannot be sharded over tensor_parallel_size 4" in errors[0].message


def test_remove_beside_a_child_group_of_the_same_name_drops_only_the_base_group(tmp_path):
    family = write_family(tmp_path, "child.yaml", """family: child
extends: llama
model_types: [llama]
remove: [final_norm]
parameters:
  - name: final_norm
    role: replicated
    owner: {static: final_norm}
    module: model.norm
    sharding: replicated
    params: {weight: [hidden_size]}
""")
    _, decl, _ = bind(family, hf("llama") / "config.json")
    names = [g.name.text for g in decl.groups]
    assert names.count("final_norm") == 1
    assert names[-1] == "final_norm"  # the child's, appended after the base's groups
    assert decl.document.locate(f"/parameters/{len(names) - 1}").file == str(family)
    assert check_family(family, hf("llama") / "config.json", hf("llama")) == []


@pytest.mark.parametrize(("text", "message", "line"), [
    ("extends: llama\nremove: [final_norm]\nparameters:\n"
     "  - {name: final_norm, patch: true, sharding: replicated}\n",
     "parameter group 'final_norm' has `patch: true`, so it changes a base group, but it "
     "names one which `remove` drops; base groups: ", 6),
    ("extends: llama\nparameters:\n  - {name: final_nrom, patch: true, sharding: replicated}\n",
     "parameter group 'final_nrom' has `patch: true`, so it changes a base group, but it "
     "names one which base family `llama` does not declare; base groups: ", 5),
    ("parameters:\n  - {name: final_norm, patch: true, sharding: replicated}\n",
     "parameter group 'final_norm' has `patch: true`, which changes a group of a base family, "
     "so it needs `extends`", 4),
])
def test_a_patch_of_no_base_group_is_a_located_error(tmp_path, text, message, line):
    family = write_family(tmp_path, "child.yaml", "family: child\nmodel_types: [llama]\n" + text)
    (error,) = check_family(family)
    assert error.message.startswith(message)
    assert error.location is not None and error.location.line == line
