"""Cold and warm loads of rank 0 against the cold floors and safetensors, in one interleaved run
(`python benchmarks/load.py --vs-safetensors`, or this file directly with load.py's options).

Every figure is a fresh process, the median of --repeats, the variants interleaved repeat by
repeat (the runs of a T in an order drawn afresh each repeat, `shuffled`). Before its clock
starts, a loader's child imports torch (partc's as a serving process has, safetensors' because
it needs it) and collects garbage, then idles 0.3 s: numpy's OpenBLAS threads spin ~0.1 s once
numpy is imported (a child timed at once paid ~25 ms of CPU for them inside a 50 ms load), and
a process that has just freed memory (torch's import frees ~300 MB) faults fresh pages in
cheaper on this VM (partc's warm T=8 load, children run one after another with nothing
between: 41 against 49 ms after importing torch, the same after allocating and freeing
300 MiB without it, the same number of page faults; in this benchmark, where each child
follows another's exit, 0.038 against 0.039 s). The warm table also shows partc in a process
that has not imported torch ("torch not imported");
bytes fetched from storage (/proc/self/io read_bytes over the rank's share) stand beside every
time, and the load average before and after is printed. Each ratio names its floor:

- sectors ÷ share: the 512-byte sectors the rank's byte runs touch, the least any read from
  this disk fetches (what a cap of 1.05 can reach where it is above 1.05);
- cold: the checkpoint evicted from the page cache (fsync, POSIX_FADV_DONTNEED; mincore checks
  that none of it stayed) before each cold run;
- partc: `load(checkpoint)` (the read planner unbounded), and with `max_fetch_ratio=1.05`;
- floor rows: one sequential read (8 MiB `readinto`, the kernel's readahead on) of the rows the
  rank touches: for each tensor, its bytes from the rank's first run to its last, adjacent
  tensors merged, in file order (readahead runs past each range's end, so it fetches more);
  "exact": readahead off and every range asked for at once (`POSIX_FADV_WILLNEED`) before the
  same reads, so it fetches those bytes only; partc is divided by the faster of the two;
- safetensors: `safe_open(..., framework="pt")`, `get_slice(name)[...]` of exactly the rank's
  slices, each `.clone()`d (torch imported before the clock starts);
- node: all T ranks at once (`LOCAL_WORLD_SIZE=T`, released together), cold; the slowest rank
  against floor cat: `cat` of the checkpoint files, cold (the node runs and cat in an order
  drawn afresh each repeat, as the one-rank runs);
- warm: the page cache settled once (evicted, read once) and read again after the cold runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

CHILD = r"""
import json, os, sys, time
mode, spec = sys.argv[1], json.loads(sys.argv[2])
IDLE = 0.3  # after the imports: numpy's OpenBLAS threads spin ~0.1 s once numpy is imported

def io():
    with open("/proc/self/io") as f:
        rows = dict(line.split(": ") for line in f.read().splitlines())
    return int(rows["read_bytes"])

result = {}
if mode.startswith("partc"):
    if not spec.get("bare"):  # as a serving process has (the module docstring)
        import gc, torch
        gc.collect()
    sys.path.insert(0, spec["build"])
    import importlib
    module = importlib.import_module(spec["module"])
    import ml_dtypes
    time.sleep(IDLE)
    b0, t0 = io(), time.monotonic()
    state = module.load(spec["checkpoint"], max_fetch_ratio=spec.get("cap"))
    result["seconds"] = time.monotonic() - t0
elif mode == "safetensors":
    import gc, torch
    from safetensors import safe_open
    gc.collect()
    time.sleep(IDLE)
    b0, t0 = io(), time.monotonic()
    mine = {}
    with safe_open(spec["file"], framework="pt") as f:
        for name, axis, ranges in spec["selections"]:
            part = f.get_slice(name)
            if axis is None:
                mine[name] = part[:].clone()
                continue
            pieces = [part[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
            mine[name] = (torch.cat(pieces, dim=axis) if len(pieces) > 1
                          else pieces[0].clone())
    result["seconds"] = time.monotonic() - t0
else:  # floor rows: one sequential read of the touched row ranges
    view = memoryview(bytearray(8 << 20))
    b0, t0 = io(), time.monotonic()
    with open(spec["file"], "rb", buffering=0) as handle:
        if mode == "rows-exact":  # exactly those bytes, all asked for at once
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            for start, end in spec["ranges"]:
                os.posix_fadvise(handle.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)
        for start, end in spec["ranges"]:
            handle.seek(start)
            left = end - start
            while left:
                got = handle.readinto(view[:min(left, len(view))])
                if not got:
                    break
                left -= got
    result["seconds"] = time.monotonic() - t0
result["read_bytes"] = io() - b0
print(json.dumps(result))
"""


def run(mode: str, spec: dict[str, Any], extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One fresh process of `mode`; its JSON result."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(spec)],
                          capture_output=True, text=True, env={**env, **(extra or {})})
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def touched_rows(folder: Path, selections: list[list[Any]]) -> list[tuple[int, int]]:
    """Absolute byte ranges from each tensor's first run of the rank to its last, adjacent ones
    merged, in file order (one file)."""
    from partc.runtime._engine.runs import byte_runs
    from partc.runtime._engine.selection import TensorSelection
    from partc.runtime.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(folder)
    ranges = []
    for name, axis, pieces in selections:
        header, entry = checkpoint.tensor(name)
        src, _, length = byte_runs(entry, TensorSelection(axis, tuple(map(tuple, pieces))))
        if len(src):
            base = header.data_start + entry.begin
            ranges.append((base + int(src.min()), base + int((src + length).max())))
    ranges.sort()
    merged = [ranges[0]]
    for start, end in ranges[1:]:
        if start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def resident(files: list[Path]) -> float:
    """The fraction of the files' pages in the page cache (mincore of a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    have = total = 0
    for f in files:
        with open(f, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        address = np.frombuffer(mapping, np.uint8).ctypes.data
        pages = np.zeros(-(-len(mapping) // mmap.PAGESIZE), np.uint8)
        libc.mincore(ctypes.c_void_p(address), len(mapping), pages.ctypes.data)
        have, total = have + int(np.count_nonzero(pages & 1)), total + len(pages)
        mapping.close()
    return have / total


WARM_RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("partc", "partc", {}), ("partc bare", "partc", {"bare": True}),
    ("safetensors", "safetensors", {}))
"""The warm runs of one T (as `COLD_RUNS`); "partc bare" has not imported torch."""
COLD_RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("partc", "partc", {}), ("partc 1.05", "partc", {"cap": 1.05}), ("floor rows", "rows", {}),
    ("floor rows exact", "rows-exact", {}), ("safetensors", "safetensors", {}))
"""The cold runs of one T: (row key, child mode, spec additions)."""


def shuffled(items: tuple[Any, ...], repeat: int) -> list[Any]:
    """`items` in an order drawn afresh each repeat (seeded by the repeat: the same run after
    run), so that no run always follows the same other: a cold read right after another of
    the same bytes can find them in the storage's own cache below this VM, which no eviction
    here reaches (measured at T=8: the exact floor right after the readahead floor, which
    reads a superset of its bytes, 146-216 ms, as a fixed order had it; partc right after
    safetensors, 209-278 ms; each right after the readahead floor, 148-206 and 180-231 ms)."""
    import random

    return random.Random(repeat).sample(items, len(items))


def compare(folder: Path, specs: dict[int, dict[str, Any]], repeats: int,
            raw: Path | None = None) -> None:
    """Run the interleaved comparison and print its table; `raw`: also write every run's
    result there (JSON: each row's runs in the order they were run)."""
    import load

    files = load.checkpoint_files(folder)
    if len(files) != 1:
        raise SystemExit("--vs-safetensors measures a single-file checkpoint (--shards 1)")
    file = str(files[0])
    size = files[0].stat().st_size
    tps = sorted(specs)
    for tp in tps:
        specs[tp]["file"] = file
        specs[tp]["ranges"] = touched_rows(folder, specs[tp]["selections"])
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    before = os.getloadavg()
    left_cached = []
    for repeat in range(repeats):
        print(f"repeat {repeat + 1} of {repeats} (load average {os.getloadavg()[0]:.2f})",
              file=sys.stderr, flush=True)
        for tp in tps:
            for key, mode, extra in shuffled(COLD_RUNS, repeat):
                load.evict(files)
                left_cached.append(resident(files))
                runs.setdefault(("cold", tp, key), []).append(run(mode, {**specs[tp], **extra}))
        # the node runs and the cat floor in an order drawn afresh too: a cat right after a
        # node has read the whole file found much of it in the storage's own cache (always
        # last in a fixed order: 0.81 s against 0.90-0.93 s shuffled, same session)
        for tp in shuffled((*[t for t in tps if t > 1], 0), repeat):
            load.evict(files)
            if tp:
                runs.setdefault(("node", tp, "partc"), []).append(
                    load.whole_node(specs[tp], tp, "cold"))
                continue
            start = time.monotonic()
            subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
            runs.setdefault(("node", 0, "cat"), []).append(
                {"seconds": time.monotonic() - start, "read_bytes": size})
        load.warm(files)
        for tp in tps:
            for key, mode, extra in shuffled(WARM_RUNS, repeat):
                runs.setdefault(("warm", tp, key), []).append(run(mode, {**specs[tp], **extra}))
    after = os.getloadavg()
    if raw is not None:
        raw.write_text(json.dumps({" ".join(map(str, key)): found
                                   for key, found in runs.items()}, indent=1))

    def med(*key: Any, field: str = "seconds") -> float:
        return statistics.median(r[field] for r in runs[key])

    print(f"\nload average {before[0]:.2f} before, {after[0]:.2f} after; median of {repeats}; "
          f"evicted file's pages left cached before a cold run: at most "
          f"{max(left_cached):.1%}")
    print("\ncold, one rank alone (s; fetched ÷ share in brackets)")
    print("| T | share MiB | sectors ÷ share | partc | partc cap 1.05 | floor rows | floor rows "
          "exact | safetensors | partc ÷ floor rows (target 1.2) | partc ÷ safetensors "
          "(target 1) | cap 1.05 ÷ floor rows |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for tp in tps:
        share = specs[tp]["local"]
        cells = []
        for key in ("partc", "partc 1.05", "floor rows", "floor rows exact", "safetensors"):
            cells.append(f"{med('cold', tp, key):.3f} "
                         f"({med('cold', tp, key, field='read_bytes') / share:.3f})")
        floor = min(med("cold", tp, "floor rows"), med("cold", tp, "floor rows exact"))
        ratio = med("cold", tp, "partc") / floor
        versus = med("cold", tp, "partc") / med("cold", tp, "safetensors")
        capped = med("cold", tp, "partc 1.05") / floor
        print(f"| {tp} | {share / 2**20:.1f} | {specs[tp]['sectors'] / share:.3f} | "
              f"{' | '.join(cells)} | {ratio:.2f}"
              f"{'' if ratio <= 1.2 else ' MISSED'} | {versus:.2f}"
              f"{'' if versus <= 1.0 else ' MISSED'} | {capped:.2f} |")
    cat = med("node", 0, "cat")
    print(f"\ncold, whole node (T ranks at once; floor cat {cat:.3f} s of {size / 2**20:.1f} MiB)")
    print("| T | slowest rank s | fetched ÷ file | slowest ÷ cat (target 1.3) | cat ÷ T s |")
    print("|--:|--:|--:|--:|--:|")
    for tp in [t for t in tps if t > 1]:
        slowest = med("node", tp, "partc")
        ratio = slowest / cat
        print(f"| {tp} | {slowest:.3f} | "
              f"{med('node', tp, 'partc', field='read_bytes') / size:.3f} | {ratio:.2f}"
              f"{'' if ratio <= 1.3 else ' MISSED'} | {cat / tp:.3f} |")
    print("\nwarm, one rank alone (s; fetched ÷ share in brackets)")
    print("| T | partc | safetensors get_slice + clone | partc ÷ safetensors (target 1) | "
          "partc, torch not imported | it ÷ safetensors |")
    print("|--:|--:|--:|--:|--:|--:|")
    for tp in tps:
        share = specs[tp]["local"]
        st = med("warm", tp, "safetensors")
        versus = med("warm", tp, "partc") / st
        print(f"| {tp} | {med('warm', tp, 'partc'):.3f} "
              f"({med('warm', tp, 'partc', field='read_bytes') / share:.3f}) | "
              f"{st:.3f} | {versus:.2f}{'' if versus <= 1.0 else ' MISSED'} | "
              f"{med('warm', tp, 'partc bare'):.3f} | {med('warm', tp, 'partc bare') / st:.2f} |")
