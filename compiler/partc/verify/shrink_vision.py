"""How `partc verify` shrinks the vision side of a large vision-language config: its
`vision_config` (the vision tower) and the top-level fields tying the tower to the decoder.

The decoder's `text_config` is shrunk by the text rules (`partc.verify.shrink.SHRINK_RULES`);
the tower here keeps its structure with a few heads of at most 16 channels, enough layers for
the pipeline check's cuts and `vision_feature_layer`, and a small image (PATCHES_PER_SIDE
patches a side, or as many as a pooled image token count needs); its output width follows the
shrunk decoder where the tower's own config says it (Qwen2-VL's merger `hidden_size`,
Qwen2.5-VL's `out_hidden_size`). A projector built from both configs (LLaVA's, Gemma-3's)
follows them by itself.
"""

from __future__ import annotations

import math
from typing import Any

VISION_LARGE = {"hidden_size": 256, "embed_dim": 256, "intermediate_size": 1024,
                "num_hidden_layers": 8, "depth": 8, "num_attention_heads": 16, "num_heads": 16}
"""A vision tower is shrunk when any of these exceeds its value (or its image is more than
PATCHES_PER_SIDE_LARGE patches a side), or when the config's decoder is."""
PATCHES_PER_SIDE_LARGE = 8
"""Patches a side of an image above which a tower is large."""
PATCHES_PER_SIDE = 2
"""Patches a side of a shrunk tower's image (one token per patch: 4 image tokens)."""
VISION_HEAD_DIM = 16
"""The widest head of a shrunk tower (a narrower real one is kept)."""
VISION_INTERMEDIATE = 128
"""A shrunk tower's feed-forward width."""
VISION_LAYERS = 3
"""The fewest layers a shrunk tower keeps (fewer when the config has fewer)."""
POOLED_TOKENS = 4
"""Image tokens of a shrunk model whose projector pools to `mm_tokens_per_image` (2 x 2)."""
_TOKEN_FIELDS = ("_token_id", "_token_index")
"""How the top-level fields naming a vision-language model's own token ids end."""


def _first(config: dict[str, Any], *names: str) -> str | None:
    return next((name for name in names if isinstance(config.get(name), int)), None)


def vision_is_large(vision: dict[str, Any]) -> bool:
    """Whether a vision tower's sizes exceed VISION_LARGE (or its image PATCHES_PER_SIDE_LARGE
    patches a side)."""
    image, patch = vision.get("image_size"), vision.get("patch_size")
    sides = image // patch if isinstance(image, int) and isinstance(patch, int) and patch else 0
    return sides > PATCHES_PER_SIDE_LARGE or any(
        (vision.get(name) or 0) > limit for name, limit in VISION_LARGE.items())


def _feature_layers(config: dict[str, Any]) -> int:
    """The tower layers `vision_feature_layer` (an index into the hidden states, or a list of
    them) needs: -2 reads the last but one layer's output, 3 layers keep it distinct from the
    last; a non-negative index i reads layer i's output."""
    wanted = config.get("vision_feature_layer")
    layers = wanted if isinstance(wanted, list) else [wanted]
    return max([1 - v if v < 0 else v for v in layers if isinstance(v, int)], default=0)


def shrunk_tower(vision: dict[str, Any], config: dict[str, Any], text_hidden: int | None, *,
                 tensor_parallel_size: int, pipeline_parallel_size: int,
                 keep_layers: bool) -> dict[str, Any]:
    """The new values of a vision tower's size fields: heads (a head per rank of the largest
    T, at least 4, at most the tower's), their width at most VISION_HEAD_DIM, the feed-forward
    width, layers (enough for `vision_feature_layer` and a layer per stage; all of them with
    `keep_layers`), the image, and the tower's output width where it is the decoder's."""
    out: dict[str, Any] = {}
    heads_name = _first(vision, "num_attention_heads", "num_heads")
    width_name = "embed_dim" if isinstance(vision.get("embed_dim"), int) else "hidden_size"
    if heads_name and isinstance(vision.get(width_name), int):
        heads = int(vision[heads_name])
        small = min(heads, max(4, tensor_parallel_size))
        width = small * min(VISION_HEAD_DIM, int(vision[width_name]) // heads)
        out[heads_name], out[width_name] = small, width
    if (vision.get("intermediate_size") or 0) > VISION_INTERMEDIATE:
        out["intermediate_size"] = VISION_INTERMEDIATE
    layers_name = _first(vision, "num_hidden_layers", "depth")
    if layers_name and not keep_layers:
        layers = min(int(vision[layers_name]), max(VISION_LAYERS, pipeline_parallel_size,
                                                   _feature_layers(config)))
        out[layers_name] = layers
        if isinstance(vision.get("fullatt_block_indexes"), list):  # Qwen2.5-VL
            out["fullatt_block_indexes"] = [i for i in vision["fullatt_block_indexes"]
                                            if i < layers] or [layers - 1]
    if isinstance(vision.get("image_size"), int) and isinstance(vision.get("patch_size"), int):
        pooled = config.get("mm_tokens_per_image")
        side = 2 * math.isqrt(POOLED_TOKENS) if isinstance(pooled, int) else PATCHES_PER_SIDE
        out["image_size"] = min(int(vision["image_size"]), side * int(vision["patch_size"]))
    if text_hidden is not None:
        if width_name == "embed_dim" and "hidden_size" in vision:  # Qwen2-VL's merger output
            out["hidden_size"] = text_hidden
        if "out_hidden_size" in vision:  # Qwen2.5-VL's
            out["out_hidden_size"] = text_hidden
    return {k: v for k, v in out.items() if vision.get(k) != v}


def shrunk_ties(config: dict[str, Any], vision: dict[str, Any],
                vocab: int | None) -> dict[str, Any]:
    """The new values of the top-level fields tying the tower to the decoder: each token id
    (`image_token_index`, `boi_token_index`, ...) outside the shrunk vocabulary moved to the
    highest free ids (the largest to the last id), `mm_tokens_per_image` to POOLED_TOKENS,
    LLaVA's `image_seq_length` to the shrunk image's patches."""
    out: dict[str, Any] = {}
    if isinstance(vocab, int):
        ids = {name: value for name, value in config.items() if isinstance(value, int)
               and not isinstance(value, bool) and name.endswith(_TOKEN_FIELDS)}
        taken = {value for value in ids.values() if value < vocab}
        free = (i for i in range(vocab - 1, -1, -1) if i not in taken)
        for name, value in sorted(ids.items(), key=lambda item: (-item[1], item[0])):
            if value >= vocab:
                out[name] = next(free)
    if (config.get("mm_tokens_per_image") or 0) > POOLED_TOKENS:
        out["mm_tokens_per_image"] = POOLED_TOKENS
    image, patch = vision.get("image_size"), vision.get("patch_size")
    if isinstance(config.get("image_seq_length"), int) and isinstance(image, int) \
            and isinstance(patch, int) and patch:
        pooled = out.get("mm_tokens_per_image", config.get("mm_tokens_per_image"))
        out["image_seq_length"] = pooled if isinstance(pooled, int) else (image // patch) ** 2
    return {k: v for k, v in out.items() if config.get(k) != v}
