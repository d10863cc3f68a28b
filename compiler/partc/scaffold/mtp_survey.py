"""`partc init`: multi-token-prediction layers in the survey (DeepSeek-V3's, GLM-4-MoE's).

A config's `num_nextn_predict_layers` = K declares K MTP layers after the decoder's N; the
released checkpoint holds them as the decoder repetition's layers N .. N + K - 1, each a decoder
layer plus DeepSeek's glue (`embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head`).
`split_mtp` takes those out of the decoder's layers before the survey reads them (they would
read as extra decoder layers holding modules the others lack); `partc.scaffold.mtp_family`
writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MTP_FIELD = "num_nextn_predict_layers"
"""The config field counting the MTP layers."""

GLUE = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
"""The MTP layer's modules beside its decoder block (their first name part), as DeepSeek names
them."""


def _config_int(config: Mapping[str, Any], key: str) -> int:
    """An int field of the config's top level, else of `text_config` (0 when neither)."""
    for section in (config, config.get("text_config")):
        value = section.get(key) if isinstance(section, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _is_glue(relative: str) -> bool:
    """A tensor of the MTP glue, by its name relative to the layer."""
    return relative.split(".", 1)[0] in GLUE


def split_mtp(config: Mapping[str, Any], by_layer: dict[int, dict[str, tuple[str, list[int]]]]
              ) -> dict[int, dict[str, tuple[str, list[int]]]]:
    """Take the config's MTP layers out of the decoder's layers `by_layer` (those numbered
    `num_hidden_layers + i`, i < `num_nextn_predict_layers`, holding MTP glue); them by i."""
    base, count = _config_int(config, "num_hidden_layers"), _config_int(config, MTP_FIELD)
    out = {}
    for number in sorted(n for n in by_layer if base and base <= n < base + count):
        if any(_is_glue(t) for t in by_layer[number]):  # (the header's layers, not `count`)
            out[number - base] = by_layer.pop(number)
    return out
