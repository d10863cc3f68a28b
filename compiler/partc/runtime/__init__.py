"""What generated rank modules import: table decoding, checkpoint headers and reads, ranks.

This package needs only numpy, and ml_dtypes for a bf16 or fp8 tensor (imported then, not
here); never the compiler's jinja2, jsonschema or pyyaml. Its `__init__` is the face generated
modules call through `_runtime.<name>`; each name is defined in one submodule.
"""

from partc.runtime.loader import load_package_rank, load_rank, package_rank_module
from partc.runtime.tables import (
    RankTable,
    architecture_boundary,
    architecture_partition,
    boundary_schema,
    layered_partition_driver,
    local_model_layout,
    parallel_model_info,
    partition_state,
)

__all__ = [
    "RankTable",
    "architecture_boundary",
    "architecture_partition",
    "boundary_schema",
    "layered_partition_driver",
    "load_package_rank",
    "load_rank",
    "local_model_layout",
    "package_rank_module",
    "parallel_model_info",
    "partition_state",
]
