"""Floats of the expression language: config values as exact rationals, and their rounding.

A config float is the exact rational of the shortest decimal that reads back as it (Python's
`repr`: the JSON text for any value written with at most 15 significant digits; `0.4` is 2/5,
never 0.40000000000000002220446). `+ - *` and comparisons compute exactly; `//` and `%` take
integers only. A float is never an integer by itself: a shape or a count needs `floor`, `ceil`
or `round` (half to even, exactly: `round(5/2)` is 2, `round(7/2)` is 4), and is refused
naming the value otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

ROUNDING: dict[str, Callable[[int | Fraction], int]] = {
    "floor": math.floor, "ceil": math.ceil, "round": round,
}
"""The functions that turn a number into an integer, by name."""


def exact(value: float | Fraction) -> Fraction:
    """The rational a float stands for (a Fraction is returned as it is); finite floats only."""
    return Fraction(repr(value)) if isinstance(value, float) else value


def fraction_text(value: Fraction) -> str:
    """A float's decimal spelling when `repr` is exact (`0.4`), else `n/d`."""
    as_float = float(value)
    if math.isfinite(as_float) and Fraction(repr(as_float)) == value:
        return repr(as_float)
    return f"{value.numerator}/{value.denominator}"
