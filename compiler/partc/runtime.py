"""The small runtime that generated rank modules import.

A rank module holds literal tables; these functions turn them into the `parallel` and
`partition` values (through their validating constructors) and read the rank's slices from a
checkpoint after checking its header against the plan.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from partc.boundary import ArchitectureBoundary, PipelineActivationDtype, PipelineWireContract
from partc.boundary import architecture_boundary as _boundary_of
from partc.checkpoint import Checkpoint, TensorSelection, open_checkpoint, read_tensors
from partc.driver import LayeredPartitionDriver
from partc.errors import CheckpointError, PartcError, PartcErrors, SourceLocation
from partc.parallel import (
    LocalModelLayout,
    LocalTensorLayout,
    ParallelModelInfo,
    ParameterRole,
    TensorPlacement,
)
from partc.partition import (
    ArchitecturePartition,
    BoundaryTensorDimension,
    BoundaryTensorDimensionKind,
    BoundaryTensorDtype,
    BoundaryTensorSpec,
    BoundaryWireSchema,
    PartitionState,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTable:
    """The literal tables of one generated rank module."""

    plan_hash: str
    """Hash of the plan the module was generated from."""
    model_type: str
    """HF model type."""
    rank: int
    """Global rank."""
    tensor_parallel_rank: int
    """Rank within the stage."""
    pipeline_stage: int
    """Stage."""
    tensor_parallel_size: int
    """T."""
    pipeline_parallel_size: int
    """S."""
    checkpoint_fingerprint: str | None
    """Expected header fingerprint, when the plan was compiled against a checkpoint."""
    tensors: tuple[tuple[Any, ...], ...]
    """Rows: target, logical name, role, dtype, global shape, local shape, placement, units,
    logical range, fell back."""
    partition: Mapping[str, Any]
    """The stage's partition (JSON form)."""
    info: Mapping[str, Any]
    """Byte accounting (JSON form)."""
    boundary: Mapping[str, Any]
    """Boundary wire schema (JSON form)."""
    activation_dtype: str
    """Pipeline activation dtype."""


@dataclass(frozen=True, slots=True)
class RankState:
    """What `load` returns: the rank's arrays with their layout and accounting."""

    tensors: dict[str, np.ndarray]
    """Local arrays by checkpoint target, in target order."""
    layout: LocalModelLayout
    """This rank's layouts."""
    info: ParallelModelInfo
    """Topology and byte accounting."""


def local_model_layout(table: RankTable) -> LocalModelLayout:
    """The rank's LocalModelLayout, rebuilt through the validating constructors."""
    layouts = []
    for (target, logical, role, dtype, global_shape, local_shape, placement, units, logical_range,
         fell_back, kv_replicas) in table.tensors:
        layouts.append(LocalTensorLayout(
            target=target, logical_name=logical, role=ParameterRole(role), dtype=dtype,
            global_shape=tuple(global_shape), local_shape=tuple(local_shape),
            placement=TensorPlacement.from_json(placement), logical_units=units,
            logical_range=tuple(logical_range) if logical_range else None,
            fell_back_to_replication=fell_back, kv_replicas=kv_replicas))
    return LocalModelLayout(tensors=tuple(layouts))


def parallel_model_info(table: RankTable) -> ParallelModelInfo:
    """The rank's ParallelModelInfo."""
    return ParallelModelInfo(
        model_type=table.model_type, tensor_parallel_size=table.tensor_parallel_size,
        pipeline_parallel_size=table.pipeline_parallel_size, rank=table.rank,
        tensor_parallel_rank=table.tensor_parallel_rank, pipeline_stage=table.pipeline_stage,
        **{**table.info, "local_bytes_by_dtype": tuple(sorted(
            table.info.get("local_bytes_by_dtype", {}).items()))})


def architecture_partition(table: RankTable) -> ArchitecturePartition:
    """The stage's ArchitecturePartition (graph, bindings and wire contract included)."""
    return ArchitecturePartition.from_json(table.partition, boundary=wire_contract(table))


def partition_state(table: RankTable) -> PartitionState:
    """The stage's KV-state geometry and global state-layer range."""
    return architecture_partition(table).state


def wire_contract(table: RankTable) -> PipelineWireContract:
    """The pipeline wire contract: boundary schema and the compiled activation dtype."""
    return PipelineWireContract(schema=BoundaryWireSchema.from_json(table.boundary),
                                activation_dtype=PipelineActivationDtype(table.activation_dtype))


def architecture_boundary(table: RankTable) -> ArchitectureBoundary:
    """Typed encode/decode of the pipeline boundary under the wire contract."""
    return _boundary_of(wire_contract(table))


def layered_partition_driver(table: RankTable, storage: Mapping[str, Any] | None = None
                             ) -> LayeredPartitionDriver:
    """The stage's LayeredPartitionDriver, checking the executor's `storage` ranges if given."""
    return LayeredPartitionDriver.for_partition(architecture_partition(table), storage)


def boundary_schema(table: RankTable) -> BoundaryWireSchema:
    """The pipeline boundary wire schema."""
    def spec(data: Mapping[str, Any]) -> BoundaryTensorSpec:
        dims = tuple(BoundaryTensorDimension(kind=BoundaryTensorDimensionKind.FIXED, size=d)
                     if isinstance(d, int) else
                     BoundaryTensorDimension(kind=BoundaryTensorDimensionKind(d))
                     for d in data["shape"])
        return BoundaryTensorSpec(role=data["role"], shape=dims,
                                  dtype=BoundaryTensorDtype(data["dtype"]))
    b = table.boundary
    return BoundaryWireSchema(identity=b["identity"], primary=spec(b["primary"]),
                              auxiliary=tuple(spec(a) for a in b["auxiliary"]))


def header_fingerprint(checkpoint: Checkpoint) -> str:
    """sha256 over every tensor's (name, dtype, shape) in name order."""
    digest = hashlib.sha256()
    for name in checkpoint.names:
        _, entry = checkpoint.tensor(name)
        digest.update(f"{name}\0{entry.dtype}\0{list(entry.shape)}\n".encode())
    return digest.hexdigest()


def check_header(table: RankTable, checkpoint: Checkpoint, *,
                 verify_fingerprint: bool = True) -> list[PartcError]:
    """Every mismatch between the rank's tensors and the checkpoint header."""
    errors: list[PartcError] = []
    if verify_fingerprint and table.checkpoint_fingerprint is not None:
        found = header_fingerprint(checkpoint)
        if found != table.checkpoint_fingerprint:
            errors.append(CheckpointError(
                f"checkpoint header fingerprint {found[:16]} does not match the plan's "
                f"{table.checkpoint_fingerprint[:16]}; recompile against this checkpoint or pass "
                "verify_fingerprint=False", location=SourceLocation(str(checkpoint.path))))
    for row in table.tensors:
        target, dtype, shape = row[0], row[3], tuple(row[4])
        if target not in checkpoint:
            errors.append(CheckpointError(
                f"tensor `{target}` of the plan is not in the checkpoint",
                location=SourceLocation(str(checkpoint.path)), tensor=target))
            continue
        header, entry = checkpoint.tensor(target)
        where = SourceLocation(str(header.path))
        if entry.dtype != dtype:
            errors.append(CheckpointError(
                f"tensor `{target}` has dtype {entry.dtype} in the checkpoint; the plan expects "
                f"{dtype}", location=where, tensor=target))
        if tuple(entry.shape) != shape:
            errors.append(CheckpointError(
                f"tensor `{target}` has shape {list(entry.shape)} in the checkpoint; the plan "
                f"expects {list(shape)}", location=where, tensor=target))
    return errors


def load_rank(table: RankTable, checkpoint: str | os.PathLike[str] | Checkpoint, *,
              verify_fingerprint: bool = True, dtype: Any = None, reader: Any = None,
              framework: str = "numpy") -> RankState:
    """Check the checkpoint header against the plan, then read only this rank's slices.

    `dtype` converts every floating tensor after reading (e.g. `np.float32`);
    `framework="torch"` returns torch tensors sharing the numpy memory.
    """
    opened = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(
        Path(checkpoint))
    errors = check_header(table, opened, verify_fingerprint=verify_fingerprint)
    if errors:
        raise errors[0] if len(errors) == 1 else PartcErrors(errors)
    layout = local_model_layout(table)
    requests = []
    for item in layout.tensors:
        axis, ranges = item.selection
        requests.append((item.target, TensorSelection(axis=axis, ranges=ranges)))
    arrays = read_tensors(opened, requests, reader=reader)
    tensors = {name: arrays[name] for name, _ in requests}
    if dtype is not None:
        target_dtype = np.dtype(dtype)
        tensors = {k: v.astype(target_dtype) if v.dtype.kind == "f" or v.dtype.itemsize == 2
                   and v.dtype.kind == "V" else v for k, v in tensors.items()}
    if framework == "torch":
        tensors = _to_torch(tensors)
    elif framework != "numpy":
        raise CheckpointError(f"framework must be 'numpy' or 'torch', found {framework!r}")
    return RankState(tensors=tensors, layout=layout, info=parallel_model_info(table))


def _to_torch(tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise CheckpointError("framework='torch' needs torch installed") from None
    return {k: torch.from_numpy(v) for k, v in tensors.items()}


def rank_from_environment(world_size: int) -> int:
    """This process's global rank from torchrun's environment (`RANK`, `WORLD_SIZE`)."""
    raw = os.environ.get("RANK")
    if raw is None:
        raise CheckpointError("no rank given and RANK is not set; pass rank= or run under "
                              "torchrun")
    try:
        rank = int(raw)
    except ValueError:
        raise CheckpointError(f"environment RANK={raw!r} is not an integer") from None
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world != str(world_size):
        raise CheckpointError(f"WORLD_SIZE={world} but this build has {world_size} ranks "
                              "(TP x PP)")
    return rank


def rank_out_of_range(rank: int, world_size: int) -> CheckpointError:
    """The error for a rank outside the build."""
    return CheckpointError(f"rank {rank} is outside this build's ranks 0..{world_size - 1}")


def package_rank_module(package: str, modules: tuple[str, ...], rank: int | None = None) -> Any:
    """The generated module of `rank` in a build package (default: the rank under torchrun)."""
    world_size = len(modules)
    if rank is None:
        rank = rank_from_environment(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise CheckpointError(f"rank must be an integer, found {rank!r}")
    if not 0 <= rank < world_size:
        raise rank_out_of_range(rank, world_size)
    return importlib.import_module("." + modules[rank], package)


def load_package_rank(package: str, modules: tuple[str, ...], checkpoint: Any,
                      rank: int | None = None, **options: Any) -> RankState:
    """`load` of a build package: the rank module's `load(checkpoint, **options)`."""
    state: RankState = package_rank_module(package, modules, rank).load(checkpoint, **options)
    return state
