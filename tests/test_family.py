"""Stage 3, the family: expressions, names and ownership rules, located at the exact character."""

from __future__ import annotations

import pytest

from partc.api import check_family

from support.families import MINI, MINI_TOML


def check(tmp_path, monkeypatch, text: str, name: str = "family.yaml") -> list[str]:
    (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return [str(e) for e in sorted(check_family(name), key=lambda e: e.sort_key())]


def edited(tmp_path, monkeypatch, old: str, new: str) -> list[str]:
    assert old in MINI, old
    return check(tmp_path, monkeypatch, MINI.replace(old, new, 1))


def test_the_mini_family_checks_clean(tmp_path, monkeypatch):
    assert check(tmp_path, monkeypatch, MINI) == []


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("    units: hidden_size\n", "    units: hidden_size //\n",
     "family.yaml:21:26: expected a value, found the end of the expression "
     "[at /parameters/1/units]"),
    ("    units: hidden_size\n", "    units: 'hidden_size / 2'\n",
     "family.yaml:21:25: `/` is not supported: use `//` for integer (floor) division "
     "[at /parameters/1/units]"),
    ("    units: hidden_size\n", "    units: sqrt(hidden_size)\n",
     "family.yaml:21:12: unknown function `sqrt` (known: abs, ceil, ceil_div, floor, gcd, len, "
     "max, min, round) [at /parameters/1/units]"),
    ("    units: hidden_size\n", "    units: 2 * 99999999999999999999\n",
     "family.yaml:21:16: integer overflow: `99999999999999999999` exceeds 2**63 "
     "[at /parameters/1/units]"),
    ("    units: hidden_size\n", "    units: 99999999999999999999\n",
     "family.yaml:21:12: integer overflow: the constant = 99999999999999999999 exceeds 2**63 "
     "[at /parameters/1/units]"),
    ("    units: hidden_size\n", "    units: " + "(" * 70 + "1" + ")" * 70 + "\n",
     "family.yaml:21:76: expression nests deeper than 64 levels [at /parameters/1/units]"),
    ("    units: hidden_size\n", "    units: 0o10\n",
     "family.yaml:21:12: expected an integer, a boolean or an expression, found '0o10'; YAML 1.1 "
     "would read `0o10` as the octal integer 8; partc reads YAML 1.2 and keeps it the string "
     "'0o10' (write 8) [at /parameters/1/units]"),
    ("    units: hidden_size\n", "    units: 1e3\n",
     "family.yaml:21:12: expected an integer, a boolean or an expression, found 1000.0; `1e3` is "
     "the float 1000.0 in YAML; write the integer 1000 [at /parameters/1/units]"),
    ("    owner: {unit: decoder}\n", "    owner: {unit: decoder}\n    when: no\n",
     "family.yaml:21:11: `when` uses unknown name `no`; YAML 1.1 would read `no` as false; partc "
     "reads YAML 1.2 and keeps it the string 'no' (write false, or quote it) "
     "[at /parameters/1/when]"),
    ("params: {weight: [vocab_size, hidden_size]}", "params: {weight: [vocab_size, hiden_size]}",
     "family.yaml:17:35: a shape uses unknown name `hiden_size`; did you mean `hidden_size`? "
     "Known names: config fields (hidden_size, num_layers, vocab_size); declare it under "
     "`config` [at /parameters/0/params/weight/1]"),
    ('path: "model.layers.{unit}"', 'path: "model.layers.{unit"',
     "family.yaml:8:61: unclosed `{` in template: close the field with `}` or write `{{` for a "
     "literal brace [at /graph/0/path]"),
    ('path: "model.layers.{unit}"', 'path: "model.layers.{layer}"',
     "family.yaml:8:47: the unit path uses unknown name `layer`; did you mean `num_layers`? Known "
     "names: config fields "
     "(hidden_size, num_layers, vocab_size); here also `unit`; declare it under `config` "
     "[at /graph/0/path]"),
    ("    sharding: {balanced: 0}\n", "    sharding: {balanced: 0}\n    units: vocab_size\n",
     "family.yaml:17:12: this group declares `units: vocab_size` but no member is partitioned; "
     "drop `units`, or shard a member with `partitioned` or `partitioned_segments` "
     "[at /parameters/0/units]"),
    ("    sharding: {balanced: 0}\n", "    sharding: {partitioned: 0}\n",
     "family.yaml:12:5: this group partitions a member but declares no `units` "
     "[at /parameters/0]"),
    ("    owner: {unit: decoder}", "    owner: [{unit: decoder, when: true}, {static: embedding}]",
     "family.yaml:18:5: a group is either unit-owned or statically owned, not both "
     "[at /parameters/1]"),
    ("    owner: {static: embedding}", "    owner: {static: embeddings}",
     "family.yaml:14:12: owner names undeclared static role `embeddings`; declared under "
     "`static`: embedding [at /parameters/0/owner]"),
])
def test_a_family_mistake_is_reported_at_its_exact_character(tmp_path, monkeypatch, old, new,
                                                             expected):
    assert edited(tmp_path, monkeypatch, old, new) == [expected]


def test_a_duplicate_execution_group_is_reported_once_pointing_at_the_first(tmp_path,
                                                                            monkeypatch):
    assert edited(tmp_path, monkeypatch, "state: true}\n",
                  'state: true}\n  - {group: decoder, units: 1, path: "mtp.{unit}"}\n') == [
        "family.yaml:9:5: execution group `decoder` is declared twice (first at "
        "family.yaml:8:5); group names must be unique [at /graph/1]"]


def test_a_broken_unit_path_does_not_make_its_group_unknown_to_owners(tmp_path, monkeypatch):
    messages = edited(tmp_path, monkeypatch, 'path: "model.layers.{unit}"', 'path: "x.{"')
    assert len(messages) == 1
    assert "unknown execution group" not in messages[0]


def test_toml_expression_errors_point_into_the_string(tmp_path, monkeypatch):
    text = MINI_TOML.replace('units = "hidden_size"', 'units = "hidden_size % 0 +"')
    assert check(tmp_path, monkeypatch, text, "family.toml") == [
        "family.toml:32:27: expected a value, found the end of the expression "
        "[at /parameters/1/units]"]


def test_toml_unknown_names_in_inline_tables_point_at_the_element(tmp_path, monkeypatch):
    text = MINI_TOML.replace('params = {weight = ["hidden_size", 8]}',
                             'params = {weight = ["hiddensize", 8]}')
    assert check(tmp_path, monkeypatch, text, "family.toml") == [
        "family.toml:37:21: a shape uses unknown name `hiddensize`; did you mean "
        "`hidden_size`? Known names: config fields (hidden_size, num_layers, vocab_size); here "
        "also `group`, `path`, `unit`; declare it under `config` "
        "[at /parameters/1/projections/0/params/weight/0]"]



def test_the_toml_spelling_of_the_mini_family_checks_clean(tmp_path, monkeypatch):
    assert check(tmp_path, monkeypatch, MINI_TOML, "family.toml") == []


def test_a_declared_sharding_is_one_frozen_class_per_kind() -> None:
    import dataclasses

    from partc.api import load_family
    from partc.family.declaration import (
        AXIS_SHARDING_DECLS,
        SEGMENTS_SHARDING_DECLS,
        BalancedShardingDecl,
        PartitionedShardingDecl,
        ReplicatedShardingDecl,
    )
    from partc.parallel.specs import MemberShardingKind

    assert set(AXIS_SHARDING_DECLS) | set(SEGMENTS_SHARDING_DECLS) | {
        MemberShardingKind.REPLICATED} == set(MemberShardingKind)
    bloom, _ = load_family("bloom", builtin=True)
    by_name = {g.name.text: g for g in bloom.groups}
    embeddings = by_name["embedding"].module_sharding
    assert embeddings == BalancedShardingDecl(axis=0) and not embeddings.partitions
    assert by_name["embedding_norm"].module_sharding == ReplicatedShardingDecl()
    with pytest.raises(dataclasses.FrozenInstanceError):
        embeddings.axis = 1  # type: ignore[misc, union-attr]
    gpt_oss, _ = load_family("gpt_oss", builtin=True)
    experts = next(g for g in gpt_oss.groups if g.name.text == "layers.{unit}.experts")
    rules = [m.sharding for m in experts.members]
    assert rules[:3] == [PartitionedShardingDecl(axis=2), PartitionedShardingDecl(axis=1),
                         PartitionedShardingDecl(axis=1)]
    assert all(rule is not None and rule.partitions for rule in rules[:3])
    assert not hasattr(ReplicatedShardingDecl(), "axis"), "a replicated rule has no axis"
