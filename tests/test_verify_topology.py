"""`partc verify --tp T --pp S --ep E`: the one T x S x E build the user asks for, checked as a
whole: every stage's modules split over that stage's T ranks, its experts over its E ranks
through the build's expert map, and the stage hand-offs of the same build (not T at S = 1 plus
S at T = 1).

The oracle is transformers' modeling code of the reference model (its modules and experts
modules, and its logits). One reference model per family, shared by the module's tests."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_verify_experts import _swapped

from partc.cli.main import main
from partc.verify.combined import topology_checks
from partc.verify.mtp import MtpSession, mtp_layers
from partc.verify.results import Check
from partc.verify.run import _reference_session
from partc.verify.session import ExpertTopology, Session, compile_build
from partc.verify.shrink import reference_config

from support import edited_family, hf


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """The reference model of a fixture (sized for T <= 2 and S = 2), built once per module."""
    built: dict[str, tuple[Session, MtpSession | None, Path]] = {}

    def session(name: str) -> tuple[Session, MtpSession | None, Path]:
        if name not in built:
            work = tmp_path_factory.mktemp(name)
            config = hf(name) / "config.json"
            data = json.loads(config.read_text())
            reference, notes = reference_config(data, tensor_parallel_size=2,
                                                pipeline_parallel_size=2)
            main, _ = _reference_session(reference, work / "reference", work, 0, config, data,
                                         notes)
            mtp = MtpSession(main, reference) if mtp_layers(reference) else None
            built[name] = (main, mtp, work)
        return built[name]
    return session


def _placement(kind: str, experts: int, ep: int) -> list[list[int]] | None:
    """A placement of `experts` over `ep` EP ranks: None (balanced ranges), round robin
    (explicit: not contiguous), or balanced plus a copy of expert 0 on every rank (redundant)."""
    if kind == "balanced":
        return None
    if kind == "explicit":
        return [[e for e in range(experts) if e % ep == r] for r in range(ep)]
    per = experts // ep
    return [sorted({0, *range(r * per, (r + 1) * per)}) for r in range(ep)]


def _checked(sessions, name: str, tp: int, ep: int | None, kind: str = "balanced",
             family: Path | None = None) -> tuple[list[Check], object]:
    """Every check of the T x 2 (x E) build of fixture `name` (placement `kind`)."""
    session, mtp, work = sessions(name)
    experts = session.model.config.to_dict()
    count = next(experts[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                 if experts.get(k))
    ranks = _placement(kind, count, ep or 1)
    placement = None
    if ranks is not None:
        placement = work / f"{kind}{ep}.json"
        placement.write_text(json.dumps({"ranks": ranks}))
    out = work / f"{family.stem if family else 'built_in'}_{tp}_{ep}_{kind}"
    build = compile_build(family, work / "reference", out, tp, 2, None, experts=ExpertTopology(
        expert_parallel_size=ep, placement=placement) if ep else None)
    return topology_checks(session, build, mtp), build


# each family at one topology; together T in {1, 2}, E in {2, 4}, every kind of placement
# (the full matrix, every family at every one, is run by hand: docs/verify.md)
@pytest.mark.parametrize(("name", "tp", "ep", "kind"), [
    ("qwen3_moe", 2, 4, "balanced"),
    ("mixtral", 1, 2, "redundant"),     # N = 2 > T: two dense replicas
    ("deepseek_v3", 2, 2, "explicit"),  # a dense first layer; the MoE layers cut 1 | 1
    ("gpt_oss", 1, 4, "redundant"),     # stacked [E, H, 2I] experts with biases
    ("qwen2_moe", 2, 4, "explicit"),    # shared experts split over T, two dense replicas
])
def test_a_moe_family_verifies_at_one_whole_topology(sessions, name, tp, ep, kind):
    checks, build = _checked(sessions, name, tp, ep, kind)
    assert all(c.ok for c in checks), next(c.message for c in checks if not c.ok)
    assert {(c.tp, c.pp, c.ep, c.etp) for c in checks} == {(tp, 2, ep, 1)}
    kinds = {c.kind for c in checks}
    assert {"module", "experts", "cut", "logits"} <= kinds, kinds
    session, mtp, _ = sessions(name)
    layers = session.model.config.num_hidden_layers
    modules = [c.module for c in checks if c.kind == "module"]
    # the attention of the first and of the last layer: both stages' modules were checked
    assert {"model.layers.0.self_attn", f"model.layers.{layers - 1}.self_attn"} <= set(modules)
    experts = [c.module for c in checks if c.kind == "experts"]
    moe = [m for m in (f"model.layers.{u}.mlp.experts" for u in range(layers))
           if any(n.startswith(m + ".") for n in session.sources)]
    if mtp is not None:  # deepseek_v3's MTP layer, checked like a decoder layer's
        moe.append(f"model.layers.{layers}.mlp.experts")
        assert [m for m in modules if m.startswith(f"model.layers.{layers}.")] == [
            f"model.layers.{layers}.{m}" for m in (
                "self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
                "embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm",
                "shared_head.head")]
    assert experts == moe and len(experts) >= 2  # one per MoE layer, on either stage
    if kind != "balanced":
        assert build.file.expert_parallel.explicit_placement  # the file was compiled in


def test_a_map_that_swaps_two_stacked_experts_is_refused_on_every_stage(sessions, monkeypatch):
    monkeypatch.setattr("partc.runtime.expert_map", _swapped(0, 1))  # slots 0, 1 of EP rank 0
    checks, _ = _checked(sessions, "gpt_oss", 1, 2)
    failed = [c for c in checks if not c.ok]
    assert [(c.kind, c.module) for c in failed] == [
        ("experts", "model.layers.0.mlp.experts"), ("experts", "model.layers.1.mlp.experts")]
    assert failed[0].message.startswith(
        "T=1 x S=2 x EP=2: module `model.layers.0.mlp.experts` (group `layers.0.experts`), "
        "ranks 0-1: the experts computed by each rank from its own slots"), failed[0].message
    # layer 1 runs on stage 1: its experts are computed by the ranks of stage 1
    assert failed[1].message.startswith(
        "T=1 x S=2 x EP=2: module `model.layers.1.mlp.experts` (group `layers.1.experts`), "
        "ranks 2-3: the experts computed by each rank from its own slots"), failed[1].message
    assert "(first wrong: expert 0)" in failed[1].message


def test_a_map_that_moves_a_loaded_expert_to_another_ep_rank_is_refused_on_every_stage(
        sessions, monkeypatch):
    monkeypatch.setattr("partc.runtime.expert_map", _swapped(0, 4))  # EP rank 0 <-> 1
    checks, _ = _checked(sessions, "qwen3_moe", 1, 2)
    loads = [c.message for c in checks if not c.ok and c.rank is not None]
    assert loads[-1] == (
        "T=1 x S=2 x EP=2: rank 3: the rank loads expert 4's "
        "`model.layers.1.mlp.experts.4.up_proj.weight`, but its expert map puts expert 4 on "
        "EP ranks [0], not on EP rank 1"), loads
    assert {c.rank for c in checks if not c.ok} >= {0, 1, 2, 3}


def test_a_wrong_split_and_a_wrong_placement_on_the_last_stage_are_refused(sessions, tmp_path):
    family = edited_family(tmp_path, "mixtral", "final_norm: {stage: last}",
                           "final_norm: {stage: first}")
    text = family.read_text()  # o_proj split on its output axis: heads no longer add up
    family.write_text(text.replace('o_proj"\n        sharding: row', 'o_proj"\n        '
                                   'sharding: column', 1))
    checks, _ = _checked(sessions, "mixtral", 2, 2, family=family)
    failed = [c for c in checks if not c.ok]
    attention = [c for c in failed if c.kind == "module"]
    assert [c.module for c in attention] == ["model.layers.0.self_attn",
                                             "model.layers.1.self_attn"]
    assert attention[1].rank in (2, 3)  # a rank of stage 1 (ranks 2, 3 at T = 2, E = 2)
    assert attention[1].message.startswith("T=2 x S=2 x EP=2: module `model.layers.1.self_attn`")
    owned = [c for c in failed if c.kind == "ownership"]
    assert [c.message for c in owned] == [
        "T=2 x S=2 x EP=2: stage 1 executes `model.norm.weight`, made of `model.norm.weight`, "
        "but does not own that tensor"]


def test_the_cli_checks_the_build_of_tp_pp_and_ep_together(tmp_path, capsys):
    # the fused [E * I, H] axis taken for E * I experts: refused on the T x S x E build
    wrong = edited_family(tmp_path, "dbrx", "experts: {axis: 0, count: moe_num_experts}   #",
                          "experts: {axis: 0}   #")
    status = main(["verify", str(wrong), "--config", str(hf("dbrx") / "config.json"),
                   "--tp", "1", "--pp", "2", "--ep", "2", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 1
    assert {(c["tp"], c["pp"], c["ep"], c["etp"]) for c in report["checks"]} == {(1, 2, 2, 1)}
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [c["kind"] for c in failed] == ["experts", "experts"]
    assert failed[1]["message"] == (
        "T=1 x S=2 x EP=2: module `transformer.blocks.1.ffn.experts` (group "
        "`layers.1.experts`): the build's expert map routes over 128 experts, but the model's "
        "module has 4: the family's expert count (`for: {expert: ...}` or `experts: {count: "
        "...}`) is not the model's")
    assert any(c["kind"] == "cut" and c["ok"] for c in report["checks"])
    assert "the T=1 x S=2 build cut decoder*1|decoder*1" in " ".join(report["notes"])


def test_the_mtp_layer_s_split_is_checked_on_its_own_stage(sessions, tmp_path):
    # o_proj split on its output axis: refused in every decoder layer and in the MTP layer
    # (model.layers.3, after the 3 decoder layers), whose attention runs on stage 1
    family = edited_family(tmp_path, "deepseek_v3", '.o_proj"\n        sharding: row',
                           '.o_proj"\n        sharding: column')
    checks, _ = _checked(sessions, "deepseek_v3", 2, None, family=family)
    failed = [c for c in checks if not c.ok]
    assert [(c.module, c.rank) for c in failed] == [
        ("model.layers.0.self_attn", 0), ("model.layers.1.self_attn", 0),
        ("model.layers.2.self_attn", 2), ("model.layers.3.self_attn", 2)]
    assert failed[-1].message.startswith(
        "T=2 x S=2: module `model.layers.3.self_attn` (group "
        "`model.layers.3.attention.heads`), rank 2: ")
    assert all(c.ok for c in checks if c.module.startswith("model.layers.3.")
               and c.module != "model.layers.3.self_attn")


def test_a_dense_replica_holding_other_elements_is_refused(sessions):
    # T=2 x E=4: ranks 2, 3 of a stage repeat the dense parts of ranks 0, 1; rank 2 given
    # rank 3's state holds the other half of every split dense tensor
    session, mtp, work = sessions("qwen3_moe")
    build = compile_build(None, work / "reference", work / "replicas", 2, 2, None,
                          experts=ExpertTopology(expert_parallel_size=4))
    states = list(build.states)
    states[2], states[3] = states[3], states[2]
    checks = topology_checks(session, replace(build, states=tuple(states)), mtp)
    replicas = [c for c in checks if c.kind == "load" and not c.ok]
    assert replicas and {c.rank for c in replicas} == {2, 3}
    assert replicas[0].message == (
        "T=2 x S=2 x EP=4: rank 2's loader holds other elements of "
        "`model.embed_tokens.weight` than rank 0, whose dense replica it is")
