"""The layered partition driver: its checks, and how it walks an executor through a stage."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from partc.errors import (
    ArchitectureBoundaryErrorKind,
    ArchitecturePartitionError,
    ArchitecturePartitionErrorKind,
    BoundaryPayloadError,
    LayeredPartitionBeginError,
    LayeredPartitionError,
    LayeredPartitionErrorKind,
)
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import ParameterGroupSpec, ParameterMemberSpec, ReplicatedSharding
from partc.partition.boundary import NoAuxiliaryBoundarySchema, PipelineActivationDtype
from partc.partition.ownership import (
    ArchitectureParameterDescription,
    ExecutionGraph,
    ExecutionGroupSpec,
    ExecutionUnit,
    OwnedParameterGroupSpec,
    StageSide,
    StaticRole,
    StaticRoleSpec,
)
from partc.partition.pipeline import PartitionState
from partc.plan.pipeline_cut import realize_pipeline
from partc.runtime.boundary_codec import boundary_for
from partc.runtime.driver import (
    LayeredPartitionDriver,
    LayeredPartitionExecutor,
    LayeredPartitionInput,
    LayeredUnitExecution,
)

from support import compile_and_import, hf

LK = LayeredPartitionErrorKind
HIDDEN = 8
WIRE = NoAuxiliaryBoundarySchema(hidden_size=HIDDEN, identity="toy.hidden").contract(
    PipelineActivationDtype.BFLOAT16)


def _group(name, *targets):
    return ParameterGroupSpec(name=name, role=ParameterRole.REPLICATED, members=tuple(
        ParameterMemberSpec(target=t, shape=(1,), sharding=ReplicatedSharding())
        for t in targets))


def vision_language_model():
    """vision (2 units) → projector (1) → decoder (4, KV state) → mtp (1, KV state)."""
    graph = ExecutionGraph(groups=(
        ExecutionGroupSpec(name="decoder", unit_paths=tuple(f"model.layers.{i}" for i in range(4)),
                           carries_state=True, dependencies=("projector",)),
        ExecutionGroupSpec(name="mtp", unit_paths=("model.layers.4",), carries_state=True,
                           dependencies=("decoder",)),
        ExecutionGroupSpec(name="projector", unit_paths=("multi_modal_projector",),
                           dependencies=("vision",)),
        ExecutionGroupSpec(name="vision", unit_paths=("vision.layers.0", "vision.layers.1"))))
    owned = [OwnedParameterGroupSpec(group=_group(f"{u.path}", f"{u.path}.weight"),
                                     owner=ExecutionUnit(group=u.group, unit=u.unit))
             for u in graph.unit_layout()]
    owned += [OwnedParameterGroupSpec(group=_group("embedding", "model.embed_tokens.weight"),
                                      owner=StaticRole(role="embedding")),
              OwnedParameterGroupSpec(group=_group("lm_head", "lm_head.weight"),
                                      owner=StaticRole(role="output"))]
    return ArchitectureParameterDescription(
        graph=graph, static_roles=(StaticRoleSpec(name="embedding", side=StageSide.FIRST),
                                   StaticRoleSpec(name="output", side=StageSide.LAST)),
        groups=tuple(owned))


def stages(count=2, explicit=None, boundary=WIRE):
    return realize_pipeline(vision_language_model(), count, explicit, boundary=boundary)


class RecordingExecutor:
    """A toy executor: embeds token ids as constant rows, adds 1 per unit, sums for logits."""

    def __init__(self, hidden=HIDDEN):
        self.hidden = hidden
        self.trace = []

    def begin(self, inputs: LayeredPartitionInput, state: PartitionState):
        if inputs.tokens is not None:
            self.trace.append(("begin", "tokens", state.units))
            return inputs.tokens[..., None].astype(np.float32) * np.ones(self.hidden, np.float32)
        self.trace.append(("begin", tuple(inputs.boundary), state.units))
        return inputs.boundary["hidden"].astype(np.float32)

    def enter_group(self, group, hidden):
        self.trace.append(("enter", group.group, group.unit_range, group.state_range))
        return hidden

    def run_unit(self, unit: LayeredUnitExecution, hidden):
        self.trace.append(("unit", unit.path, unit.state_slot, unit.state_layer))
        return hidden + 1

    def leave_group(self, group, hidden):
        self.trace.append(("leave", group.group))
        return hidden

    def finish(self, hidden, *, project_output):
        self.trace.append(("finish", project_output))
        if project_output:
            return hidden.sum(axis=-1)
        return {"hidden": hidden.astype(ml_dtypes.bfloat16)}


def _executor_is_a_protocol_implementation(executor: LayeredPartitionExecutor[np.ndarray]):
    return executor


# ---------------------------------------------------------------- sequencing


def test_the_driver_walks_groups_and_units_in_canonical_order_with_state_slots():
    first, last = stages()
    tokens = np.array([[1, 2, 3]], dtype=np.int32)
    executor = _executor_is_a_protocol_implementation(RecordingExecutor())
    sent = LayeredPartitionDriver.for_partition(first).run(executor, tokens=tokens)
    assert sent.logits is None
    assert [v.role for v in sent.boundary] == ["hidden"]
    assert executor.trace == [
        ("begin", "tokens", 1),
        ("enter", "vision", (0, 2), None),
        ("unit", "vision.layers.0", None, None), ("unit", "vision.layers.1", None, None),
        ("leave", "vision"),
        ("enter", "projector", (0, 1), None),
        ("unit", "multi_modal_projector", None, None),
        ("leave", "projector"),
        ("enter", "decoder", (0, 1), (0, 1)),
        ("unit", "model.layers.0", 0, 0),
        ("leave", "decoder"),
        ("finish", False)]
    executor = RecordingExecutor()
    result = LayeredPartitionDriver.for_partition(last).run(executor, boundary=sent.boundary)
    assert executor.trace == [
        ("begin", ("hidden",), 4),
        ("enter", "decoder", (1, 4), (1, 4)),
        ("unit", "model.layers.1", 0, 1), ("unit", "model.layers.2", 1, 2),
        ("unit", "model.layers.3", 2, 3),
        ("leave", "decoder"),
        ("enter", "mtp", (0, 1), (4, 5)),
        ("unit", "model.layers.4", 3, 4),
        ("leave", "mtp"),
        ("finish", True)]
    np.testing.assert_array_equal(result.logits, (tokens + 8) * HIDDEN)
    assert result.boundary is None


@pytest.mark.parametrize(("count", "explicit"), [(1, None), (2, None), (3, None), (4, [1, 1, 5, 1]),
                                                 (8, None)])
def test_running_every_stage_in_turn_executes_each_unit_once_in_canonical_order(count, explicit):
    partitions = stages(count, explicit)
    tokens = np.array([[5]], dtype=np.int32)
    executed = []
    payload, output = None, None
    for partition in partitions:
        executor = RecordingExecutor()
        driver = LayeredPartitionDriver.for_partition(partition)
        output = driver.run(executor, **({"tokens": tokens} if payload is None
                                         else {"boundary": payload}))
        payload = output.boundary
        slots = [e[2] for e in executor.trace if e[0] == "unit" and e[2] is not None]
        assert slots == list(range(partition.state.units))
        executed += [e[1] for e in executor.trace if e[0] == "unit"]
    assert executed == [u.path for u in partitions[0].graph.unit_layout()]
    np.testing.assert_array_equal(output.logits, (tokens + 8) * HIDDEN)


def test_the_output_owner_may_hand_on_its_boundary_instead_of_projecting():
    (only,) = stages(1)
    result = LayeredPartitionDriver.for_partition(only).run(
        RecordingExecutor(), tokens=np.zeros((1, 2), np.int32), project_output=False)
    assert result.logits is None
    assert result.boundary[0].tensor.shape == (1, 2, HIDDEN)


def test_storage_equal_to_the_canonical_ranges_is_accepted():
    _, last = stages()
    driver = LayeredPartitionDriver.for_partition(last, {"mtp": [0, 1], "decoder": (1, 4)})
    assert [u.canonical_index for u in driver.units()] == [4, 5, 6, 7]
    assert (driver.owns_input, driver.owns_output) == (False, True)


# ---------------------------------------------------------------- refusals


def _refused(build):
    with pytest.raises(LayeredPartitionError) as caught:
        build()
    return caught.value


@pytest.mark.parametrize(("storage", "kind", "group", "message"), [
    ({"vision": (0, 2), "decoder": (1, 4), "mtp": (0, 1)}, LK.GROUP_NOT_OWNED, "vision",
     "stage 1 of 2 does not own execution group `vision`; it owns `decoder` [1, 4), `mtp` [0, 1)"),
    ({"decoder": (0, 4), "mtp": (0, 1)}, LK.STORAGE_RANGE, "decoder",
     "storage of group `decoder` holds units [0, 4), but stage 1 of 2 owns its canonical range "
     "[1, 4)"),
    ({"decoder": (1, 4)}, LK.STORAGE_RANGE, "mtp",
     "storage holds no units of group `mtp`, but stage 1 of 2 owns its canonical range [0, 1)"),
])
def test_storage_that_differs_from_the_canonical_range_is_refused(storage, kind, group, message):
    _, last = stages()
    error = _refused(lambda: LayeredPartitionDriver.for_partition(last, storage))
    assert (error.kind, error.group, error.message) == (kind, group, message)


def test_storage_listing_a_group_twice_is_refused():
    _, last = stages()
    error = _refused(lambda: LayeredPartitionDriver(partition=last, storage=(
        ("decoder", (1, 4)), ("decoder", (1, 4)), ("mtp", (0, 1)))))
    assert error.kind is LK.STORAGE_RANGE
    assert error.message == ("storage of group `decoder` holds units [1, 4) twice, but stage 1 of "
                             "2 owns its canonical range [1, 4)")


def test_a_state_carrying_stage_without_state_is_refused():
    _, last = stages()
    stateless = replace(last, state=PartitionState(units=0, global_range=(1, 1)))
    error = _refused(lambda: LayeredPartitionDriver.for_partition(stateless))
    assert error.kind is LK.MISSING_STATE
    assert error.message == ("stage 1 of 2 executes state-carrying group `decoder` units [1, 4) "
                             "but has no state")


def test_state_that_does_not_cover_the_units_is_refused():
    _, last = stages()
    short = replace(last, state=PartitionState(units=3, global_range=(1, 4)))
    error = _refused(lambda: LayeredPartitionDriver.for_partition(short))
    assert error.kind is LK.STATE_RANGE
    assert error.group == "mtp"
    assert error.message == ("state range [1, 4) of stage 1 of 2 does not cover state layers "
                             "[4, 5) of group `mtp` units [0, 1)")


def test_token_ids_are_refused_by_a_stage_that_does_not_own_the_input():
    _, last = stages()
    error = _refused(lambda: LayeredPartitionDriver.for_partition(last).run(
        RecordingExecutor(), tokens=np.zeros((1, 1), np.int32)))
    assert error.kind is LK.TOKENS_ON_NON_INPUT_OWNER
    assert error.message == ("stage 1 of 2 received token ids, but only stage 0 owns the model "
                             "input; later stages take the boundary payload of the previous stage")


def test_the_output_projection_is_refused_on_a_stage_that_does_not_own_the_output():
    first, _ = stages()
    executor = RecordingExecutor()
    error = _refused(lambda: LayeredPartitionDriver.for_partition(first).run(
        executor, tokens=np.zeros((1, 1), np.int32), project_output=True))
    assert error.kind is LK.OUTPUT_ON_NON_OUTPUT_OWNER
    assert error.message == ("stage 0 of 2 was asked for the output projection, but only the last "
                             "stage (1) owns the model output")
    assert executor.trace == [], "nothing runs before the checks"


@pytest.mark.parametrize("inputs", [{}, {"tokens": np.zeros((1, 1), np.int32), "boundary": ()}])
def test_a_stage_needs_exactly_one_of_token_ids_and_a_boundary_payload(inputs):
    first, _ = stages()
    error = _refused(lambda: LayeredPartitionDriver.for_partition(first).run(RecordingExecutor(),
                                                                            **inputs))
    assert error.kind is LK.INVALID_INPUT
    assert error.message == ("stage 0 of 2 needs either token ids or a boundary payload, exactly "
                             "one of them")
    assert _refused(lambda: LayeredPartitionInput()).kind is LK.INVALID_INPUT


def test_a_stage_that_does_not_project_must_return_its_boundary_tensors_by_role():
    first, _ = stages()

    class Forgetful(RecordingExecutor):
        def finish(self, hidden, *, project_output):
            return hidden

    error = _refused(lambda: LayeredPartitionDriver.for_partition(first).run(
        Forgetful(), tokens=np.zeros((1, 1), np.int32)))
    assert error.kind is LK.INVALID_OUTPUT
    assert error.message == ("stage 0 of 2 finished without the output projection, so the "
                             "executor must return the boundary tensors by role; it returned "
                             "ndarray")


def test_an_outgoing_boundary_in_the_wrong_dtype_is_refused_by_the_wire_contract():
    first, _ = stages()

    class Careless(RecordingExecutor):
        def finish(self, hidden, *, project_output):
            return {"hidden": hidden}

    with pytest.raises(BoundaryPayloadError) as caught:
        LayeredPartitionDriver.for_partition(first).run(Careless(),
                                                        tokens=np.zeros((1, 1), np.int32))
    assert caught.value.kind is ArchitectureBoundaryErrorKind.WRONG_DTYPE


def test_an_executor_failing_to_begin_is_reported_with_its_cause():
    first, _ = stages()

    class Broken(RecordingExecutor):
        def begin(self, inputs, state):
            raise ValueError("no KV cache allocated")

    with pytest.raises(LayeredPartitionBeginError) as caught:
        LayeredPartitionDriver.for_partition(first).run(Broken(),
                                                        tokens=np.zeros((1, 1), np.int32))
    error = caught.value
    assert error.message == ("executor failed to begin stage 0 of 2: ValueError: no KV cache "
                             "allocated")
    assert (error.phase, error.group) == ("begin", "vision")
    assert isinstance(error.cause, ValueError) and error.__cause__ is error.cause


def test_an_executor_failing_to_enter_the_first_group_is_a_begin_error_later_ones_are_its_own():
    first, _ = stages()

    class Picky(RecordingExecutor):
        def __init__(self, refuse):
            super().__init__()
            self.refuse = refuse

        def enter_group(self, group, hidden):
            if group.group == self.refuse:
                raise RuntimeError(f"cannot enter {group.group}")
            return hidden

    driver = LayeredPartitionDriver.for_partition(first)
    with pytest.raises(LayeredPartitionBeginError) as caught:
        driver.run(Picky("vision"), tokens=np.zeros((1, 1), np.int32))
    assert caught.value.message == ("executor failed to enter group `vision` of stage 0 of 2: "
                                    "RuntimeError: cannot enter vision")
    assert caught.value.phase == "enter_group"
    with pytest.raises(RuntimeError, match="cannot enter decoder"):
        driver.run(Picky("decoder"), tokens=np.zeros((1, 1), np.int32))


def test_a_payload_for_a_partition_without_a_wire_contract_is_refused():
    _, last = stages(boundary=None)
    with pytest.raises(ArchitecturePartitionError) as caught:
        LayeredPartitionDriver.for_partition(last).run(RecordingExecutor(), boundary=())
    assert caught.value.kind is ArchitecturePartitionErrorKind.MISSING_BOUNDARY


def test_an_incoming_payload_that_breaks_the_wire_contract_is_refused_before_running():
    _, last = stages()
    executor = RecordingExecutor()
    float32_wire = boundary_for(NoAuxiliaryBoundarySchema(
        hidden_size=HIDDEN, identity="toy.hidden").contract(PipelineActivationDtype.FLOAT32))
    bad = float32_wire.encode_hidden(np.zeros((1, 2, HIDDEN), np.float32))
    with pytest.raises(BoundaryPayloadError) as caught:
        LayeredPartitionDriver.for_partition(last).run(executor, boundary=bad)
    assert caught.value.message == ("boundary tensor `hidden` of `toy.hidden` has dtype float32; "
                                    "expected bfloat16 (the pipeline activation dtype bfloat16)")
    assert executor.trace == []


# ---------------------------------------------------------------- generated rank modules


def test_generated_tiny_llama_stages_drive_an_executor_end_to_end(tmp_path):
    plan, package = compile_and_import("llama", hf("llama") / "config.json", tmp_path / "b",
                                       tp=2, pp=2, activation_dtype="bfloat16")
    tokens = np.array([[3, 1, 4, 1]], dtype=np.int32)
    sent = package.rank_module(0).driver().run(RecordingExecutor(64), tokens=tokens)
    assert sent.boundary[0].tensor.dtype == np.dtype(ml_dtypes.bfloat16)
    executor = RecordingExecutor(64)
    received = package.rank_module(3).driver({"decoder": (2, 3)}).run(executor,
                                                                      boundary=sent.boundary)
    np.testing.assert_array_equal(received.logits, (tokens + 3) * 64)
    assert executor.trace[1:3] == [("enter", "decoder", (2, 3), (2, 3)),
                                   ("unit", "model.layers.2", 0, 2)]
    with pytest.raises(LayeredPartitionError) as caught:
        package.rank_module(2).driver({"decoder": (0, 3)})
    assert caught.value.message == ("storage of group `decoder` holds units [0, 3), but stage 1 "
                                    "of 2 owns its canonical range [2, 3)")


def test_the_wire_dtype_follows_the_checkpoint_unless_it_is_given(tmp_path):
    # the tiny Llama is float32 throughout (config dtype float32, every tensor F32)
    plan, package = compile_and_import("llama", hf("llama") / "config.json", tmp_path / "f32",
                                       tp=1, pp=2)
    assert plan.topology.activation_dtype is PipelineActivationDtype.FLOAT32
    assert plan.to_json()["topology"]["activation_dtype"] == "float32"
    hidden = np.zeros((1, 2, 64), np.float32)
    boundary = package.rank_module(0).boundary()
    assert boundary.decode_hidden(boundary.encode_hidden(hidden)) is hidden
    plan, _ = compile_and_import("llama", hf("llama") / "config.json", tmp_path / "bf16", tp=1,
                                 pp=2, activation_dtype="bfloat16")
    assert plan.topology.activation_dtype is PipelineActivationDtype.BFLOAT16
