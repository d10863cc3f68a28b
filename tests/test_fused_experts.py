"""Fused per-expert 2-D tensors (DBRX `[E * I, H]`) and the `grouped` fused layout (CodeGen),
on the real transformers fixtures (issue 35).

The oracles are the safetensors files read by the safetensors library and the row meaning
transformers' modeling code gives them: DBRX views `w1` as `[E, I, H]` (`DbrxExperts.forward`,
`view(-1, ffn_hidden_size, hidden_size)[expert]`), CodeGen views `qkv_proj`'s output as
`mp_num` groups of `[q | v | k]` (`CodeGenAttention.forward`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from partc.api import check_family

from support import ROOT, compile_and_import, compile_and_load, hf

ARCHITECTURES = ROOT / "architectures"
EXPERTS = "transformer.blocks.{}.ffn.experts.mlp.{}"


def _dbrx() -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((hf("dbrx") / "config.json").read_text())
    return config, load_file(str(hf("dbrx") / "model.safetensors"))


@pytest.mark.parametrize("tp", [2, 4])
def test_every_tp_rank_takes_the_same_channels_inside_every_dbrx_expert_block(tmp_path, tp):
    config, full = _dbrx()
    experts, inner = (config["ffn_config"]["moe_num_experts"],
                      config["ffn_config"]["ffn_hidden_size"])
    _, states = compile_and_load(ARCHITECTURES / "dbrx.yaml", hf("dbrx") / "config.json",
                                 tmp_path / "build", hf("dbrx"), tp=tp)
    for rank, state in enumerate(states):
        channels = slice(rank * inner // tp, (rank + 1) * inner // tp)
        for part in ("w1", "v1", "w2"):
            name = EXPERTS.format(1, part)
            blocks = full[name].reshape(experts, inner, -1)  # HF: view(-1, I, H)[expert]
            want = blocks[:, channels].reshape(-1, blocks.shape[-1])
            np.testing.assert_array_equal(np.asarray(state.tensors[name]), want)


def test_dbrx_expert_parallel_places_whole_expert_blocks_and_maps_expert_ids(tmp_path):
    config, full = _dbrx()
    experts, inner = (config["ffn_config"]["moe_num_experts"],
                      config["ffn_config"]["ffn_hidden_size"])
    plan, package = compile_and_import(ARCHITECTURES / "dbrx.yaml", hf("dbrx") / "config.json",
                                       tmp_path / "build", tp=1, expert_parallel_size=2)
    try:
        modules = [package.rank_module(r) for r in range(2)]
        states = [m.load(hf("dbrx")) for m in modules]
    finally:
        for name in [m for m in sys.modules if m.startswith(package.__name__)]:
            del sys.modules[name]
    assert plan.expert_parallel.placement.experts == experts  # 4 experts, not 128 rows
    for module, state in zip(modules, states, strict=True):
        mapping = module.expert_map()
        assert mapping.experts == experts
        mine = list(mapping.local_experts)
        assert mine == [2 * mapping.expert_parallel_rank, 2 * mapping.expert_parallel_rank + 1]
        for part in ("w1", "v1", "w2"):
            name = EXPERTS.format(0, part)
            want = full[name].reshape(experts, inner, -1)[mine].reshape(-1, full[name].shape[1])
            np.testing.assert_array_equal(np.asarray(state.tensors[name]), want)


def _edited(tmp_path: Path, file: str, old: str, new: str) -> Path:
    text = (ARCHITECTURES / file).read_text()
    assert text.count(old) >= 1, old
    path = tmp_path / file
    path.write_text(text.replace(old, new))
    return path


def test_an_expert_count_that_does_not_divide_the_expert_axis_is_a_located_error(tmp_path):
    path = _edited(tmp_path, "dbrx.yaml", "experts: {axis: 0, count: moe_num_experts}",
                   "experts: {axis: 0, count: 3}")
    errors = check_family(path, hf("dbrx") / "config.json")
    assert [str(e) for e in errors] == [
        f"{path}:87:31: `experts: {{count: 3}}` (3) does not divide axis 0 of "
        "`transformer.blocks.0.ffn.experts.mlp.w1` (128 rows); every expert must be a block of "
        "the same whole number of rows [at /parameters/5/experts/count]"]


def test_without_a_count_the_expert_axis_counts_rows_as_experts(tmp_path):
    """What `count:` fixes: the same group without it routes to one "expert" per row."""
    path = _edited(tmp_path, "dbrx.yaml", "experts: {axis: 0, count: moe_num_experts}",
                   "experts: {axis: 0}")
    plan, _ = compile_and_import(path, hf("dbrx") / "config.json", tmp_path / "build", tp=1,
                                 expert_parallel_size=2)
    assert plan.expert_parallel.placement.experts == 128


@pytest.mark.parametrize("tp", [2, 8])
def test_codegen_ranks_take_their_heads_inside_each_mp_num_group_of_q_v_k(tmp_path, tp):
    config = json.loads((hf("codegen") / "config.json").read_text())
    full = load_file(str(hf("codegen") / "model.safetensors"))
    hidden, heads, mp_num = config["n_embd"], config["n_head"], 4  # HF: self.mp_num = 4
    head_dim, per_group = hidden // heads, heads // mp_num
    _, states = compile_and_load(ARCHITECTURES / "codegen.yaml", hf("codegen") / "config.json",
                                 tmp_path / "build", hf("codegen"), tp=tp)
    name = "transformer.h.0.attn.qkv_proj.weight"
    # HF: qkv.view(..., mp_num, 3 * local_dim).split(local_dim) -> q, v, k per group
    grouped = full[name].reshape(mp_num, 3, per_group, head_dim, hidden)
    for rank, state in enumerate(states):
        mine = range(rank * heads // tp, (rank + 1) * heads // tp)
        groups = sorted({h // per_group for h in mine})
        # stored order: group by group, inside each its q heads, v heads, k heads
        want = np.concatenate([grouped[g, c, [h % per_group for h in mine if h // per_group == g]]
                               for g in groups for c in range(3)]).reshape(-1, hidden)
        np.testing.assert_array_equal(np.asarray(state.tensors[name]), want)


def test_a_fused_expert_member_split_as_whole_experts_is_located_at_its_own_sharding(tmp_path):
    """The error names the member's `sharding:` (where the mistake is), not the group's
    `experts:` line, which is right."""
    text = (ARCHITECTURES / "dbrx.yaml").read_text()
    w2 = 'ffn.experts.mlp.w2"   # used as x @ w2: [in, out]\n'
    old = ('        shape: [moe_num_experts * ffn_hidden_size, hidden_size]\n        sharding:\n'
           '          partitioned_segments: {axis: 0, segments: "[ffn_hidden_size] * '
           'moe_num_experts"}\n')
    new = ('        shape: [moe_num_experts * ffn_hidden_size, hidden_size]\n'
           '        sharding: {partitioned: 0}\n')
    start = text.index(w2)
    assert text[start + len(w2):].startswith(old)
    path = tmp_path / "dbrx.yaml"
    path.write_text(text[:start + len(w2)] + new + text[start + len(w2) + len(old):])
    lines = path.read_text().splitlines()
    line = next(i for i, s in enumerate(lines, 1) if s == "        sharding: {partitioned: 0}")
    column = len("        sharding: ") + 1  # the rule, as every located value
    errors = check_family(path, hf("dbrx") / "config.json")
    assert [str(e) for e in errors] == [
        f"{path}:{line}:{column}: `transformer.blocks.0.ffn.experts.mlp.w2` is "
        "partitioned(axis 0) along the expert axis 0, which holds 4 experts of 32 rows: its "
        "cuts would give a tensor-parallel rank a range of whole experts instead of the same "
        "rows inside every expert; split each expert on its own, e.g. `partitioned_segments: "
        "{axis: 0, segments: \"[32] * 4\"}` [at /parameters/5/members/2/sharding]"]
