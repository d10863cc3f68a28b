"""`partc init`: a two-linear MLP outside the layers (a projector, a vision tower's merger),
split as one.

LLaVA's `multi_modal_projector.linear_1` [M, vision width] and `linear_2` [out, M] (GELU
between) are one `feed_forward_intermediate` group over M (architectures/llava.yaml): the first
column, the second row, each rank computing M / T of the middle channels; so is Qwen2-VL's
`merger.mlp.0` / `.2`, whose M is the tower's width times its spatial merge size squared
(architectures/qwen2_vl.yaml's merged_width), written as that product of config fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.decisions import _signature_params, _Writer
from partc.scaffold.yaml_writer import Flow, Quoted


def two_linear_projector(w: _Writer, name: str, modules: Mapping[str, dict[str, Any]],
                         front: list[dict[str, Any]], owner: Flow | None = None) -> set[str]:
    """The group `name` (appended to `front`, owned by `owner`, default the projector's
    unit) when `modules` are two dense linears, the second reading the first's output; the
    modules written (none otherwise)."""
    if len(modules) != 2 or any(set(p) - {"weight", "bias"} or len(p.get(
            "weight", ("", []))[1]) != 2 for p in modules.values()):
        return set()
    first, second = sorted(modules)
    (middle, _), (_, into) = modules[first]["weight"][1], modules[second]["weight"][1]
    if middle != into:
        return set()
    names, prefer = w.vocabulary(first)
    units, why = w.resolve(None, middle, names=names, prefer=prefer)
    if why is not None or not units.isidentifier():
        units = _merged(w, middle) or ""
    if not units:
        return set()
    w.used.update(units.split(" * "))
    group: dict[str, Any] = {"name": Quoted(name) if owner else name,
                             "role": "feed_forward_intermediate",
                             "owner": owner or Flow(unit="projector"), "units": units}
    projections = []
    for module, sharding in ((first, "column"), (second, "row")):
        projection: dict[str, Any] = {"module": Quoted(module), "sharding": sharding}
        cols = modules[module]["weight"][1][1]
        w.params(projection, _signature_params(
            w, module, modules[module], units if sharding == "column" else None,
            units if sharding == "row" or cols == middle else None), module)
        projections.append(projection)
    group["projections"] = projections
    front.append(group)
    return {first, second}


def _merged(w: _Writer, middle: int) -> str | None:
    """`width * k * k` when the width `middle` is a width field's times a field's square (a
    patch merger concatenating k x k patches), the first such pair in `w.dimensions` order."""
    fields = [n for n in w.dimensions if w.values.get(n, 0) > 1]
    return next((f"{width} * {k} * {k}" for width in fields for k in fields
                 if width != k and w.values[width] * w.values[k] ** 2 == middle), None)
