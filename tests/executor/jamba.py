"""Jamba (attention / Mamba / MoE hybrid) decoder layers on tensor-parallel rank shards.

Layer ``i`` mixes with attention when ``i % attn_layer_period == attn_layer_offset`` (GQA, no
positional embedding: q/k/v column-parallel by heads, o_proj row-parallel) and with the Mamba
mixer of ``ssm`` otherwise (its dt / B / C RMSNorms after the in-mixer all-reduce of x_proj);
its MLP is the routed experts (softmax top-k, weights left unnormalised) when ``i %
expert_layer_period == expert_layer_offset``, else a dense gated MLP. Each Mamba layer reports
each rank's conv / SSM state as ``ssm`` does (attention layers report none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import hybrid, ops, ssm
from .model import _gated_mlp, _routed_experts
from .shard import F32, RankShard, replicated

Array = np.ndarray
SUPPORTED = {"jamba"}


def describe(config: Mapping[str, Any]) -> ssm.Arch:
    """The Mamba part of the config as ``ssm.Arch`` (its ``eps`` is ``rms_norm_eps``)."""
    if config.get("mamba_proj_bias") or config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError("jamba: only mamba_proj_bias=false and silu")
    hidden = int(config["hidden_size"])
    rank = config.get("mamba_dt_rank", "auto")
    return ssm.Arch(n_layers=int(config["num_hidden_layers"]), hidden=hidden,
                    inner=int(config.get("mamba_expand", 2)) * hidden,
                    state=int(config.get("mamba_d_state", 16)),
                    kernel=int(config.get("mamba_d_conv", 4)),
                    dt_rank=-(-hidden // 16) if rank == "auto" else int(rank),
                    vocab=int(config["vocab_size"]), eps=float(config["rms_norm_eps"]),
                    tied=bool(config.get("tie_word_embeddings", False)))


def _feed_forward(config: Mapping[str, Any], ranks: Sequence[RankShard], layer: int, x: Array
                  ) -> Array:
    """Routed experts (with the replicated router) or the dense gated MLP of ``layer``."""
    prefix = f"model.layers.{layer}.feed_forward"
    n_experts = int(config.get("num_experts", 16))
    inter = int(config["intermediate_size"])
    act = SimpleNamespace(act=ops.silu, n_experts=n_experts)
    if n_experts > 1 and layer % int(config["expert_layer_period"]) == int(
            config["expert_layer_offset"]):
        flat = x.reshape(-1, x.shape[-1])
        logits = flat @ replicated(ranks, f"{prefix}.router.weight").T
        index, weight = ops.route_softmax_topk(logits, int(config["num_experts_per_tok"]),
                                               normalize=False)
        out = _routed_experts(act, ranks, flat, index, weight,  # type: ignore[arg-type]
                              lambda e: tuple(f"{prefix}.experts.{e}.{n}" for n in (
                                  "gate_proj", "up_proj", "down_proj")), inter)
        return out.reshape(x.shape).astype(F32)
    names = (f"{prefix}.gate_proj", f"{prefix}.up_proj", f"{prefix}.down_proj")
    return _gated_mlp(act, ranks, names, x, inter)  # type: ignore[arg-type]


def run(config: Mapping[str, Any], ranks: Sequence[RankShard], input_ids: Array,
        layers: range, hidden_in: Array | None) -> ssm.Pass:
    """Run ``layers`` on the tensor-parallel ``ranks`` (see ``model.forward_tensor_parallel``);
    ``states`` holds each layer's rank states (empty for an attention layer)."""
    arch = describe(config)

    def mix(layer: int, prefix: str, normed: Array) -> tuple[Array, list[Any]]:
        if layer % int(config["attn_layer_period"]) == int(config["attn_layer_offset"]):
            return hybrid.attention(config, ranks, f"{prefix}.self_attn", normed), []
        return ssm._mixer(arch, ranks, f"{prefix}.mamba", normed)

    def feed_forward(layer: int, prefix: str, normed: Array) -> Array:
        return _feed_forward(config, ranks, layer, normed)

    return hybrid.run_layers(arch, ranks, input_ids, layers, hidden_in, mix, feed_forward)
