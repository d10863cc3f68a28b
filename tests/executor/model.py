"""Decoder forward pass over tensor-parallel rank shards, plus pipeline stages.

One code path serves everything: :func:`forward` is :func:`forward_tensor_parallel` on a single
rank that holds every tensor whole. Each rank computes with its own local tensors only; the
results meet in the simulated collectives of :mod:`.shard` (vocab-parallel embedding sum,
row-parallel all-reduce, vocab-parallel logit gather).

Supported ``model_type`` values: llama, mistral, qwen2, qwen3, phi3, gemma2, mixtral,
qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3, gpt_oss, qwen3_next (its gated DeltaNet in
:mod:`.deltanet`), plus the families of :mod:`.variants` (gpt2, gpt_neox, falcon, bloom, olmo2,
granite, stablelm, phi, codegen, dbrx), which have their own tensor names, mamba (:mod:`.ssm`)
jamba (:mod:`.jamba`) and bamba (:mod:`.bamba`), which use this module's MLP helpers.
Tensor names are the on-disk checkpoint names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import deltanet, ops, ssm, variants
from .quant import dequantize
from .shard import (
    RankShard,
    ShardingError,
    align,
    all_reduce,
    all_reduce_distinct,
    column,
    positions,
    replicated,
    replicated_optional,
    row,
    split_heads,
    vocab_parallel_logits,
)

F32 = np.float32
Array = np.ndarray

__all__ = [
    "PipelineResult",
    "Result",
    "dequantize",
    "forward",
    "forward_pipeline",
    "forward_tensor_parallel",
]

SUPPORTED = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
}
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


@dataclass
class Result:
    """Output of one (possibly partial) forward pass.

    ``logits`` [B, S, V] is None unless the call ran the last layer. ``hidden`` is the residual
    stream after the last layer run (before the final norm): what a pipeline stage sends on.
    ``layer_inputs[k]`` / ``layer_outputs[k]`` belong to decoder layer ``layers[k]``.
    ``normed`` is the final norm's output (HF's last ``hidden_states`` entry) when it ran.
    """

    logits: Array | None
    hidden: Array
    layers: range
    layer_inputs: list[Array] = field(default_factory=list)
    layer_outputs: list[Array] = field(default_factory=list)
    normed: Array | None = None
    states: list[Any] = field(default_factory=list)
    """State-space families: per layer run, each rank's runtime state (``ssm.RankState``;
    qwen3_next: ``deltanet.RankState`` on linear-attention layers, none on full attention)."""


@dataclass
class PipelineResult:
    """Output of :func:`forward_pipeline`.

    ``sent[c]`` is the hidden state leaving stage ``c`` (before ``transfer``), ``received[c]``
    what stage ``c + 1`` got (after ``transfer``); ``stages`` are the per-stage results.
    """

    logits: Array
    sent: list[Array]
    received: list[Array]
    stages: list[Result]


@dataclass(frozen=True)
class _Mla:
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int


@dataclass(frozen=True)
class _Arch(ops.DecoderArch):
    """The config values the forward pass needs, normalised across families."""

    model_type: str
    v_head_dim: int
    norm_offset: float = 0.0
    embed_scale: float | None = None
    sandwich_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    fused_qkv: bool = False
    qk_norm: bool = False
    sinks: bool = False
    mla: _Mla | None = None
    rope_interleaved: bool = False
    gated_q: bool = False

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (None: full causal attention)."""
        window = self.config.get("sliding_window")
        layer_types = self.config.get("layer_types")
        if layer_types:
            return window if layer_types[layer] == "sliding_attention" else None
        if self.model_type in ("mistral", "mixtral") and window:
            return int(window)
        return None

    def mlp_kind(self, layer: int) -> str:
        """One of dense, fused_dense, mixtral, qwen_moe, deepseek_moe, gpt_oss."""
        c = self.config
        if self.model_type == "phi3":
            return "fused_dense"
        if self.model_type == "mixtral":
            return "mixtral"
        if self.model_type == "gpt_oss":
            return "gpt_oss"
        if self.model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
            sparse = (
                layer not in (c.get("mlp_only_layers") or [])
                and self.n_experts > 0
                and (layer + 1) % int(c.get("decoder_sparse_step", 1)) == 0
            )
            return "qwen_moe" if sparse else "dense"
        if self.model_type == "deepseek_v2":  # HF 5.24: every layer after the dense ones
            return "dense" if layer < int(c.get("first_k_dense_replace", 0)) else "deepseek_moe"
        if self.model_type == "deepseek_v3":
            dense = layer < int(c.get("first_k_dense_replace", 0))
            dense = dense or layer % int(c.get("moe_layer_freq", 1)) != 0
            return "dense" if dense else "deepseek_moe"
        return "dense"

    @property
    def n_experts(self) -> int:
        """Number of routed experts."""
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if self.config.get(key):
                return int(self.config[key])
        return 0


def _describe(config: Mapping[str, Any]) -> _Arch:
    mt = config["model_type"]
    if mt not in SUPPORTED:
        raise NotImplementedError(f"model_type {mt!r}")
    hidden = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    rope_params = config.get("rope_parameters") or {}
    partial = float(
        rope_params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1))
    )
    act_name = config.get("hidden_activation") or config.get("hidden_act", "silu")
    common: dict[str, Any] = {
        "config": config,
        "model_type": mt,
        "hidden": hidden,
        "vocab": int(config["vocab_size"]),
        "n_layers": int(config["num_hidden_layers"]),
        "n_heads": n_heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or n_heads),
        "head_dim": head_dim,
        "v_head_dim": head_dim,
        "eps": float(config.get("rms_norm_eps", 1e-6)),
        "act": ops.ACTIVATIONS[act_name],
        "rotary_dim": int(head_dim * partial),
        "scaling": head_dim**-0.5,
    }
    if mt == "gemma2":
        common |= {
            "norm_offset": 1.0,
            "embed_scale": hidden**0.5,
            "sandwich_norms": True,
            "attn_softcap": config.get("attn_logit_softcapping"),
            "final_softcap": config.get("final_logit_softcapping"),
            "scaling": float(config["query_pre_attn_scalar"]) ** -0.5,
        }
    elif mt == "phi3":
        common["fused_qkv"] = True
    elif mt in ("qwen3", "qwen3_moe"):
        common["qk_norm"] = True
    elif mt == "qwen3_next":  # RMSNorm x * (1 + w) everywhere; q_proj [q | gate] per head
        common |= {"qk_norm": True, "norm_offset": 1.0, "gated_q": True}
    elif mt == "gpt_oss":
        common["sinks"] = True
    elif mt in ("deepseek_v2", "deepseek_v3"):
        mla = _Mla(
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=int(config["kv_lora_rank"]),
            nope=int(config["qk_nope_head_dim"]),
            rope=int(config["qk_rope_head_dim"]),
            v=int(config["v_head_dim"]),
        )
        scaling = (mla.nope + mla.rope) ** -0.5
        if rope_params.get("rope_type", "default") != "default":
            mscale_all_dim = rope_params.get("mscale_all_dim", 0)
            factor = float(rope_params["factor"])
            if mscale_all_dim and factor > 1:
                mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
                scaling *= mscale * mscale
        common |= {
            "mla": mla,
            "head_dim": mla.nope + mla.rope,
            "v_head_dim": mla.v,
            "rotary_dim": mla.rope,
            "scaling": scaling,
            "rope_interleaved": bool(config.get("rope_interleave", True)),
        }
    return _Arch(**common)


# --------------------------------------------------------------------------- public API


def forward(config: Mapping[str, Any], tensors: Mapping[str, Array], input_ids: Array) -> Result:
    """Full-weight forward: the tensor-parallel path on one rank holding everything whole."""
    rank = RankShard(dict(tensors), {name: None for name in tensors})
    return forward_tensor_parallel(config, [rank], input_ids)


def forward_tensor_parallel(
    config: Mapping[str, Any],
    ranks: Sequence[RankShard],
    input_ids: Array,
    *,
    layers: range | None = None,
    hidden_in: Array | None = None,
    rope: tuple[Array, Array] | None = None,
) -> Result:
    """Run decoder ``layers`` (default: all) on the tensor-parallel ``ranks`` of one stage.

    Without ``hidden_in`` the ranks embed ``input_ids``; with it the call continues the residual
    stream a previous stage sent. If ``layers`` ends at the last decoder layer, the final norm
    and the (vocab-parallel) lm_head run too. ``input_ids`` [B, S] fixes the positions unless
    ``rope`` gives the ``(cos, sin)`` tables ([S, d] or [B, 1, S, d]; Qwen2-VL's M-RoPE).
    """
    n_layers = _n_layers(config)
    layers = range(n_layers) if layers is None else layers
    if layers.step != 1 or layers.start < 0 or layers.stop > n_layers:
        raise ValueError(f"layers {layers} not a contiguous part of range({n_layers})")
    if not ranks:
        raise ShardingError("no ranks")
    input_ids = np.asarray(input_ids)
    if hidden_in is None and layers.start != 0:
        raise ValueError("a stage that does not start at layer 0 needs hidden_in")
    if config["model_type"] in variants.SUPPORTED:
        if rope is not None:
            raise NotImplementedError("rope tables for the variants families")
        hidden_f32 = None if hidden_in is None else np.asarray(hidden_in, dtype=F32)
        done = variants.run(config, ranks, input_ids, layers, hidden_f32)
        return Result(
            logits=done.logits,
            hidden=done.hidden,
            layers=layers,
            layer_inputs=done.layer_inputs,
            layer_outputs=done.layer_outputs,
            normed=done.normed,
        )
    if config["model_type"] in ssm.SUPPORTED | {"jamba", "bamba"}:
        if rope is not None:
            raise NotImplementedError("rope tables for a state-space family")
        hidden_f32 = None if hidden_in is None else np.asarray(hidden_in, dtype=F32)
        from . import bamba, jamba  # they import this module's MLP helpers

        run = {"jamba": jamba.run, "bamba": bamba.run}.get(config["model_type"], ssm.run)
        passed = run(config, ranks, input_ids, layers, hidden_f32)
        return Result(logits=passed.logits, hidden=passed.hidden, layers=layers,
                      layer_inputs=passed.layer_inputs, layer_outputs=passed.layer_outputs,
                      normed=passed.normed, states=passed.states)
    arch = _describe(config)
    expert_ranks = ranks  # routed experts: every rank; dense parts: those not experts_only
    ranks = [rank for rank in ranks if not rank.experts_only]
    if not ranks:
        raise ShardingError("every rank is experts_only; no rank holds the dense parts")
    if hidden_in is None:
        hidden = _embed(arch, ranks, input_ids)
    else:
        hidden = np.asarray(hidden_in, dtype=F32)
    if rope is None:
        rope = ops.rope_tables(config, arch.rotary_dim, input_ids.shape[1])
    result = Result(logits=None, hidden=hidden, layers=layers)
    for layer in layers:
        result.layer_inputs.append(hidden)
        hidden = _decoder_layer(arch, ranks, layer, hidden, rope, expert_ranks, result.states)
        result.layer_outputs.append(hidden)
    result.hidden = hidden
    if layers.stop == arch.n_layers:
        result.normed = _norm(arch, hidden, replicated(ranks, FINAL_NORM))
        result.logits = _lm_head(arch, ranks, result.normed)
    return result


def _n_layers(config: Mapping[str, Any]) -> int:
    if config["model_type"] in ssm.SUPPORTED | {"jamba", "bamba"}:
        return int(config["num_hidden_layers"])
    if config["model_type"] in variants.SUPPORTED:
        return variants.describe(config).n_layers
    return _describe(config).n_layers


def forward_pipeline(
    config: Mapping[str, Any],
    stages: Sequence[Sequence[RankShard]],
    stage_layers: Sequence[range],
    input_ids: Array,
    transfer: Callable[[Array], Array] = lambda h: h,
) -> PipelineResult:
    """Run pipeline ``stages`` (each a list of TP ranks) over consecutive ``stage_layers``.

    ``transfer`` is applied to the hidden state at every stage cut (e.g. an encode/decode round
    trip); the result records what each cut sent and received.
    """
    n_layers = _n_layers(config)
    if len(stages) != len(stage_layers) or not stages:
        raise ValueError("need one layer range per stage")
    expected = 0
    for rng in stage_layers:
        if rng.start != expected or rng.step != 1 or rng.stop < rng.start:
            raise ValueError(f"stage layers {list(stage_layers)} are not consecutive")
        expected = rng.stop
    if expected != n_layers:
        raise ValueError(f"stage layers cover {expected} of {n_layers} layers")
    sent: list[Array] = []
    received: list[Array] = []
    results: list[Result] = []
    hidden: Array | None = None
    for index, (ranks, rng) in enumerate(zip(stages, stage_layers, strict=True)):
        result = forward_tensor_parallel(config, ranks, input_ids, layers=rng, hidden_in=hidden)
        results.append(result)
        if index < len(stages) - 1:
            sent.append(result.hidden)
            hidden = np.asarray(transfer(result.hidden), dtype=F32)
            received.append(hidden)
    logits = results[-1].logits
    assert logits is not None
    return PipelineResult(logits=logits, sent=sent, received=received, stages=results)


# --------------------------------------------------------------------------- embedding / head


def _embed(arch: _Arch, ranks: Sequence[RankShard], ids: Array) -> Array:
    """Vocab-parallel (or hidden-parallel) embedding lookup, summed over ranks."""
    axes = {sel.axis for rank in ranks if (sel := rank.selection(EMBED)) is not None}
    if len(axes) > 1:
        raise ShardingError(f"{EMBED}: ranks slice different axes {axes}")
    axis = axes.pop() if axes else 0
    if ids.min() < 0 or ids.max() >= arch.vocab:
        raise ValueError("input id outside the vocabulary")
    parts = []
    for rank in ranks:
        rows, cols = rank.indices(EMBED, 0), rank.indices(EMBED, 1)
        lookup = np.full(arch.vocab, -1)
        lookup[rows] = np.arange(len(rows))
        local = lookup[ids]
        vectors = np.where((local >= 0)[..., None], rank.array(EMBED)[np.maximum(local, 0)], 0)
        full = np.zeros((*ids.shape, arch.hidden), dtype=F32)
        full[..., cols] = vectors
        parts.append((full, rows if axis == 0 else cols))
    hidden = all_reduce(parts, arch.vocab if axis == 0 else arch.hidden, EMBED)
    if arch.embed_scale is not None:
        hidden = hidden * F32(arch.embed_scale)
    return hidden.astype(F32)


def _lm_head(arch: _Arch, ranks: Sequence[RankShard], x: Array) -> Array:
    """Vocab-parallel logits of the final-norm output, gathered over ranks (tied: embedding)."""
    if all(rank.has(LM_HEAD) for rank in ranks):
        name = LM_HEAD
    elif arch.config.get("tie_word_embeddings"):
        name = EMBED
    else:
        raise ShardingError(f"a rank of the last stage lacks {LM_HEAD}")
    logits = vocab_parallel_logits(ranks, name, x, arch.vocab)
    if arch.final_softcap is not None:
        cap = F32(arch.final_softcap)
        logits = np.tanh(logits / cap) * cap
    return logits.astype(F32)


def _norm(arch: _Arch, x: Array, weight: Array) -> Array:
    return ops.rms_norm(x, weight, arch.eps, offset=arch.norm_offset)


# --------------------------------------------------------------------------- decoder layer


def _decoder_layer(
    arch: _Arch,
    ranks: Sequence[RankShard],
    layer: int,
    hidden: Array,
    rope: tuple[Array, Array],
    expert_ranks: Sequence[RankShard] | None = None,
    states: list[Any] | None = None,
) -> Array:
    p = f"model.layers.{layer}."
    x = _norm(arch, hidden, replicated(ranks, p + "input_layernorm.weight"))
    layer_types = arch.config.get("layer_types") or []
    if arch.model_type == "qwen3_next" and layer_types[layer] == "linear_attention":
        attn, rank_states = deltanet.mixer(arch.config, ranks, p + "linear_attn", x)
    else:
        attn = _attention(arch, ranks, p + "self_attn", x, arch.window(layer), rope)
        rank_states = []
    if states is not None:
        states.append(rank_states)
    if arch.sandwich_norms:
        attn = _norm(arch, attn, replicated(ranks, p + "post_attention_layernorm.weight"))
    hidden = hidden + attn
    pre_ff = "pre_feedforward_layernorm" if arch.sandwich_norms else "post_attention_layernorm"
    x = _norm(arch, hidden, replicated(ranks, p + pre_ff + ".weight"))
    ff = _feed_forward(arch, ranks, layer, x, expert_ranks)
    if arch.sandwich_norms:
        ff = _norm(arch, ff, replicated(ranks, p + "post_feedforward_layernorm.weight"))
    return (hidden + ff).astype(F32)


# --------------------------------------------------------------------------- attention


def _attention(
    arch: _Arch,
    ranks: Sequence[RankShard],
    prefix: str,
    x: Array,
    window: int | None,
    rope: tuple[Array, Array],
) -> Array:
    """Each rank attends with its local heads; o_proj partials are all-reduced, bias added once."""
    parts = [_attention_rank(arch, rank, prefix, x, window, rope) for rank in ranks]
    out = all_reduce(parts, arch.n_heads * arch.v_head_dim, f"{prefix}.o_proj")
    bias = replicated_optional(ranks, f"{prefix}.o_proj.bias")
    return out if bias is None else (out + bias).astype(F32)


def _local_dense(rank: RankShard, prefix: str, x: Array) -> Array:
    """A projection the rank must hold whole (MLA's down-projections)."""
    y = x @ rank.whole(f"{prefix}.weight").T
    if rank.has(f"{prefix}.bias"):
        y = y + rank.whole(f"{prefix}.bias")
    return y.astype(F32)


def _standard_qkv(
    arch: _Arch, rank: RankShard, prefix: str, x: Array, rope: tuple[Array, Array]
) -> tuple[Array, Array, Array, Array]:
    """Local q heads [B, hq, S, d] with their ids, and k, v expanded to one per q head."""
    hd = arch.head_dim
    if arch.fused_qkv:
        y, idx = column(rank, f"{prefix}.qkv_proj", x)
        nq, nkv = arch.n_heads * hd, arch.n_kv_heads * hd
        segments = []
        for lo, hi in ((0, nq), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)):
            keep = (idx >= lo) & (idx < hi)
            segments.append((y[..., keep], idx[keep] - lo))
        (q, q_idx), (k, k_idx), (v, v_idx) = segments
    elif arch.gated_q:
        q, q_idx, _, _ = deltanet.gated_query(rank, prefix, x, hd)
        k, k_idx = column(rank, f"{prefix}.k_proj", x)
        v, v_idx = column(rank, f"{prefix}.v_proj", x)
    else:
        q, q_idx = column(rank, f"{prefix}.q_proj", x)
        k, k_idx = column(rank, f"{prefix}.k_proj", x)
        v, v_idx = column(rank, f"{prefix}.v_proj", x)
    q, q_heads = split_heads(q, q_idx, hd, f"{prefix} q")
    k, k_heads = split_heads(k, k_idx, hd, f"{prefix} k")
    v, v_heads = split_heads(v, v_idx, hd, f"{prefix} v")
    v = v[:, positions(k_heads, v_heads, f"{prefix} v heads")]
    if arch.qk_norm:
        q = _norm(arch, q, rank.whole(f"{prefix}.q_norm.weight"))
        k = _norm(arch, k, rank.whole(f"{prefix}.k_norm.weight"))
    cos, sin = rope
    q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    group = arch.n_heads // arch.n_kv_heads
    kv = positions(q_heads // group, k_heads, f"{prefix}: kv heads of the local q heads")
    return q, q_heads, k[:, kv], v[:, kv]


def _mla_qkv(
    arch: _Arch, rank: RankShard, prefix: str, x: Array, rope: tuple[Array, Array]
) -> tuple[Array, Array, Array, Array]:
    """DeepSeek-V3 multi-head latent attention, for the rank's local heads."""
    mla = arch.mla
    assert mla is not None
    if mla.q_lora_rank:
        q_latent = _local_dense(rank, f"{prefix}.q_a_proj", x)
        q_latent = ops.rms_norm(q_latent, rank.whole(f"{prefix}.q_a_layernorm.weight"), 1e-6)
        q, q_idx = column(rank, f"{prefix}.q_b_proj", q_latent)
    else:
        q, q_idx = column(rank, f"{prefix}.q_proj", x)
    q, q_heads = split_heads(q, q_idx, mla.nope + mla.rope, f"{prefix} q")
    compressed = _local_dense(rank, f"{prefix}.kv_a_proj_with_mqa", x)
    latent, k_rot = compressed[..., : mla.kv_lora_rank], compressed[..., mla.kv_lora_rank :]
    latent = ops.rms_norm(latent, rank.whole(f"{prefix}.kv_a_layernorm.weight"), 1e-6)
    kv, kv_idx = column(rank, f"{prefix}.kv_b_proj", latent)
    kv, kv_heads = split_heads(kv, kv_idx, mla.nope + mla.v, f"{prefix} kv_b")
    kv = kv[:, positions(q_heads, kv_heads, f"{prefix}: kv_b heads of the local q heads")]
    k_nope, v = kv[..., : mla.nope], kv[..., mla.nope :]
    cos, sin = rope
    q_rot = ops.apply_rope(q[..., mla.nope :], cos, sin, interleaved=arch.rope_interleaved)
    k_rot = ops.apply_rope(k_rot[:, None], cos, sin, interleaved=arch.rope_interleaved)
    q = np.concatenate([q[..., : mla.nope], q_rot], axis=-1)
    k = np.concatenate([k_nope, np.broadcast_to(k_rot, (*k_nope.shape[:-1], mla.rope))], axis=-1)
    return q, q_heads, k, v


def _attention_rank(
    arch: _Arch,
    rank: RankShard,
    prefix: str,
    x: Array,
    window: int | None,
    rope: tuple[Array, Array],
) -> tuple[Array, Array]:
    """One rank's o_proj partial product and the attention features it covers."""
    qkv = _mla_qkv if arch.mla is not None else _standard_qkv
    q, q_heads, k, v = qkv(arch, rank, prefix, x, rope)
    sinks = None
    if arch.sinks:
        name = f"{prefix}.sinks"
        sinks = rank.array(name)[positions(q_heads, rank.indices(name, 0), name)]
    out = ops.attend(
        q, k, v, scaling=arch.scaling, softcap=arch.attn_softcap, sinks=sinks, window=window
    )
    batch, heads, seq, dv = out.shape
    features = (q_heads[:, None] * dv + np.arange(dv)).ravel()
    merged = out.transpose(0, 2, 1, 3).reshape(batch, seq, heads * dv)
    if arch.gated_q:  # Qwen3-Next: the output times sigmoid(gate) of the same features
        _, _, gate, gate_idx = deltanet.gated_query(rank, prefix, x, arch.head_dim)
        merged = merged * ops.sigmoid(align(gate, gate_idx, features, f"{prefix} gate"))
    return row(rank, f"{prefix}.o_proj", merged, features), features


# --------------------------------------------------------------------------- feed-forward


def _feed_forward(
    arch: _Arch,
    ranks: Sequence[RankShard],
    layer: int,
    x: Array,
    expert_ranks: Sequence[RankShard] | None = None,
) -> Array:
    """Dense or MoE feed-forward; routed experts run on ``expert_ranks`` (default ``ranks``)."""
    c = arch.config
    experts = ranks if expert_ranks is None else expert_ranks
    p = f"model.layers.{layer}."
    kind = arch.mlp_kind(layer)
    if kind == "dense":
        names = _gated(f"{p}mlp")
        return _gated_mlp(arch, ranks, names, x, int(c["intermediate_size"]))
    if kind == "fused_dense":
        return _fused_mlp(arch, ranks, p + "mlp", x, int(c["intermediate_size"]))

    batch, seq, hidden = x.shape
    x2d = x.reshape(batch * seq, hidden)
    top_k = int(c["num_experts_per_tok"])
    if kind == "mixtral":
        logits = x2d @ replicated(ranks, f"{p}block_sparse_moe.gate.weight").T
        index, weight = ops.route_softmax_topk(logits, top_k, normalize=True)
        out = _routed_experts(
            arch,
            experts,
            x2d,
            index,
            weight,
            lambda e: _gated(f"{p}block_sparse_moe.experts.{e}", "w1", "w3", "w2"),
            int(c["intermediate_size"]),
        )
    elif kind in ("qwen_moe", "deepseek_moe"):
        logits = x2d @ replicated(ranks, f"{p}mlp.gate.weight").T
        if kind == "qwen_moe":
            normalize = bool(c.get("norm_topk_prob", False))
            index, weight = ops.route_softmax_topk(logits, top_k, normalize)
        elif arch.model_type == "deepseek_v2":
            index, weight = ops.route_deepseek_v2(
                logits,
                top_k=top_k,
                method=str(c.get("topk_method") or "greedy"),
                n_group=int(c.get("n_group") or 1),
                topk_group=int(c.get("topk_group") or 1),
                scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            )
        else:
            index, weight = ops.route_deepseek(
                logits,
                replicated(ranks, f"{p}mlp.gate.e_score_correction_bias"),
                top_k=top_k,
                n_group=int(c.get("n_group", 1)),
                topk_group=int(c.get("topk_group", 1)),
                normalize=bool(c.get("norm_topk_prob", True)),
                scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            )
        out = _routed_experts(
            arch,
            experts,
            x2d,
            index,
            weight,
            lambda e: _gated(f"{p}mlp.experts.{e}"),
            int(c["moe_intermediate_size"]),
        )
        if kind == "qwen_moe" and int(c.get("shared_expert_intermediate_size") or 0):
            shared_names = _gated(f"{p}mlp.shared_expert")
            shared = _gated_mlp(
                arch, ranks, shared_names, x2d, int(c["shared_expert_intermediate_size"])
            )
            gate = ops.sigmoid(x2d @ replicated(ranks, f"{p}mlp.shared_expert_gate.weight").T)
            out = out + gate * shared
        elif kind == "deepseek_moe" and int(c.get("n_shared_experts") or 0):
            shared_names = _gated(f"{p}mlp.shared_experts")
            inter = int(c["moe_intermediate_size"]) * int(c["n_shared_experts"])
            out = out + _gated_mlp(arch, ranks, shared_names, x2d, inter)
    elif kind == "gpt_oss":
        router = f"{p}mlp.router"
        logits = x2d @ replicated(ranks, f"{router}.weight").T + replicated(ranks, f"{router}.bias")
        index, weight = ops.route_topk_softmax(logits.astype(F32), top_k)
        out = _gpt_oss_experts(arch, experts, f"{p}mlp.experts", x2d, index, weight)
    else:  # pragma: no cover - mlp_kind is exhaustive
        raise AssertionError(kind)
    return out.reshape(batch, seq, hidden).astype(F32)


def _gated(
    prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
) -> tuple[str, str, str]:
    """Module prefixes ``(gate, up, down)`` of a gated MLP."""
    return f"{prefix}.{gate}", f"{prefix}.{up}", f"{prefix}.{down}"


def _gated_mlp_rank(
    arch: _Arch, rank: RankShard, names: tuple[str, str, str], x: Array
) -> tuple[Array, Array]:
    """``down(act(gate(x)) * up(x))`` on the rank's intermediate slice: (partial, slice)."""
    gate_name, up_name, down_name = names
    gate, gate_idx = column(rank, gate_name, x)
    up, up_idx = column(rank, up_name, x)
    up = align(up, up_idx, gate_idx, up_name)
    return row(rank, down_name, arch.act(gate) * up, gate_idx), gate_idx


def _gated_mlp(
    arch: _Arch,
    ranks: Sequence[RankShard],
    names: tuple[str, str, str],
    x: Array,
    intermediate: int,
) -> Array:
    """Gated MLP, column-parallel gate/up and row-parallel down, over all ranks."""
    parts = [_gated_mlp_rank(arch, rank, names, x) for rank in ranks]
    out = all_reduce(parts, intermediate, names[2])
    bias = replicated_optional(ranks, f"{names[2]}.bias")
    return out if bias is None else (out + bias).astype(F32)


def _fused_mlp(
    arch: _Arch, ranks: Sequence[RankShard], prefix: str, x: Array, intermediate: int
) -> Array:
    """Phi-3: ``gate_up_proj`` is [gate | up] on axis 0; a shard holds a range in each half."""
    parts = []
    for rank in ranks:
        y, idx = column(rank, f"{prefix}.gate_up_proj", x)
        is_gate = idx < intermediate
        gate, gate_idx = y[..., is_gate], idx[is_gate]
        up = align(y[..., ~is_gate], idx[~is_gate] - intermediate, gate_idx, prefix)
        parts.append((row(rank, f"{prefix}.down_proj", arch.act(gate) * up, gate_idx), gate_idx))
    return all_reduce(parts, intermediate, f"{prefix}.down_proj")


def _routed_experts(
    arch: _Arch,
    ranks: Sequence[RankShard],
    x2d: Array,
    index: Array,
    weight: Array,
    names: Callable[[int], tuple[str, str, str]],
    intermediate: int,
) -> Array:
    """Per-expert checkpoints (``experts.{e}.*``): each expert's partials are reduced over the
    ranks holding it (TP on the intermediate dim and/or expert parallelism), then weighted."""
    out = np.zeros_like(x2d)
    for expert in range(arch.n_experts):
        gate, up, down = names(expert)
        holders = [rank for rank in ranks if rank.has(f"{gate}.weight")]
        if not holders:
            raise ShardingError(f"no rank holds {gate}.weight")
        tokens, slot = np.nonzero(index == expert)
        if len(tokens) == 0:
            continue
        parts = [_gated_mlp_rank(arch, rank, (gate, up, down), x2d[tokens]) for rank in holders]
        y = all_reduce_distinct(parts, intermediate, down)  # redundant copies count once
        bias = replicated_optional(holders, f"{down}.bias")
        if bias is not None:
            y = y + bias
        out[tokens] += weight[tokens, slot][:, None] * y
    return out


def _expert_row(rank: RankShard, name: str, expert: int) -> Array:
    """The local ``[expert]`` slab of a stacked ``[E, ...]`` tensor."""
    local = positions(np.array([expert]), rank.indices(name, 0), name)[0]
    return rank.array(name)[local]


def _check_axes(rank: RankShard, allowed: Mapping[str, tuple[int, ...]]) -> None:
    for name, axes in allowed.items():
        sel = rank.selection(name)
        if sel is not None and sel.axis not in axes:
            raise ShardingError(f"{name}: unsupported slice on axis {sel.axis}")


def _gpt_oss_experts(
    arch: _Arch,
    ranks: Sequence[RankShard],
    prefix: str,
    x2d: Array,
    index: Array,
    weight: Array,
) -> Array:
    """gpt-oss stacked experts: ``gate_up_proj`` [E, H, 2I] (gate/up interleaved on the last
    axis), ``down_proj`` [E, I, H]; TP slices the last axis of gate_up and axis 1 of down."""
    c = arch.config
    alpha, limit = float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0))
    intermediate = int(c["intermediate_size"])
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    out = np.zeros_like(x2d)
    for expert in range(arch.n_experts):
        holders = [r for r in ranks if r.has(gate_up) and expert in r.indices(gate_up, 0)]
        if not holders:
            raise ShardingError(f"no rank holds expert {expert} of {gate_up}")
        tokens, slot = np.nonzero(index == expert)
        if len(tokens) == 0:
            continue
        xe = x2d[tokens]
        parts = []
        for rank in holders:
            _check_axes(rank, {gate_up: (0, 2), f"{gate_up}_bias": (0, 1), down: (0, 1)})
            cols = rank.indices(gate_up, 2)
            w = _expert_row(rank, gate_up, expert)
            b = _expert_row(rank, f"{gate_up}_bias", expert)
            b_cols = rank.indices(f"{gate_up}_bias", 1)
            y = xe @ w + b[positions(cols, b_cols, f"{gate_up}_bias")]
            is_gate = cols % 2 == 0
            gate, gate_j = y[..., is_gate], cols[is_gate] // 2
            up = align(y[..., ~is_gate], cols[~is_gate] // 2, gate_j, gate_up)
            glu = ops.gpt_oss_glu(gate, up, alpha, limit)
            d = _expert_row(rank, down, expert)
            rows = positions(gate_j, rank.indices(down, 1), down)
            parts.append(((glu @ d[rows]).astype(F32), gate_j))
        y = all_reduce_distinct(parts, intermediate, f"{down} expert {expert}")
        bias_rows = []
        for rank in holders:
            if rank.has(f"{down}_bias"):
                _check_axes(rank, {f"{down}_bias": (0,)})
                bias_rows.append(_expert_row(rank, f"{down}_bias", expert))
        if bias_rows:
            if any(not np.array_equal(b, bias_rows[0]) for b in bias_rows):
                raise ShardingError(f"{down}_bias: replicated copies differ")
            y = y + bias_rows[0]
        out[tokens] += weight[tokens, slot][:, None] * y
    return out
