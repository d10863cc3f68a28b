"""Transfer plans: each destination tensor rebuilt from source ranks' slices equals the
original's slice (safetensors' own `get_slice` as the oracle), every destination byte is read
once, replicas share the load, and builds of another model are refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from partc.api import CompileOptions, compile_family
from partc.errors import LayoutError
from partc.plan.ir import canonical_json
from partc.plan.plan_file import read_plan
from partc.plan.topology import Topology
from partc.plan.transfer import TransferPlan, plan_transfer
from partc.shard import rank_slices

from support import fixture_folder, policy_for

Builds = Callable[..., Path]

PLACEMENT = {"ranks": [[0, 1, 2, 3, 4], [0, 4, 5, 6, 7]]}
"""qwen3_moe's 8 experts over EP=2 with experts 0 and 4 on both EP ranks (redundant)."""


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    """A build folder per (fixture, T, S, E, options), compiled once against the fixture."""
    made: dict[tuple[Any, ...], Path] = {}

    def get(name: str, tp: int = 1, pp: int = 1, ep: int | None = None, etp: int = 1,
            **options: Any) -> Path:
        key = (name, tp, pp, ep, etp, *sorted(options.items()))
        if key not in made:
            root = tmp_path_factory.mktemp(name)
            folder = fixture_folder(name)
            if options.get("expert_placement") == "redundant":
                (root / "placement.json").write_text(json.dumps(PLACEMENT))
                options = {**options, "expert_placement": root / "placement.json"}
            sizes = {} if ep is None else {"expert_parallel_size": ep,
                                           "expert_tensor_parallel_size": etp}
            compile_family(None, folder / "config.json",
                           Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp, **sizes),
                           CompileOptions(out=root / "build", checkpoint=folder,
                                          policy=policy_for(name, tp), **options))
            made[key] = root / "build"
        return made[key]

    return get


def original_slice(handle: Any, target: str, axis: int | None,
                   ranges: tuple[tuple[int, int], ...]) -> np.ndarray:
    """A rank's part of a tensor, read by safetensors from the original checkpoint."""
    part = handle.get_slice(target)
    if axis is None:
        return np.asarray(part[:])
    pieces = []
    for start, end in ranges:
        index = [slice(None)] * len(part.get_shape())
        index[axis] = slice(start, end)
        pieces.append(np.asarray(part[tuple(index)]))
    return np.concatenate(pieces, axis=axis)


PAIRS = [
    ("llama", dict(tp=2, pp=2), dict(tp=4)),  # KV heads replicated over 4 destination ranks
    ("llama", dict(tp=4), dict(tp=2, pp=2, split="chunk")),
    ("phi3", dict(tp=2), dict(tp=1, pp=2)),  # fused qkv and gate_up
    ("qwen3_moe", dict(ep=4), dict(tp=2, ep=2)),
    ("qwen3_moe", dict(ep=2, expert_placement="redundant"), dict(tp=2, pp=2)),
    ("gpt_oss", dict(tp=2, ep=2), dict(pp=2)),  # stacked experts, interleaved gate_up
    ("qwen3_moe", dict(tp=2, ep=2, etp=2), dict(ep=4)),  # each expert split over X=2
    ("deepseek_v3", dict(ep=2, etp=2), dict(tp=2, pp=2)),
]


@pytest.mark.parametrize(("name", "source", "destination"), PAIRS)
def test_every_destination_tensor_rebuilt_from_source_slices_is_the_originals_slice(
        builds: Builds, name: str, source: dict[str, Any], destination: dict[str, Any]) -> None:
    a, b = builds(name, **source), builds(name, **destination)
    plan = plan_transfer(read_plan(a / "plan.json"), read_plan(b / "plan.json"))
    # the ranks' parts as the generated rank modules select them (not partc.plan.transfer)
    held = [{s.target: s for s in slices} for slices in rank_slices(a, read_plan(a / "plan.json"))]
    wanted = rank_slices(b, read_plan(b / "plan.json"))
    with safe_open(str(fixture_folder(name) / "model.safetensors"), "np") as handle:
        for rank, slices in zip(plan.ranks, wanted, strict=True):
            assert [t.target for t in rank.tensors] == sorted(s.target for s in slices)
            by_name = {s.target: s for s in slices}
            for tensor in rank.tensors:
                want = by_name[tensor.target]
                expected = original_slice(handle, want.target, want.selection.axis,
                                          want.selection.ranges)
                rebuilt = np.zeros_like(expected)
                count = np.zeros(expected.shape, dtype=np.int64)
                for piece in tensor.pieces:
                    have = held[piece.source_rank][tensor.target]
                    local = original_slice(handle, tensor.target, have.selection.axis,
                                           have.selection.ranges)
                    into = tuple(slice(x, y) for x, y in piece.destination)
                    rebuilt[into] = local[tuple(slice(x, y) for x, y in piece.source)]
                    count[into] += 1
                assert (count == 1).all(), f"{tensor.target}: every element read once"
                np.testing.assert_array_equal(rebuilt, expected, err_msg=tensor.target)
    assert plan.total_bytes == sum(s.nbytes for slices in wanted for s in slices)
    assert sum(plan.pair_bytes().values()) == plan.total_bytes


def test_a_transfer_plan_is_deterministic_and_survives_its_json(builds: Builds) -> None:
    a, b = read_plan(builds("llama", tp=2, pp=2) / "plan.json"), read_plan(
        builds("llama", tp=4) / "plan.json")
    first, second = plan_transfer(a, b), plan_transfer(a, b)
    assert canonical_json(first.to_json()) == canonical_json(second.to_json())
    again = TransferPlan.from_json(json.loads(canonical_json(first.to_json())))
    assert again == first


def test_replicas_spread_the_reads_over_every_source_rank_holding_them(builds: Builds) -> None:
    a, b = read_plan(builds("llama", tp=4) / "plan.json"), read_plan(
        builds("llama") / "plan.json")
    plan = plan_transfer(a, b)
    norms = [t for t in plan.ranks[0].tensors if t.target.endswith("layernorm.weight")]
    assert len(norms) == 6
    assert {p.source_rank for t in norms for p in t.pieces} == {0, 1, 2, 3}
    sent = plan.source_bytes()
    assert max(sent) - min(sent) <= max(t.nbytes for t in plan.ranks[0].tensors)
    assert plan.naive_bytes == plan.total_bytes == plan.global_bytes  # T=1 holds all, whole


def edited(build: Path, folder: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of `build`'s plan.json with `edit` applied."""
    folder.mkdir()
    document = json.loads((build / "plan.json").read_text())
    edit(document)
    (folder / "plan.json").write_text(json.dumps(document))
    return folder / "plan.json"


def test_a_build_for_another_checkpoint_is_refused_at_its_fingerprint(
        builds: Builds, tmp_path: Path) -> None:
    a = builds("llama", tp=2)
    other = edited(builds("llama", tp=4), tmp_path / "b",
                   lambda d: d.update(checkpoint_fingerprint="f" * 64))
    with pytest.raises(LayoutError, match=r"compiled against checkpoint fingerprint "
                                          r"ffffffffffffffff, the source against [0-9a-f]{16}; "
                                          r"a transfer needs one checkpoint") as caught:
        plan_transfer(read_plan(a / "plan.json"), read_plan(other))
    assert caught.value.pointer == "/checkpoint_fingerprint"


def test_a_tensor_of_another_shape_is_refused_naming_it(builds: Builds, tmp_path: Path) -> None:
    def grow(document: dict[str, Any]) -> None:
        entry = next(t for t in document["tensors"] if t["target"] == "lm_head.weight")
        entry["shape"] = [132, 64]

    other = edited(builds("llama", tp=1), tmp_path / "b", grow)
    with pytest.raises(LayoutError, match=r"tensor `lm_head.weight` is F32 \[132, 64\] in the "
                                          r"destination plan, F32 \[131, 64\] in the source plan"):
        plan_transfer(read_plan(builds("llama", tp=2) / "plan.json"), read_plan(other))


def test_a_part_cutting_through_a_quantization_block_is_refused(
        builds: Builds, tmp_path: Path) -> None:
    target = "model.layers.0.self_attn.k_proj.weight"  # F8 [32, 64], scale [2, 4]: blocks of 16

    def cut(document: dict[str, Any]) -> None:
        entry = next(t for t in document["tensors"] if t["target"] == target)
        entry["placements"] = [["range", 0, 0, 8], ["range", 0, 8, 32]]

    good = builds("qwen3_fp8", tp=2)
    bad = edited(good, tmp_path / "b", cut)
    with pytest.raises(LayoutError, match=rf"rank 0 of .* holds rows/columns 0:8 of axis 0 of "
                                          rf"`{target}` \[32, 64\], cutting through its "
                                          r"quantization blocks of 16 \(scale"):
        plan_transfer(read_plan(good / "plan.json"), read_plan(bad))
    plan = plan_transfer(read_plan(good / "plan.json"), read_plan(
        builds("qwen3_fp8") / "plan.json"))
    assert plan.total_bytes == plan.global_bytes


def test_the_transfer_of_a_tensor_no_source_rank_holds_is_refused(
        builds: Builds, tmp_path: Path) -> None:
    def drop(document: dict[str, Any]) -> None:
        entry = next(t for t in document["tensors"] if t["target"] == "lm_head.weight")
        entry["placements"] = [["range", 0, 0, 66], ["omit"]]

    source = edited(builds("llama", tp=2), tmp_path / "a", drop)
    with pytest.raises(LayoutError, match=r"no rank of the source holds \[\[66, 131\], \[0, 64\]\]"
                                          r" of `lm_head.weight` \[131, 64\], which destination "
                                          r"rank 0 needs"):
        plan_transfer(read_plan(source), read_plan(builds("llama") / "plan.json"))


def test_inspect_to_shows_the_pairs_the_busiest_ranks_and_the_naive_total(
        builds: Builds, capsys: pytest.CaptureFixture[str]) -> None:
    from partc.cli.main import main

    a, b = builds("llama", tp=2, pp=2), builds("llama", tp=4)
    assert main(["inspect", str(a), "--to", str(b), "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    destination = read_plan(b / "plan.json")
    assert found["kind"] == "transfer"
    assert found["total_bytes"] == sum(r.info.local_parameter_bytes for r in destination.ranks)
    with safe_open(str(fixture_folder("llama") / "model.safetensors"), "np") as handle:
        whole = {n: handle.get_slice(n).get_shape() for n in handle.keys()}  # noqa: SIM118
    per_rank = [{s.target for s in slices} for slices in rank_slices(b, destination)]
    assert found["naive_bytes"] == sum(4 * int(np.prod(whole[n])) for names in per_rank
                                       for n in names)  # F32
    assert sum(p["bytes"] for p in found["pairs"]) == found["total_bytes"]
    sent = found["source_bytes"]
    assert sent[found["busiest_source"]] == max(sent) and len(sent) == 4
    assert main(["inspect", str(a), "--to", str(b)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("transfer llama: TP=2 x PP=2 (plan ")
    assert "gathering every tensor whole then slicing reads 1.95 MiB (3.61x)" in text[1]
    assert text[4] == "source  destination  bytes"
    assert len(text) == 5 + len(found["pairs"])


def test_report_to_writes_a_page_of_the_pair_matrix_the_same_twice(
        builds: Builds, tmp_path: Path) -> None:
    import re

    from partc.cli.main import main

    a, b = builds("llama", tp=2, pp=2), builds("llama", tp=4)
    pages = []
    for name in ("one.html", "two.html"):
        assert main(["report", str(a), "--to", str(b), "--out", str(tmp_path / name),
                     "--format", "json"]) == 0
        pages.append((tmp_path / name).read_text())
    assert pages[0] == pages[1]
    plan = plan_transfer(read_plan(a / "plan.json"), read_plan(b / "plan.json"))
    matrix = pages[0].split('<table id="pairs">')[1].split("</table>")[0]
    rows = re.findall(r"<tr><th>(\d+)</th>(.*?)</tr>", matrix)
    assert [int(r) for r, _ in rows] == [0, 1, 2, 3]
    filled = {(int(r), d) for r, cells in rows
              for d, text in enumerate(re.findall(r"<td [^>]*>([^<]*)</td>", cells)[:4]) if text}
    assert filled == set(plan.pair_bytes())
    assert "<title>partc transfer: llama: TP=2 x PP=2 -&gt; TP=4 x PP=1</title>" in pages[0]
