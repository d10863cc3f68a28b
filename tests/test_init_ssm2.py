"""`partc init` on Mamba2 mixers and Qwen3-Next's gated DeltaNet: the scaffold splits them as
architectures/bamba.yaml and architectures/qwen3_next.yaml declare them (in_proj and conv1d in
segments by heads and groups, A_log/D/dt_bias by head, out_proj row-parallel; the one Mamba2
group repeated over the ranks with its norm's statistic all-reduced; the DeltaNet by key
heads, its row order decided by `--prove`), so it checks and verifies at every T <= 4 the
built-in family checks at, as written, and its ranks read exactly the elements the built-in's
read (computed by compiling the built-in file). A Mamba2 checkpoint with two groups, written
by transformers, is split by group like tests/fixtures/mamba2_style/family.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from partc.api import check_family, plan_family
from partc.cli.main import main
from partc.plan.topology import Topology
from partc.scaffold.prove import read_share
from partc.verify.run import verify_family

from support import ROOT, hf

CHECK = "# partc init: CHECK:"
MAMBA2 = ROOT / "tests" / "fixtures" / "mamba2_style"
REFERENCE = {"bamba": ROOT / "architectures" / "bamba.yaml",
             "qwen3_next": ROOT / "architectures" / "qwen3_next.yaml",
             "mamba2": MAMBA2 / "family.yaml"}
"""The family each scaffold is compared with."""
MIXER = {"bamba": "layers.{unit}.mamba", "qwen3_next": "layers.{unit}.linear_attn",
         "mamba2": "layers.{unit}.mixer"}


def _mamba2_checkpoint(folder: Path) -> Path:
    """A checkpoint of transformers' Mamba2ForCausalLM (two groups) with the fixture's
    config, its names and shapes as transformers writes them (tied head left out)."""
    from safetensors.torch import save_file

    config = transformers.AutoConfig.from_pretrained(MAMBA2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((MAMBA2 / "config.json").read_text())
    return folder


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each checkpoint and the scaffold `partc init --prove` writes for it."""
    folder = tmp_path_factory.mktemp("ssm2")
    checkpoints = {"bamba": hf("bamba"), "qwen3_next": hf("qwen3_next"),
                   "mamba2": _mamba2_checkpoint(tmp_path_factory.mktemp("mamba2"))}
    out = {}
    for name, checkpoint in checkpoints.items():
        path = folder / f"{name}.yaml"
        assert main(["init", "--checkpoint", str(checkpoint), "--out", str(path), "--prove",
                     "--format", "json"]) == 0
        out[name] = (checkpoint, path)
    return out


def _legal(family: Path, checkpoint: Path) -> list[int]:
    return [tp for tp in (1, 2, 3, 4) if not check_family(
        family, checkpoint / "config.json", checkpoint,
        topology=Topology(tensor_parallel_size=tp))]


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_the_scaffold_of_a_state_space_mixer_checks_verifies_and_splits_as_the_reference(
        name: str, written: dict[str, tuple[Path, Path]]) -> None:
    checkpoint, family = written[name]
    text = family.read_text()
    block = text[text.index(f'name: "{MIXER[name]}"'):]
    block = block[:block.index("\n\n")]
    assert "role: channels" in block
    assert CHECK not in block.split("\n", 4)[-1]  # past its `when:` over layer numbers
    sizes = _legal(family, checkpoint)
    assert sizes == _legal(REFERENCE[name], checkpoint)
    assert sizes == ([1, 2] if name == "mamba2" else [1, 2, 4])
    report = verify_family(family, checkpoint / "config.json", tensor_parallel_sizes=sizes,
                           pipeline_parallel_size=1)
    assert [c.message for c in report.checks if not c.ok] == []
    assert any(c.group.startswith(MIXER[name].split("{")[0]) and c.tp == sizes[-1]
               for c in report.checks)
    for tp in sizes:
        shares = [read_share(plan_family(f, checkpoint / "config.json",
                                         Topology(tensor_parallel_size=tp),
                                         checkpoint=checkpoint))
                  for f in (family, REFERENCE[name])]
        assert shares[0] == shares[1], (tp, shares)


def test_the_delta_nets_row_order_is_proven_per_key_head_and_component_major_refused(
        written: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    checkpoint, family = written["qwen3_next"]
    text = family.read_text()
    assert "    units: linear_num_key_heads\n    # partc init --prove: per_head: verified " \
        "against transformers at T=2, 4\n" in text
    # [all q | all k | all v | all z] instead: rank 0 would compute with the wrong rows
    from partc.scaffold.family_text import scaffold

    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(scaffold(checkpoint, checkpoint / "config.json",
                              choices={MIXER["qwen3_next"]: 1}).text)
    assert "segments: [linear_num_key_heads * linear_key_head_dim, linear_num_key_heads * " \
        "linear_key_head_dim, linear_num_value_heads * linear_value_head_dim, " \
        "linear_num_value_heads * linear_value_head_dim]" in wrong.read_text()
    report = verify_family(wrong, checkpoint / "config.json", tensor_parallel_sizes=[2],
                           pipeline_parallel_size=1)
    assert report.first_failure is not None
    assert report.first_failure.group == "layers.0.linear_attn"


def test_the_mixers_sizes_are_the_configs_own_fields(
        written: dict[str, tuple[Path, Path]]) -> None:
    """Read from the config (`mamba_n_groups`, Mamba2's `n_groups`), not literals."""
    config = {name: json.loads((checkpoint / "config.json").read_text())
              for name, (checkpoint, _) in written.items()}
    fields = {"bamba": ("mamba_n_groups", "mamba_d_state", "mamba_n_heads", "mamba_expand",
                        "mamba_d_conv"),
              "qwen3_next": ("linear_num_key_heads", "linear_key_head_dim",
                             "linear_num_value_heads", "linear_value_head_dim",
                             "linear_conv_kernel_dim"),
              "mamba2": ("n_groups", "state_size", "num_heads", "expand", "conv_kernel")}
    for name, names in fields.items():
        text = written[name][1].read_text()
        for field in names:
            assert field in config[name]
            assert f"\n  {field}: int\n" in text, (name, field)
