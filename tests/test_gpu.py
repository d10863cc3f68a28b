"""On a real CUDA device: `load(device="cuda")` through the pinned staging ring, digests through
the ring, boundary payloads of CUDA tensors, DTensors on a CUDA mesh and the transformers
recipe's logits on the GPU.

Every test here is marked `gpu`. pyproject's addopts deselect the marker (`-m "not gpu"`), so a
machine without a GPU (CI) never collects them into a run; `pytest -m gpu tests/test_gpu.py` on
a GPU machine runs them (benchmarks/gpu/run.sh does). They never skip themselves: without CUDA
they fail. Multi-process tests use NCCL where there is a GPU per rank; several ranks on one GPU
would need gloo, whose CUDA all_gather crashed with SIGSEGV under torch 2.11 on the H200 run
(docs/performance.md): there the DTensor test checks each rank's shard without gathering and the
transformers recipe runs at T=1."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from partc.api import CompileOptions, compile_family
from partc.emit.render import package_name
from partc.errors import BoundaryPayloadError, CheckpointError, PartcErrors
from partc.plan.topology import Topology

from support import HF, QUANTIZED, compile_and_import

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.fixture(scope="module", autouse=True)
def a_gpu():
    """The tests need CUDA: without it they fail (they are deselected where there is none)."""
    assert torch.cuda.is_available(), ("the gpu-marked tests need a CUDA device; run them "
                                       "with `-m gpu` on a GPU machine")
    torch.cuda.init()


def _files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def expected_slices(state, checkpoint: Path) -> dict[str, torch.Tensor]:
    """Each loaded tensor's bytes as the safetensors library reads them (torch, on the CPU), cut
    by the rank's layout: an oracle independent of partc's reader."""
    wanted = {layout.target: layout.selection for layout in state.layout.tensors}
    out: dict[str, torch.Tensor] = {}
    for path in _files(checkpoint):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name not in wanted:
                    continue
                whole = handle.get_tensor(name)
                axis, ranges = wanted[name]
                out[name] = whole if axis is None else torch.cat(
                    [whole.narrow(axis, a, b - a) for a, b in ranges], dim=axis)
    assert set(out) == set(wanted)
    return out


def assert_bitwise(state, checkpoint: Path, device: torch.device = CUDA) -> int:
    """Every tensor of `state` is on `device` and equals the checkpoint slice bit for bit
    (copied back and compared as bytes); returns the bytes compared."""
    expected = expected_slices(state, checkpoint)
    compared = 0
    for name, tensor in state.tensors.items():
        assert tensor.device == device, (name, tensor.device)
        want = expected[name]
        assert tensor.dtype == want.dtype and tuple(tensor.shape) == tuple(want.shape), name
        got = tensor.cpu().contiguous().view(torch.uint8)
        assert torch.equal(got, want.contiguous().view(torch.uint8)), name
        compared += got.numel()
    return compared


@pytest.mark.parametrize(("model", "tp", "ring", "workers"), [
    (HF / "llama", 2, None, None),       # the default ring, default threads
    (HF / "llama", 4, 512, 1),           # one thread, blocks and rows cut small
    (HF / "phi3", 2, 4096, 4),           # fused segments and column slices, four threads
    (HF / "mixtral", 2, 1 << 16, 3),     # experts
    (QUANTIZED / "qwen3_fp8", 2, None, None),  # stored FP8 weights with their block scales
])
def test_every_rank_of_a_cuda_load_equals_the_checkpoint_slices_bitwise(
        tmp_path, model, tp, ring, workers):
    _, package = compile_and_import(None, model / "config.json", tmp_path / "b", tp=tp)
    options = {} if ring is None else {"staging_bytes": ring}
    if workers is not None:
        options["workers"] = workers
    for rank in range(tp):
        torch.cuda.reset_peak_memory_stats(CUDA)
        before = torch.cuda.memory_allocated(CUDA)
        state = package.load(model, rank=rank, device="cuda:0", **options)
        share = sum(layout.local_bytes for layout in state.layout.tensors)
        # the device holds the share once: no second copy, no whole tensors
        assert torch.cuda.memory_allocated(CUDA) - before >= share
        assert torch.cuda.max_memory_allocated(CUDA) - before <= share + len(state.tensors) * 512
        assert assert_bitwise(state, model) == share
        del state


def test_the_default_device_is_cuda_local_rank(tmp_path, monkeypatch):
    _, package = compile_and_import(None, HF / "llama" / "config.json", tmp_path / "b", tp=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    state = package.load(HF / "llama", rank=1, framework="torch")
    assert {t.device for t in state.tensors.values()} == {CUDA}
    monkeypatch.setenv("LOCAL_RANK", "0")
    state = package.load(HF / "llama", rank=0, device="cuda")
    assert_bitwise(state, HF / "llama")
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(CheckpointError, match=r"LOCAL_RANK=\d+ names CUDA device"):
        package.load(HF / "llama", rank=0, device="cuda")


def test_dtype_converts_on_the_device_to_what_torch_converts(tmp_path):
    _, package = compile_and_import(None, HF / "llama" / "config.json", tmp_path / "b", tp=2)
    state = package.load(HF / "llama", rank=0, device="cuda:0", dtype="bfloat16")
    expected = expected_slices(state, HF / "llama")
    for name, tensor in state.tensors.items():
        assert tensor.device == CUDA and tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor.cpu(), expected[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("ring", [None, 96])
def test_digests_are_verified_through_the_pinned_ring(tmp_path, ring):
    model = HF / "phi3"
    plan, package = compile_and_import(None, model / "config.json", tmp_path / "b", tp=2,
                                       checkpoint=model, digests=True)
    options = {} if ring is None else {"staging_bytes": ring}
    state = package.load(model, rank=1, device="cuda:0", verify="digest", **options)
    assert_bitwise(state, model)
    # one payload byte of a column slice flipped (header untouched): named, never loaded
    copy = tmp_path / "ck"
    shutil.copytree(model, copy)
    target = next(t.target for t in state.layout.tensors if t.selection[0] == 1)
    raw = bytearray((copy / "model.safetensors").read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8:8 + size])[target]
    begin, end = entry["data_offsets"]
    rows, cols = entry["shape"]
    item = (end - begin) // (rows * cols)
    first = next(t.selection[1][0][0] for t in state.layout.tensors if t.target == target)
    raw[8 + size + begin + (rows // 2 * cols + first) * item] ^= 0x40
    (copy / "model.safetensors").write_bytes(bytes(raw))
    package.load(copy, rank=1, device="cuda:0", **options)  # unverified: it loads
    with pytest.raises((CheckpointError, PartcErrors)) as caught:
        package.load(copy, rank=1, device="cuda:0", verify="digest", **options)
    errors = caught.value.errors if isinstance(caught.value, PartcErrors) else [caught.value]
    assert [e.tensor for e in errors] == [target]


def test_a_pipeline_boundary_carries_cuda_tensors_unconverted(tmp_path):
    model = HF / "llama"
    _, package = compile_and_import(None, model / "config.json", tmp_path / "b", tp=1, pp=2)
    boundary = package.rank_module(0).boundary()
    config = json.loads((model / "config.json").read_text())
    hidden = torch.randn(2, 5, config["hidden_size"], device=CUDA)
    values = boundary.encode_hidden(hidden)
    decoded = boundary.decode_hidden(values)
    assert decoded is hidden and decoded.device == CUDA
    wrong = torch.randn(2, 5, config["hidden_size"], device=CUDA, dtype=torch.float16)
    with pytest.raises(BoundaryPayloadError) as caught:
        boundary.decode_hidden(boundary.encode_hidden(wrong))
    assert "float16" in str(caught.value)


def _torchrun(worker: Path, *args: str, reports: Path, nproc: int = 2) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "torch.distributed.run",
         f"--nproc_per_node={nproc}", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
         str(worker), *args],
        capture_output=True, text=True, timeout=150,
        env={**env, "PARTC_TEST_REPORTS": str(reports), "OMP_NUM_THREADS": "1",
             "PYTHONFAULTHANDLER": "1"})
    # the ranks' own lines (tracebacks, a crashed rank's stack), not torchrun's summary
    lines = [line for line in done.stderr.splitlines()
             if "[rank" in line or "Fatal Python" in line or line.startswith(("  File", "Thread",
                                                                               "Current"))]
    assert done.returncode == 0, "\n".join(lines[-60:]) or done.stderr[-3000:]


def _per_rank_gpus(ranks: int) -> bool:
    return torch.cuda.device_count() >= ranks


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_dtensors_on_a_cuda_mesh_are_the_checkpoint_tensors(tmp_path, tp, pp):
    # NCCL where there is a GPU per rank: full_tensor() gathers every shard; several ranks on
    # one GPU go through gloo, whose CUDA all_gather crashed (SIGSEGV, torch 2.11): there each
    # rank's local shard and its placement are checked, no gather
    model = HF / "llama"
    result = compile_family(None, model / "config.json",
                            Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                            CompileOptions(out=tmp_path / "b"))
    reports = tmp_path / "reports"
    reports.mkdir()
    nccl = _per_rank_gpus(tp * pp)
    _torchrun(HERE / "distributed" / "cuda_dtensor_worker.py", str(tmp_path / "b"), str(model),
              package_name(result.plan), "nccl" if nccl else "cpu:gloo,cuda:gloo",
              "gather" if nccl else "local", reports=reports, nproc=tp * pp)
    found = [json.loads((reports / f"rank-{g}.json").read_text()) for g in range(tp * pp)]
    assert all(r["device"].startswith("cuda:") and r["mesh_device"] == "cuda" for r in found)
    assert all(r["checked"] == len(r["names"]) > 0 for r in found)
    assert (sum(r["sharded"] for r in found) > 0) == (tp > 1)


def recipe_block() -> str:
    """docs/transformers_tp.md's recipe module, as the CPU test extracts it."""
    text = (ROOT / "docs" / "transformers_tp.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]


@pytest.mark.parametrize(("name", "dtype", "tolerance"), [
    ("llama", "float32", 1e-4), ("llama_tied", "float32", 1e-4), ("llama", "bfloat16", 1e-3)])
def test_the_transformers_recipe_on_cuda_gives_hf_logits(tmp_path, name, dtype, tolerance):
    # HF's own model, whole, on the same GPU in the same dtype, is the reference. The recipe
    # runs with NCCL, one GPU per rank: T=2 where there are two GPUs, else T=1
    from transformers import AutoModelForCausalLM

    tp = 2 if _per_rank_gpus(2) else 1

    model = HF / name
    with np.load(model / "reference.npz") as npz:
        input_ids = torch.from_numpy(npz["input_ids"].astype(np.int64))
    reference = AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, dtype), attn_implementation="eager").to(CUDA).eval()
    with torch.no_grad():
        want = reference(input_ids.to(CUDA)).logits.float().cpu().numpy()
    if dtype == "float32":  # the GPU's fp32 HF model agrees with the CPU reference too
        with np.load(model / "reference.npz") as npz:
            assert float(np.max(np.abs(want - npz["logits"]))) < tolerance
    result = compile_family(None, model / "config.json", Topology(tensor_parallel_size=tp),
                            CompileOptions(checkpoint=model, out=tmp_path / "build"))
    recipe = tmp_path / "transformers_tp.py"
    recipe.write_text(recipe_block())
    reports = tmp_path / "reports"
    reports.mkdir()
    _torchrun(HERE / "distributed" / "cuda_recipe_worker.py", str(recipe), str(tmp_path / "build"),
              package_name(result.plan), str(model), dtype, reports=reports, nproc=tp)
    for g in range(tp):
        report = json.loads((reports / f"rank-{g}.json").read_text())
        assert report["devices"] == [f"cuda:{g}"], report["devices"]
        assert report["dtypes"] == [f"torch.{dtype}"], report["dtypes"]
        with np.load(reports / f"rank-{g}.npz") as npz:
            logits = npz["logits"]
        assert logits.shape == want.shape
        error = float(np.max(np.abs(logits - want)))
        assert error < tolerance, (g, error)
