"""Stage 4, binding to config.json: config mistakes and evaluation errors, located exactly."""

from __future__ import annotations

import json

import pytest

from partc.api import check_family

from support.families import MINI, MINI_CONFIG


def bind_errors(tmp_path, monkeypatch, family: str = MINI, config: object = None,
                raw_config: str | None = None) -> list[str]:
    (tmp_path / "family.yaml").write_text(family)
    text = raw_config if raw_config is not None else json.dumps(
        MINI_CONFIG if config is None else config, indent=1)
    (tmp_path / "config.json").write_text(text)
    monkeypatch.chdir(tmp_path)
    errors = check_family("family.yaml", "config.json")
    return [str(e) for e in sorted(errors, key=lambda e: e.sort_key())]


def with_config_fields(extra: str) -> str:
    return MINI.replace("  vocab_size: int\n", "  vocab_size: int\n" + extra, 1)


def test_the_mini_family_binds_to_its_config(tmp_path, monkeypatch):
    assert bind_errors(tmp_path, monkeypatch) == []


@pytest.mark.parametrize(("config", "expected"), [
    ({**MINI_CONFIG, "hidden_size": "8"},
     "config.json:3:17: config field `hidden_size` must be int, found str '8' (declared at "
     "family.yaml:4:16) [at /hidden_size]"),
    ({**MINI_CONFIG, "hidden_size": True},
     "config.json:3:17: config field `hidden_size` must be int, found bool True (declared at "
     "family.yaml:4:16) [at /hidden_size]"),
    ({k: v for k, v in MINI_CONFIG.items() if k != "vocab_size"},
     "config.json:1:1: config.json has no `vocab_size`, which family `mini` requires (declared "
     "as int with no default, at family.yaml:6:15) [at /vocab_size]"),
    ({**MINI_CONFIG, "model_type": "llama"},
     "config.json:2:16: config model_type is 'llama' but family `mini` describes 'mini' "
     "[at /model_type]"),
    ({**MINI_CONFIG, "vocab_size": -4},
     "config.json:5:16: config field `vocab_size` must be a positive integer of at most "
     "2147483647, found -4 [at /vocab_size]"),
    ({**MINI_CONFIG, "hidden_size": 2**80},
     "config.json:3:17: config field `hidden_size` must be a positive integer of at most "
     "2147483647, found 1208925819614629174706176 [at /hidden_size]"),
])
def test_a_config_mistake_names_the_config_line_or_the_expression_that_fails(
        tmp_path, monkeypatch, config, expected):
    assert bind_errors(tmp_path, monkeypatch, config=config) == [expected]


@pytest.mark.parametrize(("fields", "expected"), [
    ("  heads: {type: int, default: 0}\n  head_dim: {type: int, default: hidden_size // heads}\n",
     "family.yaml:8:46: division by zero: `hidden_size // heads` where heads = 0 "
     "[at /config/head_dim/default]"),
    ("  odd: {type: int, default: 'hidden_size % (num_layers - 2)'}\n",
     "family.yaml:7:42: modulo by zero: `hidden_size % (num_layers - 2)` where (num_layers - 2)"
     " = 0 [at /config/odd/default]"),
    ("  a: {type: int, default: b + 1}\n  b: {type: int, default: a * 2}\n",
     "family.yaml:7:6: config defaults depend on each other in a cycle: `a`, `b` "
     "[at /config/a]"),
    ("  mixed: {type: int, default: hidden_size + true}\n",
     "family.yaml:7:43: `+` needs integers, found int (8) and bool (true) "
     "[at /config/mixed/default]"),
])
def test_a_default_that_cannot_be_evaluated_points_at_its_operator(tmp_path, monkeypatch,
                                                                   fields, expected):
    assert bind_errors(tmp_path, monkeypatch, with_config_fields(fields)) == [expected]


def test_a_condition_that_is_not_a_boolean_is_an_error_at_the_condition(tmp_path, monkeypatch):
    family = MINI.replace("    owner: {unit: decoder}\n",
                          "    owner: {unit: decoder}\n    when: hidden_size\n", 1)
    assert bind_errors(tmp_path, monkeypatch, family) == [
        "family.yaml:21:11: condition `hidden_size` must be true or false, found 8 "
        "[at /parameters/1/when]"]


def test_a_group_name_repeated_by_units_says_to_include_the_unit(tmp_path, monkeypatch):
    family = MINI.replace('  - name: "layers.{unit}.mlp"', '  - name: "layers.mlp"', 1)
    assert bind_errors(tmp_path, monkeypatch, family) == [
        "family.yaml:18:5: parameter group name `layers.mlp` is produced twice (by another "
        "instance of this same declaration); names must be unique, e.g. include `{unit}` "
        "[at /parameters/1]"]


def test_a_group_name_produced_by_two_declarations_names_both(tmp_path, monkeypatch):
    family = MINI.replace('  - name: "layers.{unit}.mlp"', '  - name: "embedding"', 1).replace(
        "owner: {unit: decoder}", "owner: {static: embedding}").replace(
        '"model.layers.{unit}.', '"model.x.')
    assert bind_errors(tmp_path, monkeypatch, family) == [
        "family.yaml:18:5: parameter group name `embedding` is produced twice (also by "
        "family.yaml:12:5); names must be unique, e.g. include `{unit}` [at /parameters/1]"]


def test_every_owner_condition_false_is_an_error_at_the_group(tmp_path, monkeypatch):
    family = MINI.replace("owner: {static: embedding}",
                          "owner: [{static: embedding, when: num_layers > 5}]", 1)
    assert bind_errors(tmp_path, monkeypatch, family) == [
        "family.yaml:12:5: no owner choice applies: every `when` is false [at /parameters/0]"]


def test_a_malformed_config_is_a_load_error_located_in_the_config(tmp_path, monkeypatch):
    assert bind_errors(tmp_path, monkeypatch, raw_config='{"model_type": "mini",\n "x": }') == [
        "config.json:2:7: malformed JSON in config.json: Expecting value"]


def test_absurd_unit_counts_fail_fast_instead_of_expanding(tmp_path, monkeypatch):
    config = {**MINI_CONFIG, "num_layers": 10**9}
    assert bind_errors(tmp_path, monkeypatch, config=config) == [
        "family.yaml:8:29: execution group `decoder` has 1000000000 units; partc accepts at most "
        "4096 per group [at /graph/0/units]"]


def test_absurd_loop_counts_fail_fast_instead_of_expanding(tmp_path, monkeypatch):
    family = MINI.replace("    owner: {unit: decoder}\n",
                          "    owner: {unit: decoder}\n    for: {expert: vocab_size * 100000}\n"
                          ).replace('"layers.{unit}.mlp"', '"layers.{unit}.{expert}.mlp"').replace(
        '"model.layers.{unit}.', '"model.layers.{unit}.{expert}.')
    assert bind_errors(tmp_path, monkeypatch, family) == [
        "family.yaml:21:19: the count of `expert` is 1600000; partc accepts at most 4096 "
        "iterations [at /parameters/1/for/expert]"]


def test_every_config_field_mistake_is_reported_together(tmp_path, monkeypatch):
    config = {k: v for k, v in MINI_CONFIG.items() if k != "num_layers"}
    config.update(hidden_size="8", vocab_size=-4)
    assert bind_errors(tmp_path, monkeypatch, config=config) == [
        "config.json:1:1: config.json has no `num_layers`, which family `mini` requires "
        "(declared as int with no default, at family.yaml:5:15) [at /num_layers]",
        "config.json:3:17: config field `hidden_size` must be int, found str '8' (declared at "
        "family.yaml:4:16) [at /hidden_size]",
        "config.json:4:16: config field `vocab_size` must be a positive integer of at most "
        "2147483647, found -4 [at /vocab_size]"]


@pytest.mark.parametrize(("declared", "config", "line", "close"), [
    ("  experts: {type: int, from: num_local_expert}\n", {"num_local_experts": 4}, 7,
     "num_local_experts"),
    ("  experts: {type: int, from: text_config.num_local_expert}\n",
     {"text_config": {"num_local_experts": 4}}, 7, "text_config.num_local_experts"),
    ("  experts: {type: int, from: text_confg.num_local_experts}\n",
     {"text_config": {"num_local_experts": 4}}, 7, "text_config.num_local_experts"),
])
def test_a_misspelt_source_is_located_at_the_family_line_with_the_name_config_json_has(
        tmp_path, monkeypatch, declared, config, line, close):
    family = with_config_fields(declared)
    source = declared.split("from: ")[1].split("}")[0]
    column = declared.index("{") + 1
    assert bind_errors(tmp_path, monkeypatch, family=family, config={**MINI_CONFIG, **config}) \
        == [f"family.yaml:{line}:{column}: config.json has no `{source}`, which family `mini` "
            "requires (declared as int with no default); did you mean "
            f"`{close}`, which config.json has? [at /{source.replace('.', '/')}]"]


@pytest.mark.parametrize(("declared", "config", "meant"), [
    # the field's own name beside a source naming another key
    ("  kv_heads: {type: int, from: num_kv_heads, default: 1}\n", {"kv_heads": 2}, "kv_heads"),
    ("  kv_heads: {type: int, from: text_config.n_kv, default: hidden_size}\n",
     {"text_config": {"kv_heads": 2}}, "text_config.kv_heads"),
    # a misspelt source, with an expression default
    ("  experts: {type: int, from: num_local_expert, default: hidden_size}\n",
     {"num_local_experts": 4}, "num_local_experts"),
])
def test_a_misspelt_source_with_a_default_is_an_error_not_a_silent_default(
        tmp_path, monkeypatch, declared, config, meant):
    family = with_config_fields(declared)
    name, source = declared.split(":")[0].strip(), declared.split("from: ")[1].split(",")[0]
    column = declared.index("{") + 1
    assert bind_errors(tmp_path, monkeypatch, family=family, config={**MINI_CONFIG, **config}) \
        == [f"family.yaml:7:{column}: config field `{name}` reads `{source}`, which config.json "
            f"lacks, so it would take its default; config.json has `{meant}`: did you mean "
            f"`from: {meant}`? [at /config/{name}]"]


@pytest.mark.parametrize("config", [
    MINI_CONFIG,                               # nothing close: the default, silently
    {**MINI_CONFIG, "kv_heads": None},         # the own name given as null is no value
    {**MINI_CONFIG, "num_kv_heads": 3},        # the source itself: read
])
def test_a_source_with_a_default_and_nothing_it_could_mean_binds(tmp_path, monkeypatch,
                                                                 config):
    family = with_config_fields("  kv_heads: {type: int, from: num_kv_heads, default: 1}\n")
    assert bind_errors(tmp_path, monkeypatch, family=family, config=config) == []


@pytest.mark.parametrize(("config", "expected"), [
    ({**MINI_CONFIG, "num_local_experts": None},
     "config.json:6:23: config.json has none of `num_experts`, `num_local_experts` (tried in "
     "this order); `num_local_experts` is null, which family `mini` requires (declared as int "
     "with no default, at family.yaml:7:12) [at /num_local_experts]"),
    (MINI_CONFIG,
     "config.json:1:1: config.json has none of `num_experts`, `num_local_experts` (tried in "
     "this order), which family `mini` requires (declared as int with no default, at "
     "family.yaml:7:12) [at /num_experts]"),
])
def test_a_missing_field_names_every_source_tried(tmp_path, monkeypatch, config, expected):
    family = with_config_fields("  experts: {type: int, from: [num_experts, num_local_experts]}\n")
    assert bind_errors(tmp_path, monkeypatch, family=family, config=config) == [expected]


@pytest.mark.parametrize(("config", "expected"), [
    ({"hidden_size": 8}, "config.json:1:1: config.json has no `model_type`, so no built-in "
                         "family applies; expected the model type of a built-in family "
                         "(bamba, bloom, "),
    ({"model_type": None}, "config.json:2:16: config.json gives `model_type` as null, not a "
                           "string, so no built-in family applies; expected the model type of "),
])
def test_a_config_without_a_model_type_says_so(tmp_path, monkeypatch, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config, indent=1))
    monkeypatch.chdir(tmp_path)
    errors = [str(e) for e in check_family(None, "config.json")]
    assert len(errors) == 1 and errors[0].startswith(expected), errors
    assert errors[0].endswith("), or name a family file [at /model_type]")


# ---------------------------------------------------------------- null config values (issue 35)

def _with_lora_rank(field: str, when: str = "q_lora_rank != null") -> str:
    """MINI with a `q_lora_rank` field and a replicated `q_a` module present under `when`."""
    family = with_config_fields(f"  q_lora_rank: {field}\n")
    return family.replace("  - name: \"layers.{unit}.mlp\"\n", (
        "  - name: \"layers.{unit}.q_a\"\n    role: replicated\n    owner: {unit: decoder}\n"
        f"    when: {when}\n    module: \"model.layers.{{unit}}.q_a\"\n"
        "    sharding: replicated\n    params: {weight: [q_lora_rank, hidden_size]}\n"
        "  - name: \"layers.{unit}.mlp\"\n"), 1)


def _bound_values(tmp_path, monkeypatch, family: str, config: object) -> dict:
    from partc.api import load_family
    from partc.bind.values import read_config_values
    from partc.front.load import load_json

    (tmp_path / "family.yaml").write_text(family)
    (tmp_path / "config.json").write_text(json.dumps(config, indent=1))
    monkeypatch.chdir(tmp_path)
    return read_config_values(load_family("family.yaml")[0], load_json("config.json"))


@pytest.mark.parametrize(("field", "config", "expected"), [
    # nullable: null is the value; the default applies only to a missing key
    ("{type: int, nullable: true, default: 16}", {"q_lora_rank": None}, None),
    ("{type: int, nullable: true, default: 16}", {}, 16),
    ("{type: int, nullable: true, default: 16}", {"q_lora_rank": 4}, 4),
    ("{type: int, nullable: true}", {"q_lora_rank": None}, None),
    # not nullable: null reads as a missing key, and the default applies
    ("{type: int, default: 16}", {"q_lora_rank": None}, 16),
])
def test_a_nullable_field_binds_null_as_a_value_and_its_default_only_to_a_missing_key(
        tmp_path, monkeypatch, field, config, expected):
    values = _bound_values(tmp_path, monkeypatch, _with_lora_rank(field),
                           {**MINI_CONFIG, **config})
    assert values["q_lora_rank"] == expected


@pytest.mark.parametrize("field", ["{type: int, default: 0}",
                                   "{type: int, nullable: true, default: 0}"])
def test_a_null_key_that_resembles_another_key_is_not_taken_for_a_misspelling(
        tmp_path, monkeypatch, field):
    # `q_lora_rank` is present (null) beside `kv_lora_rank`: no "did you mean" error
    config = {**MINI_CONFIG, "q_lora_rank": None, "kv_lora_rank": 8}
    assert bind_errors(tmp_path, monkeypatch, _with_lora_rank(field, "true"
                                                              if "nullable" not in field
                                                              else "q_lora_rank != null"),
                       config=config) == []


def test_a_null_that_reaches_arithmetic_is_located_at_the_expression(tmp_path, monkeypatch):
    family = _with_lora_rank("{type: int, nullable: true}", "q_lora_rank > 0")
    assert bind_errors(tmp_path, monkeypatch, family,
                       config={**MINI_CONFIG, "q_lora_rank": None}) == [
        "family.yaml:22:23: `>` needs two integers or two strings, found null and int (0) "
        "[at /parameters/1/when]"]
    family = _with_lora_rank("{type: int, nullable: true}", "true")
    assert bind_errors(tmp_path, monkeypatch, family,
                       config={**MINI_CONFIG, "q_lora_rank": None}) == [
        "family.yaml:25:23: a shape dimension `q_lora_rank` must be an integer, found null "
        "[at /parameters/1/params/weight/0]"]


def test_a_probe_field_cannot_be_nullable(tmp_path, monkeypatch):
    family = with_config_fields("  probed: {type: bool, nullable: true, default: false, "
                                "present: x.weight}\n")
    assert bind_errors(tmp_path, monkeypatch, family) == [
        "family.yaml:7:11: config field `probed` probes the checkpoint with `present`, so it "
        "is true or false, never null; remove `nullable` [at /config/probed]"]
