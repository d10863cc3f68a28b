"""partc: compile declarative LLM family descriptions into rank-local parallel loaders.

The public names below are imported lazily, so a generated rank module that imports
`partc.runtime` does not pay for the compiler (jinja2, yaml, jsonschema).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CompileOptions": "partc.api",
    "CompileResult": "partc.api",
    "check_family": "partc.api",
    "compile_family": "partc.api",
    "ArchitectureBoundaryError": "partc.errors",
    "ArchitectureParameterError": "partc.errors",
    "ArchitecturePartitionError": "partc.errors",
    "BoundaryPayloadError": "partc.errors",
    "ExecutorError": "partc.errors",
    "LaunchError": "partc.errors",
    "LayeredPartitionBeginError": "partc.errors",
    "LayeredPartitionError": "partc.errors",
    "CheckpointError": "partc.errors",
    "EmitError": "partc.errors",
    "LayoutError": "partc.errors",
    "LoadError": "partc.errors",
    "ParallelPlanError": "partc.errors",
    "PartcError": "partc.errors",
    "PartcErrors": "partc.errors",
    "SchemaError": "partc.errors",
    "SemanticError": "partc.errors",
    "SourceLocation": "partc.errors",
    "Plan": "partc.plan.ir",
    "RankPlan": "partc.plan.ranks",
    "ShardingPolicy": "partc.parallel.specs",
    "Topology": "partc.plan.topology",
}

__all__ = [
    "ArchitectureBoundaryError",
    "ArchitectureParameterError",
    "ArchitecturePartitionError",
    "BoundaryPayloadError",
    "CheckpointError",
    "CompileOptions",
    "CompileResult",
    "EmitError",
    "ExecutorError",
    "LaunchError",
    "LayeredPartitionBeginError",
    "LayeredPartitionError",
    "LayoutError",
    "LoadError",
    "ParallelPlanError",
    "PartcError",
    "PartcErrors",
    "Plan",
    "RankPlan",
    "SchemaError",
    "SemanticError",
    "ShardingPolicy",
    "SourceLocation",
    "Topology",
    "check_family",
    "compile_family",
    "__version__",
]

if TYPE_CHECKING:
    from partc.api import CompileOptions, CompileResult, check_family, compile_family
    from partc.errors import (
        ArchitectureBoundaryError,
        ArchitectureParameterError,
        ArchitecturePartitionError,
        BoundaryPayloadError,
        CheckpointError,
        EmitError,
        ExecutorError,
        LaunchError,
        LayeredPartitionBeginError,
        LayeredPartitionError,
        LayoutError,
        LoadError,
        ParallelPlanError,
        PartcError,
        PartcErrors,
        SchemaError,
        SemanticError,
        SourceLocation,
    )
    from partc.parallel.specs import ShardingPolicy
    from partc.plan.ir import Plan
    from partc.plan.ranks import RankPlan
    from partc.plan.topology import Topology


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'partc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
