"""The small runtime that generated rank modules import.

A rank module holds literal tables; these functions turn them into the `parallel` and
`partition` values (through their validating constructors) and read the rank's slices from a
checkpoint after checking its header against the plan.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.errors import (
    CheckpointError,
    LaunchError,
    PartcError,
    SourceLocation,
    raise_if_any,
)
from partc.runtime._engine.reader import read_tensors
from partc.runtime._engine.selection import ReadOptions, TensorSelection
from partc.runtime.checkpoint import Checkpoint, open_checkpoint
from partc.runtime.digests import (
    check_digests,
    compiled_digests,
    verify_digests,
)
from partc.runtime.files import path_text, sha256, spelled
from partc.runtime.frameworks import FLOAT_DTYPES, to_torch
from partc.runtime.headers import ML_DTYPES
from partc.runtime.manifest import ShardManifest, read_shard_manifest
from partc.runtime.options import Framework, LoadOptions, Verify, option_error
from partc.runtime.progress import progress_bar
from partc.runtime.rank_env import package_factors, rank_from_environment, rank_out_of_range
from partc.runtime.tables import (
    RankTable,
    local_model_layout,
    parallel_model_info,
    tensor_selections,
)

if TYPE_CHECKING:  # decoded on first use of a state's `layout` / `info` (import cost)
    from partc.parallel.layout import LocalModelLayout, ParallelModelInfo
    from partc.parallel.placements import Selection


@dataclass(frozen=True, eq=False)
class RankState:
    """What `load` returns: the rank's arrays with their layout and accounting.

    Not slotted: `layout` and `info` are decoded from the rank module's tables on first use
    and then kept (a load reads by the tables' selections and needs neither).
    """

    tensors: dict[str, np.ndarray]
    """Local arrays by checkpoint target, in target order."""
    table: RankTable = field(repr=False)
    """The tables of the rank module that loaded them."""

    @cached_property
    def layout(self) -> LocalModelLayout:
        """This rank's layouts."""
        return local_model_layout(self.table)

    @cached_property
    def info(self) -> ParallelModelInfo:
        """Topology and byte accounting."""
        return parallel_model_info(self.table)


def header_fingerprint(checkpoint: Checkpoint) -> str:
    """sha256 over every tensor's (name, dtype, shape) in name order."""
    return checkpoint.fingerprint()


def _index_beside(checkpoint: Checkpoint) -> str:
    """Why a folder's tensors may be missing: it was read from its single file while an index
    sits beside it ('' otherwise)."""
    if checkpoint.index_path is None and os.path.isdir(checkpoint.path) and os.path.isfile(
            os.path.join(checkpoint.path, "model.safetensors.index.json")):
        return (" (read from model.safetensors: the folder also holds "
                "model.safetensors.index.json, which is ignored when both are present, as "
                "transformers ignores it; pass the index file itself to read the shards)")
    return ""


def check_header(table: RankTable, checkpoint: Checkpoint, *,
                 verify_fingerprint: bool = True) -> list[PartcError]:
    """Every mismatch between the rank's tensors and the checkpoint header: the tensors
    missing or of another dtype or shape, else a fingerprint that differs (whose advice,
    `verify_fingerprint=False`, can only help when every tensor matches)."""
    errors: list[PartcError] = []
    if len(checkpoint.files) == 1:  # a rank file of a `partc shard` set given by itself
        shard = dict(checkpoint.files[0].metadata)
        if "partc_plan_hash" in shard and "partc_rank" in shard:
            return [CheckpointError(
                f"this file is rank {shard['partc_rank']}'s of a `partc shard` set (plan "
                f"{shard['partc_plan_hash'][:16]}), not a checkpoint: pass the set's folder, "
                "whose manifest each rank's load reads its own file from",
                location=SourceLocation(str(checkpoint.path)))]
    rows = table.tensor_rows()
    targets = {row[0] for row in rows}
    rename = renamed_prefix([t for t in targets if t not in checkpoint], checkpoint, targets)
    missing: list[str] = []
    renamed_said = False
    for target, _, dtype, shape, _, _ in rows:
        signature = checkpoint.signature(target)
        if signature is None:
            if rename is not None and target in rename.targets:
                if not renamed_said:  # at the first of them, once
                    errors.extend(renamed_errors(rename, checkpoint))
                    renamed_said = True
                continue
            missing.append(target)
            continue
        header, found_dtype, found_shape = signature
        if found_dtype != dtype:
            errors.append(CheckpointError(
                f"tensor `{target}` has dtype {found_dtype} in the checkpoint; the plan expects "
                f"{dtype}", location=SourceLocation(str(header.path)), tensor=target))
        if tuple(found_shape) != shape:
            errors.append(CheckpointError(
                f"tensor `{target}` has shape {list(found_shape)} in the checkpoint; the plan "
                f"expects {list(shape)}", location=SourceLocation(str(header.path)),
                tensor=target))
    first = min(missing, default="")  # the first reported (errors sort by message) says
    # once the index beside, the other side and the way to a plan of this checkpoint
    for target in missing:
        beside = "" if target != first else _index_beside(checkpoint) + _other_side(
            table, checkpoint, rename)
        errors.append(CheckpointError(
            f"tensor `{target}` of the plan is not in the checkpoint{beside}",
            location=SourceLocation(str(checkpoint.path)), tensor=target))
    if not errors and verify_fingerprint and table.checkpoint_fingerprint is not None:
        mismatch = checkpoint.fingerprint_error(
            table.checkpoint_fingerprint, table.checkpoint_header_digest,
            override="verify_fingerprint=False",
            explain=lambda: _fingerprint_difference(table, checkpoint))
        if mismatch is not None:
            errors.append(mismatch)
    elif not errors and verify_fingerprint and table.plan_tensors is not None:
        mismatch = _names_error(table, checkpoint)
        if mismatch is not None:
            errors.append(mismatch)
    return errors


def _omitted(omit: Iterable[str]) -> Callable[[str], object] | None:
    """A predicate true of the names the family's `omit` globs match (None: no globs)."""
    globs = list(omit)
    if not globs:
        return None
    import fnmatch
    import re

    return re.compile("|".join(fnmatch.translate(glob) for glob in globs)).match


def _names_error(table: RankTable, checkpoint: Checkpoint) -> CheckpointError | None:
    """The error when the checkpoint's tensor names (less the family's `omit` matches) are not
    exactly the plan's, though every tensor of this rank matched: another model's checkpoint
    whose extra tensors (a Qwen3's q_norm under a Llama build) no rank would load, or whose
    missing ones another rank needs, or the checkpoint the plan was compiled for without it
    (DeepSeek-V3's stored MTP layer, which the config alone does not say is there). It names
    the tensors of each side when the build's other rank modules can be imported. A plan
    compiled against a checkpoint checks its fingerprint instead, which covers this."""
    assert table.plan_tensors is not None
    count, digest, omit = table.plan_tensors
    names: Iterable[str] = checkpoint.names
    skip = _omitted(omit)
    if skip is not None:
        names = [n for n in names if skip(n) is None]
    names = sorted(names)  # the plan's digest (Plan.tensor_names_check): one name a line
    if len(names) == count and sha256("\n".join(names).encode()).hexdigest() == digest:
        return None
    plan = _plan_signatures(table)
    if plan is not None:
        said = plan_difference(checkpoint, plan, omit, matched=f": every tensor of rank "
                               f"{table.rank} matches", lacking=" that other ranks load")
    else:
        held = (f"{count} tensors, as the plan has, but under other names"
                if len(names) == count else f"{len(names)} tensors where the plan has {count}")
        said = (f": every tensor of rank {table.rank} matches, but the checkpoint holds {held} "
                "(tensors no rank would load, or ones another rank needs); `partc check FAMILY "
                "--config CONFIG --checkpoint CHECKPOINT` names them")
    return CheckpointError(
        f"the checkpoint is not the one this build's plan describes{said}"
        f"{recompile_hint(table.checkpoint_fingerprint, checkpoint.path, said)}; "
        "verify_fingerprint=False loads this rank anyway",
        location=SourceLocation(str(checkpoint.path)))


def recompile_hint(fingerprint: str | None, checkpoint: str, said: str = "") -> str:
    """'; this build was compiled without --checkpoint ...: compile with --checkpoint PATH'
    for a plan that recorded no checkpoint fingerprint (plan.json `checkpoint_fingerprint`
    null: planned from the config alone), '' for one compiled against a checkpoint or when
    `said` (the message so far) already gives that advice."""
    if fingerprint is not None or "compile with --checkpoint" in said:
        return ""
    return ("; this build was compiled without --checkpoint, so its plan has only the tensors "
            f"the config implies: compile with --checkpoint {checkpoint} to plan for the "
            "tensors this checkpoint holds")


def _other_side(table: RankTable, checkpoint: Checkpoint, rename: PrefixRename | None) -> str:
    """For the first of this rank's tensors the checkpoint lacks: the checkpoint's tensors no
    rank of the plan knows (when the build's rank modules can be imported; less those a
    prefix rename explains), then `recompile_hint` unless a rename's error gives it."""
    omit = tuple(table.plan_tensors[2]) if table.plan_tensors is not None else ()
    plan = _plan_signatures(table)
    extra = [] if plan is None else unknown_names(checkpoint, plan, omit)
    if rename is not None:
        held = {rename.held(t) for t in rename.targets}
        extra = [n for n in extra if n not in held]
    said = f"; the checkpoint {unknown_clause(checkpoint, extra)}" if extra else ""
    if rename is not None:  # its own error already says to compile with --checkpoint
        return said
    return said + recompile_hint(table.checkpoint_fingerprint, checkpoint.path)


_SHOWN = 3
"""How many tensors of each kind of difference a fingerprint mismatch names."""


def _fingerprint_difference(table: RankTable, checkpoint: Checkpoint) -> str:
    """What a checkpoint whose fingerprint is not the plan's holds otherwise (called only once
    the fingerprints differ; this rank's own tensors all matched), as `plan_difference` says
    it. The plan's tensors are those of every rank module of the build package; when they
    cannot all be imported, only the counts are compared."""
    omit = tuple(table.plan_tensors[2]) if table.plan_tensors is not None else ()
    matched = f": every tensor of rank {table.rank} matches"
    plan = _plan_signatures(table)
    if plan is not None:
        return plan_difference(checkpoint, plan, omit, matched=matched,
                               lacking=" that other ranks load")
    if table.plan_tensors is None:
        return ""
    count = table.plan_tensors[0]
    held = len(checkpoint.names) - len(omitted_names(checkpoint, omit))
    what = (f"holds {held} tensors where the plan has {count}" if held != count
            else f"holds {count} tensors, as the plan has, but one differs from another "
                 "rank's by name, dtype or shape")
    return (f"{matched}, but {_checkpoint_file(checkpoint)} {what} (the tables of the build's "
            "other ranks, which name the plan's other tensors, were not found); `partc check "
            "FAMILY --config CONFIG --checkpoint CHECKPOINT` names them")


@dataclass(frozen=True, slots=True)
class PrefixRename:
    """Tensors of the plan that the checkpoint holds under another name prefix: each target
    `expected + rest` is the checkpoint's `found + rest` (a build compiled without the
    checkpoint, so with the family's default prefix, e.g. LLaVA's `vision_tower.` where the
    released checkpoints name `vision_tower.vision_model.`)."""

    expected: str
    """The prefix the build's names start with ('' or ending in `.`)."""
    found: str
    """The prefix the checkpoint holds them under ('' or ending in `.`)."""
    targets: tuple[str, ...]
    """The plan's targets so renamed, sorted."""

    def held(self, target: str) -> str:
        """The checkpoint's name of `target`."""
        return self.found + target[len(self.expected):]


_MINIMUM_RENAMED = 2
"""The fewest missing tensors a prefix substitution is looked for (one missing tensor and one
extra always differ by some prefix: that says nothing)."""


def renamed_prefix(missing: Iterable[str], checkpoint: Checkpoint, known: Container[str]
                   ) -> PrefixRename | None:
    """The prefix substitution (whole dotted components) under which the checkpoint holds
    every one of the plan's `missing` targets (at least _MINIMUM_RENAMED), each under a name
    the plan does not know (`known`: its targets); None when there is none. The shortest such
    prefixes are taken: each candidate keeps the longest suffix the first missing name shares
    with a checkpoint name."""
    names = sorted(set(missing))
    if len(names) < _MINIMUM_RENAMED:
        return None
    first = names[0].split(".")
    candidates: set[tuple[str, str]] = set()
    for name in checkpoint.names:
        parts = name.split(".")
        if parts[-1] != first[-1] or name in known:
            continue
        same = 0
        while same < min(len(parts), len(first)) and parts[-1 - same] == first[-1 - same]:
            same += 1
        expected = ".".join(first[:len(first) - same])
        found = ".".join(parts[:len(parts) - same])
        if expected != found:
            candidates.add((expected + "." if expected else "", found + "." if found else ""))

    def renamed(expected: str, found: str, name: str) -> bool:
        held = found + name[len(expected):]
        return name.startswith(expected) and held in checkpoint and held not in known

    for expected, found in sorted(candidates):
        # the last name first: most candidates (sharing only a last component) fail there
        if renamed(expected, found, names[-1]) and all(
                renamed(expected, found, n) for n in names):
            return PrefixRename(expected=expected, found=found, targets=tuple(names))
    return None


def renamed_hint(rename: PrefixRename, checkpoint: Checkpoint) -> str:
    """The one line saying which prefix the checkpoint uses and how to compile for it."""
    return (f"{_count(list(rename.targets))} of the plan are not in the checkpoint by name: the "
            f"checkpoint names these tensors `{rename.found}…` where the build expects "
            f"`{rename.expected}…` (the first {min(_SHOWN, len(rename.targets))} below); "
            f"compile with --checkpoint {checkpoint.path} so partc picks the checkpoint's "
            "prefix")


def renamed_errors(rename: PrefixRename, checkpoint: Checkpoint) -> list[CheckpointError]:
    """The errors of tensors the checkpoint holds under another prefix: the hint (its message
    begins with the count, so it sorts before the others), then the first _SHOWN of them, each
    with the name the checkpoint holds it under."""
    where = SourceLocation(str(checkpoint.path))
    return [CheckpointError(renamed_hint(rename, checkpoint), location=where)] + [
        CheckpointError(f"tensor `{target}` of the plan is not in the checkpoint, which holds "
                        f"`{rename.held(target)}`", location=where, tensor=target)
        for target in rename.targets[:_SHOWN]]


def plan_difference(checkpoint: Checkpoint, plan: Mapping[str, tuple[str, tuple[int, ...]]],
                    omit: Iterable[str], *, matched: str, lacking: str = "") -> str:
    """What `checkpoint` holds otherwise than `plan` (every tensor of the plan: target ->
    (dtype, global shape)), for the text of a fingerprint mismatch: the plan's tensors it
    lacks, the tensors it holds that the plan does not know (less the family's `omit`
    matches), and those of another dtype or shape, each counted and the first few named, after
    `matched` (what already matched, e.g. ': every tensor of rank 0 matches'; '': nothing is
    said of it). `lacking` follows 'lacks N tensors of the plan' (e.g. ' that other ranks
    load')."""
    omit = tuple(omit)
    file = _checkpoint_file(checkpoint)
    missing = sorted(name for name in plan if name not in checkpoint)
    extra = unknown_names(checkpoint, plan, omit)
    changed = []
    for name in sorted(plan):
        signature = checkpoint.signature(name)
        if signature is None:
            continue
        header, found_dtype, found_shape = signature
        dtype, shape = plan[name]
        if found_dtype != dtype or tuple(found_shape) != tuple(shape):
            changed.append(f"`{name}`{_shard_of(checkpoint, header.path)} is {found_dtype} "
                           f"{list(found_shape)} where the plan expects {dtype} {list(shape)}")
    clauses = []
    rename = renamed_prefix(missing, checkpoint, plan)
    if rename is not None:
        renamed = set(rename.held(n) for n in missing)
        extra = [n for n in extra if n not in renamed]
        clauses.append(f"names {_count(missing)} of the plan{lacking} `{rename.found}…` where "
                       f"the build expects `{rename.expected}…` ("
                       + _listed([f"`{n}` is `{rename.held(n)}`" for n in missing])
                       + f"; compile with --checkpoint {checkpoint.path} so partc picks the "
                       "checkpoint's prefix)")
        missing = []
    if missing:
        clauses.append(f"lacks {_count(missing)} of the plan{lacking} "
                       f"({_listed([f'`{n}`' for n in missing])})")
    if extra:
        clauses.append(unknown_clause(checkpoint, extra))
    if changed:
        clauses.append(f"holds {_count(changed)} in another dtype or shape "
                       f"({_listed(changed)})")
    if not clauses:
        where = (f"the tensors the family omits ({', '.join(f'`{g}`' for g in omit)}), which "
                 "no rank loads" if omit else "tensors the plan does not record")
        return (f"{matched}, and " if matched else ": ") + (
            f"{file} holds every tensor of the plan, in its dtype and shape, and no other: what "
            f"differs is among {where}")
    text = (", ".join(clauses[:-1]) + " and " + clauses[-1]) if len(clauses) > 1 else clauses[0]
    hint = ("; `partc check FAMILY --config CONFIG --checkpoint CHECKPOINT` names them all"
            if max(len(missing), len(extra), len(changed)) > _SHOWN else "")
    return (f"{matched}, but " if matched else ": ") + f"{file} {text}{hint}"


def omitted_names(checkpoint: Checkpoint, omit: Iterable[str]) -> list[str]:
    """The checkpoint's tensor names the family's `omit` globs match, sorted."""
    skip = _omitted(omit)
    return [] if skip is None else [n for n in checkpoint.names if skip(n) is not None]


def unknown_names(checkpoint: Checkpoint, known: Container[str], omit: Iterable[str]
                  ) -> list[str]:
    """The checkpoint's tensor names not in `known` (the plan's) that no `omit` glob matches,
    sorted."""
    skip = _omitted(omit)
    return [n for n in checkpoint.names  # checkpoint.names is sorted
            if n not in known and (skip is None or skip(n) is None)]


def unknown_clause(checkpoint: Checkpoint, names: list[str]) -> str:
    """'holds N tensors the plan does not know[, all under `p.`] (`a`, `b` in <shard file>,
    ...)': the tensors `unknown_names` found (not empty), their common prefix of at least two
    dotted components (an MTP layer's `model.layers.61.`), the first few named with their file
    when there are several files."""
    common = os.path.commonprefix([n.split(".")[:-1] for n in names])
    under = f", all under `{'.'.join(common)}.`" if len(names) > 1 and len(common) > 1 else ""
    return (f"holds {_count(names)} the plan does not know{under} ("
            + _listed([f"`{n}`{_shard_of(checkpoint, _file_of(checkpoint, n))}" for n in names])
            + ")")


def _checkpoint_file(checkpoint: Checkpoint) -> str:
    """The file a message about the checkpoint's header names: its one file, else its index
    (else the folder)."""
    if len(checkpoint.files) == 1:
        return checkpoint.files[0].path
    return checkpoint.index_path or checkpoint.path


def _count(items: list[str]) -> str:
    """'1 tensor', 'N tensors'."""
    return f"{len(items)} tensor{'s' if len(items) != 1 else ''}"


def _listed(items: list[str]) -> str:
    """The first _SHOWN items, then how many more."""
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _file_of(checkpoint: Checkpoint, name: str) -> str:
    """The file of the checkpoint holding tensor `name` (present)."""
    return checkpoint.files[checkpoint.owners[name]].path


def _shard_of(checkpoint: Checkpoint, path: str) -> str:
    """' in <shard file>' for a checkpoint of several files ('' for one file, named once)."""
    return f" in {os.path.basename(path)}" if len(checkpoint.files) > 1 else ""


def _plan_signatures(table: RankTable) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """Every tensor of the plan, target -> (dtype, global shape), from the tables of every rank
    module of the build package that defined `table`; None when that package or one of its
    rank modules cannot be found, or they do not make up the plan's tensors (PLAN_TENSORS).
    Only for an error: it imports the other ranks' modules."""
    import sys
    import types

    module = next((m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)
                   and vars(m).get("_TABLE") is table), None)
    if module is None:
        return None
    package = module.__name__.rpartition(".")[0]
    names = vars(sys.modules[package]).get("RANK_MODULES") if package in sys.modules else None
    if not isinstance(names, tuple):
        return None
    plan: dict[str, tuple[str, tuple[int, ...]]] = {}
    try:
        for name in names:
            other = vars(importlib.import_module("." + name, package)).get("_TABLE")
            if not isinstance(other, RankTable) or other.plan_hash != table.plan_hash:
                return None
            for target, _, dtype, shape, _, _ in other.tensor_rows():
                plan.setdefault(target, (dtype, shape))
    except Exception:  # a rank module missing or broken: the error says less, never fails
        return None
    if table.plan_tensors is not None:
        count, digest = table.plan_tensors[:2]
        targets = sorted(plan)
        if len(targets) != count or sha256("\n".join(targets).encode()).hexdigest() != digest:
            return None
    return plan


def load_rank(table: RankTable, checkpoint: str | os.PathLike[str] | Checkpoint, *,
              verify_fingerprint: bool = True, dtype: Any = None, reader: Any = None,
              framework: str | None = None, workers: int | None = None,
              progress: bool | None = None, verify: str | None = None,
              zero_copy: bool | str = False, local_ranks: int | None = None,
              device: Any = None, staging_bytes: int | None = None,
              max_fetch_ratio: float | None = None, **unknown: Any) -> RankState:
    """Check the checkpoint header against the plan, then read only this rank's slices.

    A generated rank module's `load(checkpoint, **options)` and its build package's
    `load(checkpoint, rank=None, **options)` call this with the rank's table; every keyword
    option below is an option of those `load()`s. An option `load` does not have is refused
    with a CheckpointError naming the option it resembles.

    Args:
        table: The rank's decoded tables (the generated rank module passes its own).
        checkpoint: A model folder (model.safetensors or its index), a file, an opened
            Checkpoint, or a folder written by `partc shard` for this plan (its rank file is
            read whole).
        verify_fingerprint: Compare the checkpoint's header with the fingerprint compiled into
            the build (the names, shapes and dtypes the plan was made for); False skips only
            that comparison, every tensor is still checked against the plan.
        dtype: Convert every floating tensor (bf16/fp8 included) after reading, e.g.
            `np.float32`; integer and packed tensors are left alone. None keeps the stored
            dtypes. Refused (CheckpointError) when the rank holds a quantized linear weight
            (block FP8 with its scales, MLX affine, MXFP4): partc does not dequantize.
        reader: An object with a `record(path, offset, length)` method
            (`partc.runtime.ReadRecorder`), told of every byte run read.
        framework: "numpy" (the default) returns numpy arrays; "torch" returns torch tensors
            sharing the numpy memory (docs/torch.md).
        workers: The most reader threads (None: sized from the machine and `local_ranks`).
        progress: Show a progress bar of the bytes read; None shows it on a terminal only.
        verify: "digest" checks the sha256 of every tensor read against the shard manifest (a
            `partc shard` folder) or the digests compiled into the build (`--digests`); None
            checks none.
        zero_copy: True returns every tensor whose local slice is one contiguous byte run of
            its file (whole tensors, row slices; every tensor of a `partc shard` folder), or
            one strided column range, as a read-only view of the mapped file, and copies the
            rest; "private" maps the files copy-on-write instead and returns the one-run
            tensors as writable views (a write goes to a private page, never to the file;
            torch tensors can be made from them) and copies the rest, column slices included.
            In both zero-copy modes the copies are made by numpy from the mapping (docs/using.md
            for lifetime, memory accounting and the SIGBUS a file truncated meanwhile can
            raise, during the load too). False reads every tensor into new memory.
        local_ranks: The number of ranks loading on this node at once, which sizes the reader
            threads (None: `PARTC_LOCAL_RANKS`, else torchrun's `LOCAL_WORLD_SIZE`, else 1);
            with more than one, cold column slices are read through the page cache, whole
            rows at a time, so the node fetches each byte once (a rank alone reads its own
            sectors with O_DIRECT).
        device: Put the tensors on a torch device (implies `framework="torch"`; docs/torch.md):
            'cpu', 'cuda', 'cuda:N' or a torch.device. None with framework="torch" means
            `cuda:LOCAL_RANK` when torch sees a GPU, else the CPU.
        staging_bytes: The size of the host ring a GPU load stages through (None: 64 MiB,
            pinned, two buffers for each reader thread, `workers`); a GPU load never holds
            the shard in host memory, and `verify="digest"` hashes the blocks as they pass
            through the ring.
        max_fetch_ratio: The most bytes read from the checkpoint files over the rank's share
            (a number >= 1; None: `PARTC_MAX_FETCH_RATIO`, else no cap). Without a cap the
            read planner (`partc.runtime.read_planner`) reads column slices as whole row blocks
            wherever its storage model says that is faster (cold: on the project's disk,
            always); 1.0 reads exactly the share's byte runs (O_DIRECT sectors when cold).
            Network storage that bills bytes wants a cap.
        **unknown: Refused: any other keyword is an unknown option.

    Returns:
        The rank's RankState: its tensors by target name, its layout and its info.

    Raises:
        LaunchError: An argument of this call is wrong (a keyword option of the wrong type or
            value, or one it does not have; the checkpoint no path; the rank or device), or
            the launcher's environment is (a CheckpointError too, for callers that catch that).
        CheckpointError: The checkpoint does not match the plan or cannot be read (several
            problems: PartcErrors).
    """
    if unknown:
        raise _unknown_option(sorted(unknown))
    _check_checkpoint(checkpoint)
    options = LoadOptions.from_keywords(
        verify_fingerprint=verify_fingerprint, dtype=dtype, reader=reader, framework=framework,
        workers=workers, progress=progress, verify=verify, zero_copy=zero_copy,
        local_ranks=local_ranks, device=device, staging_bytes=staging_bytes,
        max_fetch_ratio=max_fetch_ratio)
    return _load(table, checkpoint, options)


def _load(table: RankTable, checkpoint: str | os.PathLike[str] | Checkpoint,
          options: LoadOptions) -> RankState:
    """`load_rank` once its options are checked."""
    staged = None
    if not options.host_numpy:  # imported only here: its torch and CUDA machinery costs
        from partc.runtime.device import load_target  # every import otherwise

        staged = load_target(options)
    target_dtype, digest = options.dtype, options.verify is Verify.DIGEST
    if target_dtype is not None:
        encoded = quantized_tensor(table)
        if encoded is not None:
            raise CheckpointError(
                f"load(dtype={np.dtype(target_dtype).name}) would convert `{encoded[0]}`, stored "
                f"{encoded[1]}, without applying {encoded[2]}: wrong weights; partc does not "
                "dequantize. Load without dtype= (the stored encoding, scales included) and "
                "dequantize with the format's own kernel (docs/linear_formats.md)",
                tensor=encoded[0])
    selections = tensor_selections(table)
    manifest = None if isinstance(checkpoint, Checkpoint) else read_shard_manifest(checkpoint)
    recorded = _recorded_digests(table, manifest, checkpoint) if digest else None
    if manifest is not None:
        opened = _open_presharded(table, manifest, local_model_layout(table))
        requests = [(target, TensorSelection()) for target, _, _ in selections]
    else:
        opened = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(
            checkpoint)
        raise_if_any(check_header(table, opened, verify_fingerprint=options.verify_fingerprint))
        requests = _requests(selections)
    total = sum(nbytes for _, _, nbytes in selections)
    if staged is not None:
        from partc.runtime.device import convert_on_device, stage_to_device

        found: dict[str, str] | None = {} if digest else None
        with progress_bar(total, f"rank {table.rank}", options.progress) as update:
            on_device = stage_to_device(opened, requests, staged,
                                        staging_bytes=options.staging_bytes, progress=update,
                                        digests=found, workers=options.workers,
                                        local_ranks=options.local_ranks)[0]
        if recorded is not None and found is not None:
            _verify_payloads(recorded, opened, on_device, options.workers, found=found)
        return RankState(tensors=convert_on_device(on_device, target_dtype), table=table)
    # a torch load without dtype= reads bf16/fp8 as their bits and views them as torch's
    # dtype: it never imports ml_dtypes (6-10 ms a process)
    torch = options.framework is Framework.TORCH
    as_bits = torch and target_dtype is None
    with progress_bar(total, f"rank {table.rank}", options.progress) as update:
        tensors = read_tensors(opened, requests, ReadOptions(
            recorder=options.reader, workers=options.workers, local_ranks=options.local_ranks,
            zero_copy=options.zero_copy, bits=as_bits, progress=update,
            max_fetch_ratio=options.max_fetch_ratio))
    if recorded is not None:
        _verify_payloads(recorded, opened, tensors, options.workers)
    if target_dtype is not None:
        for name, array in tensors.items():  # one tensor at a time: the original is freed
            if array.dtype in FLOAT_DTYPES and array.dtype != target_dtype:
                tensors[name] = array.astype(target_dtype)
    if torch:
        tensors = to_torch(tensors, _stored_bits(opened, tensors) if as_bits else None)
    return RankState(tensors=tensors, table=table)


_FP8 = ("F8_E4M3", "F8_E5M2")


def quantized_tensor(table: RankTable) -> tuple[str, str, str] | None:
    """The first of the rank's tensors stored in a quantized linear format (docs/
    linear_formats.md), as (target, how it is stored, what decodes it), or None: block FP8
    (an F8 weight with its `weight_scale_inv` / `weight_scale`), MLX affine (a U32 weight with
    its `scales`), MXFP4 (U8 `X_blocks` with `X_scales`). A dtype= conversion would widen or
    keep their stored values without these companions."""
    rows = {row[0]: row[2] for row in table.tensor_rows()}
    for target in sorted(rows):
        dtype = rows[target]
        stem = target.removesuffix(".weight")
        if dtype in _FP8:
            for scale in (f"{target}_scale_inv", f"{target}_scale"):
                if scale in rows:
                    return target, f"as {dtype}", f"its block scales `{scale}`"
        elif dtype == "U32" and target.endswith(".weight") and f"{stem}.scales" in rows:
            return (target, "packed as MLX affine U32", f"its group scales and biases "
                    f"`{stem}.scales`, `{stem}.biases`")
        elif dtype == "U8" and target.endswith("_blocks") and \
                f"{target.removesuffix('_blocks')}_scales" in rows:
            return (target, "as MXFP4 U8 blocks", f"its scales "
                    f"`{target.removesuffix('_blocks')}_scales`")
    return None


def _requests(selections: list[tuple[str, Selection, int]]
              ) -> list[tuple[str, TensorSelection]]:
    """(target, TensorSelection) of every selection of `tensor_selections`, which hands the
    tensors of one structure one selection tuple: each gets one TensorSelection, built once.
    A frozen dataclass costs ~0.5 us to build: one a tensor was ~0.07 ms of a 165-tensor
    zero-copy load (issue 18), and the reader works out each distinct selection once."""
    made: dict[int, TensorSelection] = {}  # by id: `selections` keeps each tuple alive
    requests = []
    for target, selection, _ in selections:
        request = made.get(id(selection))
        if request is None:
            request = made[id(selection)] = TensorSelection(*selection)
        requests.append((target, request))
    return requests


def _stored_bits(opened: Checkpoint, tensors: Mapping[str, np.ndarray[Any, Any]]
                 ) -> dict[str, str]:
    """Tensor name -> safetensors dtype, for the tensors read as the bits of a dtype numpy lacks
    (`BIT_DTYPES`): the unsigned-integer arrays, told apart from U8/U16 by their header."""
    out = {}
    for name, array in tensors.items():
        if array.dtype.kind == "u":
            found = opened.signature(name)
            if found is not None and found[1] in ML_DTYPES:
                out[name] = found[1]
    return out


def _unknown_option(names: list[str]) -> LaunchError:
    """The refusal of keyword options `load` does not have, each with the option it resembles
    (a misspelt option would otherwise be a TypeError naming `load_rank`). The options are read
    from `load_rank`'s signature, so the list cannot drift from it."""
    import difflib  # only for the suggestion of an error
    import inspect

    options = [p.name for p in inspect.signature(load_rank).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
    spelled = []
    for name in names:
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        spelled.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return option_error(f"load() has no option{'s' if len(names) > 1 else ''} "
                        f"{', '.join(spelled)}; its options are rank, {', '.join(options)}")


def _check_checkpoint(checkpoint: object) -> None:
    """Refuse, before anything is opened, a checkpoint that is no path, naming the value found
    and what it must be."""
    if not isinstance(checkpoint, Checkpoint) and not isinstance(path_text(checkpoint), str):
        raise option_error(
            "checkpoint must be a folder or file path (a str or an os.PathLike giving one) or "
            f"an opened Checkpoint, found {type(checkpoint).__name__} {checkpoint!r:.80}"
            + ("; decode a bytes path with os.fsdecode()" if isinstance(path_text(checkpoint),
                                                                         bytes) else ""))


def _recorded_digests(table: RankTable, manifest: ShardManifest | None,
                      checkpoint: str | os.PathLike[str] | Checkpoint
                      ) -> tuple[dict[str, str], str]:
    """The digests `verify="digest"` checks the rank's tensors against (the shard manifest's,
    else the build's) and where they come from; a CheckpointError, before anything is read,
    when neither records them."""
    expected = None if manifest is None else manifest.rank_digests(table.rank)
    source = f"the shard manifest {manifest.path}" if manifest is not None else ""
    if expected is None and table.digests is not None:
        expected = compiled_digests(table.rank, table.targets, table.digests)
        source = "the build's plan"
    if expected is None:
        where = "its shard manifest records none (cut by an older partc: run `partc shard` " \
            "again)" if manifest is not None else "this build was compiled without digests"
        path = (manifest.path if manifest is not None else checkpoint.path
                if isinstance(checkpoint, Checkpoint) else spelled(checkpoint))
        raise CheckpointError(f"verify='digest' needs recorded digests, but {where}; compile "
                              "with `partc compile ... --checkpoint DIR --digests`, or load a "
                              "folder written by `partc shard`",
                              location=SourceLocation(str(path)))
    return expected, source


def _verify_payloads(recorded: tuple[dict[str, str], str], opened: Checkpoint,
                     tensors: Mapping[str, Any], workers: int | None, *,
                     found: Mapping[str, str] | None = None) -> None:
    """Check every tensor read against its `recorded` digest (see `_recorded_digests`);
    `found`: the digests already taken (a device load hashes its staging blocks)."""
    expected, source = recorded
    files = {}
    for name in tensors:
        signature = opened.signature(name)
        files[name] = signature[0].path if signature is not None else opened.path
    if found is not None:
        check_digests(list(tensors), found, expected, files, source)
    else:
        verify_digests(tensors, expected, files, source, workers)


def _open_presharded(table: RankTable, manifest: ShardManifest, layout: LocalModelLayout
                     ) -> Checkpoint:
    """The rank's file of a `partc shard` folder, checked against the plan before any read."""
    where = SourceLocation(str(manifest.path))
    if manifest.plan_hash != table.plan_hash:
        raise CheckpointError(
            f"pre-sharded checkpoint was cut for plan {manifest.plan_hash[:16]}, this loader is "
            f"plan {table.plan_hash[:16]}; run `partc shard` again for this build",
            location=where)
    opened = open_checkpoint(manifest.rank_file(table.rank))
    errors = _rank_file_identity(table, opened)
    expected = {item.target for item in layout.tensors}
    for extra in sorted(set(opened.names) - expected):
        errors.append(CheckpointError(f"tensor `{extra}` in the rank file is not one of rank "
                                      f"{table.rank}'s tensors", location=where, tensor=extra))
    for item in layout.tensors:
        target, dtype, shape = item.target, item.dtype, item.local_shape
        if target not in opened:
            errors.append(CheckpointError(f"tensor `{target}` of the plan is not in the rank "
                                          "file", location=where, tensor=target))
            continue
        header, entry = opened.tensor(target)
        if entry.dtype != dtype or tuple(entry.shape) != shape:
            errors.append(CheckpointError(
                f"tensor `{target}` is {entry.dtype} {list(entry.shape)} in the rank file; the "
                f"plan expects {dtype} {list(shape)}", location=SourceLocation(str(header.path)),
                tensor=target))
    raise_if_any(errors)
    return opened


def _rank_file_identity(table: RankTable, opened: Checkpoint) -> list[PartcError]:
    """The rank file's own record of what it holds (`partc_rank`, `partc_plan_hash` in its
    header metadata) checked against the rank asked for: a renamed or swapped file raises at
    once (its names and shapes may all match another rank's); metadata missing (a file
    re-saved by other tools) is reported with the other mismatches."""
    header = opened.files[0]
    where = SourceLocation(str(header.path))
    metadata = dict(header.metadata)
    found_rank, found_hash = metadata.get("partc_rank"), metadata.get("partc_plan_hash")
    if found_rank is not None and found_rank != str(table.rank):
        raise CheckpointError(
            f"the rank file holds rank {found_rank}'s tensors (its metadata partc_rank is "
            f"{found_rank!r}), but rank {table.rank} was asked for; the files of the shard set "
            f"were renamed or swapped: run `partc shard` again", location=where)
    if found_hash is not None and found_hash != table.plan_hash:
        raise CheckpointError(
            f"the rank file was cut for plan {found_hash[:16]} (its metadata partc_plan_hash), "
            f"this loader is plan {table.plan_hash[:16]}; run `partc shard` again for this "
            "build", location=where)
    missing = [key for key, value in (("partc_rank", found_rank),
                                      ("partc_plan_hash", found_hash)) if value is None]
    if not missing:
        return []
    return [CheckpointError(
        f"the rank file's header metadata has no {' or '.join(missing)}; expected partc_rank "
        f"{str(table.rank)!r} and the partc_plan_hash of plan {table.plan_hash[:16]}, as "
        "`partc shard` writes them (a file re-saved by another tool?)", location=where)]


def package_rank_module(package: str, modules: tuple[str, ...], rank: int | None = None) -> Any:
    """The generated module of `rank` in a build package (default: the rank under torchrun)."""
    world_size = len(modules)
    if rank is None:
        rank = rank_from_environment(world_size, package_factors(package))
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise LaunchError(f"rank must be an integer, found {rank!r}")
    if not 0 <= rank < world_size:
        raise rank_out_of_range(rank, world_size)
    return importlib.import_module("." + modules[rank], package)


def load_package_rank(package: str, modules: tuple[str, ...], checkpoint: Any,
                      rank: int | None = None, **options: Any) -> RankState:
    """`load` of a build package: the rank module's `load(checkpoint, **options)`.

    Args:
        package: The build package's import name.
        modules: The rank modules of the package, indexed by global rank.
        checkpoint: What `load_rank` reads (a model folder, a file, an opened Checkpoint or
            a `partc shard` folder).
        rank: The global rank to load; None: this process's rank under torchrun (`RANK`,
            checked against `WORLD_SIZE` and the build's factors).
        **options: `load_rank`'s keyword options (`dtype`, `framework`, `device`,
            `zero_copy`, ...).

    Returns:
        The rank's RankState.
    """
    state: RankState = package_rank_module(package, modules, rank).load(checkpoint, **options)
    return state
