"""Decoder families with their own tensor names and layouts: gpt2, gpt_neox, falcon, bloom,
olmo2, granite, stablelm, phi, codegen, dbrx.

A :class:`Spec` per family names the checkpoint tensors and picks the variant of each part
(norm kind, residual wiring, fused-qkv layout, MLP kind, Conv1D orientation, positions). The
forward pass follows :mod:`.model`: every rank computes with its own local tensors and the
results meet in the strict collectives of :mod:`.shard`. Fused qkv outputs are decoded from
their *global* row indices, so a shard that splits a head or a KV group fails loudly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ops
from .shard import (
    RankShard,
    ShardingError,
    align,
    all_gather,
    all_reduce,
    all_reduce_distinct,
    column,
    conv_column,
    conv_row,
    positions,
    replicated,
    replicated_optional,
    row,
    split_heads,
    vocab_parallel_embedding,
)

F32 = np.float32
Array = np.ndarray


@dataclass(frozen=True)
class Spec:
    """Tensor names (``{}`` is the layer index) and structural choices of one family."""

    embed: str
    layer: str
    final_norm: str
    attn: str
    out: str
    mlp: tuple[str, ...]  # (up, down) plain, (gate, up, down) gated
    norms: tuple[str, ...]  # per-layer norm prefixes, in the order ``residual`` uses them
    residual: str  # sequential | parallel | shared | post
    qkv: str  # separate | component | interleaved | grouped | mp_grouped
    fused: str = "query_key_value"
    lm_head: str | None = None  # None: tied to ``embed``
    norm: str = "layer"  # layer (with bias) | rms
    conv1d: bool = False
    wpe: str | None = None
    embed_norm: str | None = None
    alibi: bool = False
    qk_norm: bool = False  # OLMo-2 RMSNorm over the whole q / k projection width
    norm_bias: bool = True  # False: LayerNorms without a bias (DBRX)
    rope: str = "half"  # half (HF rotate_half) | every_two (GPT-J pairs, CodeGen)
    moe: str | None = None  # dbrx: fused per-expert w1 / v1 / w2 [E * I, H] and a router
    per_head_norm: str | None = None  # config switch of StableLM's LayerNorm per q / k head


SPECS: dict[str, Spec] = {
    "gpt2": Spec(
        embed="transformer.wte.weight", layer="transformer.h.{}.", final_norm="transformer.ln_f",
        attn="attn", out="c_proj", mlp=("mlp.c_fc", "mlp.c_proj"), norms=("ln_1", "ln_2"),
        residual="sequential", qkv="component", fused="c_attn", conv1d=True,
        wpe="transformer.wpe.weight",
    ),
    "gpt_neox": Spec(
        embed="gpt_neox.embed_in.weight", layer="gpt_neox.layers.{}.",
        final_norm="gpt_neox.final_layer_norm", attn="attention", out="dense",
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        norms=("input_layernorm", "post_attention_layernorm"), residual="parallel",
        qkv="interleaved", lm_head="embed_out.weight",
    ),
    "falcon": Spec(
        embed="transformer.word_embeddings.weight", layer="transformer.h.{}.",
        final_norm="transformer.ln_f", attn="self_attention", out="dense",
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"), norms=("ln_attn", "ln_mlp"),
        residual="parallel", qkv="grouped",
    ),
    "bloom": Spec(
        embed="transformer.word_embeddings.weight", layer="transformer.h.{}.",
        final_norm="transformer.ln_f", attn="self_attention", out="dense",
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        norms=("input_layernorm", "post_attention_layernorm"), residual="sequential",
        qkv="interleaved", embed_norm="transformer.word_embeddings_layernorm", alibi=True,
    ),
    "olmo2": Spec(
        embed="model.embed_tokens.weight", layer="model.layers.{}.", final_norm="model.norm",
        attn="self_attn", out="o_proj", mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        norms=("post_attention_layernorm", "post_feedforward_layernorm"), residual="post",
        qkv="separate", lm_head="lm_head.weight", norm="rms", qk_norm=True,
    ),
    "granite": Spec(
        embed="model.embed_tokens.weight", layer="model.layers.{}.", final_norm="model.norm",
        attn="self_attn", out="o_proj", mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        norms=("input_layernorm", "post_attention_layernorm"), residual="sequential",
        qkv="separate", lm_head="lm_head.weight", norm="rms",
    ),
    "stablelm": Spec(
        embed="model.embed_tokens.weight", layer="model.layers.{}.", final_norm="model.norm",
        attn="self_attn", out="o_proj", mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        norms=("input_layernorm", "post_attention_layernorm"), residual="sequential",
        qkv="separate", lm_head="lm_head.weight", per_head_norm="qk_layernorm",
    ),
    "phi": Spec(
        embed="model.embed_tokens.weight", layer="model.layers.{}.",
        final_norm="model.final_layernorm", attn="self_attn", out="dense",
        mlp=("mlp.fc1", "mlp.fc2"), norms=("input_layernorm",), residual="shared",
        qkv="separate", lm_head="lm_head.weight",
    ),
    # CodeGen: qkv_proj is mp_num (4, fixed in HF) groups of [q_g | v_g | k_g]; attention and
    # MLP both read ln_1 (parallel residual); GPT-J rotary on the first rotary_dim features
    "codegen": Spec(
        embed="transformer.wte.weight", layer="transformer.h.{}.", final_norm="transformer.ln_f",
        attn="attn", out="out_proj", mlp=("mlp.fc_in", "mlp.fc_out"), norms=("ln_1",),
        residual="shared", qkv="mp_grouped", fused="qkv_proj", lm_head="lm_head.weight",
        rope="every_two",
    ),
    # DBRX: Wqkv [q | k | v] clamped to +-clip_qkv, bias-free LayerNorms, fused-expert MoE
    "dbrx": Spec(
        embed="transformer.wte.weight", layer="transformer.blocks.{}.",
        final_norm="transformer.norm_f", attn="norm_attn_norm.attn", out="out_proj",
        mlp=(), norms=("norm_attn_norm.norm_1", "norm_attn_norm.norm_2"), residual="sequential",
        qkv="component", fused="Wqkv", lm_head="lm_head.weight", norm_bias=False, moe="dbrx",
    ),
}
SUPPORTED = frozenset(SPECS)
# Config switches whose other setting these specs do not model: (model_type, key, supported value).
_FIXED = [
    ("gpt2", "scale_attn_by_inverse_layer_idx", False),
    ("gpt2", "scale_attn_weights", True),
    ("gpt_neox", "use_parallel_residual", True),
    ("falcon", "alibi", False),
    ("falcon", "parallel_attn", True),
    ("falcon", "new_decoder_architecture", True),
    ("bloom", "apply_residual_connection_post_layernorm", False),
    ("stablelm", "use_parallel_residual", False),
    ("phi", "qk_layernorm", False),
]


@dataclass(frozen=True)
class Arch(ops.DecoderArch):
    """Config values of one variant family, under one set of names."""

    spec: Spec
    intermediate: int
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    clip_qkv: float | None = None
    """DBRX: the fused qkv output clamped elementwise to ``[-clip_qkv, clip_qkv]``."""
    mp_num: int = 1
    """CodeGen: the groups of its fused qkv (HF's ``CodeGenAttention.mp_num``)."""
    per_head_norm: bool = False  # `q_layernorm.norms.{h}` / `k_layernorm.norms.{h}` per head


def _first(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def describe(config: Mapping[str, Any]) -> Arch:
    """Normalise the config of a variant family."""
    mt = config["model_type"]
    if mt not in SPECS:
        raise NotImplementedError(f"model_type {mt!r}")
    spec = SPECS[mt]
    for family, key, value in _FIXED:
        if family == mt and key in config and bool(config[key]) != value:
            raise NotImplementedError(f"{mt}: {key}={config[key]!r} (executor models {value})")
    if mt == "falcon" and config.get("num_ln_in_parallel_attn") not in (None, 2):
        raise NotImplementedError("falcon: only ln_attn + ln_mlp (num_ln_in_parallel_attn 2)")
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model"))
    n_heads = int(_first(config, "num_attention_heads", "n_head", "n_heads"))
    head_dim = hidden // n_heads
    n_kv = n_heads
    attn_config = config.get("attn_config") or {}
    ffn_config = config.get("ffn_config") or {}
    if mt == "dbrx":
        n_kv = int(attn_config["kv_n_heads"])
    elif mt == "falcon":  # multi_query is ignored under new_decoder_architecture
        if config.get("new_decoder_architecture"):
            n_kv = int(config["num_kv_heads"])
        elif config.get("multi_query"):
            n_kv = 1
    elif config.get("num_key_value_heads"):
        n_kv = int(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or {}
    partial = float(
        _first(rope, "partial_rotary_factor", default=None)
        or _first(config, "partial_rotary_factor", "rotary_pct", default=1.0)
    )
    uses_rope = not spec.alibi and spec.wpe is None
    rotary_dim = int(head_dim * partial) if uses_rope else 0
    act_name = "bloom_gelu" if mt == "bloom" else _first(
        config, "hidden_act", "activation_function", "activation", default="gelu"
    )
    intermediate = int(
        _first(config, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * hidden)
    )
    eps = _first(config, "layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps")
    if mt == "codegen":
        if config.get("rotary_dim") is None:
            raise NotImplementedError("codegen: rotary_dim None (HF rotates the whole head)")
        rotary_dim = int(config["rotary_dim"])
    if mt == "dbrx":
        act_name = (ffn_config.get("ffn_act_fn") or {}).get("name", "silu")
        intermediate = int(ffn_config["ffn_hidden_size"])
        eps = 1e-5  # nn.LayerNorm's default: DBRX's norms take no eps from the config
    return Arch(
        spec=spec,
        config=config,
        hidden=hidden,
        vocab=int(config["vocab_size"]),
        n_layers=int(_first(config, "num_hidden_layers", "n_layer", "n_layers")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate=intermediate,
        eps=float(eps),
        act=ops.ACTIVATIONS[act_name],
        rotary_dim=rotary_dim,
        scaling=float(config.get("attention_multiplier") or head_dim**-0.5),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)),
        clip_qkv=None if attn_config.get("clip_qkv") is None else float(attn_config["clip_qkv"]),
        mp_num=4 if mt == "codegen" else 1,
        per_head_norm=bool(spec.per_head_norm and config.get(spec.per_head_norm)),
    )


def alibi_slopes(n_heads: int) -> Array:
    """HF ``build_alibi_tensor`` slopes for every (global) head."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        extra = min(closest, n_heads - closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(extra)]
    return np.array(slopes, dtype=F32)


# --------------------------------------------------------------------------- forward


@dataclass
class Pass:
    """What one forward over some layers produced (turned into a ``model.Result``)."""

    logits: Array | None
    hidden: Array
    normed: Array | None
    layer_inputs: list[Array]
    layer_outputs: list[Array]


def run(
    config: Mapping[str, Any],
    ranks: Sequence[RankShard],
    input_ids: Array,
    layers: range,
    hidden_in: Array | None,
) -> Pass:
    """Run ``layers`` on the tensor-parallel ``ranks`` (see ``model.forward_tensor_parallel``)."""
    arch = describe(config)
    expert_ranks = ranks  # routed experts: every rank; dense parts: those not experts_only
    ranks = [rank for rank in ranks if not rank.experts_only]
    if not ranks:
        raise ShardingError("every rank is experts_only; no rank holds the dense parts")
    hidden = _embed(arch, ranks, input_ids) if hidden_in is None else hidden_in
    seq = input_ids.shape[1]
    rope = ops.rope_tables(config, arch.rotary_dim, seq) if arch.rotary_dim else None
    out = Pass(None, hidden, None, [], [])
    for layer in layers:
        out.layer_inputs.append(hidden)
        hidden = _layer(arch, ranks, layer, hidden, rope, expert_ranks)
        out.layer_outputs.append(hidden)
    out.hidden = hidden
    if layers.stop == arch.n_layers:
        out.normed = _norm(arch, ranks, arch.spec.final_norm, hidden)
        out.logits = _lm_head(arch, ranks, out.normed)
    return out


def _norm(arch: Arch, ranks: Sequence[RankShard], prefix: str, x: Array) -> Array:
    weight = replicated(ranks, f"{prefix}.weight")
    if arch.spec.norm == "rms":
        return ops.rms_norm(x, weight, arch.eps)
    bias = replicated(ranks, f"{prefix}.bias") if arch.spec.norm_bias else None
    return ops.layer_norm(x, weight, bias, arch.eps)


def _embed(arch: Arch, ranks: Sequence[RankShard], ids: Array) -> Array:
    """Vocab-parallel token embedding summed over ranks, then positions / norm / multiplier."""
    name = arch.spec.embed
    if ids.min() < 0 or ids.max() >= arch.vocab:
        raise ValueError("input id outside the vocabulary")
    hidden = vocab_parallel_embedding(ranks, name, ids, arch.vocab)
    if arch.spec.wpe is not None:
        hidden = hidden + replicated(ranks, arch.spec.wpe)[np.arange(ids.shape[1])][None]
    if arch.spec.embed_norm is not None:
        hidden = _norm(arch, ranks, arch.spec.embed_norm, hidden)
    if arch.embedding_multiplier != 1.0:
        hidden = hidden * F32(arch.embedding_multiplier)
    return hidden.astype(F32)


def _lm_head(arch: Arch, ranks: Sequence[RankShard], x: Array) -> Array:
    """Vocab-parallel logits (with lm_head bias where the family has one), gathered."""
    name = arch.spec.lm_head or arch.spec.embed
    prefix = name.removesuffix(".weight")
    parts = [column(rank, prefix, x) for rank in ranks]
    logits = all_gather(parts, arch.vocab, name)
    if arch.logits_scaling != 1.0:
        logits = logits / F32(arch.logits_scaling)
    return logits.astype(F32)


def _layer(
    arch: Arch,
    ranks: Sequence[RankShard],
    layer: int,
    hidden: Array,
    rope: tuple[Array, Array] | None,
    expert_ranks: Sequence[RankShard],
) -> Array:
    """One decoder layer; a MoE's routed experts run on ``expert_ranks``."""
    spec, p = arch.spec, arch.spec.layer.format(layer)

    r = F32(arch.residual_multiplier)
    if spec.residual == "post":  # OLMo-2: norms on the branch outputs, no input norm
        h = hidden + _norm(arch, ranks, p + spec.norms[0], _attention(arch, ranks, p, hidden, rope))
        ff = _mlp(arch, ranks, expert_ranks, p, h)
        return (h + _norm(arch, ranks, p + spec.norms[1], ff)).astype(F32)
    attn = _attention(arch, ranks, p, _norm(arch, ranks, p + spec.norms[0], hidden), rope)
    if spec.residual == "sequential":
        h = hidden + attn * r
        ff = _mlp(arch, ranks, expert_ranks, p, _norm(arch, ranks, p + spec.norms[1], h))
        return (h + ff * r).astype(F32)
    # parallel: its own norm of the layer input; shared (phi): the attention's norm again
    x_mlp = _norm(arch, ranks, p + spec.norms[-1], hidden)
    return (hidden + attn + _mlp(arch, ranks, expert_ranks, p, x_mlp)).astype(F32)


# --------------------------------------------------------------------------- attention


def _project(arch: Arch, rank: RankShard, prefix: str, x: Array) -> tuple[Array, Array]:
    return conv_column(rank, prefix, x) if arch.spec.conv1d else column(rank, prefix, x)


def _decode_fused(arch: Arch, idx: Array) -> tuple[Array, Array]:
    """Global fused-qkv output rows -> (component 0/1/2 = q/k/v, feature within component)."""
    hd, heads, kv = arch.head_dim, arch.n_heads, arch.n_kv_heads
    layout = arch.spec.qkv
    if layout == "component":  # [all q | all k | all v]
        nq, nkv = heads * hd, kv * hd
        comp = np.where(idx < nq, 0, np.where(idx < nq + nkv, 1, 2))
        return comp, idx - np.array([0, nq, nq + nkv])[comp]
    if layout == "interleaved":  # head h: [q_h | k_h | v_h]
        head, within = idx // (3 * hd), idx % (3 * hd)
        return within // hd, head * hd + within % hd
    if layout == "mp_grouped":  # CodeGen: mp_num groups of [q_g | v_g | k_g], value first
        local = heads * hd // arch.mp_num
        g, within = idx // (3 * local), idx % (3 * local)
        comp = np.array([0, 2, 1])[within // local]
        return comp, g * local + within % local
    if layout == "grouped":  # kv group g: [q_{g*G} .. q_{g*G+G-1} | k_g | v_g]
        group = heads // kv
        g, within = idx // ((group + 2) * hd), idx % ((group + 2) * hd)
        slot, d = within // hd, within % hd
        comp = np.where(slot < group, 0, slot - group + 1)
        head = np.where(comp == 0, g * group + np.minimum(slot, group - 1), g)
        return comp, head * hd + d
    raise AssertionError(layout)


def _qkv_flat(arch: Arch, rank: RankShard, prefix: str, x: Array) -> list[tuple[Array, Array]]:
    """The rank's local q, k, v features ``[B, S, n]`` with their global feature indices."""
    if arch.spec.qkv == "separate":
        return [column(rank, f"{prefix}.{c}_proj", x) for c in "qkv"]
    y, idx = _project(arch, rank, f"{prefix}.{arch.spec.fused}", x)
    if arch.clip_qkv is not None:  # elementwise, so a rank clamps its own rows exactly
        y = np.clip(y, -F32(arch.clip_qkv), F32(arch.clip_qkv)).astype(F32)
    comp, feature = _decode_fused(arch, idx)
    return [(y[..., comp == c], feature[comp == c]) for c in range(3)]


def _full_width_norm(
    arch: Arch, ranks: Sequence[RankShard], name: str, parts: list[tuple[Array, Array]], width: int
) -> list[Array]:
    """OLMo-2 RMSNorm over the whole projection width, the sum of squares all-reduced."""
    sums = [(np.sum(y * y, axis=-1, keepdims=True).astype(F32), idx) for y, idx in parts]
    mean = all_reduce_distinct(sums, width, f"{name} sum of squares") / F32(width)
    scale = F32(1.0) / np.sqrt(mean + F32(arch.eps))
    out = []
    for rank, (y, idx) in zip(ranks, parts, strict=True):
        weight = rank.array(name)[positions(idx, rank.indices(name, 0), name)]
        out.append((y * scale * weight).astype(F32))
    return out


def _attention(
    arch: Arch,
    ranks: Sequence[RankShard],
    p: str,
    x: Array,
    rope: tuple[Array, Array] | None,
) -> Array:
    """Local heads per rank; the output projection's partials are all-reduced, bias added once."""
    prefix = p + arch.spec.attn
    hd = arch.head_dim
    flat = [_qkv_flat(arch, rank, prefix, x) for rank in ranks]
    if arch.spec.qk_norm:
        for c, width in ((0, arch.n_heads * hd), (1, arch.n_kv_heads * hd)):
            name = f"{prefix}.{'qk'[c]}_norm.weight"
            normed = _full_width_norm(arch, ranks, name, [f[c] for f in flat], width)
            for f, y in zip(flat, normed, strict=True):
                f[c] = (y, f[c][1])
    out_prefix = f"{prefix}.{arch.spec.out}"
    parts = []
    for rank, ((q, q_idx), (k, k_idx), (v, v_idx)) in zip(ranks, flat, strict=True):
        q, q_heads = split_heads(q, q_idx, hd, f"{prefix} q")
        k, k_heads = split_heads(k, k_idx, hd, f"{prefix} k")
        v, v_heads = split_heads(v, v_idx, hd, f"{prefix} v")
        v = v[:, positions(k_heads, v_heads, f"{prefix} v heads")]
        if arch.per_head_norm:  # HF StableLmLayerNormPerHead: each head its own LayerNorm
            q = _per_head_norm(arch, rank, f"{prefix}.q_layernorm", q, q_heads)
            k = _per_head_norm(arch, rank, f"{prefix}.k_layernorm", k, k_heads)
        if rope is not None:
            rotate = ops.apply_rope_every_two if arch.spec.rope == "every_two" else ops.apply_rope
            q, k = rotate(q, *rope), rotate(k, *rope)
        group = arch.n_heads // arch.n_kv_heads
        kv = positions(q_heads // group, k_heads, f"{prefix}: kv heads of the local q heads")
        bias = None
        if arch.spec.alibi:  # slopes of the GLOBAL head ids, times the key position
            seq = x.shape[1]
            slopes = alibi_slopes(arch.n_heads)[q_heads]
            bias = slopes[:, None, None] * np.arange(seq, dtype=F32)[None, None, :]
            bias = np.broadcast_to(bias, (len(q_heads), seq, seq))
        out = ops.attend(q, k[:, kv], v[:, kv], scaling=arch.scaling, bias=bias)
        batch, heads, seq, _ = out.shape
        features = (q_heads[:, None] * hd + np.arange(hd)).ravel()
        merged = out.transpose(0, 2, 1, 3).reshape(batch, seq, heads * hd)
        project = conv_row if arch.spec.conv1d else row
        parts.append((project(rank, out_prefix, merged, features), features))
    total = all_reduce(parts, arch.n_heads * hd, out_prefix)
    bias_out = replicated_optional(ranks, f"{out_prefix}.bias")
    return total if bias_out is None else (total + bias_out).astype(F32)


def _per_head_norm(arch: Arch, rank: RankShard, prefix: str, x: Array, heads: Array) -> Array:
    """LayerNorm (no bias) of each local head ``[B, h, S, d]`` with the weight of its global
    head id: the rank must hold whole ``norms.{h}`` of exactly its heads, no other's."""
    held = {int(m.group(1)) for name in rank.tensors
            if (m := re.fullmatch(re.escape(prefix) + r"\.norms\.(\d+)\.weight", name))}
    if held != set(heads.tolist()):
        raise ShardingError(f"{prefix}: rank holds the norms of heads {sorted(held)}, its "
                            f"heads are {sorted(heads.tolist())}")
    return np.stack([ops.layer_norm(x[:, i], rank.whole(f"{prefix}.norms.{h}.weight"), None,
                                    arch.eps) for i, h in enumerate(heads.tolist())], axis=1)


# --------------------------------------------------------------------------- feed-forward


def _mlp(
    arch: Arch, ranks: Sequence[RankShard], expert_ranks: Sequence[RankShard], p: str, x: Array
) -> Array:
    """The layer's feed-forward: DBRX's MoE (routed experts on ``expert_ranks``) or dense."""
    if arch.spec.moe == "dbrx":
        return _dbrx_moe(arch, ranks, expert_ranks, p, x)
    return _dense_mlp(arch, ranks, p, x)


def _dense_mlp(arch: Arch, ranks: Sequence[RankShard], p: str, x: Array) -> Array:
    """Plain ``down(act(up x))`` or gated ``down(act(gate x) * up x)``, intermediate-parallel."""
    names = [p + name for name in arch.spec.mlp]
    down = names[-1]
    parts = []
    for rank in ranks:
        if len(names) == 3:
            gate, gate_idx = column(rank, names[0], x)
            up, up_idx = column(rank, names[1], x)
            a, a_idx = arch.act(gate) * align(up, up_idx, gate_idx, names[1]), gate_idx
        else:
            up, a_idx = _project(arch, rank, names[0], x)
            a = arch.act(up)
        project = conv_row if arch.spec.conv1d else row
        parts.append((project(rank, down, a.astype(F32), a_idx), a_idx))
    out = all_reduce(parts, arch.intermediate, down)
    bias = replicated_optional(ranks, f"{down}.bias")
    return out if bias is None else (out + bias).astype(F32)


def _expert_block(rank: RankShard, name: str, expert: int, rows: int) -> tuple[Array, Array]:
    """The local rows of expert ``expert``'s block ``[expert * rows, (expert + 1) * rows)`` of a
    fused ``[E * rows, H]`` tensor, and their channels within the block."""
    sel = rank.selection(name)
    if sel is not None and sel.axis != 0:
        raise ShardingError(f"{name}: fused expert tensor sliced on axis {sel.axis}")
    global_rows = rank.indices(name, 0)
    keep = (global_rows >= expert * rows) & (global_rows < (expert + 1) * rows)
    return rank.array(name)[keep], global_rows[keep] - expert * rows


def _dbrx_expert_rank(
    arch: Arch, rank: RankShard, prefix: str, expert: int, x: Array
) -> tuple[Array, Array] | None:
    """One rank's partial ``(act(x w1_e^T) * x v1_e^T) w2_e`` over the channels it holds of
    expert ``expert`` (None: it holds none); w2 is used as ``x @ w2``, i.e. stored [in, out]."""
    inner = arch.intermediate
    w1, cw1 = _expert_block(rank, f"{prefix}.w1", expert, inner)
    v1, cv1 = _expert_block(rank, f"{prefix}.v1", expert, inner)
    w2, cw2 = _expert_block(rank, f"{prefix}.w2", expert, inner)
    if not (len(cw1) or len(cv1) or len(cw2)):
        return None
    gate = x @ w1.T
    up = align(x @ v1.T, cv1, cw1, f"{prefix}.v1 expert {expert}")
    if len(cw2) != len(cw1):
        raise ShardingError(f"{prefix}.w2 expert {expert}: {len(cw2)} channels, w1 {len(cw1)}")
    down = w2[positions(cw1, cw2, f"{prefix}.w2 expert {expert}")]
    return ((arch.act(gate) * up) @ down).astype(F32), cw1


def _dbrx_moe(
    arch: Arch,
    ranks: Sequence[RankShard],
    expert_ranks: Sequence[RankShard],
    p: str,
    x: Array,
) -> Array:
    """DBRX ``DbrxFFN``: the replicated router on ``ranks``; each routed expert's partials
    reduced over the ``expert_ranks`` holding channels of its block (TP: the same channels of
    every block; EP: whole blocks; redundant copies counted once), then weighted."""
    ffn = arch.config["ffn_config"]
    batch, seq, hidden = x.shape
    x2d = x.reshape(batch * seq, hidden)
    logits = x2d @ replicated(ranks, f"{p}ffn.router.layer.weight").T
    p_norm = ffn.get("moe_normalize_expert_weights")
    index, weight = ops.route_dbrx(
        logits, int(ffn["moe_top_k"]), None if p_norm is None else float(p_norm)
    )
    prefix = f"{p}ffn.experts.mlp"
    out = np.zeros_like(x2d)
    for expert in range(int(ffn["moe_num_experts"])):
        tokens, slot = np.nonzero(index == expert)
        if len(tokens) == 0:
            continue
        parts = []
        for rank in expert_ranks:
            if rank.has(f"{prefix}.w1"):
                part = _dbrx_expert_rank(arch, rank, prefix, expert, x2d[tokens])
                if part is not None:
                    parts.append(part)
        if not parts:
            raise ShardingError(f"no rank holds expert {expert} of {prefix}.w1")
        y = all_reduce_distinct(parts, arch.intermediate, f"{prefix}.w2 expert {expert}")
        out[tokens] += weight[tokens, slot][:, None] * y
    return out.reshape(batch, seq, hidden).astype(F32)
