"""A rank's loaded tensors as torch DTensors on a tensor-parallel mesh, or a loud refusal.

DTensor's `Shard(axis)` follows `torch.chunk`: with n elements over T ranks, rank i holds
`[i·c, min((i+1)·c, n))` for `c = ceil(n / T)`. partc's balanced ranges give the first `n mod T`
ranks one extra element instead, and its fused-segment (`Indices`) placements and repeated KV
heads have no DTensor spelling at all (`partc compile --split chunk` makes uneven splits follow
torch.chunk where they can). A tensor is converted only when its partc placement is
exactly what DTensor would hold on that rank; otherwise `dtensor_placement` raises a
LaunchError naming the tensor, partc's range and DTensor's, so a DTensor is never silently
wrong. torch is imported only when DTensors are built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partc.errors import LaunchError
from partc.parallel.layout import LocalTensorLayout
from partc.parallel.placements import PlacementKind
from partc.parallel.specs import chunk_range
from partc.runtime.frameworks import import_torch, to_torch


@dataclass(frozen=True, slots=True, kw_only=True)
class DTensorSpec:
    """How one local tensor maps to a DTensor: replicated, or sharded on one axis."""

    target: str
    """Checkpoint tensor name."""
    shard_axis: int | None
    """The sharded axis; None when every rank holds the whole tensor."""
    global_shape: tuple[int, ...]
    """The DTensor's global shape."""


def dtensor_placement(layout: LocalTensorLayout, tensor_parallel_size: int,
                      tensor_parallel_rank: int) -> DTensorSpec:
    """The DTensor form of one layout on one TP rank, or a LaunchError saying why not."""
    target, placement = layout.target, layout.placement
    if placement.kind in (PlacementKind.LOCAL, PlacementKind.RANK) and tensor_parallel_size > 1:
        raise LaunchError(
            f"`{target}` is held whole by one rank of its tensor-parallel group only "
            f"({placement.kind.value}); DTensor's Replicate() would claim all "
            f"{tensor_parallel_size} hold it", tensor=target)
    if layout.kv_replicas > 1:
        raise LaunchError(
            f"`{target}` repeats KV heads over {layout.kv_replicas} ranks (KV replication); "
            "DTensor has no placement for repeated shards. load() without DTensors serves it "
            "(each rank its KV head); for DTensors compile at a TP size the KV heads divide, or "
            "with the group's `kv_replication: false` and --policy replicate-unsupported "
            "(attention replicated; docs/kv_replication.md)", tensor=target)
    if placement.holds_whole:
        return DTensorSpec(target=target, shard_axis=None, global_shape=layout.global_shape)
    axis, ranges = layout.selection
    if placement.kind is PlacementKind.INDICES or axis is None or len(ranges) != 1:
        raise LaunchError(
            f"`{target}` holds rows {_spell(ranges)} of axis {axis} (fused segments); DTensor's "
            "Shard holds one contiguous range per rank", tensor=target)
    expected = chunk_range(layout.global_shape[axis], tensor_parallel_size, tensor_parallel_rank)
    if ranges[0] != expected:
        raise _chunk_error(layout, tensor_parallel_rank, ranges[0], expected)
    return DTensorSpec(target=target, shard_axis=axis, global_shape=layout.global_shape)


def _chunk_error(layout: LocalTensorLayout, tensor_parallel_rank: int, held: Any,
                 chunk: Any) -> LaunchError:
    """The refusal of a tensor TP rank `tensor_parallel_rank` holds as `held`, not `chunk`."""
    target, (axis, _) = layout.target, layout.selection
    assert axis is not None  # a split tensor
    return LaunchError(
        f"`{target}`: partc split axis {axis} of {layout.global_shape[axis]} so that TP rank "
        f"{tensor_parallel_rank} holds {_spell((tuple(held),))}, but DTensor's Shard({axis}) "
        f"(torch.chunk) would hold {_spell((tuple(chunk),))} there; compile with `--split "
        "chunk` (a group split by units wider than one element, such as attention heads, "
        "cannot follow torch.chunk's element ranges: use a tensor-parallel size dividing its "
        "units) or use the plain tensors (every rank of the TP group refuses this state)",
        tensor=target)


def _spell(ranges: Any) -> str:
    return ", ".join(f"{a}:{b}" for a, b in ranges)


def dtensor_specs(layouts: Mapping[str, LocalTensorLayout] | Any, tensor_parallel_size: int,
                  tensor_parallel_rank: int) -> dict[str, DTensorSpec]:
    """`dtensor_placement` of every layout of a rank (a LocalModelLayout or a mapping)."""
    items = layouts.tensors if hasattr(layouts, "tensors") else tuple(layouts.values())
    return {layout.target: dtensor_placement(layout, tensor_parallel_size, tensor_parallel_rank)
            for layout in items}


def to_dtensors(state: Any, mesh: Any) -> dict[str, Any]:
    """A loaded RankState's tensors as DTensors on `mesh` (1-D, or a mesh with a `tp` dim).

    Every tensor is checked first, so either all are converted or none is.
    """
    torch = import_torch("to_dtensors()")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not (hasattr(state, "info") and hasattr(state, "layout") and hasattr(state, "tensors")):
        raise LaunchError(f"to_dtensors takes the RankState load() returned (its layout "
                          f"says how each tensor is split), found {type(state).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise LaunchError(f"to_dtensors takes a torch DeviceMesh (the package's "
                          f"device_mesh()), found {type(mesh).__name__}")
    info = state.info
    if info.ranks_per_stage or info.expert_parallel_size > 1:
        raise LaunchError(
            f"to_dtensors: rank {info.rank} is of an expert-parallel build, whose experts are "
            "held by their EP ranks only (DTensor has no placement for a tensor some ranks of "
            "the mesh lack); use its tensors with the package's process_groups()")
    omitted: tuple[str, ...] = getattr(state.table, "omitted_targets", tuple)()
    if omitted:  # every rank of the group lacks some head's tensors: all of them refuse
        raise LaunchError(
            f"to_dtensors: rank {info.rank} holds the per-head tensors of its own heads only "
            f"(`sharding: per_head`), not `{omitted[0]}` and {len(omitted) - 1} more that other "
            "ranks of its tensor-parallel group hold; DTensor has no placement for a tensor "
            "some ranks of the mesh lack. Use the plain tensors (each rank its heads' "
            "tensors)", tensor=omitted[0])
    tp_size, tp_rank = info.tensor_parallel_size, info.tensor_parallel_rank
    tp_mesh = _tp_mesh(mesh, info)
    mismatches = getattr(state.table, "chunk_mismatches", None)  # the stage's, on every rank
    if mismatches:
        target, rank, held, chunk = mismatches[0]
        raise _chunk_error(state.layout[target], rank, held, chunk)
    specs = dtensor_specs(state.layout, tp_size, tp_rank)
    arrays = state.tensors
    read_only = sorted(target for target, a in arrays.items()
                       if not isinstance(a, torch.Tensor) and not a.flags.writeable)
    if read_only:
        raise LaunchError(
            f"to_dtensors: `{read_only[0]}` is a read-only view of the checkpoint file "
            "(zero_copy=True), which a torch tensor cannot be; load with zero_copy='private' "
            "(writable copy-on-write views) or without zero_copy", tensor=read_only[0])
    if not all(isinstance(a, torch.Tensor) for a in arrays.values()):
        arrays = to_torch(dict(arrays))
    out: dict[str, Any] = {}
    made: dict[tuple[Any, ...], Any] = {}  # (axis, global shape, dtype) -> a from_local DTensor
    fast = True
    for target, local in arrays.items():  # both ways wrap the local tensor: no copy
        spec = specs[target]
        key = (spec.shard_axis, spec.global_shape, local.dtype)
        first = made.get(key)
        if first is not None and fast:
            wrapped = _like(DTensor, first, local)
            if wrapped is not None:
                out[target] = wrapped
                continue
            fast = False
        placement = Replicate() if spec.shard_axis is None else Shard(spec.shard_axis)
        out[target] = made[key] = DTensor.from_local(
            local, tp_mesh, [placement], run_check=False, shape=torch.Size(spec.global_shape),
            stride=_contiguous_strides(spec.global_shape))
    return out


def _tp_mesh(mesh: Any, info: Any) -> Any:
    """The tensor-parallel dimension of `mesh`, checked against the rank a state was loaded
    for: its size is the build's T, this process lies in it at the state's TP rank, and on
    the mesh's `pp` dimension (if any) at the state's stage."""
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" in names:
        tp_mesh = mesh["tp"]
    elif mesh.ndim == 1 and not names:  # an unnamed 1-D mesh is taken as the TP group
        tp_mesh = mesh
    else:
        raise LaunchError(
            "to_dtensors needs an unnamed 1-D tensor-parallel mesh or a mesh with a `tp` "
            f"dimension; this mesh has {mesh.ndim} dimensions named {names or 'nothing'}")
    size, rank = info.tensor_parallel_size, info.tensor_parallel_rank
    if tp_mesh.size() != size:
        raise LaunchError(f"the mesh's tp dimension has {tp_mesh.size()} ranks; this build "
                          f"has tensor-parallel size {size}")
    # Every process holds the whole mesh: each TP group of it must be T consecutive global
    # ranks from a multiple of T, as the build's are (g = (dp*S + stage)*T + tp), so that a
    # mesh of other groups is refused by every process, not only where its own group differs.
    whole = mesh.mesh
    axis = names.index("tp") if "tp" in names else whole.ndim - 1
    for group in whole.movedim(axis, -1).reshape(-1, whole.shape[axis]).tolist():
        if group != list(range(group[0], group[0] + size)) or group[0] % size:
            raise LaunchError(
                f"to_dtensors: the mesh's tp dimension groups global ranks {group}; a build's "
                f"TP group is {size} consecutive ranks from a multiple of {size} (global rank "
                "= (dp*S + stage)*T + tp): use the package's device_mesh()")
    if mesh.get_coordinate() is None:
        raise LaunchError("to_dtensors: this process is not one of the mesh's ranks")
    mine = tp_mesh.get_local_rank()
    if mine != rank:
        raise LaunchError(
            f"to_dtensors: the state is TP rank {rank} of the build (global rank {info.rank}), "
            f"but this process is TP rank {mine} of the mesh; load this process's own rank "
            "(the default: torchrun's RANK) or pass the mesh this rank belongs to")
    if "pp" in names and mesh.get_local_rank("pp") != info.pipeline_stage:
        raise LaunchError(
            f"to_dtensors: the state is of pipeline stage {info.pipeline_stage}, but this "
            f"process is on stage {mesh.get_local_rank('pp')} of the mesh")
    return tp_mesh


def _like(dtensor_type: Any, first: Any, local: Any) -> Any:
    """A DTensor of `local` with the distribution spec of `first` (a `from_local` DTensor of
    the same placement, global shape and dtype), or None where this torch refuses.

    `DTensor.from_local` builds a new DTensorSpec and goes through an autograd Function: about
    50-75 µs a tensor, 264 times for a 29-layer Llama. Inference weights need neither, and
    DTensor's own constructor with the spec `from_local` made for the first tensor of each kind
    (specs are immutable; DTensor's operators share them) takes a few µs. It is not a public
    constructor, so the result is checked against `first` and the caller falls back to
    `from_local` for the rest if it differs.
    """
    try:
        made = dtensor_type(local.view_as(local), first._spec, requires_grad=False)
    except (TypeError, AttributeError, RuntimeError):
        return None
    if (type(made) is not type(first) or made.placements != first.placements
            or made.shape != first.shape or made.stride() != first.stride()
            or made.requires_grad or made._local_tensor.data_ptr() != local.data_ptr()):
        return None
    return made


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a C-contiguous tensor of `shape` (torch's for a fresh tensor)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
