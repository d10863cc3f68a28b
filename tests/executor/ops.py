"""Numerical building blocks, written to follow Hugging Face's modeling code in float32."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

F32 = np.float32
Array = np.ndarray


@dataclass(frozen=True)
class DecoderArch:
    """The config values every attention decoder's forward reads, under one set of names."""

    config: Mapping[str, Any]
    hidden: int
    vocab: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    act: Callable[[Array], Array]
    rotary_dim: int
    scaling: float


# --------------------------------------------------------------------------- activations


def sigmoid(x: Array) -> Array:
    """Logistic function (float32, no overflow warnings)."""
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(F32)


def silu(x: Array) -> Array:
    """``x * sigmoid(x)`` (HF ``silu``)."""
    return (x * sigmoid(x)).astype(F32)


def gelu_tanh(x: Array) -> Array:
    """Tanh approximation of GELU (HF ``gelu_pytorch_tanh``)."""
    inner = F32(math.sqrt(2.0 / math.pi)) * (x + F32(0.044715) * x * x * x)
    return (F32(0.5) * x * (F32(1.0) + np.tanh(inner))).astype(F32)


_ERF = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x: Array) -> Array:
    """Exact (erf) GELU (HF ``gelu``); numpy has no erf, the tiny tensors allow ``math.erf``."""
    return (x * F32(0.5) * (F32(1.0) + _ERF(x / math.sqrt(2.0)).astype(F32))).astype(F32)


def quick_gelu(x: Array) -> Array:
    """CLIP's ``quick_gelu``: ``x * sigmoid(1.702 x)`` (the vision towers of llava, Qwen2-VL)."""
    return (x * sigmoid(F32(1.702) * x)).astype(F32)


def bloom_gelu(x: Array) -> Array:
    """BLOOM's ``bloom_gelu_forward``: the tanh approximation with its rounded constant."""
    inner = F32(0.79788456) * x * (F32(1.0) + F32(0.044715) * x * x)
    return (x * F32(0.5) * (F32(1.0) + np.tanh(inner))).astype(F32)


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": silu,
    "swish": silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu": gelu,
    "bloom_gelu": bloom_gelu,
    "quick_gelu": quick_gelu,
}


def softmax(x: Array, axis: int = -1) -> Array:
    """Numerically stable softmax in float32."""
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(F32)


# --------------------------------------------------------------------------- norms


def rms_norm(x: Array, weight: Array, eps: float, *, offset: float = 0.0) -> Array:
    """RMSNorm over the last axis; ``offset=1`` gives Gemma's ``x * (1 + w)``."""
    x = x.astype(F32)
    variance = np.mean(x * x, axis=-1, keepdims=True)
    normed = x / np.sqrt(variance + F32(eps))
    return (normed * (F32(offset) + weight.astype(F32))).astype(F32)


def layer_norm(x: Array, weight: Array, bias: Array | None, eps: float) -> Array:
    """LayerNorm over the last axis (biased variance, as ``torch.nn.LayerNorm``)."""
    x = x.astype(F32)
    mean = np.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = np.mean(centered * centered, axis=-1, keepdims=True)
    out = centered / np.sqrt(variance + F32(eps)) * weight.astype(F32)
    return (out if bias is None else out + bias.astype(F32)).astype(F32)


# --------------------------------------------------------------------------- rotary embeddings


def _yarn_inv_freq(
    params: Mapping[str, Any], base: float, dim: int, max_positions: int
) -> tuple[Array, float]:
    """HF ``_compute_yarn_parameters``: blended inverse frequencies and attention factor."""
    factor = float(params["factor"])
    original = params.get("original_max_position_embeddings") or max_positions
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32.0
    beta_slow = params.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - low) / (high - low), 0, 1).astype(F32)
    pos_freqs = F32(base) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim))
    extrapolation = F32(1.0) / pos_freqs
    interpolation = F32(1.0) / (F32(factor) * pos_freqs)
    keep = F32(1.0) - ramp  # share of the extrapolated (unscaled) frequency
    inv_freq = interpolation * (F32(1.0) - keep) + extrapolation * keep
    return inv_freq.astype(F32), float(attention_factor)


def rope_tables(config: Mapping[str, Any], rotary_dim: int, seq_len: int) -> tuple[Array, Array]:
    """``(cos, sin)`` of shape ``[seq_len, rotary_dim]`` for positions ``0..seq_len-1``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    base = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    attention_factor = 1.0
    inv_freq = F32(1.0) / (F32(base) ** (np.arange(0, rotary_dim, 2, dtype=F32) / F32(rotary_dim)))
    if rope_type == "linear":
        inv_freq = inv_freq / F32(params["factor"])
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(
            params, base, rotary_dim, int(config["max_position_embeddings"])
        )
    elif rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r}")
    freqs = np.arange(seq_len, dtype=F32)[:, None] * inv_freq[None, :].astype(F32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos = (np.cos(emb) * F32(attention_factor)).astype(F32)
    sin = (np.sin(emb) * F32(attention_factor)).astype(F32)
    return cos, sin


def apply_rope(x: Array, cos: Array, sin: Array, *, interleaved: bool = False) -> Array:
    """Rotate the first ``cos.shape[-1]`` features of ``x`` [..., S, d] (HF ``rotate_half``).

    ``interleaved`` first de-interleaves pairs (x0, x1), (x2, x3), ... into halves, as HF's
    DeepSeek-V3 ``apply_rotary_pos_emb_interleave`` does.
    """
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        shape = x_rot.shape
        x_rot = x_rot.reshape(*shape[:-1], rot_dim // 2, 2).swapaxes(-1, -2).reshape(shape)
    half = rot_dim // 2
    rotated = np.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated * sin
    return np.concatenate([out, x_pass], axis=-1).astype(F32)


def apply_rope_every_two(x: Array, cos: Array, sin: Array) -> Array:
    """GPT-J rotation of the first ``cos.shape[-1]`` features of ``x`` [..., S, d] (HF CodeGen's
    ``apply_rotary_pos_emb``): pair ``(x[2i], x[2i+1])`` turns by frequency ``i``.

    ``cos`` / ``sin`` are :func:`rope_tables`' ``[S, rot]`` tables (``[freqs | freqs]``); the
    first half gives one angle per pair, repeated for both features of the pair as HF's
    ``repeat_interleave`` does.
    """
    rot_dim = cos.shape[-1]
    half = rot_dim // 2
    cos2 = np.repeat(cos[..., :half], 2, axis=-1)
    sin2 = np.repeat(sin[..., :half], 2, axis=-1)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rotated = np.stack([-x_rot[..., 1::2], x_rot[..., ::2]], axis=-1).reshape(x_rot.shape)
    out = x_rot * cos2 + rotated * sin2
    return np.concatenate([out, x_pass], axis=-1).astype(F32)


# --------------------------------------------------------------------------- attention


def attend(
    q: Array,
    k: Array,
    v: Array,
    *,
    scaling: float,
    softcap: float | None = None,
    sinks: Array | None = None,
    window: int | None = None,
    bias: Array | None = None,
) -> Array:
    """Causal eager attention. ``q``/``k`` [B, h, S, dk], ``v`` [B, h, S, dv] -> [B, h, S, dv].

    ``k`` and ``v`` are already expanded to one entry per query head. ``softcap`` is Gemma-2's
    ``tanh`` logit cap; ``sinks`` [h] are gpt-oss's per-head sink logits (a softmax column
    that is dropped afterwards); ``window`` keeps keys with ``i - j < window``; ``bias``
    [h, S, S] is added to the scaled scores (BLOOM's ALiBi).
    """
    seq = q.shape[-2]
    scores = (q @ k.swapaxes(-1, -2)) * F32(scaling)
    if bias is not None:
        scores = (scores + bias.astype(F32)).astype(F32)
    if softcap is not None:
        scores = np.tanh(scores / F32(softcap)) * F32(softcap)
    i = np.arange(seq)[:, None]
    j = np.arange(seq)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    scores = np.where(allowed, scores, -np.inf).astype(F32)
    if sinks is not None:
        sink_col = np.broadcast_to(sinks.astype(F32)[None, :, None, None], (*scores.shape[:-1], 1))
        probs = softmax(np.concatenate([scores, sink_col], axis=-1))[..., :-1]
    else:
        probs = softmax(scores)
    return (probs @ v).astype(F32)


# --------------------------------------------------------------------------- MoE routing


def route_softmax_topk(logits: Array, top_k: int, normalize: bool) -> tuple[Array, Array]:
    """Mixtral / Qwen-MoE: softmax over all experts, top-k, optional renormalisation."""
    probs = softmax(logits.astype(F32))
    index = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(probs, index, axis=-1)
    if normalize:
        weight = weight / np.sum(weight, axis=-1, keepdims=True)
    return index, weight.astype(F32)


def route_deepseek_v2(
    logits: Array, *, top_k: int, method: str, n_group: int, topk_group: int,
    scaling_factor: float,
) -> tuple[Array, Array]:
    """DeepSeek-V2 ``DeepseekV2TopkRouter``: softmax scores; ``greedy`` top-k, or
    ``group_limited_greedy`` (groups ranked by their best score, experts outside the best
    ``topk_group`` groups masked to 0.0); weights times ``scaling_factor``, not renormalised."""
    scores = softmax(logits.astype(F32))
    if method == "group_limited_greedy":
        tokens, experts = scores.shape
        group_scores = scores.reshape(tokens, n_group, experts // n_group).max(axis=-1)
        best_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
        group_mask = np.zeros_like(group_scores, dtype=bool)
        np.put_along_axis(group_mask, best_groups, True, axis=-1)
        scores = np.where(np.repeat(group_mask, experts // n_group, axis=-1), scores, F32(0.0))
    elif method != "greedy":
        raise NotImplementedError(f"topk_method {method!r}")
    index = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(scores, index, axis=-1)
    return index, (weight * F32(scaling_factor)).astype(F32)


def route_topk_softmax(logits: Array, top_k: int) -> tuple[Array, Array]:
    """gpt-oss: top-k of the raw logits, then softmax over the selected ones."""
    index = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    return index, softmax(np.take_along_axis(logits, index, axis=-1))


def route_deepseek(
    logits: Array,
    correction_bias: Array,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling_factor: float,
) -> tuple[Array, Array]:
    """DeepSeek-V3 ``route_tokens_to_experts``: sigmoid scores, bias-corrected group-limited top-k.

    Groups are ranked by the sum of their two best corrected scores; experts outside the best
    ``topk_group`` groups are masked to 0.0 (as HF's ``masked_fill``); the weights are the
    uncorrected sigmoid scores of the chosen experts.
    """
    scores = sigmoid(logits.astype(F32))
    choice = scores + correction_bias.astype(F32)
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, n_group, experts // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., ::-1][..., :2].sum(axis=-1)
    best_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    group_mask = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(group_mask, best_groups, True, axis=-1)
    expert_mask = np.repeat(group_mask, experts // n_group, axis=-1)
    masked = np.where(expert_mask, choice, F32(0.0))
    index = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(scores, index, axis=-1)
    if normalize:
        weight = weight / (np.sum(weight, axis=-1, keepdims=True) + F32(1e-20))
    return index, (weight * F32(scaling_factor)).astype(F32)


def route_dbrx(logits: Array, top_k: int, p_norm: float | None) -> tuple[Array, Array]:
    """DBRX ``DbrxFFN.route_tokens_to_experts``: softmax over all experts, top-k, the weights
    divided by their ``p_norm``-norm (``moe_normalize_expert_weights``; None: kept as they are)."""
    probs = softmax(logits.astype(F32))
    index = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(probs, index, axis=-1)
    if p_norm is not None:
        norm = np.sum(np.abs(weight) ** F32(p_norm), axis=-1, keepdims=True) ** F32(1 / p_norm)
        weight = weight / norm
    return index, weight.astype(F32)


def gpt_oss_glu(gate: Array, up: Array, alpha: float, limit: float) -> Array:
    """gpt-oss ``_apply_gate``: clamped gate/up, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = np.minimum(gate, F32(limit))
    up = np.clip(up, -F32(limit), F32(limit))
    return ((up + F32(1.0)) * (gate * sigmoid(gate * F32(alpha)))).astype(F32)
