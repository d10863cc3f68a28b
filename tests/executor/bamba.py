"""Bamba (Mamba2 / attention hybrid) decoder layers on tensor-parallel rank shards.

Layer ``i`` mixes with attention when ``i in attn_layer_indices`` (GQA with partial rotary:
q/k/v column-parallel by heads, o_proj row-parallel) and with the Mamba2 mixer otherwise, split
as vLLM's MambaMixer2: ``in_proj`` rows ``[z | x | B | C | dt]`` give a rank its heads' z, x and
dt and the B and C of those heads' groups (a group's B and C on every rank holding one of its
heads); the depthwise conv runs over the rank's ``[x | B | C]`` channels; each head's recurrence
(scalar ``A``, state ``[head_dim, N]``) is the recurrent form of the SSD scan; the gated RMSNorm
takes each group's statistic over all ranks' channels of that group (an all-reduce of the sums
of squares); ``out_proj`` is row-parallel. Every layer has a dense gated MLP. Each Mamba2 layer
reports each rank's conv state [B, c, K] (its ``[x | B | C]`` channel ids) and SSM state
[B, h, head_dim, N] (its head ids), as HF's cache keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import hybrid, ops, ssm
from .model import _gated_mlp
from .shard import (
    F32,
    RankShard,
    ShardingError,
    all_reduce,
    positions,
)

Array = np.ndarray
SUPPORTED = {"bamba"}


@dataclass(frozen=True)
class Mixer2:
    """The Mamba2 part of a Bamba config."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    state: int
    kernel: int
    eps: float

    @property
    def inner(self) -> int:
        """Channels of x (and z): heads * head_dim."""
        return self.heads * self.head_dim


@dataclass
class RankState:
    """One rank's Mamba2 state after the forward: conv window and SSM state, with their ids."""

    conv_state: Array
    conv_channels: Array
    ssm_state: Array
    heads: Array


def describe(config: Mapping[str, Any]) -> tuple[ssm.Arch, Mixer2]:
    """The config as ``ssm.Arch`` (embedding / head / norms) and the Mamba2 mixer's sizes."""
    if config.get("mamba_proj_bias") or config.get("hidden_act", "silu") != "silu" or \
            config.get("attention_bias") or config.get("mlp_bias"):
        raise NotImplementedError("bamba: only bias-free projections and silu")
    hidden = int(config["hidden_size"])
    heads = int(config["mamba_n_heads"])
    mixer = Mixer2(hidden=hidden, heads=heads,
                   head_dim=int(config.get("mamba_expand", 2)) * hidden // heads,
                   groups=int(config.get("mamba_n_groups", 1)),
                   state=int(config["mamba_d_state"]), kernel=int(config["mamba_d_conv"]),
                   eps=float(config["rms_norm_eps"]))
    arch = ssm.Arch(n_layers=int(config["num_hidden_layers"]), hidden=hidden,
                    inner=mixer.inner, state=mixer.state, kernel=mixer.kernel, dt_rank=0,
                    vocab=int(config["vocab_size"]), eps=mixer.eps,
                    tied=bool(config.get("tie_word_embeddings", False)))
    return arch, mixer


def _attention(config: Mapping[str, Any], ranks: Sequence[RankShard], prefix: str, x: Array
               ) -> Array:
    """GQA attention with partial rotary, heads split over the ranks; o_proj all-reduced."""
    d = int(config["hidden_size"]) // int(config["num_attention_heads"])
    partial = float((config.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
    rope = ops.rope_tables(config, int(d * partial), x.shape[1])
    return hybrid.attention(config, ranks, prefix, x, rope)


def _rows(rank: RankShard, name: str, wanted: Array) -> Array:
    """Local positions on axis 0 of ``name`` of the global rows ``wanted``."""
    sel = rank.selection(name)
    if sel is not None and sel.axis != 0:
        raise ShardingError(f"{name}: split on axis {sel.axis}, expected 0")
    return positions(wanted, rank.indices(name, 0), name)


def _mixer(m: Mixer2, ranks: Sequence[RankShard], prefix: str, x: Array
           ) -> tuple[Array, list[RankState]]:
    """The Mamba2 mixer on each rank's heads and groups; out_proj all-reduced."""
    inner, gn, per_group = m.inner, m.groups * m.state, m.heads // m.groups
    group_width = inner // m.groups
    local = []
    for rank in ranks:
        name = f"{prefix}.in_proj.weight"
        held = rank.indices(name, 0) if rank.selection(name) is not None else np.arange(
            2 * inner + 2 * gn + m.heads)
        dt_start = 2 * inner + 2 * gn
        heads = np.sort(held[held >= dt_start] - dt_start)
        channels = (heads[:, None] * m.head_dim + np.arange(m.head_dim)).ravel()
        groups = np.unique(heads // per_group)
        bc = (groups[:, None] * m.state + np.arange(m.state)).ravel()
        w = rank.array(name)
        z = x @ w[_rows(rank, name, channels)].T
        xbc_rows = np.concatenate([inner + channels, 2 * inner + bc, 2 * inner + gn + bc])
        xbc = x @ w[_rows(rank, name, xbc_rows)].T  # [B, S, c] over [x | B | C]
        dt_raw = x @ w[_rows(rank, name, dt_start + heads)].T
        conv_ids = np.concatenate([channels, inner + bc, inner + gn + bc])
        cw = f"{prefix}.conv1d.weight"
        conv_w = rank.array(cw)[_rows(rank, cw, conv_ids)][:, 0, :]  # [c, K]
        cb = f"{prefix}.conv1d.bias"
        conv_b = (rank.array(cb)[_rows(rank, cb, conv_ids)] if rank.has(cb)
                  else np.zeros(len(conv_ids), F32))
        seq, k = xbc.shape[1], m.kernel
        padded = np.concatenate([np.zeros((xbc.shape[0], k - 1, len(conv_ids)), F32), xbc], 1)
        conv = sum(padded[:, j:j + seq, :] * conv_w[:, j] for j in range(k)) + conv_b
        conv_state = np.transpose(padded[:, -k:, :], (0, 2, 1)).astype(F32)  # [B, c, K]
        u = ops.silu(conv.astype(F32))
        n_ch, n_bc = len(channels), len(bc)
        xs = u[..., :n_ch].reshape(*u.shape[:2], len(heads), m.head_dim)
        bs = u[..., n_ch:n_ch + n_bc].reshape(*u.shape[:2], len(groups), m.state)
        cs = u[..., n_ch + n_bc:].reshape(*u.shape[:2], len(groups), m.state)
        dt = ssm.softplus(dt_raw + rank.array(f"{prefix}.dt_bias")[
            _rows(rank, f"{prefix}.dt_bias", heads)])  # [B, S, h]
        a = -np.exp(rank.array(f"{prefix}.A_log")[_rows(rank, f"{prefix}.A_log", heads)])
        d = rank.array(f"{prefix}.D")[_rows(rank, f"{prefix}.D", heads)]
        slot = positions(heads // per_group, groups, f"{prefix}.in_proj")  # head -> its group
        state = np.zeros((x.shape[0], len(heads), m.head_dim, m.state), F32)
        ys = []
        for t in range(x.shape[1]):
            decay = np.exp(dt[:, t] * a)[:, :, None, None]  # [B, h, 1, 1]
            inflow = (dt[:, t, :, None] * xs[:, t])[..., None] * bs[:, t, slot][:, :, None, :]
            state = (decay * state + inflow).astype(F32)
            ys.append(np.einsum("bhpn,bhn->bhp", state, cs[:, t, slot]) + d[:, None] * xs[:, t])
        y = np.stack(ys, 1).reshape(x.shape[0], x.shape[1], n_ch)
        gated = (y * ops.silu(z)).astype(F32)
        # per group: this rank's sum of squares over its channels of the group
        sums = {int(g): (gated[..., (channels // group_width) == g] ** 2).sum(-1, keepdims=True)
                for g in groups}
        local.append((rank, heads, channels, conv_ids, conv_state, state, gated, sums))
    total: dict[int, Array] = {}
    covered: dict[int, list[Array]] = {}
    for _, _, channels, _, _, _, _, sums in local:
        for g, s in sums.items():
            total[g] = total.get(g, 0) + s
            covered.setdefault(g, []).append(channels[(channels // group_width) == g])
    for g, parts in covered.items():  # the all-reduce covers each channel of the group once
        if not np.array_equal(np.sort(np.concatenate(parts)),
                              np.arange(g * group_width, (g + 1) * group_width)):
            raise ShardingError(f"{prefix}.norm: group {g}'s channels are not split over the "
                                "ranks exactly once")
    outputs, states = [], []
    for rank, heads, channels, conv_ids, conv_state, state, gated, _ in local:
        variance = np.concatenate([np.broadcast_to(total[int(g)] / group_width,
                                                   (*gated.shape[:2], 1))
                                   for g in channels // group_width], -1)
        nw = f"{prefix}.norm.weight"
        normed = (gated / np.sqrt(variance + m.eps) * rank.array(nw)[_rows(rank, nw, channels)])
        op = f"{prefix}.out_proj.weight"
        sel = rank.selection(op)
        if sel is not None and sel.axis != 1:
            raise ShardingError(f"{op}: split on axis {sel.axis}, expected 1")
        cols = positions(channels, rank.indices(op, 1), op)
        outputs.append(((normed.astype(F32) @ rank.array(op)[:, cols].T).astype(F32), channels))
        states.append(RankState(conv_state=conv_state, conv_channels=conv_ids,
                                ssm_state=state, heads=heads))
    return all_reduce(outputs, inner, f"{prefix}.out_proj"), states


def run(config: Mapping[str, Any], ranks: Sequence[RankShard], input_ids: Array,
        layers: range, hidden_in: Array | None) -> ssm.Pass:
    """Run ``layers`` on the tensor-parallel ``ranks`` (see ``model.forward_tensor_parallel``);
    ``states`` holds each layer's rank states (empty for an attention layer)."""
    arch, mixer = describe(config)
    attention_layers = set(config.get("attn_layer_indices") or [])
    act = SimpleNamespace(act=ops.silu)
    inter = int(config["intermediate_size"])

    def mix(layer: int, prefix: str, normed: Array) -> tuple[Array, list[Any]]:
        if layer in attention_layers:
            return _attention(config, ranks, f"{prefix}.self_attn", normed), []
        return _mixer(mixer, ranks, f"{prefix}.mamba", normed)

    def feed_forward(layer: int, prefix: str, normed: Array) -> Array:
        names = tuple(f"{prefix}.feed_forward.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
        return _gated_mlp(act, ranks, names, normed, inter)  # type: ignore[arg-type]

    return hybrid.run_layers(arch, ranks, input_ids, layers, hidden_in, mix, feed_forward)
