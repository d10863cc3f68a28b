"""`partc init`: a family scaffold guessed from a checkpoint header and its config.json.

It recognises the layer repetition (`<prefix>.layers.<n>.`), the common Llama-style projection
names (q/k/v/o, gate/up/down), norms, the token embedding and a tied or untied head. Anything
else is kept as a replicated group with literal shapes and marked `# partc init: CHECK`, so
that the scaffold still owns every tensor and passes `partc check` as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
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
_LAYER = re.compile(r"^(?P<prefix>.*?layers)\.(?P<n>\d+)\.(?P<rest>.+)$")

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


def _values(config: Mapping[str, Any]) -> dict[str, int]:
    """The config names the scaffold's expressions use, with their defaults."""
    def number(key: str, default: int | None = None) -> int | None:
        value = config.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    hidden, heads = number("hidden_size"), number("num_attention_heads")
    out = {"hidden_size": hidden, "num_attention_heads": heads,
           "num_key_value_heads": number("num_key_value_heads", heads),
           "intermediate_size": number("intermediate_size"),
           "num_hidden_layers": number("num_hidden_layers"), "vocab_size": number("vocab_size")}
    out["head_dim"] = number("head_dim", hidden // heads if hidden and heads else None)
    return {k: v for k, v in out.items() if v is not None}


def _evaluate(expression: str, values: Mapping[str, int]) -> int | None:
    """The value of `a` or `a * b` over config names (the only forms the scaffold writes)."""
    result = 1
    for name in expression.split(" * "):
        if name not in values:
            return None
        result *= values[name]
    return result


class _Writer:
    def __init__(self, values: dict[str, int], default_dtype: str | None) -> None:
        self.values = values
        self.default_dtype = default_dtype
        self.lines: list[str] = []
        self.undecided: list[str] = []
        self.used: set[str] = set()

    def dim(self, expected: str | None, actual: int, what: str) -> str:
        """A shape entry: the config expression when it matches the header, else the number."""
        if expected is not None and _evaluate(expected, self.values) == actual:
            self.used.update(expected.split(" * "))
            return expected
        for name in ("hidden_size", "intermediate_size", "vocab_size"):
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


def _modules(tensors: Mapping[str, tuple[str, list[int]]]) -> dict[str, dict[str, Any]]:
    """Tensors grouped by module: `a.b.weight` -> module `a.b`, param `weight`."""
    out: dict[str, dict[str, Any]] = {}
    for name, signature in tensors.items():
        module, _, param = name.rpartition(".")
        out.setdefault(module, {})[param] = signature
    return out


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
    family = name or re.sub(r"[^A-Za-z0-9_]", "_", model_type)
    torch_dtype = config.get("torch_dtype") or config.get("dtype")
    default = TORCH_DTYPE_NAMES.get(str(torch_dtype)) if torch_dtype else None
    values = _values(config)
    w = _Writer(values, default or "F32")
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
        raise LoadError(f"partc init recognises one `<prefix>.layers.<n>.` repetition; "
                        f"{checkpoint} has {len(layers)} ({', '.join(sorted(layers)) or 'none'})",
                        location=SourceLocation(str(checkpoint)))
    (prefix, by_layer), = layers.items()
    count = len(by_layer)
    first = by_layer[min(by_layer)]
    if any(set(layer) != set(first) for layer in by_layer.values()):
        w.undecided.append("layers hold different tensors; the scaffold follows layer 0")
    w.lines += [f"# Family scaffold written by `partc init` from {checkpoint.name} "
                f"({len(header)} tensors). Lines marked `{CHECK}` need a decision.", "",
                f"family: {family}",
                f"description: {model_type} decoder (scaffold; describe it here)",
                f"model_types: [{model_type}]", ""]
    body: list[str] = []
    w.lines, saved = body, w.lines
    _layer_groups(w, prefix, _modules(first))
    w.lines = saved
    tied = "lm_head.weight" not in header
    static = _static_groups(w, _modules(outside), tied)
    used = sorted(w.used | {"num_hidden_layers"})
    w.lines.append("config:")
    for key in used:
        if key == "num_key_value_heads":
            w.lines.append("  num_key_value_heads: {type: int, default: num_attention_heads}")
        elif key == "head_dim":
            w.lines.append("  head_dim: {type: int, default: hidden_size // "
                           "num_attention_heads}")
        else:
            w.lines.append(f"  {key}: int")
    if values.get("num_hidden_layers") != count:
        w.check(f"  # the checkpoint has {count} layers", "num_hidden_layers differs from the "
                "header's layer count")
    w.lines += ["", "graph:", f'  - {{group: decoder, units: num_hidden_layers, path: '
                f'"{prefix}.{{unit}}", state: true}}', "", "static:",
                "  embedding: {stage: first}", "  final_norm: {stage: last}",
                "  output: {stage: last}", "", "parameters:"]
    w.lines += static[0] + body + static[1]
    w.lines += ["", "boundary:", f"  identity: {family}.hidden",
                "  primary: {role: hidden, shape: [batch, sequence, hidden_size], "
                "dtype: activation}", "  auxiliary: []", ""]
    from importlib import resources

    schema = Path(str(resources.files("partc.schemas").joinpath("architecture.schema.json")))
    text = SCHEMA_COMMENT + schema.resolve().as_uri() + "\n" + "\n".join(w.lines)
    return Scaffold(text=text, undecided=tuple(w.undecided))


def _signature_params(w: _Writer, params: Mapping[str, tuple[str, list[int]]],
                      rows: str | None, cols: str | None) -> dict[str, tuple[list[str], str]]:
    out = {}
    for param, (dtype, shape) in params.items():
        expected = [rows, cols][:len(shape)] if param == "weight" else [rows]
        out[param] = ([w.dim(e, n, param) for e, n in zip(expected + [None] * len(shape),
                                                              shape, strict=False)], dtype)
    return out


def _layer_groups(w: _Writer, prefix: str, modules: dict[str, dict[str, Any]]) -> None:
    unit = f"{prefix}.{{unit}}"
    done: set[str] = set()
    for block, table, group, role, units in (
            ("self_attn", _ATTENTION, "attention", "attention_heads", "num_key_value_heads"),
            ("mlp", _MLP, "mlp", "feed_forward_intermediate", "intermediate_size")):
        found = [p for p in table if f"{block}.{p}" in modules]
        if len(found) != len(table):
            continue
        w.used.add(units)
        w.lines += ["", f'  - name: "layers.{{unit}}.{group}"', f"    role: {role}",
                    "    owner: {unit: decoder}", f"    units: {units}", "    projections:"]
        for proj in found:
            spec = table[proj]
            module = f"{block}.{proj}"
            done.add(module)
            w.lines.append(f'      - module: "{unit}.{module}"')
            w.lines.append(f"        sharding: {spec[0]}")
            if len(spec) == 4:
                w.lines.append(f"        heads: {spec[1]}")
                w.used.add(spec[1])
            rows, cols = spec[-2], spec[-1]
            w.params(_signature_params(w, modules[module], rows, cols), "        ")
    for module in sorted(set(modules) - done):
        params = _signature_params(w, modules[module], None, None)
        safe = module.replace("self_attn.", "attention.")
        w.lines += ["", f'  - name: "layers.{{unit}}.{safe}"', "    role: replicated",
                    "    owner: {unit: decoder}", f'    module: "{unit}.{module}"',
                    "    sharding: replicated"]
        if "norm" not in module.rsplit(".", 1)[-1]:
            w.check("    # replicated on every rank", f"`{module}` is not a known projection: "
                    "replicated; shard it if it is large")
        w.params(params, "    ")


def _static_groups(w: _Writer, modules: dict[str, dict[str, Any]], tied: bool
                   ) -> tuple[list[str], list[str]]:
    head: list[str] = []
    tail: list[str] = []
    for module in sorted(modules):
        params = modules[module]
        leaf = module.rsplit(".", 1)[-1]
        saved, w.lines = w.lines, []
        if "embed" in leaf:
            w.lines += ["", "  - name: embedding", "    role: vocabulary"]
            w.lines.append("    owner: {any_of: [embedding, output]}" if tied else
                           "    owner: {static: embedding}")
            if tied:
                w.lines.append("    # the checkpoint has no lm_head: the head is tied to the "
                               "embedding, which the last stage loads too")
            w.lines += [f"    module: {module}", "    sharding: {balanced: 0}"]
            w.params(_signature_params(w, params, "vocab_size", "hidden_size"), "    ")
            head += w.lines
        elif module == "lm_head":
            w.lines += ["", "  - name: lm_head", "    role: vocabulary",
                        "    owner: {static: output}", "    module: lm_head",
                        "    sharding: {balanced: 0}"]
            w.params(_signature_params(w, params, "vocab_size", "hidden_size"), "    ")
            tail += w.lines
        else:
            norm = "norm" in leaf
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
