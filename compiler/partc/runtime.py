"""The small runtime that generated rank modules import.

A rank module holds literal tables; these functions turn them into the `parallel` and
`partition` values (through their validating constructors) and read the rank's slices from a
checkpoint after checking its header against the plan.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partc.boundary import ArchitectureBoundary, PipelineActivationDtype, PipelineWireContract
from partc.boundary import architecture_boundary as _boundary_of
from partc.checkpoint import (
    DTYPES,
    Checkpoint,
    ShardManifest,
    TensorSelection,
    open_checkpoint,
    paused_gc,
    read_shard_manifest,
    read_tensors,
)
from partc.digests import VERIFY_MODES, manifest_digests, verify_digests
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
    checkpoint_header_digest: str | None
    """sha256 of that checkpoint's stored header bytes (equal: fingerprint not recomputed)."""
    kinds: tuple[tuple[Any, ...], ...]
    """KINDS rows: role, logical units, logical range, fell back, members (dtype, global shape,
    compact placement, KV replicas)."""
    owners: tuple[Mapping[str, Any], ...]
    """OWNERS rows: JSON form of each group owner."""
    groups: str | tuple[str, ...]
    """GROUPS: one line per group, `<kind> <owner> <logical name>` (text, or a tuple of lines
    when a name is not plain ASCII)."""
    targets: str | tuple[str, ...]
    """TARGETS: one checkpoint name per line, group by group (text or a tuple, as GROUPS)."""
    partition: Mapping[str, Any]
    """The stage's partition (JSON form)."""
    info: Mapping[str, Any]
    """Byte accounting (JSON form)."""
    boundary: Mapping[str, Any]
    """Boundary wire schema (JSON form)."""
    activation_dtype: str
    """Pipeline activation dtype."""
    digests: str | tuple[str, ...] | None = None
    """DIGESTS: sha256 of each target's rank-local bytes, in TARGETS order, one per line (only
    in a build compiled with `--digests`)."""
    _rows: list[tuple[list[GroupRow], list[TensorRow]]] = field(
        default_factory=list, compare=False, repr=False)

    def group_rows(self) -> list[GroupRow]:
        """One row per group in binding order: (logical name, role, owner, logical units,
        logical range, fell back)."""
        return self._decoded()[0]

    def tensor_rows(self) -> list[TensorRow]:
        """One row per tensor, group by group: (target, group index, dtype, global shape,
        compact placement, KV replicas)."""
        return self._decoded()[1]

    def _decoded(self) -> tuple[list[GroupRow], list[TensorRow]]:
        """The columnar tables joined into rows (once; a rank has up to ~10^4 tensors)."""
        if not self._rows:
            with paused_gc():
                self._rows.append(_join_tables(self))
        return self._rows[0]


GroupRow = tuple[str, str, Mapping[str, Any], "int | None", "tuple[int, int] | None", bool]
"""(logical name, role, owner JSON, logical units, logical range, fell back to replication)."""
TensorRow = tuple[str, int, str, tuple[int, ...], tuple[Any, ...], int]
"""(target, index of its group, dtype, global shape, compact placement, KV replicas)."""


def _lines(value: str | tuple[str, ...]) -> list[str]:
    """The items of a GROUPS or TARGETS table: lines of a text, or a tuple's strings."""
    if isinstance(value, str):
        return value.split("\n")[:-1]
    return list(value)


def _join_tables(table: RankTable) -> tuple[list[GroupRow], list[TensorRow]]:
    """Rows from KINDS, OWNERS, GROUPS and TARGETS; CheckpointError if they do not fit."""
    targets, lines = _lines(table.targets), _lines(table.groups)
    groups: list[GroupRow] = []
    tensors: list[TensorRow] = []
    kinds: dict[str, tuple[Any, ...]] = {}  # KINDS index text -> row with tuple shapes
    try:
        for index, line in enumerate(lines):
            kind_text, owner_text, name = line.split(" ", 2)
            kind = kinds.get(kind_text)
            if kind is None:
                role, units, logical, fell_back, members = table.kinds[int(kind_text)]
                kind = kinds[kind_text] = (
                    role, units, None if logical is None else tuple(logical), fell_back,
                    [(dtype, tuple(shape), placement, kv_replicas)
                     for dtype, shape, placement, kv_replicas in members])
            groups.append((name, kind[0], table.owners[int(owner_text)], kind[1], kind[2],
                           kind[3]))
            first = len(tensors)
            tensors += [(targets[first + i], index, *member)
                        for i, member in enumerate(kind[4])]
    except (ValueError, IndexError, TypeError):
        raise CheckpointError(f"the generated tables of rank {table.rank} are malformed at "
                              f"GROUPS line {len(groups) + 1}; regenerate the build") from None
    if len(tensors) != len(targets):
        raise CheckpointError(f"the generated tables of rank {table.rank} list {len(targets)} "
                              f"TARGETS for {len(tensors)} group members; regenerate the build")
    return groups, tensors


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
    groups = table.group_rows()
    validated: dict[tuple[Any, ...], LocalTensorLayout] = {}  # one per distinct structure
    layouts = []
    for target, index, dtype, shape, compact, kv_replicas in table.tensor_rows():
        name, role, _, units, logical, fell_back = groups[index]
        key = (role, units, logical, fell_back, dtype, shape, compact, kv_replicas)
        first = validated.get(key)
        if first is None:
            placement = TensorPlacement.from_compact(compact)
            axis, ranges = placement.selection(shape)
            local = list(shape)
            if axis is not None:
                local[axis] = sum(b - a for a, b in ranges)
            first = validated[key] = LocalTensorLayout(
                target=target, logical_name=name, role=ParameterRole(role), dtype=dtype,
                global_shape=shape, local_shape=tuple(local), placement=placement,
                logical_units=units, logical_range=logical, fell_back_to_replication=fell_back,
                kv_replicas=kv_replicas)
        layouts.append(first.renamed(target, name))
    return LocalModelLayout(tensors=tuple(layouts))


def _parameter_bindings(table: RankTable) -> list[dict[str, Any]]:
    """The stage's parameter bindings (JSON form) from the GROUPS and TARGETS tables."""
    groups = table.group_rows()
    targets: list[list[str]] = [[] for _ in groups]
    for row in table.tensor_rows():
        targets[row[1]].append(row[0])
    return [{"group": group[0], "owner": group[2], "targets": names}
            for group, names in zip(groups, targets, strict=True)]


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
    return ArchitecturePartition.from_json(
        {**table.partition, "parameter_bindings": _parameter_bindings(table)},
        boundary=wire_contract(table))


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
    return checkpoint.fingerprint()


def check_header(table: RankTable, checkpoint: Checkpoint, *,
                 verify_fingerprint: bool = True) -> list[PartcError]:
    """Every mismatch between the rank's tensors and the checkpoint header."""
    errors: list[PartcError] = []
    if verify_fingerprint and table.checkpoint_fingerprint is not None:
        mismatch = checkpoint.fingerprint_error(
            table.checkpoint_fingerprint, table.checkpoint_header_digest,
            override="verify_fingerprint=False")
        if mismatch is not None:
            errors.append(mismatch)
    for target, _, dtype, shape, _, _ in table.tensor_rows():
        signature = checkpoint.signature(target)
        if signature is None:
            errors.append(CheckpointError(
                f"tensor `{target}` of the plan is not in the checkpoint",
                location=SourceLocation(str(checkpoint.path)), tensor=target))
            continue
        header, found_dtype, found_shape = signature
        if found_dtype != dtype:
            errors.append(CheckpointError(
                f"tensor `{target}` has dtype {found_dtype} in the checkpoint; the plan expects "
                f"{dtype}", location=SourceLocation(str(header.path)), tensor=target))
        if tuple(found_shape) != shape:
            errors.append(CheckpointError(
                f"tensor `{target}` has shape {list(found_shape)} in the checkpoint; the plan "
                f"expects {list(shape)}", location=SourceLocation(str(header.path)),
                tensor=target))
    return errors


def load_rank(table: RankTable, checkpoint: str | os.PathLike[str] | Checkpoint, *,
              verify_fingerprint: bool = True, dtype: Any = None, reader: Any = None,
              framework: str = "numpy", workers: int | None = None,
              progress: bool | None = None, verify: str | None = None) -> RankState:
    """Check the checkpoint header against the plan, then read only this rank's slices.

    `checkpoint` is a model folder (model.safetensors or its index), a file, an opened
    Checkpoint, or a folder written by `partc shard` for this plan (its rank file is read
    whole). `dtype` converts every floating tensor (bf16/fp8 included) after reading, e.g.
    `np.float32`, and leaves integer and packed tensors alone; `framework="torch"` returns
    torch tensors sharing the numpy memory; `reader` is told of every byte run read;
    `workers` caps the reader threads; `progress` shows a bar (None: on a terminal only);
    `verify="digest"` checks the sha256 of every tensor read against the shard manifest (a
    `partc shard` folder) or the digests compiled into the build (`--digests`).
    """
    if framework not in ("numpy", "torch"):
        raise CheckpointError(f"framework must be 'numpy' or 'torch', found {framework!r}")
    if verify not in VERIFY_MODES:
        raise CheckpointError(f"verify must be None or 'digest', found {verify!r}")
    target_dtype = None if dtype is None else _float_dtype(dtype)
    layout = local_model_layout(table)
    manifest = None if isinstance(checkpoint, Checkpoint) else read_shard_manifest(checkpoint)
    if manifest is not None:
        opened = _open_presharded(table, manifest, layout)
        requests = [(item.target, TensorSelection()) for item in layout.tensors]
    else:
        opened = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(
            Path(checkpoint))
        errors = check_header(table, opened, verify_fingerprint=verify_fingerprint)
        if errors:
            raise errors[0] if len(errors) == 1 else PartcErrors(errors)
        requests = [(item.target, TensorSelection(axis=item.selection[0],
                                                  ranges=item.selection[1]))
                    for item in layout.tensors]
    total = sum(item.local_bytes for item in layout.tensors)
    with progress_bar(total, f"rank {table.rank}", progress) as update:
        tensors = read_tensors(opened, requests, reader=reader, workers=workers,
                               progress=update)
    if verify == "digest":
        _verify_payloads(table, manifest, opened, tensors, workers)
    if target_dtype is not None:
        for name, array in tensors.items():  # one tensor at a time: the original is freed
            if array.dtype in _FLOAT_DTYPES and array.dtype != target_dtype:
                tensors[name] = array.astype(target_dtype)
    if framework == "torch":
        tensors = _to_torch(tensors)
    return RankState(tensors=tensors, layout=layout, info=parallel_model_info(table))


_FLOAT_DTYPES = frozenset(dt for name, dt in DTYPES.items() if name.startswith(("F", "BF")))
"""Floating dtypes a `dtype=` conversion applies to (bf16 and fp8 are numpy kind 'V')."""
_TORCH_VIEWS = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn",
                "float8_e5m2": "float8_e5m2", "float8_e8m0fnu": "float8_e8m0fnu"}
"""ml_dtypes dtype name -> torch dtype name, for types torch.from_numpy does not know."""


def _float_dtype(dtype: Any) -> np.dtype[Any]:
    """`dtype` as a numpy floating dtype (ml_dtypes' bf16/fp8 included), or CheckpointError."""
    try:
        found: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise CheckpointError(f"dtype must be a numpy floating dtype such as np.float32 or "
                              f"'bfloat16', found {dtype!r}") from None
    if found.kind != "f" and found not in _FLOAT_DTYPES:
        raise CheckpointError(f"dtype must be a floating dtype, found {found}; integer and "
                              "packed tensors are never converted")
    return found


def _verify_payloads(table: RankTable, manifest: ShardManifest | None, opened: Checkpoint,
                     tensors: dict[str, np.ndarray], workers: int | None) -> None:
    """Check every tensor read against its recorded digest (manifest first, else the build)."""
    expected = None if manifest is None else manifest_digests(manifest.path, table.rank)
    source = f"the shard manifest {manifest.path}" if manifest is not None else ""
    if expected is None and table.digests is not None:
        targets, digests = _lines(table.targets), _lines(table.digests)
        if len(targets) != len(digests):
            raise CheckpointError(f"the generated tables of rank {table.rank} list "
                                  f"{len(digests)} DIGESTS for {len(targets)} TARGETS; "
                                  "regenerate the build")
        expected, source = dict(zip(targets, digests, strict=True)), "the build's plan"
    if expected is None:
        where = "its shard manifest records none (cut by an older partc: run `partc shard` " \
            "again)" if manifest is not None else "this build was compiled without digests"
        raise CheckpointError(f"verify='digest' needs recorded digests, but {where}; compile "
                              "with `partc compile ... --checkpoint DIR --digests`, or load a "
                              "folder written by `partc shard`",
                              location=SourceLocation(str(opened.path)))
    files = {}
    for name in tensors:
        signature = opened.signature(name)
        files[name] = signature[0].path if signature is not None else opened.path
    verify_digests(tensors, expected, files, source, workers)


def _open_presharded(table: RankTable, manifest: ShardManifest, layout: LocalModelLayout
                     ) -> Checkpoint:
    """The rank's file of a `partc shard` folder, checked against the plan before any read."""
    where = SourceLocation(str(manifest.path))
    if manifest.plan_hash != table.plan_hash:
        raise CheckpointError(
            f"pre-sharded checkpoint was cut for plan {manifest.plan_hash[:16]}, this loader is "
            f"plan {table.plan_hash[:16]}; run `partc shard` again for this build",
            location=where)
    opened = open_checkpoint(manifest.rank_file(table.rank))
    errors: list[PartcError] = []
    expected = {item.target for item in layout.tensors}
    for extra in sorted(set(opened.names) - expected):
        errors.append(CheckpointError(f"tensor `{extra}` in the rank file is not one of rank "
                                      f"{table.rank}'s tensors", location=where, tensor=extra))
    for item in layout.tensors:
        target, dtype, shape = item.target, item.dtype, item.local_shape
        if target not in opened:
            errors.append(CheckpointError(f"tensor `{target}` of the plan is not in the rank "
                                          "file", location=where, tensor=target))
            continue
        header, entry = opened.tensor(target)
        if entry.dtype != dtype or tuple(entry.shape) != shape:
            errors.append(CheckpointError(
                f"tensor `{target}` is {entry.dtype} {list(entry.shape)} in the rank file; the "
                f"plan expects {dtype} {list(shape)}", location=SourceLocation(str(header.path)),
                tensor=target))
    if errors:
        raise errors[0] if len(errors) == 1 else PartcErrors(errors)
    return opened


@contextmanager
def progress_bar(total: int, description: str, enabled: bool | None = None
                 ) -> Iterator[Callable[[int], None] | None]:
    """A byte-count progress callback drawing a tqdm bar once a task passes one second.

    `enabled=None` draws only on a terminal and never under pytest; the callback is None
    when no bar is drawn (also when tqdm is not installed).
    """
    interactive = (sys.stderr is not None and sys.stderr.isatty()
                   and "PYTEST_CURRENT_TEST" not in os.environ)
    if enabled is False or (enabled is None and not interactive) or total <= 0:
        yield None
        return
    try:  # tqdm is optional at serving time: the runtime needs only numpy and ml_dtypes
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        yield None
        return
    with tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
              delay=1.0, leave=False, dynamic_ncols=True) as bar:
        yield bar.update


def _to_torch(tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Torch tensors sharing each array's memory (bf16/fp8 through an integer view)."""
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise CheckpointError("framework='torch' needs torch installed") from None
    out = {}
    for name, array in tensors.items():
        special = _TORCH_VIEWS.get(array.dtype.name)
        if special is None:
            out[name] = torch.from_numpy(array)
            continue
        torch_dtype = getattr(torch, special, None)
        if torch_dtype is None:
            raise CheckpointError(f"torch {torch.__version__} has no {special} for tensor "
                                  f"`{name}`", tensor=name)
        bits = array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8)
        out[name] = torch.from_numpy(bits).view(torch_dtype)
    return out


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
