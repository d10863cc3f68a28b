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

import importlib
import inspect
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.api import compile_family
from partc.errors import PartcError, PartcErrors
from partc.verify.reference import (
    build_reference,
    load_config,
    load_model,
    model_inputs,
    parameter_sources,
    reference_config,
    require_libraries,
    tensor_shapes,
)

if TYPE_CHECKING:
    from partc.parallel.specs import ShardingPolicy

MAX_TENSOR_PARALLEL = 8
"""By default every T from 1 to this that compiles is checked."""
RELATIVE_TOLERANCE = 1e-4
"""Tolerance relative to the largest magnitude of the full output."""
ABSOLUTE_TOLERANCE = 1e-5
"""Tolerance added to the relative one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One verified claim: a module (or the logits, or a tensor's ownership) at one topology."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    module: str
    """Hugging Face module path (or `logits`, or the on-disk tensor for ownership)."""
    group: str
    """The parameter group(s) concerned ('' when not narrowed to groups)."""
    rank: int | None
    """The global rank concerned; None when the claim is about all ranks together."""
    ok: bool
    """Whether the claim holds."""
    max_error: float
    """Largest absolute difference from the full model's output."""
    tolerance: float
    """The largest difference allowed."""
    message: str = ""
    """What failed, in words ('' when ok)."""

    def to_json(self) -> dict[str, object]:
        """The check as a JSON object."""
        return {"tp": self.tp, "pp": self.pp, "module": self.module, "group": self.group,
                "rank": self.rank, "ok": self.ok, "max_error": self.max_error,
                "tolerance": self.tolerance, "message": self.message}


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyReport:
    """Every check of one `partc verify` run, the topologies skipped and notes on the model."""

    family: str
    """The family's name."""
    model_type: str
    """The config's model type."""
    checks: tuple[Check, ...]
    """Every check, in the order they ran."""
    skipped: tuple[dict[str, object], ...] = ()
    """Topologies not checked, each with the reason (the compile error)."""
    notes: tuple[str, ...] = ()
    """How the reference model differs from the given config."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall-clock time per phase, for the report only."""

    @property
    def ok(self) -> bool:
        """Whether every check holds (and at least one ran)."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def first_failure(self) -> Check | None:
        """The first check that failed."""
        return next((c for c in self.checks if not c.ok), None)

    def to_json(self) -> dict[str, object]:
        """The report as a JSON object."""
        return {"family": self.family, "model_type": self.model_type, "ok": self.ok,
                "checks": [c.to_json() for c in self.checks], "skipped": list(self.skipped),
                "notes": list(self.notes),
                "seconds": {k: round(v, 3) for k, v in sorted(self.seconds.items())}}


# ---------------------------------------------------------------- the compiled ranks


@dataclass(slots=True)
class _Build:
    tp: int
    pp: int
    plan: dict[str, Any]
    states: list[Any]


@contextmanager
def _imported(out: Path) -> Iterator[Any]:
    """The generated package of a build folder, forgotten again afterwards."""
    (package,) = [p.name for p in out.iterdir() if (p / "__init__.py").is_file()]
    sys.path.insert(0, str(out))
    try:
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
        yield importlib.import_module(package)
    finally:
        sys.path.remove(str(out))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


def _compile(family: str | Path | None, reference: Path, out: Path, tp: int, pp: int,
             policy: ShardingPolicy | None) -> _Build:
    compile_family(family, reference / "config.json", tensor_parallel_size=tp,
                   pipeline_parallel_size=pp, policy=policy, checkpoint=reference, out=out)
    plan = json.loads((out / "plan.json").read_text())
    with _imported(out) as package:
        states = [package.load(reference, rank=r) for r in range(tp * pp)]
    return _Build(tp=tp, pp=pp, plan=plan, states=states)


def _scatter(shape: tuple[int, ...], selection: tuple[int | None, Sequence[tuple[int, int]]],
             local: np.ndarray) -> np.ndarray:
    """A zeroed global array holding `local` at the global ranges it was read from."""
    axis, ranges = selection
    out = np.zeros(shape, dtype=local.dtype)
    if axis is None:
        out[...] = local
        return out
    offset = 0
    for start, end in ranges:
        index: list[slice] = [slice(None)] * len(shape)
        index[axis] = slice(start, end)
        source: list[slice] = [slice(None)] * len(shape)
        source[axis] = slice(offset, offset + end - start)
        out[tuple(index)] = local[tuple(source)]
        offset += end - start
    return out


# ---------------------------------------------------------------- the session


class _Session:
    """The reference model, its captured module inputs and outputs, and masked copies of it."""

    def __init__(self, folder: Path, work: Path, seed: int = 0) -> None:
        self.torch, _ = require_libraries()
        from safetensors.torch import load_file

        self.folder = folder
        self.work = work
        self.shapes = tensor_shapes(folder)
        self.names = sorted(self.shapes)
        self.full = {k: v.numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.sources = parameter_sources(folder, self.names)
        self.model = load_model(folder)
        self.count = 0
        vocab = self.model.get_input_embeddings().weight.shape[0]
        accepted = set(inspect.signature(self.model.forward).parameters)
        self.inputs = model_inputs(folder, vocab, seed, accepted)
        self.ids = self.inputs["input_ids"]
        self.modules = self._modules()
        self.captured = self._capture()
        with self.torch.no_grad():
            self.logits = self.model(**self.inputs, use_cache=False).logits

    def _modules(self) -> list[str]:
        """Every module checked, in registration order: the children with parameters of each
        layer of every ModuleList (decoder layers, vision encoder layers or blocks, however
        deeply nested), and every other module with parameters that holds no ModuleList (the
        embeddings, norms, projector, head)."""
        module_list = self.torch.nn.ModuleList
        found: list[str] = []

        def owns_parameters(module: Any) -> bool:
            return any(True for _ in module.parameters())

        def walk(path: str, module: Any) -> None:
            for name, child in module.named_children():
                sub = f"{path}.{name}" if path else name
                if not owns_parameters(child):
                    continue
                if isinstance(child, module_list):
                    for index, layer in enumerate(child):
                        found.extend(f"{sub}.{index}.{n}" for n, c in layer.named_children()
                                     if owns_parameters(c))
                elif any(isinstance(m, module_list) for m in child.modules()):
                    walk(sub, child)
                else:
                    found.append(sub)

        walk("", self.model)
        return found

    def targets(self, module: str) -> tuple[str, ...]:
        """The on-disk tensors a module's parameters are made of (a tied head: the embedding)."""
        found: set[str] = set()
        for name, _ in self.model.get_submodule(module).named_parameters(
                remove_duplicate=False):
            found.update(self.sources.get(f"{module}.{name}", ()))
        return tuple(sorted(found))

    def _capture(self) -> dict[str, tuple[tuple[Any, ...], dict[str, Any], Any]]:
        captured: dict[str, tuple[tuple[Any, ...], dict[str, Any], Any]] = {}
        handles = []
        for path in self.modules:
            module = self.model.get_submodule(path)

            def keep(_: Any, args: Any, kwargs: Any, output: Any, path: str = path) -> None:
                # a copy: a caller may add into the output in place (Falcon's parallel
                # attention does `mlp_output += attention_output`)
                captured[path] = (args, kwargs, _first_tensor(output).clone())
            handles.append(module.register_forward_hook(keep, with_kwargs=True))
        try:
            with self.torch.no_grad():
                self.model(**self.inputs, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return captured

    def model_of(self, tensors: dict[str, np.ndarray]) -> Any:
        """A model loaded by transformers from these on-disk tensors (the rest: zeros)."""
        from safetensors.torch import save_file

        self.count += 1
        folder = self.work / f"masked-{self.count}"
        folder.mkdir()
        shutil.copyfile(self.folder / "config.json", folder / "config.json")
        save_file({name: self.torch.from_numpy(np.ascontiguousarray(tensors[name]))
                   if name in tensors else self.torch.zeros(self.shapes[name])
                   for name in self.names}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        model = load_model(folder)
        shutil.rmtree(folder)
        return model

    def run(self, model: Any, module: str) -> Any:
        """`module` of `model` run on the inputs captured from the full model."""
        args, kwargs, _ = self.captured[module]
        with self.torch.no_grad():
            return _first_tensor(model.get_submodule(module)(*args, **kwargs))


def _first_tensor(output: Any) -> Any:
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


def _error(got: Any, want: Any) -> float:
    return float((got - want).abs().max()) if want.numel() else 0.0


def _tolerance(want: Any) -> float:
    scale = float(want.abs().max()) if want.numel() else 0.0
    return RELATIVE_TOLERANCE * scale + ABSOLUTE_TOLERANCE


# ---------------------------------------------------------------- tensor-parallel checks


class _Ranks:
    """The masks and masked models of one tensor-parallel build (one stage)."""

    def __init__(self, session: _Session, build: _Build) -> None:
        self.session = session
        self.build = build
        self.masks: list[dict[str, np.ndarray]] = []
        self.parts: list[dict[str, np.ndarray]] = []
        self.loader_faults: list[tuple[int, str]] = []
        for rank, state in enumerate(build.states):
            masks, parts = {}, {}
            for layout in state.layout.tensors:
                target, shape = layout.target, tuple(layout.global_shape)
                local = np.asarray(state.tensors[target])
                parts[target] = _scatter(shape, layout.selection, local)
                masks[target] = _scatter(shape, layout.selection, np.ones(local.shape, bool))
                if not np.array_equal(parts[target][masks[target]],
                                      session.full[target][masks[target]]):
                    self.loader_faults.append((rank, target))
            self.masks.append(masks)
            self.parts.append(parts)
        self.whole = {name: all(m.get(name) is not None and bool(m[name].all())
                                for m in self.masks) for name in session.names}
        self.models = [session.model_of(p) for p in self.parts]
        self.shared_model = session.model_of(self._shared(session.names)) if build.tp > 1 \
            else None

    def _shared(self, targets: Sequence[str]) -> dict[str, np.ndarray]:
        """Only the elements every rank holds of `targets`; the other tensors whole."""
        full = self.session.full
        out = dict(full)
        for name in targets:
            every = np.logical_and.reduce([m.get(name, np.zeros(self.session.shapes[name], bool))
                                           for m in self.masks])
            out[name] = np.where(every, full[name], 0).astype(full[name].dtype)
        return out

    def _masked(self, targets: Sequence[str], masks: Sequence[dict[str, np.ndarray]]
                ) -> dict[str, np.ndarray]:
        """The union of `masks` on `targets`; the other tensors whole."""
        full = self.session.full
        out = dict(full)
        for name in targets:
            union = np.logical_or.reduce([m.get(name, np.zeros(self.session.shapes[name], bool))
                                          for m in masks])
            out[name] = np.where(union, full[name], 0).astype(full[name].dtype)
        return out

    def check(self, module: str) -> Check:
        """The claim for one module: every rank equals it, or the ranks add up to it."""
        session, tp = self.session, self.build.tp
        want = session.captured[module][2]
        tolerance = _tolerance(want)
        targets = session.targets(module)
        split = [t for t in targets if not self.whole[t]]
        groups = self._groups(split)
        if not split:
            for rank, model in enumerate(self.models):
                error = _error(session.run(model, module), want)
                if error > tolerance:
                    return self._fail(module, "", rank, error, tolerance,
                                      "its tensors are whole on every rank, but the rank's "
                                      "output differs from the full module's")
            return Check(tp=tp, pp=1, module=module, group=", ".join(self._groups(targets)),
                         rank=None, ok=True, max_error=0.0, tolerance=tolerance)
        norms = self._reduced_norms(module, split)
        if norms:  # the engine all-reduces these norms' statistic: so does the check
            total = sum(self._run_reduced(module, norms))
        else:
            total = sum(session.run(m, module) for m in self.models)
        if self.shared_model is not None:
            total = total - (tp - 1) * session.run(self.shared_model, module)
        error = _error(total, want)
        if error <= tolerance:
            return Check(tp=tp, pp=1, module=module, group=", ".join(groups), rank=None,
                         ok=True, max_error=error, tolerance=tolerance)
        return self._narrow(module, groups, error, tolerance)

    def _reduced_norms(self, module: str, targets: Sequence[str]) -> list[str]:
        """Submodules of `module` holding a split tensor that needs a TP reduction (a norm
        whose statistic spans the split projection, `reduction: tensor_parallel`)."""
        norms: list[str] = []
        for target in targets:
            layouts = [state.layout[target] for state in self.build.states
                       if target in state.layout]
            path = target.rsplit(".", 1)[0]
            if any(x.needs_tp_reduction for x in layouts) and path.startswith(module + ".") \
                    and path not in norms:
                norms.append(path)
        return norms

    def _run_reduced(self, module: str, norms: Sequence[str]) -> list[Any]:
        """Each rank's output of `module` with the RMS statistic of every norm in `norms` taken
        over all ranks' pieces (the all-reduce an engine does), not over the rank's own.

        A first pass records each rank's sum of squares at each norm's input; the second
        rescales each norm's output by sqrt((own + eps) / (all + eps)) (mean squares over the
        full width): the RMSNorm the whole model computes, restricted to the rank's rows.
        """
        torch, session = self.session.torch, self.session
        sums: list[dict[str, Any]] = [{} for _ in self.models]

        def record(rank: int, path: str) -> Any:
            def hook(_: Any, args: Any, output: Any) -> None:
                sums[rank][path] = args[0].float().pow(2).sum(-1, keepdim=True)
            return hook

        def rescale(rank: int, path: str, eps: float) -> Any:
            def hook(_: Any, args: Any, output: Any) -> Any:
                width = args[0].shape[-1]
                own = sums[rank][path] / width
                full = sum(s[path] for s in sums) / width
                return (output.float() * torch.sqrt((own + eps) / (full + eps))).to(
                    output.dtype)
            return hook

        for make in (record, None):
            outputs = []
            for rank, model in enumerate(self.models):
                handles = []
                for path in norms:
                    norm = model.get_submodule(path)
                    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
                    hook = make(rank, path) if make else rescale(rank, path, eps)
                    handles.append(norm.register_forward_hook(hook))
                try:
                    outputs.append(session.run(model, module))
                finally:
                    for handle in handles:
                        handle.remove()
        return outputs

    def _groups(self, targets: Sequence[str]) -> list[str]:
        names: list[str] = []
        for target in targets:
            for state in self.build.states:
                if target in state.layout:
                    name = state.layout[target].logical_name
                    if name not in names:
                        names.append(name)
                    break
        return names

    def _group_targets(self, group: str, targets: Sequence[str]) -> list[str]:
        return [t for t in targets if self._groups([t]) == [group]]

    def _narrow(self, module: str, groups: list[str], error: float, tolerance: float) -> Check:
        """The first group (then rank) whose split alone breaks the module."""
        session, tp = self.session, self.build.tp
        want = session.captured[module][2]
        targets = session.targets(module)
        for group in groups:
            mine = self._group_targets(group, targets)
            shared = session.run(session.model_of(self._shared(mine)), module)
            outs = [session.run(session.model_of(self._masked(mine, [m])), module)
                    for m in self.masks]
            alone = _error(sum(outs) - (tp - 1) * shared, want)
            if alone <= tolerance:
                continue
            for rank in range(tp):
                others = [m for r, m in enumerate(self.masks) if r != rank]
                rest = session.run(session.model_of(self._masked(mine, others)), module) \
                    if others else 0
                separable = _error(outs[rank] + rest - shared, want) if others else alone
                if separable > tolerance:
                    return self._fail(module, group, rank, alone, tolerance,
                                      "the rank's part of the group is not separable from the "
                                      "other ranks' (rank + the others - the shared part "
                                      f"differs by {separable:.3g})")
            return self._fail(module, group, None, alone, tolerance,
                              "the ranks' parts of the group do not add up to the full module")
        return self._fail(module, ", ".join(groups), None, error, tolerance,
                          "the ranks' parts do not add up to the full module, though each "
                          "group alone does")

    def _fail(self, module: str, group: str, rank: int | None, error: float,
              tolerance: float, why: str) -> Check:
        tp = self.build.tp
        where = f"rank {rank}" if rank is not None else f"ranks 0-{tp - 1}"
        return Check(tp=tp, pp=1, module=module, group=group, rank=rank, ok=False,
                     max_error=error, tolerance=tolerance,
                     message=f"T={tp} x S=1: module `{module}`"
                             f"{f' (group `{group}`)' if group else ''}, {where}: {why}; max "
                             f"abs error {error:.3g}, tolerance {tolerance:.3g}")


# ---------------------------------------------------------------- pipeline checks


def _unit_stages(plan: dict[str, Any]) -> dict[str, int]:
    """Unit path -> the pipeline stage executing it, from plan.json."""
    paths = {g["group"]: g["unit_paths"] for g in plan["graph"]}
    stages = {}
    for rank in plan["ranks"]:
        partition = rank["partition"]
        for owned in partition["groups"]:
            start, end = owned["unit_range"]
            for unit in range(start, end):
                stages[paths[owned["group"]][unit]] = partition["stage"]
    return stages


def _role_stages(plan: dict[str, Any], units: dict[str, int]) -> dict[str, int]:
    """Static role -> the stage its declared placement puts it on: `first` stage 0, `last` the
    last stage, `{with: group, unit: first|last}` the stage of that unit of the group (from
    plan.json's `static_roles` and unit ranges, not from the ranks' own role lists)."""
    last = plan["topology"]["pipeline_parallel_size"] - 1
    paths = {g["group"]: g["unit_paths"] for g in plan["graph"]}
    stages = {}
    for role in plan["static_roles"]:
        place = role["stage"]
        if isinstance(place, dict):
            group = paths[place["with"]]
            stages[role["role"]] = units[group[0 if place["unit"] == "first" else -1]]
        else:
            stages[role["role"]] = 0 if place == "first" else last
    return stages


def _in_memory(session: _Session, path: str) -> str:
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

    def __init__(self, session: _Session, plan: dict[str, Any]) -> None:
        disk = _unit_stages(plan)
        self.session = session
        self.units = {_in_memory(session, path): stage for path, stage in disk.items()}
        self.roles = _role_stages(plan, disk)
        self.owners = _owners(plan)
        self.ran = {module: i for i, module in enumerate(session.captured)}
        in_units = [i for m, i in self.ran.items()
                    if any(m.startswith(p + ".") for p in self.units)]
        self.last_unit = max(in_units, default=None)

    def stages(self, name: str) -> dict[str, int]:
        """On-disk tensor -> the stage executing the in-memory parameter `name` made of it: the
        stage of the unit holding it, else the placement of the static role owning the tensor
        (of a role shared by several, `any_of`: the first of their stages for a module that
        runs before the last unit, the last for a module after it, as a tied head)."""
        sources = self.session.sources[name]
        unit = max((p for p in self.units if name.startswith(p + ".")), key=len, default=None)
        if unit is not None:
            return dict.fromkeys(sources, self.units[unit])
        module = max((m for m in self.ran if name.startswith(m + ".")), key=len, default=None)
        after = module is not None and self.last_unit is not None and \
            self.ran[module] > self.last_unit
        out = {}
        for target in sources:
            placed = [self.roles[r] for r in self.owners.get(target, ()) if r in self.roles]
            if placed:
                out[target] = max(placed) if after else min(placed)
        return out


def _owners(plan: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """On-disk tensor -> the static roles owning it (none for a tensor a unit owns)."""
    roles = {g["name"]: tuple(g["owner"].get("roles", ())) for g in plan["groups"]}
    return {t["target"]: roles.get(t["group"], ()) for t in plan["tensors"]}


def _pipeline_checks(session: _Session, build: _Build) -> list[Check]:
    """Each stage owns what it executes; the stages' tensors give the full logits."""
    stages = build.pp
    placement = _Placement(session, build.plan)
    executing: dict[str, dict[int, str]] = {}
    for name in sorted(session.sources):
        for target, stage in placement.stages(name).items():
            executing.setdefault(target, {}).setdefault(stage, name)
    checks, composite = [], {}
    owned = [set(state.layout.targets) for state in build.states]
    for target in session.names:
        users = executing.get(target, {})
        missing = [s for s in sorted(users) if target not in owned[s]]
        for stage in missing:
            checks.append(Check(
                tp=1, pp=stages, module=target, group="", rank=stage, ok=False,
                max_error=float("inf"), tolerance=0.0,
                message=f"T=1 x S={stages}: stage {stage} executes `{users[stage]}`, made of "
                        f"`{target}`, but does not own that tensor"))
        holders = [s for s in (sorted(users) or range(stages)) if target in owned[s]]
        if holders and not missing:
            composite[target] = np.asarray(build.states[holders[0]].tensors[target])
    if "cuts" in build.plan:
        checks.extend(_cut_checks(session, build))
    logits = session.model_of(composite)
    with session.torch.no_grad():
        got = logits(**session.inputs, use_cache=False).logits
    error, tolerance = _error(got, session.logits), _tolerance(session.logits)
    checks.append(Check(
        tp=1, pp=stages, module="logits", group="", rank=None, ok=error <= tolerance,
        max_error=error, tolerance=tolerance,
        message="" if error <= tolerance else
        f"T=1 x S={stages}: the model assembled from each stage's tensors gives logits that "
        f"differ from the full model's; max abs error {error:.3g}, tolerance {tolerance:.3g}"))
    return checks


# ---------------------------------------------------------------- boundary checks


def _unit_ends(plan: dict[str, Any]) -> dict[int, tuple[str, str]]:
    """Stage -> the on-disk paths of its first and last unit (canonical order)."""
    paths = {g["group"]: g["unit_paths"] for g in plan["graph"]}
    ends = {}
    for rank in plan["ranks"]:
        partition = rank["partition"]
        owned = partition["groups"]
        if rank["tensor_parallel_rank"] == 0 and owned:
            ends[partition["stage"]] = (paths[owned[0]["group"]][owned[0]["unit_range"][0]],
                                       paths[owned[-1]["group"]][owned[-1]["unit_range"][1] - 1])
    return ends


def _unit_traffic(session: _Session, senders: Sequence[str], receivers: Sequence[str]
                  ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One full forward pass: each sending unit's output, each receiving unit's inputs by name
    (its keyword arguments; the first positional one as `hidden`)."""
    outputs: dict[str, Any] = {}
    inputs: dict[str, dict[str, Any]] = {}
    handles = []
    for path in senders:
        def sent(_: Any, args: Any, output: Any, path: str = path) -> None:
            outputs.setdefault(path, _first_tensor(output))
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
    for axis, (want, got) in enumerate(zip(declared, sizes, strict=True)):
        if isinstance(want, int) and want != got:
            return f"axis {axis} has {got} elements, the boundary declares {want}"
        if isinstance(want, str) and bound.setdefault(want, got) != got:
            return f"axis {axis} (`{want}`) has {got} elements, but `{want}` is {bound[want]}"
    return None


def _spell(shape: Sequence[object]) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def _cut_checks(session: _Session, build: _Build) -> list[Check]:
    """Each cut's declared boundary against what really crosses it: the primary tensor against
    the output of the stage's last unit, an auxiliary tensor against the model input or the
    next stage's first-unit argument of the same name (one of neither is not checked)."""
    stages, plan = build.pp, build.plan
    ends = _unit_ends(plan)
    cuts = [(c, _in_memory(session, ends[c["after_stage"]][1]),
             _in_memory(session, ends[c["after_stage"] + 1][0])) for c in plan["cuts"]]
    outputs, inputs = _unit_traffic(session, [c[1] for c in cuts], [c[2] for c in cuts])
    checks = []
    for cut, sender, receiver in cuts:
        stage, schema = cut["after_stage"], cut["boundary"]
        bound = {"batch": int(session.ids.shape[0]), "sequence": int(session.ids.shape[1])}
        where = (f"T=1 x S={stages}: the cut after stage {stage} (group `{cut['group']}`, "
                 f"boundary `{schema['identity']}`)")
        found = [(schema["primary"], sender, outputs.get(sender))] + [
            (spec, receiver if spec["role"] in inputs.get(receiver, {}) else "the model input",
             inputs.get(receiver, {}).get(spec["role"], session.inputs.get(spec["role"])))
            for spec in schema["auxiliary"]]
        failure = ""
        for spec, module, value in found:
            if value is None or not hasattr(value, "shape"):
                continue
            why = _axes(spec["shape"], tuple(value.shape), bound)
            if why is not None:
                failure = (f"{where} declares `{spec['role']}` as {_spell(spec['shape'])}, but "
                           f"module `{module}` gives it as {_spell(value.shape)}: {why}")
                break
        checks.append(Check(tp=1, pp=stages, module=sender, group=cut["group"], rank=stage,
                            ok=not failure, max_error=float("inf") if failure else 0.0,
                            tolerance=0.0, message=failure))
    return checks


# ---------------------------------------------------------------- the entry point


def verify_family(family: str | Path | None, config: str | Path, *,
                  tensor_parallel_sizes: Sequence[int] | None = None,
                  pipeline_parallel_size: int | None = None,
                  policy: ShardingPolicy | None = None, seed: int = 0) -> VerifyReport:
    """Verify a family's split against transformers' modeling code for `config`'s architecture.

    `tensor_parallel_sizes`: the T to check (default: every T up to 8 that compiles, the others
    reported as skipped); `pipeline_parallel_size`: the S of the pipeline check (default 2, or
    the number of units if smaller; 1 skips it). Raises a VerifyError when torch or
    transformers is missing or the model cannot be built.
    """
    require_libraries()
    given = load_config(Path(config))
    reference, notes = reference_config(given)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="partc-verify-") as scratch:
        work = Path(scratch)
        folder = work / "reference"
        build_reference(reference, folder, seed)
        session = _Session(folder, work, seed)
        seconds["reference"] = time.perf_counter() - start
        checks: list[Check] = []
        skipped: list[dict[str, object]] = []
        family_name = ""
        last_plan: dict[str, Any] | None = None
        sizes = list(tensor_parallel_sizes or range(1, MAX_TENSOR_PARALLEL + 1))
        for tp in sizes:
            begin = time.perf_counter()
            try:
                build = _compile(family, folder, work / f"tp{tp}", tp, 1, policy)
            except PartcError as error:
                first = error.errors[0] if isinstance(error, PartcErrors) else error
                if tensor_parallel_sizes is None:
                    skipped.append({"tp": tp, "pp": 1, "reason": str(first)})
                    continue
                checks.append(Check(tp=tp, pp=1, module="", group="", rank=None, ok=False,
                                    max_error=float("inf"), tolerance=0.0,
                                    message=f"T={tp} x S=1 does not compile: {first}"))
                continue
            family_name, last_plan = build.plan["family"], build.plan
            ranks = _Ranks(session, build)
            checks.extend(Check(
                tp=tp, pp=1, module=target, group="", rank=rank, ok=False,
                max_error=float("inf"), tolerance=0.0,
                message=f"T={tp} x S=1: rank {rank}'s loader read `{target}` bytes that differ "
                        "from the checkpoint's") for rank, target in ranks.loader_faults)
            checks.extend(ranks.check(module) for module in session.modules)
            seconds[f"tp{tp}"] = time.perf_counter() - begin
        if last_plan is None:
            try:
                last_plan = _compile(family, folder, work / "units", 1, 1, policy).plan
            except PartcError:
                last_plan = {"graph": []}
        units = sum(len(g["unit_paths"]) for g in last_plan["graph"])
        pp = min(pipeline_parallel_size or 2, units)
        if pp > 1:
            begin = time.perf_counter()
            try:
                staged = _compile(family, folder, work / f"pp{pp}", 1, pp, policy)
                checks.extend(_pipeline_checks(session, staged))
                family_name = family_name or staged.plan["family"]
            except PartcError as error:
                first = error.errors[0] if isinstance(error, PartcErrors) else error
                checks.append(Check(tp=1, pp=pp, module="", group="", rank=None, ok=False,
                                    max_error=float("inf"), tolerance=0.0,
                                    message=f"T=1 x S={pp} does not compile: {first}"))
            seconds[f"pp{pp}"] = time.perf_counter() - begin
        else:
            skipped.append({"tp": 1, "pp": pipeline_parallel_size or 2, "reason":
                            "no pipeline split asked for (S=1)" if pipeline_parallel_size == 1
                            else f"the model has {units} unit(s); no pipeline split"})
    seconds["total"] = time.perf_counter() - start
    return VerifyReport(family=family_name or str(family or given["model_type"]),
                        model_type=str(given["model_type"]), checks=tuple(checks),
                        skipped=tuple(skipped), notes=tuple(notes), seconds=seconds)
