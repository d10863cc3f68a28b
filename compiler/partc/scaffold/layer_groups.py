"""`partc init`: the parameter groups of a repetition's layers.

Its attention and MLP blocks split by heads and intermediate units (Llama-style names, CLIP's,
Mixtral's experts; with `partc.scaffold.fused.Blocks`, also the blocks the other recognisers
write), per-head norms split with the heads, every other module replicated and, when the
scaffold cannot say why, marked CHECK (`_layer_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partc.scaffold.decisions import (
    _entry,
    _intermediate_names,
    _signature_params,
    _sized_like,
    _Writer,
)
from partc.scaffold.delta_net import delta_nets
from partc.scaffold.fused import Blocks
from partc.scaffold.layer_table import _ATTENTION, _MLP, _PACKED, _is_norm, _Module
from partc.scaffold.mla import mla_attention
from partc.scaffold.per_head import per_head_modules
from partc.scaffold.ssm import mamba_mixers
from partc.scaffold.ssm2 import mamba2_mixers
from partc.scaffold.stacked import stacked_experts
from partc.scaffold.yaml_writer import Flow, Quoted

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
