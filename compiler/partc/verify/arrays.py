"""Global arrays rebuilt from the ranks' local pieces, for the checks of `partc verify`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["scatter"]


def scatter(shape: tuple[int, ...], selection: tuple[int | None, Sequence[tuple[int, int]]],
             local: np.ndarray) -> np.ndarray:
    """A zeroed global array holding `local` at the global ranges it was read from."""
    axis, ranges = selection
    out = np.zeros(shape, dtype=local.dtype)
    if axis is None:
        out[...] = local
        return out
    offset = 0
    for start, end in ranges:
        index: list[slice] = [slice(None)] * len(shape)
        index[axis] = slice(start, end)
        source: list[slice] = [slice(None)] * len(shape)
        source[axis] = slice(offset, offset + end - start)
        out[tuple(index)] = local[tuple(source)]
        offset += end - start
    return out
