"""Measure the two ways a loader can copy column slices out of a mapped checkpoint.

A tensor split on its last axis (o_proj and down_proj under tensor parallelism) is one run of
`row bytes / T` per row: thousands of short pieces a tensor. partc's default load copies them
with `process_vm_writev` from a read-only mapping of the file (a file truncated meanwhile then
fails the copy, which becomes a CheckpointError), the zero-copy modes with numpy from the mapping
(where truncation raises SIGBUS). This script times both for rank 0's column slices of the
synthetic Llama of benchmarks/load.py, one thread, each variant in a fresh process (so that the
mapping's pages are faulted in by the copy, as in a load), alternating, destinations faulted in
beforehand (MADV_POPULATE_WRITE) in both, and prints the median of each. Linux only. Usage:

    python benchmarks/column_copy.py --dir /tmp/ckpt --tp 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/load.py: the synthetic checkpoint

from load import PRESETS, checkpoint_files, llama_config, warm, write_checkpoint  # noqa: E402

WORKER = r'''
import ctypes, json, mmap, os, struct, sys, time
import numpy as np

path, tp, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
base, whole = 8 + n, np.frombuffer(mapping, np.uint8)
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
copy = libc.process_vm_writev
copy.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                 ctypes.c_ulong, ctypes.c_ulong]
copy.restype = ctypes.c_ssize_t
seconds, nbytes, kept = 0.0, 0, []
for name in sorted(k for k in header if k.endswith(("o_proj.weight", "down_proj.weight"))):
    begin, end = header[name]["data_offsets"]
    rows, columns = header[name]["shape"]
    row = (end - begin) // rows
    width = row // tp
    source = whole[base + begin:base + end].reshape(rows, row)
    memory = mmap.mmap(-1, rows * width, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = np.frombuffer(memory, np.uint8).reshape(rows, width)
    libc.madvise(out.ctypes.data, out.nbytes, 23)  # MADV_POPULATE_WRITE, not timed
    start = time.perf_counter()
    if mode == "numpy":
        out[:] = source[:, :width]
    else:  # one iovec a row piece, at most 1024 a call (IOV_MAX), into the contiguous rows
        pieces = np.empty((rows, 2), np.uint64)
        pieces[:, 0] = np.uint64(source.ctypes.data) + np.arange(rows, dtype=np.uint64) * row
        pieces[:, 1] = width
        target, done = np.empty((1, 2), np.uint64), 0
        for i in range(0, rows, 1024):
            chunk = pieces[i:i + 1024]
            want = len(chunk) * width
            target[0] = (out.ctypes.data + done, want)
            got = copy(os.getpid(), chunk.ctypes.data, len(chunk), target.ctypes.data, 1, 0)
            if got != want:
                raise SystemExit(f"process_vm_writev copied {got} of {want} bytes")
            done += want
    seconds += time.perf_counter() - start
    assert np.array_equal(out, source[:, :width]), name
    nbytes += out.nbytes
    kept.append(out)
print(json.dumps({"seconds": seconds, "bytes": nbytes}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, required=True,
                        help="checkpoint folder (written if missing, reused if present)")
    args = parser.parse_args()
    hidden, intermediate, heads, kv, vocab, layers = PRESETS[args.preset]
    config = llama_config(hidden, intermediate, heads, kv, vocab, layers)
    existing = args.dir / "config.json"
    if not existing.is_file() or json.loads(existing.read_text()) != config:
        print(f"writing the synthetic checkpoint to {args.dir} ...", flush=True)
        write_checkpoint(args.dir, config, 1)
    files = checkpoint_files(args.dir)
    times: dict[str, list[float]] = {"numpy": [], "process_vm_writev": []}
    size = 0
    for repeat in range(args.repeats):
        for mode in (list(times) if repeat % 2 == 0 else list(times)[::-1]):
            warm(files)
            done = subprocess.run([sys.executable, "-c", WORKER, str(files[0]), str(args.tp),
                                   mode], capture_output=True, text=True, check=True)
            report = json.loads(done.stdout)
            times[mode].append(report["seconds"])
            size = report["bytes"]
    print(f"T={args.tp}: rank 0's column slices (o_proj, down_proj), {size / 2**20:.0f} MiB, "
          f"one thread, median of {args.repeats} fresh processes each")
    for mode, found in times.items():
        print(f"  {mode:18s} {statistics.median(found) * 1e3:7.1f} ms "
              f"(range {min(found) * 1e3:.1f}-{max(found) * 1e3:.1f})")
    ratio = statistics.median(times["process_vm_writev"]) / statistics.median(times["numpy"])
    print(f"  process_vm_writev / numpy: {ratio:.2f}")


if __name__ == "__main__":
    main()
