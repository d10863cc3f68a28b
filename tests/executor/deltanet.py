"""Qwen3-Next's gated DeltaNet linear attention and gated query on tensor-parallel rank shards.

The DeltaNet is split as vLLM's Qwen3Next: by linear-attention key heads. ``in_proj_qkvz``
holds one row block per key head g, ``[q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)]`` with
``r = Hv / Hk`` value heads per key head, and ``in_proj_ba`` one block ``[b_g (r) | a_g (r)]``;
``conv1d`` runs over the channels ``[all q | all k | all v]``; ``A_log`` / ``dt_bias`` are per
value head and ``out_proj`` is row-parallel over value heads. Each rank computes the causal conv,
the gated delta rule and the gated RMSNorm of its heads alone and reports the runtime state it
ends with: the conv state [B, c, K] over its conv channels (the last K inputs, left-padded with
zeros, as HF's cache keeps them) and the recurrent state [B, hv, dk, dv] of its value heads.

The full-attention layers' ``q_proj`` produces ``[q_h | gate_h]`` per head; :func:`gated_query`
splits a rank's rows into both, and the attention output is multiplied by ``sigmoid(gate)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ops
from .shard import F32, RankShard, ShardingError, align, all_reduce, column, positions, row
from .ssm import softplus

Array = np.ndarray


@dataclass(frozen=True)
class Dims:
    """The gated DeltaNet config fields the forward reads."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int
    eps: float

    @property
    def per_key(self) -> int:
        """Value heads per key head (HF ``num_v_heads // num_k_heads``)."""
        return self.value_heads // self.key_heads


@dataclass
class RankState:
    """One rank's runtime state of one linear-attention layer after the forward."""

    conv_state: Array
    """[B, c, K]: the last K conv inputs of the rank's c channels."""
    channels: Array
    """Global conv channels (in ``[q | k | v]`` order) of the rows of ``conv_state``."""
    recurrent_state: Array
    """[B, hv, dk, dv]: the delta-rule state of the rank's value heads."""
    value_heads: Array
    """Global value-head ids of the rows of ``recurrent_state``."""


def describe(config: Mapping[str, Any]) -> Dims:
    """The DeltaNet dimensions of a Qwen3-Next config."""
    if config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError("qwen3_next: only silu")
    return Dims(key_heads=int(config["linear_num_key_heads"]),
                value_heads=int(config["linear_num_value_heads"]),
                key_dim=int(config["linear_key_head_dim"]),
                value_dim=int(config["linear_value_head_dim"]),
                kernel=int(config["linear_conv_kernel_dim"]),
                eps=float(config.get("rms_norm_eps", 1e-6)))


def gated_query(rank: RankShard, prefix: str, x: Array, head_dim: int
                ) -> tuple[Array, Array, Array, Array]:
    """``q_proj`` rows ``[q_h | gate_h]`` per head: (q, q features, gate, gate features)."""
    y, idx = column(rank, f"{prefix}.q_proj", x)
    head, within = idx // (2 * head_dim), idx % (2 * head_dim)
    is_q = within < head_dim
    features = head * head_dim + np.where(is_q, within, within - head_dim)
    return y[..., is_q], features[is_q], y[..., ~is_q], features[~is_q]


def _l2norm(x: Array) -> Array:
    """HF / FLA's ``x * rsqrt(sum(x²) + 1e-6)`` over the last axis."""
    return (x / np.sqrt((x * x).sum(-1, keepdims=True) + F32(1e-6))).astype(F32)


def _rows(rank: RankShard, name: str, axis: int, wanted: Array) -> Array:
    """Local positions along ``axis`` of ``name`` of the global indices ``wanted``."""
    sel = rank.selection(name)
    if sel is not None and sel.axis != axis:
        raise ShardingError(f"{name}: split on axis {sel.axis}, expected {axis}")
    return positions(wanted, rank.indices(name, axis), name)


def _key_groups(name: str, y: Array, idx: Array, width: int) -> tuple[Array, Array]:
    """The key heads whose whole row block (``width`` rows) the rank holds, and ``y`` by head."""
    groups = np.unique(idx // width)
    whole = (groups[:, None] * width + np.arange(width)).ravel()
    if len(whole) != len(idx):
        raise ShardingError(f"{name}: the rank holds {len(idx)} rows, not whole key-head blocks "
                            f"of {width} rows (key heads {groups[:8].tolist()}...)")
    y = align(y, idx, whole, name)
    return groups, y.reshape(*y.shape[:-1], len(groups), width)


def _rank_mixer(dims: Dims, rank: RankShard, prefix: str, x: Array
                ) -> tuple[tuple[Array, Array], RankState]:
    """One rank's out_proj partial product (with its value features) and its state."""
    dk, dv, r, kern = dims.key_dim, dims.value_dim, dims.per_key, dims.kernel
    batch, seq, _ = x.shape
    qkvz, idx = column(rank, f"{prefix}.in_proj_qkvz", x)
    groups, qkvz = _key_groups(f"{prefix}.in_proj_qkvz.weight", qkvz, idx,
                               2 * dk + 2 * r * dv)
    ba, ba_idx = column(rank, f"{prefix}.in_proj_ba", x)
    ba_groups, ba = _key_groups(f"{prefix}.in_proj_ba.weight", ba, ba_idx, 2 * r)
    if not np.array_equal(groups, ba_groups):
        raise ShardingError(f"{prefix}: in_proj_qkvz holds key heads {groups.tolist()} but "
                            f"in_proj_ba {ba_groups.tolist()}")
    n_k = len(groups)
    value_heads = (groups[:, None] * r + np.arange(r)).ravel()
    q = qkvz[..., :dk]
    k = qkvz[..., dk:2 * dk]
    v = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(batch, seq, n_k * r, dv)
    z = qkvz[..., 2 * dk + r * dv:].reshape(batch, seq, n_k * r, dv)
    b = ba[..., :r].reshape(batch, seq, n_k * r)
    a = ba[..., r:].reshape(batch, seq, n_k * r)
    # the causal depthwise conv over this rank's channels of [all q | all k | all v]
    key_total = dims.key_heads * dk
    q_channels = (groups[:, None] * dk + np.arange(dk)).ravel()
    v_channels = 2 * key_total + (value_heads[:, None] * dv + np.arange(dv)).ravel()
    channels = np.concatenate([q_channels, key_total + q_channels, v_channels])
    mixed = np.concatenate([q.reshape(batch, seq, -1), k.reshape(batch, seq, -1),
                            v.reshape(batch, seq, -1)], -1)
    conv_name = f"{prefix}.conv1d.weight"
    conv_w = rank.array(conv_name)[_rows(rank, conv_name, 0, channels)][:, 0, :]  # [c, K]
    padded = np.concatenate([np.zeros((batch, kern - 1, len(channels)), F32), mixed], 1)
    conv = sum(padded[:, j:j + seq, :] * conv_w[:, j] for j in range(kern))
    conv_state = np.transpose(padded[:, -kern:, :], (0, 2, 1)).astype(F32)  # [B, c, K]
    conv = ops.silu(np.asarray(conv, dtype=F32))
    n_q = n_k * dk
    q = conv[..., :n_q].reshape(batch, seq, n_k, dk)
    k = conv[..., n_q:2 * n_q].reshape(batch, seq, n_k, dk)
    v = conv[..., 2 * n_q:].reshape(batch, seq, n_k * r, dv)
    a_log = rank.array(f"{prefix}.A_log")[_rows(rank, f"{prefix}.A_log", 0, value_heads)]
    dt_bias = rank.array(f"{prefix}.dt_bias")[_rows(rank, f"{prefix}.dt_bias", 0, value_heads)]
    decay = np.exp(-np.exp(a_log) * softplus(a + dt_bias)).astype(F32)  # [B, S, hv]
    beta = ops.sigmoid(b)
    # grouped value attention: each key head serves its r value heads
    q = _l2norm(np.repeat(q, r, axis=2)) * F32(dk ** -0.5)
    k = _l2norm(np.repeat(k, r, axis=2))
    state = np.zeros((batch, n_k * r, dk, dv), F32)
    outs = []
    for t in range(seq):
        state = state * decay[:, t, :, None, None]
        memory = np.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        state = (state + k[:, t, :, :, None] * delta[:, :, None, :]).astype(F32)
        outs.append(np.einsum("bhkv,bhk->bhv", state, q[:, t]))
    core = np.stack(outs, 1).astype(F32)  # [B, S, hv, dv]
    normed = ops.rms_norm(core, rank.whole(f"{prefix}.norm.weight"), dims.eps) * ops.silu(z)
    features = (value_heads[:, None] * dv + np.arange(dv)).ravel()
    partial = row(rank, f"{prefix}.out_proj", normed.reshape(batch, seq, -1).astype(F32),
                  features)
    return (partial, features), RankState(conv_state=conv_state, channels=channels,
                                          recurrent_state=state, value_heads=value_heads)


def mixer(config: Mapping[str, Any], ranks: Sequence[RankShard], prefix: str, x: Array
          ) -> tuple[Array, list[RankState]]:
    """The gated DeltaNet on each rank's key heads; out_proj partials all-reduced."""
    dims = describe(config)
    done = [_rank_mixer(dims, rank, prefix, x) for rank in ranks]
    out = all_reduce([part for part, _ in done], dims.value_heads * dims.value_dim,
                     f"{prefix}.out_proj")
    return out.astype(F32), [state for _, state in done]
