"""`partc init`: a layer repetition's tensors grouped into modules, and the names it knows.

A layer's tensors grouped by module (`_modules`), routed experts folded into one
`experts.{expert}` module (`_layer_modules`), every module of any layer with the layers that hold
it (`_layer_table`); and the names the scaffold recognises: Llama-style attention and MLP
projections, packed quantized params, norms and position embeddings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_EXPERT = re.compile(r"^(?P<pre>(?:.*\.)?experts)\.(?P<e>0|[1-9][0-9]*)\.(?P<rest>.+)$",
                     re.DOTALL)


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


def _is_norm(leaf: str) -> bool:
    """A normalisation module's name: `norm`, `input_layernorm`, GPT-2's `ln_1`, `ln_f`."""
    return "norm" in leaf or leaf.startswith("ln_")


def _positional(leaf: str) -> bool:
    """A learned position embedding's name: GPT-2's `wpe`, `embed_positions`."""
    return leaf == "wpe" or "position" in leaf
