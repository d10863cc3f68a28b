"""How many reader threads a rank uses: the node's cores shared among its loading ranks, and
the environment variables and options that override it."""

from __future__ import annotations

import os

from partc.errors import LaunchError
from partc.runtime.rank_env import bounded_integer, shown


def environment_count(name: str) -> int | None:
    """Environment variable `name` as a positive integer; None when unset or blank.

    Any other value is a LaunchError naming the variable and its value: only ASCII digits
    are read (`str.isdigit` accepts '²', which `int` refuses; `int` accepts '1_0' and
    other scripts' digits, which no launcher writes).
    """
    raw = os.environ.get(name)
    text = (raw or "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or bounded_integer(name, text) == 0:
        raise LaunchError(f"environment {name}={shown(raw or '')} must be a positive integer in "
                          "ASCII digits (e.g. 4); unset it for the default")
    return bounded_integer(name, text)


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where known)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def node_ranks(local_ranks: int | None = None) -> int:
    """Ranks loading on this node at once: `local_ranks`, else `PARTC_LOCAL_RANKS`, else
    torchrun's `LOCAL_WORLD_SIZE`, else 1."""
    if local_ranks is not None:
        return max(1, int(local_ranks))
    return environment_count("PARTC_LOCAL_RANKS") or environment_count("LOCAL_WORLD_SIZE") or 1


def default_workers(local_ranks: int | None = None) -> int:
    """Reader threads of one rank: `PARTC_READ_THREADS`, else the node's cores shared among its
    loading ranks (`node_ranks`), at least 1 and at most 8.

    Reads from the page cache are memory copies: more threads than cores on a node only make
    the ranks take turns (measured: 2T threads on 2 cores made the slowest of T ranks 2x-4x
    slower than one rank alone).
    """
    forced = environment_count("PARTC_READ_THREADS")
    if forced is not None:
        return forced
    return shared_cores(node_ranks(local_ranks))


def shared_cores(ranks: int) -> int:
    """A rank's share of the node's cores among `ranks` loading ranks, 1 to 8."""
    return max(1, min(8, usable_cores() // ranks))
