"""The pipeline of stages as one call: load, schema, family, bind, plan, emit."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from partc.bind.binder import BoundArchitecture, bind_family
from partc.errors import (
    ArchitectureParameterError,
    CheckpointError,
    LoadError,
    PartcError,
    PartcErrors,
    SourceLocation,
    raise_if_any,
)
from partc.family.build import build_family
from partc.family.declaration import FamilyDecl
from partc.front.extend import FamilySources, extended_document
from partc.front.load import (
    MAX_CONFIG_BYTES,
    RawDocument,
    decode_text,
    load_document,
    parse_json,
    read_bytes,
)
from partc.front.schema import validate_document
from partc.library import (
    BUILTIN_PREFIX,
    builtin_families,
    family_for_config,
    family_spec_is_file,
    read_family_source,
)
from partc.parallel.specs import TensorSplit
from partc.partition.boundary import PipelineActivationDtype
from partc.partition.ownership import GroupParallelMode
from partc.plan.expert_placement import (
    model_expert_count,
    placement_byte_limit,
    placement_from_document,
)
from partc.plan.ir import Plan
from partc.plan.ranks import GroupSite
from partc.plan.realize import realize_plan
from partc.plan.topology import Topology

if TYPE_CHECKING:
    from partc.parallel.specs import ShardingPolicy
    from partc.plan.stage_balance import StageLayout
    from partc.runtime.checkpoint import Checkpoint
    from partc.runtime.progress import ProgressCallback

StageUnits = Sequence[int] | Sequence[Sequence[tuple[str, int]]] | None
"""The stages' units as `compile_family` takes them: one unit count per stage (`3,5,4`), or per
stage its (execution group, units) runs (`vision*3|decoder*2`); None: balanced."""


_FAMILY_SOURCES = FamilySources(
    read=lambda spec, builtin: read_family_source(spec, builtin=builtin),
    is_file=family_spec_is_file, builtin_names=builtin_families, builtin_prefix=BUILTIN_PREFIX)
"""Where `extends:` reads base families: the family library."""


def load_family(spec: str | Path, *, builtin: bool = False) -> tuple[FamilyDecl, str]:
    """Load, schema-check and build a family; returns it with the sha256 of its text.

    `builtin`: `spec` is a model type naming a built-in family, never a file.
    """
    label, text = read_family_source(spec, builtin=builtin)
    document, digest = family_document(label, text)
    raise_if_any(validate_document(document))
    family, errors = build_family(document)
    raise_if_any(errors)
    assert family is not None
    return family, digest


def family_document(label: str, text: str) -> tuple[RawDocument, str]:
    """The loaded family document (written over the families it `extends`) and its sha256:
    of the text alone, or, for an extending family, of its text and every base's."""
    document, texts = extended_document(load_document(label, text=text), _FAMILY_SOURCES)
    digest = hashlib.sha256(text.encode())
    for base_text in texts:  # an extending family is identified by every file it reads
        digest.update(b"\0" + base_text.encode())
    return document, digest.hexdigest()


@dataclass(frozen=True, slots=True)
class CompileResult:
    """The plan of a compile, the rendered files and where they were written."""

    plan: Plan
    """The plan IR."""
    files: dict[str, str] = field(repr=False)
    """Rendered files by relative path."""
    out: Path | None
    """Output folder (None when nothing was written)."""


def _step(progress: ProgressCallback | None, step: str) -> Callable[[int, int], None] | None:
    """`progress` for one named step, as the stages call it: `(done, total)`."""
    if progress is None:
        return None
    report = progress

    def tick(done: int, total: int) -> None:
        report(step, done, total)
    return tick


def bind(family: str | Path | None, config: str | Path, checkpoint: Checkpoint | None = None,
         *, progress: ProgressCallback | None = None
         ) -> tuple[BoundArchitecture, FamilyDecl, tuple[tuple[str, str], ...]]:
    """Load a family (default: the built-in one for the config) and bind it to `config`.

    With `checkpoint`, config fields that probe the checkpoint (`present`) see its tensor names;
    `progress` hears of the group declarations bound (step `bind groups`).
    """
    raw = read_bytes(config, "config.json", MAX_CONFIG_BYTES)  # read once: parsed and hashed
    config_doc = parse_json(str(config), decode_text(raw, str(config), "config.json"),
                            "config.json")
    spec = family if family is not None else family_for_config(config_doc)
    decl, family_hash = load_family(spec, builtin=family is None)
    bound = bind_family(decl, config_doc,
                        None if checkpoint is None else frozenset(checkpoint.names),
                        progress=_step(progress, "bind groups"))
    config_hash = hashlib.sha256(raw).hexdigest()
    is_file = family is not None and family_spec_is_file(family)
    label = Path(str(spec)).name if is_file else f"{decl.name} (built-in)"
    sources = tuple(sorted([(label, family_hash), (Path(config).name, config_hash)]))
    return bound, decl, sources


def _locator(decl: FamilyDecl, bound: BoundArchitecture) -> GroupSite:
    pointers = dict(bound.group_pointers)

    def locate(group: str) -> tuple[SourceLocation, str] | None:
        pointer = pointers.get(group)
        return None if pointer is None else (decl.document.locate(pointer), pointer)
    return locate


def stage_topology(stage_units: StageUnits) -> tuple[tuple[int, ...] | None, StageLayout | None]:
    """`stage_units` as `compile_family` takes it (one unit count per stage, or per stage its
    (execution group, units) runs) as Topology's `stage_units` and `stage_layout`."""
    if not stage_units:
        return None, None
    first = next(iter(stage_units))
    if isinstance(first, int):
        return tuple(int(n) for n in stage_units), None  # type: ignore[arg-type]
    return None, tuple(tuple((str(g), int(n)) for g, n in runs)  # type: ignore[union-attr]
                       for runs in stage_units)


def spelled_stage_units(stage_units: StageUnits) -> str:
    """`stage_units` as --pp-layers spells them: `3,5,4`, or `vision*3|decoder*2`."""
    counts, layout = stage_topology(stage_units)
    if counts is not None:
        return ",".join(map(str, counts))
    return "|".join(",".join(f"{g}*{n}" for g, n in runs) for runs in layout or ())


def topology_errors(bound: BoundArchitecture, decl: FamilyDecl,
                    topology: Topology) -> list[PartcError]:
    """Every error realizing `bound` (of family `decl`) for `topology`, located as `check`
    locates them; [] when it compiles there."""
    try:
        realize_plan(bound, topology, group_location=_locator(decl, bound))
    except PartcErrors as many:
        return list(many.errors)
    except PartcError as one:
        return [one]
    return []


def with_expert_placement(topology: Topology, bound: BoundArchitecture,
                          placement: str | Path | None) -> Topology:
    """`topology` with the explicit expert placement of file `placement` (JSON, `{"ranks":
    [[global expert ids of EP rank 0], ...]}`; docs/expert_parallel.md), checked against the
    model's experts; `topology` itself when `placement` is None."""
    if placement is None:
        return topology
    if topology.expert_parallel_size is None:
        raise LoadError(f"--expert-placement {placement} needs --ep (the expert-parallel size)")
    experts = model_expert_count(bound)
    raw = read_bytes(placement, "expert placement file", placement_byte_limit(
        experts, topology.expert_parallel_size))
    document = parse_json(str(placement), decode_text(raw, str(placement),
                                                      "expert placement file"),
                          "expert placement file")
    return replace(topology, expert_placement=placement_from_document(
        document.data, experts, topology.expert_parallel_size,
        file=str(placement), locate=document.locate))


def plan_family(family: str | Path | None, config: str | Path, topology: Topology, *,
                checkpoint: str | Path | None = None,
                progress: ProgressCallback | None = None,
                expert_placement: str | Path | None = None) -> Plan:
    """Bind and realize a family for `topology`; with `checkpoint`, also fingerprint its header.

    `progress` hears of the steps `bind groups` and `realize groups`. `expert_placement` is a
    placement file (`with_expert_placement`) for an expert-parallel topology.
    """
    opened = None
    if checkpoint is not None:
        from partc.runtime.checkpoint import open_checkpoint

        opened = open_checkpoint(Path(checkpoint))
    bound, decl, sources = bind(family, config, opened, progress=progress)
    topology = with_expert_placement(topology, bound, expert_placement)
    fingerprint = digest = None
    omitted: tuple[str, ...] = ()
    if opened is not None:
        omitted = bound.omitted(opened.names)
        from partc.runtime.loader import header_fingerprint

        raise_if_any(checkpoint_errors(bound, opened, _locator(decl, bound)))
        fingerprint, digest = header_fingerprint(opened), opened.header_digest()
    return realize_plan(bound, topology, sources=sources, checkpoint_fingerprint=fingerprint,
                        checkpoint_header_digest=digest,
                        group_location=_locator(decl, bound), omitted=omitted,
                        omit=tuple(bound.omit),
                        progress=_step(progress, "realize groups"))


def checkpoint_errors(bound: BoundArchitecture, checkpoint: Checkpoint,
                      locate: GroupSite | None = None) -> list[PartcError]:
    """Ownership gaps and name/dtype/shape mismatches between a family and a checkpoint; a
    tensor the family declares but the checkpoint lacks is located at its group's declaration
    (by `locate`), with the unowned checkpoint name it most resembles."""
    present = set(checkpoint.names) - set(bound.omitted(checkpoint.names))
    group_of = {t: owned.group.name for owned in bound.description.groups
                for t in owned.group.targets}
    unowned = sorted(present - set(group_of))
    errors: list[PartcError] = []
    for error in bound.description.check_targets(present):
        group = group_of.get(error.tensor or "")
        if error.location is not None:
            errors.append(error)
        elif group is not None and locate is not None:  # declared, not in the file
            import difflib

            close = difflib.get_close_matches(error.tensor or "", unowned, n=1, cutoff=0.8)
            site = locate(group)
            message = (f"{error.message} (group `{group}`)"
                       + (f"; did you mean `{close[0]}`?" if close else ""))
            errors.append(ArchitectureParameterError(
                error.kind, message, group=group, tensor=error.tensor,
                location=None if site is None else site[0],
                pointer="" if site is None else site[1]))
        else:  # an ownership gap is about the checkpoint: name its file
            errors.append(error.located(_tensor_file(checkpoint, error)))
    for owned in bound.description.groups:
        declared = ""  # where to fix it: the group's declaration in the family file
        for member in owned.group.members:
            signature = checkpoint.signature(member.target)
            if signature is None:
                continue
            header, dtype, shape = signature
            if (dtype != member.dtype or tuple(shape) != member.shape) and not declared:
                site = locate(owned.group.name) if locate is not None else None
                declared = (f" (group `{owned.group.name}`"
                            + (f", declared at {site[0]})" if site is not None else ")"))
            if dtype != member.dtype:
                errors.append(CheckpointError(
                    f"tensor `{member.target}` is {dtype} in the checkpoint; the family "
                    f"declares {member.dtype}{declared}",
                    location=SourceLocation(str(header.path)), tensor=member.target))
            if tuple(shape) != member.shape:
                errors.append(CheckpointError(
                    f"tensor `{member.target}` has shape {list(shape)} in the checkpoint; "
                    f"the family declares {list(member.shape)}{declared}",
                    location=SourceLocation(str(header.path)), tensor=member.target))
    return sorted(errors, key=lambda e: (e.tensor or "", e.message))


def _tensor_file(checkpoint: Checkpoint, error: PartcError) -> SourceLocation:
    """The checkpoint file holding the tensor `error` is about (the checkpoint without one)."""
    owner = checkpoint.owners.get(error.tensor or "")
    return SourceLocation(str(checkpoint.files[owner].path if owner is not None
                              else checkpoint.path))


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileOptions:
    """How `compile_family` realizes and writes a build: everything but the topology's sizes.

    Built values are checked: `policy`, `activation_dtype` and `split` are held as their enums
    (a name is accepted and converted), and `digests` needs a `checkpoint`.
    """

    out: str | Path | None = None
    """Where to write the build (None: render only, `CompileResult.files`)."""
    force: bool = False
    """Replace a non-build `out` (`partc.output.write_atomically`'s `force`)."""
    checkpoint: str | Path | None = None
    """A checkpoint to check against and fingerprint (and digest, with `digests`)."""
    digests: bool = False
    """Record the sha256 of every rank-local tensor, for `load(..., verify="digest")`."""
    stage_units: StageUnits = None
    """One unit count per stage, or per stage its (execution group, units) runs
    (`plan.stage_balance`); None: the topology's (balanced unless it gives them)."""
    group_modes: Sequence[tuple[str, GroupParallelMode]] | None = None
    """Parallel mode per execution group, overriding the family's `parallel:` (None: the
    topology's)."""
    policy: ShardingPolicy | str | None = None
    """Sharding policy override, or its name (`replicate-unsupported`); None: the topology's."""
    activation_dtype: PipelineActivationDtype | str | None = None
    """Dtype on the pipeline wire, or its name; None: the topology's (the model's own)."""
    split: TensorSplit | str | None = None
    """How uneven splits give out the remainder: "balanced" (the first n mod T ranks get one
    more) or "chunk" (torch.chunk's rule, which DTensor's Shard follows; docs/torch.md); None:
    the topology's."""
    expert_placement: str | Path | None = None
    """A placement file for an expert-parallel topology (docs/expert_parallel.md)."""
    progress: ProgressCallback | None = None
    """Hears of each step: `bind groups`, `realize groups`, `render modules`, `write files`
    (`partc.runtime.progress.ProgressCallback`); it never changes what is written."""

    def __post_init__(self) -> None:
        from partc.parallel.specs import ShardingPolicy

        dtype, policy, split = self.activation_dtype, self.policy, self.split
        try:
            dtype = None if dtype is None else PipelineActivationDtype(dtype)
        except ValueError:
            raise LoadError(f"activation dtype must be one of "
                            f"{', '.join(d.value for d in PipelineActivationDtype)}, found "
                            f"{dtype!r}") from None
        if isinstance(policy, str) and not isinstance(policy, ShardingPolicy):
            try:  # "replicate-unsupported", as the CLI spells it, or its value
                policy = ShardingPolicy(policy.replace("-", "_"))
            except ValueError:
                raise LoadError(f"policy must be one of "
                                f"{', '.join(p.value.replace('_', '-') for p in ShardingPolicy)} "
                                f"(or a partc.ShardingPolicy), found {policy!r}") from None
        elif policy is not None and not isinstance(policy, ShardingPolicy):
            raise LoadError(f"policy must be a partc.ShardingPolicy or its name, found {policy!r}")
        try:
            split = None if split is None else TensorSplit(split)
        except ValueError:
            raise LoadError(f"split must be one of {', '.join(s.value for s in TensorSplit)}, "
                            f"found {split!r}") from None
        object.__setattr__(self, "activation_dtype", dtype)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "split", split)
        if self.digests and self.checkpoint is None:
            raise LoadError("digests need a checkpoint to read: pass --checkpoint DIR with "
                            "--digests")

    def realized(self, topology: Topology) -> Topology:
        """`topology` with the options that shape its realization (those given) applied."""
        given: dict[str, object] = {
            "policy": self.policy, "activation_dtype": self.activation_dtype,
            "split": self.split,
            "group_modes": None if self.group_modes is None else tuple(self.group_modes)}
        if self.stage_units:
            given["stage_units"], given["stage_layout"] = stage_topology(self.stage_units)
        return replace(topology, **{k: v for k, v in given.items()  # type: ignore[arg-type]
                                    if v is not None})


def compile_family(family: str | Path | None, config: str | Path,
                   topology: Topology | None = None,
                   options: CompileOptions | None = None) -> CompileResult:
    """Compile a family for a model config and `topology` (default 1 x 1); write the build to
    `options.out` if given.

    `options` (`CompileOptions`) holds the rest: output, checkpoint and digests, and the stage
    units, group modes, policy, activation dtype and split, which override the topology's when
    given. Expert parallelism is the topology's: a stage has E x X ranks, the experts placed
    balanced or by the placement file `options.expert_placement` (docs/expert_parallel.md).
    Raises a PartcError (PartcErrors when several were found) and writes nothing on failure.
    """
    from partc.emit.render import render_package
    from partc.output import check_output, write_atomically

    options = CompileOptions() if options is None else options
    topology = options.realized(Topology() if topology is None else topology)
    checkpoint, out, progress = options.checkpoint, options.out, options.progress
    expert_placement, digests = options.expert_placement, options.digests
    plan = plan_family(family, config, topology, checkpoint=checkpoint, progress=progress,
                       expert_placement=expert_placement)
    inputs = ([("checkpoint", checkpoint)] if checkpoint else []) + [("config file", config)]
    if expert_placement is not None:
        inputs.append(("expert placement file", expert_placement))
    if family is not None and Path(family).is_file():
        inputs.append(("family file", family))
    if out is not None:
        check_output(out, kind="build", inputs=inputs, force=options.force)
    if digests:
        from partc.runtime.checkpoint import open_checkpoint
        from partc.runtime.digests import plan_digests

        assert checkpoint is not None
        recorded = plan_digests([rank.layout for rank in plan.ranks],
                                open_checkpoint(Path(checkpoint)),
                                progress=_step(progress, "digest ranks"))
        plan = replace(plan, payload_digests=recorded)
    files = render_package(plan, progress=_step(progress, "render modules"))
    written = None
    if out is not None:
        write_atomically(Path(out), _counted(files, _step(progress, "write files")),
                         kind="build", inputs=inputs, force=options.force)
        written = Path(out)
    return CompileResult(plan=plan, files=files, out=written)


def _counted(files: dict[str, str], tick: Callable[[int, int], None] | None
             ) -> dict[str, str | Callable[[BinaryIO], None]]:
    """`files` as `write_atomically` takes them, each calling `tick(done, total)` once written
    (the same UTF-8 bytes `write_atomically` writes for a text)."""
    if tick is None:
        return dict(files)
    report = tick
    total = len(files)

    def writer(text: str, done: int) -> Callable[[BinaryIO], None]:
        def write(handle: BinaryIO) -> None:
            handle.write(text.encode("utf-8"))
            report(done, total)
        return write
    report(0, total)
    return {path: writer(text, done) for done, (path, text) in enumerate(files.items(), 1)}


def check_family(family: str | Path | None, config: str | Path | None = None,
                 checkpoint: str | Path | None = None, *,
                 topology: Topology | None = None,
                 progress: ProgressCallback | None = None,
                 expert_placement: str | Path | None = None) -> list[PartcError]:
    """Validate a family (and, given them, its binding, a plan and a checkpoint); all errors.

    `progress` hears of the steps `bind groups` and (with `topology`) `realize groups`.
    `expert_placement`: a placement file for an expert-parallel `topology`.
    """
    errors: list[PartcError] = []
    try:
        if config is None:
            if family is None:
                raise LoadError("check needs a family or a config")
            load_family(family)
            return errors
        opened = None
        if checkpoint is not None:
            from partc.runtime.checkpoint import open_checkpoint

            opened = open_checkpoint(Path(checkpoint))
        bound, decl, _ = bind(family, config, opened, progress=progress)
        if opened is not None:
            errors.extend(checkpoint_errors(bound, opened, _locator(decl, bound)))
        if topology is not None:
            realize_plan(bound, with_expert_placement(topology, bound, expert_placement),
                         group_location=_locator(decl, bound),
                         progress=_step(progress, "realize groups"))
    except PartcErrors as many:
        errors.extend(many.errors)
    except PartcError as one:
        errors.append(one)
    return errors
