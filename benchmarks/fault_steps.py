"""Reading warm checkpoint bytes into fresh pages: the destination faulted in all at once
first, or step by step just before each read (`python benchmarks/fault_steps.py --dir DIR`):
the measurement behind `partc.runtime._engine.memory.FAULT_STEP`.

Writes (or reuses) the reference checkpoint of `benchmarks/load.py`, reads it once so that the
page cache holds it, then, in fresh processes (each its own fresh pages, the cases interleaved,
median of --repeats), reads 96 MiB of it with preadv into one new anonymous mapping, one
thread:

- all first: MADV_POPULATE_WRITE of the whole destination, then reads of 8 MiB;
- steps of S KiB: MADV_POPULATE_WRITE of S KiB, then the read of those S KiB, and so on.

The kernel zeroes each page it faults in; read right after, the zeroed lines are still in the
core's cache and the copy writes over them there.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load  # noqa: E402  (benchmarks/load.py: the reference checkpoint)
import load_compare  # noqa: E402  (its interleaving)

CHILD = r"""
import ctypes, mmap, os, sys, time
path, step = sys.argv[1], int(sys.argv[2])
size, offset, populate_write = 96 << 20, 64 << 20, 23
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
fd = os.open(path, os.O_RDONLY)
memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
view = memoryview(memory)
base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
time.sleep(0.2)
start = time.perf_counter()
if step == 0:
    libc.madvise(base, size, populate_write)
    for at in range(0, size, 8 << 20):
        os.preadv(fd, [view[at:at + (8 << 20)]], offset + at)
else:
    for at in range(0, size, step):
        libc.madvise(base + at, step, populate_write)
        os.preadv(fd, [view[at:at + step]], offset + at)
print((time.perf_counter() - start) * 1e3)
view.release()
"""

CASES = {"all first": 0, "steps of 256 KiB": 256 << 10, "steps of 1 MiB": 1 << 20,
         "steps of 8 MiB": 8 << 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, help="checkpoint folder (kept; reused if present)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="partc-bench-")
    files = load.checkpoint_files(load.reference_checkpoint(args.dir, scratch.name))
    load.settle(files, "large")
    found: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for name in load_compare.shuffled(tuple(CASES), repeat):
            done = subprocess.run([sys.executable, "-c", CHILD, str(files[0]),
                                   str(CASES[name])], capture_output=True, text=True,
                                  check=True)
            found.setdefault(name, []).append(float(done.stdout))
    print(f"96 MiB of warm checkpoint bytes into fresh pages, one thread, median of "
          f"{args.repeats} fresh processes (ms; all runs sorted)")
    for name in CASES:
        runs = sorted(found[name])
        print(f"| {name} | {statistics.median(runs):.1f} | "
              f"{', '.join(f'{r:.1f}' for r in runs)} |")


if __name__ == "__main__":
    main()
