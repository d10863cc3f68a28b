"""The `parallel` vocabulary: every invariant, every builder, every realization rule (DESIGN §3)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partc.api import plan_family
from partc.cli.main import main
from partc.errors import ParallelPlanError, ParallelPlanErrorKind
from partc.parallel.layout import (
    LocalModelLayout,
    LocalTensorLayout,
    ParallelModelInfo,
    ParameterRole,
)
from partc.parallel.placements import (
    LOCAL,
    OMIT,
    PLACEMENT_KINDS,
    REPLICATED,
    Indices,
    Local,
    Omit,
    PipelineStage,
    Range,
    Rank,
    Replicated,
    Shard,
    TensorPlacement,
    placement_from_compact,
    placement_from_json,
    tensor_bytes,
)
from partc.parallel.specs import (
    SHARDING_CLASSES,
    BalancedSharding,
    EqualSharding,
    LinearWeightLayout,
    MemberSharding,
    MemberShardingKind,
    ParameterGroupSpec,
    ParameterMemberSpec,
    PartitionedSegmentsSharding,
    PartitionedSharding,
    Projection,
    ProjectionSharding,
    ReplicatedSharding,
    SegmentedSharding,
    ShardingPolicy,
    aligned_partition_units,
    balanced_contiguous_range,
    member_sharding,
    module_parameter_group,
    partitioned_module_parameter_group,
    partitioned_projection_group,
    projection_parameter_group,
    reduced_partition_units,
    segmented_projection_group,
    with_policy,
)
from partc.plan.tensor_split import group_sharding_problems, realize_group
from partc.plan.topology import Topology

from support import ROOT, hf, reassemble

CASES = ROOT / "tests" / "cases"
ROLE = ParameterRole.ATTENTION_HEADS


def member(target: str, shape: tuple[int, ...], sharding: MemberSharding | None = None,
           **kw: object) -> ParameterMemberSpec:
    return ParameterMemberSpec(target=target, shape=shape,
                               sharding=sharding or ReplicatedSharding(), **kw)


def group(*members: ParameterMemberSpec, units: int | None = None, **kw: object
          ) -> ParameterGroupSpec:
    return ParameterGroupSpec(name="g", role=ROLE, members=members, units=units, **kw)


def raises(message: str):
    """pytest.raises for a ParallelPlanError whose message contains `message` verbatim."""
    return pytest.raises(ParallelPlanError, match=_escape(message))


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def selections(layouts) -> list[tuple[int | None, tuple[tuple[int, int], ...]]]:
    return [layout.selection for layout in layouts]


# ---------------------------------------------------------------- MemberSharding


def test_balanced_contiguous_range_gives_the_first_parts_one_extra_item():
    assert [balanced_contiguous_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8),
                                                                      (8, 10)]
    assert [balanced_contiguous_range(2, 3, i) for i in range(3)] == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: member_sharding(MemberShardingKind.REPLICATED, axis=0),
     "replicated sharding takes no axis"),
    (lambda: member_sharding(MemberShardingKind.EQUAL), "equal sharding needs axis"),
    (lambda: member_sharding(MemberShardingKind.SEGMENTED, axis=0),
     "segmented sharding needs segments"),
    (lambda: EqualSharding(axis=None), "equal sharding needs an axis >= 0, found None"),
    (lambda: BalancedSharding(axis=-1), "balanced sharding needs an axis >= 0, found -1"),
    (lambda: PartitionedSegmentsSharding(axis=0, segments=()),
     "partitioned_segments sharding needs positive segment widths, found []"),
    (lambda: SegmentedSharding(axis=0, segments=(4, 0)),
     "segmented sharding needs positive segment widths, found [4, 0]"),
    (lambda: member_sharding(MemberShardingKind.PARTITIONED, axis=0, segments=(2, 2)),
     "partitioned sharding takes no segments"),
    (lambda: EqualSharding(axis=0, granule=0),
     "a sharding granule must be a positive integer, found 0"),
    (lambda: PartitionedSegmentsSharding(axis=0, segments=(32, 24), granule=16),
     "partitioned_segments sharding: segments [32, 24] do not all fall on 16-element granule "
     "boundaries"),
])
def test_a_malformed_member_sharding_is_rejected_with_its_rule(build, message):
    with raises(message) as info:
        build()
    assert info.value.kind is ParallelPlanErrorKind.INVALID_TENSOR


def test_member_sharding_describes_itself_for_messages():
    assert ReplicatedSharding().describe() == "replicated"
    assert EqualSharding(axis=1).describe() == "equal(axis 1)"
    assert (PartitionedSegmentsSharding(axis=0, segments=(8, 4, 4), granule=4).describe()
            == "partitioned_segments(axis 0, segments [8, 4, 4], granule 4)")
    assert PartitionedSharding(axis=0).is_partitioned
    assert not SegmentedSharding(axis=0, segments=(2, 2)).is_partitioned


def test_member_sharding_is_one_class_per_kind_holding_only_its_own_fields():
    assert sorted(k.value for k in SHARDING_CLASSES) == sorted(k.value for k in MemberShardingKind)
    assert all(cls.kind is kind for kind, cls in SHARDING_CLASSES.items())
    fields = {kind.value: [f.name for f in dataclasses.fields(cls)]
              for kind, cls in SHARDING_CLASSES.items()}
    assert fields == {"replicated": [], "equal": ["axis", "granule"],
                      "balanced": ["axis", "granule"], "partitioned": ["axis", "granule"],
                      "partitioned_segments": ["axis", "segments", "granule", "groups"],
                      "segmented": ["axis", "segments", "granule"]}
    with pytest.raises(TypeError):
        ReplicatedSharding(axis=0)  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EqualSharding(axis=0).axis = 1  # type: ignore[misc]
    assert member_sharding(MemberShardingKind.SEGMENTED, axis=1, segments=[2, 2]) == \
        SegmentedSharding(axis=1, segments=(2, 2))


# ---------------------------------------------------------------- ParameterMemberSpec


@pytest.mark.parametrize(("build", "message"), [
    (lambda: member("", (4,)), "a member needs a non-empty target name"),
    (lambda: member("w", (4, -1)),
     "`w` has shape [4, -1]; every dimension must be a non-negative integer"),
    (lambda: member("w", (4,), dtype="F12"), "`w` has unknown dtype 'F12'; expected one of BF16,"),
    (lambda: member("w", (4,), linear=LinearWeightLayout.OUT_IN),
     "`w` is marked as a linear weight but has shape [4]; a linear weight has at least 2 "
     "dimensions"),
    (lambda: member("w", (4,), EqualSharding(axis=1)),
     "`w` is equal(axis 1) but has only 1 dimension(s) (shape [4])"),
    (lambda: member("w", (12, 4), PartitionedSegmentsSharding(axis=0, segments=(4, 4))),
     "`w`: segments [4, 4] sum to 8 but axis 0 has 12 elements; segments must be contiguous, "
     "ordered and cover the fused width"),
    (lambda: member("w", (24, 4), PartitionedSharding(axis=0, granule=16)),
     "`w` is partitioned(axis 0, granule 16) but axis 0 has 24 elements, not a whole number of "
     "16-element blocks; a partitioned axis must be block-aligned"),
    (lambda: member("w", (4,), heads=(2,)),
     "`w` declares heads [2] but is replicated; `heads` only applies to partitioned members"),
    (lambda: member("w", (4, 4), EqualSharding(axis=0), heads=(2,)),
     "`w` declares heads [2] but is equal(axis 0); `heads` only applies to partitioned members"),
    (lambda: member("w", (8, 4), PartitionedSegmentsSharding(axis=0, segments=(4, 4)), heads=(2,)),
     "`w` declares 1 head count(s) [2] for 2 segment(s); give one count per segment"),
    (lambda: member("w", (12, 4), PartitionedSharding(axis=0), heads=(5,)),
     "`w`: 12 elements on axis 0 cannot hold 5 whole heads; the width must be a positive "
     "multiple of the head count"),
])
def test_a_malformed_member_is_rejected_naming_its_target_and_numbers(build, message):
    with raises(message) as info:
        build()
    assert info.value.kind is ParallelPlanErrorKind.INVALID_TENSOR


def test_an_encoded_companion_may_hold_fractional_heads():
    scale = member("s", (6, 2), PartitionedSharding(axis=0), heads=(4,),
                   encoding="block_fp8.scale")
    assert scale.widths == (6,)
    assert member("w", (3, 8), dtype="U32").nbytes == 96
    assert member("f", (3, 8), dtype="F8_E4M3").nbytes == 24


# ---------------------------------------------------------------- ParameterGroupSpec


def test_group_invariants_name_members_targets_and_units():
    col = member("q", (8, 4), PartitionedSharding(axis=0))
    with raises("a parameter group needs a non-empty name"):
        ParameterGroupSpec(name="", role=ROLE, members=(col,), units=2)
    with raises("group `g` has no members; it needs at least one"):
        group()
    with raises("group `g` lists target `q` twice; each tensor belongs to a group once") as info:
        group(col, col, units=2)
    assert (info.value.kind, info.value.group, info.value.target) == (
        ParallelPlanErrorKind.INVALID_GROUP, "g", "q")
    with raises("group `g` has partitioned member `q` but declares no partition units; add "
                "`units`"):
        group(col)
    with raises("group `g` declares 2 partition units but no member is partitioned; drop `units` "
                "or partition a member"):
        group(member("n", (4,)), units=2)
    with raises("group `g` has 0 partition units; at least 1 is required"):
        group(col, units=0)


def test_a_unit_count_that_does_not_divide_a_partitioned_width_is_rejected():
    with raises("group `g`: axis 0 of `q` has 8 elements, which cannot be cut into the group's 3 "
                "partition units (heads); use a unit count dividing 8") as info:
        group(member("q", (8, 4), PartitionedSharding(axis=0)), units=3, units_label="heads")
    assert info.value.kind is ParallelPlanErrorKind.INVALID_TENSOR
    with raises("group `g`: a segment of `qkv` has 4 elements, which cannot be cut into the "
                "group's 8 partition units"):
        group(member("qkv", (12, 4), PartitionedSegmentsSharding(axis=0, segments=(8, 4))), units=8)
    with raises("group `g`: axis 0 of `w` has 32 elements, which cannot be cut into the group's "
                "4 partition units of 16-element blocks; use a unit count dividing 2"):
        group(member("w", (32, 4), PartitionedSharding(axis=0, granule=16)), units=4)


def test_head_counts_must_be_whole_multiples_of_the_units():
    with raises("group `g`: `q` has 2 heads, not a multiple of the group's 4 partition units, so "
                "a unit boundary would cut a head"):
        group(member("q", (8, 4), PartitionedSharding(axis=0), heads=(2,)), units=4)


def test_kv_replication_needs_the_head_count_of_every_partitioned_member():
    q = member("q", (8, 4), PartitionedSharding(axis=0), heads=(4,))
    k = member("k", (4, 4), PartitionedSharding(axis=0))
    with raises("group `g` sets kv_replication but `k` declares no `heads`; KV replication needs "
                "the head count of every partitioned projection (`heads:` in YAML)") as info:
        group(q, k, units=2, kv_replication=True)
    assert info.value.target == "k"
    with raises("group `g` sets kv_replication but no member is partitioned"):
        group(member("n", (4,)), kv_replication=True)


# ---------------------------------------------------------------- builders


def test_module_parameter_group_applies_one_rule_to_every_parameter():
    g = module_parameter_group("emb", ParameterRole.VOCABULARY, "model.embed_tokens",
                               {"weight": [131, 64]}, BalancedSharding(axis=0), dtype="BF16")
    assert g.targets == ("model.embed_tokens.weight",)
    assert g.members[0].sharding == BalancedSharding(axis=0)
    assert (g.units, g.members[0].dtype, g.members[0].linear) == (None, "BF16", None)


def test_partitioned_module_parameter_group_shares_one_partition():
    g = partitioned_module_parameter_group("sinks", ROLE, "attn", {"sinks": [4], "w": [4, 2]},
                                           0, 2, units_label="kv")
    assert [m.sharding for m in g.members] == [PartitionedSharding(axis=0)] * 2
    assert (g.units, g.units_label) == (2, "kv")


def test_projection_parameter_group_splits_columns_and_rows_and_marks_the_weight_linear():
    col = projection_parameter_group("c", ParameterRole.COLUMN_PROJECTION, "m",
                                     ProjectionSharding.COLUMN,
                                     {"weight": [8, 4], "bias": [8], "scalar": []})
    assert [m.sharding for m in col.members] == [EqualSharding(axis=0), EqualSharding(axis=0),
                                                 ReplicatedSharding()]
    assert col.members[0].linear is LinearWeightLayout.OUT_IN and col.members[1].linear is None
    row = projection_parameter_group("r", ParameterRole.ROW_PROJECTION, "m",
                                     ProjectionSharding.ROW, {"weight": [4, 8], "bias": [4]},
                                     linear=False)
    assert [m.sharding for m in row.members] == [EqualSharding(axis=1),
                                                 ReplicatedSharding()]
    assert row.members[0].linear is None


def test_partitioned_projection_group_reduces_units_by_gcd_with_every_dimension_and_head():
    g = partitioned_projection_group("mlp", ParameterRole.FEED_FORWARD_INTERMEDIATE, [
        ("gate", ProjectionSharding.COLUMN, {"weight": [12, 8]}),
        ("down", ProjectionSharding.ROW, {"weight": [8, 12], "bias": [8]}),
    ], 24, units_label="intermediate_size")
    assert g.units == 12
    assert g.units_label == "gcd(intermediate_size, ...) = 12"
    assert [m.sharding.describe() for m in g.members] == [
        "partitioned(axis 0)", "partitioned(axis 1)", "replicated"]
    heads = partitioned_projection_group("a", ROLE, [
        Projection(module="q", sharding=ProjectionSharding.COLUMN, params={"weight": [64, 8]},
                   heads=4),
        Projection(module="k", sharding=ProjectionSharding.COLUMN, params={"weight": [32, 8]},
                   heads=2),
    ], 8, kv_replication=True)
    assert heads.units == 2 and heads.kv_replication
    assert [m.heads for m in heads.members] == [(4,), (2,)]
    replicated = partitioned_projection_group("r", ROLE, [
        ("n", ProjectionSharding.REPLICATED, {"weight": [8]})], 4)
    assert replicated.units is None


def test_segmented_projection_group_maps_one_partition_into_every_segment():
    g = segmented_projection_group(
        "attn", ROLE, fused_module="qkv_proj", segments=[64, 32, 32],
        fused_params={"weight": [128, 64], "weight_scale_inv": [8, 4], "bias": [128]},
        output_module="o_proj", output_params={"weight": [64, 64], "bias": [64]}, units=2,
        units_label="num_key_value_heads", fused_heads=[4, 2, 2], output_heads=4)
    rules = {m.target: m.sharding for m in g.members}
    assert rules["qkv_proj.weight"] == PartitionedSegmentsSharding(axis=0, segments=(64, 32, 32))
    assert rules["qkv_proj.weight_scale_inv"] == PartitionedSegmentsSharding(axis=0,
                                                                             segments=(4, 2, 2))
    assert rules["o_proj.weight"] == PartitionedSharding(axis=1)
    assert rules["o_proj.bias"] == ReplicatedSharding()
    assert (g.units, g.units_label) == (2, "num_key_value_heads")
    ranks = realize_group(g, 2)
    assert ranks[1][0].placement.ranges == ((32, 64), (80, 96), (112, 128))
    assert ranks[1][1].placement.ranges == ((2, 4), (5, 6), (7, 8))
    assert ranks[1][3].selection == (1, ((32, 64),))


@pytest.mark.parametrize(("segments", "params", "heads", "message"), [
    ([64, 0], {"weight": [64, 8]}, (), "group `attn`: segments must be positive widths, found "
     "[64, 0]"),
    ([4, 4], {"weight": [8, 8]}, (2,), "group `attn`: 1 head counts [2] for 2 segments; give "
     "one per segment"),
    ([8, 8], {"weight": [16, 8], "s": [3, 1]}, (), "group `attn`: fused companion `qkv.s` has 3 "
     "rows, which cannot carry the segments [8, 8] (16 rows) at a whole divisor; every companion "
     "of the fused weight must hold the same segments, scaled by its block size"),
    ([8, 8], {"weight": [12, 8]}, (), "`qkv.weight`: segments [8, 8] sum to 16 but axis 0 has 12 "
     "elements"),
])
def test_segmented_projection_group_rejects_bad_segments(segments, params, heads, message):
    with raises(message):
        segmented_projection_group("attn", ROLE, fused_module="qkv", segments=segments,
                                   fused_params=params, output_module="o",
                                   output_params={"weight": [8, 8]}, units=2, fused_heads=heads)


def test_aligned_partition_units_groups_whole_semantic_units_on_alignment_boundaries():
    assert aligned_partition_units("mlp", 96, 1, 32) == 3
    assert aligned_partition_units("attn", 8, 24, 16) == 4
    assert aligned_partition_units("attn", 8, 128, 128) == 8
    with raises("group `attn`: 3 units of 24 elements cannot be cut on 16-element boundaries; a "
                "legal cut needs whole groups of 2 units, which 3 is not a multiple of"):
        aligned_partition_units("attn", 3, 24, 16)
    with raises("group `x`: semantic units (0), elements per unit (1) and alignment (4) must all "
                "be positive"):
        aligned_partition_units("x", 0, 1, 4)


# ---------------------------------------------------------------- realization


def test_equal_shards_balanced_ranges_and_tp_one_locals():
    g = group(member("e", (8, 4), EqualSharding(axis=0)),
              member("b", (10, 4), BalancedSharding(axis=0)), member("n", (4,)))
    ranks = realize_group(g, 4)
    assert [r[0].placement for r in ranks] == [
        Shard(axis=0, index=i, parts=4) for i in range(4)]
    assert [r[1].selection for r in ranks] == [(0, ((0, 3),)), (0, ((3, 6),)), (0, ((6, 8),)),
                                               (0, ((8, 10),))]
    assert [r[1].local_shape for r in ranks] == [(3, 4), (3, 4), (2, 4), (2, 4)]
    assert {r[2].placement for r in ranks} == {REPLICATED}
    assert realize_group(g, 1)[0][0].placement == LOCAL


def test_balanced_ranges_with_a_granule_stay_on_block_boundaries_and_clip_the_last():
    g = group(member("w", (131, 64), BalancedSharding(axis=0, granule=16)))
    assert [r[0].selection for r in realize_group(g, 4)] == [
        (0, ((0, 48),)), (0, ((48, 80),)), (0, ((80, 112),)), (0, ((112, 131),))]


def test_partitioned_members_take_the_balanced_unit_range_on_their_axis():
    g = group(member("q", (12, 8), PartitionedSharding(axis=0)),
              member("o", (8, 12), PartitionedSharding(axis=1)), units=3, units_label="heads")
    ranks = realize_group(g, 2)
    assert [(r[0].selection, r[1].selection) for r in ranks] == [
        ((0, ((0, 8),)), (1, ((0, 8),))), ((0, ((8, 12),)), (1, ((8, 12),)))]
    assert [(r[0].logical_units, r[0].logical_range) for r in ranks] == [(3, (0, 2)), (3, (2, 3))]
    assert realize_group(g, 1)[0][0].logical_range == (0, 3)


def test_segmented_members_split_each_segment_on_its_own():
    g = group(member("gu", (16, 4), SegmentedSharding(axis=0, segments=(8, 8))))
    assert [r[0].selection for r in realize_group(g, 2)] == [(0, ((0, 4), (8, 12))),
                                                             (0, ((4, 8), (12, 16)))]


def test_indices_of_adjacent_segments_are_stored_compactly():
    g = group(member("w", (8, 4), PartitionedSegmentsSharding(axis=0, segments=(4, 4))), units=1)
    assert realize_group(g, 1)[0][0].placement == LOCAL
    g2 = group(member("w", (8, 4), PartitionedSegmentsSharding(axis=0, segments=(4, 2, 2))),
               units=2)
    assert realize_group(g2, 2)[0][0].placement.ranges == ((0, 2), (4, 5), (6, 7))


@pytest.mark.parametrize(("members", "units", "tp", "problem"), [
    ((member("e", (6, 4), EqualSharding(axis=0)),), None, 4,
     "`e`: axis 0 has 6 elements, not divisible into 4 equal shards of whole elements"),
    ((member("e", (64, 4), EqualSharding(axis=0, granule=32)),), None, 4,
     "`e`: axis 0 has 64 elements, not divisible into 4 equal shards of whole 32-element blocks"),
    ((member("b", (3, 4), BalancedSharding(axis=0)),), None, 4,
     "`b`: axis 0 has 3 elements, fewer than tensor_parallel_size 4 (balanced ranges)"),
    ((member("s", (12, 4), SegmentedSharding(axis=0, segments=(6, 6))),), None, 4,
     "`s`: segments [6, 6] are not each divisible into 4 shards of whole elements"),
    ((member("q", (8, 4), PartitionedSharding(axis=0)),), 2, 4,
     "it (role attention_heads) has 2 partition units (kv) but tensor_parallel_size is 4: every "
     "rank needs at least one unit; use a tensor_parallel_size of at most 2 (or set "
     "`kv_replication: true` with `heads:` on its projections to repeat KV heads, see "
     "`partc docs kv_replication`)"),
])
def test_an_illegal_shard_is_rejected_under_require_with_the_numbers_and_the_fix(members, units,
                                                                                  tp, problem):
    g = group(*members, units=units, units_label="kv")
    assert group_sharding_problems(g, tp) == [problem]
    with raises(f"group `g` cannot be sharded over tensor_parallel_size {tp}: {problem}. Use a "
                "tensor-parallel size the group allows, or set `policy: replicate_unsupported` "
                "on group `g` (CLI: --policy replicate-unsupported) to replicate it") as info:
        realize_group(g, tp)
    assert info.value.kind is ParallelPlanErrorKind.INVALID_GROUP
    assert info.value.group == "g"


def test_replicate_unsupported_replicates_the_whole_group_and_records_the_fallback():
    g = group(member("q", (8, 4), PartitionedSharding(axis=0)),
              member("n", (4,)), units=2)
    ranks = realize_group(g, 4, ShardingPolicy.REPLICATE_UNSUPPORTED)
    assert all(t.placement == REPLICATED and t.fell_back_to_replication
               and t.logical_units is None and t.logical_range is None
               for r in ranks for t in r)
    legal = realize_group(g, 2, ShardingPolicy.REPLICATE_UNSUPPORTED)
    assert not legal[0][0].fell_back_to_replication


def test_a_group_policy_wins_over_the_topology_policy():
    g = with_policy(group(member("q", (8, 4), PartitionedSharding(axis=0)), units=2),
                    ShardingPolicy.REPLICATE_UNSUPPORTED)
    assert realize_group(g, 4, ShardingPolicy.REQUIRE)[0][0].fell_back_to_replication
    strict = with_policy(g, ShardingPolicy.REQUIRE)
    with raises("has 2 partition units"):
        realize_group(strict, 4, ShardingPolicy.REPLICATE_UNSUPPORTED)
    with raises("tensor_parallel_size must be a positive integer, found 0"):
        realize_group(g, 0)


# ---------------------------------------------------------------- KV replication


def gqa(heads: int, kv_heads: int, head_dim: int, hidden: int = 8, *, granule: int = 1,
        fused: bool = False) -> ParameterGroupSpec:
    """A GQA attention group partitioned by KV heads, with heads hints and KV replication."""
    q, kv = heads * head_dim, kv_heads * head_dim
    out = member("o", (hidden, q), PartitionedSharding(axis=1, granule=granule),
                 heads=(heads,))
    if fused:
        members = (member("qkv", (q + 2 * kv, hidden), PartitionedSegmentsSharding(axis=
            0, segments=(q, kv, kv), granule=granule), heads=(heads, kv_heads, kv_heads)), out)
    else:
        members = tuple(member(n, (w, hidden), PartitionedSharding(axis=0, granule=granule),
                               heads=(h,))
                        for n, w, h in (("q", q, heads), ("k", kv, kv_heads),
                                        ("v", kv, kv_heads))) + (out,)
    return group(*members, units=reduced_partition_units(kv_heads, members), kv_replication=True)


def test_kv_replication_splits_query_heads_and_repeats_the_kv_head_each_rank_attends_to():
    ranks = realize_group(gqa(4, 2, 16), 4)
    table = [(r[0].selection[1], r[1].selection[1], r[2].selection[1], r[3].selection[1],
              r[1].kv_replicas, r[0].kv_replicas, r[0].logical_units, r[0].logical_range)
             for r in ranks]
    assert table == [
        (((0, 16),), ((0, 16),), ((0, 16),), ((0, 16),), 2, 1, 4, (0, 1)),
        (((16, 32),), ((0, 16),), ((0, 16),), ((16, 32),), 2, 1, 4, (1, 2)),
        (((32, 48),), ((16, 32),), ((16, 32),), ((32, 48),), 2, 1, 4, (2, 3)),
        (((48, 64),), ((16, 32),), ((16, 32),), ((48, 64),), 2, 1, 4, (3, 4)),
    ]


def test_kv_replication_follows_vllm_for_every_legal_size():
    heads, kv_heads, head_dim = 32, 8, 4
    for tp in (8, 16, 32):
        ranks = realize_group(gqa(heads, kv_heads, head_dim), tp)
        for t, layouts in enumerate(ranks):
            per_rank = heads // tp
            kv = t * kv_heads // tp
            assert layouts[0].selection == (0, ((t * per_rank * head_dim,
                                                 (t + 1) * per_rank * head_dim),))
            assert layouts[1].selection == (0, ((kv * head_dim, (kv + 1) * head_dim),))
            assert layouts[3].selection == (1, ((t * per_rank * head_dim,
                                                 (t + 1) * per_rank * head_dim),))
            assert layouts[1].kv_replicas == tp // kv_heads
            first_q_head = t * per_rank
            assert first_q_head // (heads // kv_heads) == kv  # its q heads attend to kv head kv


def test_kv_replication_of_a_fused_qkv_projection_takes_slices_of_every_segment():
    ranks = realize_group(gqa(4, 2, 16, fused=True), 4)
    assert [r[0].selection[1] for r in ranks] == [
        ((0, 16), (64, 80), (96, 112)), ((16, 32), (64, 80), (96, 112)),
        ((32, 48), (80, 96), (112, 128)), ((48, 64), (80, 96), (112, 128))]
    assert ranks[0][0].kv_replicas == 2


def test_without_more_ranks_than_units_kv_replication_is_an_ordinary_partition():
    ranks = realize_group(gqa(4, 2, 16), 2)
    assert [r[1].selection for r in ranks] == [(0, ((0, 16),)), (0, ((16, 32),))]
    assert [(r[0].logical_units, r[0].logical_range, r[1].kv_replicas) for r in ranks] == [
        (2, (0, 1), 1), (2, (1, 2), 1)]


@pytest.mark.parametrize(("tp", "problems"), [
    (3, ["it has 2 partition units, fewer than 3 ranks, so KV replication applies and `q` has 4 "
         "query heads, not divisible by tensor_parallel_size 3",
         "`k` has 2 KV heads and tensor_parallel_size 3 is not a multiple of 2",
         "`v` has 2 KV heads and tensor_parallel_size 3 is not a multiple of 2",
         "`o` has 4 query heads, not divisible by tensor_parallel_size 3",
         "KV replication (vLLM's rule) needs tensor_parallel_size to divide the query head count "
         "and to be a multiple of the KV head count"]),
    (8, ["it has 2 partition units, fewer than 8 ranks, so KV replication applies and `q` has 4 "
         "query heads, not divisible by tensor_parallel_size 8",
         "`o` has 4 query heads, not divisible by tensor_parallel_size 8",
         "KV replication (vLLM's rule) needs tensor_parallel_size to divide the query head count "
         "and to be a multiple of the KV head count"]),
])
def test_kv_replication_outside_vllms_rule_names_every_member_and_count(tp, problems):
    assert group_sharding_problems(gqa(4, 2, 16), tp) == problems


def test_kv_replication_must_keep_block_aligned_cuts():
    assert group_sharding_problems(gqa(4, 2, 16, granule=32), 4) == [
        "it has 1 partition units, fewer than 4 ranks, so KV replication applies and `q`: "
        "splitting its 4 heads over 4 ranks cuts its 64 elements into pieces that are not whole "
        "32-element blocks",
        "`k`: one of its 2 KV heads spans 32/2 elements, not whole 32-element blocks, so it "
        "cannot be repeated",
        "`v`: one of its 2 KV heads spans 32/2 elements, not whole 32-element blocks, so it "
        "cannot be repeated",
        "`o`: splitting its 4 heads over 4 ranks cuts its 64 elements into pieces that are not "
        "whole 32-element blocks"]
    assert group_sharding_problems(gqa(4, 2, 16, granule=16), 4) == []


# ---------------------------------------------------------------- placements and layouts


@pytest.mark.parametrize(("build", "kind"), [
    (lambda: Shard(axis=0, index=2, parts=2), "shard"),
    (lambda: Shard(axis=-1, index=0, parts=2), "shard"),
    (lambda: Range(axis=0, start=3, end=3), "range"),
    (lambda: Range(axis=0, start=True, end=3), "range"),
    (lambda: Indices(axis=0, ranges=()), "indices"),
    (lambda: Indices(axis=0, ranges=((0, 2), (2, 4))), "indices"),
    (lambda: Indices(axis=0, ranges=((4, 6), (0, 2))), "indices"),
    (lambda: Indices(axis=0, ranges=((0, 2.5),)), "indices"),
    (lambda: Rank(rank=-1), "rank"),
    (lambda: PipelineStage(stage="1"), "pipeline_stage"),
])
def test_a_malformed_placement_is_rejected(build, kind):
    with raises(f"malformed {kind} placement"):
        build()


@pytest.mark.parametrize(("data", "message"), [
    ({"kind": "pipeline_stage"}, "malformed pipeline_stage placement {'kind': 'pipeline_stage'}: "
     "expected the fields ['stage']"),
    ({"kind": "replicated", "axis": 0}, "malformed replicated placement {'kind': 'replicated', "
     "'axis': 0}: expected the fields []"),
    ({"kind": "range", "axis": 0, "start": 0, "end": 2, "ranges": [[0, 2]]},
     "malformed range placement"),
    ({"kind": "sideways"}, "unknown placement kind 'sideways' in {'kind': 'sideways'}; known: "
     "replicated, local, omit, rank, pipeline_stage, shard, range, indices"),
    ({"kind": "indices", "axis": 0, "ranges": [[0, 1, 2]]}, "malformed indices placement"),
])
def test_placement_json_with_missing_or_foreign_fields_is_rejected(data, message):
    with raises(message):
        placement_from_json(data)


def test_compact_placements_of_the_wrong_length_are_rejected():
    with raises("malformed shard placement ['shard', 0, 1]"):
        placement_from_compact(("shard", 0, 1))
    with raises("unknown placement kind None in []"):
        placement_from_compact(())


def test_placements_round_trip_through_json_and_compact_forms_and_select_their_ranges():
    placements = [REPLICATED, LOCAL, OMIT, Rank(rank=3), PipelineStage(stage=1),
                  Shard(axis=1, index=1, parts=4), Range(axis=0, start=2, end=5),
                  Indices(axis=0, ranges=((0, 2), (4, 6)))]
    assert [p.kind for p in placements] == list(PLACEMENT_KINDS)
    assert all(PLACEMENT_KINDS[p.kind] is type(p) for p in placements)
    for placement in placements:
        assert placement_from_json(json.loads(json.dumps(placement.to_json()))) == placement
        assert placement_from_compact(json.loads(json.dumps(placement.to_compact()))) == placement
    assert placements[5].selection((3, 8)) == (1, ((2, 4),))
    assert placements[7].to_json() == {"kind": "indices", "axis": 0, "ranges": [[0, 2], [4, 6]]}
    assert placements[7].to_compact() == ("indices", 0, ((0, 2), (4, 6)))
    assert placements[3].to_json() == {"kind": "rank", "rank": 3}
    assert placements[6].to_compact() == ("range", 0, 2, 5)
    assert placements[3].selection((3, 8)) == (None, ())
    assert [p.holds_whole for p in placements] == [True, True, False, True, True, False, False,
                                                   False]
    assert Replicated() != Local() and len({Replicated(), Local(), Omit()}) == 3
    assert not any(hasattr(p, "__dict__") for p in placements)  # slotted, frozen values
    with pytest.raises(dataclasses.FrozenInstanceError):
        placements[5].index = 0  # type: ignore[misc]


def layout(target: str, placement: TensorPlacement = LOCAL, shape=(8, 4), local=None,
           dtype: str = "F32", **kw) -> LocalTensorLayout:
    return LocalTensorLayout(target=target, logical_name="g", role=ROLE, dtype=dtype,
                             global_shape=shape, local_shape=local or shape, placement=placement,
                             **kw)


def test_local_tensor_layout_checks_its_shape_against_its_placement():
    shard = Shard(axis=0, index=0, parts=3)
    with raises("`w`: placement {'kind': 'shard', 'axis': 0, 'index': 0, 'parts': 3} does not fit "
                "global shape [8, 4]"):
        layout("w", shard, local=(2, 4))
    with raises("`w`: local shape [3, 4] does not match placement {'kind': 'range', 'axis': 0, "
                "'start': 0, 'end': 2} (expected [2, 4])"):
        layout("w", Range(axis=0, start=0, end=2),
               local=(3, 4))
    with raises("`w`: local shape [8] and global shape [8, 4] differ in rank"):
        layout("w", local=(8,))
    with raises("`w`: logical range (0, 3) does not fit 2 logical units"):
        layout("w", logical_units=2, logical_range=(0, 3))
    with raises("`w`: kv_replicas must be >= 1, found 0"):
        layout("w", kv_replicas=0)
    assert layout("w", dtype="U32").local_bytes == 128


def test_local_model_layout_is_sorted_by_target_and_rejects_duplicates():
    model = LocalModelLayout(tensors=(layout("b"), layout("a", dtype="F8_E4M3"),
                                      layout("c", Range(axis=0, start=0, end=4),
                                             local=(4, 4), dtype="U8")))
    assert model.targets == ("a", "b", "c")
    assert model["b"].target == "b" and "c" in model and "z" not in model and len(model) == 3
    assert model.local_bytes == 32 + 128 + 16
    assert model.pinned_bytes == 32 + 128
    assert model.bytes_by_dtype == (("F32", 128), ("F8_E4M3", 32), ("U8", 16))
    with raises("layout lists `a` twice (groups `g` and `g`)"):
        LocalModelLayout(tensors=(layout("a"), layout("a")))


def test_parallel_model_info_accounts_bytes_exactly_per_dtype():
    ranks = [LocalModelLayout(tensors=(layout("w", Range(
        axis=0, start=a, end=b), local=(b - a, 4), dtype="U32"),
        layout("n", REPLICATED, shape=(4,), dtype="BF16"))) for a, b in ((0, 5), (5, 8))]
    info = ParallelModelInfo.from_layouts(model_type="llama", tensor_parallel_size=2,
                                          pipeline_parallel_size=1, rank=1, layouts=ranks,
                                          global_parameter_bytes=8 * 4 * 4 + 8)
    assert (info.local_parameter_bytes, info.pinned_parameter_bytes,
            info.maximum_device_parameter_bytes, info.owned_tensors) == (56, 8, 88, 2)
    assert info.local_bytes_by_dtype == (("BF16", 8), ("U32", 48))
    assert (info.tensor_parallel_rank, info.pipeline_stage) == (1, 0)
    base = dict(model_type="x", tensor_parallel_size=2, pipeline_parallel_size=2, rank=3,
                tensor_parallel_rank=1, pipeline_stage=1, owned_tensors=1,
                local_parameter_bytes=10, global_parameter_bytes=40, pinned_parameter_bytes=4,
                maximum_device_parameter_bytes=12)
    ParallelModelInfo(**base)
    for change, message in [
        ({"tensor_parallel_size": 0}, "topology sizes must be positive, found "
                                      "tensor_parallel_size 0 and pipeline_parallel_size 2"),
        ({"tensor_parallel_rank": 2}, "tensor_parallel_rank 2 / stage 1 outside a 2 x 2 "
                                      "topology"),
        ({"rank": 2}, "rank 2 is not stage 1 * 2 + 1"),
        ({"pinned_parameter_bytes": 11}, "rank 3: byte accounting must satisfy 0 <= pinned (11) "
                                         "<= local (10) <= maximum (12)"),
        ({"local_bytes_by_dtype": (("F32", 9),)}, "rank 3: bytes by dtype (('F32', 9),) do not "
                                                  "add up to 10"),
    ]:
        with raises(message):
            ParallelModelInfo(**{**base, **change})


def test_tensor_bytes_counts_packed_and_fp8_dtypes_exactly():
    assert tensor_bytes("U32", (131, 8)) == 4192
    assert tensor_bytes("F8_E4M3", (24, 64)) == 1536
    assert tensor_bytes("U8", (4, 192, 2, 16)) == 24576
    assert tensor_bytes("BF16", ()) == 2


# ---------------------------------------------------------------- properties


def _read(full: np.ndarray, selection) -> np.ndarray:
    axis, ranges = selection
    if axis is None:
        return full
    return np.concatenate([np.take(full, np.arange(a, b), axis=axis) for a, b in ranges],
                          axis=axis)


def _reassemble_and_count(spec: ParameterMemberSpec, layouts):
    full = np.arange(int(np.prod(spec.shape)), dtype=np.int64).reshape(spec.shape)
    pieces = []
    for item in layouts:
        local = _read(full, item.selection)
        assert local.shape == item.local_shape
        pieces.append((local, *item.selection))
    whole, count = reassemble(pieces, tuple(spec.shape), np.dtype(np.int64))
    return full, whole, count


@st.composite
def random_groups(draw):
    units = draw(st.integers(1, 12))
    members = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(list(MemberShardingKind)))
        granule = draw(st.sampled_from([1, 1, 2, 4]))
        ndim = draw(st.integers(1, 3))
        axis = draw(st.integers(0, ndim - 1))
        shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
        segments: list[int] = []
        if kind is MemberShardingKind.REPLICATED:
            rule = ReplicatedSharding()
            granule = 1
        elif kind is MemberShardingKind.EQUAL:
            shape[axis] = draw(st.integers(1, 48))
            rule = EqualSharding(axis=axis, granule=granule)
        elif kind is MemberShardingKind.BALANCED:
            shape[axis] = draw(st.integers(1, 48))
            rule = BalancedSharding(axis=axis, granule=granule)
        elif kind is MemberShardingKind.PARTITIONED:
            shape[axis] = units * granule * draw(st.integers(1, 4))
            rule = PartitionedSharding(axis=axis, granule=granule)
        else:
            per_unit = units if kind is MemberShardingKind.PARTITIONED_SEGMENTS else 1
            segments = [per_unit * granule * draw(st.integers(1, 4))
                        for _ in range(draw(st.integers(1, 4)))]
            shape[axis] = sum(segments)
            rule = SHARDING_CLASSES[kind](axis=axis, segments=tuple(segments), granule=granule)
        members.append(member(f"m{i}", tuple(shape), rule))
    partitioned = any(m.sharding.is_partitioned for m in members)
    return group(*members, units=units if partitioned else None)


def _check_realization(g: ParameterGroupSpec, tp: int) -> None:
    problems = group_sharding_problems(g, tp)
    if problems:
        with pytest.raises(ParallelPlanError):
            realize_group(g, tp)
        fallback = realize_group(g, tp, ShardingPolicy.REPLICATE_UNSUPPORTED)
        assert all(t.fell_back_to_replication and t.placement == REPLICATED
                   for r in fallback for t in r)
        return
    ranks = realize_group(g, tp)
    assert len(ranks) == tp
    for r in ranks:  # logical ranges of the members of one group agree on a rank
        assert len({(t.logical_units, t.logical_range) for t in r}) == 1
    if g.units is not None:
        ranges = [r[0].logical_range for r in ranks]
        units = ranks[0][0].logical_units
        assert ranges[0][0] == 0 and ranges[-1][1] == units
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    for index, spec in enumerate(g.members):
        layouts = [r[index] for r in ranks]
        full, whole, count = _reassemble_and_count(spec, layouts)
        assert (count >= 1).all(), spec.target  # every element is loaded by some rank
        np.testing.assert_array_equal(whole, full)  # ... from its own place
        if isinstance(spec.sharding, ReplicatedSharding) or tp == 1:
            assert (count == tp).all()
        elif any(t.kv_replicas > 1 for t in layouts):
            assert count.max() == max(t.kv_replicas for t in layouts)
        else:
            assert (count == 1).all(), spec.target  # owned by exactly one rank
        granule = 1 if isinstance(spec.sharding, ReplicatedSharding) else spec.sharding.granule
        for item in layouts:
            axis, ranges = item.selection
            if axis is not None:
                assert all(a % granule == 0 and (b % granule == 0 or b == spec.shape[axis])
                           for a, b in ranges)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=random_groups(), tp=st.integers(1, 16))
def test_realized_slices_of_every_rank_reassemble_every_tensor_exactly(g, tp):
    _check_realization(g, tp)


@st.composite
def gqa_groups(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8]))
    return gqa(heads, kv_heads, draw(st.sampled_from([1, 2, 4])), fused=draw(st.booleans()))


@settings(max_examples=200, deadline=None)
@given(g=gqa_groups(), tp=st.integers(1, 16))
def test_kv_replicated_groups_reassemble_and_keep_each_rank_on_its_kv_head(g, tp):
    _check_realization(g, tp)
    if group_sharding_problems(g, tp) or g.units is None or g.units >= tp:
        return
    heads = max(h for m in g.members for h in m.heads)
    kv_heads = min(h for m in g.members for h in m.heads)
    for t, r in enumerate(realize_group(g, tp)):
        assert r[0].logical_range == (t, t + 1)
        first_query_head = t * heads // tp
        assert first_query_head // (heads // kv_heads) == t * kv_heads // tp


# ---------------------------------------------------------------- YAML, end to end


def _family_copy(tmp_path: Path, name: str, edit=None) -> Path:
    text = (CASES / name / "family.yaml").read_text()
    if edit is not None:
        text = edit(text)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_the_kv_replication_family_gives_each_rank_the_slices_vllm_gives_it():
    plan = plan_family(CASES / "llama" / "family.yaml", hf("llama") / "config.json",
                       Topology(tensor_parallel_size=4, pipeline_parallel_size=1),
                       checkpoint=hf("llama"))
    p = "model.layers.1.self_attn."
    table = []
    for rank in plan.ranks:
        lay = rank.layout
        table.append((lay[p + "q_proj.weight"].selection, lay[p + "k_proj.weight"].selection,
                      lay[p + "v_proj.weight"].selection, lay[p + "o_proj.weight"].selection,
                      lay[p + "k_proj.weight"].kv_replicas))
    assert table == [
        ((0, ((0, 16),)), (0, ((0, 16),)), (0, ((0, 16),)), (1, ((0, 16),)), 2),
        ((0, ((16, 32),)), (0, ((0, 16),)), (0, ((0, 16),)), (1, ((16, 32),)), 2),
        ((0, ((32, 48),)), (0, ((16, 32),)), (0, ((16, 32),)), (1, ((32, 48),)), 2),
        ((0, ((48, 64),)), (0, ((16, 32),)), (0, ((16, 32),)), (1, ((48, 64),)), 2),
    ]
    mlp = [r.layout["model.layers.0.mlp.down_proj.weight"].selection for r in plan.ranks]
    assert mlp == [(1, ((32 * t, 32 * t + 32),)) for t in range(4)]


def test_the_kv_replicated_tiny_llama_at_tp_4_reproduces_the_reference_logits(tmp_path):
    from partc.runtime._engine.reader import read_tensor
    from partc.runtime._engine.selection import TensorSelection
    from partc.runtime.checkpoint import open_checkpoint

    from executor import RankShard, Selection, forward_tensor_parallel

    plan = plan_family(CASES / "llama" / "family.yaml", hf("llama") / "config.json",
                       Topology(tensor_parallel_size=4, pipeline_parallel_size=1))
    checkpoint = open_checkpoint(hf("llama"))
    shards = []
    for rank in plan.ranks:
        tensors, sel = {}, {}
        for item in rank.layout.tensors:
            axis, ranges = item.selection
            tensors[item.target] = read_tensor(checkpoint, item.target,
                                               TensorSelection(axis=axis, ranges=ranges))
            sel[item.target] = None if axis is None else Selection(axis, ranges)
        shards.append(RankShard(tensors, sel))
    config = json.loads((hf("llama") / "config.json").read_text())
    reference = np.load(hf("llama") / "reference.npz")
    result = forward_tensor_parallel(config, shards, reference["input_ids"])
    np.testing.assert_allclose(result.logits, reference["logits"], atol=1e-4)


def test_without_kv_replication_the_attention_group_follows_its_yaml_policy(tmp_path):
    family = _family_copy(tmp_path, "llama", lambda t: t.replace(
        "    kv_replication: true\n", "    policy: replicate_unsupported\n"))
    plan = plan_family(family, hf("llama") / "config.json",
                       Topology(tensor_parallel_size=4, pipeline_parallel_size=1))
    lay = plan.ranks[2].layout
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert (q.placement, q.fell_back_to_replication, q.logical_units) == (REPLICATED, True, None)
    down = lay["model.layers.0.mlp.down_proj.weight"]
    assert (down.selection, down.fell_back_to_replication) == ((1, ((64, 96),)), False)


def test_without_kv_replication_or_a_policy_the_plan_is_rejected_at_the_group_line(tmp_path):
    family = _family_copy(tmp_path, "llama", lambda t: t.replace(
        "    kv_replication: true\n", ""))
    with pytest.raises(ParallelPlanError) as info:
        plan_family(family, hf("llama") / "config.json",
                    Topology(tensor_parallel_size=4, pipeline_parallel_size=1))
    error = info.value
    assert str(error).startswith(
        f"{family}:59:5: group `layers.0.attention` cannot be sharded over tensor_parallel_size "
        "4: it (role attention_heads) has 2 partition units (num_key_value_heads) but "
        "tensor_parallel_size is 4")
    assert error.pointer == "/parameters/2"


def test_the_global_policy_replicates_every_illegal_group(tmp_path, capsys):
    family = _family_copy(tmp_path, "llama", lambda t: t.replace(
        "    kv_replication: true\n", ""))
    out = tmp_path / "build"
    code = main(["compile", str(family), "--config", str(hf("llama") / "config.json"),
                 "--tp", "4", "--policy", "replicate-unsupported", "--out", str(out)])
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    tensors = {t["target"]: t for t in plan["tensors"]}
    groups = {g["name"]: g for g in plan["groups"]}
    k_proj = tensors["model.layers.0.self_attn.k_proj.weight"]
    assert groups[k_proj["group"]]["fell_back_to_replication"] is True
    assert k_proj["placements"][1] == ["replicated"]
    assert tensors["model.layers.0.mlp.up_proj.weight"]["placements"][1] == ["range", 0, 32, 64]


@pytest.mark.parametrize(("edit", "message", "line"), [
    # a split attention projection without `heads:` is refused by the family checks, at the
    # projection, before KV replication would need its head count
    (lambda t: t.replace("        heads: num_key_value_heads\n", "", 1),
     "this `attention_heads` group splits `model.layers.{unit}.self_attn.k_proj` (column) over "
     "`units: num_key_value_heads` but it states no `heads:`", 71),
    (lambda t: t.replace("        heads: num_key_value_heads\n", "        heads: 3\n", 1),
     "`model.layers.0.self_attn.k_proj.weight`: 32 elements on axis 0 cannot hold 3 whole heads",
     59),
    (lambda t: t.replace("heads: num_attention_heads\n", "heads: num_atention_heads\n", 1),
     "`heads` uses unknown name `num_atention_heads`; did you mean `num_attention_heads`?", 67),
])
def test_known_kv_replication_mistakes_are_reported_at_their_yaml_line(tmp_path, edit, message,
                                                                       line):
    from partc.errors import PartcError

    family = _family_copy(tmp_path, "llama", edit)
    with pytest.raises(PartcError) as info:
        plan_family(family, hf("llama") / "config.json",
                    Topology(tensor_parallel_size=4, pipeline_parallel_size=1))
    assert message in info.value.message
    assert info.value.location.line == line

