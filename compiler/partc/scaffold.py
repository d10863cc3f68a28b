"""`partc init`: a family scaffold guessed from a checkpoint header and its config.json.

It recognises the layer repetition (`<prefix>.layers.<n>.`, GPT-2's `<prefix>.h.<n>.`), the
common Llama-style projection names (q/k/v/o, gate/up/down, also of shared and routed experts),
expert repetition (`experts.<e>.`), norms (`ln_1` too), the token embedding and what the first
stage uses beside it (position embeddings), and a tied or untied head; config fields nested
under `text_config`, or spelled GPT-2's way (`n_embd`, `n_layer`), are read with `from:`. A
part found in only some layers gets a `when:` over the layer numbers. Anything else is kept
as a replicated group with literal shapes and marked `# partc init: CHECK`, so that the
scaffold still owns every tensor and passes `partc check` as written; what it cannot write so
that it does (a tensor whose shape differs between layers) is marked too and said in
`Scaffold.notes`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.front.load import MAX_CONFIG_BYTES, decode_text, parse_json, read_bytes
from partc.parallel.placements import TORCH_DTYPE_NAMES
from partc.runtime.checkpoint import open_checkpoint

CHECK = "# partc init: CHECK"
"""The comment on every line the scaffold could not decide."""
SCHEMA_COMMENT = "# yaml-language-server: $schema="
"""The editor line (see docs/authoring.md, "Editor support"), followed by the schema's path."""
_LAYER = re.compile(r"^(?P<prefix>(?:.*?\.)??(?:layers|h))\.(?P<n>\d+)\.(?P<rest>.+)$")
"""A tensor of the layer repetition: `model.layers.3.`, or GPT-2/BLOOM/Falcon's `transformer.h.3.`
(the first such name from the left; a vision tower's `blocks.<n>` stay outside, as its own)."""
_EXPERT = re.compile(r"^(?P<pre>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
_DIMENSIONS = ("hidden_size", "intermediate_size", "vocab_size", "moe_intermediate_size",
               "shared_expert_intermediate_size")
"""Config names a literal dimension is matched against, first match wins."""
_EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
"""Config names an expert count is matched against."""
_NESTED = ("text_config",)
"""Config sections whose fields are read (with `from:`) when the top level lacks them."""
_ALIASES = {"hidden_size": ("n_embd",), "num_attention_heads": ("n_head",),
            "num_hidden_layers": ("n_layer",), "intermediate_size": ("n_inner",)}
"""The names GPT-2 and BLOOM configs use instead (transformers' `attribute_map`), read with
`from:` when the config lacks the usual one."""

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


@dataclass(frozen=True, slots=True)
class Scaffold:
    """The family text and the tensors (or decisions) it marked for a person to check."""

    text: str
    """The YAML family."""
    undecided: tuple[str, ...]
    """What the scaffold could not decide, one entry per CHECK comment."""
    notes: tuple[str, ...] = ()
    """What the user should know before running `partc check` (said on the console too)."""


def _values(config: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, str]]:
    """The config names the scaffold's expressions use, with their defaults, and where each
    is read (`hidden_size`, or `text_config.hidden_size` when only that section has it)."""
    sources: dict[str, str] = {}

    def number(key: str, default: int | None = None) -> int | None:
        for name in (key, *_ALIASES.get(key, ())):
            for where, section in (("", config), *((f"{n}.", config.get(n)) for n in _NESTED)):
                if isinstance(section, Mapping) and name in section:
                    value = section[name]
                    if isinstance(value, int) and not isinstance(value, bool):
                        sources[key] = where + name
                        return value
        return default

    hidden, heads = number("hidden_size"), number("num_attention_heads")
    out = {"hidden_size": hidden, "num_attention_heads": heads,
           "num_key_value_heads": number("num_key_value_heads", heads),
           "intermediate_size": number("intermediate_size"),
           "num_hidden_layers": number("num_hidden_layers"), "vocab_size": number("vocab_size")}
    out["head_dim"] = number("head_dim", hidden // heads if hidden and heads else None)
    for key in (*_DIMENSIONS, *_EXPERT_COUNTS):
        out.setdefault(key, number(key))
    return {k: v for k, v in out.items() if v is not None}, sources


def _evaluate(expression: str, values: Mapping[str, int]) -> int | None:
    """The value of `a` or `a * b` over config names (the only forms the scaffold writes)."""
    result = 1
    for name in expression.split(" * "):
        if name not in values:
            return None
        result *= values[name]
    return result


@dataclass(slots=True)
class _Module:
    """One module of the repeated layer: its params, the layers holding it and, for a module
    of every routed expert (`{expert}` in its name), the number of experts."""

    params: dict[str, tuple[str, list[int]]]
    layers: set[int]
    experts: int | None
    differs: list[int]
    """Layers where the module has other params, shapes or expert counts than in the first."""


class _Writer:
    def __init__(self, values: dict[str, int], default_dtype: str | None,
                 layers: Sequence[int]) -> None:
        self.values = values
        self.default_dtype = default_dtype
        self.all_layers = set(layers)
        self.lines: list[str] = []
        self.undecided: list[str] = []
        self.used: set[str] = set()
        self.conditional = 0
        """How many groups got a `when:` over layer numbers."""

    def dim(self, expected: str | None, actual: int, what: str) -> str:
        """A shape entry: the config expression when it matches the header, else the number."""
        if expected is not None and _evaluate(expected, self.values) == actual:
            self.used.update(expected.split(" * "))
            return expected
        for name in _DIMENSIONS:
            if self.values.get(name) == actual:
                self.used.add(name)
                return name
        return str(actual)

    def params(self, entries: Mapping[str, tuple[list[str], str]], indent: str) -> None:
        items = []
        for name, (shape, dtype) in sorted(entries.items()):
            text = "[" + ", ".join(shape) + "]"
            if dtype != self.default_dtype:
                text = f"{{shape: {text}, dtype: {dtype}}}"
            items.append(f"{name}: {text}")
        if len(items) == 1:
            self.lines.append(f"{indent}params: {{{items[0]}}}")
        else:
            self.lines.append(f"{indent}params:")
            self.lines += [f"{indent}  {item}" for item in items]

    def check(self, line: str, why: str) -> None:
        self.lines.append(f"{line}  {CHECK}: {why}")
        self.undecided.append(why)

    def scope(self, module: str, entry: _Module, differs: Sequence[int] = ()) -> None:
        """The `when:` and `for:` lines of a layer group: the layers and experts it covers
        (`differs`: more layers where a module of the group has other params)."""
        if entry.layers != self.all_layers:
            self.conditional += 1
            self.check(f'    when: "{_condition(entry.layers, self.all_layers)}"',
                       f"`{module}` is only in {_layers(entry.layers)} of layers "
                       f"{_spelled(self.all_layers)}: the condition follows this checkpoint; "
                       "write it over config fields")
        if entry.experts is not None:
            count = next((n for n in _EXPERT_COUNTS if self.values.get(n) == entry.experts),
                         None)
            if count is None:
                self.check(f"    for: {{expert: {entry.experts}}}", "the number of experts is "
                           "no config field the scaffold knows: write it as one")
            else:
                self.used.add(count)
                self.lines.append(f"    for: {{expert: {count}}}")
        if entry.differs or differs:
            self.check(f"    # {_layers({*entry.differs, *differs})} hold(s) `{module}` with other "
                       "params, shapes or expert counts", "this group fits the first layers "
                       "only: split it by layer, `partc check` fails until then")


def _runs(numbers: set[int]) -> list[tuple[int, int]]:
    """Ascending numbers as (first, last) runs of consecutive ones."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and runs[-1][1] + 1 == n:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return [(a, b) for a, b in runs]


def _spelled(numbers: set[int]) -> str:
    """`0-2, 5`."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _runs(numbers))


def _layers(numbers: set[int]) -> str:
    """`layer 3` or `layers 0-2, 5`."""
    return f"layer{'s' if len(numbers) > 1 else ''} {_spelled(numbers)}"


def _condition(layers: set[int], every: set[int]) -> str:
    """A `when:` over `unit` that holds exactly for `layers` among `every` layer."""
    first, last = min(every), max(every)
    parts = []
    for a, b in _runs(layers):
        if a == b:
            parts.append(f"unit == {a}")
        elif a == first:
            parts.append(f"unit <= {b}")
        elif b == last:
            parts.append(f"unit >= {a}")
        else:
            parts.append(f"unit >= {a} and unit <= {b}")
    return " or ".join(parts)


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


def _read_config(path: Path) -> dict[str, Any]:
    raw = read_bytes(path, "config.json", MAX_CONFIG_BYTES)
    document = parse_json(str(path), decode_text(raw, str(path), "config.json"), "config.json")
    if not isinstance(document.data, dict):
        raise LoadError(f"{path} is not a JSON object", location=SourceLocation(str(path)))
    return document.data


def scaffold(checkpoint: Path, config_path: Path, *, name: str | None = None) -> Scaffold:
    """A family for the checkpoint: Llama-like parts recognised, the rest marked CHECK."""
    config = _read_config(config_path)
    opened = open_checkpoint(checkpoint)
    header: dict[str, tuple[str, list[int]]] = {}
    for tensor in opened.names:
        found = opened.signature(tensor)
        assert found is not None
        header[tensor] = (found[1], list(found[2]))
    model_type = str(config.get("model_type") or "unknown")
    family = name or re.sub(r"^(?=\d)", "_", re.sub(r"[^A-Za-z0-9_]", "_", model_type))[:128]
    torch_dtype = config.get("torch_dtype") or config.get("dtype")
    default = TORCH_DTYPE_NAMES.get(str(torch_dtype)) if torch_dtype else None
    values, sources = _values(config)
    layers: dict[str, dict[int, dict[str, tuple[str, list[int]]]]] = {}
    outside: dict[str, tuple[str, list[int]]] = {}
    for tensor, signature in header.items():
        match = _LAYER.match(tensor)
        if match:
            layers.setdefault(match["prefix"], {}).setdefault(int(match["n"]), {})[
                match["rest"]] = signature
        else:
            outside[tensor] = signature
    if len(layers) != 1:
        raise LoadError(f"partc init recognises one `<prefix>.layers.<n>.` (or `.h.<n>.`) "
                        "repetition; "
                        f"{checkpoint} has {len(layers)} ({', '.join(sorted(layers)) or 'none'})",
                        location=SourceLocation(str(checkpoint)))
    (prefix, by_layer), = layers.items()
    count = len(by_layer)
    w = _Writer(values, default or "F32", sorted(by_layer))
    w.lines += [f"# Family scaffold written by `partc init` from {checkpoint.name} "
                f"({len(header)} tensors). Lines marked `{CHECK}` need a decision.", "",
                f"family: {family}",
                f"description: {model_type} decoder (scaffold; describe it here)",
                f"model_types: [{model_type}]", ""]
    body: list[str] = []
    w.lines, saved = body, w.lines
    table = _layer_table(by_layer)
    _layer_groups(w, prefix, table)
    w.lines = saved
    static = _static_groups(w, _modules(outside), _static_roles(_modules(outside), prefix))
    if "hidden_size" in values:
        w.used.add("hidden_size")  # the boundary's hidden dimension
    used = sorted(w.used | {"num_hidden_layers"})
    w.lines.append("config:")
    for key in used:
        w.lines.append(f"  {key}: {_config_field(key, sources.get(key, key))}")
    if values.get("num_hidden_layers") != count:
        w.check(f"  # the checkpoint has {count} layers", "num_hidden_layers differs from the "
                "header's layer count")
    w.lines += ["", "graph:", f'  - {{group: decoder, units: num_hidden_layers, path: '
                f'"{prefix}.{{unit}}", state: true}}', "", "static:",
                "  embedding: {stage: first}", "  final_norm: {stage: last}",
                "  output: {stage: last}", "", "parameters:"]
    w.lines += static[0] + body + static[1]
    w.lines += ["", "boundary:", f"  identity: {family}.hidden"]
    if "hidden_size" in values:
        w.lines.append("  primary: {role: hidden, shape: [batch, sequence, hidden_size], "
                       "dtype: activation}")
    else:
        w.check("  primary: {role: hidden, shape: [batch, sequence, HIDDEN], dtype: activation}",
                "the config has no hidden_size: write the hidden dimension (a config field)")
    w.lines += ["  auxiliary: []", ""]
    notes = []
    if w.conditional:
        notes.append(f"the layers hold different tensors: {w.conditional} group(s) apply to "
                     "some layers only, with a `when:` over layer numbers marked CHECK")
    if any(e.differs for e in table.values()):
        notes.append("some layers hold a module with other shapes than the first layer that "
                     "holds it: the scaffold does not pass `partc check` until those groups "
                     "are split by layer (marked CHECK)")
    from importlib import resources

    schema = Path(str(resources.files("partc.schemas").joinpath("architecture.schema.json")))
    text = SCHEMA_COMMENT + schema.resolve().as_uri() + "\n" + "\n".join(w.lines)
    return Scaffold(text=text, undecided=tuple(w.undecided), notes=tuple(notes))


def _config_field(key: str, source: str) -> str:
    """The declaration of config field `key`, read from `source` (a dotted path)."""
    default = {"num_key_value_heads": "num_attention_heads",
               "head_dim": "hidden_size // num_attention_heads"}.get(key)
    parts = ["type: int"] + ([f"from: {source}"] if source != key else []) + (
        [f"default: {default}"] if default else [])
    return "int" if parts == ["type: int"] else "{" + ", ".join(parts) + "}"


def _signature_params(w: _Writer, params: Mapping[str, tuple[str, list[int]]],
                      rows: str | None, cols: str | None) -> dict[str, tuple[list[str], str]]:
    out = {}
    for param, (dtype, shape) in params.items():
        expected = [rows, cols][:len(shape)] if param == "weight" else [rows]
        out[param] = ([w.dim(e, n, param) for e, n in zip(expected + [None] * len(shape),
                                                              shape, strict=False)], dtype)
    return out


_PACKED = frozenset({"scales", "biases", "qweight", "qzeros", "g_idx"})
"""Params of a packed quantized linear (MLX's `scales`/`biases`, GPTQ/AWQ's): its columns are
not the matrix's, so the scaffold cannot split it by heads as a dense one."""


def _block_groups(table: Mapping[str, _Module], block: str,
                  projections: Sequence[str]) -> bool:
    """Whether every projection of `block` is a dense module of the same layers and experts."""
    found = [table.get(f"{block}.{p}") for p in projections]
    return all(e is not None and not _PACKED & set(e.params) for e in found) and all(
        e is not None and found[0] is not None and (e.layers, e.experts) ==
        (found[0].layers, found[0].experts) for e in found)


def _layer_groups(w: _Writer, prefix: str, table: Mapping[str, _Module]) -> None:
    unit = f"{prefix}.{{unit}}"
    done: set[str] = set()
    blocks = [("self_attn", "attention")] if _block_groups(table, "self_attn", list(
        _ATTENTION)) else []
    blocks += sorted((m.rpartition(".")[0], "mlp") for m in table
                     if m.endswith(".gate_proj") and _block_groups(
                         table, m.rpartition(".")[0], list(_MLP)))
    for block, kind in blocks:
        spec_table: Mapping[str, tuple[str, ...]] = _ATTENTION if kind == "attention" else _MLP
        first = table[f"{block}.{next(iter(spec_table))}"]
        if kind == "attention":
            name, role, units = "attention", "attention_heads", "num_key_value_heads"
        else:
            name = block
            role = "feed_forward_intermediate" if first.experts is None else \
                "expert_intermediate"
            rows = first.params.get("weight", ("", [0]))[1][0]
            units = w.dim("intermediate_size", rows, "units")
        if units in w.values:
            w.used.add(units)
        w.lines += ["", f'  - name: "layers.{{unit}}.{name}"', f"    role: {role}",
                    "    owner: {unit: decoder}"]
        w.scope(block, first, [n for p in spec_table for n in table[f"{block}.{p}"].differs])
        w.lines += [f"    units: {units}", "    projections:"]
        for proj, spec in spec_table.items():
            module = f"{block}.{proj}"
            done.add(module)
            w.lines.append(f'      - module: "{unit}.{module}"')
            w.lines.append(f"        sharding: {spec[0]}")
            if len(spec) == 4:
                w.lines.append(f"        heads: {spec[1]}")
                w.used.add(spec[1])
                rows_of, cols_of = spec[-2], spec[-1]
            else:  # the intermediate dimension is the group's units
                rows_of = units if spec[0] == "column" else spec[1]
                cols_of = units if spec[0] == "row" else spec[2]
            w.params(_signature_params(w, table[module].params, rows_of, cols_of), "        ")
    for module in sorted(set(table) - done):
        entry = table[module]
        leaf = module.rsplit(".", 1)[-1]
        sized, spans = _sized_like(w, table, module, leaf, entry)
        params = _signature_params(w, entry.params, sized, None)
        safe = module.replace("self_attn.", "attention.")
        w.lines += ["", f'  - name: "layers.{{unit}}.{safe}"', "    role: replicated",
                    "    owner: {unit: decoder}"]
        w.scope(module, entry)
        w.lines += [f'    module: "{unit}.{module}"', "    sharding: replicated"]
        if spans is not None:
            w.check("    # replicated on every rank", f"`{module}` normalises the whole "
                    f"`{spans}` output ({sized}), which the attention group splits: declare "
                    "it in that group, split with the projection and `reduction: "
                    "tensor_parallel` (architectures/olmo2.yaml), or verify fails at T >= 2")
        elif _PACKED & set(entry.params):
            w.check("    # replicated on every rank", f"`{module}` holds packed quantized "
                    f"weights ({', '.join(sorted(_PACKED & set(entry.params)))}): replicated; "
                    "shard it with the family's linear format (docs/linear_formats.md)")
        elif leaf in _ATTENTION or leaf in _MLP:
            w.check("    # replicated on every rank", f"`{module}` is a known projection, but "
                    "its block's others are not all there as separate dense modules (fused, "
                    "such as qkv_proj?): replicated; shard the block by hand")
        elif not _is_norm(leaf):
            w.check("    # replicated on every rank", f"`{module}` is not a known projection: "
                    "replicated; shard it if it is large")
        w.params(params, "    ")


def _sized_like(w: _Writer, table: Mapping[str, _Module], module: str, leaf: str,
                entry: _Module) -> tuple[str | None, str | None]:
    """The expression a module outside the projection groups is sized by, and, for a norm of
    the attention block as wide as a projection's whole output (OLMo-2's q_norm and k_norm,
    not Qwen3's per-head ones), that projection: a size read as the projection's expression
    (`num_key_value_heads * head_dim`), not whichever config field has that value; a router
    (`gate`, `router`) by the expert count."""
    weight = entry.params.get("weight", ("", []))[1]
    block = module.rpartition(".")[0]
    if _is_norm(leaf) and len(weight) == 1 and block.endswith("self_attn"):
        for proj in ("q_proj", "k_proj", "v_proj"):
            rows = _ATTENTION[proj][2]
            if f"{block}.{proj}" in table and _evaluate(rows, w.values) == weight[0] and \
                    w.values.get("head_dim") != weight[0]:
                return rows, proj
        return ("head_dim" if w.values.get("head_dim") == weight[0] else None), None
    if leaf in ("gate", "router") and len(weight) == 2:
        count = next((n for n in _EXPERT_COUNTS if w.values.get(n) == weight[0]), None)
        return count, None
    return None, None


def _static_roles(modules: Mapping[str, Any], prefix: str) -> dict[str, str]:
    """Which modules outside the layers are the embedding, the head and the final norm: at
    most one each (the one beside the layers when several could be); the others get none."""
    parent = prefix.rpartition(".")[0]

    def beside(module: str) -> tuple[bool, str]:
        return module.rpartition(".")[0] != parent, module

    leaf = {m: m.rsplit(".", 1)[-1] for m in modules}
    heads = sorted((m for m in modules if m == "lm_head" or leaf[m] == "embed_out"), key=beside)
    roles = {heads[0]: "output"} if heads else {}
    embeddings = sorted((m for m in modules if ("embed" in leaf[m] or leaf[m] == "wte")
                         and m not in roles and not _positional(leaf[m])
                         and not _is_norm(leaf[m])), key=beside)
    if embeddings:
        roles[embeddings[0]] = "embedding"
    norms = sorted((m for m in modules if _is_norm(leaf[m]) and m not in roles), key=beside)
    if norms:
        roles[norms[0]] = "final_norm"
    return roles


def _is_norm(leaf: str) -> bool:
    """A normalisation module's name: `norm`, `input_layernorm`, GPT-2's `ln_1`, `ln_f`."""
    return "norm" in leaf or leaf.startswith("ln_")


def _positional(leaf: str) -> bool:
    """A learned position embedding's name: GPT-2's `wpe`, `embed_positions`."""
    return leaf == "wpe" or "position" in leaf


def _beside_embedding(leaf: str) -> bool:
    """A module outside the layers used with the token embedding, on the first stage: a
    position embedding, BLOOM's `word_embeddings_layernorm`."""
    return _positional(leaf) or "embed" in leaf


def _static_groups(w: _Writer, modules: dict[str, dict[str, Any]], roles: Mapping[str, str]
                   ) -> tuple[list[str], list[str]]:
    head: list[str] = []
    tail: list[str] = []
    tied = "output" not in roles.values()
    for module in sorted(modules):
        params = modules[module]
        role = roles.get(module)
        saved, w.lines = w.lines, []
        if role == "embedding":
            w.lines += ["", "  - name: embedding", "    role: vocabulary"]
            w.lines.append("    owner: {any_of: [embedding, output]}" if tied else
                           "    owner: {static: embedding}")
            if tied:
                w.lines.append("    # the checkpoint has no lm_head: the head is tied to the "
                               "embedding, which the last stage loads too")
            w.lines += [f"    module: {module}", "    sharding: {balanced: 0}"]
            w.params(_signature_params(w, params, "vocab_size", "hidden_size"), "    ")
            head += w.lines
        elif role == "output":
            w.lines += ["", f"  - name: {module}", "    role: vocabulary",
                        "    owner: {static: output}", f"    module: {module}",
                        "    sharding: {balanced: 0}"]
            w.params(_signature_params(w, params, "vocab_size", "hidden_size"), "    ")
            tail += w.lines
        elif role is None and _beside_embedding(module.rsplit(".", 1)[-1]):
            w.lines += ["", f"  - name: {json.dumps(module)}", "    role: replicated",
                        "    owner: {static: embedding}", f"    module: {module}",
                        "    sharding: replicated"]
            w.params(_signature_params(w, params, None, None), "    ")
            head += w.lines
        else:
            norm = role == "final_norm"
            w.lines += ["", f"  - name: {'final_norm' if norm else json.dumps(module)}",
                        "    role: replicated",
                        "    owner: {static: final_norm}" if norm else
                        "    owner: {static: output}", f"    module: {module}",
                        "    sharding: replicated"]
            if not norm:
                w.check("    # owner guessed", f"`{module}` is outside the layers and not a "
                        "known name: owned by the last stage")
            w.params(_signature_params(w, params, None, None), "    ")
            tail += w.lines
        w.lines = saved
    return head, tail
