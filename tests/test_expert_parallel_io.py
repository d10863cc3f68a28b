"""Expert-parallel ranks at the I/O level: a rank reads exactly the bytes of its own experts.

The expected bytes come from the safetensors header parsed here (8-byte length + JSON) and the
placement the test chose, not from partc's layouts: a per-expert tensor `experts.{e}.*` is read
whole iff e is one of the rank's experts; a stacked `[E, ...]` tensor (and its MXFP4 blocks and
scales) only in the rows of the rank's experts; block-FP8 scales follow their weights. No other
expert byte is read, and none twice.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import QUANTIZED, Recorder, compile_and_import, hf

PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)")


def header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, tensor entries) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    entries = json.loads(raw[8:8 + length])
    entries.pop("__metadata__", None)
    return 8 + length, entries


def expected_expert_bytes(path: Path, mine: set[int], experts: int
                          ) -> tuple[np.ndarray, np.ndarray]:
    """(every expert byte of the file, the bytes of the experts in `mine`) as 0/1 masks."""
    start, entries = header(path)
    size = path.stat().st_size
    every, wanted = np.zeros(size, np.int8), np.zeros(size, np.int8)
    for name, entry in entries.items():
        begin, end = (start + o for o in entry["data_offsets"])
        found = PER_EXPERT.search(name)
        if found:
            every[begin:end] = 1
            if int(found.group(1)) in mine:
                wanted[begin:end] = 1
        elif STACKED.search(name):
            assert entry["shape"][0] == experts, name
            every[begin:end] = 1
            row = (end - begin) // experts
            for expert in mine:
                wanted[begin + expert * row:begin + (expert + 1) * row] = 1
    return every, wanted


CASES = [
    ("qwen3_moe", hf("qwen3_moe"), 8, 2, 1, [[1, 3, 4], [0, 2, 5, 6, 7]]),
    ("qwen3_moe", hf("qwen3_moe"), 8, 4, 2, None),
    ("gpt_oss", hf("gpt_oss"), 4, 2, 1, [[0, 2], [1, 3]]),
    ("gpt_oss_mxfp4", QUANTIZED / "gpt_oss_mxfp4", 4, 4, 1, [[0, 3], [1], [2, 3], [0]]),
    ("deepseek_v3_fp8", QUANTIZED / "deepseek_v3_fp8", 8, 2, 2, [[0, 5, 6], [1, 2, 3, 4, 7]]),
]


@pytest.mark.parametrize(("name", "folder", "experts", "ep", "tp", "slots"), CASES,
                         ids=[f"{c[0]}-ep{c[3]}-tp{c[4]}" for c in CASES])
def test_a_rank_reads_exactly_the_bytes_of_its_experts(
        tmp_path: Path, name: str, folder: Path, experts: int, ep: int, tp: int,
        slots: list[list[int]] | None) -> None:
    options: dict[str, Any] = {"expert_parallel_size": ep}
    if slots is not None:
        (tmp_path / "placement.json").write_text(json.dumps({"ranks": slots}))
        options["expert_placement"] = tmp_path / "placement.json"
    else:  # balanced: contiguous ranges, computed here
        base, extra = divmod(experts, ep)
        starts = [r * base + min(r, extra) for r in range(ep + 1)]
        slots = [list(range(starts[r], starts[r + 1])) for r in range(ep)]
    plan, package = compile_and_import(None, folder / "config.json", tmp_path / "build", tp=tp,
                                       **options)
    checkpoint = folder / "model.safetensors"
    try:
        for rank in range(plan.topology.world_size):
            recorder = Recorder()
            state = package.load(folder, rank=rank, reader=recorder)
            module = package.rank_module(rank)
            mine = set(slots[module.expert_map().expert_parallel_rank])
            every, wanted = expected_expert_bytes(checkpoint, mine, experts)
            seen = np.zeros_like(every)
            for path, offset, length in recorder.runs:
                assert Path(path).resolve() == checkpoint.resolve()
                seen[offset:offset + length] += 1
            np.testing.assert_array_equal(seen * every, wanted,
                                          err_msg=f"rank {rank}: expert bytes read")
            assert module.info().expert_parameter_bytes == int(wanted.sum())
            assert any(n for n in state.tensors if PER_EXPERT.search(n) or STACKED.search(n))
    finally:
        for module_name in [m for m in sys.modules if m.startswith(package.__name__)]:
            del sys.modules[module_name]


def test_partc_shard_writes_each_expert_parallel_rank_exactly_what_it_loads(
        tmp_path: Path) -> None:
    from partc.cli.main import main

    folder = hf("gpt_oss")
    assert main(["compile", "--config", str(folder / "config.json"), "--ep", "2", "--pp", "2",
                 "--out", str(tmp_path / "build")]) == 0
    assert main(["shard", str(tmp_path / "build"), "--checkpoint", str(folder), "--out",
                 str(tmp_path / "shards")]) == 0
    files = sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))
    assert files == [f"rank-{r:02d}-of-04.safetensors" for r in range(4)]
    sys.path.insert(0, str(tmp_path / "build"))
    try:
        import importlib

        package = importlib.import_module("partc_gpt_oss_tp1_pp2_ep2")
        for rank in range(4):
            direct = package.load(folder, rank=rank)
            sharded = package.load(tmp_path / "shards", rank=rank)
            assert set(direct.tensors) == set(sharded.tensors)
            for name, array in direct.tensors.items():
                assert np.array_equal(array, sharded.tensors[name]), name
    finally:
        sys.path.remove(str(tmp_path / "build"))
        for name in [m for m in sys.modules if m.startswith("partc_gpt_oss_tp1_pp2_ep2")]:
            del sys.modules[name]
