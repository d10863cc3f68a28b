"""docs/verify.md's table of what verify proves and what it does not, kept true: each row's
case is run here and must give the row's verdict (issue 38).

A case returns what it observes: `caught: verify` (a failed check), `caught: verify
--checkpoint`, `caught: check` (refused statically) or `not caught` (the blind spot is still
there). To add a row, add a line to the table and a function to CASES; the verify runs the
cases share are made once (`Runs`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import pytest

from partc.verify.checkpoint_check import checkpoint_errors
from partc.verify.results import VerifyReport
from partc.verify.run import verify_family

import support
from support import QUANTIZED, ROOT, check_case, edited_family, fp8_scales_family, hf

DOC = ROOT / "docs" / "verify.md"
HEADING = "## What verify proves and what it does not"
VERDICTS = ("caught: verify", "caught: verify --checkpoint", "caught: check", "not caught")


def table() -> dict[str, str]:
    """The table's rows: case -> verdict, read from docs/verify.md (one row per line)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        found = re.fullmatch(r"\| `([\w-]+)` \| .+ \| ([^|]+) \|", line)
        if found:
            assert found.group(1) not in rows, f"case `{found.group(1)}` is listed twice"
            rows[found.group(1)] = found.group(2).strip()
    return rows


class Runs:
    """The verify runs and files the cases share, each made once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @cached_property
    def llama_o_proj_column(self) -> VerifyReport:
        """llama with `o_proj` declared column, at T = 2 x S = 2 checked as one build."""
        family = edited_family(self.folder, "llama", 'self_attn.o_proj"\n        sharding: row',
                               'self_attn.o_proj"\n        sharding: column')
        return verify_family(family, hf("llama") / "config.json", tensor_parallel_sizes=[2],
                             pipeline_parallel_size=2, combined=True)


def _verified(report: VerifyReport) -> str:
    return "not caught" if report.ok else "caught: verify"


def _checked(case: str) -> str:
    return "caught: check" if check_case(ROOT / "tests" / "cases" / case) else "not caught"


def wrong_split(runs: Runs) -> str:
    """The o_proj's ranks do not add up: the attention module fails."""
    failure = runs.llama_o_proj_column.first_failure
    assert failure is None or failure.module == "model.layers.0.self_attn", failure
    return _verified(runs.llama_o_proj_column)


def unread_cut(runs: Runs) -> str:
    """Every llava vision layer a unit, cut after the last one, which the projector never
    reads (it reads `vision_feature_layer: -2`)."""
    family = edited_family(runs.folder, "llava", "  vision_used: >-\n    vision_feature_layer "
                           "if vision_feature_layer >= 0\n    else vision_layers + 1 + "
                           "vision_feature_layer\n", "  vision_used: vision_layers\n")
    report = verify_family(family, hf("llava") / "config.json", tensor_parallel_sizes=[1],
                           stage_units=((("vision", 3),), (("projector", 1), ("decoder", 2))))
    failed = [c for c in report.checks if not c.ok]
    assert all((c.pp, c.module, c.group, c.rank) == (
        2, "model.vision_tower.encoder.layers.2", "vision", 0) for c in failed), failed
    assert all("which the full model's logits do not depend on" in c.message for c in failed)
    assert any(c.module == "logits" and c.ok for c in report.checks)  # the logits agree
    return _verified(report)


def released_names(runs: Runs) -> str:
    """llava in llava-hf's released naming, the family declaring transformers' prefix only."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "gen"))
    from gen_renamed import write_renamed

    released = write_renamed(hf("llava"), runs.folder / "released", "llava")
    family = edited_family(runs.folder, "llava", "candidates: [vision_tower.vision_model, "
                           "vision_tower]", "candidates: [vision_tower]")
    assert checkpoint_errors(None, released / "config.json", released) == []
    refused = checkpoint_errors(family, released / "config.json", released)
    return "caught: verify --checkpoint" if refused else "not caught"


def quantized_formats(runs: Runs) -> str:
    """Qwen3 FP8 with `down_proj`'s `weight_scale_inv` split on the other axis than its
    weight: each rank's stored slices no longer decode to its part of the weight."""
    family = fp8_scales_family(runs.folder, down_scale_axis=0, gate_segments=False)
    report = verify_family(family, QUANTIZED / "qwen3_fp8" / "config.json",
                           tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    failure = report.first_failure
    assert failure is None or "weight_scale_inv" in failure.message, failure
    return _verified(report)


def mtp_layers(runs: Runs) -> str:
    """deepseek_v3 with `o_proj` declared column: the MTP layer (model.layers.3, after the
    fixture's three decoder layers) is refused too, not only the decoder's."""
    family = edited_family(runs.folder, "deepseek_v3", '.o_proj"\n        sharding: row',
                           '.o_proj"\n        sharding: column')
    report = verify_family(family, hf("deepseek_v3") / "config.json",
                           tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    assert not report.ok
    refused = {c.module for c in report.checks if not c.ok}
    return "caught: verify" if "model.layers.3.self_attn" in refused else "not caught"


def tp_with_pp(runs: Runs) -> str:
    """The T = 2 x S = 2 run's module checks are made on that one build."""
    checks = runs.llama_o_proj_column.checks
    assert {(c.tp, c.pp) for c in checks} == {(2, 2)}
    return "caught: verify" if any(not c.ok and c.module == "model.layers.0.self_attn"
                                   for c in checks) else "not caught"


def large_vision_language(runs: Runs) -> str:
    """A llava config with a 70B decoder and a ViT-L tower, its vision layers' `out_proj`
    declared column: shrunk section by section (a full-size model could not be built), and
    the shrunk tower's attention refused at T = 2."""
    path = runs.folder / "llava-70b.json"
    path.write_text(json.dumps(support.large_vision_language("llava")))
    family = edited_family(runs.folder, "llava", '{module: "{path}.self_attn.out_proj", '
                           "sharding: row", '{module: "{path}.self_attn.out_proj", '
                           "sharding: column")
    report = verify_family(family, path, tensor_parallel_sizes=[2], pipeline_parallel_size=1)
    notes = " ".join(report.notes)
    assert "text_config.hidden_size 8192 -> 256" in notes, notes
    assert "vision_config.hidden_size 1024 -> 64" in notes, notes
    refused = {c.module for c in report.checks if not c.ok}
    assert all(m.startswith("model.vision_tower.") for m in refused), refused
    return "caught: verify" if "model.vision_tower.encoder.layers.0.self_attn" in refused \
        else "not caught"


CASES: dict[str, Callable[[Runs], str]] = {
    "wrong-split": wrong_split,
    "unread-cut": unread_cut,
    "released-names": released_names,
    "row-bias-split": lambda runs: _checked("row_bias_split_in_its_own_group"),
    "per-head-norms-whole": lambda runs: _checked("per_head_norms_kept_whole"),
    "quantized-formats": quantized_formats,
    "mtp-layers": mtp_layers,
    "tp-with-pp": tp_with_pp,
    "large-vision-language": large_vision_language,
}
"""Each row's case: what it observes, one of VERDICTS."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("doc-table"))


def test_every_row_has_a_case_and_every_case_a_row():
    rows = table()
    assert set(rows) == set(CASES)
    assert all(verdict in VERDICTS for verdict in rows.values()), rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_row_says_what_the_case_observes(case: str, runs: Runs):
    assert CASES[case](runs) == table()[case]
