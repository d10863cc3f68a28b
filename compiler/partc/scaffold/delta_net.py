"""`partc init`: Qwen3-Next's gated DeltaNet split by key heads, as architectures/qwen3_next.yaml
does.

A module holding `A_log` and `dt_bias` [Hv] beside `in_proj_qkvz` [2Kd + 2Vd, hidden],
`in_proj_ba` [2Hv, hidden], `conv1d` [2Kd + Vd, 1, K], a gated `norm` [dv] and `out_proj`
[hidden, Vd] (Qwen3-Next's `linear_attn`; Kd = Hk·dk, Vd = Hv·dv) is one `channels` group over
its Hk key heads, split as vLLM's Qwen3Next: in_proj_qkvz and in_proj_ba hold one row block per
key head (its q, k, v, z; its b, a: transformers' `fix_query_key_value_ordering`), so a rank's
key heads are one contiguous row range; conv1d runs over [all q | all k | all v] and takes the
rank's key heads' channels in each block; A_log and dt_bias by value head; the norm over one
value head replicated; out_proj row-parallel. The shapes give Hv, dv, Vd and Kd; Hk and dk
apart, and the conv kernel, are read from the config fields of those values named like them
(`linear_num_key_heads`, `linear_key_head_dim`). A block whose sizes no field explains is left
to the replicated groups (marked CHECK there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.fused import Blocks, Candidate
from partc.scaffold.layer_table import _Module
from partc.scaffold.ssm2 import declare, field, scan_mixers, segments, written
from partc.scaffold.yaml_writer import Flow, FlowList

_CHILDREN = frozenset({"in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"})
"""A gated DeltaNet's modules."""


_CANDIDATES = (Candidate("per_head"), Candidate("component_major"))
"""The row orders of in_proj_qkvz and in_proj_ba: one block per key head (Qwen3-Next's), or
[all q | all k | all v | all z] and [all b | all a]."""


def delta_nets(blocks: Blocks, groups: list[dict[str, Any]], done: set[str]) -> None:
    """Append a group per gated DeltaNet of the layers not `done` (adding its modules)."""
    scan_mixers(blocks, groups, done, {"A_log", "dt_bias"}, lambda found: found == _CHILDREN,
                _delta_net)


def _delta_net(blocks: Blocks, groups: list[dict[str, Any]], module: str, entry: _Module,
               found: Mapping[str, _Module]) -> bool:
    """The block's group, when its shapes are a gated DeltaNet's and the config explains
    them."""
    w = blocks.w
    shapes = {f"{c}.{p}": s for c, e in found.items() for p, s in e.params.items()}
    needed = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "norm.weight",
              "out_proj.weight")
    if not set(needed) <= set(shapes) or len(entry.params["A_log"][1]) != 1:
        return False
    hv = entry.params["A_log"][1][0]
    hidden = w.values.get("hidden_size")
    value_width = (shapes["out_proj.weight"][1] + [0, 0])[1]
    conv = shapes["conv1d.weight"][1]
    dv = (shapes["norm.weight"][1] + [0])[0]
    key_width = (conv[0] - value_width) // 2 if len(conv) == 3 else 0
    if not hv or not dv or key_width <= 0 or (conv[0] - value_width) % 2 or \
            value_width != hv * dv or entry.params["dt_bias"][1] != [hv] or \
            shapes["out_proj.weight"][1] != [hidden, value_width] or \
            shapes["in_proj_ba.weight"][1] != [2 * hv, hidden] or \
            shapes["in_proj_qkvz.weight"][1] != [2 * key_width + 2 * value_width, hidden]:
        return False
    # key heads and their width: a pair of fields whose product is Kd, the value heads a
    # whole number per key head
    pairs = [(h, d) for v in range(1, key_width + 1) if key_width % v == 0 and hv % v == 0
             and (h := field(w, v, "key", "heads")) and (d := field(w, key_width // v, "key",
                                                                     "dim"))]
    value_heads, value_dim = field(w, hv, "value", "heads"), field(w, dv, "value", "dim")
    k = field(w, conv[2], "conv")
    if len(pairs) != 1 or value_heads is None or value_dim is None or k is None:
        return False
    hk, dk = pairs[0]
    axes = _axes(hk, dk, value_heads, value_dim, k, per_head=True)
    tensors = {**shapes, **entry.params}
    if written(w, blocks.unit, module, tensors, axes) is None:
        return False
    declare(w, [hk, dk, value_heads, value_dim, k])
    group = blocks._group(groups, f"layers.{{unit}}.{module}", "channels", hk, entry)
    chosen = blocks._choose(group, f"{module}.in_proj_qkvz", _CANDIDATES, key="units")
    group["members"] = written(w, blocks.unit, module, tensors, _axes(
        hk, dk, value_heads, value_dim, k, per_head=chosen.layout == "per_head"))
    w.used.add("hidden_size")
    return True


def _axes(hk: str, dk: str, value_heads: str, value_dim: str, k: str, *, per_head: bool
          ) -> dict[str, tuple[list[str], dict[str, Any], bool]]:
    """Each tensor's shape, split and whether it is a linear weight, its input projections'
    rows one block per key head (`per_head`) or component-major."""
    kd, vd = f"{hk} * {dk}", f"{value_heads} * {value_dim}"
    rows = {"sharding": Flow(partitioned=0), "heads": FlowList([hk])}
    return {
        "in_proj_qkvz.weight": ([f"2 * {kd} + 2 * {vd}", "hidden_size"], rows if per_head else
                                segments([kd, kd, vd, vd], [hk, hk, value_heads, value_heads]),
                                True),
        "in_proj_ba.weight": ([f"2 * {value_heads}", "hidden_size"], rows if per_head else
                              segments([value_heads] * 2, [value_heads] * 2), True),
        "conv1d.weight": ([f"2 * {kd} + {vd}", "1", k],
                          segments([kd, kd, vd], [hk, hk, value_heads]), False),
        "A_log": ([value_heads], {"sharding": Flow(partitioned=0)}, False),
        "dt_bias": ([value_heads], {"sharding": Flow(partitioned=0)}, False),
        "norm.weight": ([value_dim], {"sharding": "replicated"}, False),
        "out_proj.weight": (["hidden_size", vd], {"sharding": Flow(partitioned=1),
                                                  "heads": FlowList([value_heads])}, True)}
