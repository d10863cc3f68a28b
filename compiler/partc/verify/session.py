"""The reference model of a `partc verify` run and its compiled builds: the module inputs and
outputs captured from the full model, masked copies of it, and the tolerance of a comparison."""

from __future__ import annotations

import importlib
import inspect
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from partc.api import CompileOptions, compile_family
from partc.plan.plan_file import read_plan
from partc.plan.plan_records import PlanFile
from partc.plan.topology import Topology
from partc.verify.inputs import model_inputs
from partc.verify.reference import (
    load_model,
    parameter_sources,
    require_libraries,
    tensor_shapes,
)

if TYPE_CHECKING:
    from partc.api import StageUnits
    from partc.parallel.specs import ShardingPolicy
    from partc.verify.quantized import StoredReference
    from partc.verify.results import Check

RELATIVE_TOLERANCE = 1e-4
"""Tolerance relative to the largest magnitude of the full output."""
ABSOLUTE_TOLERANCE = 1e-5
"""Tolerance added to the relative one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Build:
    """A compiled build: its plan.json read back typed, and every rank's loaded state."""

    file: PlanFile
    """The build's plan.json."""
    states: tuple[Any, ...]
    """Each rank's loaded state, by rank."""
    expert_maps: tuple[Any, ...] = ()
    """Each rank's `expert_map()` (an expert-parallel build; empty otherwise)."""
    stored_checks: tuple[Check, ...] = ()
    """The checks of each rank's stored weights decoded from its own slices (a reference in a
    storage format, `partc.verify.quantized`; empty otherwise)."""

    @property
    def tp(self) -> int:
        """T."""
        return self.file.shape.tensor_parallel_size

    @property
    def pp(self) -> int:
        """S."""
        return self.file.shape.pipeline_parallel_size

    @property
    def ep(self) -> int | None:
        """E (None: no expert parallelism)."""
        return self.file.shape.expert_parallel_size

    @property
    def etp(self) -> int | None:
        """X (None: no expert parallelism)."""
        return self.file.shape.expert_tensor_parallel_size if self.ep is not None else None

    def stage_ranks(self, stage: int) -> range:
        """The build ranks of a pipeline stage (N of them: E x X, or T)."""
        per = self.file.shape.ranks_per_stage
        return range(stage * per, (stage + 1) * per)

    def dense_ranks(self, stage: int) -> range:
        """The ranks of a stage's first dense replica: its T tensor-parallel ranks."""
        first = self.stage_ranks(stage).start
        return range(first, first + self.tp)


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


def compile_build(family: str | Path | None, reference: Path, out: Path, tp: int, pp: int,
                  policy: ShardingPolicy | None, stage_units: StageUnits = None, *,
                  experts: ExpertTopology | None = None,
                  stored: StoredReference | None = None) -> Build:
    """Compile the family for the reference checkpoint at T x S (`stage_units`: the stages'
    units, as `compile_family` takes them; None: balanced; `experts`: expert parallelism) and
    load every rank (and its expert map, under expert parallelism). `stored`: the reference
    in a storage format, compiled for and loaded instead, each rank's weights then decoded
    from its own slices."""
    reference = stored.folder if stored is not None else reference
    compile_family(family, reference / "config.json",
                   Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            expert_parallel_size=experts.expert_parallel_size if experts
                            else None, expert_tensor_parallel_size=experts.
                            expert_tensor_parallel_size if experts else 1),
                   CompileOptions(stage_units=stage_units, policy=policy, checkpoint=reference,
                                  out=out, expert_placement=experts.placement if experts
                                  else None))
    plan = read_plan(out / "plan.json")
    ranks = range(plan.shape.build_world_size)
    with _imported(out) as package:
        states = tuple(package.load(reference, rank=r) for r in ranks)
        maps = tuple(package.rank_module(r).expert_map() for r in ranks) if experts else ()
    if stored is None:
        return Build(file=plan, states=states, expert_maps=maps)
    states, found = stored.dense_states(states, tp, pp, (
        experts.expert_parallel_size, experts.expert_tensor_parallel_size) if experts else None)
    return Build(file=plan, states=states, expert_maps=maps, stored_checks=tuple(found))


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertTopology:
    """The expert parallelism `verify --ep` checks."""

    expert_parallel_size: int
    """E."""
    expert_tensor_parallel_size: int = 1
    """X."""
    placement: Path | None = None
    """The placement file (None: balanced)."""


class Session:
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
        self._reaches: dict[str, bool | None] = {}
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
                captured[path] = (args, kwargs, first_tensor(output).clone())
            handles.append(module.register_forward_hook(keep, with_kwargs=True))
        try:
            with self.torch.no_grad():
                self.model(**self.inputs, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return captured

    def module_of(self, parameter: str) -> str | None:
        """The checked module (`modules`) a parameter of the model lies in, if any."""
        return max((m for m in self.captured if parameter.startswith(m + ".")), key=len,
                   default=None)

    def reaches_logits(self, module: str) -> bool | None:
        """Whether the output of `module` changes the logits: the full model run again with
        that output perturbed (its first tensor doubled plus one). A module run but never
        used, as LLaVA's vision post_layernorm or SigLIP's pooling head, does not. None when
        the output cannot be perturbed so (not floating point, or nested deeper than a tuple
        of tensors): the callers then take the cautious answer. Cached."""
        if module in self._reaches:
            return self._reaches[module]
        torch = self.torch
        perturbed = []

        def perturb(_: Any, args: Any, output: Any) -> Any:
            first = first_tensor(output)
            if not torch.is_floating_point(first):
                return output
            if isinstance(output, (tuple, list)):
                if not output or output[0] is not first:
                    return output
                perturbed.append(True)
                return type(output)([first * 2 + 1, *output[1:]])
            perturbed.append(True)
            return first * 2 + 1

        handle = self.model.get_submodule(module).register_forward_hook(perturb)
        try:
            with torch.no_grad():
                got = self.model(**self.inputs, use_cache=False).logits
        finally:
            handle.remove()
        found = None if not perturbed else largest_error(got, self.logits) > tolerance_of(
            self.logits)
        self._reaches[module] = found
        return found

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
            return first_tensor(model.get_submodule(module)(*args, **kwargs))


def first_tensor(output: Any) -> Any:
    """The first tensor of a module's output (a tensor, or nested tuples or lists)."""
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


def largest_error(got: Any, want: Any) -> float:
    """The largest absolute difference between two outputs (0 when empty)."""
    return float((got - want).abs().max()) if want.numel() else 0.0


def tolerance_of(want: Any) -> float:
    """The largest difference allowed from `want`: relative to its magnitude, plus a constant."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    return RELATIVE_TOLERANCE * scale + ABSOLUTE_TOLERANCE
