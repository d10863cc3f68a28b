"""`partc verify` on a Gemma-3-style vision-language model, whose projector pools the vision
tower's patches to `mm_tokens_per_image` image tokens (issue 38: the seeded image put one
image token per patch, and verify ended in an internal error).

The model is a tiny random `Gemma3ForConditionalGeneration` built here from transformers'
own config class (transformers 5.24.0, torch 2.13.0 CPU: tests/fixtures/gen/requirements.txt;
4 x 4 patches of a 16-pixel SigLIP tower pooled to 4 image tokens, the image token the last
id of the vocabulary, as Gemma-3's is one of its own), and its family is what `partc init`
writes for it, unedited.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partc.cli.main import main
from partc.parallel.specs import ShardingPolicy
from partc.verify.run import verify_family

IMAGE_TOKEN = 130
"""The image token: the last id of the vocabulary of 131, also verify's last text id."""


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random Gemma-3 written by transformers, and the family `partc init` scaffolds for it."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "vocab_size": 131, "sliding_window": 16, "max_position_embeddings": 128},
        mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=128,
        eoi_token_index=129)
    root = tmp_path_factory.mktemp("gemma3")
    Gemma3ForConditionalGeneration(config).save_pretrained(root / "model")
    family = root / "gemma3.yaml"
    assert main(["init", "--checkpoint", str(root / "model"), "--out", str(family)]) == 0
    return root / "model", family


def test_the_image_has_as_many_tokens_as_the_projector_gives_features(gemma3):
    """The image block has `mm_tokens_per_image` tokens, the rows transformers' own
    `get_image_features` gives for the seeded image; no text id is the image token."""
    import torch

    from partc.verify.inputs import model_inputs
    from partc.verify.reference import load_model

    folder, _ = gemma3
    inputs = model_inputs(folder, 131, 0, set())
    ids = inputs["input_ids"][0].tolist()
    model = load_model(folder)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=inputs["pixel_values"])
    pooled = getattr(features, "pooler_output", features)
    rows = sum(t.shape[-2] for t in pooled) if isinstance(pooled, (list, tuple)) \
        else pooled.reshape(-1, pooled.shape[-1]).shape[0]
    assert ids.count(IMAGE_TOKEN) == rows == 4
    assert ids[3:7] == [IMAGE_TOKEN] * 4  # the block after the third text token, text clear of it


def test_the_scaffolded_family_verifies_with_a_cut_inside_the_vision_tower(gemma3):
    """The crash is gone: every module of the tower, the projector and the decoder holds at
    T = 1, 2 (one KV head: replicated by the policy) and the stages at S = 3."""
    folder, family = gemma3
    report = verify_family(family, folder / "config.json", tensor_parallel_sizes=[1, 2],
                           pipeline_parallel_size=3,
                           policy=ShardingPolicy.REPLICATE_UNSUPPORTED)
    assert report.ok, report.first_failure
    modules = {c.module for c in report.checks}
    assert {"model.multi_modal_projector", "model.vision_tower.encoder.layers.0.mlp",
            "model.language_model.layers.0.mlp"} <= modules
    assert any(c.pp == 3 for c in report.checks)

