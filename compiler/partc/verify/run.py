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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partc.api import (
    StageUnits,
    bind,
    plan_family,
    spelled_stage_units,
    stage_topology,
    topology_errors,
)
from partc.errors import PartcError, PartcErrors, SourceLocation, VerifyError, raise_if_any
from partc.plan.topology import Topology
from partc.verify.budget import DEFAULT_MEMORY_BUDGET, within_budget
from partc.verify.combined import mtp_checks, topology_checks
from partc.verify.expert_checks import ExpertParallelRanks
from partc.verify.modules import TensorParallelRanks
from partc.verify.mtp import MtpSession, add_mtp_layers, keep_mtp, mtp_layers
from partc.verify.quantized import StoredReference, stored_reference
from partc.verify.reference import build_reference, load_config, require_libraries
from partc.verify.results import Check, VerifyReport, topology_name
from partc.verify.session import Build, ExpertTopology, Session, compile_build
from partc.verify.shrink import family_sizes, reference_config
from partc.verify.stage_checks import pipeline_checks, unexercised_boundaries

if TYPE_CHECKING:
    from partc.parallel.specs import ShardingPolicy
    from partc.plan.ir import Plan
    from partc.plan.plan_records import PlanFile

MAX_TENSOR_PARALLEL = 8
"""By default every T from 1 to this that compiles is checked."""


def verify_family(family: str | Path | None, config: str | Path, *,
                  tensor_parallel_sizes: Sequence[int] | None = None,
                  pipeline_parallel_size: int | None = None, stage_units: StageUnits = None,
                  policy: ShardingPolicy | None = None, seed: int = 0,
                  experts: ExpertTopology | None = None, combined: bool = False,
                  memory_budget: int = DEFAULT_MEMORY_BUDGET) -> VerifyReport:
    """Verify a family's split against transformers' modeling code for `config`'s architecture.

    `tensor_parallel_sizes`: the T to check (default: every T up to 8 that compiles, the others
    reported as skipped); `pipeline_parallel_size`: the S of the pipeline check (default 2, or
    the number of units if smaller, or of `stage_units`; 1 skips it); `stage_units`: where
    the pipeline check cuts, as `compile_family` takes it (default balanced; a large config is
    then shrunk keeping its layers, which the counts name). Raises a VerifyError when torch or
    transformers is missing or the model cannot be built. `experts`: the expert parallelism
    checked too (`--ep`), at each T that divides its E x X ranks (`ExpertParallelRanks`).
    `memory_budget`: bytes the run may need (`partc.verify.budget`); a reference model whose
    estimate exceeds it is refused, a VerifyError, before it is built.

    `combined` (with S > 1): one build per T at the whole topology T x S (x E x X), every check
    made on it (`topology_checks`), instead of the tensor-parallel (and expert) checks at S = 1
    and the pipeline check at T = 1.
    """
    require_libraries()
    if stage_units and pipeline_parallel_size is None:
        pipeline_parallel_size = len(stage_units)
    user = checked_config(family, Path(config), tensor_parallel_sizes, pipeline_parallel_size,
                          policy, stage_units, combined=combined, experts=experts)
    combined = combined and user.pipeline_parallel_size > 1
    reference, notes = reference_config(
        user.data, tensor_parallel_size=max(user.tensor_parallel_sizes, default=1),
        pipeline_parallel_size=user.pipeline_parallel_size,
        keep_layers=user.stage_units is not None, sizes=user.sizes)
    keep_mtp(user.data, reference, notes)
    notes.append(within_budget(reference, _ranks(user, experts), memory_budget, notes,
                               SourceLocation(str(config))))
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="partc-verify-") as scratch:
        work = Path(scratch)
        folder = work / "reference"
        session, stored = _reference_session(reference, folder, work, seed, Path(config),
                                             user.data, notes)
        mtp = MtpSession(session, reference) if mtp_layers(reference) else None
        seconds["reference"] = time.perf_counter() - start
        run = _Run(family=family, folder=folder, work=work, policy=policy, session=session,
                   mtp=mtp, stored=stored, notes=notes, seconds=seconds)
        if combined:
            run.whole_topologies(user, experts)
        else:
            run.separate_topologies(user, experts)
    seconds["total"] = time.perf_counter() - start
    return VerifyReport(family=run.family_name or user.family, model_type=user.model_type,
                        checks=tuple(run.checks), skipped=user.skipped, notes=tuple(notes),
                        seconds=seconds, stage_units=spelled_stage_units(user.stage_units)
                        if user.stage_units else None,
                        plans=tuple(run.plans), pipeline_cuts=tuple(run.cuts))


@dataclass(kw_only=True)
class _Run:
    """The builds of one verify run and what their checks found."""

    family: str | Path | None
    folder: Path
    """The reference checkpoint."""
    work: Path
    policy: ShardingPolicy | None
    session: Session
    mtp: MtpSession | None
    """The MTP layers of the reference model, if it has any."""
    stored: StoredReference | None
    """The reference re-stored in the config's quantized format, if it names one."""
    notes: list[str]
    seconds: dict[str, float]
    checks: list[Check] = field(default_factory=list)
    plans: list[PlanFile] = field(default_factory=list)
    """The builds' plans, read back."""
    cuts: list[dict[str, object]] = field(default_factory=list)
    """Each cut checked, as the report lists them."""
    family_name: str = ""

    def _built(self, build: Build) -> None:
        self.family_name = self.family_name or build.file.family
        self.plans.append(build.file)
        if self.mtp is not None and not any(n in state.layout for state in build.states
                                             for n in self.mtp.names):
            note = (f"the {self.family_name} build loads none of the reference checkpoint's "
                    "MTP layers: they were not checked")
            if note not in self.notes:
                self.notes.append(note)

    def _stored_checks(self, build: Build, checks: Sequence[Check]) -> None:
        """`checks` after the build's storage checks, less the loader faults those report."""
        self.checks.extend(build.stored_checks)
        decoded = {(c.rank, c.module) for c in build.stored_checks}
        self.checks.extend(c for c in checks
                           if c.kind != "load" or (c.rank, c.module) not in decoded)

    def whole_topologies(self, user: CheckedConfig, experts: ExpertTopology | None) -> None:
        """One build per T at T x S (x E x X), every check made on it."""
        pp = user.pipeline_parallel_size
        suffix = "" if experts is None else \
            f"_ep{experts.expert_parallel_size}_etp{experts.expert_tensor_parallel_size}"
        for tp in user.tensor_parallel_sizes:
            begin = time.perf_counter()
            try:
                build = compile_build(self.family, self.folder, self.work / f"tp{tp}_pp{pp}"
                                      f"{suffix}", tp, pp, self.policy, user.stage_units,
                                      experts=experts, stored=self.stored)
            except PartcError as error:
                self.checks.append(_not_compiled(tp, pp, error, self.notes, experts))
                continue
            self._built(build)
            self._stored_checks(build, topology_checks(self.session, build, self.mtp))
            self.cuts.append(_cut_entry((tp,), pp, build.file, given=bool(user.stage_units)))
            self.notes.append(_cut_note(self.cuts[-1], whole=True))
            self.seconds[f"tp{tp}_pp{pp}" + suffix] = time.perf_counter() - begin
        missed = unexercised_boundaries(self.plans)
        if missed is not None:
            self.notes.append(missed)

    def separate_topologies(self, user: CheckedConfig, experts: ExpertTopology | None) -> None:
        """The tensor-parallel checks at each T x 1, the expert checks at each T x 1 x E x X
        and the pipeline check at 1 x S (at each cut a T chooses)."""
        family, folder, work, policy = self.family, self.folder, self.work, self.policy
        for tp in user.tensor_parallel_sizes:
            begin = time.perf_counter()
            try:
                build = compile_build(family, folder, work / f"tp{tp}", tp, 1, policy,
                                      stored=self.stored)
            except PartcError as error:
                self.checks.append(_not_compiled(tp, 1, error, self.notes))
                continue
            self._built(build)
            ranks = TensorParallelRanks(self.session, build)
            self._stored_checks(build, ranks.load_checks())
            self.checks.extend(ranks.check(module) for module in self.session.modules)
            if self.mtp is not None:
                self.checks.extend(mtp_checks(self.mtp, build, experts=False))
            self.seconds[f"tp{tp}"] = time.perf_counter() - begin
        if experts is not None:
            begin = time.perf_counter()
            self.checks.extend(_expert_checks(family, folder, work, user.tensor_parallel_sizes,
                                              policy, experts, self.session, self.notes,
                                              self.mtp, self.stored))
            self.seconds["ep"] = time.perf_counter() - begin
        pp = user.pipeline_parallel_size
        if pp == 1:
            return
        begin = time.perf_counter()
        staged_plans: list[PlanFile] = []
        asked = ([(user.tensor_parallel_sizes, user.stage_units)] if user.stage_units
                 else asked_cuts(family, folder, user.tensor_parallel_sizes, pp, policy))
        for index, (sizes, units) in enumerate(asked):
            try:
                staged = compile_build(family, folder, work / f"pp{pp}_{index}", 1, pp,
                                       policy, units, stored=self.stored)
                self._built(staged)
                self.checks.extend(staged.stored_checks)
                self.checks.extend(pipeline_checks(self.session, staged))
                staged_plans.append(staged.file)
                self.cuts.append(_cut_entry(sizes, pp, staged.file,
                                            given=bool(user.stage_units)))
                self.notes.append(_cut_note(self.cuts[-1]))
            except PartcError as error:
                self.checks.append(_not_compiled(1, pp, error, self.notes))
        missed = unexercised_boundaries(staged_plans)
        if missed is not None:
            self.notes.append(missed)
        self.seconds[f"pp{pp}"] = time.perf_counter() - begin


def _expert_checks(family: str | Path | None, folder: Path, work: Path,
                   tensor_parallel_sizes: Sequence[int], policy: ShardingPolicy | None,
                   experts: ExpertTopology, session: Session, notes: list[str],
                   mtp: MtpSession | None = None, stored: StoredReference | None = None
                   ) -> list[Check]:
    """The expert-parallel checks at each T of `tensor_parallel_sizes` that divides the E x X
    ranks of a stage (the others noted); a build that does not compile is a failed check."""
    ep, etp = experts.expert_parallel_size, experts.expert_tensor_parallel_size
    ranks = ep * etp
    sizes = [tp for tp in tensor_parallel_sizes if ranks % tp == 0]
    left = [tp for tp in tensor_parallel_sizes if ranks % tp]
    if left:
        notes.append(f"expert parallelism EP={ep} x ETP={etp} not checked at T="
                     f"{', '.join(map(str, left))}: T must divide the {ranks} ranks of a stage")
    if not sizes:
        return [Check(tp=min(tensor_parallel_sizes, default=1), pp=1, module="", group="",
                      rank=None, ok=False, max_error=float("inf"), tolerance=0.0, ep=ep,
                      etp=etp, kind="compile",
                      message=f"EP={ep} x ETP={etp}: no T checked divides the {ranks} ranks of "
                              "a stage; give one with --tp")]
    checks: list[Check] = []
    for tp in sizes:
        try:
            build = compile_build(family, folder, work / f"tp{tp}_ep{ep}_etp{etp}", tp, 1,
                                  policy, experts=experts, stored=stored)
        except PartcError as error:
            checks.append(_not_compiled(tp, 1, error, notes, experts))
            continue
        checks.extend(build.stored_checks)
        checks.extend(ExpertParallelRanks(session, build).checks())
        if mtp is not None:
            checks.extend(mtp_checks(mtp, build, modules=False))
    return checks


StageLayout = tuple[tuple[tuple[str, int], ...], ...]
"""Each pipeline stage's (execution group, units) runs, as `compile_family` takes them."""


def _layout(ranks: Iterable[tuple[int, Iterable[tuple[str, Sequence[int]]]]]) -> StageLayout:
    """The stage units of a plan's ranks, each given as (pipeline stage, its partition's
    (group, unit range) parts); the ranks of one stage hold the same parts."""
    stages: dict[int, tuple[tuple[str, int], ...]] = {}
    for stage, parts in ranks:
        if stage not in stages:
            stages[stage] = tuple((group, end - begin) for group, (begin, end) in parts)
    return tuple(stages[stage] for stage in sorted(stages))


def stage_layout(plan: Plan) -> StageLayout:
    """The stage units compile chose for `plan`."""
    return _layout((rank.pipeline_stage, ((part.group, part.unit_range)
                                          for part in rank.partition.groups))
                   for rank in plan.ranks)


def asked_cuts(family: str | Path | None, reference: Path, tensor_parallel_sizes: Sequence[int],
               pipeline_parallel_size: int, policy: ShardingPolicy | None
               ) -> list[tuple[tuple[int, ...], StageUnits]]:
    """The stage units compile chooses for the reference build at each T x S (T of
    `tensor_parallel_sizes`), each distinct one once with the T that choose it, in T order.

    Compile balances the stages' bytes *per rank*, so a T can cut elsewhere than T=1 does (a
    vision-language model after its tower at T=2, after the projector at T=1); the pipeline
    check (itself at T=1) is run at each of these cuts. A T that does not compile at S is left
    out; when none compiles, the balanced cut at T=1 (None)."""
    chosen: dict[StageLayout, list[int]] = {}
    for tp in tensor_parallel_sizes:
        try:
            plan = plan_family(family, reference / "config.json", Topology(
                tensor_parallel_size=tp, pipeline_parallel_size=pipeline_parallel_size,
                policy=policy), checkpoint=reference)
        except PartcError:
            continue
        chosen.setdefault(stage_layout(plan), []).append(tp)
    if not chosen:
        return [((1,), None)]
    return [(tuple(sizes), layout) for layout, sizes in chosen.items()]


def _cut_entry(sizes: Sequence[int], pp: int, plan: PlanFile, *, given: bool
               ) -> dict[str, object]:
    """Which cut the pipeline check checked (the report's `pipeline_cuts` entry): the T whose
    compile chooses it (or `--pp-layers`), its stage units, and each cut's stage and group."""
    units = _layout((rank.pipeline_stage, ((u.group, (u.start, u.end)) for u in rank.units))
                    for rank in plan.ranks)
    return {"tensor_parallel_sizes": list(sizes), "pipeline_parallel_size": pp,
            "given": given, "stage_units": spelled_stage_units(units),
            "cuts": [{"after_stage": c.after_stage, "group": c.group}
                     for c in plan.pipeline_cuts()]}


def _cut_note(entry: dict[str, object], *, whole: bool = False) -> str:
    """The report's note on a cut the pipeline check checked (`whole`: on the build of the
    whole topology)."""
    sizes = entry["tensor_parallel_sizes"]
    assert isinstance(sizes, list)
    cuts = entry["cuts"]
    assert isinstance(cuts, list)
    where = ", ".join(f"after stage {c['after_stage']} in `{c['group']}`" for c in cuts)
    spelled = ", ".join(f"T={tp}" for tp in sizes)
    why = ("as --pp-layers asks" if entry["given"]
           else f"the cut compile chooses at {spelled} x S={entry['pipeline_parallel_size']}")
    if whole:
        return f"the {spelled} x S={entry['pipeline_parallel_size']} build cut " \
               f"{entry['stage_units']} ({where}): {why}"
    return (f"the pipeline check (at T=1) cut {entry['stage_units']} ({where}): {why}")


def _not_compiled(tp: int, pp: int, error: PartcError, notes: list[str],
                  experts: ExpertTopology | None = None) -> Check:
    """A failed check: the reference model does not compile at a topology the user's config
    compiles at (its shrunk sizes are too small for it)."""
    first = error.errors[0] if isinstance(error, PartcErrors) else error
    shrunk = " (shrunk as the notes say)" if any(n.startswith("shrunk") for n in notes) else ""
    ep = None if experts is None else experts.expert_parallel_size
    etp = None if experts is None else experts.expert_tensor_parallel_size
    return Check(tp=tp, pp=pp, ep=ep, etp=etp, module="", group="", rank=None, ok=False,
                 max_error=float("inf"), tolerance=0.0, kind="compile",
                 message=f"{topology_name(tp, pp, ep, etp)}: the config compiles here but the "
                         f"reference model built from it{shrunk} does not: {first.message}")


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
    sizes: dict[str, tuple[str, ...]]
    """The family's `int` config fields and their sources (`family_sizes`)."""


def checked_config(family: str | Path | None, config: Path,
                   tensor_parallel_sizes: Sequence[int] | None = None,
                   pipeline_parallel_size: int | None = None,
                   policy: ShardingPolicy | None = None,
                   stage_units: StageUnits = None, *, combined: bool = False,
                   experts: ExpertTopology | None = None) -> CheckedConfig:
    """The user's config.json, checked as `partc check --config` checks it before any model
    is built: read by partc's front end (duplicate keys refused), the family (the built-in one
    of its `model_type` by default) loaded and validated, and bound to it, with the meaning of
    every field it reads checked; each error names the user's files.

    Then each topology is realized for the config itself, as `check --tp T` / `--pp S` does: a
    size given that does not compile is an error (all of them raised together); by default
    (every T up to 8, S = 2) one that does not compile is skipped, with its first error.
    `stage_units` (the pipeline check's cut) is realized at T=1 x S, an error when it does not
    compile. `combined` (S > 1): each T is realized at T x S (x E x X of `experts`) instead,
    as one build; when none of the default T compiles there, the first one's errors are
    raised.
    """
    bound, decl, _ = bind(family, config)  # raises every binding error, in the user's files
    data: dict[str, Any] = load_config(config).data
    skipped: list[dict[str, object]] = []
    errors: list[PartcError] = []
    counts, layout = stage_topology(stage_units)

    def compiles(tp: int, pp: int, given: bool, experts: ExpertTopology | None = None) -> bool:
        staged = pp > 1
        try:  # the sizes themselves may not fit (T not dividing E x X)
            topology = Topology(
                tensor_parallel_size=tp, pipeline_parallel_size=pp, policy=policy,
                stage_units=counts if staged else None, stage_layout=layout if staged else None,
                expert_parallel_size=experts.expert_parallel_size if experts else None,
                expert_tensor_parallel_size=experts.expert_tensor_parallel_size if experts
                else 1)
        except PartcError as error:
            found = [error]
        else:
            found = topology_errors(bound, decl, topology)
        if found and given:
            errors.extend(found)
        elif found:
            where = topology_name(tp, pp, *((experts.expert_parallel_size,
                                             experts.expert_tensor_parallel_size)
                                            if experts else ()))
            skipped.append({"tp": tp, "pp": pp, "reason": f"the config does not compile at "
                            f"{where}: {min(found, key=PartcError.sort_key)}"})
        return not found

    stages = pipeline_parallel_size or 2
    candidates = tensor_parallel_sizes or range(1, MAX_TENSOR_PARALLEL + 1)
    if combined and stages > 1:
        sizes = tuple(tp for tp in candidates
                      if compiles(tp, stages, tensor_parallel_sizes is not None, experts))
        if not sizes and not errors:
            compiles(candidates[0], stages, True, experts)
        raise_if_any(errors)
        return CheckedConfig(data=data, family=bound.family, model_type=bound.model_type,
                             tensor_parallel_sizes=sizes, pipeline_parallel_size=stages,
                             stage_units=stage_units, skipped=tuple(skipped),
                             sizes=family_sizes(decl.config))
    sizes = tuple(tp for tp in candidates if compiles(tp, 1, tensor_parallel_sizes is not None))
    if stages == 1:
        skipped.append({"tp": 1, "pp": 1, "reason": "no pipeline split asked for (S=1)",
                        "check": "pipeline"})
    elif not compiles(1, stages, pipeline_parallel_size is not None or bool(stage_units)):
        stages = 1
    raise_if_any(errors)
    return CheckedConfig(data=data, family=bound.family, model_type=bound.model_type,
                         tensor_parallel_sizes=sizes, pipeline_parallel_size=stages,
                         stage_units=stage_units if stages > 1 else None,
                         skipped=tuple(skipped), sizes=family_sizes(decl.config))


def _ranks(user: CheckedConfig, experts: ExpertTopology | None) -> int:
    """The ranks of the largest build the run loads at once (an expert build: its E x X)."""
    ep = experts.expert_parallel_size * experts.expert_tensor_parallel_size if experts else 1
    return max(max(user.tensor_parallel_sizes, default=1), ep, user.pipeline_parallel_size)


def _reference_session(reference: dict[str, Any], folder: Path, work: Path, seed: int,
                       config: Path, user: dict[str, Any], notes: list[str]
                       ) -> tuple[Session, StoredReference | None]:
    """The reference model built and run once, and re-stored in the storage format the
    user's config names, if any (`partc.verify.quantized`: the model run is then the decoded
    one); a VerifyError at the user's config when transformers builds a model of it that it
    cannot run."""
    build_reference(reference, folder, seed, SourceLocation(str(config)))
    add_mtp_layers(reference, folder, seed)
    stored = stored_reference(user, folder, work, notes)
    try:
        return Session(folder, work, seed), stored
    except RuntimeError as error:  # torch: the config's sizes do not fit each other
        raise VerifyError(f"transformers cannot run the `{reference['model_type']}` model "
                          f"built from the config: {error}",
                          location=SourceLocation(str(config))) from None
