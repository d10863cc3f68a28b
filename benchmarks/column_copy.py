"""Measure the ways a loader can copy column slices out of a checkpoint in the page cache.

A tensor split on its last axis (o_proj and down_proj under tensor parallelism) is one run of
`row bytes / T` per row: thousands of short pieces a tensor. The zero-copy modes copy them with
numpy from a mapping of the file (where a truncation raises SIGBUS); under
`max_fetch_ratio=1.0` partc copies them piece by piece with `process_vm_writev` from a
read-only mapping (a truncation fails the copy: a CheckpointError); by default, warm, it reads
the rows whole with one vectored preadv per 1024 buffers, the columns straight into place and
the rest into a scratch buffer (`rows.vector_gather`, partc's own function here), where it
used to read them into a 256 KiB bounce buffer and copy the columns out with numpy (`bounce`:
`spans.span_gather` with the vectored read turned off). This script times the four for rank
0's column slices of the synthetic Llama of benchmarks/load.py, one thread, each variant in a
fresh process (so that the mapping's pages are faulted in by the copy, as in a load), in turn,
destinations faulted in beforehand (MADV_POPULATE_WRITE) in all, and prints the median of each.
Linux only. Usage:

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
from partc.runtime._engine.gather import Gather
from partc.runtime._engine import spans
from partc.runtime._engine.rows import vector_gather
from partc.runtime._engine.spans import span_gather
fd = os.open(path, os.O_RDONLY)


class _Source:  # what span_gather asks of a job's file: its descriptor, read through the cache
    direct_fd = -1


source = _Source()


def gathers(name, out, rows, row, width):
    """The tensor's rows in blocks of 8 MiB, rank 0's columns of each, as partc's jobs."""
    begin = base + header[name]["data_offsets"][0]
    step = max(1, (8 << 20) // row)
    for r in range(0, rows, step):
        job = Gather(file=0, path=path, name=name, out=out, base=begin, row_bytes=row,
                     rows=(r, min(rows, r + step)), pieces=((0, 0, width),),
                     nbytes=(min(rows, r + step) - r) * width)
        job.fd = fd
        job.source = source
        yield job


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
    elif mode == "vectored":  # partc's own warm whole-row read (rows.vector_gather)
        for job in gathers(name, out, rows, row, width):
            vector_gather(job, None)
    elif mode == "bounce":  # the earlier default: a bounce buffer, numpy copying the columns
        spans._VECTORED = False
        for job in gathers(name, out, rows, row, width):
            job.merge = True
            span_gather(job, None)
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
    times: dict[str, list[float]] = {"numpy": [], "process_vm_writev": [], "bounce": [],
                                     "vectored": []}
    size = 0
    for repeat in range(args.repeats):
        turn = repeat % len(times)
        for mode in list(times)[turn:] + list(times)[:turn]:
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
    for mode in ("process_vm_writev", "bounce", "vectored"):
        ratio = statistics.median(times[mode]) / statistics.median(times["numpy"])
        print(f"  {mode} / numpy: {ratio:.2f}")


if __name__ == "__main__":
    main()
