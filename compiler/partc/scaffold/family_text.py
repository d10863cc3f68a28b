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
from partc.scaffold.decisions import (
    CHECK,
    _entry,
    _intermediate_names,
    _signature_params,
    _sized_like,
    _Writer,
)
from partc.scaffold.delta_net import delta_nets
from partc.scaffold.fused import Blocks, OpenLayout, Proof
from partc.scaffold.mla import mla_attention
from partc.scaffold.mtp_family import mtp_groups
from partc.scaffold.per_head import per_head_modules
from partc.scaffold.projector import two_linear_projector
from partc.scaffold.prove_boundary import OpenBoundary
from partc.scaffold.ssm import mamba_mixers
from partc.scaffold.ssm2 import mamba2_mixers
from partc.scaffold.stacked import stacked_experts
from partc.scaffold.survey import (
    _ATTENTION,
    _DIMENSIONS,
    _ENCODER_COUNTS,
    _ENCODER_HEADS,
    _ENCODER_WIDTHS,
    _MLP,
    _PACKED,
    _Encoder,
    _is_norm,
    _layer_table,
    _Module,
    _positional,
    survey_checkpoint,
)
from partc.scaffold.vision import encoder_attention
from partc.scaffold.vision_boundary import (
    DIMENSIONS,
    VisionParts,
    encoder_boundary,
    merger_entry,
    merger_name,
    merger_root,
    position_params,
    position_rows,
    projector_boundary,
    reads_grid,
    used_layers,
)
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted, write_yaml

SCHEMA_COMMENT = "# yaml-language-server: $schema="
"""The editor line (see docs/authoring.md, "Editor support"), followed by the schema's path."""


_ENCODER_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "fc1",
                                  "fc2", *_MLP})
"""Projection names of an encoder layer the scaffold splits when their block is complete."""


@dataclass(frozen=True, slots=True)
class _Kinds:
    """What a repetition's groups are named and recognised by: the decoder's (Llama-style
    names over the decoder's config) or an encoder's (also CLIP's, over its prefixed ones)."""

    group: str
    """The execution group (`decoder`, `vision`), also the owner of its layer groups."""
    label: str
    """The first part of its layer groups' names: `layers`, or the group's name."""
    attention: tuple[Mapping[str, tuple[str | None, ...]], ...]
    """Alternative projection sets of `self_attn` (q/k/v/o or CLIP's q/k/v/out_proj)."""
    heads: str
    """The attention group's units (KV heads of a decoder, the heads of an encoder)."""
    mlps: tuple[tuple[str, Mapping[str, tuple[str | None, ...]]], ...]
    """MLP projection sets, each found by its first projection's name."""
    intermediate: str
    """The config name an MLP's intermediate dimension is expected as."""
    encoder: bool = False


_EXPERT_W = {"w1": _MLP["gate_proj"], "w3": _MLP["up_proj"], "w2": _MLP["down_proj"]}
"""Mixtral's expert projections: `w1` gate, `w3` up, `w2` down."""

_DECODER = _Kinds("decoder", "layers", (_ATTENTION,), "num_key_value_heads",
                  (("gate_proj", _MLP), ("w1", _EXPERT_W)), "intermediate_size")


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


def _before_layers(relative: str) -> bool:
    """A module of an encoder run before its layers, by name: CLIP's `embeddings` (class,
    patch and position embeddings) and `pre_layrnorm`, Qwen2-VL's `patch_embed`."""
    return any("embed" in part or "patch" in part or part.startswith("pre") or
               part.endswith("_pre") for part in relative.split("."))


def _encoder_groups(w: _Writer, e: _Encoder, front: list[dict[str, Any]],
                    graph: list[dict[str, Any]], family: str, after: str | None,
                    feature: object, blocks: Blocks, parts: VisionParts, merger: str | None
                    ) -> dict[str, _Module]:
    """An encoder's parameter groups (appended to `front`: its modules before the layers,
    its layers, its other modules) and its graph entry (to `graph`), with its merger's
    (execution group `merger`, if any); its table of modules. `feature`: the config's
    `vision_feature_layer` (LLaVA's: the vision layer whose output the projector reads), if
    any; `blocks`: the decoder's, whose choices, proofs and open layouts a fused attention of
    the encoder shares; `parts`: the derived values, roles and dimensions the boundaries add
    (partc.scaffold.vision_boundary)."""
    table = _layer_table(e.by_layer)
    counts = {e.stem + k for k in _ENCODER_COUNTS}
    w.dimensions = (*(e.stem + k for k in (*_ENCODER_WIDTHS, *_ENCODER_HEADS)
                      if e.stem + k in w.values),
                    *sorted(n for n in e.names if n not in counts and n[len(e.stem):] not in (
                        *_ENCODER_WIDTHS, *_ENCODER_HEADS)))
    w.all_layers = set(e.by_layer)
    heads = next((e.stem + k for k in _ENCODER_HEADS if e.stem + k in w.values), None)
    norm = next((entry.params["weight"][1][0] for module, entry in sorted(table.items())
                 if _is_norm(module.rsplit(".", 1)[-1]) and len(entry.params.get(
                     "weight", ("", []))[1]) == 1), None)
    # the tower's width: the one its layers' norms have (Qwen2-VL's embed_dim, not its
    # hidden_size, the merger's output width), else the first there is
    widths = [e.stem + k for k in _ENCODER_WIDTHS[:2] if e.stem + k in w.values]
    width = next((n for n in widths if w.values[n] == norm), widths[0] if widths else None)
    inter = e.stem + "intermediate_size"
    attention: tuple[Mapping[str, tuple[str | None, ...]], ...] = tuple(
        {"q_proj": ("column", heads, width, width), "k_proj": ("column", heads, width, width),
         "v_proj": ("column", heads, width, width), out: ("row", heads, width, width)}
        for out in ("out_proj", "o_proj")) if heads else ()
    mlps = (("fc1", {"fc1": ("column", inter, width), "fc2": ("row", width, inter)}),
            ("gate_proj", {"gate_proj": ("column", inter, width),
                           "up_proj": ("column", inter, width),
                           "down_proj": ("row", width, inter)}))
    head, tail = _encoder_statics(w, e, parts, merger)
    layers: list[dict[str, Any]] = []
    mine = Blocks(w, f"{e.prefix}.{{unit}}", table, blocks.choices, blocks.proofs)
    written = encoder_attention(mine, layers, table, e.group, e.group, heads, width)
    blocks.open += mine.open
    _layer_groups(w, layers, e.prefix, {m: t for m, t in table.items() if m not in written},
                  _Kinds(e.group, e.group, attention, heads or "",
                                                     mlps, inter, encoder=True))
    entry: dict[str, Any] = {"group": e.group}
    graph.append(entry)
    count = next((e.stem + k for k in _ENCODER_COUNTS if e.stem + k in w.values), None)
    units = None if count is None or w.values[count] != len(e.by_layer) or \
        feature is None or e.section != "vision_config" else \
        used_layers(w, e, count, feature, e.group, layers, parts)
    front += head + layers + tail
    if units is not None and count is not None:
        w.used.add(count)
        entry["units"] = units
        if units != count:
            w.comments.note(entry, "units", f"# the layers vision_feature_layer ({feature}) "
                            f"reads; the rest never reach the logits: {e.group}_unused")
    elif count is not None and w.values[count] == len(e.by_layer) and feature is not None \
            and e.section == "vision_config":
        w.used.add(count)
        entry["units"] = count
        w.check(entry, "units", f"the config's vision_feature_layer ({feature}) says "
                "the projector reads an earlier layer's output: the layers after it never "
                "reach the logits (architectures/llava.yaml's vision_used, vision_unused)")
    elif count is not None and w.values[count] == len(e.by_layer):
        w.used.add(count)
        entry["units"] = count
    else:
        entry["units"] = len(e.by_layer)
        w.check(entry, "units", f"`{e.prefix}` has {len(e.by_layer)} layers "
                + (f"and {e.section} no layer count ({', '.join(_ENCODER_COUNTS)}) equal to "
                   "it" if e.section else "and the config no section for it (vision_config)")
                + ": write the count as a config field")
    entry["path"] = Quoted(f"{e.prefix}.{{unit}}")
    if after is not None:
        entry["after"] = FlowList([after])
    out_width = w.dim(None, norm) if norm is not None else (width or "hidden_size")
    entry["boundary"] = encoder_boundary(w, e, family, out_width, width, parts)
    root = merger_root(e)
    if merger is not None and root is not None:
        graph.append(merger_entry(w, e, root, merger, family, reads_grid(w, e), parts))
    return table


def _encoder_statics(w: _Writer, e: _Encoder, parts: VisionParts, merger: str | None
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The groups of an encoder's modules outside its layers: those run before them with its
    first unit (`<group>_embeddings`), the merger's with its unit (execution group `merger`),
    the others with its last unit (`<group>_tail`), marked."""
    root = merger_root(e) if merger is not None else None

    def inside(module: str) -> bool:
        return root is not None and module.startswith(root + ".")

    positions = position_rows(w, e, parts)
    head: list[dict[str, Any]] = []
    tail: list[dict[str, Any]] = []
    parents: dict[str, dict[str, dict[str, Any]]] = {}  # a tail MLP's: Qwen2-VL's merger.mlp
    for module in e.modules:
        if not _before_layers(module[len(e.root) + 1:]):
            parents.setdefault(module.rpartition(".")[0], {})[module] = e.modules[module]
    written: set[str] = set()
    for parent, modules in sorted(parents.items()):
        if parent != e.root and parent.rsplit(".", 1)[-1] == "mlp":
            done = two_linear_projector(w, f"{e.group}.{parent[len(e.root) + 1:]}", modules,
                                        tail, Flow(unit=merger) if inside(parent + ".")
                                        else Flow(static=f"{e.group}_tail"))
            if done and not inside(parent + "."):
                w.note(tail[-1], "owner", "# owner guessed", f"`{parent}` is under "
                       f"`{e.root}` but not run before its layers: loaded with the last "
                       f"`{e.group}` unit (Qwen2-VL's merger, an execution group after the "
                       "tower in architectures/qwen2_vl.yaml)")
            written |= done
    for module in sorted(set(e.modules) - written):
        before = _before_layers(module[len(e.root) + 1:])
        role = f"{e.group}_embeddings" if before else f"{e.group}_tail"
        group: dict[str, Any] = {"name": Quoted(module), "role": "replicated",
                                 "owner": Flow(unit=merger) if inside(module) and merger
                                 else Flow(static=role), "module": module,
                                 "sharding": "replicated"}
        if positions is not None and module == positions[0]:
            w.params(group, position_params(w, e, module, positions[1], parts), module)
            head.append(group)
            continue
        if not before and not inside(module):
            w.note(group, "owner", "# owner guessed", f"`{module}` is under `{e.root}` but not "
                   f"run before its layers: loaded with the last `{e.group}` unit; whether it "
                   "reaches the logits the scaffold cannot know (LLaVA's post_layernorm does "
                   "not; Qwen2-VL's merger does, an execution group after the tower in "
                   "architectures/qwen2_vl.yaml)")
        w.params(group, _signature_params(w, module, e.modules[module], None, None), module)
        (head if before else tail).append(group)
    return head, tail


def _projector_groups(w: _Writer, projector: tuple[str, dict[str, dict[str, Any]]],
                      encoder: _Encoder, front: list[dict[str, Any]],
                      graph: list[dict[str, Any]], family: str,
                      loose: Mapping[str, tuple[str, list[int]]], parts: VisionParts,
                      after: str) -> None:
    """The projector's groups (replicated, marked) and its graph entry after `after` (the
    last encoder, or its merger): its dimensions are matched against the decoder's config,
    then the encoder's (it maps the tower's width to the decoder's). The tensors of no module
    (`loose`) are placed with it, marked: LLaVA-NeXT's `image_newline` is appended to its
    output."""
    root, modules = projector
    w.dimensions = (*_DIMENSIONS, *(encoder.stem + k for k in _ENCODER_WIDTHS
                                    if encoder.stem + k in w.values))
    written = two_linear_projector(w, root, modules, front)
    for module in sorted(set(modules) - written):
        relative = module[len(root) + 1:]
        label = "projector" + (f".{relative}" if relative else "")
        group: dict[str, Any] = {"name": Quoted(label), "role": "replicated",
                                 "owner": Flow(unit="projector"), "module": module,
                                 "sharding": "replicated"}
        front.append(group)
        if not _is_norm(module.rsplit(".", 1)[-1]):
            w.note(group, "sharding", "# replicated on every rank", f"`{module}` is the "
                   "projector's: replicated; a two-linear MLP splits as one "
                   "feed_forward_intermediate group, the first column, the second row "
                   "(architectures/llava.yaml)")
        w.params(group, _signature_params(w, module, modules[module], None, None), module)
    for tensor in sorted(loose):
        w.loose(front, f"projector.{tensor}", tensor, loose[tensor], Flow(unit="projector"),
                f"`{tensor}` is a tensor of no module, outside the layers: owned with the "
                "projector, whose output LLaVA-NeXT's `image_newline` is appended to (HF's "
                "pack_image_features); whether this one is, the header does not say")
    out = modules[sorted(written)[-1]]["weight"][1][0] if written else None
    graph.append({"group": "projector", "units": 1, "path": root, "after": FlowList([after]),
                  "boundary": projector_boundary(w, encoder, family, out, parts)})


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


def _block_groups(table: Mapping[str, _Module], block: str,
                  projections: Sequence[str]) -> bool:
    """Whether every projection of `block` is a dense module of the same layers and experts."""
    found = [table.get(f"{block}.{p}") for p in projections]
    return all(e is not None and not _PACKED & set(e.params) for e in found) and all(
        e is not None and found[0] is not None and (e.layers, e.experts) ==
        (found[0].layers, found[0].experts) for e in found)


def _layer_groups(w: _Writer, groups: list[dict[str, Any]], prefix: str,
                  table: Mapping[str, _Module], kinds: _Kinds = _DECODER,
                  others: Blocks | None = None) -> None:
    """The groups of a repetition's layers (appended to `groups`): its attention and MLP
    blocks split by heads and intermediate units (`others`: also those not named the Llama
    way), every other module replicated."""
    unit = f"{prefix}.{{unit}}"
    done: set[str] = set()
    attention_projections: list[dict[str, Any]] | None = None
    attention_group: dict[str, Any] = {}
    attention = next((spec for spec in kinds.attention
                      if _block_groups(table, "self_attn", list(spec))), None)
    blocks: list[tuple[str, Mapping[str, tuple[str | None, ...]]]] = [
        ("self_attn", attention)] if attention is not None else []
    blocks += sorted(((m.rpartition(".")[0], spec) for marker, spec in kinds.mlps for m in table
                      if m.endswith(f".{marker}") and _block_groups(
                          table, m.rpartition(".")[0], list(spec))), key=lambda b: b[0])
    for block, spec_table in blocks:
        first = table[f"{block}.{next(iter(spec_table))}"]
        guessed: str | None = None
        if spec_table is attention:
            name, role, units = "attention", "attention_heads", kinds.heads
        else:
            name = block
            role = "feed_forward_intermediate" if first.experts is None else \
                "expert_intermediate"
            rows = first.params.get("weight", ("", [0]))[1][0]
            units, guessed = w.resolve(kinds.intermediate, rows, names=w.vocabulary(block)[0],
                                       prefer=_intermediate_names(w, block, first))
        if units in w.values:
            w.used.add(units)
        group: dict[str, Any] = {"name": Quoted(f"{kinds.label}.{{unit}}.{name}"), "role": role,
                                 "owner": Flow(unit=kinds.group)}
        groups.append(group)
        w.scope(group, block, first,
                [n for p in spec_table for n in table[f"{block}.{p}"].differs])
        group["units"] = _entry(units)
        if spec_table is attention and not kinds.encoder and w.values.get(units, 0) < \
                w.values.get("num_attention_heads", 0):
            group["kv_replication"] = True  # T > KV heads: repeat them (docs/kv_replication.md)
        if kinds.encoder and units not in w.values:
            w.check(group, "units", f"the intermediate size of `{block}` ({units}) is "
                    "no field of the encoder's config section: write it as an expression "
                    "(Qwen2-VL's is embed_dim * mlp_ratio)")
        elif guessed is not None:
            w.check(group, "units", f"the intermediate size of `{block}`: {guessed}: "
                    "write it as a config field")
        projections: list[dict[str, Any]] = []
        group["projections"] = projections
        if spec_table is attention:
            attention_projections, attention_group = projections, group
        for proj, spec in spec_table.items():
            module = f"{block}.{proj}"
            done.add(module)
            projection: dict[str, Any] = {"module": Quoted(f"{unit}.{module}"),
                                          "sharding": spec[0]}
            projections.append(projection)
            if len(spec) == 4:
                projection["heads"] = spec[1]
                w.used.add(str(spec[1]))
                rows_of, cols_of = spec[-2], spec[-1]
            else:  # the intermediate dimension is the group's units
                rows_of = units if spec[0] == "column" else spec[1]
                cols_of = units if spec[0] == "row" else spec[2]
            w.params(projection, _signature_params(w, module, table[module].params, rows_of,
                                                   cols_of), module)
    reduced: set[str] = set()  # whole-width norms split with the attention (OLMo 2's)
    if others is not None:
        mla_attention(others, groups, done)
        mamba_mixers(others, groups, done)
        mamba2_mixers(others, groups, done)
        delta_nets(others, groups, done)
        others.write(groups, done)
        stacked_experts(others, groups, done)
        spanning = [m for m in sorted(set(table) - done) if attention_projections is not None
                    and _sized_like(w, table, m, m.rsplit(".", 1)[-1], table[m])[1]]
        if spanning and others.reduction(attention_group, spanning):
            reduced = set(spanning)
            attention_group.pop("kv_replication", None)  # refused beside a reduced norm
    if not kinds.encoder:
        per_head_modules(w, unit, table, done, attention_projections)
    for module in sorted(set(table) - done):
        entry = table[module]
        leaf = module.rsplit(".", 1)[-1]
        # an encoder's norms are sized by its own widths, not as the decoder's attention's
        sized, spans = (None, None) if kinds.encoder else _sized_like(w, table, module, leaf,
                                                                      entry)
        # a known projection outside its group (its block fused or packed) keeps its sizes
        known: tuple[str, ...] | None = None if kinds.encoder else (
            _ATTENTION[leaf] if leaf in _ATTENTION else _MLP.get(leaf))
        size_rows, size_cols = (known[-2], known[-1]) if known is not None else (None, None)
        prefer = () if kinds.encoder or not _is_norm(leaf) else ("hidden_size",)
        params = _signature_params(w, module, entry.params, size_rows, size_cols,
                                   axes=sized, prefer=prefer)
        heads = _per_head_axis(params, module, attention_projections)
        if module in reduced and attention_projections is not None and spans is not None:
            projection = {"module": Quoted(f"{unit}.{module}"), "sharding": "column",
                          "reduction": "tensor_parallel", "linear": False,
                          "heads": _ATTENTION[spans][1]}
            attention_projections.append(projection)
            w.params(projection, params, module)
            continue
        if heads is not None and attention_projections is not None:
            # one row per head of its projection (Cohere's q_norm [heads, head_dim]): a rank
            # computing some of the heads holds their rows, split with the attention's heads
            projection = {"module": Quoted(f"{unit}.{module}"), "sharding": "column",
                          "heads": heads}
            if "weight" not in entry.params:  # gpt-oss's sinks: one logit per head
                projection["linear"] = False
            attention_projections.append(projection)
            w.params(projection, params, module)
            continue
        safe = module.replace("self_attn.", "attention.")
        group = {"name": Quoted(f"{kinds.label}.{{unit}}.{safe}"), "role": "replicated",
                 "owner": Flow(unit=kinds.group)}
        groups.append(group)
        w.scope(group, module, entry)
        group["module"] = Quoted(f"{unit}.{module}")
        group["sharding"] = "replicated"
        why = None
        if spans is not None and sized:
            why = (f"`{module}` normalises the whole `{spans}` output ({sized[0]}), which the "
                   "attention group splits: declare it in that group, split with the "
                   "projection and `reduction: tensor_parallel` (architectures/olmo2.yaml), "
                   "or verify fails at T >= 2")
        elif _PACKED & set(entry.params):
            why = (f"`{module}` holds packed quantized weights "
                   f"({', '.join(sorted(_PACKED & set(entry.params)))}): replicated; shard it "
                   "with the family's linear format (docs/linear_formats.md)")
        elif kinds.encoder and leaf == "qkv":
            why = (f"`{module}` looks like a fused [q | k | v] projection: replicated; split "
                   "it by heads with `fused:` and its output projection "
                   "(architectures/qwen2_vl.yaml)")
        elif kinds.encoder and leaf in _ENCODER_PROJECTIONS:
            why = (f"`{module}` is a known projection, but its block's others are not all "
                   "there as separate dense modules, or the encoder's config section has no "
                   "head count: replicated; shard the block by hand")
        elif leaf in _ATTENTION or leaf in _MLP:
            why = (f"`{module}` is a known projection, but its block's others are not all "
                   "there as separate dense modules (fused, such as qkv_proj?): replicated; "
                   "shard the block by hand")
        elif not _is_norm(leaf):
            why = f"`{module}` is not a known projection: replicated; shard it if it is large"
        if why is not None:
            w.note(group, "sharding", "# replicated on every rank", why)
        w.params(group, params, module)


def _per_head_axis(params: Mapping[str, tuple[list[str], str, list[str]]], module: str,
                   attention: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The head count a norm of the attention block is sized by on its first axis (every param
    `[heads, ...]` with `heads` one the attention's projections state; the block's own params,
    gpt-oss's sinks, also `[heads]`), else None: such a norm holds a row per head and splits
    with the heads."""
    own = module == "self_attn"  # the block's own params: gpt-oss's sinks [heads]
    if attention is None or not (own or module.startswith("self_attn.")) or not params:
        return None
    stated = {str(p["heads"]) for p in attention if "heads" in p}
    firsts = {shape[0] for shape, _, _ in params.values() if shape}
    if len(firsts) == 1 and all(len(shape) >= 2 - own for shape, _, _ in params.values()):
        (first,) = firsts
        if first in stated:
            return first
    return None


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
