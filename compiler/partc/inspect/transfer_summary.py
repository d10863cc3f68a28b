"""A transfer plan between two builds as people and tools read it (`partc inspect A --to B`):
bytes per source -> destination rank pair, the busiest ranks, the total against a naive
gather-everything-then-slice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.inspect.plan_summary import byte_text, topology_text
from partc.plan.plan_records import PlanFile
from partc.plan.transfer import plan_transfer


def transfer_summary(source: PlanFile, destination: PlanFile) -> dict[str, Any]:
    """The transfer plan's totals (JSON form): per pair, per source and destination rank, the
    busiest of each, the minimum (each destination byte read once) and the naive total."""
    plan = plan_transfer(source, destination)
    pairs = plan.pair_bytes()
    sent = plan.source_bytes()
    received = [sum(t.nbytes for t in r.tensors) for r in plan.ranks]
    return {
        "source": {"path": str(source.path), "plan_hash": source.plan_hash,
                   "topology": dict(source.topology_json)},
        "destination": {"path": str(destination.path), "plan_hash": destination.plan_hash,
                        "topology": dict(destination.topology_json)},
        "family": plan.family, "global_bytes": plan.global_bytes,
        "total_bytes": plan.total_bytes, "naive_bytes": plan.naive_bytes,
        "pieces": sum(len(t.pieces) for r in plan.ranks for t in r.tensors),
        "pairs": [{"source": s, "destination": d, "bytes": n} for (s, d), n in pairs.items()],
        "source_bytes": sent, "destination_bytes": received,
        "busiest_source": max(range(len(sent)), key=lambda r: (sent[r], -r)),
        "busiest_destination": max(range(len(received)), key=lambda r: (received[r], -r)),
    }


def transfer_lines(summary: Mapping[str, Any]) -> list[str]:
    """The transfer plan's totals as text: the two builds, the totals, the busiest ranks, then
    one line per source -> destination pair that moves bytes."""
    source, destination = summary["source"], summary["destination"]
    total, naive = summary["total_bytes"], summary["naive_bytes"]
    sent, received = summary["source_bytes"], summary["destination_bytes"]
    busy_s, busy_d = summary["busiest_source"], summary["busiest_destination"]
    ratio = f"{naive / total:.2f}x" if total else "-"
    out = [f"transfer {summary['family']}: {topology_text(source['topology'])} (plan "
           f"{source['plan_hash'][:16]}) -> {topology_text(destination['topology'])} (plan "
           f"{destination['plan_hash'][:16]})",
           f"read {byte_text(total)} in {summary['pieces']} pieces (each destination byte "
           f"once; the model is {byte_text(summary['global_bytes'])}); gathering every tensor "
           f"whole then slicing reads {byte_text(naive)} ({ratio})",
           f"busiest source rank {busy_s}: sends {byte_text(sent[busy_s])}; busiest "
           f"destination rank {busy_d}: receives {byte_text(received[busy_d])}",
           "",
           "source  destination  bytes"]
    out += [f"{p['source']:>6}  {p['destination']:>11}  {byte_text(p['bytes'])}"
            for p in summary["pairs"]]
    return out


def render_transfer_report(summary: Mapping[str, Any]) -> str:
    """The transfer plan's HTML page (`partc report A --to B`): totals and the source x
    destination matrix of bytes, self-contained and deterministic."""
    from partc import __version__
    from partc.inspect.html_report import _environment

    pairs = {(p["source"], p["destination"]): p["bytes"] for p in summary["pairs"]}
    sent, received = summary["source_bytes"], summary["destination_bytes"]
    largest = max(pairs.values(), default=0) or 1
    total, naive = summary["total_bytes"], summary["naive_bytes"]
    rows = [{"rank": s, "sends": byte_text(sent[s]), "busiest": s == summary["busiest_source"],
             "cells": [{"text": byte_text(pairs[s, d]) if (s, d) in pairs else "",
                        "shade": f"{0.6 * pairs.get((s, d), 0) / largest:.3f}"}
                       for d in range(len(received))]} for s in range(len(sent))]
    source, destination = summary["source"], summary["destination"]
    busy_source, busy_destination = summary["busiest_source"], summary["busiest_destination"]
    return _environment().get_template("transfer.html.jinja2").render(
        title=f"{summary['family']}: {topology_text(source['topology'])} -> "
              f"{topology_text(destination['topology'])}",
        version=__version__, source_hash=source["plan_hash"],
        destination_hash=destination["plan_hash"], total=byte_text(total),
        naive=byte_text(naive), ratio=f"{naive / total:.2f}x" if total else "-",
        model=byte_text(summary["global_bytes"]), pieces=summary["pieces"],
        busiest_source=f"{busy_source} ({byte_text(sent[busy_source])})",
        busiest_destination=f"{busy_destination} ({byte_text(received[busy_destination])})",
        destinations=list(range(len(received))), rows=rows,
        received=[{"text": byte_text(n), "busiest": d == summary["busiest_destination"]}
                  for d, n in enumerate(received)])
