"""Transfer plans: which elements each rank of one build needs from which rank of another.

Two builds of the same family, config and checkpoint differ only in how they cut the same global
tensors (T, S, E, X, balanced or chunk splits, KV replicas, redundant experts). For each
destination rank and tensor, `plan_transfer` lists the pieces that make it up: a source rank and
a box of that rank's local tensor, copied into a box of the destination's local tensor. Every
destination element is read exactly once (the minimum), from the least loaded source rank
holding it (bytes assigned so far, destination ranks in order, tensors by name), ties to the
lowest rank: replicas spread the load over their holders.
The result is a frozen value with a canonical JSON form; the same two plans give the same bytes.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.errors import LayoutError, SourceLocation
from partc.parallel.placements import (
    DTYPE_BITS,
    PlacementKind,
    Selection,
    local_shape,
    placement_from_compact,
)
from partc.plan.plan_records import PlanFile, PlanRank, PlanTensor

__all__ = ["Box", "RankTransfer", "TensorTransfer", "TransferPiece", "TransferPlan",
           "plan_selections", "plan_transfer", "transfer_between"]

TRANSFER_FORMAT = "partc-transfer"
"""The `format` value of a transfer plan's JSON form."""

Box = tuple[tuple[int, int], ...]
"""Half-open [start, end) per axis of a tensor."""

RankSelections = Mapping[str, Selection]
"""One rank's tensors: target -> the selection (axis, ranges) of the global tensor it holds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferPiece:
    """One copy: a box of a source rank's local tensor into a box of the destination's."""

    source_rank: int
    """The source build's rank the elements are read from."""
    source: Box
    """The box of the source rank's local tensor."""
    destination: Box
    """The box of the destination rank's local tensor (same extents as `source`)."""

    def __post_init__(self) -> None:
        if self.source_rank < 0 or len(self.source) != len(self.destination) or any(
                not 0 <= a < b or d - c != b - a
                for (a, b), (c, d) in zip(self.source, self.destination, strict=True)):
            raise LayoutError(f"a transfer piece from rank {self.source_rank} copies "
                              f"{list(self.source)} into {list(self.destination)}: expected "
                              "non-empty boxes of equal extents")

    @property
    def elements(self) -> int:
        """Elements the piece copies."""
        return math.prod(b - a for a, b in self.source)

    def to_json(self) -> list[Any]:
        """Compact JSON form: [source rank, source box, destination box]."""
        return [self.source_rank, [list(r) for r in self.source],
                [list(r) for r in self.destination]]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorTransfer:
    """How one destination rank's tensor is assembled."""

    target: str
    """Checkpoint name."""
    dtype: str
    """Safetensors dtype."""
    local_shape: tuple[int, ...]
    """The destination rank's local shape."""
    pieces: tuple[TransferPiece, ...]
    """The copies, covering the local tensor exactly once, in destination order."""

    def __post_init__(self) -> None:
        covered = sum(p.elements for p in self.pieces)
        if self.dtype not in DTYPE_BITS or covered != math.prod(self.local_shape) or any(
                len(p.destination) != len(self.local_shape)
                or any(e > n for (_, e), n in zip(p.destination, self.local_shape, strict=True))
                for p in self.pieces):
            raise LayoutError(f"the transfer of `{self.target}` ({self.dtype} "
                              f"{list(self.local_shape)}) has pieces covering {covered} "
                              "elements: expected the local tensor exactly",
                              tensor=self.target)

    @property
    def nbytes(self) -> int:
        """Bytes of the destination's local tensor (what it reads)."""
        return math.prod(self.local_shape) * DTYPE_BITS[self.dtype] // 8

    def piece_bytes(self, piece: TransferPiece) -> int:
        """Bytes one piece of this tensor copies."""
        return piece.elements * DTYPE_BITS[self.dtype] // 8

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"target": self.target, "dtype": self.dtype,
                "local_shape": list(self.local_shape),
                "pieces": [p.to_json() for p in self.pieces]}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTransfer:
    """Everything one destination rank reads."""

    rank: int
    """The destination build's rank."""
    tensors: tuple[TensorTransfer, ...]
    """Its tensors, sorted by target."""

    def __post_init__(self) -> None:
        names = [t.target for t in self.tensors]
        if names != sorted(set(names)):
            raise LayoutError(f"the transfer of rank {self.rank} lists its tensors out of order "
                              "or twice")


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferPlan:
    """Which elements each destination rank reads from which source rank (`plan_transfer`)."""

    family: str
    """The family both builds were compiled from."""
    source_plan_hash: str
    """Hash of the source build's plan."""
    destination_plan_hash: str
    """Hash of the destination build's plan."""
    source_world_size: int
    """Ranks of the source build."""
    destination_world_size: int
    """Ranks of the destination build."""
    global_bytes: int
    """Bytes of every tensor of the global table."""
    ranks: tuple[RankTransfer, ...]
    """Every destination rank, by rank."""
    naive_bytes: int = 0
    """Bytes a gather-everything-then-slice would move: each destination rank reads every
    tensor it holds part of, whole."""

    def __post_init__(self) -> None:
        if [r.rank for r in self.ranks] != list(range(self.destination_world_size)):
            raise LayoutError(f"a transfer plan to {self.destination_world_size} ranks lists "
                              f"ranks {[r.rank for r in self.ranks]}")
        for rank in self.ranks:
            for tensor in rank.tensors:
                for piece in tensor.pieces:
                    if piece.source_rank >= self.source_world_size:
                        raise LayoutError(
                            f"the transfer of `{tensor.target}` to rank {rank.rank} reads "
                            f"source rank {piece.source_rank} of {self.source_world_size}",
                            tensor=tensor.target)

    @property
    def total_bytes(self) -> int:
        """Bytes read over every destination rank: the minimum, each destination byte once."""
        return sum(t.nbytes for r in self.ranks for t in r.tensors)

    def pair_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per (source rank, destination rank) pair, sorted by the pair."""
        pairs: dict[tuple[int, int], int] = {}
        for rank in self.ranks:
            for tensor in rank.tensors:
                for piece in tensor.pieces:
                    key = (piece.source_rank, rank.rank)
                    pairs[key] = pairs.get(key, 0) + tensor.piece_bytes(piece)
        return dict(sorted(pairs.items()))

    def source_bytes(self) -> list[int]:
        """Bytes each source rank sends (reads out), by source rank."""
        sent = [0] * self.source_world_size
        for (source, _), nbytes in self.pair_bytes().items():
            sent[source] += nbytes
        return sent

    def to_json(self) -> dict[str, Any]:
        """JSON form (canonical with `partc.plan.ir.canonical_json`)."""
        return {"format": TRANSFER_FORMAT, "version": 1, "family": self.family,
                "source_plan_hash": self.source_plan_hash,
                "destination_plan_hash": self.destination_plan_hash,
                "source_world_size": self.source_world_size,
                "destination_world_size": self.destination_world_size,
                "global_bytes": self.global_bytes, "naive_bytes": self.naive_bytes,
                "ranks": [{"rank": r.rank, "tensors": [t.to_json() for t in r.tensors]}
                          for r in self.ranks]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TransferPlan:
        """Rebuild (and re-validate) a plan from its `to_json` form."""
        if data.get("format") != TRANSFER_FORMAT or data.get("version") != 1:
            raise LayoutError(f"not a partc transfer plan: expected format {TRANSFER_FORMAT!r} "
                              "version 1")
        try:
            return cls(
                family=str(data["family"]), source_plan_hash=str(data["source_plan_hash"]),
                destination_plan_hash=str(data["destination_plan_hash"]),
                source_world_size=int(data["source_world_size"]),
                destination_world_size=int(data["destination_world_size"]),
                global_bytes=int(data["global_bytes"]), naive_bytes=int(data["naive_bytes"]),
                ranks=tuple(RankTransfer(rank=int(r["rank"]), tensors=tuple(
                    TensorTransfer(target=str(t["target"]), dtype=str(t["dtype"]),
                                   local_shape=tuple(int(n) for n in t["local_shape"]),
                                   pieces=tuple(TransferPiece(
                                       source_rank=int(source), source=_box(box_s),
                                       destination=_box(box_d))
                                       for source, box_s, box_d in t["pieces"]))
                    for t in r["tensors"])) for r in data["ranks"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"a malformed transfer plan: {exc!r}") from None


def _box(value: Sequence[Sequence[int]]) -> Box:
    """A JSON box as a tuple of (start, end) pairs."""
    return tuple((int(a), int(b)) for a, b in value)


# ---------------------------------------------------------------- selections of a plan


SelectionCache = dict[tuple[Any, ...], "Selection | None"]
"""Each (compact placement, shape) already decoded into the selection it holds (a plan repeats
a few hundred distinct placements across 10^5 tensors and their ranks)."""


def rank_selection(plan: PlanFile, rank: PlanRank, tensor: PlanTensor,
                   cache: SelectionCache | None = None) -> Selection | None:
    """The part of `tensor` that `rank` holds, or None when it holds none: its TP rank's
    placement, or under expert parallelism (docs/expert_parallel.md) its ETP rank's for a
    per-expert tensor of an expert in its slots, its stage-local rank's for a stacked one."""
    if rank.pipeline_stage not in tensor.stages:
        return None
    row = rank.tensor_parallel_rank
    experts = plan.expert_parallel
    if experts is not None and tensor.group in experts.expert_groups:
        expert = experts.expert_groups[tensor.group]
        if expert is None:  # stacked: one placement per stage-local rank
            row = rank.rank % experts.ranks_per_stage
        elif expert not in experts.slots[rank.info.expert_parallel_rank or 0]:
            return None
        else:
            row = rank.info.expert_tensor_parallel_rank or 0
    if row >= len(tensor.placements):
        return None, ()
    key = (tensor.placements[row], tensor.shape)
    if cache is not None and key in cache:
        return cache[key]
    placement = placement_from_compact(tensor.placements[row])
    found = None if placement.kind is PlacementKind.OMIT else placement.selection(tensor.shape)
    if cache is not None:
        cache[key] = found
    return found


def plan_selections(plan: PlanFile) -> list[dict[str, Selection]]:
    """Every rank's tensors and the selection each holds, by build rank (each tensor asked of
    the ranks of its stages only)."""
    found: list[dict[str, Selection]] = [{} for _ in plan.ranks]
    cache: SelectionCache = {}
    for tensor in plan.tensors:
        for stage in tensor.stages:
            for index in plan.shape.stage_ranks(stage):
                held = rank_selection(plan, plan.ranks[index], tensor, cache)
                if held is not None:
                    found[index][tensor.target] = held
    return found


# ---------------------------------------------------------------- the transfer


def plan_transfer(source: PlanFile, destination: PlanFile) -> TransferPlan:
    """The transfer plan from the ranks of `source` to those of `destination`; a LayoutError
    located in the destination's plan.json when they are not builds of one model."""
    _check_same_model(source, destination)
    tensors = {t.target: (t.dtype, t.shape) for t in source.tensors}
    ranks, naive = transfer_between(plan_selections(source), plan_selections(destination),
                                    tensors, where=destination.path)
    return TransferPlan(family=source.family, source_plan_hash=source.plan_hash,
                        destination_plan_hash=destination.plan_hash,
                        source_world_size=len(source.ranks),
                        destination_world_size=len(destination.ranks),
                        global_bytes=source.tensor_bytes_total(), ranks=ranks,
                        naive_bytes=naive)


def _check_same_model(source: PlanFile, destination: PlanFile) -> None:
    """Both plans are builds of one family, config and checkpoint: the same family, model
    type, checkpoint fingerprint (when both record one) and global tensor table."""
    def refuse(message: str, pointer: str = "", tensor: str | None = None) -> LayoutError:
        return LayoutError(f"cannot transfer between {source.path} and {destination.path}: "
                           f"{message}", location=SourceLocation(str(destination.path)),
                           pointer=pointer, tensor=tensor)

    if (source.family, source.model_type) != (destination.family, destination.model_type):
        raise refuse(f"the destination is family `{destination.family}` (model type "
                     f"{destination.model_type!r}), the source `{source.family}` (model type "
                     f"{source.model_type!r}); a transfer needs builds of one family",
                     "/family")
    a, b = source.checkpoint_fingerprint, destination.checkpoint_fingerprint
    if a is not None and b is not None and a != b:
        raise refuse(f"the destination was compiled against checkpoint fingerprint {b[:16]}, "
                     f"the source against {a[:16]}; a transfer needs one checkpoint",
                     "/checkpoint_fingerprint")
    theirs = {t.target: (t.dtype, t.shape) for t in source.tensors}
    ours = {t.target: (t.dtype, t.shape) for t in destination.tensors}
    for index, tensor in enumerate(destination.tensors):
        found = theirs.get(tensor.target)
        if found != (tensor.dtype, tensor.shape):
            held = "not in the source plan" if found is None else (
                f"{found[0]} {list(found[1])} in the source plan")
            raise refuse(f"tensor `{tensor.target}` is {tensor.dtype} {list(tensor.shape)} in "
                         f"the destination plan, {held}", f"/tensors/{index}", tensor.target)
    extra = sorted(set(theirs) - set(ours))
    if extra:
        raise refuse(f"the source plan holds {len(extra)} tensor(s) the destination plan does "
                     f"not: `{extra[0]}`{' ...' if len(extra) > 1 else ''}", "/tensors",
                     extra[0])
    _check_block_scales(source)
    _check_block_scales(destination)


def _check_block_scales(plan: PlanFile) -> None:
    """No rank's part of a block-quantized weight cuts through a block of its scale
    (`<weight>_scale_inv`, one scale per block): its bounds on each axis are multiples of the
    block (or the axis end), and the scale's part on that rank is exactly those blocks."""
    tensors = {t.target: t for t in plan.tensors}
    pairs = [(tensors[name[:-len("_scale_inv")]], scale) for name, scale in tensors.items()
             if name.endswith("_scale_inv") and name[:-len("_scale_inv")] in tensors]
    if not pairs:
        return
    cache: SelectionCache = {}
    for weight, scale in pairs:
        if len(weight.shape) != len(scale.shape) or 0 in scale.shape:
            continue
        blocks = [-(-w // s) for w, s in zip(weight.shape, scale.shape, strict=True)]
        for rank in plan.ranks:
            held = rank_selection(plan, rank, weight, cache)
            if held is None:
                continue
            axis, ranges = held
            if axis is None:
                continue
            block = blocks[axis]
            want = tuple((a // block, -(-b // block)) for a, b in ranges)
            cut = next(((a, b) for a, b in ranges
                        if a % block or (b % block and b != weight.shape[axis])), None)
            scaled = rank_selection(plan, rank, scale, cache)
            if cut is None and scaled is not None and (
                    scaled[0] is None and want == ((0, scale.shape[axis]),)
                    or scaled == (axis, want)):
                continue
            place = (f"rows/columns {cut[0]}:{cut[1]} of axis {axis}" if cut is not None
                     else f"axis {axis} {list(ranges)} while its scale holds {scaled}")
            raise LayoutError(
                f"rank {rank.rank} of {plan.path} holds {place} of `{weight.target}` "
                f"{list(weight.shape)}, cutting through its quantization blocks of {block} "
                f"(scale `{scale.target}` {list(scale.shape)}); a transfer never splits a "
                "block: compile the build again with partc", location=SourceLocation(
                    str(plan.path)), tensor=weight.target)


def transfer_between(sources: Sequence[RankSelections], destinations: Sequence[RankSelections],
                     tensors: Mapping[str, tuple[str, tuple[int, ...]]], *,
                     where: Path | None = None) -> tuple[tuple[RankTransfer, ...], int]:
    """The pieces each destination rank's tensors are made of, from any source ranks holding
    them (see the module's doc for the choice), and the bytes a gather-then-slice would read;
    `tensors` gives every target's dtype and global shape. A LayoutError names a destination
    tensor part no source rank holds."""
    holders: dict[str, list[tuple[int, Selection]]] = {}
    for rank, held in enumerate(sources):
        for target, selection in held.items():
            holders.setdefault(target, []).append((rank, selection))
    load = [0] * len(sources)
    ranks, naive = [], 0
    for rank, wanted in enumerate(destinations):
        made = []
        for target in sorted(wanted):
            dtype, shape = tensors[target]
            selection = wanted[target]
            pieces = _pieces(rank, target, shape, selection, holders.get(target, []), load,
                             DTYPE_BITS[dtype], where)
            made.append(TensorTransfer(target=target, dtype=dtype,
                                       local_shape=local_shape(shape, selection),
                                       pieces=pieces))
            naive += math.prod(shape) * DTYPE_BITS[dtype] // 8
        ranks.append(RankTransfer(rank=rank, tensors=tuple(made)))
    return tuple(ranks), naive


def _cuts(shape: tuple[int, ...], selections: Sequence[Selection]) -> list[list[int]]:
    """Per axis, every bound any selection places on it (0 and the size included)."""
    cuts = [{0, n} for n in shape]
    for axis, ranges in selections:
        if axis is not None:
            for a, b in ranges:
                cuts[axis].update((a, b))
    return [sorted(c) for c in cuts]


def _holds(selection: Selection, box: Box) -> bool:
    """Whether a rank holding `selection` holds every element of `box`."""
    axis, ranges = selection
    if axis is None:
        return True
    a, b = box[axis]
    return any(s <= a and b <= e for s, e in ranges)


def _local(selection: Selection, box: Box) -> Box:
    """`box` (global coordinates, inside one range of the selection) in local coordinates."""
    axis, ranges = selection
    if axis is None:
        return box
    a, b = box[axis]
    offset = 0
    for s, e in ranges:
        if s <= a and b <= e:
            break
        offset += e - s
    return (*box[:axis], (offset + a - s, offset + b - s), *box[axis + 1:])


def _cells(shape: tuple[int, ...], selection: Selection, cuts: list[list[int]]
           ) -> Iterator[Box]:
    """The elementary boxes of the destination's part, in its local (row-major) order."""
    axis, ranges = selection
    spans: list[list[tuple[int, int]]] = []
    for dim, points in enumerate(cuts):
        pairs = list(itertools.pairwise(points))
        if dim == axis:
            pairs = [(a, b) for a, b in pairs
                     if any(s <= a and b <= e for s, e in ranges)]
        spans.append(pairs)
    yield from itertools.product(*spans)


def _pieces(rank: int, target: str, shape: tuple[int, ...], selection: Selection,
            holders: list[tuple[int, Selection]], load: list[int], bits: int,
            where: Path | None) -> tuple[TransferPiece, ...]:
    """One destination tensor's pieces; `load` (bytes per source rank) is updated."""
    if not shape or math.prod(local_shape(shape, selection)) == 0:
        return ()
    whole = _whole_holders(shape, selection, tuple(holders))
    if whole is not None:  # one box single holders hold: read it from the least loaded one
        destination, elements, holding = whole
        chosen, source = min(holding, key=lambda item: (load[item[0]], item[0]))
        load[chosen] += elements * bits // 8
        return (TransferPiece(source_rank=chosen, source=source, destination=destination),)
    cuts = _cuts(shape, [selection, *(s for _, s in holders)])
    pieces: list[tuple[int, Box]] = []  # (source rank, global box)
    for cell in _cells(shape, selection, cuts):
        able = [(r, s) for r, s in holders if _holds(s, cell)]
        if not able:
            raise LayoutError(
                f"no rank of the source holds {[list(c) for c in cell]} of `{target}` "
                f"{list(shape)}, which destination rank {rank} needs",
                location=None if where is None else SourceLocation(str(where)), tensor=target)
        chosen, held = min(able, key=lambda item: (load[item[0]], item[0]))
        load[chosen] += math.prod(b - a for a, b in cell) * bits // 8
        if pieces and (merged := _merge(pieces[-1], chosen, cell, held, selection)):
            pieces[-1] = merged
        else:
            pieces.append((chosen, cell))
    sources = dict(holders)
    return tuple(TransferPiece(source_rank=r, source=_local(sources[r], box),
                               destination=_local(selection, box)) for r, box in pieces)


@functools.lru_cache(maxsize=4096)
def _whole_holders(shape: tuple[int, ...], selection: Selection,
                   holders: tuple[tuple[int, Selection], ...]
                   ) -> tuple[Box, int, tuple[tuple[int, Box], ...]] | None:
    """When the destination's part is one box that single holders hold whole: its local box,
    its elements, and each such holder's rank and box in its local tensor; None otherwise (the
    part is then cut into cells). Cached: the layers of a model repeat a few structures."""
    axis, ranges = selection
    if axis is not None and len(ranges) != 1:
        return None
    box = tuple((0, n) if d != axis else ranges[0] for d, n in enumerate(shape))
    able = tuple((r, _local(s, box)) for r, s in holders if _holds(s, box))
    if not able:
        return None
    return _local(selection, box), math.prod(b - a for a, b in box), able


def _merge(last: tuple[int, Box], chosen: int, cell: Box, held: Selection,
           selection: Selection) -> tuple[int, Box] | None:
    """`last` grown by `cell` when both come from one source, `cell` continues it along one axis
    (the same extents on every other), and the union lies in one range of the source's and of
    the destination's selection (so it is one box in both local tensors); else None."""
    source, box = last
    if source != chosen:
        return None
    differs = [d for d, (x, y) in enumerate(zip(box, cell, strict=True)) if x != y]
    if len(differs) != 1 or box[differs[0]][1] != cell[differs[0]][0]:
        return None
    axis = differs[0]
    union = (*box[:axis], (box[axis][0], cell[axis][1]), *box[axis + 1:])
    if not (_holds(held, union) and _holds(selection, union)):
        return None
    return source, union
