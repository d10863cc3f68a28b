"""The seeded inputs of `partc verify`'s forward passes: token ids, and for a model with a
`vision_config` one image (pixel values of the shape its vision tower takes) and as many image
tokens in the ids as the config's own pooling gives image features.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from partc.errors import VerifyError
from partc.verify.reference import require_libraries

INPUT_IDS = (1, 5, 9, 17, 33, 64, 100, 130)
"""The token ids every module's inputs are captured from (clipped to the vocabulary)."""
IMAGE_AFTER = 3
"""The image's tokens follow this many text tokens (then the rest of INPUT_IDS)."""


def _image_token(config: dict[str, Any]) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        if isinstance(config.get(name), int):
            return int(config[name])
    return None


def _special_ids(config: dict[str, Any]) -> set[int]:
    """The ids of a vision-language config's own tokens (image, video, begin and end of an
    image: every top-level `*_token_id` / `*_token_index` but padding, begin and end of text),
    which a text id must not take: the model would count it as an image token."""
    return {value for name, value in config.items() if isinstance(value, int)
            and name.endswith(("_token_id", "_token_index"))
            and not name.startswith(("pad", "bos", "eos"))}


def _text_ids(vocab: int, special: set[int]) -> list[int]:
    """INPUT_IDS clipped to the vocabulary, each special id replaced by the nearest lower id
    that is not one."""
    ids = []
    for wanted in INPUT_IDS:
        token = min(wanted, vocab - 1)
        while token in special and token > 0:
            token -= 1
        ids.append(token)
    return ids


POOLING: tuple[tuple[str, Callable[[dict[str, Any], int], int]], ...] = (
    ("mm_tokens_per_image", lambda config, patches: int(config["mm_tokens_per_image"])),
    ("downsample_factor", lambda config, patches: patches // int(
        config["downsample_factor"]) ** 2),
)
"""How a square-image model pools its tower's patches into image tokens, by the top-level
config field that says it (the first one present): Gemma-3's projector averages them to
`mm_tokens_per_image`; Aya Vision's pixel shuffle merges `downsample_factor`² of them. A
config with none of these has one token per patch (LLaVA, PaliGemma)."""

_UNKNOWN_POOLING = ("scale_factor", "downsample_ratio", "spatial_merge_size",
                    "image_grid_pinpoints", "vision_soft_tokens_per_image")
"""Top-level fields of other transformers 5 vision-language configs whose image tokens are
counted otherwise (Idefics3's pixel shuffle over image splits, InternVL's, Mistral-3's image
sizes, LLaVA-NeXT's tiles, Gemma-3n): verify refuses them rather than guess."""


def _image(torch: Any, config: dict[str, Any], vision: dict[str, Any],
           generator: Any) -> tuple[dict[str, Any], int]:
    """One seeded image in the layout the vision tower takes, and its image-token count.

    A tower with a `temporal_patch_size` takes rows of flattened patches and a (t, h, w) grid
    (Qwen2-VL): a 2 x 3 grid of merged patches. Otherwise a square image of `image_size`:
    one token per patch, pooled as POOLING says, plus the CLS token of a CLIP tower under
    `vision_feature_select_strategy` `full`.
    """
    channels = int(vision.get("in_channels") or vision.get("num_channels") or 3)
    patch = int(vision["patch_size"])
    if "temporal_patch_size" in vision:
        temporal, merge = int(vision["temporal_patch_size"]), int(vision.get(
            "spatial_merge_size") or 1)
        grid = (1, 2 * merge, 3 * merge)
        rows = grid[0] * grid[1] * grid[2]
        pixels = torch.randn((rows, channels * temporal * patch * patch), generator=generator)
        return ({"pixel_values": pixels, "image_grid_thw": torch.tensor([list(grid)])},
                rows // (merge * merge))
    unknown = [name for name in _UNKNOWN_POOLING if name in config]
    if unknown:
        raise VerifyError(f"verify cannot make an image for a `{config.get('model_type')}` "
                          f"model: its image tokens are counted from `{unknown[0]}`, which "
                          "verify does not model (it knows one token per patch, "
                          + ", ".join(f"`{name}`" for name, _ in POOLING)
                          + " and Qwen2-VL's grid)")
    size = int(vision["image_size"])
    pixels = torch.randn((1, channels, size, size), generator=generator)
    count = (size // patch) ** 2
    pooled = next((rule for name, rule in POOLING if isinstance(config.get(name), int)), None)
    if pooled is not None:
        return {"pixel_values": pixels}, pooled(config, count)
    clip = "clip" in str(vision.get("model_type", "clip"))
    full = config.get("vision_feature_select_strategy") == "full"
    return {"pixel_values": pixels}, count + int(clip and full)


def model_inputs(folder: Path, vocab: int, seed: int, accepted: set[str]) -> dict[str, Any]:
    """The seeded inputs of every forward pass: `input_ids`, and for a vision-language config
    (a `vision_config` and an image token) one image and its tokens after IMAGE_AFTER text ids
    (no text id is one of the config's special tokens, `_special_ids`).

    `accepted` is the model's forward parameters: `mm_token_type_ids` (1 at image tokens) is
    given only to a model that takes it (Qwen2-VL's M-RoPE needs it with an image grid).
    """
    torch, _ = require_libraries()
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vision, token = config.get("vision_config"), _image_token(config)
    if not isinstance(vision, dict) or token is None:
        return {"input_ids": torch.tensor([[min(i, vocab - 1) for i in INPUT_IDS]])}
    text = _text_ids(vocab, _special_ids(config))
    inputs, count = _image(torch, config, vision, torch.Generator().manual_seed(seed + 2))
    start, end = config.get("vision_start_token_id"), config.get("vision_end_token_id")
    block = ([start] if isinstance(start, int) else []) + [token] * count + (
        [end] if isinstance(end, int) else [])
    ids = text[:IMAGE_AFTER] + block + text[IMAGE_AFTER:]
    inputs["input_ids"] = torch.tensor([ids])
    if "mm_token_type_ids" in accepted:
        inputs["mm_token_type_ids"] = torch.tensor([[int(i == token) for i in ids]])
    return inputs
