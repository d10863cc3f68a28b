"""How `partc verify` shrinks a large config to a tiny model of the same structure.

A large config's size fields (heads, widths, layers, vocabulary, experts, positions, however
the config or the family spells them) are rewritten by SHRINK_RULES; a vision-language
config's `text_config` by the same rules, its `vision_config` by VISION_RULES and the
top-level fields tying them (image token ids, pooled image tokens) to match
(`reference_config`). Every change is one note.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from partc.verify.shrink_vision import shrunk_ties, shrunk_tower, vision_is_large

HEAD_DIM = 16
"""Head width of a shrunk model."""

LARGE = {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 512,
         "intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 16,
         "head_dim": 256, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
         "max_position_embeddings": 2**20, "num_experts": 64, "num_local_experts": 64,
         "n_routed_experts": 64, "q_lora_rank": 512, "kv_lora_rank": 512,
         "qk_nope_head_dim": 256, "qk_rope_head_dim": 256, "v_head_dim": 256,
         "mamba_n_heads": 256, "mamba_d_head": 256, "mamba_d_state": 256, "state_size": 256}
"""A config is shrunk when any of these fields exceeds its value; a tiny config is kept as is.
Beyond the five main sizes, a limit no real model's other sizes stay under alone: a tiny config
with one huge width (a 2^20 `head_dim`, 2^31 positions) is shrunk too."""
FAMILY_SIZE_LIMIT = 1024
"""A config field the family reads (an `int` field) still above this in the reference config
(the largest shrunk width: 64 heads of 16) is noted as kept at full size."""

@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """The largest topology a shrunk reference model must still compile at."""

    tensor_parallel_size: int = 1
    """The largest T checked."""
    pipeline_parallel_size: int = 1
    """The S of the pipeline check (1: none)."""


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token")


def _shrunk_heads(config: dict[str, Any], largest: Sizes) -> dict[str, Any]:
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    group = heads // kv if heads % kv == 0 else 1
    # at least 4 query heads when there are, and a KV head for each rank of the largest T
    # (the real config gives every rank one there: check --tp T compiled it)
    kv_small = min(kv, max(2, 4 // group, largest.tensor_parallel_size))
    heads_small = kv_small * min(group, 8)  # query heads per KV head kept (up to 8)
    out = {"num_attention_heads": heads_small, "hidden_size": heads_small * HEAD_DIM}
    if "num_key_value_heads" in config:
        out["num_key_value_heads"] = kv_small
    if "head_dim" in config:
        out["head_dim"] = HEAD_DIM
    rotary, width = config.get("rotary_dim"), config.get("hidden_size")
    if isinstance(rotary, int) and isinstance(width, int) and rotary > HEAD_DIM:
        # CodeGen's, GPT-J's partial rotary width: the same part of the narrower head (even)
        out["rotary_dim"] = max(2, rotary * HEAD_DIM * heads // width // 2 * 2)
    for name in ("rope_parameters", "rope_scaling"):
        rope = config.get(name)
        sections = rope.get("mrope_section") if isinstance(rope, dict) else None
        if sections is None and name == "rope_parameters" and isinstance(rope, dict) \
                and _reads_mrope(config.get("model_type")):
            sections = MROPE_DEFAULT
        if isinstance(rope, dict) and isinstance(sections, list):
            out[name] = {**rope, "mrope_section": _mrope_section(sections)}
    return out


MROPE_DEFAULT = [16, 24, 24]
"""The M-RoPE sections Qwen2-VL's and Qwen2.5-VL's rotary embeddings use when the config
gives none (`modeling_qwen2_vl.py`: `rope_parameters.get("mrope_section", [16, 24, 24])`)."""


def _reads_mrope(model_type: object) -> bool:
    """Whether the config class of `model_type` declares `mrope_section` among its rope keys
    (`ignore_keys_at_rope_validation`: Qwen2-VL's, Qwen2.5-VL's text configs)."""
    try:
        from transformers import CONFIG_MAPPING
        keys = getattr(CONFIG_MAPPING[str(model_type)], "ignore_keys_at_rope_validation", ())
    except (ImportError, KeyError, TypeError):
        return False
    return "mrope_section" in (keys or ())


def _mrope_section(parts: list[int]) -> list[int]:
    """Qwen2-VL's M-RoPE sections (temporal, height, width: half a head's width together)
    scaled to the shrunk head, each at least 1."""
    total, half = sum(parts) or 1, HEAD_DIM // 2
    small = [max(1, part * half // total) for part in parts]
    small[-1] += half - sum(small)
    return small


def _shrunk_mla(config: dict[str, Any], _: Sizes) -> dict[str, Any]:
    out: dict[str, Any] = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                           "v_head_dim": 16}
    if config.get("q_lora_rank") is not None:
        out["q_lora_rank"] = 32
    if "head_dim" in config:
        out["head_dim"] = 8  # DeepSeek's head_dim is the rope width
    return out


def _shrunk_experts(config: dict[str, Any], _: Sizes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _EXPERT_COUNTS:
        if (config.get(name) or 0) > 8:
            out[name] = 8
    for name in _EXPERTS_PER_TOKEN:
        if (config.get(name) or 0) > 2:
            out[name] = 2
    for name in ("n_group", "topk_group"):
        if config.get(name):
            out[name] = 1
    return out


def _shrunk_layers(config: dict[str, Any], largest: Sizes) -> dict[str, Any]:
    dense = min(config.get("first_k_dense_replace") or 0, 1)
    step = config.get("decoder_sparse_step") or 1
    layers = min(config["num_hidden_layers"], max(2, dense + 2, step + 1,
                                                  largest.pipeline_parallel_size))
    out: dict[str, Any] = {"num_hidden_layers": layers}
    if "first_k_dense_replace" in config:
        out["first_k_dense_replace"] = dense
    if isinstance(config.get("layer_types"), list):
        out["layer_types"] = config["layer_types"][:layers]
    if isinstance(config.get("attn_layer_indices"), list):  # Bamba: keep an attention layer
        kept = [u for u in config["attn_layer_indices"] if u < layers]
        out["attn_layer_indices"] = kept or ([layers - 1] if config["attn_layer_indices"]
                                             else [])
    if isinstance(config.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [u for u in config["mlp_only_layers"] if u < layers]
    if config.get("max_window_layers") is not None:
        out["max_window_layers"] = min(config["max_window_layers"], layers)
    if config.get("num_nextn_predict_layers"):
        out["num_nextn_predict_layers"] = 0  # transformers builds no MTP layer
    return out


def _shrunk_mamba2(config: dict[str, Any], _: Sizes) -> dict[str, Any]:
    """Mamba2 heads of 16 channels over the (shrunk) expand * hidden_size, the groups kept where
    they divide them, a state of at most 16."""
    inner = int(config.get("mamba_expand") or 2) * int(config["hidden_size"])
    heads = max(1, inner // HEAD_DIM)
    out: dict[str, Any] = {"mamba_n_heads": heads, "mamba_d_head": inner // heads,
                           "mamba_n_groups": math.gcd(int(config.get("mamba_n_groups") or 1),
                                                      heads)}
    if (config.get("mamba_d_state") or 0) > 16:
        out["mamba_d_state"] = 16
    return out


def _shrunk_widths(config: dict[str, Any], _: Sizes) -> dict[str, Any]:
    out: dict[str, Any] = {"vocab_size": 131}  # odd on purpose: balanced, uneven vocab split
    for name, small in (("intermediate_size", 128), ("moe_intermediate_size", 32),
                        ("shared_expert_intermediate_size", 32), ("mamba_d_state", 16),
                        ("state_size", 16)):
        if (config.get(name) or 0) > small:
            out[name] = small
    if (config.get("max_position_embeddings") or 0) > 128:
        out["max_position_embeddings"] = 128
    if (config.get("sliding_window") or 0) > 64:
        out["sliding_window"] = 64
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(name)
        if isinstance(value, int) and value >= 131 or isinstance(value, list):
            out[name] = None
    return out


SHRINK_RULES: tuple[tuple[str, Callable[[dict[str, Any]], bool],
                          Callable[[dict[str, Any], Sizes], dict[str, Any]]], ...] = (
    ("attention heads (query heads per KV head kept, a KV head per rank)",
     lambda c: bool(c.get("num_attention_heads")), _shrunk_heads),
    ("multi-head latent attention ranks", lambda c: "kv_lora_rank" in c, _shrunk_mla),
    ("Mamba2 heads (16 channels each over the shrunk width, groups that divide them)",
     lambda c: "mamba_n_heads" in c, _shrunk_mamba2),
    ("experts (at most 8, 2 per token, one routing group)",
     lambda c: any(n in c for n in _EXPERT_COUNTS), _shrunk_experts),
    ("layers (first dense layers and sparse steps kept, a layer per stage)",
     lambda c: bool(c.get("num_hidden_layers")), _shrunk_layers),
    ("vocabulary, feed-forward widths, positions", lambda c: True, _shrunk_widths),
)
"""The size fields a large config is shrunk on, in order: (what, applies, new values). A rule
sees the largest T and S the real config compiles at and keeps a unit for each of their ranks
(every partition unit count of the real families is at least the shrunk one, or the shrunk KV
heads and layers)."""


SHRINK_NAMES = ("rotary_dim", "sliding_window", "num_experts_per_tok", "experts_per_token",
                "n_group", "topk_group", "first_k_dense_replace", "mamba_n_groups",
                "max_window_layers", "num_nextn_predict_layers")
"""The usual names the shrink rules read or rewrite besides LARGE's."""

_SECTIONS = ("text_config", "vision_config")
"""The sections a vision-language config keeps its models' sizes in."""


def _composite(config: dict[str, Any]) -> bool:
    """Whether a config keeps its sizes in sections (a vision-language config)."""
    return any(isinstance(config.get(name), dict) for name in _SECTIONS)


def _exceeds(config: dict[str, Any]) -> bool:
    return any((config.get(name) or 0) > limit for name, limit in LARGE.items())


_UNMAPPED_NAMES = {"kv_n_heads": "num_key_value_heads", "moe_num_experts": "num_local_experts",
                   "moe_top_k": "num_experts_per_tok", "ffn_hidden_size": "moe_intermediate_size",
                   "n_inner": "intermediate_size"}
"""Size fields transformers reads under another name without an `attribute_map` entry, by the
usual name the shrink rules read: DBRX's sections (`attn_config`, `ffn_config`, mapped in
`DbrxConfig.__post_init__`) and GPT-2's, CodeGen's, GPT-J's `n_inner` (read by their MLPs)."""


def _attribute_map(model_type: object) -> dict[str, str]:
    """transformers' `attribute_map` of the config class of `model_type` (usual name -> the
    name the config spells it with: GPT-2's `n_embd` for `hidden_size`); empty when unknown."""
    try:
        from transformers import CONFIG_MAPPING
        return dict(CONFIG_MAPPING[str(model_type)].attribute_map)
    except (ImportError, KeyError, TypeError, AttributeError):
        return {}


FamilySizes = Mapping[str, tuple[str, ...]]
"""The `int` config fields a family reads: field name -> its dotted sources in config.json
(the first present one is read)."""


def family_sizes(fields: Iterable[Any]) -> dict[str, tuple[str, ...]]:
    """The `int` fields of a family's `config:` declarations (ConfigFieldDecl), as FamilySizes."""
    from partc.family.declaration import ConfigType

    return {f.name: tuple(f.sources) for f in fields if f.type is ConfigType.INT}


def _read_path(config: dict[str, Any], sources: Iterable[str]) -> tuple[str, ...] | None:
    """The key path of the first of a field's dotted sources present in the config."""
    for source in sources:
        path = tuple(source.split("."))
        if _get(config, path) is not None:
            return path
    return None


def _family_places(config: dict[str, Any], sizes: FamilySizes
                   ) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(usual name, key path) for each field the family reads under a name the shrink rules
    read (`LARGE`'s, `SHRINK_NAMES`) from another key of the config, outside the sections of a
    vision-language config (DBRX's `attn_config.kv_n_heads` read as `num_key_value_heads`)."""
    for name, sources in sorted(sizes.items()):
        path = _read_path(config, sources)
        if (name in LARGE or name in SHRINK_NAMES) and path is not None and path != (name,) \
                and path[0] not in _SECTIONS:
            yield name, path


def spellings(config: dict[str, Any], sizes: FamilySizes | None = None
              ) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Where a config spells each size field the shrink rules read by its usual name, when it
    spells it otherwise: usual name -> the key paths holding it (all of them are rewritten).

    Top-level names come from transformers' `attribute_map` of the config's own class
    (`n_embd`, `n_head`, `n_layer`; `d_model`, `n_heads`, `n_layers`, `max_seq_len`); a field of
    the config or of a section (a dict value that is not `text_config` or `vision_config`) from
    _UNMAPPED_NAMES; and from the family itself (`sizes`): a field it declares under a usual
    name and reads from another key (`hidden_size: {from: n_embd}`).
    A usual name the config also has at the top level is one more place rewritten.
    """
    places: dict[str, list[tuple[str, ...]]] = {}
    for usual, own in sorted(_attribute_map(config.get("model_type")).items()):
        if own in config and own != usual:
            places.setdefault(usual, []).append((own,))
    for own, usual in sorted(_UNMAPPED_NAMES.items()):
        if isinstance(config.get(own), int):
            places.setdefault(usual, []).append((own,))
    for section, value in sorted(config.items()):
        if isinstance(value, dict) and section not in _SECTIONS:
            for own, usual in sorted(_UNMAPPED_NAMES.items()):
                if own in value:
                    places.setdefault(usual, []).append((section, own))
    for usual, path in _family_places(config, sizes or {}):
        places.setdefault(usual, []).append(path)
    for usual, paths in places.items():
        if usual in config:
            paths.insert(0, (usual,))
    return {usual: tuple(dict.fromkeys(paths)) for usual, paths in sorted(places.items())}


def _get(config: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = config
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _usual_view(config: dict[str, Any],
                where: dict[str, tuple[tuple[str, ...], ...]]) -> dict[str, Any]:
    """The config with every size field also under its usual name (as `spellings` finds it)."""
    view = dict(config)
    for usual, paths in where.items():
        view[usual] = _get(config, paths[0])
    return view


def is_large(config: dict[str, Any], sizes: FamilySizes | None = None) -> bool:
    """Whether a config is shrunk before the reference model is built: one whose sizes, by
    their usual names or as the config spells them (`spellings`), exceed LARGE; a
    vision-language config when its `text_config` does or its `vision_config` is a large tower
    (`vision_is_large`); its top-level sizes are not its models' (PaliGemma's legacy
    `hidden_size`)."""
    if _composite(config):
        text, vision = config.get("text_config"), config.get("vision_config")
        return isinstance(text, dict) and is_large(text, _section_sizes(sizes, "text_config")) \
            or isinstance(vision, dict) and vision_is_large(vision)
    return _exceeds(_usual_view(config, spellings(config, sizes)))


def _section_sizes(sizes: FamilySizes | None, section: str) -> FamilySizes:
    """The family's fields read from inside a section, by their path in it."""
    prefix = f"{section}."
    return {name: tuple(s[len(prefix):] for s in sources if s.startswith(prefix))
            for name, sources in (sizes or {}).items()
            if any(s.startswith(prefix) for s in sources)}


def reference_config(config: dict[str, Any], *, tensor_parallel_size: int = 1,
                     pipeline_parallel_size: int = 1, keep_layers: bool = False,
                     sizes: FamilySizes | None = None) -> tuple[dict[str, Any], list[str]]:
    """The config of the reference model and one note per change made to it.

    Always: float32 weights, eager attention, no quantization. A large config (`is_large`) is
    shrunk by SHRINK_RULES to a tiny model of the same structure, which still compiles at the
    largest T (`tensor_parallel_size`) and S (`pipeline_parallel_size`) the config compiles at;
    a vision-language one section by section (`_shrunk_sections`).
    `keep_layers`: the shrunk model keeps the config's layers (the pipeline check's cut, given
    as unit counts, names them); only a multi-token-prediction layer, which transformers does
    not build, is dropped. `sizes`: the family's `int` fields, more spellings of the sizes
    (`spellings`); one still above FAMILY_SIZE_LIMIT afterwards is noted as kept at full size.
    """
    largest = Sizes(tensor_parallel_size=tensor_parallel_size,
                    pipeline_parallel_size=pipeline_parallel_size)
    out = {k: v for k, v in config.items() if k not in ("quantization_config", "quantization")}
    notes = [f"dropped {k}: the reference model is dense float32"
             for k in ("quantization_config", "quantization") if k in config]
    out["dtype"] = "float32"
    out.pop("torch_dtype", None)
    if is_large(config, sizes) and _composite(config):
        out = _shrunk_sections(out, largest, keep_layers, sizes, notes)
    elif is_large(config, sizes):
        out = _shrunk_text(out, largest, keep_layers, sizes, notes)
    notes.extend(kept_sizes(config, out, sizes or {}))
    return out, notes


def _shrunk_text(config: dict[str, Any], largest: Sizes, keep_layers: bool,
                 sizes: FamilySizes | None, notes: list[str],
                 prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """A text model's config shrunk by SHRINK_RULES (a note per rule that changed something,
    its fields named under `prefix`: the section it is in)."""
    out = dict(config)
    where = spellings(out, sizes)
    view = _usual_view(out, where)
    for what, applies, rule in SHRINK_RULES:
        if not applies(view):
            continue
        changes = {k: v for k, v in rule(view, largest).items() if view.get(k) != v}
        if keep_layers and rule is _shrunk_layers:
            notes.append(f"kept all {view['num_hidden_layers']} layers: the pipeline "
                         "check's stage units (--pp-layers) count them")
            changes = {k: v for k, v in changes.items() if k == "num_nextn_predict_layers"}
        if changes:
            notes.append(f"shrunk {what}: " + ", ".join(
                f"{'.'.join(prefix + path)} {_shown(view.get(k))} -> {_shown(v)}"
                for k, v in sorted(changes.items()) for path in where.get(k, ((k,),))))
            view.update(changes)
            for k, v in changes.items():
                for path in where.get(k, ((k,),)):
                    _put(out, path, v)
    return out


def _shown(value: Any) -> str:
    """A value as a note says it: a long list by its length."""
    return f"[{len(value)} entries]" if isinstance(value, list) and len(value) > 4 else str(value)


def _shrunk_sections(config: dict[str, Any], largest: Sizes, keep_layers: bool,
                     sizes: FamilySizes | None, notes: list[str]) -> dict[str, Any]:
    """A vision-language config shrunk: its `text_config` as a text model's, its
    `vision_config` as a vision tower (`shrunk_tower`), then the top-level fields tying them
    (`shrunk_ties`), a note for each."""
    out = dict(config)
    text = out.get("text_config")
    if isinstance(text, dict):
        out["text_config"] = text = _shrunk_text(
            text, largest, keep_layers, _section_sizes(sizes, "text_config"), notes,
            ("text_config",))
    hidden = text.get("hidden_size") if isinstance(text, dict) else None
    vision = out.get("vision_config")
    if isinstance(vision, dict):
        changes = shrunk_tower(vision, config, hidden if isinstance(hidden, int) else None,
                               tensor_parallel_size=largest.tensor_parallel_size,
                               pipeline_parallel_size=largest.pipeline_parallel_size,
                               keep_layers=keep_layers)
        layers = vision.get("num_hidden_layers", vision.get("depth"))
        if keep_layers and isinstance(layers, int):
            notes.append(f"kept all {layers} vision layers: the pipeline check's stage units "
                         "(--pp-layers) count them")
        _changed(notes, "vision tower (heads, widths, layers, image)", vision, changes,
                 "vision_config.")
        out["vision_config"] = vision = {**vision, **changes}
    vocab = text.get("vocab_size") if isinstance(text, dict) else None
    ties = shrunk_ties(out, vision if isinstance(vision, dict) else {},
                       vocab if isinstance(vocab, int) else None)
    _changed(notes, "image tokens (ids in the shrunk vocabulary, pooled tokens)", out, ties, "")
    out.update(ties)
    return out


def _changed(notes: list[str], what: str, before: dict[str, Any], changes: dict[str, Any],
             prefix: str) -> None:
    """One note on the `changes` made to a config (`before`), when there are any."""
    if changes:
        notes.append(f"shrunk {what}: " + ", ".join(
            f"{prefix}{k} {before.get(k)} -> {v}" for k, v in sorted(changes.items())))


def kept_sizes(config: dict[str, Any], reference: dict[str, Any],
               sizes: FamilySizes) -> list[str]:
    """The note on the fields the family reads (`sizes`) whose values in the reference config
    are still above FAMILY_SIZE_LIMIT (none: no note): no shrink rule knows them, so they are
    built at full size (the memory estimate then decides whether the model is built at all)."""
    found = []
    for name, sources in sorted(sizes.items()):
        path = _read_path(config, sources)
        value = None if path is None else _get(reference, path)
        if path is not None and isinstance(value, int) and not isinstance(value, bool) \
                and value > FAMILY_SIZE_LIMIT:
            spelled = ".".join(path)
            found.append(f"`{spelled}` {value}" + ("" if spelled == name else f" (`{name}`)"))
    return [f"kept at full size (no shrink rule rewrites them): {', '.join(found)}"] \
        if found else []


def _put(config: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set the field at a key path, copying the sections on the way (the caller's config is
    not changed)."""
    if len(path) == 1:
        config[path[0]] = value
        return
    section = dict(config[path[0]])
    _put(section, path[1:], value)
    config[path[0]] = section
