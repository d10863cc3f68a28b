"""`partc init`: routed experts stacked into one module's params, split by intermediate units.

gpt-oss's `mlp.experts` holds `gate_up_proj` [E, hidden, 2I] (a linear weight stored `[in,
out]`), its bias [E, 2I], `down_proj` [E, I, hidden] and its bias [E, hidden]: one
`expert_intermediate` group of `members:` (architectures/gpt_oss.yaml), every expert's gate
and up columns and down rows split by intermediate units, the down bias (added once after the
reduction) replicated, `experts: {axis: 0}` for expert parallelism. Whether gate and up are
interleaved (column 2i gate_i, 2i + 1 up_i) or component-major (all gates, then all ups) the
shapes leave open: two candidates, for `partc init --prove`.

DBRX's `ffn.experts.mlp` holds `w1` (gate), `v1` (up) and `w2` (down, used as `x @ w2`), each
[E * I, hidden], expert e the rows [e * I, (e + 1) * I): one group whose units are the
intermediate channels of every expert, each param split inside every expert's block of rows
(`partitioned_segments`, architectures/dbrx.yaml); the layout is not open (the rows of an
expert's block are its channels whichever way `w2` is used).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.config_values import _EXPERT_COUNTS
from partc.scaffold.decisions import _evaluate
from partc.scaffold.fused import Blocks, Candidate
from partc.scaffold.layer_table import _Module
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

_STACKED = {"gate_up_proj": 3, "gate_up_proj_bias": 2, "down_proj": 3, "down_proj_bias": 2}
"""The params of a stacked-experts module (gpt-oss's) and their ranks."""


def stacked_experts(blocks: Blocks, groups: list[dict[str, Any]], done: set[str]) -> None:
    """Append a group per stacked-experts module not `done` (adding it to `done`)."""
    for module in sorted(m for m in blocks.table if m not in done):
        entry = blocks.table[module]
        if _stacked(blocks, groups, module, entry) or _expert_rows(blocks, groups, module,
                                                                   entry):
            done.add(module)


_ROWS = ("w1", "v1", "w2")
"""The params of DBRX's fused experts module: gate, up and down, each [E * I, hidden]."""


def _expert_rows(blocks: Blocks, groups: list[dict[str, Any]], module: str, entry: _Module
                 ) -> bool:
    """The group of `module` when it is a DBRX-style experts module of [E * I, hidden] params."""
    w, params = blocks.w, entry.params
    parts = module.split(".")
    shapes = {tuple(shape) for _, shape in params.values()}
    if "experts" not in parts[:-1] or set(params) != set(_ROWS) or len(shapes) != 1 or \
            entry.differs:
        return False
    ((rows, hidden, *rest),) = shapes
    count = next((n for n in _EXPERT_COUNTS if w.values.get(n)), None)
    experts = w.values.get(count or "", 0)
    if rest or count is None or w.values.get("hidden_size") != hidden or rows % experts:
        return False
    names, prefer = w.vocabulary(module)
    units, why = w.resolve(None, rows // experts, names=[
        n for n in names if "intermediate" in n or "ffn" in n], prefer=prefer)
    if why is not None or not units.isidentifier():
        return False
    group = blocks._group(groups, f"layers.{{unit}}.{module}", "expert_intermediate", units,
                          entry)
    w.used.update((count, "hidden_size"))
    group["experts"] = Flow(axis=0, count=count)
    split = Flow(partitioned_segments=Flow(axis=0, segments=Quoted(f"[{units}] * {count}")))
    group["members"] = [
        Flow(target=Quoted(f"{blocks.unit}.{module}.{param}"),
             shape=FlowList([f"{count} * {units}", "hidden_size"]),
             **({"dtype": params[param][0]} if params[param][0] != w.default_dtype else {}),
             sharding=split) for param in _ROWS]
    return True


def _stacked(blocks: Blocks, groups: list[dict[str, Any]], module: str, entry: _Module
             ) -> bool:
    """The group of `module` when it is a stacked-experts module with consistent shapes."""
    w, params = blocks.w, entry.params
    if module.rsplit(".", 1)[-1] != "experts" or set(params) != set(_STACKED) or any(
            len(params[p][1]) != rank for p, rank in _STACKED.items()) or entry.differs:
        return False
    experts, hidden, doubled = params["gate_up_proj"][1]
    width = params["down_proj"][1][1]
    count = next((n for n in _EXPERT_COUNTS if w.values.get(n) == experts), None)
    if count is None or w.values.get("hidden_size") != hidden or doubled != 2 * width or [
            params["gate_up_proj_bias"][1], params["down_proj"][1],
            params["down_proj_bias"][1]] != [[experts, doubled], [experts, width, hidden],
                                             [experts, hidden]]:
        return False
    names, prefer = w.vocabulary(module)
    units, why = w.resolve("intermediate_size", width, names=names, prefer=prefer)
    if not units.isidentifier() or _evaluate(units, w.values) != width:
        return False
    group = blocks._group(groups, f"layers.{{unit}}.{module}", "expert_intermediate", units,
                          entry)
    if why is not None:
        w.check(group, "units", f"the intermediate size of `{module}`: {why}")
    w.used.update((count, "hidden_size"))
    group["experts"] = Flow(axis=0)
    candidates = (Candidate("component_major"), Candidate("per_head"))
    chosen = blocks._choose(group, f"{module}.gate_up_proj", candidates, "experts")
    interleaved = chosen.layout == "per_head"
    members: list[Flow] = []
    shapes: Mapping[str, tuple[list[str], Any, str | None]] = {
        "gate_up_proj": ([count, "hidden_size", f"2 * {units}"], _split(2, units, interleaved),
                         "linear_transposed"),
        "gate_up_proj_bias": ([count, f"2 * {units}"], _split(1, units, interleaved), None),
        "down_proj": ([count, units, "hidden_size"], Flow(partitioned=1), "linear_transposed"),
        "down_proj_bias": ([count, "hidden_size"], "replicated", None)}
    for param, (shape, sharding, form) in shapes.items():
        member = Flow(target=Quoted(f"{blocks.unit}.{module}.{param}"), shape=FlowList(shape))
        if params[param][0] != w.default_dtype:
            member["dtype"] = params[param][0]
        member["sharding"] = sharding
        if form is not None:
            member["format"] = form
        members.append(member)
    group["members"] = members
    return True


def _split(axis: int, units: str, interleaved: bool) -> Flow:
    """The sharding of a fused gate/up axis: contiguous units of interleaved (gate, up)
    pairs, or each of the gate and up halves split alike."""
    if interleaved:
        return Flow(partitioned=axis)
    return Flow(partitioned_segments=Flow(axis=axis, segments=Quoted(f"[{units}] * 2")))
