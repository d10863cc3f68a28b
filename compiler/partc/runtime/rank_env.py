"""Rank discovery from the launcher's environment, data parallelism included."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from partc.errors import LaunchError


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPosition:
    """Where this process sits in a job that runs a build D times side by side.

    A job of WORLD_SIZE = D·B processes holds D data-parallel replicas of the build's B ranks
    (T·S; E·X·S for an expert-parallel build), each replica a contiguous block of B global
    ranks: global rank g runs build rank g mod B of replica g div B.
    """

    global_rank: int
    """This process's rank in the whole job (`RANK`)."""
    world_size: int
    """Processes in the whole job (`WORLD_SIZE`)."""
    rank: int
    """This process's rank in the build (the rank module it loads)."""
    build_world_size: int
    """Ranks of one replica of the build (T·S; N·S = E·X·S for an expert-parallel build)."""
    data_parallel_rank: int
    """Which replica of the build this process belongs to."""
    data_parallel_size: int
    """Replicas of the build in the job."""

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.build_world_size and self.world_size
                == self.build_world_size * self.data_parallel_size
                and self.global_rank == self.data_parallel_rank * self.build_world_size
                + self.rank and 0 <= self.data_parallel_rank < self.data_parallel_size):
            raise LaunchError(f"inconsistent launch position {self}")


MAX_DIGITS = 18
"""The most significant digits a launcher variable may have: a count of ranks, processes or
threads is far below 10**18, and `int` refuses strings past 4300 digits with a bare
ValueError."""


def shown(raw: str, limit: int = 64) -> str:
    """`raw` as its repr for a message, cut to `limit` characters (a launcher variable may be
    any length) with the characters left out counted."""
    if len(raw) <= limit:
        return repr(raw)
    return f"{raw[:limit]!r}... ({len(raw) - limit} more characters)"


def bounded_integer(name: str, digits: str) -> int:
    """ASCII `digits` of environment variable `name` as an int, or a LaunchError naming the
    variable when they are more than MAX_DIGITS significant digits (leading zeros aside)."""
    significant = digits.lstrip("0")
    if len(significant) > MAX_DIGITS:
        raise LaunchError(f"environment {name} holds a {len(significant)}-digit number; a rank "
                          f"or count has at most {MAX_DIGITS} digits (e.g. 3)")
    return int(significant or "0")


def environment_integer(name: str, raw: str) -> int:
    """Environment variable `name`'s value `raw` as a non-negative integer, or a clear error.

    Only ASCII digits are read (surrounding whitespace aside): `int` would also take '1_0'
    and other scripts' digits ('٣' is 3), which no launcher writes.
    """
    text = raw.strip()
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()):
        raise LaunchError(f"environment {name}={shown(raw)} is not an integer in ASCII digits "
                          "(e.g. 3)")
    if text.startswith("-"):
        raise LaunchError(f"environment {name}={shown(raw)} must not be negative")
    return bounded_integer(name, digits)


def world_factors(tensor_parallel_size: int, pipeline_parallel_size: int,
                  expert_parallel_size: int | None = None,
                  expert_tensor_parallel_size: int = 1) -> str:
    """The factors of a build's rank count as its messages name them: `tp 2 x pp 2`, or
    `pp 2 x ep 2 x etp 2` for an expert-parallel build (N = E x X ranks a stage; `etp` only
    when above 1, and no `tp`: the dense TP groups divide N)."""
    if expert_parallel_size is None:
        return f"tp {tensor_parallel_size} x pp {pipeline_parallel_size}"
    return (f"pp {pipeline_parallel_size} x ep {expert_parallel_size}"
            + (f" x etp {expert_tensor_parallel_size}" if expert_tensor_parallel_size > 1
               else ""))


def launch_position(build_world_size: int, factors: str | None = None) -> LaunchPosition:
    """This process's position from torchrun's environment (`RANK`, `WORLD_SIZE`).

    WORLD_SIZE must be a multiple of the build's ranks (T·S, or E·X·S; the quotient is the
    data-parallel size); without WORLD_SIZE the job is taken to be one replica. `factors`
    (`world_factors`) names the build's sizes in the error when it is not.
    """
    raw = os.environ.get("RANK")
    if raw is None:
        raise LaunchError("no rank given and RANK is not set; pass rank= or run under "
                          "torchrun")
    global_rank = environment_integer("RANK", raw)
    world_raw = os.environ.get("WORLD_SIZE")
    world = build_world_size if world_raw is None else environment_integer("WORLD_SIZE", world_raw)
    if world == 0:
        raise LaunchError(f"environment WORLD_SIZE={shown(world_raw or '')} must be a positive "
                          "count of processes (at least this build's "
                          f"{build_world_size}); unset it for one replica")
    if world % build_world_size:
        raise not_a_multiple(world, build_world_size, factors)
    if global_rank >= world:
        raise LaunchError(f"RANK={global_rank} is outside WORLD_SIZE={world}" if world_raw
                          is not None else f"RANK={global_rank} is outside this build's "
                          f"ranks 0..{build_world_size - 1} (WORLD_SIZE is not set: one "
                          "replica)")
    return LaunchPosition(global_rank=global_rank, world_size=world,
                          rank=global_rank % build_world_size,
                          build_world_size=build_world_size,
                          data_parallel_rank=global_rank // build_world_size,
                          data_parallel_size=world // build_world_size)


def build_launch_position(tensor_parallel_size: int, pipeline_parallel_size: int, *,
                          expert_parallel_size: int | None = None,
                          expert_tensor_parallel_size: int = 1) -> LaunchPosition:
    """`launch_position` of a build of these sizes (T·S ranks, or E·X·S under expert
    parallelism), whose error names them (`world_factors`)."""
    per_stage = (tensor_parallel_size if expert_parallel_size is None
                 else expert_parallel_size * expert_tensor_parallel_size)
    return launch_position(per_stage * pipeline_parallel_size, world_factors(
        tensor_parallel_size, pipeline_parallel_size, expert_parallel_size,
        expert_tensor_parallel_size))


def not_a_multiple(world: int, build_world_size: int, factors: str | None) -> LaunchError:
    """The error for a WORLD_SIZE that is no multiple of the build's ranks (`factors` of them)."""
    named = "" if factors is None else f" ({factors})"
    return LaunchError(
        f"WORLD_SIZE={world} is not a multiple of this build's {build_world_size} "
        f"rank{'' if build_world_size == 1 else 's'}{named}; run {build_world_size} x D "
        "processes for D data-parallel replicas")


def rank_from_environment(world_size: int, factors: str | None = None) -> int:
    """This process's rank in the build, from torchrun's environment (see `launch_position`)."""
    return launch_position(world_size, factors).rank


def package_factors(package: str) -> str | None:
    """`world_factors` of an imported build package, from the sizes its `__init__` exports
    (None when it exports none)."""
    face = sys.modules.get(package)
    tp, pp, ep, etp = (getattr(face, name, None) for name in (
        "TENSOR_PARALLEL_SIZE", "PIPELINE_PARALLEL_SIZE", "EXPERT_PARALLEL_SIZE",
        "EXPERT_TENSOR_PARALLEL_SIZE"))
    if not (isinstance(tp, int) and isinstance(pp, int)):
        return None
    return world_factors(tp, pp, ep if isinstance(ep, int) else None,
                         etp if isinstance(etp, int) else 1)


def rank_out_of_range(rank: int, world_size: int) -> LaunchError:
    """The error for a rank outside the build."""
    return LaunchError(f"rank {rank} is outside this build's ranks 0..{world_size - 1}")
