"""`partc init`: the groups and graph entries of the encoders and the projector before the decoder.

An encoder's layers (`partc.scaffold.layer_groups` over its prefixed config names), its modules
outside them placed with its first or last unit, its merger's (`_encoder_groups`,
`_encoder_statics`); the projector's modules and the tensors of no module placed with it
(`_projector_groups`); each with the boundary `partc.scaffold.vision_boundary` writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.config_values import _DIMENSIONS
from partc.scaffold.decisions import _signature_params, _Writer
from partc.scaffold.fused import Blocks
from partc.scaffold.layer_groups import _Kinds, _layer_groups
from partc.scaffold.layer_table import _is_norm, _layer_table, _Module
from partc.scaffold.projector import two_linear_projector
from partc.scaffold.repetitions import (
    _ENCODER_COUNTS,
    _ENCODER_HEADS,
    _ENCODER_WIDTHS,
    _Encoder,
)
from partc.scaffold.vision import encoder_attention
from partc.scaffold.vision_boundary import (
    VisionParts,
    encoder_boundary,
    merger_entry,
    merger_root,
    position_params,
    position_rows,
    projector_boundary,
    reads_grid,
    used_layers,
)
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted


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
