"""Progress on a terminal: byte bars for the loader's reads, and the steps of long compiles,
checks and shards (tqdm when installed, else one line redrawn in place; nothing off a terminal)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TextIO


@contextmanager
def progress_bar(total: int, description: str, enabled: bool | None = None
                 ) -> Iterator[Callable[[int], None] | None]:
    """A byte-count progress callback drawing a tqdm bar once a task passes one second.

    `enabled=None` draws only when stderr is a terminal; the callback is None when no bar is
    drawn (also when tqdm is not installed).
    """
    interactive = sys.stderr is not None and sys.stderr.isatty()
    if enabled is False or (enabled is None and not interactive) or total <= 0:
        yield None
        return
    try:  # tqdm is optional at serving time: the runtime needs only numpy and ml_dtypes
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        yield None
        return
    with tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
              delay=1.0, leave=False, dynamic_ncols=True) as bar:
        yield bar.update


class ProgressCallback(Protocol):
    """Progress of a long task, step by step: `step` names the phase (`bind groups`, `render
    modules`, `write rank-00-of-04.safetensors`), `done` of `total` items (bytes when `unit` is
    `B`) are finished. Called with `done == total` when a step ends."""

    def __call__(self, step: str, done: int, total: int, *, unit: str = "") -> None:
        """Report that `done` of `total` of `step` are finished."""


REDRAW_SECONDS = 0.1
"""Least time between two redraws of one step (its first and last state are always drawn)."""


class TerminalProgress:
    """Draws each step of a long task on a terminal stream: a tqdm bar when tqdm is installed
    (and `use_tqdm`), else one line redrawn in place with a carriage return. The last drawing is
    cleared by `close`, so nothing is left between the command's own output lines."""

    def __init__(self, stream: TextIO, *, prefix: str = "partc", use_tqdm: bool = True) -> None:
        self.stream = stream
        """Where to draw (stderr, a terminal)."""
        self.prefix = prefix
        """The first word of every line."""
        self._tqdm: Any = None
        if use_tqdm:
            try:  # optional, as for the loader's bars
                from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
            except ImportError:
                pass
            else:
                self._tqdm = tqdm
        self._bar: Any = None
        self._step: str | None = None
        self._drawn = 0.0
        self._width = 0

    def __call__(self, step: str, done: int, total: int, *, unit: str = "") -> None:
        """Draw `step` at `done` of `total`."""
        new = step != self._step
        if new:
            self._end_step()
            self._step = step
        if self._tqdm is not None:
            self._draw_tqdm(step, done, total, unit, new)
            return
        now = time.monotonic()
        if new or done >= total or now - self._drawn >= REDRAW_SECONDS:
            self._drawn = now
            self._write_line(f"{self.prefix}: {step} {_amount(done, total, unit)}")

    def _draw_tqdm(self, step: str, done: int, total: int, unit: str, new: bool) -> None:
        if new or self._bar is None:
            sized = bool(_columns(self.stream))  # a terminal of no size: tqdm would draw nothing
            self._bar = self._tqdm(
                total=max(total, 0), desc=f"{self.prefix}: {step}", unit=unit or "it",
                unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                leave=False, dynamic_ncols=sized, ncols=None if sized else DEFAULT_COLUMNS,
                nrows=None if sized else DEFAULT_ROWS, file=self.stream,
                mininterval=REDRAW_SECONDS)
        bar = self._bar
        if total != bar.total:
            bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.refresh()  # the finished state is drawn even when the last update came soon

    def _write_line(self, text: str) -> None:
        text = text[:max(1, (_columns(self.stream) or DEFAULT_COLUMNS) - 1)]  # never wraps
        pad = " " * max(0, self._width - len(text))
        self.stream.write(f"\r{text}{pad}")
        self.stream.flush()
        self._width = len(text)

    def _end_step(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """End the last step and clear its line."""
        self._end_step()
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
        self._step = None


DEFAULT_COLUMNS = 80
"""Width assumed for a terminal that reports none."""
DEFAULT_ROWS = 24
"""Height assumed for a terminal that reports none."""


def _columns(stream: TextIO) -> int:
    """The width of the terminal `stream` draws on (0 when it reports none)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _amount(done: int, total: int, unit: str) -> str:
    """`3/12`, or for bytes `1.5/4.0 MiB (37%)`."""
    if unit != "B":
        return f"{done}/{total}{' ' + unit if unit else ''}"
    scale, name = next(((1 << s, n) for s, n in ((30, "GiB"), (20, "MiB"), (10, "KiB"))
                        if total >= 1 << s), (1, "B"))
    share = f" ({100 * done // total}%)" if total else ""
    if scale == 1:
        return f"{done}/{total} B{share}"
    return f"{done / scale:.1f}/{total / scale:.1f} {name}{share}"


def stream_is_terminal(stream: Any) -> bool:
    """True when `stream` is an open terminal (False for files, pipes and closed streams)."""
    try:
        return stream is not None and bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


@contextmanager
def terminal_progress(enabled: bool | None = None, stream: TextIO | None = None
                      ) -> Iterator[ProgressCallback | None]:
    """A progress callback drawing on `stream` (default stderr), or None when nothing is to be
    drawn: `enabled=False`, or `enabled=None` and the stream is not a terminal."""
    out = sys.stderr if stream is None else stream
    if enabled is False or (enabled is None and not stream_is_terminal(out)):
        yield None
        return
    reporter = TerminalProgress(out)
    try:
        yield reporter
    finally:
        reporter.close()
