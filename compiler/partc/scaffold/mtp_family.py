"""`partc init`: multi-token-prediction layers (DeepSeek-V3's and GLM-4-MoE's MTP).

A config with `num_nextn_predict_layers` = K declares K MTP layers after the decoder's N: the
released checkpoint holds them as `model.layers.{N + i}` (a decoder layer's modules plus
`embed_tokens`, `enorm`, `hnorm`, `eh_proj` and `shared_head.{norm,head}`), a checkpoint
transformers saved holds none (it drops them on load). The survey takes such layers out of the
decoder's repetition (`split_mtp`: they would read as an extra decoder layer holding modules
the others lack); the scaffold writes them as architectures/deepseek_v3.yaml does
(`mtp_groups`): an `mtp` execution group after the decoder with units only when the checkpoint
holds its first layer (`mtp_in_checkpoint`, a `present:` field), the layer's attention, MLP and
expert groups written as the decoder's are, the embedding and `shared_head.head` split by
vocabulary rows, `eh_proj` ([2H] -> [H], applied once per token) and the norms replicated.
Without MTP layers in the checkpoint, the layer is written as the decoder's last layer plus the
glue at the config's widths, marked CHECK.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from partc.scaffold.decisions import _signature_params, _Writer
from partc.scaffold.dense_twin import Signature
from partc.scaffold.fused import Blocks
from partc.scaffold.layer_table import _layer_table
from partc.scaffold.mtp_survey import MTP_FIELD, _config_int, _is_glue
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

PRESENT_FIELD = "mtp_in_checkpoint"
"""The family's bool field: whether the checkpoint holds the first MTP layer."""

_VOCABULARY = ("embed_tokens", "shared_head.head")
"""The glue modules split by vocabulary rows, as the decoder's embedding and head."""


@dataclass(slots=True)
class Mtp:
    """What the scaffold writes for the MTP layers beside their parameter groups."""

    graph: list[dict[str, Any]] = field(default_factory=list)
    """The `mtp` graph entry."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The config fields it reads (`num_nextn_predict_layers`, `mtp_in_checkpoint`)."""
    guessed: str | None = None
    """Why the layers are a guess (the checkpoint holds none), marked on `mtp_in_checkpoint`."""

    def declare(self, w: _Writer, fields: dict[str, Any]) -> None:
        """Add the config fields to the family's `fields`, the guess marked."""
        fields.update(self.fields)
        if self.guessed is not None:
            w.check(fields, PRESENT_FIELD, self.guessed)


def _synthesized(w: _Writer, last: Mapping[str, Signature]) -> dict[int, dict[str, Signature]]:
    """An MTP layer as the decoder's last layer (`last`) plus the glue at the config's widths,
    for a checkpoint that holds none (empty without `hidden_size` and `vocab_size`)."""
    hidden, vocab = w.values.get("hidden_size"), w.values.get("vocab_size")
    if not hidden or not vocab:
        return {}
    dtype = w.default_dtype or "F32"
    glue = {"embed_tokens.weight": [vocab, hidden], "enorm.weight": [hidden],
            "hnorm.weight": [hidden], "eh_proj.weight": [hidden, 2 * hidden],
            "shared_head.norm.weight": [hidden], "shared_head.head.weight": [vocab, hidden]}
    return {0: {**last, **{name: (dtype, shape) for name, shape in glue.items()}}}


def mtp_groups(w: _Writer, config: Mapping[str, Any], prefix: str,
               layers: dict[int, dict[str, Signature]], decoder: Mapping[int, Any],
               blocks: Blocks, groups: list[dict[str, Any]],
               layer_groups: Callable[..., None]) -> Mtp | None:
    """The MTP layers' groups (appended to `groups`), graph entry and config fields, for a
    config declaring some (None otherwise): `layers` are the checkpoint's (`split_mtp`),
    `decoder` the decoder's layers, `blocks` the decoder's (its layout choices and proofs),
    `layer_groups` what writes a layer's groups (`partc.scaffold.layer_groups._layer_groups`)."""
    count = _config_int(config, MTP_FIELD)
    if count <= 0 or not decoder:
        return None
    held = bool(layers)
    if not held:
        layers = _synthesized(w, decoder[max(decoder)])
        if not layers:
            return None
    table = _layer_table(layers)
    unit = f"{prefix}.{{unit}}"
    block = {m: e for m, e in table.items() if not _is_glue(m)}
    mine = Blocks(w, unit, block, blocks.choices, blocks.proofs)  # its open layouts: the decoder's
    every, w.all_layers = w.all_layers, set(layers)
    start = len(groups)
    try:
        layer_groups(w, groups, prefix, block, others=mine)
    finally:
        w.all_layers = every
    moved = f"{prefix}.{{num_hidden_layers + unit}}"
    for group in groups[start:]:
        _move(group, f"{unit}.", f"{moved}.")
        group["name"] = Quoted("mtp." + str(group["name"]).split(".", 1)[-1])
        group["owner"]["unit"] = "mtp"
    for module in sorted(m for m in table if _is_glue(m)):
        groups.append(_glue_group(w, module, table[module].params, moved))
    tensors = sorted(t for t in layers[min(layers)] if _is_glue(t))
    present = "eh_proj.weight" if "eh_proj.weight" in tensors else tensors[0]
    entry: dict[str, Any] = Flow(group="mtp", units=f"{MTP_FIELD} if {PRESENT_FIELD} else 0",
                                 path=Quoted(moved), state=True, after=FlowList(["decoder"]))
    out = Mtp(graph=[entry], fields={
        MTP_FIELD: Flow(type="int", default=0),
        PRESENT_FIELD: Flow(type="bool", default=False,
                            present=Quoted(f"{prefix}.{{num_hidden_layers}}.{present}"))})
    if not held:
        out.guessed = (f"the config declares {MTP_FIELD} = {count} MTP layer(s) the "
                       "checkpoint does not hold: planned only with a checkpoint that holds "
                       "them, each written as the decoder's last layer plus DeepSeek's "
                       "embed_tokens, enorm, hnorm, eh_proj and shared_head at the config's "
                       "widths")
    return out


def _move(node: Any, old: str, new: str) -> None:
    """Every string of `node` (a group, in place) starting with `old` made to start with
    `new`: a decoder layer's module templates made the MTP layer's."""
    items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
    for key, value in items:
        if isinstance(value, str) and value.startswith(old):
            node[key] = Quoted(new + value[len(old):])
        elif isinstance(value, dict | list):
            _move(value, old, new)


def _glue_group(w: _Writer, module: str, params: Mapping[str, Signature], path: str
                ) -> dict[str, Any]:
    """The group of an MTP glue module: the embedding and head split by vocabulary rows as
    the decoder's, `eh_proj` and the norms replicated (`eh_proj` not a linear weight of a
    quantized format unless the checkpoint stores it so)."""
    role = "vocabulary" if module in _VOCABULARY else "replicated"
    group: dict[str, Any] = {"name": Quoted(f"mtp.{{unit}}.{module}"), "role": role,
                             "owner": Flow(unit="mtp")}
    if module in _VOCABULARY:
        group.update(module=Quoted(f"{path}.{module}"), sharding=Flow(balanced=0))
        w.params(group, _signature_params(w, module, params, "vocab_size", "hidden_size"),
                 module)
    elif module == "eh_proj":
        projection: dict[str, Any] = {"module": Quoted(f"{path}.{module}"),
                                      "sharding": "replicated"}
        if set(params) <= {"weight", "bias"}:
            projection["linear"] = False
        w.params(projection, _signature_params(w, module, params, "hidden_size",
                                               "2 * hidden_size"), module)
        group["projections"] = [projection]
    else:
        group.update(module=Quoted(f"{path}.{module}"), sharding="replicated")
        w.params(group, _signature_params(w, module, params, None, None,
                                          prefer=("hidden_size",)), module)
    return group
