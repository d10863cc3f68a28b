"""Why one tensor (or group) of a build is split the way it is."""

from __future__ import annotations

import fnmatch
from typing import Any

from partc.errors import LoadError, SourceLocation, plural
from partc.inspect.origins import Origins
from partc.inspect.plan_summary import Build, names_hint, placement_text, rank_placement
from partc.plan.plan_records import ExpertParallelLayout, PlanGroup, PlanTensor


def _suggest(name: str, names: list[str]) -> str:
    """The closest name, preferring those that end as `name` does (its module and parameter:
    `model.layers.0.q_proj.weight` is `...self_attn.q_proj.weight`, not `...mlp.up_proj.weight`,
    which a plain character match finds closer)."""
    import difflib

    tail = ".".join(name.split(".")[-2:])
    ending = [n for n in names if n == tail or n.endswith("." + tail)]
    close = difflib.get_close_matches(name, ending, n=1, cutoff=0.3) if ending else []
    close = close or difflib.get_close_matches(name, names, n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _reasons(build: Build, group: PlanGroup, tensors: list[PlanTensor],
             origin: str | None, own: str | None) -> list[str]:
    """The causes behind a group's split, each a sentence; `origin` is the group's family line,
    `own` the line of the entry declaring the one tensor explained (None: a group is)."""
    tp = build.tensor_parallel_size
    policy = build.file.topology.policy
    why = []
    if group.fell_back_to_replication:
        reason = group.fallback_reason
        by = ("--policy replicate-unsupported" if policy else
              "the family's policy replicate_unsupported")
        why.append(f"policy fallback: the group could not be sharded over TP={tp}"
                   + (f": {reason}." if reason else ";") + f" {by[0].upper()}{by[1:]} "
                   "replicated it on every rank of its stages instead of failing")
    elif group.role == "replicated":
        why.append("role `replicated`: every rank of the stage loads it whole")
    units = group.logical_units
    experts = build.file.expert_parallel
    if experts is not None and group.name in experts.expert_groups:
        why.append(_expert_reason(experts, experts.expert_groups[group.name]))
        tp, split = experts.expert_tensor_parallel_size, "ETP"
    else:
        split = "TP"
    if units and group.logical_ranges:
        sizes = [b - a for a, b in group.logical_ranges]
        if len(set(sizes)) > 1:
            rule = ("torch.chunk ranges (--split chunk)" if build.file.topology.split == "chunk"
                    else "balanced contiguous ranges")
            why.append(f"{units} units do not divide evenly by {split}={tp}: {rule} of "
                       f"{', '.join(map(str, sizes))} units")
        else:
            why.append(f"{units} units split evenly over {split}={tp}: {sizes[0]} per rank")
    for t in tensors:
        holders = [i for i, p in enumerate(t.placements) if p[0] != "omit"]
        if len(holders) < len(t.placements):
            why.append(f"per head: `{t.target}` belongs to one head; TP rank"
                       f"{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))} "
                       "hold that head and load it whole, the others do not load it "
                       "(`sharding: per_head`)")
        if t.needs_tp_reduction:
            why.append(f"TP reduction: `{t.target}` is a norm over a split projection's whole "
                       "output, split with it; its statistic spans every rank's piece, so an "
                       "engine all-reduces the sum of squares over the TP group before scaling "
                       "(`reduction: tensor_parallel`)")
        if t.kv_replicas > 1:
            why.append(f"KV replication: `{t.target}` has fewer KV heads than TP={tp} ranks; "
                       f"each KV head is repeated on {t.kv_replicas} ranks "
                       "(`partc docs kv_replication`)")
            continue  # its cuts follow the repeated heads, not the unit boundaries
        placements = t.placements
        logical = group.logical_ranges
        if units and logical and placements and all(p[0] == "range" for p in placements):
            axis = int(placements[0][1])
            per_unit = t.shape[axis] / units
            expected = [[a * per_unit, b * per_unit] for a, b in logical]
            actual = [[int(p[2]), int(p[3])] for p in placements]
            if actual != expected:
                why.append(f"`{t.target}`: cuts {actual} on axis {axis} differ from the unit "
                           f"boundaries {[[int(a), int(b)] for a, b in expected]}: the ranges "
                           "are aligned to blocks (quantization) or heads")
    if own and own != origin:
        why.append(f"declared at {own}" + (f" (its group `{group.name}` at {origin})"
                                           if origin else ""))
    elif origin:
        why.append(f"declared at {origin}")
    return why


def _expert_reason(experts: ExpertParallelLayout, expert: int | None) -> str:
    """Why an expert group is on the ranks it is on (docs/expert_parallel.md)."""
    size = f"E={experts.expert_parallel_size}, X={experts.expert_tensor_parallel_size}"
    how = "an explicit placement" if experts.explicit_placement else "the balanced placement"
    if expert is None:
        return (f"expert parallelism ({size}): a stacked expert tensor; each EP rank loads the "
                f"rows of the experts in its slots ({how})")
    holders = [f"EP rank {ep} slot {slot}" for ep, ids in enumerate(experts.slots)
               for slot, held in enumerate(ids) if held == expert]
    copies = f", {len(holders)} copies" if len(holders) > 1 else ""
    return (f"expert parallelism ({size}): expert {expert} is placed on {', '.join(holders)} by "
            f"{how}{copies}; only the ranks of those EP ranks load it")


def _glob_hint(glob: str, names: list[str], shown: list[str]) -> str:
    """The names closest to a glob that matched nothing, dotted part by dotted part (a part
    the glob's own part matches counts whole): `model.layers.0.*.q_prj.weight` is closest to
    `model.layers.0.self_attn.q_proj.weight`; else the closest of `shown` by characters."""
    import difflib

    parts = glob.split(".")
    scored = []
    for name in names:
        pieces = name.split(".")
        if len(pieces) != len(parts):
            continue
        score = sum(1.0 if fnmatch.fnmatchcase(piece, part) else difflib.SequenceMatcher(
            None, part.strip("*?"), piece).ratio() for piece, part in zip(pieces, parts,
                                                                          strict=True))
        scored.append((-score / len(parts), name))
    close = [name for score, name in sorted(scored) if -score >= 0.75][:3]
    if close:
        return "did you mean " + " or ".join(repr(n) for n in close) + "?"
    return names_hint(shown, glob)


GLOB_CHARACTERS = frozenset("*?[")
"""Characters that make `explain`'s subject a glob (fnmatch, as inspect's --target)."""


def explain(build: Build, target: str, origins: Origins) -> dict[str, Any]:
    """What `partc explain` says of `target`: a tensor's or group's explanation
    (`explain_one`), or for a glob matching no exact name, every tensor it matches (else every
    group), in the plan's order, as `{"pattern": glob, "matches": [...]}`."""
    tensors = [t.target for t in build.file.tensors]
    groups = [g.name for g in build.file.groups]
    if target in tensors or target in groups or not GLOB_CHARACTERS & set(target):
        return explain_one(build, target, origins)
    matched = [t for t in tensors if fnmatch.fnmatchcase(t, target)] or [
        g for g in groups if fnmatch.fnmatchcase(g, target)]
    if not matched:
        raise LoadError(f"`{target}` matches no tensor and no group of this build "
                        f"({plural(len(tensors), 'tensor')}, {plural(len(groups), 'group')}); "
                        + _glob_hint(target, tensors + groups, tensors),
                        location=SourceLocation(str(build.path)))
    return {"pattern": target, "matches": [explain_one(build, name, origins)
                                           for name in matched]}


def explain_one(build: Build, target: str, origins: Origins) -> dict[str, Any]:
    """Group, role, units, each rank's range and placement of a tensor or group, and why; the
    family line of the group (`origin`) and of each tensor's own entry."""
    plan = build.file
    groups = plan.groups_by_name()
    by_target = {t.target: t for t in plan.tensors}
    if target in by_target:
        group = groups[by_target[target].group]
        tensors = [by_target[target]]
    elif target in groups:
        group = groups[target]
        tensors = [t for t in plan.tensors if t.group == target]
    else:
        raise LoadError(f"`{target}` is neither a tensor nor a group of this build"
                        + _suggest(target, sorted(by_target) + sorted(groups)))
    experts = plan.expert_parallel
    expert_groups = experts.expert_groups if experts is not None else {}
    ranks = []
    for rank in plan.ranks:
        if rank.pipeline_stage not in group.stages:
            continue
        tp_rank = rank.tensor_parallel_rank
        held = [rank_placement(plan, rank, t) for t in tensors]
        if all(h is None for h in held):  # an expert this rank's EP slots do not hold
            continue
        ranges = group.logical_ranges or ()
        row = (int(rank.info.expert_tensor_parallel_rank or 0) if group.name in expert_groups
               else tp_rank)  # a per-expert group's units are split over its ETP group
        logical = list(ranges[row]) if row < len(ranges) else None
        members = []
        for t, h in zip(tensors, held, strict=True):
            members.append({"target": t.target,
                            "placement": "not held" if h is None else placement_text(h[0]),
                            "local_shape": None if h is None else list(h[1])})
        entry = {"rank": rank.rank, "tensor_parallel_rank": tp_rank,
                 "pipeline_stage": rank.pipeline_stage, "logical_range": logical,
                 "tensors": members}
        if experts is not None:
            entry |= {"expert_parallel_rank": rank.info.expert_parallel_rank,
                      "expert_tensor_parallel_rank": rank.info.expert_tensor_parallel_rank}
        ranks.append(entry)
    origin = origins.lines.get(group.name)
    lines = {t.target: origins.lines.tensor(t.target, group.name) for t in tensors}
    own = lines[target] if target in by_target else None
    return {"target": target, "group": group.name, "role": group.role,
            "expert_tensor_parallel_size": None if experts is None
            else experts.expert_tensor_parallel_size,
            "owner": group.owner_json(), "stages": list(group.stages),
            "logical_units": group.logical_units,
            "fell_back_to_replication": group.fell_back_to_replication,
            "tensors": [{"target": t.target, "dtype": t.dtype, "shape": list(t.shape),
                         "kv_replicas": t.kv_replicas,
                         "needs_tp_reduction": t.needs_tp_reduction,
                         "origin": lines[t.target]}
                        for t in tensors],
            "ranks": ranks, "origin": origin, "origin_note": origins.note,
            "why": _reasons(build, group, tensors, origin, own)}
