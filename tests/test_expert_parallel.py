"""Expert parallelism: what the generated loaders of an `--ep` build load reproduces HF.

Each tiny MoE fixture is compiled with its built-in family at an expert-parallel topology and
loaded on every rank through the generated package. The numpy executor (tests/executor) runs
each pipeline stage: the dense parts on the ranks of dense replica 0 (the other replicas'
dense copies are checked byte-equal to them and take part in the routed experts only), every
routed expert on the ranks that hold it, redundant copies counted once. Logits must match HF's
`reference.npz` (or `reference_dequant.npz` for the quantized fixtures).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from partc.plan.ranks import KindIndex

from executor import RankShard, Selection, dequantize, forward_pipeline
from support import QUANTIZED, compile_and_import, hf

TOLERANCE = 1e-4
EXPERT = re.compile(r"\.experts\.(\d+)\.")

# (fixture, E, T, S, X, placement): every family, E in {2, 4, 8}, T in {1, 2}, S in {1, 2},
# balanced, explicit and redundant placements (mixtral and gpt_oss have 4 experts: E = 8 needs
# each expert twice).
CASES = [
    ("qwen3_moe", 2, 1, 1, 1, "balanced"),
    ("qwen3_moe", 4, 2, 2, 1, "balanced"),
    ("qwen3_moe", 8, 2, 1, 1, "balanced"),
    ("qwen3_moe", 2, 2, 1, 2, "balanced"),
    ("qwen3_moe", 4, 1, 1, 1, "redundant"),
    ("mixtral", 2, 2, 2, 1, "balanced"),
    ("mixtral", 4, 1, 1, 1, "explicit"),
    ("mixtral", 8, 2, 1, 1, "redundant"),
    ("mixtral", 4, 2, 1, 2, "redundant"),
    ("deepseek_v3", 8, 1, 1, 1, "balanced"),
    ("deepseek_v3", 2, 2, 2, 1, "explicit"),
    ("deepseek_v3", 4, 1, 2, 1, "redundant"),
    ("gpt_oss", 2, 1, 1, 1, "balanced"),
    ("gpt_oss", 2, 2, 2, 1, "explicit"),
    ("gpt_oss", 8, 2, 1, 1, "redundant"),
    ("gpt_oss", 4, 1, 2, 1, "explicit"),
    # DBRX's fused [E * I, H] experts: an EP rank holds whole expert blocks of w1 / v1 / w2
    ("dbrx", 2, 1, 1, 1, "balanced"),
    ("dbrx", 4, 2, 2, 1, "balanced"),
    ("dbrx", 2, 2, 1, 1, "explicit"),  # (a stacked group refuses --etp > 1)
    ("dbrx", 4, 1, 2, 1, "redundant"),
]
CASE_IDS = [f"{f}-ep{e}-tp{t}-pp{s}-etp{x}-{p}" for f, e, t, s, x, p in CASES]
QUANTIZED_CASES = [("gpt_oss_mxfp4", 2, 1, 1, 1, "explicit"),
                   ("deepseek_v3_fp8", 4, 2, 1, 1, "redundant")]


def experts_of(config: dict[str, Any]) -> int:
    """The routed experts of an HF config (DBRX: `ffn_config.moe_num_experts`)."""
    if config["model_type"] == "dbrx":
        return int(config["ffn_config"]["moe_num_experts"])
    return int(next(config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if config.get(k)))


def placement(kind: str, experts: int, ep: int) -> list[list[int]] | None:
    """A placement file's `ranks` (None: the balanced default).

    explicit: experts dealt round-robin (non-contiguous, every expert once); redundant: the
    round-robin deal plus expert 0 (and, when E exceeds the experts, every expert again)."""
    if kind == "balanced":
        return None
    ranks = [[e for e in range(experts) if e % ep == r] for r in range(ep)]
    if kind == "redundant":
        for r in range(ep):
            extra = {0, r % experts}
            ranks[r] = sorted(set(ranks[r]) | extra)
    return ranks


def build(tmp_path: Path, folder: Path, ep: int, tp: int, pp: int, etp: int,
          kind: str) -> tuple[Any, list[Any], list[Any], list[list[int]] | None]:
    """Compile, import and load every rank: (plan, rank modules, loaded states, placement)."""
    config = json.loads((folder / "config.json").read_text())
    slots = placement(kind, experts_of(config), ep)
    options: dict[str, Any] = {"expert_parallel_size": ep, "expert_tensor_parallel_size": etp}
    if slots is not None:
        path = tmp_path / "placement.json"
        path.write_text(json.dumps({"ranks": slots}))
        options["expert_placement"] = path
    plan, package = compile_and_import(None, folder / "config.json", tmp_path / "build",
                                       tp=tp, pp=pp, **options)
    try:
        modules = [package.rank_module(r) for r in range(plan.topology.world_size)]
        states = [m.load(folder) for m in modules]
    finally:
        for name in [m for m in sys.modules if m.startswith(package.__name__)]:
            del sys.modules[name]
    return plan, modules, states, slots


def expert_targets(plan: Any) -> set[str]:
    """Checkpoint names of the routed-expert groups (realized per ETP or local rank)."""
    return {t for g in plan.groups if plan.kinds[g.kind].index is not KindIndex.TENSOR
            for t in g.targets}


def shard(tensors: dict[str, np.ndarray], state: Any, experts_only: bool) -> RankShard:
    """An executor rank from dense arrays (by checkpoint name) and the layout's selections."""
    selections = {}
    for name in tensors:
        axis, ranges = state.layout[name].selection
        selections[name] = None if axis is None else Selection(axis=axis, ranges=ranges)
    return RankShard(tensors=tensors, selections=selections, experts_only=experts_only)


def dequantized(config: dict[str, Any], state: Any) -> tuple[dict[str, np.ndarray], Any]:
    """A quantized rank's arrays decoded locally, and a layout view giving dense selections
    (FP8 keeps the stored selection; MXFP4 blocks on the expert axis keep it too)."""
    dense = dequantize(config, dict(state.tensors))

    class _Layouts:
        def __getitem__(self, name: str) -> Any:
            layout = state.layout[name if name in state.tensors else f"{name}_blocks"]
            axis, ranges = layout.selection
            if name in state.tensors and axis is not None:
                factor = dense[name].shape[axis] // state.tensors[name].shape[axis]
                ranges = tuple((a * factor, b * factor) for a, b in ranges)
            assert axis in (None, 0) or name in state.tensors, name
            return type("L", (), {"selection": (axis, ranges)})()

    return dense, type("S", (), {"layout": _Layouts()})()


def stage_ranks(plan: Any, states: list[Any], dense_arrays: list[dict[str, np.ndarray]],
                views: list[Any]) -> list[list[RankShard]]:
    """Each stage's executor ranks: dense replica 0 whole, the other replicas' experts only
    (after checking their dense copies equal replica 0's)."""
    stored = expert_targets(plan)  # a dequantized MXFP4 weight is named after its blocks
    experts = stored | {name.removesuffix("_blocks") for name in stored}
    n = plan.expert_parallel.ranks_per_stage
    tp = plan.topology.tensor_parallel_size
    stages = []
    for stage in range(plan.topology.pipeline_parallel_size):
        ranks = []
        for local in range(n):
            g = stage * n + local
            arrays = dense_arrays[g]
            if local < tp:
                ranks.append(shard(arrays, views[g], experts_only=False))
                continue
            twin = dense_arrays[stage * n + local % tp]
            dense = {k for k in arrays if k not in experts}
            assert dense == {k for k in twin if k not in experts}
            for name in dense:
                assert arrays[name].tobytes() == twin[name].tobytes(), name
                assert states[g].layout[name].selection == \
                    states[stage * n + local % tp].layout[name].selection
            ranks.append(shard({k: v for k, v in arrays.items() if k in experts}, views[g],
                               experts_only=True))
        stages.append(ranks)
    return stages


def stage_layers(plan: Any) -> list[range]:
    """The decoder layers of each stage."""
    n = plan.expert_parallel.ranks_per_stage
    out: list[range] = []
    for stage in range(plan.topology.pipeline_parallel_size):
        groups = {g.group: g.unit_range for g in plan.ranks[stage * n].partition.groups}
        start, end = groups.get("decoder", (out[-1].stop, out[-1].stop) if out else (0, 0))
        out.append(range(start, end))
    return out


def check_expert_map(plan: Any, modules: list[Any], states: list[Any],
                     slots: list[list[int]] | None, experts: int) -> None:
    """Each rank's expert map and loaded experts follow the placement."""
    ep = plan.expert_parallel.expert_parallel_size
    want = slots
    if want is None:  # balanced contiguous ranges, computed independently of partc
        base, extra = divmod(experts, ep)
        starts = [r * base + min(r, extra) for r in range(ep + 1)]
        want = [list(range(starts[r], starts[r + 1])) for r in range(ep)]
    for module, state in zip(modules, states, strict=True):
        mapping = module.expert_map()
        mine = want[mapping.expert_parallel_rank]
        assert list(mapping.local_experts) == mine
        for expert in range(experts):
            holders = [r for r in range(ep) if expert in want[r]]
            assert [h for h, _ in mapping.owners[expert]] == holders
            assert all(want[h][slot] == expert for h, slot in mapping.owners[expert])
        loaded = {int(m.group(1)) for name in state.tensors if (m := EXPERT.search(name))}
        assert loaded <= set(mine)
        info = module.info()
        assert info.local_experts == len(mine)
        assert info.expert_parallel_rank == mapping.expert_parallel_rank
        stacked = [n for n in state.tensors if n.endswith("mlp.experts.gate_up_proj")
                   or n.endswith("mlp.experts.gate_up_proj_blocks")]
        for name in stacked:
            axis, ranges = state.layout[name].selection
            assert axis == 0
            assert [i for a, b in ranges for i in range(a, b)] == mine
        # DBRX's fused [E * I, H] tensors: rows of whole expert blocks, in expert-id order
        fused = [n for n in state.tensors if n.endswith(("mlp.w1", "mlp.v1", "mlp.w2"))]
        for name in fused:
            axis, ranges = state.layout[name].selection
            rows = state.layout[name].global_shape[0] // experts
            assert axis == 0
            blocks = [i // rows for a, b in ranges for i in range(a, b)]
            assert sorted(set(blocks)) == sorted(mine)


@pytest.mark.parametrize(("name", "ep", "tp", "pp", "etp", "kind"), CASES, ids=CASE_IDS)
def test_expert_parallel_ranks_reproduce_hf_logits(tmp_path: Path, name: str, ep: int, tp: int,
                                                   pp: int, etp: int, kind: str) -> None:
    folder = hf(name)
    config = json.loads((folder / "config.json").read_text())
    plan, modules, states, slots = build(tmp_path, folder, ep, tp, pp, etp, kind)
    assert plan.topology.world_size == ep * etp * pp
    check_expert_map(plan, modules, states, slots, experts_of(config))
    arrays = [{k: np.asarray(v, dtype=np.float32) for k, v in s.tensors.items()}
              for s in states]
    stages = stage_ranks(plan, states, arrays, states)
    with np.load(folder / "reference.npz") as npz:
        reference = {k: npz[k] for k in npz.files}
    result = forward_pipeline(config, stages, stage_layers(plan), reference["input_ids"])
    err = np.max(np.abs(result.logits - reference["logits"])) / np.max(
        np.abs(reference["logits"]))
    assert err < TOLERANCE


@pytest.mark.parametrize(("name", "ep", "tp", "pp", "etp", "kind"), QUANTIZED_CASES,
                         ids=[f"{c[0]}-ep{c[1]}-tp{c[2]}" for c in QUANTIZED_CASES])
def test_quantized_expert_parallel_ranks_reproduce_hf_dequantized_logits(
        tmp_path: Path, name: str, ep: int, tp: int, pp: int, etp: int, kind: str) -> None:
    folder = QUANTIZED / name
    config = json.loads((folder / "config.json").read_text())
    plan, modules, states, slots = build(tmp_path, folder, ep, tp, pp, etp, kind)
    check_expert_map(plan, modules, states, slots, experts_of(config))
    decoded = [dequantized(config, s) for s in states]
    stages = stage_ranks(plan, [v for _, v in decoded], [d for d, _ in decoded],
                         [v for _, v in decoded])
    with np.load(folder / "reference_dequant.npz") as npz:
        reference = {k: npz[k] for k in npz.files}
    result = forward_pipeline(config, stages, stage_layers(plan), reference["input_ids"])
    err = np.max(np.abs(result.logits - reference["logits"])) / np.max(
        np.abs(reference["logits"]))
    assert err < TOLERANCE
