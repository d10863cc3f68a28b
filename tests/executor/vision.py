"""Vision-language forward passes (llava, qwen2_vl): vision tower -> projector -> decoder.

The model is one sequence of units: the vision layers that reach the projector ``0..U-1``
(llava: the ``vision_feature_layer`` ones; the tower's later layers never reach the logits and
run with the last vision unit, so that HF's ``vision_layer_outputs`` can still be checked), the
projector (llava's ``multi_modal_projector``, Qwen2-VL's ``visual.merger``: one unit) and the
decoder layers ``0..L-1``. A pipeline stage runs a contiguous slice of it (a :class:`Span`); what
crosses a cut is a dict of named tensors (see :func:`handoff_keys`), and a stage prefers what it
received (ids, image mask, grid, M-RoPE ids) over the model inputs it also sees.

Each rank computes with its own local tensors only and the results meet in the strict simulated
collectives of :mod:`.shard`: vision heads split (CLIP's separate q/k/v, Qwen2-VL's fused
``attn.qkv`` ``[q | k | v]`` by head ranges taken from each block), vision MLP and projector
column/row parallel, the patch embedding split on its output channels (all-gathered), or all of
it replicated on every rank. The decoder is :func:`.model.forward_tensor_parallel` with the
image features written into the image-token rows of the embedding and, for Qwen2-VL, M-RoPE
tables from :func:`mrope_position_ids` (computed from ``input_ids`` and ``image_grid_thw``).

Tensor names: the on-disk names of either layout (transformers 5.x ``vision_tower.*``, the
released ``vision_tower.vision_model.*``, or the in-memory ``model.language_model.*`` ones) are
mapped to one canonical spelling by :func:`canonical` before use.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import ops
from .model import forward_tensor_parallel
from .shard import (
    RankShard,
    ShardingError,
    all_gather,
    all_reduce,
    column,
    positions,
    replicated,
    replicated_optional,
    row,
    split_heads,
)

F32 = np.float32
Array = np.ndarray

SUPPORTED = {"llava", "qwen2_vl"}
Transfer = Callable[[int, dict[str, Array]], Mapping[str, Array]]

# Other spellings of the same tensors -> the canonical (transformers 5.x on-disk) names.
_RENAMES = (
    ("vision_tower.vision_model.", "vision_tower."),  # released llava-hf checkpoints
    ("language_model.model.", "model."),  # llava's decoder on disk
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # in-memory names
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.visual.", "visual."),
)


def canonical(name: str) -> str:
    """The canonical spelling of a tensor name (see the module docstring)."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def canonical_shard(rank: RankShard) -> RankShard:
    """The same rank with canonical tensor names (two names for one tensor are refused)."""
    tensors: dict[str, Array] = {}
    selections = {}
    for name, value in rank.tensors.items():
        new = canonical(name)
        if new in tensors:
            raise ShardingError(f"{name}: the rank holds {new} under two names")
        tensors[new] = value
        selections[new] = rank.selections.get(name)
    return RankShard(tensors, selections)


# --------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class VisionArch:
    """The config values of one vision-language model, normalised across llava and qwen2_vl."""

    model_type: str
    width: int  # vision hidden size (Qwen2-VL: embed_dim)
    heads: int
    head_dim: int
    n_vision: int  # every layer of the tower
    n_used: int  # the layers that reach the projector: the vision units
    intermediate: int
    eps: float
    act: Callable[[Array], Array]
    projector_act: Callable[[Array], Array]
    layer: str  # prefix of vision layer i, with "{}"
    names: Mapping[str, str]  # role -> canonical module name inside a vision layer
    drop_cls: bool
    image_token: int
    video_token: int | None
    merge: int  # Qwen2-VL spatial merge size (1 for llava)
    decoder: Mapping[str, Any]  # the text config, as model.py reads it
    n_decoder: int

    @property
    def n_units(self) -> int:
        """Vision layers, the projector and the decoder layers."""
        return self.n_used + 1 + self.n_decoder


_CLIP_NAMES = {
    "norm1": "layer_norm1", "norm2": "layer_norm2", "q": "self_attn.q_proj",
    "k": "self_attn.k_proj", "v": "self_attn.v_proj", "out": "self_attn.out_proj",
    "fc1": "mlp.fc1", "fc2": "mlp.fc2",
}
_QWEN_NAMES = {
    "norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "out": "attn.proj",
    "fc1": "mlp.fc1", "fc2": "mlp.fc2",
}


def describe(config: Mapping[str, Any]) -> VisionArch:
    """Normalise a llava or qwen2_vl config.json."""
    mt = config.get("model_type")
    if mt not in SUPPORTED:
        raise NotImplementedError(f"model_type {mt!r}")
    v = config["vision_config"]
    text = dict(config["text_config"])
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    if mt == "llava":
        layer = config.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise NotImplementedError("vision_feature_layer as a list of layers")
        n_vision = int(v["num_hidden_layers"])
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise NotImplementedError(f"vision_feature_select_strategy {strategy!r}")
        width, heads = int(v["hidden_size"]), int(v["num_attention_heads"])
        return VisionArch(
            model_type=mt, width=width, heads=heads, head_dim=width // heads, n_vision=n_vision,
            intermediate=int(v["intermediate_size"]), eps=float(v.get("layer_norm_eps", 1e-5)),
            act=ops.ACTIVATIONS[v.get("hidden_act", "quick_gelu")],
            projector_act=ops.ACTIVATIONS[config.get("projector_hidden_act", "gelu")],
            layer="vision_tower.encoder.layers.{}.", names=_CLIP_NAMES,
            n_used=_used_layers(layer, n_vision), drop_cls=strategy == "default",
            image_token=int(config["image_token_index"]), video_token=None, merge=1,
            decoder=text, n_decoder=int(text["num_hidden_layers"]),
        )
    if text.get("model_type") == "qwen2_vl_text":
        text["model_type"] = "qwen2"  # the same decoder layer; positions come from M-RoPE
    width, heads = int(v["embed_dim"]), int(v["num_heads"])
    n_vision = int(v["depth"])
    return VisionArch(
        model_type=mt, width=width, heads=heads, head_dim=width // heads, n_vision=n_vision,
        intermediate=int(width * float(v["mlp_ratio"])), eps=1e-6,
        act=ops.ACTIVATIONS[v.get("hidden_act", "quick_gelu")],
        projector_act=ops.gelu,  # the merger's nn.GELU()
        layer="visual.blocks.{}.", names=_QWEN_NAMES, n_used=n_vision, drop_cls=False,
        image_token=int(config["image_token_id"]), video_token=config.get("video_token_id"),
        merge=int(v.get("spatial_merge_size", 2)), decoder=text,
        n_decoder=int(text["num_hidden_layers"]),
    )


def _used_layers(feature_layer: int, n_vision: int) -> int:
    """HF ``hidden_states[k]`` is layer ``k - 1``'s output: the projector needs ``k`` layers."""
    used = feature_layer % (n_vision + 1)
    if used == 0:
        raise NotImplementedError("a projector reading the vision embeddings (no vision layer)")
    return used


# --------------------------------------------------------------------------- spans


@dataclass(frozen=True)
class Span:
    """The units one pipeline stage runs: vision layers, the projector (0 or 1 unit), decoder."""

    vision: range = range(0)
    projector: range = range(0)
    decoder: range = range(0)

    def bounds(self, arch: VisionArch) -> tuple[int, int]:
        """``[start, stop)`` in the unit sequence; the parts must be contiguous in it."""
        parts = [
            (self.vision, 0, arch.n_used),
            (self.projector, arch.n_used, 1),
            (self.decoder, arch.n_used + 1, arch.n_decoder),
        ]
        units: list[int] = []
        for rng, offset, size in parts:
            if rng.step != 1 or rng.start < 0 or rng.stop > size:
                raise ValueError(f"{self}: {rng} is not a part of range({size})")
            units += [offset + i for i in rng]
        if not units or units != list(range(units[0], units[-1] + 1)):
            raise ValueError(f"{self} is not a non-empty contiguous run of units")
        return units[0], units[-1] + 1


def full_span(arch: VisionArch) -> Span:
    """Every unit of the model."""
    return Span(range(arch.n_used), range(1), range(arch.n_decoder))


def split_units(arch: VisionArch, cuts: Sequence[int]) -> list[Span]:
    """Stage spans for cuts at unit positions ``cuts`` (a cut ``c`` falls before unit ``c``)."""
    bounds = [0, *cuts, arch.n_units]
    spans = []
    for start, stop in itertools.pairwise(bounds):
        if not 0 <= start < stop <= arch.n_units:
            raise ValueError(f"cuts {list(cuts)} do not split range({arch.n_units})")
        v, d0 = arch.n_used, arch.n_used + 1
        spans.append(Span(
            range(min(start, v), min(stop, v)),
            range(0, 1) if start <= v < stop else range(0),
            range(max(start, d0) - d0, max(stop, d0) - d0),
        ))
    return spans


def handoff_keys(arch: VisionArch, stop: int) -> tuple[str, ...]:
    """What crosses a cut before unit ``stop``: only what a later unit still needs.

    ``vision_hidden`` (the vision stream after the last vision unit run, [B, 1 + P, D] for
    llava, [N, D] for Qwen2-VL) up to the projector, with the request's ``input_ids`` [B, S]
    (int32), ``image_mask`` [B, S] (bool) and, for Qwen2-VL, ``image_grid_thw`` [images, 3]
    (int32); ``image_features`` [image tokens, H] and the same between the projector and decoder
    layer 0; ``hidden`` (the decoder's residual stream) inside the decoder, with Qwen2-VL's
    ``position_ids`` [3, B, S] (int32).
    """
    qwen = arch.model_type == "qwen2_vl"
    request = ("input_ids", "image_mask", *(("image_grid_thw",) if qwen else ()))
    if 0 < stop <= arch.n_used:
        return ("vision_hidden", *request)
    if stop == arch.n_used + 1:
        return ("image_features", *request)
    if arch.n_used + 1 < stop < arch.n_units:
        return ("hidden", *(("position_ids",) if qwen else ()))
    return ()


# --------------------------------------------------------------------------- results


@dataclass
class VisionLanguageResult:
    """What one stage (or the whole model) computed; lists follow the units it ran.

    Shapes follow ``reference.npz``: llava's vision stream [B, 1 + P, D], Qwen2-VL's [N, D];
    ``image_features`` [image tokens, H]; decoder streams [B, S, H]. ``outgoing`` is what the
    stage hands on (empty for the last stage); ``position_ids`` are Qwen2-VL's M-RoPE ids
    [3, B, S] when the stage ran decoder layers.
    """

    span: Span
    vision_layer_inputs: list[Array] = field(default_factory=list)
    vision_layer_outputs: list[Array] = field(default_factory=list)
    projector_input: Array | None = None
    image_features: Array | None = None
    position_ids: Array | None = None
    layer_inputs: list[Array] = field(default_factory=list)
    layer_outputs: list[Array] = field(default_factory=list)
    normed: Array | None = None
    logits: Array | None = None
    outgoing: dict[str, Array] = field(default_factory=dict)


@dataclass
class VisionLanguagePipelineResult:
    """Output of :func:`forward_vision_language_pipeline`.

    ``whole`` gathers every stage's streams in unit order; ``sent[c]`` / ``received[c]`` are the
    payloads before / after ``transfer`` at cut ``c``.
    """

    whole: VisionLanguageResult
    sent: list[dict[str, Array]]
    received: list[dict[str, Array]]
    stages: list[VisionLanguageResult]


# --------------------------------------------------------------------------- public API


def forward_vision_language(
    config: Mapping[str, Any],
    tensors: Mapping[str, Array],
    reference_inputs: Mapping[str, Array],
    *,
    position_ids: Array | None = None,
) -> VisionLanguageResult:
    """Full-weight forward: the tensor-parallel path on one rank holding everything whole.

    ``reference_inputs`` needs ``input_ids`` and ``pixel_values`` (and ``image_grid_thw`` for
    qwen2_vl); any other keys (a whole ``reference.npz``) are ignored. ``position_ids``
    overrides the computed M-RoPE ids.
    """
    rank = RankShard(dict(tensors), {name: None for name in tensors})
    return forward_vision_language_tensor_parallel(
        config, [rank], reference_inputs, position_ids=position_ids
    )


def forward_vision_language_tensor_parallel(
    config: Mapping[str, Any],
    ranks: Sequence[RankShard],
    reference_inputs: Mapping[str, Array],
    *,
    span: Span | None = None,
    received: Mapping[str, Array] | None = None,
    position_ids: Array | None = None,
) -> VisionLanguageResult:
    """Run the units of ``span`` (default: all) on the tensor-parallel ``ranks`` of one stage.

    ``received`` is what the previous stage handed on (it must hold :func:`handoff_keys` of the
    cut before ``span``); the result's ``outgoing`` holds the keys of the cut after it.
    """
    arch = describe(config)
    span = full_span(arch) if span is None else span
    start, stop = span.bounds(arch)
    if not ranks:
        raise ShardingError("no ranks")
    local = [canonical_shard(rank) for rank in ranks]
    state = dict(received or {})
    needed = handoff_keys(arch, start)
    missing = [key for key in needed if key not in state]
    if missing:
        raise ValueError(f"a stage starting at unit {start} needs {list(needed)}; missing "
                         f"{missing} (received {sorted(state)})")
    ids = np.asarray(state.get("input_ids", reference_inputs["input_ids"]))
    state.setdefault("input_ids", ids.astype(np.int32))
    state.setdefault("image_mask", ids == arch.image_token)
    if arch.model_type == "qwen2_vl":
        state.setdefault("image_grid_thw", np.asarray(reference_inputs["image_grid_thw"],
                                                      dtype=np.int32))
    result = VisionLanguageResult(span=span)
    if span.vision:
        _run_vision(arch, local, span.vision, reference_inputs, state, result)
    if span.projector:
        result.projector_input = _select(arch, np.asarray(state["vision_hidden"], dtype=F32))
        state["image_features"] = _project(arch, local, result.projector_input)
        result.image_features = state["image_features"]
    if span.decoder:
        _run_decoder(arch, local, span.decoder, state, result, position_ids)
    result.outgoing = {key: state[key] for key in handoff_keys(arch, stop)}
    return result


def forward_vision_language_pipeline(
    config: Mapping[str, Any],
    stages: Sequence[Sequence[RankShard]],
    spans: Sequence[Span],
    reference_inputs: Mapping[str, Array],
    transfer: Transfer = lambda cut, payload: payload,
    *,
    position_ids: Array | None = None,
) -> VisionLanguagePipelineResult:
    """Run pipeline ``stages`` (each a list of TP ranks) over consecutive ``spans``.

    At cut ``c`` the payload dict goes through ``transfer(c, payload)`` (e.g. the generated
    encode of stage ``c`` and decode of stage ``c + 1``); the next stage gets what it returns.
    """
    arch = describe(config)
    if len(stages) != len(spans) or not stages:
        raise ValueError("need one span per stage")
    expected = 0
    for span in spans:
        start, stop = span.bounds(arch)
        if start != expected:
            raise ValueError(f"stage spans {list(spans)} are not consecutive")
        expected = stop
    if expected != arch.n_units:
        raise ValueError(f"stage spans cover {expected} of {arch.n_units} units")
    sent: list[dict[str, Array]] = []
    got: list[dict[str, Array]] = []
    results: list[VisionLanguageResult] = []
    payload: dict[str, Array] | None = None
    for index, (ranks, span) in enumerate(zip(stages, spans, strict=True)):
        result = forward_vision_language_tensor_parallel(
            config, ranks, reference_inputs, span=span, received=payload,
            position_ids=position_ids,
        )
        results.append(result)
        if index < len(stages) - 1:
            sent.append(dict(result.outgoing))
            payload = {k: np.asarray(t) for k, t in transfer(index, dict(result.outgoing)).items()}
            got.append(payload)
    return VisionLanguagePipelineResult(_gather(results), sent, got, results)


def _gather(results: Sequence[VisionLanguageResult]) -> VisionLanguageResult:
    whole = VisionLanguageResult(span=Span())
    for r in results:
        whole.vision_layer_inputs += r.vision_layer_inputs
        whole.vision_layer_outputs += r.vision_layer_outputs
        whole.layer_inputs += r.layer_inputs
        whole.layer_outputs += r.layer_outputs
        for key in ("projector_input", "image_features", "position_ids", "normed", "logits"):
            if getattr(r, key) is not None:
                setattr(whole, key, getattr(r, key))
    return whole


# --------------------------------------------------------------------------- vision tower


def _run_vision(
    arch: VisionArch,
    ranks: Sequence[RankShard],
    units: range,
    inputs: Mapping[str, Array],
    state: dict[str, Array],
    result: VisionLanguageResult,
) -> None:
    """The vision units (and, with the last one, the tower's layers past the selected one)."""
    if units.start == 0:
        stream = _vision_embed(arch, ranks, inputs)
    else:
        stream = np.asarray(state["vision_hidden"], dtype=F32)
    rope = segments = None
    if arch.model_type == "qwen2_vl":
        grid = np.asarray(state["image_grid_thw"])
        rope = vision_rope(arch, grid)
        segments = np.repeat(np.arange(int(grid[:, 0].sum())), np.repeat(grid[:, 1] * grid[:, 2],
                                                                           grid[:, 0]))
        if len(segments) != stream.shape[0]:
            raise ValueError(f"image_grid_thw {grid.tolist()} gives {len(segments)} patches; the "
                             f"vision stream has {stream.shape[0]}")
    layers = list(units)
    if units.stop == arch.n_used:
        layers += range(arch.n_used, arch.n_vision)
    for layer in layers:
        result.vision_layer_inputs.append(stream)
        out = _vision_layer(arch, ranks, layer, stream, rope, segments)
        result.vision_layer_outputs.append(out)
        if layer < arch.n_used:
            state["vision_hidden"] = out
        stream = out


def _select(arch: VisionArch, stream: Array) -> Array:
    """The projector's input from the selected vision hidden state (llava drops CLS)."""
    return stream[:, 1:] if arch.drop_cls else stream


def _patch_embed(arch: VisionArch, ranks: Sequence[RankShard], patches: Array, name: str) -> Array:
    """Patch rows [..., C*(T)*p*p] times the conv kernel: output channels may be split."""
    parts = []
    for rank in ranks:
        sel = rank.selection(name)
        if sel is not None and sel.axis != 0:
            raise ShardingError(f"{name}: patch embedding sliced on axis {sel.axis}")
        kernel = rank.array(name)
        parts.append(((patches @ kernel.reshape(kernel.shape[0], -1).T).astype(F32),
                      rank.indices(name, 0)))
    return all_gather(parts, arch.width, name)


def _vision_embed(
    arch: VisionArch, ranks: Sequence[RankShard], inputs: Mapping[str, Array]
) -> Array:
    pixels = np.asarray(inputs["pixel_values"], dtype=F32)
    if arch.model_type == "qwen2_vl":  # one row per patch, (C, T, p, p) as Conv3d's kernel
        return _patch_embed(arch, ranks, pixels, "visual.patch_embed.proj.weight")
    name = "vision_tower.embeddings.patch_embedding.weight"
    batch, channels, height, width = pixels.shape
    p = int(ranks[0].tensors[name].shape[-1])
    grid = pixels.reshape(batch, channels, height // p, p, width // p, p)
    patches = grid.transpose(0, 2, 4, 1, 3, 5).reshape(batch, (height // p) * (width // p), -1)
    embeds = _patch_embed(arch, ranks, patches, name)
    cls = replicated(ranks, "vision_tower.embeddings.class_embedding")
    stream = np.concatenate([np.broadcast_to(cls, (batch, 1, arch.width)), embeds], axis=1)
    table = replicated(ranks, "vision_tower.embeddings.position_embedding.weight")
    if table.shape[0] != stream.shape[1]:
        raise ValueError(f"{stream.shape[1]} positions; the position table has {table.shape[0]}")
    stream = (stream + table[None]).astype(F32)
    return _layer_norm(arch, ranks, "vision_tower.pre_layrnorm", stream)


def _layer_norm(arch: VisionArch, ranks: Sequence[RankShard], prefix: str, x: Array) -> Array:
    return ops.layer_norm(x, replicated(ranks, f"{prefix}.weight"),
                          replicated(ranks, f"{prefix}.bias"), arch.eps)


def vision_rope(arch: VisionArch, grid_thw: Array) -> tuple[Array, Array]:
    """Qwen2-VL's 2-D vision rotary ``(cos, sin)`` [N, head_dim] in the processor's patch order.

    Positions (row, column) are laid out block-major over the ``merge x merge`` blocks, as the
    image processor orders the patch rows; half of the rotary features follow the row, half the
    column (HF ``get_vision_position_ids`` and ``Qwen2VLVisionRotaryEmbedding``).
    """
    m = arch.merge
    rows = []
    for t, h, w in np.asarray(grid_thw).tolist():
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // m, m, w // m, m)
        hpos = hpos.reshape(block).transpose(0, 2, 1, 3).ravel()
        wpos = wpos.reshape(block).transpose(0, 2, 1, 3).ravel()
        rows.append(np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)))
    pos = np.concatenate(rows).astype(F32)
    spatial = arch.head_dim // 2
    inv_freq = F32(1.0) / (F32(10000.0) ** (np.arange(0, spatial, 2, dtype=F32) / F32(spatial)))
    freqs = pos[..., None] * inv_freq  # [N, 2, spatial / 2]
    hw = np.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
    emb = np.concatenate([hw, hw], axis=-1)
    return np.cos(emb).astype(F32), np.sin(emb).astype(F32)


def _vision_layer(
    arch: VisionArch,
    ranks: Sequence[RankShard],
    layer: int,
    stream: Array,
    rope: tuple[Array, Array] | None,
    segments: Array | None,
) -> Array:
    p = arch.layer.format(layer)
    n = arch.names
    batched = stream if stream.ndim == 3 else stream[None]
    x = _layer_norm(arch, ranks, p + n["norm1"], batched)
    batched = batched + _vision_attention(arch, ranks, p, x, rope, segments)
    x = _layer_norm(arch, ranks, p + n["norm2"], batched)
    batched = (batched + _vision_mlp(arch, ranks, p, x)).astype(F32)
    return batched if stream.ndim == 3 else batched[0]


def _local_qkv(arch: VisionArch, rank: RankShard, p: str, x: Array) -> list[tuple[Array, Array]]:
    """The rank's q, k, v features with their global indices within each block."""
    n = arch.names
    if "qkv" not in n:
        return [column(rank, p + n[leaf], x) for leaf in ("q", "k", "v")]
    y, idx = column(rank, p + n["qkv"], x)  # [q | k | v], each heads x head_dim
    blocks = []
    for b in range(3):
        keep = (idx >= b * arch.width) & (idx < (b + 1) * arch.width)
        blocks.append((y[..., keep], idx[keep] - b * arch.width))
    return blocks


def _vision_attention(
    arch: VisionArch,
    ranks: Sequence[RankShard],
    p: str,
    x: Array,
    rope: tuple[Array, Array] | None,
    segments: Array | None,
) -> Array:
    """Bidirectional attention over the local heads; out-projection partials all-reduced."""
    out_name = p + arch.names["out"]
    where = p.rstrip(".")
    parts = []
    for rank in ranks:
        (q, q_idx), (k, k_idx), (v, v_idx) = _local_qkv(arch, rank, p, x)
        q, q_heads = split_heads(q, q_idx, arch.head_dim, f"{where} q")
        k, k_heads = split_heads(k, k_idx, arch.head_dim, f"{where} k")
        v, v_heads = split_heads(v, v_idx, arch.head_dim, f"{where} v")
        k = k[:, positions(q_heads, k_heads, f"{where}: k heads of the local q heads")]
        v = v[:, positions(q_heads, v_heads, f"{where}: v heads of the local q heads")]
        if rope is not None:
            q, k = ops.apply_rope(q, *rope), ops.apply_rope(k, *rope)
        scores = (q @ k.swapaxes(-1, -2)) * F32(arch.head_dim**-0.5)
        if segments is not None:
            scores = np.where(segments[:, None] == segments[None, :], scores, -np.inf)
        out = (ops.softmax(scores.astype(F32)) @ v).astype(F32)
        batch, heads, seq, hd = out.shape
        features = (q_heads[:, None] * hd + np.arange(hd)).ravel()
        merged = out.transpose(0, 2, 1, 3).reshape(batch, seq, heads * hd)
        parts.append((row(rank, out_name, merged, features), features))
    out = all_reduce(parts, arch.width, out_name)
    bias = replicated_optional(ranks, f"{out_name}.bias")
    return out if bias is None else (out + bias).astype(F32)


def _column_row(
    ranks: Sequence[RankShard],
    first: str,
    second: str,
    x: Array,
    act: Callable[[Array], Array],
    inner: int,
) -> Array:
    """``second(act(first(x)))``: column-parallel ``first``, row-parallel ``second``."""
    parts = []
    for rank in ranks:
        h, idx = column(rank, first, x)
        parts.append((row(rank, second, act(h), idx), idx))
    out = all_reduce(parts, inner, second)
    bias = replicated_optional(ranks, f"{second}.bias")
    return out if bias is None else (out + bias).astype(F32)


def _vision_mlp(arch: VisionArch, ranks: Sequence[RankShard], p: str, x: Array) -> Array:
    n = arch.names
    return _column_row(ranks, p + n["fc1"], p + n["fc2"], x, arch.act, arch.intermediate)


# --------------------------------------------------------------------------- projector


def _project(arch: VisionArch, ranks: Sequence[RankShard], features: Array) -> Array:
    """llava's two-layer projector, or Qwen2-VL's patch merger: ``image_features`` [N, H]."""
    features = np.asarray(features, dtype=F32)
    if arch.model_type == "llava":
        inner = int(arch.decoder["hidden_size"])  # linear_1: vision width -> decoder width
        out = _column_row(ranks, "multi_modal_projector.linear_1",
                          "multi_modal_projector.linear_2", features, arch.projector_act, inner)
        return out.reshape(-1, out.shape[-1])
    x = _layer_norm(arch, ranks, "visual.merger.ln_q", features)
    group = arch.merge * arch.merge
    if x.shape[0] % group:
        raise ValueError(f"{x.shape[0]} patches are not whole {arch.merge}x{arch.merge} groups")
    x = x.reshape(-1, group * arch.width)  # each run of merge*merge patch rows, concatenated
    return _column_row(ranks, "visual.merger.mlp.0", "visual.merger.mlp.2", x,
                       arch.projector_act, group * arch.width)


# --------------------------------------------------------------------------- decoder


def mrope_position_ids(
    config: Mapping[str, Any], input_ids: Array, image_grid_thw: Array | None
) -> tuple[Array, Array]:
    """Qwen2-VL's M-RoPE ids [3 (t, h, w), B, S] and ``rope_deltas`` [B, 1] (HF
    ``get_rope_index``): text runs count on; each image's tokens take its merged (t, h, w) grid
    offset by the running position, which then advances by ``max(h, w) / merge``."""
    return _mrope_ids(describe(config), input_ids, image_grid_thw)


def _mrope_ids(
    arch: VisionArch, input_ids: Array, image_grid_thw: Array | None
) -> tuple[Array, Array]:
    ids = np.asarray(input_ids)
    kinds = (ids == arch.image_token).astype(np.int64)
    if arch.video_token is not None and (ids == arch.video_token).any():
        raise NotImplementedError("video tokens")
    grids = iter(np.asarray(image_grid_thw).tolist() if image_grid_thw is not None else [])
    out = np.zeros((3, *ids.shape), dtype=np.int64)
    deltas = []
    for b in range(ids.shape[0]):
        pieces, current = [], 0
        for kind, run in itertools.groupby(kinds[b].tolist()):
            length = len(list(run))
            if kind == 0:
                pieces.append(np.broadcast_to(np.arange(length) + current, (3, length)))
                current += length
                continue
            try:
                t, h, w = next(grids)
            except StopIteration:
                raise ValueError("more image token runs than image_grid_thw rows") from None
            gh, gw = h // arch.merge, w // arch.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            grid = np.stack([tt, hh, ww]).reshape(3, -1) + current
            if grid.shape[1] != length:
                raise ValueError(f"an image of grid {[t, h, w]} has {grid.shape[1]} tokens; the "
                                 f"ids hold a run of {length}")
            pieces.append(grid)
            current += max(h, w) // arch.merge
        row_ids = np.concatenate(pieces, axis=1)
        out[:, b] = row_ids
        deltas.append(int(row_ids.max()) + 1 - ids.shape[1])
    return out, np.array(deltas, dtype=np.int64)[:, None]


def mrope_tables(text_config: Mapping[str, Any], position_ids: Array) -> tuple[Array, Array]:
    """``(cos, sin)`` [B, 1, S, head_dim]: frequency chunks of ``mrope_section`` take their
    angle from the t, h, w ids in turn (HF ``Qwen2VLRotaryEmbedding``)."""
    params = text_config.get("rope_parameters") or {}
    base = float(params.get("rope_theta", text_config.get("rope_theta", 10000.0)))
    hd = int(text_config.get("head_dim") or
             int(text_config["hidden_size"]) // int(text_config["num_attention_heads"]))
    section = list(params["mrope_section"])
    inv_freq = F32(1.0) / (F32(base) ** (np.arange(0, hd, 2, dtype=F32) / F32(hd)))
    if sum(section) != len(inv_freq):
        raise ValueError(f"mrope_section {section} does not sum to {len(inv_freq)} frequencies")
    freqs = np.asarray(position_ids).astype(F32)[..., None] * inv_freq  # [3, B, S, hd / 2]
    chunks = np.split(freqs, np.cumsum(section)[:-1], axis=-1)
    mixed = np.concatenate([chunk[i % 3] for i, chunk in enumerate(chunks)], axis=-1)
    emb = np.concatenate([mixed, mixed], axis=-1)[:, None]
    return np.cos(emb).astype(F32), np.sin(emb).astype(F32)


def _run_decoder(
    arch: VisionArch,
    ranks: Sequence[RankShard],
    layers: range,
    state: dict[str, Array],
    result: VisionLanguageResult,
    position_ids: Array | None,
) -> None:
    """Decoder ``layers``: embedding with the image rows (layer 0), M-RoPE (Qwen2-VL)."""
    ids = np.asarray(state["input_ids"]).astype(np.int64)
    if layers.start == 0:
        embedded = forward_tensor_parallel(arch.decoder, ranks, ids, layers=range(0, 0)).hidden
        hidden = merge_image_features(np.asarray(state["image_mask"]), embedded,
                                      state["image_features"])
    else:
        hidden = np.asarray(state["hidden"], dtype=F32)
    rope = None
    if arch.model_type == "qwen2_vl":
        if "position_ids" in state:
            position_ids = state["position_ids"]
        elif position_ids is None:
            position_ids, _ = _mrope_ids(arch, ids, state["image_grid_thw"])
        result.position_ids = np.asarray(position_ids).astype(np.int64)
        state["position_ids"] = result.position_ids.astype(np.int32)
        rope = mrope_tables(arch.decoder, result.position_ids)
    out = forward_tensor_parallel(arch.decoder, ranks, ids, layers=layers, hidden_in=hidden,
                                  rope=rope)
    result.layer_inputs, result.layer_outputs = out.layer_inputs, out.layer_outputs
    result.normed, result.logits = out.normed, out.logits
    state["hidden"] = out.hidden


def merge_image_features(mask: Array, embedded: Array, features: Array) -> Array:
    """The token embeddings with the ``mask`` rows (image tokens) replaced, in order, by
    ``features``."""
    mask = np.asarray(mask, dtype=bool)
    features = np.asarray(features, dtype=F32)
    if int(mask.sum()) != features.shape[0]:
        raise ValueError(f"{int(mask.sum())} image tokens in the ids; {features.shape[0]} image "
                         "feature rows")
    hidden = np.array(embedded, dtype=F32)
    hidden[mask] = features
    return hidden
