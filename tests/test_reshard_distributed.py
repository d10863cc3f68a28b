"""In-memory resharding under torch.distributed (CPU, gloo): one `torchrun --nproc_per_node=4`
launch in which every process plays a rank of a source build, hands its weights over with
`partc.runtime.weight_transfer.reshard_weights`, then plays a rank of the destination build and
serves it with the reference torch executor. The moved tensors must be the destination build's
own `load()` bit for bit, and the output ranks' logits Hugging Face's reference.npz (an
expert-parallel destination, which the executor does not run, is checked by its tensors). A
second launch of 8 processes runs docs/reshard.md's RL-style sync; the bytes each process
measured are checked against the minimum; the transport device's choice by backend is checked
without a launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from partc.api import CompileOptions, compile_family
from partc.emit.render import package_name
from partc.errors import CheckpointError
from partc.plan.ir import canonical_json
from partc.plan.plan_file import read_plan
from partc.plan.topology import Topology
from partc.plan.transfer import plan_transfer
from partc.runtime import weight_transfer

from support import hf
from support.distributed import torchrun

WORKER = Path(__file__).resolve().parent / "distributed" / "reshard_worker.py"
TOLERANCE = 1e-4
RUNS = {  # name: (fixture, source (T, S, E), destination (T, S, E))
    "llama-tp2pp2-to-tp4": ("llama", (2, 2, None), (4, 1, None)),  # KV heads repeated
    "qwen3_moe-tp4-to-tp2pp2": ("qwen3_moe", (4, 1, None), (2, 2, None)),
    "qwen3_moe-tp2pp2-to-ep4": ("qwen3_moe", (2, 2, None), (1, 1, 4)),  # tensors checked only
}


RL_SYNC = ("qwen3_moe", (4, 2, None), (2, 1, 4))
"""docs/reshard.md's RL-style weight sync: trainer TP=4 x PP=2 (8 processes) -> inference
TP=2 x EP=4 (4 ranks, on processes 4-7 of the same launch)."""
RL_DESTINATION_PROCESSES = [4, 5, 6, 7]
SMALL_CHUNK = 999
"""Message size of the Llama and RL runs: streams cut mid-piece, mid-element, many rounds."""


def prepare(folder: Path, name: str, fixture: str, source: tuple[int, int, int | None],
            destination: tuple[int, int, int | None]) -> dict[str, Any]:
    """Compile both builds of one run and write its transfer plan; the run for the worker."""
    made = {}
    for side, (tp, pp, ep) in (("source", source), ("destination", destination)):
        out = folder / f"{name}-{side}"
        result = compile_family(None, hf(fixture) / "config.json",
                                Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                         expert_parallel_size=ep),
                                CompileOptions(checkpoint=hf(fixture), out=out))
        made[side] = (out, package_name(result.plan))
    transfer = plan_transfer(read_plan(made["source"][0] / "plan.json"),
                             read_plan(made["destination"][0] / "plan.json"))
    (folder / f"{name}.json").write_text(canonical_json(transfer.to_json()))
    return {"name": name, "source": str(made["source"][0]), "source_package": made["source"][1],
            "destination": str(made["destination"][0]),
            "destination_package": made["destination"][1],
            "transfer": str(folder / f"{name}.json"), "checkpoint": str(hf(fixture)),
            "tp": destination[0], "pp": destination[1], "serve": destination[2] is None}


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compile both builds of every run, launch the workers once; the reports folder."""
    folder = tmp_path_factory.mktemp("reshard-serve")
    runs = [prepare(folder, name, *run) for name, run in RUNS.items()]
    runs[0]["chunk_bytes"] = SMALL_CHUNK
    return torchrun(WORKER, runs, folder)


@pytest.fixture(scope="module")
def rl_synced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The RL-style sync in its own launch of 8 processes; the reports folder."""
    folder = tmp_path_factory.mktemp("reshard-rl")
    run = prepare(folder, "rl-sync", *RL_SYNC)
    run |= {"destination_processes": RL_DESTINATION_PROCESSES, "chunk_bytes": SMALL_CHUNK}
    return torchrun(WORKER, [run], folder, processes=8)


def test_rl_weight_sync_trainer_tp4_pp2_to_inference_tp2_ep4_is_the_inference_load(
        rl_synced: Path) -> None:
    """Every inference rank's tensors, moved from the 8 trainer processes, are its build's own
    load() bit for bit; the trainer-only processes receive nothing."""
    reports = [json.loads((rl_synced / f"rl-sync-rank-{g}.json").read_text()) for g in range(8)]
    assert all(r["identical"] for r in reports)
    assert [r["destination_rank"] for r in reports] == [None] * 4 + [0, 1, 2, 3]
    assert all(r["names"] for r in reports[4:]) and not any(r["names"] for r in reports[:4])
    folder = rl_synced.parent
    check_bytes(folder, "rl-sync", reports, RL_DESTINATION_PROCESSES)


@pytest.mark.parametrize("name", list(RUNS))
def test_weights_moved_in_memory_are_the_destinations_own_load_and_give_hf_logits(
        moved: Path, name: str) -> None:
    fixture, _, (tp, pp, ep) = RUNS[name]
    with np.load(hf(fixture) / "reference.npz") as npz:
        want = npz["logits"]
    outputs = 0
    for g in range(4):
        report = json.loads((moved / f"{name}-rank-{g}.json").read_text())
        assert report["identical"], (name, g)
        with np.load(moved / f"{name}-rank-{g}.npz") as npz:
            if "logits" in npz.files:
                outputs += 1
                assert float(np.max(np.abs(npz["logits"] - want))) < TOLERANCE, (name, g)
    assert outputs == (tp if ep is None else 0)  # every TP rank of the last stage served


@pytest.mark.parametrize("name", list(RUNS))
def test_bytes_sent_and_copied_in_memory_are_each_destination_byte_once(
        moved: Path, name: str) -> None:
    """What `reshard_weights` measured (buffers sent, pieces copied locally) adds up to every
    destination rank's local parameter bytes as the destination plan lists them: no byte
    twice; every sender's count is its receiver's, and the plan's source x destination pairs."""
    reports = [json.loads((moved / f"{name}-rank-{g}.json").read_text()) for g in range(4)]
    check_bytes(moved.parent, name, reports, list(range(4)))


def check_bytes(folder: Path, name: str, reports: list[dict[str, Any]], placed: list[int]
                ) -> None:
    """Sent + copied over all processes is the destination plan's local parameter bytes;
    senders' and receivers' counts agree, and with the plan's pairs (destination rank r on
    process placed[r], source rank r on process r)."""
    destination = read_plan(folder / f"{name}-destination" / "plan.json")
    minimum = sum(rank.info.local_parameter_bytes for rank in destination.ranks)
    sent = {(a, b): n for r in reports for a, b, n in r["sent"]}
    received = {(a, b): n for r in reports for a, b, n in r["received"]}
    copied = {r["rank"]: r["copied"] for r in reports}
    assert sum(sent.values()) + sum(copied.values()) == minimum
    assert sent == received
    transfer = plan_transfer(read_plan(folder / f"{name}-source" / "plan.json"), destination)
    want: dict[tuple[int, int], int] = {}
    for (source, rank), n in transfer.pair_bytes().items():
        want[(source, placed[rank])] = want.get((source, placed[rank]), 0) + n
    assert {**sent, **{(r, r): n for r, n in copied.items() if n}} == want


ONE_PIECE = {"source_world_size": 1, "destination_world_size": 1, "ranks": [
    {"rank": 0, "tensors": [{"target": "w", "dtype": "F32", "local_shape": [2, 3],
                             "pieces": [[0, [[0, 2], [0, 3]], [[0, 2], [0, 3]]]]}]}]}
"""One process, one tensor copied whole: no message, so no process group is needed."""


def test_the_transport_device_follows_the_groups_backend(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """NCCL (alone or beside gloo) moves on the current CUDA device, gloo on the CPU; another
    backend, or NCCL without CUDA, is one clear error (the NCCL path itself is not run here)."""
    import torch

    def backend(name: str) -> Any:
        return type("Dist", (), {"get_backend": staticmethod(lambda group=None: name)})

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("nccl", "cpu:gloo,cuda:nccl"):
        assert weight_transfer.transport_device(torch, backend(name)) == torch.device("cuda", 3)
    assert weight_transfer.transport_device(torch, backend("gloo")) == torch.device("cpu")
    with pytest.raises(CheckpointError, match="backend is 'mpi'"):
        weight_transfer.transport_device(torch, backend("mpi"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    with pytest.raises(CheckpointError, match="NCCL but torch sees no CUDA device"):
        weight_transfer.reshard_weights(ONE_PIECE, {"w": np.zeros((2, 3), np.float32)})


def test_tensors_are_moved_and_returned_on_the_transport_device(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Whatever device the backend chooses, the source bytes are put on it and the destination
    tensors built there (the meta device stands in for CUDA)."""
    import torch

    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(weight_transfer, "transport_device",
                        lambda torch, dist, group=None: torch.device("meta"))
    moved = weight_transfer.reshard_weights(ONE_PIECE, {"w": np.ones((2, 3), np.float32)})
    assert moved.tensors["w"].device.type == "meta"
    assert (moved.tensors["w"].shape, moved.tensors["w"].dtype) == ((2, 3), torch.float32)
    assert moved.copied == 24 and not moved.sent and not moved.received
