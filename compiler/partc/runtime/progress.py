"""Progress bars for long reads and writes (tqdm when installed, on a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


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
