"""`partc init --prove`: a vision-side boundary the scaffold could not derive, decided by
`partc verify`'s cut checks.

Where `partc.scaffold.vision_boundary` finds no rule for what crosses a cut inside a tower or
after its projector, the scaffold writes a placeholder over a per-request dimension (its
leading axes folded, as verify's boundary check reads it) and lists the widths the last axis
may have (`Scaffold.boundaries`: the tower's, the decoder's). Each round writes every
undecided boundary at its next width and verifies the scaffold at T = 1 with a stage per unit,
so that every cut is crossed; a boundary no failing cut check names is decided (its CHECK
mark becomes the proof), one a cut names moves to its next width, and one no width explains
keeps the first, marked CHECK with verify's finding (`partc.scaffold.prove.prove_boundaries`
runs the rounds; this module holds what the scaffold writes and reads of them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PipelineVerifier = Callable[[Path, Path, int], Sequence[tuple[str, str]]]
"""`partc verify` at T = 1 and S stages: (family file, config, S) -> the failing checks'
(group, message). The command line passes `partc.cli.commands.verify_cut_failures`."""

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
