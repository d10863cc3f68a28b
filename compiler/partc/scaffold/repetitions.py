"""`partc init`: which layer repetition is the decoder, and what lies around it.

Of several repetitions, the decoder (`_decoder_prefix`) and the encoders with their roots, group
names and config sections (`_encoders`); the projector between them (`_projector`); the static
roles of the modules outside the layers (`_static_roles`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.scaffold.config_values import _DIMENSION_NAME, _NESTED, _NOT_DIMENSION
from partc.scaffold.layer_table import _is_norm, _positional

_ENCODER_WIDTHS = ("hidden_size", "embed_dim", "intermediate_size")
"""Fields of an encoder's config section a literal dimension inside the tower is matched
against, and only these (a decoder width of the same size would be a coincidence): CLIP's
`hidden_size`, Qwen2-VL's `embed_dim` (its `hidden_size` is the merger's output width)."""


_ENCODER_HEADS = ("num_attention_heads", "num_heads")
"""An encoder's head count: CLIP's spelling, Qwen2-VL's."""


_ENCODER_COUNTS = ("num_hidden_layers", "depth", "num_layers")
"""An encoder's layer count: CLIP's spelling, Qwen2-VL's `depth`, others'."""


_TOWER_SUFFIXES = ("_tower", "_model", "_encoder", "_backbone")
"""Dropped from an encoder root's name for its group's name: `vision_tower` -> `vision`."""


@dataclass(slots=True)
class _Encoder:
    """A repetition other than the decoder's (a vision tower's layers)."""

    prefix: str
    """`vision_tower.encoder.layers`."""
    root: str
    """The module holding it and its other modules: `vision_tower`, Qwen2-VL's `visual`."""
    group: str
    """Its execution group: `vision`, `visual`."""
    section: str | None
    """Its config section (`vision_config`), if the config has one for it."""
    stem: str
    """The prefix of its config names (`vision_`), from the section's name."""
    by_layer: dict[int, dict[str, tuple[str, list[int]]]]
    modules: dict[str, dict[str, Any]]
    """Its modules outside the layers (embeddings, post norm, Qwen2-VL's merger)."""
    names: set[str]
    """The config names read from its section (`vision_hidden_size`)."""


def _decoder_prefix(layers: Mapping[str, object], modules: Mapping[str, object],
                    checkpoint: Path) -> str:
    """The repetition that is the decoder: the only one; of several, the one whose parent
    module holds the token embedding (`embed_tokens`, `wte`: LLaVA's `language_model.model`),
    else the one sharing the longest name prefix with the head (`lm_head`, `embed_out`)."""
    if len(layers) == 1:
        return next(iter(layers))
    leaf = {m: m.rsplit(".", 1)[-1] for m in modules}
    parents = {m.rpartition(".")[0] for m in modules if leaf[m] in ("embed_tokens", "wte")}
    beside = [p for p in sorted(layers) if p.rpartition(".")[0] in parents]
    if len(beside) == 1:
        return beside[0]
    heads = [m for m in modules if leaf[m] in ("lm_head", "embed_out")]
    candidates = beside or sorted(layers)
    near = {p: max((len(_common_parts([p, h])) for h in heads), default=0) for p in candidates}
    nearest = [p for p in candidates if near[p] == max(near.values())]
    if len(nearest) == 1 and near[nearest[0]] > 0:
        return nearest[0]
    raise LoadError(f"partc init found {len(layers)} layer repetitions in {checkpoint} "
                    f"({', '.join(sorted(layers))}) and cannot tell which is the decoder: none "
                    "alone sits beside the token embedding (`embed_tokens`, `wte`) or nearest "
                    "the head (`lm_head`); write the family from the scaffold of a checkpoint "
                    "holding the decoder's layers only, or start from a built-in one "
                    "(`partc families --copy llava`)", location=SourceLocation(str(checkpoint)))


def _common_parts(names: Sequence[str]) -> list[str]:
    """The dotted components every name starts with, each name keeping at least one more."""
    parts = [n.split(".") for n in names]
    count = 0
    while all(len(p) > count + 1 for p in parts) and len({p[count] for p in parts}) == 1:
        count += 1
    return parts[0][:count]


def _root_of(module: str, common: Sequence[str]) -> str:
    """The module a name lies under, one component past the repetitions' common prefix:
    `vision_tower` of `vision_tower.encoder.layers` beside `language_model.model.layers`."""
    parts = module.split(".")
    if parts[:len(common)] == list(common) and len(parts) > len(common):
        return ".".join(parts[:len(common) + 1])
    return parts[0]


def _under(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def _encoders(layers: Mapping[str, dict[int, dict[str, tuple[str, list[int]]]]], decoder: str,
              common: Sequence[str], modules: Mapping[str, dict[str, Any]],
              config: Mapping[str, Any], values: dict[str, int], sources: dict[str, str],
              checkpoint: Path) -> list[_Encoder]:
    """The repetitions other than the decoder's, in name order, with their roots, group
    names, config sections and modules; their config fields are added to `values` and
    `sources` under prefixed names (`vision_hidden_size` from `vision_config.hidden_size`)."""
    roots = {p: _root_of(p, common) for p in layers}
    if len(set(roots.values())) != len(roots):
        raise LoadError(f"partc init found layer repetitions in {checkpoint} that lie inside "
                        f"one another ({', '.join(sorted(layers))}): it cannot tell their "
                        "modules apart", location=SourceLocation(str(checkpoint)))
    others = [p for p in sorted(layers) if p != decoder]
    sections = [k for k in sorted(config) if k.endswith("_config") and k not in _NESTED
                and isinstance(config[k], Mapping)]
    taken = {"decoder", "projector"}
    out = []
    for prefix in others:
        root = roots[prefix]
        group = _group_name(root, taken)
        taken.add(group)
        section = _section(sections, group, root, alone=len(others) == 1)
        stem = re.sub(r"^(?=\d)", "_", re.sub(r"[^A-Za-z0-9_]", "_", (
            section.removesuffix("_config") if section else group)))[:64] + "_"
        names = set()
        known = (*_ENCODER_WIDTHS, *_ENCODER_HEADS, *_ENCODER_COUNTS)
        others = sorted(k for k in (config[section] if section else ()) if isinstance(k, str)
                        and k not in known and _DIMENSION_NAME.match(k)
                        and not _NOT_DIMENSION.search(k))  # CLIP's patch_size, num_channels
        for key in (*known, *others):
            value = config[section].get(key) if section else None
            if isinstance(value, int) and not isinstance(value, bool) and (
                    key in known or stem + key not in values):
                values[stem + key], sources[stem + key] = value, f"{section}.{key}"
                names.add(stem + key)
        out.append(_Encoder(prefix, root, group, section, stem, dict(layers[prefix]),
                            {m: p for m, p in modules.items() if _under(m, root)}, names))
    return out


def _group_name(root: str, taken: set[str]) -> str:
    """An encoder group's name from its root: `vision_tower` -> `vision`, `visual`."""
    leaf = root.rsplit(".", 1)[-1]
    for suffix in _TOWER_SUFFIXES:
        if leaf.endswith(suffix) and leaf != suffix:
            leaf = leaf.removesuffix(suffix)
            break
    name = re.sub(r"^(?=\d)", "_", re.sub(r"[^A-Za-z0-9_]", "_", leaf))[:64] or "encoder"
    base, number = name, 2
    while name in taken:
        name, number = f"{base}_{number}", number + 1
    return name


def _section(sections: Sequence[str], group: str, root: str, *, alone: bool) -> str | None:
    """An encoder's config section: the only one beside `text_config` for the only encoder,
    else the one whose name starts most like the group's or the root's (at least 3 letters:
    `vision_config` for `vision`), if exactly one does."""
    if alone and len(sections) == 1:
        return sections[0]
    names = (group, root.rsplit(".", 1)[-1])

    def shared(section: str) -> int:
        stem = section.removesuffix("_config")
        return max(next((i for i, (a, b) in enumerate(zip(stem, n, strict=False)) if a != b),
                        min(len(stem), len(n))) for n in names)

    scores = {s: shared(s) for s in sections}
    best = [s for s in sections if scores[s] == max(scores.values())]
    return best[0] if len(best) == 1 and scores[best[0]] >= 3 else None


def _projector(modules: Mapping[str, dict[str, Any]], roles: Mapping[str, str],
               decoder_root: str, common: Sequence[str]
               ) -> tuple[str, dict[str, dict[str, Any]]] | None:
    """The modules outside every repetition's root that are no decoder static role (LLaVA's
    `multi_modal_projector`), with their root, when they share one: the projector group."""
    rest = {m: p for m, p in modules.items() if m not in roles and not _under(m, decoder_root)}
    found = {_root_of(m, common) for m in rest}
    return (found.pop(), rest) if len(found) == 1 else None


def _static_roles(modules: Mapping[str, Any], prefix: str) -> dict[str, str]:
    """Which modules outside the layers are the embedding, the head and the final norm: at
    most one each (the one beside the layers when several could be); the others get none."""
    parent = prefix.rpartition(".")[0]

    def beside(module: str) -> tuple[bool, str]:
        return module.rpartition(".")[0] != parent, module

    leaf = {m: m.rsplit(".", 1)[-1] for m in modules}
    heads = sorted((m for m in modules if leaf[m] in ("lm_head", "embed_out")), key=beside)
    roles = {heads[0]: "output"} if heads else {}
    embeddings = sorted((m for m in modules if ("embed" in leaf[m] or leaf[m] == "wte")
                         and m not in roles and not _positional(leaf[m])
                         and not _is_norm(leaf[m])), key=beside)
    if embeddings:
        roles[embeddings[0]] = "embedding"
    norms = sorted((m for m in modules if _is_norm(leaf[m]) and m not in roles), key=beside)
    if norms:
        roles[norms[0]] = "final_norm"
    return roles
