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
T=2, 4 and 8: `python benchmarks/warm_gathers.py`), an AMD EPYC whose kernel copies without
`rep movsb` (no ERMS): where the kernel's copies are faster, rows whole win more often
(`calibrate_warm` measures the machine; `warm_models` reads what it cached)."""
WARM_PIECES = StorageModel(0.25e-6, 3.2e9)
"""The same gather copying each piece by itself (`_engine.gather`: process_vm_writev out of the
file's mapping, 1024 pieces a call): ~0.25 us a piece, and its bytes at ~3.2 GB/s (the kernel
pins every destination page it writes). Measured as `WARM_ROWS`."""
WARM = StorageModel(WARM_PIECES.latency, WARM_ROWS.bandwidth)
"""The page cache under a byte cap (`plan_merges` with a budget): skipping a gap costs a piece
(`WARM_PIECES`), reading it through its bytes (`WARM_ROWS`). Gaps up to ~2.3 KB are worth
reading through."""


def warm_rows_whole(row_bytes: int, widths: list[int],
                    models: tuple[StorageModel, StorageModel] | None = None) -> bool:
    """Whether a warm column gather with no cap reads its rows whole (the first of `models`,
    by default `warm_models()`'s: every byte of a row, a buffer for each piece and each gap)
    rather than copying its pieces (the second: a request for each piece, its bytes only), by
    the modelled time of one row (the same in every row). On the project's machine a rank's
    half of a row is cheaper read with the other half, its quarter or eighth cheaper copied
    by itself (measured: `WARM_ROWS`)."""
    rows, pieces = warm_models() if models is None else models
    return rows.cost(2 * len(widths), row_bytes) <= pieces.cost(len(widths), sum(widths))


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


PAGE_CACHE = "page cache"
"""The cache's key for this machine's warm gather models (`calibrate_warm`; the other keys are
storage devices' st_dev)."""
_WARM: list[tuple[StorageModel, StorageModel]] = []
"""The warm gather models once looked up in this process (empty before)."""


def warm_models() -> tuple[StorageModel, StorageModel]:
    """(whole rows, pieces by themselves): the models of a warm column gather's two ways on this
    machine: its cached calibration (`calibrate_warm`), else `WARM_ROWS` and `WARM_PIECES`."""
    if not _WARM:
        _WARM.append(_warm_entry(_cached().get(PAGE_CACHE)) or (WARM_ROWS, WARM_PIECES))
    return _WARM[0]


def _warm_entry(entry: Any) -> tuple[StorageModel, StorageModel] | None:
    """The two models of a cached page-cache entry; None when it is missing or malformed."""
    try:
        return (StorageModel(entry["rows"]["latency"], entry["rows"]["bandwidth"]),
                StorageModel(entry["pieces"]["latency"], entry["pieces"]["bandwidth"]))
    except (KeyError, TypeError, ValueError):
        return None


def cached_warm() -> tuple[str, StorageModel, StorageModel] | None:
    """This machine's cached warm calibration as (the file measured, whole rows, pieces), or
    None."""
    entry = _cached().get(PAGE_CACHE)
    found = _warm_entry(entry)
    if found is None or not isinstance(entry, dict):
        return None
    return str(entry.get("path", "")), *found


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
        _save(str(st.st_dev), {"latency": latency, "bandwidth": bandwidth, "path": path})
    return model


def _save(key: str, entry: dict[str, Any]) -> None:
    """Store `entry` under `key` in the cache file, the other keys kept."""
    cached = _cached()
    cached[key] = entry
    target = cache_file()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    import tempfile

    # a temporary file of this call's own, renamed over the cache: two calibrations at once
    # each leave a whole file, never a mixed one
    handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=os.path.dirname(target),
                                         prefix=".storage-", suffix=".tmp", delete=False)
    try:
        with handle:
            json.dump(cached, handle, indent=1, sort_keys=True)
        os.replace(handle.name, target)
    except BaseException:
        os.unlink(handle.name)
        raise


WARM_CASES = ((2048, 2), (2048, 8), (8192, 2), (8192, 8))
"""(row bytes, share) of the gathers `calibrate_warm` times: a rank's half and eighth of rows
as wide as a hidden size of 1024 and 4096 in bf16."""


def calibrate_warm(path: str, *, region: int = 16 << 20, repeats: int = 3,
                   save: bool = True) -> tuple[StorageModel, StorageModel]:
    """Measure this machine's two ways of a warm column gather on the first `region` bytes of
    the file `path` (read once first, so that the page cache holds them): each of
    `WARM_CASES`, its rows read whole (`_engine.rows.vector_gather`) and its pieces copied by
    themselves (`_engine.gather`, process_vm_writev), one thread, destinations faulted in first,
    the fastest of `repeats`; the two models fitted by least squares (whole rows: a buffer's
    cost and the rows' bandwidth; pieces: a piece's cost and the pieces' bandwidth) and kept in
    the cache under `PAGE_CACHE` when `save`. ValueError where process_vm_writev is refused or
    the file is shorter than 1 MiB. Takes well under a second."""
    import time

    from partc.runtime._engine.gather import Gather, GatherFile, copy_pieces, vm_copy_usable
    from partc.runtime._engine.memory import empty_array, populate
    from partc.runtime._engine.rows import vector_gather
    from partc.runtime.headers import FileHeader, TensorTable

    if not vm_copy_usable():
        raise ValueError(f"{path}: process_vm_writev is refused here, so warm column gathers "
                         f"always read their rows whole: nothing to calibrate")
    fd = os.open(path, os.O_RDONLY)
    source = None
    try:
        # any file's bytes will do: they stand for rows of a tensor, not read as one
        header = FileHeader(path=path, header_size=0, data_start=0,
                            file_size=os.fstat(fd).st_size, metadata=(),
                            tensors=TensorTable([], [], [], {}))
        size = min(region, header.file_size)
        if size < 1 << 20:
            raise ValueError(f"{path}: calibration needs a file of at least 1 MiB, found "
                             f"{header.file_size} bytes")
        scratch = bytearray(1 << 20)
        for at in range(0, size, len(scratch)):  # into the page cache
            os.preadv(fd, [memoryview(scratch)[:min(len(scratch), size - at)]], at)
        source = GatherFile(header, fd, "calibration")
        rows_a, rows_b, pieces_a, pieces_b = [], [], [], []
        for row_bytes, share in WARM_CASES:
            count, width = size // row_bytes, row_bytes // share
            out = empty_array((count, width), np.dtype(np.uint8))
            populate(int(out.ctypes.data), 0, out.nbytes)
            job = Gather(file=0, path=path, name="calibration", out=out, base=0,
                         row_bytes=row_bytes, rows=(0, count), pieces=((0, 0, width),),
                         nbytes=out.nbytes)
            job.source, job.fd = source, fd
            for way in ("rows", "pieces"):
                best = float("inf")
                for _ in range(repeats):
                    begin = time.perf_counter()
                    done = vector_gather(job, None) if way == "rows" else copy_pieces(job)
                    best = min(best, time.perf_counter() - begin)
                    if not done:
                        raise ValueError(f"{path}: the {way} gather was refused here")
                if way == "rows":  # a row: two buffers, row_bytes through the kernel
                    rows_a.append([2.0, float(row_bytes)])
                    rows_b.append(best / count)
                else:  # a row: one piece, its width
                    pieces_a.append([1.0, float(width)])
                    pieces_b.append(best / count)
    finally:
        if source is not None:
            source.close()
        os.close(fd)
    fitted = []
    for a, b in ((rows_a, rows_b), (pieces_a, pieces_b)):
        (latency, per_byte), *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
        # noise can tip a fit past zero: a request is never free of cost nor a byte either
        fitted.append(StorageModel(max(float(latency), 1e-9), 1 / max(float(per_byte), 1e-12)))
    models = (fitted[0], fitted[1])
    _WARM[:] = [models]
    if save:
        _save(PAGE_CACHE, {"path": path,
                           "rows": {"latency": models[0].latency,
                                    "bandwidth": models[0].bandwidth},
                           "pieces": {"latency": models[1].latency,
                                      "bandwidth": models[1].bandwidth}})
    return models
