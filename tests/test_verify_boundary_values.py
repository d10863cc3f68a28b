"""Boundaries checked by value, not shape alone (issue 38): a cut must hand the next stage a
value the full model's logits depend on.

LLaVA's projector reads the vision layer before the last (`vision_feature_layer: -2`); the
built-in family makes only the layers read units (`vision_used`). A family that makes every
vision layer a unit and cuts after the last one hands off a tensor of the declared shape that
nothing reads: verify refuses that cut.
"""

from __future__ import annotations

from partc.verify.run import verify_family

from support import edited_family, hf


def test_a_cut_after_a_vision_layer_the_model_never_reads_is_refused(tmp_path):
    family = edited_family(tmp_path, "llava", "  vision_used: >-\n    vision_feature_layer if "
                           "vision_feature_layer >= 0\n    else vision_layers + 1 + "
                           "vision_feature_layer\n", "  vision_used: vision_layers\n")
    report = verify_family(family, hf("llava") / "config.json", tensor_parallel_sizes=[1],
                           stage_units=((("vision", 3),), (("projector", 1), ("decoder", 2))))
    failed = [c for c in report.checks if not c.ok]
    assert len(failed) == 1
    [cut] = failed
    assert (cut.pp, cut.module, cut.group, cut.rank) == (
        2, "model.vision_tower.encoder.layers.2", "vision", 0)
    assert cut.message.startswith(
        "T=1 x S=2: the cut after stage 0 (group `vision`, boundary `llava.vision`): it hands "
        "the next stage the output of `model.vision_tower.encoder.layers.2`, which the full "
        "model's logits do not depend on")
    # the stages' tensors still give the logits: only the value check sees it
    assert any(c.module == "logits" and c.ok for c in report.checks)
