"""`verify --checkpoint DIR`: the family bound to the user's config against the user's own
checkpoint header (names, dtypes, shapes; no weight is read).

verify builds its reference checkpoint from config.json with transformers, so it holds
transformers' own names: a family whose templates match those but not the released files (a
prefix, an extra multi-token-prediction layer, a buffer) verifies and then fails to load on
the cluster. This check closes that gap with `partc check --checkpoint`'s own code
(`partc.api.check_family`: every declared tensor present with its dtype and global shape,
every checkpoint tensor owned or omitted, each error located at the family's declaration or
the checkpoint file), plus one line naming a prefix under which the checkpoint holds the
declared tensors (`partc.runtime.loader.renamed_prefix`, as `shard` and the loader find it).
"""

from __future__ import annotations

from pathlib import Path

from partc.api import bind, check_family
from partc.errors import CheckpointError, PartcError, SourceLocation


def checkpoint_errors(family: str | Path | None, config: str | Path,
                      checkpoint: str | Path) -> list[PartcError]:
    """Every error `partc check FAMILY --config CONFIG --checkpoint CHECKPOINT` reports (an
    index.json of shards is read as `check` reads it, headers only), preceded, when the
    declared tensors the checkpoint lacks are all held under another prefix, by one error
    saying which; [] when the family loads the checkpoint's tensors as declared."""
    errors = check_family(family, config, checkpoint)
    if not errors:
        return errors
    prefix = _prefix_error(family, config, Path(checkpoint))
    return ([prefix] if prefix is not None else []) + errors


def _prefix_error(family: str | Path | None, config: str | Path,
                  checkpoint: Path) -> PartcError | None:
    """The error naming the prefix under which the checkpoint holds every declared tensor it
    lacks (None when there is no such prefix, or the binding itself fails)."""
    from partc.runtime.checkpoint import open_checkpoint
    from partc.runtime.loader import renamed_prefix

    try:
        opened = open_checkpoint(checkpoint)
        bound, _, _ = bind(family, config, opened)
    except PartcError:
        return None
    declared = {t for owned in bound.description.groups for t in owned.group.targets}
    rename = renamed_prefix(sorted(t for t in declared if t not in opened), opened, declared)
    if rename is None:
        return None
    return CheckpointError(
        f"the checkpoint holds {len(rename.targets)} tensor(s) of the family under "
        f"`{rename.found}…` where the family declares `{rename.expected}…` (`"
        f"{rename.targets[0]}` is `{rename.held(rename.targets[0])}` there): the family's "
        "templates follow transformers' names, not this checkpoint's; declare the "
        "checkpoint's prefix (`prefixes:` with `candidates:`, docs/authoring.md)",
        location=SourceLocation(str(opened.path)))
