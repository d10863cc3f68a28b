"""`partc init`: the scaffold of a checkpoint passes `partc check` against that checkpoint, also
when its layers differ (dense and MoE layers), its experts repeat, its config nests the
decoder's fields under `text_config`, or it is a vision-language model (a vision tower's layers
beside the decoder's: a multi-group graph, encoder first); every decision it could not make is
one marked line, counted as written; what it cannot write is said in the file and on the
console."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from partc.api import CompileOptions, compile_family
from partc.cli.commands import error_reference
from partc.cli.main import main
from partc.plan.topology import Topology
from partc.scaffold.family_text import scaffold
from partc.scaffold.survey import survey_checkpoint
from partc.scaffold.yaml_writer import Comments, Flow, FlowList, Quoted, write_yaml

from support import HF, hf

CHECK = "# partc init: CHECK:"
SCAFFOLDED = sorted(p.name for p in HF.iterdir() if p.is_dir())
"""Every fixture: init writes a scaffold of each, also of the vision-language ones."""
VISION_LANGUAGE = {  # fixture -> (its vision layers' prefix, group, vision_config layer count)
    "llava": ("vision_tower.encoder.layers.", "vision", "num_hidden_layers"),
    "qwen2_vl": ("visual.blocks.", "visual", "depth"),
}
"""The fixtures with two layer repetitions, a vision tower's beside the decoder's."""
DECODER = {"llava": "language_model.model.layers.", "qwen2_vl": "model.layers."}


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(args)
    out = capsys.readouterr()
    return status, out.out, out.err


def _init(checkpoint: Path, out: Path, capsys: pytest.CaptureFixture[str]
          ) -> tuple[str, str, dict[str, object]]:
    status, stdout, stderr = _run(["init", "--checkpoint", str(checkpoint), "--out", str(out)],
                                  capsys)
    assert status == 0, stderr
    status, report, _ = _run(["init", "--checkpoint", str(checkpoint), "--format", "json"],
                             capsys)
    assert status == 0
    return stdout, stderr, json.loads(report)


@pytest.mark.parametrize("fixture", SCAFFOLDED)
def test_the_scaffold_of_every_fixture_checks_against_its_checkpoint_and_counts_its_marks(
        fixture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    family = tmp_path / "family.yaml"
    stdout, _, report = _init(hf(fixture), family, capsys)
    text = family.read_text()
    assert report["text"] == text
    marked = [line for line in text.splitlines() if CHECK in line]
    assert len(marked) == len(report["undecided"])  # type: ignore[arg-type]
    assert f"wrote {family}: {len(marked)} line(s) marked" in stdout
    next_command = stdout.split("next: ")[1].split()
    assert next_command[:2] == ["partc", "check"]
    status, out, err = _run([*next_command[1:], "--tp", "2", "--pp", "2"], capsys)
    assert status == 0, err
    assert out.startswith("ok: family, config binding, checkpoint, topology checked")


def test_deepseek_dense_and_moe_layers_get_conditions_experts_and_a_console_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    family = tmp_path / "ds.yaml"
    _, err, report = _init(hf("deepseek_v3"), family, capsys)
    text = family.read_text()
    assert ('    when: "unit == 0"  # partc init: CHECK: `mlp` is only in layer 0 of layers '
            '0-2: the condition follows this checkpoint; write it over config fields') in text
    experts = text[text.index('  - name: "layers.{unit}.mlp.experts.{expert}"'):]
    experts = experts[:experts.index("\n\n")]
    assert experts.splitlines()[1:5] == [
        "    role: expert_intermediate", "    owner: {unit: decoder}",
        '    when: "unit >= 1"  # partc init: CHECK: `mlp.experts.{expert}` is only in layers '
        "1-2 of layers 0-2: the condition follows this checkpoint; write it over config fields",
        "    for: {expert: n_routed_experts}"]
    assert "    units: moe_intermediate_size" in experts
    assert '  - name: "layers.{unit}.mlp.shared_experts"' in text
    note = ("note: the layers hold different tensors: 4 group(s) apply to some layers only, "
            "with a `when:` over layer numbers marked CHECK")
    assert note in err
    assert report["notes"] == [note.removeprefix("note: ")]
    # Every tensor of the checkpoint is owned exactly once: check with the checkpoint passes at
    # every stage split, and the layers' own tensors are all named by a group.
    status, _, err = _run(["check", str(family), "--checkpoint", str(hf("deepseek_v3")),
                           "--tp", "2", "--pp", "3"], capsys)
    assert status == 0, err


def test_gpt2_layers_config_names_and_embeddings_are_recognised_and_staged_as_hf_uses_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    family = tmp_path / "gpt2.yaml"
    _init(hf("gpt2"), family, capsys)
    text = family.read_text()
    assert '  - {group: decoder, units: num_hidden_layers, path: "transformer.h.{unit}"' in text
    config = json.loads((hf("gpt2") / "config.json").read_text())
    assert "hidden_size" not in config and "num_hidden_layers" not in config  # n_embd, n_layer
    assert "  hidden_size: {type: int, from: n_embd}" in text
    assert "  num_hidden_layers: {type: int, from: n_layer}" in text
    assert "ln_1` is not a known projection" not in text  # GPT-2's norms are norms
    result = compile_family(str(family), hf("gpt2") / "config.json",
                            Topology(tensor_parallel_size=1, pipeline_parallel_size=2),
                            CompileOptions(checkpoint=hf("gpt2")))
    first, last = ({t.target for t in rank.layout.tensors} for rank in result.plan.ranks)
    # GPT2Model.forward: wte(input_ids) + wpe(positions) before the blocks, ln_f after them;
    # the tied head (no lm_head tensor) reads wte on the last stage too
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= first
    assert "transformer.ln_f.weight" in last and "transformer.ln_f.weight" not in first
    assert "transformer.wte.weight" in last and "transformer.wpe.weight" not in last


def test_a_config_alias_never_hides_the_usual_name(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(hf("gpt2"), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_hidden_layers"] = config["n_layer"]  # both spellings: the usual one is read
    (checkpoint / "config.json").write_text(json.dumps(config))
    _init(checkpoint, tmp_path / "f.yaml", capsys)
    text = (tmp_path / "f.yaml").read_text()
    assert "  num_hidden_layers: int\n" in text and "from: n_layer" not in text


@pytest.mark.parametrize("fixture", ["llama_mlx4", "qwen3_fp8", "deepseek_v3_fp8",
                                     "gpt_oss_mxfp4"])
def test_a_quantized_checkpoints_scaffold_checks_and_declares_its_format(
        fixture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = HF.parent / "quantized" / fixture
    family = tmp_path / "q.yaml"
    _, _, report = _init(checkpoint, family, capsys)
    status, _, err = _run(["check", str(family), "--checkpoint", str(checkpoint), "--tp", "2",
                           "--pp", "2"], capsys)
    assert status == 0, err
    if fixture == "llama_mlx4":  # MLX: U32 weights with scales/biases declared dense, the
        # format named once (tests/test_init_quantized.py checks the four fixtures in full)
        assert report["undecided"] == []
        assert "  - format: mlx_affine\n" in family.read_text()


def test_qwen2_vl_reads_its_decoder_fields_from_text_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    family = tmp_path / "qv.yaml"
    _init(hf("qwen2_vl"), family, capsys)
    text = family.read_text()
    config = json.loads((hf("qwen2_vl") / "config.json").read_text())
    assert "hidden_size" not in config and config["text_config"]["hidden_size"] == 64
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
        assert f"  {field}: {{type: int, from: text_config.{field}}}" in text
    assert ("  num_key_value_heads: {type: int, from: text_config.num_key_value_heads, "
            "default: num_attention_heads}") in text
    embedding = text[text.index("  - name: embedding"):]
    assert "    params: {weight: [vocab_size, hidden_size]}" in embedding[:embedding.index("\n\n")]
    assert "  primary: {role: hidden, shape: [batch, sequence, hidden_size]" in text
    assert text.count("  - name: final_norm") == 1  # model.norm, not a vision block's norm1
    assert "    module: model.norm\n" in text[text.index("  - name: final_norm"):]


def _llama_with(tmp_path: Path, name: str, array: np.ndarray) -> Path:
    """A copy of the tiny Llama checkpoint (config.json too) with tensor `name` set to `array`
    (added when it is not there)."""
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    shutil.copy(hf("llama") / "config.json", checkpoint / "config.json")
    tensors = load_file(hf("llama") / "model.safetensors")
    tensors[name] = array
    save_file(tensors, checkpoint / "model.safetensors")
    return checkpoint


def test_a_module_whose_shape_differs_between_layers_is_marked_and_said_not_to_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _llama_with(tmp_path, "model.layers.1.mlp.down_proj.weight",
                             np.zeros((64, 96), np.float32))
    family = tmp_path / "odd.yaml"
    _, err, report = _init(checkpoint, family, capsys)
    text = family.read_text()
    marked = [line for line in text.splitlines() if "with other params, shapes" in line]
    assert marked == ["    # layer 1 hold(s) `mlp` with other params, shapes or "
                      "expert counts  # partc init: CHECK: this group fits the first layers "
                      "only: split it by layer, `partc check` fails until then"]
    assert "does not pass `partc check` until those groups are split by layer" in err
    assert len(report["notes"]) == 1  # type: ignore[arg-type]
    status, _, err = _run(["check", str(family), "--checkpoint", str(checkpoint)], capsys)
    assert status == 1 and "model.layers.1.mlp.down_proj.weight" in err


@pytest.mark.parametrize("command", ["init", "families"])
@pytest.mark.parametrize("name", ["family.toml", "family.json", "family", "yaml"])
def test_init_and_families_copy_refuse_a_file_name_that_is_not_yaml(
        command: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / name
    argv = (["init", "--checkpoint", str(hf("llama")), "--out", str(target)]
            if command == "init" else ["families", "--copy", "llama", str(target)])
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    option = "--out" if command == "init" else "--copy"
    assert (f"partc {command}: error: argument {option}: expected a family file name ending in "
            f".yaml or .yml (the family is written as YAML, and partc reads a file by its "
            f"suffix), found '{target}'") in err
    assert f"    see: {error_reference(f'cli#partc-{command}')}\n" in err  # its section
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_a_yml_scaffold_and_a_named_one_check(
        suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    family = tmp_path / f"mine{suffix}"
    assert main(["init", "--checkpoint", str(hf("llama")), "--name", "my_llama_2",
                 "--out", str(family)]) == 0
    assert "\nfamily: my_llama_2\n" in family.read_text()
    capsys.readouterr()
    status, out, err = _run(["check", str(family), "--checkpoint", str(hf("llama"))], capsys)
    assert status == 0, err


@pytest.mark.parametrize("name", ["bad name!", "2fast", "a-b", "", "x" * 129])
def test_init_refuses_a_family_name_check_would_reject_before_writing(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["init", "--checkpoint", str(hf("llama")), "--name", name,
              "--out", str(tmp_path / "f.yaml")])
    assert exited.value.code == 2
    assert (f"partc init: error: argument --name: expected a family name: letters, digits and "
            f"`_`, not starting with a digit, at most 128 characters, found {name!r}"
            ) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_copied_family_points_its_editor_line_at_the_installed_schema(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "elsewhere" / "mine.yaml"
    copy.parent.mkdir()
    assert main(["families", "--copy", "deepseek_v3", str(copy)]) == 0
    first, _, rest = copy.read_text().partition("\n")
    assert first.startswith("# yaml-language-server: $schema=file:///")
    schema = Path(first.removeprefix("# yaml-language-server: $schema=file://"))
    assert json.loads(schema.read_text())["$schema"].startswith("https://json-schema.org/")
    capsys.readouterr()
    assert _run(["schema", "--path"], capsys)[1].strip() == str(schema)
    original = (Path(__file__).parents[1] / "architectures" / "deepseek_v3.yaml").read_text()
    assert rest == original.partition("\n")[2]
    status, _, err = _run(["check", str(copy), "--checkpoint", str(hf("deepseek_v3"))], capsys)
    assert status == 0, err


def test_full_width_attention_norms_are_marked_and_sized_by_their_projection(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OLMoE's q_norm and k_norm normalise the whole q/k output, which the attention group
    splits: the scaffold marks them (they need the group and `reduction: tensor_parallel`) and
    writes their size as the projection's expression, not as whichever config field has that
    value (here intermediate_size = K*d = 32); its router is sized by the expert count. The
    checkpoint is a random one written by transformers' own OLMoE code."""
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    config = OlmoeConfig(hidden_size=64, intermediate_size=32, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, num_experts=4,
                         num_experts_per_tok=2, vocab_size=131)
    folder = tmp_path / "olmoe"
    OlmoeForCausalLM(config).save_pretrained(folder)
    family = tmp_path / "olmoe.yaml"
    _init(folder, family, capsys)
    text = family.read_text()
    for norm, proj, size in (("q_norm", "q_proj", "num_attention_heads * head_dim"),
                             ("k_norm", "k_proj", "num_key_value_heads * head_dim")):
        block = text[text.index(f'module: "model.layers.{{unit}}.self_attn.{norm}"'):]
        block = block[:block.index("\n\n")]
        assert f"{CHECK} `self_attn.{norm}` normalises the whole `{proj}` output ({size})" in block
        assert f"params: {{weight: [{size}]}}" in block, block
    assert "params: {weight: [num_experts, hidden_size]}" in text
    status, _, err = _run(["check", str(family), "--checkpoint", str(folder)], capsys)
    assert status == 0, err  # as written it checks; verify is what the mark warns of


def _keys(fixture: str) -> set[str]:
    """The checkpoint's tensor names, read by the safetensors library (not partc)."""
    with safe_open(str(hf(fixture) / "model.safetensors"), "np") as opened:
        return set(opened.keys())


@pytest.mark.parametrize("fixture", sorted(set(SCAFFOLDED) - set(VISION_LANGUAGE)))
def test_a_single_repetition_scaffold_has_the_decoder_as_its_only_graph_entry(
        fixture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = _keys(fixture)
    repeated = {k.split(".0.")[0] for k in keys if ".0." in k and k.split(".0.")[0].rsplit(
        ".", 1)[-1] in ("layers", "h", "blocks")}
    assert len(repeated) == 1, repeated  # one repetition, counted without partc
    family = tmp_path / "f.yaml"
    _, err, report = _init(hf(fixture), family, capsys)
    data = yaml.safe_load(family.read_text())
    config = json.loads((hf(fixture) / "config.json").read_text())
    mtp = ["mtp"] if config.get("num_nextn_predict_layers") else []  # after it (test_init_mtp)
    assert [g["group"] for g in data["graph"]] == ["decoder", *mtp]
    assert "after" not in data["graph"][0] and "boundary" not in data["graph"][0]
    assert "dimensions" not in data
    assert data["static"]["embedding"] == {"stage": "first"}
    notes = report["notes"]
    assert isinstance(notes, list)
    assert "layer repetitions" not in err and not any("layer repetitions" in n for n in notes)


@pytest.mark.parametrize("fixture", sorted(VISION_LANGUAGE))
def test_a_vision_language_scaffold_compiles_with_its_encoder_group_before_the_decoder(
        fixture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix, encoder, count_field = VISION_LANGUAGE[fixture]
    family = tmp_path / "vl.yaml"
    _, err, report = _init(hf(fixture), family, capsys)
    text = family.read_text()
    assert report["text"] == text  # a second run writes the same bytes
    data = yaml.safe_load(text)
    config = json.loads((hf(fixture) / "config.json").read_text())
    keys = _keys(fixture)
    layers = {int(k[len(prefix):].split(".")[0]) for k in keys if k.startswith(prefix)}
    assert layers == set(range(len(layers))) and len(layers) == config["vision_config"][
        count_field]
    groups = [g["group"] for g in data["graph"]]
    assert groups == ([encoder, "projector", "decoder"] if fixture == "llava" else
                      [encoder, "merger", "decoder"])  # Qwen2-VL's merger runs after the tower
    assert [g.get("after", []) for g in data["graph"]] == [[], *([g] for g in groups[:-1])]
    # LLaVA's vision_feature_layer (-2) leaves the last layer unread: no unit
    used = len(layers) + 1 + config["vision_feature_layer"] if fixture == "llava" else len(
        layers)
    assert data["graph"][0]["units"] == ("vision_used" if fixture == "llava" else
                                         f"vision_{count_field}")
    assert data["config"][f"vision_{count_field}"] == {
        "type": "int", "from": f"vision_config.{count_field}"}
    assert data["static"]["embedding"] == {"stage": {"with": "decoder", "unit": "first"}}
    assert data["static"][f"{encoder}_embeddings"] == {"stage": {"with": encoder,
                                                                 "unit": "first"}}
    for group in data["graph"][:-1]:  # a boundary per encoder / projector group, declared
        assert group["boundary"]["identity"] == f"{fixture}.{group['group']}"
        assert {"role": "input_ids", "shape": ["batch", "sequence"], "dtype": "int32"} in group[
            "boundary"]["auxiliary"]
    assert text.count("      primary: {role:") == len(groups) - 1
    assert not any(CHECK in line for line in text.splitlines()
                   if line.startswith("      primary:"))
    assert "execution groups " + " -> ".join(groups) in err
    out = tmp_path / "out"
    status, _, err = _run(["compile", str(family), "--checkpoint", str(hf(fixture)), "--tp", "2",
                           "--pp", "2", "--out", str(out)], capsys)
    assert status == 0, err
    plan = json.loads(next(out.rglob("plan.json")).read_text())
    targets = [t["target"] for t in plan["tensors"]]
    assert sorted(targets) == sorted(keys)  # every tensor owned, and once
    assert [g["group"] for g in plan["graph"]] == groups
    assert plan["graph"][0]["unit_paths"] == [f"{prefix}{n}" for n in range(used)]
    owners = {g["name"]: g["owner"] for g in plan["groups"]}
    stages = {t["target"]: t["stages"] for t in plan["tensors"]}
    by_target = {t["target"]: t["group"] for t in plan["tensors"]}
    encoder_stages, decoder_stages = set(), set()
    for target in keys:
        if target.startswith(prefix):
            owner = owners[by_target[target]]
            number = int(target[len(prefix):].split(".")[0])
            assert owner == ({"kind": "execution_unit", "group": encoder, "unit": number}
                             if number < used else {"kind": "static_role",
                                                    "roles": [f"{encoder}_unused"]}), target
            encoder_stages.update(stages[target])
        elif target.startswith(DECODER[fixture]):
            assert owners[by_target[target]]["group"] == "decoder"
            decoder_stages.update(stages[target])
    assert max(encoder_stages) <= min(decoder_stages) and min(encoder_stages) == 0
    # the tower's modules outside its layers sit with its first unit (embeddings) or its last
    embeddings = [t for t in keys if "embed" in t and t.startswith(prefix.split(".")[0] + ".")]
    assert embeddings and all(stages[t] == [0] for t in embeddings)
    if fixture == "llava":  # the tower's dimensions are vision_config's, not the decoder's
        assert "    units: vision_intermediate_size" in text
        assert "          weight: [vision_intermediate_size, vision_hidden_size]" in text
        assert "      weight: [hidden_size, vision_hidden_size]" in text  # linear_1
        projector = [t for t in keys if t.startswith("multi_modal_projector.")]
        assert {owners[by_target[t]]["group"] for t in projector} == {"projector"}
    else:  # the fused qkv split by heads; the merger is its own unit, after the last block
        assert '    units: vision_num_heads\n' in text
        assert '    fused:\n      module: "visual.blocks.{unit}.attn.qkv"\n' in text
        merger = [t for t in keys if t.startswith("visual.merger.")]
        assert merger and all(owners[by_target[t]] == {
            "kind": "execution_unit", "group": "merger", "unit": 0} for t in merger)
        last = max(stages[f"{prefix}{max(layers)}.norm1.weight"])
        assert all(len(stages[t]) == 1 and stages[t][0] >= last for t in merger)


def test_the_llava_scaffold_verifies_against_transformers(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """As written, its splits and stages agree with HF's LlavaForConditionalGeneration. At
    S = 3 the cut falls after the last vision layer the projector reads (`vision_feature_layer:
    -2`: the scaffold's units are `vision_used`, the unread layer a static role), and the
    value it hands off is what the next stage computes from."""
    from partc.verify.run import verify_family

    family = tmp_path / "llava.yaml"
    _init(hf("llava"), family, capsys)
    config = hf("llava") / "config.json"
    two = verify_family(family, config, tensor_parallel_sizes=[1, 2], pipeline_parallel_size=2)
    assert two.ok, two.first_failure
    three = verify_family(family, config, tensor_parallel_sizes=[1], pipeline_parallel_size=3)
    assert three.ok, three.first_failure
    assert [(c.module, c.group) for c in three.checks if c.kind == "cut" and c.group ==
            "vision"] == [("model.vision_tower.encoder.layers.1", "vision")]


def test_several_repetitions_none_beside_an_embedding_are_refused_with_the_file_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "two"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "two"}))
    save_file({"a.layers.0.w.weight": np.zeros((2, 2), np.float32),
               "b.blocks.0.w.weight": np.zeros((2, 2), np.float32)},
              checkpoint / "model.safetensors")
    status, _, err = _run(["init", "--checkpoint", str(checkpoint)], capsys)
    assert status == 1
    assert (f"{checkpoint}: partc init found 2 layer repetitions in {checkpoint} (a.layers, "
            "b.blocks) and cannot tell which is the decoder") in err


def _keys_of(checkpoint: Path) -> set[str]:
    """A checkpoint folder's tensor names, read by the safetensors library."""
    names: set[str] = set()
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "np") as opened:
            names.update(opened.keys())
    return names


def _compiled(family: Path, checkpoint: Path, tp: int, pp: int, out: Path,
              capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    status, _, err = _run(["compile", str(family), "--checkpoint", str(checkpoint), "--tp",
                           str(tp), "--pp", str(pp), "--out", str(out)], capsys)
    assert status == 0, err
    plan: dict[str, object] = json.loads(next(out.rglob("plan.json")).read_text())
    return plan


def _checks(family: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(["check", str(family), "--checkpoint", str(checkpoint), "--tp", "2",
                             "--pp", "2"], capsys)
    assert status == 0, err
    assert out.startswith("ok: family, config binding, checkpoint, topology checked")


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    """A random PaliGemma written by transformers (vision width 40, decoder width 48), with
    its decoder's hidden and vocabulary sizes read from the model's own config object. Its
    config.json keeps PaliGemmaConfig's legacy top-level `hidden_size` (2048) and
    `vocab_size` (257152) beside `text_config`'s."""
    import torch
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    torch.manual_seed(0)
    config = PaliGemmaConfig(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 40,
                       "intermediate_size": 80, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 16, "patch_size": 8},
        text_config={"model_type": "gemma", "hidden_size": 48, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 260},
        image_token_index=257, projection_dim=48)
    model = PaliGemmaForConditionalGeneration(config)
    folder = tmp_path_factory.mktemp("paligemma") / "pg"
    model.save_pretrained(folder)
    text = model.config.text_config
    return folder, text.hidden_size, text.vocab_size


def test_paligemma_reads_the_decoder_fields_text_config_holds_beside_legacy_top_level_ones(
        paligemma: tuple[Path, int, int], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """PaliGemma's config.json has a top-level `hidden_size` (2048) and `vocab_size` besides
    `text_config`'s: the decoder's are the ones its tensors have, so they are read, and the
    boundaries (the projector's output, the decoder's hidden state) are the decoder's width."""
    folder, hidden, vocab = paligemma
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] != hidden == config["text_config"]["hidden_size"]
    assert config["vocab_size"] != vocab == config["text_config"]["vocab_size"]
    family = tmp_path / "pg.yaml"
    _, _, report = _init(folder, family, capsys)
    text = family.read_text()
    data = yaml.safe_load(text)
    for field in ("hidden_size", "vocab_size"):
        assert data["config"][field] == {"type": "int", "from": f"text_config.{field}"}
        assert not any(line.startswith(f"  {field}:") and CHECK in line
                       for line in text.splitlines())
    embedding = text[text.index("  - name: embedding"):]
    assert "    params: {weight: [vocab_size, hidden_size]}" in embedding[:embedding.index("\n\n")]
    assert f"[{hidden}]" not in text and f", {hidden}]" not in text  # no literal decoder width
    _checks(family, folder, capsys)
    plan = _compiled(family, folder, 1, 2, tmp_path / "out", capsys)
    cuts = plan["cuts"]
    assert isinstance(cuts, list) and cuts
    widths = [cut["boundary"]["primary"]["shape"][-1] for cut in cuts]
    boundary = plan["boundary"]
    assert isinstance(boundary, dict)
    assert widths + [boundary["primary"]["shape"][-1]] == [hidden] * (len(cuts) + 1), cuts
    assert isinstance(report["undecided"], list)


def test_a_top_level_field_and_text_configs_neither_matching_the_header_is_marked(
        paligemma: tuple[Path, int, int], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two different values of a field, neither the embedding's rows: text_config's is read,
    marked; a field whose two values agree is read from text_config, unmarked."""
    folder, hidden, vocab = paligemma
    checkpoint = tmp_path / "pg"
    shutil.copytree(folder, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"]["vocab_size"] = vocab + 4  # the embedding keeps `vocab` rows
    config["hidden_size"] = hidden  # the legacy field agrees with text_config's
    (checkpoint / "config.json").write_text(json.dumps(config))
    family = tmp_path / "pg.yaml"
    _, _, report = _init(checkpoint, family, capsys)
    text = family.read_text()
    assert (f"  vocab_size: {{type: int, from: text_config.vocab_size}}  {CHECK} the config's "
            f"top level has vocab_size = {config['vocab_size']} and text_config.vocab_size = "
            f"{vocab + 4}; neither matches the decoder's shapes in the header") in text
    assert "  hidden_size: {type: int, from: text_config.hidden_size}\n" in text
    assert len([line for line in text.splitlines() if CHECK in line]) == len(
        report["undecided"])  # type: ignore[arg-type]
    _checks(family, checkpoint, capsys)


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LLaVA-NeXT written by transformers: its root-level `image_newline` [48] (no
    module) beside `multi_modal_projector.linear_1/2`."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32,
                       "intermediate_size": 80, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
                       "projection_dim": 32},
        text_config={"model_type": "llama", "hidden_size": 48, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 260},
        image_token_index=257, image_grid_pinpoints=[[32, 32], [32, 64]])
    folder = tmp_path_factory.mktemp("llava_next") / "lnext"
    LlavaNextForConditionalGeneration(config).save_pretrained(folder)
    return folder


def test_llava_next_puts_its_root_level_image_newline_with_the_projector(
        llava_next: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = _keys_of(llava_next)
    assert "image_newline" in keys  # a tensor of no module
    family = tmp_path / "lnext.yaml"
    _init(llava_next, family, capsys)
    text = family.read_text()
    _checks(family, llava_next, capsys)
    data = yaml.safe_load(text)
    assert [g["group"] for g in data["graph"]] == ["vision", "projector", "decoder"]
    assert all(g["name"] for g in data["parameters"])
    newline = next(g for g in data["parameters"] if g["name"] == "projector.image_newline")
    assert newline["owner"] == {"unit": "projector"}
    assert newline["members"] == [{"target": "image_newline", "shape": ["hidden_size"]}]
    block = text[text.index('  - name: "projector.image_newline"'):]
    assert f"{CHECK} `image_newline` is a tensor of no module" in block[:block.index("\n\n")]
    plan = _compiled(family, llava_next, 2, 2, tmp_path / "out", capsys)
    tensors = plan["tensors"]
    assert isinstance(tensors, list)
    assert sorted(t["target"] for t in tensors) == sorted(keys)  # every tensor, once
    owners = {g["name"]: g["owner"] for g in plan["groups"]}  # type: ignore[attr-defined]
    projector = {t["target"] for t in tensors
                 if owners[t["group"]].get("group") == "projector"}
    assert projector == {"image_newline", *(f"multi_modal_projector.linear_{n}.{p}"
                                            for n in (1, 2) for p in ("weight", "bias"))}


def test_a_root_level_tensor_of_a_single_repetition_checkpoint_is_owned_by_the_last_stage(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _llama_with(tmp_path, "extra_scale", np.ones((64,), np.float32))  # [hidden]
    family = tmp_path / "extra.yaml"
    _init(checkpoint, family, capsys)
    text = family.read_text()
    _checks(family, checkpoint, capsys)
    data = yaml.safe_load(text)
    assert [g["group"] for g in data["graph"]] == ["decoder"]
    extra = next(g for g in data["parameters"] if g["name"] == "extra_scale")
    assert extra["owner"] == {"static": "output"}
    assert extra["members"] == [{"target": "extra_scale", "shape": ["hidden_size"]}]
    block = text[text.index('  - name: "extra_scale"'):]
    assert f"{CHECK} `extra_scale` is a tensor of no module" in block
    plan = _compiled(family, checkpoint, 2, 2, tmp_path / "out", capsys)
    targets = {t["target"]: t["stages"] for t in plan["tensors"]}  # type: ignore[attr-defined]
    assert sorted(targets) == sorted(_keys_of(checkpoint))
    assert targets["extra_scale"] == [1]


def _cohere(folder: Path, heads: int, kv_heads: int, hidden: int) -> Path:
    """A random Cohere with per-head q/k norms (`use_qk_norm`: [heads, head_dim] and
    [kv_heads, head_dim], head_dim = hidden / heads), written by transformers."""
    import torch
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    config = CohereConfig(hidden_size=hidden, intermediate_size=96, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=131,
                          max_position_embeddings=64, use_qk_norm=True)
    CohereForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def _shapes(checkpoint: Path, suffix: str) -> dict[str, list[int]]:
    """The shapes of a checkpoint's tensors ending in `suffix`, read by safetensors."""
    out: dict[str, list[int]] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "np") as opened:
            for name in opened.keys():
                if name.endswith(suffix):
                    out[name] = list(opened.get_slice(name).get_shape())
    return out


def _group_block(text: str, module: str) -> str:
    block = text[text.index(f'module: "model.layers.{{unit}}.{module}"'):]
    return block[:block.index("\n\n")]


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_cohere_per_head_norms_are_sized_by_their_heads_and_follow_another_config(
        kv_heads: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Cohere's q_norm / k_norm hold one head_dim row per head of their projection: the
    scaffold writes [num_attention_heads, head_dim] and [num_key_value_heads, head_dim], not
    the literal [4, 16] that held for this checkpoint only (and passed `partc check` against
    a larger config, declaring q_norm [4, 16] beside a [128, 128] q_proj). With as many KV
    heads as heads (kv_heads 4) both norms are [4, 16]: each is read as its own
    projection's heads, which a config with 2 KV heads of 8 heads tells apart. They are
    written in the attention group, split with their heads (`column`, `heads:`): kept whole,
    a rank computing 2 of 4 heads would get all 4 heads' rows (`partc check` refuses that)."""
    checkpoint = _cohere(tmp_path / "cohere", 4, kv_heads, 64)
    other = _cohere(tmp_path / "cohere8", 8, 2, 128)  # the same architecture, larger
    real = _shapes(checkpoint, "_norm.weight")
    assert real["model.layers.0.self_attn.q_norm.weight"] == [4, 16]
    assert real["model.layers.0.self_attn.k_norm.weight"] == [kv_heads, 16]
    family = tmp_path / "cohere.yaml"
    stdout, _, report = _init(checkpoint, family, capsys)
    text = family.read_text()
    attention = _group_block(text, "self_attn.q_proj")
    for norm, heads in (("q_norm", "num_attention_heads"), ("k_norm", "num_key_value_heads")):
        entry = (f'      - module: "model.layers.{{unit}}.self_attn.{norm}"\n'
                 f"        sharding: column\n        heads: {heads}\n"
                 f"        params: {{weight: [{heads}, head_dim]}}")
        assert entry in attention, attention
    assert "self_attn.q_norm" not in text.replace(attention, "")  # no replicated group of its own
    assert CHECK not in attention
    marked = [line for line in text.splitlines() if CHECK in line]
    assert len(marked) == len(report["undecided"])  # type: ignore[arg-type]
    assert f"{len(marked)} line(s) marked" in stdout
    for folder in (checkpoint, other):  # as written it holds for both checkpoints
        _checks(family, folder, capsys)
    status, _, err = _run(["check", str(family), "--config", str(other / "config.json"),
                           "--tp", "2"], capsys)
    assert status == 0, err
    for number, folder in enumerate((checkpoint, other)):
        plan = _compiled(family, folder, 2, 1, tmp_path / f"out{number}", capsys)
        compiled = {t["target"]: t["shape"] for t in plan["tensors"]  # type: ignore[attr-defined]
                    if t["target"].endswith("_norm.weight")}
        assert compiled == _shapes(folder, "_norm.weight")
    assert _shapes(other, "q_norm.weight")["model.layers.1.self_attn.q_norm.weight"] == [8, 16]
    assert _shapes(other, "k_norm.weight")["model.layers.1.self_attn.k_norm.weight"] == [2, 16]


def test_a_whole_per_head_norm_is_still_one_head_dim_and_replicated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3's q_norm / k_norm are one head_dim shared by every head: [head_dim],
    replicated, unmarked."""
    family = tmp_path / "qwen3.yaml"
    _init(hf("qwen3"), family, capsys)
    text = family.read_text()
    for norm in ("q_norm", "k_norm"):
        block = _group_block(text, f"self_attn.{norm}")
        assert block.splitlines()[1:] == ["    sharding: replicated",
                                          "    params: {weight: [head_dim]}"], block


_SHAPE = re.compile(r"\[([^\[\]]*)\]")


def _literal_lines(text: str) -> list[str]:
    """The lines declaring a shape with a literal dimension (a number other than 1) or a
    literal `units:`. (Qwen2-VL's `image_grid_thw` is [images, 3] whatever the config: its
    (t, h, w) axis is no dimension.)"""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "role: image_grid_thw, shape: [images, 3]" in line:
            continue
        code = line.split(" # ", 1)[0]
        code = re.sub(r"default: \[[^\]]*\]", "", code)  # a config default ([128, 128] blocks)
        shapes = _SHAPE.findall(code)
        if any(d.strip().isdigit() and d.strip() != "1" for s in shapes for d in s.split(",")) \
                or re.match(r"^\s*units: (?!1\s*$)\d+\s*$", code):
            out.append(line)
    return out


def test_granitemoe_marks_the_dimension_it_cannot_explain_on_its_own_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GraniteMoE's fused experts `input_linear` [experts, 2 * intermediate, hidden]: the
    expert count and the width are config fields, 2 * intermediate_size is no field the
    scaffold knows. Its params line keeps the literal and is marked (not only the group's
    "not a known projection" line), and the printed count is the count of marked lines."""
    import torch
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeConfig(hidden_size=64, intermediate_size=48, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2, num_local_experts=3,
                              num_experts_per_tok=2, vocab_size=131,
                              max_position_embeddings=64)
    checkpoint = tmp_path / "granitemoe"
    GraniteMoeForCausalLM(config).save_pretrained(checkpoint, safe_serialization=True)
    family = tmp_path / "granitemoe.yaml"
    stdout, _, report = _init(checkpoint, family, capsys)
    text = family.read_text()
    block = _group_block(text, "block_sparse_moe.input_linear")
    params = block.splitlines()[-1]
    assert params.startswith("    params: {weight: [num_local_experts, 96, hidden_size]}  "
                             f"{CHECK} `block_sparse_moe.input_linear`: weight axis 1: 96 is "
                             "no config field the scaffold knows"), params
    assert "    params: {weight: [num_local_experts, hidden_size, intermediate_size]}" in \
        _group_block(text, "block_sparse_moe.output_linear").splitlines()
    assert "  num_local_experts: int" in text.splitlines()  # declared: a shape uses it
    marked = [line for line in text.splitlines() if CHECK in line]
    assert len(marked) == len(report["undecided"])  # type: ignore[arg-type]
    assert f"wrote {family}: {len(marked)} line(s) marked" in stdout
    assert set(_literal_lines(text)) <= set(marked)
    _checks(family, checkpoint, capsys)


@pytest.mark.parametrize("checkpoint", [*(hf(f) for f in SCAFFOLDED), *(
    HF.parent / "quantized" / q for q in ("llama_mlx4", "qwen3_fp8", "deepseek_v3_fp8",
                                          "gpt_oss_mxfp4"))], ids=lambda p: p.name)
def test_every_literal_dimension_of_a_scaffold_is_on_a_marked_line(
        checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the scaffold writes as a number (BLOOM's fused [192, hidden_size], block-FP8's
    weight_scale_inv [4, 4]) holds for this checkpoint's config only: every such line is
    marked, so the count the scaffold prints covers them."""
    family = tmp_path / "f.yaml"
    stdout, _, report = _init(checkpoint, family, capsys)
    text = family.read_text()
    marked = [line for line in text.splitlines() if CHECK in line]
    assert [line for line in _literal_lines(text) if CHECK not in line] == []
    assert len(marked) == len(report["undecided"])  # type: ignore[arg-type]
    assert f"{len(marked)} line(s) marked" in stdout


@pytest.mark.parametrize("fixture", SCAFFOLDED)
def test_the_survey_holds_every_header_tensor_once_with_the_dtype_and_shape_safetensors_reads(
        fixture: str) -> None:
    """The survey the family is written from (layer repetitions, the decoder's, encoders' and
    projector's modules outside the layers, tensors of no module) partitions the header."""
    survey = survey_checkpoint(hf(fixture), hf(fixture) / "config.json")
    held: list[tuple[str, str, list[int]]] = [
        (f"{prefix}.{n}.{rest}", *signature) for prefix, layers in survey.layers.items()
        for n, tensors in layers.items() for rest, signature in tensors.items()]
    outside = [survey.decoder_modules, *(e.modules for e in survey.encoders),
               *([survey.projector[1]] if survey.projector else [])]
    held += [(f"{module}.{param}", *signature) for modules in outside
             for module, params in modules.items() for param, signature in params.items()]
    held += [(tensor, *signature) for tensor, signature in survey.loose.items()]
    with safe_open(hf(fixture) / "model.safetensors", "np") as opened:
        header = {name: opened.get_slice(name) for name in opened.keys()}
        expected = sorted((name, piece.get_dtype(), list(piece.get_shape()))
                          for name, piece in header.items())
    assert sorted(held) == expected


@pytest.mark.parametrize("fixture", sorted(VISION_LANGUAGE))
def test_the_survey_tells_the_decoder_from_the_vision_tower_and_counts_its_layers(
        fixture: str) -> None:
    survey = survey_checkpoint(hf(fixture), hf(fixture) / "config.json")
    config = json.loads((hf(fixture) / "config.json").read_text())
    vision, group, count = VISION_LANGUAGE[fixture]
    assert survey.prefix + "." == DECODER[fixture]
    assert len(survey.by_layer) == config["text_config"]["num_hidden_layers"]
    assert [(e.prefix + ".", e.group, e.section, len(e.by_layer)) for e in survey.encoders] == [
        (vision, group, "vision_config", config["vision_config"][count])]



@pytest.mark.parametrize("checkpoint", [*(hf(f) for f in SCAFFOLDED), *(
    HF.parent / "quantized" / q for q in ("llama_mlx4", "qwen3_fp8", "deepseek_v3_fp8",
                                          "gpt_oss_mxfp4"))], ids=lambda p: p.name)
def test_the_scaffold_text_parses_to_its_document_and_its_marks_are_comments(
        checkpoint: Path) -> None:
    """The text is the document written by PyYAML, each CHECK a comment on its own line: the
    parsed text is the document, and stays it with every comment taken out."""
    written = scaffold(checkpoint, checkpoint / "config.json")
    assert yaml.safe_load(written.text) == written.document
    uncommented = "\n".join(line.split("  # partc init: CHECK")[0] for line in
                            written.text.splitlines() if not line.lstrip().startswith("#"))
    assert yaml.safe_load(uncommented) == written.document
    assert written.document["family"] == json.loads(
        (checkpoint / "config.json").read_text())["model_type"]


def test_a_comment_is_placed_on_the_line_of_its_node_at_its_indentation() -> None:
    owner = Flow(static="output")
    group: dict[str, object] = {"name": Quoted("layers.{unit}.x"), "owner": owner,
                                "params": {"weight": FlowList([4, "hidden_size"])}}
    document = {"family": "f", "parameters": [group], "boundary": {"auxiliary": FlowList()}}
    comments = Comments()
    comments.mark(group["params"], "weight", "# partc init: CHECK: 4")  # type: ignore[arg-type]
    comments.note(group, "owner", "# owner guessed")
    comments.note(document["boundary"], "auxiliary", "# before", before=True)
    assert write_yaml(document, comments, ["# head"]) == (
        '# head\nfamily: f\n\nparameters:\n\n  - name: "layers.{unit}.x"\n'
        "    owner: {static: output}\n    # owner guessed\n    params:\n"
        "      weight: [4, hidden_size]  # partc init: CHECK: 4\n\nboundary:\n  # before\n"
        "  auxiliary: []\n")
