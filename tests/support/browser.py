"""A real browser for the page tests: headless Chromium driven by Playwright's Python package,
started from the system's Chromium (never a downloaded one), offline.

`PARTC_CHROMIUM` names another Chromium binary. Without Playwright (the `test` extra) or a
Chromium (Debian's package `chromium`, which `.ci/run` installs) the browser tests fail, saying
which is missing: they are the report's only check in a real browser.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("PARTC_CHROMIUM", "/usr/bin/chromium"))
"""The Chromium binary the tests drive."""
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
"""Headless, offline, nothing fetched in the background."""
WINDOW = {"width": 1280, "height": 900}
"""The viewport, in CSS pixels."""

LAYOUT = """() => {
  const box = (e) => { const r = e.getBoundingClientRect();
    return {left: r.left + scrollX, top: r.top + scrollY, right: r.right + scrollX,
            bottom: r.bottom + scrollY}; };
  const texts = (svg) => svg === null ? [] : [...svg.querySelectorAll('text')].map(
    (t) => ({text: t.textContent, box: box(t)}));
  const rows = (sel) => [...document.querySelectorAll(sel)].map((g) => ({
    text: [...g.querySelectorAll('text')].map((t) => t.textContent).join(' | ') || g.innerText,
    ranks: g.dataset.ranks, count: g.dataset.count, stage: g.dataset.stages,
    ep: g.dataset.ep, etp: g.dataset.etp, experts: g.dataset.experts,
    visible: g.getBoundingClientRect().height > 0}));
  const fills = (sel) => [...new Set([...document.querySelectorAll(sel)].map(
    (r) => getComputedStyle(r).fill))];
  const ownership = document.querySelector('svg#ownership');
  const bytes = document.querySelector('svg#bytes');
  return {
    height: document.scrollingElement.scrollHeight,
    width: document.scrollingElement.scrollWidth,
    ownership: {texts: texts(ownership), box: ownership && box(ownership)},
    bytes: {texts: texts(bytes), box: bytes && box(bytes)},
    map_rows: rows('svg#ownership g.row'),
    bar_rows: rows('svg#bytes g.row'),
    expert_cards: rows('#experts > div'),
    stage_fills: fills('svg#ownership rect.owned'),
    role_fills: fills('svg#bytes rect.segment'),
    resources: performance.getEntriesByType('resource').map((e) => e.name),
  };
}"""
"""JavaScript run in the page: what the tests assert, read from the rendered DOM."""


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium browser (fails the test, saying what is missing, without one)."""
    try:
        from playwright import sync_api
    except ImportError:
        pytest.fail("the report's browser tests need the playwright package (the test extra)")
    if not CHROMIUM.is_file():
        pytest.fail(f"the report's browser tests need a Chromium binary at {CHROMIUM} "
                    "(apt-get install chromium, or set PARTC_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_offline(browser: Any, url: str) -> tuple[Any, list[str]]:
    """A new page at the window size showing `url`, every request but `file:` refused; the
    page and the requests it tried."""
    page = browser.new_page(viewport=WINDOW)
    tried: list[str] = []

    def refuse(route: Any) -> None:
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            tried.append(route.request.url)
            route.abort()

    page.route("**/*", refuse)
    page.goto(url)
    return page, tried


def overlapping(boxes: list[dict[str, Any]], slack: float = 0.5) -> list[tuple[str, str]]:
    """The pairs of labels whose boxes overlap by more than `slack` pixels each way."""
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            p, q = a["box"], b["box"]
            if (min(p["right"], q["right"]) - max(p["left"], q["left"]) > slack
                    and min(p["bottom"], q["bottom"]) - max(p["top"], q["top"]) > slack):
                found.append((a["text"], b["text"]))
    return found
