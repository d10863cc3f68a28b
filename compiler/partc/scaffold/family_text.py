"""`partc init`, second half: the family text written from a `Survey` of the checkpoint.

It recognises the layer repetition (`<prefix>.layers.<n>.`, GPT-2's `<prefix>.h.<n>.`, a vision
tower's `<prefix>.blocks.<n>.`), the common Llama-style projection names (q/k/v/o,
gate/up/down, also of shared and routed experts), expert repetition (`experts.<e>.`), norms
(`ln_1` too), the token embedding and what the first stage uses beside it (position
embeddings), and a tied or untied head; config fields nested under `text_config`, or spelled
GPT-2's way (`n_embd`, `n_layer`), are read with `from:` (of a field both the top level and
`text_config` hold, the value that matches the header's decoder). A part found in only some
layers gets a `when:` over the layer numbers. Anything else is kept as a replicated group
marked `# partc init: CHECK`, so that the scaffold still owns every tensor and passes `partc
check` as written; what it cannot write so that it does (a tensor whose shape differs between
layers) is marked too and said in `Scaffold.notes`. Every dimension is written as the
expression the module's place expects (a projection's `num_key_value_heads * head_dim`, a
per-head norm's `[num_attention_heads, head_dim]`), else as the config field of its value
(`_Writer.resolve`); a dimension no field explains stays a literal, one several fields have is
written as the one its neighbours use or marked, and every line with a literal or such a guess
is marked, so that no shape silently holds for this checkpoint's config only.

A checkpoint with several repetitions (a vision-language model: a vision tower's layers beside
the language model's) gets a multi-group graph: the decoder is the repetition beside the token
embedding (or nearest the head), every other one an encoder execution group before it, its
config fields read from its config section (`vision_config`) under prefixed names, CLIP's
attention and `fc1`/`fc2` split, its modules outside the layers static roles placed with its
first or last unit; modules outside every repetition's root (LLaVA's projector) are one
`projector` group between them. Each such group gets a boundary whose shapes are placeholders
marked CHECK (what crosses a cut inside a vision tower is not in the header). A tensor of no
module (LLaVA-NeXT's root-level `image_newline`) is a `members:` group placed with the projector
when there is one, else with the last stage, marked.

The family is built as data (`Scaffold.document`; `partc.scaffold.decisions._Writer` decides
each dimension and keeps the comments: a decision the scaffold could not make is a `# partc
init: CHECK: why` comment on the line of the node it concerns, counted in `Scaffold.undecided`)
and written by PyYAML (`partc.scaffold.yaml_writer`), which places the comments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.front.load import MAX_DOCUMENT_BYTES
from partc.scaffold.decisions import CHECK, _signature_params, _Writer
from partc.scaffold.encoder_groups import _before_layers, _encoder_groups, _projector_groups
from partc.scaffold.fused import Blocks, OpenLayout, Proof
from partc.scaffold.layer_groups import _layer_groups
from partc.scaffold.layer_table import _layer_table, _positional
from partc.scaffold.mtp_family import mtp_groups
from partc.scaffold.prove_boundary import OpenBoundary
from partc.scaffold.repetitions import _Encoder
from partc.scaffold.survey import survey_checkpoint
from partc.scaffold.vision_boundary import DIMENSIONS, VisionParts, merger_name, merger_root
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted, write_yaml

SCHEMA_COMMENT = "# yaml-language-server: $schema="
"""The editor line (see docs/authoring.md, "Editor support"), followed by the schema's path."""


@dataclass(frozen=True, slots=True)
class Scaffold:
    """The family text and the tensors (or decisions) it marked for a person to check."""

    text: str
    """The YAML family."""
    undecided: tuple[str, ...]
    """What the scaffold could not decide, one entry per CHECK comment."""
    notes: tuple[str, ...] = ()
    """What the user should know before running `partc check` (said on the console too)."""
    document: dict[str, Any] = field(default_factory=dict, repr=False)
    """The family as data: what `text` holds, without its comments."""
    open: tuple[OpenLayout, ...] = ()
    """The groups whose layout the header leaves open, with their candidates
    (`partc.scaffold.prove` tries them)."""
    boundaries: tuple[OpenBoundary, ...] = ()
    """The placeholder boundaries, with the widths `partc.scaffold.prove_boundary` tries."""


def scaffold(checkpoint: Path, config_path: Path, *, name: str | None = None,
             choices: Mapping[str, int] | None = None,
             proofs: Mapping[str, Proof] | None = None) -> Scaffold:
    """A family for the checkpoint: Llama-like parts recognised, the rest marked CHECK; with
    several layer repetitions, encoder groups and a projector before the decoder. `choices`:
    the candidate written for each open group by name (default the first); `proofs`: what
    `partc init --prove` found for them."""
    s = survey_checkpoint(checkpoint, config_path, name=name)
    config, model_type, family, layers = s.config, s.model_type, s.family, s.layers
    prefix, by_layer, roles, values, sources = s.prefix, s.by_layer, s.roles, s.values, s.sources
    marked, encoders, dimensions, projector = s.marked, s.encoders, s.dimensions, s.projector
    decoder_modules, loose = s.decoder_modules, s.loose
    count = len(by_layer)
    w = _Writer(values, s.default_dtype, sorted(by_layer), dimensions)
    w.config = config
    parts = VisionParts()
    mergers = {e.group: merger_name(e, encoders) for e in encoders}
    chain = [g for e in encoders for g in (e.group, mergers[e.group]) if g] + (
        ["projector"] if projector is not None else [])
    description = (f"{model_type} decoder" if not encoders else
                   f"{model_type} model, execution groups {', '.join([*chain, 'decoder'])}")
    header = [f"# Family scaffold written by `partc init` from {checkpoint.name} "
              f"({s.tensor_count} tensors). Lines marked `{CHECK}` need a decision.", ""]
    document: dict[str, Any] = {"family": family,
                                "description": f"{description} (scaffold; describe it here)",
                                "model_types": FlowList([model_type])}
    table = _layer_table(by_layer)
    body: list[dict[str, Any]] = []
    blocks = Blocks(w, f"{prefix}.{{unit}}", table, choices or {}, proofs or {})
    _layer_groups(w, body, prefix, table, others=blocks)
    mtp = mtp_groups(w, config, prefix, s.mtp, by_layer, blocks, body, _layer_groups)
    tables = [table]
    static = _static_groups(w, decoder_modules, roles, {} if projector else loose)
    front: list[dict[str, Any]] = []  # the encoders' and the projector's groups
    graph: list[dict[str, Any]] = []  # and their graph entries
    for number, encoder in enumerate(encoders):
        previous = encoders[number - 1].group if number else None
        tables.append(_encoder_groups(w, encoder, front, graph, family, None if previous is None
                                      else mergers[previous] or previous,
                                      config.get("vision_feature_layer"), blocks, parts,
                                      mergers[encoder.group]))
    if projector is not None:
        _projector_groups(w, projector, encoders[-1], front, graph, family, loose, parts,
                          chain[-2])
    w.dimensions, w.all_layers = dimensions, set(by_layer)
    if "hidden_size" in values:
        w.used.add("hidden_size")  # the boundary's hidden dimension
    prefixed = {n for e in encoders for n in e.names}
    for key, over in _DEFAULTS.items():  # a default is declared over fields declared too
        if key in w.used and key not in sources:
            w.used.update(n for n in over if n in values)
    # a field read from a guess is declared (and marked) also when no shape uses it
    used = sorted((w.used - prefixed) | {"num_hidden_layers"} | set(marked))
    fields: dict[str, Any] = {}
    document["config"] = fields
    for key in used:
        fields[key] = _config_field(key, sources.get(key, key), used)
        if key in marked:
            w.check(fields, key, marked[key])
    if mtp is not None:
        mtp.declare(w, fields)
    if values.get("num_hidden_layers") != count:
        w.note(fields, used[-1], f"# the checkpoint has {count} layers", "num_hidden_layers "
               "differs from the header's layer count")
    for section, names in _sections(encoders).items():
        written = sorted(names & w.used)
        for key in written:
            fields[key] = _config_field(key, sources[key], ())
        if written:
            w.comments.note(fields, written[0], "# " + ", ".join(
                e.group for e in encoders if e.section == section) + f" ({section})",
                before=True)
    fields.update(parts.config)
    if parts.derived:
        document["derived"] = dict(parts.derived)
    if encoders:
        dims = {f"{e.group}_tokens": f"the rows of what crosses a cut inside `{e.group}` (its "
                "units' output; written by partc init, see its boundary)" for e in encoders
                if f"{e.group}_tokens" in parts.dimensions}
        dims.update((d, DIMENSIONS[d]) for d in DIMENSIONS if d in parts.dimensions)
        document["dimensions"] = dims
    decoder = Flow(group="decoder", units="num_hidden_layers", path=Quoted(f"{prefix}.{{unit}}"),
                   state=True)
    if chain:
        decoder["after"] = FlowList([chain[-1]])
    document["graph"] = [*graph, decoder, *(mtp.graph if mtp else ())]
    statics: dict[str, Any] = {}
    for e in encoders:  # the roles its modules outside the layers have (_encoder_statics)
        merger = merger_root(e) if mergers[e.group] else None
        before = {_before_layers(m[len(e.root) + 1:]) for m in e.modules
                  if merger is None or not m.startswith(merger + ".")}
        for role, unit, holds in (("embeddings", "first", True), ("tail", "last", False)):
            if holds in before:
                statics[f"{e.group}_{role}"] = Flow(stage=Flow({"with": e.group, "unit": unit}))
    statics.update(parts.statics)
    statics["embedding"] = Flow(stage=Flow({"with": "decoder", "unit": "first"})) \
        if encoders else Flow(stage="first")
    statics["final_norm"] = Flow(stage="last")
    statics["output"] = Flow(stage="last")
    document["static"] = statics
    document["parameters"] = [*front, *static[0], *body, *static[1]]
    if s.quantized is not None:
        s.quantized.declare(fields, document)
    boundary: dict[str, Any] = {"identity": f"{family}.hidden", "primary": Flow(
        role="hidden", shape=FlowList(["batch", "sequence", "hidden_size" if "hidden_size" in
                                       values else "HIDDEN"]), dtype="activation"),
                                "auxiliary": FlowList()}
    document["boundary"] = boundary
    if "hidden_size" not in values:
        w.check(boundary, "primary", "the config has no hidden_size: write the hidden "
                "dimension (a config field)")
    notes = []
    if w.conditional:
        notes.append(f"the layers hold different tensors: {w.conditional} group(s) apply to "
                     "some layers only, with a `when:` over layer numbers marked CHECK")
    if any(e.differs for t in tables for e in t.values()):
        notes.append("some layers hold a module with other shapes than the first layer that "
                     "holds it: the scaffold does not pass `partc check` until those groups "
                     "are split by layer (marked CHECK)")
    if encoders:
        placeholders = [g["group"] for g in graph if any(
            c is g["boundary"] and k == "primary" for c, k, _ in w.comments.marks)]
        notes.append(f"{len(layers)} layer repetitions: execution groups "
                     f"{' -> '.join([*chain, 'decoder'])}" + (
                         f"; the boundaries of {', '.join(placeholders)} are placeholders "
                         "marked CHECK (what crosses a cut there is not in the checkpoint)"
                         if placeholders else ""))
    from importlib import resources

    schema = Path(str(resources.files("partc.schemas").joinpath("architecture.schema.json")))
    text = write_yaml(document, w.comments,
                      [SCHEMA_COMMENT + schema.resolve().as_uri(), *header])
    if len(text.encode()) > MAX_DOCUMENT_BYTES:
        raise LoadError(f"the scaffold of {checkpoint} would be {len(text.encode())} bytes; a "
                        f"family file holds at most {MAX_DOCUMENT_BYTES} (its names or tensors "
                        "outside the layers are too many or too long)",
                        location=SourceLocation(str(checkpoint)))
    return Scaffold(text=text, undecided=tuple(w.undecided), notes=tuple(notes),
                    document=document, open=tuple(blocks.open),
                    boundaries=tuple(parts.open))


def _sections(encoders: Sequence[_Encoder]) -> dict[str, set[str]]:
    """The config sections the encoders read, in their order, with the names read."""
    out: dict[str, set[str]] = {}
    for e in encoders:
        if e.section is not None:
            out.setdefault(e.section, set()).update(e.names)
    return out


_DEFAULTS = {"num_key_value_heads": ("num_attention_heads",),
             "head_dim": ("hidden_size", "num_attention_heads")}
"""The fields declared with a default (transformers'), and the fields it is computed from."""


def _config_field(key: str, source: str, declared: Sequence[str]) -> str | Flow:
    """The declaration of config field `key`, read from `source` (a dotted path), with its
    default (`_DEFAULTS`) when every field that reads is `declared` too (a default over a
    field the family lacks fails `partc check`)."""
    over = _DEFAULTS.get(key, ("-",))
    default = {"num_key_value_heads": "num_attention_heads",
               "head_dim": "hidden_size // num_attention_heads"}.get(key) \
        if all(n in declared for n in over) else None
    if source == key and not default:
        return "int"
    declared_field = Flow(type="int")
    if source != key:
        declared_field["from"] = source
    if default:
        declared_field["default"] = default
    return declared_field


def _beside_embedding(leaf: str) -> bool:
    """A module outside the layers used with the token embedding, on the first stage: a
    position embedding, BLOOM's `word_embeddings_layernorm`."""
    return _positional(leaf) or "embed" in leaf


def _static_groups(w: _Writer, modules: dict[str, dict[str, Any]], roles: Mapping[str, str],
                   loose: Mapping[str, tuple[str, list[int]]]
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The groups of the decoder's modules outside its layers (the first stage's, the last
    stage's), and of the tensors of no module (`loose`: the last stage's, marked)."""
    head: list[dict[str, Any]] = []
    tail: list[dict[str, Any]] = []
    tied = "output" not in roles.values()
    for module in sorted(modules):
        params = modules[module]
        role = roles.get(module)
        if role == "embedding":
            group: dict[str, Any] = {"name": "embedding", "role": "vocabulary", "owner": Flow(
                any_of=FlowList(["embedding", "output"])) if tied else Flow(static="embedding")}
            if tied:
                w.note(group, "owner", "# the checkpoint has no lm_head: the head is tied to "
                       "the embedding, which the last stage loads too")
            group.update(module=module, sharding=Flow(balanced=0))
            w.params(group, _signature_params(w, module, params, "vocab_size", "hidden_size"),
                     module)
            head.append(group)
        elif role == "output":
            group = {"name": module, "role": "vocabulary", "owner": Flow(static="output"),
                     "module": module, "sharding": Flow(balanced=0)}
            w.params(group, _signature_params(w, module, params, "vocab_size", "hidden_size"),
                     module)
            tail.append(group)
        elif role is None and _beside_embedding(module.rsplit(".", 1)[-1]):
            group = {"name": Quoted(module), "role": "replicated",
                     "owner": Flow(static="embedding"), "module": module,
                     "sharding": "replicated"}
            w.params(group, _signature_params(w, module, params, None, None,
                                              prefer=("hidden_size",)), module)
            head.append(group)
        else:
            norm = role == "final_norm"
            group = {"name": "final_norm" if norm else Quoted(module), "role": "replicated",
                     "owner": Flow(static="final_norm" if norm else "output"),
                     "module": module, "sharding": "replicated"}
            if not norm:
                w.note(group, "owner", "# owner guessed", f"`{module}` is outside the layers "
                       "and not a known name: owned by the last stage")
            w.params(group, _signature_params(w, module, params, None, None, prefer=(
                "hidden_size",) if norm else ()), module)
            tail.append(group)
    for tensor in sorted(loose):
        w.loose(tail, tensor, tensor, loose[tensor], Flow(static="output"), f"`{tensor}` is a "
                "tensor of no module, outside the layers, and not a known name: owned by the "
                "last stage")
    return head, tail
