"""Stage 4, first step: a family's config fields read from config.json (types, defaults,
prefixes and derived values), and the binder every later step evaluates expressions with."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from partc.bind.cache import BindCache
from partc.bind.meanings import config_errors, read_fields
from partc.errors import ExpressionError, PartcError, SemanticError, raise_if_any
from partc.family.declaration import ConfigType
from partc.family.expr import Expression, Template
from partc.family.expr_values import format_value
from partc.front.positions import join_pointer
from partc.parallel.placements import TORCH_DTYPE_NAMES

if TYPE_CHECKING:
    from partc.family.declaration import ConfigFieldDecl, FamilyDecl
    from partc.front.load import RawDocument


Value = Any


class Binder:
    """A family bound to one config: the evaluator (with its memo) and the error builder that
    every binding step shares."""

    def __init__(self, family: FamilyDecl, config: RawDocument, cache: bool = True) -> None:
        self.family = family
        self.config = config
        self.instances = 0
        self.cache = BindCache(enabled=cache)
        """Evaluation memo and group templates: see `partc.bind.cache`."""

    def fail(self, message: str, pointer: str, tensor: str | None = None) -> SemanticError:
        """A SemanticError located at `pointer` of the family document."""
        return SemanticError(message, location=self.family.document.locate(pointer),
                             pointer=pointer, tensor=tensor)

    def evaluate(self, expr: Expression, env: Mapping[str, Value], pointer: str) -> Value:
        """`expr` evaluated in `env` (memoized); an expression error located at `pointer`."""
        key = self.cache.evaluation_key(expr, env)
        if key is not None and key in self.cache.evaluations:
            return self.cache.evaluations[key]
        try:
            value = expr.evaluate(env)
        except ExpressionError as exc:
            raise exc.located(self.family.document.locate_offset(pointer, exc.offset),
                              pointer) from None
        if key is not None:
            self.cache.evaluations[key] = value
        return value

    def integer(self, expr: Expression, env: Mapping[str, Value], pointer: str, what: str,
                minimum: int | None = None) -> int:
        """`expr` evaluated to an integer (at least `minimum`), or a located error."""
        value = self.evaluate(expr, env, pointer)
        if isinstance(value, Fraction):
            raise self.fail(f"{what} `{expr.text}` must be an integer, found the float "
                            f"{format_value(value)}; round it explicitly with floor(), ceil() "
                            "or round()", pointer)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(f"{what} `{expr.text}` must be an integer, found "
                            f"{format_value(value)}", pointer)
        if minimum is not None and value < minimum:
            raise self.fail(f"{what} `{expr.text}` must be >= {minimum}, found {value}", pointer)
        return value

    def boolean(self, expr: Expression | None, env: Mapping[str, Value], pointer: str) -> bool:
        """A condition evaluated to true or false (no condition: true), or a located error."""
        if expr is None:
            return True
        value = self.evaluate(expr, env, pointer)
        if not isinstance(value, bool):
            raise self.fail(f"condition `{expr.text}` must be true or false, found "
                            f"{format_value(value)}", pointer)
        return value

    def render(self, template: Template, env: Mapping[str, Value], pointer: str) -> str:
        """`template` rendered in `env`; an expression error located at `pointer`."""
        try:
            return template.render(env)
        except ExpressionError as exc:
            raise exc.located(self.family.document.locate_offset(pointer, exc.offset),
                              pointer) from None


# ---------------------------------------------------------------- config values


def _lookup(data: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """(True, value) when config.json has the key `dotted` (its value may be null), else
    (False, None)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list_of(fits: Any) -> Any:
    """A converter taking a list whose every item `fits` to a tuple."""
    return lambda value: (tuple(value) if isinstance(value, list) and all(map(fits, value))
                          else None)


_CONVERTERS: dict[ConfigType, Any] = {
    ConfigType.INT: lambda value: value if _is_int(value) else None,
    ConfigType.BOOL: lambda value: value if isinstance(value, bool) else None,
    ConfigType.STR: lambda value: value if isinstance(value, str) else None,
    ConfigType.FLOAT: lambda value: (value if _is_int(value) or isinstance(value, float)
                                     else None),
    ConfigType.INT_LIST: _list_of(_is_int),
    ConfigType.STR_LIST: _list_of(lambda item: isinstance(item, str)),
    ConfigType.ANY: lambda value: tuple(value) if isinstance(value, list) else value,
}
"""Per declared type: the config.json value converted to it, or None when it does not fit."""


def _check_type(kind: ConfigType, value: Any) -> Value | None:
    """The value converted to the declared type, or None when it does not fit."""
    return _CONVERTERS[kind](value)


def read_config_values(family: FamilyDecl, config: RawDocument,
                       checkpoint_names: Collection[str] | None = None, *,
                       cache: bool = True) -> dict[str, Value]:
    """Every declared config field's value: from config.json, else its default.

    A field with a `present` probe is true when `checkpoint_names` holds the tensor it names;
    without checkpoint names it takes its default. `cache=False` evaluates every default
    without the evaluation memo (`partc.bind.cache`). Every field's error (a value that
    contradicts its meaning, of the wrong type, or missing) is raised together, before any
    default is evaluated.
    """
    errors: list[PartcError] = list(config_errors(config, read_fields(config.data, (
        f.sources for f in family.config if f.present is None))))
    binder = Binder(family, config, cache)
    values: dict[str, Value] = {"model_type": config.data.get("model_type")}
    pending = []
    for field in family.config:
        if field.present is not None:
            if checkpoint_names is None and field.default is None:
                errors.append(binder.fail(f"config field `{field.name}` probes the checkpoint "
                                          "and has no default; give a checkpoint or declare a "
                                          "default", field.pointer))
            pending.append(field)
            continue
        try:
            if not _read_field(binder, field, values):
                pending.append(field)
        except SemanticError as error:
            errors.append(error)
    raise_if_any(errors)
    while pending:
        progressed = False
        for field in list(pending):  # in declaration order, each seeing the values before it
            if not _waits(field, pending, checkpoint_names):
                values[field.name] = _derived(binder, field, values, checkpoint_names)
                pending.remove(field)
                progressed = True
        if not progressed:
            names = ", ".join(f"`{f.name}`" for f in pending)
            raise binder.fail(f"config defaults depend on each other in a cycle: {names}",
                              pending[0].pointer)
    _prefix_values(binder, values, checkpoint_names)
    _derived_values(binder, values)
    return values


def _prefix_values(binder: Binder, values: dict[str, Value],
                   checkpoint_names: Collection[str] | None) -> None:
    """Each `prefixes` entry: the first candidate some checkpoint name starts with (then `.`),
    else the default when no checkpoint is given."""
    for prefix in binder.family.prefixes:
        if checkpoint_names is None:
            values[prefix.name] = prefix.default
            continue
        chosen = next((c for c in prefix.candidates
                       if any(n.startswith(c + ".") for n in checkpoint_names)), None)
        if chosen is None:
            raise binder.fail(f"prefix `{prefix.name}`: the checkpoint holds no tensor under any "
                              f"of its candidates {list(prefix.candidates)}; expected names "
                              f"starting with one of them and `.`", prefix.pointer)
        values[prefix.name] = chosen


def _derived_values(binder: Binder, values: dict[str, Value]) -> None:
    """Add every derived value, each after the derived values it reads (cycles are refused by
    the family checks)."""
    waiting = list(binder.family.derived)
    while waiting:
        names = {d.name for d in waiting}
        ready = [d for d in waiting if not d.expression.names & names]
        if not ready:
            raise binder.fail("derived values depend on each other in a cycle: "
                              + ", ".join(f"`{d.name}`" for d in waiting), waiting[0].pointer)
        for decl in ready:
            values[decl.name] = binder.evaluate(decl.expression, values, decl.pointer)
            waiting.remove(decl)


def recorded(value: Value) -> Value:
    """A bound value as the plan records it (a float derived value as a JSON number)."""
    return float(value) if isinstance(value, Fraction) else value


def _read_field(binder: Binder, field: ConfigFieldDecl, values: dict[str, Value]) -> bool:
    """Set `values[field.name]` from config.json, or from a literal default; False when the
    field's default expression must be evaluated (after the fields it reads)."""
    config, family = binder.config, binder.family
    given = False  # some source is a key of config.json, maybe null: no spelling check
    for source in field.sources:
        present, raw = _lookup(config.data, source)
        given = given or present
        if present and raw is None and field.nullable:
            values[field.name] = None
            return True
        if present and raw is not None:
            converted = _check_type(field.type, raw)
            if converted is None:
                raise SemanticError(
                    f"config field `{source}` must be {field.type.value}, found "
                    f"{type(raw).__name__} {raw!r} (declared at "
                    f"{family.document.locate(field.pointer)})",
                    location=config.locate("/" + source.split(".")[0]), pointer="/" + source)
            values[field.name] = converted
            return True
    defaulted = field.literal_default[0] or field.default is not None
    meant = _meant_source(config.data, field) if defaulted and not given else None
    if meant is not None:  # the default would hide a misspelt `from:`
        names = ", ".join(f"`{s}`" for s in field.sources)
        raise SemanticError(
            f"config field `{field.name}` reads {names}, which config.json lacks, so it would "
            f"take its default; config.json has `{meant}`: did you mean `from: {meant}`?",
            location=family.document.locate(field.pointer), pointer=field.pointer)
    if field.literal_default[0]:
        values[field.name] = field.literal_default[1]
        return True
    if field.default is None:
        raise _missing(binder, field)
    return False


def _missing(binder: Binder, field: ConfigFieldDecl) -> SemanticError:
    """A required field none of whose sources config.json gives: each source named, in the
    order tried, and those present but null said so (the error at the first of them)."""
    config, family = binder.config, binder.family
    nulls = [s for s in field.sources if _is_null(config.data, s)]
    names = ", ".join(f"`{s}`" for s in field.sources)
    found = (f"no {names}" if len(field.sources) == 1
             else f"none of {names} (tried in this order)")
    if nulls:
        found += "; " + ", ".join(f"`{s}`" for s in nulls) + (
            " is null" if len(nulls) == 1 else " are null")
    pointer = "/" + (nulls or field.sources)[0].replace(".", "/")
    declared = family.document.locate(field.pointer)
    close = None if nulls else _close_source(config.data, field.sources)
    if close is not None:  # a misspelt name in the family, most likely: located there
        return SemanticError(
            f"config.json has {found}, which family `{family.name}` requires (declared as "
            f"{field.type.value} with no default); did you mean `{close}`, which config.json "
            f"has?", location=declared, pointer=pointer)
    return SemanticError(
        f"config.json has {found}, which family `{family.name}` requires (declared as "
        f"{field.type.value} with no default, at {declared})",
        location=config.locate(pointer if nulls else ""), pointer=pointer)


def _meant_source(data: Mapping[str, Any], field: ConfigFieldDecl) -> str | None:
    """For a field with a default none of whose sources config.json gives: a key config.json
    has (not null) that a source is probably a misspelling of, or the field's own name beside a
    source that names another key (`num_key_value_heads` read `from: num_kv_heads`); None when
    there is none, or the field reads its own name."""
    for source in field.sources:
        *parents, last = source.split(".")
        own = ".".join([*parents, field.name])
        if last != field.name and own not in field.sources:
            present, raw = _lookup(data, own)
            if present and raw is not None:
                return own
    return _close_source(data, field.sources)


def _close_source(data: Mapping[str, Any], sources: Sequence[str]) -> str | None:
    """A name config.json has that one of `sources` is probably a misspelling of: the closest
    key beside where the source looks (`vision_config.hidden_size` for `vision_config.hiden_size`,
    the section's name too: `text_config.hidden_size` for `text_confg.hidden_size`)."""
    import difflib

    for source in sources:
        *parents, last = source.split(".")
        node: Any = data
        path: list[str] = []
        for part in parents:
            if not isinstance(node, Mapping):
                break
            if part not in node:
                sections = [k for k, v in node.items() if isinstance(v, Mapping)]
                match = difflib.get_close_matches(part, sections, n=1, cutoff=0.8)
                if not match:
                    node = None
                    break
                part = match[0]
            path.append(part)
            node = node[part]
        if not isinstance(node, Mapping):
            continue
        keys = [k for k in node if isinstance(k, str) and node[k] is not None]
        match = difflib.get_close_matches(last, keys, n=1, cutoff=0.8)
        if match and ".".join([*path, match[0]]) != source:
            return ".".join([*path, match[0]])
    return None


def _is_null(data: Mapping[str, Any], dotted: str) -> bool:
    """Whether config.json gives `dotted` as an explicit null."""
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, Mapping) else None
    return isinstance(node, Mapping) and last in node and node[last] is None


def _probes(field: ConfigFieldDecl, checkpoint_names: Collection[str] | None) -> bool:
    return field.present is not None and checkpoint_names is not None


def _waits(field: ConfigFieldDecl, pending: list[ConfigFieldDecl],
           checkpoint_names: Collection[str] | None) -> bool:
    """Whether a pending field reads another pending field (its probe, else its default)."""
    expr = field.present if _probes(field, checkpoint_names) else field.default
    assert expr is not None
    return any(n in {p.name for p in pending} for n in expr.names)


def _derived(binder: Binder, field: ConfigFieldDecl, values: Mapping[str, Value],
             checkpoint_names: Collection[str] | None) -> Value:
    """A pending field's value: whether the checkpoint holds its probe, else its default."""
    if _probes(field, checkpoint_names):
        assert field.present is not None and checkpoint_names is not None
        return binder.render(field.present, values,
                             join_pointer(field.pointer, "present")) in checkpoint_names
    assert field.default is not None
    return binder.evaluate(field.default, values, join_pointer(field.pointer, "default"))


def default_dtype(config: RawDocument) -> str:
    """The safetensors dtype config.json names (`dtype`, else `torch_dtype`), else F32."""
    for key in ("dtype", "torch_dtype"):
        value = config.data.get(key)
        if isinstance(value, str):
            if value not in TORCH_DTYPE_NAMES:
                raise SemanticError(f"config `{key}` is {value!r}; expected one of "
                                    f"{', '.join(sorted(TORCH_DTYPE_NAMES))}",
                                    location=config.locate("/" + key), pointer="/" + key)
            return TORCH_DTYPE_NAMES[value]
    return "F32"
