"""Rank-local tensors with their selection metadata, and the simulated collectives.

Every helper here works on one rank's *local* tensors plus the global indices its
:class:`Selection` names; a full weight is never rebuilt. Collectives are strict: a reduction
either sums contributions that partition the contracted domain exactly, or takes one of several
identical replicated results. Anything else (overlap, gaps, replicas that disagree, a rank mixing
the two) raises :class:`ShardingError`, so a wrong slice cannot be averaged away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

F32 = np.float32


class ShardingError(ValueError):
    """The rank shards are inconsistent, incomplete or not supported by the executor."""


@dataclass(frozen=True)
class Selection:
    """A local tensor is the concatenation along ``axis`` of the global ``[start, end)`` ranges."""

    axis: int
    ranges: tuple[tuple[int, int], ...]

    def indices(self) -> np.ndarray:
        """Global indices along ``axis``, in local order."""
        parts = [np.arange(start, end) for start, end in self.ranges]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class RankShard:
    """One rank's tensors; ``selections[name]`` is None (or absent) for a whole tensor."""

    tensors: dict[str, np.ndarray]
    selections: dict[str, Selection | None] = field(default_factory=dict)
    experts_only: bool = False
    """An expert-parallel rank whose dense parts are another rank's copy: it takes part in the
    routed experts only (the dense layers run on the other ranks)."""

    @classmethod
    def of_state(cls, state: Any) -> RankShard:
        """One partc-loaded rank (a generated module's load() result): its arrays as float32,
        with its layout's selections."""
        selections: dict[str, Selection | None] = {}
        for target in state.tensors:
            axis, ranges = state.layout[target].selection
            selections[target] = None if axis is None else Selection(axis=axis, ranges=ranges)
        return cls(tensors={k: np.asarray(v, dtype=np.float32) for k, v in state.tensors.items()},
                   selections=selections)

    def has(self, name: str) -> bool:
        """Whether this rank holds tensor ``name``."""
        return name in self.tensors

    def selection(self, name: str) -> Selection | None:
        """The selection of ``name`` (checked against the local shape)."""
        sel = self.selections.get(name)
        if sel is not None:
            shape = self.tensors[name].shape
            if not 0 <= sel.axis < len(shape):
                raise ShardingError(f"{name}: selection axis {sel.axis} for shape {shape}")
            if any(end < start or start < 0 for start, end in sel.ranges):
                raise ShardingError(f"{name}: bad ranges {sel.ranges}")
            idx = sel.indices()
            if len(idx) != shape[sel.axis]:
                raise ShardingError(
                    f"{name}: ranges {sel.ranges} hold {len(idx)} rows, local axis {sel.axis}"
                    f" has {shape[sel.axis]}"
                )
            if len(np.unique(idx)) != len(idx):
                raise ShardingError(f"{name}: overlapping ranges {sel.ranges}")
        return sel

    def array(self, name: str) -> np.ndarray:
        """The local tensor upcast to float32."""
        if name not in self.tensors:
            raise ShardingError(f"rank lacks tensor {name}")
        return np.asarray(self.tensors[name], dtype=F32)

    def whole(self, name: str) -> np.ndarray:
        """The local tensor, which this rank must hold unsliced."""
        if self.selection(name) is not None:
            raise ShardingError(f"{name} must be held whole, got {self.selections[name]}")
        return self.array(name)

    def indices(self, name: str, axis: int) -> np.ndarray:
        """Global indices the local tensor covers along ``axis``."""
        sel = self.selection(name)
        if sel is not None and sel.axis == axis:
            return sel.indices()
        return np.arange(self.tensors[name].shape[axis])


def positions(wanted: np.ndarray, have: np.ndarray, what: str) -> np.ndarray:
    """Local positions in ``have`` of the global indices ``wanted`` (all must be present)."""
    if len(wanted) == 0:
        return np.zeros(0, dtype=np.int64)
    size = int(max(wanted.max(), have.max() if len(have) else 0)) + 1
    lookup = np.full(size, -1, dtype=np.int64)
    lookup[have] = np.arange(len(have))
    found = lookup[wanted]
    if (found < 0).any():
        missing = wanted[found < 0]
        raise ShardingError(f"{what}: rank lacks global indices {missing[:8].tolist()}...")
    return found


# --------------------------------------------------------------------------- local projections


def column(rank: RankShard, prefix: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column-parallel ``x @ W.T (+ b)``: local output features and their global indices."""
    name = f"{prefix}.weight"
    sel = rank.selection(name)
    if sel is not None and sel.axis != 0:
        raise ShardingError(f"{name}: column-parallel weight sliced on axis {sel.axis}")
    out_idx = rank.indices(name, 0)
    y = x @ rank.array(name).T
    if rank.has(f"{prefix}.bias"):
        bias_idx = rank.indices(f"{prefix}.bias", 0)
        y = y + rank.array(f"{prefix}.bias")[positions(out_idx, bias_idx, f"{prefix}.bias")]
    return y.astype(F32), out_idx


def row(rank: RankShard, prefix: str, a: np.ndarray, a_idx: np.ndarray) -> np.ndarray:
    """Row-parallel partial product over the local input features ``a_idx`` (no bias)."""
    name = f"{prefix}.weight"
    sel = rank.selection(name)
    if sel is not None and sel.axis != 1:
        raise ShardingError(f"{name}: row-parallel weight sliced on axis {sel.axis}")
    cols = positions(a_idx, rank.indices(name, 1), name)
    return (a @ rank.array(name)[:, cols].T).astype(F32)


def split_heads(
    y: np.ndarray, idx: np.ndarray, size: int, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """``[B, S, h*size]`` features with global indices -> ``[B, h, S, size]`` and head ids."""
    if len(idx) % size:
        raise ShardingError(f"{what}: {len(idx)} features are not whole heads of {size}")
    grid = idx.reshape(-1, size)
    heads = grid[:, 0] // size
    if not (grid == heads[:, None] * size + np.arange(size)).all():
        raise ShardingError(f"{what}: selection splits a head")
    batch, seq = y.shape[:2]
    return y.reshape(batch, seq, len(heads), size).transpose(0, 2, 1, 3), heads


def align(values: np.ndarray, idx: np.ndarray, target: np.ndarray, what: str) -> np.ndarray:
    """Reorder the last axis of ``values`` (global ``idx``) to the global order ``target``."""
    if len(idx) != len(target) or set(idx.tolist()) != set(target.tolist()):
        raise ShardingError(f"{what}: paired projections hold different features")
    return values[..., positions(target, idx, what)]


# --------------------------------------------------------------------------- collectives


def _is_complete(covered: np.ndarray, domain: int) -> bool:
    return len(covered) == domain and bool((np.sort(covered) == np.arange(domain)).all())


def all_reduce(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], domain: int, what: str
) -> np.ndarray:
    """Simulated all-reduce of ``(value, covered indices of the contracted domain)`` per rank.

    Ranks that each cover the whole domain computed replicated work: their values must agree and
    one is taken. Otherwise the covered sets must partition ``range(domain)`` and are summed.
    """
    if not parts:
        raise ShardingError(f"{what}: no rank holds it")
    complete = [_is_complete(covered, domain) for _, covered in parts]
    if all(complete):
        first = parts[0][0]
        for value, _ in parts[1:]:
            if not np.allclose(value, first, rtol=1e-5, atol=1e-6):
                raise ShardingError(f"{what}: replicated ranks disagree")
        return first
    if any(complete):
        raise ShardingError(f"{what}: some ranks hold it whole, others a slice")
    covered = np.concatenate([c for _, c in parts])
    if not _is_complete(covered, domain):
        counts = np.bincount(covered, minlength=domain)
        raise ShardingError(
            f"{what}: slices do not partition {domain} (missing {np.flatnonzero(counts == 0)[:8]},"
            f" repeated {np.flatnonzero(counts > 1)[:8]})"
        )
    total = np.zeros_like(parts[0][0])
    for value, _ in parts:
        total = total + value
    return total.astype(F32)


def all_gather(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], domain: int, what: str
) -> np.ndarray:
    """Concatenate last-axis slices ``(values, global indices)`` in global order.

    Ranks holding the whole axis must agree and one copy is taken; slices must partition it.
    """
    if not parts:
        raise ShardingError(f"{what}: no rank holds it")
    if all(_is_complete(idx, domain) for _, idx in parts):
        ordered = [v[..., np.argsort(idx)] for v, idx in parts]
        return all_reduce([(v, np.arange(domain)) for v in ordered], domain, what)
    all_reduce([(np.zeros(1), idx) for _, idx in parts], domain, what)  # partition check
    full = np.zeros((*parts[0][0].shape[:-1], domain), dtype=F32)
    for values, idx in parts:
        full[..., idx] = values
    return full


def vocab_parallel_embedding(
    ranks: Sequence[RankShard], name: str, ids: np.ndarray, vocab: int
) -> np.ndarray:
    """Lookup of ``ids`` in the embedding ``name`` split by vocabulary rows, summed over ranks."""
    parts = []
    for rank in ranks:
        rows = _vocab_rows(rank, name, "embedding")
        lookup = np.full(vocab, -1)
        lookup[rows] = np.arange(len(rows))
        local = lookup[ids]
        vectors = np.where((local >= 0)[..., None], rank.array(name)[np.maximum(local, 0)], 0)
        parts.append((vectors.astype(F32), rows))
    return all_reduce(parts, vocab, name)


def vocab_parallel_logits(
    ranks: Sequence[RankShard], name: str, x: np.ndarray, vocab: int
) -> np.ndarray:
    """``x`` times each rank's vocabulary rows of ``name`` (the head), gathered over ranks."""
    parts = [((x @ rank.array(name).T).astype(F32), _vocab_rows(rank, name, "lm_head"))
             for rank in ranks]
    return all_gather(parts, vocab, name)


def _vocab_rows(rank: RankShard, name: str, what: str) -> np.ndarray:
    """The vocabulary rows `rank` holds of `name`, refused unless it is split by rows."""
    sel = rank.selection(name)
    if sel is not None and sel.axis != 0:
        raise ShardingError(f"{name}: {what} must be vocab-parallel (axis 0)")
    return rank.indices(name, 0)


def replicated(ranks: Sequence[RankShard], name: str) -> np.ndarray:
    """A tensor every rank must hold whole and identically (norms, routers, row biases)."""
    values = [rank.whole(name) for rank in ranks]
    for value in values[1:]:
        if value.shape != values[0].shape or not np.array_equal(value, values[0]):
            raise ShardingError(f"{name}: replicated copies differ between ranks")
    return values[0]


def replicated_optional(ranks: Sequence[RankShard], name: str) -> np.ndarray | None:
    """Like :func:`replicated`, for a tensor only some ranks (or none) may hold.

    Used for biases that follow a reduction: whoever holds it holds it whole, and it is added once.
    """
    holders = [rank for rank in ranks if rank.has(name)]
    return replicated(holders, name) if holders else None


def all_reduce_distinct(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], domain: int, what: str
) -> np.ndarray:
    """All-reduce where replicated ranks (same covered set) count once.

    Used for a norm statistic over features that KV replication puts on several ranks: ranks
    covering the same indices must agree, and the distinct sets must partition the domain.
    """
    groups: dict[tuple[int, ...], list[np.ndarray]] = {}
    for value, covered in parts:
        groups.setdefault(tuple(np.sort(covered).tolist()), []).append(value)
    distinct = []
    for covered, values in groups.items():
        for value in values[1:]:
            if not np.allclose(value, values[0], rtol=1e-5, atol=1e-6):
                raise ShardingError(f"{what}: ranks holding the same slice disagree")
        distinct.append((values[0], np.array(covered, dtype=np.int64)))
    return all_reduce(distinct, domain, what)


def conv_column(rank: RankShard, prefix: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column-parallel Conv1D ``x @ W + b`` (weight ``[in, out]``, sliced on axis 1)."""
    name = f"{prefix}.weight"
    sel = rank.selection(name)
    if sel is not None and sel.axis != 1:
        raise ShardingError(f"{name}: column-parallel Conv1D weight sliced on axis {sel.axis}")
    out_idx = rank.indices(name, 1)
    y = x @ rank.array(name)
    if rank.has(f"{prefix}.bias"):
        bias_idx = rank.indices(f"{prefix}.bias", 0)
        y = y + rank.array(f"{prefix}.bias")[positions(out_idx, bias_idx, f"{prefix}.bias")]
    return y.astype(F32), out_idx


def conv_row(rank: RankShard, prefix: str, a: np.ndarray, a_idx: np.ndarray) -> np.ndarray:
    """Row-parallel Conv1D partial product over the local input rows ``a_idx`` (no bias)."""
    name = f"{prefix}.weight"
    sel = rank.selection(name)
    if sel is not None and sel.axis != 0:
        raise ShardingError(f"{name}: row-parallel Conv1D weight sliced on axis {sel.axis}")
    rows = positions(a_idx, rank.indices(name, 0), name)
    return (a @ rank.array(name)[rows]).astype(F32)
