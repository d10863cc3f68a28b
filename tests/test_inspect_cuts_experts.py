"""inspect, explain, report and compile's summary on pipeline cuts and expert placement.

Oracles, kept apart from the code under test: the boundary of each cut is the one the family
YAML declares for the execution group whose unit ends the stage before it (the family's own
`boundary` when that group declares none), its shapes the config's numbers; each rank's experts
follow the balanced placement worked out here by hand (E EP ranks, contiguous equal blocks,
ep = r div X, etp = r mod X of the stage-local rank r); expert bytes are summed from the
checkpoint's safetensors header, divided by X where each expert is split over its ETP group.
"""

from __future__ import annotations

import fnmatch
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import yaml

from partc.cli.main import main

from support import ROOT, hf


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    return json.loads(_run(capsys, *argv, "--format", "json"))


def _compile(capsys: pytest.CaptureFixture[str], out: Path, model: str, *options: str) -> str:
    """Compile the fixture `model` into `out`; compile's text summary."""
    return _run(capsys, "compile", "--checkpoint", str(hf(model)), "--out", str(out), *options)


def _header(model: str) -> dict[str, int]:
    """Bytes of every tensor of a fixture checkpoint, from its safetensors header."""
    with (hf(model) / "model.safetensors").open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {
        name: entry["data_offsets"][1] - entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _config(model: str) -> dict[str, Any]:
    return dict(json.loads((hf(model) / "config.json").read_text()))


def _family(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "architectures" / f"{name}.yaml").read_text()))


def _declared_boundary(family: dict[str, Any], group: str) -> dict[str, Any]:
    """The boundary the family declares for an execution group (its own, else the family's)."""
    for node in family["graph"]:
        if node["group"] == group and "boundary" in node:
            return dict(node["boundary"])
    return dict(family["boundary"])


def _balanced(experts: int, ep: int) -> list[list[int]]:
    """The balanced placement: EP rank e holds the e-th contiguous block of experts/E ids."""
    per = experts // ep
    return [list(range(e * per, (e + 1) * per)) for e in range(ep)]


# ---------------------------------------------------------------- pipeline cuts


@pytest.mark.parametrize(
    ("layout", "group"),
    [
        (["--pp", "2"], "vision"),  # bytes-balanced: vision | rest
        (["--pp-layers", "vision*3,merger|decoder*2"], "merger"),  # cut after the merger
    ],
)
def test_each_cut_of_a_vision_language_build_lists_the_boundary_that_crosses_it(
    tmp_path: Path, capsys: Any, layout: list[str], group: str
) -> None:
    out = tmp_path / "b"
    _compile(capsys, out, "qwen2_vl", "--tp", "2", *layout)
    found = _json(capsys, "inspect", str(out))
    stage0 = {
        u.split("[")[0]
        for r in found["ranks"]
        if r["pipeline_stage"] == 0
        for u in r["units"].split(", ")
    }
    assert group in stage0 and "decoder" not in stage0  # the oracle's own reading of the plan
    family, config = _family("qwen2_vl"), _config("qwen2_vl")
    declared = _declared_boundary(family, group)
    sizes = {
        "vision_embed_dim": config["vision_config"]["embed_dim"],
        "hidden_size": config["text_config"]["hidden_size"]
        if "text_config" in config
        else config["hidden_size"],
    }
    primary = [sizes.get(d, d) for d in declared["primary"]["shape"]]
    [cut] = found["cuts"]
    assert (cut["from_stage"], cut["to_stage"], cut["group"]) == (0, 1, group)
    assert cut["boundary"] == declared["identity"] != family["boundary"]["identity"]
    assert [(t["kind"], t["role"], t["shape"], t["dtype"]) for t in cut["tensors"]] == [
        ("primary", declared["primary"]["role"], primary, "activation")
    ] + [("auxiliary", a["role"], a["shape"], a["dtype"]) for a in declared["auxiliary"]]
    text = _run(capsys, "inspect", str(out))
    assert f"stage 0 -> 1 (after `{group}`): {declared['identity']}" in text
    assert re.search(
        rf"primary\s+{declared['primary']['role']}\s+"
        rf"\[{', '.join(map(str, primary))}\]\s+activation \(float32\)",
        text,
    )
    _run(capsys, "report", str(out), "--out", str(tmp_path / "r.html"))
    html = (tmp_path / "r.html").read_text()
    assert f'data-identity="{declared["identity"]}"' in html
    assert f'data-identity="{family["boundary"]["identity"]}"' not in html
    assert " x ".join(map(str, primary)) in html


def test_a_build_with_a_vision_cut_and_a_decoder_cut_shows_both_boundaries(
    tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "b"
    _compile(capsys, out, "llava", "--tp", "2", "--pp", "3")
    found = _json(capsys, "inspect", str(out))
    last_group = {}
    for r in found["ranks"]:
        last_group[r["pipeline_stage"]] = r["units"].split(", ")[-1].split("[")[0]
    family, config = _family("llava"), _config("llava")
    cuts = found["cuts"]
    assert [(c["from_stage"], c["to_stage"]) for c in cuts] == [(0, 1), (1, 2)]
    assert [c["group"] for c in cuts] == [last_group[0], last_group[1]] == ["vision", "decoder"]
    assert [c["boundary"] for c in cuts] == [
        _declared_boundary(family, "vision")["identity"],
        family["boundary"]["identity"],
    ]
    assert cuts[1]["tensors"][0]["shape"] == [
        "batch",
        "sequence",
        config["text_config"]["hidden_size"],
    ]
    _run(capsys, "report", str(out), "--out", str(tmp_path / "r.html"))
    html = (tmp_path / "r.html").read_text()
    assert html.count('<table class="wire"') == 2
    assert "Cut between stage 0 and stage 1" in html and "Cut between stage 1 and stage 2" in html


# ---------------------------------------------------------------- expert coordinates


def _mixtral_expert_bytes(layers: list[int], experts: list[int]) -> int:
    sizes = _header("mixtral")
    return sum(
        n
        for name, n in sizes.items()
        for layer in layers
        for e in experts
        if name.startswith(f"model.layers.{layer}.block_sparse_moe.experts.{e}.")
    )


def test_every_rank_table_gives_each_ranks_ep_and_etp_rank_and_experts(
    tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "b"
    tp, ep, etp, pp = 2, 2, 2, 2
    compiled = _compile(
        capsys, out, "mixtral", "--tp", str(tp), "--ep", str(ep), "--etp", str(etp), "--pp", str(pp)
    )
    n = ep * etp
    config = _config("mixtral")
    slots = _balanced(config["num_local_experts"], ep)
    found = _json(capsys, "inspect", str(out))
    layers_of = {
        s["pipeline_stage"]: [int(u) for u in re.findall(r"decoder\[(\d+):(\d+)\]", s["units"])[0]]
        for s in found["stages"]
    }
    for row in found["ranks"]:
        r = row["rank"] % n
        assert (row["expert_parallel_rank"], row["expert_tensor_parallel_rank"]) == (
            r // etp,
            r % etp,
        )
        assert row["experts"] == slots[r // etp]
        a, b = layers_of[row["pipeline_stage"]]
        assert (
            row["expert_bytes"] == _mixtral_expert_bytes(list(range(a, b)), slots[r // etp]) // etp
        )
    # compile's and inspect's rank tables: ep and etp columns, each rank's experts
    for text, head in (
        (compiled, r"rank\s+tp\s+stage\s+ep\s+etp\s"),
        (_run(capsys, "inspect", str(out)), r"rank\s+stage\s+tp\s+ep\s+etp\s"),
    ):
        assert re.search(head, text)
        for rank in range(n * pp):
            r = rank % n
            ids = slots[r // etp]
            assert re.search(
                rf"^\s+{rank}\s+(\d+\s+){{2}}{r // etp}\s+{r % etp}\s.*"
                rf"{len(ids)}: {ids[0]}-{ids[-1]}\s",
                text,
                re.M,
            ), (rank, text)
    explained = _run(
        capsys, "explain", str(out), "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    )
    holders = [rank for rank in range(n * pp) if rank // n == 1 and 3 in slots[rank % n // etp]]
    assert re.search(r"rank\s+stage\s+tp\s+ep\s+etp\s+units", explained)
    for rank in holders:
        assert re.search(rf"^\s+{rank}\s+1\s+\d+\s+1\s+{rank % n % etp}\s", explained, re.M)
    _run(capsys, "report", str(out), "--out", str(tmp_path / "r.html"))
    html = (tmp_path / "r.html").read_text()
    assert "<h2>Expert placement</h2>" in html
    placed = re.findall(
        r'<tr class="expert[^"]*" data-rank="(\d+)" data-ep="(\d+)" '
        r'data-etp="(\d+)" data-experts="([\d,]*)">',
        html,
    )
    assert [(int(a), int(b), int(c), d) for a, b, c, d in placed] == [
        (rank, rank % n // etp, rank % n % etp, ",".join(map(str, slots[rank % n // etp])))
        for rank in range(n * pp)
    ]
    assert re.search(
        r'data-rank="5"[^>]*><td class="num">5</td><td>stage 1, tp 1, ep 0, etp 1</td>', html
    )


def test_a_stage_without_moe_layers_holds_no_experts(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "b"
    compiled = _compile(capsys, out, "deepseek_v3", "--ep", "2", "--pp", "2", "--pp-layers", "1,2")
    config = _config("deepseek_v3")
    dense = config["first_k_dense_replace"]
    assert dense == 1  # layer 0 is dense: stage 0 holds it alone
    slots = _balanced(config["n_routed_experts"], 2)
    sizes = _header("deepseek_v3")
    plan = json.loads((out / "plan.json").read_text())
    found = _json(capsys, "inspect", str(out))
    for rank, row in zip(plan["ranks"], found["ranks"], strict=True):
        mine = slots[rank["rank"] % 2] if rank["pipeline_stage"] == 1 else []
        want = sum(
            n
            for name, n in sizes.items()
            for layer in (1, 2)
            for e in mine
            if name.startswith(f"model.layers.{layer}.mlp.experts.{e}.")
        )
        assert rank["info"]["local_experts"] == len(mine)
        assert rank["info"]["expert_parameter_bytes"] == want
        assert (row["experts"], row["expert_bytes"]) == (mine, want)
    assert re.search(
        r"EP rank\s+0:\s+4 experts 0-3 on rank 2, 0\.188 MiB of experts per rank;"
        r" rank 0 holds none",
        compiled,
    )
    assert re.search(r"^\s+0\s+0\s+0\s+0\s+decoder\[0:1\].*-\s+0\.000$", compiled, re.M)
    summary = _json(
        capsys,
        "compile",
        "--checkpoint",
        str(hf("deepseek_v3")),
        "--out",
        str(out),
        "--force",
        "--ep",
        "2",
        "--pp",
        "2",
        "--pp-layers",
        "1,2",
    )
    assert [r["experts"] for r in summary["expert_parallel"]["ranks"]] == [[], [], *slots]
    _run(capsys, "report", str(out), "--out", str(tmp_path / "r.html"))
    html = (tmp_path / "r.html").read_text()
    assert re.search(r'data-rank="0"[^>]*data-experts="">.*?0 experts.*?0 B</td>', html)


def test_one_expert_is_said_in_the_singular(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "b"
    config = _config("qwen2_moe")
    assert config["num_experts"] == 4  # EP=4: one expert per EP rank
    compiled = _compile(capsys, out, "qwen2_moe", "--ep", "4")
    _run(capsys, "report", str(out), "--out", str(tmp_path / "r.html"))
    for text in (compiled, _run(capsys, "inspect", str(out)), (tmp_path / "r.html").read_text()):
        assert not re.search(r"\b1 experts\b", text) and "0 redundant slots" in text
    assert re.search(r"EP rank\s+3:\s+1 expert\s+3 on rank 3,", compiled)


# ---------------------------------------------------------------- explain with a glob


def test_explain_takes_a_glob_and_explains_every_match_in_order(
    tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "b"
    _compile(capsys, out, "llama", "--tp", "2")
    glob = "model.layers.0.*.q_proj.weight"
    names = sorted(n for n in _header("llama") if fnmatch.fnmatchcase(n, "model.layers.0.*"))
    wanted = [n for n in names if fnmatch.fnmatchcase(n, glob)]
    assert wanted == ["model.layers.0.self_attn.q_proj.weight"]
    glob = "model.layers.0.*_proj.weight"
    wanted = [n for n in names if fnmatch.fnmatchcase(n, glob)]
    assert len(wanted) == 7
    found = _json(capsys, "explain", str(out), glob)
    assert found["pattern"] == glob
    assert [m["target"] for m in found["matches"]] == wanted
    text = _run(capsys, "explain", str(out), glob)
    assert text.startswith(f"`{glob}` matches 7 tensors\n")
    assert [line for line in text.splitlines() if line.startswith("model.")] == wanted
    exact = _json(capsys, "explain", str(out), wanted[0])
    assert "pattern" not in exact and exact["target"] == wanted[0]
    assert _run(capsys, "explain", str(out), wanted[0]) in text


def test_a_glob_matching_nothing_is_one_error_with_close_names(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "b"
    _compile(capsys, out, "llama", "--tp", "2")
    assert main(["explain", str(out), "model.layers.0.*.q_prj.weight"]) != 0
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in captured.err
    assert "`model.layers.0.*.q_prj.weight` matches no tensor and no group" in errors[0]
    assert "'model.layers.0.self_attn.q_proj.weight'" in errors[0]
