"""The structural cache of `bind`: renamed copies equal full builds, and no error is skipped.

Every test binds twice, once as `bind_family` does (instances with one structure share a
template and differ only by names) and once with the cache off (every instance evaluated and
built in full, as before the cache), and requires the same architecture or the same error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import partc.bind.binder as bind_module
import partc.bind.values as values_module
from partc.api import load_family
from partc.bind.binder import bind_family
from partc.errors import ExpressionError, PartcError
from partc.family.expr import parse
from partc.front.load import load_json, parse_json
from partc.library import builtin_families

from support import FULLSIZE, HF, QUANTIZED

ARCHITECTURES = Path(__file__).resolve().parent.parent / "architectures"


def uncached_bind(family, config, names=None):
    """`bind_family` with the cache off: every instance evaluated and built in full."""
    return outcome(lambda: bind_family(family, config, names, cache=False))


def outcome(run):
    """The bound architecture, or what identifies the error raised."""
    try:
        return run()
    except PartcError as error:
        return type(error).__name__, str(error), error.pointer, error.tensor


def assert_same(cached, uncached):
    """Equal field by field; on a difference, name the first group that differs."""
    if not isinstance(cached, tuple) and not isinstance(uncached, tuple):
        ours = {o.group.name: o for o in cached.description.groups}
        for theirs in uncached.description.groups:
            assert ours.get(theirs.group.name) == theirs, theirs.group.name
        assert [type(m) for o in cached.description.groups for m in o.group.members] == [
            type(m) for o in uncached.description.groups for m in o.group.members]
    assert cached == uncached
    assert repr(cached) == repr(uncached)


def both(family, config, names=None):
    cached = outcome(lambda: bind_family(family, config, names))
    assert_same(cached, uncached_bind(family, config, names))
    return cached


def fixture_names(folder: Path) -> frozenset[str]:
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return frozenset(f.keys())


TINY = sorted(p for root in (HF, QUANTIZED) for p in root.iterdir()
              if (p / "config.json").is_file())


@pytest.mark.parametrize("folder", TINY, ids=lambda p: p.name)
def test_every_tiny_fixture_binds_the_same_cached_and_uncached(folder):
    config = load_json(folder / "config.json")
    family, _ = load_family(config.data["model_type"])
    bound = both(family, config, fixture_names(folder))
    assert not isinstance(bound, tuple), bound


@pytest.mark.parametrize(("model", "family", "groups", "full_builds"), [
    ("DeepSeek-V3", "deepseek_v3", 15_480, 20), ("Qwen3-30B-A3B", "qwen3_moe", 6_387, 12)])
def test_full_size_inventories_bind_the_same_from_a_few_full_builds(
        monkeypatch, model, family, groups, full_builds):
    config = load_json(FULLSIZE / model / "config.json")
    header = json.loads((FULLSIZE / model / "safetensors_header.json").read_text())
    names = frozenset(header) - {"__metadata__"}
    decl, _ = load_family(family)
    built = []
    real = bind_module._build_group
    with monkeypatch.context() as patch:
        patch.setattr(bind_module, "_build_group", lambda *args: built.append(1) or real(*args))
        bound = bind_family(decl, config, names)
        cached_builds = len(built)
        uncached = uncached_bind(decl, config, names)
    assert len(bound.description.groups) == groups
    assert cached_builds <= full_builds  # one per structure, not one per layer or expert
    assert len(built) - cached_builds >= groups  # the switch: off, every instance is built
    assert set(bound.description.targets) == names
    assert_same(bound, uncached)


# ---------------------------------------------------------------- edited families


def edited(tmp_path, name: str, *edits: tuple[str, str]):
    """A built-in family with text replacements, loaded (and checked) from a file."""
    text = (ARCHITECTURES / f"{name}.yaml").read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "family.yaml"
    path.write_text(text)
    return load_family(path)[0]


def config_of(folder: Path):
    return parse_json("config.json", (folder / "config.json").read_text())


EXPERT_SHAPE = "params: {weight: [moe_intermediate_size, hidden_size]}\n      - module: " \
               '"{path}.mlp.experts.{expert}.up_proj"'


def expert_shape(dim: str) -> tuple[str, str]:
    return EXPERT_SHAPE, EXPERT_SHAPE.replace("moe_intermediate_size", dim, 1)


@pytest.mark.parametrize(("edit", "expected"), [
    (expert_shape("moe_intermediate_size * (expert - 1) // (expert - 1)"),
     "division by zero: `moe_intermediate_size * (expert - 1) // (expert - 1)` where "
     "(expert - 1) = 0"),
    (expert_shape("moe_intermediate_size + (8 if expert == 3 else 0)"),
     "`model.layers.1.mlp.experts.3.gate_proj.weight` is split on axis 0, of 40 elements, "
     "which is not a multiple of group `model.layers.1.experts.3`'s 32 partition units"),
])
def test_an_error_in_a_later_expert_of_a_cached_structure_is_still_reported(
        tmp_path, edit, expected):
    family = edited(tmp_path, "deepseek_v3", edit)
    found = both(family, config_of(QUANTIZED / "deepseek_v3_fp8"))
    assert isinstance(found, tuple) and expected in found[1], found


@pytest.mark.parametrize(("old", "new", "field"), [
    ('module: "{path}.mlp.experts.{expert}.up_proj"',
     "module: \"{path}.mlp.experts.{expert}.{'gate_proj' if expert == 2 else 'up_proj'}\"",
     "{'gate_proj' if expert == 2 else 'up_proj'}"),
    ('name: "{path}.experts.{expert}"', 'name: "{path}.experts.{expert % 3}"', "{expert % 3}"),
    ('name: "{path}.experts.{expert}"',
     'name: "{path}.experts.{expert if expert < 5 else true}"',
     "{expert if expert < 5 else true}"),
])
def test_a_name_that_reads_the_expert_other_than_as_its_id_is_refused_before_binding(
        tmp_path, old, new, field):
    # names that differ by expert other than through the id itself (which could give a later
    # expert of a cached structure a name error) are refused by check, at the template's line
    text = (ARCHITECTURES / "deepseek_v3.yaml").read_text()
    assert old in text
    line = text[:text.index(old)].count("\n") + 1
    with pytest.raises(PartcError) as caught:
        edited(tmp_path, "deepseek_v3", (old, new))
    message = str(caught.value)
    assert f"family.yaml:{line}:" in message, message
    assert f"numbers the experts with `{field}`; expected `{{expert}}`" in message, message


def test_values_that_vary_by_expert_or_unit_build_one_structure_each(tmp_path):
    router_dtype = "dtype: \"'F32' if fp8 else dtype\""
    family = edited(tmp_path, "deepseek_v3",
                    expert_shape("moe_intermediate_size * (1 + expert % 3)"),
                    (router_dtype, router_dtype.replace("fp8", "unit == 2")))
    bound = both(family, config_of(QUANTIZED / "deepseek_v3_fp8"))
    groups = {o.group.name: o.group for o in bound.description.groups}
    assert [groups[f"model.layers.1.experts.{e}"].members[0].shape[0] for e in range(4)] == [
        32, 64, 96, 32]
    assert [groups[f"model.layers.{u}.router"].members[1].dtype for u in (1, 2)] == ["BF16",
                                                                                     "F32"]


EXTRA = """  - name: "layers.{unit}.extra"
    role: replicated
    owner: {unit: decoder}
    members:
      - {target: "{path}.extra.a.weight", shape: [hidden_size, hidden_size], sharding: replicated,
         format: linear}
      - {target: "%s", sharding: replicated, %s}

  - name: final_norm
"""


def extra_member(target: str, spec: str) -> tuple[str, str]:
    """A members-form group whose second member is `target` with `spec`, before `final_norm`."""
    return "  - name: final_norm\n", EXTRA % (target, spec)


LINEAR = "shape: [hidden_size, hidden_size], format: linear"
STORED = "model.layers.{}.self_attn.{}_proj.scales"
NOT_WEIGHT = "stores `scales`/`biases` next to a `<module>.weight`, but `{}` is not named"


@pytest.mark.parametrize(("edits", "mlx", "dense"), [
    ([('applies_to: ["*"]', 'applies_to: ["*.layers.1.*", "*.layers.2.*.q_proj"]')],
     {STORED.format(1, "k"), STORED.format(2, "q")}, set()),
    ([('applies_to: ["*"]', 'applies_to: ["*"]\n    except: ["*.2.self_attn.k_proj"]')],
     {STORED.format(2, "q"), STORED.format(1, "k")}, set()),
    ([extra_member("{path}.extra.{'b.weight' if unit != 1 else 'b'}", LINEAR)],
     NOT_WEIGHT.format("model.layers.1.extra.b"), set()),
    ([extra_member("{path}.extra.{'a.scales' if unit == 1 else 'b'}", "shape: [hidden_size]")],
     "lists target `model.layers.1.extra.a.scales` twice", set()),
    ([extra_member("{'' if unit == 2 else path}", "shape: [hidden_size]")],
     "a member needs a non-empty target name", "a member needs a non-empty target name"),
    ([('module: "model.layers.{unit}.self_attn.q_proj"',
       "module: \"{'' if unit == 2 else 'x'}{'' if unit == 2 else path}\"")],
     NOT_WEIGHT.format("weight"), set()),
    ([('name: "layers.{unit}.attention"',
       "name: \"{'' if unit == 2 else 'L'}{'' if unit == 2 else unit}\"")],
     "a parameter group needs a non-empty name", "a parameter group needs a non-empty name"),
], ids=["patterns", "except", "not-weight", "companion-clash", "empty-target", "empty-module",
        "empty-name"])
def test_name_dependent_checks_run_on_every_instance(tmp_path, edits, mlx, dense):
    """Format patterns, `.weight` suffixes and name clashes that differ between units: the
    error expected, or stored targets that only some units have."""
    family = edited(tmp_path, "llama", *edits)
    for folder, expected in ((QUANTIZED / "llama_mlx4", mlx), (HF / "llama", dense)):
        found = both(family, config_of(folder))
        if isinstance(expected, str):
            assert isinstance(found, tuple) and expected in found[1], found
            continue
        assert not isinstance(found, tuple), found
        stored = {t for t in found.description.targets if t.endswith("_proj.scales")}
        assert expected <= stored
        assert not expected or len(stored) < 7 * 3  # some units leave these weights dense


def test_a_repeated_dense_target_is_reported_even_when_its_stored_tensors_differ(
        tmp_path):
    """Under MXFP4 an encoded weight keeps no tensor of its own name, so only the dense targets
    show that unit 1 names two members alike."""
    experts = "{path}.mlp.experts.gate_up_proj"
    family = edited(tmp_path, "gpt_oss", ("  - name: final_norm\n", f"""\
  - name: "layers.{{unit}}.x"
    role: replicated
    owner: {{unit: decoder}}
    members:
      - {{target: "{experts}.x", shape: [hidden_size, 64], sharding: replicated}}
      - {{target: "{experts}.{{'x' if unit == 1 else 'y'}}", shape: [8], sharding: replicated}}

  - name: final_norm
"""))
    found = both(family, config_of(QUANTIZED / "gpt_oss_mxfp4"))
    assert isinstance(found, tuple), found
    assert "lists target `model.layers.1.mlp.experts.gate_up_proj.x` twice" in found[1]


def test_a_fused_output_prefix_that_differs_between_units_is_honoured(tmp_path):
    family = edited(tmp_path, "phi3", (
        '      module: "model.layers.{unit}.self_attn.o_proj"\n',
        '      module: "model.layers.{unit}.self_attn.o_proj"\n      linear: false\n'), (
        'module: "model.layers.{unit}.self_attn.qkv_proj"',
        "module: \"model.layers.{unit}.self_attn.{'o_proj.x' if unit == 1 else 'qkv_proj'}\""))
    bound = both(family, config_of(HF / "phi3"))
    linear = {m.target: m.linear for o in bound.description.groups for m in o.group.members}
    assert linear["model.layers.1.self_attn.o_proj.x.weight"] is None
    assert linear["model.layers.0.self_attn.qkv_proj.weight"] is not None


def test_the_tiny_fixtures_cover_every_builtin_family():
    files = builtin_families()
    covered = {files[load_json(p / "config.json").data["model_type"]] for p in TINY}
    assert covered == set(files.values())


def test_the_evaluation_memo_tells_true_from_one():
    family, _ = load_family("llama")
    binder = values_module.Binder(family, config_of(HF / "llama"))
    assert binder.cache.enabled
    expr = parse("x + 1")
    assert binder.evaluate(expr, {"x": 1}, "") == 2
    with pytest.raises(ExpressionError, match="needs integers, found bool"):
        binder.evaluate(expr, {"x": True}, "")
    assert binder.evaluate(expr, {"x": 2}, "") == 3


def test_the_evaluation_memo_is_keyed_by_the_expression_not_its_object():
    """Two parses of one text share a memo entry; with the cache off nothing is memoized."""
    family, _ = load_family("llama")
    for enabled, entries in ((True, 1), (False, 0)):
        binder = values_module.Binder(family, config_of(HF / "llama"), cache=enabled)
        assert [binder.evaluate(parse("x * 2"), {"x": 3}, "") for _ in range(2)] == [6, 6]
        assert len(binder.cache.evaluations) == entries
