"""Stage 2: validate a loaded document against `schemas/architecture.schema.json`.

This is the one place where jsonschema errors become partc errors: the error's
`absolute_path` becomes a JSON pointer, the pointer a source location, and the
`schema_path` is kept as a second field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import jsonschema
from jsonschema.exceptions import ValidationError, best_match

from partc.errors import SchemaError
from partc.load import escape_pointer_token

if TYPE_CHECKING:
    from partc.load import RawDocument


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


def _message(error: ValidationError) -> str:
    """A message stating the rule and the value found."""
    found = _describe(error.instance)
    keyword = error.validator
    if keyword == "additionalProperties":
        return f"unexpected key: {error.message}"
    if keyword == "enum":
        allowed = ", ".join(json.dumps(v) for v in error.validator_value)
        return f"expected one of {allowed}, found {found}"
    if keyword == "type":
        return f"expected {error.validator_value}, found {found}"
    if keyword == "pattern":
        return f"expected a string matching {error.validator_value!r}, found {found}"
    if keyword == "const":
        return f"expected {json.dumps(error.validator_value)}, found {found}"
    return error.message


def _leaf(error: ValidationError) -> ValidationError:
    """The most relevant error inside a oneOf/anyOf failure (jsonschema's `best_match`)."""
    while error.context:
        deeper = best_match(error.context)
        if deeper is None or deeper is error:
            break
        # prefer a branch whose shape matches: a deeper path means the branch got further
        error = deeper
    return error


def iter_schema_errors(document: RawDocument, schema: str = "architecture.schema.json"
                       ) -> Iterator[SchemaError]:
    """Yield every schema violation of `document`, located by pointer and source position."""
    validator = _validator(schema)
    for error in validator.iter_errors(document.data):
        shown = _leaf(error) if error.validator in ("oneOf", "anyOf") else error
        pointer = _pointer(shown.absolute_path)
        message = _message(shown)
        if shown is not error and error.validator == "oneOf":
            message = f"{message} (no alternative of {_pointer(error.absolute_path) or '/'} fits)"
        yield SchemaError(
            message,
            location=document.locate(pointer),
            pointer=pointer,
            schema_path=_pointer(shown.absolute_schema_path),
        )


def validate_document(document: RawDocument) -> list[SchemaError]:
    """Every schema error of `document`, sorted by position."""
    return sorted(iter_schema_errors(document), key=SchemaError.sort_key)
