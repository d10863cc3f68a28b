"""Quantized families verified in their storage format.

When the config names a linear storage format (`quantization_config` FP8 or MXFP4, mlx_lm's
`quantization`), the dense seeded reference model is encoded the way that format stores it
(`partc.verify.quantized_formats`: which tensors its own implementation converts, and how),
decoded again with the format's own dequantization into the dense reference every module is
checked against, and every build is compiled for and loaded from the *stored* checkpoint. Each
rank's stored weights are then decoded from the rank's own slices, the weight with the
companions (scales, biases) the rank loaded beside it, as an engine's kernel reads them:

- a companion slice that does not cover the rank's weight slice block for block (a scale split
  on the other axis, or not loaded with its weight) is a failed check naming the tensors;
- the decoded slice must equal the dense reference on the elements the rank holds (exactly:
  both are the same elementwise float32 operations on the same values); a companion slice of
  the right shape but of other blocks is a failed check there;
- the decoded slices stand in for the rank's tensors in the module checks, which then hold
  within their usual tolerance.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from partc.verify.arrays import scatter
from partc.verify.quantized_formats import (
    Selection,
    StorageFormat,
    decode,
    dense_selection,
    encode,
    expected_companion_shape,
    numpy_of,
    quantization_keys,
    storage_format,
)
from partc.verify.reference import load_config, load_model, parameter_sources, require_libraries
from partc.verify.results import Check

DOC = "docs/verify.md#quantized-formats"
"""Where the storage-format checks are described."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseLayout:
    """A decoded weight's layout on one rank, as the module checks read a loaded layout."""

    target: str
    """The dense on-disk name."""
    logical_name: str
    """The weight's parameter group."""
    global_shape: tuple[int, ...]
    """The dense weight's shape."""
    local_shape: tuple[int, ...]
    """The decoded slice's shape."""
    selection: Selection
    """The dense elements the slice holds."""
    is_whole: bool
    """Whether the rank holds the whole weight."""
    needs_tp_reduction: bool = False
    """As the stored weight's layout says."""
    needs_tp_output_reduction: bool = False
    """As the stored weight's layout says."""


class DenseLayouts:
    """A rank's layouts with every stored weight replaced by its decoded dense layout."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tuple(tensors)
        self._index = {t.target: t for t in self.tensors}

    def __getitem__(self, target: str) -> Any:
        return self._index[target]

    def __contains__(self, target: object) -> bool:
        return target in self._index

    @property
    def targets(self) -> tuple[str, ...]:
        """Targets in order."""
        return tuple(t.target for t in self.tensors)


@dataclass(frozen=True, slots=True)
class DenseState:
    """A rank's loaded state with every stored weight decoded from its own slices."""

    tensors: dict[str, Any]
    """Local tensors by dense name."""
    layout: DenseLayouts
    """Their layouts."""


def _spelled(selection: Selection) -> str:
    axis, ranges = selection
    if axis is None:
        return "whole"
    return f"axis {axis} " + ", ".join(f"{a}:{b}" for a, b in ranges)


class StoredReference:
    """The reference checkpoint in the config's storage format, and each rank decoded."""

    def __init__(self, fmt: StorageFormat, folder: Path, encoded: dict[str, dict[str, str]],
                 dense: dict[str, np.ndarray]) -> None:
        self.format = fmt
        self.folder = folder
        """The stored checkpoint (config.json with the quantization keys, model.safetensors)."""
        self.encoded = encoded
        """Dense on-disk name -> its stored tensors by part (`weight`, `scale`, `bias`)."""
        self.dense = dense
        """The dense reference (decoded), by on-disk name."""
        self._part_of = {stored: (name, part) for name, parts in encoded.items()
                         for part, stored in parts.items()}

    def dense_states(self, states: tuple[Any, ...], tp: int, pp: int,
                     experts: tuple[int, int] | None = None
                     ) -> tuple[tuple[DenseState, ...], list[Check]]:
        """Every rank's state with its stored weights decoded from its own slices, and the
        checks of the decoding: one per rank (its weights equal the reference's), or a failed
        one per weight whose companions do not follow it. `experts`: (E, X) of an
        expert-parallel build, recorded on its checks."""
        ep, etp = experts if experts else (None, None)
        topology = f"T={tp} x S={pp}" + (f" x EP={ep}" if ep else "") + (
            f" x ETP={etp}" if etp and etp > 1 else "")
        dense_states: list[DenseState] = []
        checks: list[Check] = []
        for rank, state in enumerate(states):
            tensors: dict[str, Any] = {}
            layouts: list[Any] = []
            failed = len(checks)
            decoded = 0
            seen: set[str] = set()
            for layout in state.layout.tensors:
                found = self._part_of.get(layout.target)
                if found is None:
                    tensors[layout.target] = state.tensors[layout.target]
                    layouts.append(layout)
                    continue
                name = found[0]
                if name in seen:
                    continue
                seen.add(name)
                result = self._decoded(name, state, rank, topology, (tp, pp, ep, etp))
                if isinstance(result, Check):
                    checks.append(result)
                    continue
                tensors[name], dense_layout = result
                layouts.append(dense_layout)
                decoded += 1
            if len(checks) == failed:
                checks.append(Check(tp=tp, pp=pp, module=f"{self.format.kind} storage", group="",
                                    rank=rank, ok=True, max_error=0.0, tolerance=0.0, ep=ep,
                                    etp=etp,
                                    message=f"{decoded} stored weights decoded from the rank's "
                                            "own slices equal the reference's"))
            dense_states.append(DenseState(tensors=tensors, layout=DenseLayouts(layouts)))
        return tuple(dense_states), checks

    @property
    def _units(self) -> str:
        """What one scale covers, in words."""
        if self.format.kind == "block_fp8":
            return f"{list(self.format.block)} blocks"
        if self.format.kind == "mxfp4":
            return "32-element blocks"
        return f"groups of {self.format.group_size}"

    @staticmethod
    def _held(target: str, state: Any) -> str:
        """What a rank loads of a stored tensor, in words."""
        layout = state.layout[target]
        return (f"`{target}` as {list(layout.local_shape)} ({_spelled(layout.selection)} "
                f"of {list(layout.global_shape)})")

    def _decoded(self, name: str, state: Any, rank: int, topology: str,
                 sizes: tuple[int, int, int | None, int | None]
                 ) -> tuple[np.ndarray, DenseLayout] | Check:
        """One weight of one rank decoded from its own stored slices, or the failed check
        (at `topology`, spelled, of `sizes` T, S, E, X)."""
        parts = self.encoded[name]
        weight = state.layout[parts["weight"]] if parts["weight"] in state.layout else None
        tp, pp, ep, etp = sizes

        def fail(why: str, error: float = float("inf")) -> Check:
            group = weight.logical_name if weight is not None else next(
                state.layout[p].logical_name for p in parts.values() if p in state.layout)
            return Check(tp=tp, pp=pp, module=name, group=group, rank=rank, ok=False,
                         max_error=error, tolerance=0.0, ep=ep, etp=etp,
                         message=f"{topology}: rank {rank} {why} ({self.format.spelled}; {DOC})")

        missing = [p for p in parts.values() if p not in state.layout]
        if missing:
            held = [p for p in parts.values() if p in state.layout]
            return fail(f"loads {', '.join(f'`{p}`' for p in held)} but not "
                        f"{', '.join(f'`{p}`' for p in missing)}: a stored weight is decoded "
                        "with its companions, so a rank holds them together")
        assert weight is not None
        local = {part: np.asarray(state.tensors[stored]) for part, stored in parts.items()}
        want = expected_companion_shape(self.format, tuple(local["weight"].shape))
        for part, stored in parts.items():
            if part != "weight" and tuple(local[part].shape) != want:
                return fail(f"loads {self._held(parts['weight'], state)} but "
                            f"{self._held(stored, state)}: the {self._units} of the rank's "
                            f"weight slice need a {list(want)} slice of `{stored}`, split with "
                            "its weight's blocks")
        shape = tuple(self.dense[name].shape)
        selection = dense_selection(self.format, weight.selection, len(shape))
        if selection is None:
            return fail(f"loads {self._held(parts['weight'], state)}: a slice inside a "
                        "block, which no rank can decode")
        values = decode(self.format, local)
        try:
            placed = scatter(shape, selection, values)
        except ValueError:  # numpy: the decoded slice does not fit where its weight slice is
            return fail(f"loads {self._held(parts['weight'], state)}, which decodes to "
                        f"{list(values.shape)}: not the dense elements its slice names")
        mask = scatter(shape, selection, np.ones(values.shape, bool))
        error = float(np.abs(placed[mask] - self.dense[name][mask]).max(initial=0.0))
        if error > 0.0 or values.size != int(mask.sum()):
            companions = " and ".join(self._held(p, state) for k, p in parts.items()
                                      if k != "weight")
            return fail(f"loads {self._held(parts['weight'], state)}, which decoded with "
                        f"{companions} differs from the reference weight on those elements "
                        f"(max abs error {error:.3g}): the companion slice holds the "
                        f"{self._units} of other elements than its weight's; split it with its "
                        "weight's blocks", error)
        return values, DenseLayout(
            target=name, logical_name=weight.logical_name, global_shape=shape,
            local_shape=tuple(values.shape), selection=selection, is_whole=weight.is_whole,
            needs_tp_reduction=weight.needs_tp_reduction,
            needs_tp_output_reduction=weight.needs_tp_output_reduction)


def _encoded_tensors(fmt: StorageFormat, model: Any,
                     sources: dict[str, tuple[str, ...]]) -> list[str]:
    """The on-disk tensors the format's own implementation converts: transformers' FP8
    integration every `nn.Linear` and `.experts` module (their weights), its MXFP4 integration
    gpt-oss's experts, mlx_lm every `nn.Linear` and `nn.Embedding` whose input width is a
    multiple of the group size; the FP8 and MXFP4 ones less `modules_to_not_convert`
    (default: transformers' own, the output head)."""
    torch, _ = require_libraries()
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skips = list(fmt.not_converted) if fmt.not_converted is not None \
        else get_keys_to_not_convert(model)
    linear, embedding = torch.nn.Linear, torch.nn.Embedding
    found: list[str] = []
    for path, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if fmt.kind == "mlx_affine":
            chosen = ["weight"] if type(module) in (linear, embedding) and \
                own["weight"].shape[-1] % fmt.group_size == 0 else []
        elif not should_convert_module(path, skips):
            chosen = []
        elif fmt.kind == "block_fp8" and type(module) is linear:
            chosen = ["weight"]
        elif path.endswith(".experts") and (fmt.kind == "block_fp8" or type(
                model.get_submodule(path.rsplit(".", 1)[0])).__name__ == "GptOssMLP"):
            chosen = [n for n, p in own.items() if p.dim() >= 3]
        else:
            chosen = []
        for parameter in chosen:
            found.extend(s for s in sources.get(f"{path}.{parameter}", ()) if s not in found)
    return sorted(found)


def _mtp_counterparts(tensors: list[str], encoded: set[str], config: dict[str, Any]
                      ) -> set[str]:
    """The multi-token-prediction layers' tensors to encode (`model.layers.{N + i}`, which
    transformers does not build, added by `partc.verify.mtp`): those whose counterpart in the
    last decoder layer is encoded, as DeepSeek-V3's release stores its MTP block with the
    decoder's FP8 convention (its `eh_proj`, embedding, norms and head stay dense)."""
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        return set()
    found = set()
    for name in tensors:
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match and int(match.group(1)) >= layers and \
                f"model.layers.{layers - 1}.{match.group(2)}" in encoded:
            found.add(name)
    return found


def stored_reference(config: dict[str, Any], folder: Path, work: Path,
                     notes: list[str]) -> StoredReference | None:
    """The reference checkpoint in folder re-stored in the storage format the user's `config`
    names (None: dense): folder then holds the decoded dense reference, the stored one is
    written beside it. A note says what was encoded."""
    fmt = storage_format(config, shrunk=any(n.startswith("shrunk") for n in notes))
    if fmt is None:
        return None
    torch, _ = require_libraries()
    from safetensors.torch import load_file, save_file

    source = work / "dense-source"
    shutil.move(str(folder), str(source))
    tensors = load_file(str(source / "model.safetensors"))
    sources = parameter_sources(source, sorted(tensors))
    names = _encoded_tensors(fmt, load_model(source), sources)
    names = sorted({*names, *_mtp_counterparts(sorted(tensors), set(names),
                                               load_config(source / "config.json").data)})
    stored: dict[str, Any] = {k: v for k, v in tensors.items() if k not in names}
    encoded: dict[str, dict[str, str]] = {}
    dense = {k: v.numpy() for k, v in tensors.items()}
    for name in names:
        parts = encode(fmt, tensors[name])
        encoded[name] = {part: fmt.companions(name)[part] for part in parts}
        stored.update({encoded[name][part]: value for part, value in parts.items()})
        dense[name] = decode(fmt, {part: numpy_of(value) for part, value in parts.items()})
    out = work / "stored"
    out.mkdir()
    data = dict(load_config(source / "config.json").data)
    data.update(quantization_keys(fmt, config))
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")
    save_file({k: v.contiguous() for k, v in sorted(stored.items())},
              str(out / "model.safetensors"),
              metadata={"format": "mlx" if fmt.kind == "mlx_affine" else "pt"})
    folder.mkdir()
    shutil.copyfile(source / "config.json", folder / "config.json")
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sorted(dense.items())},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    notes.append(f"the reference checkpoint is stored as {fmt.spelled}: {len(names)} tensors "
                 "encoded as the format's own implementation converts them; the dense reference "
                 "is their decoding, and each rank's stored weights are decoded from its own "
                 "slices")
    return StoredReference(fmt, out, encoded, dense)

