"""What a gather job's release drops from the process's mapping of the checkpoint: its rows,
cut at 2 MiB boundaries so that no 2 MiB page-cache folio mapped by one page-table entry is
split, and, after a tensor's last job, everything up to the boundary past its end.

Observed through the kernel's own accounting of the mapping (/proc/self/smaps Rss)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from partc.runtime._engine import gather
from partc.runtime.headers import read_header

MIB = 1 << 20


def mapped_bytes(address: int) -> int:
    """Rss of the mapping starting at `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if int(head.split("-")[0], 16) == address:
                rss = next(row for row in lines[i + 1:] if row.startswith("Rss:"))
                return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_release_drops_whole_2_mib_regions_and_a_tensors_last_job_its_tail(
        tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": np.arange(3 * MIB, dtype=np.uint32)}, str(path))  # 12 MiB of data
    header = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        source = gather.GatherFile(header, fd, "w")
        size = len(source.mapping)

        def touched() -> int:
            view = np.frombuffer(source.mapping, dtype=np.uint8)
            int(view[::4096].sum())  # map every page of the file
            del view
            return mapped_bytes(source.address)

        assert touched() == -(-size // 4096) * 4096
        source.release(1 * MIB, 5 * MIB, last=False)  # [0, 4 MiB): the rows' 2 MiB regions
        assert mapped_bytes(source.address) == touched() - 4 * MIB
        assert touched() == -(-size // 4096) * 4096
        source.release(3 * MIB, 3 * MIB + 4096, last=False)  # within one region: kept
        assert mapped_bytes(source.address) == touched()
        source.release(5 * MIB, 7 * MIB, last=True)  # the tensor's end: [4 MiB, 8 MiB)
        assert mapped_bytes(source.address) == touched() - 4 * MIB
        # a tensor's jobs, none aligned, in order: nothing of its rows stays mapped after it;
        # the 2 MiB regions it touches are dropped whole, and what lies past the region of its
        # last byte stays mapped
        for tensor_end in (size - 100, 12 * MIB - 100):
            touched()
            jobs = [(MIB // 2 + i * 3 * MIB, min(MIB // 2 + (i + 1) * 3 * MIB, tensor_end))
                    for i in range(4)]
            for i, (start, end) in enumerate(jobs):
                source.release(start, end, last=i == len(jobs) - 1)
            past = -(-tensor_end // (2 * MIB)) * (2 * MIB)
            assert mapped_bytes(source.address) == max(0, -(-(size - past) // 4096) * 4096)
        source.release(0, size, last=True)  # a tensor up to the file's end: all of it
        assert mapped_bytes(source.address) == 0
        source.close()
    finally:
        os.close(fd)
