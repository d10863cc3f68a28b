"""`partc init`, first half: a checkpoint header and its config.json read into a `Survey`.

The survey is what the scaffold knows before it writes a line: the tensors grouped into layer
repetitions and modules (`_layer_table`), which repetition is the decoder and which are encoders
(`_decoder_prefix`, `_encoders`), the modules outside the layers and their static roles
(`_static_roles`), the projector between them (`_projector`), and the config fields that may
explain a dimension, with where each is read and why a guessed one is marked (`_values`).
`partc.scaffold.family_text` writes the family from it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.family.expr import MAX_TEXT_LENGTH
from partc.front.load import MAX_CONFIG_BYTES, decode_text, parse_json, read_bytes
from partc.front.schema import IDENTIFIER
from partc.parallel.placements import TORCH_DTYPE_NAMES
from partc.runtime.checkpoint import open_checkpoint
from partc.scaffold.dense_twin import Quantized, dense_header
from partc.scaffold.mtp_survey import split_mtp

Signature = tuple[str, list[int]]
"""A tensor's (dtype, shape) in the header."""


@dataclass(slots=True, kw_only=True)
class Survey:
    """What a checkpoint and its config hold, as the scaffold reads them."""

    checkpoint: Path
    """The checkpoint read (its name is said in the scaffold's first line)."""
    config: dict[str, Any]
    """The config.json object."""
    tensor_count: int
    """How many tensors the header lists."""
    model_type: str
    """The config's `model_type` (`unknown` when it has none)."""
    family: str
    """The family's name: the one asked for, else the model type as an identifier."""
    default_dtype: str
    """The dtype of the config's `torch_dtype` (F32 when it names none partc knows)."""
    layers: dict[str, dict[int, dict[str, Signature]]]
    """Every layer repetition by prefix: its layers by number, their tensors by relative name."""
    prefix: str
    """The decoder's repetition (`model.layers`)."""
    encoders: list[_Encoder]
    """The other repetitions (a vision tower's), in name order."""
    decoder_modules: dict[str, dict[str, Any]]
    """The decoder's modules outside its layers (the projector's taken out), by name."""
    roles: dict[str, str]
    """Static roles of those modules: `embedding`, `output`, `final_norm`."""
    projector: tuple[str, dict[str, dict[str, Any]]] | None
    """The projector's root and modules, when the checkpoint has encoders and one."""
    loose: dict[str, Signature]
    """Tensors of no module (LLaVA-NeXT's `image_newline`)."""
    values: dict[str, int]
    """Config values by the names the scaffold's expressions use (encoders' prefixed)."""
    sources: dict[str, str]
    """Where each of `values` is read (`text_config.hidden_size`)."""
    marked: dict[str, str]
    """Why a field read from a guess is marked CHECK, by name."""
    dimensions: tuple[str, ...]
    """The config names a literal dimension of the decoder is matched against, in order."""
    mtp: dict[int, dict[str, Signature]]
    """The MTP layers taken out of the decoder's repetition (`mtp_survey.split_mtp`), by i."""
    quantized: Quantized | None = None
    """The linear format the checkpoint stores its weights in (`layers` hold them dense)."""

    @property
    def by_layer(self) -> dict[int, dict[str, Signature]]:
        """The decoder's layers."""
        return self.layers[self.prefix]


def survey_checkpoint(checkpoint: Path, config_path: Path, *, name: str | None = None
                      ) -> Survey:
    """Read the checkpoint's header and config into a `Survey` (LoadError when the header has
    no layer repetition, or several and none is recognisably the decoder's)."""
    config = _read_config(config_path)
    opened = open_checkpoint(checkpoint)
    header: dict[str, Signature] = {}
    for tensor in opened.names:
        found = opened.signature(tensor)
        assert found is not None
        header[_literal(tensor, checkpoint)] = (found[1], list(found[2]))
        module, _, param = tensor.rpartition(".")
        if "" in tensor.split("."):
            raise LoadError(f"tensor `{ascii(tensor)[1:-1]}` of {checkpoint} has an empty "
                            "dotted part (a leading, trailing or doubled `.`); partc init "
                            "splits names into modules at dots",
                            location=SourceLocation(str(checkpoint)))
        if module and not re.fullmatch(IDENTIFIER, param):
            raise LoadError(f"tensor `{ascii(tensor)[1:-1]}` of {checkpoint} is parameter "
                            f"`{ascii(param)[1:-1]}` of module `{ascii(module)[1:-1]}`; a "
                            "family names a module's parameters by identifiers (letters, digits "
                            "and `_`, not starting with a digit)",
                            location=SourceLocation(str(checkpoint)))
        for number in _NUMBERED.finditer(tensor):
            if not re.fullmatch(r"0|[1-9][0-9]*", number[1]):
                raise LoadError(f"tensor `{ascii(tensor)[1:-1]}` of {checkpoint} numbers a "
                                f"repetition `{ascii(number[1])[1:-1]}`; expected ASCII "
                                "digits without a leading zero (as a family's `{unit}` and "
                                "`{expert}` are written)",
                                location=SourceLocation(str(checkpoint)))
    model_type = str(config.get("model_type") or "unknown")
    family = name or re.sub(r"^(?=\d)", "_", re.sub(r"[^A-Za-z0-9_]", "_", model_type))[:128]
    torch_dtype = config.get("torch_dtype") or config.get("dtype")
    default = TORCH_DTYPE_NAMES.get(str(torch_dtype)) if torch_dtype else None
    stored = len(header)
    header, quantized = dense_header(header, config, default or "F32")  # as the family declares
    layers: dict[str, dict[int, dict[str, Signature]]] = {}
    outside: dict[str, Signature] = {}
    for tensor, signature in header.items():
        match = _LAYER.match(tensor)
        if match:
            layers.setdefault(match["prefix"], {}).setdefault(int(match["n"]), {})[
                match["rest"]] = signature
        else:
            outside[tensor] = signature
    if not layers:
        raise LoadError("partc init recognises layer repetitions `<prefix>.layers.<n>.` (or "
                        f"`.h.<n>.`, `.blocks.<n>.`); {checkpoint} has none",
                        location=SourceLocation(str(checkpoint)))
    if len(outside) > MAX_OUTSIDE:
        raise LoadError(f"partc init found {len(outside)} tensors outside the layer "
                        f"repetitions in {checkpoint}; it writes at most {MAX_OUTSIDE} (each is "
                        "a group of the family): is this a model checkpoint?",
                        location=SourceLocation(str(checkpoint)))
    modules = _modules(outside)
    loose = modules.pop("", {})  # tensors of no module (LLaVA-NeXT's `image_newline`)
    prefix = _decoder_prefix(layers, modules, checkpoint)
    common = _common_parts(sorted(layers))
    by_layer = layers[prefix]
    mtp = split_mtp(config, by_layer)
    roots = {_root_of(p, common) for p in layers if p != prefix}  # the encoders' (_encoders)
    decoder_modules = {m: p for m, p in modules.items()
                       if not any(_under(m, root) for root in roots)}
    roles = _static_roles(decoder_modules, prefix)
    values, sources, marked = _values(config, _header_matches(by_layer, decoder_modules, roles))
    encoders = _encoders(layers, prefix, common, modules, config, values, sources, checkpoint)
    dimensions = _decoder_dimensions(values, sources, {n for e in encoders for n in e.names})
    projector = _projector(decoder_modules, roles, _root_of(prefix, common), common) \
        if encoders else None
    if projector is not None:
        decoder_modules = {m: p for m, p in decoder_modules.items() if m not in projector[1]}
    return Survey(checkpoint=checkpoint, config=config, tensor_count=stored,
                  model_type=model_type, family=family, default_dtype=default or "F32",
                  layers=layers, prefix=prefix, encoders=encoders,
                  decoder_modules=decoder_modules, roles=roles, projector=projector,
                  loose=loose, values=values, sources=sources, marked=marked,
                  dimensions=dimensions, mtp=mtp, quantized=quantized)


_LAYER = re.compile(r"^(?P<prefix>(?:.*?\.)??(?:layers|h|blocks))\.(?P<n>0|[1-9][0-9]*)\."
                    r"(?P<rest>.+)$", re.DOTALL)
"""A tensor of a layer repetition: `model.layers.3.`, GPT-2/BLOOM/Falcon's `transformer.h.3.`, or
Qwen2-VL's vision `visual.blocks.3.` (the first such name from the left, so a `blocks.<n>` inside
a layer stays part of that layer). The number is written as a unit's number expands (ASCII
digits, no leading zero; `_NUMBERED` refuses others)."""


_NUMBERED = re.compile(r"(?:^|\.)(?:layers|h|blocks|experts)\.(\d+)\.")
"""A repetition's number in a tensor name, any decimal digits (refused unless as `_LAYER` and
`_EXPERT` read them)."""

MAX_OUTSIDE = 1024
"""The most tensors outside the layer repetitions `partc init` writes groups for (real
checkpoints hold a few hundred at most; each is written as a group of ~300 bytes, and a family
file holds at most `MAX_DOCUMENT_BYTES`)."""

MAX_NAME = MAX_TEXT_LENGTH - 64
"""The longest tensor name (its braces doubled) `partc init` writes: a family template holds at
most `MAX_TEXT_LENGTH` characters, and the scaffold adds `{unit}` and a group label to it."""


def _literal(tensor: str, checkpoint: Path) -> str:
    """The tensor's name as template text: `{` and `}` doubled (the family's templates read
    `{...}` as a field, `{{` as a literal brace); LoadError when it is too long to be one."""
    text = tensor.replace("{", "{{").replace("}", "}}")
    if len(text) > MAX_NAME:
        raise LoadError(f"tensor `{ascii(tensor[:80])[1:-1]}...` of {checkpoint} has a name of "
                        f"{len(tensor)} characters ({len(text)} as a family template, braces "
                        f"doubled); partc init writes names of at most {MAX_NAME}",
                        location=SourceLocation(str(checkpoint)))
    return text


_EXPERT = re.compile(r"^(?P<pre>(?:.*\.)?experts)\.(?P<e>0|[1-9][0-9]*)\.(?P<rest>.+)$",
                     re.DOTALL)


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


_ATTENTION = {  # projection -> (sharding, heads, rows, cols) in config names
    "q_proj": ("column", "num_attention_heads", "num_attention_heads * head_dim", "hidden_size"),
    "k_proj": ("column", "num_key_value_heads", "num_key_value_heads * head_dim", "hidden_size"),
    "v_proj": ("column", "num_key_value_heads", "num_key_value_heads * head_dim", "hidden_size"),
    "o_proj": ("row", "num_attention_heads", "hidden_size", "num_attention_heads * head_dim"),
}


_MLP = {
    "gate_proj": ("column", "intermediate_size", "hidden_size"),
    "up_proj": ("column", "intermediate_size", "hidden_size"),
    "down_proj": ("row", "hidden_size", "intermediate_size"),
}


_PACKED = frozenset({"scales", "biases", "qweight", "qzeros", "g_idx"})
"""Params of a packed quantized linear (MLX's `scales`/`biases`, GPTQ/AWQ's): its columns are
not the matrix's, so the scaffold cannot split it by heads as a dense one."""


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



@dataclass(slots=True)
class _Module:
    """One module of the repeated layer: its params, the layers holding it and, for a module
    of every routed expert (`{expert}` in its name), the number of experts."""

    params: dict[str, tuple[str, list[int]]]
    layers: set[int]
    experts: int | None
    differs: list[int]
    """Layers where the module has other params, shapes or expert counts than in the first."""



def _modules(tensors: Mapping[str, tuple[str, list[int]]]) -> dict[str, dict[str, Any]]:
    """Tensors grouped by module: `a.b.weight` -> module `a.b`, param `weight`."""
    out: dict[str, dict[str, Any]] = {}
    for name, signature in tensors.items():
        module, _, param = name.rpartition(".")
        out.setdefault(module, {})[param] = signature
    return out



def _layer_modules(tensors: Mapping[str, tuple[str, list[int]]]
                   ) -> dict[str, tuple[dict[str, Any], int | None]]:
    """The modules of one layer; the modules of routed experts 0..E-1 with equal params are
    one `...experts.{expert}...` module with E experts."""
    out: dict[str, tuple[dict[str, Any], int | None]] = {}
    repeated: dict[str, dict[int, dict[str, Any]]] = {}
    for module, params in _modules(tensors).items():
        match = _EXPERT.match(module)
        if match:
            template = f"{match['pre']}.{{expert}}.{match['rest']}"
            repeated.setdefault(template, {})[int(match["e"])] = params
        else:
            out[module] = (params, None)
    for template, experts in repeated.items():
        first = experts[min(experts)]
        if sorted(experts) == list(range(len(experts))) and all(
                p == first for p in experts.values()):
            out[template] = (first, len(experts))
        else:
            for number, params in experts.items():
                out[template.replace("{expert}", str(number))] = (params, None)
    return out



def _layer_table(by_layer: Mapping[int, Mapping[str, tuple[str, list[int]]]]
                 ) -> dict[str, _Module]:
    """Every module of any layer, with the layers that hold it."""
    table: dict[str, _Module] = {}
    for number in sorted(by_layer):
        for module, (params, experts) in _layer_modules(by_layer[number]).items():
            entry = table.get(module)
            if entry is None:
                table[module] = _Module(params, {number}, experts, [])
            else:
                entry.layers.add(number)
                if (entry.params, entry.experts) != (params, experts):
                    entry.differs.append(number)
    return table



def _read_config(path: Path) -> dict[str, Any]:
    raw = read_bytes(path, "config.json", MAX_CONFIG_BYTES)
    document = parse_json(str(path), decode_text(raw, str(path), "config.json"), "config.json")
    if not isinstance(document.data, dict):
        raise LoadError(f"{path} is not a JSON object", location=SourceLocation(str(path)))
    return document.data



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



def _is_norm(leaf: str) -> bool:
    """A normalisation module's name: `norm`, `input_layernorm`, GPT-2's `ln_1`, `ln_f`."""
    return "norm" in leaf or leaf.startswith("ln_")



def _positional(leaf: str) -> bool:
    """A learned position embedding's name: GPT-2's `wpe`, `embed_positions`."""
    return leaf == "wpe" or "position" in leaf
