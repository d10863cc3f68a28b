"""Stage 1, loading: YAML, TOML and config.json become data with exact positions, within bounds."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
import yaml

from partc.errors import LoadError, SourceLocation
from partc.front.load import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_DOCUMENT_BYTES,
    load_document,
    load_json,
    parse_json,
)
from partc.front.positions import toml_locations


def load_yaml(text: str):
    return load_document("f.yaml", text=text)


def load_error(text: str, name: str = "f.yaml") -> str:
    with pytest.raises(LoadError) as caught:
        load_document(name, text=text)
    return str(caught.value)


# ---------------------------------------------------------------- YAML values and positions


def test_yaml_records_the_line_and_column_of_every_value():
    document = load_yaml("a: 1\nb:\n  - x\n  - {c: 'y'}\n")
    assert document.data == {"a": 1, "b": ["x", {"c": "y"}]}
    assert document.locations["/a"] == SourceLocation("f.yaml", 1, 4)
    assert document.locations["/b"] == SourceLocation("f.yaml", 3, 3)
    assert document.locations["/b/1"] == SourceLocation("f.yaml", 4, 5)
    assert document.locations["/b/1/c"] == SourceLocation("f.yaml", 4, 9)


def test_locate_falls_back_to_the_nearest_located_ancestor():
    document = load_yaml("a:\n  b: 1\n")
    assert document.locate("/a/b/c/d") == SourceLocation("f.yaml", 2, 6)
    assert document.locate("/nope") == SourceLocation("f.yaml", 1, 1)


def test_pointer_tokens_escape_slash_and_tilde():
    document = load_yaml("'a/b': {'c~d': 1}\n")
    assert document.locations["/a~1b/c~0d"] == SourceLocation("f.yaml", 1, 16)


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("False", False), ("null", None), ("~", None), ("", None), ("10", 10),
    ("-3", -3), ("+7", 7), ("0", 0), ("1.5", 1.5), ("1e3", 1000.0), ("'no'", "no"),
    ('"0o10"', "0o10"), ("!!str 12", "12"), ("! 12", "12"), ("|\n  x\n", "x\n"),
])
def test_plain_scalars_resolve_by_yaml_1_2_core_rules(text, value):
    assert load_yaml(f"v: {text}").data == {"v": value}


@pytest.mark.parametrize(("text", "note"), [
    ("no", "YAML 1.1 would read `no` as false; partc reads YAML 1.2 and keeps it the string 'no'"
           " (write false, or quote it)"),
    ("On", "YAML 1.1 would read `On` as true; partc reads YAML 1.2 and keeps it the string 'On'"
           " (write true, or quote it)"),
    ("0o10", "YAML 1.1 would read `0o10` as the octal integer 8; partc reads YAML 1.2 and keeps "
             "it the string '0o10' (write 8)"),
    ("0x1F", "YAML 1.1 would read `0x1F` as the hexadecimal integer 31; partc reads YAML 1.2 and"
             " keeps it the string '0x1F' (write 31)"),
    ("010", "YAML 1.1 would read `010` as the octal integer 8 (YAML 1.2 parsers read 10); partc "
            "reads YAML 1.2 and keeps it the string '010' (write 8 or 10)"),
    ("1_000", "YAML 1.1 would read `1_000` as the integer 1000; partc reads YAML 1.2 and keeps it"
              " the string '1_000' (write 1000)"),
    ("1:20", "YAML 1.1 would read `1:20` as the base-60 integer 80; partc reads YAML 1.2 and "
             "keeps it the string '1:20' (write 80)"),
    (".inf", "`.inf` is a string here (YAML would read it as a non-finite float)"),
])
def test_yaml_1_1_lookalikes_stay_strings_with_a_note_explaining_the_surprise(text, note):
    document = load_yaml(f"v: {text}\n")
    assert document.data == {"v": text}
    assert document.note("/v") == note


def test_an_exponent_float_is_a_float_with_a_note_saying_to_write_the_integer():
    document = load_yaml("v: 1e3\n")
    assert document.data == {"v": 1000.0}
    assert document.note("/v") == "`1e3` is the float 1000.0 in YAML; write the integer 1000"


def test_verbatim_strings_locate_a_character_offset_exactly():
    document = load_yaml("plain: a + b\nquoted: 'a + b'\nescaped: \"a\\tb\"\nblock: |\n  a\n")
    assert document.locate_offset("/plain", 4) == SourceLocation("f.yaml", 1, 12)
    assert document.locate_offset("/quoted", 4) == SourceLocation("f.yaml", 2, 14)
    assert document.locate_offset("/escaped", 2) == SourceLocation("f.yaml", 3, 10)
    assert document.locate_offset("/block", 1) == SourceLocation("f.yaml", 4, 8)


# ---------------------------------------------------------------- YAML refusals


@pytest.mark.parametrize(("text", "message"), [
    ("a: 1\na: 2\n", "f.yaml:2:1: duplicate key 'a' (first defined at line 1) [at /a]"),
    ("1: x\n", "f.yaml:1:1: mapping keys must be strings, found int '1' (quote it)"),
    ("~: x\n", "f.yaml:1:1: mapping keys must be strings, found null (quote it)"),
    ("true: x\n", "f.yaml:1:1: mapping keys must be strings, found bool 'true' (quote it)"),
    ("? [a]\n: 1\n", "f.yaml:1:3: mapping keys must be strings, found a sequence"),
    ("a: &k x\n*k : 1\n", "f.yaml:2:1: an alias (*k) cannot be a mapping key; keys must be plain"
                          " strings"),
    ("a: !!python/object/apply:os.system [ls]\n",
     "f.yaml:1:4: explicit YAML tags are not allowed, found '!!python/object/apply:os.system'; "
     "write plain values [at /a]"),
    ("a: !!int 3\n", "f.yaml:1:4: explicit YAML tags are not allowed, found '!!int'; write plain"
                     " values [at /a]"),
    ("a: !custom x\n", "f.yaml:1:4: explicit YAML tags are not allowed, found '!custom'; write "
                       "plain values [at /a]"),
    ("a: &x {b: 1}\nc:\n  <<: *x\n", "f.yaml:3:3: YAML merge keys (<<) are not allowed; repeat "
                                     "the keys you need [at /c]"),
    ("a: *nope\n", "f.yaml:1:4: alias *nope names no anchor defined before it [at /a]"),
    ("a: &r [1, *r]\n", "f.yaml:1:11: alias *r refers to its own anchor (a recursive alias) "
                        "[at /a/1]"),
    ("a: 1\n---\nb: 2\n", "f.yaml:2:1: expected a single YAML document, found a second one "
                          "(`---`); put everything in one document"),
    ("# only a comment\n", "f.yaml:1:1: empty document: expected a mapping with `family`, "
                           "`config`, ..."),
    ("a:\n\tb: 1\n", "f.yaml:2:1: malformed YAML: found character '\\t' that cannot start any "
                     "token; YAML indentation must use spaces, not tabs (while scanning for the "
                     "next token)"),
    ("a: [1, 2\n", "f.yaml:2:1: malformed YAML: expected ',' or ']', but got '<stream end>' "
                   "(while parsing a flow sequence)"),
    ("a: 'x\n", "f.yaml:2:1: malformed YAML: found unexpected end of stream (while scanning a "
                "quoted scalar)"),
    ("a: 1\x00\n", "f.yaml:1:1: family file contains a NUL character; expected text"),
])
def test_yaml_refusals_name_the_line_column_and_rule(text, message):
    assert load_error(text) == message


@pytest.mark.parametrize("libyaml", [True, False])
def test_yaml_syntax_errors_read_the_same_with_or_without_libyaml(monkeypatch, libyaml):
    monkeypatch.setattr(yaml, "__with_libyaml__", libyaml)
    assert load_error("a: [1, 2\n") == ("f.yaml:2:1: malformed YAML: expected ',' or ']', but "
                                        "got '<stream end>' (while parsing a flow sequence)")
    document = load_yaml("a: [1, {b: x}]\n")
    assert document.locations["/a/1/b"] == SourceLocation("f.yaml", 1, 12)


def _billion_laughs(levels: int = 9) -> str:
    lines = ['l0: &l0 "lol"']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_document_fails_fast_in_bounded_memory():
    tracemalloc.start()
    started = time.perf_counter()
    try:
        message = load_error(_billion_laughs())
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message == ("f.yaml:6:45: document holds more than 100000 values once aliases are "
                       "expanded (an alias bomb?); the limit keeps memory bounded [at /l5/7]")
    assert elapsed < 0.5
    assert peak < 2 * 1024 * 1024


def test_aliases_within_the_bounds_are_expanded_and_shared():
    document = load_yaml("base: &b [1, 2]\nuse: *b\n")
    assert document.data == {"base": [1, 2], "use": [1, 2]}
    assert document.locations["/use"] == SourceLocation("f.yaml", 2, 6)


def test_a_long_string_repeated_by_aliases_is_bounded_by_characters():
    text = "s: &s '" + "x" * 500_000 + "'\nr: [" + ", ".join(["*s"] * 20) + "]\n"
    assert "characters of text once aliases are expanded (an alias bomb?)" in load_error(text)


@pytest.mark.parametrize(("text", "where"), [
    ("a: " + "[" * 100 + "]" * 100 + "\n", "f.yaml:1:67:"),
    ("a: " + "{b: " * 100 + "1" + "}" * 100 + "\n", "f.yaml:1:256:"),
    ("".join(" " * (2 * i) + f"k{i}:\n" for i in range(100)) + " " * 200 + "v\n", "f.yaml:65:"),
])
def test_nesting_deeper_than_the_limit_is_refused_where_it_crosses_the_limit(text, where):
    message = load_error(text)
    assert message.startswith(where)
    assert f"nesting deeper than {MAX_DEPTH} levels" in message


def test_a_million_open_brackets_fail_fast():
    started = time.perf_counter()
    assert "nesting deeper than 64 levels" in load_error("[" * 1_000_000)
    assert time.perf_counter() - started < 5


def test_a_document_over_the_size_limit_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * MAX_DOCUMENT_BYTES)
    with pytest.raises(LoadError) as caught:
        load_document(path)
    assert str(caught.value) == (f"{path}: family file is larger than the limit of "
                                 f"{MAX_DOCUMENT_BYTES} bytes")


def test_a_family_file_that_is_not_utf8_names_the_line_and_column_of_the_bad_byte(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_bytes(b"a: 1\nb: caf\xe9\n")
    with pytest.raises(LoadError) as caught:
        load_document(path)
    assert str(caught.value) == f"{path}:2:7: family file is not UTF-8: byte 0xe9 at offset 11"


def test_an_unknown_suffix_is_refused():
    assert load_error("a: 1", "f.json") == ("f.json: unknown family file type '.json': expected "
                                            ".yaml, .yml or .toml")


# ---------------------------------------------------------------- TOML

TOML = '''\
family = "mini"
model_types = ["mini", 'other']

[config]
hidden_size = "int"
heads = {type = "int", default = "hidden_size // 8"}
"quoted.key" = "str"
dotted.inner.leaf = 1

[[parameters]]
name = "embedding"
owner = [
  {any_of = ["a", "b"], when = "x"},  # a comment
  {static = "a"},
]

[parameters.params]
weight = ["vocab_size", "hidden_size"]

[[parameters]]
name = "mlp"
when = """
multi
line"""

[[parameters.projections]]
module = "up"
params = {weight = ["a", "b"], bias = {shape = ["a"], when = "c"}}

[[parameters.projections]]
module = "down"
'''


@pytest.mark.parametrize(("pointer", "line", "column"), [
    ("/family", 1, 10),
    ("/model_types/1", 2, 24),
    ("/config", 4, 1),
    ("/config/heads", 6, 9),
    ("/config/heads/default", 6, 34),
    ("/config/quoted.key", 7, 16),
    ("/config/dotted/inner", 8, 1),
    ("/config/dotted/inner/leaf", 8, 21),
    ("/parameters", 10, 1),
    ("/parameters/0", 10, 1),
    ("/parameters/0/owner", 12, 9),
    ("/parameters/0/owner/0/when", 13, 32),
    ("/parameters/0/owner/1/static", 14, 13),
    ("/parameters/0/params", 17, 1),
    ("/parameters/0/params/weight/1", 18, 25),
    ("/parameters/1", 20, 1),
    ("/parameters/1/when", 22, 8),
    ("/parameters/1/projections/0", 26, 1),
    ("/parameters/1/projections/0/params/bias/when", 28, 62),
    ("/parameters/1/projections/1/module", 31, 10),
])
def test_toml_positions_follow_arrays_of_tables_subtables_and_inline_tables(pointer, line,
                                                                           column):
    assert toml_locations("f.toml", TOML)[pointer] == SourceLocation("f.toml", line, column)


def test_the_toml_scanner_finds_a_position_for_every_value_tomllib_reads():
    document = load_document("f.toml", text=TOML)

    def pointers(value, pointer=""):
        yield pointer
        if isinstance(value, dict):
            for key, item in value.items():
                yield from pointers(item, f"{pointer}/{key.replace('~', '~0').replace('/', '~1')}")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                yield from pointers(item, f"{pointer}/{index}")

    assert set(pointers(document.data)) <= set(document.locations)


@pytest.mark.parametrize(("text", "message"), [
    ("a = 1\na = 2\n", "f.toml:2:1: malformed TOML: duplicate key `a`: it is already defined in "
                       "this table; expected every key once"),
    ("[x]\n[x]\n", "f.toml:2:1: malformed TOML: table [x] is declared twice; expected every "
                   "table once"),
    ('a = "x\n', "f.toml:1:7: malformed TOML: unterminated string: missing its closing quote "
                 "before the end of the line"),
    ("a = tru\n", "f.toml:1:5: malformed TOML: Invalid value"),
    ("a = [1,\n", "f.toml:2:1: malformed TOML: Invalid value"),
    ("d = 2024-01-01\n", "f.toml:1:5: TOML date values are not allowed: expected a string, a "
                         "number, a boolean, an array or a table [at /d]"),
    ("a = " + "[" * 80 + "]" * 80 + "\n", "f.toml:1:" + str(5 + MAX_DEPTH) + ": nesting deeper "
     f"than {MAX_DEPTH} levels [at /a" + "/0" * MAX_DEPTH + "]"),
])
def test_toml_errors_name_the_line_and_what_is_wrong(text, message):
    assert load_error(text, "f.toml") == message


def test_toml_verbatim_strings_locate_character_offsets():
    document = load_document("f.toml", text='a = "x // y"\nb = \'lit\'\nc = "e\\tsc"\n')
    assert document.locate_offset("/a", 2) == SourceLocation("f.toml", 1, 8)
    assert document.locate_offset("/b", 1) == SourceLocation("f.toml", 2, 7)
    assert document.locate_offset("/c", 3) == SourceLocation("f.toml", 3, 5)


# ---------------------------------------------------------------- config.json


def test_config_json_records_the_position_of_nested_values():
    document = parse_json("config.json", '{"a": 1,\n "q": {"bits": 4, "list": [1, {"x": 2}]}}')
    assert document.locations["/a"] == SourceLocation("config.json", 1, 7)
    assert document.locations["/q/bits"] == SourceLocation("config.json", 2, 16)
    assert document.locations["/q/list/1/x"] == SourceLocation("config.json", 2, 37)


@pytest.mark.parametrize(("text", "message"), [
    ('{"a": 1,}', "config.json:1:9: malformed JSON in config.json: Expecting property name "
                  "enclosed in double quotes"),
    ('{"a": NaN}', "config.json:1:1: malformed JSON in config.json: NaN is not valid JSON"),
    ('{"a": 1,\n "a": 2}', "config.json:2:2: duplicate key 'a' in config.json; expected every key"
                           " once"),
    ("[1]", "config.json:1:1: config.json must be a JSON object, found an array"),
    ('"x"', "config.json:1:1: config.json must be a JSON object, found a string"),
    ("", "config.json:1:1: malformed JSON in config.json: Expecting value"),
    ('{"a": ' + "[" * 70 + "]" * 70 + "}",
     "config.json:1:" + str(7 + MAX_DEPTH) + f": nesting deeper than {MAX_DEPTH} levels [at /a"
     + "/0" * MAX_DEPTH + "]"),
])
def test_config_json_errors_are_located(text, message):
    with pytest.raises(LoadError) as caught:
        parse_json("config.json", text, "config.json")
    assert str(caught.value) == message


def test_config_json_refuses_a_folder_a_missing_file_and_an_oversized_file(tmp_path):
    (tmp_path / "folder").mkdir()
    big = tmp_path / "big.json"
    big.write_text('{"x": "' + "y" * MAX_CONFIG_BYTES + '"}')
    messages = []
    for path in (tmp_path / "folder", tmp_path / "missing.json", big):
        with pytest.raises(LoadError) as caught:
            load_json(path, "config.json")
        messages.append(str(caught.value))
    assert messages == [
        f"{tmp_path / 'folder'}: cannot read config.json: {tmp_path / 'folder'} is a folder, "
        "expected a file",
        f"{tmp_path / 'missing.json'}: cannot read config.json: No such file or directory",
        f"{big}: config.json is larger than the limit of {MAX_CONFIG_BYTES} bytes",
    ]


def test_a_path_with_a_nul_character_is_a_load_error_not_a_value_error():
    with pytest.raises(LoadError) as caught:
        load_json("con\x00fig.json")
    assert caught.value.message == "cannot read config: the path contains a NUL character"


def test_json_huge_integers_are_values_not_crashes():
    document = parse_json("c.json", json.dumps({"n": 2**200}))
    assert document.data["n"] == 2**200


@pytest.mark.parametrize(("name", "text", "message"), [
    ("f.toml", "a = 1\nb = " + "9" * 5000 + "\n",
     "f.toml:2:5: malformed TOML: a number is too long (Python reads at most 4300 digits)"),
    ("f.toml", "a = 0x" + "f" * 100 + "\n",
     "f.toml:1:5: integer of 400 bits is too large: expected at most 256 bits [at /a]"),
    ("f.yaml", "a: " + "9" * 5000 + "\n", None),
    ("f.yaml", "a: 0x" + "f" * 5000 + "\n", None),
])
def test_numbers_too_long_to_print_are_refused_or_kept_as_strings(name, text, message):
    if message is None:
        document = load_document(name, text=text)
        assert isinstance(document.data["a"], str)
    else:
        assert load_error(text, name) == message


def test_a_config_number_too_long_for_python_is_a_located_load_error():
    with pytest.raises(LoadError) as caught:
        parse_json("config.json", '{"a":\n ' + "9" * 5000 + "}", "config.json")
    assert str(caught.value) == ("config.json:2:2: malformed JSON in config.json: a number is too "
                                 "long (Python reads at most 4300 digits)")
    with pytest.raises(LoadError) as caught:
        parse_json("config.json", json.dumps({"a": 2**300}), "config.json")
    assert str(caught.value) == ("config.json:1:7: integer of 301 bits is too large: expected at "
                                 "most 256 bits [at /a]")
