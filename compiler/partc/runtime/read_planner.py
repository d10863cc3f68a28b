"""Read planning: which gaps between a file's byte runs are read through (coalesced) and which
are skipped (exact runs), chosen by a cost model of the storage so that the modelled time is
least, under the user's cap on the bytes read over the share (`max_fetch_ratio`).

The model: a read of the file is a set of requests; each costs `latency` seconds (the time a
request occupies the storage at the depth the reader keeps in flight) plus its bytes over
`bandwidth`. Requests are aligned (`align`: 512 for O_DIRECT's sectors, 4096 for the page
cache's pages, 1 for copies out of the page cache), so a request for [start, end) moves
[start rounded down, end rounded up). Reading the gap between two neighbouring runs through
saves one request and costs the gap's aligned bytes: gap k weighs `w_k` = (start of run k+1
rounded down) - (end of run k rounded up), which can be negative when both runs touch one
sector (then coalescing fetches it once instead of twice), and saves `latency - w_k /
bandwidth` seconds. Each gap's weight and saving depend only on its two runs, so the fetched
bytes and the time of a plan are sums over the gaps it reads through, and the best plan under a
byte budget is a 0/1 knapsack whose items' savings fall as their weights grow: every gap of
weight <= 0 is taken, then gaps by ascending weight while they save time and fit the budget.
Any feasible set of k positive gaps is dominated item by item by the k lightest gaps, so this
is optimal, not a heuristic (`tests/test_read_planner.py` checks it against brute force).

The defaults were measured on the project's machine (virtio disk, ext4); `calibrate` measures a
device and `storage_model` reads what it cached (never required: without a cache the defaults
hold).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from partc.runtime.options import fetch_cap


class StorageModel:
    """Per-request latency (seconds, at the reader's depth) and bandwidth (bytes/s) of reads
    from one kind of storage; `cost` of a plan is requests x latency + bytes / bandwidth.

    A plain slotted class: creating a dataclass costs every runtime import about a millisecond.
    """

    __slots__ = ("bandwidth", "latency")

    def __init__(self, latency: float, bandwidth: float) -> None:
        if not (latency >= 0 and bandwidth > 0):
            raise ValueError(f"a storage model needs latency >= 0 and bandwidth > 0, found "
                             f"{latency!r} s and {bandwidth!r} B/s")
        self.latency = float(latency)
        """Seconds one request costs beyond its bytes."""
        self.bandwidth = float(bandwidth)
        """Bytes a second once a request is under way."""

    def cost(self, requests: int, nbytes: int) -> float:
        """Modelled seconds of `requests` requests moving `nbytes` bytes in all."""
        return requests * self.latency + nbytes / self.bandwidth

    def __repr__(self) -> str:
        return f"StorageModel(latency={self.latency!r}, bandwidth={self.bandwidth!r})"


COLD = StorageModel(25e-6, 1.4e9)
"""Storage (the default for a device never calibrated): measured on the project's machine with
O_DIRECT, 8 requests in flight: 4 KiB reads 23-26 us each, 1-8 MiB reads 1.4 GB/s. The gap
worth reading through is then up to ~35 KB: every gap of a column slice's rows."""
WARM_ROWS = StorageModel(0.105e-6, 9.4e9)
"""A warm column gather reading its rows whole (`_engine.rows`: vectored preadv, each piece
straight into its array, each gap into a scratch buffer): a buffer (a piece or a gap) costs
~0.1 us and every byte of the rows a kernel copy, ~9.4 GB/s. Measured on the project's machine
(one thread, destinations faulted in first, the column slices of the reference checkpoint at
T=2, 4 and 8: `python benchmarks/warm_gathers.py`)."""
WARM_PIECES = StorageModel(0.25e-6, 3.2e9)
"""The same gather copying each piece by itself (`_engine.gather`: process_vm_writev out of the
file's mapping, 1024 pieces a call): ~0.25 us a piece, and its bytes at ~3.2 GB/s (the kernel
pins every destination page it writes). Measured as `WARM_ROWS`."""
WARM = StorageModel(WARM_PIECES.latency, WARM_ROWS.bandwidth)
"""The page cache under a byte cap (`plan_merges` with a budget): skipping a gap costs a piece
(`WARM_PIECES`), reading it through its bytes (`WARM_ROWS`). Gaps up to ~2.3 KB are worth
reading through."""


def warm_rows_whole(row_bytes: int, widths: list[int]) -> bool:
    """Whether a warm column gather with no cap reads its rows whole (`WARM_ROWS`: every byte of
    a row, a buffer for each piece and each gap) rather than copying its pieces (`WARM_PIECES`:
    a request for each piece, its bytes only), by the modelled time of one row (the same in
    every row). At T=2 a rank's half of a row is cheaper read with the other half; at T=8 its
    eighth is cheaper copied by itself (measured: `WARM_ROWS`)."""
    return (WARM_ROWS.cost(2 * len(widths), row_bytes)
            <= WARM_PIECES.cost(len(widths), sum(widths)))


ENVIRONMENT = "PARTC_MAX_FETCH_RATIO"
"""The environment variable giving the default `max_fetch_ratio`."""


def environment_cap() -> float | None:
    """`PARTC_MAX_FETCH_RATIO` as a cap (unset or blank: None); a LaunchError naming it when it
    is not a number >= 1."""
    raw = os.environ.get(ENVIRONMENT, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    return fetch_cap(value if value == value else raw, f"environment {ENVIRONMENT}")


Ints = np.ndarray[Any, np.dtype[np.int64]]


def gap_weights(starts: Ints, ends: Ints, align: int) -> tuple[Ints, int]:
    """Each gap's weight (the aligned bytes reading it through adds; see the module) and the
    aligned bytes of reading every run by itself."""
    low = starts - starts % align
    high = -(-ends // align) * align
    return low[1:] - high[:-1], int((high - low).sum())


def plan_merges(starts: Ints, ends: Ints, model: StorageModel, *, align: int = 1,
                budget: float | None = None) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which gaps to read through (True at k: runs k and k+1 are one request), least modelled
    time first, the aligned bytes fetched at most `budget` (None: no cap) unless reading each
    run by itself already fetches more (then the least bytes). Runs are sorted and disjoint."""
    weights, exact = gap_weights(np.asarray(starts, np.int64), np.asarray(ends, np.int64), align)
    worth = weights < model.latency * model.bandwidth  # saves time (weight <= 0 always does)
    free = weights <= 0
    if budget is None:
        return worth | free
    room = budget - exact - int(weights[free].sum())
    chosen = free.copy()
    candidates = np.flatnonzero(worth & ~free)
    if len(candidates) and room > 0:
        order = candidates[np.argsort(weights[candidates], kind="stable")]
        chosen[order[:int(np.searchsorted(np.cumsum(weights[order]), room, "right"))]] = True
    return chosen


def plan_time(starts: Ints, ends: Ints, merged: np.ndarray[Any, Any], model: StorageModel,
              align: int = 1) -> tuple[float, int]:
    """(modelled seconds, aligned bytes fetched) of reading the runs with the gaps `merged`."""
    weights, exact = gap_weights(np.asarray(starts, np.int64), np.asarray(ends, np.int64), align)
    nbytes = exact + int(weights[merged].sum())
    return model.cost(len(starts) - int(np.count_nonzero(merged)), nbytes), nbytes


def cache_file() -> str:
    """Where calibrations are kept: $XDG_CACHE_HOME/partc/storage.json (~/.cache by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "partc", "storage.json")


def _cached() -> dict[str, Any]:
    """Every cached calibration by st_dev (empty when there is none or it cannot be read)."""
    try:
        with open(cache_file(), encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def cached_models() -> dict[int, tuple[str, StorageModel]]:
    """Every well-formed cached calibration: st_dev -> (the file measured, its model)."""
    found: dict[int, tuple[str, StorageModel]] = {}
    for device, entry in _cached().items():
        try:
            found[int(device)] = (str(entry["path"]),
                                  StorageModel(entry["latency"], entry["bandwidth"]))
        except (KeyError, TypeError, ValueError):
            continue
    return found


_MODELS: dict[int, StorageModel] = {}
"""Storage models already looked up in this process, by st_dev."""


def storage_model(device: int) -> StorageModel:
    """The model of the storage device `device` (an st_dev): its cached calibration, else
    `COLD`."""
    model = _MODELS.get(device)
    if model is None:
        entry = _cached().get(str(device))
        try:
            model = StorageModel(entry["latency"], entry["bandwidth"]) if isinstance(
                entry, dict) else COLD
        except (KeyError, TypeError, ValueError):
            model = COLD
        _MODELS[device] = model
    return model


def calibrate(path: str, *, requests: int = 512, large: int = 64 << 20, depth: int = 8,
              save: bool = True) -> StorageModel:
    """Measure the storage holding `path` (a large file on it, read with O_DIRECT so that the
    page cache neither helps nor changes): `requests` 4 KiB reads at random offsets on `depth`
    threads give the latency, `large` bytes read in 1 MiB requests the bandwidth; kept in the
    cache under the file's st_dev when `save`. Takes about a second."""
    import mmap
    import threading
    import time

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size < 1 << 20:
            raise ValueError(f"{path}: calibration needs a file of at least 1 MiB, found "
                             f"{size} bytes")
        rng = np.random.default_rng(0)
        small = (rng.integers(0, size // 4096, requests) * 4096).tolist()
        chunk = 1 << 20
        big = [(i * chunk) % (size - size % chunk or chunk)
               for i in range(max(1, min(large, size) // chunk))]

        def timed(offsets: list[int], length: int) -> float:
            todo, lock = iter(offsets), threading.Lock()

            def work() -> None:
                buffer = mmap.mmap(-1, length)
                while True:
                    with lock:
                        at = next(todo, None)
                    if at is None:
                        return
                    os.preadv(fd, [buffer], at)

            threads = [threading.Thread(target=work) for _ in range(depth)]
            begin = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return time.perf_counter() - begin

        bandwidth = len(big) * chunk / timed(big, chunk)
        latency = max(0.0, timed(small, 4096) / len(small) - 4096 / bandwidth)
    finally:
        os.close(fd)
    model = StorageModel(latency, bandwidth)
    _MODELS[st.st_dev] = model
    if save:
        cached = _cached()
        cached[str(st.st_dev)] = {"latency": latency, "bandwidth": bandwidth, "path": path}
        target = cache_file()
        os.makedirs(os.path.dirname(target), exist_ok=True)
        import tempfile

        # a temporary file of this call's own, renamed over the cache: two calibrations at
        # once each leave a whole file, never a mixed one
        handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=os.path.dirname(target),
                                             prefix=".storage-", suffix=".tmp", delete=False)
        try:
            with handle:
                json.dump(cached, handle, indent=1, sort_keys=True)
            os.replace(handle.name, target)
        except BaseException:
            os.unlink(handle.name)
            raise
    return model
