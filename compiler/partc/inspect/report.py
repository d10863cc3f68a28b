"""`partc report`: one self-contained HTML page of a build (inline SVG, no network, no script).

Every coordinate, label and colour is computed here; the template only arranges them. The page
has its own strict jinja2 environment with HTML autoescaping (emit's renders Python, unescaped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import jinja2

from partc import __version__
from partc.errors import plural
from partc.inspect.build import (
    FALLBACK_ROLE,
    Build,
    byte_text,
    rank_role_bytes,
    summary,
    topology_text,
    unit_columns,
    wire_tensors,
)
from partc.inspect.origins import Origins

STAGE_COLOURS = ("#4e79a7", "#59a14f", "#9c755f", "#b07aa1", "#76b7b2", "#edc948", "#af7aa1",
                 "#ff9da7")
"""Fill of an owned cell, by pipeline stage (cycled)."""
ROLE_COLOURS = {"vocabulary": "#4e79a7", "attention_heads": "#f28e2b",
                "feed_forward_intermediate": "#59a14f", "expert_intermediate": "#76b7b2",
                "replicated": "#bab0ac", "column_projection": "#edc948",
                "row_projection": "#b07aa1", "channels": "#9c755f", "segmented": "#ff9da7",
                FALLBACK_ROLE: "#d62728"}
"""Fill of each role's segment in the byte bars; fallbacks are red."""
LABEL_WIDTH = 150
"""Pixels left of the map and the bars for rank labels."""
MAP_WIDTH = 1000
"""Pixels the ownership map's cells may take in all."""
BAR_WIDTH = 900
"""Pixels of the widest byte bar."""


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
    """One SVG text."""

    x: float
    """Anchor x."""
    y: float
    """Baseline y."""
    text: str
    """The text."""
    rotate: bool = False
    """Rotated -60 degrees around its anchor (column labels)."""


def _coordinates(plan: dict[str, Any], rank: dict[str, Any]) -> str:
    """`stage 1, tp 0`, with `, ep 1` (and `, etp 0` when experts are split) under expert
    parallelism."""
    text = f"stage {rank['pipeline_stage']}, tp {rank['tensor_parallel_rank']}"
    experts = plan.get("expert_parallel")
    if experts is not None:
        text += f", ep {rank['info']['expert_parallel_rank']}"
        if int(experts["expert_tensor_parallel_size"]) > 1:
            text += f", etp {rank['info']['expert_tensor_parallel_rank']}"
    return text


def _ownership(build: Build) -> dict[str, Any]:
    plan = build.plan
    columns = unit_columns(plan)
    ranks = plan["ranks"]
    cell_w = max(4.0, min(28.0, MAP_WIDTH / max(1, len(columns))))
    cell_h = max(4.0, min(22.0, 640 / max(1, len(ranks))))
    top = 110.0
    cells, labels = [], []
    every = max(1, round(12 / cell_w))  # label every column when it is wide enough to read
    for i, column in enumerate(columns):
        if i % every == 0 or column["kind"] == "static":
            labels.append(Label(LABEL_WIDTH + i * cell_w + cell_w / 2, top - 6, column["label"],
                                rotate=True))
    row_every = max(1, round(11 / cell_h))
    for j, rank in enumerate(ranks):
        stage = rank["pipeline_stage"]
        if j % row_every == 0:
            labels.append(Label(4, top + j * cell_h + cell_h * 0.75,
                                f"rank {rank['rank']}  ({_coordinates(plan, rank)})"))
        for i, column in enumerate(columns):
            owned = rank["rank"] in column["owners"]
            fill = STAGE_COLOURS[stage % len(STAGE_COLOURS)] if owned else "#f3f3f3"
            css = "cell " + ("owned" if owned else "free") + (
                " static" if column["kind"] == "static" else "")
            cells.append(Rect(LABEL_WIDTH + i * cell_w, top + j * cell_h, cell_w - 1, cell_h - 1,
                              fill, css, f"rank {rank['rank']} / {column['label']} "
                              f"({column['path']}): {'owned' if owned else 'not owned'}"))
    return {"cells": cells, "labels": labels, "width": LABEL_WIDTH + len(columns) * cell_w + 20,
            "height": top + len(ranks) * cell_h + 10, "columns": len(columns),
            "ranks": len(ranks)}


def _bars(build: Build) -> dict[str, Any]:
    plan = build.plan
    per_rank = rank_role_bytes(plan)
    largest = max((sum(r.values()) for r in per_rank), default=0) or 1
    height, gap, top = 18.0, 4.0, 10.0
    bars, labels = [], []
    for j, (rank, roles) in enumerate(zip(plan["ranks"], per_rank, strict=True)):
        y = top + j * (height + gap)
        x = float(LABEL_WIDTH)
        total = sum(roles.values())
        labels.append(Label(4, y + height * 0.75, f"rank {rank['rank']} (stage "
                                                  f"{rank['pipeline_stage']})"))
        for role in sorted(roles, key=lambda r: (r == FALLBACK_ROLE, r)):
            width = BAR_WIDTH * roles[role] / largest
            css = "segment" + (" fallback" if role == FALLBACK_ROLE else "")
            bars.append(Rect(x, y, width, height, ROLE_COLOURS.get(role, "#888888"), css,
                             f"rank {rank['rank']}: {role} {byte_text(roles[role])}"))
            x += width
        labels.append(Label(x + 6, y + height * 0.75, byte_text(total)))
    used = sorted({role for roles in per_rank for role in roles})
    legend = [(role, ROLE_COLOURS.get(role, "#888888")) for role in used]
    return {"bars": bars, "labels": labels, "legend": legend, "rows": len(per_rank),
            "width": LABEL_WIDTH + BAR_WIDTH + 110,
            "height": top + len(per_rank) * (height + gap) + 10}


def _wire_rows(tensors: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"kind": t["kind"], "role": t["role"], "shape": " x ".join(map(str, t["shape"])),
             "dtype": t["dtype"] if t["dtype"] == t["wire_dtype"]
             else f"{t['dtype']} ({t['wire_dtype']})"} for t in tensors]


def _cuts(facts: dict[str, Any], build: Build) -> list[dict[str, Any]]:
    """Each boundary crossing a pipeline cut, with the cuts it crosses (`between`, in order;
    cuts carrying the same boundary share one entry); for a build of one stage, the family's
    boundary with no cut (what a cut would carry)."""
    if not facts["cuts"]:
        boundary = build.plan["boundary"]
        return [{"between": [], "identity": str(boundary.get("identity", "")),
                 "wire": _wire_rows(wire_tensors(
                     boundary, build.plan["topology"].get("activation_dtype")))}]
    entries: dict[str, dict[str, Any]] = {}
    for c in facts["cuts"]:
        wire = _wire_rows(c["tensors"])
        key = json.dumps([c["boundary"], wire])
        entry = entries.setdefault(key, {"between": [], "identity": str(c["boundary"]),
                                         "wire": wire})
        entry["between"].append({"from_stage": c["from_stage"], "to_stage": c["to_stage"],
                                 "group": c["group"]})
    return list(entries.values())


def _experts(facts: dict[str, Any], build: Build) -> list[dict[str, Any]]:
    """Per rank of an expert-parallel build: its coordinates, the experts it holds and their
    bytes (none on a stage without MoE layers); empty without expert parallelism."""
    if facts.get("expert_parallel") is None:
        return []
    from partc.inspect.text import id_ranges

    ranks = {r["rank"]: r for r in build.plan["ranks"]}
    return [{"rank": r["rank"], "stage": r["pipeline_stage"], "tp": r["tensor_parallel_rank"],
             "ep": r["expert_parallel_rank"], "etp": r["expert_tensor_parallel_rank"],
             "coordinates": _coordinates(build.plan, ranks[r["rank"]]),
             "count": plural(len(r["experts"]), "expert"),
             "experts": id_ranges(r["experts"]) or "-",
             "ids": ",".join(map(str, r["experts"])),
             "bytes": byte_text(r["expert_bytes"]),
             "css": "expert" if r["experts"] else "expert none"}
            for r in facts["ranks"]]


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
    stages = [{"stage": s["pipeline_stage"], "ranks": ", ".join(map(str, s["ranks"])),
               "units": s["units"], "tensors": s["tensors"], "bytes": byte_text(s["bytes"]),
               "max": byte_text(s["max_rank_bytes"]),
               "roles": ", ".join(s["static_roles"]) or "-",
               "colour": STAGE_COLOURS[s["pipeline_stage"] % len(STAGE_COLOURS)]}
              for s in facts["stages"]]
    fallbacks = [{"group": f["group"], "role": f["role"], "units": f["units"],
                  "stages": ", ".join(map(str, f["stages"])), "bytes": byte_text(f["bytes"]),
                  "extra": byte_text(f["extra_bytes"]),
                  "origin": origins.lines.get(f["group"], "?")} for f in facts["fallbacks"]]
    kv = [{"group": k["group"], "replicas": k["kv_replicas"], "tensors": len(k["tensors"]),
           "origin": origins.lines.get(k["group"], "?")} for k in facts["kv_replication"]]
    reduced = [{"group": r["group"], "tensors": ", ".join(r["tensors"]),
                "origin": origins.lines.get(r["group"], "?")} for r in facts["tp_reduction"]]
    title = f"{facts['family']} at {topology_text(topology)}"
    return _environment().get_template("report.html.jinja2").render(
        title=title,
        version=__version__, plan_hash=facts["plan_hash"], facts=facts,
        global_bytes=byte_text(facts["global_bytes"]), policy=topology.get("policy") or
        "family default", stages=stages, ownership=_ownership(build), bars=_bars(build),
        cuts=_cuts(facts, build), experts=_experts(facts, build),
        expert_layout=_expert_layout(facts),
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
