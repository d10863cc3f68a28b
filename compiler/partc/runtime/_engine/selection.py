"""The bottom of the reading engine: what a read asks for (`TensorSelection`) and who is told
of it (`ReadRecorder`); every other module of the engine builds on these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from partc.parallel.placements import local_shape


class ReadRecorder(Protocol):
    """Instrumentation told of every byte run actually read from a file.

    A large read calls it from several reader threads, in no particular order.
    """

    def record(self, path: str, offset: int, length: int) -> None:
        """Note that `length` bytes were read from `path` at absolute `offset`."""


@dataclass(frozen=True, slots=True)
class TensorSelection:
    """The part of a tensor a rank owns: global slices along `axis`, concatenated in order."""

    axis: int | None = None
    """Axis the ranges cut, or None for the whole tensor."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Half-open global ranges [start, end) along `axis`, concatenated in this order."""

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the selected part of a tensor of global `shape` (assumes valid ranges)."""
        return local_shape(shape, (self.axis, self.ranges))


WHOLE = TensorSelection()
"""The selection of an entire tensor."""
