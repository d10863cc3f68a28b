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

import copy
import math
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from partc.scaffold.family_text import Scaffold, scaffold
from partc.scaffold.fused import OpenLayout, Proof
from partc.scaffold.prove_boundary import PipelineVerifier, _stages, _written

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
    boundary too (`prove_boundaries`)."""
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


def prove_boundaries(result: Scaffold, config: Path, verify: PipelineVerifier,
                     progress: Callable[[str], None] | None = None) -> Scaffold:
    """`result` with each placeholder boundary (`Scaffold.boundaries`) decided by `verify`'s
    cut checks, or marked CHECK with its finding where no width passes."""
    open_boundaries = {b.group: b for b in result.boundaries}
    if not open_boundaries:
        return result
    chosen = dict.fromkeys(open_boundaries, 0)
    findings: dict[str, str] = {}
    decided: dict[str, str | None] = {}  # group -> None (verified) or the finding
    shapes = {b.identity: b.candidates[0] for b in open_boundaries.values()}
    with tempfile.TemporaryDirectory(prefix="partc-init-") as scratch:
        family = Path(scratch) / "family.yaml"
        family.write_text(result.text, encoding="utf-8")
        stages = _stages(family, config)
        while len(decided) < len(open_boundaries):
            pending = [b for g, b in open_boundaries.items() if g not in decided]
            shapes.update((b.identity, b.candidates[chosen[b.group]]) for b in pending)
            family.write_text(_written(result.text, shapes, {}), encoding="utf-8")
            failures = verify(family, config, stages)
            for b in pending:
                shape = f"[{', '.join(b.candidates[chosen[b.group]])}]"
                message = next((m for g, m in failures if g == b.group), None)
                if message is None:
                    decided[b.group] = None
                    if progress is not None:
                        progress(f"boundary {b.identity}: {shape} verified at T=1 x S={stages}")
                    continue
                findings.setdefault(b.group, " ".join(message.split())[:_FINDING])
                if progress is not None:
                    progress(f"boundary {b.identity}: {shape} refused: {findings[b.group]}")
                chosen[b.group] += 1
                if chosen[b.group] == len(b.candidates):
                    chosen[b.group] = 0
                    shapes[b.identity] = b.candidates[0]
                    decided[b.group] = findings[b.group]
    comments, undecided = {}, list(result.undecided)
    for group, finding in decided.items():
        b = open_boundaries[group]
        undecided.remove(b.why)
        if finding is None:
            comments[b.identity] = (f"# partc init --prove: verified against transformers at "
                                    f"T=1 x S={stages} (a stage per unit: every cut crossed)")
        else:
            why = f"every width refused by verify; with the first, {finding}"
            comments[b.identity] = f"# partc init: CHECK: {why}"
            undecided.append(why)
    shaped = copy.deepcopy(result.document)
    for entry in shaped.get("graph", ()):
        schema = entry.get("boundary") if isinstance(entry, dict) else None
        if schema is not None and schema["identity"] in shapes:
            schema["primary"]["shape"] = type(schema["primary"]["shape"])(
                int(x) if x.isdigit() else x for x in shapes[schema["identity"]])
    refused = ", ".join(g for g, finding in decided.items() if finding is not None)
    notes = tuple(re.sub(r"; the boundaries of .* are placeholders marked CHECK .*", (
        f"; the boundaries of {refused} are placeholders marked CHECK (verify refused every "
        "width)") if refused else "", note) for note in result.notes)
    return replace(result, text=_written(result.text, shapes, comments), document=shaped,
                   undecided=tuple(undecided), notes=notes, boundaries=())
