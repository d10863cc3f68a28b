"""`partc init`: a vision tower's fused `[q | k | v]` attention (Qwen2-VL's `attn.qkv` beside
`attn.proj`), split by heads as architectures/qwen2_vl.yaml declares it.

The tower's heads are its config section's head count over its width: the fused rows are
3 * width, the output `[width, width]`. Which row order (component-major, per head, `groups`
blocks) the shapes leave open: the candidates are `partc init --prove`'s, as a decoder's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.fused import Blocks, _oriented, _projection, _weight, attention_candidates
from partc.scaffold.layer_table import _Module
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

_QKV, _OUT = "attn.qkv", "attn.proj"


def encoder_attention(blocks: Blocks, groups: list[dict[str, Any]], table: Mapping[str, _Module],
                      label: str, owner: str, heads: str | None, width: str | None
                      ) -> set[str]:
    """The attention group of an encoder's fused `attn.qkv` and `attn.proj` (appended to
    `groups`), split over `heads`; the modules written (none when the shapes do not fit)."""
    w = blocks.w
    fused, out = table.get(_QKV), table.get(_OUT)
    if heads is None or width is None or fused is None or out is None:
        return set()
    count, size = w.values[heads], w.values[width]
    if set(fused.params) != set(out.params) or not {"weight"} <= set(fused.params) <= {
            "weight", "bias"} or any(e.experts is not None or e.differs for e in (fused, out)) \
            or fused.layers != out.layers or size % count or \
            _weight(fused) != [3 * size, size] or _weight(out) != [size, size]:
        return set()
    group: dict[str, Any] = {"name": Quoted(f"{label}.{{unit}}.attention"),
                             "role": "attention_heads", "owner": Flow(unit=owner)}
    w.scope(group, _QKV, fused)
    group["units"] = heads
    w.used.update((heads, width))
    groups.append(group)
    chosen = blocks._choose(group, _QKV, attention_candidates(count, count, [False]))
    segments, seg_heads = [width] * 3, [heads] * 3  # component-major: q, k, v of every head
    if chosen.layout in ("per_head", "grouped"):  # a head's (a group's) q, k, v rows together
        segments, seg_heads = [f"{width} // {chosen.groups or heads}"] * 3, [heads]
    spec: dict[str, Any] = {"module": Quoted(f"{blocks.unit}.{_QKV}")}
    if chosen.layout != "component_major":
        spec["layout"] = chosen.layout
    if chosen.groups is not None:
        spec["groups"] = chosen.groups
    spec["segments"] = FlowList(segments)
    spec["heads"] = FlowList(seg_heads)
    w.params(spec, _oriented(w, _QKV, fused, f"3 * {width}", width, False), _QKV)
    group["fused"] = spec
    output = _projection(w, blocks.unit, "attn", "proj", out, "row", width, width, False,
                         heads=heads)
    del output["sharding"]
    group["output"] = output
    return {_QKV, _OUT}

