"""Numpy reference executor for tiny Hugging Face checkpoints, whole or sharded.

It reproduces HF's forward pass (eager attention, no cache) from safetensors weights, either
from full tensors (:func:`forward`) or from per-rank tensor-parallel slices
(:func:`forward_tensor_parallel`) and pipeline stages (:func:`forward_pipeline`), so that the
slices a partc loader produces can be checked against HF's own logits.
"""

from .cut import cut_shards
from .fixtures import FIXTURES, fixture_folder, load_fixture, load_safetensors
from .model import (
    PipelineResult,
    Result,
    forward,
    forward_pipeline,
    forward_tensor_parallel,
)
from .quant import dequantize
from .shard import RankShard, Selection, ShardingError
from .vision import (
    Span,
    VisionLanguagePipelineResult,
    VisionLanguageResult,
    forward_vision_language,
    forward_vision_language_pipeline,
    forward_vision_language_tensor_parallel,
)
from .vision_cut import cut_vision_language

__all__ = [
    "FIXTURES",
    "PipelineResult",
    "RankShard",
    "Result",
    "Selection",
    "ShardingError",
    "Span",
    "VisionLanguagePipelineResult",
    "VisionLanguageResult",
    "cut_shards",
    "cut_vision_language",
    "dequantize",
    "fixture_folder",
    "forward",
    "forward_pipeline",
    "forward_tensor_parallel",
    "forward_vision_language",
    "forward_vision_language_pipeline",
    "forward_vision_language_tensor_parallel",
    "load_fixture",
    "load_safetensors",
]
