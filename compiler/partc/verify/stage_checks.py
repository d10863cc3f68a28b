"""The pipeline checks of `partc verify`: each stage owns every tensor it executes, each cut
carries its declared boundary's shapes, and the stages' tensors give the full logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.verify.arrays import scatter
from partc.verify.results import Check, topology_name
from partc.verify.session import Build, Session, first_tensor, largest_error, tolerance_of

if TYPE_CHECKING:
    from partc.plan.plan_records import PlanFile


def _unit_stages(plan: PlanFile) -> dict[str, int]:
    """Unit path -> the pipeline stage executing it, from plan.json."""
    paths = {g.group: g.unit_paths for g in plan.graph}
    stages = {}
    for rank in plan.ranks:
        for owned in rank.units:
            for unit in range(owned.start, owned.end):
                stages[paths[owned.group][unit]] = rank.pipeline_stage
    return stages


def _role_stages(plan: PlanFile, units: dict[str, int]) -> dict[str, int]:
    """Static role -> the stage its declared placement puts it on: `first` stage 0, `last` the
    last stage, `{with: group, unit: first|last}` the stage of that unit of the group (from
    plan.json's `static_roles` and unit ranges, not from the ranks' own role lists)."""
    last = plan.shape.pipeline_parallel_size - 1
    paths = {g.group: g.unit_paths for g in plan.graph}
    stages = {}
    for role in plan.static_roles:
        if role.with_group is not None:
            group = paths[role.with_group]
            stages[role.role] = units[group[0 if role.unit == "first" else -1]]
        else:
            stages[role.role] = 0 if role.stage == "first" else last
    return stages


def _in_memory(session: Session, path: str) -> str:
    """The in-memory module path of an on-disk module path (a unit): the common module prefix
    of the parameters made only of tensors under it (`vision_tower.encoder.layers.1` is
    `model.vision_tower.encoder.layers.1` in memory); the path itself when none is."""
    modules = [name.split(".")[:-1] for name, sources in session.sources.items()
               if sources and all(s.startswith(path + ".") for s in sources)]
    common: list[str] = []
    for parts in zip(*modules, strict=False):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return ".".join(common) or path


class _Placement:
    """Where each in-memory parameter runs in a pipeline build, from plan.json."""

    def __init__(self, session: Session, plan: PlanFile) -> None:
        disk = _unit_stages(plan)
        self.session = session
        self.units = {_in_memory(session, path): stage for path, stage in disk.items()}
        self.roles = _role_stages(plan, disk)
        self.owners = _owners(plan)
        self.ran = {module: i for i, module in enumerate(session.captured)}
        self.last = plan.shape.pipeline_parallel_size - 1
        self.unit_runs = sorted((i, self.units[unit]) for m, i in self.ran.items()
                                for unit in [self.unit_of(m)] if unit is not None)
        """(position in the full model's run, stage) of every module run inside a unit."""
        self.group_starts = max((disk[g.unit_paths[0]] for g in plan.graph
                                 if g.unit_paths and g.unit_paths[0] in disk), default=0)
        """The last stage a graph group begins on."""

    def unit_of(self, name: str) -> str | None:
        """The in-memory unit path `name` lies under (None: outside every unit)."""
        return max((p for p in self.units if name.startswith(p + ".")), key=len, default=None)

    def allowed(self, module: str) -> tuple[int, int] | None:
        """The stages [first, last] a module outside the units may run on, from where the full
        model ran it: after every unit, from the last unit's stage to the last stage (a later
        stage gets the hidden state over the cuts; the logits come from the last); between
        units, from the stage of the unit run before it to that of the unit run after it;
        before every unit, from stage 0 to the last stage a graph group begins on (token ids
        travel over the cuts to where the decoder begins, as a vision-language model's do).
        None when no unit ran."""
        at = self.ran[module]
        before = [stage for i, stage in self.unit_runs if i < at]
        after = [stage for i, stage in self.unit_runs if i > at]
        if before and after:
            return before[-1], after[0]
        if before:
            return before[-1], self.last
        if after:
            return 0, self.group_starts
        return None

    def stages(self, name: str) -> dict[str, int]:
        """On-disk tensor -> the stage executing the in-memory parameter `name` made of it: the
        stage of the unit holding it, else the placement of the static role owning the tensor
        (of a role shared by several, `any_of`: the first of their stages for a module that
        runs before the last unit, the last for a module after it, as a tied head) when that
        lies where the full model's run allows (`allowed`); a placement outside that, or none,
        is taken as the nearest allowed stage, which then must own the tensor. So a family
        cannot check its own static placements: a final norm or tied head declared on the
        first stage is executed on the last one, which does not own it."""
        sources = self.session.sources[name]
        unit = self.unit_of(name)
        if unit is not None:
            return dict.fromkeys(sources, self.units[unit])
        module = self.session.module_of(name)
        last_unit = self.unit_runs[-1][0] if self.unit_runs else None
        after = module is not None and last_unit is not None and self.ran[module] > last_unit
        window = self.allowed(module) if module is not None else None
        out = {}
        for target in sources:
            placed = [self.roles[r] for r in self.owners.get(target, ()) if r in self.roles]
            stage = (max(placed) if after else min(placed)) if placed else None
            if window is not None and (stage is None or not window[0] <= stage <= window[1]):
                low, high = window
                stage = low if stage is None or stage < low else high
            if stage is not None:
                out[target] = stage
        return out


def module_stages(session: Session, plan: PlanFile) -> dict[str, tuple[int, ...]]:
    """Each checked module (`session.modules`) -> the stages of the build `plan` that run its
    parameters (the stage of its unit, or where its static role is placed in the run's
    window), in order."""
    placement = _Placement(session, plan)
    out = {}
    for module in session.modules:
        out[module] = tuple(sorted({stage for name in session.sources
                                    if name.startswith(module + ".")
                                    for stage in placement.stages(name).values()}))
    return out


def _owners(plan: PlanFile) -> dict[str, tuple[str, ...]]:
    """On-disk tensor -> the static roles owning it (none for a tensor a unit owns)."""
    roles = {g.name: g.owner.static_roles for g in plan.groups}
    return {t.target: roles.get(t.group, ()) for t in plan.tensors}


def _check(build: Build, **fields: Any) -> Check:
    """A check of the pipeline build's topology (T x S, x EP x ETP)."""
    return Check(tp=build.tp, pp=build.pp, ep=build.ep, etp=build.etp, **fields)


def _where(build: Build) -> str:
    """The build's topology, as messages begin."""
    return topology_name(build.tp, build.pp, build.ep, build.etp)


def _gathered(build: Build, stage: int, target: str) -> np.ndarray:
    """An on-disk tensor as the ranks of a stage hold it together: each rank's elements at
    their global place (zeros where no rank of the stage holds any)."""
    parts = [(state.layout[target], np.asarray(state.tensors[target]))
             for state in (build.states[r] for r in build.stage_ranks(stage))
             if target in state.layout]
    shape = tuple(parts[0][0].global_shape)
    out = np.zeros(shape, dtype=parts[0][1].dtype)
    for layout, local in parts:
        mask = scatter(shape, layout.selection, np.ones(local.shape, bool))
        out[mask] = scatter(shape, layout.selection, local)[mask]
    return out


def pipeline_checks(session: Session, build: Build) -> list[Check]:
    """Each stage owns what it executes; the stages' tensors give the full logits."""
    stages = build.pp
    placement = _Placement(session, build.file)
    executing: dict[str, dict[int, str]] = {}
    for name in sorted(session.sources):
        for target, stage in placement.stages(name).items():
            executing.setdefault(target, {}).setdefault(stage, name)
    checks, composite = [], {}
    owned = [{t for r in build.stage_ranks(s) for t in build.states[r].layout.targets}
             for s in range(stages)]
    for target in session.names:
        users = executing.get(target, {})
        missing = [s for s in sorted(users) if target not in owned[s]]
        omitted = not any(target in held for held in owned)
        runners = {session.module_of(users[s]) for s in missing}
        if omitted and runners and all(m is not None and session.reaches_logits(m) is False
                                       for m in runners):
            continue  # run but never used (SigLIP's pooling head): the family may omit it
        for stage in missing:
            checks.append(_check(
                build, module=target, group="", rank=build.stage_ranks(stage).start, ok=False,
                max_error=float("inf"), tolerance=0.0, kind="ownership",
                message=f"{_where(build)}: stage {stage} executes `{users[stage]}`, made of "
                        f"`{target}`, but " + (
                            "no stage loads that tensor (the family omits it), and the logits "
                            "depend on it" if omitted else "does not own that tensor")))
        holders = [s for s in (sorted(users) or range(stages)) if target in owned[s]]
        if holders and not missing:
            composite[target] = _gathered(build, holders[0], target)
    checks.extend(_cut_checks(session, build, placement))
    checks.extend(_input_checks(session, build, placement))
    logits = session.model_of(composite)
    with session.torch.no_grad():
        got = logits(**session.inputs, use_cache=False).logits
    error, tolerance = largest_error(got, session.logits), tolerance_of(session.logits)
    checks.append(_check(
        build, module="logits", group="", rank=None, ok=error <= tolerance,
        max_error=error, tolerance=tolerance, kind="logits",
        message="" if error <= tolerance else
        f"{_where(build)}: the model assembled from each stage's tensors gives logits that "
        f"differ from the full model's; max abs error {error:.3g}, tolerance {tolerance:.3g}"))
    return checks


# ---------------------------------------------------------------- boundary checks


def _unit_ends(plan: PlanFile) -> dict[int, tuple[str, str]]:
    """Stage -> the on-disk paths of its first and last unit (canonical order)."""
    paths = {g.group: g.unit_paths for g in plan.graph}
    ends = {}
    for rank in plan.ranks:
        owned = rank.units
        if rank.tensor_parallel_rank == 0 and owned:
            ends[rank.pipeline_stage] = (paths[owned[0].group][owned[0].start],
                                         paths[owned[-1].group][owned[-1].end - 1])
    return ends


def _unit_traffic(session: Session, senders: Sequence[str], receivers: Sequence[str]
                  ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One full forward pass: each sending unit's output, each receiving unit's inputs by name
    (its keyword arguments; the first positional one as `hidden`)."""
    outputs: dict[str, Any] = {}
    inputs: dict[str, dict[str, Any]] = {}
    handles = []
    for path in senders:
        def sent(_: Any, args: Any, output: Any, path: str = path) -> None:
            outputs.setdefault(path, first_tensor(output))
        handles.append(session.model.get_submodule(path).register_forward_hook(sent))
    for path in receivers:
        def received(_: Any, args: Any, kwargs: Any, path: str = path) -> None:
            inputs.setdefault(path, dict(kwargs) | ({"hidden": args[0]} if args else {}))
        handles.append(session.model.get_submodule(path).register_forward_pre_hook(
            received, with_kwargs=True))
    try:
        with session.torch.no_grad():
            session.model(**session.inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return outputs, inputs


def _axes(declared: Sequence[int | str], shape: Sequence[int], bound: dict[str, int]
          ) -> str | None:
    """None when a tensor of `shape` has the declared axes, binding named axes in `bound`;
    otherwise why not. A first axis that is a per-request dimension (not `batch`, `sequence`
    or a number) may span several leading axes of the tensor, flattened (HF keeps a batch axis
    of one image's patches that the boundary folds into `image_tokens`)."""
    folds = isinstance(declared[0], str) and declared[0] not in ("batch", "sequence")
    if len(shape) < len(declared) or len(shape) > len(declared) and not folds:
        return f"it has {len(shape)} axes, the boundary declares {len(declared)}"
    lead = len(shape) - len(declared) + 1
    sizes = [int(np.prod(shape[:lead])), *shape[lead:]]
    folded = f" (its first {lead} axes folded into one: {_spell(sizes)})" if lead > 1 else ""
    for axis, (want, got) in enumerate(zip(declared, sizes, strict=True)):
        if isinstance(want, int) and want != got:
            return f"axis {axis}{folded} has {got} elements, the boundary declares {want}"
        if isinstance(want, str) and bound.setdefault(want, got) != got:
            return (f"axis {axis}{folded} (`{want}`) has {got} elements, but `{want}` is "
                    f"{bound[want]}")
    return None


def _spell(shape: Sequence[object]) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def unexercised_boundaries(plans: Sequence[PlanFile]) -> str | None:
    """A note naming the execution groups whose boundary no cut of the pipeline builds `plans`
    (one model at one S, cut as each T chooses) crossed (a group cut after or inside), so that
    no check saw its declared shapes: at S=2 LLaVA is cut after its projector only; None when
    every group that can be cut was."""
    if not plans or any(plan.cuts is None for plan in plans) or not plans[0].graph:
        return None  # one boundary, which every cut carries
    plan = plans[0]
    crossed = {c.group for p in plans for c in p.cuts or ()}
    graph = plan.graph
    missed = [g.group for i, g in enumerate(graph) if g.group not in crossed
              and (i < len(graph) - 1 or len(g.unit_paths) > 1)]
    if not missed:
        return None
    last = graph[-1].group
    names = [f"`{g}`" + (f" ({plan.boundary.identity})" if g == last else "")
             for g in missed]
    stages = plan.shape.pipeline_parallel_size
    layouts = list(dict.fromkeys(p.pipeline.layout for p in plans
                                 if p.pipeline is not None and p.pipeline.layout))
    several = len(names) > 1
    listed = ", ".join(names[:-1]) + " and " + names[-1] if several else names[0]
    return (f"the boundar{'ies' if several else 'y'} of {listed} crossed no cut at S={stages}"
            + (f" ({' or '.join(layouts)})" if layouts else "")
            + f": no check saw {'their' if several else 'its'}"
            " shapes; verify with another --pp or --pp-layers to cut there")


def _modules_run(session: Session, paths: Sequence[str]) -> list[str]:
    """The paths of `paths` that are modules of the reference model (a unit transformers does
    not build, as DeepSeek-V3's multi-token-prediction layer, is not)."""
    found = []
    for path in paths:
        try:
            session.model.get_submodule(path)
        except AttributeError:
            continue
        found.append(path)
    return found


def _stage_tail(session: Session, placement: _Placement, stage: int, sender: str,
                receiver: str) -> str | None:
    """The module outside the units that hands the next stage its tensor in place of the
    stage's last unit: of the modules run after that unit and before the next stage's first
    one (in the full model's run) whose parameters all execute on `stage` (a static role
    placed with the stage's last unit, as a vision merger), the last one whose output reaches
    the logits. None when there is none: the last unit's output crosses."""
    ran = placement.ran
    after = max((i for m, i in ran.items() if m.startswith(sender + ".")), default=None)
    before = min((i for m, i in ran.items() if m.startswith(receiver + ".")), default=None)
    if after is None:
        return None
    tails = []
    for module, at in ran.items():
        if at <= after or (before is not None and at >= before) or \
                placement.unit_of(module) is not None:
            continue
        params = [n for n in session.sources if n.startswith(module + ".")]
        runs_on = {s for n in params for s in placement.stages(n).values()}
        if runs_on == {stage}:
            tails.append((at, module))
    # a tail whose effect cannot be told is not taken for the sender: the last unit's output
    # is checked, as before such tails were looked for
    return next((m for _, m in sorted(tails, reverse=True) if session.reaches_logits(m)),
                None)


def _hand_off(session: Session, placement: _Placement, sender: str, receiver: str,
              sent: Any, received: dict[str, Any]) -> str:
    """Why the value a cut hands off (`sent`, the output of `sender`) is not what the next
    stage computes from, by value in the full model's run; '' when it is, or cannot be told.

    The logits must depend on it (`_logits_read`): a
    vision layer the model never reads (LLaVA's last one under `vision_feature_layer: -2`)
    hands off nothing the next stage can use. And when no module with parameters runs between
    the two, the next stage's first unit (`receiver`) must receive exactly it, as its first
    positional or `hidden_states` argument (`received`), where the shapes agree.
    """
    if not _logits_read(session, sender):
        return (f"it hands the next stage the output of `{sender}`, which the full model's "
                "logits do not depend on (run but never read: the model reads an earlier "
                "value, as LLaVA's `vision_feature_layer: -2` reads the layer before the last);"
                " the next stage needs a value this cut does not carry: declare as units only "
                "the layers the model reads (the built-in llava's `vision_used`), or cut before "
                f"`{sender}`")
    got = received.get("hidden", received.get("hidden_states"))
    if sent is None or got is None or not hasattr(got, "shape") or \
            tuple(got.shape) != tuple(sent.shape):
        return ""
    ran = placement.ran
    after = max((i for m, i in ran.items() if m == sender or m.startswith(sender + ".")),
                default=None)
    before = min((i for m, i in ran.items() if m.startswith(receiver + ".")), default=None)
    if after is None or before is None or any(after < i < before for i in ran.values()):
        return ""
    error, tolerance = largest_error(got, sent), tolerance_of(sent)
    if error <= tolerance:
        return ""
    return (f"`{receiver}`, the next stage's first unit, receives a value other than the output "
            f"of `{sender}` that the cut carries (max abs error {error:.3g}, tolerance "
            f"{tolerance:.3g})")


def _logits_read(session: Session, module: str) -> bool:
    """Whether the full model's logits depend on `module`: run again with its parameters
    doubled plus one. (Perturbing its output with a hook, as `Session.reaches_logits` does, is
    not seen by transformers' own recorders of layer outputs, which a vision tower's
    `vision_feature_layer` reads.) True for a module without parameters."""
    torch = session.torch
    params = list(session.model.get_submodule(module).parameters())
    saved = [p.detach().clone() for p in params]
    if not params:
        return True
    with torch.no_grad():
        try:
            for p in params:
                p.mul_(2).add_(1)
            got = session.model(**session.inputs, use_cache=False).logits
        finally:
            for p, kept in zip(params, saved, strict=True):
                p.copy_(kept)
    return bool(largest_error(got, session.logits) > tolerance_of(session.logits))


def _cut_checks(session: Session, build: Build, placement: _Placement) -> list[Check]:
    """Each cut's declared boundary against what really crosses it: the primary tensor against
    the output of the stage's last unit, or of the module after it the stage runs last and the
    logits depend on (`_stage_tail`: a merger placed with the last vision unit), an auxiliary
    tensor against the model input or the next stage's first-unit argument of the same name
    (one of neither is not checked)."""
    ends = _unit_ends(build.file)
    cuts = [(c, _in_memory(session, ends[c.after_stage][1]),
             _in_memory(session, ends[c.after_stage + 1][0]))
            for c in build.file.pipeline_cuts()]
    outputs, inputs = _unit_traffic(session, _modules_run(session, [c[1] for c in cuts]),
                                    _modules_run(session, [c[2] for c in cuts]))
    checks = []
    for cut, unit, receiver in cuts:
        tail = _stage_tail(session, placement, cut.after_stage, unit, receiver)
        sender = unit if tail is None else tail
        if tail is not None:
            outputs[tail] = session.captured[tail][2]
        stage, schema = cut.after_stage, cut.boundary
        bound = {"batch": int(session.ids.shape[0]), "sequence": int(session.ids.shape[1])}
        where = (f"{_where(build)}: the cut after stage {stage} (group `{cut.group}`, "
                 f"boundary `{schema.identity}`)")
        found = [(schema.primary, sender, outputs.get(sender))] + [
            (spec, receiver if spec.role in inputs.get(receiver, {}) else "the model input",
             inputs.get(receiver, {}).get(spec.role, session.inputs.get(spec.role)))
            for spec in schema.auxiliary]
        failure = ""
        for spec, module, value in found:
            if value is None or not hasattr(value, "shape"):
                continue
            declared = [d.spell() for d in spec.shape]
            why = _axes(declared, tuple(value.shape), bound)
            if why is not None:
                failure = (f"{where} declares `{spec.role}` as {_spell(declared)}, but "
                           f"module `{module}` gives it as {_spell(value.shape)}: {why}")
                break
        handed = "" if failure else _hand_off(session, placement, sender, receiver,
                                              outputs.get(sender), inputs.get(receiver, {}))
        failure = failure or (f"{where}: {handed}" if handed else "")
        checks.append(_check(build, module=sender, group=cut.group,
                             rank=build.stage_ranks(stage).start, ok=not failure,
                             max_error=float("inf") if failure else 0.0, tolerance=0.0,
                             message=failure, kind="cut"))
    return checks


def _input_checks(session: Session, build: Build, placement: _Placement) -> list[Check]:
    """A model input (the token ids) that a module outside the units consumes on a stage after
    the first must cross every cut before that stage as an auxiliary tensor of its name: a
    vision-language model whose embedding sits where the decoder begins needs the token ids
    carried over the vision stages. (Which module reads an input is taken from the full
    model's run: an argument that is the input tensor itself.)"""
    cuts = {c.after_stage: c for c in build.file.pipeline_cuts()}
    needs: dict[str, tuple[int, str]] = {}  # input -> (the last stage reading it, the module)
    for module, (args, kwargs, _) in session.captured.items():
        if any(module.startswith(unit + ".") for unit in placement.units):
            continue
        given = [*args, *kwargs.values()]
        read = [name for name, value in session.inputs.items()
                if any(v is value for v in given)]
        if not read:
            continue
        params = [n for n in session.sources if n.startswith(module + ".")]
        stage = max((s for n in params for s in placement.stages(n).values()), default=0)
        for name in read:
            if stage > needs.get(name, (0, ""))[0]:
                needs[name] = (stage, module)
    checks = []
    for name, (stage, module) in sorted(needs.items()):
        for after in range(stage):
            cut = cuts.get(after)
            if cut is None:
                continue
            roles = [spec.role for spec in cut.boundary.auxiliary]
            if name in roles:
                continue
            checks.append(_check(
                build, module=module, group=cut.group, rank=build.stage_ranks(after).start,
                ok=False, max_error=float("inf"), tolerance=0.0, kind="input",
                message=f"{_where(build)}: stage {stage} runs `{module}` on the model input "
                        f"`{name}`, but the cut after stage {after} (boundary "
                        f"`{cut.boundary.identity}`) does not carry it: expected an "
                        f"auxiliary tensor `{name}` in that boundary, found "
                        f"{', '.join(f'`{r}`' for r in roles) or 'none'}"))
    return checks
