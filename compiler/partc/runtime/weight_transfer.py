"""In-memory resharding under torch.distributed: the weights of one build's ranks handed to
another build's ranks, point to point, following a transfer plan (docs/reshard.md).

`reshard_weights(transfer, tensors)` runs on every process of a group at once: on a gloo group
the bytes travel in CPU tensors, on an NCCL group in CUDA tensors on the process's current
device (`transport_device`); other backends are refused. A process that plays a source rank
passes that rank's local tensors; one that plays a destination rank gets that rank's tensors back
(`MovedWeights`, with the bytes it sent, received and copied). Each piece of the plan goes from
the process of its source rank to the process of its destination rank: the pieces one process
sends another form one stream of bytes (in the plan's order, which both sides know) cut into
`CHUNK_BYTES` messages, exchanged round by round through one reused send and receive buffer
per peer, and written into the destination tensors as they come; a piece whose source and
destination are the same process is copied without a message. Every byte moves as it is
stored (bf16, fp8, packed quantized bytes alike), so the destination's tensors are
bit-identical to what `load()` of the destination build reads from the checkpoint.

The plan is the JSON form of `partc.plan.transfer.TransferPlan` (`partc inspect A --to B
--format json` shows its totals; `TransferPlan.to_json()` is the schedule), so that a serving
process needs only the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from partc.errors import CheckpointError
from partc.runtime.frameworks import import_torch

__all__ = ["MovedWeights", "reshard_weights", "transport_device"]

_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32", "I16": "int16",
                "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
                "BOOL": "bool"}
"""Safetensors dtype -> the torch dtype of that name."""



@dataclass
class MovedWeights:
    """What `reshard_weights` gave this process and what it moved, in bytes as measured."""

    tensors: dict[str, Any]
    """This process's destination rank's tensors (empty when it plays none)."""
    sent: dict[tuple[int, int], int] = field(default_factory=dict)
    """(this process, receiving process) -> bytes of the messages this process sent it."""
    received: dict[tuple[int, int], int] = field(default_factory=dict)
    """(sending process, this process) -> bytes of the messages this process received."""
    copied: int = 0
    """Bytes copied from this process's source tensors into its destination tensors."""


Piece = tuple[int, str, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]
"""(source rank, target, source box, destination box) of one copy."""


def reshard_weights(transfer: Mapping[str, Any], tensors: Mapping[str, Any] | None, *,
                    group: Any = None, source_processes: Sequence[int] | None = None,
                    destination_processes: Sequence[int] | None = None) -> MovedWeights:
    """This process's destination rank's tensors (empty when it plays none) and the bytes it
    moved, from the source ranks' `tensors` (this process's source rank's local tensors, torch
    or numpy; None when it plays none) following `transfer`. Source rank r is process
    `source_processes[r]` of `group` (default: process r), destination rank r
    `destination_processes[r]` (default r); every process of the group must call it."""
    torch = import_torch("reshard_weights")
    import torch.distributed as dist  # type: ignore[import-not-found, unused-ignore]

    sources = _processes(transfer, "source_world_size", source_processes)
    destinations = _processes(transfer, "destination_world_size", destination_processes)
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    device = transport_device(torch, dist, group)
    mine = [r for r, p in enumerate(sources) if p == me]
    held = {} if tensors is None else {n: _as_bytes(torch, t, device)
                                            for n, t in tensors.items()}
    if sum(p == me for p in destinations) > 1:
        raise CheckpointError(f"process {me} plays several destination ranks of the transfer "
                              "plan; one process receives one rank's tensors")
    if len(mine) > 1 or (mine and tensors is None):
        raise CheckpointError(f"process {me} plays source rank(s) {mine} of the transfer plan: "
                              "it must pass exactly one source rank's tensors")
    outgoing: dict[int, list[Any]] = {}
    incoming: dict[int, list[tuple[Any, tuple[slice, ...], int]]] = {}
    out: dict[str, Any] = {}
    moved = MovedWeights({})
    for entry in transfer["ranks"]:
        rank, target_process = int(entry["rank"]), destinations[int(entry["rank"])]
        receiving = target_process == me
        for tensor in entry["tensors"]:
            target, dtype = str(tensor["target"]), str(tensor["dtype"])
            itemsize = _itemsize(torch, dtype)
            if receiving:
                shape = [int(n) for n in tensor["local_shape"]] or [1]
                shape[-1] *= itemsize
                out[target] = torch.empty(shape, dtype=torch.uint8, device=device)
            for source_rank, source_box, destination_box in tensor["pieces"]:
                sender = sources[int(source_rank)]
                into = _bytes_box(destination_box, itemsize)
                if sender == me:
                    part = _piece(held, target, source_box, itemsize, me, rank)
                    if receiving:
                        out[target][into] = part
                        moved.copied += int(part.numel())
                    else:
                        outgoing.setdefault(target_process, []).append(part)
                elif receiving:
                    size = math.prod(b - a for a, b in destination_box) * itemsize
                    incoming.setdefault(sender, []).append((out[target], into, size))
    _exchange(torch, dist, group, me, device, outgoing, incoming, moved)
    moved.tensors = {t["target"]: _typed(torch, out[t["target"]], t)
                     for entry in transfer["ranks"] if destinations[int(entry["rank"])] == me
                     for t in entry["tensors"]}
    return moved


def _processes(transfer: Mapping[str, Any], key: str, given: Sequence[int] | None
               ) -> list[int]:
    """The process of each rank of one side of the plan: `given`, or rank r on process r."""
    size = int(transfer[key])
    if given is None:
        return list(range(size))
    if len(given) != size:
        raise CheckpointError(f"the transfer plan has {size} ranks on its "
                              f"{key.split('_')[0]} side; {len(given)} processes were given")
    return [int(p) for p in given]


def _itemsize(torch: Any, dtype: str) -> int:
    """Bytes of one element of safetensors dtype `dtype`."""
    name = _TORCH_NAMES.get(dtype)
    found = None if name is None else getattr(torch, name, None)
    if found is None:
        raise CheckpointError(f"torch {torch.__version__} has no dtype for {dtype}")
    return int(torch.empty((), dtype=found).element_size())


def transport_device(torch: Any, dist: Any, group: Any = None) -> Any:
    """The device the bytes travel on over `group`'s backend: the CPU for gloo, the current
    CUDA device for NCCL; any other backend, or NCCL without CUDA, is refused."""
    backend = str(dist.get_backend(group)).lower()
    names = {part.split(":")[-1] for part in backend.split(",")}
    if "nccl" in names:
        if not torch.cuda.is_available():
            raise CheckpointError("reshard_weights: the process group's backend is NCCL but "
                                  "torch sees no CUDA device; expected a CUDA device per "
                                  "process (or pass a gloo `group`)")
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in names:
        return torch.device("cpu")
    raise CheckpointError(f"reshard_weights moves tensors over gloo (CPU) or nccl (CUDA); the "
                          f"process group's backend is {backend!r}: pass a gloo or nccl `group`")


def _as_bytes(torch: Any, tensor: Any, device: Any) -> Any:
    """A local tensor as contiguous bytes on `device`, its last axis widened by its item
    size."""
    if not isinstance(tensor, torch.Tensor):
        import numpy as np

        array = np.ascontiguousarray(tensor)
        tensor = torch.from_numpy(array.reshape(array.shape or (1,)).view(np.uint8))
        return tensor.to(device)
    tensor = tensor.detach().to(device).contiguous()
    return (tensor.reshape(1) if tensor.dim() == 0 else tensor).view(torch.uint8)


def _bytes_box(box: Sequence[Sequence[int]], itemsize: int) -> tuple[slice, ...]:
    """A box of a tensor as slices of its byte view (last axis scaled by the item size)."""
    if not box:
        return (slice(0, itemsize),)
    *lead, (a, b) = box
    return (*(slice(int(x), int(y)) for x, y in lead), slice(int(a) * itemsize,
                                                            int(b) * itemsize))


def _piece(held: Mapping[str, Any], target: str, box: Sequence[Sequence[int]], itemsize: int,
           me: int, rank: int) -> Any:
    """The bytes of one piece of a tensor this process holds as a source rank."""
    tensor = held.get(target)
    if tensor is None:
        raise CheckpointError(f"process {me} holds no `{target}`, which the transfer plan reads "
                              f"from it for destination rank {rank}", tensor=target)
    return tensor[_bytes_box(box, itemsize)]


CHUNK_BYTES = 16 * 2 ** 20
"""The most bytes of one message: the stream of pieces one process sends another goes in
chunks of this size, so a process holds a chunk per peer, not everything it sends or receives."""

Incoming = tuple[Any, tuple[slice, ...], int]
"""(destination tensor's bytes, the slices of one piece in it, the piece's bytes)."""


def _exchange(torch: Any, dist: Any, group: Any, me: int, device: Any,
              outgoing: Mapping[int, list[Any]], incoming: Mapping[int, list[Incoming]],
              moved: MovedWeights) -> None:
    """The pieces each (sender, receiver) pair exchanges, as one stream of bytes in the plan's
    order cut into `CHUNK_BYTES` messages: in round k every process posts the k-th chunk
    from and to each of its peers, waits for them, and unpacks what it received into the
    destination slices; the bytes of every message sent and received counted on `moved`."""
    stream = {peer: sum(int(part.numel()) for part in parts) for peer, parts in outgoing.items()}
    senders = {peer: _chunks(parts, _buffer(torch, device, stream[peer]))
               for peer, parts in sorted(outgoing.items()) if stream[peer]}
    unpackers = {peer: _Unpacker(parts) for peer, parts in sorted(incoming.items())}
    receivers = {peer: (unpacker, _buffer(torch, device, unpacker.left))
                 for peer, unpacker in unpackers.items() if unpacker.left}
    moved.sent.update({(me, peer): 0 for peer in outgoing})
    moved.received.update({(peer, me): 0 for peer in incoming})
    while senders or receivers:  # the buffers reused round after round
        messages = {peer: buffer[:unpacker.next_size()]
                    for peer, (unpacker, buffer) in receivers.items()}
        work = [dist.irecv(message, src=_global(dist, group, peer), group=group)
                for peer, message in messages.items()]
        chunks = {peer: next(chunks, None) for peer, chunks in senders.items()}
        work += [dist.isend(chunk, dst=_global(dist, group, peer), group=group)
                 for peer, chunk in chunks.items() if chunk is not None]
        for request in work:
            request.wait()
        for peer, chunk in chunks.items():
            moved.sent[(me, peer)] += 0 if chunk is None else int(chunk.numel())
        for peer, message in messages.items():
            moved.received[(peer, me)] += int(message.numel())
            receivers[peer][0].take(torch, message)
        receivers = {peer: r for peer, r in receivers.items() if r[0].left}
        senders = {peer: senders[peer] for peer, chunk in chunks.items() if chunk is not None}


def _buffer(torch: Any, device: Any, total: int) -> Any:
    """The message buffer of a stream of `total` bytes: one chunk, or less."""
    return torch.empty(min(CHUNK_BYTES, total), dtype=torch.uint8, device=device)


def _chunks(parts: Sequence[Any], buffer: Any) -> Any:
    """The bytes of `parts` (byte views, in order) as one stream cut into chunks of `buffer`'s
    size, the last shorter, each packed into `buffer` (a part is flattened, so copied when not
    contiguous, as it comes)."""
    filled, size = 0, int(buffer.numel())
    for part in parts:
        flat, start = part.reshape(-1), 0
        while start < flat.numel():
            take = min(size - filled, int(flat.numel()) - start)
            buffer[filled:filled + take] = flat[start:start + take]
            filled, start = filled + take, start + take
            if filled == size:
                yield buffer
                filled = 0
    if filled:
        yield buffer[:filled]


class _Unpacker:
    """Writes the chunks of one sender's stream into the destination slices they fill."""

    def __init__(self, parts: Sequence[Incoming]) -> None:
        """The pieces the stream carries, in order."""
        self.parts = [p for p in parts if p[2]]
        self.left = sum(size for _, _, size in self.parts)
        self.index = self.offset = 0
        self.partial: Any = None

    def next_size(self) -> int:
        """Bytes of the next chunk."""
        return min(CHUNK_BYTES, self.left)

    def take(self, torch: Any, buffer: Any) -> None:
        """Unpack one chunk: whole pieces straight into their slices, so is a piece cut by a
        chunk boundary whose slice is contiguous; one whose slice is not is gathered first."""
        start, end = 0, int(buffer.numel())
        while start < end:
            tensor, into, size = self.parts[self.index]
            take = min(size - self.offset, end - start)
            region = tensor[into]
            if take == size:
                tensor[into] = buffer[start:start + take].view(region.shape)
            elif region.is_contiguous():  # written in place, chunk by chunk
                region.view(-1)[self.offset:self.offset + take] = buffer[start:start + take]
            else:
                if self.partial is None:
                    self.partial = torch.empty(size, dtype=torch.uint8, device=buffer.device)
                self.partial[self.offset:self.offset + take] = buffer[start:start + take]
                if self.offset + take == size:
                    tensor[into] = self.partial.view(region.shape)
                    self.partial = None
            self.offset, start = self.offset + take, start + take
            if self.offset == size:
                self.index, self.offset = self.index + 1, 0
        self.left -= end


def _global(dist: Any, group: Any, process: int) -> int:
    """The global rank of `group`'s process `process` (the default group: itself)."""
    return process if group is None else int(dist.get_global_rank(group, process))


def _typed(torch: Any, data: Any, tensor: Mapping[str, Any]) -> Any:
    """A received byte tensor viewed as its dtype and local shape."""
    dtype = getattr(torch, _TORCH_NAMES[str(tensor["dtype"])])
    return data.view(dtype).reshape([int(n) for n in tensor["local_shape"]])
