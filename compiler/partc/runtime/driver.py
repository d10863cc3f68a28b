"""The layered partition driver: one rank's validated execution metadata, and its sequencing.

A `LayeredPartitionDriver` is built from a stage's `ArchitecturePartition` (and, optionally, the
unit ranges the executor actually holds). It is the single owner of the partition checks: the
storage must hold exactly the canonical ranges, the KV state must cover every state-carrying
unit, token ids enter only the input owner and the output projection runs only on the output
owner. `run` walks an executor (anything implementing `LayeredPartitionExecutor`) through the
stage's groups and units in canonical order, decoding the incoming boundary and encoding the
outgoing one with the family's roles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from partc.errors import (
    LayeredPartitionBeginError,
    LayeredPartitionError,
    LayeredPartitionErrorKind,
)
from partc.runtime.boundary_codec import ArchitectureBoundaryValue, boundary_for

if TYPE_CHECKING:
    from partc.partition.pipeline import ArchitecturePartition, PartitionState

Range = tuple[int, int]
"""A half-open integer range (start, end)."""

HiddenT = TypeVar("HiddenT")
"""Whatever an executor carries between units (its hidden state)."""


def _spell(r: Range) -> str:
    return f"[{r[0]}, {r[1]})"


# ---------------------------------------------------------------- what an executor sees


@dataclass(frozen=True, slots=True, kw_only=True)
class LayeredUnitExecution:
    """One unit the rank executes: where it sits and which state slot it uses."""

    group: str
    """Execution group."""
    unit: int
    """Group-local unit index."""
    path: str
    """Unit path, e.g. `model.layers.7`."""
    canonical_index: int
    """Index in the canonical unit order of the whole model."""
    state_layer: int | None
    """Global state layer (None for a stateless group)."""
    state_slot: int | None
    """Rank-local state slot, from 0 (None for a stateless group)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayeredGroupExecution:
    """One owned execution group as the executor sees it."""

    group: str
    """Execution group."""
    unit_range: Range
    """Group-local unit range on this rank."""
    canonical_range: Range
    """The same units in the canonical order of the whole model."""
    state_range: Range | None
    """Global state layers of these units (None for a stateless group)."""
    units: tuple[LayeredUnitExecution, ...]
    """The units, in order."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LayeredPartitionInput:
    """What enters a stage: token ids (input owner only) or the decoded incoming boundary."""

    tokens: Any = None
    """Token ids (numpy integer array)."""
    boundary: Mapping[str, Any] | None = None
    """Incoming boundary tensors by role."""

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.boundary is None):
            raise LayeredPartitionError(LayeredPartitionErrorKind.INVALID_INPUT,
                                        "a partition input is either token ids or a boundary "
                                        "payload, exactly one of them")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LayeredPartitionOutput:
    """What leaves a stage: logits on the output owner, else the role-tagged boundary payload."""

    logits: Any = None
    """The output projection (output owner only)."""
    boundary: tuple[ArchitectureBoundaryValue, ...] | None = None
    """The outgoing boundary payload, in wire order."""


class LayeredPartitionExecutor(Protocol[HiddenT]):
    """What an executor implements; the driver calls it in canonical order."""

    def begin(self, inputs: LayeredPartitionInput, state: PartitionState) -> HiddenT:
        """Embed tokens or adopt the incoming boundary; allocate `state.units` state slots."""
        ...

    def enter_group(self, group: LayeredGroupExecution, hidden: HiddenT) -> HiddenT:
        """Prepare an execution group (e.g. fuse the decoder output into the MTP input)."""
        ...

    def run_unit(self, unit: LayeredUnitExecution, hidden: HiddenT) -> HiddenT:
        """Run one unit."""
        ...

    def leave_group(self, group: LayeredGroupExecution, hidden: HiddenT) -> HiddenT:
        """Complete an execution group."""
        ...

    def finish(self, hidden: HiddenT, *, project_output: bool) -> Any:
        """Logits when `project_output`, else the outgoing boundary tensors by role."""
        ...


# ---------------------------------------------------------------- the driver


def _error(kind: LayeredPartitionErrorKind, message: str, group: str = ""
           ) -> LayeredPartitionError:
    return LayeredPartitionError(kind, message, group=group)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayeredPartitionDriver:
    """Validated execution metadata for one rank's layered partition."""

    partition: ArchitecturePartition
    """The stage's canonical partition."""
    storage: tuple[tuple[str, Range], ...] | None = None
    """Group-local unit ranges the executor holds, by group (None: exactly the canonical ones)."""
    groups: tuple[LayeredGroupExecution, ...] = field(init=False)
    """The owned groups with their units, canonical order."""

    def __post_init__(self) -> None:
        partition = self.partition
        where = f"stage {partition.stage} of {partition.stages}"
        owned = partition.unit_ranges
        if self.storage is not None:
            stored: dict[str, Range] = {}
            for group, held in self.storage:
                units = (held[0], held[1])
                if group not in owned:
                    raise _error(LayeredPartitionErrorKind.GROUP_NOT_OWNED,
                                 f"{where} does not own execution group `{group}`; it owns "
                                 + ", ".join(f"`{g}` {_spell(r)}" for g, r in owned.items()),
                                 group)
                if group in stored or units != owned[group]:
                    raise _error(LayeredPartitionErrorKind.STORAGE_RANGE,
                                 f"storage of group `{group}` holds units {_spell(units)}"
                                 f"{' twice' if group in stored else ''}, but {where} owns its "
                                 f"canonical range {_spell(owned[group])}", group)
                stored[group] = owned[group]
            missing = [g for g in owned if g not in stored]
            if missing:
                raise _error(LayeredPartitionErrorKind.STORAGE_RANGE,
                             f"storage holds no units of group `{missing[0]}`, but {where} owns "
                             f"its canonical range {_spell(owned[missing[0]])}", missing[0])
        graph, state = partition.graph, partition.state
        executions = []
        for part in partition.groups:
            spec = graph.group(part.group)
            offset = graph.group_range(part.group)[0]
            state_range = None
            if spec.carries_state:
                base = graph.state_offset(part.group)
                state_range = (base + part.unit_range[0], base + part.unit_range[1])
                if state.units == 0:
                    raise _error(LayeredPartitionErrorKind.MISSING_STATE,
                                 f"{where} executes state-carrying group `{part.group}` units "
                                 f"{_spell(part.unit_range)} but has no state", part.group)
                if not state.covers(state_range):
                    raise _error(LayeredPartitionErrorKind.STATE_RANGE,
                                 f"state range {_spell(state.global_range)} of {where} does not "
                                 f"cover state layers {_spell(state_range)} of group "
                                 f"`{part.group}` units {_spell(part.unit_range)}", part.group)
            first = part.unit_range[0]
            layers = [None if state_range is None else state_range[0] + u - first
                      for u in range(*part.unit_range)]
            members = tuple(LayeredUnitExecution(
                group=part.group, unit=u, path=spec.unit_paths[u], canonical_index=offset + u,
                state_layer=layer,
                state_slot=None if layer is None else layer - state.global_range[0])
                for u, layer in zip(range(*part.unit_range), layers, strict=True))
            executions.append(LayeredGroupExecution(
                group=part.group, unit_range=part.unit_range,
                canonical_range=(offset + first, offset + part.unit_range[1]),
                state_range=state_range, units=members))
        object.__setattr__(self, "groups", tuple(executions))

    @classmethod
    def for_partition(cls, partition: ArchitecturePartition,
                      storage: Mapping[str, Sequence[int]] | None = None
                      ) -> LayeredPartitionDriver:
        """The driver of `partition`, checking `storage` (group → unit range) when given."""
        held = None if storage is None else tuple(
            (group, (int(units[0]), int(units[1]))) for group, units in storage.items())
        return cls(partition=partition, storage=held)

    @property
    def owns_input(self) -> bool:
        """Whether the stage accepts token ids."""
        return self.partition.ownership.owns_input

    @property
    def owns_output(self) -> bool:
        """Whether the stage runs the output projection."""
        return self.partition.ownership.owns_output

    @property
    def state(self) -> PartitionState:
        """The stage's state geometry."""
        return self.partition.state

    def units(self) -> tuple[LayeredUnitExecution, ...]:
        """Every unit the rank executes, canonical order."""
        return tuple(u for g in self.groups for u in g.units)

    def input(self, *, tokens: Any = None,
              boundary: Sequence[ArchitectureBoundaryValue] | None = None
              ) -> LayeredPartitionInput:
        """The checked input: token ids only on the input owner; a payload decoded by role."""
        where = f"stage {self.partition.stage} of {self.partition.stages}"
        if tokens is not None and not self.owns_input:
            raise _error(LayeredPartitionErrorKind.TOKENS_ON_NON_INPUT_OWNER,
                         f"{where} received token ids, but only stage 0 owns the model input; "
                         "later stages take the boundary payload of the previous stage")
        if (tokens is None) == (boundary is None):
            raise _error(LayeredPartitionErrorKind.INVALID_INPUT,
                         f"{where} needs either token ids or a boundary payload, exactly one "
                         "of them")
        if boundary is None:
            return LayeredPartitionInput(tokens=tokens)
        decoded = boundary_for(self.partition.receiving_contract()).decode(boundary)
        return LayeredPartitionInput(boundary=decoded)

    def run(self, executor: LayeredPartitionExecutor[Any], *, tokens: Any = None,
            boundary: Sequence[ArchitectureBoundaryValue] | None = None,
            project_output: bool | None = None) -> LayeredPartitionOutput:
        """Sequence `executor` over the stage: begin, each group and unit, finish."""
        where = f"stage {self.partition.stage} of {self.partition.stages}"
        project = self.owns_output if project_output is None else project_output
        if project and not self.owns_output:
            raise _error(LayeredPartitionErrorKind.OUTPUT_ON_NON_OUTPUT_OWNER,
                         f"{where} was asked for the output projection, but only the last stage "
                         f"({self.partition.stages - 1}) owns the model output")
        inputs = self.input(tokens=tokens, boundary=boundary)
        first = self.groups[0]
        try:
            hidden = executor.begin(inputs, self.state)
        except Exception as exc:
            raise LayeredPartitionBeginError(
                f"executor failed to begin {where}: {type(exc).__name__}: {exc}",
                phase="begin", group=first.group, cause=exc) from exc
        for index, group in enumerate(self.groups):
            try:
                hidden = executor.enter_group(group, hidden)
            except Exception as exc:
                if index:
                    raise
                raise LayeredPartitionBeginError(
                    f"executor failed to enter group `{group.group}` of {where}: "
                    f"{type(exc).__name__}: {exc}", phase="enter_group", group=group.group,
                    cause=exc) from exc
            for unit in group.units:
                hidden = executor.run_unit(unit, hidden)
            hidden = executor.leave_group(group, hidden)
        result = executor.finish(hidden, project_output=project)
        if project:
            return LayeredPartitionOutput(logits=result)
        if not isinstance(result, Mapping):
            raise _error(LayeredPartitionErrorKind.INVALID_OUTPUT,
                         f"{where} finished without the output projection, so the executor must "
                         f"return the boundary tensors by role; it returned "
                         f"{type(result).__name__}")
        return LayeredPartitionOutput(
            boundary=boundary_for(self.partition.sending_contract()).encode_values(result))
