"""Errors of a plan.json read: a LoadError located at the line of the plan file a JSON pointer
names, and a value of the wrong kind explained by the plan schema
(`front.schema.plan_faults`: file, line and JSON pointer) where it can be."""

from __future__ import annotations

from pathlib import Path

from partc.errors import LoadError, SourceLocation


def _located(file: Path, pointer: str, message: str) -> LoadError:
    """A LoadError for what is wrong at `pointer` of the plan, located at its line when it can
    be, telling the user to compile again."""
    from partc.front.positions import json_locations

    try:
        where = json_locations(str(file), file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        where = {}
    return LoadError(f"{message}; it was edited, or not written by partc: compile the build "
                     "again", location=where.get(pointer, SourceLocation(str(file))),
                     pointer=pointer)


_FAULTS = (TypeError, KeyError, ValueError, IndexError, AttributeError)
"""What building the view raises on a value of the wrong kind."""


def _fault(file: Path, document: object, exc: Exception, pointer: str) -> LoadError:
    """The LoadError for a plan the view cannot be built from: located by the plan schema
    (file, line and pointer) when the schema explains it, else at `pointer` with `exc`."""
    from partc.front.schema import plan_faults

    try:
        with plan_faults(file, document):
            raise exc
    except LoadError as located:
        return located
    except _FAULTS:  # the schema allows it
        pass
    return _located(file, pointer, f"the plan cannot be read: {exc}")
