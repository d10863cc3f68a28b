"""Pipeline boundary wire schemas: resolution, role-tagged encode/decode, and refusals."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import partc.plan.topology
import partc.runtime
from partc.errors import (
    ArchitectureBoundaryError,
    ArchitectureBoundaryErrorKind,
    BoundaryPayloadError,
)
from partc.partition.boundary import (
    BatchDimension,
    BoundaryTensorDimensionKind,
    BoundaryTensorDtype,
    BoundaryTensorSpec,
    BoundaryWireSchema,
    FixedDimension,
    NoAuxiliaryBoundarySchema,
    PipelineActivationDtype,
    PipelineWireContract,
    RequestDimension,
    SequenceDimension,
    boundary_dimension,
)
from partc.runtime.boundary_codec import (
    ArchitectureBoundary,
    ArchitectureBoundaryValue,
    NoAuxiliaryBoundary,
    boundary_for,
    validate_boundary_tensor_count,
)

from support import compile_and_import, hf

BK = ArchitectureBoundaryErrorKind
B, S = BatchDimension(), SequenceDimension()


def F(size):
    return FixedDimension(size=size)

ACT, U32, I32 = (BoundaryTensorDtype.ACTIVATION, BoundaryTensorDtype.UINT32,
                 BoundaryTensorDtype.INT32)
BF16 = PipelineActivationDtype.BFLOAT16


def spec(role, shape, dtype=ACT):
    return BoundaryTensorSpec(role=role, shape=tuple(shape), dtype=dtype)


RESIDUAL_SCHEMA = BoundaryWireSchema(
    identity="toy.residual", primary=spec("hidden", [B, S, F(8)]),
    auxiliary=(spec("residual", [B, S, F(8)]), spec("positions", [B, S], I32),
               spec("expert_counts", [F(4)], U32)))


def residual_boundary(dtype=BF16):
    return ArchitectureBoundary(contract=PipelineWireContract(schema=RESIDUAL_SCHEMA,
                                                              activation_dtype=dtype))


def payload(batch=2, sequence=5, dtype=ml_dtypes.bfloat16):
    rng = np.random.default_rng(0)
    return dict(
        hidden=rng.standard_normal((batch, sequence, 8)).astype(dtype),
        residual=rng.standard_normal((batch, sequence, 8)).astype(dtype),
        positions=np.arange(batch * sequence, dtype=np.int32).reshape(batch, sequence),
        expert_counts=np.array([3, 0, 7, 1], dtype=np.uint32))


# ---------------------------------------------------------------- schema validation


SCHEMA_MISTAKES = [
    (lambda: F(0), "a fixed boundary dimension must be positive, found 0"),
    (lambda: F(-3), "a fixed boundary dimension must be positive, found -3"),
    (lambda: RequestDimension(name="batch"), "a per-request boundary dimension needs a name "
                                             "other than batch and sequence, found 'batch'"),
    (lambda: RequestDimension(name=""), "a per-request boundary dimension needs a name other "
                                        "than batch and sequence, found ''"),
    (lambda: spec("", [B]), "a boundary tensor needs a non-empty role"),
    (lambda: spec("hidden", []), "boundary tensor `hidden` needs a non-empty shape"),
    (lambda: BoundaryWireSchema(identity=" ", primary=spec("hidden", [B])),
     "a boundary schema needs a non-empty identity"),
    (lambda: BoundaryWireSchema(identity="x", primary=spec("ids", [B, S], I32)),
     "the primary boundary tensor `ids` of `x` must have dtype activation, found int32"),
    (lambda: BoundaryWireSchema(identity="x", primary=spec("hidden", [B]),
                                auxiliary=(spec("mask", [B]), spec("mask", [B], U32))),
     "boundary `x` uses role `mask` twice; roles must be unique"),
    (lambda: BoundaryWireSchema(identity="x", primary=spec("hidden", [B]),
                                auxiliary=(spec("hidden", [B]),)),
     "boundary `x` uses role `hidden` twice; roles must be unique"),
    (lambda: NoAuxiliaryBoundarySchema(hidden_size=0),
     "a hidden-state boundary needs hidden_size >= 1, found 0"),
    (lambda: NoAuxiliaryBoundary(contract=PipelineWireContract(schema=RESIDUAL_SCHEMA,
                                                               activation_dtype=BF16)),
     "boundary `toy.residual` carries auxiliary tensors (residual, positions, expert_counts); a "
     "no-auxiliary boundary carries the primary activation alone"),
]


@pytest.mark.parametrize(("build", "message"), SCHEMA_MISTAKES, ids=[m for _, m in SCHEMA_MISTAKES])
def test_every_schema_mistake_is_refused_with_its_message(build, message):
    with pytest.raises(ArchitectureBoundaryError) as caught:
        build()
    assert caught.value.kind is BK.INVALID_SCHEMA
    assert caught.value.message == message
    assert caught.value.stage == "family"


def test_a_boundary_dimension_is_one_class_per_kind_holding_only_its_own_field():
    dims = [B, S, F(8), RequestDimension(name="patches")]
    assert [d.kind for d in dims] == list(BoundaryTensorDimensionKind)
    assert [[f.name for f in dataclasses.fields(d)] for d in dims] == [[], [], ["size"], ["name"]]
    assert [d.spell() for d in dims] == ["batch", "sequence", 8, "patches"]
    assert [boundary_dimension(d.spell()) for d in dims] == dims
    with pytest.raises(TypeError):
        BatchDimension(size=4)  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        F(8).size = 9  # type: ignore[misc]


def test_schema_json_round_trips():
    assert BoundaryWireSchema.from_json(RESIDUAL_SCHEMA.to_json()) == RESIDUAL_SCHEMA
    assert RESIDUAL_SCHEMA.to_json()["auxiliary"][1] == {"role": "positions",
                                                         "shape": ["batch", "sequence"],
                                                         "dtype": "int32"}


def test_pipeline_activation_dtype_moved_to_the_boundary_vocabulary_and_plan_still_has_it():
    assert partc.plan.topology.PipelineActivationDtype is PipelineActivationDtype
    assert [d.value for d in PipelineActivationDtype] == ["float16", "bfloat16", "float32"]


# ---------------------------------------------------------------- resolution


@pytest.mark.parametrize(("activation", "numpy_dtype"), [
    (PipelineActivationDtype.FLOAT16, np.dtype(np.float16)),
    (PipelineActivationDtype.BFLOAT16, np.dtype(ml_dtypes.bfloat16)),
    (PipelineActivationDtype.FLOAT32, np.dtype(np.float32)),
])
def test_resolve_gives_concrete_shapes_and_numpy_dtypes(activation, numpy_dtype):
    resolved = RESIDUAL_SCHEMA.resolve(3, 7, activation_dtype=activation)
    assert resolved.identity == "toy.residual"
    assert resolved.roles == ("hidden", "residual", "positions", "expert_counts")
    assert [t.shape for t in resolved.tensors] == [(3, 7, 8), (3, 7, 8), (3, 7), (4,)]
    assert [t.numpy_dtype for t in resolved.tensors] == [
        numpy_dtype, numpy_dtype, np.dtype(np.int32), np.dtype(np.uint32)]
    assert resolved.activation_dtype is activation
    width = numpy_dtype.itemsize
    assert resolved.nbytes == 2 * 3 * 7 * 8 * width + 3 * 7 * 4 + 4 * 4


def test_resolve_each_takes_one_sequence_length_per_tensor_in_wire_order_or_by_role():
    contract = PipelineWireContract(schema=RESIDUAL_SCHEMA, activation_dtype=BF16)
    by_order = contract.resolve_each(2, [5, 9, 5, 1])
    by_role = contract.resolve_each(2, {"hidden": 5, "residual": 9, "positions": 5})
    assert by_order == by_role
    assert [t.shape for t in by_role.tensors] == [(2, 5, 8), (2, 9, 8), (2, 5), (4,)]


@pytest.mark.parametrize(("arguments", "message"), [
    ((0, 5), "boundary `toy.residual` needs a positive batch and sequence length; found batch 0"),
    ((2, 0), "boundary `toy.residual` needs a positive batch and sequence length; found batch 2, "
             "sequence 0 for `hidden`, sequence 0 for `residual`, sequence 0 for `positions`, "
             "sequence 0 for `expert_counts`"),
])
def test_resolve_refuses_non_positive_geometry(arguments, message):
    with pytest.raises(ArchitectureBoundaryError) as caught:
        RESIDUAL_SCHEMA.resolve(*arguments, activation_dtype=BF16)
    assert caught.value.kind is BK.INVALID_GEOMETRY
    assert caught.value.message == message


@pytest.mark.parametrize(("sequences", "message"), [
    ([5, 5], "boundary `toy.residual` carries 4 tensors (hidden, residual, positions, "
             "expert_counts) but 2 sequence lengths were given"),
    ({"hidden": 5, "residual": 5, "positions": 5, "mask": 5},
     "boundary `toy.residual` sequence lengths must be keyed by its roles (hidden, residual, "
     "positions, expert_counts): unknown role(s) `mask`"),
    ({"hidden": 5}, "boundary `toy.residual` sequence lengths must be keyed by its roles (hidden, "
                    "residual, positions, expert_counts): no length for `residual`, `positions`"),
])
def test_resolve_each_refuses_lengths_that_do_not_match_the_roles(sequences, message):
    with pytest.raises(ArchitectureBoundaryError) as caught:
        RESIDUAL_SCHEMA.resolve_each(2, sequences, activation_dtype=BF16)
    assert caught.value.kind is BK.INVALID_GEOMETRY
    assert caught.value.message == message


# ---------------------------------------------------------------- encode / decode


def test_encode_tags_every_tensor_with_its_role_and_decode_returns_them_by_role():
    boundary = residual_boundary()
    tensors = payload()
    values = boundary.encode(tensors["hidden"], residual=tensors["residual"],
                             positions=tensors["positions"],
                             expert_counts=tensors["expert_counts"])
    assert [v.role for v in values] == ["hidden", "residual", "positions", "expert_counts"]
    decoded = boundary.decode(values)
    assert list(decoded) == ["hidden", "residual", "positions", "expert_counts"]
    for role, array in tensors.items():
        assert decoded[role] is array


def test_keyword_order_does_not_matter_because_roles_are_assigned_by_name():
    boundary = residual_boundary()
    tensors = payload()
    values = boundary.encode(tensors["hidden"], expert_counts=tensors["expert_counts"],
                             positions=tensors["positions"], residual=tensors["residual"])
    assert [v.role for v in values] == ["hidden", "residual", "positions", "expert_counts"]
    assert values[1].tensor is tensors["residual"]


def test_decode_tensors_counts_first_then_tags_untagged_wire_tensors_in_schema_order():
    boundary = residual_boundary()
    tensors = payload()
    decoded = boundary.decode_tensors(list(tensors.values()))
    assert decoded["positions"] is tensors["positions"]
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode_tensors(list(tensors.values())[:3])
    assert caught.value.kind is BK.WRONG_COUNT


def test_a_payload_with_one_tensor_too_few_is_refused_before_decoding():
    boundary = residual_boundary()
    values = boundary.encode_values(payload())
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode(values[:3])
    assert caught.value.kind is BK.WRONG_COUNT
    assert caught.value.message == (
        "boundary `toy.residual` carries 4 tensor(s) (hidden, residual, positions, expert_counts) "
        "but 3 were received")
    assert caught.value.boundary == "toy.residual"
    assert caught.value.stage == "executor"


def test_validate_boundary_tensor_count_accepts_only_the_exact_count():
    validate_boundary_tensor_count(RESIDUAL_SCHEMA, [1, 2, 3, 4])
    with pytest.raises(BoundaryPayloadError, match="but 5 were received"):
        validate_boundary_tensor_count(RESIDUAL_SCHEMA, [1, 2, 3, 4, 5])


def test_a_payload_with_swapped_roles_is_refused_as_out_of_order():
    boundary = residual_boundary()
    values = list(boundary.encode_values(payload()))
    values[1], values[2] = values[2], values[1]
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode(values)
    assert caught.value.kind is BK.WRONG_ROLE
    assert caught.value.role == "positions"
    assert caught.value.message == (
        "boundary `toy.residual` expects `residual` at wire position 1, received `positions` "
        "(wire order: hidden, residual, positions, expert_counts; received: hidden, positions, "
        "residual, expert_counts); the payload has the right roles in the wrong order")


def test_a_payload_with_a_foreign_role_is_refused():
    boundary = residual_boundary()
    values = list(boundary.encode_values(payload()))
    values[3] = ArchitectureBoundaryValue(role="router_logits", tensor=values[3].tensor)
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode(values)
    assert caught.value.kind is BK.WRONG_ROLE
    assert caught.value.message.startswith("boundary `toy.residual` expects `expert_counts` at "
                                           "wire position 3, received `router_logits`")
    assert "wrong order" not in caught.value.message


def test_a_payload_with_a_swapped_dtype_is_refused_naming_the_activation_dtype():
    boundary = residual_boundary()
    tensors = payload()
    tensors["residual"] = tensors["residual"].astype(np.float32)
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.encode_values(tensors)
    assert caught.value.kind is BK.WRONG_DTYPE
    assert caught.value.role == "residual"
    assert caught.value.message == (
        "boundary tensor `residual` of `toy.residual` has dtype float32; expected bfloat16 (the "
        "pipeline activation dtype bfloat16)")


def test_integer_tensors_must_have_their_declared_integer_dtype():
    boundary = residual_boundary()
    values = list(boundary.encode_values(payload()))
    values[2] = ArchitectureBoundaryValue(role="positions",
                                          tensor=values[2].tensor.astype(np.int64))
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode(values)
    assert caught.value.message == ("boundary tensor `positions` of `toy.residual` has dtype "
                                    "int64; expected int32 (declared)")


def test_a_payload_with_a_wrong_sequence_length_is_refused_with_both_shapes():
    boundary = residual_boundary()
    tensors = payload()
    tensors["residual"] = payload(sequence=6)["residual"]
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.encode_values(tensors)
    assert caught.value.kind is BK.WRONG_SHAPE
    assert caught.value.message == (
        "boundary tensor `residual` of `toy.residual` has shape [2, 6, 8]; expected [2, 5, 8] "
        "(declared [batch, sequence, 8])")


@pytest.mark.parametrize("shape", [(5, 8), (1, 2, 5, 8)])
def test_a_tensor_of_another_rank_is_refused_by_its_axis_count_not_a_guessed_shape(shape):
    """Batch and sequence are read from tensors of the declared rank only: a tensor of another
    rank is said to have the wrong number of axes (not to miss a shape [1, 1, 8] it never
    had)."""
    boundary = residual_boundary()
    tensors = payload()
    tensors["hidden"] = np.zeros(shape, dtype=ml_dtypes.bfloat16)
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.encode_values(tensors)
    assert caught.value.kind is BK.WRONG_SHAPE
    assert caught.value.message == (
        f"boundary tensor `hidden` of `toy.residual` has {len(shape)} axes (shape "
        f"{list(shape)}); expected 3: [batch, sequence, 8]")


def test_decode_tensors_refuses_one_tensor_for_the_list_of_received_ones():
    boundary = residual_boundary()
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode_tensors(payload()["hidden"])  # (2, 5, 8): not "2 were received"
    assert caught.value.kind is BK.WRONG_COUNT
    assert caught.value.message.startswith(
        "decode_tensors takes the received tensors of `toy.residual` as a list in wire order (")
    assert caught.value.message.endswith("found one tensor of shape [2, 5, 8]")


def test_a_wrong_fixed_dimension_is_refused():
    boundary = residual_boundary()
    tensors = payload()
    tensors["hidden"] = np.zeros((2, 5, 9), dtype=ml_dtypes.bfloat16)
    with pytest.raises(BoundaryPayloadError, match=r"`hidden` of `toy.residual` has shape "
                                                        r"\[2, 5, 9\]; expected \[2, 5, 8\]"):
        boundary.encode_values(tensors)


def test_per_tensor_sequence_lengths_are_checked_against_an_explicit_resolution():
    boundary = residual_boundary()
    tensors = payload()
    tensors["residual"] = payload(sequence=9)["residual"]
    resolved = boundary.resolve_each(2, {"hidden": 5, "residual": 9, "positions": 5})
    values = boundary.encode_values(tensors, resolved=resolved)
    assert boundary.decode(values, resolved=resolved)["residual"].shape == (2, 9, 8)
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode(values)
    assert caught.value.kind is BK.WRONG_SHAPE


def test_a_resolution_of_another_boundary_is_refused():
    boundary = residual_boundary()
    other = residual_boundary(PipelineActivationDtype.FLOAT32).resolve(2, 5)
    with pytest.raises(ArchitectureBoundaryError) as caught:
        boundary.encode_values(payload(), resolved=other)
    assert caught.value.kind is BK.INVALID_SCHEMA
    assert caught.value.message == (
        "resolved schema `toy.residual` (hidden, residual, positions, expert_counts, float32) does "
        "not belong to boundary `toy.residual` (hidden, residual, positions, expert_counts, "
        "bfloat16)")


@pytest.mark.parametrize(("call", "kind", "message"), [
    (lambda b, t: b.encode(t["hidden"], residual=t["residual"], positions=t["positions"]),
     BK.WRONG_COUNT, "boundary `toy.residual` needs tensor `expert_counts`; encode received "
                     "`hidden`, `residual`, `positions` of hidden, residual, positions, "
                     "expert_counts"),
    (lambda b, t: b.encode(t["hidden"], **{**t, "hidden": None}),
     BK.WRONG_ROLE, "`hidden` is the primary tensor of boundary `toy.residual`; pass it "
                    "positionally, not by keyword"),
    (lambda b, t: b.encode_values({**t, "mask": t["positions"]}),
     BK.WRONG_ROLE, "boundary `toy.residual` has no tensor role `mask`; its roles are hidden, "
                    "residual, positions, expert_counts"),
    (lambda b, t: b.encode_values({**t, "positions": [[0, 1]]}),
     BK.WRONG_SHAPE, "boundary tensor `positions` of `toy.residual` must be an array with a "
                     "shape and a dtype, found list"),
    (lambda b, t: ArchitectureBoundaryValue(role="", tensor=t["hidden"]),
     BK.WRONG_ROLE, "a boundary value needs a non-empty role"),
])
def test_every_encode_mistake_is_refused_with_its_message(call, kind, message):
    with pytest.raises(BoundaryPayloadError) as caught:
        call(residual_boundary(), payload())
    assert caught.value.kind is kind
    assert caught.value.message == message


def test_no_auxiliary_boundary_carries_the_hidden_state_alone():
    schema = NoAuxiliaryBoundarySchema(hidden_size=64, identity="llama.hidden")
    assert schema.wire_schema() == BoundaryWireSchema(
        identity="llama.hidden", primary=BoundaryTensorSpec.primary_activation(64))
    boundary = boundary_for(schema.contract(PipelineActivationDtype.FLOAT16))
    hidden = np.ones((1, 3, 64), dtype=np.float16)
    values = boundary.encode_hidden(hidden)
    assert [v.role for v in values] == ["hidden"]
    assert boundary.decode_hidden(values) is hidden
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode_hidden((*values, ArchitectureBoundaryValue(role="extra", tensor=hidden)))
    assert caught.value.message == ("boundary `llama.hidden` carries 1 tensor(s) (hidden) but 2 "
                                    "were received")
    assert isinstance(boundary, NoAuxiliaryBoundary)
    assert type(boundary_for(residual_boundary().contract)) is ArchitectureBoundary


# ---------------------------------------------------------------- a YAML family with a residual


RESIDUAL_FAMILY = """\
family: residual_llama
model_types: [llama]
config:
  hidden_size: int
  num_hidden_layers: int
  vocab_size: int
graph:
  - {group: decoder, units: num_hidden_layers, path: "model.layers.{unit}", state: true}
static:
  embedding: {stage: first}
  final_norm: {stage: last}
  output: {stage: last}
parameters:
  - name: embedding
    role: vocabulary
    owner: {static: embedding}
    module: model.embed_tokens
    sharding: {balanced: 0}
    params: {weight: [vocab_size, hidden_size]}
  - name: "layers.{unit}.input_layernorm"
    role: replicated
    owner: {unit: decoder}
    module: "model.layers.{unit}.input_layernorm"
    sharding: replicated
    params: {weight: [hidden_size]}
  - name: final_norm
    role: replicated
    owner: {static: final_norm}
    module: model.norm
    sharding: replicated
    params: {weight: [hidden_size]}
  - name: lm_head
    role: vocabulary
    owner: {static: output}
    module: lm_head
    sharding: {balanced: 0}
    params: {weight: [vocab_size, hidden_size]}
boundary:
  identity: residual_llama.hidden
  primary: {role: hidden, shape: [batch, sequence, hidden_size], dtype: activation}
  auxiliary:
    - {role: residual, shape: [batch, sequence, hidden_size], dtype: activation}
    - {role: positions, shape: [batch, sequence], dtype: int32}
"""


@pytest.fixture(scope="module")
def residual_build(tmp_path_factory):
    folder = tmp_path_factory.mktemp("residual")
    family = folder / "residual_llama.yaml"
    family.write_text(RESIDUAL_FAMILY)
    return compile_and_import(family, hf("llama") / "config.json", folder / "build", pp=2,
                              activation_dtype="float16")


def test_a_yaml_family_with_a_residual_round_trips_across_its_generated_stages(residual_build):
    plan, package = residual_build
    first, last = package.rank_module(0), package.rank_module(1)
    assert first.ACTIVATION_DTYPE == "float16"
    assert first.boundary_schema().roles == ("hidden", "residual", "positions")
    hidden = np.full((2, 4, 64), 0.5, dtype=np.float16)
    residual = np.full((2, 4, 64), -1.0, dtype=np.float16)
    positions = np.arange(8, dtype=np.int32).reshape(2, 4)
    values = first.boundary().encode(hidden, residual=residual, positions=positions)
    assert [v.role for v in values] == ["hidden", "residual", "positions"]
    received = last.boundary().decode(values)
    assert list(received) == ["hidden", "residual", "positions"]
    np.testing.assert_array_equal(received["residual"], residual)
    np.testing.assert_array_equal(received["positions"], positions)
    assert last.partition().boundary == first.partition().boundary


def test_a_generated_stage_hands_out_the_runtimes_codec(residual_build):
    _, package = residual_build
    first = package.rank_module(0)
    assert ArchitectureBoundary.__module__ == "partc.runtime.boundary_codec"
    assert type(first.boundary()) is ArchitectureBoundary  # it carries auxiliary tensors
    assert type(partc.runtime.architecture_boundary(first._TABLE)) is ArchitectureBoundary
    assert type(partc.runtime.send_boundary(first)) is ArchitectureBoundary


@pytest.mark.parametrize(("damage", "kind", "message"), [
    (lambda v: v[:2], BK.WRONG_COUNT,
     "boundary `residual_llama.hidden` carries 3 tensor(s) (hidden, residual, positions) but 2 "
     "were received"),
    (lambda v: (v[0], ArchitectureBoundaryValue(role="residual",
                                                tensor=v[1].tensor.astype(np.float32)), v[2]),
     BK.WRONG_DTYPE, "boundary tensor `residual` of `residual_llama.hidden` has dtype float32; "
                     "expected float16 (the pipeline activation dtype float16)"),
    (lambda v: (v[0], v[1], ArchitectureBoundaryValue(role="positions",
                                                      tensor=v[2].tensor[:, :3])),
     BK.WRONG_SHAPE, "boundary tensor `positions` of `residual_llama.hidden` has shape [2, 3]; "
                     "expected [2, 4] (declared [batch, sequence])"),
])
def test_the_generated_stage_refuses_a_damaged_payload(residual_build, damage, kind, message):
    _, package = residual_build
    first, last = package.rank_module(0), package.rank_module(1)
    values = first.boundary().encode(np.zeros((2, 4, 64), dtype=np.float16),
                                     residual=np.zeros((2, 4, 64), dtype=np.float16),
                                     positions=np.zeros((2, 4), dtype=np.int32))
    with pytest.raises(BoundaryPayloadError) as caught:
        last.boundary().decode(damage(values))
    assert caught.value.kind is kind
    assert caught.value.message == message


# ---------------------------------------------------------------- torch tensors


def _torch_payload(batch=2, sequence=5):
    """The numpy payload as torch tensors sharing its memory (bf16 through its bit pattern)."""
    import torch

    def as_torch(array):
        if array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    return {name: as_torch(array) for name, array in payload(batch, sequence).items()}


def test_torch_tensors_cross_a_cut_unconverted_and_are_checked_like_arrays():
    import torch

    boundary = residual_boundary()
    tensors = _torch_payload()
    assert tensors["hidden"].dtype is torch.bfloat16 and tensors["positions"].dtype is torch.int32
    values = boundary.encode_values(tensors)
    assert [v.role for v in values] == ["hidden", "residual", "positions", "expert_counts"]
    assert all(isinstance(v.tensor, torch.Tensor) for v in values)
    decoded = boundary.decode_tensors([v.tensor for v in values])
    assert decoded["hidden"] is tensors["hidden"]
    # the bytes are the numpy payload's, so nothing was converted on the way
    assert np.array_equal(decoded["hidden"].view(torch.uint16).numpy(),
                          payload()["hidden"].view(np.uint16))


def test_a_torch_tensor_of_the_wrong_dtype_or_shape_is_refused_by_name():
    import torch

    boundary = residual_boundary()
    tensors = _torch_payload()
    tensors["residual"] = tensors["residual"].to(torch.float32)
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.encode_values(tensors)
    assert caught.value.kind is BK.WRONG_DTYPE
    assert caught.value.message == (
        "boundary tensor `residual` of `toy.residual` has dtype torch.float32; expected bfloat16 "
        "(the pipeline activation dtype bfloat16)")
    tensors = _torch_payload()
    tensors["positions"] = tensors["positions"].to(torch.int64)
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.encode_values(tensors)
    assert caught.value.message == ("boundary tensor `positions` of `toy.residual` has dtype "
                                    "torch.int64; expected int32 (declared)")
    tensors = _torch_payload()
    tensors["hidden"] = tensors["hidden"][:, :4]
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.encode_values(tensors)
    assert caught.value.kind is BK.WRONG_SHAPE


def test_a_torch_meta_tensor_is_refused_as_having_no_data_on_encode_and_decode():
    # a meta tensor has the right shape and dtype but no values: sending it would fail inside
    # torch.distributed (or send nothing meaningful), so the boundary refuses it by name
    import torch

    boundary = residual_boundary()
    tensors = _torch_payload()
    tensors["residual"] = tensors["residual"].to("meta")
    assert tensors["residual"].is_meta and tensors["residual"].dtype == torch.bfloat16
    ordered = [tensors[role] for role in boundary.schema.roles]
    refusals = []
    for call in (lambda: boundary.encode_values(tensors), lambda: boundary.decode_tensors(ordered)):
        with pytest.raises(BoundaryPayloadError) as caught:
            call()
        refusals.append((caught.value.kind, caught.value.message))
    message = ("boundary tensor `residual` of `toy.residual` is a torch meta tensor (a shape and "
               "dtype, no data); expected the stage's computed values on the CPU or a device")
    assert refusals == [(BK.NO_DATA, message)] * 2, "encode and decode refuse it alike"
    boundary.encode_values(_torch_payload())  # the same tensors with data pass
