"""Expert parallelism: which experts each expert-parallel rank holds, and the router's map.

A stage of an expert-parallel build has N = E x X ranks (docs/expert_parallel.md). The dense
parts keep their TP split over T ranks, repeated N / T times; the experts are placed on the E
expert-parallel (EP) ranks, each expert further split over the X ranks of an expert-tensor-
parallel (ETP) group. `ExpertPlacement` says which global experts each EP rank holds, in local
slot order (balanced contiguous ranges by default, or an explicit placement file, possibly with
redundant copies); `ExpertMap` is what a rank's router needs. Reading a placement file and
realizing a stacked group for an EP rank are the plan's (`partc.plan.expert_placement`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from partc.errors import (
    ExpertParallelError,
    plural,
)
from partc.parallel.placements import is_count
from partc.parallel.specs import balanced_contiguous_range


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertPlacement:
    """The global experts each expert-parallel rank holds, in local slot order.

    Every expert is on at least one EP rank; an expert on several is redundant (copies of a
    hot expert, as DeepSeek's EPLB places them). A rank's slots are ascending global ids, so a
    stacked `[experts, ...]` tensor is read in its stored order.
    """

    experts: int
    """How many global experts the model routes to."""
    slots: tuple[tuple[int, ...], ...]
    """Per EP rank, the global expert id of each local slot."""
    explicit: bool = False
    """Whether the placement came from a placement file (else balanced)."""

    def __post_init__(self) -> None:
        problem = placement_problem(self.experts, self.slots)
        if problem is not None:
            raise ExpertParallelError(f"expert placement: {problem[1]}", pointer=problem[0],
                                      doc=PLACEMENT_DOC)

    @classmethod
    def balanced(cls, experts: int, expert_parallel_size: int) -> ExpertPlacement:
        """Balanced contiguous ranges: EP rank i holds `experts // E (+1 if i < experts % E)`."""
        if expert_parallel_size > experts:
            raise ExpertParallelError(
                f"expert_parallel_size {expert_parallel_size} exceeds the model's "
                f"{plural(experts, 'expert')}: a balanced placement gives every EP rank at "
                "least one expert; use "
                f"--ep of at most {experts}, or a placement file (--expert-placement) with "
                "redundant experts")
        return cls(experts=experts, slots=tuple(
            tuple(range(*balanced_contiguous_range(experts, expert_parallel_size, i)))
            for i in range(expert_parallel_size)))

    @property
    def expert_parallel_size(self) -> int:
        """E: the EP ranks."""
        return len(self.slots)

    @property
    def redundant(self) -> int:
        """Physical slots beyond one per expert (0: no expert is held twice)."""
        return sum(len(s) for s in self.slots) - self.experts

    def owners(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per global expert, every (EP rank, local slot) that holds it, by EP rank."""
        found: list[list[tuple[int, int]]] = [[] for _ in range(self.experts)]
        for ep, ids in enumerate(self.slots):
            for slot, expert in enumerate(ids):
                found[expert].append((ep, slot))
        return tuple(tuple(x) for x in found)

    def to_json(self) -> dict[str, object]:
        """JSON form (the plan's `expert_parallel.placement`)."""
        return {"experts": self.experts, "explicit": self.explicit,
                "slots": [list(s) for s in self.slots]}


def placement_problem(experts: int, slots: Sequence[Sequence[object]]
                      ) -> tuple[str, str] | None:
    """(JSON pointer under the file's `ranks`, message) of the first rule `slots` breaks."""
    return next(iter(placement_problems(experts, slots)), None)


def placement_problems(experts: int, slots: Sequence[Sequence[object]]
                       ) -> list[tuple[str, str]]:
    """(JSON pointer under the file's `ranks`, message) of every rule `slots` breaks, in file
    order; [] when it is a placement of `experts` experts. Experts on no rank are reported only
    when every id is valid (a bad id may be the missing expert, mistyped)."""
    if not slots:
        return [("/ranks", "it lists no expert-parallel rank")]
    found: list[tuple[str, str]] = []
    held: set[int] = set()
    bad_ids = False
    for ep, ids in enumerate(slots):
        if not ids:
            found.append((f"/ranks/{ep}",
                          f"EP rank {ep} holds no expert; every EP rank needs one"))
        previous: int | None = None
        for slot, expert in enumerate(ids):
            pointer = f"/ranks/{ep}/{slot}"
            if not is_count(expert) or not 0 <= expert < experts:  # type: ignore[operator]
                found.append((pointer, f"EP rank {ep} slot {slot} names expert "
                              f"{_spelled(expert)}; expert ids are integers 0..{experts - 1}"))
                previous, bad_ids = None, True
                continue
            assert isinstance(expert, int)
            if previous is not None and expert <= previous:
                found.append((pointer, f"EP rank {ep} lists expert {expert} after {previous}; "
                              "a rank's experts are distinct and ascending (its local slot "
                              "order is the stored order)"))
            previous = expert
            held.add(expert)
    missing = sorted(set(range(experts)) - held)
    if missing and not bad_ids:  # a bad id may be the missing expert mistyped: one mistake
        shown = ", ".join(str(e) for e in missing[:8]) + (", ..." if len(missing) > 8 else "")
        found.append(("/ranks", f"{plural(len(missing), 'expert')} ({shown}) "
                      f"{'is' if len(missing) == 1 else 'are'} on no EP rank; every one of the "
                      f"{plural(experts, 'expert')} needs at least one"))
    return found


def first_problems(found: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """The first `limit` of `found`, the last saying how many more were left out."""
    if len(found) <= limit:
        return found
    pointer, message = found[limit - 1]
    return [*found[:limit - 1], (pointer, f"{message} (and {len(found) - limit} more errors "
                                          "not shown; fix these first)")]


PLACEMENT_DOC = "expert_parallel#placement"
"""The guide section a placement error points to."""


def _spelled(value: object) -> str:
    """A placement file's value as JSON spells it (`true`, `"3"`, `1.5`)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertMap:
    """What a rank's router needs: where every global expert lives, and this rank's experts."""

    expert_parallel_size: int
    """E."""
    expert_tensor_parallel_size: int
    """X: ranks splitting each expert."""
    expert_parallel_rank: int
    """This rank's EP rank."""
    owners: tuple[tuple[tuple[int, int], ...], ...]
    """Per global expert id, each (EP rank, local slot) holding it (several when redundant)."""
    local_experts: tuple[int, ...]
    """Per local slot of this rank, its global expert id."""

    def __post_init__(self) -> None:
        placed = [(ep, slot) for held in self.owners for ep, slot in held]
        mine = sorted(slot for ep, slot in placed if ep == self.expert_parallel_rank)
        if not 0 <= self.expert_parallel_rank < self.expert_parallel_size or mine != list(
                range(len(self.local_experts))) or any(
                self.local_experts[slot] != expert for expert, held in enumerate(self.owners)
                for ep, slot in held if ep == self.expert_parallel_rank):
            raise ExpertParallelError(
                f"inconsistent expert map: EP rank {self.expert_parallel_rank} "
                f"of {self.expert_parallel_size}, local experts "
                f"{list(self.local_experts)}")

    @property
    def experts(self) -> int:
        """How many global experts the router chooses from."""
        return len(self.owners)

    def local_slot(self, expert: int) -> int | None:
        """This rank's slot holding global `expert` (None: another EP rank holds it)."""
        return next((slot for ep, slot in self.owners[expert]
                     if ep == self.expert_parallel_rank), None)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertGroup:
    """How a bound parameter group takes part in expert parallelism."""

    expert: int | None = None
    """The global expert id of a per-expert group (`for: {expert: ...}`)."""
    axis: int | None = None
    """The expert axis of a stacked group (`experts: {axis: ...}`)."""
    count: int | None = None
    """The experts a stacked group's expert axis holds, each a block of `length / count` rows
    (`experts: {count: ...}`, DBRX `[E * I, H]`); None: one row per expert."""

    def __post_init__(self) -> None:
        if (self.expert is None) == (self.axis is None):
            raise ExpertParallelError("an expert group is either one expert (an id) or stacked (an "
                                      f"axis), found expert {self.expert} and axis {self.axis}")
        if self.count is not None and (self.axis is None or self.count < 1):
            raise ExpertParallelError(f"an expert count ({self.count}) belongs to a stacked "
                                      "group and must be positive")

    def rows_per_expert(self, length: int) -> int:
        """The rows of one expert on an expert axis of `length` rows."""
        return 1 if self.count is None else length // self.count
