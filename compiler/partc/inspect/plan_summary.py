"""What a build holds, read from its plan.json: per-rank and per-stage totals, fallbacks, tensors.

Everything here works from the plan read back typed (`partc.plan.plan_file.read_plan`), the
build's public and stable output, so that a build can be inspected without the family or the
config it came from.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partc.errors import LoadError, SourceLocation
from partc.parallel.placements import tensor_bytes
from partc.plan.plan_file import read_plan
from partc.plan.plan_records import PlanFile, PlanGroup, PlanRank, PlanTensor

if TYPE_CHECKING:
    from partc.inspect.origins import FamilyLines
    from partc.partition.boundary import BoundaryWireSchema


@dataclass(frozen=True, slots=True, kw_only=True)
class Build:
    """A build's plan, read back typed (`file`)."""

    file: PlanFile
    """The plan.json read back."""

    @property
    def path(self) -> Path:
        """The plan.json file."""
        return self.file.path

    @property
    def tensor_parallel_size(self) -> int:
        """T."""
        return self.file.shape.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        """S."""
        return self.file.shape.pipeline_parallel_size


def is_build(path: Path) -> bool:
    """True when `path` is a build folder (holding plan.json) or a plan.json file."""
    return (path / "plan.json").is_file() if path.is_dir() else (
        path.suffix == ".json" and path.name != "model.safetensors.index.json" and path.is_file())


def read_build(path: str | Path) -> Build:
    """Read a build folder's plan.json (or a plan file); LoadError when it is not one."""
    where = Path(path)
    file = where / "plan.json" if where.is_dir() else where
    hint = "expected a folder written by `partc compile` (it holds plan.json)"
    return Build(file=read_plan(file, hint=hint))


def topology_text(topology: Mapping[str, Any]) -> str:
    """`TP=T x PP=S`, with ` x EP=E (ETP=X)` under expert parallelism (as compile says it), from
    a summary's `topology`."""
    text = f"TP={topology['tensor_parallel_size']} x PP={topology['pipeline_parallel_size']}"
    if topology.get("expert_parallel_size") is not None:
        text += (f" x EP={topology['expert_parallel_size']} "
                 f"(ETP={topology.get('expert_tensor_parallel_size', 1)})")
    return text


def local_shape(placement: Sequence[Any], shape: Sequence[int], tensor_parallel_rank: int
                ) -> tuple[int, ...] | None:
    """The rank-local shape of a tensor under a compact placement (None: not on this rank)."""
    kind = placement[0]
    out = list(shape)
    if kind in ("replicated", "local", "pipeline_stage", "whole"):
        return tuple(out)
    if kind == "rank":
        return tuple(out) if placement[1] == tensor_parallel_rank else None
    if kind == "omit":
        return None
    axis = int(placement[1])
    if kind == "shard":
        out[axis] = shape[axis] // int(placement[3])
    elif kind == "range":
        out[axis] = int(placement[3]) - int(placement[2])
    elif kind == "indices":
        out[axis] = sum(int(b) - int(a) for a, b in placement[2])
    return tuple(out)


def rank_placement(plan: PlanFile, rank: PlanRank, tensor: PlanTensor
                   ) -> tuple[list[Any], tuple[int, ...]] | None:
    """A tensor's placement on `rank` and its local shape there (None: the rank does not hold
    it): its TP rank's placement, or under expert parallelism (docs/expert_parallel.md) its ETP
    rank's for a per-expert tensor of an expert in the rank's slots, its stage-local rank's for
    a stacked expert tensor."""
    if rank.pipeline_stage not in tensor.stages:
        return None
    placements = tensor.placements
    experts = plan.expert_parallel
    row = rank.tensor_parallel_rank
    if experts is not None and tensor.group in experts.expert_groups:
        info = rank.info
        expert = experts.expert_groups[tensor.group]
        if expert is None:  # stacked: one placement per stage-local rank
            row = rank.rank % experts.ranks_per_stage
        elif expert not in experts.slots[int(info.expert_parallel_rank or 0)]:
            return None
        else:
            row = int(info.expert_tensor_parallel_rank or 0)
    placement = list(placements[row]) if row < len(placements) else ["whole"]
    shape = local_shape(placement, tensor.shape, row)
    return None if shape is None else (placement, shape)


def placement_text(placement: Sequence[Any]) -> str:
    """A placement as people read it: `rows 0:66`, `cols 32:64`, `replicated`."""
    kind = placement[0]
    if kind in ("range", "shard", "indices"):
        axis = int(placement[1])
        name = {0: "rows", 1: "cols"}.get(axis, f"axis {axis}")
        if kind == "range":
            return f"{name} {placement[2]}:{placement[3]}"
        if kind == "shard":
            return f"{name} part {placement[2]}/{placement[3]}"
        return f"{name} " + ",".join(f"{a}:{b}" for a, b in placement[2])
    if kind == "rank":
        return f"whole on tp rank {placement[1]}"
    if kind == "omit":  # a per-head tensor of another rank's head
        return "not held"
    return str(kind)


def _units_text(rank: PlanRank) -> str:
    return ", ".join(f"{u.group}[{u.start}:{u.end}]" for u in rank.units) or "-"


ExpertTensors = dict[tuple[int, int | None], list[PlanTensor]]
"""A plan's routed-expert tensors by (pipeline stage, expert id; None: stacked, every slot's)."""


def expert_tensors(plan: PlanFile) -> ExpertTensors:
    """The routed-expert tensors of an expert-parallel `plan`, indexed for `rank_experts` (one
    pass over the tensors, however many ranks are then asked about)."""
    assert plan.expert_parallel is not None
    groups = plan.expert_parallel.expert_groups
    index: ExpertTensors = {}
    for tensor in plan.tensors:
        if tensor.group in groups:
            for stage in tensor.stages:
                index.setdefault((stage, groups[tensor.group]), []).append(tensor)
    return index


def rank_experts(plan: PlanFile, rank: PlanRank, index: ExpertTensors | None = None
                 ) -> tuple[list[int], int] | None:
    """The routed experts a rank loads (in its slot order) and their bytes, read from the
    tensors it holds: none on a stage without MoE layers; None without expert parallelism.
    `index`: `expert_tensors(plan)`, when several ranks are asked about."""
    experts = plan.expert_parallel
    if experts is None:
        return None
    if index is None:
        index = expert_tensors(plan)
    stage = rank.pipeline_stage
    slots = list(experts.slots[int(rank.info.expert_parallel_rank or 0)])
    held: set[int] = set()
    nbytes = 0
    for expert in [None, *dict.fromkeys(slots)]:
        for tensor in index.get((stage, expert), ()):
            placed = rank_placement(plan, rank, tensor)
            if placed is None:
                continue
            held.update(slots if expert is None else [expert])  # a stacked tensor: every slot's
            nbytes += tensor_bytes(tensor.dtype, placed[1])
    return [e for e in slots if e in held], nbytes


def rank_rows(plan: PlanFile, *, tensor_table: bool = True) -> list[dict[str, Any]]:
    """One row per rank: stage, TP rank, units, tensors, bytes (total and by dtype), roles;
    under expert parallelism also its EP and ETP rank, and (from the tensor table, unless
    `tensor_table` is false) its experts and their bytes."""
    rows = []
    index = (expert_tensors(plan) if plan.expert_parallel is not None and tensor_table
             else None)
    for rank in plan.ranks:
        info = rank.info
        row: dict[str, Any] = {
            "rank": rank.rank, "tensor_parallel_rank": rank.tensor_parallel_rank,
            "pipeline_stage": rank.pipeline_stage, "units": _units_text(rank),
            "tensors": info.owned_tensors, "bytes": info.local_parameter_bytes,
            "bytes_by_dtype": dict(info.local_bytes_by_dtype),
            "static_roles": list(rank.static_roles)}
        held = rank_experts(plan, rank, index) if index is not None else None
        if plan.expert_parallel is not None:
            row |= {"expert_parallel_rank": info.expert_parallel_rank,
                    "expert_tensor_parallel_rank": info.expert_tensor_parallel_rank}
        if held is not None:
            row |= {"experts": held[0], "expert_bytes": held[1]}
        rows.append(row)
    return rows


def stage_rows(plan: PlanFile, ranks: Sequence[Mapping[str, Any]] | None = None
               ) -> list[dict[str, Any]]:
    """One row per pipeline stage: units, tensors and bytes summed over its TP ranks (`ranks`:
    `rank_rows(plan)`, when the caller has them)."""
    stages: dict[int, dict[str, Any]] = {}
    for row in rank_rows(plan) if ranks is None else ranks:
        stage = stages.setdefault(row["pipeline_stage"], {
            "pipeline_stage": row["pipeline_stage"], "ranks": [], "units": row["units"],
            "tensors": 0, "bytes": 0, "bytes_by_dtype": {},
            "static_roles": list(row["static_roles"]), "max_rank_bytes": 0})
        stage["ranks"].append(row["rank"])
        stage["tensors"] += row["tensors"]
        stage["bytes"] += row["bytes"]
        stage["max_rank_bytes"] = max(stage["max_rank_bytes"], row["bytes"])
        for dtype, n in row["bytes_by_dtype"].items():
            stage["bytes_by_dtype"][dtype] = stage["bytes_by_dtype"].get(dtype, 0) + n
    return [stages[s] for s in sorted(stages)]


def imbalance(values: Iterable[int]) -> float:
    """Largest over mean (1.0 is perfect balance; 0 when there is nothing)."""
    numbers = list(values)
    mean = sum(numbers) / len(numbers) if numbers else 0
    return round(max(numbers) / mean, 4) if mean else 0.0


def group_bytes_from_tensors(tensors: Iterable[PlanTensor]) -> Callable[[str], int]:
    """A function giving a group's global bytes, summed over the plan's tensor entries."""
    totals: dict[str, int] = {}
    for t in tensors:
        totals[t.group] = totals.get(t.group, 0) + tensor_bytes(t.dtype, t.shape)
    return lambda name: totals.get(name, 0)


def fallbacks(groups: Iterable[PlanGroup], tensor_parallel_size: int,
              group_bytes: Callable[[str], int]) -> list[dict[str, Any]]:
    """Groups the policy replicated instead of sharding, each with the bytes that costs.

    A fallen-back group is whole on each of the T ranks of each stage that loads it, where a
    sharded one would have been split across them: it costs (T - 1) x its bytes per stage.
    """
    out = []
    for group in groups:
        if group.fell_back_to_replication:
            nbytes = group_bytes(group.name)
            out.append({"group": group.name, "role": group.role,
                        "units": group.logical_units, "stages": list(group.stages),
                        "bytes": nbytes,
                        "extra_bytes": (tensor_parallel_size - 1) * nbytes
                        * len(group.stages)})
    return sorted(out, key=lambda f: f["group"])


def kv_replicated(tensors: Iterable[Mapping[str, Any] | PlanTensor]) -> list[dict[str, Any]]:
    """Groups whose KV heads are repeated across ranks (kv_replicas > 1), one entry per group
    (`tensors`: the plan's, or compile's rows of `group`, `target`, `kv_replicas`)."""
    found: dict[str, dict[str, Any]] = {}
    for t in map(_tensor_row, tensors):
        if int(t.get("kv_replicas", 1)) > 1:
            entry = found.setdefault(t["group"], {"group": t["group"],
                                                  "kv_replicas": t["kv_replicas"], "tensors": []})
            entry["tensors"].append(t["target"])
    return [found[g] for g in sorted(found)]


def tp_reduced(tensors: Iterable[Mapping[str, Any] | PlanTensor]) -> list[dict[str, Any]]:
    """Groups holding norms an engine all-reduces over the TP group (plan.json
    `needs_tp_reduction`), one entry per group with those tensors (`tensors`: the plan's, or
    compile's rows of `group`, `target`, `needs_tp_reduction`)."""
    found: dict[str, dict[str, Any]] = {}
    for t in map(_tensor_row, tensors):
        if t.get("needs_tp_reduction"):
            found.setdefault(t["group"], {"group": t["group"], "tensors": []})["tensors"].append(
                t["target"])
    return [found[g] for g in sorted(found)]


def runtime_state(plan: PlanFile) -> list[dict[str, Any]]:
    """Each rank's declared runtime state (`state:`): its units' state tensors (name, whole and
    local shape, dtype, per sequence or per token, bytes) grouped into runs of consecutive units
    of one group whose tensors are alike, and its totals per sequence and per token; empty when
    none is declared."""
    out = []
    for rank in plan.ranks:
        if not rank.state:
            continue
        units: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for t in rank.state:
            units.setdefault((t.group, t.unit), []).append(
                {"name": t.name, "shape": list(t.shape), "local_shape": list(t.local_shape),
                 "dtype": t.dtype, "per": t.per, "bytes": t.local_bytes})
        runs: list[dict[str, Any]] = []
        for (group, unit), items in units.items():
            last = runs[-1] if runs else None
            if (last is not None and last["group"] == group and last["units"][1] == unit
                    and last["tensors"] == items):
                last["units"][1] = unit + 1
            else:
                runs.append({"group": group, "units": [unit, unit + 1], "tensors": items,
                             "unit_bytes": sum(i["bytes"] for i in items
                                               if i["per"] == "sequence"),
                             "unit_bytes_per_token": sum(i["bytes"] for i in items
                                                         if i["per"] == "token")})
        out.append({"rank": rank.rank, "bytes": rank.info.local_state_bytes,
                    "bytes_per_token": rank.info.local_state_bytes_per_token, "runs": runs})
    return out


def _tensor_row(tensor: Mapping[str, Any] | PlanTensor) -> Mapping[str, Any]:
    """A tensor's group, target, KV replicas and TP reduction as a row."""
    if isinstance(tensor, PlanTensor):
        return {"group": tensor.group, "target": tensor.target,
                "kv_replicas": tensor.kv_replicas,
                "needs_tp_reduction": tensor.needs_tp_reduction}
    return tensor


def plan_summary(plan: PlanFile, group_bytes: Callable[[str], int], *,
                 tensor_table: bool = True) -> dict[str, Any]:
    """Stages, ranks, imbalance and fallbacks of a plan (`tensor_table` false: a plan read
    without its tensors, whose ranks' experts are then not counted); `group_bytes` gives a
    group's global bytes."""
    ranks = rank_rows(plan, tensor_table=tensor_table)
    stages = stage_rows(plan, ranks)
    return {"topology": dict(plan.topology_json),
            "rank_imbalance": imbalance(r["bytes"] for r in ranks),
            "stage_imbalance": imbalance(s["bytes"] for s in stages),
            "stages": stages, "ranks": ranks,
            "fallbacks": fallbacks(plan.groups, plan.shape.tensor_parallel_size, group_bytes)}


def summary(build: Build) -> dict[str, Any]:
    """The whole build in numbers: topology, stages, ranks, fallbacks, KV replication."""
    file = build.file
    return {
        "path": str(file.path.parent), "family": file.family,
        "model_type": file.model_type, "plan_hash": file.plan_hash,
        "sources": [{"name": s.name, "sha256": s.sha256} for s in file.sources],
        "global_bytes": file.tensor_bytes_total(),
        "tensors": len(file.tensors), "groups": len(file.groups),
    } | plan_summary(file, group_bytes_from_tensors(file.tensors)) | {
        "kv_replication": kv_replicated(file.tensors),
        "tp_reduction": tp_reduced(file.tensors), "boundary": boundary_json(file.boundary),
        "cuts": pipeline_cuts(file)} | (
        {} if file.expert_parallel is None
        else {"expert_parallel": expert_summary(file)}) | (
        {} if file.pipeline is None else {"pipeline": pipeline_facts(file)}) | (
        {"state": state} if (state := runtime_state(file)) else {})


def boundary_json(boundary: BoundaryWireSchema) -> dict[str, Any]:
    """A boundary as plan.json writes it (keys sorted)."""
    return {"auxiliary": [_spec_json(a) for a in boundary.auxiliary],
            "identity": boundary.identity, "primary": _spec_json(boundary.primary)}


def _spec_json(spec: Any) -> dict[str, Any]:
    return {"dtype": spec.dtype.value, "role": spec.role, "shape": [d.spell() for d in spec.shape]}


def wire_tensors(boundary: BoundaryWireSchema, activation_dtype: str | None
                 ) -> list[dict[str, Any]]:
    """A boundary's tensors, primary first: kind, role, shape and dtype (`activation` spelt
    with the build's activation dtype when it has one)."""
    rows = []
    for kind, tensor in [("primary", boundary.primary)] + [
            ("auxiliary", t) for t in boundary.auxiliary]:
        dtype = tensor.dtype.value
        rows.append({"kind": kind, "role": tensor.role,
                     "shape": [d.spell() for d in tensor.shape], "dtype": dtype,
                     "wire_dtype": activation_dtype or dtype if dtype == "activation"
                     else dtype})
    return rows


def pipeline_cuts(plan: PlanFile) -> list[dict[str, Any]]:
    """Every pipeline cut, in order: the stages it is between, the execution group whose unit
    ends the stage before it, and the boundary that crosses it (plan.json `cuts` where the
    family declares one per group, else the family's one `boundary`) with its tensors."""
    declared = {c.after_stage: c for c in plan.cuts or ()}
    order = [node.group for node in plan.graph]
    last: dict[int, str] = {}
    for rank in plan.ranks:
        groups = [u.group for u in rank.units]
        if groups:
            last[rank.pipeline_stage] = max(
                groups, key=lambda g: order.index(g) if g in order else -1)
    activation = plan.topology.activation_dtype
    out = []
    for stage in range(plan.shape.pipeline_parallel_size - 1):
        cut = declared.get(stage)
        boundary = cut.boundary if cut is not None else plan.boundary
        out.append({"from_stage": stage, "to_stage": stage + 1,
                    "group": cut.group if cut is not None else last.get(stage),
                    "boundary": boundary.identity,
                    "tensors": wire_tensors(boundary, activation)})
    return out


def pipeline_facts(plan: PlanFile) -> dict[str, Any]:
    """plan.json's `pipeline` (a multi-group graph's stage choice) with its group modes in the
    graph's order, vision before decoder (the plan keeps them sorted by name)."""
    assert plan.pipeline is not None
    pipeline = plan.pipeline
    modes = dict(pipeline.group_modes)
    order = [node.group for node in plan.graph if node.group in modes]
    return {"balance": pipeline.balance,
            "group_modes": {g: modes[g] for g in order + sorted(set(modes) - set(order))},
            "imbalance": pipeline.imbalance, "layout": pipeline.layout,
            "stage_bytes": list(pipeline.stage_bytes)}


def expert_summary(plan: PlanFile) -> dict[str, Any]:
    """An expert-parallel build's layout: E, X, N and each EP rank's experts and build ranks."""
    ep = plan.expert_parallel
    assert ep is not None
    n, x = ep.ranks_per_stage, ep.expert_tensor_parallel_size
    return {"expert_parallel_size": ep.expert_parallel_size,
            "expert_tensor_parallel_size": x, "ranks_per_stage": n, "experts": ep.experts,
            "explicit_placement": ep.explicit_placement,
            "redundant_slots": ep.redundant_slots, "layout": ep.layout,
            "ep_ranks": [{"ep_rank": e, "experts": list(ids),
                          "ranks": [r.rank for r in plan.ranks if (r.rank % n) // x == e]}
                         for e, ids in enumerate(ep.slots)]}


def tensor_rows(build: Build, *, rank: int | None = None, group: str | None = None,
                target: str | None = None,
                origins: FamilyLines | None = None) -> list[dict[str, Any]]:
    """The tensors selected by rank, group glob and target glob, one row per (tensor, rank),
    each with the family line of its own entry (`origins`)."""
    world = build.file.shape.build_world_size
    if rank is not None and not 0 <= rank < world:
        raise LoadError(f"--rank {rank} is not a rank of this build: it has ranks 0 to "
                        f"{world - 1}")
    wanted_ranks = [r for r in build.file.ranks if rank is None or r.rank == rank]
    tensors = build.file.tensors
    names = {"group": [t.group for t in tensors], "target": [t.target for t in tensors]}
    for option, glob, key, other in (("--group", group, "group", "target"),
                                     ("--target", target, "target", "group")):
        if glob is None or any(fnmatch.fnmatchcase(n, glob) for n in names[key]):
            continue
        kind = "group" if key == "group" else "checkpoint tensor"
        if any(fnmatch.fnmatchcase(n, glob) for n in names[other]):
            hint = (f"it matches {'checkpoint tensor names' if other == 'target' else 'groups'}"
                    f": use --{other}")
        else:
            hint = names_hint(sorted(set(names[key])), glob)
        raise LoadError(f"{option} {glob!r} matches no {kind} of this build; {hint}",
                        location=SourceLocation(str(build.path)))
    rows = []
    for t in tensors:
        if group is not None and not fnmatch.fnmatchcase(t.group, group):
            continue
        if target is not None and not fnmatch.fnmatchcase(t.target, target):
            continue
        for r in wanted_ranks:
            held = rank_placement(build.file, r, t)
            if held is None:
                continue
            placement, shape = held
            rows.append({"rank": r.rank, "target": t.target, "group": t.group,
                         "dtype": t.dtype, "global_shape": list(t.shape),
                         "local_shape": list(shape), "placement": placement_text(placement),
                         "kv_replicas": t.kv_replicas,
                         "needs_tp_reduction": t.needs_tp_reduction,
                         "origin": None if origins is None else origins.tensor(t.target,
                                                                                t.group)})
    return rows


def names_hint(names: Sequence[str], glob: str) -> str:
    """What a glob that matched nothing could have said: the closest names, or the first few."""
    import difflib

    close = difflib.get_close_matches(glob, names, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(repr(n) for n in close) + "?"
    shown = names[:6]
    return (f"it has {len(names)}, e.g. " + ", ".join(repr(n) for n in shown)
            + (" ..." if len(names) > len(shown) else ""))


def byte_text(n: float) -> str:
    """Bytes in binary units with three significant digits: `7.41 GiB`, `99.5 KiB`; 1000 to
    1023 of a unit are whole numbers (`1000 KiB`, `1023 KiB`), as `ls -h` writes them, and
    what rounds to 1024 is the next unit (`1 MiB`)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        text = f"{int(n)}" if unit == "B" else f"{n:.3g}" if abs(n) < 999.5 else f"{n:.0f}"
        if abs(float(text)) < 1024 or unit == "TiB":
            return f"{text} {unit}"
        n /= 1024
    return f"{n} TiB"  # pragma: no cover - the loop always returns


FALLBACK_ROLE = "fallback"
"""The role name `rank_role_bytes` gives the bytes of groups the policy replicated."""


def rank_role_bytes(plan: PlanFile) -> list[dict[str, int]]:
    """Per rank (by global rank), its local bytes by group role; fallen-back groups' bytes are
    counted under FALLBACK_ROLE."""
    roles = {g.name: FALLBACK_ROLE if g.fell_back_to_replication else g.role
             for g in plan.groups}
    out: list[dict[str, int]] = [{} for _ in plan.ranks]
    for t in plan.tensors:
        role = roles[t.group]
        for i, rank in enumerate(plan.ranks):
            held = rank_placement(plan, rank, t)
            if held is None:
                continue
            row = out[i]
            row[role] = row.get(role, 0) + tensor_bytes(t.dtype, held[1])
    return out


def unit_columns(plan: PlanFile) -> list[dict[str, Any]]:
    """The columns of an ownership map: every execution unit (graph order), then every static
    role; each with the global ranks that own it."""
    columns: list[dict[str, Any]] = []
    for node in plan.graph:
        for unit, path in enumerate(node.unit_paths):
            owners = [r.rank for r in plan.ranks if any(
                u.group == node.group and u.start <= unit < u.end for u in r.units)]
            columns.append({"label": f"{node.group} {unit}", "path": path, "kind": "unit",
                            "owners": owners})
    for role in plan.static_roles:
        owners = [r.rank for r in plan.ranks if role.role in r.static_roles]
        columns.append({"label": role.role, "path": f"static role ({role.spell()})",
                        "kind": "static", "owners": owners})
    return columns
