"""Helpers shared by the state-space family tests (test_ssm, test_bamba, test_jamba): the
relative error against HF's reference, the indices a selection takes, and one build of a
fixture's ranks run through the numpy executor's pipeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from . import compile_and_load, hf
from executor import RankShard, forward, forward_pipeline, load_fixture

TOLERANCE = 1e-4
"""Relative error allowed between the executor's outputs and HF's."""


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest absolute difference relative to the largest magnitude of `expected`."""
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def assert_hf_cache_on(produced: np.ndarray, cache: np.ndarray, held: Any) -> None:
    """`produced` (a rank's state) equals HF's `cache` [batch, ...] on the indices `held` of
    its first axis after the batch (rtol 1e-4, atol 1e-5)."""
    np.testing.assert_allclose(produced, cache[:, held], rtol=1e-4, atol=1e-5)


def indices(selection: tuple[Any, Any], length: int) -> list[int]:
    """The indices along the split axis a (axis, ranges) selection takes (all when whole)."""
    axis, ranges = selection
    if axis is None:
        return list(range(length))
    return [i for a, b in ranges for i in range(a, b)]


def reference(folder: Path) -> dict[str, np.ndarray]:
    """The arrays of a fixture's `reference.npz` (HF's logits, layer outputs and cache)."""
    with np.load(folder / "reference.npz") as npz:
        return {k: npz[k] for k in npz.files}


def stage_layers(plan: Any, stage: int) -> range:
    """The decoder layers the plan gives pipeline stage `stage`."""
    tp = plan.topology.tensor_parallel_size
    start, end = {g.group: g.unit_range
                  for g in plan.ranks[stage * tp].partition.groups}["decoder"]
    return range(start, end)


def run_ranks(name: str, out: Path, tp: int, pp: int) -> tuple[Any, list[Any], Any, dict[str, Any]]:
    """Fixture `name` compiled with its built-in family at (tp, pp) into `out`, every rank
    loaded and the ranks run by the executor's pipeline: (plan, loaded states, executor
    result, HF's reference)."""
    folder = hf(name)
    ref = reference(folder)
    config = json.loads((folder / "config.json").read_text())
    plan, states = compile_and_load(None, folder / "config.json", out,
                                    folder / "model.safetensors", tp=tp, pp=pp)
    stages = [[RankShard.of_state(s) for s in states[p * tp:(p + 1) * tp]] for p in range(pp)]
    layers = [stage_layers(plan, p) for p in range(pp)]
    result = forward_pipeline(config, stages, layers, ref["input_ids"])
    return plan, states, result, ref


def whole_model_run(name: str, n_layers: int) -> tuple[Any, dict[str, np.ndarray]]:
    """The executor's whole-model forward of fixture `name`, checked against HF's logits and
    each of its `n_layers` layer outputs: (executor result, HF's reference)."""
    config, tensors, ref = load_fixture(name)
    result = forward(config, tensors, ref["input_ids"])
    assert rel_err(result.logits, ref["logits"]) < TOLERANCE
    for layer in range(n_layers):
        assert rel_err(result.layer_outputs[layer], ref["layer_outputs"][layer]) < TOLERANCE
    return result, ref
