"""A checkpoint's inventory from its header, with layer and expert numbers collapsed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from partc.parallel.placements import tensor_bytes
from partc.runtime.checkpoint import open_checkpoint

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")
"""A dotted path segment that is a number: a layer, an expert, a head index."""
PLACEHOLDERS = ("N", "M", "K", "J")
"""What the first, second, ... numbered segment of a name is collapsed to."""


def collapse(name: str) -> tuple[str, tuple[int, ...]]:
    """`model.layers.3.mlp.experts.7.w1` -> (`model.layers.N.mlp.experts.M.w1`, (3, 7))."""
    numbers: list[int] = []

    def placeholder(match: re.Match[str]) -> str:
        numbers.append(int(match.group()))
        return PLACEHOLDERS[min(len(numbers) - 1, len(PLACEHOLDERS) - 1)]
    return _NUMBER.sub(placeholder, name), tuple(numbers)


def _ranges(values: list[int]) -> str:
    """`0..3,5,7..9` of sorted distinct integers."""
    out: list[str] = []
    ordered: list[int | None] = [*sorted(set(values)), None]
    start = prev = ordered[0]
    assert start is not None and prev is not None
    for v in ordered[1:]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}..{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def inventory(path: str | Path) -> dict[str, Any]:
    """The checkpoint's tensors grouped by collapsed name, shape and dtype, with counts."""
    checkpoint = open_checkpoint(Path(path))
    rows: dict[tuple[str, tuple[int, ...], str], list[tuple[int, ...]]] = {}
    total = 0
    by_dtype: dict[str, int] = {}
    for name in checkpoint.names:
        signature = checkpoint.signature(name)
        assert signature is not None
        _, dtype, shape = signature
        pattern, numbers = collapse(name)
        rows.setdefault((pattern, tuple(shape), dtype), []).append(numbers)
        nbytes = tensor_bytes(dtype, shape)
        total += nbytes
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    entries = []
    for (pattern, dims, dtype), found in sorted(rows.items()):
        ranges = {PLACEHOLDERS[i]: _ranges([n[i] for n in found])
                  for i in range(min(len(found[0]), len(PLACEHOLDERS)))}
        entries.append({"pattern": pattern, "shape": list(dims), "dtype": dtype,
                        "count": len(found), "ranges": ranges,
                        "bytes": len(found) * tensor_bytes(dtype, dims)})
    return {"path": str(checkpoint.path), "files": [str(f.path) for f in checkpoint.files],
            "tensors": len(checkpoint.names), "bytes": total,
            "bytes_by_dtype": dict(sorted(by_dtype.items())), "entries": entries}
