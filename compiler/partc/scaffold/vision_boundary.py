"""`partc init`: what crosses a cut inside or after a vision tower, written as
architectures/llava.yaml and architectures/qwen2_vl.yaml declare it.

- The layers a tower runs: with the config's `vision_feature_layer` (LLaVA's -2: the
  projector reads the output of the layer before the last), the tower's units are the layers
  the model reads (`vision_used`), and the rest are groups of the static role `vision_unused`
  (`for: {layer: count - vision_used}`), split as the used ones, loaded with the last unit: a
  layer the model never reads is no unit a cut hands over from.
- A CLIP-style tower (a position embedding of `(image_size // patch_size)^2` rows, `+ 1` with
  a class embedding, as the header confirms) hands over `[images, positions, width]`; a
  tower of flattened patches and a merger (Qwen2-VL: a patch embedding over temporal patches,
  `spatial_merge_size`) hands over `[patches, width]` with the image grid.
- A merger inside the tower (`<tower>.merger`, holding a two-linear MLP) is an execution group
  after the tower, as the projector outside it: its output, `[image_tokens, hidden_size]`,
  crosses a cut after it.

Each boundary carries the token ids and the image mask (the text embedding runs with the first
decoder unit, later), and the image grid where the tower reads one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from partc.scaffold.decisions import _entry, _signature_params
from partc.scaffold.prove_boundary import OpenBoundary, tried_widths
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

if TYPE_CHECKING:
    from partc.scaffold.decisions import _Writer
    from partc.scaffold.repetitions import _Encoder

_AUXILIARY: tuple[tuple[str, list[str | int], str], ...] = (
    ("input_ids", ["batch", "sequence"], "int32"),
              ("image_mask", ["batch", "sequence"], "bool"))
"""What every vision-side boundary carries besides its primary (architectures/llava.yaml)."""

_GRID: tuple[str, list[str | int], str] = ("image_grid_thw", ["images", 3], "int32")
"""Qwen2-VL's per-image (t, h, w) patch grid, which the tower's rotary positions and the
merger read."""

DIMENSIONS = {
    "images": "the images of the request (one tower pass each, or rows of `image_grid_thw`)",
    "patches": "the vision patches of every image of the request (rows of `pixel_values`)",
    "image_tokens": "the image-token positions of the request (the projector's or merger's "
                    "output rows)",
}
"""The per-request dimensions the boundaries written here use, and what each counts."""


@dataclass(slots=True)
class VisionParts:
    """What the vision boundaries add to the family beside the groups: derived values, static
    roles and per-request dimensions (in the order written)."""

    derived: dict[str, str] = field(default_factory=dict)
    """Named expressions over config fields (`vision_used`, `vision_positions`)."""
    statics: dict[str, Flow] = field(default_factory=dict)
    """Static roles (`vision_unused`), by name."""
    dimensions: set[str] = field(default_factory=set)
    """The per-request dimensions the boundaries use (keys of `DIMENSIONS`)."""
    config: dict[str, Flow] = field(default_factory=dict)
    """Config fields read outside the prefixed sections (`vision_feature_layer`)."""
    open: list[OpenBoundary] = field(default_factory=list)
    """The placeholder boundaries written, for `partc init --prove`."""


def boundary(parts: VisionParts, identity: str, role: str, shape: list[str | int],
             grid: bool) -> dict[str, Any]:
    """A vision-side boundary: `shape` of the primary, the token ids and image mask beside it
    (and the image grid when `grid`); its per-request dimensions recorded in `parts`."""
    parts.dimensions.update(d for d in shape if isinstance(d, str) and d in DIMENSIONS)
    auxiliary: list[tuple[str, list[str | int], str]] = [*([_GRID] if grid else []),
                                                          *_AUXILIARY]
    parts.dimensions.update(d for _, s, _ in auxiliary for d in s
                            if isinstance(d, str) and d in DIMENSIONS)
    return {"identity": identity,
            "primary": Flow(role=role, shape=FlowList(shape), dtype="activation"),
            "auxiliary": [Flow(role=r, shape=FlowList(s), dtype=t) for r, s, t in auxiliary]}


def placeholder_boundary(w: _Writer, identity: str, role: str, shape: list[str | int],
                         why: str) -> dict[str, Any]:
    """A boundary no rule derives: its primary a placeholder marked `why`, the token ids
    beside it (the text embedding runs with the first decoder unit, later)."""
    written: dict[str, Any] = {
        "identity": identity, "primary": Flow(role=role, shape=FlowList(shape),
                                              dtype="activation"),
        "auxiliary": [Flow(role="input_ids", shape=FlowList(["batch", "sequence"]),
                           dtype="int32")]}
    w.check(written, "primary", why)
    w.comments.note(written, "auxiliary", "# the text embedding runs with the first decoder "
                    "unit, on a later stage: its token ids cross this cut", before=True)
    return written


def encoder_boundary(w: _Writer, e: _Encoder, family: str, out_width: str, width: str | None,
                     parts: VisionParts) -> dict[str, Any]:
    """What crosses a cut inside tower `e` (of output width `out_width`): CLIP's
    `[images, positions, width]`, Qwen2-VL's `[patches, width]` with the image grid, else a
    placeholder over `<group>_tokens` marked CHECK, whose widths `--prove` tries."""
    grid, rows = reads_grid(w, e), position_rows(w, e, parts)
    identity, last = f"{family}.{e.group}", _entry(out_width)
    if rows is not None or grid:
        return boundary(parts, identity, "hidden",
                        [*(["images", rows[1]] if rows is not None else ["patches"]), last],
                        grid)
    tokens = f"{e.group}_tokens"
    parts.dimensions.add(tokens)
    why = (f"what crosses a cut inside `{e.group}` is not in the checkpoint: `{tokens}` takes "
           "the leading axes of its layers' output (CLIP's [images, positions, width]); write "
           "the shape, and the tensors the next stage needs besides (architectures/llava.yaml, "
           "qwen2_vl.yaml's image_grid_thw)")
    parts.open.append(OpenBoundary(e.group, identity, why, tuple(
        (tokens, x) for x in tried_widths(
            out_width, width, "hidden_size" if "hidden_size" in w.values else None))))
    return placeholder_boundary(w, identity, "hidden", [tokens, last], why)


def projector_boundary(w: _Writer, e: _Encoder, family: str, out: int | None,
                       parts: VisionParts) -> dict[str, Any]:
    """What the projector after tower `e` hands the decoder: `[image_tokens, hidden_size]`
    when it is a two-linear MLP whose second linear gives `out` = the decoder's width, else
    that shape as a placeholder marked CHECK, whose widths `--prove` tries."""
    hidden, identity = "hidden_size" if "hidden_size" in w.values else "HIDDEN", \
        f"{family}.projector"
    if out is not None and out == w.values.get("hidden_size"):
        return boundary(parts, identity, "image_features", ["image_tokens", hidden],
                        reads_grid(w, e))
    why = ("what the projector hands the decoder is not in the checkpoint: `image_tokens` rows "
           "of the decoder's width is LLaVA's; write the shape, and the tensors the decoder "
           "needs besides (architectures/llava.yaml's image_mask)")
    parts.dimensions.add("image_tokens")
    tower = (e.stem + k for k in ("hidden_size", "embed_dim") if e.stem + k in w.values)
    parts.open.append(OpenBoundary("projector", identity, why, tuple(
        ("image_tokens", x) for x in tried_widths(hidden, *tower))))
    return placeholder_boundary(w, identity, "image_features", ["image_tokens", hidden], why)


def position_params(w: _Writer, e: _Encoder, module: str, name: str, parts: VisionParts
                    ) -> dict[str, tuple[list[str], str, list[str]]]:
    """The params of the tower's position embedding `module`, its rows the derived `name`
    (`position_rows`), matched against the header as the expression it stands for."""
    signature = _signature_params(w, module, e.modules[module], parts.derived[name], None)
    signature["weight"][0][0] = name
    return signature


def reads_grid(w: _Writer, e: _Encoder) -> bool:
    """Whether the tower reads an image grid (Qwen2-VL's `image_grid_thw`): its config has a
    spatial merge size and a temporal patch size and its patch embedding is 3-D (5 axes)."""
    fields = {e.stem + "spatial_merge_size", e.stem + "temporal_patch_size"}
    return fields <= set(w.values) and any(
        len(params.get("weight", ("", []))[1]) == 5 for m, params in e.modules.items()
        if "patch" in m[len(e.root):])


def positions(w: _Writer, e: _Encoder) -> tuple[str, str] | None:
    """(module, expression) of a CLIP-style tower's position embedding whose rows the header
    shows are `(image_size // patch_size)^2` (+ 1 with a class embedding), None otherwise."""
    size, patch = e.stem + "image_size", e.stem + "patch_size"
    if size not in w.values or patch not in w.values or not w.values[patch]:
        return None
    cls = any("class_embedding" in params for params in e.modules.values())
    side = w.values[size] // w.values[patch]
    for module, params in sorted(e.modules.items()):
        shape = params.get("weight", ("", []))[1]
        if module.rsplit(".", 1)[-1] == "position_embedding" and len(shape) == 2 and \
                shape[0] == side * side + cls:
            return module, (f"({size} // {patch}) * ({size} // {patch})" + (" + 1" if cls
                                                                                else ""))
    return None


def position_rows(w: _Writer, e: _Encoder, parts: VisionParts) -> tuple[str, str] | None:
    """(module, name) of the tower's position embedding whose rows are the derived
    `<stem>positions` (recorded in `parts`, its fields used), None when `positions` finds none."""
    found = positions(w, e)
    if found is None:
        return None
    name = e.stem + "positions"
    parts.derived[name] = found[1]
    w.used.update((e.stem + "image_size", e.stem + "patch_size"))
    return found[0], name


def merger_root(e: _Encoder) -> str | None:
    """The module inside the tower, run after its layers, that merges patches: a norm and a
    two-linear MLP whose first linear reads k > 1 norm widths (Qwen2-VL's `visual.merger`:
    `ln_q` [width], `mlp.0` [.., width * merge^2]); None when there is none. (SigLIP's pooling
    `head` reads one width: it is no merger.)"""
    found = {m.rpartition(".")[0] for m in e.modules if m.rpartition(".")[0].endswith(".mlp")}
    roots = sorted({m.rpartition(".")[0] for m in found} - {e.root})
    if len(roots) != 1 or not roots[0].startswith(e.root + "."):
        return None
    inside = {m: p.get("weight", ("", []))[1] for m, p in e.modules.items()
              if m.startswith(roots[0] + ".")}
    norms = {s[0] for s in inside.values() if len(s) == 1}
    first = min((m for m, s in inside.items() if len(s) == 2 and ".mlp." in m),
                key=_numbered, default=None)
    reads = inside[first][1] if first is not None else 0
    return roots[0] if any(reads > n and reads % n == 0 for n in norms) else None


def _numbered(module: str) -> list[int]:
    """A module's sort key in numeric order of its numbered parts (`mlp.2` after `mlp.0`)."""
    return [int(p) if p.isdigit() else -1 for p in module.split(".")]


def merger_name(e: _Encoder, encoders: Sequence[_Encoder]) -> str | None:
    """The execution group of the encoder's merger (`merger_root`), None without one."""
    root = merger_root(e)
    if root is None:
        return None
    name, taken = root.rsplit(".", 1)[-1], {"decoder", "projector", *(x.group for x in encoders)}
    return name if name.isidentifier() and name not in taken else None


def merger_entry(w: _Writer, e: _Encoder, root: str, name: str, family: str, grid: bool,
                 parts: VisionParts) -> dict[str, Any]:
    """The graph entry of a merger inside the tower: one unit after it, handing over its
    last linear's rows, `[image_tokens, hidden_size]` (the decoder's width)."""
    last = max((m for m in e.modules if m.startswith(root + ".") and
                len(e.modules[m].get("weight", ("", []))[1]) == 2),
               key=_numbered)
    out = e.modules[last]["weight"][1][0]
    hidden, why = w.resolve("hidden_size" if "hidden_size" in w.values else None, out,
                            lookup=False)
    entry: dict[str, Any] = {"group": name, "units": 1, "path": root,
                             "after": FlowList([e.group]), "boundary": boundary(
                                 parts, f"{family}.{name}", "image_features",
                                 ["image_tokens", _entry(hidden)], grid)}
    if why is not None:
        w.check(entry["boundary"], "primary", f"the merger's output `{last}`: {why}")
    return entry


def used_layers(w: _Writer, e: _Encoder, count: str, feature: object, group: str,
                layers: list[dict[str, Any]], parts: VisionParts) -> str | None:
    """The units of tower `group` under the config's `vision_feature_layer` (`feature`): the
    derived `vision_used` when layers after the one read exist, their copies of the layer
    groups appended to `layers` (static role `<group>_unused`); `count` when every layer is
    read; None when `feature` is no single layer index within the tower."""
    total = w.values[count]
    if isinstance(feature, bool) or not isinstance(feature, int) or \
            not -total - 1 <= feature <= total:
        return None
    used = feature if feature >= 0 else total + 1 + feature
    if used == total:
        return count
    if used < 1 or any("when" in g or "for" in g for g in layers):
        return None
    name, role = e.stem + "used", f"{group}_unused"
    parts.derived[name] = (f"vision_feature_layer if vision_feature_layer >= 0 "
                           f"else {count} + 1 + vision_feature_layer")
    parts.config["vision_feature_layer"] = Flow(type="int", default=-2)
    parts.statics[role] = Flow(stage=Flow({"with": group, "unit": "last"}))
    layers += [_unused(g, group, role, count, name) for g in list(layers)]
    return name


def _unused(group: dict[str, Any], label: str, role: str, count: str, used: str
            ) -> dict[str, Any]:
    """A layer group's copy for the layers after `used`: named `<role>.{layer}...`, owned by
    the static role, over `for: {layer: count - used}`, its modules at `{used + layer}`."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "name":
            out[key] = Quoted(str(value).replace(f"{label}.{{unit}}", f"{role}.{{layer}}", 1))
        elif key == "owner":
            out[key] = Flow(static=role)
            out["for"] = Flow(layer=f"{count} - {used}")
        else:
            out[key] = _renumbered(value, f"{{{used} + layer}}")
    return out


def _renumbered(value: Any, unit: str) -> Any:
    """`value` (a group's node) with every `{unit}` in its strings written `unit`."""
    if isinstance(value, Quoted):
        return Quoted(str(value).replace("{unit}", unit))
    if isinstance(value, str):
        return value.replace("{unit}", unit)
    if isinstance(value, Flow):
        return Flow({k: _renumbered(v, unit) for k, v in value.items()})
    if isinstance(value, FlowList):
        return FlowList(_renumbered(v, unit) for v in value)
    if isinstance(value, Mapping):
        return {k: _renumbered(v, unit) for k, v in value.items()}
    if isinstance(value, list):
        return [_renumbered(v, unit) for v in value]
    return value
