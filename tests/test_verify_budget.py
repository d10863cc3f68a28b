"""`partc verify` never builds a reference model that cannot fit: sizes are shrunk (however the
config spells them, and whichever fields the family reads), and what is left is estimated on
the meta device and refused over the memory budget before anything is allocated.

The hostile configs of issue 39 (a 2^31 `n_positions`, a 2^20 `head_dim`, a 2^26
`moe_intermediate_size`, a 2^20 Mamba state, a 70B `text_config` inside a vision-language
config and a ViT-L tower in its vision_config, shrunk section by section; a Qwen3-Next
linear-attention key width of 2^20 that no shrink rule knows) and the released GPT-2,
CodeGen-350M-mono and MPT-7B configs run in one child process whose address space is capped
at 3 GiB (`RLIMIT_AS`): a run that allocated any of these models at full size would die
there. Each run's outcome, message and the number of reference models it built are
asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from partc.cli.main import main
from partc.verify.shrink import reference_config

from support import FIXTURES, ROOT, edited_config, hf, large_vision_language

RELEASED = FIXTURES / "released"
ADDRESS_SPACE = 3 * 2**30
"""The child's address-space cap: torch and transformers need about 1.5 GiB of it."""
HOSTILE = {
    "gpt2_positions": (edited_config("gpt2", {"n_positions": 2**31}), None),
    "llama_head_dim": (edited_config("llama", {"head_dim": 2**20}), None),
    "qwen3_moe_width": (edited_config("qwen3_moe", {"moe_intermediate_size": 2**26}), None),
    "llava_70b_text": (large_vision_language("llava"), None),
    "qwen2_vl_70b_text": (large_vision_language("qwen2_vl"), None),
    "mamba_state": (edited_config("mamba", {"state_size": 2**20}), None),
    "qwen3_next_linear_keys": (edited_config("qwen3_next", {"linear_key_head_dim": 2**20}), None),
    "gpt2_124m": (None, RELEASED / "gpt2" / "config.json"),
    "codegen_350m_mono": (None, RELEASED / "codegen-350M-mono" / "config.json"),
    "mpt_7b": (None, RELEASED / "mpt-7b" / "config.json"),
}
"""Case -> (config written for it, or a released config file)."""
HOSTILE["llava_70b_small_budget"] = HOSTILE["llava_70b_text"]
FAMILIES = {"mpt_7b": RELEASED / "mpt.yaml"}
"""Cases verified with a family file (partc has no built-in MPT family)."""
OPTIONS = {"llava_70b_small_budget": ["--memory-budget", "64MiB"]}
"""Cases run with more options."""

_CHILD = """
import contextlib, io, json, resource, sys, time
from partc.cli.main import main
from partc.verify import run
built = []
real = run.build_reference
def counting(config, *args, **kwargs):
    built.append(1)
    return real(config, *args, **kwargs)
run.build_reference = counting
results = {}
for case, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    built.clear()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    results[case] = {"status": status, "out": out.getvalue(), "err": err.getvalue(),
                     "built": len(built), "seconds": time.perf_counter() - start}
results["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case of HOSTILE verified at T=2 x S=1 in one child process capped at
    ADDRESS_SPACE."""
    import resource

    folder = tmp_path_factory.mktemp("budget")
    argv = {}
    for case, (config, released) in HOSTILE.items():
        path = released or folder / f"{case}.json"
        if config is not None:
            path.write_text(json.dumps(config))
        family = [str(FAMILIES[case])] if case in FAMILIES else []
        argv[case] = ["verify", *family, "--config", str(path), "--tp", "2", "--pp", "1",
                      *OPTIONS.get(case, [])]

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argv)], cwd=ROOT,
                          capture_output=True, text=True, preexec_fn=cap, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = dict(json.loads(done.stdout.splitlines()[-1]))
    results["configs"] = {case: args[args.index("--config") + 1] for case, args in argv.items()}
    return results


def _notes(text: str) -> str:
    return " ".join(line for line in text.splitlines() if line.startswith("note: "))


@pytest.mark.parametrize(("case", "shrunk"), [
    ("gpt2_positions", ["n_positions 2147483648 -> 128"]),
    ("llama_head_dim", ["head_dim 1048576 -> 16"]),
    ("qwen3_moe_width", ["moe_intermediate_size 67108864 -> 32"]),
    ("mamba_state", ["state_size 1048576 -> 16"]),
    # at T=2: 2 "KV" heads (one per rank) of 2 query heads each, 16 wide
    ("gpt2_124m", ["n_embd 768 -> 64", "n_head 12 -> 4", "n_layer 12 -> 2",
                   "n_positions 1024 -> 128", "vocab_size 50257 -> 131"]),
    ("codegen_350m_mono", ["n_embd 1024 -> 64", "n_head 16 -> 4", "rotary_dim 32 -> 8",
                           "n_layer 20 -> 2", "n_positions 2048 -> 128",
                           "vocab_size 51200 -> 131"]),
    ("mpt_7b", ["d_model 4096 -> 64", "n_heads 32 -> 4", "n_layers 32 -> 2",
                "vocab_size 50432 -> 131"]),
    # a 70B text_config shrunk as a text model's; a ViT-L tower to 4 heads of 16, 3 layers
    # (vision_feature_layer -2) and 2 x 2 patches; the image token moved into the vocabulary
    ("llava_70b_text", ["text_config.hidden_size 8192 -> 256",
                        "text_config.num_hidden_layers 80 -> 2",
                        "text_config.vocab_size 128256 -> 131",
                        "vision_config.hidden_size 1024 -> 64",
                        "vision_config.num_attention_heads 16 -> 4",
                        "vision_config.num_hidden_layers 24 -> 3",
                        "vision_config.image_size 336 -> 28",
                        "vision_config.intermediate_size 4096 -> 128",
                        "image_token_index 128000 -> 130", "image_seq_length 576 -> 4"]),
    # the merger's output is the shrunk decoder's width; M-RoPE's sections half a 16-wide head
    ("qwen2_vl_70b_text", ["text_config.hidden_size 8192 -> 256",
                           "text_config.num_hidden_layers 80 -> 2",
                           "'mrope_section': [2, 3, 3]", "vision_config.embed_dim 1024 -> 64",
                           "vision_config.hidden_size 8192 -> 256",
                           "vision_config.num_heads 16 -> 4", "vision_config.depth 24 -> 3"]),
])
def test_a_config_with_huge_or_released_sizes_is_shrunk_and_verifies(runs, case, shrunk):
    result = runs[case]
    assert result["status"] == 0 and result["built"] == 1, result
    assert result["out"].splitlines()[-1].endswith("every check holds"), result["out"]
    notes = _notes(result["out"])
    assert all(part in notes for part in shrunk), notes
    # the estimate of the shrunk model, said in the report
    assert "within the memory budget of 4 GiB" in notes, notes


@pytest.mark.parametrize(("case", "kept", "budget"), [
    ("qwen3_next_linear_keys", "kept at full size (no shrink rule rewrites them): "
                               "`linear_key_head_dim` 1048576", "4 GiB"),
    # the shrunk llava-70B at T=2 over a budget of 64 MiB: the estimate of the shrunk model
    ("llava_70b_small_budget", "780,992 parameters, 2.98 MiB in float32, and a verify run at "
                               "2 rank(s) holds 7 copies of it: estimated peak 84.9 MiB", "64 MiB"),
])
def test_a_reference_model_over_the_budget_is_refused_before_it_is_built(runs, case, kept,
                                                                         budget):
    result = runs[case]
    assert result["status"] == 1 and result["built"] == 0, result
    errors = [line for line in result["err"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result["err"]
    assert errors[0].startswith(f"error: {runs['configs'][case]}: the reference model would "
                                "not fit the memory budget: "), errors
    assert f"over the budget of {budget}; no model was built" in errors[0], errors
    assert kept in errors[0], errors


def test_the_child_process_stayed_small(runs):
    # every shrunk model and the 2^20 linear-attention estimate together: well under the
    # 4 GB asked for
    assert runs["maxrss_kib"] < 2 * 2**20, runs["maxrss_kib"]



@pytest.fixture
def no_reference_model(monkeypatch):
    """Fail the test if verify gets as far as building a reference model."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("verify built a reference model over its budget")
    monkeypatch.setattr("partc.verify.run.build_reference", refuse)


@pytest.mark.parametrize(("budget", "said"), [("1MiB", "1 MiB"), ("300k", "300 KiB"),
                                              ("0.5M", "512 KiB")])
def test_memory_budget_is_the_limit_the_estimate_is_held_to(capsys, no_reference_model,
                                                            budget, said):
    # the tiny llama (127,808 parameters, 499 KiB) at T=2 holds 7 copies: 3.41 MiB + 64 MiB
    config = hf("llama") / "config.json"
    status = main(["verify", "--config", str(config), "--tp", "2", "--pp", "1",
                   "--memory-budget", budget])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert status == 1 and errors == [
        f"error: {config}: the reference model would not fit the memory budget: 127,808 "
        f"parameters, 499 KiB in float32, and a verify run at 2 rank(s) holds 7 copies of "
        f"it: estimated peak 67.4 MiB, over the budget of {said}; no model was built "
        "(--memory-budget raises the budget)"], errors


@pytest.mark.parametrize("budget", ["4XB", "-1", "0", "2PiB", "1e9", ""])
def test_a_memory_budget_that_is_not_a_size_is_a_usage_error(capsys, budget):
    with pytest.raises(SystemExit) as stopped:
        main(["verify", "--config", str(hf("llama") / "config.json"), "--memory-budget",
              budget])
    assert stopped.value.code == 2
    assert "argument --memory-budget: expected " in capsys.readouterr().err


def test_the_estimate_counts_the_parameters_transformers_builds():
    # the oracle: the tiny fixture's own checkpoint, as HF saved it (its tied head counted
    # once, as the model holds it once)
    from safetensors import safe_open

    from partc.verify.budget import estimate

    for name in ("llama", "llama_tied", "codegen", "qwen3_moe"):
        with safe_open(str(hf(name) / "model.safetensors"), "np") as handle:
            stored = sum(math.prod(handle.get_slice(n).get_shape())
                         for n in handle.keys())  # noqa: SIM118
        config = json.loads((hf(name) / "config.json").read_text())
        found = estimate(reference_config(config)[0], ranks=1)
        assert found.parameters == stored, name
        assert found.model_bytes >= 4 * stored
    codegen = estimate(reference_config(json.loads((hf("codegen") / "config.json")
                                                   .read_text()))[0], ranks=1)
    # CodeGen's rotary table is a buffer: n_positions 128 x rotary_dim 4, in float32
    assert codegen.model_bytes - 4 * codegen.parameters == 128 * 4 * 4


def test_a_config_its_own_class_refuses_is_one_error_at_the_config(tmp_path, capsys,
                                                                   no_reference_model):
    # huggingface_hub's strict config dataclass refuses it (not a ValueError): it ended in
    # exit 70, "internal error"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(edited_config("qwen2_vl", {}, {"text_config": {
        "num_hidden_layers": 3}})))
    status = main(["verify", "--config", str(config), "--tp", "1", "--pp", "1"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert status == 1 and len(errors) == 1, errors
    assert errors[0].startswith(
        f"error: {config}: transformers 5.24.0 cannot build a `qwen2_vl` causal LM from the "
        "config: Class validation error for validator 'validate_layer_type':"), errors
    assert errors[0].endswith("`num_hidden_layers` (3) must be equal to the number of "
                              "`layer_types` (2)"), errors
