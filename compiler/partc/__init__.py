"""partc: compile declarative LLM family descriptions into rank-local parallel loaders."""

from __future__ import annotations

__version__ = "0.1.0"

from partc.api import CompileResult, check_family, compile_family  # noqa: E402
from partc.errors import (  # noqa: E402
    CheckpointError,
    EmitError,
    LayoutError,
    LoadError,
    ParallelPlanError,
    PartcError,
    PartcErrors,
    SchemaError,
    SemanticError,
    SourceLocation,
)
from partc.plan import Plan, RankPlan, Topology  # noqa: E402

__all__ = [
    "CheckpointError",
    "CompileResult",
    "EmitError",
    "LayoutError",
    "LoadError",
    "ParallelPlanError",
    "PartcError",
    "PartcErrors",
    "Plan",
    "RankPlan",
    "SchemaError",
    "SemanticError",
    "SourceLocation",
    "Topology",
    "__version__",
    "check_family",
    "compile_family",
]
