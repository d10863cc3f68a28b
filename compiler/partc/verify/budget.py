"""How much memory a `partc verify` run will need, estimated before any model is built.

The reference model is built once on torch's meta device (shapes only, no storage) with the
class and config the real build uses: its parameters and buffers (a rotary cache of positions
x rotary width included) give the model's float32 bytes. A run holds several copies of it at
once (the checkpoint's tensors, the loaded model, the copy that traces where each parameter
comes from, the ranks' loaded states and their masked models), more with more ranks: measured
on a 96M-parameter Llama at T = 1, 2 and 4 (peak RSS less the libraries' 0.34 GB) as 4.5, 6.2
and 9.5 copies, which `COPIES_BASE + COPIES_PER_RANK x ranks` bounds. A run whose estimate
exceeds the memory budget is refused before the reference model is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partc.errors import SourceLocation, VerifyError
from partc.verify.reference import new_model

KEPT = ("kept at full size",)
"""How the notes on sizes the shrink left begin (repeated in the budget's error)."""
DEFAULT_MEMORY_BUDGET = 4 * 2**30
"""The memory a verify run may need by default (bytes): 4 GiB."""
COPIES_BASE = 3
"""Copies of the reference model a run holds whatever its ranks."""
COPIES_PER_RANK = 2
"""Further copies per rank of the largest topology checked."""
MARGIN = 64 * 2**20
"""Activations of the captured runs (8 tokens, one small image) and scratch (bytes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """The reference model's size and the memory a verify run of it needs."""

    parameters: int
    """Elements of the model's parameters (a tied head counted once)."""
    model_bytes: int
    """float32 bytes of its parameters and buffers."""
    ranks: int
    """Ranks of the largest topology checked."""

    @property
    def peak_bytes(self) -> int:
        """The run's estimated peak: its copies of the model, plus MARGIN."""
        return (COPIES_BASE + COPIES_PER_RANK * self.ranks) * self.model_bytes + MARGIN

    def note(self, budget: int) -> str:
        """The report's line on the estimate."""
        return (f"reference model: {self.parameters:,} parameters, {size(self.model_bytes)} in "
                f"float32; estimated peak {size(self.peak_bytes)} at {self.ranks} rank(s), "
                f"within the memory budget of {size(budget)}")


def size(count: int) -> str:
    """A byte count as people read it (KiB to TiB, 3 significant digits)."""
    value, unit = float(count), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, name
    return f"{count} bytes" if unit == "bytes" else f"{value:.3g} {unit}"


def estimate(config: dict[str, Any], ranks: int,
             source: SourceLocation | None = None) -> MemoryEstimate:
    """The memory estimate of the reference model of `config` (the reference config, as
    `build_reference` takes it), built on the meta device, for a run at `ranks` ranks; a
    VerifyError at `source` (the user's config) when transformers cannot build it."""
    model = new_model(config, source, device="meta")
    parameters = sum(int(p.numel()) for p in model.parameters())
    buffers = sum(int(b.numel()) * 4 for b in model.buffers())  # float32 whatever their dtype
    return MemoryEstimate(parameters=parameters, model_bytes=4 * parameters + buffers,
                          ranks=max(1, ranks))


def check_budget(found: MemoryEstimate, budget: int, source: SourceLocation | None = None,
                 kept: Sequence[str] = ()) -> None:
    """Refuse (a VerifyError at `source`, the user's config) a run whose estimated peak
    exceeds `budget` bytes; `kept`: the notes on sizes left unshrunk, said in the error."""
    if found.peak_bytes > budget:
        raise VerifyError(
            f"the reference model would not fit the memory budget: {found.parameters:,} "
            f"parameters, {size(found.model_bytes)} in float32, and a verify run at "
            f"{found.ranks} rank(s) holds {COPIES_BASE + COPIES_PER_RANK * found.ranks} copies "
            f"of it: estimated peak {size(found.peak_bytes)}, over the budget of "
            f"{size(budget)}; no model was built"
            + "".join(f"; {line}" for line in kept)
            + " (--memory-budget raises the budget)", location=source)


def within_budget(config: dict[str, Any], ranks: int, budget: int, notes: Sequence[str],
                  source: SourceLocation | None = None) -> str:
    """The estimate's note for the report, once the reference model of `config` (at `ranks`
    ranks) is known to fit `budget`; else the budget's VerifyError, which repeats the `notes`
    on sizes kept at full size."""
    found = estimate(config, ranks, source)
    check_budget(found, budget, source, [n for n in notes if n.startswith(KEPT)])
    return found.note(budget)
