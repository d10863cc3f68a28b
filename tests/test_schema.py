"""Stage 2, the schema: every violation says what was expected and found, at the exact node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from partc.errors import SchemaError
from partc.front.load import load_document
from partc.front.schema import validate_document

from support.families import MINI


def errors(text: str, name: str = "f.yaml") -> list[str]:
    return [str(e) for e in validate_document(load_document(name, text=text))]


def edited(old: str, new: str) -> list[str]:
    assert old in MINI
    return errors(MINI.replace(old, new, 1))


def test_the_mini_family_is_schema_valid():
    assert errors(MINI) == []


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("model_types: [mini]", "model_types: mini",
     'f.yaml:2:14: expected a list, found "mini" [at /model_types]'),
    ("model_types: [mini]", "model_types: []",
     "f.yaml:2:14: expected at least 1 item, found 0 [at /model_types]"),
    ("    role: vocabulary", "    role: vocab",
     'f.yaml:13:11: expected one of "replicated", "column_projection", "row_projection", '
     '"vocabulary", "attention_heads", "feed_forward_intermediate", "expert_intermediate", '
     '"channels", "segmented", found "vocab"; did you mean "vocabulary"? [at /parameters/0/role]'),
    ("  hidden_size: int", "  hidden-size: int",
     'f.yaml:4:3: key "hidden-size" is not allowed: expected an identifier (letters, digits and '
     "`_`, not starting with a digit) [at /config]"),
    ("  hidden_size: int", "  hidden_size: integer",
     'f.yaml:4:16: expected one of "int", "bool", "str", "float", "int_list", "str_list", "any" '
     'or a mapping, found "integer"; did you mean "int"? [at /config/hidden_size]'),
    ("    sharding: {balanced: 0}", "    sharding: {balanced: x}",
     'f.yaml:16:26: expected an integer, found "x" [at /parameters/0/sharding/balanced]'),
    ("    sharding: {balanced: 0}", "    sharding: {balanced: 0o2}",
     'f.yaml:16:26: expected an integer, found "0o2"; YAML 1.1 would read `0o2` as the octal '
     "integer 2; partc reads YAML 1.2 and keeps it the string '0o2' (write 2) "
     "[at /parameters/0/sharding/balanced]"),
    ("    sharding: {balanced: 0}", "    sharding: {balance: 0}",
     "f.yaml:16:15: expected a mapping with `equal`, a mapping with `balanced`, a mapping with "
     "`partitioned`, a mapping with `partitioned_segments` or a mapping with `segmented`, found "
     '{"balance": 0}; unexpected key `balance`; did you mean `balanced`? '
     "[at /parameters/0/sharding]"),
    ("    sharding: {balanced: 0}", "    sharding: column",
     'f.yaml:16:15: expected "replicated" or a mapping, found "column"; a `module:` group\'s '
     "`sharding` is `replicated` or one rule along an axis A: `{equal: A}`, `{balanced: A}`, "
     "`{partitioned: A}`, `{partitioned_segments: {axis: A, segments: [...]}}` or "
     "`{segmented: {axis: A, segments: [...]}}`; `column` and `row` split the projections of a "
     "`projections:` group: a vocabulary head's rows are split with `{balanced: 0}`, as the "
     "built-in families write it [at /parameters/0/sharding]"),
    ("    owner: {static: embedding}", "    owner: {static: embedding, unit: decoder}",
     "f.yaml:14:12: expected exactly one of `static`, `any_of`, `unit`, found `static`, `unit` "
     "[at /parameters/0/owner]"),
    ("    module: model.embed_tokens\n",
     "    module: model.embed_tokens\n"
     "    projections: [{module: m, sharding: row, params: {w: [1]}}]\n",
     "f.yaml:12:5: expected exactly one of `members`, `module`, `projections`, `fused`, found "
     "`module`, `projections` [at /parameters/0]"),
    ("    module: model.embed_tokens\n",
     "    module: model.embed_tokens\n    fused: {module: f, segments: [1], params: {w: [1]}}\n",
     "f.yaml:12:5: expected exactly one of `members`, `module`, `projections`, `fused`, found "
     "`module`, `fused` [at /parameters/0]"),
    ("state: true}", "state: no}",
     "f.yaml:8:77: expected a boolean, found \"no\"; YAML 1.1 would read `no` as false; partc "
     "reads YAML 1.2 and keeps it the string 'no' (write false, or quote it) [at /graph/0/state]"),
    ("shape: [batch, sequence, hidden_size]", "shape: [batch, 0]",
     "f.yaml:27:42: expected a number >= 1, found 0 [at /boundary/primary/shape/1]"),
    ("params: {weight: [vocab_size, hidden_size]}",
     "params: {weight: {shape: [vocab_size], extra: 1}}",
     "f.yaml:17:44: unexpected key `extra` (allowed here: dtype, shape, when) "
     "[at /parameters/0/params/weight/extra]"),
])
def test_one_mistake_gives_one_message_stating_rule_and_value(old, new, expected):
    assert edited(old, new) == [expected]


def test_an_unknown_key_is_pointed_at_itself_with_a_suggestion():
    (message,) = edited("    role: vocabulary\n", "    role: vocabulary\n    shards: 2\n")
    assert message.startswith("f.yaml:14:5: unexpected key `shards`; did you mean `sharding`? "
                              "(allowed here: ")
    assert message.endswith("[at /parameters/0/shards]")


def test_an_unknown_top_level_key_over_a_list_is_pointed_at_its_own_line():
    # the value of `grahp:` starts on the next line: the error is at the key, not there
    line = MINI.splitlines().index("graph:") + 1
    messages = edited("graph:\n", "grahp:\n")
    unexpected = [m for m in messages if "unexpected key `grahp`" in m]
    assert len(unexpected) == 1 and unexpected[0].startswith(f"f.yaml:{line}:1: "), messages


def test_missing_required_keys_are_reported_one_by_one_at_the_mapping():
    assert errors("family: x\nmodel_types: [x]\nconfig: {}\ngraph: []\n") == [
        "f.yaml:1:1: missing required key `boundary`",
        "f.yaml:1:1: missing required key `parameters`",
        "f.yaml:4:8: expected at least 1 item, found 0 [at /graph]",
    ]


def test_toml_documents_hear_tables_and_arrays_not_mappings_and_lists():
    assert errors('family = "x"\nmodel_types = "x"\nconfig = 1\n', "f.toml")[-2:] == [
        'f.toml:2:15: expected an array, found "x" [at /model_types]',
        "f.toml:3:10: expected a table, found 1 [at /config]",
    ]


def test_a_non_mapping_document_is_one_clear_error():
    assert errors("- a\n- b\n") == ['f.yaml:1:1: expected a mapping, found ["a", "b"]']


def test_schema_errors_keep_the_schema_path_as_a_second_field():
    document = load_document("f.yaml", text=MINI.replace("role: vocabulary", "role: vocab"))
    (error,) = validate_document(document)
    assert isinstance(error, SchemaError)
    assert error.pointer == "/parameters/0/role"
    assert error.schema_path == "/properties/parameters/items/properties/role/enum"
    assert error.to_json()["kind"] == "SchemaError"


def test_every_error_of_a_document_is_reported_sorted_by_position():
    text = (MINI.replace("model_types: [mini]", "model_types: 3")
            .replace("role: vocabulary", "role: x")
            .replace("dtype: activation", "dtype: fp8"))
    lines = [line.split(": ")[0] for line in errors(text)]
    assert lines == ["f.yaml:2:14", "f.yaml:13:11", "f.yaml:27:73"]


def test_a_key_too_long_for_an_identifier_is_explained_not_recursed_on():
    key = "k" * 200
    (message,) = edited("  hidden_size: int", f"  {key}: int")
    assert message == (f'f.yaml:4:3: key "{key[:56]}... is not allowed: expected at most 128 '
                       "characters, found a string of 200 [at /config]")


SCHEMA_FILE = Path(__file__).resolve().parents[1] / "schemas" / "architecture.schema.json"


def _properties(node: object, pointer: str = "") -> Iterator[tuple[str, object]]:
    """Every `properties` entry of the schema at every depth, with its JSON pointer."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                yield f"{pointer}/properties/{name}", sub
        for key, value in node.items():
            yield from _properties(value, f"{pointer}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _properties(value, f"{pointer}/{i}")


def _undescribed(schema: object) -> list[str]:
    return [pointer for pointer, sub in _properties(schema)
            if not (isinstance(sub, dict) and isinstance(sub.get("description"), str)
                    and sub["description"].strip())]


def test_the_walker_finds_nested_properties_and_flags_a_missing_description():
    # the oracle for the walk: a property nested in a oneOf inside $defs, one without a text
    sample = {"$defs": {"a": {"oneOf": [{"properties": {
        "x": {"type": "integer", "description": "An x."},
        "y": {"type": "integer"},
        "z": {"description": "  "}}}]}}}
    assert _undescribed(sample) == ["/$defs/a/oneOf/0/properties/y",
                                    "/$defs/a/oneOf/0/properties/z"]


def test_every_schema_property_has_a_description_for_editors():
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    pointers = [pointer for pointer, _ in _properties(schema)]
    # the walk reaches top-level keys and keys nested in $defs alternatives
    assert "/properties/family" in pointers
    assert "/$defs/sharding/oneOf/1/properties/equal" in pointers
    missing = _undescribed(schema)
    assert missing == [], f"schema properties without a description: {', '.join(missing)}"


def test_the_schema_is_a_valid_draft_2020_12_schema():
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
