"""`partc report` pages in a real browser (headless Chromium, tests/support/browser.py) at 8, 64
and 512 ranks of full-size models (configs only, tests/fixtures/fullsize): the page stays short,
no two labels of its figures overlap, ranks holding the same thing share one row that says how
many, and the colours of stages and of roles are two distinct colour-blind-safe sets.

Oracles, kept apart from partc: the rendered DOM (boxes, computed fills, page height) as Chromium
lays it out; each rank's stage, TP, EP and ETP coordinates and experts from the rank layout of
docs/expert_parallel.md worked out here; colour differences by CIEDE2000 with simulated
dichromacy (tests/support/colour.py, checked against Sharma et al.'s test pairs).

A PNG of each page is saved under the session's temporary folder (printed with `-s`), or under
`PARTC_REPORT_SHOTS` when set, for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from partc.cli.main import main

from support import FULLSIZE
from support.browser import LAYOUT, chromium, open_offline, overlapping
from support.colour import ciede2000, closest_pair

HEIGHT_BOUND = 2600
"""Most CSS pixels a page may be tall in a 1280 px wide window (the every-rank table closed)."""
WINDOW_WIDTH = 1280
"""The window's width, in CSS pixels."""

# name: (model, T, S, E, X)
BUILDS: dict[str, tuple[str, int, int, int | None, int]] = {
    "8": ("Llama-3.1-8B", 8, 1, None, 1),
    "64": ("Llama-3.1-70B", 8, 8, None, 1),
    "512-ep": ("Qwen3-30B-A3B", 4, 8, 32, 2),
    "512-pp": ("Llama-3.1-70B", 8, 64, None, 1),
}
"""Builds of 8, 64 and 512 ranks: dense TP; TP x PP; TP x PP x EP x ETP with 16 dense
replicas; TP x 64 stages."""
SIZES = list(BUILDS)
STAGE_COLOURS = 8
"""Stage colours before they repeat (Okabe and Ito's eight)."""


def _world(size: str) -> int:
    _, tp, pp, ep, etp = BUILDS[size]
    return pp * (tp if ep is None else ep * etp)


def _options(size: str) -> list[str]:
    model, tp, pp, ep, etp = BUILDS[size]
    options = ["--config", str(FULLSIZE / model / "config.json"), "--tp", str(tp), "--pp", str(pp)]
    return options + ([] if ep is None else ["--ep", str(ep), "--etp", str(etp)])


def _ranks_per_stage(size: str) -> int:
    _, tp, _, ep, etp = BUILDS[size]
    return tp if ep is None else ep * etp


def _coordinates(size: str, rank: int) -> dict[str, int]:
    """A rank's stage, TP, EP and ETP rank by the layout docs/expert_parallel.md gives."""
    _, tp, _, ep, etp = BUILDS[size]
    n = _ranks_per_stage(size)
    local = rank % n
    found = {"stage": rank // n, "tp": local % tp}
    if ep is not None:
        found |= {"ep": local // etp, "etp": local % etp}
    return found


def _ids(runs: str) -> list[int]:
    """`8-15,24` as ids."""
    out: list[int] = []
    for run in filter(None, runs.split(",")):
        first, _, last = run.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _shots() -> Path | None:
    where = os.environ.get("PARTC_REPORT_SHOTS")
    return Path(where) if where else None


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each size compiled and reported once: (build folder, report page)."""
    made = {}
    for size in SIZES:
        folder = tmp_path_factory.mktemp(f"report{size}")
        build, page = folder / "build", folder / "report.html"
        assert main(["compile", *_options(size), "--out", str(build)]) == 0
        assert main(["report", str(build), "--out", str(page)]) == 0
        assert len(json.loads((build / "plan.json").read_text())["ranks"]) == _world(size)
        made[size] = (build, page)
    return made


@pytest.fixture(scope="module")
def layouts(reports: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, dict[str, Any]]]:
    """Each page as Chromium lays it out in a 1280 px window (one browser for the module), with
    a full-page screenshot saved beside it."""
    shots = _shots() or tmp_path_factory.mktemp("report-shots")
    shots.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        found = {}
        for size, (_, html) in reports.items():
            page, tried = open_offline(browser, html.as_uri())
            found[size] = page.evaluate(LAYOUT) | {"tried": tried}
            shot = shots / f"report-{size}-ranks.png"
            page.screenshot(path=str(shot), full_page=True)
            found[size]["shot"] = shot
            print(f"report {size}: {shot} ({found[size]['height']} px tall)")
            page.close()
        yield found


@pytest.mark.parametrize("size", SIZES)
def test_the_page_is_short_fits_the_window_width_and_stands_alone_at_any_rank_count(
        reports: dict[str, tuple[Path, Path]], layouts: dict[str, dict[str, Any]], size: str,
        tmp_path: Path) -> None:
    page = layouts[size]
    assert page["height"] <= HEIGHT_BOUND, (size, page["height"])
    assert page["width"] <= WINDOW_WIDTH, (size, page["width"])
    assert page["shot"].stat().st_size > 0
    assert page["tried"] == [] and page["resources"] == []  # nothing from the network
    build, html = reports[size]
    text = html.read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert not re.search(r"(src|href)=|https?://|@import|url\(", text)
    if size == SIZES[0]:  # the same bytes when reported again
        again = tmp_path / "again.html"
        assert main(["report", str(build), "--out", str(again)]) == 0
        assert again.read_bytes() == html.read_bytes()


@pytest.mark.parametrize("size", SIZES)
def test_no_two_labels_of_the_ownership_map_or_the_byte_bars_overlap(
        layouts: dict[str, dict[str, Any]], size: str) -> None:
    for figure in ("ownership", "bytes"):
        texts = layouts[size][figure]["texts"]
        assert texts and all(t["text"].strip() for t in texts), figure
        assert overlapping(texts) == [], (size, figure, overlapping(texts)[:5])
        svg = layouts[size][figure]["box"]
        outside = [t["text"] for t in texts if t["box"]["left"] < svg["left"] - 0.5
                   or t["box"]["right"] > svg["right"] + 0.5
                   or t["box"]["top"] < svg["top"] - 0.5
                   or t["box"]["bottom"] > svg["bottom"] + 0.5]
        assert outside == [], (size, figure, outside)


def _check_rows(rows: list[dict[str, Any]], size: str, bound: int) -> None:
    """Rows partition the build's ranks, each says its count (`×N`), and no more than
    `bound` of them."""
    assert 0 < len(rows) <= bound, (len(rows), bound)
    seen: list[int] = []
    for row in rows:
        ids = _ids(row["ranks"])
        assert int(row["count"]) == len(ids) and f"×{len(ids)}" in row["text"], row
        seen += ids
    assert sorted(seen) == list(range(_world(size)))


@pytest.mark.parametrize("size", SIZES)
def test_ranks_owning_the_same_units_share_one_map_row_with_their_tp_and_ep_coordinates(
        layouts: dict[str, dict[str, Any]], size: str) -> None:
    _, tp, pp, ep, etp = BUILDS[size]
    rows = layouts[size]["map_rows"]
    _check_rows(rows, size, bound=pp)  # a pipeline stage's ranks own the same units
    texts = {t["text"] for t in layouts[size]["ownership"]["texts"]}
    for row in rows:
        coordinates = [_coordinates(size, r) for r in _ids(row["ranks"])]
        assert {c["stage"] for c in coordinates} == {int(row["stage"])}
        # under the ranks, or once over the rows when there are many
        assert (f"stage {row['stage']} · tp 0–{tp - 1}" in row["text"]
                or f"stage {row['stage']}" in row["text"] and f"each row: tp 0–{tp - 1}" in texts
                ), row
        if ep is not None:
            assert f" ×{_ranks_per_stage(size) // tp} replicas" in row["text"], row
            assert f"ep 0–{ep - 1} · etp 0–{etp - 1}" in row["text"], row


@pytest.mark.parametrize("size", SIZES)
def test_ranks_holding_the_same_bytes_share_one_bar_with_their_bytes(
        reports: dict[str, tuple[Path, Path]], layouts: dict[str, dict[str, Any]],
        size: str) -> None:
    rows = layouts[size]["bar_rows"]
    _check_rows(rows, size, bound=BUILDS[size][2])  # one bar per stage: even splits
    plan = json.loads((reports[size][0] / "plan.json").read_text())
    units = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
    for row in rows:
        found = re.search(r"([\d.]+) (B|KiB|MiB|GiB)( each)?$", row["text"])
        assert found is not None, row
        number, unit = found.group(1), found.group(2)
        shown = float(number) * units[unit]
        for rank in _ids(row["ranks"]):  # the bytes compile counted for the rank
            loaded = plan["ranks"][rank]["info"]["local_parameter_bytes"]
            assert abs(shown - loaded) <= 0.005 * loaded, (row, rank, loaded)


def test_ranks_holding_the_same_experts_share_one_card(
        layouts: dict[str, dict[str, Any]]) -> None:
    _, _, _, ep, etp = BUILDS["512-ep"]
    assert ep is not None
    cards = layouts["512-ep"]["expert_cards"]
    _check_rows(cards, "512-ep", bound=ep * etp)
    per_rank = 128 // ep  # Qwen3-30B-A3B: 128 experts, balanced: contiguous equal blocks
    for card in cards:
        for rank in _ids(card["ranks"]):
            want = _coordinates("512-ep", rank)
            assert (int(card["ep"]), int(card["etp"])) == (want["ep"], want["etp"]), card
        e = int(card["ep"])
        assert _ids(card["experts"]) == list(range(e * per_rank, (e + 1) * per_rank))
        assert f"{per_rank} experts {e * per_rank}–{(e + 1) * per_rank - 1}" in card["text"]


@pytest.mark.parametrize("size", SIZES)
def test_stage_and_role_colours_are_two_distinct_colour_blind_safe_sets(
        layouts: dict[str, dict[str, Any]], size: str) -> None:
    stages, roles = layouts[size]["stage_fills"], layouts[size]["role_fills"]
    assert len(stages) == min(BUILDS[size][2], STAGE_COLOURS) and len(roles) >= 4, (stages,
                                                                                     roles)
    assert not set(stages) & set(roles), (stages, roles)
    for colours in (stages, roles):
        if len(colours) > 1:
            for deficiency, least in ((None, 12.0), ("deuteranopia", 8.0),
                                      ("protanopia", 8.0)):
                found = closest_pair(colours, deficiency)
                assert found[0] >= least, (deficiency, found)
    across = min(closest_pair([s, r])[0] for s in stages for r in roles)
    assert across >= 6.0, (stages, roles)


def test_the_ciede2000_oracle_gives_sharma_wu_dalals_published_differences() -> None:
    pairs = [((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
             ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669),
             ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
             ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644),
             ((2.0776, 0.0795, -1.135), (0.9033, -0.0636, -0.5514), 0.9082),
             ((50.0, 2.49, -0.001), (50.0, -2.49, 0.0011), 7.2195)]
    assert [round(ciede2000(a, b), 4) for a, b, _ in pairs] == [want for _, _, want in pairs]
