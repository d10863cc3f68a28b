"""`partc init`: a Mamba (selective state-space) mixer split by its inner channels.

A module holding `A_log` [I, N] and `D` [I] beside `in_proj` [2I, H], `conv1d` [I, 1, K],
`x_proj` [R + 2N, I], `dt_proj` [I, R] and `out_proj` [H, I] (Mamba's `mixer`, Jamba's `mamba`,
with Jamba's dt/b/c layernorms) is one `channels` group of `members:` over I, as
architectures/mamba.yaml declares it (vLLM's MambaMixer): `in_proj`'s x and z halves take the
same channel range, conv1d, dt_proj, A_log and D the rank's channels, x_proj and out_proj are
row-parallel, x_proj's partial output all-reduced inside the mixer (`reduction: output`), the
layernorms over its (dt, B, C) output and out_proj's bias replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.decisions import _entry, _Writer
from partc.scaffold.fused import Blocks
from partc.scaffold.layer_table import _Module
from partc.scaffold.ssm2 import scan_mixers
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

_PROJECTIONS = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def mamba_mixers(blocks: Blocks, groups: list[dict[str, Any]], done: set[str]) -> None:
    """Append a group per Mamba mixer of the layers not `done` (adding its modules)."""
    scan_mixers(blocks, groups, done, {"A_log", "D"},
                lambda found: set(_PROJECTIONS) <= found <= {*_PROJECTIONS, *_NORMS}, _mixer)


def _mixer(blocks: Blocks, groups: list[dict[str, Any]], module: str, entry: _Module,
           children: Mapping[str, _Module]) -> bool:
    """The mixer's group, when its shapes are Mamba's."""
    w = blocks.w
    inner, state = entry.params["A_log"][1] if len(entry.params["A_log"][1]) == 2 else (0, 0)
    shapes = {f"{c}.{p}": shape for c, e in children.items() for p, (_, shape) in e.params.items()}
    rank = shapes.get("dt_proj.weight", [0, 0])[-1]
    hidden = w.values.get("hidden_size")
    if not inner or entry.params["D"][1] != [inner] or shapes.get("in_proj.weight") != [
            2 * inner, hidden] or shapes.get("out_proj.weight") != [hidden, inner] or \
            shapes.get("x_proj.weight") != [rank + 2 * state, inner] or \
            shapes.get("dt_proj.weight") != [inner, rank] or \
            shapes.get("conv1d.weight", [0])[0] != inner:
        return False
    names, prefer = w.vocabulary(module)
    kernel = shapes["conv1d.weight"][-1]
    found: dict[str, tuple[str, str | None]] = {}
    for key, value, like in (("U", inner, "intermediate"), ("R", rank, "rank"),
                             ("N", state, "state"), ("K", kernel, "conv")):
        fits = [n for n in names if like in n and w.values.get(n) == value]
        found[key] = (fits[0], None) if len(fits) == 1 else w.resolve(
            None, value, names=names, prefer=prefer) if key == "U" else (
            str(value), f"{value} is no config field named like `{like}` the scaffold knows")
    units = found["U"][0]
    group = blocks._group(groups, f"layers.{{unit}}.{module}", "channels", units, entry)
    group["units"] = _entry(units)
    if found["U"][1] is not None:
        w.check(group, "units", f"the inner channels of `{module}`: {found['U'][1]}")
    u, r, n, k = (found[key][0] for key in "URNK")
    double = f"2 * {u}" if u.isidentifier() else str(2 * inner)
    axes = {"in_proj.weight": [double, "hidden_size"], "in_proj.bias": [double],
            "conv1d.weight": [u, "1", k], "conv1d.bias": [u],
            "x_proj.weight": [f"{r} + 2 * {n}" if r.isidentifier() and n.isidentifier()
                              else str(rank + 2 * state), u],
            "dt_proj.weight": [u, r], "dt_proj.bias": [u], "out_proj.weight": ["hidden_size", u],
            "out_proj.bias": ["hidden_size"], "A_log": [u, n], "D": [u],
            "dt_layernorm.weight": [r], "b_layernorm.weight": [n], "c_layernorm.weight": [n]}
    members: list[Flow] = []
    group["members"] = members
    tensors = [(f"{c}.{p}", children[c].params[p]) for c in sorted(
        children, key=lambda c: (c not in _PROJECTIONS, _order(c)))
        for p in sorted(children[c].params)]
    for name, (dtype, shape) in [*tensors, *((p, entry.params[p]) for p in ("A_log", "D"))]:
        expected = axes.get(name)
        if expected is None or len(expected) != len(shape):
            return False
        members.append(_member(w, blocks.unit, module, name, dtype, expected, double))
        tokens = {t for e in expected for t in e.split()}
        literal = {"U": double, "R": str(rank + 2 * state), "N": str(rank + 2 * state)}
        whys = [f"{key}: {found[key][1]}" for key in "URNK" if found[key][1] is not None
                and (found[key][0] in tokens or literal.get(key) in tokens)]
        w.shape_mark(members, len(members) - 1, f"{module}.{name}", whys)
    w.used.update(t for t in (u, r, n, k, "hidden_size") if t.isidentifier())
    return True


def _order(child: str) -> int:
    return (*_PROJECTIONS, *_NORMS).index(child)


_SHARDING = {"in_proj.weight": "halves", "in_proj.bias": "halves", "x_proj.weight": 1,
             "out_proj.weight": 1, "out_proj.bias": None}
"""How a mixer tensor is split (its axis; `halves`: x and z alike; None: replicated); the
others on axis 0, the layernorms replicated."""


def _member(w: _Writer, unit: str, module: str, name: str, dtype: str, shape: list[str],
            double: str) -> Flow:
    """One member of the mixer group: its shape over the config and its split."""
    member = Flow(target=Quoted(f"{unit}.{module}.{name}"),
                  shape=FlowList(_entry(t) for t in shape))
    if dtype != w.default_dtype:
        member["dtype"] = dtype
    how = _SHARDING.get(name, 0) if "layernorm" not in name else None
    if how == "halves":
        half = double.removeprefix("2 * ") if double.startswith("2 * ") else \
            str(int(double) // 2)
        member["sharding"] = Flow(partitioned_segments=Flow(axis=0, segments=FlowList(
            [_entry(half)] * 2)))
    elif how is None:
        member["sharding"] = "replicated"
    else:
        member["sharding"] = Flow(partitioned=how)
    if name == "x_proj.weight":
        member["reduction"] = "output"
    if name.endswith(".weight") and name.split(".")[0] in ("in_proj", "x_proj", "dt_proj",
                                                           "out_proj"):
        member["format"] = "linear"
    return member
