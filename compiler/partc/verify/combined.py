"""One build checked at the whole topology the user asks for (`verify --tp T --pp S [--ep E]`):
each stage's modules split over that stage's T ranks, each stage's experts over its E x X
ranks through the expert map, and the stage hand-offs of the same build.

A rank of a T x S (x E x X) build holds only its stage's tensors. Each checked module is run
on the stage that executes it (its unit's stage, or its static role's, as the pipeline check
places it) and the claim of `TensorParallelRanks` is made over that stage's first dense replica
(T ranks); the other dense replicas of the stage (N / T of them under expert parallelism)
must hold the same elements. Under expert parallelism the routed experts are whole in that
claim (so an MoE block's router and shared experts are checked split over T), and each
stage's experts modules are the claim of `ExpertParallelRanks` over the stage's N ranks.
Then `pipeline_checks` runs on the same build: ownership, cuts, model inputs, and the logits
of the model assembled from every stage's gathered tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partc.verify.expert_checks import ExpertParallelRanks
from partc.verify.modules import TensorParallelRanks
from partc.verify.results import Check
from partc.verify.session import Build, Session
from partc.verify.stage_checks import module_stages, pipeline_checks

if TYPE_CHECKING:
    from partc.verify.mtp import MtpSession


def _expert_targets(build: Build) -> frozenset[str]:
    """The on-disk tensors of an expert-parallel build's expert groups (none without EP)."""
    experts = build.file.expert_parallel
    return frozenset(
        layout.target for state in build.states for layout in state.layout.tensors
        if experts is not None and layout.logical_name in experts.expert_groups)


def _held(build: Build) -> list[set[str]]:
    """The on-disk tensors each stage's ranks hold."""
    return [{t for r in build.stage_ranks(s) for t in build.states[r].layout.targets}
            for s in range(build.pp)]


def mtp_checks(mtp: MtpSession, build: Build, *, experts: bool = True,
               modules: bool = True) -> list[Check]:
    """The MTP layers' modules checked like a decoder layer's, on the stage holding them
    (`modules`: the tensor-parallel claim over its T ranks; `experts`: under expert
    parallelism, its experts over its N ranks); none when no rank loads an MTP tensor (the
    run notes it)."""
    held = _held(build)
    stage = next((s for s, mine in enumerate(held) if any(n in mine for n in mtp.names)), None)
    if stage is None:
        return []
    checks: list[Check] = []
    if modules:
        ranks = TensorParallelRanks(mtp, build, stage, whole=_expert_targets(build))
        checks.extend(ranks.check(module) for module in mtp.modules)
    if experts and build.file.expert_parallel is not None:
        checks.extend(ExpertParallelRanks(mtp, build, stage).checks())
    return checks


def topology_checks(session: Session, build: Build, mtp: MtpSession | None = None
                    ) -> list[Check]:
    """Every check of `build` at its own topology: per stage, the load, the tensor-parallel
    decomposition of each module it runs and (under expert parallelism) its experts; the MTP
    layers' (`mtp`) on their stage; then the pipeline checks of the build."""
    stages_of = module_stages(session, build.file)
    experts = build.file.expert_parallel
    expert_targets = _expert_targets(build)
    held = _held(build)
    checks: list[Check] = []
    for stage in range(build.pp):
        mine = [m for m in session.modules if stage in (stages_of.get(m) or (0,))]
        ranks = TensorParallelRanks(session, build, stage, whole=expert_targets)
        checks.extend(ranks.load_checks())
        for module in mine:
            elsewhere = [t for t in session.targets(module) if t not in held[stage]
                         and any(t in other for other in held)]
            if not elsewhere:  # else the stage does not own it: the ownership check says so
                checks.append(ranks.check(module))
        if experts is not None:
            checks.extend(ExpertParallelRanks(session, build, stage, mine).checks())
    if mtp is not None:
        checks.extend(mtp_checks(mtp, build))
    checks.extend(pipeline_checks(session, build))
    return checks
