"""`partc init`, first half: a checkpoint header and its config.json read into a `Survey`.

The survey is what the scaffold knows before it writes a line: the tensors grouped into layer
repetitions and modules (`partc.scaffold.layer_table`), which repetition is the decoder and which
are encoders, the modules outside the layers and their static roles, the projector between them
(`partc.scaffold.repetitions`), and the config fields that may explain a dimension, with where
each is read and why a guessed one is marked (`partc.scaffold.config_values`).
`partc.scaffold.family_text` writes the family from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.family.expr import MAX_TEXT_LENGTH
from partc.front.load import MAX_CONFIG_BYTES, decode_text, parse_json, read_bytes
from partc.front.schema import IDENTIFIER
from partc.parallel.placements import TORCH_DTYPE_NAMES
from partc.runtime.checkpoint import open_checkpoint
from partc.scaffold.config_values import _decoder_dimensions, _header_matches, _values
from partc.scaffold.dense_twin import Quantized, Signature, dense_header
from partc.scaffold.layer_table import _modules
from partc.scaffold.mtp_survey import split_mtp
from partc.scaffold.repetitions import (
    _common_parts,
    _decoder_prefix,
    _Encoder,
    _encoders,
    _projector,
    _root_of,
    _static_roles,
    _under,
)


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


def _read_config(path: Path) -> dict[str, Any]:
    raw = read_bytes(path, "config.json", MAX_CONFIG_BYTES)
    document = parse_json(str(path), decode_text(raw, str(path), "config.json"), "config.json")
    if not isinstance(document.data, dict):
        raise LoadError(f"{path} is not a JSON object", location=SourceLocation(str(path)))
    return document.data
