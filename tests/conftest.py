"""Fixtures shared by the test modules (helpers live in `tests/support/`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from support import compile_and_load, fixture_folder, policy_for

Build = tuple[Any, list[Any]]


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int, int], Build]:
    """Every (fixture, T, S) compiled once with its built-in family and loaded on every rank.

    The family is found from the fixture's `model_type`; the policy is `policy_for(name, T)`.
    Returns `get(name, tp, pp) -> (plan, states)`, one compile per key for the whole session.
    """
    cache: dict[tuple[str, int, int], Build] = {}

    def get(name: str, tp: int, pp: int) -> Build:
        key = (name, tp, pp)
        if key not in cache:
            folder = fixture_folder(name)
            out = tmp_path_factory.mktemp(f"{name}_{tp}_{pp}") / "build"
            cache[key] = compile_and_load(None, folder / "config.json", out, folder, tp=tp,
                                          pp=pp, policy=policy_for(name, tp))
        return cache[key]

    return get
