"""A build's plan.json read back: one typed, frozen view that inspect, explain, report, verify and
shard read instead of walking the JSON document.

`read_plan` reads the file once, builds the view (`plan_decode`, into the records of
`plan_records`), and turns anything the view trips over into one LoadError located at its line
in the plan file (`plan_errors`): a value of the wrong type is explained by the plan schema
(`front.schema.plan_faults`: file, line and JSON pointer), and a plan that follows the schema
but disagrees with itself (its ranks against its topology) names the pointer and the values.
Every read then checks the whole plan schema and the bounds the schema does not state
(`plan_checks`).

The modules import one another without a cycle: `plan_records` and `plan_errors` import none of
the others, `plan_decode` and `plan_checks` those two, and this module all four.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from partc.errors import LoadError, SourceLocation
from partc.front.load import MAX_PLAN_BYTES, read_bytes
from partc.plan.plan_checks import (
    _check_sane,
    _check_topology_sizes,
    _Insane,
    _insane,
    _schema_problem,
)
from partc.plan.plan_decode import _plan_file
from partc.plan.plan_errors import _FAULTS, _fault, _located
from partc.plan.plan_records import PlanFile

PLAN_KEYS = ("topology", "groups", "ranks", "tensors", "boundary", "family", "plan_hash")
"""The top-level keys a plan document must have to be read as one."""


def read_plan(path: str | Path, *, label: str | None = None, hint: str = "") -> PlanFile:
    """Read, check and type a plan.json; one LoadError located in the file when it cannot be
    read as a plan. `label` names the file in read errors (default `a plan from <path>`),
    `hint` is added to them."""
    file = Path(path)
    where = SourceLocation(str(file))
    label = f"a plan from {file}" if label is None else label
    tail = f"; {hint}" if hint else ""
    text = ""
    try:  # a regular file only, checked before it is opened: a FIFO would block the read
        text = read_bytes(file, label, MAX_PLAN_BYTES).decode()
        document = json.loads(text)
    except LoadError as exc:
        raise LoadError(f"{exc.message}{tail}", location=where) from None
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: an integer of > 4300 digits
        raise _unreadable(file, label, text, exc, tail) from None
    missing = [key for key in PLAN_KEYS if not isinstance(document, dict) or key not in document]
    if missing:
        raise LoadError(f"{file} is not a partc plan: it lacks {', '.join(missing)}",
                        location=where)
    try:
        _check_topology_sizes(document["topology"])
        view = _plan_file(file, document)
    except _Insane as exc:
        raise _insane(file, exc) from None
    except _FAULTS as exc:
        raise _fault(file, document, exc, "") from None
    try:
        _check_sane(view)
    except _Insane as exc:
        raise _insane(file, exc) from None
    problem = _schema_problem(document, view)
    if problem is not None:
        raise _located(file, problem[0], f"the plan breaks its schema: {problem[1]}")
    return view


_LONG_INTEGER = re.compile(r"(?<![0-9.eE])-?[0-9]{21,}")
"""An integer of more digits than any a plan states (2^64 has 20): json refuses one of more
than 4300 digits (`sys.get_int_max_str_digits`), and this finds where it is."""


def _unreadable(file: Path, label: str, text: str, exc: Exception, tail: str) -> LoadError:
    """The LoadError for a plan.json that is not UTF-8 JSON: an over-long integer located at
    its line and column (json names neither), else json's own message and position."""
    long = _LONG_INTEGER.search(text) if isinstance(exc, ValueError) else None
    if long is not None and "digits" in str(exc):
        line = text.count("\n", 0, long.start()) + 1
        column = long.start() - (text.rfind("\n", 0, long.start()) + 1) + 1
        return LoadError(f"cannot read {label}: an integer of {len(long.group().lstrip('-'))} "
                         "digits, more than the 4300 a JSON reader converts (a plan's integers "
                         f"have at most 20){tail}",
                         location=SourceLocation(str(file), line, column))
    return LoadError(f"cannot read {label}: {exc}{tail}", location=SourceLocation(str(file)))
