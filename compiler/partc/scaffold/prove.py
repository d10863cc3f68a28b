"""`partc init --prove`: each layout the header leaves open decided by `partc verify`.

The scaffold lists the groups whose declaration the checkpoint's shapes do not decide
(`Scaffold.open`: a fused projection's row order, a square weight's orientation) with the
candidates the language has. Each round writes the scaffold with every undecided group at its
next candidate, checks it at T = 2, 3 and 4 (`check_family`, as `partc check --tp T`), and verifies
it against transformers' modeling code at the sizes that compile (`verify_family`, S = 1). A
group no failing check names is decided; one a check names (or a compile error at T = 2) moves
to its next candidate. The groups are independent modules, so the rounds are as many as the
longest candidate list, not their product. What no candidate explains keeps the first and is
marked CHECK with verify's finding.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from partc.scaffold.family_text import Scaffold, scaffold
from partc.scaffold.fused import OpenLayout, Proof
from partc.scaffold.prove_boundary import PipelineVerifier, prove_boundaries

if TYPE_CHECKING:
    from partc.plan.ir import Plan

Verifier = Callable[[Path, Path, Sequence[int]], Sequence[tuple[str, str]]]
"""`partc verify` as prove calls it: (family file, config, T sizes) -> the failing checks'
(group, message). The command line passes `partc.cli.commands.verify_failures` (partc.verify
lies above this package)."""

PROVE_SIZES = (2, 3, 4)
"""The tensor-parallel sizes each candidate is verified at (those that compile). T = 3 is
among them because candidates can put the same rows on every rank at T = 2 and 4 (CodeGen's
16 heads in 4 groups read as per-head rows) and differ only at an odd T."""

_FINDING = 240
"""The longest finding quoted in a comment (verify's first message, cut)."""


@dataclass(frozen=True, slots=True)
class Round:
    """One candidate set tried: the sizes verified and the groups refused, with why."""

    sizes: tuple[int, ...]
    refused: dict[str, str]


def _group_pattern(template: str) -> re.Pattern[str]:
    """The names of a group template's groups: `layers.{unit}.attention` -> `layers.3.attention`."""
    return re.compile(re.escape(template).replace(re.escape("{unit}"), r"\d+") + "$")


def _short(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= _FINDING else text[:_FINDING - 3] + "..."


def _blamed(open_layouts: Sequence[OpenLayout], messages: Sequence[tuple[str, str]]
            ) -> dict[str, str]:
    """The open groups named by failing checks or errors, each with the first message:
    `messages` are (group name or text naming it, message)."""
    found: dict[str, str] = {}
    for layout in open_layouts:
        pattern = _group_pattern(layout.group)
        for where, message in messages:
            if pattern.match(where) or re.search(
                    r"group `" + pattern.pattern.rstrip("$") + "`", where):
                found.setdefault(layout.group, message)
    return found


def _try(family: Path, checkpoint: Path, config: Path, open_layouts: Sequence[OpenLayout],
         verify: Verifier) -> Round:
    """Check the written scaffold at `PROVE_SIZES` and verify it at those that compile."""
    from partc.api import check_family
    from partc.plan.topology import Topology

    sizes: list[int] = []
    messages: list[tuple[str, str]] = []
    for tp in PROVE_SIZES:
        errors = check_family(family, config, checkpoint,
                              topology=Topology(tensor_parallel_size=tp))
        if not errors:
            sizes.append(tp)
        elif tp == PROVE_SIZES[0]:
            messages += [(str(e), f"T={tp} does not compile: {e}") for e in errors]
    if not sizes:
        return Round((), _blamed(open_layouts, messages) or {
            layout.group: messages[0][1] for layout in open_layouts})
    messages += verify(family, config, sizes)
    return Round(tuple(sizes), _blamed(open_layouts, messages))


def prove(checkpoint: Path, config: Path, verify: Verifier, *, name: str | None = None,
          progress: Callable[[str], None] | None = None,
          pipeline: PipelineVerifier | None = None) -> Scaffold:
    """The scaffold with every open layout decided by `verify` (`Scaffold.open`), or marked
    CHECK with verify's finding where no candidate passes; with `pipeline`, every placeholder
    boundary too (`partc.scaffold.prove_boundary`)."""
    proven = _layouts(checkpoint, config, verify, name, progress)
    if pipeline is None:
        return proven
    return prove_boundaries(proven, config, pipeline, progress)


def _layouts(checkpoint: Path, config: Path, verify: Verifier, name: str | None,
             progress: Callable[[str], None] | None) -> Scaffold:
    """The scaffold with every open layout decided (`prove` without its boundaries)."""
    first = scaffold(checkpoint, config, name=name)
    if not first.open:
        return first
    open_layouts = {layout.group: layout for layout in first.open}
    chosen = dict.fromkeys(open_layouts, 0)
    refused: dict[str, list[str]] = {group: [] for group in open_layouts}
    findings: dict[str, str] = {}
    proofs: dict[str, Proof] = {}
    with tempfile.TemporaryDirectory(prefix="partc-init-") as scratch:
        family = Path(scratch) / "family.yaml"
        while len(proofs) < len(open_layouts):
            pending = [open_layouts[g] for g in open_layouts if g not in proofs]
            family.write_text(scaffold(checkpoint, config, name=name, choices=chosen).text,
                              encoding="utf-8")
            tried = _try(family, checkpoint, config, pending, verify)
            for layout in pending:
                group, label = layout.group, layout.candidates[chosen[layout.group]].label
                if group not in tried.refused:
                    sizes = ", ".join(map(str, tried.sizes))
                    proofs[group] = Proof(chosen[group], f"verified against transformers at "
                                          f"T={sizes}" + (f"; refused: {'; '.join(refused[group])}"
                                                          if refused[group] else ""))
                    if progress is not None:
                        progress(f"{group}: {label} verified at T={sizes}")
                    continue
                findings.setdefault(group, _short(tried.refused[group]))
                refused[group].append(label)
                if progress is not None:
                    progress(f"{group}: {label} refused: {_short(tried.refused[group])}")
                chosen[group] += 1
                if chosen[group] == len(layout.candidates):
                    chosen[group] = 0
                    proofs[group] = Proof(None, f"every candidate refused; with the first, "
                                          f"{findings[group]}")
    return scaffold(checkpoint, config, name=name, choices=chosen, proofs=proofs)


def read_share(plan: Plan) -> float:
    """The elements the ranks of a plan's first stage read together over the checkpoint's
    elements (1.0: one rank's worth, everything split; T: everything replicated)."""
    from partc.parallel.placements import PlacementKind

    total = sum(math.prod(t.shape) for t in plan.tensors)
    read = 0
    for group in plan.groups:
        if 0 not in group.stages:
            continue
        for layouts in plan.kinds[group.kind].layouts:
            read += sum(math.prod(layout.local_shape) for layout in layouts
                        if layout.placement.kind is not PlacementKind.OMIT)
    return read / total
