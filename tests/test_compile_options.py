"""`compile_family(family, config, topology, options)`: the sizes are a `Topology`, the rest a
validated `CompileOptions`, whose realization options override the topology's only when given."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import partc
from partc.api import CompileOptions, compile_family
from partc.errors import LoadError
from partc.parallel.specs import ShardingPolicy, TensorSplit
from partc.partition.boundary import PipelineActivationDtype
from partc.plan.topology import Topology

from support import HF

LLAMA = HF / "llama" / "config.json"


def test_compile_family_takes_a_topology_and_options_positionally() -> None:
    assert list(inspect.signature(compile_family).parameters) == [
        "family", "config", "topology", "options"]
    assert partc.CompileOptions is CompileOptions


def test_options_hold_names_as_their_enums() -> None:
    options = CompileOptions(policy="replicate-unsupported", activation_dtype="float32",
                             split="chunk")
    assert options.policy is ShardingPolicy.REPLICATE_UNSUPPORTED
    assert options.activation_dtype is PipelineActivationDtype("float32")
    assert options.split is TensorSplit.CHUNK


@pytest.mark.parametrize(("options", "message"), [
    ({"split": "even"}, r"split must be one of balanced, chunk, found 'even'"),
    ({"policy": "lenient"}, r"policy must be one of require, replicate-unsupported"),
    ({"activation_dtype": "int3"}, r"activation dtype must be one of .* found 'int3'"),
    ({"digests": True}, r"digests need a checkpoint to read"),
])
def test_bad_options_are_refused_when_built(options: dict[str, object], message: str) -> None:
    with pytest.raises(LoadError, match=message):
        CompileOptions(**options)  # type: ignore[arg-type]


def test_no_topology_is_one_by_one_and_given_options_override_the_topology(
        tmp_path: Path) -> None:
    plan = compile_family(None, LLAMA).plan
    assert (plan.topology.tensor_parallel_size, plan.topology.pipeline_parallel_size) == (1, 1)
    chunked = Topology(tensor_parallel_size=2, split=TensorSplit.CHUNK)
    kept = compile_family(None, LLAMA, chunked, CompileOptions(out=tmp_path / "a")).plan
    assert kept.topology.split is TensorSplit.CHUNK  # options without a split keep the topology's
    replaced = compile_family(None, LLAMA, chunked,
                              CompileOptions(split="balanced", out=tmp_path / "b")).plan
    assert replaced.topology.split is TensorSplit.BALANCED
    assert json.loads((tmp_path / "a" / "plan.json").read_text())["topology"]["split"] == "chunk"
