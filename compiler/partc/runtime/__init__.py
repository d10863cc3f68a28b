"""What generated rank modules import: table decoding, checkpoint headers and reads, ranks.

This package needs only numpy, and ml_dtypes for a bf16 or fp8 tensor (imported then, not
here); never the compiler's jinja2, jsonschema or pyyaml. Its `__init__` is the face generated
modules call through `_runtime.<name>`; each name is defined in one submodule.
"""

from typing import TYPE_CHECKING, Any

from partc.runtime._engine.reader import read_tensors
from partc.runtime._engine.selection import ReadOptions, ReadRecorder, TensorSelection
from partc.runtime.loader import load_package_rank, load_rank, package_rank_module
from partc.runtime.options import Framework, LoadOptions, Verify, ZeroCopy
from partc.runtime.rank_env import LaunchPosition, build_launch_position, launch_position
from partc.runtime.tables import (
    RankTable,
    architecture_boundary,
    architecture_partition,
    boundary_schema,
    expert_map,
    layered_partition_driver,
    local_model_layout,
    parallel_model_info,
    partition_state,
    receive_boundary,
    send_boundary,
)

if TYPE_CHECKING:
    from partc.runtime.mesh import (
        BuildTopology,
        build_device_mesh,
        build_process_groups,
        build_topology,
    )

_TOPOLOGY = ("BuildTopology", "build_device_mesh", "build_process_groups", "build_topology")
"""Names of `partc.runtime.mesh`, imported on first use: a process that only loads its
tensors never needs the rank arithmetic of process groups (import cost, issue 18)."""


def __getattr__(name: str) -> Any:
    """The topology helpers, imported when first asked for."""
    if name in _TOPOLOGY:
        from partc.runtime import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module 'partc.runtime' has no attribute {name!r}")

__all__ = [
    "BuildTopology",
    "Framework",
    "LaunchPosition",
    "LoadOptions",
    "RankTable",
    "ReadOptions",
    "ReadRecorder",
    "TensorSelection",
    "Verify",
    "ZeroCopy",
    "architecture_boundary",
    "architecture_partition",
    "boundary_schema",
    "build_device_mesh",
    "build_launch_position",
    "build_process_groups",
    "build_topology",
    "launch_position",
    "expert_map",
    "layered_partition_driver",
    "load_package_rank",
    "load_rank",
    "local_model_layout",
    "package_rank_module",
    "parallel_model_info",
    "partition_state",
    "read_tensors",
    "receive_boundary",
    "send_boundary",
]
