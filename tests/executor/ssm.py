"""Selective state-space (Mamba) decoder layers on tensor-parallel rank shards.

The mixer is split as vLLM's MambaMixer: ``in_proj`` [x | z] by inner channel (a rank holds the
same channels of both halves), ``conv1d`` / ``dt_proj`` / ``A_log`` / ``D`` by channel,
``x_proj`` row-parallel with its (dt rank, B, C) output all-reduced inside the mixer, and
``out_proj`` row-parallel. Each rank computes its channels' causal conv and selective scan
alone and reports the runtime state it ends with: the conv state [B, c, K] (the last K inputs
of the conv, left-padded with zeros, as HF's cache keeps them) and the SSM state [B, c, N] of
its c channels, with their global channel ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import ops
from .shard import (
    F32,
    RankShard,
    ShardingError,
    all_reduce,
    positions,
    replicated,
    replicated_optional,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)

Array = np.ndarray
SUPPORTED = {"mamba"}
EMBED = "backbone.embeddings.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "backbone.norm_f.weight"


@dataclass(frozen=True)
class Arch:
    """The Mamba config fields the forward reads."""

    n_layers: int
    hidden: int
    inner: int
    state: int
    kernel: int
    dt_rank: int
    vocab: int
    eps: float
    tied: bool


@dataclass
class RankState:
    """One rank's runtime state of one layer after the forward: arrays and channel ids."""

    conv_state: Array
    ssm_state: Array
    channels: Array


@dataclass
class Pass:
    """What one forward over some layers produced (turned into a ``model.Result``)."""

    logits: Array | None
    hidden: Array
    normed: Array | None
    layer_inputs: list[Array] = field(default_factory=list)
    layer_outputs: list[Array] = field(default_factory=list)
    states: list[list[RankState]] = field(default_factory=list)


def describe(config: Mapping[str, Any]) -> Arch:
    """The Mamba config, normalised (HF writes ``time_step_rank`` as an int)."""
    if config["model_type"] not in SUPPORTED:
        raise NotImplementedError(f"model_type {config['model_type']!r}")
    if config.get("use_bias") or config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError("mamba: only use_bias=false and silu")
    hidden = int(config["hidden_size"])
    rank = config.get("time_step_rank", "auto")
    return Arch(n_layers=int(config["num_hidden_layers"]), hidden=hidden,
                inner=int(config["intermediate_size"]), state=int(config["state_size"]),
                kernel=int(config["conv_kernel"]),
                dt_rank=-(-hidden // 16) if rank == "auto" else int(rank),
                vocab=int(config["vocab_size"]), eps=float(config["layer_norm_epsilon"]),
                tied=bool(config.get("tie_word_embeddings", True)))


def run(config: Mapping[str, Any], ranks: Sequence[RankShard], input_ids: Array,
        layers: range, hidden_in: Array | None) -> Pass:
    """Run ``layers`` on the tensor-parallel ``ranks`` (see ``model.forward_tensor_parallel``)."""
    arch = describe(config)
    hidden = _embed(arch, ranks, input_ids) if hidden_in is None else hidden_in
    out = Pass(None, hidden, None)
    for layer in layers:
        out.layer_inputs.append(hidden)
        prefix = f"backbone.layers.{layer}"
        normed = ops.rms_norm(hidden, replicated(ranks, f"{prefix}.norm.weight"), arch.eps)
        mixed, states = _mixer(arch, ranks, f"{prefix}.mixer", normed)
        hidden = (hidden + mixed).astype(F32)
        out.layer_outputs.append(hidden)
        out.states.append(states)
    out.hidden = hidden
    if layers.stop == arch.n_layers:
        out.normed = ops.rms_norm(hidden, replicated(ranks, FINAL_NORM), arch.eps)
        out.logits = _lm_head(arch, ranks, out.normed)
    return out


def _embed(arch: Arch, ranks: Sequence[RankShard], ids: Array, name: str = EMBED) -> Array:
    """Vocab-parallel embedding lookup, summed over ranks."""
    return vocab_parallel_embedding(ranks, name, ids, arch.vocab)


def _lm_head(arch: Arch, ranks: Sequence[RankShard], x: Array, embed: str = EMBED) -> Array:
    """Vocab-parallel logits, gathered (tied: the embedding ``embed``)."""
    name = LM_HEAD if all(rank.has(LM_HEAD) for rank in ranks) else embed
    if name == embed and not arch.tied:
        raise ShardingError(f"a rank of the last stage lacks {LM_HEAD}")
    return vocab_parallel_logits(ranks, name, x, arch.vocab)


def softplus(x: Array) -> Array:
    """torch's softplus (threshold 20)."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(F32)


def _channel_rows(rank: RankShard, name: str, axis: int, channels: Array) -> Array:
    """Local positions along ``axis`` of ``name`` of the global ``channels``."""
    sel = rank.selection(name)
    if sel is not None and sel.axis != axis:
        raise ShardingError(f"{name}: split on axis {sel.axis}, expected its channel axis {axis}")
    return positions(channels, rank.indices(name, axis), name)


def _mixer(arch: Arch, ranks: Sequence[RankShard], prefix: str, x: Array
           ) -> tuple[Array, list[RankState]]:
    """The Mamba mixer on each rank's channels; the output all-reduced over the ranks."""
    inner, k = arch.inner, arch.kernel
    local = []
    for rank in ranks:
        name = f"{prefix}.in_proj.weight"
        sel = rank.selection(name)
        if sel is not None and sel.axis != 0:
            raise ShardingError(f"{name}: split on axis {sel.axis}, expected 0")
        rows = rank.indices(name, 0)
        x_channels, z_channels = rows[rows < inner], rows[rows >= inner] - inner
        if not np.array_equal(np.sort(x_channels), np.sort(z_channels)):
            raise ShardingError(f"{name}: the rank holds x channels {x_channels[:8].tolist()}... "
                                f"but gate channels {z_channels[:8].tolist()}...: a channel's x "
                                "and z must sit on the same rank")
        channels = np.sort(x_channels)
        w = rank.array(name)
        xs = x @ w[positions(channels, rows, name)].T  # [B, S, c]
        zs = x @ w[positions(channels + inner, rows, name)].T
        # causal depthwise conv over each channel's sequence
        conv_w = rank.array(f"{prefix}.conv1d.weight")[
            _channel_rows(rank, f"{prefix}.conv1d.weight", 0, channels)][:, 0, :]  # [c, K]
        bias_name = f"{prefix}.conv1d.bias"
        conv_b = (rank.array(bias_name)[_channel_rows(rank, bias_name, 0, channels)]
                  if rank.has(bias_name) else np.zeros(len(channels), F32))
        seq = xs.shape[1]
        padded = np.concatenate([np.zeros((xs.shape[0], k - 1, len(channels)), F32), xs], 1)
        conv = sum(padded[:, j:j + seq, :] * conv_w[:, j] for j in range(k)) + conv_b
        conv_state = np.transpose(padded[:, -k:, :], (0, 2, 1))  # [B, c, K]
        u = ops.silu(conv.astype(F32))
        # x_proj reads this rank's channels: a partial (dt rank, B, C), summed over the ranks
        xp = f"{prefix}.x_proj.weight"
        cols = _channel_rows(rank, xp, 1, channels)
        local.append((rank, channels, u, zs, conv_state, (u @ rank.array(xp)[:, cols].T)))
    dbc = all_reduce([(part, channels) for _, channels, _, _, _, part in local], inner,
                     f"{prefix}.x_proj")
    ts, b, c = np.split(dbc, [arch.dt_rank, arch.dt_rank + arch.state], axis=-1)
    if any(rank.has(f"{prefix}.dt_layernorm.weight") for rank in ranks):
        # Jamba: RMSNorms over the reduced dt rank, B and C (replicated: they follow the sum)
        ts, b, c = (ops.rms_norm(v, replicated(ranks, f"{prefix}.{n}_layernorm.weight"),
                                 arch.eps) for v, n in ((ts, "dt"), (b, "b"), (c, "c")))
    outputs, states = [], []
    for rank, channels, u, zs, conv_state, _ in local:
        dw, db = f"{prefix}.dt_proj.weight", f"{prefix}.dt_proj.bias"
        dt = softplus(ts @ rank.array(dw)[_channel_rows(rank, dw, 0, channels)].T
                      + rank.array(db)[_channel_rows(rank, db, 0, channels)])  # [B, S, c]
        a = -np.exp(rank.array(f"{prefix}.A_log")[
            _channel_rows(rank, f"{prefix}.A_log", 0, channels)])  # [c, N]
        d = rank.array(f"{prefix}.D")[_channel_rows(rank, f"{prefix}.D", 0, channels)]
        h = np.zeros((u.shape[0], len(channels), arch.state), F32)
        ys = []
        for t in range(u.shape[1]):
            h = (np.exp(a[None] * dt[:, t, :, None]) * h
                 + (dt[:, t, :, None] * b[:, t, None, :]) * u[:, t, :, None]).astype(F32)
            ys.append(np.einsum("bcn,bn->bc", h, c[:, t]))
        y = (np.stack(ys, 1) + u * d) * ops.silu(zs)
        op = f"{prefix}.out_proj.weight"
        cols = _channel_rows(rank, op, 1, channels)
        outputs.append(((y @ rank.array(op)[:, cols].T).astype(F32), channels))
        states.append(RankState(conv_state=conv_state.astype(F32), ssm_state=h,
                                channels=channels))
    out = all_reduce(outputs, inner, f"{prefix}.out_proj")
    bias = replicated_optional(ranks, f"{prefix}.out_proj.bias")
    return (out if bias is None else out + bias).astype(F32), states
