"""`verify_family`: the ranks' parts of every module must add up to the full module's output.

For each tensor-parallel size T the family is compiled for the reference checkpoint, every rank
is loaded with its generated loader, and each rank's tensors are scattered back into an
otherwise-zeroed copy of the checkpoint (under the on-disk names, so transformers applies its
own on-disk to in-memory conversion when it loads it). Every module that owns parameters (the
direct children of each layer of every ModuleList, however nested: decoder layers, vision
layers; the embeddings, norms, projector and head) is run on the inputs captured from the full
model (token ids, and an image for a vision-language model):

- a module whose tensors are whole on every rank must give the full output on every rank;
- otherwise the ranks' outputs, less T - 1 times the output of the *shared part* (the module
  with only the elements every rank holds), must add up to the full output. Subtracting the
  shared part counts replicated parts once (a row projection's bias, a replicated router)
  without classifying any tensor by name or role.

A failing module is narrowed to the first parameter group that fails alone (the other groups
whole) and then to the first rank whose part is not separable (that rank plus the union of the
others, less the shared part). For a pipeline split each stage must own every tensor it
executes (the module of unit i on the stage of unit i, a static role's modules on the stage
its declared placement in plan.json puts it, a tied embedding on the first and last), every cut
of plan.json's `cuts` must carry tensors of its declared boundary shapes, and the model
assembled from the stages' tensors must give the full model's logits.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partc.api import StageUnits, bind, spelled_stage_units, stage_topology, topology_errors
from partc.errors import PartcError, PartcErrors, SourceLocation
from partc.plan.topology import Topology
from partc.verify.modules import TensorParallelRanks
from partc.verify.pipeline import pipeline_checks, unexercised_boundaries
from partc.verify.reference import (
    VerifyError,
    build_reference,
    load_config,
    reference_config,
    require_libraries,
)
from partc.verify.report import Check, VerifyReport
from partc.verify.session import Session, compile_build

if TYPE_CHECKING:
    from partc.parallel.specs import ShardingPolicy

MAX_TENSOR_PARALLEL = 8
"""By default every T from 1 to this that compiles is checked."""


def verify_family(family: str | Path | None, config: str | Path, *,
                  tensor_parallel_sizes: Sequence[int] | None = None,
                  pipeline_parallel_size: int | None = None, stage_units: StageUnits = None,
                  policy: ShardingPolicy | None = None, seed: int = 0) -> VerifyReport:
    """Verify a family's split against transformers' modeling code for `config`'s architecture.

    `tensor_parallel_sizes`: the T to check (default: every T up to 8 that compiles, the others
    reported as skipped); `pipeline_parallel_size`: the S of the pipeline check (default 2, or
    the number of units if smaller, or of `stage_units`; 1 skips it); `stage_units`: where
    the pipeline check cuts, as `compile_family` takes it (default balanced; a large config is
    then shrunk keeping its layers, which the counts name). Raises a VerifyError when torch or
    transformers is missing or the model cannot be built.
    """
    require_libraries()
    if stage_units and pipeline_parallel_size is None:
        pipeline_parallel_size = len(stage_units)
    user = checked_config(family, Path(config), tensor_parallel_sizes, pipeline_parallel_size,
                          policy, stage_units)
    reference, notes = reference_config(
        user.data, tensor_parallel_size=max(user.tensor_parallel_sizes, default=1),
        pipeline_parallel_size=user.pipeline_parallel_size,
        keep_layers=user.stage_units is not None)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="partc-verify-") as scratch:
        work = Path(scratch)
        folder = work / "reference"
        session = _reference_session(reference, folder, work, seed, Path(config))
        seconds["reference"] = time.perf_counter() - start
        checks: list[Check] = []
        plans: list[dict[str, Any]] = []  # the builds' plan.json documents
        family_name = ""
        for tp in user.tensor_parallel_sizes:
            begin = time.perf_counter()
            try:
                build = compile_build(family, folder, work / f"tp{tp}", tp, 1, policy)
            except PartcError as error:
                checks.append(_not_compiled(tp, 1, error, notes))
                continue
            family_name = build.plan["family"]
            plans.append(build.plan)
            ranks = TensorParallelRanks(session, build)
            checks.extend(Check(
                tp=tp, pp=1, module=target, group="", rank=rank, ok=False,
                max_error=float("inf"), tolerance=0.0,
                message=f"T={tp} x S=1: rank {rank}'s loader read `{target}` bytes that differ "
                        "from the checkpoint's") for rank, target in ranks.loader_faults)
            checks.extend(ranks.check(module) for module in session.modules)
            seconds[f"tp{tp}"] = time.perf_counter() - begin
        pp = user.pipeline_parallel_size
        if pp > 1:
            begin = time.perf_counter()
            try:
                staged = compile_build(family, folder, work / f"pp{pp}", 1, pp, policy,
                                       user.stage_units)
                plans.append(staged.plan)
                checks.extend(pipeline_checks(session, staged))
                missed = unexercised_boundaries(staged.plan)
                if missed is not None:
                    notes.append(missed)
                family_name = family_name or staged.plan["family"]
            except PartcError as error:
                checks.append(_not_compiled(1, pp, error, notes))
            seconds[f"pp{pp}"] = time.perf_counter() - begin
    seconds["total"] = time.perf_counter() - start
    return VerifyReport(family=family_name or user.family, model_type=user.model_type,
                        checks=tuple(checks), skipped=user.skipped, notes=tuple(notes),
                        seconds=seconds, stage_units=spelled_stage_units(user.stage_units)
                        if user.stage_units else None,
                        plans=tuple(plans))


def _not_compiled(tp: int, pp: int, error: PartcError, notes: list[str]) -> Check:
    """A failed check: the reference model does not compile at a topology the user's config
    compiles at (its shrunk sizes are too small for it)."""
    first = error.errors[0] if isinstance(error, PartcErrors) else error
    shrunk = " (shrunk as the notes say)" if any(n.startswith("shrunk") for n in notes) else ""
    return Check(tp=tp, pp=pp, module="", group="", rank=None, ok=False,
                 max_error=float("inf"), tolerance=0.0,
                 message=f"T={tp} x S={pp}: the config compiles here but the reference model "
                         f"built from it{shrunk} does not: {first.message}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckedConfig:
    """The user's config as `partc check` reads it, and the topologies verify checks it at."""

    data: dict[str, Any]
    """config.json's fields."""
    family: str
    """The bound family's name."""
    model_type: str
    """The config's `model_type`."""
    tensor_parallel_sizes: tuple[int, ...]
    """The T the config compiles at (each checked)."""
    pipeline_parallel_size: int
    """The S of the pipeline check (1: none)."""
    stage_units: StageUnits
    """Where the pipeline check cuts (None: balanced)."""
    skipped: tuple[dict[str, object], ...]
    """The topologies not checked, each with the reason."""


def checked_config(family: str | Path | None, config: Path,
                   tensor_parallel_sizes: Sequence[int] | None = None,
                   pipeline_parallel_size: int | None = None,
                   policy: ShardingPolicy | None = None,
                   stage_units: StageUnits = None) -> CheckedConfig:
    """The user's config.json, checked as `partc check --config` checks it before any model
    is built: read by partc's front end (duplicate keys refused), the family (the built-in one
    of its `model_type` by default) loaded and validated, and bound to it, with the meaning of
    every field it reads checked; each error names the user's files.

    Then each topology is realized for the config itself, as `check --tp T` / `--pp S` does: a
    size given that does not compile is an error (all of them raised together); by default
    (every T up to 8, S = 2) one that does not compile is skipped, with its first error.
    `stage_units` (the pipeline check's cut) is realized at T=1 x S, an error when it does not
    compile.
    """
    bound, decl, _ = bind(family, config)  # raises every binding error, in the user's files
    data: dict[str, Any] = load_config(config).data
    skipped: list[dict[str, object]] = []
    errors: list[PartcError] = []
    counts, layout = stage_topology(stage_units)

    def compiles(tp: int, pp: int, given: bool) -> bool:
        staged = pp > 1
        found = topology_errors(bound, decl, Topology(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, policy=policy,
            stage_units=counts if staged else None, stage_layout=layout if staged else None))
        if found and given:
            errors.extend(found)
        elif found:
            skipped.append({"tp": tp, "pp": pp, "reason": f"the config does not compile at "
                            f"T={tp} x S={pp}: {min(found, key=PartcError.sort_key)}"})
        return not found

    sizes = tuple(tp for tp in tensor_parallel_sizes or range(1, MAX_TENSOR_PARALLEL + 1)
                  if compiles(tp, 1, tensor_parallel_sizes is not None))
    stages = pipeline_parallel_size or 2
    if stages == 1:
        skipped.append({"tp": 1, "pp": 1, "reason": "no pipeline split asked for (S=1)",
                        "check": "pipeline"})
    elif not compiles(1, stages, pipeline_parallel_size is not None or bool(stage_units)):
        stages = 1
    if errors:
        raise errors[0] if len(errors) == 1 else PartcErrors(errors)
    return CheckedConfig(data=data, family=bound.family, model_type=bound.model_type,
                         tensor_parallel_sizes=sizes, pipeline_parallel_size=stages,
                         stage_units=stage_units if stages > 1 else None,
                         skipped=tuple(skipped))


def _reference_session(reference: dict[str, Any], folder: Path, work: Path, seed: int,
                       config: Path) -> Session:
    """The reference model built and run once; a VerifyError at the user's config when
    transformers builds a model of it that it cannot run."""
    build_reference(reference, folder, seed, SourceLocation(str(config)))
    try:
        return Session(folder, work, seed)
    except RuntimeError as error:  # torch: the config's sizes do not fit each other
        raise VerifyError(f"transformers cannot run the `{reference['model_type']}` model "
                          f"built from the config: {error}",
                          location=SourceLocation(str(config))) from None
