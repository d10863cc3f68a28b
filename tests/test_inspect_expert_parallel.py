"""`partc inspect`, `explain` and `report` on expert-parallel builds.

The oracle is what each rank's generated module actually loads from the checkpoint: a rank
listed as holding a tensor must load it with that shape, and no rank that loads a tensor may be
missing from the listing. A redundant placement (expert 1 on two EP ranks) and a stacked family
(gpt_oss, one placement per stage-local rank) are both covered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from partc.cli.main import main
from partc.inspect.plan_summary import rank_role_bytes, read_build

from support import compile_and_import, hf


def _loaded(package: Any, checkpoint: Path, world: int) -> dict[int, dict[str, tuple[int, ...]]]:
    """Per build rank, the shape of every tensor its generated module loads."""
    return {r: {name: tuple(a.shape) for name, a in package.load(str(checkpoint), rank=r)
                .tensors.items()} for r in range(world)}


@pytest.fixture(scope="module", params=[
    ("mixtral", 1, 3, 2, [[0, 1], [1, 2], [3]]),   # redundant: expert 1 on EP ranks 0 and 1
    ("gpt_oss", 1, 2, 1, None),                      # stacked experts, balanced placement
    ("qwen3_moe", 2, 4, 1, None),                    # dense TP=2 inside EP=4
], ids=["mixtral-redundant-pp2", "gpt_oss-stacked", "qwen3_moe-tp2-ep4"])
def build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    family, tp, ep, pp, placement = request.param
    folder = tmp_path_factory.mktemp(family)
    options: dict[str, Any] = {"tp": tp, "pp": pp, "expert_parallel_size": ep}
    if placement is not None:
        (folder / "p.json").write_text(json.dumps({"ranks": placement}))
        options["expert_placement"] = folder / "p.json"
    plan, package = compile_and_import(None, hf(family) / "config.json", folder / "b",
                                       checkpoint=hf(family), **options)
    try:
        loaded = _loaded(package, hf(family), plan.topology.world_size)
    finally:
        for name in [m for m in sys.modules if m.startswith(package.__name__)]:
            del sys.modules[name]
    return folder / "b", loaded


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_lists_exactly_the_tensors_each_rank_loads(build: Any, capsys: Any) -> None:
    out, loaded = build
    rows = _json(capsys, "inspect", str(out), "--target", "*experts*", "--format", "json")
    listed: dict[int, dict[str, tuple[int, ...]]] = {}
    for row in rows["tensors"]:
        listed.setdefault(row["rank"], {})[row["target"]] = tuple(row["local_shape"])
    want = {r: {n: s for n, s in names.items() if "experts" in n} for r, names in loaded.items()}
    assert listed == {r: m for r, m in want.items() if m}


def test_explain_names_only_the_ranks_that_load_an_expert(build: Any, capsys: Any) -> None:
    out, loaded = build
    every = sorted({n for names in loaded.values() for n in names if ".experts." in n})
    for target in every[:3] + every[-3:]:
        explained = _json(capsys, "explain", str(out), target, "--format", "json")
        ranks = {r["rank"]: r for r in explained["ranks"]}
        holders = {r for r, names in loaded.items() if target in names}
        assert set(ranks) == holders, target
        for r in holders:
            (member,) = [m for m in ranks[r]["tensors"] if m["target"] == target]
            assert tuple(member["local_shape"]) == loaded[r][target]


def test_explain_says_which_ep_ranks_hold_an_expert_and_why(build: Any, capsys: Any) -> None:
    out, loaded = build
    plan = json.loads((out / "plan.json").read_text())
    experts = plan["expert_parallel"]
    for group, expert in sorted(experts["expert_groups"].items())[:4]:
        target = next(t["target"] for t in plan["tensors"] if t["group"] == group)
        explained = _json(capsys, "explain", str(out), target, "--format", "json")
        (reason,) = [w for w in explained["why"] if w.startswith("expert parallelism")]
        if expert is None:  # stacked: every EP rank holds its slots' rows
            assert "a stacked expert tensor" in reason, reason
            continue
        # the holders the placement file (or the balanced rule) gives, as the loaders load it
        holders = [(ep, ids.index(expert)) for ep, ids in enumerate(experts["slots"])
                   if expert in ids]
        named = ", ".join(f"EP rank {ep} slot {slot}" for ep, slot in holders)
        assert f"expert {expert} is placed on {named} " in reason, reason
        assert ("copies" in reason) == (len(holders) > 1), reason
        loading = {r for r, names in loaded.items() if target in names}
        assert loading and {ranks["rank"] for ranks in explained["ranks"]} == loading


def test_report_bytes_per_rank_are_the_bytes_each_rank_loads(build: Any) -> None:
    out, loaded = build
    plan = json.loads((out / "plan.json").read_text())
    dtype_bytes = {t["target"]: t for t in plan["tensors"]}
    per_rank = rank_role_bytes(read_build(out).file)
    for r, names in loaded.items():
        want = 0
        for name, shape in names.items():
            count = 1
            for n in shape:
                count *= n
            dtype = dtype_bytes[name]["dtype"]
            want += count * {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "F8_E4M3": 1}[dtype]
        assert sum(per_rank[r].values()) == want, r


def test_inspect_text_shows_every_ep_rank_its_experts_and_build_ranks(build: Any,
                                                                      capsys: Any) -> None:
    out, loaded = build
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    summary = _json(capsys, "inspect", str(out), "--format", "json")["expert_parallel"]
    assert "expert parallelism: E=" in text
    for row in summary["ep_ranks"]:
        for r in row["ranks"]:
            held = {int(n.split(".experts.")[1].split(".")[0]) for n in loaded[r]
                    if ".experts." in n and n.split(".experts.")[1][0].isdigit()}
            if held:  # per-expert tensors: exactly the EP rank's experts
                assert held == set(row["experts"])
