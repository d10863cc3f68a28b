"""Pieces shared by the attention / state-space hybrids (``bamba``, ``jamba``): their GQA
attention on heads split over the ranks and their decoder loop (input norm, mixer, residual,
pre-feed-forward norm, feed-forward, residual; final norm and head on the last stage).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import ops, ssm
from .shard import F32, RankShard, all_reduce, column, positions, replicated, row, split_heads

Array = np.ndarray
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.final_layernorm.weight"
Mix = Callable[[int, str, Array], tuple[Array, list[Any]]]
"""(layer, its tensor-name prefix, normed input) -> (mixer output, the rank states it kept)."""
FeedForward = Callable[[int, str, Array], Array]
"""(layer, its tensor-name prefix, normed input) -> the feed-forward output."""


def attention(config: Mapping[str, Any], ranks: Sequence[RankShard], prefix: str, x: Array,
              rope: tuple[Array, Array] | None = None) -> Array:
    """GQA attention (rotary by the ``rope`` (cos, sin) tables when given), heads split over
    the ranks; o_proj all-reduced."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    d = int(config["hidden_size"]) // heads
    parts = []
    for rank in ranks:
        q, q_idx = column(rank, f"{prefix}.q_proj", x)
        k, k_idx = column(rank, f"{prefix}.k_proj", x)
        v, v_idx = column(rank, f"{prefix}.v_proj", x)
        q, q_heads = split_heads(q, q_idx, d, f"{prefix}.q_proj")
        k, k_heads = split_heads(k, k_idx, d, f"{prefix}.k_proj")
        v, v_heads = split_heads(v, v_idx, d, f"{prefix}.v_proj")
        if rope is not None:
            q, k = ops.apply_rope(q, *rope), ops.apply_rope(k, *rope)
        kv_of_q = q_heads // (heads // kv_heads)  # each query head's KV head
        k = k[:, positions(kv_of_q, k_heads, f"{prefix}.k_proj")]
        v = v[:, positions(kv_of_q, v_heads, f"{prefix}.v_proj")]
        out = ops.attend(q, k, v, scaling=d ** -0.5)
        batch, local, seq, _ = out.shape
        features = (q_heads[:, None] * d + np.arange(d)).ravel()
        merged = out.transpose(0, 2, 1, 3).reshape(batch, seq, local * d)
        parts.append((row(rank, f"{prefix}.o_proj", merged, features), features))
    return all_reduce(parts, heads * d, f"{prefix}.o_proj")


def run_layers(arch: ssm.Arch, ranks: Sequence[RankShard], input_ids: Array, layers: range,
               hidden_in: Array | None, mix: Mix, feed_forward: FeedForward) -> ssm.Pass:
    """Run ``layers`` of a hybrid on the tensor-parallel ``ranks``, each layer's mixer and
    feed-forward given by ``mix`` and ``feed_forward``; ``states`` holds what ``mix`` kept."""
    hidden = ssm._embed(arch, ranks, input_ids, EMBED) if hidden_in is None else hidden_in
    out = ssm.Pass(None, hidden, None)
    for layer in layers:
        out.layer_inputs.append(hidden)
        prefix = f"model.layers.{layer}"
        normed = ops.rms_norm(hidden, replicated(ranks, f"{prefix}.input_layernorm.weight"),
                              arch.eps)
        mixed, states = mix(layer, prefix, normed)
        hidden = (hidden + mixed).astype(F32)
        normed = ops.rms_norm(hidden, replicated(ranks, f"{prefix}.pre_ff_layernorm.weight"),
                              arch.eps)
        hidden = (hidden + feed_forward(layer, prefix, normed)).astype(F32)
        out.layer_outputs.append(hidden)
        out.states.append(states)
    out.hidden = hidden
    if layers.stop == arch.n_layers:
        out.normed = ops.rms_norm(hidden, replicated(ranks, FINAL_NORM), arch.eps)
        out.logits = ssm._lm_head(arch, ranks, out.normed, EMBED)
    return out
