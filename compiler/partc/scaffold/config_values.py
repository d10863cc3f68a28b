"""`partc init`: the config fields the survey reads, and which may explain a dimension.

The config names the scaffold's expressions use, where each is read (the top level, `text_config`,
GPT-2's spellings, a block section), which of two differing values the decoder uses
(`_nested_choice`, `_header_matches`), why a guessed one is marked (`_values`), and the names a
literal dimension of the decoder is matched against (`_decoder_dimensions`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_DIMENSIONS = ("hidden_size", "intermediate_size", "vocab_size", "moe_intermediate_size",
               "shared_expert_intermediate_size")
"""The decoder's widths: the config names a literal dimension is matched against first
(`_decoder_dimensions`)."""


_EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
"""Config names an expert count is matched against."""


_HEADS = ("num_attention_heads", "num_key_value_heads", "head_dim")
"""Config names of the attention's head counts and head width a literal dimension is matched
against, after the widths (a per-head norm's [num_attention_heads, head_dim])."""


_DIMENSION_NAME = re.compile(
    r"^(?:num|n)_[a-z0-9_]+$|^[a-z0-9_]+_(?:size|dim|rank|heads|experts|channels|kernel"
    r"|embeddings|positions)$")


_NOT_DIMENSION = re.compile(
    r"(?:_ids?|_idx|_index|_layers?|_tok|_groups?|_replace|_freq|_steps?|_labels)$")
"""Which other integer config fields (DeepSeek's `q_lora_rank`, GPT-2's `n_positions`, CLIP's
`patch_size`, Mamba's `conv_kernel`) a literal dimension is matched against too, by name:
counts and sizes, not token ids, layer counts or routing settings. A dimension equal to one of
them and to a known name is ambiguous (marked), one equal to one of them only is written as
that field."""


_NESTED = ("text_config",)
"""Config sections whose fields are read (with `from:`) when the top level lacks them, or holds
them too (PaliGemma's legacy top-level `hidden_size`): then the value that matches the header
(`_nested_choice`)."""


_BLOCK_SECTIONS = ("attn_config", "ffn_config")
"""Config sections of the decoder's blocks (DBRX's `ffn_config.ffn_hidden_size`,
`moe_num_experts`): their fields named like a dimension are read (`_other_dimensions`) when
neither the top level nor `text_config` has one of that name."""


_ALIASES = {"hidden_size": ("n_embd", "d_model"), "num_attention_heads": ("n_head", "n_heads"),
            "num_hidden_layers": ("n_layer", "n_layers"), "intermediate_size": ("n_inner",)}
"""The names GPT-2, BLOOM, CodeGen and DBRX configs use instead (transformers' `attribute_map`),
read with `from:` when the config lacks the usual one."""


def _values(config: Mapping[str, Any], matches: Callable[[str, int], bool | None]
            ) -> tuple[dict[str, int], dict[str, str], dict[str, str]]:
    """The config names the scaffold's expressions use, with their defaults, where each is read
    (`hidden_size`, or `text_config.hidden_size` when only that section has it) and, by name,
    why a field read from a guess is marked CHECK. A field both the top level and
    `text_config` hold (PaliGemma's legacy top-level `hidden_size`) is read where its value
    `matches` the header's decoder, `text_config` when both do; when neither or both of two
    different values do (or the header cannot tell), `text_config`'s, marked."""
    sources: dict[str, str] = {}
    marked: dict[str, str] = {}

    def number(key: str, default: int | None = None) -> int | None:
        for name in (key, *_ALIASES.get(key, ())):
            found: list[tuple[str, int]] = [
                (where, section[name]) for where, section in (
                    ("", config), *((f"{n}.", config.get(n)) for n in _NESTED))
                if isinstance(section, Mapping) and name in section
                and isinstance(section[name], int) and not isinstance(section[name], bool)]
            if not found:
                continue
            where, value = found[0]
            if len(found) > 1:
                where, value = _nested_choice(key, name, found, matches, marked)
            sources[key] = where + name
            return value
        return default

    hidden, heads = number("hidden_size"), number("num_attention_heads")
    out = {"hidden_size": hidden, "num_attention_heads": heads,
           "num_key_value_heads": number("num_key_value_heads", heads),
           "intermediate_size": number("intermediate_size"),
           "num_hidden_layers": number("num_hidden_layers"), "vocab_size": number("vocab_size")}
    # transformers' default head width, unless the config spells head widths of its own
    # (MLA's v_head_dim, qk_nope_head_dim): `check` takes a missing head_dim beside those for
    # a misspelling of one, and the default's value is one of theirs by coincidence only
    others = any(isinstance(k, str) and k.endswith("head_dim") and k != "head_dim"
                 for section in (config, config.get("text_config")) if isinstance(section, Mapping)
                 for k in section)
    out["head_dim"] = number("head_dim", hidden // heads if hidden and heads and not others
                             else None)
    for key in (*_DIMENSIONS, *_EXPERT_COUNTS):
        out.setdefault(key, number(key))
    known = {*(k for k, v in out.items() if v is not None),
             *(a for names in _ALIASES.values() for a in names)}
    for key, (where, value) in _other_dimensions(config, known).items():
        out[key], sources[key] = value, where + key
    return {k: v for k, v in out.items() if v is not None}, sources, marked


def _other_dimensions(config: Mapping[str, Any], known: set[str]
                      ) -> dict[str, tuple[str, int]]:
    """The integer fields of the config's top level and `text_config` named like a dimension
    (`_DIMENSION_NAME`) that are not `known`, sorted, each with where it is read (`""` or
    `text_config.`); a field both hold with different values is left out (which the decoder
    uses, the scaffold does not try to tell for these)."""
    found: dict[str, list[tuple[str, int]]] = {}
    outer = [section for section in (config, *(config.get(n) for n in _NESTED))
             if isinstance(section, Mapping)]
    outer_keys = {k for section in outer for k in section}  # a block section's: after these
    for where, section in (("", config), *((f"{n}.", config.get(n)) for n in _NESTED),
                           *((f"{n}.", config.get(n)) for n in _BLOCK_SECTIONS)):
        if not isinstance(section, Mapping):
            continue
        for key, value in section.items():
            if isinstance(key, str) and isinstance(value, int) and not isinstance(value, bool) \
                    and key not in known and _DIMENSION_NAME.match(key) \
                    and (where.rstrip(".") not in _BLOCK_SECTIONS or key not in outer_keys) \
                    and not _NOT_DIMENSION.search(key):
                found.setdefault(key, []).append((where, value))
    return {key: places[-1] for key, places in sorted(found.items())
            if len({value for _, value in places}) == 1}


def _nested_choice(key: str, name: str, found: Sequence[tuple[str, int]],
                   matches: Callable[[str, int], bool | None], marked: dict[str, str]
                   ) -> tuple[str, int]:
    """Of a field the top level and `text_config` both hold, the one the decoder uses: the
    one whose value matches the header, else `text_config`'s (the decoder's section), marked
    in `marked` when the values differ and the header does not single one out."""
    (_, top), nested = found[0], found[-1]
    if top == nested[1]:
        return nested
    said = [matches(key, value) for _, value in found]
    if said.count(True) == 1:
        return found[said.index(True)]
    why = ("both match the decoder's shapes in the header" if True in said else
           "neither matches the decoder's shapes in the header" if all(
               s is False for s in said) else "the header does not tell which the decoder uses")
    marked[key] = (f"the config's top level has {name} = {top} and {nested[0]}{name} = "
                   f"{nested[1]}; {why}: read {nested[0].rstrip('.')}'s (the decoder's section "
                   "in vision-language configs); write the one the decoder uses")
    return nested


def _header_matches(by_layer: Mapping[int, Mapping[str, tuple[str, list[int]]]],
                    modules: Mapping[str, Mapping[str, tuple[str, list[int]]]],
                    roles: Mapping[str, str]) -> Callable[[str, int], bool | None]:
    """Whether a config value of a decoder field agrees with the decoder's tensors in the
    header (None: they do not say): `hidden_size` and `vocab_size` with the token embedding's
    (or head's) [rows, width], `num_hidden_layers` with the layer count, another dimension
    with some axis of a decoder layer's tensors or its embedding, norm and head."""
    tables = [modules[m]["weight"][1] for m, role in roles.items()
              if role in ("embedding", "output") and len(modules[m].get("weight", ("", []))[1])
              == 2]
    axes = {n for tensors in by_layer.values() for _, shape in tensors.values() for n in shape}
    axes |= {n for m in roles for _, shape in modules[m].values() for n in shape}

    def matches(key: str, value: int) -> bool | None:
        if key == "num_hidden_layers":
            return value == len(by_layer)
        if key in ("hidden_size", "vocab_size"):
            if not tables:
                return value in axes if key == "hidden_size" else None
            return any(shape[key == "hidden_size"] == value for shape in tables)
        if key in (*_DIMENSIONS, "head_dim"):
            return value in axes
        return None

    return matches


def _decoder_dimensions(values: Mapping[str, int], sources: Mapping[str, str],
                        encoders: set[str]) -> tuple[str, ...]:
    """The config names a literal dimension of the decoder is matched against, in this order:
    its widths, head counts and head width, expert counts, then the config's other fields
    named like a dimension (`_other_dimensions`); not `num_key_value_heads` when the config
    lacks it (then it is the head count by default, no field of its own), nor an encoder's."""
    known = (*_DIMENSIONS, *_HEADS, *_EXPERT_COUNTS)
    return (*(n for n in known if n in values and (
        n != "num_key_value_heads" or n in sources)),
        *sorted(n for n in values if n not in known and n not in encoders
                and n != "num_hidden_layers"))
