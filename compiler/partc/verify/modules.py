"""The tensor-parallel checks of `partc verify`: the ranks' parts of every module must add up
to the full module's output; a failing module is narrowed to a group, then to a rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partc.verify.arrays import scatter
from partc.verify.results import Check, topology_name
from partc.verify.session import Build, Session, largest_error, tolerance_of


class TensorParallelRanks:
    """The masks and masked models of one stage's tensor-parallel ranks: its first dense
    replica (T ranks). `whole`: on-disk tensors taken whole on every rank (an expert-parallel
    build's routed experts, which the expert check covers)."""

    def __init__(self, session: Session, build: Build, stage: int = 0,
                 whole: frozenset[str] = frozenset()) -> None:
        self.session = session
        self.build = build
        self.ranks = tuple(build.dense_ranks(stage))
        """The build ranks checked, by tensor-parallel rank."""
        self.where = topology_name(build.tp, build.pp, build.ep, build.etp)
        self.masks: list[dict[str, np.ndarray]] = []
        self.parts: list[dict[str, np.ndarray]] = []
        self.loader_faults: list[tuple[int, str, str]] = []
        """(rank, tensor, why) of every rank of the stage that loaded a tensor wrongly."""
        for rank in self.ranks:
            parts = self._read(rank, build.states[rank], whole)
            masks = {t: m for t, (_, m) in parts.items()}
            for target in whole:
                parts[target] = (session.full[target],
                                 np.ones(session.shapes[target], dtype=bool))
                masks[target] = parts[target][1]
            self.masks.append(masks)
            self.parts.append({t: v for t, (v, _) in parts.items()})
        for rank in build.stage_ranks(stage)[build.tp:]:  # the other dense replicas
            first = self.ranks[(rank - self.ranks[0]) % build.tp]
            theirs = self.masks[self.ranks.index(first)]
            for target, (_, mask) in self._read(rank, build.states[rank], whole).items():
                if target not in theirs or not np.array_equal(mask, theirs[target]):
                    self.loader_faults.append((rank, target, f"holds other elements of "
                                               f"`{target}` than rank {first}, whose dense "
                                               "replica it is"))
        self.whole = {name: all(m.get(name) is not None and bool(m[name].all())
                                for m in self.masks) for name in session.names}
        self.models = [session.model_of(p) for p in self.parts]
        self.shared_model = session.model_of(self._shared(session.names)) if build.tp > 1 \
            else None

    def _read(self, rank: int, state: Any, whole: frozenset[str]
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """What a rank loaded (but the `whole` tensors), each tensor scattered into a zeroed
        global one, with the mask of the elements it holds; a tensor whose bytes differ from
        the checkpoint's is a loader fault."""
        full = self.session.full
        out = {}
        for layout in state.layout.tensors:
            target, shape = layout.target, tuple(layout.global_shape)
            if target in whole:
                continue
            local = np.asarray(state.tensors[target])
            part = scatter(shape, layout.selection, local)
            mask = scatter(shape, layout.selection, np.ones(local.shape, bool))
            if not np.array_equal(part[mask], full[target][mask]):
                self.loader_faults.append((rank, target, f"read `{target}` bytes that differ "
                                                         "from the checkpoint's"))
            out[target] = (part, mask)
        return out

    def load_checks(self) -> list[Check]:
        """A failed check per tensor a rank of the stage loaded wrongly."""
        return [self._check(module=target, group="", rank=rank, ok=False,
                            max_error=float("inf"), tolerance=0.0, kind="load",
                            message=f"{self.where}: rank {rank}'s loader {why}")
                for rank, target, why in self.loader_faults]

    def _check(self, **fields: Any) -> Check:
        """A check of this build's topology."""
        build = self.build
        return Check(tp=build.tp, pp=build.pp, ep=build.ep, etp=build.etp, **fields)

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
        tolerance = tolerance_of(want)
        targets = session.targets(module)
        omitted = [t for t in targets if not any(t in m for m in self.masks)]
        if omitted:  # no rank loads them (the family's `omit:`)
            if len(omitted) == len(targets) and session.reaches_logits(module) is False:
                return self._check(module=module, group="", rank=None, ok=True,
                                   max_error=0.0, tolerance=tolerance)  # run, never used
            return self._fail(module, "", None, float("inf"), tolerance,
                              "no rank loads " + ", ".join(f"`{t}`" for t in omitted)
                              + " (the family omits " + ("it" if len(omitted) == 1 else "them")
                              + "), but the module runs them and the logits depend on it")
        split = [t for t in targets if not self.whole[t]]
        groups = self._groups(split)
        if not split:
            for rank, model in enumerate(self.models):
                error = largest_error(session.run(model, module), want)
                if error > tolerance:
                    return self._fail(module, "", self.ranks[rank], error, tolerance,
                                      "its tensors are whole on every rank, but the rank's "
                                      "output differs from the full module's")
            return self._check(module=module, group=", ".join(self._groups(targets)),
                               rank=None, ok=True, max_error=0.0, tolerance=tolerance)
        norms = self._reduced_norms(module, split)
        outputs = self._reduced_outputs(module, split)
        if norms or outputs:  # the engine all-reduces these: so does the check
            total = sum(self._run_reduced(module, norms, outputs))
        else:
            total = sum(session.run(m, module) for m in self.models)
        if self.shared_model is not None:
            total = total - (tp - 1) * session.run(self.shared_model, module)
        error = largest_error(total, want)
        if error <= tolerance:
            return self._check(module=module, group=", ".join(groups), rank=None,
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

    def _reduced_outputs(self, module: str, targets: Sequence[str]) -> list[str]:
        """Submodules of `module` holding a split tensor whose output the engine all-reduces
        over the TP group inside the module (a row projection declared `reduction:
        tensor_parallel`, Mamba's `x_proj`)."""
        found: list[str] = []
        for target in targets:
            layouts = [state.layout[target] for state in self.build.states
                       if target in state.layout]
            path = target.rsplit(".", 1)[0]
            if any(x.needs_tp_output_reduction for x in layouts) \
                    and path.startswith(module + ".") and path not in found:
                found.append(path)
        return found

    def _run_reduced(self, module: str, norms: Sequence[str],
                     projections: Sequence[str] = ()) -> list[Any]:
        """Each rank's output of `module` with the RMS statistic of every norm in `norms` taken
        over all ranks' pieces, and the output of every projection in `projections` summed over
        the ranks (the all-reduces an engine does), not the rank's own.

        A first pass records each rank's sum of squares at each norm's input and each rank's
        partial output of each reduced projection; the second rescales each norm's output by
        sqrt((own + eps) / (all + eps)) (mean squares over the full width): the RMSNorm the
        whole model computes, restricted to the rank's rows, and replaces each reduced
        projection's output by the sum of every rank's.
        """
        torch, session = self.session.torch, self.session
        sums: list[dict[str, Any]] = [{} for _ in self.models]
        partial: list[dict[str, Any]] = [{} for _ in self.models]

        def record(rank: int, path: str) -> Any:
            def hook(_: Any, args: Any, output: Any) -> None:
                x = args[0].float()
                if len(args) > 1 and args[1] is not None:  # a gated norm: x * silu(gate)
                    x = x * torch.nn.functional.silu(args[1].float())
                sums[rank][path] = x.pow(2).sum(-1, keepdim=True)
            return hook

        def keep(rank: int, path: str) -> Any:
            def hook(_: Any, args: Any, output: Any) -> None:
                partial[rank][path] = output.detach().clone()
            return hook

        def summed(path: str) -> Any:
            def hook(_: Any, args: Any, output: Any) -> Any:
                return sum(p[path] for p in partial).to(output.dtype)
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
                for path in projections:
                    handles.append(model.get_submodule(path).register_forward_hook(
                        keep(rank, path) if make else summed(path)))
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
            alone = largest_error(sum(outs) - (tp - 1) * shared, want)
            if alone <= tolerance:
                continue
            for rank in range(tp):
                others = [m for r, m in enumerate(self.masks) if r != rank]
                rest = session.run(session.model_of(self._masked(mine, others)), module) \
                    if others else 0
                separable = largest_error(outs[rank] + rest - shared, want) if others else alone
                if separable > tolerance:
                    return self._fail(module, group, self.ranks[rank], alone, tolerance,
                                      "the rank's part of the group is not separable from the "
                                      "other ranks' (rank + the others - the shared part "
                                      f"differs by {separable:.3g})"
                                      + self._whole_norms(module, targets, mine))
            return self._fail(module, group, None, alone, tolerance,
                              "the ranks' parts of the group do not add up to the full module"
                              + self._whole_norms(module, targets, mine))
        return self._fail(module, ", ".join(groups), None, error, tolerance,
                          "the ranks' parts do not add up to the full module, though each "
                          "group alone does")

    def _whole_norms(self, module: str, targets: Sequence[str], split: Sequence[str]) -> str:
        """A hint when `module` also runs a norm kept whole that is as wide as a split axis of
        the failing group (OLMo-2's q_norm over a split q_proj): the norm's statistic then
        spans the ranks, and the culprit is the norm's declaration, not the group's split."""
        widths: set[int] = set()
        for target in split:
            layouts = [st.layout[target] for st in self.build.states if target in st.layout]
            for x in layouts:
                widths.update(g for g, loc in zip(x.global_shape, x.local_shape, strict=True)
                              if g != loc)
        found: dict[str, str] = {}  # path -> its group
        for target in targets:
            path = target.rsplit(".", 1)[0]
            if target in split or not self.whole[target] or "norm" not in path.rsplit(".", 1)[-1]:
                continue
            shape = self.session.shapes[target]
            if len(shape) == 1 and shape[0] in widths:
                found.setdefault(path, ", ".join(self._groups([target])))
        if not found or not self._norms_explain(module, list(found)):
            return ""
        named = " and ".join(f"`{path}` (group `{group}`)" for path, group in found.items())
        return (f"; the module also runs {named}, kept whole although as wide as "
                "the split: a norm whose statistic spans split rows goes in that group, split "
                "with them and declared `reduction: tensor_parallel` (docs/verify.md)")

    def _norms_explain(self, module: str, norms: list[str]) -> bool:
        """Whether the module's ranks add up once the statistic of each of `norms` is taken
        over all ranks (the all-reduce `reduction: tensor_parallel` asks for): only then is a
        whole norm the cause of a failure, not, say, a fused projection's wrong layout."""
        session, tp = self.session, self.build.tp
        want = session.captured[module][2]
        total = sum(self._run_reduced(module, norms))
        if self.shared_model is not None:
            total = total - (tp - 1) * session.run(self.shared_model, module)
        return bool(largest_error(total, want) <= tolerance_of(want))

    def _fail(self, module: str, group: str, rank: int | None, error: float,
              tolerance: float, why: str) -> Check:
        where = f"rank {rank}" if rank is not None else \
            f"ranks {self.ranks[0]}-{self.ranks[-1]}"
        return self._check(module=module, group=group, rank=rank, ok=False,
                           max_error=error, tolerance=tolerance,
                           message=f"{self.where}: module `{module}`"
                                   f"{f' (group `{group}`)' if group else ''}, {where}: {why}; "
                                   f"max abs error {error:.3g}, tolerance {tolerance:.3g}")
