"""The `partition` vocabulary: execution graphs, ownership, and pipeline realization."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from partc.api import bind
from partc.errors import (
    ArchitectureParameterError,
    ArchitectureParameterErrorKind,
    ArchitecturePartitionError,
    ArchitecturePartitionErrorKind,
)
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import ParameterGroupSpec, ParameterMemberSpec, ReplicatedSharding
from partc.partition.ownership import (
    OWNER_KINDS,
    ArchitectureParameterDescription,
    ExecutionGraph,
    ExecutionGroupSpec,
    ExecutionUnit,
    OwnedParameterGroupSpec,
    StageSide,
    StaticAnyOf,
    StaticRole,
    StaticRoleSpec,
    UnitRef,
    owner_from_json,
    ownership_errors,
)
from partc.partition.pipeline import (
    ArchitecturePartition,
    PartitionGroup,
    PartitionOwnership,
    PartitionParameterBinding,
    PartitionState,
)
from partc.plan.pipeline_cut import pipeline_stage_ranges, realize_partition, realize_pipeline

from support import FULLSIZE, compile_and_import, hf

PK = ArchitectureParameterErrorKind
AK = ArchitecturePartitionErrorKind
FIRST, LAST = StageSide.FIRST, StageSide.LAST


def group(name: str, targets: list[str] | tuple[str, ...], role=ParameterRole.REPLICATED):
    """A parameter group of replicated 1-element tensors."""
    return ParameterGroupSpec(name=name, role=role, members=tuple(
        ParameterMemberSpec(target=t, shape=(1,), sharding=ReplicatedSharding())
        for t in targets))


def unit_owned(graph_group: str, unit: int, name: str, *targets: str):
    return OwnedParameterGroupSpec(group=group(name, targets),
                                   owner=ExecutionUnit(group=graph_group, unit=unit))


def static_owned(role: str, name: str, *targets: str, role_kind=ParameterRole.REPLICATED):
    return OwnedParameterGroupSpec(group=group(name, targets, role_kind),
                                   owner=StaticRole(role=role))


def layers(group_name: str, count: int, path="model.layers.{}", start=0, state=True, after=()):
    return ExecutionGroupSpec(name=group_name, unit_paths=tuple(
        path.format(start + i) for i in range(count)), carries_state=state, dependencies=after)


LLAMA_ROLES = (StaticRoleSpec(name="embedding", side=FIRST),
               StaticRoleSpec(name="final_norm", side=LAST),
               StaticRoleSpec(name="output", side=LAST))


def decoder_description(units: int, roles=LLAMA_ROLES, extra=()):
    graph = ExecutionGraph(groups=(layers("decoder", units),))
    owned = [unit_owned("decoder", u, f"layers.{u}", f"model.layers.{u}.w") for u in range(units)]
    owned += [static_owned("embedding", "embedding", "model.embed_tokens.weight",
                           role_kind=ParameterRole.VOCABULARY),
              static_owned("final_norm", "final_norm", "model.norm.weight"),
              static_owned("output", "lm_head", "lm_head.weight",
                           role_kind=ParameterRole.VOCABULARY), *extra]
    return ArchitectureParameterDescription(graph=graph, static_roles=roles, groups=tuple(owned))


# ---------------------------------------------------------------- execution graphs


def test_a_chain_of_decoder_then_mtp_lays_out_units_in_canonical_order():
    graph = ExecutionGraph(groups=(layers("mtp", 1, start=61, after=("decoder",)),
                                   layers("decoder", 61)))
    assert [g.name for g in graph.canonical_order()] == ["decoder", "mtp"]
    layout = graph.unit_layout()
    assert len(layout) == graph.total_units == 62
    assert layout[0] == UnitRef("decoder", 0, "model.layers.0")
    assert layout[60] == UnitRef("decoder", 60, "model.layers.60")
    assert layout[61] == UnitRef("mtp", 0, "model.layers.61")
    assert graph.group_range("decoder") == (0, 61)
    assert graph.group_range("mtp") == (61, 62)
    assert graph.state_offset("mtp") == 61


def test_a_dag_of_vision_projector_decoder_orders_by_dependency_not_declaration():
    graph = ExecutionGraph(groups=(
        layers("decoder", 4, after=("projector",)),
        layers("projector", 1, path="multi_modal_projector.{}", state=False,
               after=("vision",)),
        layers("vision", 2, path="vision_tower.layers.{}", state=False)))
    assert [g.name for g in graph.canonical_order()] == ["vision", "projector", "decoder"]
    assert [u.path for u in graph.unit_layout()] == [
        "vision_tower.layers.0", "vision_tower.layers.1", "multi_modal_projector.0",
        "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]
    assert graph.group_range("decoder") == (3, 7)
    assert graph.state_offset("decoder") == 0
    assert graph.state_units == 4


def test_graph_json_round_trips_through_the_plan_spelling():
    data = [{"group": "decoder", "unit_paths": ["a", "b"], "state": True, "after": []},
            {"group": "mtp", "unit_paths": ["c"], "state": True, "after": ["decoder"]}]
    graph = ExecutionGraph.from_json(data)
    assert graph.groups[1] == ExecutionGroupSpec(name="mtp", unit_paths=("c",),
                                                 carries_state=True, dependencies=("decoder",))


GRAPH_MISTAKES = [
    (lambda: ExecutionGraph(groups=()), "the execution graph needs at least one group"),
    (lambda: ExecutionGroupSpec(name="", unit_paths=("a",)),
     "an execution group needs a non-empty name"),
    (lambda: ExecutionGroupSpec(name="decoder", unit_paths=("a", "")),
     "unit 1 of group `decoder` has an empty path"),
    (lambda: ExecutionGroupSpec(name="decoder", unit_paths=("a", "b", "a")),
     "group `decoder` repeats unit path `a` (unit 2); unit paths must be unique"),
    (lambda: ExecutionGroupSpec(name="decoder", unit_paths=("a",), dependencies=("decoder",)),
     "group `decoder` depends on itself"),
    (lambda: ExecutionGraph(groups=(layers("decoder", 1), layers("decoder", 1, start=5))),
     "execution group `decoder` is declared twice"),
    (lambda: ExecutionGraph(groups=(layers("mtp", 1, after=("decoder",)),)),
     "group `mtp` depends on unknown group `decoder`; known: mtp"),
    (lambda: ExecutionGraph(groups=(layers("a", 1, path="a.{}", after=("b",)),
                                    layers("b", 1, path="b.{}", after=("a",)))),
     "execution groups depend on each other in a cycle: a, b"),
    (lambda: ExecutionGraph(groups=(layers("decoder", 2), layers("mtp", 1, start=1))),
     "unit path `model.layers.1` is used by both `decoder` and `mtp`"),
]


@pytest.mark.parametrize(("build", "message"), GRAPH_MISTAKES, ids=[m for _, m in GRAPH_MISTAKES])
def test_every_graph_mistake_is_refused_with_its_message(build, message):
    with pytest.raises(ArchitecturePartitionError) as caught:
        build()
    assert caught.value.kind is AK.INVALID_GRAPH
    assert caught.value.message == message


# ---------------------------------------------------------------- ownership


OWNER_MISTAKES = [
    ({"kind": "execution_unit", "group": "decoder"},
     "malformed execution_unit owner {'kind': 'execution_unit', 'group': 'decoder'}"),
    ({"kind": "static_role", "roles": ["a"], "unit": 1},
     "malformed static_role owner {'kind': 'static_role', 'roles': ['a'], 'unit': 1}"),
    ({"kind": "static_role", "roles": ["a", "b"]},
     "malformed static_role owner {'kind': 'static_role', 'roles': ['a', 'b']}"),
    ({"kind": "static_any_of", "roles": "ab"},
     "malformed static_any_of owner {'kind': 'static_any_of', 'roles': 'ab'}"),
    ({"kind": "execution_unit", "group": "decoder", "unit": True},
     "an execution-unit owner needs a group name and an integer unit, found 'decoder' and True"),
    ({"kind": "everyone"},
     "unknown owner kind 'everyone'; known: static_role, static_any_of, execution_unit"),
]


@pytest.mark.parametrize(("data", "message"), OWNER_MISTAKES)
def test_an_owner_whose_fields_do_not_match_its_kind_is_refused(data, message):
    with pytest.raises(ArchitectureParameterError) as caught:
        owner_from_json(data)
    assert caught.value.kind is PK.INVALID_OWNER
    assert caught.value.message == message


def test_owners_round_trip_through_json_through_their_kind_table():
    owners = [StaticRole(role="embedding"), StaticAnyOf(roles=("output", "embedding")),
              ExecutionUnit(group="decoder", unit=3)]
    assert [type(o) for o in owners] == list(OWNER_KINDS.values())
    assert [o.to_json() for o in owners] == [
        {"kind": "static_role", "roles": ["embedding"]},
        {"kind": "static_any_of", "roles": ["output", "embedding"]},
        {"kind": "execution_unit", "group": "decoder", "unit": 3}]
    assert [owner_from_json(json.loads(json.dumps(o.to_json()))) for o in owners] == owners
    assert [o.static_roles for o in owners] == [("embedding",), ("output", "embedding"), ()]
    assert [o.describe() for o in owners] == [
        "static role `embedding`", "any of `output`, `embedding`", "unit 3 of `decoder`"]
    assert [o.is_local({"decoder": (2, 4)}, ["embedding"]) for o in owners] == [True, True, True]
    assert [o.is_local({"decoder": (0, 3)}, ["output"]) for o in owners] == [False, True, False]


def _description(owned=(), roles=LLAMA_ROLES):
    graph = ExecutionGraph(groups=(layers("decoder", 2),))
    return ArchitectureParameterDescription(graph=graph, static_roles=roles, groups=tuple(owned))


DESCRIPTION_MISTAKES = [
    (PK.DUPLICATE_OWNERSHIP, "layers.1",
     dict(owned=[unit_owned("decoder", 0, "layers.0", "x", "w"),
                 unit_owned("decoder", 1, "layers.1", "w")]),
     "tensor `w` is owned twice: by group `layers.0` and by group `layers.1`"),
    (PK.UNKNOWN_GROUP, "vision.0",
     dict(owned=[unit_owned("vision", 0, "vision.0", "v")]),
     "group `vision.0` is owned by unknown execution group `vision`; known: decoder"),
    (PK.UNIT_OUT_OF_RANGE, "layers.2",
     dict(owned=[unit_owned("decoder", 2, "layers.2", "w")]),
     "group `layers.2` is owned by unit 2 of `decoder`, which has units 0..1"),
    (PK.UNIT_OUT_OF_RANGE, "layers.-1",
     dict(owned=[unit_owned("decoder", -1, "layers.-1", "w")]),
     "group `layers.-1` is owned by unit -1 of `decoder`, which has units 0..1"),
    (PK.EMPTY_STATIC_ROLE, "",
     dict(roles=(StaticRoleSpec(name="", side=FIRST),)),
     "a declared static role has an empty name"),
    (PK.EMPTY_STATIC_ROLE, "tied",
     dict(owned=[OwnedParameterGroupSpec(group=group("tied", ["e"]),
                                         owner=StaticAnyOf(roles=()))]),
     "group `tied` is shared by an empty list of static roles; name at least one consumer role"),
    (PK.EMPTY_STATIC_ROLE, "tied",
     dict(owned=[OwnedParameterGroupSpec(group=group("tied", ["e"]),
                                         owner=StaticAnyOf(roles=("output", "")))]),
     "group `tied` names an empty static role"),
    (PK.REPEATED_STATIC_ROLE, "",
     dict(roles=LLAMA_ROLES + (StaticRoleSpec(name="output", side=FIRST),)),
     "static role `output` is declared twice"),
    (PK.REPEATED_STATIC_ROLE, "tied",
     dict(owned=[OwnedParameterGroupSpec(
         group=group("tied", ["e"]),
         owner=StaticAnyOf(roles=("embedding", "output", "embedding")))]),
     "group `tied` names static role `embedding` twice in ['embedding', 'output', 'embedding']"),
    (PK.UNKNOWN_STATIC_ROLE, "head",
     dict(owned=[static_owned("lm_output", "head", "lm_head.weight")]),
     "group `head` is owned by undeclared static role `lm_output`; declared: embedding, "
     "final_norm, output"),
]


@pytest.mark.parametrize(("kind", "group_name", "inputs", "message"), DESCRIPTION_MISTAKES,
                         ids=[f"{k.value}:{m[:40]}" for k, _, _, m in DESCRIPTION_MISTAKES])
def test_every_ownership_mistake_is_refused_naming_the_group(kind, group_name, inputs, message):
    with pytest.raises(ArchitectureParameterError) as caught:
        _description(**inputs)
    assert caught.value.kind is kind
    assert caught.value.message == message
    assert caught.value.group == group_name


def test_duplicate_ownership_names_the_tensor_as_data():
    with pytest.raises(ArchitectureParameterError) as caught:
        _description([unit_owned("decoder", 0, "a", "w"), unit_owned("decoder", 1, "b", "w")])
    assert caught.value.tensor == "w"


def test_missing_and_unexpected_ownership_are_reported_against_checkpoint_names():
    description = decoder_description(2)
    errors = description.check_targets(["model.layers.0.w", "model.layers.1.w", "lm_head.weight",
                                        "model.norm.weight", "model.rotary.inv_freq"])
    assert [(e.kind, e.tensor, e.message) for e in errors] == [
        (PK.MISSING_OWNERSHIP, "model.rotary.inv_freq",
         "checkpoint tensor `model.rotary.inv_freq` is owned by no parameter group"),
        (PK.UNEXPECTED_OWNERSHIP, "model.embed_tokens.weight",
         "the family declares tensor `model.embed_tokens.weight`, which the checkpoint does not "
         "have"),
    ]
    assert description.check_targets(description.targets) == []


def test_ownership_errors_yields_every_mistake_in_declaration_order():
    graph = ExecutionGraph(groups=(layers("decoder", 1),))
    bad = [unit_owned("decoder", 5, "a", "x"), static_owned("nope", "b", "x"),
           OwnedParameterGroupSpec(group=group("c", ["y"]),
                                   owner=StaticAnyOf(roles=("out", "out")))]
    roles = (StaticRoleSpec(name="out", side=LAST), StaticRoleSpec(name="out", side=FIRST))
    errors = list(ownership_errors(graph, roles, bad))
    assert [(e.kind, e.group) for e in errors] == [
        (PK.REPEATED_STATIC_ROLE, ""), (PK.UNIT_OUT_OF_RANGE, "a"),
        (PK.UNKNOWN_STATIC_ROLE, "b"), (PK.DUPLICATE_OWNERSHIP, "b"),
        (PK.REPEATED_STATIC_ROLE, "c")]
    assert errors[1].message == "group `a` is owned by unit 5 of `decoder`, which has units 0..0"


def test_selection_by_semantic_role_static_role_and_partition():
    tied = OwnedParameterGroupSpec(group=group("embedding", ["model.embed_tokens.weight"],
                                               ParameterRole.VOCABULARY),
                                   owner=StaticAnyOf(roles=("embedding", "output")))
    graph = ExecutionGraph(groups=(layers("decoder", 3),))
    description = ArchitectureParameterDescription(
        graph=graph, static_roles=LLAMA_ROLES, groups=(
            tied, *[unit_owned("decoder", u, f"layers.{u}", f"model.layers.{u}.w")
                    for u in range(3)],
            static_owned("final_norm", "final_norm", "model.norm.weight")))
    assert description.targets_for_role(ParameterRole.VOCABULARY) == ("model.embed_tokens.weight",)
    assert description.targets_for_static_role("output") == ("model.embed_tokens.weight",)
    assert description.targets_for_static_role("final_norm") == ("model.norm.weight",)
    first, last = realize_pipeline(description, 2)
    assert [g.group.name for g in first.owned_groups(description)] == [
        "embedding", "layers.0", "layers.1"]
    assert [g.group.name for g in last.owned_groups(description)] == [
        "embedding", "layers.2", "final_norm"]
    assert first.owned_static_roles(description) == ("embedding",)
    assert last.owned_static_roles(description) == ("embedding", "final_norm")


# ---------------------------------------------------------------- stage ranges


def test_balanced_split_gives_the_first_stages_the_remainder():
    assert pipeline_stage_ranges(62, 8) == ((0, 8), (8, 16), (16, 24), (24, 32), (32, 40),
                                            (40, 48), (48, 55), (55, 62))
    assert pipeline_stage_ranges(3, 1) == ((0, 3),)


def test_explicit_split_is_taken_as_given():
    assert pipeline_stage_ranges(12, 3, [3, 5, 4]) == ((0, 3), (3, 8), (8, 12))


STAGE_MISTAKES = [
    ((3, 0, None), "pipeline_parallel_size must be a positive integer, found 0"),
    ((3, 4, None), "pipeline_parallel_size 4 exceeds the 3 execution units of the model; every "
                   "stage needs at least one unit (use --pp 3 or fewer)"),
    ((12, 2, [3, 5, 4]), "3 explicit stage sizes [3, 5, 4] given for pipeline_parallel_size 2; "
                         "give one per stage"),
    ((12, 3, [6, 0, 6]), "explicit stage sizes [6, 0, 6] give stage 1 0 units; every stage needs "
                         "at least one"),
    ((12, 3, [3, 5, 5]), "explicit stage sizes [3, 5, 5] sum to 13, but the model has 12 "
                         "execution units"),
]


@pytest.mark.parametrize(("arguments", "message"), STAGE_MISTAKES)
def test_every_illegal_stage_split_is_refused_with_its_message(arguments, message):
    with pytest.raises(ArchitecturePartitionError) as caught:
        pipeline_stage_ranges(*arguments)
    assert caught.value.kind is AK.INVALID_STAGES
    assert caught.value.message == message


def test_a_stage_outside_the_pipeline_is_refused():
    with pytest.raises(ArchitecturePartitionError, match=r"stage 2 is outside pipeline stages "
                                                         r"0\.\.1"):
        realize_partition(decoder_description(3), 2, 2)


# ---------------------------------------------------------------- partition checks


def _partition(**changes):
    description = decoder_description(3)
    base = realize_partition(description, 1, 2)
    fields = {f: getattr(base, f) for f in ("graph", "stage", "stages", "canonical_range",
                                            "groups", "ownership", "state",
                                            "parameter_bindings")}
    fields.update(changes)
    return ArchitecturePartition(**fields)


def _binding(owner, *targets, name="g"):
    return PartitionParameterBinding(group=name, owner=owner, targets=targets)


PARTITION_MISTAKES = [
    (AK.UNKNOWN_GROUP, dict(groups=(PartitionGroup(group="vision", unit_range=(0, 1)),)),
     "partition names unknown group `vision`; known: decoder"),
    (AK.DUPLICATE_GROUP, dict(groups=(PartitionGroup(group="decoder", unit_range=(2, 3)),
                                      PartitionGroup(group="decoder", unit_range=(2, 3)))),
     "partition lists group `decoder` twice"),
    (AK.OUT_OF_BOUNDS, dict(groups=(PartitionGroup(group="decoder", unit_range=(2, 4)),)),
     "group `decoder` range [2, 4) exceeds its 3 units"),
    (AK.NON_CANONICAL, dict(canonical_range=(1, 3)),
     "stage 1 declares canonical range [1, 3) but its groups cover [2, 3); a stage holds one "
     "contiguous, non-empty run of the canonical unit order"),
    (AK.NON_CANONICAL, dict(groups=()),
     "stage 1 declares canonical range [2, 3) but its groups cover no units; a stage holds one "
     "contiguous, non-empty run of the canonical unit order"),
    (AK.INVALID_STAGES, dict(stage=2),
     "stage 2 is outside pipeline stages 0..1"),
    (AK.INVALID_STAGES, dict(stages=0, stage=0),
     "pipeline_parallel_size must be a positive integer, found 0"),
    (AK.INVALID_OWNERSHIP, dict(ownership=PartitionOwnership(owns_input=True, owns_output=True,
                                                            static_roles=())),
     "stage 1 of 2 must own the input iff it is the first stage and the output iff it is the "
     "last; found owns_input=True, owns_output=True"),
    (AK.OUT_OF_BOUNDS, dict(state=PartitionState(units=2, global_range=(2, 4))),
     "state range [2, 4) exceeds the 3 state-carrying units of the graph"),
    (AK.NON_LOCAL_OWNER, dict(parameter_bindings=(
        _binding(ExecutionUnit(group="decoder", unit=0), "model.layers.0.w",
                 name="layers.0"),)),
     "stage 1 binds group `layers.0` whose owner (unit 0 of `decoder`) is not local to it"),
    (AK.NON_LOCAL_OWNER, dict(parameter_bindings=(
        _binding(StaticRole(role="embedding"), "e", name="embedding"),)),
     "stage 1 binds group `embedding` whose owner (static role `embedding`) is not local to it"),
    (AK.REPEATED_TARGET, dict(parameter_bindings=(
        _binding(StaticRole(role="output"), "w", name="lm_head"),
        _binding(StaticAnyOf(roles=("final_norm", "embedding")), "w",
                 name="shared"))),
     "stage 1 binds tensor `w` twice: in group `lm_head` and in group `shared`"),
]


@pytest.mark.parametrize(("kind", "changes", "message"), PARTITION_MISTAKES,
                         ids=[f"{k.value}:{m[:30]}" for k, _, m in PARTITION_MISTAKES])
def test_every_inconsistent_partition_is_refused_with_its_message(kind, changes, message):
    with pytest.raises(ArchitecturePartitionError) as caught:
        _partition(**changes)
    assert caught.value.kind is kind
    assert caught.value.message == message


def test_partition_groups_must_follow_the_canonical_order():
    graph = ExecutionGraph(groups=(layers("decoder", 1), layers("mtp", 1, start=1,
                                                                after=("decoder",))))
    with pytest.raises(ArchitecturePartitionError) as caught:
        ArchitecturePartition(
            graph=graph, stage=0, stages=1, canonical_range=(0, 2),
            groups=(PartitionGroup(group="mtp", unit_range=(0, 1)),
                    PartitionGroup(group="decoder", unit_range=(0, 1))),
            ownership=PartitionOwnership(owns_input=True, owns_output=True, static_roles=()),
            state=PartitionState(units=2, global_range=(0, 2)))
    assert caught.value.kind is AK.NON_CANONICAL
    assert caught.value.message == ("partition lists group `decoder` after `mtp`; the canonical "
                                    "order is decoder, mtp")


@pytest.mark.parametrize(("build", "kind", "message"), [
    (lambda: PartitionGroup(group="decoder", unit_range=(2, 2)), AK.EMPTY_RANGE,
     "group `decoder` has empty or negative unit range [2, 2)"),
    (lambda: PartitionGroup(group="decoder", unit_range=(-1, 2)), AK.EMPTY_RANGE,
     "group `decoder` has empty or negative unit range [-1, 2)"),
    (lambda: PartitionState(units=2, global_range=(0, 3)), AK.OUT_OF_BOUNDS,
     "state range [0, 3) does not hold 2 state units"),
    (lambda: PartitionOwnership(owns_input=True, owns_output=False,
                                static_roles=("embedding", "embedding")), AK.INVALID_OWNERSHIP,
     "partition static roles ['embedding', 'embedding'] must be non-empty and distinct"),
])
def test_partition_parts_validate_themselves(build, kind, message):
    with pytest.raises(ArchitecturePartitionError) as caught:
        build()
    assert caught.value.kind is kind
    assert caught.value.message == message


def test_a_partition_round_trips_through_json_with_graph_and_bindings():
    partition = realize_partition(decoder_description(3), 1, 2)
    data = {**partition.to_json(), "graph": [
        {"group": g.name, "unit_paths": list(g.unit_paths), "state": g.carries_state,
         "after": list(g.dependencies)} for g in partition.graph.groups],
        "parameter_bindings": [b.to_json() for b in partition.parameter_bindings]}
    assert ArchitecturePartition.from_json(json.loads(json.dumps(data))) == partition


def test_a_partition_without_a_wire_contract_has_no_boundary_to_offer():
    with pytest.raises(ArchitecturePartitionError) as caught:
        realize_partition(decoder_description(3), 0, 1).wire_contract()
    assert caught.value.kind is AK.MISSING_BOUNDARY
    assert "realized without a pipeline wire contract" in caught.value.message


# ---------------------------------------------------------------- the real tiny Llama


@pytest.fixture(scope="module")
def tiny_llama():
    bound, _, _ = bind("llama", hf("llama") / "config.json")
    return bound.description


def _summary(partition):
    return (partition.canonical_range, [(g.group, g.unit_range) for g in partition.groups],
            partition.ownership.static_roles, partition.state.global_range,
            partition.state.units)


FIRST_ROLES, LAST_ROLES, ALL_ROLES = ("embedding",), ("final_norm", "output"), (
    "embedding", "final_norm", "output")
LLAMA_CASES = [
    (1, None, [((0, 3), [("decoder", (0, 3))], ALL_ROLES, (0, 3), 3)]),
    (2, None, [((0, 2), [("decoder", (0, 2))], FIRST_ROLES, (0, 2), 2),
               ((2, 3), [("decoder", (2, 3))], LAST_ROLES, (2, 3), 1)]),
    (3, None, [((0, 1), [("decoder", (0, 1))], FIRST_ROLES, (0, 1), 1),
               ((1, 2), [("decoder", (1, 2))], (), (1, 2), 1),
               ((2, 3), [("decoder", (2, 3))], LAST_ROLES, (2, 3), 1)]),
    (2, (1, 2), [((0, 1), [("decoder", (0, 1))], FIRST_ROLES, (0, 1), 1),
                 ((1, 3), [("decoder", (1, 3))], LAST_ROLES, (1, 3), 2)]),
    (2, (2, 1), [((0, 2), [("decoder", (0, 2))], FIRST_ROLES, (0, 2), 2),
                 ((2, 3), [("decoder", (2, 3))], LAST_ROLES, (2, 3), 1)]),
    (3, (1, 1, 1), [((0, 1), [("decoder", (0, 1))], FIRST_ROLES, (0, 1), 1),
                    ((1, 2), [("decoder", (1, 2))], (), (1, 2), 1),
                    ((2, 3), [("decoder", (2, 3))], LAST_ROLES, (2, 3), 1)]),
]


@pytest.mark.parametrize(("stages", "explicit", "expected"), LLAMA_CASES)
def test_tiny_llama_stages_hold_exact_units_static_roles_and_state(tiny_llama, stages, explicit,
                                                                   expected):
    partitions = realize_pipeline(tiny_llama, stages, explicit)
    assert [_summary(p) for p in partitions] == expected
    for partition in partitions:
        layer_targets = {t for t in partition.parameter_targets if t.startswith("model.layers.")}
        held = {int(t.split(".")[2]) for t in layer_targets}
        assert held == set(range(*partition.canonical_range))
        assert ("model.embed_tokens.weight" in partition.parameter_targets) == (
            partition.stage == 0)
        assert ("lm_head.weight" in partition.parameter_targets) == (
            partition.stage == stages - 1)


def test_tiny_llama_over_four_stages_is_refused_with_a_clear_message(tiny_llama):
    with pytest.raises(ArchitecturePartitionError) as caught:
        realize_pipeline(tiny_llama, 4)
    assert caught.value.message == (
        "pipeline_parallel_size 4 exceeds the 3 execution units of the model; every stage needs "
        "at least one unit (use --pp 3 or fewer)")


def test_tiny_llama_explicit_split_through_compile_reaches_the_generated_modules(tmp_path):
    plan, package = compile_and_import("llama", hf("llama") / "config.json", tmp_path / "b",
                                       pp=2, stage_units=(1, 2))
    first, last = package.rank_module(0), package.rank_module(1)
    assert first.partition() == plan.ranks[0].partition
    assert last.partition().groups == (PartitionGroup(group="decoder", unit_range=(1, 3)),)
    assert (first.STATE_RANGE, last.STATE_RANGE) == ((0, 1), (1, 3))
    assert last.state() == PartitionState(units=2, global_range=(1, 3))
    assert last.partition().ownership.static_roles == ("final_norm", "output")
    # the wire carries the checkpoint's own dtype (the tiny Llama is float32)
    assert last.partition().boundary.activation_dtype.value == "float32"


def test_tied_embeddings_load_on_both_ends_of_the_pipeline():
    bound, _, _ = bind("llama", hf("llama_tied") / "config.json")
    first, middle, last = realize_pipeline(bound.description, 3)
    assert "model.embed_tokens.weight" in first.parameter_targets
    assert "model.embed_tokens.weight" not in middle.parameter_targets
    assert "model.embed_tokens.weight" in last.parameter_targets
    assert last.owned_static_roles(bound.description) == ("embedding", "final_norm")


# ---------------------------------------------------------------- DeepSeek-V3 through the API


DEEPSEEK_ROLES = LLAMA_ROLES


def deepseek_description(names, layers_count: int, mtp_layers: int):
    """DeepSeek-V3 ownership: decoder units, MTP units after them, and three static roles."""
    graph = ExecutionGraph(groups=(
        layers("decoder", layers_count),
        layers("mtp", mtp_layers, start=layers_count, after=("decoder",))))
    by_layer = defaultdict(list)
    statics = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "final_norm",
               "lm_head.weight": "output"}
    owned = []
    for name in sorted(names):
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match:
            by_layer[int(match.group(1))].append(name)
        else:
            owned.append(static_owned(statics[name], statics[name], name))
    for layer, targets in sorted(by_layer.items()):
        owner = (ExecutionUnit(group="decoder", unit=layer) if layer < layers_count
                 else ExecutionUnit(group="mtp", unit=layer - layers_count))
        owned.append(OwnedParameterGroupSpec(group=group(f"layers.{layer}", targets),
                                             owner=owner))
    return ArchitectureParameterDescription(graph=graph, static_roles=DEEPSEEK_ROLES,
                                            groups=tuple(owned))


MTP_SUFFIXES = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.head.weight",
                "shared_head.norm.weight", "input_layernorm.weight")


@pytest.fixture(scope="module")
def tiny_deepseek():
    config = json.loads((hf("deepseek_v3") / "config.json").read_text())
    with safe_open(str(hf("deepseek_v3") / "model.safetensors"), "np") as handle:
        names = list(handle.keys())
    base = config["num_hidden_layers"]
    mtp = [f"model.layers.{base + i}.{s}" for i in range(config["num_nextn_predict_layers"])
           for s in MTP_SUFFIXES]
    return names, deepseek_description(names + mtp, base, config["num_nextn_predict_layers"])


@pytest.mark.parametrize(("stages", "expected"), [
    (2, [((0, 2), [("decoder", (0, 2))], FIRST_ROLES, (0, 2), 2),
         ((2, 4), [("decoder", (2, 3)), ("mtp", (0, 1))], LAST_ROLES, (2, 4), 2)]),
    (3, [((0, 2), [("decoder", (0, 2))], FIRST_ROLES, (0, 2), 2),
         ((2, 3), [("decoder", (2, 3))], (), (2, 3), 1),
         ((3, 4), [("mtp", (0, 1))], LAST_ROLES, (3, 4), 1)]),
])
def test_tiny_deepseek_puts_the_mtp_unit_after_the_decoder(tiny_deepseek, stages, expected):
    names, description = tiny_deepseek
    partitions = realize_pipeline(description, stages)
    assert [_summary(p) for p in partitions] == expected
    loaded = [t for p in partitions for t in p.parameter_targets]
    assert set(names) <= set(loaded)
    assert len(loaded) == len(set(loaded)), "every tensor is loaded by exactly one stage"
    assert "model.layers.3.eh_proj.weight" in partitions[-1].parameter_targets


@pytest.fixture(scope="module")
def fullsize_deepseek():
    folder = FULLSIZE / "DeepSeek-V3"
    config = json.loads((folder / "config.json").read_text())
    header = json.loads((folder / "safetensors_header.json").read_text())
    names = [n for n in header if n != "__metadata__"]
    return config, names, deepseek_description(names, config["num_hidden_layers"],
                                               config["num_nextn_predict_layers"])


def test_full_size_deepseek_v3_over_eight_stages_gives_mtp_its_own_place_on_the_last_stage(
        fullsize_deepseek):
    config, names, description = fullsize_deepseek
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (61, 1)
    assert description.check_targets(names) == []
    partitions = realize_pipeline(description, 8)
    assert [p.canonical_range for p in partitions] == [
        (0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 48), (48, 55), (55, 62)]
    last = partitions[-1]
    assert [(g.group, g.unit_range) for g in last.groups] == [("decoder", (55, 61)),
                                                             ("mtp", (0, 1))]
    assert [u.path for u in last.units()][-2:] == ["model.layers.60", "model.layers.61"]
    assert last.ownership.static_roles == ("final_norm", "output")
    assert last.state == PartitionState(units=7, global_range=(55, 62))
    assert partitions[0].ownership.static_roles == ("embedding",)
    assert "model.layers.61.shared_head.head.weight" in last.parameter_targets
    loaded = [t for p in partitions for t in p.parameter_targets]
    assert len(loaded) == len(set(loaded)) == len(names) == 91991


# ---------------------------------------------------------------- properties


@st.composite
def architectures(draw):
    """A random DAG of 1-4 groups (0-5 units each), static roles, and owned groups."""
    count = draw(st.integers(1, 4))
    names = [f"g{i}" for i in range(count)]
    units = [draw(st.integers(0, 5)) for _ in names]
    assume(sum(units) >= 1)
    specs = []
    for index, name in enumerate(names):
        after = draw(st.lists(st.sampled_from(names[:index]), unique=True)) if index else []
        specs.append(ExecutionGroupSpec(
            name=name, unit_paths=tuple(f"{name}.{u}" for u in range(units[index])),
            carries_state=draw(st.booleans()), dependencies=tuple(after)))
    graph = ExecutionGraph(groups=tuple(draw(st.permutations(specs))))
    role_names = draw(st.lists(st.sampled_from(["embedding", "final_norm", "output", "vision",
                                                "audio"]), unique=True))
    roles = tuple(StaticRoleSpec(name=r, side=draw(st.sampled_from([FIRST, LAST])))
                  for r in role_names)
    owned = [unit_owned(g.name, u, f"{g.name}.{u}", *[f"{g.name}.{u}.w{k}" for k in range(
        draw(st.integers(1, 2)))]) for g in specs for u in range(g.units)]
    owned += [static_owned(r, f"static.{r}", f"{r}.weight") for r in role_names]
    if role_names:
        consumers = draw(st.lists(st.sampled_from(role_names), min_size=1, unique=True))
        owned.append(OwnedParameterGroupSpec(
            group=group("shared", ["shared.weight"]),
            owner=StaticAnyOf(roles=tuple(consumers))))
    description = ArchitectureParameterDescription(graph=graph, static_roles=roles,
                                                   groups=tuple(owned))
    return description


@st.composite
def pipelines(draw):
    description = draw(architectures())
    total = description.graph.total_units
    stages = draw(st.integers(1, 8))
    explicit = None
    if stages <= total and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=stages - 1,
                                    max_size=stages - 1, unique=True))) if stages > 1 else []
        bounds = [0, *cuts, total]
        explicit = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    return description, stages, explicit


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_any_pipeline_covers_every_unit_once_in_contiguous_stages(case):
    description, stages, explicit = case
    graph = description.graph
    if explicit is None and stages > graph.total_units:
        with pytest.raises(ArchitecturePartitionError) as caught:
            realize_pipeline(description, stages)
        assert caught.value.kind is AK.INVALID_STAGES
        return
    partitions = realize_pipeline(description, stages, explicit)
    order = [g.name for g in graph.canonical_order()]
    for spec in graph.groups:
        assert all(order.index(d) < order.index(spec.name) for d in spec.dependencies)
    # contiguous stages covering every canonical unit exactly once
    assert partitions[0].canonical_range[0] == 0
    assert partitions[-1].canonical_range[1] == graph.total_units
    for before, after in zip(partitions, partitions[1:], strict=False):
        assert before.canonical_range[1] == after.canonical_range[0]
    executed = [u for p in partitions for u in p.units()]
    assert executed == list(graph.unit_layout())
    if explicit is not None:
        assert [p.canonical_range[1] - p.canonical_range[0] for p in partitions] == explicit
    # state ranges tile the state-carrying units in the same order
    assert [r for p in partitions for r in range(*p.state.global_range)] == list(
        range(graph.state_units))
    # static roles land where declared; input and output at the ends
    for partition in partitions:
        expected = sorted(r.name for r in description.static_roles
                          if (r.side is FIRST and partition.stage == 0)
                          or (r.side is LAST and partition.stage == stages - 1))
        assert list(partition.ownership.static_roles) == expected
        assert partition.ownership.owns_input == (partition.stage == 0)
        assert partition.ownership.owns_output == (partition.stage == stages - 1)
    # every target owned by at least one stage, each by exactly one owner
    targets = description.targets
    assert len(targets) == len(set(targets))
    loads: dict[str, list[int]] = defaultdict(list)
    for partition in partitions:
        for target in partition.parameter_targets:
            loads[target].append(partition.stage)
    assert set(loads) == set(targets)
    for owned in description.groups:
        stages_holding = {s for t in owned.group.targets for s in loads[t]}
        owner = owned.owner
        if isinstance(owner, ExecutionUnit):
            assert len(stages_holding) == 1
            (stage,) = stages_holding
            assert partitions[stage].owns_unit(owner.group, owner.unit)
        else:
            assert stages_holding == {p.stage for p in partitions
                                      if set(owner.static_roles) & set(p.ownership.static_roles)}
