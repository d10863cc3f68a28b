"""What `partc verify` found: one `Check` per verified claim, gathered in a `VerifyReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partc.plan.plan_records import PlanFile


CHECK_KINDS = {
    "module": "a module's ranks add up to the full module (or each gives it, when whole)",
    "load": "a rank's loader read the checkpoint's bytes (and a dense replica its first's)",
    "experts": "an experts module's EP ranks, through the expert map, give the full module",
    "ownership": "a stage owns a tensor it executes",
    "cut": "a cut carries its declared boundary",
    "input": "a model input read past stage 0 crosses the cuts before it",
    "logits": "the model assembled from the stages' tensors gives the full logits",
    "compile": "the reference model compiles at a topology the config compiles at",
}
"""The `kind` of a check, and what it claims."""


def topology_name(tp: int, pp: int, ep: int | None = None, etp: int | None = None) -> str:
    """A topology as reports spell it: `T=2 x S=2 x EP=4` (`x ETP=X` when X > 1)."""
    experts = "" if ep is None else f" x EP={ep}" + (f" x ETP={etp}" if (etp or 1) > 1 else "")
    return f"T={tp} x S={pp}{experts}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One verified claim: a module (or the logits, or a tensor's ownership) at one topology."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    module: str
    """Hugging Face module path (or `logits`, or the on-disk tensor for ownership)."""
    group: str
    """The parameter group(s) concerned ('' when not narrowed to groups)."""
    rank: int | None
    """The global rank concerned; None when the claim is about all ranks together."""
    ok: bool
    """Whether the claim holds."""
    max_error: float
    """Largest absolute difference from the full model's output."""
    tolerance: float
    """The largest difference allowed."""
    message: str = ""
    """What failed, in words ('' when ok)."""
    declared: str = ""
    """`file:line` of the family entry declaring the (first) group concerned, for a failed
    check ('' when ok, not narrowed to a group, or not found)."""
    ep: int | None = None
    """Expert-parallel size E of the build checked (`verify --ep`); None for a build without
    expert parallelism."""
    etp: int | None = None
    """Expert-tensor-parallel size X of the build checked; None without expert parallelism."""
    kind: str = "module"
    """What is claimed (`CHECK_KINDS`)."""

    def to_json(self) -> dict[str, object]:
        """The check as a JSON object."""
        return {"tp": self.tp, "pp": self.pp, "module": self.module, "group": self.group,
                "rank": self.rank, "ok": self.ok, "max_error": self.max_error,
                "tolerance": self.tolerance, "message": self.message,
                "declared": self.declared, "ep": self.ep, "etp": self.etp, "kind": self.kind}


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyReport:
    """Every check of one `partc verify` run, the topologies skipped and notes on the model."""

    family: str
    """The family's name."""
    model_type: str
    """The config's model type."""
    checks: tuple[Check, ...]
    """Every check, in the order they ran."""
    skipped: tuple[dict[str, object], ...] = ()
    """Topologies not checked, each with the reason (the compile error)."""
    notes: tuple[str, ...] = ()
    """How the reference model differs from the given config."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall-clock time per phase, for the report only."""
    stage_units: str | None = None
    """Where the pipeline check cut, as --pp-layers spells it (None: balanced)."""
    plans: tuple[PlanFile, ...] = ()
    """The plans of the builds checked, read back (to locate a failed group's line)."""
    pipeline_cuts: tuple[dict[str, object], ...] = ()
    """Each cut the pipeline check checked: `tensor_parallel_sizes` (the T whose compile
    chooses it at `pipeline_parallel_size`), `given` (--pp-layers), `stage_units` (as
    --pp-layers spells them) and `cuts` (each `after_stage` and `group`)."""

    @property
    def ok(self) -> bool:
        """Whether every check holds (and at least one ran)."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def first_failure(self) -> Check | None:
        """The first check that failed."""
        return next((c for c in self.checks if not c.ok), None)

    def to_json(self) -> dict[str, object]:
        """The report as a JSON object."""
        return {"family": self.family, "model_type": self.model_type, "ok": self.ok,
                "checks": [c.to_json() for c in self.checks], "skipped": list(self.skipped),
                "notes": list(self.notes), "stage_units": self.stage_units,
                "pipeline_cuts": list(self.pipeline_cuts),
                "seconds": {k: round(v, 3) for k, v in sorted(self.seconds.items())}}
