"""Cut rank shards of the :mod:`.variants` families from full tensors with numpy.

The executor's own plan, independent of partc: vocab-parallel embedding and head, query heads
split evenly (part ``i`` of ``n`` over ``k`` gets ``n // k + (1 if i < n % k else 0)``) with the
KV heads those queries need (replicated when there are fewer KV heads than ranks), and the MLP
intermediate dimension split evenly. Each fused layout is cut the way it is stored:

* component-major (gpt2 ``c_attn``): three ranges of the out axis, one per q / k / v block;
* per-head interleaved (gpt_neox, bloom): whole ``[q_h | k_h | v_h]`` blocks;
* grouped per KV head (falcon): per group, the rank's query rows of the group plus the group's
  k and v rows (whole groups when the rank holds every query head of them);
* CodeGen's ``mp_num`` groups of ``[q_g | v_g | k_g]``: in each group holding some of the rank's
  heads, those heads' rows of q, of v and of k;
* DBRX's fused experts ``w1`` / ``v1`` / ``w2`` ``[E * I, H]``: the rank's intermediate channels
  inside every expert's block of ``I`` rows;
* Conv1D weights (gpt2) are ``[in, out]``: column-parallel on axis 1, row-parallel on axis 0;
* OLMo-2's ``q_norm`` / ``k_norm`` follow their projection's out axis;
* StableLM's per-head ``q_layernorm.norms.{h}`` / ``k_layernorm.norms.{h}`` are held whole by
  the ranks of head ``h`` only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .shard import RankShard, Selection
from .variants import Arch, describe

Ranges = list[tuple[int, int]]


def balanced(n: int, k: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``k`` consecutive parts, the first ``n % k`` one longer."""
    bounds, start = [], 0
    for i in range(k):
        size = n // k + (1 if i < n % k else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _merge(ranges: Ranges) -> tuple[tuple[int, int], ...]:
    merged: Ranges = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        elif end > start:
            merged.append((start, end))
    return tuple(merged)


def _fused_ranges(arch: Arch, q0: int, q1: int) -> Ranges:
    """Out-axis ranges of the fused qkv rows for query heads ``[q0, q1)``."""
    hd, heads, kv = arch.head_dim, arch.n_heads, arch.n_kv_heads
    group = heads // kv
    k0, k1 = q0 // group, (q1 - 1) // group + 1
    layout = arch.spec.qkv
    if layout == "component":
        nq, nkv = heads * hd, kv * hd
        return [(q0 * hd, q1 * hd), (nq + k0 * hd, nq + k1 * hd),
                (nq + nkv + k0 * hd, nq + nkv + k1 * hd)]
    if layout == "interleaved":
        if kv != heads:
            raise ValueError("per-head interleaved qkv needs one kv head per query head")
        return [(3 * hd * q0, 3 * hd * q1)]
    if layout == "grouped":
        size = (group + 2) * hd
        ranges: Ranges = []
        for g in range(k0, k1):
            s0, s1 = max(q0, g * group) - g * group, min(q1, (g + 1) * group) - g * group
            queries = (g * size + s0 * hd, g * size + s1 * hd)
            ranges += [queries, (g * size + group * hd, (g + 1) * size)]  # then k_g, v_g
        return ranges
    if layout == "mp_grouped":
        local, per_group = heads * hd // arch.mp_num, heads // arch.mp_num
        ranges = []
        for g in range(q0 // per_group, (q1 - 1) // per_group + 1):
            base = g * per_group
            s0, s1 = max(q0, base) - base, min(q1, base + per_group) - base
            for part in range(3):  # q, v, k
                start = g * 3 * local + part * local
                ranges.append((start + s0 * hd, start + s1 * hd))
        return ranges
    raise ValueError(f"no fused layout {layout!r}")


def selection(
    arch: Arch, name: str, shape: tuple[int, ...], tp: int, rank: int
) -> Selection | None:
    """The slice rank ``rank`` of ``tp`` holds of tensor ``name`` (None: whole)."""
    spec = arch.spec
    if name in (spec.embed, spec.lm_head) or (
        spec.lm_head and name == spec.lm_head.replace(".weight", ".bias")
    ):
        return Selection(0, (balanced(shape[0], tp)[rank],))
    layer_prefix = spec.layer.split("{}")[0]
    if not name.startswith(layer_prefix):
        return None  # positions, embedding norm, final norm
    rest = name[len(layer_prefix):].split(".", 1)[1]
    hd = arch.head_dim
    q0, q1 = balanced(arch.n_heads, tp)[rank]
    group = arch.n_heads // arch.n_kv_heads
    k0, k1 = q0 // group, (q1 - 1) // group + 1
    col_axis, row_axis = (1, 0) if spec.conv1d else (0, 1)
    attn = spec.attn + "."
    inter = balanced(arch.intermediate, tp)[rank]
    by_rest: dict[str, tuple[int, Ranges]] = {
        f"{attn}{spec.out}.weight": (row_axis, [(q0 * hd, q1 * hd)]),
    }
    if spec.qkv != "separate":
        fused = _fused_ranges(arch, q0, q1)
        by_rest[f"{attn}{spec.fused}.weight"] = (col_axis, fused)
        by_rest[f"{attn}{spec.fused}.bias"] = (0, fused)
    for leaf, (a, b) in (("q", (q0, q1)), ("k", (k0, k1)), ("v", (k0, k1))):
        for kind in (f"{leaf}_proj.weight", f"{leaf}_proj.bias", f"{leaf}_norm.weight"):
            by_rest[attn + kind] = (0, [(a * hd, b * hd)])
    for up in spec.mlp[:-1]:
        by_rest[f"{up}.weight"] = (col_axis, [inter])
        by_rest[f"{up}.bias"] = (0, [inter])
    if spec.mlp:
        by_rest[f"{spec.mlp[-1]}.weight"] = (row_axis, [inter])
    if spec.moe == "dbrx":
        experts, size = int(arch.config["ffn_config"]["moe_num_experts"]), arch.intermediate
        blocks = [(e * size + inter[0], e * size + inter[1]) for e in range(experts)]
        for part in ("w1", "v1", "w2"):
            by_rest[f"ffn.experts.mlp.{part}"] = (0, blocks)
    if rest not in by_rest:
        return None  # norms, output biases (added once after the reduction)
    axis, ranges = by_rest[rest]
    return Selection(axis, _merge(ranges))


def holds_head(arch: Arch, name: str, tp: int, rank: int) -> bool:
    """Whether rank ``rank`` of ``tp`` holds ``name``: a per-head norm (StableLM's
    ``q_layernorm.norms.{h}``) only on the ranks of its head, every other tensor everywhere."""
    found = re.search(r"\.([qk])_layernorm\.norms\.(\d+)\.weight$", name)
    if not arch.per_head_norm or found is None:
        return True
    q0, q1 = balanced(arch.n_heads, tp)[rank]
    group = arch.n_heads // arch.n_kv_heads
    a, b = (q0, q1) if found.group(1) == "q" else (q0 // group, (q1 - 1) // group + 1)
    return a <= int(found.group(2)) < b


def take(full: np.ndarray, sel: Selection | None) -> np.ndarray:
    """The local tensor a selection names, cut from the full tensor."""
    if sel is None:
        return full
    pieces = [np.take(full, np.arange(a, b), axis=sel.axis) for a, b in sel.ranges]
    return np.ascontiguousarray(np.concatenate(pieces, axis=sel.axis))


def stage_filter(arch: Arch, layers: range) -> Callable[[str], bool]:
    """Which tensors a pipeline stage running ``layers`` holds."""
    spec = arch.spec
    first, last = layers.start == 0, layers.stop == arch.n_layers
    layer_prefix = spec.layer.split("{}")[0]
    embedding = {spec.embed, spec.wpe, f"{spec.embed_norm}.weight", f"{spec.embed_norm}.bias"}

    def keep(name: str) -> bool:
        if name.startswith(layer_prefix):
            return int(name[len(layer_prefix):].split(".")[0]) in layers
        if name == spec.embed:
            return first or (last and spec.lm_head is None)
        if name in embedding:
            return first
        return last  # final norm, lm_head (+ bias)

    return keep


def cut_shards(
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    tp: int,
    *,
    layers: range | None = None,
) -> list[RankShard]:
    """The ``tp`` tensor-parallel rank shards of one stage (default: the whole model)."""
    arch = describe(config)
    keep = stage_filter(arch, layers if layers is not None else range(arch.n_layers))
    ranks = []
    for rank in range(tp):
        sels = {
            name: selection(arch, name, full.shape, tp, rank)
            for name, full in tensors.items()
            if keep(name) and holds_head(arch, name, tp, rank)
        }
        ranks.append(RankShard({n: take(np.asarray(tensors[n]), s) for n, s in sels.items()}, sels))
    return ranks
