"""`partc init`: attention and MLP blocks not named the Llama way, and the layouts their shapes
leave open.

A fused `[q | k | v]` projection (`qkv_proj`, `query_key_value`, GPT-2's `c_attn`, DBRX's
`Wqkv`) beside an output projection, separate `q/k/v_proj` beside an output named otherwise
than `o_proj` (Phi's `dense`), an up/down pair (`fc1`/`fc2`, `dense_h_to_4h`/`dense_4h_to_h`,
`c_fc`/`c_proj`, `fc_in`/`fc_out`) or a fused `gate_up_proj` beside its down projection: each is
one split group. What the header cannot tell is a list of candidates (`Candidate`), each a
declaration the language has (docs/layouts.md): the fused row order (component-major, per head,
per KV group, or `groups` blocks of their own) and the weights' orientation (`[out, in]`, or
Conv1D's `[in, out]`) where a square weight leaves it open. The scaffold writes the candidate
`choices` names (the first by default) and marks it CHECK unless `partc init --prove`
(`partc.scaffold.prove`) found the one `partc verify` accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partc.family.expr import parse
from partc.scaffold.config_values import _HEADS
from partc.scaffold.decisions import _signature_params, _Writer
from partc.scaffold.layer_table import _PACKED, _Module
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

_FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "qkv", "W_pack")
"""Names of a fused `[q | k | v]` projection."""

_OUTPUTS = ("o_proj", "dense", "out_proj", "c_proj")
"""Names of an attention block's output projection."""

_UPS = ("fc1", "fc_in", "c_fc", "dense_h_to_4h", "up_proj", "w1")
"""Names of an MLP's up (column) projection, when it has no gate."""

_DOWNS = ("fc2", "fc_out", "c_proj", "dense_4h_to_h", "down_proj", "w2")
"""Names of an MLP's down (row) projection."""

_NORMS = {"norms": "whole-width norms replicated",
          "reduced": "whole-width norms in the group, reduction: tensor_parallel"}
"""The candidates of an attention group beside norms as wide as a projection's output
(OLMo 2's q_norm and k_norm), by layout name."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One declaration of an open group: its fused layout and its weights' orientation."""

    layout: str
    """`component_major`, `per_head`, `grouped_per_kv` or `grouped`; `plain` without a fused
    projection."""
    groups: int | None = None
    """The group count of `grouped`."""
    in_out: bool = False
    """The weights stored `[in, out]` (Conv1D)."""

    @property
    def label(self) -> str:
        """How the candidate is named in comments and reports."""
        if self.layout == "plain":
            return "[in, out]" if self.in_out else "[out, in]"
        if self.layout in _NORMS:
            return _NORMS[self.layout]
        text = self.layout + (f" ({self.groups} groups)" if self.groups else "")
        return text + (", [in, out]" if self.in_out else "")


@dataclass(frozen=True, slots=True)
class OpenLayout:
    """A group whose declaration the header leaves open, with the candidates tried in order."""

    group: str
    """Its name as written (`layers.{unit}.attention`)."""
    module: str
    """The module the choice is about (the fused projection, or the block's first)."""
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True, slots=True)
class Proof:
    """What `partc init --prove` found for one open group."""

    chosen: int | None
    """The candidate verify accepted, or None when none did."""
    text: str
    """The comment written: the sizes verified and the candidates refused, or verify's
    finding."""


def _weight(entry: _Module) -> list[int] | None:
    shape = entry.params.get("weight", ("", []))[1]
    return list(shape) if len(shape) == 2 else None


def _orientations(pairs: Sequence[tuple[list[int], int | None, int | None]]) -> list[bool]:
    """The orientations (`in_out`) that fit every (weight shape, out, in) pair; None: any."""
    fits = []
    for in_out in (False, True):
        if all((o is None or shape[1 if in_out else 0] == o) and
               (i is None or shape[0 if in_out else 1] == i) for shape, o, i in pairs):
            fits.append(in_out)
    return fits


def _oriented(w: _Writer, module: str, entry: _Module, out: str, into: str, in_out: bool
              ) -> dict[str, tuple[list[str], str, list[str]]]:
    """A projection's params: its weight `[out, in]` (or `[in, out]`), its bias `[out]`."""
    weight = {"weight": entry.params["weight"]}
    rest = {k: v for k, v in entry.params.items() if k != "weight"}
    found = _signature_params(w, module, weight, into if in_out else out,
                              out if in_out else into)
    found.update(_signature_params(w, module, rest, out, None))
    return found


def _projection(w: _Writer, unit: str, block: str, leaf: str, entry: _Module, sharding: str,
                out: str, into: str, in_out: bool, heads: str | None = None
                ) -> dict[str, Any]:
    projection: dict[str, Any] = {"module": Quoted(f"{unit}.{block}.{leaf}"),
                                  "sharding": sharding}
    if in_out:
        projection["orientation"] = "in_out"
    if heads is not None:
        projection["heads"] = heads
    w.params(projection, _oriented(w, f"{block}.{leaf}", entry, out, into, in_out),
             f"{block}.{leaf}")
    return projection


def _same_scope(entries: Sequence[_Module]) -> bool:
    return all(e.experts is None and not _PACKED & set(e.params) and not e.differs and
               e.layers == entries[0].layers for e in entries)


def _kv_name(w: _Writer, kv: int, heads: int) -> str | None:
    """The config field of the KV head count: the query heads' when equal, else a field named
    like one (`num_key_value_heads`, Falcon's `num_kv_heads`) of that value."""
    if kv == heads:
        return "num_attention_heads"
    names = [n for n in w.values if "kv" in n or "key_value" in n]
    return next((n for n in sorted(names, key=lambda n: n != "num_key_value_heads")
                 if w.values[n] == kv and n in w.dimensions), None)


def attention_candidates(heads: int, kv: int, orientations: Sequence[bool]
                         ) -> tuple[Candidate, ...]:
    """The fused layouts the language has for `heads` query and `kv` KV heads, per
    orientation: component-major, per head (as many KV heads as query heads), per KV group
    (fewer), and `grouped` over each group count that puts whole heads in every group."""
    layouts: list[tuple[str, int | None]] = [("component_major", None)]
    if kv == heads:
        layouts.append(("per_head", None))
        layouts += [("grouped", g) for g in range(2, heads) if heads % g == 0]
    elif kv > 1:
        layouts.append(("grouped_per_kv", None))
    return tuple(Candidate(layout, groups, in_out) for in_out in orientations
                 for layout, groups in layouts)


def _fused_entries(c: Candidate, kv_name: str, same: bool
                   ) -> tuple[list[str], list[str] | str]:
    """The `segments` and `heads` of a fused q/k/v projection under candidate `c`."""
    q, k = "num_attention_heads", kv_name
    if c.layout == "per_head":
        return ["head_dim"] * 3, [q]
    if c.layout == "grouped_per_kv":
        return [f"{q} // {k} * head_dim", "head_dim", "head_dim"], [q, k, k]
    if c.layout == "grouped":
        return [f"{q} // {c.groups} * head_dim"] * 3, [q]
    return ([f"{q} * head_dim"] + [f"{k} * head_dim"] * 2), [q, k, k] if not same else [q] * 3


class Blocks:
    """The groups of a repetition's attention and MLP blocks not named the Llama way."""

    def __init__(self, w: _Writer, unit: str, table: Mapping[str, _Module],
                 choices: Mapping[str, int], proofs: Mapping[str, Proof]) -> None:
        self.w, self.unit, self.table = w, unit, table
        self.choices, self.proofs = choices, proofs
        self.open: list[OpenLayout] = []
        """The groups written whose declaration the header leaves open."""

    def write(self, groups: list[dict[str, Any]], done: set[str]) -> None:
        """Append a group per recognised block whose modules are not `done`, adding them."""
        blocks = sorted({m.rpartition(".")[0] for m in self.table if m not in done})
        for block in blocks:
            leaves = {m.rpartition(".")[2]: e for m, e in self.table.items()
                      if m.rpartition(".")[0] == block and m not in done
                      and _weight(e) is not None}
            name = block.rpartition(".")[2]
            if "attn" in name or "attention" in name:
                found = self._attention(groups, block, leaves)
            elif any(k in name for k in ("mlp", "ffn", "feed_forward")):
                found = self._mlp(groups, block, leaves)
            else:
                continue
            done.update(f"{block}.{leaf}" for leaf in found)

    def _group(self, groups: list[dict[str, Any]], name: str, role: str, units: str,
               entry: _Module) -> dict[str, Any]:
        group: dict[str, Any] = {"name": Quoted(name), "role": role,
                                 "owner": Flow(unit="decoder")}
        self.w.scope(group, name.split(".", 2)[-1], entry)
        group["units"] = units
        self.w.used.update(parse(units).names)
        groups.append(group)
        return group

    def _choose(self, group: dict[str, Any], module: str,
                candidates: tuple[Candidate, ...], key: str | None = None) -> Candidate:
        """The candidate written for `group` (the chosen one, else the first), with its
        comment: what --prove found, else a CHECK when there are several."""
        name = str(group["name"])
        if len(candidates) > 1:
            self.open.append(OpenLayout(name, module, candidates))
        proof = self.proofs.get(name)
        index = self.choices.get(name, 0)
        chosen = candidates[index if 0 <= index < len(candidates) else 0]
        last = key or list(group)[-1]
        if proof is not None and proof.chosen is not None:
            self.w.note(group, last, f"# partc init --prove: {chosen.label}: {proof.text}")
        elif proof is not None:
            self.w.note(group, last, f"# {chosen.label} written", f"no layout partc verify "
                        f"accepts: {proof.text}")
        elif len(candidates) > 1:
            tried = "; ".join(c.label for c in candidates)
            self.w.note(group, last, f"# {chosen.label} guessed", "the header leaves the "
                        f"layout of `{module}` open ({tried}): `partc init --prove` tries "
                        "each against transformers")
        return chosen

    def reduction(self, group: dict[str, Any], norms: Sequence[str]) -> bool:
        """Whether the attention `group` holds its whole-width `norms` (split with their
        projections, `reduction: tensor_parallel`) rather than leaving them replicated."""
        candidates = (Candidate("norms"), Candidate("reduced"))
        return self._choose(group, ", ".join(norms), candidates, "units").layout == "reduced"

    def _attention(self, groups: list[dict[str, Any]], block: str,
                   leaves: Mapping[str, _Module]) -> list[str]:
        w, values = self.w, self.w.values
        out = next((o for o in _OUTPUTS if o in leaves), None)
        fused = next((f for f in _FUSED_QKV if f in leaves), None)
        hidden, heads, dim = (values.get(n) for n in ("hidden_size", *_HEADS[::2]))
        if out is None or hidden is None or heads is None or dim is None:
            return []
        if fused is None:
            return self._separate(groups, block, leaves, out)
        entries = [leaves[fused], leaves[out]]
        if not _same_scope(entries):
            return []
        fw, ow = _weight(entries[0]), _weight(entries[1])
        assert fw is not None and ow is not None
        orientations = _orientations([(fw, None, hidden), (ow, hidden, heads * dim)])
        if not orientations:
            return []
        rows = fw[1] if orientations[0] else fw[0]
        kv2 = rows // dim - heads
        kv = kv2 // 2
        kv_name = _kv_name(w, kv, heads) if rows % dim == 0 and kv2 % 2 == 0 and kv > 0 \
            and heads % kv == 0 else None
        if kv_name is None:
            return []
        same = kv == heads
        group = self._group(groups, "layers.{unit}.attention", "attention_heads",
                            "num_attention_heads" if same else kv_name, entries[0])
        if not same:
            group["kv_replication"] = True
        candidates = attention_candidates(heads, kv, orientations)
        c = self._choose(group, f"{block}.{fused}", candidates)
        segments, seg_heads = _fused_entries(c, kv_name, same)
        total = "3 * num_attention_heads * head_dim" if same else \
            f"(num_attention_heads + 2 * {kv_name}) * head_dim"
        spec: dict[str, Any] = {"module": Quoted(f"{self.unit}.{block}.{fused}")}
        if c.layout != "component_major":
            spec["layout"] = c.layout
        if c.groups is not None:
            spec["groups"] = c.groups
            w.note(spec, "groups", "# no config field holds the group count: the model's "
                   "code fixes it (CodeGen's mp_num)")
        if c.in_out:
            spec["orientation"] = "in_out"
        spec["segments"] = FlowList(segments)
        spec["heads"] = FlowList(seg_heads)
        w.used.update(("num_attention_heads", "head_dim", kv_name))
        w.params(spec, _oriented(w, f"{block}.{fused}", entries[0], total, "hidden_size",
                                 c.in_out), f"{block}.{fused}")
        group["fused"] = spec
        output = _projection(w, self.unit, block, out, entries[1], "row", "hidden_size",
                             "num_attention_heads * head_dim", c.in_out,
                             heads="num_attention_heads")
        del output["sharding"]
        group["output"] = output
        return [fused, out]

    def _separate(self, groups: list[dict[str, Any]], block: str,
                  leaves: Mapping[str, _Module], out: str) -> list[str]:
        """Separate q/k/v projections beside an output not named `o_proj` (Phi's `dense`)."""
        names = ("q_proj", "k_proj", "v_proj")
        if out == "o_proj" or not all(n in leaves for n in names):
            return []
        entries = [leaves[n] for n in (*names, out)]
        if not _same_scope(entries):
            return []
        kv_rows = _weight(leaves["k_proj"])
        dim = self.w.values["head_dim"]
        heads = self.w.values["num_attention_heads"]
        kv_name = _kv_name(self.w, kv_rows[0] // dim, heads) if kv_rows else None
        if kv_name is None or kv_rows is None or kv_rows[0] % dim:
            return []
        group = self._group(groups, "layers.{unit}.attention", "attention_heads", kv_name,
                            entries[0])
        if kv_name != "num_attention_heads":
            group["kv_replication"] = True
        group["projections"] = [
            _projection(self.w, self.unit, block, n, leaves[n], "column", f"{h} * head_dim",
                        "hidden_size", False, heads=h)
            for n, h in zip(names, ("num_attention_heads", kv_name, kv_name), strict=True)] + [
            _projection(self.w, self.unit, block, out, leaves[out], "row", "hidden_size",
                        "num_attention_heads * head_dim", False, heads="num_attention_heads")]
        self.w.used.update(("num_attention_heads", "head_dim"))
        return [*names, out]

    def _mlp(self, groups: list[dict[str, Any]], block: str,
             leaves: Mapping[str, _Module]) -> list[str]:
        hidden = self.w.values.get("hidden_size")
        down = next((d for d in _DOWNS if d in leaves), None)
        fused = "gate_up_proj" if "gate_up_proj" in leaves else None
        up = fused or next((u for u in _UPS if u in leaves and u != down), None)
        if hidden is None or down is None or up is None or len(leaves) != 2:
            return []
        entries = [leaves[up], leaves[down]]
        uw, dw = _weight(entries[0]), _weight(entries[1])
        if not _same_scope(entries) or uw is None or dw is None:
            return []
        orientations = [o for o in _orientations([(uw, None, hidden), (dw, hidden, None)])
                        if (uw[1] if o else uw[0]) == (dw[0] if o else dw[1]) * (
                            2 if fused else 1)]
        if not orientations:
            return []
        width = dw[0] if orientations[0] else dw[1]
        names, prefer = self.w.vocabulary(block)
        units, why = self.w.resolve("intermediate_size", width, names=names, prefer=prefer)
        if not units.isidentifier() and width == 4 * hidden:
            units, why = "4 * hidden_size", None  # hard-wired (BLOOM), transformers' default
        elif not units.isidentifier():
            return []
        group = self._group(groups, f"layers.{{unit}}.{block}", "feed_forward_intermediate",
                            units, entries[0])
        if why is not None:
            self.w.check(group, "units", f"the intermediate size of `{block}`: {why}")
        candidates = tuple(Candidate(layout, None, o) for o in orientations for layout in (
            ("component_major", "per_head") if fused else ("plain",)))
        c = self._choose(group, f"{block}.{up}", candidates)
        if fused:
            spec: dict[str, Any] = {"module": Quoted(f"{self.unit}.{block}.{up}")}
            if c.layout == "per_head":  # gate and up rows interleaved, one pair per unit
                spec["layout"] = "per_head"
            if c.in_out:
                spec["orientation"] = "in_out"
            spec["segments"] = FlowList([1, 1] if c.layout == "per_head" else [units] * 2)
            if c.layout == "per_head":
                spec["heads"] = FlowList([units])
            self.w.params(spec, _oriented(self.w, f"{block}.{up}", entries[0],
                                          f"2 * {units}", "hidden_size", c.in_out),
                          f"{block}.{up}")
            group["fused"] = spec
            output = _projection(self.w, self.unit, block, down, entries[1], "row",
                                 "hidden_size", units, c.in_out)
            del output["sharding"]
            group["output"] = output
        else:
            group["projections"] = [
                _projection(self.w, self.unit, block, up, entries[0], "column", units,
                            "hidden_size", c.in_out),
                _projection(self.w, self.unit, block, down, entries[1], "row", "hidden_size",
                            units, c.in_out)]
        return [up, down]
