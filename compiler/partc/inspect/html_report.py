"""`partc report`: one self-contained HTML page of a build (inline SVG, no network, no script).

Every coordinate, label and colour is computed here; the template only arranges them. The page
has its own strict jinja2 environment with HTML autoescaping (emit's renders Python, unescaped).

The page scales with the build's structure, not its rank count: ranks that own the same units
share one row of the ownership map, ranks that hold the same bytes by role one bar, ranks that
hold the same experts one card, each row saying which ranks and how many (`ranks 8–15 ×8`).
Every rank, one line each, stays in a closed `<details>` table. Labels are placed only where
their estimated width fits, so no two overlap; the rest are said in the notes under each map.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import jinja2

from partc import __version__
from partc.errors import plural
from partc.inspect.origins import Origins
from partc.inspect.plan_summary import (
    FALLBACK_ROLE,
    Build,
    byte_text,
    placement_text,
    rank_placement,
    summary,
    topology_text,
    unit_columns,
    wire_tensors,
)
from partc.inspect.text import id_ranges, id_runs
from partc.parallel.placements import tensor_bytes
from partc.parallel.shape import ParallelShape
from partc.plan.plan_records import PlanFile, PlanRank, PlanTensor

STAGE_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7",
                 "#000000")
"""Fill of an owned cell, by pipeline stage (cycled): Okabe and Ito's colour-blind-safe set
(orange, sky blue, bluish green, yellow, blue, vermillion, reddish purple, black)."""
ROLE_COLOURS = {"vocabulary": "#332288", "attention_heads": "#88CCEE",
                "feed_forward_intermediate": "#44AA99", "expert_intermediate": "#117733",
                "column_projection": "#DDCC77", "row_projection": "#999933",
                "channels": "#AA4499", "segmented": "#882255", "replicated": "#DDDDDD",
                FALLBACK_ROLE: "#CC6677"}
"""Fill of each role's segment in the byte bars: Paul Tol's colour-blind-safe "muted" scheme
(nine colours and its pale grey), no colour of STAGE_COLOURS; fallbacks are rose, outlined."""
OTHER_ROLE_COLOUR = "#777777"
"""Fill of a role the table above does not name."""
FREE_COLOUR = "#F2F2F2"
"""Fill of a cell the ranks of a row do not own."""
PAGE_WIDTH = 1180
"""Pixels of the widest figure (the page fits a 1280 px window without scrolling sideways)."""
LABEL_WIDTH = 280
"""Pixels left of the map and the bars for row labels."""
FONT = 11.0
"""Font size of the figures' labels, in pixels."""
SMALL = 10.0
"""Font size of the second line of a row label."""


@dataclass(frozen=True, slots=True)
class Rect:
    """One SVG rectangle with its tooltip."""

    x: float
    """Left."""
    y: float
    """Top."""
    width: float
    """Width."""
    height: float
    """Height."""
    fill: str
    """Fill colour."""
    css: str
    """Class names."""
    title: str
    """Tooltip text."""


@dataclass(frozen=True, slots=True)
class Label:
    """One SVG text, horizontal."""

    x: float
    """Anchor x."""
    y: float
    """Baseline y."""
    text: str
    """The text."""
    css: str = "label"
    """Class names (`small` for the second line of a row label)."""
    anchor: str = "start"
    """SVG text-anchor: start, middle or end."""


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a figure: a set of ranks that hold the same thing, with what it draws."""

    y: float
    """Top."""
    ranks: str
    """Every rank of the row as id runs (`8-15,24-31`)."""
    count: int
    """How many ranks the row stands for."""
    stages: str
    """Their pipeline stages (`1`, `1–6`)."""
    labels: tuple[Label, ...]
    """Texts of the row."""
    rects: tuple[Rect, ...]
    """Rectangles of the row."""


# ---------------------------------------------------------------- text and geometry


def text_width(text: str, size: float = FONT) -> float:
    """A generous estimate of a text's width in pixels in a sans-serif font of `size` pixels
    (DejaVu Sans's advance widths, rounded up), so that labels placed by it never overlap."""
    wide, narrow = set("mwMW@%"), set(" .,:;'|!ilIjft()[]·")
    total = 0.0
    for c in text:
        total += 0.92 if c in wide else 0.34 if c in narrow else 0.72 if c.isupper() else (
            0.8 if c in "×…" else 0.6)
    return total * size


def fit(text: str, width: float, size: float = FONT) -> str:
    """`text`, shortened with `…` until its estimated width fits `width` (empty if not even
    one character does)."""
    if text_width(text, size) <= width:
        return text
    for end in range(len(text) - 1, 0, -1):
        shorter = text[:end].rstrip(" ,·") + "…"
        if text_width(shorter, size) <= width:
            return shorter
    return ""


def span_text(ids: Sequence[int], width: int = 34) -> str:
    """Ids as people read them, in at most about `width` characters: `8–15`, `0–3, 8–11`, a
    regular pattern as `5, 69, …, 453 (step 64)`, else the first runs, `…` and the last."""
    runs = id_runs(sorted(set(ids)))
    parts = [f"{a}–{b}" if b > a else str(a) for a, b in runs]
    text = ", ".join(parts)
    if len(text) <= width or len(parts) < 3:
        return text
    strides = {runs[i + 1][0] - runs[i][0] for i in range(len(runs) - 1)}
    if len({b - a for a, b in runs}) == 1 and len(strides) == 1:
        return f"{parts[0]}, {parts[1]}, …, {parts[-1]} (step {strides.pop()})"
    shown = parts[0]
    for part in parts[1:-1]:
        if len(shown) + len(part) + len(parts[-1]) + 6 > width:
            break
        shown += ", " + part
    return f"{shown}, …, {parts[-1]}"


def _classes(ranks: Sequence[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], Hashable]
             ) -> list[list[Mapping[str, Any]]]:
    """The ranks grouped by `key`, each group in rank order, groups by their first rank."""
    return _alike(sorted(ranks, key=lambda r: int(r["rank"])), key)


def _rank_classes(ranks: Sequence[PlanRank], key: Callable[[PlanRank], Hashable]
                  ) -> list[list[PlanRank]]:
    """The plan's ranks grouped by `key`, each group in rank order, groups by their first."""
    return _alike(sorted(ranks, key=lambda r: r.rank), key)


def stage_colour(stage: int) -> str:
    """The fill of a pipeline stage."""
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def _coordinates(shape: ParallelShape, rank: int) -> str:
    """`stage 1, tp 0`, with `, ep 1` (and `, etp 0` when experts are split) under expert
    parallelism."""
    at = shape.coordinates(rank)
    text = f"stage {at.pipeline_stage}, tp {at.tensor_parallel_rank}"
    if shape.expert_parallel_size is not None:
        text += f", ep {at.expert_parallel_rank}"
        if shape.expert_tensor_parallel_size > 1:
            text += f", etp {at.expert_tensor_parallel_rank}"
    return text


def _coordinate_spans(shape: ParallelShape, ranks: Sequence[PlanRank]) -> str:
    """The TP (and EP, ETP) coordinates a set of ranks covers: `tp 0–7`, or
    `tp 0–3 ×16 replicas · ep 0–31 · etp 0–1`."""
    at = [shape.coordinates(r.rank) for r in ranks]
    text = f"tp {span_text([c.tensor_parallel_rank for c in at], 12)}"
    if shape.expert_parallel_size is None:
        return text
    replicas = {c.dense_replica for c in at}
    if len(replicas) > 1:
        text += f" ×{len(replicas)} replicas"
    text += f" · ep {span_text([c.expert_parallel_rank for c in at], 12)}"
    if shape.expert_tensor_parallel_size > 1:
        text += f" · etp {span_text([c.expert_tensor_parallel_rank for c in at], 8)}"
    return text


def _row_labels(y: float, height: float, head: str, sub: str | None) -> tuple[Label, ...]:
    """The one or two lines of a row's label, fitted into LABEL_WIDTH."""
    if sub is None:
        return (Label(4, y + height / 2 + FONT * 0.36, fit(head, LABEL_WIDTH - 10)),)
    return (Label(4, y + height / 2 - 2, fit(head, LABEL_WIDTH - 10)),
            Label(4, y + height / 2 + SMALL + 1, fit(sub, LABEL_WIDTH - 10, SMALL), "small"))


def _ticks(first: int, count: int, left: float, cell: float) -> list[Label]:
    """Unit numbers over a group's columns, every 1, 2, 5, 10, 20, 50 … units: the smallest
    step whose labels do not touch, none past the group's right edge."""
    widest = text_width(str(first + count - 1)) + 6
    step = next(s for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 10 ** 9)
                if s * cell >= widest or s >= count)
    labels = []
    for unit in range(0, count, step):
        centre = left + (unit + 0.5) * cell
        half = text_width(str(first + unit)) / 2
        if centre - half >= left - 1 and centre + half <= left + count * cell + 1:
            labels.append(Label(round(centre, 2), 34, str(first + unit), "tick", "middle"))
    return labels


# ---------------------------------------------------------------- ownership map


def _ownership(build: Build) -> dict[str, Any]:
    """The ownership map: one row per set of ranks owning the same units and static roles."""
    columns = unit_columns(build.file)
    owners = [set(c["owners"]) for c in columns]
    statics = [c for c in columns if c["kind"] == "static"]
    units = [c for c in columns if c["kind"] != "static"]
    area = PAGE_WIDTH - LABEL_WIDTH - 10
    static_width = [min(96.0, max(16.0, text_width(c["label"]) + 8)) for c in statics]
    gap = 8.0 if statics else 0.0
    cell = max(1.0, min(28.0, (area - sum(static_width) - gap) / max(1, len(units))))
    lefts, widths = [], []
    x = float(LABEL_WIDTH)
    for i, column in enumerate(columns):
        if column["kind"] == "static" and (i == 0 or columns[i - 1]["kind"] != "static"):
            x += gap
        w = static_width[i - len(units)] if column["kind"] == "static" else cell
        lefts.append(x)
        widths.append(w)
        x += w
    right = x
    head: list[Label] = []
    groups: dict[str, list[int]] = {}
    for i, column in enumerate(units):
        groups.setdefault(column["label"].rsplit(" ", 1)[0], []).append(i)
    hidden = []
    for name, members in groups.items():
        left, width = lefts[members[0]], cell * len(members)
        text = next((t for t in (f"{name} · {plural(len(members), 'unit')}", name)
                     if text_width(t) * 1.1 <= width - 4), "")  # bold: a tenth wider
        if text:
            head.append(Label(round(left + 2, 2), 16, text, "band"))
        if text != f"{name} · {plural(len(members), 'unit')}":
            hidden.append(name)
        head.extend(_ticks(0, len(members), left, cell))
    if statics:
        room = right - lefts[len(units)]
        head.append(Label(round(lefts[len(units)], 2), 16, next(
            (t for t in ("static roles", "static") if text_width(t) * 1.1 <= room), ""), "band"))
        for i, column in enumerate(statics, start=len(units)):
            text = fit(column["label"], widths[i] - 2)
            head.append(Label(round(lefts[i] + widths[i] / 2, 2), 34, text, "tick", "middle"))
    head = [label for label in head if label.text]

    def owning(rank: PlanRank) -> tuple[int, tuple[int, ...]]:
        return rank.pipeline_stage, tuple(i for i, o in enumerate(owners) if rank.rank in o)

    shape = build.file.shape
    classes = _rank_classes(build.file.ranks, owning)
    spans = {_coordinate_spans(shape, ranks) for ranks in classes}
    single = len(classes) > 12 and len(spans) == 1  # many stages: one line a row
    if single:
        head.append(Label(4, 34, fit(f"each row: {spans.pop()}", LABEL_WIDTH - 10), "tick"))
    top = 44.0
    height, pitch = (14.0, 18.0) if single else (26.0, 30.0)
    rows = []
    for j, ranks in enumerate(classes):
        ids = [r.rank for r in ranks]
        stage = ranks[0].pipeline_stage
        y = top + j * pitch
        owned = owning(ranks[0])[1]
        cells = tuple(
            Rect(round(lefts[i], 2), y, round(max(0.5, widths[i] - (1 if widths[i] > 3 else 0)),
                                              2), height,
                 stage_colour(stage) if i in owned else FREE_COLOUR,
                 "cell " + ("owned" if i in owned else "free")
                 + (" static" if column["kind"] == "static" else ""),
                 f"ranks {span_text(ids, 60)} (stage {stage}) / {column['label']} "
                 f"({column['path']}): {'owned' if i in owned else 'not owned'}")
            for i, column in enumerate(columns))
        labels = (_row_labels(y, height, f"ranks {span_text(ids, 26)} ×{len(ids)} · stage "
                                         f"{stage}", None) if single else
                  _row_labels(y, height, f"ranks {span_text(ids)} ×{len(ids)}",
                              f"stage {stage} · {_coordinate_spans(shape, ranks)}"))
        rows.append(Row(y, id_ranges(ids), len(ids), str(stage), labels, cells))
    note = "; ".join(
        [f"{name}: units 0–{len(groups[name]) - 1}" for name in hidden]
        + [f"{c['label']} ({c['path'].removeprefix('static role ').strip('()')} stage)"
           for c in statics])
    return {"head": head, "rows": rows, "width": round(right + 10, 2),
            "height": top + len(rows) * pitch + 6, "columns": len(columns),
            "ranks": shape.build_world_size, "note": note}


# ---------------------------------------------------------------- bytes by role


def role_bytes(plan: PlanFile) -> list[dict[str, int]]:
    """Per rank (in plan order), its local bytes by group role; fallen-back groups' bytes under
    FALLBACK_ROLE (`build.rank_role_bytes`, asking only the ranks of each tensor's stages)."""
    roles = {g.name: FALLBACK_ROLE if g.fell_back_to_replication else g.role
             for g in plan.groups}
    by_stage: dict[int, list[int]] = {}
    for i, rank in enumerate(plan.ranks):
        by_stage.setdefault(rank.pipeline_stage, []).append(i)
    out: list[dict[str, int]] = [{} for _ in plan.ranks]
    for t in plan.tensors:
        role = roles[t.group]
        for i in (i for stage in dict.fromkeys(t.stages) for i in by_stage.get(stage, ())):
            held = rank_placement(plan, plan.ranks[i], t)
            if held is not None:
                out[i][role] = out[i].get(role, 0) + tensor_bytes(t.dtype, held[1])
    return out


def _role_order(role: str) -> tuple[bool, str]:
    return role == FALLBACK_ROLE, role


def _bars(build: Build) -> dict[str, Any]:
    """Bytes per rank by role: one bar per set of ranks holding the same bytes of each role."""
    per_rank = dict(zip((r.rank for r in build.file.ranks), role_bytes(build.file),
                        strict=True))
    largest = max((sum(r.values()) for r in per_rank.values()), default=0) or 1
    height, pitch, top = 18.0, 24.0, 6.0
    bar_width = PAGE_WIDTH - LABEL_WIDTH - 110
    rows = []
    for j, members in enumerate(_rank_classes(build.file.ranks, lambda r: tuple(
            sorted(per_rank[r.rank].items())))):
        ids = [r.rank for r in members]
        stages = [r.pipeline_stage for r in members]
        stage = ("stage " if len(set(stages)) == 1 else "stages ") + span_text(stages, 12)
        roles = per_rank[ids[0]]
        y = top + j * pitch
        x = float(LABEL_WIDTH)
        rects = []
        for role in sorted(roles, key=_role_order):
            width = bar_width * roles[role] / largest
            rects.append(Rect(round(x, 2), y, round(width, 2), height,
                              ROLE_COLOURS.get(role, OTHER_ROLE_COLOUR),
                              "segment" + (" fallback" if role == FALLBACK_ROLE else ""),
                              f"ranks {span_text(ids, 60)}: {role} {byte_text(roles[role])} "
                              "each"))
            x += width
        total = byte_text(sum(roles.values())) + (" each" if len(ids) > 1 else "")
        labels = (*_row_labels(y, height, f"ranks {span_text(ids, 24)} ×{len(ids)} · {stage}",
                               None),
                  Label(round(x + 6, 2), y + height / 2 + FONT * 0.36, total))
        rows.append(Row(y, id_ranges(ids), len(ids), span_text(stages, 12), labels,
                        tuple(rects)))
    used = sorted({role for roles in per_rank.values() for role in roles}, key=_role_order)
    return {"rows": rows, "legend": [(role, ROLE_COLOURS.get(role, OTHER_ROLE_COLOUR))
                                     for role in used],
            "width": PAGE_WIDTH, "height": top + len(rows) * pitch + 4,
            "ranks": len(per_rank)}


# ---------------------------------------------------------------- what each TP rank holds


def _pieces_text(axis: str, pieces: Sequence[Sequence[int]]) -> str:
    """Each `axis` rank's [start, stop) as `tp 0 → 0–3583 · tp 1 → 3584–7167 · …` (the first
    two and the last of more than four), with `(3584 each)` when they are equal."""
    def one(a: int, b: int) -> str:
        return str(a) if b - a == 1 else f"{a}–{b - 1}"

    parts = [f"{axis} {i} → {one(int(a), int(b))}" for i, (a, b) in enumerate(pieces)]
    if len(parts) == 1:
        return f"whole on its {axis} rank ({parts[0].split(' → ')[1]})"
    shown = parts if len(parts) <= 4 else [parts[0], parts[1], "…", parts[-1]]
    sizes = {int(b) - int(a) for a, b in pieces}
    return " · ".join(shown) + (f" ({sizes.pop()} each)" if len(sizes) == 1 else "")


def _slices(build: Build) -> list[dict[str, Any]]:
    """What each TP rank (ETP rank, for placed experts) holds of each kind of group: one row
    per role and split, with how many groups share it."""
    plan = build.file
    experts = plan.expert_parallel
    placed = experts.expert_groups if experts is not None else {}
    first: dict[str, PlanTensor] = {}
    for each in plan.tensors:
        first.setdefault(each.group, each)
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for group in plan.groups:
        axis = "etp" if group.name in placed else "tp"
        role = FALLBACK_ROLE if group.fell_back_to_replication else group.role
        tensor = first.get(group.name)
        if group.fell_back_to_replication:
            what, split = f"{group.role}, replicated by the policy", "whole on every rank"
        elif group.logical_ranges:
            what = plural(int(group.logical_units or 0), "unit")
            split = _pieces_text(axis, group.logical_ranges)
        elif tensor is None:
            continue
        else:
            placements = tensor.placements
            kinds = {p[0] for p in placements}
            if kinds <= {"replicated", "whole", "local", "pipeline_stage"}:
                what, split = "-", "whole on every rank"
            elif kinds == {"range"} and len({p[1] for p in placements}) == 1:
                axis_index = int(placements[0][1])
                name = {0: "rows", 1: "columns"}.get(axis_index, f"axis {axis_index}")
                what = f"{tensor.shape[axis_index]} {name}"
                split = _pieces_text(axis, [(p[2], p[3]) for p in placements])
            else:
                what = "-"
                split = " · ".join(f"{axis} {i}: {placement_text(p)}"
                                   for i, p in enumerate(placements[:4])) + (
                    " · …" if len(placements) > 4 else "")
        entry = rows.setdefault((role, what, split), {
            "role": role, "what": what, "split": split, "groups": [],
            "colour": ROLE_COLOURS.get(role, OTHER_ROLE_COLOUR)})
        entry["groups"].append(group.name)
    out = []
    for _, entry in sorted(rows.items(), key=lambda kv: (_role_order(kv[0][0]),
                                                         kv[1]["groups"][0])):
        names = entry.pop("groups")
        entry["groups"] = (names[0] if len(names) == 1
                           else f"{len(names)} groups ({names[0]}, …)")
        out.append(entry)
    return out


# ---------------------------------------------------------------- experts and ranks


def _expert_cards(facts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One card per set of ranks holding the same experts at the same ETP rank (empty without
    expert parallelism)."""
    if facts.get("expert_parallel") is None:
        return []
    split = int(facts["expert_parallel"]["expert_tensor_parallel_size"]) > 1
    cards = []
    for members in sorted(_classes(facts["ranks"], lambda r: (
            r["expert_parallel_rank"], r["expert_tensor_parallel_rank"],
            tuple(r.get("experts", ())))),
            key=lambda m: (m[0]["expert_parallel_rank"], m[0]["expert_tensor_parallel_rank"],
                           not m[0].get("experts"), m[0]["rank"])):
        first = members[0]
        ids = [int(r["rank"]) for r in members]
        held = list(first.get("experts", ()))
        nbytes = sorted({int(r.get("expert_bytes", 0)) for r in members})
        cards.append({
            "ep": first["expert_parallel_rank"], "etp": first["expert_tensor_parallel_rank"],
            "head": f"ep {first['expert_parallel_rank']}"
                    + (f" · etp {first['expert_tensor_parallel_rank']}" if split else ""),
            "experts": (f"{plural(len(held), 'expert')} {span_text(held, 24)}" if held
                        else "no experts (a stage without MoE layers)"),
            "ids": ",".join(map(str, held)), "ranks": id_ranges(ids), "count": len(ids),
            "rank_text": f"ranks {span_text(ids, 30)} ×{len(ids)}",
            "bytes": (byte_text(nbytes[0]) if len(nbytes) == 1
                      else f"{byte_text(nbytes[0])}–{byte_text(nbytes[-1])}"),
            "css": "expert-card" + ("" if held else " none")})
    return cards


def _every_rank(facts: Mapping[str, Any], build: Build) -> list[dict[str, Any]]:
    """Every rank, one row each: coordinates, units, bytes and (under expert parallelism) the
    experts it holds."""
    experts = facts.get("expert_parallel") is not None
    return [{"rank": r["rank"], "coordinates": _coordinates(build.file.shape, int(r["rank"])),
             "units": r["units"], "bytes": byte_text(r["bytes"]),
             "ep": r.get("expert_parallel_rank"), "etp": r.get("expert_tensor_parallel_rank"),
             "count": plural(len(r.get("experts", ())), "expert"),
             "experts": id_ranges(r.get("experts", ())) or "-",
             "ids": ",".join(map(str, r.get("experts", ()))),
             "expert_bytes": byte_text(r.get("expert_bytes", 0)),
             "css": "rank" if not experts else "expert" if r.get("experts") else "expert none"}
            for r in facts["ranks"]]


_Entry = TypeVar("_Entry")
"""A row `_alike` groups: a plan rank, or a JSON row."""


def _alike(entries: Sequence[_Entry], key: Callable[[_Entry], Hashable]
           ) -> list[list[_Entry]]:
    """Entries grouped by `key`, in the order of each group's first entry."""
    groups: dict[Hashable, list[_Entry]] = {}
    for entry in entries:
        groups.setdefault(key(entry), []).append(entry)
    return list(groups.values())


def _group_names(names: Sequence[str]) -> str:
    """One group's name, or the first and last of several in numeric order with their count:
    `layers.0.attention … layers.79.attention (80 groups)`."""
    if len(names) == 1:
        return names[0]
    ordered = sorted(names, key=lambda n: [int(p) if p.isdigit() else p
                                           for p in re.split(r"(\d+)", n)])
    return f"{ordered[0]} … {ordered[-1]} ({len(names)} groups)"


def _stage_rows(facts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The stages table: consecutive stages holding as many tensors and bytes (and the same
    static roles) share one row."""
    runs: list[list[Mapping[str, Any]]] = []
    for stage in facts["stages"]:
        same = [(s["tensors"], s["bytes"], s["max_rank_bytes"], s["static_roles"],
                 len(s["ranks"])) for s in (stage, runs[-1][-1] if runs else None) if s]
        if len(same) == 2 and same[0] == same[1]:
            runs[-1].append(stage)
        else:
            runs.append([stage])
    rows = []
    for run in runs:
        first, numbers = run[0], [int(s["pipeline_stage"]) for s in run]
        ids = [r for s in run for r in s["ranks"]]
        rows.append({"stage": span_text(numbers, 12), "ranks": f"{span_text(ids)} ×{len(ids)}",
                     "units": first["units"] if len(run) == 1
                     else f"{first['units']} … {run[-1]['units']}",
                     "tensors": first["tensors"], "bytes": byte_text(first["bytes"]),
                     "max": byte_text(first["max_rank_bytes"]),
                     "roles": ", ".join(first["static_roles"]) or "-",
                     "colours": [stage_colour(n) for n in numbers[:len(STAGE_COLOURS)]]})
    return rows


def _wire_rows(tensors: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"kind": t["kind"], "role": t["role"], "shape": " x ".join(map(str, t["shape"])),
             "dtype": t["dtype"] if t["dtype"] == t["wire_dtype"]
             else f"{t['dtype']} ({t['wire_dtype']})"} for t in tensors]


def _cuts(facts: dict[str, Any], build: Build) -> list[dict[str, Any]]:
    """Each boundary crossing a pipeline cut, with the cuts it crosses (`between`, in order;
    cuts carrying the same boundary share one entry); for a build of one stage, the family's
    boundary with no cut (what a cut would carry)."""
    if not facts["cuts"]:
        boundary = build.file.boundary
        return [{"between": [], "identity": boundary.identity,
                 "wire": _wire_rows(wire_tensors(boundary,
                                                 build.file.topology.activation_dtype))}]
    entries: dict[str, dict[str, Any]] = {}
    for c in facts["cuts"]:
        wire = _wire_rows(c["tensors"])
        key = json.dumps([c["boundary"], wire])
        entry = entries.setdefault(key, {"between": [], "identity": str(c["boundary"]),
                                         "wire": wire})
        entry["between"].append({"from_stage": c["from_stage"], "to_stage": c["to_stage"],
                                 "group": c["group"]})
    for entry in entries.values():  # many cuts: said as one span of stages
        entry["span"] = span_text([b["from_stage"] for b in entry["between"]])
        entry["groups"] = ", ".join(sorted({str(b["group"]) for b in entry["between"]
                                            if b["group"]}))
    return list(entries.values())


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("partc.inspect", "templates"),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, autoescape=True)


def render_report(build: Build, origins: Origins) -> str:
    """The report page of a build, as HTML text (deterministic for a given plan)."""
    facts = summary(build)
    topology = facts["topology"]
    fallbacks = []
    for same in _alike(facts["fallbacks"], lambda f: (
            f["role"], f["units"], f["bytes"], f["extra_bytes"],
            origins.lines.get(f["group"], "?"))):
        f, each = same[0], " each" if len(same) > 1 else ""
        fallbacks.append({
            "group": _group_names([g["group"] for g in same]), "role": f["role"],
            "units": f["units"], "stages": span_text([s for g in same for s in g["stages"]]),
            "bytes": byte_text(f["bytes"]) + each,
            "extra": byte_text(f["extra_bytes"]) + each + (
                f" (+{byte_text(f['extra_bytes'] * len(same))} in all)" if each else ""),
            "origin": origins.lines.get(f["group"], "?")})
    kv = [{"group": _group_names([k["group"] for k in same]), "replicas": same[0]["kv_replicas"],
           "tensors": len(same[0]["tensors"]) * len(same),
           "origin": origins.lines.get(same[0]["group"], "?")}
          for same in _alike(facts["kv_replication"], lambda k: (
              k["kv_replicas"], len(k["tensors"]), origins.lines.get(k["group"], "?")))]
    reduced = [{"group": r["group"], "tensors": ", ".join(r["tensors"]),
                "origin": origins.lines.get(r["group"], "?")} for r in facts["tp_reduction"]]
    title = f"{facts['family']} at {topology_text(topology)}"
    return _environment().get_template("report.html.jinja2").render(
        title=title,
        version=__version__, plan_hash=facts["plan_hash"], facts=facts,
        global_bytes=byte_text(facts["global_bytes"]), policy=topology.get("policy") or
        "family default", stages=_stage_rows(facts), stage_cycle=len(STAGE_COLOURS),
        stage_count=len(facts["stages"]),
        ownership=_ownership(build), slices=_slices(build), bars=_bars(build),
        cuts=_cuts(facts, build), cards=_expert_cards(facts),
        every_rank=_every_rank(facts, build), expert_layout=_expert_layout(facts),
        fallbacks=fallbacks, kv=kv, reduced=reduced, origin_note=origins.note,
        sources=[f"{s['name']} (sha256 {s['sha256'][:16]})" for s in facts["sources"]])


def _expert_layout(facts: dict[str, Any]) -> str:
    """The one-line expert-parallel layout (empty without expert parallelism)."""
    experts = facts.get("expert_parallel")
    if experts is None:
        return ""
    return (f"E={experts['expert_parallel_size']} x X={experts['expert_tensor_parallel_size']} "
            f"= {experts['ranks_per_stage']} ranks per stage; "
            f"{plural(experts['experts'], 'expert')}, "
            f"{'explicit' if experts['explicit_placement'] else 'balanced'} placement, "
            f"{plural(experts['redundant_slots'], 'redundant slot')}; {experts['layout']}")
