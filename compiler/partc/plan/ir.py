"""The plan IR's root: `Plan` with its global tensor table and pipeline summary, spelled as
canonical JSON with its content hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from partc import __version__
from partc.partition.boundary import BoundaryWireSchema
from partc.partition.ownership import (
    ExecutionGroupSpec,
    GroupParallelMode,
    ParameterGroupOwner,
    StaticRoleSpec,
)
from partc.plan.ranks import GroupKind, PlannedGroup, RankPlan
from partc.plan.topology import Topology

if TYPE_CHECKING:
    from partc.plan.expert_placement import ExpertParallelPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalTensor:
    """One checkpoint tensor in the global view: where it lives."""

    target: str
    """Checkpoint name."""
    dtype: str
    """Safetensors dtype."""
    shape: tuple[int, ...]
    """Global shape."""
    group: str
    """Owning parameter group."""
    owner: ParameterGroupOwner
    """The group's owner."""
    stages: tuple[int, ...]
    """Pipeline stages that load it (Omit on every other)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSummary:
    """How the stages of a multi-group graph were chosen, and what each holds."""

    balance: str
    """`bytes`, `weight`, `units` or `explicit`."""
    layout: str
    """The stage layout in Megatron's notation (`plan.stage_balance`)."""
    stage_bytes: tuple[int, ...]
    """Parameter bytes of each stage on its largest tensor-parallel rank."""
    group_modes: tuple[tuple[str, GroupParallelMode], ...]
    """Parallel mode of every execution group, canonical order."""

    @property
    def imbalance(self) -> float:
        """Largest stage bytes over the mean stage bytes (1.0: perfectly even)."""
        mean = sum(self.stage_bytes) / len(self.stage_bytes)
        return max(self.stage_bytes) / mean if mean else 1.0

    def to_json(self) -> dict[str, object]:
        """JSON form."""
        return {"balance": self.balance, "layout": self.layout,
                "stage_bytes": list(self.stage_bytes),
                "imbalance": round(self.imbalance, 6),
                "group_modes": {g: m.value for g, m in self.group_modes}}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The frozen plan IR of one (family, config, topology).

    Not slotted: `tensors` and `document` are `functools.cached_property` values, derived from
    the fields on first use and then kept (the tensor table has ~10^5 entries for the largest
    models); the fields never change and equality sees only them.
    """

    family: str
    """Family name."""
    model_type: str
    """HF model type."""
    topology: Topology
    """The topology realized."""
    sources: tuple[tuple[str, str], ...]
    """Input names and their sha256, sorted."""
    config_values: tuple[tuple[str, Any], ...]
    """Bound config values."""
    graph: tuple[ExecutionGroupSpec, ...]
    """Execution groups in canonical order."""
    static_roles: tuple[StaticRoleSpec, ...]
    """Static roles and their sides, in declaration order."""
    boundary: BoundaryWireSchema
    """What crosses a pipeline cut."""
    groups: tuple[PlannedGroup, ...]
    """Every parameter group, in declaration order."""
    kinds: tuple[GroupKind, ...]
    """Realizations shared by groups of one structure, in order of first use."""
    ranks: tuple[RankPlan, ...]
    """Per-rank plans, by global rank."""
    checkpoint_fingerprint: str | None = None
    """sha256 over the checkpoint header's (name, dtype, shape) when one was given."""
    checkpoint_header_digest: str | None = None
    """sha256 of that checkpoint's stored header bytes (lets a loader skip the fingerprint)."""
    payload_digests: tuple[tuple[tuple[str, str], ...], ...] | None = None
    """Per rank, (target, sha256 of its rank-local bytes) sorted by target; only when compiled
    with `--digests` (the JSON key `digests` is absent otherwise)."""
    omitted: tuple[str, ...] = ()
    """Checkpoint tensors the family's `omit` globs matched: loaded by no rank (the JSON key
    `omitted` is absent when there are none)."""
    omit: tuple[str, ...] = ()
    """The family's `omit` globs (the JSON key `omit` is absent when it has none): a loader
    leaves the checkpoint tensors they match out of its check of the checkpoint's names."""
    pipeline: PipelineSummary | None = None
    """How a multi-group graph was cut into stages (the JSON key `pipeline` is absent for a
    single-group graph, whose stages are balanced by unit count)."""
    cuts: tuple[tuple[int, str, BoundaryWireSchema], ...] = ()
    """Per pipeline cut, when the family declares boundaries per execution group: (the stage
    before the cut, the group of the unit before it, what crosses it); JSON key `cuts`."""
    expert_parallel: ExpertParallelPlan | None = None
    """The expert-parallel layout and placement (the JSON key `expert_parallel` is absent
    without expert parallelism)."""

    def chunk_mismatches(self, stage: int) -> tuple[tuple[str, int, tuple[int, int],
                                                          tuple[int, int]], ...]:
        """The tensors of `stage` that some TP rank holds otherwise than torch.chunk (DTensor's
        `Shard`) would: (target, that TP rank, partc's range, torch.chunk's), the first such
        rank of each, in target order. The same on every rank of the stage, so that
        `to_dtensors` refuses them on all of them, not only where its own range differs.
        Empty under expert parallelism (whose states `to_dtensors` refuses as such)."""
        return self._chunk_mismatches.get(stage, ())

    @cached_property
    def _chunk_mismatches(self) -> dict[int, tuple[tuple[str, int, tuple[int, int],
                                                          tuple[int, int]], ...]]:
        from partc.parallel.specs import chunk_range

        tp = self.topology.tensor_parallel_size
        if tp == 1 or self.topology.expert_parallel_size is not None:
            return {}
        # per group kind (shared by every group of one structure), once: each member's first
        # TP rank whose one range is not torch.chunk's; then the stages' groups of those kinds
        uneven: dict[int, list[tuple[int, int, tuple[int, int], tuple[int, int]]]] = {}
        for index, kind in enumerate(self.kinds):
            for member in range(len(kind.layouts[0])):
                for rank, layouts in enumerate(kind.layouts):
                    axis, ranges = layouts[member].selection
                    if axis is None or len(ranges) != 1:  # whole, or fused segments here
                        continue
                    chunk = chunk_range(layouts[member].global_shape[axis], tp, rank)
                    if tuple(ranges[0]) != chunk:
                        start, end = ranges[0]
                        uneven.setdefault(index, []).append((member, rank, (start, end), chunk))
                        break
        out: dict[int, Any] = {}
        for group in self.groups:
            for member, rank, held, chunk in uneven.get(group.kind, ()):
                for stage in group.stages:
                    out.setdefault(stage, []).append((group.targets[member], rank, held, chunk))
        return {stage: tuple(sorted(found)) for stage, found in sorted(out.items())}

    @cached_property
    def tensor_names_check(self) -> tuple[int, str, tuple[str, ...]]:
        """What a loader checks a checkpoint's names against: (tensor count, sha256 of the
        sorted targets one per line, the family's `omit` globs); `partc.runtime.loader`
        takes the same digest of the checkpoint's names."""
        targets = sorted(t.target for t in self.tensors)
        digest = hashlib.sha256("\n".join(targets).encode()).hexdigest()  # as the loader's
        return len(targets), digest, self.omit

    @cached_property
    def tensors(self) -> tuple[GlobalTensor, ...]:
        """Global tensor table, sorted by target (derived on first use, then kept)."""
        table = [GlobalTensor(target=target, dtype=layout.dtype, shape=layout.global_shape,
                              group=group.name, owner=group.owner, stages=group.stages)
                 for group in self.groups
                 for layout, target in zip(self.kinds[group.kind].layouts[0], group.targets,
                                           strict=True)]
        return tuple(sorted(table, key=lambda t: t.target))

    @property
    def global_parameter_bytes(self) -> int:
        """Bytes of every tensor of the checkpoint."""
        from partc.parallel.placements import tensor_bytes

        return sum(tensor_bytes(t.dtype, t.shape) for t in self.tensors)

    def to_json(self) -> dict[str, object]:
        """The canonical JSON document (validates against `schemas/plan.schema.json`)."""
        body = self._body()
        body["tensors"] = self._tensors_json()
        body["plan_hash"] = plan_hash(body)
        return body

    @property
    def plan_hash(self) -> str:
        """The content hash of the plan (`plan_hash` of its JSON document)."""
        return str(self.document[0]["plan_hash"])

    @cached_property
    def document(self) -> tuple[dict[str, Any], str]:
        """`to_json()` without its `tensors` list, and the canonical text of the whole document
        (equal to `canonical_json(to_json())`), each part encoded once; derived on first use,
        then kept (treat the dict as read-only).

        The tensor table (~10^5 entries for the largest models) is spelled directly from the
        group kinds, whose shape and placement text its tensors share.
        """
        body = self._body()
        parts = {key: canonical_json(value)[:-1] for key, value in body.items()}
        parts["tensors"] = self._tensors_text()
        digest = hashlib.sha256((_object_text(parts) + "\n").encode()).hexdigest()
        body["plan_hash"] = digest
        parts["plan_hash"] = _string(digest)
        return body, _object_text(parts) + "\n"

    def _body(self) -> dict[str, Any]:
        return {
            "partc_version": __version__,
            "family": self.family,
            "model_type": self.model_type,
            "topology": self.topology.to_json(),
            "sources": [{"name": n, "sha256": h} for n, h in self.sources],
            "checkpoint_fingerprint": self.checkpoint_fingerprint,
            "checkpoint_header_digest": self.checkpoint_header_digest,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.config_values},
            "graph": [{"group": g.name, "unit_paths": list(g.unit_paths),
                       "state": g.carries_state, "after": list(g.dependencies)}
                      for g in self.graph],
            "static_roles": [{"role": r.name, "stage": r.spell()} for r in self.static_roles],
            "boundary": self.boundary.to_json(),
            "groups": self._groups_json(),
            "ranks": [r.to_json() for r in self.ranks],
        } | ({} if self.pipeline is None else {"pipeline": self.pipeline.to_json()}) | (
            {"cuts": [{"after_stage": s, "group": g, "boundary": b.to_json()}
                      for s, g, b in self.cuts]} if self.cuts else {}) | (
            {} if self.payload_digests is None else {
            "digests": [dict(rank) for rank in self.payload_digests]}) | (
            {"omitted": list(self.omitted)} if self.omitted else {}) | (
            {"omit": list(self.omit)} if self.omit else {}) | (
            {} if self.expert_parallel is None
            else {"expert_parallel": self.expert_parallel.to_json()})

    def _groups_json(self) -> list[dict[str, object]]:
        """Each parameter group: owner, logical units and every TP rank's logical range."""
        out: list[dict[str, object]] = []
        for group in sorted(self.groups, key=lambda g: g.name):
            layouts = [rank[0] for rank in self.kinds[group.kind].layouts]
            first = layouts[0]
            entry: dict[str, object] = {
                "name": group.name, "role": first.role.value, "owner": group.owner.to_json(),
                "stages": list(group.stages), "logical_units": first.logical_units,
                "logical_ranges": None if first.logical_range is None else
                [list(x.logical_range or ()) for x in layouts],
                "fell_back_to_replication": first.fell_back_to_replication}
            if first.fallback_reason:  # absent otherwise: other plans read as before
                entry["fallback_reason"] = first.fallback_reason
            out.append(entry)
        return out

    def _tensors_json(self) -> list[dict[str, object]]:
        """Each checkpoint tensor: dtype, shape, group, stages and its placement on each TP rank.

        Groups of one kind share the shape and placement lists (the text is the same).
        """
        members: dict[int, list[tuple[str, list[int], int, list[list[object]], bool, bool]]] = {}
        out = []
        for group in self.groups:
            shared = members.get(group.kind)
            if shared is None:
                layouts = self.kinds[group.kind].layouts
                shared = members[group.kind] = [
                    (first.dtype, list(first.global_shape), first.kv_replicas,
                     [_compact_json(rank[i].placement.to_compact()) for rank in layouts],
                     any(rank[i].needs_tp_reduction for rank in layouts),
                     any(rank[i].needs_tp_output_reduction for rank in layouts))
                    for i, first in enumerate(layouts[0])]
            stages = list(group.stages)
            for target, (dtype, shape, kv_replicas, placements, reduced, output) in zip(
                    group.targets, shared, strict=True):
                out.append({"target": target, "dtype": dtype, "shape": shape,
                            "group": group.name, "stages": stages, "kv_replicas": kv_replicas,
                            "placements": placements}
                           | ({"needs_tp_output_reduction": True} if output else {})
                           | ({"needs_tp_reduction": True} if reduced else {}))
        out.sort(key=lambda t: t["target"])  # type: ignore[arg-type, return-value]
        return out


    def _tensors_text(self) -> str:
        """The canonical JSON text of `_tensors_json()`, written without building it."""
        members: dict[int, list[tuple[str, str]]] = {}
        stage_texts: dict[tuple[int, ...], str] = {}
        entries = []
        for group in self.groups:
            shared = members.get(group.kind)
            if shared is None:
                layouts = self.kinds[group.kind].layouts
                shared = members[group.kind] = [
                    ('{"dtype":' + _string(first.dtype) + ',"group":',
                     f',"kv_replicas":{first.kv_replicas},'
                     + ('"needs_tp_output_reduction":true,' if any(
                         rank[i].needs_tp_output_reduction for rank in layouts) else '')
                     + ('"needs_tp_reduction":true,' if any(
                         rank[i].needs_tp_reduction for rank in layouts) else '')
                     + '"placements":'
                     + _text([_compact_json(rank[i].placement.to_compact()) for rank in layouts])
                     + ',"shape":' + _text(list(first.global_shape)) + ',"stages":')
                    for i, first in enumerate(layouts[0])]
            middle = _string(group.name)
            tail = stage_texts.get(group.stages)
            if tail is None:
                tail = stage_texts[group.stages] = _text(list(group.stages)) + ',"target":'
            for target, (head, body) in zip(group.targets, shared, strict=True):
                entries.append((target, head + middle + body + tail + _string(target) + "}"))
        entries.sort(key=lambda entry: entry[0])
        return "[" + ",".join(text for _, text in entries) + "]"


_string: Callable[[str], str] = json.encoder.encode_basestring_ascii
"""A str as a JSON string with ASCII escapes, exactly as `canonical_json` spells it."""


def _text(value: object) -> str:
    """Canonical JSON text of a value, without the trailing newline."""
    return canonical_json(value)[:-1]


def _object_text(parts: dict[str, str]) -> str:
    """Canonical JSON text of an object whose values are already encoded."""
    return "{" + ",".join(_string(key) + ":" + parts[key] for key in sorted(parts)) + "}"


def _compact_json(value: tuple[object, ...]) -> list[object]:
    return [[list(r) for r in v] if isinstance(v, tuple) else v for v in value]


def canonical_json(data: object) -> str:
    """Deterministic JSON text: sorted keys, compact separators, ASCII only, trailing newline."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"


def plan_hash(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a plan body (without its own hash)."""
    clean = {k: v for k, v in body.items() if k != "plan_hash"}
    return hashlib.sha256(canonical_json(clean).encode()).hexdigest()
