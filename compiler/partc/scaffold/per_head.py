"""`partc init`: an attention block's modules repeated once per head (StableLM's per-head
LayerNorms `self_attn.q_layernorm.norms.<h>`), split with the heads they belong to.

Modules `<block>.<name>.norms.0` .. `.norms.<N-1>` of equal params, N a head count the
attention's projections state, are one `{head}` projection of the attention group with
`sharding: per_head` (architectures/stablelm.yaml): a rank loads the modules of its own heads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from partc.scaffold.decisions import _signature_params, _Writer
from partc.scaffold.layer_table import _Module
from partc.scaffold.yaml_writer import Quoted

_NUMBERED = re.compile(r"^(?P<stem>self_attn\.[A-Za-z0-9_]+\.norms)\.(?P<h>0|[1-9][0-9]*)$")
"""A module of a per-head repetition inside the attention block, by name."""


def per_head_modules(w: _Writer, unit: str, table: Mapping[str, _Module], done: set[str],
                     projections: list[dict[str, Any]] | None) -> None:
    """Append a `per_head` projection to the attention's `projections` for each repetition
    of per-head modules not `done` (adding them)."""
    if projections is None:
        return
    found: dict[str, dict[int, str]] = {}
    for module in sorted(set(table) - done):
        match = _NUMBERED.match(module)
        if match:
            found.setdefault(match["stem"], {})[int(match["h"])] = module
    stated = [str(p["heads"]) for p in projections if "heads" in p]
    for stem, numbered in sorted(found.items()):
        entries = [table[numbered[h]] for h in sorted(numbered)]
        first = entries[0]
        heads = [n for n in dict.fromkeys(stated) if w.values.get(n) == len(numbered)]
        if sorted(numbered) != list(range(len(numbered))) or not heads or any(
                (e.params, e.layers, e.experts) != (first.params, first.layers, first.experts)
                or e.differs for e in entries):
            continue
        key = stem.split(".")[1].startswith("k")  # k_layernorm: the KV heads', when equal
        name = next((n for n in heads if ("key_value" in n or "kv" in n) == key), heads[0])
        projection: dict[str, Any] = {"module": Quoted(f"{unit}.{stem}.{{head}}"),
                                      "sharding": "per_head", "heads": name}
        w.params(projection, _signature_params(w, stem, first.params, None, None,
                                               prefer=("head_dim",)), stem)
        projections.append(projection)
        w.used.add(name)
        done.update(numbered.values())
