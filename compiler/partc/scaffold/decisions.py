"""`partc init`: the scaffold's decisions, made while the family is built.

How each dimension of a tensor is written (`_Writer.resolve`: the expression the module's place
expects, else the config field of its value, else a literal, marked), which layers and experts a
layer group covers (`_Writer.scope`), and the comments that record what it could not decide
(`CHECK`), kept by the node they belong to for `partc.scaffold.yaml_writer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from partc.scaffold.config_values import _EXPERT_COUNTS, _HEADS
from partc.scaffold.layer_table import _ATTENTION, _is_norm, _Module, _positional
from partc.scaffold.yaml_writer import Comments, Container, Flow, FlowList, Quoted

CHECK = "# partc init: CHECK"
"""The comment on every line the scaffold could not decide."""


def _evaluate(expression: str, values: Mapping[str, int]) -> int | None:
    """The value of an expression the scaffold writes over config names (`a * b`,
    `(a + 2 * b) * c`, `a // b * c`), None when it reads a name `values` lacks, or none."""
    from partc.errors import PartcError
    from partc.family.expr import parse

    try:
        parsed = parse(expression)
        if not parsed.names or not parsed.names <= set(values):
            return None  # a literal is no expression over the config
        return parsed.evaluate_int(values)
    except PartcError:
        return None


class _Writer:
    """The family being built: the config values its shapes are matched against, its
    comments, and what it used and marked."""

    def __init__(self, values: dict[str, int], default_dtype: str | None,
                 layers: Sequence[int], dimensions: tuple[str, ...]) -> None:
        self.values = values
        self.default_dtype = default_dtype
        self.all_layers = set(layers)
        self.comments = Comments()
        """The document's comments (`CHECK` marks, notes), by the node they belong to."""
        self.undecided: list[str] = []
        self.used: set[str] = set()
        self.conditional = 0
        """How many groups got a `when:` over layer numbers."""
        self.dimensions = dimensions
        """Config names a literal dimension is matched against, in this order: the
        decoder's, or an encoder's own."""
        self.config: Mapping[str, Any] = {}
        """The config.json object (a mixer's sizes the survey does not read: Mamba2's
        `mamba_n_groups`, `partc.scaffold.ssm2`)."""

    def vocabulary(self, module: str) -> tuple[list[str], tuple[str, ...]]:
        """The config names a literal dimension of `module` is matched against, and those
        preferred when several have its value: of `self.dimensions`, a position count only
        in a position embedding, an MLP's intermediate size not in an attention block (where
        DeepSeek's q_lora_rank may have its value); an attention block's head counts and
        head width preferred there, an expert count in an expert or router module."""
        parts = module.split(".")
        leaf = parts[-1]
        attention = any("attn" in p or "attention" in p for p in parts[:-1]) or (
            not _is_norm(leaf) and ("attn" in leaf or "attention" in leaf))
        experts = any("expert" in p or "moe" in p or "router" in p for p in parts)
        positional = any(_positional(p) for p in parts)
        names = [n for n in self.dimensions if ("position" not in n or positional)
                 and not (attention and "intermediate" in n)]
        return names, (*(_HEADS if attention else ()), *(_EXPERT_COUNTS if experts else ()))

    def resolve(self, expected: str | None, actual: int, *, lookup: bool = True,
                names: Sequence[str] | None = None, prefer: Sequence[str] = ()
                ) -> tuple[str, str | None]:
        """A shape entry and, when it is a guess, why (for a CHECK): the `expected`
        expression when it has the header's value; else, if `lookup`, the config name of
        `names` (`self.dimensions`) with that value, when just one has it or `prefer` names
        one of those that do (the name the neighbouring modules use), else the first, said
        ambiguous; else the number, said unexplained. An axis of 1 is no dimension (a gate's
        single row): written 1, unmarked."""
        if expected is not None and _evaluate(expected, self.values) == actual:
            from partc.family.expr import parse

            self.used.update(parse(expected).names)
            return expected, None
        if actual == 1:
            return "1", None
        names = [n for n in (self.dimensions if names is None else names)
                 if self.values.get(n) == actual] if lookup else []
        chosen = next((n for n in prefer if n in names), names[0] if names else None)
        if chosen is not None:
            self.used.add(chosen)
        if chosen is not None and (len(names) == 1 or chosen in prefer):
            return chosen, None
        if chosen is not None:
            return chosen, f"{actual} is {_spelled_names(names)} alike, {chosen} written"
        value = _evaluate(expected, self.values) if expected is not None else None
        if value is None:
            return str(actual), f"{actual} is no config field the scaffold knows"
        return str(actual), f"{actual} is not {expected} ({value})" + (
            " nor any config field the scaffold knows" if lookup else "")

    def dim(self, expected: str | None, actual: int) -> str:
        """A shape entry where a guess is not marked (a line marked already)."""
        return self.resolve(expected, actual)[0]

    def params(self, group: dict[str, Any],
               entries: Mapping[str, tuple[list[str], str, list[str]]], what: str) -> None:
        """The `params:` of module `what` into `group`: a flow mapping for a single param,
        else one line per param; a line with a dimension the scaffold guessed or could not
        explain marked with why."""
        items: dict[str, Any] = {}
        whys: dict[str, list[str]] = {}
        for name, (shape, dtype, why) in sorted(entries.items()):
            dims = FlowList(_entry(text) for text in shape)
            items[name] = dims if dtype == self.default_dtype else Flow(shape=dims, dtype=dtype)
            whys[name] = [f"{name} {w}" for w in why]
        if len(items) == 1:
            group["params"] = Flow(items)
            self.shape_mark(group, "params", what, next(iter(whys.values())))
        else:
            group["params"] = items
            for name in items:
                self.shape_mark(items, name, what, whys[name])

    def shape_mark(self, container: Container, key: str | int, what: str,
                   whys: Sequence[str]) -> None:
        """Mark the line of a shape when some of its dimensions are guesses."""
        if whys:
            self.check(container, key, f"`{what}`: {'; '.join(whys)}: write each as an "
                       "expression over config fields, or the shape holds for this "
                       "checkpoint's config only")

    def loose(self, groups: list[dict[str, Any]], name: str, tensor: str,
              signature: tuple[str, list[int]], owner: Flow, why: str) -> None:
        """The group `name` of a tensor of no module (a root-level `image_newline`), appended
        to `groups`: one `members:` entry, replicated, owned by `owner`, a guess marked with
        `why`."""
        dtype, shape = signature
        names, prefer = self.vocabulary(tensor)
        resolved = [self.resolve(None, n, names=names, prefer=prefer) for n in shape]
        entry = Flow(target=Quoted(tensor), shape=FlowList(_entry(t) for t, _ in resolved))
        if dtype != self.default_dtype:
            entry["dtype"] = dtype
        group: dict[str, Any] = {"name": Quoted(name), "role": "replicated", "owner": owner,
                                 "members": [entry]}
        groups.append(group)
        self.note(group, "owner", "# owner guessed", why)
        self.shape_mark(group["members"], 0, tensor, [f"axis {i}: {w}" for i, (_, w) in
                                                      enumerate(resolved) if w is not None])

    def check(self, container: Container, key: str | int, why: str) -> None:
        """Mark the line of `container[key]` CHECK, saying why."""
        self.comments.mark(container, key, f"{CHECK}: {why}")
        self.undecided.append(why)

    def note(self, container: Container, key: str | int, text: str,
             why: str | None = None) -> None:
        """A comment line after the line of `container[key]`, marked CHECK when `why`."""
        if why is not None:
            text += f"  {CHECK}: {why}"
            self.undecided.append(why)
        self.comments.note(container, key, text)

    def scope(self, group: dict[str, Any], module: str, entry: _Module,
              differs: Sequence[int] = ()) -> None:
        """The `when:` and `for:` of a layer group: the layers and experts it covers
        (`differs`: more layers where a module of the group has other params)."""
        if entry.layers != self.all_layers:
            self.conditional += 1
            group["when"] = Quoted(_condition(entry.layers, self.all_layers))
            self.check(group, "when", f"`{module}` is only in {_layers(entry.layers)} of layers "
                       f"{_spelled(self.all_layers)}: the condition follows this checkpoint; "
                       "write it over config fields")
        if entry.experts is not None:
            count = next((n for n in _EXPERT_COUNTS if self.values.get(n) == entry.experts),
                         None)
            group["for"] = Flow(expert=entry.experts if count is None else count)
            if count is None:
                self.check(group, "for", "the number of experts is no config field the "
                           "scaffold knows: write it as one")
            else:
                self.used.add(count)
        if entry.differs or differs:
            self.note(group, list(group)[-1], f"# {_layers({*entry.differs, *differs})} "
                      f"hold(s) `{module}` with other params, shapes or expert counts",
                      "this group fits the first layers only: split it by layer, `partc "
                      "check` fails until then")


def _entry(text: str) -> int | str:
    """A shape entry as written: a literal as a number, an expression as text."""
    return int(text) if text.isdigit() else text


def _spelled_names(names: Sequence[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


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


def _signature_params(w: _Writer, module: str, params: Mapping[str, tuple[str, list[int]]],
                      rows: str | None, cols: str | None, *,
                      axes: Sequence[str | None] | None = None, prefer: Sequence[str] = ()
                      ) -> dict[str, tuple[list[str], str, list[str]]]:
    """Each param's shape entries, dtype and the guesses among them (`_Writer.resolve`): a
    weight's are expected as [rows, cols], another param's first as rows; `axes`, when
    given, are every param's (a norm's weight and bias, a router's). An axis expected as
    an expression is that or a literal; where none is expected it is looked up by value among
    the names `module` may use (`_Writer.vocabulary`; `prefer` first), but not in a param of a
    matrix beside its weight and bias (a quantized format's scales: their dimensions are
    derived, a config field of the same value a coincidence)."""
    names, preferred = w.vocabulary(module)
    prefer = (*prefer, *preferred)
    guided = axes is not None or rows is not None or cols is not None
    out = {}
    for param, (dtype, shape) in params.items():
        expected = list(axes) if axes is not None else [rows, cols] if param == "weight" \
            else [rows]
        dense = not guided or axes is not None or param in ("weight", "bias")
        entries, whys = [], []
        for i, n in enumerate(shape):
            e = expected[i] if i < len(expected) else None
            text, why = w.resolve(e, n, lookup=dense and e is None, names=names,
                                  prefer=prefer)
            entries.append(text)
            if why is not None:
                whys.append(f"axis {i}: {why}" if len(shape) > 1 else why)
        if whys and not dense:
            whys[-1] += " (a param beside a matrix's weight, sized by its format: " \
                "docs/linear_formats.md)"
        out[param] = (entries, dtype, whys)
    return out


def _sized_like(w: _Writer, table: Mapping[str, _Module], module: str, leaf: str,
                entry: _Module) -> tuple[list[str | None] | None, str | None]:
    """The axes a module outside the projection groups is sized by (its every param's), and,
    for a norm of the attention block as wide as a projection's whole output (OLMo-2's
    q_norm and k_norm, not Qwen3's per-head ones), that projection: a size read as the
    projection's expression (`num_key_value_heads * head_dim`), not whichever config field
    has that value; a per-head norm's [head_dim] (Qwen3's) or [heads, head_dim] (Cohere's),
    the heads those of the projection it normalises (`q_norm`: q_proj's num_attention_heads);
    a router (`gate`, `router`) by the expert count."""
    weight = entry.params.get("weight", ("", []))[1]
    block = module.rpartition(".")[0]
    if _is_norm(leaf) and len(weight) == 1 and block.endswith("self_attn"):
        for proj in ("q_proj", "k_proj", "v_proj"):
            rows = _ATTENTION[proj][2]
            if f"{block}.{proj}" in table and _evaluate(rows, w.values) == weight[0] and \
                    w.values.get("head_dim") != weight[0]:
                return [rows], proj
        return (["head_dim"] if w.values.get("head_dim") == weight[0] else None), None
    if _is_norm(leaf) and len(weight) == 2 and block.endswith("self_attn"):
        # the projection the norm's name starts like (q_norm, k_layernorm), else any of them
        named = [p for p in ("q_proj", "k_proj") if leaf.startswith(p[0])] or \
            ["q_proj", "k_proj", "v_proj"]
        fits = {str(_ATTENTION[p][1]) for p in named if f"{block}.{p}" in table and [
            w.values.get(str(_ATTENTION[p][1])), w.values.get("head_dim")] == weight}
        return ([fits.pop(), "head_dim"] if len(fits) == 1 else None), None
    if leaf in ("gate", "router") and len(weight) == 2:
        count = next((n for n in _EXPERT_COUNTS if w.values.get(n) == weight[0]), None)
        return ([count, None] if count is not None else None), None
    return None, None


def _intermediate_names(w: _Writer, block: str, first: _Module) -> tuple[str, ...]:
    """The config names an MLP block's intermediate size is preferred as, when several have
    its value: a shared expert's, a routed expert's, then any intermediate size."""
    names = [n for n in w.dimensions if "intermediate" in n]
    if "shared" in block:
        names.sort(key=lambda n: "shared" not in n)
    elif first.experts is not None:
        names.sort(key=lambda n: "moe" not in n)
    return tuple(names)
