"""`partc init`: a vision-language projector that is a two-linear MLP, split as one.

LLaVA's `multi_modal_projector.linear_1` [M, vision width] and `linear_2` [out, M] (GELU
between) are one `feed_forward_intermediate` group over M (architectures/llava.yaml): the first
column, the second row, each rank computing M / T of the middle channels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.decisions import _signature_params, _Writer
from partc.scaffold.yaml_writer import Flow, Quoted


def two_linear_projector(w: _Writer, root: str, modules: Mapping[str, dict[str, Any]],
                         front: list[dict[str, Any]]) -> set[str]:
    """The projector's group (appended to `front`) when its modules are two dense linears,
    the second reading the first's output; the modules written (none otherwise)."""
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
        return set()
    group: dict[str, Any] = {"name": "projector", "role": "feed_forward_intermediate",
                             "owner": Flow(unit="projector"), "units": units}
    projections = []
    for module, sharding in ((first, "column"), (second, "row")):
        projection: dict[str, Any] = {"module": Quoted(module), "sharding": sharding}
        w.params(projection, _signature_params(
            w, module, modules[module], units if sharding == "column" else None,
            units if sharding == "row" else None), module)
        projections.append(projection)
    group["projections"] = projections
    front.append(group)
    return {first, second}
