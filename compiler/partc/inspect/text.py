"""Human tables for inspect and explain: aligned columns, totals, one line per fact."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec

from partc.errors import plural, terminal_safe
from partc.inspect.plan_summary import byte_text, topology_text

_P = ParamSpec("_P")


def _terminal_safe_lines(render: Callable[_P, list[str]]) -> Callable[_P, list[str]]:
    """`render` with every control character of its lines escaped (`terminal_safe`): the names
    it shows come from a plan or a checkpoint header, which may have been tampered with."""
    @functools.wraps(render)
    def escaped(*args: _P.args, **kwargs: _P.kwargs) -> list[str]:
        return [terminal_safe(line) for line in render(*args, **kwargs)]
    return escaped


def table(header: Sequence[str], rows: Sequence[Sequence[object]], *,
          right: Sequence[bool] | None = None) -> list[str]:
    """Columns padded to their widest cell; `right` marks right-aligned (numeric) columns."""
    cells = [[terminal_safe(str(c)) for c in header]] + [[terminal_safe(str(c)) for c in row]
                                                         for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    align = right or [False] * len(header)
    out = []
    for row in cells:
        out.append("  ".join(c.rjust(w) if a else c.ljust(w)
                             for c, w, a in zip(row, widths, align, strict=True)).rstrip())
    return out


def _dtypes(by_dtype: Mapping[str, int]) -> str:
    return ", ".join(f"{d} {byte_text(n)}" for d, n in sorted(by_dtype.items())) or "-"


_NUMBER = re.compile(r"\d+")


def id_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Ids, in the order given, as (first, last) runs of consecutive numbers."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(a, b) for a, b in runs]


def _numbers_text(numbers: Sequence[int]) -> str:
    """Sorted distinct numbers as runs: `0..31`, `0..3,5,7..9`."""
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in id_runs(sorted(set(numbers))))


def _by_pattern(entries: Sequence[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], object]
                ) -> list[tuple[str, list[Mapping[str, Any]]]]:
    """Entries whose group names differ only in their first number (the layer) and whose `key`
    agrees, as one `layers.{0..31}.attention` line each, in the order of their first entry."""
    found: dict[tuple[str, object], tuple[list[int], list[Mapping[str, Any]]]] = {}
    for entry in entries:
        name = entry["group"]
        match = _NUMBER.search(name)
        pattern = name if match is None else name[:match.start()] + "{}" + name[match.end():]
        numbers, members = found.setdefault((pattern, key(entry)), ([], []))
        numbers.extend([] if match is None else [int(match.group())])
        members.append(entry)
    out = []
    for (pattern, _), (numbers, members) in found.items():
        if len(members) == 1:
            out.append((members[0]["group"], members))
        else:
            out.append((pattern.replace("{}", "{" + _numbers_text(numbers) + "}")
                        + f" ({len(members)} groups)", members))
    return out


def fallback_lines(fallbacks: Sequence[Mapping[str, Any]],
                   kv: Sequence[Mapping[str, Any]],
                   reduced: Sequence[Mapping[str, Any]] = ()) -> list[str]:
    """One line per policy fallback (with its extra bytes), per KV-replicated group and per
    group with norms all-reduced over the TP group; groups that differ only in their layer
    number share a line (`layers.{0..31}.attention (32 groups)`), with totals where they add."""
    out = []
    if fallbacks:
        extra = sum(f["extra_bytes"] for f in fallbacks)
        out.append(f"fallbacks: {len(fallbacks)} group(s) replicated by the policy instead of "
                   f"sharded, {byte_text(extra)} extra in all")
        for name, members in _by_pattern(fallbacks, lambda f: f["role"]):
            stages = sorted({s for f in members for s in f["stages"]})
            out.append(f"  {name} ({members[0]['role']}): "
                       f"{byte_text(sum(f['bytes'] for f in members))} "
                       f"on every rank of stage(s) {','.join(map(str, stages))}, "
                       f"+{byte_text(sum(f['extra_bytes'] for f in members))}")
    if kv:
        out.append(f"KV replication: {len(kv)} group(s) repeat KV heads across ranks")
        for name, members in _by_pattern(kv, lambda k: (k["kv_replicas"], len(k["tensors"]))):
            each = " each" if len(members) > 1 else ""
            out.append(f"  {name}: each KV head on {members[0]['kv_replicas']} ranks "
                       f"({plural(len(members[0]['tensors']), 'tensor')}{each})")
    if reduced:
        count = sum(len(r["tensors"]) for r in reduced)
        out.append(f"TP reduction: {count} norm(s) in {len(reduced)} group(s) are split with a "
                   "projection's output and all-reduced over the TP group (plan.json "
                   "`needs_tp_reduction`; `partc explain` says why)")
        for name, members in _by_pattern(
                reduced, lambda r: tuple(_NUMBER.sub("{}", t, count=1) for t in r["tensors"])):
            tensors = members[0]["tensors"]
            if len(members) > 1:
                tensors = [_NUMBER.sub("{}", t, count=1) for t in tensors]
            out.append(f"  {name}: " + ", ".join(tensors))
    return out


def stage_lines(stages: Sequence[Mapping[str, Any]], *, imbalance: float | None = None
                ) -> list[str]:
    """The per-stage table."""
    rows = [(s["pipeline_stage"], ",".join(map(str, s["ranks"])), s["units"], s["tensors"],
             byte_text(s["bytes"]), byte_text(s["max_rank_bytes"]), _dtypes(s["bytes_by_dtype"]),
             ", ".join(s["static_roles"]) or "-") for s in stages]
    out = table(("stage", "ranks", "units", "tensors", "bytes", "max/rank", "by dtype",
                 "static roles"), rows, right=(True, False, False, True, True, True, False,
                                               False))
    if imbalance is not None:
        out.append(f"stage imbalance (largest / mean bytes): {imbalance:.3f}")
    return out


def pipeline_lines(pipeline: Mapping[str, Any] | None) -> list[str]:
    """How a multi-group graph's stages were chosen (nothing for a single-group one): the
    layout in the notation `--pp-layers` accepts, and every group's parallel mode."""
    if not pipeline:
        return []
    modes = ", ".join(f"{g} {m}" for g, m in pipeline["group_modes"].items())
    how = ("as --pp-layers gives it" if pipeline["balance"] == "explicit"
           else f"balanced by {pipeline['balance']}")
    return [f"pipeline layout ({how}): {pipeline['layout']}", f"group modes: {modes}"]


@_terminal_safe_lines
def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The whole build: header, stages, ranks, fallbacks."""
    topology = summary["topology"]
    out = [f"build {summary['path']}: {summary['family']} ({summary['model_type']}) at "
           f"{topology_text(topology)}, plan {summary['plan_hash'][:16]}",
           f"{summary['tensors']} tensors in {summary['groups']} groups, "
           f"{byte_text(summary['global_bytes'])} in the checkpoint; policy "
           f"{topology.get('policy') or 'the family default'}", ""]
    out += stage_lines(summary["stages"], imbalance=summary["stage_imbalance"])
    out += pipeline_lines(summary.get("pipeline"))
    out.append("")
    experts = summary.get("expert_parallel")
    etp = experts is not None and experts["expert_tensor_parallel_size"] > 1
    header, right = expert_columns(("rank", "stage", "tp"), experts is not None, etp)
    rows = [rank_coordinates((r["rank"], r["pipeline_stage"], r["tensor_parallel_rank"]), r,
                             etp)
            + [r["units"], r["tensors"], byte_text(r["bytes"]), _dtypes(r["bytes_by_dtype"]),
               ", ".join(r["static_roles"]) or "-"]
            + ([] if experts is None else [expert_ids_text(r.get("experts", [])),
                                           byte_text(r.get("expert_bytes", 0))])
            for r in summary["ranks"]]
    header += ["units", "tensors", "bytes", "by dtype", "static roles"]
    right += [False, True, True, False, False]
    if experts is not None:
        header += ["experts", "expert bytes"]
        right += [False, True]
    out += table(header, rows, right=right)
    out.append(f"rank imbalance (largest / mean bytes): {summary['rank_imbalance']:.3f}")
    out += cut_lines(summary.get("cuts", ()))
    out += state_lines(summary.get("state", ()))
    extra = fallback_lines(summary["fallbacks"], summary["kv_replication"],
                           summary.get("tp_reduction", ()))
    out += [""] + (extra or ["fallbacks: none; KV replication: none"])
    if experts is not None:
        out += ["", f"expert parallelism: E={experts['expert_parallel_size']} x "
                f"X={experts['expert_tensor_parallel_size']} = {experts['ranks_per_stage']} "
                f"ranks per stage; {plural(experts['experts'], 'expert')}, "
                f"{'explicit' if experts['explicit_placement'] else 'balanced'} placement, "
                f"{plural(experts['redundant_slots'], 'redundant slot')}; {experts['layout']}"]
        out += table(("EP rank", "experts", "build ranks"),
                     [(e["ep_rank"], id_ranges(e["experts"]),
                       ",".join(str(r) for r in e["ranks"])) for e in experts["ep_ranks"]],
                     right=(True, False, False))
        if any(not r.get("experts") for r in summary["ranks"]):
            out.append("a rank whose experts are `-` is on a stage without MoE layers: it "
                       "holds no expert")
    return out


def _state_bytes(per_sequence: int, per_token: int) -> str:
    """`2.5 KiB`, `64 B/token` or `2.5 KiB + 64 B/token`."""
    parts = ([byte_text(per_sequence)] if per_sequence or not per_token else []) + (
        [f"{byte_text(per_token)}/token"] if per_token else [])
    return " + ".join(parts)


def state_lines(state: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each rank's declared runtime state: one row per run of alike units, its tensors' local
    shapes (of the whole shape), dtypes and `/token` for a per-token one, bytes per unit and in
    all (per sequence, `+ N/token` for the per-token ones)."""
    if not state:
        return []
    rows = []
    for rank in state:
        for i, run in enumerate(rank["runs"]):
            start, end = run["units"]
            units = f"{run['group']}[{start}]" if end == start + 1 else (
                f"{run['group']}[{start}:{end}]")
            tensors = ", ".join(
                f"{t['name']} {_shape_text(t['local_shape'])}"
                + ("" if t["local_shape"] == t["shape"] else f" of {_shape_text(t['shape'])}")
                + f" {t['dtype']}" + ("/token" if t["per"] == "token" else "")
                for t in run["tensors"])
            rows.append((rank["rank"] if i == 0 else "", units, tensors,
                         _state_bytes(run["unit_bytes"], run["unit_bytes_per_token"]),
                         _state_bytes(rank["bytes"], rank["bytes_per_token"]) if i == 0 else ""))
    return ["", "runtime state (declared `state:`), as each rank allocates it per sequence"] + (
        table(("rank", "units", "tensors (local of whole shape)", "per unit", "rank total"),
              rows, right=(True, False, False, True, True)))


def expert_columns(head: Sequence[str], experts: bool, etp: bool
                   ) -> tuple[list[str], list[bool]]:
    """A rank table's coordinate columns (`head`, right-aligned) and, under expert parallelism,
    `ep` (and `etp` when experts are split, X > 1)."""
    header = list(head) + (["ep"] if experts else []) + (["etp"] if etp else [])
    return header, [True] * len(header)


def rank_coordinates(head: Sequence[object], info: Mapping[str, Any], etp: bool
                     ) -> list[object]:
    """A rank row's coordinate cells: `head`, then its EP (and ETP) rank when `info` has them."""
    cells = list(head)
    if "expert_parallel_rank" in info:
        cells.append(info["expert_parallel_rank"])
        if etp:
            cells.append(info["expert_tensor_parallel_rank"])
    return cells


def expert_ids_text(ids: Sequence[int]) -> str:
    """A rank's experts as `4: 0-3` (count, then id runs), `-` for none."""
    return f"{len(ids)}: {id_ranges(ids)}" if ids else "-"


def _shape_text(shape: Sequence[object]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def cut_lines(cuts: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pipeline cuts, one paragraph per boundary: the cuts it crosses (stages and the group
    before each) and its tensors (nothing for a build of one stage)."""
    if not cuts:
        return []
    paragraphs: dict[str, list[Mapping[str, Any]]] = {}
    for cut in cuts:
        key = repr((cut["boundary"], cut["tensors"]))
        paragraphs.setdefault(key, []).append(cut)
    out = ["", f"pipeline cuts: {plural(len(cuts), 'cut')}, each with the boundary that "
           "crosses it"]
    for same in paragraphs.values():
        where = ", ".join(f"stage {c['from_stage']} -> {c['to_stage']}"
                          + (f" (after `{c['group']}`)" if c.get("group") else "") for c in same)
        out.append(f"  {where}: {same[0]['boundary']}")
        rows = [(f"    {t['kind']}", t["role"], _shape_text(t["shape"]),
                 t["dtype"] if t["dtype"] == t["wire_dtype"]
                 else f"{t['dtype']} ({t['wire_dtype']})") for t in same[0]["tensors"]]
        out += table(("    tensor", "role", "shape", "dtype"), rows)
    return out


def id_ranges(ids: Sequence[int]) -> str:
    """Expert ids as runs: `0-3,8,10-11`."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in id_runs(ids))


@_terminal_safe_lines
def tensor_lines(rows: Sequence[Mapping[str, Any]], note: str) -> list[str]:
    """The tensor table of `inspect --rank/--group/--target`."""
    body = [(r["rank"], r["target"], r["dtype"], r["global_shape"], r["local_shape"],
             r["placement"] + (f" (KV x{r['kv_replicas']})" if r["kv_replicas"] > 1 else "")
             + (" (TP all-reduce)" if r.get("needs_tp_reduction") else ""),
             r["origin"] or "?") for r in rows]
    out = table(("rank", "tensor", "dtype", "global shape", "local shape", "placement",
                 "family line"), body, right=(True, False, False, False, False, False, False))
    out.append(f"{len(rows)} row(s); family lines: {note}")
    return out


@_terminal_safe_lines
def inventory_lines(inv: Mapping[str, Any]) -> list[str]:
    """The collapsed checkpoint inventory."""
    out = [f"checkpoint {inv['path']}: {inv['tensors']} tensors in {len(inv['files'])} file(s), "
           f"{byte_text(inv['bytes'])} ({_dtypes(inv['bytes_by_dtype'])})", ""]
    rows = [(e["pattern"], e["shape"], e["dtype"], f"x{e['count']}",
             " ".join(f"{k}={v}" for k, v in e["ranges"].items()), byte_text(e["bytes"]))
            for e in inv["entries"]]
    out += table(("name", "shape", "dtype", "count", "numbers", "bytes"), rows,
                 right=(False, False, False, True, False, True))
    return out


def _family_line(e: Mapping[str, Any]) -> str:
    """Where `explain`'s subject is declared: a tensor's own entry (and its group's line when
    that differs), a group's declaration, or why that is unknown."""
    group: str | None = e["origin"]
    own: str | None = next((t.get("origin") for t in e["tensors"]
                            if t["target"] == e["target"]), None)
    if own and own != group:
        return own + (f" (group at {group})" if group else "")
    return group or own or f"? ({e['origin_note']})"


@_terminal_safe_lines
def explain_lines(e: Mapping[str, Any]) -> list[str]:
    """What `partc explain` prints: one explanation, or each of a glob's matches in turn."""
    if "matches" not in e:
        return _explained_lines(e)
    matches = e["matches"]
    what = "tensor" if all(m["target"] != m["group"] for m in matches) else "name"
    out = [f"`{e['pattern']}` matches {plural(len(matches), what)}"]
    for m in matches:
        out += [""] + _explained_lines(m)
    return out


def _explained_lines(e: Mapping[str, Any]) -> list[str]:
    owner = e["owner"]
    who = (f"unit {owner.get('unit')} of `{owner.get('group')}`" if owner.get("kind") ==
           "execution_unit" else f"static role {', '.join(owner.get('roles', []))}")
    out = [f"{e['target']}",
           f"  group   {e['group']}",
           f"  role    {e['role']}" + ("  (FELL BACK TO REPLICATION)"
                                       if e["fell_back_to_replication"] else ""),
           f"  owner   {who}; stage(s) {', '.join(map(str, e['stages']))}",
           f"  units   {e['logical_units'] if e['logical_units'] is not None else '-'}",
           f"  family  {_family_line(e)}"]
    for t in e["tensors"]:
        out.append(f"  tensor  {t['target']}  {t['dtype']} {t['shape']}"
                   + (f"  KV x{t['kv_replicas']}" if t["kv_replicas"] > 1 else ""))
    out.append("")
    size = e.get("expert_tensor_parallel_size")
    header, right = expert_columns(("rank", "stage", "tp"), size is not None, (size or 1) > 1)
    rows = []
    for r in e["ranks"]:
        logical = r["logical_range"]
        for m in r["tensors"]:
            rows.append(rank_coordinates((r["rank"], r["pipeline_stage"],
                                          r["tensor_parallel_rank"]), r, (size or 1) > 1)
                        + ["-" if logical is None else f"{logical[0]}:{logical[1]}",
                           m["target"], m["placement"],
                           "-" if m["local_shape"] is None else m["local_shape"]])
    out += table(header + ["units", "tensor", "placement", "local shape"], rows,
                 right=right + [False, False, False, False])
    out += ["", "why:"] + [f"  - {w}" for w in e["why"]]
    return out
