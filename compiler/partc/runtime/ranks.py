"""Rank discovery from the launcher's environment."""

from __future__ import annotations

import os

from partc.errors import CheckpointError


def rank_from_environment(world_size: int) -> int:
    """This process's global rank from torchrun's environment (`RANK`, `WORLD_SIZE`)."""
    raw = os.environ.get("RANK")
    if raw is None:
        raise CheckpointError("no rank given and RANK is not set; pass rank= or run under "
                              "torchrun")
    try:
        rank = int(raw)
    except ValueError:
        raise CheckpointError(f"environment RANK={raw!r} is not an integer") from None
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world != str(world_size):
        raise CheckpointError(f"WORLD_SIZE={world} but this build has {world_size} ranks "
                              "(TP x PP)")
    return rank


def rank_out_of_range(rank: int, world_size: int) -> CheckpointError:
    """The error for a rank outside the build."""
    return CheckpointError(f"rank {rank} is outside this build's ranks 0..{world_size - 1}")
