"""The expert-parallel checks of `partc verify --ep E`: every routed expert, computed by the
ranks from their own slots only and combined through the build's expert map, must give the
full experts module's output.

An expert-parallel build's ranks each load their experts (whole, or their ETP piece of each).
For every rank the check takes what the generated loader read and places it at the global
expert the rank's `expert_map()` (the map an engine routes with) names for each local slot:
a per-expert tensor must belong to an expert the map puts on the rank; a stacked tensor's
local slot s (its s-th block of rows on the expert axis) goes to expert `local_experts[s]`. An
expert held by several EP ranks (a redundant copy) is counted once, on its first owner in the
map. Each rank's model holds only those experts (the others zero), so its experts module gives
the rank's contribution; the contributions must add up to the full module's output.

The experts modules (transformers' `...Experts`, called with `hidden_states, top_k_index,
top_k_weights`, or GptOssExperts' `router_indices, routing_weights`) are driven directly: the
hidden states they received in the full model, as many rows as experts, each row routed to
`top_k` consecutive experts, so that every expert is reached whatever the router chose. The
number of experts the map routes over must be the number the module has (an `experts:` count
that is not the model's, a fused `[E * I, H]` axis taken for `E * I` experts, is refused).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from partc.verify.arrays import scatter
from partc.verify.results import Check, topology_name
from partc.verify.session import Build, Session, largest_error, tolerance_of

ROUTING_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")
"""The arguments of a transformers experts module (`MixtralExperts.forward` and the others),
by the names this check gives them."""
ROUTING_SPELLINGS = (ROUTING_ARGUMENTS, ("hidden_states", "router_indices", "routing_weights"))
"""How experts modules name their first three arguments (GptOssExperts: the second)."""
_CAPTURED: weakref.WeakKeyDictionary[Session, dict[str, dict[str, Any]]] = \
    weakref.WeakKeyDictionary()
"""The routing arguments of a session's experts modules, captured once per reference model
(every stage and build of a run drives the same inputs)."""


def _routing_names(module: Any) -> tuple[str, ...] | None:
    """The first three argument names of an experts module's forward; None for another
    module."""
    names = tuple(inspect.signature(module.forward).parameters)[:3]
    return names if names in ROUTING_SPELLINGS else None


def _experts_modules(model: Any) -> list[str]:
    """Every experts module of the model (forward arguments as ROUTING_SPELLINGS), in
    registration order."""
    return [name for name, module in model.named_modules() if _routing_names(module)]


class ExpertParallelRanks:
    """The experts of one stage of an expert-parallel build (its N = E x X ranks), placed
    through its expert map. `modules`: the modules the stage runs, whose experts modules are
    checked (default: every experts module of the model)."""

    def __init__(self, session: Session, build: Build, stage: int = 0,
                 modules: Sequence[str] | None = None) -> None:
        self.session = session
        self.build = build
        self.ranks = tuple(build.stage_ranks(stage))
        """The build ranks of the stage."""
        experts = build.file.expert_parallel
        assert experts is not None, "an expert-parallel build records its layout"
        self.ep = experts.expert_parallel_size
        self.etp = experts.expert_tensor_parallel_size
        self.expert_groups: dict[str, int | None] = dict(experts.expert_groups)
        self.where = topology_name(build.tp, build.pp, self.ep, self.etp)
        self.faults: list[Check] = []
        self.contributions = [self._contribution(rank, build.states[rank],
                                                 build.expert_maps[rank])
                              for rank in self.ranks]
        self.targets = sorted({t for c in self.contributions for t in c})
        self.every = _experts_modules(session.model)
        self.modules = [m for m in self.every if modules is None or any(
            m == x or m.startswith(x + ".") for x in modules)]
        if self.modules and session not in _CAPTURED:
            _CAPTURED[session] = self._capture()
        self.captured = _CAPTURED.get(session, {})
        zeros = {t: np.zeros(session.shapes[t], session.full[t].dtype) for t in self.targets}
        self.models = [session.model_of({**session.full, **zeros, **c})
                       for c in self.contributions] if self.modules else []
        self.shared_model = session.model_of({**session.full, **zeros}) if self.modules \
            else None

    def _fault(self, rank: int | None, module: str, why: str) -> None:
        where = f"rank {rank}" if rank is not None else self._all_ranks
        self.faults.append(self._check(module=module, group="", rank=rank, ok=False,
                                       max_error=float("inf"), tolerance=0.0,
                                       message=f"{self.where}: {where}: {why}"))

    @property
    def _all_ranks(self) -> str:
        return f"ranks {self.ranks[0]}-{self.ranks[-1]}"

    def _check(self, **fields: Any) -> Check:
        """An expert check of this build's topology."""
        return Check(tp=self.build.tp, pp=self.build.pp, ep=self.ep, etp=self.etp,
                     kind="experts", **fields)

    def _contribution(self, rank: int, state: Any, expert_map: Any) -> dict[str, np.ndarray]:
        """The experts rank `rank` computes, at the global experts its map names: its ETP
        piece of each expert whose first owner in the map is its EP rank, zeros elsewhere."""
        full, mine = self.session.full, expert_map.expert_parallel_rank
        counted = {e for e, owners in enumerate(expert_map.owners) if owners[0][0] == mine}
        out: dict[str, np.ndarray] = {}
        for layout in state.layout.tensors:
            if layout.logical_name not in self.expert_groups:
                continue
            target, shape = layout.target, tuple(layout.global_shape)
            local = np.asarray(state.tensors[target])
            axis, ranges = layout.selection
            placed = scatter(shape, layout.selection, local)
            read = scatter(shape, layout.selection, np.ones(local.shape, bool))
            if not np.array_equal(placed[read], full[target][read]):
                self._fault(rank, target, f"the loader read `{target}` bytes that differ from "
                                          "the checkpoint's")
            expert = self.expert_groups[layout.logical_name]
            if expert is not None:  # a per-expert group: the tensor names its expert
                if expert_map.local_slot(expert) is None:
                    self._fault(rank, target, f"the rank loads expert {expert}'s `{target}`, but "
                                              f"its expert map puts expert {expert} on EP ranks "
                                              f"{[ep for ep, _ in expert_map.owners[expert]]}, "
                                              f"not on EP rank {mine}")
                elif expert in counted:
                    out[target] = placed
                continue
            # a stacked group: local slot s is the s-th block of rows on the expert axis
            if axis is None:
                self._fault(rank, target, f"`{target}` of a stacked expert group is loaded whole, "
                                          "not by the rank's experts")
                continue
            rows = shape[axis] // expert_map.experts
            slots = len(expert_map.local_experts)
            if local.shape[axis] != slots * rows:
                self._fault(rank, target, f"the rank holds {local.shape[axis]} rows of "
                                          f"`{target}` on axis {axis}, but its expert map lists "
                                          f"{slots} local experts of {rows} rows each")
                continue
            routed = np.zeros(shape, local.dtype)
            for slot, expert in enumerate(expert_map.local_experts):
                if expert not in counted:
                    continue
                source: list[slice] = [slice(None)] * len(shape)
                source[axis] = slice(slot * rows, (slot + 1) * rows)
                index: list[slice] = [slice(None)] * len(shape)
                index[axis] = slice(expert * rows, (expert + 1) * rows)
                routed[tuple(index)] = local[tuple(source)]
            out[target] = routed
        return out

    def _capture(self) -> dict[str, dict[str, Any]]:
        """The routing arguments every experts module of the model received in the full
        model."""
        captured: dict[str, dict[str, Any]] = {}
        handles = []
        for path in self.every:
            module = self.session.model.get_submodule(path)
            signature = inspect.signature(module.forward)
            names = dict(zip(tuple(signature.parameters)[:3], ROUTING_ARGUMENTS, strict=True))

            def keep(_: Any, args: Any, kwargs: Any, path: str = path,
                     signature: inspect.Signature = signature,
                     names: dict[str, str] = names) -> None:
                bound = signature.bind(*args, **kwargs).arguments
                captured[path] = {names[k]: v for k, v in bound.items() if k in names}
            handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
        try:
            with self.session.torch.no_grad():
                self.session.model(**self.session.inputs, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return captured

    def _routing(self, module: str, experts: int) -> dict[str, Any]:
        """Inputs reaching every expert: the captured hidden rows, repeated to at least one row
        per expert, row i routed to experts i, i + 1, ... (top_k of them, mod `experts`) with
        equal weights."""
        torch = self.session.torch
        arguments = self.captured[module]
        hidden, index = arguments["hidden_states"], arguments["top_k_index"]
        width = hidden.shape[-1]
        flat = hidden.reshape(-1, width)
        rows = max(flat.shape[0], experts)
        flat = flat.repeat((rows + flat.shape[0] - 1) // flat.shape[0], 1)[:rows]
        top_k = min(int(index.shape[-1]), experts)
        routed = (torch.arange(rows)[:, None] + torch.arange(top_k)[None, :]) % experts
        weights = torch.full((rows, top_k), 1.0 / top_k,
                             dtype=arguments["top_k_weights"].dtype)
        states = flat.reshape(1, rows, width) if hidden.dim() == 3 else flat
        return {"hidden_states": states, "top_k_index": routed.to(index.dtype),
                "top_k_weights": weights}

    def _run(self, model: Any, module: str, inputs: dict[str, Any]) -> Any:
        with self.session.torch.no_grad():  # positional: the modules name them differently
            return model.get_submodule(module)(*(inputs[n] for n in ROUTING_ARGUMENTS))

    def _groups(self, module: str) -> str:
        """The expert groups of a module's tensors, as the plan names them; per-expert groups
        named `<base>.<expert>` for a contiguous run of experts as `<base>.<first>-<last>`."""
        targets = set(self.session.targets(module))
        names = sorted({layout.logical_name for state in self.build.states
                        for layout in state.layout.tensors
                        if layout.target in targets and layout.logical_name in self.expert_groups})
        runs: dict[str, list[int]] = {}
        out: list[str] = []
        for name in names:
            expert = self.expert_groups[name]
            if expert is not None and name.endswith(f".{expert}"):
                runs.setdefault(name.removesuffix(f".{expert}"), []).append(expert)
            else:
                out.append(name)
        for base, ids in sorted(runs.items()):
            ids.sort()
            if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
                out.append(f"{base}.{ids[0]}-{ids[-1]}")
            else:
                out.extend(f"{base}.{i}" for i in ids)
        return ", ".join(sorted(out))

    def checks(self) -> list[Check]:
        """One check per experts module (an expert group per layer), after the load faults."""
        out = list(self.faults)
        if not self.every:
            self._fault(None, "", "the model has no experts module (transformers' experts take "
                                  f"{', '.join(ROUTING_ARGUMENTS)} or "
                                  f"{', '.join(ROUTING_SPELLINGS[1])}) to drive")
            return list(self.faults)
        counts = {m.experts for m in self.build.expert_maps}
        for module in self.modules:
            group = self._groups(module)
            real = getattr(self.session.model.get_submodule(module), "num_experts", None)
            if not isinstance(real, int):  # no count to compare with: the map's own
                real = max(counts)
            if counts != {real}:
                out.append(self._check(
                    module=module, group=group, rank=None, ok=False,
                    max_error=float("inf"), tolerance=0.0,
                    message=f"{self.where}: module `{module}` (group `{group}`): the build's "
                            f"expert map routes over {sorted(counts)[0]} experts, but the "
                            f"model's module has {real}: the family's expert count (`for: "
                            "{expert: ...}` or `experts: {count: ...}`) is not the model's"))
                continue
            inputs = self._routing(module, real)
            want = self._run(self.session.model, module, inputs)
            tolerance = tolerance_of(want)
            outputs = [self._run(model, module, inputs) for model in self.models]
            shared = self._run(self.shared_model, module, inputs)
            total = sum(outputs) - (len(outputs) - 1) * shared
            error = largest_error(total, want)
            message = "" if error <= tolerance else (
                f"{self.where}: module `{module}` (group `{group}`), {self._all_ranks}: "
                "the experts computed by each rank from its own slots, "
                "placed through its expert map (redundant copies once), do not add up to the "
                f"full module{self._culprit(module, inputs)}; max abs error "
                f"{error:.3g}, tolerance {tolerance:.3g}")
            out.append(self._check(module=module, group=group, rank=None, ok=not message,
                                   max_error=error, tolerance=tolerance, message=message))
        return out

    def _culprit(self, module: str, inputs: dict[str, Any]) -> str:
        """The first expert whose output the ranks do not give: `, first at expert e`."""
        torch = self.session.torch
        index = inputs["top_k_index"]
        for expert in range(int(index.max()) + 1):
            only = {**inputs, "top_k_index": torch.full_like(index, expert)}
            want = self._run(self.session.model, module, only)
            got = sum(self._run(m, module, only) for m in self.models) - (
                len(self.models) - 1) * self._run(self.shared_model, module, only)
            if largest_error(got, want) > tolerance_of(want):
                return f" (first wrong: expert {expert})"
        return ""
