"""Stage 2: validate a loaded document against `schemas/architecture.schema.json`.

This is the one place where jsonschema errors become partc errors: the error's
`absolute_path` becomes a JSON pointer, the pointer a source location, and the
`schema_path` is kept as a second field. Messages are rewritten to state what was expected and
what was found in the author's own vocabulary (mapping/list for YAML, table/array for TOML); a
failed `oneOf` is explained by the alternative that got furthest, not by the first one tried.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
from jsonschema.exceptions import ValidationError

from partc.errors import LoadError, SchemaError, SourceLocation
from partc.front.positions import escape_pointer_token

if TYPE_CHECKING:
    from partc.front.load import RawDocument


@cache
def load_schema(name: str) -> dict[str, Any]:
    """A JSON Schema shipped with partc, by file name (e.g. `plan.schema.json`)."""
    text = resources.files("partc.schemas").joinpath(name).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _pointer(path: Any) -> str:
    return "".join("/" + escape_pointer_token(token) for token in path)


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


_TYPE_WORDS = {
    "yaml": {"object": "a mapping", "array": "a list"},
    "toml": {"object": "a table", "array": "an array"},
    "json": {"object": "an object", "array": "an array"},
}
_ARTICLES = {"integer": "an integer", "boolean": "a boolean", "string": "a string",
             "number": "a number", "null": "null"}


@dataclass(frozen=True, slots=True)
class _Found:
    """One explained violation: the jsonschema error it came from, its pointer and message."""

    error: ValidationError
    pointer: str
    message: str


class _Explainer:
    """Turns jsonschema errors into partc messages for one document format."""

    def __init__(self, document: RawDocument) -> None:
        self.document = document
        self.words = _TYPE_WORDS.get(document.format, _TYPE_WORDS["json"])

    def type_word(self, name: str) -> str:
        return self.words.get(name) or _ARTICLES.get(name, name)

    def types(self, value: Any) -> str:
        names = value if isinstance(value, list) else [value]
        return " or ".join(self.type_word(str(n)) for n in names)

    def explain(self, error: ValidationError) -> Iterator[_Found]:
        """Every located message that `error` stands for (several for extra keys)."""
        pointer = _pointer(error.absolute_path)
        keyword, rule, instance, schema = _parts(error)
        if keyword in ("oneOf", "anyOf"):
            yield from self.alternatives(error)
        elif keyword == "additionalProperties" and isinstance(instance, dict):
            allowed = sorted(schema.get("properties", {}))
            patterns = schema.get("patternProperties", {})
            for key in instance:
                if key in allowed or any(re.search(p, key) for p in patterns):
                    continue
                yield _Found(error, pointer + "/" + escape_pointer_token(key),
                             _unexpected_key(key, allowed))
        elif keyword == "required" and isinstance(instance, dict):
            for key in rule:
                if key not in instance:
                    yield _Found(error, pointer, f"missing required key `{key}`")
        else:
            yield _Found(error, pointer, self.message(error))

    def message(self, error: ValidationError) -> str:
        """A message stating the rule and the value found."""
        keyword = str(error.validator)
        if "propertyNames" in error.absolute_schema_path:  # the instance is the key itself
            inner = (f"expected {self.rule_phrase(error)}" if keyword in _PHRASED
                     else self.keyword_message(error))
            return f"key {_describe(error.instance)} is not allowed: {inner}"
        return self.keyword_message(error)

    def keyword_message(self, error: ValidationError) -> str:
        """'expected <rule>, found <value>' for one failed keyword (`_KEYWORD_MESSAGES`)."""
        keyword, rule, instance, _ = _parts(error)
        message = _KEYWORD_MESSAGES.get(keyword)
        return str(error.message) if message is None else message(self, error, rule, instance)

    def rule_phrase(self, error: ValidationError) -> str:
        """What a failed keyword expected, as a noun phrase ('an integer', 'one of ...')."""
        keyword, rule, _, _ = _parts(error)
        phrase = _RULE_PHRASES.get(keyword)
        return self.keyword_message(error) if phrase is None else phrase(self, rule)

    def alternatives(self, error: ValidationError) -> Iterator[_Found]:
        """Explain a failed oneOf/anyOf by the alternative that matched furthest."""
        pointer = _pointer(error.absolute_path)
        branches = error.validator_value if isinstance(error.validator_value, list) else []
        keyed = _exclusive_keys(branches)
        if keyed and isinstance(error.instance, dict):
            present = [k for k in keyed if k in error.instance]
            if len(present) != 1:
                found = ", ".join(f"`{k}`" for k in present) or "none of them"
                yield _Found(error, pointer, f"expected exactly one of "
                             f"{', '.join(f'`{k}`' for k in keyed)}, found {found}")
                return
            branch = keyed.index(present[0])
            inside = [e for e in error.context if e.relative_schema_path[0] == branch]
            for child in _deepest(inside):
                yield from self.explain(child)
            return
        if not error.context:
            yield _Found(error, pointer, error.message)
            return
        by_branch: dict[int, list[ValidationError]] = {}
        for child in error.context:
            by_branch.setdefault(int(child.relative_schema_path[0]), []).append(child)
        # alternatives of the instance's own type (a mapping for a mapping) explain it best
        fitting = {b: errs for b, errs in by_branch.items() if _fits(errs, error.instance)}
        candidates = fitting or by_branch
        depth = {b: max(len(e.relative_path) for e in errs) for b, errs in candidates.items()}
        best = max(depth.values())
        only = next(iter(candidates.values())) if len(candidates) == 1 else []
        mismatch = bool(only) and all(e.validator in ("enum", "const") for e in only)
        if best == 0 and (len(candidates) > 1 or mismatch):
            # each failed at the value itself: say what every alternative wanted
            message = self.combined(error, by_branch if mismatch else candidates)
            if message:
                yield _Found(error, pointer, message)
                return
        chosen = min((b for b in candidates if depth[b] == best),
                     key=lambda b: (len(candidates[b]), b))
        for child in _deepest(candidates[chosen]) if best else candidates[chosen]:
            yield from self.explain(child)


    def combined(self, error: ValidationError, branches: dict[int, list[ValidationError]]
                 ) -> str:
        """'expected A, B or C, found X' over alternatives that all failed at the value."""
        ordered = [errs for _, errs in sorted(branches.items())]
        wanted = list(dict.fromkeys(self.rule_phrase(errs[0]) for errs in ordered
                                    if str(errs[0].validator) in _PHRASED))
        if not wanted:
            return ""
        instance = error.instance
        message = f"expected {_or(wanted)}, found {_describe(instance)}"
        if isinstance(instance, str):
            values = [str(v) for errs in ordered for v in _allowed_values(errs[0])]
            close = difflib.get_close_matches(instance, values, n=1)
            message += f"; did you mean {json.dumps(close[0])}?" if close else ""
        allowed = {key for errs in ordered for e in errs for key in _properties(e)}
        if isinstance(instance, dict) and allowed:
            for key in instance:
                if key not in allowed:
                    message += "; " + _unexpected_key(key, sorted(allowed)).split(
                        " (allowed here")[0]
        return message


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string" if isinstance(value, str) else "null"


def _fits(errors: list[ValidationError], instance: Any) -> bool:
    """Whether an alternative is of the instance's type (it failed inside, not at the type)."""
    for error in errors:
        if len(error.relative_path):
            continue
        keyword, rule, _, _ = _parts(error)
        if keyword == "type":
            return False
        if keyword in ("enum", "const"):
            values = rule if keyword == "enum" else [rule]
            if all(_json_type(v) != _json_type(instance) for v in values):
                return False
    return True


_PHRASED = ("type", "enum", "const", "pattern", "required")


def _allowed_values(error: ValidationError) -> list[Any]:
    """The values an `enum` or `const` keyword allows ([] for another keyword)."""
    keyword, rule, _, _ = _parts(error)
    return list(rule) if keyword == "enum" else [rule] if keyword == "const" else []


def _properties(error: ValidationError) -> Iterator[str]:
    """The property names the schema of `error` declares."""
    schema = _parts(error)[3]
    if isinstance(schema, dict):
        yield from schema.get("properties") or ()


def _s(count: int) -> str:
    return "s" * (count != 1)


Message = Callable[[_Explainer, ValidationError, Any, Any], str]
"""A failed keyword's message from (explainer, error, the keyword's value, the instance)."""


def _expected(explainer: _Explainer, error: ValidationError, rule: Any, instance: Any) -> str:
    return f"expected {explainer.rule_phrase(error)}, found {_describe(instance)}"


def _enum(explainer: _Explainer, error: ValidationError, rule: Any, instance: Any) -> str:
    message = _expected(explainer, error, rule, instance)
    if not isinstance(instance, str):
        return message
    close = difflib.get_close_matches(instance, [str(v) for v in rule], n=1)
    return message + (f"; did you mean {json.dumps(close[0])}?" if close else "")


_KEYWORD_MESSAGES: dict[str, Message] = {
    "type": _expected,
    "enum": _enum,
    "const": _expected,
    "pattern": _expected,
    "minItems": lambda _x, _e, rule, instance: (
        f"expected at least {rule} item{_s(rule)}, found {len(instance)}"),
    "maxItems": lambda _x, _e, rule, instance: (
        f"expected at most {rule} items, found {len(instance)}"),
    "minLength": lambda _x, _e, rule, instance: (
        f"expected a string of at least {rule} character{_s(rule)}, found "
        f"{_describe(instance)}"),
    "maxLength": lambda _x, _e, rule, instance: (
        f"expected at most {rule} characters, found a string of {len(instance)}"),
    "minimum": lambda _x, _e, rule, instance: (
        f"expected a number >= {rule}, found {_describe(instance)}"),
    "maximum": lambda _x, _e, rule, instance: (
        f"expected a number <= {rule}, found {_describe(instance)}"),
    "minProperties": lambda _x, _e, rule, instance: (
        f"expected at least {rule} key{_s(rule)}, found {len(instance)}"),
    "maxProperties": lambda _x, _e, rule, instance: (
        f"expected at most {rule} keys, found {len(instance)}"),
    "uniqueItems": lambda _x, _e, rule, instance: (
        f"expected every item once, found a repeated item in {_describe(instance)}"),
}
"""Per jsonschema keyword, its message (jsonschema's own for a keyword not listed), as
jsonschema's VALIDATORS table maps each keyword to its check."""


IDENTIFIER = "^[A-Za-z_][A-Za-z0-9_]*$"
"""The schema's identifier pattern, which messages name in words."""


def _pattern_phrase(explainer: _Explainer, rule: Any) -> str:
    if rule == IDENTIFIER:
        return "an identifier (letters, digits and `_`, not starting with a digit)"
    return f"a string matching {rule!r}"


_RULE_PHRASES: dict[str, Callable[[_Explainer, Any], str]] = {
    "type": lambda explainer, rule: explainer.types(rule),
    "enum": lambda _x, rule: "one of " + ", ".join(json.dumps(v) for v in rule),
    "const": lambda _x, rule: json.dumps(rule),
    "pattern": _pattern_phrase,
    "required": lambda explainer, rule: (
        "a " + explainer.words["object"].split()[-1] + " with "
        + ", ".join(f"`{k}`" for k in rule)),
}
"""Per keyword, what it expects as a noun phrase (others: their `_KEYWORD_MESSAGES`)."""


def _parts(error: ValidationError) -> tuple[str, Any, Any, Any]:
    """(keyword, rule, instance, schema) of a jsonschema error, as plain values."""
    keyword: Any = error.validator
    rule: Any = error.validator_value
    instance: Any = error.instance
    schema: Any = error.schema
    return str(keyword), rule, instance, schema


def _or(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _deepest(errors: list[ValidationError]) -> list[ValidationError]:
    depth = max(len(e.relative_path) for e in errors)
    return [e for e in errors if len(e.relative_path) == depth]


def _exclusive_keys(branches: list[Any]) -> list[str]:
    """For `oneOf` alternatives that each require one distinct key: those keys ([] otherwise)."""
    keys = []
    for branch in branches:
        required = branch.get("required") if isinstance(branch, dict) else None
        if not required or "not" not in branch:
            return []
        keys.append(required[0])
    return keys if len(set(keys)) == len(keys) else []


def _unexpected_key(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    listed = f" (allowed here: {', '.join(allowed)})" if allowed else ""
    return f"unexpected key `{key}`{hint}{listed}"


def _node(data: Any, path: Sequence[Any]) -> Any:
    """The value at `path` (keys and indices) of plain data (None: absent)."""
    for token in path:
        if isinstance(data, dict) and token in data or isinstance(data, list) and isinstance(
                token, int) and 0 <= token < len(data):
            data = data[token]
        else:
            return None
    return data


_RULES = ("`{equal: A}`, `{balanced: A}`, `{partitioned: A}`, `{partitioned_segments: {axis: A, "
          "segments: [...]}}` or `{segmented: {axis: A, segments: [...]}}`")
"""The axis rules a member sharding may be, as written."""


def _member_sharding_hint(document: RawDocument, path: Sequence[Any], instance: Any) -> str:
    """A `module:` group's or a member's `sharding` given a word it does not take (a
    projection's `column` / `row`); a mapping's message already lists the rules."""
    if isinstance(instance, dict):
        return ""
    where = "a member's" if "members" in path else "a `module:` group's"
    hint = f"{where} `sharding` is `replicated` or one rule along an axis A: {_RULES}"
    if instance not in ("column", "row"):
        return hint
    group = _node(document.data, path[:2])
    vocabulary = isinstance(group, dict) and group.get("role") == "vocabulary"
    return hint + ("; `column` and `row` split the projections of a `projections:` group"
                   + (": a vocabulary head's rows are split with `{balanced: 0}`, as the "
                      "built-in families write it" if vocabulary else ""))


def _projection_sharding_hint(document: RawDocument, path: Sequence[Any], instance: Any) -> str:
    """A projection's `sharding` given a member rule along an axis."""
    if not isinstance(instance, dict):
        return ""
    return ("a projection's `sharding` is `column` (its output features), `row` (its input "
            "features) or `replicated`; a rule along an axis belongs to a `module:` group or a "
            "`members:` entry")


_HINTS: dict[str, Callable[[RawDocument, Sequence[Any], Any], str]] = {
    "sharding": _member_sharding_hint,
    "projection/properties/sharding": _projection_sharding_hint,
}
"""Known mistakes: per schema location under `$defs`, the hint added to a violation there,
from (document, the violating value's path, the value); '' for none."""


@cache
def _hint_locations(name: str) -> dict[int, str]:
    """The `id` of each schema node `_HINTS` names, to its key (a schema without it: none)."""
    found = {}
    for key in _HINTS:
        node = _node(load_schema(name).get("$defs"), key.split("/"))
        if isinstance(node, dict):
            found[id(node)] = key
    return found


def _hint(schema: str, document: RawDocument, error: ValidationError) -> str:
    """The known-mistake hint of a violation ('' for none)."""
    key = _hint_locations(schema).get(id(error.schema))
    return "" if key is None else _HINTS[key](document, list(error.absolute_path),
                                              error.instance)


def first_data_error(schema: str, data: object) -> tuple[str, str] | None:
    """The most relevant violation of plain JSON data (no source positions, such as a plan
    read back) against a shipped schema: (JSON pointer, jsonschema's message); None if valid."""
    error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(data))
    if error is None:
        return None
    return "".join(f"/{escape_pointer_token(p)}" for p in error.absolute_path), error.message


@contextmanager
def plan_faults(path: Path, plan: object) -> Iterator[None]:
    """Report a plan.json (read from `path` as `plan`) that a command trips over as a located
    LoadError when it breaks the plan schema (edited by hand, or written by another tool).

    A plan partc wrote follows its schema by construction, so the schema is checked only after
    a failure: validating a full-size plan (tens of MB) on every command would cost seconds.
    A failure on a plan that follows the schema is a bug, and propagates as one.
    """
    try:
        yield
    except (TypeError, KeyError, ValueError, IndexError, AttributeError, ZeroDivisionError):
        from partc.front.positions import json_locations

        problem = first_data_error("plan.schema.json", plan)
        if problem is None:
            raise
        pointer, message = problem
        try:
            where = json_locations(str(path), path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            where = {}
        raise LoadError(f"the plan breaks its schema: {message}; it was edited, or not "
                        "written by partc: compile the build again",
                        location=where.get(pointer, SourceLocation(str(path))),
                        pointer=pointer) from None


def iter_schema_errors(document: RawDocument, schema: str = "architecture.schema.json"
                       ) -> Iterator[SchemaError]:
    """Yield every schema violation of `document`, located by pointer and source position."""
    explainer = _Explainer(document)
    seen: set[tuple[str, str]] = set()
    for error in _validator(schema).iter_errors(document.data):
        for found in explainer.explain(error):
            message = found.message
            for extra in (_hint(schema, document, found.error), document.note(found.pointer)):
                if extra:
                    message = f"{message}; {extra}"
            if (found.pointer, message) in seen:
                continue
            seen.add((found.pointer, message))
            where = (document.locate_key(found.pointer)
                     if found.error.validator == "additionalProperties"
                     else document.locate(found.pointer))
            yield SchemaError(message, location=where,
                              pointer=found.pointer,
                              schema_path=_pointer(found.error.absolute_schema_path))


def validate_document(document: RawDocument) -> list[SchemaError]:
    """Every schema error of `document`, sorted by position."""
    return sorted(iter_schema_errors(document), key=SchemaError.sort_key)
