"""`partc init --prove`: a vision-side boundary the scaffold could not derive, decided by
`partc verify`'s cut checks.

Where `partc.scaffold.vision_boundary` finds no rule for what crosses a cut inside a tower or
after its projector, the scaffold writes a placeholder over a per-request dimension (its
leading axes folded, as verify's boundary check reads it) and lists the widths the last axis
may have (`Scaffold.boundaries`: the tower's, the decoder's). Each round writes every
undecided boundary at its next width and verifies the scaffold at T = 1 with a stage per unit,
so that every cut is crossed; a boundary no failing cut check names is decided (its CHECK
mark becomes the proof), one a cut names moves to its next width, and one no width explains
keeps the first, marked CHECK with verify's finding.
"""

from __future__ import annotations

import copy
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partc.scaffold.family_text import Scaffold

PipelineVerifier = Callable[[Path, Path, int], Sequence[tuple[str, str]]]
"""`partc verify` at T = 1 and S stages: (family file, config, S) -> the failing checks'
(group, message). The command line passes `partc.cli.commands.verify_cut_failures`."""

_FINDING = 240
"""The longest finding quoted in a comment (verify's first message, cut)."""


@dataclass(frozen=True, slots=True)
class OpenBoundary:
    """A placeholder boundary: its execution group, the CHECK reason written on its primary,
    and the shapes tried in order (the first written without `--prove`)."""

    group: str
    """The execution group whose cuts carry it."""
    identity: str
    """The boundary's identity (`gemma3.projector`), which finds its lines in the text."""
    why: str
    """The CHECK reason the scaffold wrote on its primary line."""
    candidates: tuple[tuple[str, ...], ...]
    """The primary shapes tried, each as its entries (`vision_tokens`, `vision_hidden_size`)."""


def tried_widths(first: str, *others: str | None) -> tuple[str, ...]:
    """The widths a placeholder's last axis is tried at: `first`, then the others (absent
    and repeated ones dropped)."""
    return tuple(dict.fromkeys(w for w in (first, *others) if w))


def _line(lines: list[str], identity: str) -> int:
    """The index of the primary line of the boundary `identity`."""
    start = lines.index(next(line for line in lines if line.strip() == f"identity: {identity}"))
    return next(i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith(
        "primary:"))


def _written(text: str, shapes: dict[str, tuple[str, ...]], comments: dict[str, str]
             ) -> str:
    """`text` with each boundary's primary shape (by identity) replaced, and its comment when
    `comments` has one."""
    lines = text.split("\n")
    for identity, shape in shapes.items():
        at = _line(lines, identity)
        code, _, comment = lines[at].partition("  # ")
        code = re.sub(r"shape: \[[^\]]*\]", f"shape: [{', '.join(shape)}]", code, count=1)
        note = comments.get(identity, "# " + comment if comment else "")
        lines[at] = code + (f"  {note}" if note else "")
    return "\n".join(lines)


def _stages(family: Path, config: Path) -> int:
    """A stage per execution unit: every cut of the graph crossed."""
    from partc.api import bind

    bound, _, _ = bind(family, config)
    return sum(len(g.unit_paths) for g in bound.description.graph.groups)


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
    document = copy.deepcopy(result.document)
    for entry in document.get("graph", ()):
        schema = entry.get("boundary") if isinstance(entry, dict) else None
        if schema is not None and schema["identity"] in shapes:
            schema["primary"]["shape"] = type(schema["primary"]["shape"])(
                int(x) if x.isdigit() else x for x in shapes[schema["identity"]])
    refused = ", ".join(g for g, finding in decided.items() if finding is not None)
    notes = tuple(re.sub(r"; the boundaries of .* are placeholders marked CHECK .*", (
        f"; the boundaries of {refused} are placeholders marked CHECK (verify refused every "
        "width)") if refused else "", note) for note in result.notes)
    return replace(result, text=_written(result.text, shapes, comments), document=document,
                   undecided=tuple(undecided), notes=notes, boundaries=())
