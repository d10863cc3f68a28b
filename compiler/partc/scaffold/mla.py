"""`partc init`: multi-head latent attention (DeepSeek-V2/V3's MLA).

The low-rank `q_a_proj` / `kv_a_proj_with_mqa` and their norms compute one latent every head
reads: one replicated group (`attention.latent`). The heads' `q_b_proj` (or `q_proj` without
query compression) and `kv_b_proj` hold a block of rows per head and `o_proj` a block of columns
per head: one group split by heads (`attention.heads`), as architectures/deepseek_v2.yaml
declares them. Every shape is written as the expression over the config's MLA widths
(`qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `kv_lora_rank`, `q_lora_rank`); a block
whose shapes are not those, or whose weights carry a quantized format's companions (FP8's
`weight_scale_inv`, split by the family's linear format), is left to the other recognisers
(replicated, marked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partc.scaffold.decisions import _evaluate, _signature_params
from partc.scaffold.fused import Blocks, _projection, _weight
from partc.scaffold.layer_table import _Module
from partc.scaffold.yaml_writer import Quoted

_HEADS = "num_attention_heads"
_Q_ROWS = f"{_HEADS} * (qk_nope_head_dim + qk_rope_head_dim)"
_KV_ROWS = f"{_HEADS} * (qk_nope_head_dim + v_head_dim)"
_O_COLS = f"{_HEADS} * v_head_dim"
_KV_A = "kv_lora_rank + qk_rope_head_dim"


def mla_attention(blocks: Blocks, groups: list[dict[str, Any]], done: set[str]) -> None:
    """Append the latent and heads groups of an MLA `self_attn` not `done` (adding it)."""
    block = "self_attn"
    leaves = {m.rpartition(".")[2]: e for m, e in blocks.table.items()
              if m.rpartition(".")[0] == block and m not in done}
    query = ("q_a_proj", "q_a_layernorm", "q_b_proj") if "q_b_proj" in leaves else ("q_proj",)
    names = (*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    if set(leaves) != set(names) or not _fits(blocks, leaves, query):
        return
    w, entries = blocks.w, [leaves[n] for n in names]
    if any(e.experts is not None or e.differs or e.layers != entries[0].layers
           or set(e.params) - {"weight", "bias"} for e in entries):
        return  # a quantized format's companions (FP8's weight_scale_inv) are not split so
    latent = blocks._group(groups, "layers.{unit}.attention.latent", "replicated", "1",
                           entries[0])
    del latent["units"]
    projections: list[dict[str, Any]] = []
    latent["projections"] = projections
    for leaf, rows, norm, width in (
            ("q_a_proj", "q_lora_rank", "q_a_layernorm", "q_lora_rank"),
            ("kv_a_proj_with_mqa", _KV_A, "kv_a_layernorm", "kv_lora_rank")):
        if leaf in leaves:
            projections.append(_projection(w, blocks.unit, block, leaf, leaves[leaf],
                                           "replicated", rows, "hidden_size", False))
        if norm in leaves:
            projection = {"module": Quoted(f"{blocks.unit}.{block}.{norm}"),
                          "sharding": "replicated", "linear": False}
            w.params(projection, _signature_params(w, f"{block}.{norm}", leaves[norm].params,
                                                   None, None, axes=[width]), f"{block}.{norm}")
            projections.append(projection)
    heads = blocks._group(groups, "layers.{unit}.attention.heads", "attention_heads", _HEADS,
                          entries[0])
    q = query[-1]
    heads["projections"] = [
        _projection(w, blocks.unit, block, q, leaves[q], "column", _Q_ROWS,
                    "q_lora_rank" if q == "q_b_proj" else "hidden_size", False, heads=_HEADS),
        _projection(w, blocks.unit, block, "kv_b_proj", leaves["kv_b_proj"], "column",
                    _KV_ROWS, "kv_lora_rank", False, heads=_HEADS),
        _projection(w, blocks.unit, block, "o_proj", leaves["o_proj"], "row", "hidden_size",
                    _O_COLS, False, heads=_HEADS)]
    done.update(f"{block}.{n}" for n in names)


def _fits(blocks: Blocks, leaves: Mapping[str, _Module], query: tuple[str, ...]) -> bool:
    """Whether the projections' weights have the shapes MLA's config widths give them."""
    expected = {"kv_a_proj_with_mqa": (_KV_A, "hidden_size"),
                "kv_b_proj": (_KV_ROWS, "kv_lora_rank"), "o_proj": ("hidden_size", _O_COLS),
                query[-1]: (_Q_ROWS, "q_lora_rank" if len(query) > 1 else "hidden_size")}
    if len(query) > 1:
        expected["q_a_proj"] = ("q_lora_rank", "hidden_size")
    values = blocks.w.values
    return all(_weight(leaves[leaf]) == [_evaluate(rows, values), _evaluate(cols, values)]
               for leaf, (rows, cols) in expected.items())
