"""`partc verify --ep E`: every expert, computed by the ranks from their own slots and combined
through the build's expert map (`expert_map()` of the generated package), must give the full
experts module's output, for each MoE layer; a map that disagrees with what the ranks loaded,
and an expert count that is not the model's, are refused.

The oracle is transformers' own experts modules (`MixtralExperts`, `DbrxExperts`, ...), driven
with every expert selected."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from partc.cli.main import main

from support import ROOT, hf


def _verify(capsys, name: str, *extra: str, family: str | None = None) -> tuple[int, dict]:
    status = main(["verify", *([family] if family else []), "--config",
                   str(hf(name) / "config.json"), "--pp", "1", "--format", "json", *extra])
    return status, json.loads(capsys.readouterr().out)


def _expert_checks(report: dict) -> list[dict]:
    return [c for c in report["checks"] if c["ep"] is not None]


@pytest.mark.parametrize(("name", "module", "groups"), [
    ("mixtral", "model.layers.{}.mlp.experts", "layers.{0}.experts.0-3"),
    ("qwen3_moe", "model.layers.{}.mlp.experts", "layers.{0}.experts.0-7"),
    ("deepseek_v3", "model.layers.{}.mlp.experts", "model.layers.{0}.experts.0-7"),
    ("dbrx", "transformer.blocks.{}.ffn.experts", "layers.{0}.experts"),  # fused [E * I, H]
    ("gpt_oss", "model.layers.{}.mlp.experts", "layers.{0}.experts"),  # stacked [E, H, 2I]
])
def test_every_moe_layer_s_experts_add_up_through_the_expert_map(capsys, name, module, groups):
    status, report = _verify(capsys, name, "--tp", "1,2", "--ep", "2")
    assert status == 0 and report["ok"] is True, report
    checks = _expert_checks(report)
    layers = sorted({int(c["module"].split(".")[-3]) for c in checks})
    assert layers and all(c["ok"] and c["ep"] == 2 and c["etp"] == 1 for c in checks)
    # one check per MoE layer's experts at each T (deepseek_v3's first layer is dense)
    assert [(c["tp"], c["module"]) for c in checks] == [
        (tp, module.format(layer)) for tp in (1, 2) for layer in layers]
    if groups:
        assert [c["group"] for c in checks[:len(layers)]] == [groups.format(u) for u in layers]


def test_a_redundant_placement_and_expert_tensor_parallelism_verify(tmp_path, capsys):
    placement = tmp_path / "hot.json"
    placement.write_text(json.dumps({"ranks": [[0, 1, 2], [0, 3]]}))  # expert 0 twice
    status, report = _verify(capsys, "mixtral", "--tp", "2", "--ep", "2",
                             "--expert-placement", str(placement))
    assert status == 0 and report["ok"] is True, report
    assert len(_expert_checks(report)) == 2
    status, report = _verify(capsys, "qwen3_moe", "--tp", "2", "--ep", "2", "--etp", "2")
    assert status == 0 and report["ok"] is True, report
    assert {(c["ep"], c["etp"]) for c in _expert_checks(report)} == {(2, 2)}


def test_four_ep_ranks_verify_at_t_1_and_2(capsys):
    status, report = _verify(capsys, "qwen3_moe", "--tp", "1,2", "--ep", "4")
    assert status == 0 and report["ok"] is True, report
    checks = _expert_checks(report)
    assert {(c["tp"], c["ep"]) for c in checks} == {(1, 4), (2, 4)} and len(checks) == 4


def test_a_t_that_does_not_divide_the_expert_ranks_is_noted(capsys):
    status, report = _verify(capsys, "mixtral", "--tp", "1,4", "--ep", "2")
    assert status == 0, report
    assert {c["tp"] for c in _expert_checks(report)} == {1}
    assert "expert parallelism EP=2 x ETP=1 not checked at T=4: T must divide the 2 ranks of " \
           "a stage" in report["notes"]


def _swapped(first: int, second: int):
    """An expert_map() that swaps two experts' places and leaves the loaded slots as they are
    (a placement the loader and the router disagree on)."""
    from partc import runtime

    real = runtime.expert_map

    def swapped(table):
        found = real(table)
        where = {e: held for e, held in enumerate(found.owners)}
        where[first], where[second] = where[second], where[first]
        owners = tuple(where[e] for e in range(len(found.owners)))
        local = [0] * len(found.local_experts)
        for expert, held in enumerate(owners):
            for ep, slot in held:
                if ep == found.expert_parallel_rank:
                    local[slot] = expert
        return replace(found, owners=owners, local_experts=tuple(local))
    return swapped


@pytest.mark.parametrize(("name", "module"), [("dbrx", "transformer.blocks.{}.ffn.experts"),
                                              ("gpt_oss", "model.layers.{}.mlp.experts")])
def test_a_map_that_swaps_two_stacked_experts_slots_is_refused(monkeypatch, capsys, name,
                                                                module):
    monkeypatch.setattr("partc.runtime.expert_map", _swapped(0, 1))  # both on EP rank 0
    status, report = _verify(capsys, name, "--tp", "1", "--ep", "2")
    assert status == 1
    failed = [c for c in _expert_checks(report) if not c["ok"]]
    assert [c["module"] for c in failed] == [module.format(0), module.format(1)]
    assert failed[0]["message"].startswith(
        f"T=1 x S=1 x EP=2: module `{module.format(0)}` (group "
        "`layers.0.experts`), ranks 0-1: the experts computed by each rank from its own slots, "
        "placed through its expert map (redundant copies once), do not add up to the full "
        "module (first wrong: expert 0); max abs error ")


def test_a_map_that_puts_a_loaded_expert_on_another_ep_rank_is_refused(monkeypatch, capsys):
    monkeypatch.setattr("partc.runtime.expert_map", _swapped(1, 2))  # EP rank 0 <-> 1
    status, report = _verify(capsys, "mixtral", "--tp", "1", "--ep", "2")
    assert status == 1
    first = next(c for c in report["checks"] if not c["ok"])
    assert first["message"] == (
        "T=1 x S=1 x EP=2: rank 0: the rank loads expert 1's "
        "`model.layers.0.block_sparse_moe.experts.1.w1.weight`, but its expert map puts expert "
        "1 on EP ranks [1], not on EP rank 0")


def test_a_stacked_expert_count_that_is_not_the_model_s_is_refused(tmp_path, capsys):
    text = (ROOT / "architectures" / "dbrx.yaml").read_text()
    wrong = tmp_path / "dbrx.yaml"  # the fused [E * I, H] axis taken for E * I experts
    wrong.write_text(text.replace("experts: {axis: 0, count: moe_num_experts}",
                                  "experts: {axis: 0}"))
    status, report = _verify(capsys, "dbrx", "--tp", "1", "--ep", "2", family=str(wrong))
    assert status == 1
    failed = [c for c in _expert_checks(report) if not c["ok"]]
    assert failed and failed[0]["message"] == (
        "T=1 x S=1 x EP=2: module `transformer.blocks.0.ffn.experts` (group "
        "`layers.0.experts`): the build's expert map routes over 128 experts, but the model's "
        "module has 4: the family's expert count (`for: {expert: ...}` or `experts: {count: "
        "...}`) is not the model's")


def test_expert_options_without_ep_are_refused(capsys):
    status = main(["verify", "--config", str(hf("mixtral") / "config.json"), "--etp", "2"])
    assert status != 0
    assert "--etp needs --ep (the expert-parallel size)" in capsys.readouterr().err
