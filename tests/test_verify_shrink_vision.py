"""A large vision-language config is shrunk section by section into a model transformers
builds and runs on verify's own inputs (issue 38): the decoder by the text rules, the tower
by the vision rules, and the fields tying them (image token ids, pooled image tokens, the
merger's width, M-RoPE sections) kept consistent.

The oracle is transformers' own forward: it raises when the image features and the image
tokens differ in number, when an image token id is past the vocabulary, when the merger's
output is not the decoder's width or M-RoPE's sections do not add up to half a head. The
configs are transformers' own config classes at released sizes (Gemma-3-4B's from
google/gemma-3-4b-it's config.json, Qwen2.5-VL's class defaults: a 7B-wide tower over a 70B
decoder with no `mrope_section` in its config), so none of them is built at full size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from partc.api import check_family
from partc.plan.topology import Topology
from partc.verify.shrink import reference_config

from support import large_vision_language

GEMMA3_4B = {
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "vocab_size": 262208, "sliding_window": 1024,
                    "max_position_embeddings": 131072},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                      "intermediate_size": 4304, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "image_size": 896, "patch_size": 14},
    "mm_tokens_per_image": 256, "image_token_index": 262144, "boi_token_index": 255999,
    "eoi_token_index": 256000}
"""Gemma-3-4B's sizes: a SigLIP tower of 64 x 64 patches pooled to 256 image tokens, whose
ids are past the vocabulary a shrunk model keeps."""


def _config(case: str) -> dict[str, Any]:
    from transformers import Gemma3Config, Qwen2_5_VLConfig

    made = Gemma3Config(**GEMMA3_4B) if case == "gemma3_4b" else Qwen2_5_VLConfig()
    return dict(json.loads(made.to_json_string()))


@pytest.mark.parametrize(("case", "changes", "image_tokens"), [
    ("gemma3_4b", ["text_config.hidden_size 2560 -> 64", "text_config.vocab_size 262208 -> 131",
                   "vision_config.hidden_size 1152 -> 64", "vision_config.image_size 896 -> 56",
                   "vision_config.num_hidden_layers 27 -> 3", "mm_tokens_per_image 256 -> 4",
                   "image_token_index 262144 -> 130", "eoi_token_index 256000 -> 129",
                   "boi_token_index 255999 -> 128"], 4),
    # Qwen2.5-VL's tower width is its `hidden_size`, the merger's `out_hidden_size`
    ("qwen2_5_vl", ["text_config.hidden_size 8192 -> 256", "'mrope_section': [2, 3, 3]",
                    "vision_config.hidden_size 3584 -> 64",
                    "vision_config.out_hidden_size 3584 -> 256", "vision_config.depth 32 -> 3",
                    "vision_config.fullatt_block_indexes [7, 15, 23, 31] -> [2]",
                    "image_token_id 151655 -> 129"], 6),
])
def test_a_large_vision_language_config_shrinks_into_a_model_transformers_runs(
        tmp_path: Path, case: str, changes: list[str], image_tokens: int) -> None:
    import torch

    from partc.verify.inputs import model_inputs
    from partc.verify.reference import build_reference, load_model
    config = _config(case)
    reference, notes = reference_config(config, tensor_parallel_size=2,
                                        pipeline_parallel_size=2)
    said = " ".join(notes)
    assert all(change in said for change in changes), said
    build_reference(reference, tmp_path / "model", seed=0)
    vocab = reference["text_config"]["vocab_size"]
    inputs = model_inputs(tmp_path / "model", vocab, 0, {"mm_token_type_ids"})
    model = load_model(tmp_path / "model")
    kwargs = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"
              or case == "qwen2_5_vl"}
    with torch.no_grad():
        logits = model(**kwargs).logits
    token = reference.get("image_token_index", reference.get("image_token_id"))
    assert inputs["input_ids"][0].tolist().count(token) == image_tokens
    assert logits.shape == (1, inputs["input_ids"].shape[1], vocab)


def test_stage_units_keep_every_layer_of_both_sections() -> None:
    """With --pp-layers (`keep_layers`) the units counted are the config's: the decoder's and
    the tower's layers are kept, each said in a note, while their widths shrink."""
    config = _config("gemma3_4b")
    reference, notes = reference_config(config, tensor_parallel_size=2,
                                        pipeline_parallel_size=2, keep_layers=True)
    assert reference["text_config"]["num_hidden_layers"] == 34
    assert reference["vision_config"]["num_hidden_layers"] == 27
    assert reference["vision_config"]["hidden_size"] == 64
    assert "kept all 34 layers: the pipeline check's stage units (--pp-layers) count them" in notes
    assert "kept all 27 vision layers: the pipeline check's stage units (--pp-layers) count " \
           "them" in notes


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_a_shrunk_vision_language_reference_compiles_wherever_the_real_config_does(
        tmp_path: Path, name: str) -> None:
    """A 70B decoder with a ViT-L tower: the shrunk config compiles (`partc check` with the
    built-in family) at every T up to 8 and at S = 4 where the real one does."""
    def compiles(config: dict[str, Any], tp: int, pp: int = 1) -> bool:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        topology = Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        return check_family(None, path, topology=topology) == []

    real = large_vision_language(name)
    sizes = [tp for tp in range(1, 9) if compiles(real, tp)]
    assert sizes[:4] == [1, 2, 3, 4] and compiles(real, 1, 4), sizes
    small, notes = reference_config(real, tensor_parallel_size=max(sizes),
                                    pipeline_parallel_size=4)
    assert any(n.startswith("shrunk vision tower") for n in notes), notes
    assert [tp for tp in sizes if compiles(small, tp)] == sizes, notes
    assert compiles(small, 1, 4), notes
