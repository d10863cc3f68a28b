"""What a warm column gather costs each way, per job, on this machine: the measurement behind
`read_planner.WARM_ROWS` and `WARM_PIECES` (`python benchmarks/warm_gathers.py --dir DIR`).

Runs against the installed partc. Writes (or reuses) the reference checkpoint of
`benchmarks/load.py` (777.6 MiB, bf16 Llama, hidden 1024, intermediate 2816), reads it once so
that the page cache holds it, then, in this one thread, for the o_proj and down_proj of six
layers, cuts each into the column slice of rank 0 at T = 2, 4 and 8 and times its gather jobs
both ways, every destination faulted in first (so both pay the same and neither pays it here):

- rows: every row read whole by vectored preadv (`_engine.rows.vector_gather`), the pieces
  straight into the destination, the gaps into a scratch buffer;
- pieces: each piece copied by itself by process_vm_writev out of the file's mapping
  (`_engine.gather._vm_gather`).

It prints the median milliseconds per MiB of the rank's columns for each case, then the two
models fitted to them by least squares: whole rows, seconds per buffer (a piece or a gap; two a
piece) and bytes per second of the rows; pieces, seconds per piece and bytes per second of the
pieces; and which way each model picks for each case against which was faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load  # noqa: E402  (benchmarks/load.py: the reference checkpoint)

TENSORS = (("self_attn.o_proj", 1024), ("mlp.down_proj", 2816))
"""(module path, columns) of the reference model's row-parallel projections."""
SIZES = (2, 4, 8)
LAYERS = range(2, 8)


def measure(folder: Path) -> dict[tuple[str, int, str], list[float]]:
    """ms per MiB of the rank's columns, per (tensor, T, way), one sample per layer."""
    from partc.runtime._engine.gather import GatherFile, column_gathers, copy_pieces, vm_copy_usable
    from partc.runtime._engine.memory import populate
    from partc.runtime._engine.rows import vector_gather
    from partc.runtime._engine.selection import TensorSelection
    from partc.runtime.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(folder)
    path = load.checkpoint_files(folder)[0]
    fd = os.open(path, os.O_RDONLY)
    if not vm_copy_usable():
        raise SystemExit("process_vm_writev is not available here: nothing to compare")
    found: dict[tuple[str, int, str], list[float]] = {}
    try:
        for layer in LAYERS:
            for module, columns in TENSORS:
                name = f"model.layers.{layer}.{module}.weight"
                header, entry = checkpoint.tensor(name)
                source = GatherFile(header, fd, name)
                for tp in SIZES:
                    width = columns // tp
                    selection = TensorSelection(1, ((0, width),))
                    for way in ("rows", "pieces"):
                        out = np.empty((entry.shape[0], width), dtype=np.uint16)
                        jobs = column_gathers(0, header, entry, selection, out)
                        for job in jobs:
                            job.source, job.fd = source, fd
                            populate(int(out.ctypes.data), 0, out.nbytes)
                        start = time.perf_counter()
                        for job in jobs:
                            done = (vector_gather(job, None) if way == "rows"
                                    else copy_pieces(job))
                            assert done, way
                        seconds = time.perf_counter() - start
                        found.setdefault((module.split(".")[1], tp, way), []).append(
                            seconds * 1e3 / (out.nbytes / 2**20))
                source.close()
    finally:
        os.close(fd)
    return found


def fit(found: dict[tuple[str, int, str], list[float]]) -> tuple[tuple[float, float],
                                                                   tuple[float, float]]:
    """(rows: s a buffer, B/s), (pieces: s a piece, B/s), least squares over the medians."""
    widths = dict(TENSORS)
    rows_a, rows_b, pieces_a, pieces_b = [], [], [], []
    for (module, tp, way), samples in found.items():
        columns = widths[next(m for m in widths if m.endswith(module))]
        row, piece = columns * 2, columns * 2 // tp
        per_mib = 2**20 / piece  # pieces in a MiB of the rank's columns
        seconds = statistics.median(samples) / 1e3  # a MiB of the rank's columns
        if way == "rows":  # seconds = 2 * pieces * buffer + (pieces * row) / bandwidth
            rows_a.append([2 * per_mib, per_mib * row])
            rows_b.append(seconds)
        else:  # seconds = pieces * latency + 2**20 / bandwidth
            pieces_a.append([per_mib, 2**20])
            pieces_b.append(seconds)
    (buffer, inverse), *_ = np.linalg.lstsq(np.array(rows_a), np.array(rows_b), rcond=None)
    (latency, per_byte), *_ = np.linalg.lstsq(np.array(pieces_a), np.array(pieces_b),
                                               rcond=None)
    return (float(buffer), 1 / float(inverse)), (float(latency), 1 / float(per_byte))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, help="checkpoint folder (kept; reused if present)")
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="partc-bench-")
    folder = load.reference_checkpoint(args.dir, scratch.name)
    load.settle(load.checkpoint_files(folder), "large")
    found = measure(folder)
    (buffer, rows_bw), (latency, pieces_bw) = fit(found)
    from partc.runtime.read_planner import WARM_PIECES, WARM_ROWS, warm_rows_whole

    print(f"one thread, destinations faulted in first; median of {len(LAYERS)} layers; "
          f"ms a MiB of rank 0's columns")
    print("| tensor | T | rows | pieces | faster | partc's model picks |")
    print("|---|--:|--:|--:|---|---|")
    for module, columns in TENSORS:
        short = module.split(".")[1]
        for tp in SIZES:
            rows_ms = statistics.median(found[(short, tp, "rows")])
            pieces_ms = statistics.median(found[(short, tp, "pieces")])
            row = columns * 2
            picks = "rows" if warm_rows_whole(row, [row // tp]) else "pieces"
            faster = "rows" if rows_ms <= pieces_ms else "pieces"
            print(f"| {short} | {tp} | {rows_ms:.3f} | {pieces_ms:.3f} | {faster} | {picks} |")
    print(f"\nfitted: rows {buffer * 1e6:.3f} us a buffer, {rows_bw / 1e9:.2f} GB/s "
          f"(partc: {WARM_ROWS.latency * 1e6:.3f} us, {WARM_ROWS.bandwidth / 1e9:.2f} GB/s); "
          f"pieces {latency * 1e6:.3f} us a piece, {pieces_bw / 1e9:.2f} GB/s "
          f"(partc: {WARM_PIECES.latency * 1e6:.3f} us, {WARM_PIECES.bandwidth / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
