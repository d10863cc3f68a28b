"""`partc init`: a Mamba2 mixer split by heads and groups, as architectures/bamba.yaml does.

A module holding `A_log`, `D` and `dt_bias` [H] beside `in_proj` [2I + 2GN + H, hidden] (rows
[z | x | B | C | dt]), `conv1d` [I + 2GN, 1, K] (over [x | B | C]), a gated `norm` [I] and
`out_proj` [hidden, I] (Bamba's `mamba`, Mamba2's `mixer`) is one `channels` group of
`members:` over its G groups, split as vLLM's MambaMixer2: in_proj and conv1d in
`partitioned_segments`, A_log, D and dt_bias by head, out_proj row-parallel. With one group
(`G = 1`, every released Bamba) the group's B and C are repeated on every rank
(`kv_replication`, `heads:` counting heads on z / x / dt and groups on B / C) and the gated
norm's statistic, over all I channels, is all-reduced (`reduction: tensor_parallel`); with
several, each rank holds whole groups with their heads and the per-group norm stays local.

The shapes give H, I and GN; G and N apart, the conv kernel and the width's spelling
(`mamba_expand * hidden_size`) are read from the config fields of those values, named like
them (`mamba_n_groups`, Mamba2's `n_groups`). A mixer whose sizes no field explains is left
to the replicated groups (marked CHECK there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from partc.scaffold.config_values import _HEADS
from partc.scaffold.decisions import _entry, _Writer
from partc.scaffold.fused import Blocks
from partc.scaffold.layer_table import _Module
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

_CHILDREN = frozenset({"in_proj", "conv1d", "norm", "out_proj"})
"""A Mamba2 mixer's modules."""


def field(w: _Writer, value: int, *hints: str) -> str | None:
    """The top-level config field of `value` named with every hint (`group`, `state`), one not
    the attention's (`num_attention_heads`) preferred; None unless one is singled out."""
    names = sorted(k for k, v in w.config.items() if isinstance(k, str) and isinstance(v, int)
                   and not isinstance(v, bool) and v == value and all(h in k for h in hints))
    own = [n for n in names if n not in _HEADS] or names
    return own[0] if len(own) == 1 else None


def declare(w: _Writer, names: Sequence[str]) -> None:
    """Declare the config fields a group's shapes use (`field`'s), their values known."""
    for name in names:
        w.values[name] = w.config[name]
        w.used.add(name)


def children(table: Mapping[str, _Module], module: str, done: set[str]) -> dict[str, _Module]:
    """The modules directly under `module` not yet `done`, by leaf name."""
    return {m.rpartition(".")[2]: table[m] for m in table
            if m.rpartition(".")[0] == module and m not in done}


def same_scope(entry: _Module, found: Mapping[str, _Module]) -> bool:
    """Whether a mixer and its modules hold the same layers, one shape each, no experts."""
    return not entry.differs and entry.experts is None and all(
        c.layers == entry.layers and not c.differs and c.experts is None
        for c in found.values())


def member(w: _Writer, unit: str, tensor: str, signature: tuple[str, list[int]],
           shape: Sequence[str], sharding: Any, **extra: Any) -> dict[str, Any] | None:
    """One `members:` entry, a line per key (None when the shape's rank is not the expected
    one)."""
    dtype, actual = signature
    if len(actual) != len(shape):
        return None
    entry: dict[str, Any] = {"target": Quoted(f"{unit}.{tensor}"),
                             "shape": FlowList(_entry(t) for t in shape)}
    if dtype != w.default_dtype:
        entry["dtype"] = dtype
    entry["sharding"] = sharding
    entry.update(extra)
    return entry


def written(w: _Writer, unit: str, module: str, tensors: Mapping[str, tuple[str, list[int]]],
            axes: Mapping[str, tuple[list[str], dict[str, Any], bool]]
            ) -> list[dict[str, Any]] | None:
    """The `members:` of a mixer's `tensors` (by name under `module`), each with its shape,
    split and `format: linear` as `axes` says, in the order of `axes`; None when the module
    holds a tensor `axes` lacks or one of another rank."""
    if set(tensors) - set(axes):
        return None
    members = []
    for name, (shape, split, linear) in axes.items():
        if name not in tensors:
            continue
        extra = {k: v for k, v in split.items() if k != "sharding"}
        if linear:
            extra["format"] = "linear"
        one = member(w, unit, f"{module}.{name}", tensors[name], shape, split["sharding"],
                     **extra)
        if one is None:
            return None
        members.append(one)
    return members


def segments(sizes: Sequence[str], heads: Sequence[str] | None = None) -> dict[str, Any]:
    """A `partitioned_segments` split over axis 0, with its `heads:` when given."""
    out: dict[str, Any] = {"sharding": {"partitioned_segments": Flow(
        axis=0, segments=FlowList(_entry(s) for s in sizes))}}
    if heads is not None:
        out["heads"] = FlowList(_entry(h) for h in heads)
    return out


def mamba2_mixers(blocks: Blocks, groups: list[dict[str, Any]], done: set[str]) -> None:
    """Append a group per Mamba2 mixer of the layers not `done` (adding its modules)."""
    scan_mixers(blocks, groups, done, {"A_log", "D", "dt_bias"},
                lambda found: found == _CHILDREN, _mixer)


def scan_mixers(blocks: Blocks, groups: list[dict[str, Any]], done: set[str], params: set[str],
                wanted: Callable[[set[str]], bool], build: Callable[..., bool]) -> None:
    """Call `build(blocks, groups, module, entry, found)` on every module not `done` that holds
    exactly `params` and child modules whose names `wanted` accepts, all in one scope
    (`same_scope`); a module whose group `build` writes is `done`, with its children."""
    table = blocks.table
    for module in sorted(m for m in table if m not in done):
        entry = table[module]
        found = children(table, module, done)
        if set(entry.params) != params or not wanted(set(found)) or \
                not same_scope(entry, found):
            continue
        if build(blocks, groups, module, entry, found):
            done.update({module, *(f"{module}.{c}" for c in found)})


def _mixer(blocks: Blocks, groups: list[dict[str, Any]], module: str, entry: _Module,
           found: Mapping[str, _Module]) -> bool:
    """The mixer's group, when its shapes are Mamba2's and the config explains them."""
    w = blocks.w
    shapes = {f"{c}.{p}": s for c, e in found.items() for p, s in e.params.items()}
    if not {"in_proj.weight", "conv1d.weight", "norm.weight", "out_proj.weight"} <= set(shapes):
        return False
    heads = entry.params["A_log"][1]
    hidden, inner = (shapes["out_proj.weight"][1] + [0, 0])[:2]
    conv = shapes["conv1d.weight"][1]
    if len(heads) != 1 or len(conv) != 3 or hidden != w.values.get("hidden_size") or \
            not inner or (conv[0] - inner) % 2 or conv[0] <= inner:
        return False
    h, width = heads[0], (conv[0] - inner) // 2  # width: G * N
    if entry.params["D"][1] != [h] or entry.params["dt_bias"][1] != [h] or \
            shapes["norm.weight"][1] != [inner] or \
            shapes["in_proj.weight"][1] != [2 * inner + 2 * width + h, hidden] or inner % h:
        return False
    found_groups = [g for v in _divisors(width) if (g := field(w, v, "group"))]
    states = [(g, s) for g in found_groups if (s := field(w, width // w.config[g], "state"))]
    head_name = field(w, h, "heads")
    expand = field(w, inner // hidden, "expand") if inner % hidden == 0 else None
    head_dim = field(w, inner // h, "head") if expand is None else None
    u = f"{expand} * hidden_size" if expand else f"{head_name} * {head_dim}" if head_dim \
        else None
    k = field(w, conv[2], "conv")
    if len(states) != 1 or head_name is None or u is None or k is None:
        return False
    g, n = states[0]
    one = w.config[g] == 1
    gw = f"{g} * {n}"
    by_head = {"heads": head_name} if one else {}
    in_heads = [head_name, head_name, g, g, head_name] if one else None
    conv_heads = [head_name, g, g] if one else None
    rows = f"2 * {u} + 2 * {gw} + {head_name}"
    axes = {"in_proj.weight": ([rows, "hidden_size"], segments([u, u, gw, gw, head_name],
                                                                in_heads), True),
            "in_proj.bias": ([rows], segments([u, u, gw, gw, head_name], in_heads), False),
            "conv1d.weight": ([f"{u} + 2 * {gw}", "1", k], segments([u, gw, gw], conv_heads),
                              False),
            "conv1d.bias": ([f"{u} + 2 * {gw}"], segments([u, gw, gw], conv_heads), False),
            "dt_bias": ([head_name], {"sharding": Flow(partitioned=0), **by_head}, False),
            "A_log": ([head_name], {"sharding": Flow(partitioned=0), **by_head}, False),
            "D": ([head_name], {"sharding": Flow(partitioned=0), **by_head}, False),
            "norm.weight": ([u], {"sharding": Flow(partitioned=0), **by_head, **(
                {"reduction": "tensor_parallel"} if one else {})}, False),
            "out_proj.weight": (["hidden_size", u], {"sharding": Flow(partitioned=1),
                                                     **by_head}, True),
            "out_proj.bias": (["hidden_size"], {"sharding": "replicated"}, False)}
    members = written(w, blocks.unit, module, {**shapes, **entry.params}, axes)
    if members is None:
        return False
    declare(w, [x for x in (g, n, head_name, expand, head_dim, k) if x is not None])
    group = blocks._group(groups, f"layers.{{unit}}.{module}", "channels", g, entry)
    if one:
        group["kv_replication"] = True
    group["members"] = members
    w.used.add("hidden_size")
    return True


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
