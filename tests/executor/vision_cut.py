"""Cut rank shards of the vision-language fixtures (llava, qwen2_vl) from full tensors with numpy.

The executor's own plan, independent of partc, per pipeline stage (a :class:`.vision.Span`):

* vision attention heads split evenly (:func:`.cut.balanced`): CLIP's separate ``q/k/v_proj``
  rows (weight and bias) of the rank's heads, ``out_proj`` columns; Qwen2-VL's fused
  ``attn.qkv`` ``[q | k | v]`` as three row ranges, the same head range from each block, and
  ``attn.proj`` columns; vision ``fc1`` rows / ``fc2`` columns over the intermediate axis;
* the patch embedding (Conv2d / Conv3d kernel) on its output channels (axis 0);
* the projector (``linear_1`` / ``merger.mlp.0`` rows, ``linear_2`` / ``merger.mlp.2`` columns);
* the decoder as the llama-like families: vocab-parallel embedding and ``lm_head``, query heads
  with the KV heads they need, the MLP intermediate axis;
* norms, class / position embeddings and row-parallel biases whole on every rank.

``replicate_vision=True`` keeps the vision tower and projector whole on every rank instead.
Shards keep the checkpoint's own names; selections are decided on :func:`.vision.canonical`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .cut import _merge, balanced, take
from .shard import RankShard, Selection
from .vision import Span, VisionArch, canonical, describe, full_span

Ranges = list[tuple[int, int]]


def _part(arch: VisionArch, name: str) -> tuple[str, int | None, str]:
    """``(part, unit, rest)``: part is vision / vision_embed / vision_post / projector /
    embed / decoder / head; ``unit`` the layer index of a per-layer tensor."""
    for part, prefix in (("vision", arch.layer.split("{}")[0]), ("decoder", "model.layers.")):
        if name.startswith(prefix):
            unit, rest = name[len(prefix):].split(".", 1)
            return part, int(unit), rest
    if name.startswith(("multi_modal_projector.", "visual.merger.")):
        return "projector", None, name.split(".", 1)[1].removeprefix("merger.")
    if name.startswith("vision_tower.post_layernorm."):
        return "vision_post", None, name
    if name.startswith(("vision_tower.", "visual.")):
        return "vision_embed", None, name
    if name == "model.embed_tokens.weight":
        return "embed", None, name
    if name in ("model.norm.weight", "lm_head.weight"):
        return "head", None, name
    raise ValueError(f"{name}: not a tensor of a {arch.model_type} checkpoint")


def keeps(arch: VisionArch, span: Span, name: str) -> bool:
    """Whether a stage running ``span`` holds the (canonical) tensor ``name``."""
    part, unit, _ = _part(arch, name)
    if part == "vision":  # the layers past the selected one stay with the last vision unit
        return min(unit, arch.n_used - 1) in span.vision if unit is not None else False
    if part == "vision_embed":
        return 0 in span.vision
    if part == "vision_post":  # never reaches the logits; kept with the last vision unit
        return arch.n_used - 1 in span.vision
    if part == "projector":
        return bool(span.projector)
    if part == "decoder":
        return unit in span.decoder
    if part == "embed":
        return 0 in span.decoder or (
            arch.n_decoder - 1 in span.decoder and bool(arch.decoder.get("tie_word_embeddings"))
        )
    return arch.n_decoder - 1 in span.decoder  # final norm, lm_head


def _vision_rules(arch: VisionArch, tp: int, rank: int) -> dict[str, tuple[int, Ranges]]:
    hd, width = arch.head_dim, arch.width
    h0, h1 = balanced(arch.heads, tp)[rank]
    heads = (h0 * hd, h1 * hd)
    inter = balanced(arch.intermediate, tp)[rank]
    n = arch.names
    rules: dict[str, tuple[int, Ranges]] = {
        f"{n['out']}.weight": (1, [heads]),
        f"{n['fc1']}.weight": (0, [inter]),
        f"{n['fc1']}.bias": (0, [inter]),
        f"{n['fc2']}.weight": (1, [inter]),
    }
    if "qkv" in n:
        fused = [(b * width + heads[0], b * width + heads[1]) for b in range(3)]
        rules |= {f"{n['qkv']}.weight": (0, fused), f"{n['qkv']}.bias": (0, fused)}
    else:
        for leaf in ("q", "k", "v"):
            rules |= {f"{n[leaf]}.weight": (0, [heads]), f"{n[leaf]}.bias": (0, [heads])}
    return rules


def _decoder_rules(arch: VisionArch, tp: int, rank: int) -> dict[str, tuple[int, Ranges]]:
    c = arch.decoder
    heads, kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or 0)
    kv = kv or heads
    hd = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    q0, q1 = balanced(heads, tp)[rank]
    group = heads // kv
    k0, k1 = q0 // group, (q1 - 1) // group + 1
    inter = balanced(int(c["intermediate_size"]), tp)[rank]
    rules: dict[str, tuple[int, Ranges]] = {
        "self_attn.o_proj.weight": (1, [(q0 * hd, q1 * hd)]),
        "mlp.gate_proj.weight": (0, [inter]),
        "mlp.up_proj.weight": (0, [inter]),
        "mlp.down_proj.weight": (1, [inter]),
    }
    for leaf, (a, b) in (("q", (q0, q1)), ("k", (k0, k1)), ("v", (k0, k1))):
        for kind in ("weight", "bias"):
            rules[f"self_attn.{leaf}_proj.{kind}"] = (0, [(a * hd, b * hd)])
    return rules


def selection(
    arch: VisionArch,
    name: str,
    shape: tuple[int, ...],
    tp: int,
    rank: int,
    *,
    replicate_vision: bool = False,
) -> Selection | None:
    """The slice rank ``rank`` of ``tp`` holds of the (canonical) tensor ``name`` (None: whole)."""
    part, _, rest = _part(arch, name)
    rules: dict[str, tuple[int, Ranges]]
    if part in ("vision", "vision_embed", "projector") and replicate_vision:
        return None
    if part == "vision":
        rules = _vision_rules(arch, tp, rank)
    elif part == "vision_embed":
        rules = {name: (0, [balanced(shape[0], tp)[rank]])} if name.endswith(
            ("patch_embedding.weight", "patch_embed.proj.weight")) else {}
        rest = name
    elif part == "projector":
        first, second = ("linear_1", "linear_2") if arch.model_type == "llava" else ("mlp.0",
                                                                                    "mlp.2")
        inner = balanced(shape[0] if rest.startswith(first) else shape[-1], tp)[rank]
        rules = {f"{first}.weight": (0, [inner]), f"{first}.bias": (0, [inner]),
                 f"{second}.weight": (1, [inner])}
    elif part == "decoder":
        rules = _decoder_rules(arch, tp, rank)
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        rules, rest = {name: (0, [balanced(shape[0], tp)[rank]])}, name
    else:
        rules = {}
    if rest not in rules:
        return None
    axis, ranges = rules[rest]
    return Selection(axis, _merge(ranges))


def cut_vision_language(
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    tp: int,
    *,
    span: Span | None = None,
    replicate_vision: bool = False,
) -> list[RankShard]:
    """The ``tp`` tensor-parallel rank shards of the stage running ``span`` (default: all)."""
    arch = describe(config)
    span = full_span(arch) if span is None else span
    span.bounds(arch)
    ranks = []
    for rank in range(tp):
        held, sels = {}, {}
        for name, full in tensors.items():
            canon = canonical(name)
            if not keeps(arch, span, canon):
                continue
            sel = selection(arch, canon, tuple(full.shape), tp, rank,
                            replicate_vision=replicate_vision)
            held[name], sels[name] = take(np.asarray(full), sel), sel
        ranks.append(RankShard(held, sels))
    return ranks
